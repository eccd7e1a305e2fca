"""The shape of the package holds (DESIGN.md §1): the import contract, and the lists that name the layouts
agree with the registry."""

from __future__ import annotations

import re
from pathlib import Path

from ckptctl.layouts import layout_names
from scripts.check_imports import PACKAGE, check

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_package_keeps_its_import_contract() -> None:
    assert [str(v) for v in check()] == []


def test_the_contract_catches_each_kind_of_break(tmp_path: Path) -> None:
    """A planted import of each forbidden kind is found (the check can fail)."""
    package = tmp_path / "ckptctl"
    files = {
        "frameworks/a/layout.py": "from ckptctl.frameworks.b import layout\nfrom ckptctl.frameworks.a import x\n",
        "frameworks/b/layout.py": "from ckptctl.layouts import parts\n",
        "core/manager.py": "def f():\n    from ckptctl.frameworks.a.layout import X\n",
        "layouts/base.py": "import ckptctl.frameworks.a.layout\n",
        "formats/dcp.py": "from ckptctl import ops\n",
        "ops/listing.py": "from ckptctl.layouts import scan_run\nfrom ckptctl.formats import dcp\n",
    }
    for rel, text in files.items():
        (package / rel).parent.mkdir(parents=True, exist_ok=True)
        (package / rel).write_text(text)

    found = {(v.module, v.imported) for v in check(package)}

    assert found == {
        ("ckptctl.frameworks.a.layout", "ckptctl.frameworks.b.layout"),
        ("ckptctl.core.manager", "ckptctl.frameworks.a.layout.X"),
        ("ckptctl.layouts.base", "ckptctl.frameworks.a.layout"),
        ("ckptctl.formats.dcp", "ckptctl.ops"),
    }


def test_the_real_package_is_what_the_contract_reads() -> None:
    assert (PACKAGE / "frameworks").is_dir() and len(list(PACKAGE.rglob("*.py"))) > 100


def _readme_layouts() -> list[str]:
    text = README.read_text()
    table = text[text.index("## What it reads") :].split("\n\n")[1]
    return [m.group(1) for m in re.finditer(r"^\| `([a-z_]+)` \|", table, re.MULTILINE)]


def test_the_readme_lists_every_registered_layout_once_in_registry_order() -> None:
    assert _readme_layouts() == list(layout_names())
