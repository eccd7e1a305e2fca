"""The fault matrix's verify side and its rule, judged against the loaders' cached verdicts.

For each cell (`tests.faults.cells`) of one real writer's checkpoint, `ckptctl verify --json` runs in this
process (through `ckptctl.cli.app.main`, the real error boundary: exit code, JSON problems) on a damaged copy,
and the cell is judged against the framework's own verdict on the same damage:

- `caught`: the load failed or lost state, and verify exited non-zero with an error problem naming the file;
- `gap`: the load failed or lost state, and verify exited 0 or named another file (THE RULE broken);
- `undetectable without digests`: a flipped byte the load takes in silently, in a file with no checksum of its
  own (safetensors data, JSON, raw DCP bytes; not a torch.save zip, whose records carry CRC-32s), in a
  checkpoint without a ckptctl manifest; allowed, and proved caught (`digest_mismatch`) once
  `verify --write-manifest` has run on the undamaged checkpoint;
- `warned`: the load went on without a deleted file, with a note of its own, losing what it held (the
  Trainer's `rng_state.pth`: `Trainer._load_rng_state` logs that it found none), and verify exited 0 with a
  warning naming the file: DESIGN §4, "what the framework loads with only a warning is a warning";
- `harmless`: the load restored everything, and verify exited 0;
- `false alarm`: the load restored everything, and verify still exited non-zero (not against the rule: a
  damaged file the load does not read is still damage; counted so that the matrix shows it).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import posixpath
import re
import shutil
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.faults.cells import FAULTS, Cell, cells, damaged_copy, file_of, write_damaged

__all__ = [
    "KNOWN_GAPS",
    "Row",
    "VerifyOutcome",
    "damaged_copies",
    "known_gaps",
    "matrix_rows",
    "verify",
    "verify_each",
    "write_rows",
]

KNOWN_GAPS = Path(__file__).with_name("known_gaps.txt")
MANIFEST = "ckptctl-manifest.json"
#: Where `python -m tests.faults.matrix` asks the tests to write their rows (one JSON document per line).
ROWS_ENV = "CKPTCTL_FAULT_MATRIX_ROWS"


@dataclass(frozen=True)
class VerifyOutcome:
    """What `ckptctl verify --json` said: its exit code, its problems (kind, path, severity, message) and
    stderr; `bases`, where `verify_each` verified checkpoints inside the one of the matrix, the folder each
    problem's checkpoint is in it (its message names files relative to that folder)."""

    exit_code: int
    problems: tuple[tuple[str, str, str, str], ...]
    stderr: str
    bases: tuple[str, ...] = ()

    def names(self, file: str) -> bool:
        """An error problem names `file` of the checkpoint in its path, else in its message (some problems
        about a checkpoint's metadata carry no path; a message may name it relative to its problem's base);
        on exit 2 without problems, the error message does."""
        bases = self.bases or ("",) * len(self.problems)
        for (_, path, severity, message), base in zip(self.problems, bases, strict=True):
            local = file.removeprefix(base + "/") if base else file
            if severity == "error" and (_names(path, file) or _names(message, file) or _names(message, local)):
                return True
        return self.exit_code == 2 and not self.problems and _names(self.stderr, file)

    def warns(self, file: str) -> bool:
        """A warning names `file` as missing (the framework's load goes on without it, and says so)."""
        return any(
            kind == "missing_file" and severity == "warning" and _names(path, file)
            for kind, path, severity, _ in self.problems
        )


def _names(text: str, file: str) -> bool:
    """`text` is `file` (a path relative to the checkpoint) or names it after a slash, or alone as a word."""
    text = text.replace(os.sep, "/")
    if text == file or text.endswith("/" + file):
        return True
    return re.search(rf"(^|[/\s'\"`(]){re.escape(file)}($|[\s'\"`):,;])", text) is not None


def verify(path: Path, *extra: str) -> VerifyOutcome:
    """`ckptctl verify --json [EXTRA...] PATH` in this process."""
    from ckptctl.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(["verify", "--json", *extra, str(path)])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    problems: list[tuple[str, str, str, str]] = []
    with contextlib.suppress(json.JSONDecodeError):
        doc = json.loads(out.getvalue())
        for result in doc.get("results", [doc]):
            problems += [
                (p["kind"], p["path"] or "", p.get("severity", "error"), p.get("message", ""))
                for p in result.get("problems", [])
            ]
    return VerifyOutcome(code, tuple(problems), err.getvalue())


