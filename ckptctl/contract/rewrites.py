"""The capabilities that change a run's files in place (DESIGN §4): `repair`'s `PointerWriter` (the pointers a
framework's loader reads) and `slim`'s `Slimmer` (what of a checkpoint is training-only state, and what to write
instead). `ops.repair` and `ops.slim` plan, check and apply; these only say what. `contract.capabilities` types
their slots."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ckptctl.checkpoint import Checkpoint, Problem
from ckptctl.errors import CkptctlError


@dataclass(frozen=True, slots=True)
class Pointer:
    """A file the framework's loader reads to choose what it resumes from, and what it must hold for the
    loader to resume from one checkpoint (`PointerWriter.pointers`).

    Attributes:
        path: the pointer file (DeepSpeed's `latest`, Megatron's and verl's tracker).
        content: its whole content, as the framework itself writes it (`global_step2`, `2`); for a link, its
            target, as the framework makes it (a name in the same folder).
        link: the pointer is a symbolic link the framework itself makes (Lightning's `last.ckpt` with
            `save_last="link"`), rewritten as a link; a file where a link is expected is refused.
    """

    path: str
    content: str
    link: bool = False


class PointerWriter(Protocol):
    """`repair`: the smallest change this framework's own loader honours that makes it resume from a given
    checkpoint of its run (DESIGN §4 `repair`): the pointers it reads rewritten, or, where it picks by name
    (the highest `checkpoint-N`), the newer entries it would pick out of its way. `ops.repair` plans, checks
    and applies the change (atomic pointer writes, quarantine inside the run); the writer only says what.
    """

    def roles(self, checkpoint: str) -> tuple[str, ...]:
        """Every checkpoint a resume from the checkpoint folder `checkpoint` loads, itself first: the other roles
        the framework saves at the same step (OpenRLHF's critic tag beside the actor's). A resume lands on a
        step only when every one of them verifies."""
        ...

    def pointers(self, checkpoint: str) -> tuple[Pointer, ...]:
        """The pointers to write, and what each must hold, for the loader to resume from `checkpoint` (every
        role's); () for a framework that keeps none."""
        ...

    def picked_over(self, checkpoint: str) -> tuple[str, ...]:
        """Entries (folders or files) that the loader, picking by name, would take instead of `checkpoint`:
        `repair` moves them into quarantine; () for a framework that follows its pointers."""
        ...

    def refusal(self, checkpoint: str) -> str | None:
        """Why no change of this framework's files makes its loader resume from `checkpoint`, with what to do
        instead (AReaL's `recover_info/` describing a dump that is gone; a copied `last.ckpt`); None when the
        writer's change does."""
        ...


@dataclass(frozen=True, slots=True)
class SlimRewrite:
    """A file the slim version of a checkpoint gets anew (a manifest without the dropped entries, the model
    that lived in the dropped files written as a model file).

    Attributes:
        path: where, relative to the checkpoint folder (`/` separated); it may replace a file of the same name.
        write: `write(local_path)` writes it there (the folder exists; `slim` fsyncs it afterwards).
    """

    path: str
    write: Callable[[str], None] = field(repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class SlimRecipe:
    """What a `Slimmer` drops from one checkpoint and what it writes instead; every other file is kept as is
    (hard-linked into the slim version).

    Attributes:
        drop: files dropped, relative to the checkpoint folder (`/` separated).
        dropped: what they held, for people and the JSON report (`optimizer`, `scheduler`, `rng`).
        rewrites: files written anew.
        shed_bytes: how much smaller the rewritten files are than the files of the same names they replace
            (a DCP data file keeping only its model items), for the plan's bytes freed.
    """

    drop: tuple[str, ...]
    dropped: tuple[str, ...]
    rewrites: tuple[SlimRewrite, ...] = ()
    shed_bytes: int = 0


@runtime_checkable
class Slimmer(Protocol):
    """`slim`: what of this framework's checkpoints is training-only state (optimizer moments and partitions,
    schedulers, RNG: what only a resume needs), keeping the model where the framework keeps it so that
    `convert` of the slim checkpoint writes what it wrote before (DESIGN §4 `slim`). `ops.slim` builds the
    slim version beside the checkpoint and swaps it in; the slimmer only decides and writes new files."""

    def refusal(self, checkpoint: Checkpoint) -> str | None:
        """Why this checkpoint cannot be slimmed safely (a part the slimmer does not know how to cut, a model
        that lives in the training state and cannot be written apart yet), or None when it can. Reads
        metadata only."""
        ...

    def recipe(self, checkpoint: Checkpoint) -> SlimRecipe:
        """What to drop and write. Reads metadata only; the rewrites read tensor data when they run."""
        ...

    def expected(self, problem: Problem) -> bool:
        """Whether a problem this framework's reader reports about a slim checkpoint is what the drop explains,
        beyond problems naming a dropped file (those `verify` leaves out anyway): a rank file it expects
        under a name other than the one dropped."""
        ...


class OneLookSlimmer:
    """A `Slimmer` whose refusal and recipe come from one look at the checkpoint: `decide` gives the recipe or
    why there is none. Subclasses override `decide`, and `expected` where their reader reports what the drop
    explains."""

    def decide(self, checkpoint: Checkpoint) -> SlimRecipe | str:
        """The recipe for this checkpoint, or why it cannot be slimmed safely (reads metadata only)."""
        raise NotImplementedError

    def refusal(self, checkpoint: Checkpoint) -> str | None:
        found = self.decide(checkpoint)
        return found if isinstance(found, str) else None

    def recipe(self, checkpoint: Checkpoint) -> SlimRecipe:
        found = self.decide(checkpoint)
        if isinstance(found, str):
            raise CkptctlError(f"{checkpoint.url} cannot be slimmed: {found}")
        return found

    def expected(self, problem: Problem) -> bool:
        return False
