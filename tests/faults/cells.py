"""The cells of the fault matrix, and the frameworks' own verdicts on them (the loader side).

A cell is one file of one real writer's checkpoint damaged one way: deleted, truncated to half its size, or
one byte in its middle flipped (files of 4 KiB or more: a flip in a tiny JSON file says little). Each damaged
copy is the checkpoint's folder under its own name in a folder of its own, every undamaged file a hard link
to the original (a cheap copy; neither the loaders nor `verify` write to them, and the session's check of the
cache would fail if one did).

`loader_verdicts` runs one framework's loader (the module `tests.faults.loaders.NAME` as `python -m` runs it, in a
process of its own forked from the writers' server that has imported torch: `tests.writers.ranks`; a framework
that loads on several ranks has them forked likewise by `tests.faults.loaders.ranks`; it imports the framework
once and loads the undamaged copy, then every damaged one) and returns its verdict per cell:
`ok` (every tensor and value the reference load restored is restored equal), `failed: <exception>` or
`lost: <what>` (it loaded, but some saved state is missing or different, or it warned about it).

This module does not import ckptctl: the loaders' verdicts are cached per machine by
`tests.conftest.build_once`, keyed by the code they reach, and ckptctl's own changes must not rebuild them.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.faults.loaders import ranks
from tests.writers.ranks import run_ranks

__all__ = [
    "FAULTS",
    "FLIP_MIN_BYTES",
    "LOADER_ENVIRONMENT",
    "Cell",
    "cells",
    "damaged_copy",
    "file_of",
    "loader_verdicts",
    "member",
    "run_loader",
    "write_damaged",
]

FAULTS = ("delete", "truncate", "flip")
FLIP_MIN_BYTES = 4096


@dataclass(frozen=True, order=True)
class Cell:
    """One file of a checkpoint (its path relative to the checkpoint folder) and one fault."""

    file: str
    fault: str

    @property
    def id(self) -> str:
        return f"{self.fault}:{self.file}"


def cells(checkpoint: Path) -> list[Cell]:
    """Every cell of the checkpoint folder: each regular file (links are left alone) deleted, truncated to
    half (when it has bytes) and flipped (when it has `FLIP_MIN_BYTES` or more)."""
    found = []
    if checkpoint.is_file():  # a one-file checkpoint (Lightning's `.ckpt`): its cells are named by its name
        paths = [checkpoint]
    else:
        paths = sorted(p for p in checkpoint.rglob("*") if p.is_file() and not p.is_symlink())
    for path in paths:
        rel = member(checkpoint, path)
        size = path.stat().st_size
        found.append(Cell(rel, "delete"))
        if size:
            found.append(Cell(rel, "truncate"))
        if size >= FLIP_MIN_BYTES:
            found.append(Cell(rel, "flip"))
    return found


def damaged_copy(checkpoint: Path, parent: Path, cell: Cell | None) -> Path:
    """`parent/<checkpoint's name>`: the checkpoint with `cell`'s damage (none for the reference copy)."""
    target = parent / checkpoint.name
    if checkpoint.is_file():
        parent.mkdir(parents=True, exist_ok=True)
        if cell is not None:
            write_damaged(checkpoint, target, cell.fault)
        else:
            _link(checkpoint, target)
        return target
    for src in sorted(checkpoint.rglob("*")):
        dst = target / src.relative_to(checkpoint)
        if src.is_dir() and not src.is_symlink():
            dst.mkdir(parents=True, exist_ok=True)
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        rel = src.relative_to(checkpoint).as_posix()
        if cell is not None and rel == cell.file:
            write_damaged(src, dst, cell.fault)
        elif src.is_symlink():
            os.symlink(os.readlink(src), dst)
        else:
            _link(src, dst)
    target.mkdir(parents=True, exist_ok=True)
    return target


def member(checkpoint: Path, path: Path) -> str:
    """The name of the checkpoint's file `path` in a cell: relative to the checkpoint folder, or the one-file
    checkpoint's own name."""
    return checkpoint.name if path == checkpoint else path.relative_to(checkpoint).as_posix()


