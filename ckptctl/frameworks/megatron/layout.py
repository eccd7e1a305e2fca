"""Megatron dist-ckpt folders (`--ckpt-format torch_dist`), as Megatron-LM and megatron-core write them.

```
{--save}/
├── latest_checkpointed_iteration.txt   the tracker: "100", or "release" (rank 0, after the save)
├── iter_0000100/                       one folder per saved iteration (`iter_{iteration:07d}`), or release/
│   ├── common.pt                       torch.save of what is not sharded: args, iteration, scheduler, ...
│   ├── __{rank}_{n}.distcp             torch DCP data files (model, optimizer.*, rng_state ShardedObjects)
│   ├── .metadata                       torch DCP metadata, with every rank's save plan (all_local_plans)
│   ├── metadata.json                   {"sharded_backend": "torch_dist", ...}, written last
│   └── tokenizer/                      (--save-tokenizer-assets) the tokenizer's files
```

Facts from NVIDIA/Megatron-LM @ d98e8a64 `megatron/training/checkpointing.py` (`get_checkpoint_name`,
`get_checkpoint_tracker_filename`, `read_metadata`, `save_checkpoint`'s `iter_finalize_fn`,
`generate_state_dict`) and megatron-core 0.16.1 `dist_checkpointing/serialization.py` (`save`: common.pt, then
the sharded data, then metadata.json "only if the checkpoint is complete"; `core.py` `CONFIG_FNAME`). The
same folders appear under other names inside other frameworks' runs (verl's `dist_ckpt/`, NeMo's
`weights/`): they are recognised by `metadata.json` beside the DCP files.

Keys are megatron-core's, with the layers of a block stacked on a leading axis
(`decoder.layers.self_attention.linear_qkv.weight` of shape [layers, rows, hidden]) and the tensor-parallel
parts as chunks of the full tensor; `inspect` lists them so, as `.metadata` holds them and megatron-core's
load matches them. `names.py` gives the model's own names (one tensor per layer, what that load hands to the
model) for `convert --mapping none` and `diff`; `hf.py` maps them to transformers names for `convert --to hf`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import cache
from typing import TYPE_CHECKING, Any

from ckptctl import io
from ckptctl.checkpoint import (
    Checkpoint,
    CheckpointRef,
    CheckpointState,
    Component,
    Problem,
    ProblemKind,
    TensorEntry,
)
from ckptctl.contract.base import Layout, every_child_folder, list_files, newest_mtime, timestamp
from ckptctl.errors import CheckpointInProgress, CkptctlError, CorruptCheckpoint
from ckptctl.families.dcp_folder import (
    DISTCP_RE,
    component_classifier,
    index_from_metadata,
    verify_dcp,
    world_size_of,
)
from ckptctl.formats.dcp_folder_metadata import load_dcp_metadata
from ckptctl.formats.dcp_metadata import METADATA_NAME, DcpMetadata
from ckptctl.formats.documents import read_json
from ckptctl.formats.safe_pickle import FrameworkObject
from ckptctl.frameworks.megatron.files import COMMON, RELEASE, TRACKER, iteration_of, read_common, read_tracker
from ckptctl.io import DirEntry

if TYPE_CHECKING:
    from ckptctl.contract.resume import ResumeProfile

__all__ = ["MARKER", "MegatronLayout"]

#: megatron-core's dist-ckpt config, written after everything else (`CONFIG_FNAME`).
MARKER = "metadata.json"
#: Megatron-LM's tokenizer assets inside an iteration folder (`save_tokenizer_assets`).
TOKENIZER_FOLDER = "tokenizer"
#: verl's Hugging Face export (config, tokenizer, weights) beside its `dist_ckpt/`.
VERL_HF_FOLDER = "huggingface"

_TMP_METADATA = METADATA_NAME + ".tmp"

#: Megatron-LM argument names shown by `inspect` (the parallelism facts, then the model's shape).
_PARALLELISM_ARGS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "data_parallel_size",
    "world_size",
    "sequence_parallel",
    "use_distributed_optimizer",
)
_MODEL_ARGS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "padded_vocab_size",
    "max_position_embeddings",
    "position_embedding_type",
    "normalization",
    "swiglu",
    "untie_embeddings_and_output_weights",
    "num_experts",
    "params_dtype",
    # The layer spec: the local one saves its norms under Transformer Engine's names (`names.py`).
    "transformer_impl",
)
#: Counters `common.pt` keeps that a resume continues from (in `args` or at the top).
_PROGRESS_KEYS = ("consumed_train_samples", "consumed_valid_samples", "num_floating_point_operations_so_far")


def _plain(value: Any) -> Any:
    """A value of `args` as `inspect` shows it: stand-ins by what they stand for."""
    if isinstance(value, FrameworkObject):
        return f"{value.stands_for.rpartition('.')[2]}.{value.value}" if value.value is not None else value.stands_for
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def tensor_parallel_size(metadata: DcpMetadata) -> int | None:
    """The tensor-parallel size the model was saved with, from its chunks: the parts of a column-parallel
    layer (the word embeddings, or the first layer's fused QKV) along its rows."""
    for key in ("embedding.word_embeddings.weight", "decoder.layers.self_attention.linear_qkv.weight"):
        tensor = metadata.entries.get(key)
        chunks = getattr(tensor, "chunks", None)
        if chunks:
            row = 1 if key.startswith("decoder.layers.") else 0
            return len({c.offsets[row] for c in chunks if len(c.offsets) > row})
    return None


def _failing_index(url: str) -> tuple[TensorEntry, ...]:
    """The tensor index of a folder whose `.metadata` did not read at open: reading it again raises why."""
    return index_from_metadata(load_dcp_metadata(url), component_classifier(()))


class MegatronLayout(Layout):
    """One Megatron dist-ckpt folder: an iteration folder of Megatron-LM (`iter_NNNNNNN/`, `release/`), or a
    dist-ckpt folder inside another framework's checkpoint (recognised by `metadata.json`)."""

    name = "megatron"

    # ------------------------------------------------------------------------------------------ reading

    def identify(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        """A ref when the folder holds DCP files or `common.pt` and either `metadata.json` or Megatron's folder
        name (`iter_NNNNNNN`, `release`): without `metadata.json` it is a save under way."""
        files = {e.name: e for e in entries if not e.is_dir}
        data = METADATA_NAME in files or _TMP_METADATA in files or any(DISTCP_RE.match(n) for n in files)
        name = io.name_of(url)
        megatron_name = iteration_of(name) is not None or name == RELEASE
        if not (data or COMMON in files) or not (MARKER in files or megatron_name):
            return None
        marker = files.get(MARKER)
        if marker is None:
            state, note = (
                CheckpointState.IN_PROGRESS,
                f"no {MARKER} yet: megatron-core writes it when the save is complete",
            )
        elif METADATA_NAME not in files:
            state, note = CheckpointState.BROKEN, f"{MARKER} is there but {METADATA_NAME} is not"
        elif _TMP_METADATA in files:
            state, note = CheckpointState.IN_PROGRESS, f"{_TMP_METADATA} present: being overwritten"
        else:
            state, note = CheckpointState.COMPLETE, ""
        return CheckpointRef(
            url=url,
            layout=self.name,
            step=iteration_of(name),
            epoch=None,
            created=timestamp(marker.mtime if marker is not None else newest_mtime(entries)),
            state=state,
            size_bytes=sum(e.size for e in files.values()),
            note=note,
        )

    def latest_pointer(self, url: str, entries: Sequence[DirEntry]) -> str | None:
        """The iteration folder Megatron-LM's tracker names (what `--load` loads)."""
        if not any(e.name == TRACKER and not e.is_dir for e in entries):
            return None
        return read_tracker(url)

    def open(self, url: str) -> Checkpoint:
        """Open the folder: `.metadata` for the tensor index and world size, `common.pt` (safely) for the
        arguments, counters and parallelism, `metadata.json` for the backend.

        A folder whose `.metadata` or `common.pt` cannot be read still opens, so that `verify` says why.
        """
        entries = io.list_dir(url)
        ref = self.identified(url, entries, f"a Megatron dist-ckpt folder (no {MARKER} beside DCP files)")
        files = list_files(url) if any(e.is_dir for e in entries) else {e.name: e.size for e in entries}
        info: dict[str, Any] = {"format": "megatron dist-ckpt", "release": io.name_of(url) == RELEASE}
        common: dict[str, Any] = {}
        if COMMON in files:
            try:
                common = read_common(url)
            except CkptctlError as exc:
                info["common_error"] = exc.message
        recorded = common.get("args")
        args: dict[str, Any] = recorded if isinstance(recorded, dict) else {}
        backend = self._backend(url, files, info)
        if backend is not None:
            info["sharded_backend"] = backend
        metadata = None
        try:
            metadata = load_dcp_metadata(url, next((e for e in entries if e.name == METADATA_NAME), None))
        except (CheckpointInProgress, CorruptCheckpoint) as exc:
            info["error"] = exc.message
            if not isinstance(exc, CheckpointInProgress) and ref.state is CheckpointState.COMPLETE:
                ref = replace(ref, state=CheckpointState.BROKEN, note=exc.message)
        components = self._components(common, args, files)
        progress = self._progress(common, args)
        info.update(self._facts(common, args, metadata))
        if progress:
            info["progress"] = progress
        if metadata is None:
            return Checkpoint(
                ref=ref,
                components=frozenset(components),
                world_size=world_size_of(entries),
                metadata=info,
                tensor_index=lambda: _failing_index(url),
                files=files,
                progress=progress,
            )
        classify = component_classifier(metadata.entries)
        components |= classify.components
        info["dcp_version"] = metadata.version
        info["tensors"] = sum(1 for _ in metadata.tensors())
        loaded = metadata

        @cache
        def tensor_index() -> tuple[TensorEntry, ...]:
            return index_from_metadata(loaded, classify)

        return Checkpoint(
            ref=ref,
            components=frozenset(components),
            world_size=world_size_of(entries, metadata.referenced_files()),
            metadata=info,
            tensor_index=tensor_index,
            files=files,
            progress=progress,
        )

    def _backend(self, url: str, files: Mapping[str, int], info: dict[str, Any]) -> str | None:
        if MARKER not in files:
            return None
        try:
            config = read_json(io.join(url, MARKER))
        except CkptctlError as exc:
            info["marker_error"] = exc.message
            return None
        backend = config.get("sharded_backend") if isinstance(config, dict) else None
        return backend if isinstance(backend, str) else None

    def _components(
        self, common: Mapping[str, Any], args: Mapping[str, Any], files: Mapping[str, int]
    ) -> set[Component]:
        found: set[Component] = set()
        if "opt_param_scheduler" in common:
            found.add(Component.SCHEDULER)
        if isinstance(common.get("iteration"), int):
            found.add(Component.TRAINER_STATE)
        # Megatron-LM's samplers start from `args.consumed_train_samples`: the data position is restored.
        if isinstance(args.get("consumed_train_samples"), int):
            found.add(Component.DATALOADER)
        if args:
            found.add(Component.CONFIG)
        if any(name.startswith(TOKENIZER_FOLDER + "/") for name in files):
            found.add(Component.TOKENIZER)
        return found

    def _progress(self, common: Mapping[str, Any], args: Mapping[str, Any]) -> dict[str, Any]:
        progress: dict[str, Any] = {}
        if isinstance(common.get("iteration"), int):
            progress["iteration"] = common["iteration"]
        for key in _PROGRESS_KEYS:
            value = common.get(key, args.get(key))
            if isinstance(value, int) and not isinstance(value, bool):
                progress[key] = value
        return progress

    def _facts(
        self, common: Mapping[str, Any], args: Mapping[str, Any], metadata: DcpMetadata | None
    ) -> dict[str, Any]:
        facts: dict[str, Any] = {}
        version = common.get("checkpoint_version")
        if isinstance(version, (int, float)):
            facts["checkpoint_version"] = version
        parallelism = {k: _plain(args[k]) for k in _PARALLELISM_ARGS if k in args}
        if "tensor_model_parallel_size" not in parallelism and metadata is not None:
            derived = tensor_parallel_size(metadata)
            if derived is not None:
                parallelism["tensor_model_parallel_size"] = derived
                parallelism["derived_from"] = "the tensor chunks (no args in common.pt)"
        optimizer = common.get("optimizer")
        sharding = optimizer.get("param_state_sharding_type") if isinstance(optimizer, dict) else None
        if isinstance(sharding, str):
            parallelism["distrib_optim_sharding_type"] = sharding
        if parallelism:
            facts["parallelism"] = parallelism
        model = {k: _plain(args[k]) for k in _MODEL_ARGS if k in args}
        if model:
            facts["model"] = model
        return facts

    def verify(self, checkpoint: Checkpoint) -> list[Problem]:
        """The DCP folder's structure (`verify_dcp`: `.metadata`, data files, coverage, the bytes items such
        as `rng_state` read safely), `metadata.json` present and naming its backend, and `common.pt` present
        and readable without running it (Megatron's load reads both)."""
        url = checkpoint.url
        problems = verify_dcp(url)
        files = checkpoint.files
        if MARKER not in files:
            problems.append(
                Problem(
                    ProblemKind.IN_PROGRESS,
                    MARKER,
                    f"no {MARKER}: megatron-core writes it after all the data, so the save has not finished "
                    "(Megatron's load refuses the folder)",
                )
            )
        elif "marker_error" in checkpoint.metadata:
            problems.append(Problem(ProblemKind.BAD_METADATA, MARKER, checkpoint.metadata["marker_error"]))
        elif checkpoint.metadata.get("sharded_backend") not in ("torch_dist", None):
            problems.append(
                Problem(
                    ProblemKind.BAD_METADATA,
                    MARKER,
                    f"sharded backend {checkpoint.metadata['sharded_backend']!r}: ckptctl reads torch_dist "
                    "(legacy zarr checkpoints need Megatron's own tools)",
                )
            )
        if COMMON not in files:
            problems.append(
                Problem(ProblemKind.MISSING_FILE, COMMON, f"{COMMON} is missing (Megatron's load reads it)")
            )
        else:
            try:
                read_common(url)
            except CkptctlError as exc:
                problems.append(Problem.from_error(exc, COMMON))
        return problems

    # ------------------------------------------------------------------------------------- the run walk

    def members(self, url: str, entries: Sequence[DirEntry]) -> frozenset[str]:
        """Every child folder (`tokenizer/`, ModelOpt's state): Megatron-LM writes and deletes an iteration
        folder as a whole."""
        return every_child_folder(entries)

    # ------------------------------------------------------------------------------------------- prune

    def completion_markers(self, files: Mapping[str, int]) -> tuple[str, ...]:
        """`.metadata` (the DCP save's last file), then `metadata.json` (written after it)."""
        return tuple(name for name in (METADATA_NAME, MARKER) if name in files)

    # ------------------------------------------------------------------------------------------ resume

    def resume_profile(self) -> ResumeProfile:
        """See `frameworks.megatron.resume`."""
        from ckptctl.frameworks.megatron.resume import PROFILE

        return PROFILE

    # ----------------------------------------------------------------------------------------- convert
