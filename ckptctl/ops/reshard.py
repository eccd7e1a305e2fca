"""`reshard SRC DST`: a whole resumable training state for another number of ranks or another framework.

The writing is a framework's: the training-state writer (`contract.capabilities.TrainingStateWriter`) that
`--to` names, or without `--to` the one of the source's own framework. This module owns what every writer
shares, as `convert` does (and with the same code, `ops.commit`): the source opened and verified, DST
refused when it is not empty, the writer's refusal asked before anything is written, the output staged
in a hidden folder next to DST, digested (`ckptctl-digests.json`, so that `ckptctl verify DST` checks every
byte later), and renamed into place; an interrupted or failed reshard leaves nothing at DST.

DST on an object store (any fsspec URL) is staged in the local temporary folder and uploaded as `convert`
uploads (`UploadStaging`): every file in parallel but those the writer lists last (`WrittenState.files`:
markers, trackers and pointers), which go up one after another in its order (`published_last`), then the
digests; a failed or interrupted upload deletes what it put.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ckptctl.contract.capabilities import TRAINING_STATE_WRITER, NotCarried, ReshardRequest, TrainingStateWriter
from ckptctl.errors import CkptctlError, StorageError
from ckptctl.layouts import capability, resolve, training_state_writer, training_state_writers
from ckptctl.ops.commit import check_destination, published_last, staging_for, write_digests
from ckptctl.ops.report import SCHEMA_VERSION, NoProgress, Progress
from ckptctl.ops.sources import open_verified

__all__ = ["ReshardOptions", "ReshardResult", "reshard"]


@dataclass(frozen=True, slots=True)
class ReshardOptions:
    """What `reshard` is asked for.

    Attributes:
        to: the target writer's name (`deepspeed-universal`, ...); None: the source framework's own writer.
        world_size: the number of ranks the target loads on; None keeps the source's where that means something.
        workers: threads the writer may read and write with.
        force: replace a DST that is not empty (only an earlier output: one holding `ckptctl-digests.json`).
        layout: read SRC as this layout instead of detecting it.
    """

    to: str | None = None
    world_size: int | None = None
    workers: int = 1
    force: bool = False
    layout: str | None = None


@dataclass(frozen=True, slots=True)
class ReshardResult:
    """What `reshard` wrote (DESIGN §4 JSON contract `reshard`).

    Attributes:
        src: SRC as given.
        checkpoint: the checkpoint SRC resolved to (a save folder's latest tag).
        layout: its layout.
        dst: where the output is.
        to: the writer's target name.
        world_size: the world size the output loads on (None: any).
        tensors: tensors written.
        bytes: tensor bytes written.
        files: the output's files, relative to DST.
        not_carried: what the output does not carry, and why.
        resume_hint: the setting that makes the target framework resume from DST.
        seconds: wall time.
        uploaded: bytes uploaded to an object store DST (every file of the output; 0 for a local DST).
    """

    src: str
    checkpoint: str
    layout: str
    dst: str
    to: str
    world_size: int | None
    tensors: int
    bytes: int
    files: tuple[str, ...]
    not_carried: tuple[NotCarried, ...]
    resume_hint: str | None
    seconds: float
    uploaded: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "src": self.src,
            "checkpoint": self.checkpoint,
            "layout": self.layout,
            "dst": self.dst,
            "to": self.to,
            "world_size": self.world_size,
            "tensors": self.tensors,
            "bytes": self.bytes,
            "files": list(self.files),
            "not_carried": [{"what": n.what, "why": n.why} for n in self.not_carried],
            "resume_hint": self.resume_hint,
            "seconds": round(self.seconds, 3),
            "bytes_uploaded": self.uploaded,
        }


def reshard(
    src: str, dst: str, options: ReshardOptions | None = None, progress: Progress | None = None
) -> ReshardResult:
    """Write the resumable training state of `src` into `dst` with the chosen writer.

    Raises:
        CkptctlError: DST not empty (without `force`), no writer for the source or `to`, the
            writer refuses the source (a torn one, naming the missing file; a world size it cannot honour),
            or the source does not read.
    """
    options = options or ReshardOptions()
    progress = progress or NoProgress()
    started = time.monotonic()
    if options.world_size is not None and options.world_size < 1:
        raise CkptctlError(f"--world-size {options.world_size}: a world size is at least 1")
    target = check_destination(src, dst, options.force)
    layout, ref = resolve(src, options.layout)
    checkpoint = open_verified(layout, ref)
    writer = _writer(options.to, checkpoint.layout)
    refusal = writer.refusal(checkpoint, options.world_size)
    if refusal is not None:
        raise CkptctlError(f"cannot reshard {checkpoint.url} to {writer.target}: {refusal}")
    with staging_for(target) as staging:
        # The output holds about what the source does (the same states, in other files).
        staging.check_space(sum(checkpoint.files.values()))
        progress.start(f"resharding to {writer.target}", None)
        request = ReshardRequest(checkpoint, staging.out, options.world_size, max(1, options.workers))
        try:
            written = writer.write(request, progress.advance)
        except OSError as exc:  # a full disk, a name too long: the writer's own files, in staging
            raise StorageError(f"cannot write the output: {exc.strerror or exc}") from exc
        progress.finish()
        write_digests(staging.out, dict(written.digests))  # what the writer hashed is not read back
        uploaded = staging.commit(options.force, progress, published_last(written.files))
    return ReshardResult(
        src=src,
        checkpoint=checkpoint.url,
        layout=checkpoint.layout,
        dst=target,
        to=writer.target,
        world_size=written.world_size,
        tensors=written.tensors,
        bytes=written.bytes,
        files=written.files,
        not_carried=written.not_carried,
        resume_hint=written.resume_hint,
        seconds=time.monotonic() - started,
        uploaded=uploaded,
    )


def _writer(to: str | None, layout: str) -> TrainingStateWriter:
    """The writer `to` names, else the source framework's own."""
    if to is not None:
        return training_state_writer(to)
    own = capability(layout, TRAINING_STATE_WRITER)
    if own is None:
        known = ", ".join(sorted(writer.target for writer in training_state_writers())) or "none"
        raise CkptctlError(
            f"the {layout} framework has no training-state writer of its own", f"choose a target with --to ({known})"
        )
    return own
