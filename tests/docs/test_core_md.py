"""The Python examples of docs/core.md run as written: blocks in order, one namespace, in a temporary folder.

A block preceded by `<!-- docs-test: syntax-only -->` is only compiled (the multi-rank example needs
`torchrun`); one preceded by `<!-- docs-test: s3 -->` runs against the local S3 server, whose endpoint
and credentials reach ckptctl through the standard AWS variables, like a user's would.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "core.md"
_BLOCK = re.compile(r"(?:<!-- docs-test: (?P<mode>[a-z0-9-]+) -->\n)?```python\n(?P<code>.*?)```", re.DOTALL)
#: The bucket the object storage example saves into.
DOCS_BUCKET = "ckptctl-docs"


def python_blocks(text: str) -> list[tuple[str, int, str]]:
    """(mode, line number, code) of every ```python block; mode is `run` unless a marker says otherwise."""
    return [(m["mode"] or "run", text[: m.start("code")].count("\n") + 1, m["code"]) for m in _BLOCK.finditer(text)]


def test_every_block_is_found() -> None:
    modes = [mode for mode, _, _ in python_blocks(DOC.read_text())]
    assert modes.count("run") >= 3 and "s3" in modes and "syntax-only" in modes
    assert set(modes) <= {"run", "s3", "syntax-only"}


def test_core_md_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "docs_core_md"}
    for mode, line, code in python_blocks(DOC.read_text()):
        compiled = compile(code, f"{DOC}:{line}", "exec")  # every block must at least compile
        if mode == "syntax-only":
            continue
        if mode == "s3":
            server = request.getfixturevalue("s3_server")
            fs = server.filesystem()
            if not fs.exists(DOCS_BUCKET):
                fs.mkdir(DOCS_BUCKET)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an example that warns is a bad example
            exec(compiled, namespace)