def file_of(checkpoint: Path, file: str) -> Path:
    """The checkpoint's file a cell names (`member`'s inverse)."""
    return checkpoint if checkpoint.is_file() else checkpoint / file


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system
        shutil.copy2(src, dst)


def write_damaged(src: Path, dst: Path, fault: str) -> None:
    if fault == "delete":
        return
    data = bytearray(src.read_bytes())
    if fault == "truncate":
        data = data[: len(data) // 2]
    elif fault == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        raise ValueError(fault)
    dst.write_bytes(bytes(data))


@dataclass(frozen=True)
class CellCopies:
    """The reference copy and one damaged copy per cell, under one temporary folder."""

    reference: Path
    copies: dict[Cell, Path]


def make_copies(checkpoint: Path, root: Path, selected: list[Cell]) -> CellCopies:
    """A reference copy and a damaged copy of `checkpoint` per cell, each in a numbered folder under `root`."""
    reference = damaged_copy(checkpoint, root / "reference", None)
    copies = {cell: damaged_copy(checkpoint, root / f"cell-{i:03d}", cell) for i, cell in enumerate(selected)}
    return CellCopies(reference, copies)


def loader_verdicts(loader: str, checkpoint: Path, **options: object) -> dict[str, str]:
    """Run the loader module `loader` (`tests.faults.loaders.NAME`) on every cell of `checkpoint`: its verdict
    by `Cell.id`, and `reference` (the undamaged copy's load: `ok`, else the matrix cannot be judged)."""
    selected = cells(checkpoint)
    with tempfile.TemporaryDirectory(prefix="ckptctl-faults-") as tmp:
        copies = make_copies(checkpoint, Path(tmp), selected)
        spec = {
            "reference": str(copies.reference),
            "cells": [{"id": cell.id, "path": str(path)} for cell, path in copies.copies.items()],
            "options": options,
            "out": str(Path(tmp) / "verdicts.json"),
        }
        module = importlib.import_module(loader)
        if hasattr(module, "join"):  # its framework loads on several ranks: `tests.faults.loaders.ranks`
            spec_path = Path(tmp) / "spec.json"
            spec_path.write_text(json.dumps(spec))
            ranks.run_ranks(loader, module.WORLD, str(spec_path), LOADER_ENVIRONMENT)
            verdicts: dict[str, str] = json.loads(Path(spec["out"]).read_text())  # type: ignore[arg-type]
        else:
            verdicts = run_loader(_loader_process, (loader,), 1, spec, Path(tmp))
    return verdicts


#: The loaders' settings beside the test process's environment: offline, quiet, one thread per rank.
LOADER_ENVIRONMENT = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
}


def run_loader(
    fn: Callable[..., None], args: tuple[Any, ...], nprocs: int, spec: dict[str, Any], tmp: Path, **environment: str
) -> Any:
    """`fn(rank, SPEC_FILE, *args)` on `nprocs` ranks forked from the writers' pre-imported server
    (`tests.writers.ranks.run_ranks`: each imports its framework itself, as a fresh interpreter would) on `spec`
    written into `tmp`, with `LOADER_ENVIRONMENT` and `environment` added to this process's environment; what
    the ranks wrote to `spec["out"]`, parsed."""
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    run_ranks(fn, (str(spec_path), *args), nprocs, environment={**LOADER_ENVIRONMENT, **environment})
    out = Path(spec["out"])
    if not out.exists():
        raise RuntimeError(f"{fn.__module__} wrote no verdicts")
    return json.loads(out.read_text())


def _loader_process(_rank: int, spec: str, loader: str) -> None:
    """A single-process loader (`python -m LOADER SPEC`: its `main()`, else `run(load)`) forked from the writers'
    pre-imported server rather than a fresh interpreter importing torch again."""
    import torch

    from tests.faults.loaders.common import run

    torch.set_num_threads(1)  # OMP_NUM_THREADS=1 is read when torch starts: the server has started it
    sys.argv = [loader, spec]
    module = importlib.import_module(loader)
    main = getattr(module, "main", None)
    if main is not None:
        main()
    else:
        run(module.load)