def verify_each(copy: Path, targets: Sequence[str], *extra: str) -> VerifyOutcome:
    """`verify` of each checkpoint `targets` names inside `copy` (relative paths; "" is the copy itself), as one
    outcome: the first non-zero exit (else 0), every problem with its path made relative to `copy` (AReaL's slot
    names `../../recover_info/step_info.json`: `recover_info/step_info.json` of the trial), stderr joined."""
    outcomes = [(target, verify(copy / target if target else copy, *extra)) for target in targets]
    problems = tuple(
        (kind, posixpath.normpath(posixpath.join(target, path)) if target and path else path, severity, message)
        for target, outcome in outcomes
        for kind, path, severity, message in outcome.problems
    )
    bases = tuple(target for target, outcome in outcomes for _ in outcome.problems)
    exit_code = next((o.exit_code for _, o in outcomes if o.exit_code != 0), 0)
    return VerifyOutcome(exit_code, problems, "".join(o.stderr for _, o in outcomes), bases)


@dataclass(frozen=True)
class Row:
    """One cell of one framework's matrix: the framework's verdict, verify's, and the judgement."""

    framework: str
    cell: Cell
    loader: str
    verify: VerifyOutcome
    judgement: str

    def to_json(self) -> dict[str, Any]:
        return {
            "framework": self.framework,
            "file": self.cell.file,
            "fault": self.cell.fault,
            "loader": self.loader,
            "verify_exit": self.verify.exit_code,
            "verify_problems": [list(p) for p in self.verify.problems],
            "judgement": self.judgement,
        }


def _is_zip(path: Path) -> bool:
    """A torch.save zip whose records' CRC-32s cover the whole file. Not a DCP data file (`.distcp`): it holds
    raw tensor bytes beside its torch.save items, and one may begin with such an item ("PK\x03\x04") while its
    CRC-32s cover that item only."""
    if path.suffix == ".distcp":
        return False
    with path.open("rb") as f:
        return f.read(4) == b"PK\x03\x04"


def judge(checkpoint: Path, cell: Cell, loader: str, outcome: VerifyOutcome) -> str:
    """The cell's judgement (see the module's doc)."""
    harmful = loader != "ok"
    if not harmful:
        return "harmless" if outcome.exit_code == 0 else "false alarm"
    if outcome.exit_code != 0 and outcome.names(cell.file):
        return "caught"
    if cell.fault == "delete" and loader.startswith("lost") and outcome.exit_code == 0 and outcome.warns(cell.file):
        return "warned"
    silent_flip = cell.fault == "flip" and loader.startswith("lost") and outcome.exit_code == 0
    if silent_flip and not (checkpoint / MANIFEST).exists() and not _is_zip(file_of(checkpoint, cell.file)):
        return "undetectable without digests"
    return "gap"


def matrix_rows(
    framework: str, checkpoint: Path, verdicts: Mapping[str, str], tmp: Path, targets: Sequence[str] = ("",)
) -> list[Row]:
    """Verify a damaged copy of `checkpoint` per cell (under `tmp`; the checkpoints `targets` names in it,
    `verify_each`) and judge it against `verdicts`."""
    if verdicts.get("reference") != "ok":
        raise AssertionError(f"{framework}: the framework's load of the undamaged copy: {verdicts.get('reference')}")
    rows = []
    for cell, copy in damaged_copies(checkpoint, tmp, cells(checkpoint)):
        outcome = verify_each(copy, targets)
        loader = verdicts[cell.id]
        rows.append(Row(framework, cell, loader, outcome, judge(checkpoint, cell, loader, outcome)))
    return rows


