"""Names: which rank files a tag folder holds, which ones it lacks, and the save folder's `latest`
(no file is read but `latest`)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from ckptctl import io
from ckptctl.checkpoint import Problem, ProblemKind
from ckptctl.contract.base import LISTED_ABSENT
from ckptctl.errors import CkptctlError
from ckptctl.io import DirEntry

LATEST_NAME = "latest"
#: What `load_checkpoint` follows instead of `latest` with `"checkpoint": {"load_universal": true}`:
#: `ds_to_universal` writes the name of its output folder into it, beside that folder.
UNIVERSAL_LATEST_NAME = "latest_universal"
#: The folder of a universal checkpoint holding one folder of states per parameter.
UNIVERSAL_STATES_DIR = "zero"
#: The registry name of the layout of universal checkpoints (`frameworks.deepspeed.universal`), which the
#: resume rules of every framework built on DeepSpeed tell apart from its tags.
UNIVERSAL_LAYOUT = "deepspeed_universal"
#: The names of DeepSpeed's rank files (the one definition every module uses): model states, one per MP
#: rank under ZeRO 0-2 and one per DP and MP rank under ZeRO-3; optimizer states, one per DP and MP rank.
MODEL_STATES = re.compile(r"^(?:zero_pp_rank_(?P<dp>\d+)_)?mp_rank_(?P<mp>\d+)_model_states\.pt$")
OPTIM_STATES = re.compile(r"^(?P<bf16>bf16_)?zero_pp_rank_(?P<dp>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt$")
_MAX_LATEST_BYTES = 4096


@dataclass(frozen=True, slots=True)
class TagFiles:
    """The rank files of a tag folder, from its listing.

    Attributes:
        model: (DP rank, or None for the ZeRO 0-2 naming; MP rank) -> model-states file name.
        optim: (DP rank, MP rank) -> optim-states file name.
        sizes: file name -> size, for every file in the folder.
        bf16: whether the optim files carry the `bf16_` prefix.
    """

    model: dict[tuple[int | None, int], str]
    optim: dict[tuple[int, int], str]
    sizes: dict[str, int]
    bf16: bool

    @property
    def per_dp_model_files(self) -> bool:
        """Whether model states are saved per DP rank (`zero_pp_rank_*`: ZeRO-3)."""
        return any(dp is not None for dp, _ in self.model)

    def model_name(self, dp: int, mp: int) -> str:
        return (
            f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt" if self.per_dp_model_files else self.model_name_0(mp)
        )

    @staticmethod
    def model_name_0(mp: int) -> str:
        return f"mp_rank_{mp:02d}_model_states.pt"

    def optim_name(self, dp: int, mp: int) -> str:
        return f"{'bf16_' if self.bf16 else ''}zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt"

    def rank0_model(self, mp: int = 0) -> str | None:
        """The model-states file that holds the tag's metadata for an MP rank (DP rank 0)."""
        return self.model.get((0, mp)) or self.model.get((None, mp))

    def missing_from_names(self) -> list[str]:
        """Rank files the names of the others promise but the folder lacks (the first `LISTED_ABSENT`).

        MP ranks must run 0..max; DP ranks too, and under ZeRO-3 the model and optim files must cover the
        same DP ranks. A missing highest rank is only seen by `verify_tag`, which reads `dp_world_size`.
        """
        mps = {mp for _, mp in self.model} | {mp for _, mp in self.optim}
        mp_count = max(mps) + 1 if mps else 1
        dps = {dp for dp, _ in self.optim} | {dp for dp, _ in self.model if dp is not None}
        dp_count = max(dps) + 1 if dps else 0

        def expected() -> Iterator[str]:
            for mp in range(mp_count):
                if self.per_dp_model_files:
                    yield from (self.model_name(dp, mp) for dp in range(max(dp_count, 1)))
                else:
                    yield self.model_name_0(mp)
                if self.optim or self.per_dp_model_files:
                    yield from (self.optim_name(dp, mp) for dp in range(max(dp_count, 1)))

        # The first few only: one stray `zero_pp_rank_99999999_...` name would otherwise promise (and make
        # us list) a hundred million files.
        return list(itertools.islice((name for name in expected() if name not in self.sizes), LISTED_ABSENT))


