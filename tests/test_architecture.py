"""The shape of the package holds (DESIGN.md §1): the import contract, and the lists that name the layouts
agree with the registry."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ckptctl.layouts import layout_names
from scripts.check_imports import PACKAGE, check

README = Path(__file__).resolve().parents[1] / "README.md"


def _plant(package: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (package / rel).parent.mkdir(parents=True, exist_ok=True)
        (package / rel).write_text(text)


@pytest.mark.long
def test_the_package_keeps_its_import_contract() -> None:
    assert [str(v) for v in check()] == []


def test_the_contract_catches_each_kind_of_break(tmp_path: Path) -> None:
    """A planted import of each forbidden kind is found (the check can fail)."""
    package = tmp_path / "ckptctl"
    files = {
        "frameworks/a/layout.py": "from ckptctl.frameworks.b import layout\nfrom ckptctl.frameworks.a import x\n",
        "frameworks/b/layout.py": "from ckptctl import families\n",
        "core/manager.py": "def f():\n    from ckptctl.frameworks.a.layout import X\n",
        "contract/base.py": "import ckptctl.frameworks.a.layout\n",
        "formats/dcp.py": "from ckptctl import ops\n",
        "ops/listing.py": "from ckptctl.layouts import scan_run\nfrom ckptctl.formats import dcp\n",
        "families/zero_tag.py": "from ckptctl.contract.base import Layout\nfrom ckptctl.layouts import get_layout\n",
        "families/dcp_folder.py": "def f():\n    from ckptctl.frameworks.dcp import layout\n",
        "contract/capabilities.py": "from ckptctl.families.value_head import HeadTask\n",
    }
    _plant(package, files)

    found = {(v.module, v.imported) for v in check(package)}

    assert found == {
        ("ckptctl.frameworks.a.layout", "ckptctl.frameworks.b.layout"),
        ("ckptctl.core.manager", "ckptctl.frameworks.a.layout.X"),
        ("ckptctl.contract.base", "ckptctl.frameworks.a.layout"),
        ("ckptctl.formats.dcp", "ckptctl.ops"),
        ("ckptctl.families.zero_tag", "ckptctl.layouts.get_layout"),
        ("ckptctl.families.dcp_folder", "ckptctl.frameworks.dcp.layout"),
        ("ckptctl.contract.capabilities", "ckptctl.families.value_head.HeadTask"),
    }


def test_the_contract_finds_every_import_cycle_also_those_a_function_or_type_check_hides(tmp_path: Path) -> None:
    """A cycle through a package's face, one a function-level import hides at run time and one of type hints
    are found, each once; a package importing its modules, which import each other, is none."""
    package = tmp_path / "ckptctl"
    files = {
        "io/__init__.py": "from ckptctl.io.failures import call\nRETRY = 1\n",
        "io/failures.py": "from ckptctl import io as _package\n",
        "frameworks/a/layout.py": "def profile():\n    from ckptctl.frameworks.a.resume import PROFILE\n",
        "frameworks/a/resume.py": "from ckptctl.frameworks.a.universal import host\n",
        "frameworks/a/universal.py": "from ckptctl.frameworks.a import layout\n",
        "contract/base.py": "from ckptctl.contract.load_set import LoadMember\n",
        "contract/load_set.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ckptctl.contract.base import Layout\n",
        "core/__init__.py": "from ckptctl.core.loading import restore\n",
        "core/loading.py": "from ckptctl.core import rng\nfrom ckptctl.core.entries import kind_of\n",
        "core/rng.py": "from ckptctl.core.entries import kind_of\n",
        "core/entries.py": "",
    }
    _plant(package, files)

    found = [v.rule for v in check(package)]

    assert found == [
        "import cycle: ckptctl.contract.base -> ckptctl.contract.load_set -> ckptctl.contract.base",
        "import cycle: ckptctl.frameworks.a.layout -> ckptctl.frameworks.a.resume -> ckptctl.frameworks.a.universal"
        " -> ckptctl.frameworks.a.layout",
        "import cycle: ckptctl.io -> ckptctl.io.failures -> ckptctl.io",
    ]


def test_the_real_package_is_what_the_contract_reads() -> None:
    assert (PACKAGE / "frameworks").is_dir() and len(list(PACKAGE.rglob("*.py"))) > 100


def _readme_layouts() -> list[str]:
    text = README.read_text()
    table = text[text.index("## What it reads") :].split("\n\n")[1]
    return [m.group(1) for m in re.finditer(r"^\| `([a-z_]+)` \|", table, re.MULTILINE)]


def test_the_readme_lists_every_registered_layout_once_in_registry_order() -> None:
    assert _readme_layouts() == list(layout_names())