def damaged_copies(checkpoint: Path, tmp: Path, selected: Sequence[Cell]) -> Iterator[tuple[Cell, Path]]:
    """(cell, `tmp/cell-NNN/<checkpoint's name>`) for each cell in turn: the tree `damaged_copy` makes for it,
    each verified at a path of its own (`verify` keeps what it read of a file by its path, size and time).

    A folder's copy is linked once and moved from cell to cell, its one damaged file put back (a link to the
    original again) in between: a universal checkpoint holds a folder per parameter, and linking then removing
    its tree per cell cost more than verifying it (209 cells: ~14,000 links and ~5,000 folders each way)."""
    if checkpoint.is_file():  # a one-file checkpoint: its copy is the damaged file alone
        for i, cell in enumerate(selected):
            parent = tmp / f"cell-{i:03d}"
            yield cell, damaged_copy(checkpoint, parent, cell)
            shutil.rmtree(parent)
        return
    parent: Path | None = None
    for i, cell in enumerate(selected):
        here = tmp / f"cell-{i:03d}"
        if parent is None:
            damaged_copy(checkpoint, here, None)
        else:
            parent.rename(here)
        parent = here
        copy = here / checkpoint.name
        original, damaged = file_of(checkpoint, cell.file), file_of(copy, cell.file)
        damaged.unlink()  # a hard link to the writer's file: the damage goes into a new file
        write_damaged(original, damaged, cell.fault)
        yield cell, copy
        damaged.unlink(missing_ok=True)
        _link(original, damaged)
    if parent is not None:
        shutil.rmtree(parent)


def _link(src: Path, dst: Path) -> None:
    """`dst` as a hard link to `src`, as `damaged_copy` makes it (a copy on another file system)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def digest_proof(checkpoint: Path, cell: Cell, tmp: Path, targets: Sequence[str] = ("",)) -> VerifyOutcome:
    """verify on the undamaged checkpoint with `--write-manifest`, then the cell's damage, then verify."""
    copy = damaged_copy(checkpoint, tmp / "digests", None)
    written = verify_each(copy, targets, "--write-manifest")
    assert written.exit_code == 0, written
    target = file_of(copy, cell.file)
    original = tmp / "original"
    shutil.copyfile(target, original)
    target.unlink()  # a hard link to the writer's file: the damage goes into a new file
    write_damaged(original, target, cell.fault)
    return verify_each(copy, targets)


def known_gaps(framework: str) -> set[tuple[str, str]]:
    """The (file, fault) cells of `framework` listed in `known_gaps.txt` (`framework file fault` a line)."""
    found = set()
    for line in KNOWN_GAPS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, file, fault = line.split()
            assert fault in FAULTS, line
            if name == framework:
                found.add((file, fault))
    return found


def write_rows(rows: list[Row]) -> None:
    """Append the rows to the file `python -m tests.faults.matrix` named (nothing when it named none)."""
    target = os.environ.get(ROWS_ENV)
    if target:
        with open(target, "a") as f:
            f.writelines(json.dumps(row.to_json()) + "\n" for row in rows)


def assert_rule(
    framework: str, checkpoint: Path, verdicts: Mapping[str, str], tmp: Path, targets: Sequence[str] = ("",)
) -> list[Row]:
    """THE RULE on every cell of `checkpoint` (verified as the checkpoints `targets` names in it), the known
    gaps as a ratchet, and the digest proof of every flip no checksum can see; returns the rows."""
    rows = matrix_rows(framework, checkpoint, verdicts, tmp, targets)
    write_rows(rows)
    gaps = {(r.cell.file, r.cell.fault): r for r in rows if r.judgement == "gap"}
    known = known_gaps(framework)
    new = {k: f"framework: {r.loader}; verify exit {r.verify.exit_code} {r.verify.problems}" for k, r in gaps.items()}
    new = {k: v for k, v in new.items() if k not in known}
    fixed = known - gaps.keys()
    assert not new, f"{framework}: verify misses damage the framework's load suffers from: {new}"
    assert not fixed, f"{framework}: known gaps now caught (remove their lines from {KNOWN_GAPS.name}): {fixed}"
    for row in rows:
        if row.judgement == "undetectable without digests":
            proof = digest_proof(checkpoint, row.cell, tmp / f"proof-{row.cell.fault}", targets)
            shutil.rmtree(tmp / f"proof-{row.cell.fault}")
            kinds = {
                kind
                for kind, path, _, message in proof.problems
                if _names(path, row.cell.file) or _names(message, row.cell.file)
            }
            assert proof.exit_code == 1 and "digest_mismatch" in kinds, (row.cell, proof)
    return rows