def expected_rank_files(
    files: TagFiles, dp_world_size: int, mp_world_size: int, zero_stage: int
) -> tuple[set[str], set[str]]:
    """The model- and optim-states file names a tag saved by `dp_world_size` x `mp_world_size` ranks holds:
    one model-states file per MP rank (per DP and MP rank under ZeRO-3), and one optim-states file per DP
    and MP rank when the tag has any or ZeRO partitioned the optimizer."""
    model = {
        files.model_name(dp, mp) if files.per_dp_model_files else files.model_name_0(mp)
        for mp in range(mp_world_size)
        for dp in range(dp_world_size)
    }
    optim = (
        {files.optim_name(dp, mp) for mp in range(mp_world_size) for dp in range(dp_world_size)}
        if files.optim or zero_stage >= 1
        else set()
    )
    return model, optim


def missing_note(missing: Sequence[str]) -> str:
    """The note of a tag that lacks rank files (the first few named)."""
    return f"missing {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}" if missing else ""


def is_universal(entries: Sequence[DirEntry]) -> bool:
    """Whether a folder listing is a universal checkpoint's (what `ds_to_universal` writes): model-states
    files beside a `zero/` folder of parameter states, and no optim-states files. A tag never holds `zero/`."""
    files = tag_files(entries)
    return files is not None and not files.optim and any(e.name == UNIVERSAL_STATES_DIR and e.is_dir for e in entries)


def is_rank_file(path: str) -> bool:
    """Whether the file at `path` (`/`-separated, any folder) is a DeepSpeed model- or optim-states file."""
    name = path.rpartition("/")[2]
    return MODEL_STATES.match(name) is not None or OPTIM_STATES.match(name) is not None


def tag_files(entries: Sequence[DirEntry]) -> TagFiles | None:
    """The rank files of a folder listing, or None when it holds no DeepSpeed model or optim states."""
    model: dict[tuple[int | None, int], str] = {}
    optim: dict[tuple[int, int], str] = {}
    sizes = {}
    bf16 = False
    for entry in entries:
        if entry.is_dir:
            continue
        sizes[entry.name] = entry.size
        if m := MODEL_STATES.match(entry.name):
            model[(None if m.group("dp") is None else int(m.group("dp")), int(m.group("mp")))] = entry.name
        elif m := OPTIM_STATES.match(entry.name):
            optim[(int(m.group("dp")), int(m.group("mp")))] = entry.name
            bf16 = bf16 or m.group("bf16") is not None
    if not model and not optim:
        return None
    return TagFiles(model, optim, sizes, bf16)


def tag_markers(files: Mapping[str, int]) -> tuple[str, ...]:
    """The rank-0 model states of each MP rank of a tag folder (its top-level files: name -> size): without
    one, the names of the other rank files show the tag broken (and without any, it is no tag at all)."""
    found = tag_files([DirEntry(name, False, size, 0.0) for name, size in files.items() if "/" not in name])
    if found is None:
        return ()
    ranks = sorted({mp for _, mp in found.model})
    return tuple(name for mp in ranks if (name := found.rank0_model(mp)) is not None)


def read_latest(url: str, entries: Sequence[DirEntry], pointer: str = LATEST_NAME) -> str | None:
    """The tag a save folder's `latest` file (or another `pointer` file) names (None when there is no
    readable one)."""
    entry = next((e for e in entries if e.name == pointer and not e.is_dir), None)
    if entry is None or entry.size > _MAX_LATEST_BYTES:
        return None
    try:
        text = io.read_bytes(io.join(url, pointer), max_size=_MAX_LATEST_BYTES).decode("utf-8").strip()
    except (CkptctlError, UnicodeDecodeError):
        return None
    return text if text and "/" not in text and "\n" not in text else None


def latest_problem(save_dir: str, path: str, pointer: str = LATEST_NAME) -> Problem | None:
    """A problem when `save_dir/latest` (or another `pointer` file) names a tag folder that does not exist
    (a resume would fail)."""
    try:
        entries = io.list_dir(save_dir)
    except CkptctlError:
        return None
    if not any(e.name == pointer and not e.is_dir for e in entries):
        return None
    tag = read_latest(save_dir, entries, pointer)
    if tag is None:
        return Problem(ProblemKind.BAD_METADATA, path, f"{path} does not name a tag")
    if not any(e.name == tag and e.is_dir for e in entries):
        return Problem(
            ProblemKind.MISSING_FILE,
            path,
            f"{path} names tag {tag!r}, which does not exist: a resume that follows it fails "
            "(write the tag to resume from into it)",
        )
    return None
