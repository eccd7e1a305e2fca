"""DeepSpeed ZeRO save folders, as `engine.save_checkpoint` writes them (LAYOUTS.md, DeepSpeed).

```
SAVE_DIR/latest                         the newest tag, e.g. `global_step40`
SAVE_DIR/{tag}/                         one checkpoint (a "tag folder")
    mp_rank_{mp:02d}_model_states.pt                        ZeRO 0-2: module weights + metadata
    zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt      ZeRO-3: one per DP rank, no weights inside
    [bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt   one per DP rank: fp32 flat partitions
```

The pieces the layouts built on this one reuse (the Trainer's, OpenRLHF's, open-instruct's) are
re-exported here; those for a DeepSpeed folder inside `checkpoint-N/` take a `path_prefix`
that makes file names relative to the outer checkpoint: `tag_files`, `read_tag`, `tag_index`, `verify_tag`.

The package's modules: `names` (rank files and `latest`, from listings), `tag` (the rank-0 facts),
`zero_index` (the tensor index), `master_weights` (zero_to_fp32's output), `verify`; `universal` and
`universal_states`, the layout of what `ds_to_universal` makes of a tag.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import cache

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointRef, CheckpointState, Problem, TensorEntry
from ckptctl.errors import CorruptCheckpoint, UnknownLayout
from ckptctl.frameworks.deepspeed.master_weights import checkpoint_master_weights, master_weights, tag_prefix
from ckptctl.frameworks.deepspeed.names import (
    LATEST_NAME,
    TagFiles,
    is_universal,
    latest_problem,
    missing_note,
    read_latest,
    tag_files,
    tag_markers,
)
from ckptctl.frameworks.deepspeed.tag import ENGINE_KEYS, DeepSpeedTag, missing_rank_files, read_tag
from ckptctl.frameworks.deepspeed.verify import verify_tag
from ckptctl.frameworks.deepspeed.zero_index import tag_index
from ckptctl.io import DirEntry
from ckptctl.layouts.base import (
    Layout,
    every_child_folder,
    folder_size,
    newest_mtime,
    step_from_name,
    timestamp,
)
from ckptctl.layouts.resume import ResumeProfile

__all__ = [
    "ENGINE_KEYS",
    "LATEST_NAME",
    "DeepSpeedLayout",
    "DeepSpeedTag",
    "TagFiles",
    "checkpoint_master_weights",
    "latest_problem",
    "master_weights",
    "missing_note",
    "missing_rank_files",
    "read_latest",
    "read_tag",
    "tag_files",
    "tag_index",
    "tag_markers",
    "tag_prefix",
    "verify_tag",
]


class DeepSpeedLayout(Layout):
    """A DeepSpeed ZeRO (0-3) tag folder; its parent is the run and holds `latest`."""

    name = "deepspeed"

    def identify(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        """A ref when the folder holds DeepSpeed model/optim states and is no universal checkpoint
        (`universal`); BROKEN when it lacks a rank file (`missing_rank_files`: the names, and the world size
        its rank-0 model states record)."""
        files = tag_files(entries)
        if files is None or is_universal(entries):
            return None
        missing = missing_rank_files(url, files)
        return CheckpointRef(
            url=url,
            layout=self.name,
            step=step_from_name(io.name_of(url)),
            epoch=None,
            created=timestamp(newest_mtime(entries)),
            state=CheckpointState.BROKEN if missing else CheckpointState.COMPLETE,
            size_bytes=folder_size(url, entries),
            note=missing_note(missing),
        )

    def latest_pointer(self, url: str, entries: Sequence[DirEntry]) -> str | None:
        """The tag the save folder's `latest` file names."""
        return read_latest(url, entries)

    def members(self, url: str, entries: Sequence[DirEntry]) -> frozenset[str]:
        """Every child folder: a tag is what one `save_checkpoint` wrote (NVMe offload adds
        `offloaded_tensors/`)."""
        return every_child_folder(entries)

    def open(self, url: str) -> Checkpoint:
        """Read the rank-0 model and optim states; the tensor index reads the other ranks' `data.pkl`.

        A tag whose rank-0 files do not parse still opens (so that `verify` can say why), as BROKEN,
        with a tensor index that raises the reason.
        """
        entries = io.list_dir(url)
        ref = self.identify(url, entries)
        files = tag_files(entries)
        if ref is None or files is None:
            raise UnknownLayout(f"{url} is not a DeepSpeed checkpoint (no *_model_states.pt or *_optim_states.pt)")
        all_files = {e.name: e.size for e in entries if not e.is_dir}
        try:
            tag = read_tag(url, files)
        except CorruptCheckpoint as exc:
            error = exc

            def unreadable() -> tuple[TensorEntry, ...]:
                raise error

            return Checkpoint(
                ref=replace(ref, state=CheckpointState.BROKEN, note=exc.message),
                components=frozenset(),
                world_size=None,
                metadata={"error": exc.message},
                tensor_index=unreadable,
                files=all_files,
            )
        epoch = tag.client_state().get("epoch")
        ref = replace(
            ref,
            step=tag.global_steps if tag.global_steps is not None else ref.step,
            epoch=float(epoch) if isinstance(epoch, int | float) and not isinstance(epoch, bool) else None,
            latest=read_latest(io.parent_of(url), io.list_dir(io.parent_of(url))) == io.name_of(url),
        )

        @cache
        def tensor_index() -> tuple[TensorEntry, ...]:
            return tag_index(tag)

        metadata = tag.metadata()
        return Checkpoint(
            ref=ref,
            components=tag.components(),
            world_size=tag.dp_world_size * tag.mp_world_size,
            metadata=metadata,
            tensor_index=tensor_index,
            files=all_files,
            progress=metadata["progress"],
        )

    def verify(self, checkpoint: Checkpoint) -> list[Problem]:
        """`verify_tag`, plus the save folder's `latest` pointer naming an existing tag."""
        problems = verify_tag(checkpoint.url)
        pointer = latest_problem(io.parent_of(checkpoint.url), f"../{LATEST_NAME}")
        if pointer is not None:
            problems.append(pointer)
        return problems

    def completion_markers(self, files: Mapping[str, int]) -> tuple[str, ...]:
        """The rank-0 model states (`tag_markers`): DeepSpeed writes no marker, but without them the tag
        reads broken."""
        return tag_markers(files)

    def resume_profile(self) -> ResumeProfile:
        """See `frameworks.deepspeed.resume`."""
        from ckptctl.frameworks.deepspeed.resume import PROFILE

        return PROFILE
