"""`python -m tests.faults.matrix [PYTEST ARGS...]`: run the fault matrix's tests and print the matrix as markdown.

Per framework and fault: `caught / tried`, where tried counts the cells whose damage the framework's own load
suffers from (it fails or loses state) and caught those where `ckptctl verify` exits non-zero naming the file;
beside them the flips no checksum can see without a manifest, the damage the load does not notice (and how
often verify flags it anyway), and the gaps (THE RULE broken: the known gaps of known_gaps.txt).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from tests.faults.cells import FAULTS
from tests.faults.harness import ROWS_ENV

REPO = Path(__file__).resolve().parents[2]


def table(rows: list[dict[str, object]]) -> str:
    """The markdown matrix of the rows the tests wrote."""
    counts: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    gaps = []
    for row in rows:
        counts[(str(row["framework"]), str(row["fault"]))][str(row["judgement"])] += 1
        if row["judgement"] == "gap":
            gaps.append(
                f"- {row['framework']} `{row['file']}` {row['fault']}: load {row['loader']}; verify exit {row['verify_exit']}"
            )
    lines = [
        "| framework | fault | caught / tried | warned (the load warns too) | undetectable without digests "
        "| harmless (verify flags) | gaps |",
        "|---|---|---|---|---|---|---|",
    ]
    frameworks = list(dict.fromkeys(str(r["framework"]) for r in rows))
    for framework in frameworks:
        for fault in FAULTS:
            c = counts.get((framework, fault))
            if not c:
                continue
            tried = c["caught"] + c["gap"] + c["warned"] + c["undetectable without digests"]
            harmless = c["harmless"] + c["false alarm"]
            lines.append(
                f"| {framework} | {fault} | {c['caught']} / {tried} | {c['warned']} | {c['undetectable without digests']} "
                f"| {harmless} ({c['false alarm']}) | {c['gap']} |"
            )
    return "\n".join(lines + (["", *gaps] if gaps else []))


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "rows.jsonl"
        target.touch()
        env = {**os.environ, ROWS_ENV: str(target), "PYTHONPATH": str(REPO)}
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/faults", *argv]
        done = subprocess.run(command, cwd=REPO, env=env, stdout=sys.stderr, check=False)
        rows = [json.loads(line) for line in target.read_text().splitlines()]
    print(table(rows))
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
