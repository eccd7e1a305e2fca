"""PEFT adapter folders, as `PeftModel.save_pretrained` writes them (LAYOUTS.md, PEFT adapters).

```
ADAPTER/
    adapter_model.safetensors      the adapter's tensors (`{"format": "pt"}` metadata), or adapter_model.bin
    adapter_config.json            written after the weights: peft_type, r, lora_alpha, target_modules, ...
    README.md, tokenizer files     (a model card; the tokenizer when the trainer saved one)
```

peft 0.21.2 `peft_model.py` `PeftModel.save_pretrained`: the weights, then `peft_config.save_pretrained`;
an adapter other than `default` goes into `ADAPTER/<adapter_name>/` (a folder of its own, walked as such).
The tensors are named `base_model.model.<module>.lora_A.weight` and so on (`families.lora.factors`).

An adapter is not a model: `convert --merge-adapter BASE` writes the model that PEFT's
`PeftModel.from_pretrained(BASE, ADAPTER).merge_and_unload()` gives (`ConvertSource.adapter`). What an adapter
folder holds is read with the LoRA part (`families.lora.adapter`), which the Trainer's layout shares
for the adapter inside a `checkpoint-N/`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
from ckptctl.contract.base import (
    Layout,
)
from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.families.hf_folder import files_ref, has_weights, legacy_index, model_components, safetensors_index
from ckptctl.families.lora.adapter import ADAPTER_WEIGHTS, adapter_metadata, adapter_problems
from ckptctl.families.lora.settings import ADAPTER_CONFIG
from ckptctl.formats.documents import read_json
from ckptctl.formats.safetensors import read_header
from ckptctl.formats.torch_pickle import open_torch_pickle, storage_problems
from ckptctl.io import DirEntry

if TYPE_CHECKING:
    from ckptctl.contract.resume import ResumeProfile

__all__ = ["PeftLayout"]


def _names_peft_type(url: str) -> bool:
    """Whether the JSON file at `url` is a PEFT config (it names a `peft_type`)."""
    try:
        config = read_json(url)
    except CkptctlError:
        return False
    return isinstance(config, dict) and isinstance(config.get("peft_type"), str)


def _weights(names: set[str]) -> str | None:
    return next((name for name in ADAPTER_WEIGHTS if name in names), None)


class PeftLayout(Layout):
    """A PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors` or `.bin`).

    A folder that also holds a model's own weights is a model folder (the `hf` layout) that happens to keep
    an adapter beside it.
    """

    name = "peft"

    def identify(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        """An adapter's weights make the folder an adapter; without `adapter_config.json` (written after
        them) it is broken: PEFT cannot load it."""
        names = {e.name for e in entries if not e.is_dir}
        weights = _weights(names)
        if has_weights(names - set(ADAPTER_WEIGHTS)):
            return None
        if weights is None:
            return self._without_weights(url, entries, names)
        if ADAPTER_CONFIG in names:
            return files_ref(self.name, url, entries, CheckpointState.COMPLETE)
        note = f"no {ADAPTER_CONFIG}: PEFT writes it after the weights, and cannot load without it"
        return files_ref(self.name, url, entries, CheckpointState.BROKEN, note)

    def _without_weights(self, url: str, entries: Sequence[DirEntry], names: set[str]) -> CheckpointRef | None:
        """A folder of files only, whose `adapter_config.json` names a PEFT type but that holds no weights (nor a
        model's `config.json`) is a torn adapter (its weights lost), never nothing: `PeftModel.from_pretrained` (peft/peft_model.py, `load_adapter`)
        fails on it."""
        if ADAPTER_CONFIG not in names or any(e.is_dir for e in entries) or "config.json" in names:
            return None  # a folder of other things that keeps a run's adapter settings (a wrapped model's save)
        if not _names_peft_type(io.join(url, ADAPTER_CONFIG)):
            return None
        return files_ref(
            self.name,
            url,
            entries,
            CheckpointState.BROKEN,
            f"no {ADAPTER_WEIGHTS[0]}: the adapter's weights are missing",
        )

    def open(self, url: str) -> Checkpoint:
        """The adapter's settings (adapter_config.json) and its tensor index (the weights file's header)."""
        entries = io.list_dir(url)
        ref = self.identify(url, entries)
        if ref is None:
            raise CorruptCheckpoint(f"{url} holds no adapter_model.safetensors or adapter_model.bin")
        files = {e.name: e.size for e in entries if not e.is_dir}
        weights = _weights(set(files))

        @cache
        def tensor_index() -> tuple[TensorEntry, ...]:
            if weights is None:  # a torn adapter (`_without_weights`)
                return ()
            if weights.endswith(".bin"):
                return legacy_index(url, [weights], files)
            return safetensors_index(url, [weights], files)

        metadata: dict[str, Any] = {"format": f"PEFT adapter ({weights})"}
        metadata.update(adapter_metadata(url, ADAPTER_CONFIG in files, tensor_index))
        return Checkpoint(
            ref=ref,
            components=frozenset(model_components(set(files)) | {Component.MODEL}),
            world_size=None,
            metadata=metadata,
            tensor_index=tensor_index,
            files=files,
        )

    def verify(self, checkpoint: Checkpoint) -> list[Problem]:
        """adapter_config.json parses; the weights file's header (or zip and pickle) is whole; every lora_A
        has its lora_B with ranks that agree with each other and with r / rank_pattern. An alpha of 0 is a
        warning: such an adapter loads and does nothing."""
        url, files = checkpoint.url, checkpoint.files
        weights = _weights(set(files))
        if weights is None:
            return [
                Problem(
                    ProblemKind.MISSING_FILE,
                    ADAPTER_WEIGHTS[0],
                    f"the adapter's weights are missing ({' or '.join(ADAPTER_WEIGHTS)}): PeftModel.from_pretrained "
                    "cannot load it",
                )
            ]
        problems: list[Problem] = []
        try:
            if weights.endswith(".bin"):
                opened = open_torch_pickle(io.join(url, weights), files[weights])
                problems += [Problem(ProblemKind.TRUNCATED, weights, message) for message in storage_problems(opened)]
            else:
                read_header(io.join(url, weights), files[weights])
            index = checkpoint.tensor_index()
        except CkptctlError as exc:
            settings_problems = adapter_problems(url, ADAPTER_CONFIG in files, (), weights)
            return [*settings_problems, *problems, Problem.from_error(exc, weights)]
        return [*adapter_problems(url, ADAPTER_CONFIG in files, index, weights), *problems]

    def completion_markers(self, files: Mapping[str, int]) -> tuple[str, ...]:
        """adapter_config.json: PEFT writes it after the weights, and loads nothing without it."""
        return (ADAPTER_CONFIG,) if ADAPTER_CONFIG in files else ()

    def resume_profile(self) -> ResumeProfile:
        """See `frameworks.peft.resume`."""
        from ckptctl.frameworks.peft.resume import PROFILE

        return PROFILE
