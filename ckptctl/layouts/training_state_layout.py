"""The layout of a training state the generic reader recognises by its top-level keys (`contract.training_state`):
listed as `training_state`, opened and verified as the single torch.save file it is (`layouts.single_file`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from functools import cache
from typing import TYPE_CHECKING

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointRef, Problem
from ckptctl.contract.base import Layout
from ckptctl.contract.step_names import CHECKPOINT_SUFFIXES
from ckptctl.errors import CkptctlError, UnknownLayout
from ckptctl.formats.torch_zip import TorchArchive
from ckptctl.io import DirEntry
from ckptctl.layouts.checkpoint_like import training_state_of
from ckptctl.layouts.generic import TRAINING_STATE, UNKNOWN_HINT, generic_layout, unclaimed

if TYPE_CHECKING:
    from ckptctl.contract.resume import PlanContext, ResumeProfile

__all__ = ["TrainingStateLayout", "training_state_layout"]


class TrainingStateLayout(Layout):
    """A training state the generic reader recognises by its top-level keys (`contract.training_state`): a
    torch.save file whose name gives a step (Composer's `ep0-ba10-rank0.pt`), or a folder holding one such file
    and nothing else checkpoint-like (LitGPT's `step-00000010/lit_model.pth`). Read as a single torch file
    (`layouts.single_file.TorchFile`): its model, optimizer, scheduler, RNG and counters, as its keys say. Not in
    the registry: the walker finds it, `get_layout(TRAINING_STATE)` returns it."""

    name = TRAINING_STATE
    checkpoint_files = CHECKPOINT_SUFFIXES

    def identify(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        ref = unclaimed(url, entries)[0]
        return ref if ref is not None and ref.layout == TRAINING_STATE else None

    def identify_file(self, url: str, entry: DirEntry) -> CheckpointRef | None:
        ref = generic_layout().identify_file(url, entry)
        return ref if ref is not None and ref.layout == TRAINING_STATE else None

    def open(self, url: str) -> Checkpoint:
        from ckptctl.layouts.single_file import TorchFile

        ref, rel = self._ref_and_file(url)
        opened = TorchFile().open(io.join(url, rel) if rel else url)
        index = opened.tensor_index()
        if rel:  # the file's chunks name it "" (itself): here it is one file of the folder
            index = tuple(replace(e, chunks=tuple(replace(c, file=rel) for c in e.chunks)) for e in index)
        files = {rel: opened.ref.size_bytes} if rel else dict(opened.files)
        step = ref.step if ref.step is not None else opened.ref.step
        epoch = ref.epoch if ref.epoch is not None else opened.ref.epoch
        return replace(
            opened,
            ref=replace(ref, step=step, epoch=epoch),
            metadata={**opened.metadata, "state file": rel or io.name_of(url)},
            tensor_index=lambda: index,
            files=files,
        )

    def verify(self, checkpoint: Checkpoint) -> list[Problem]:
        """Its state file read whole: the pickle through the allowlist, every storage inside the file."""
        from ckptctl.layouts.single_file import TorchFile

        rel = next(iter(checkpoint.files), "")
        file = io.join(checkpoint.url, rel) if rel else checkpoint.url
        layout = TorchFile()
        try:
            found = layout.verify(layout.open(file))
        except CkptctlError as exc:
            found = [Problem.from_error(exc, "")]
        return [replace(p, path=p.path or rel) for p in found]

    def torch_archives(self, checkpoint: Checkpoint) -> Sequence[TorchArchive]:
        """Its state file (the checkpoint itself when it is a file)."""
        return tuple(TorchArchive(rel) for rel in checkpoint.files)

    def resume_profile(self) -> ResumeProfile:
        """What its keys hold is what a resume restores; the framework that wrote it is not known."""
        from ckptctl.contract.resume import generic_profile

        return replace(generic_profile(TRAINING_STATE), hint=_training_state_hint)

    def _ref_and_file(self, url: str) -> tuple[CheckpointRef, str]:
        if io.is_dir(url):
            entries = io.list_dir(url)
            ref = self.identify(url, entries)
            if ref is None:
                raise UnknownLayout(f"{url} holds no training state ckptctl can read", UNKNOWN_HINT)
            rel = next(e.name for e in entries if training_state_of(io.join(url, e.name), e) is not None)
            return ref, rel
        name = io.name_of(url)
        entry = next((e for e in io.list_dir(io.parent_of(url)) if e.name == name and not e.is_dir), None)
        ref = None if entry is None else generic_layout().identify_file(url, entry)
        if ref is None or ref.layout != TRAINING_STATE:
            raise UnknownLayout(f"{url} is no training state ckptctl can read", UNKNOWN_HINT)
        return ref, ""


def _training_state_hint(ctx: PlanContext) -> str:
    return (
        f"load {ctx.url} with the training code that wrote it (torch.load; its keys: "
        f"{ctx.checkpoint.metadata.get('training state keys', '?')})"
    )


@cache
def training_state_layout() -> TrainingStateLayout:
    """The one instance (layouts hold no state)."""
    return TrainingStateLayout()
