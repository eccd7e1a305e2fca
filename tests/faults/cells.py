"""The cells of the fault matrix, and the frameworks' own verdicts on them (the loader side).

A cell is one file of one real writer's checkpoint damaged one way: deleted, truncated to half its size, or
one byte in its middle flipped (files of 4 KiB or more: a flip in a tiny JSON file says little). Each damaged
copy is the checkpoint's folder under its own name in a folder of its own, every undamaged file a hard link
to the original (a cheap copy; neither the loaders nor `verify` write to them, and the session's check of the
cache would fail if one did).

`loader_verdicts` runs one framework's loader (the module `tests.faults.loaders.NAME` as `python -m` runs it, in a
process of its own forked from the writers' server that has imported torch: `tests.writers.ranks`; it imports
the framework once and loads the undamaged copy, then every damaged one) and returns its verdict per cell:
`ok` (every tensor and value the reference load restored is restored equal), `failed: <exception>` or
`lost: <what>` (it loaded, but some saved state is missing or different, or it warned about it).

This module does not import ckptctl: the loaders' verdicts are cached per machine by
`tests.conftest.build_once`, keyed by the code they reach, and ckptctl's own changes must not rebuild them.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.writers.ranks import run_ranks

__all__ = ["FAULTS", "FLIP_MIN_BYTES", "Cell", "cells", "damaged_copy", "loader_verdicts", "write_damaged"]

FAULTS = ("delete", "truncate", "flip")
FLIP_MIN_BYTES = 4096
REPO = Path(__file__).resolve().parents[2]


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
    for path in sorted(p for p in checkpoint.rglob("*") if p.is_file() and not p.is_symlink()):
        rel = path.relative_to(checkpoint).as_posix()
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
            try:
                os.link(src, dst)
            except OSError:  # another file system
                shutil.copy2(src, dst)
    target.mkdir(parents=True, exist_ok=True)
    return target


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
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        environment = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
        run_ranks(_loader_process, (loader, str(Path(tmp) / "spec.json")), 1, environment=environment)
        out = Path(spec["out"])  # type: ignore[arg-type]
        if not out.exists():
            raise RuntimeError(f"{loader} wrote no verdicts")
        verdicts: dict[str, str] = json.loads(out.read_text())
    return verdicts


def _loader_process(_rank: int, loader: str, spec: str) -> None:
    """The loader process: `python -m LOADER SPEC` (its `main()`, else `run(load)`), forked from the writers'
    pre-imported server (`tests.writers.ranks`) rather than a fresh interpreter importing torch again."""
    import importlib

    import torch

    from tests.faults.loaders.common import run

    torch.set_num_threads(1)  # OMP_NUM_THREADS=1, as the loaders ran before: tiny loads, no thread pool
    sys.argv = [loader, spec]
    module = importlib.import_module(loader)
    main = getattr(module, "main", None)
    if main is not None:
        main()
    else:
        run(module.load)
