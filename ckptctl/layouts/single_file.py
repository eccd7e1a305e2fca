"""Single weights files, read as a checkpoint of their own: `inspect`, `verify` and `diff` take them.

- `*.safetensors`: one safetensors file (a shard of an HF export, a file someone sent), from its header.
- `*.pt`, `*.pth`, `*.bin`: one torch.save zip (`pytorch_model.bin`, a `torch.save(model.state_dict())`,
  a training state), read with the allowlisting unpickler of `formats.torch_pickle`: its structure and
  tensor facts come from `data.pkl`, nothing in it runs, and tensor bytes are plain ranges of the file.

The checkpoint's url is the file itself; its tensor chunks name the file as "" (the checkpoint itself),
which `io.join(url, "")` resolves to the file. A `.distcp` file is one shard of a DCP checkpoint and only
makes sense with the folder around it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import cache, partial
from typing import TYPE_CHECKING

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
from ckptctl.contract.base import Layout, timestamp
from ckptctl.errors import CkptctlError, UnknownLayout
from ckptctl.families.hf_folder import safetensors_index, torch_file_entries
from ckptctl.formats.safetensors import read_header
from ckptctl.formats.torch_zip import TorchArchive
from ckptctl.io import DirEntry

if TYPE_CHECKING:
    from ckptctl.contract.training_state import TrainingState
    from ckptctl.formats.torch_pickle import TorchPickle

#: The chunk file name of a single-file checkpoint: the checkpoint itself.
SELF = ""
TORCH_SUFFIXES = (".pt", ".pth", ".bin")


class _FileLayout(Layout):
    """A layout of one file rather than a folder."""

    def identify(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        """Never a folder: files are recognised by `detect_file`."""
        return None


class SafetensorsFile(_FileLayout):
    """One `*.safetensors` file."""

    name = "safetensors"

    def open(self, url: str) -> Checkpoint:
        ref = file_ref(url, self.name)
        files = {SELF: ref.size_bytes}
        header = read_header(url, ref.size_bytes)
        metadata: dict[str, object] = {"format": "safetensors", "tensors": len(header.tensors)}
        if header.metadata:
            metadata["header metadata"] = dict(header.metadata)

        @cache
        def tensor_index() -> tuple[TensorEntry, ...]:
            return safetensors_index(url, [SELF], files)

        return Checkpoint(ref, frozenset({Component.MODEL}), None, metadata, tensor_index, files)

    def verify(self, checkpoint: Checkpoint) -> list[Problem]:
        """The header parses and every tensor lies inside the file (`read_header` checks both)."""
        try:
            read_header(checkpoint.url, checkpoint.ref.size_bytes)
        except CkptctlError as exc:
            return [Problem.from_error(exc, SELF)]
        return []


class TorchFile(_FileLayout):
    """One torch.save zip file (`*.pt`, `*.pth`, `*.bin`)."""

    name = "torch"

    def open(self, url: str) -> Checkpoint:
        # Imported here: the pickle readers cost every command their import, and only torch.save files need them.
        from ckptctl.contract.training_state import read_training_state
        from ckptctl.formats.safe_pickle import opaque_values
        from ckptctl.formats.torch_pickle import open_torch_pickle
        from ckptctl.formats.torch_pickle_classes import OPAQUE_PICKLE_GLOBALS

        ref = file_ref(url, self.name)
        opened = open_torch_pickle(url, ref.size_bytes, OPAQUE_PICKLE_GLOBALS)
        state = read_training_state(opened.root)
        entries = _tensor_entries(opened, state)
        metadata: dict[str, object] = {
            "format": "torch.save zip (read without unpickling code)",
            "tensors": len(entries),
        }
        components = {e.component for e in entries}
        if state.recognised:
            # A training state: what its top-level keys hold, also where they hold no tensor (a scheduler's
            # state is numbers only) and the counters a resume continues from.
            components |= set(state.components.values())
            metadata["training state keys"] = ", ".join(k for k in state.components if not k.startswith("("))
            metadata.update({f"counter {key}": value for key, value in state.counters.items()})
            ref = replace(ref, step=state.step, epoch=state.epoch)
        opaque = opaque_values(opened.root)
        if opaque:
            metadata["opaque values"] = "; ".join(opaque)
        return Checkpoint(
            ref,
            frozenset(components) or frozenset({Component.EXTRA}),
            None,
            metadata,
            lambda: entries,
            {SELF: ref.size_bytes},
            progress=dict(state.counters),
        )

    def torch_archives(self, checkpoint: Checkpoint) -> Sequence[TorchArchive]:
        """The file itself."""
        return (TorchArchive(SELF),)

    def verify(self, checkpoint: Checkpoint) -> list[Problem]:
        """`data.pkl` loads with the allowlist and every storage it names lies whole inside the file."""
        from ckptctl.families.torch_file import torch_file_problems
        from ckptctl.formats.safe_pickle import opaque_values
        from ckptctl.formats.torch_pickle import open_torch_pickle
        from ckptctl.formats.torch_pickle_classes import OPAQUE_PICKLE_GLOBALS

        opened, problems = torch_file_problems(
            SELF, partial(open_torch_pickle, checkpoint.url, checkpoint.ref.size_bytes, OPAQUE_PICKLE_GLOBALS)
        )
        if opened is None:
            return problems
        # A class of a known library ckptctl was not taught is read as an opaque value: said, not failed.
        problems += [
            Problem(ProblemKind.UNSUPPORTED_CLASS, SELF, f"{note}: read as an opaque value", severity="warning")
            for note in opaque_values(opened.root)
        ]
        return problems


def _tensor_entries(opened: TorchPickle, state: TrainingState) -> tuple[TensorEntry, ...]:
    """Every tensor of the file, as RAW chunks into it (see `torch_file_entries`); a training state's model
    tensors under the model's own names (`model_name`), unless that would give two tensors one name."""
    from ckptctl.contract.training_state import model_name

    classify: Callable[[str], Component]
    if state.components:
        classify = state.component_of
    elif io.name_of(opened.url).startswith("optim") or is_optimizer_state(opened.root):
        classify = _optimizer  # optimizer.pt, optim_states.pt, any `{state, param_groups}`: keys are `state.*`
    else:
        classify = _classifier_with_evidence([name for name, _ in opened.tensors()])
    entries = torch_file_entries(opened, SELF, classify)
    if not state.components:
        return tuple(entries)
    renamed = [replace(e, name=model_name(e.name, state)) if e.component == Component.MODEL else e for e in entries]
    return tuple(renamed if len({e.name for e in renamed}) == len(renamed) else entries)


def _optimizer(_name: str) -> Component:
    return Component.OPTIMIZER


#: The names torch.optim's optimizers give their per-parameter state (Adam/AdamW, SGD's momentum, RMSprop,
#: Adadelta, Adamax, ...): a tensor under one of them is optimizer state, whatever the keys around it.
_OPTIMIZER_STATE_NAMES = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta", "exp_inf", "grad_avg"}
)
#: Last name segments of a model's parameters and buffers: the evidence that a file of bare names is a model.
_PARAMETER_NAMES = re.compile(r"(?:^|[._])(?:weight|bias|running_mean|running_var|inv_freq|embeddings?)$")


def is_optimizer_state(root: object) -> bool:
    """Whether an unpickled object is a torch optimizer's `state_dict()` (`{"state": {...}, "param_groups": [...]}`),
    whatever its state is keyed by (indices, or the parameters' names in FSDP's full optimizer state)."""
    return isinstance(root, dict) and isinstance(root.get("state"), dict) and isinstance(root.get("param_groups"), list)


def _classifier_with_evidence(names: list[str]) -> Callable[[str], Component]:
    """The components of a file of bare tensors, claiming a model only with evidence (DESIGN §1: an honest
    unknown beats a confident guess): optimizer state by its names (`*.exp_avg`) is optimizer state, and the
    rest is model weights only when one of them is named as parameters are (`*.weight`, `*.bias`); otherwise
    it is `extra`, which `convert` refuses to publish as a model, rather than writing Adam moments into
    model.safetensors."""
    from ckptctl.families.dcp_folder import component_classifier

    keys = component_classifier(names)
    optimizer = {name for name in names if not _OPTIMIZER_STATE_NAMES.isdisjoint(name.split("."))}
    evidence = any(_PARAMETER_NAMES.search(name) for name in names if name not in optimizer)

    def classify(name: str) -> Component:
        if name in optimizer:
            return Component.OPTIMIZER
        component = keys(name)
        return component if component is not Component.MODEL or evidence else Component.EXTRA

    return classify


def file_ref(url: str, layout: str) -> CheckpointRef:
    """The ref of a single-file checkpoint: complete (nothing cheaper than its header could say otherwise)."""
    # A local stat gives size and mtime; on an object store the parent's listing gives both (a HEAD the fallback).
    if io.is_local(url):
        st = os.stat(io.local_path(url))
        size, mtime = st.st_size, st.st_mtime or None
    else:
        name = io.name_of(url)
        entry = next((e for e in io.list_dir(io.parent_of(url)) if e.name == name and not e.is_dir), None)
        size, mtime = (entry.size, entry.mtime) if entry is not None else (io.file_size(url), None)
    return CheckpointRef(url, layout, None, None, timestamp(mtime), CheckpointState.COMPLETE, size)


def detect_file(url: str) -> tuple[Layout, CheckpointRef]:
    """The layout of a single file and its ref, judged from its name.

    Raises:
        UnknownLayout: a `.distcp` shard (its folder is the checkpoint), or a file of no known format.
    """
    name = io.name_of(url)
    layout: Layout
    if name.endswith(".safetensors"):
        layout = SafetensorsFile()
    elif name.endswith(TORCH_SUFFIXES):
        layout = TorchFile()
    elif name.endswith(".distcp") or name == ".metadata":
        raise UnknownLayout(
            f"{url} is one file of a torch DCP checkpoint", "pass the folder that holds it (with its .metadata)"
        )
    else:
        raise UnknownLayout(
            f"{url} is a file, not a checkpoint folder",
            "pass the folder that contains it, or a single weights file (*.safetensors, or a torch.save *.pt, "
            "*.pth, *.bin)",
        )
    return layout, file_ref(url, layout.name)
