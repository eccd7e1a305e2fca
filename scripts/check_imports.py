"""The import contract of ckptctl (DESIGN.md §1), checked by `make lint` and by the suite.

Layers, from the top; a module imports from its own layer and those below it, never above:

    cli, demo, integrations          what people and training loops run
    ops                              the logic of each command (names no framework)
    core                             what a training loop imports (imports no framework package)
    frameworks                       one plugin per framework: imports `layouts` (the registry and the shared
                                     parts), never another framework package
    layouts                          registry, run walker, shared parts (imports no framework package: the
                                     registry names plugins by dotted strings and imports them lazily)
    formats                          file formats, no layout knowledge
    io                               every file access
    errors, units, checkpoint        the vocabulary every layer uses

Only static imports count (`import x`, `from x import y`, also inside functions): importing a plugin by its
dotted name through `importlib` is how the registry is meant to reach the frameworks.

Usage: `python -m scripts.check_imports` (exit 1 and one line per broken rule).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ckptctl"

#: Each top-level part of the package and its layer (a higher number is a higher layer).
LAYERS = {
    "errors": 0,
    "units": 0,
    "checkpoint": 0,
    "io": 1,
    "formats": 2,
    "layouts": 3,
    "frameworks": 4,
    "core": 5,
    "ops": 6,
    "cli": 7,
    "demo": 7,
    "integrations": 7,
    "__main__": 8,
}

#: Parts that must not import the plugins although they sit above them (they reach them through the registry).
NO_FRAMEWORKS = ("core", "ops", "cli", "demo", "integrations")


@dataclass(frozen=True, slots=True)
class Violation:
    module: str
    imported: str
    line: int
    rule: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line}: imports {self.imported}: {self.rule}"


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, package: Path) -> Iterator[tuple[str, int]]:
    """The ckptctl modules a file imports statically (`from ckptctl import io` counts as `ckptctl.io`)."""
    module = module_name(path, package)
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            for alias in node.names:
                yield f"{source}.{alias.name}", node.lineno  # a submodule, or a name in `source`


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _plugin(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "frameworks" else None


def check(package: Path = PACKAGE) -> list[Violation]:
    found = []
    for path in sorted(package.rglob("*.py")):
        module = module_name(path, package)
        part = _part(module)
        for imported, line in imports(path, package):
            if not imported.startswith("ckptctl.") or _part(imported) not in LAYERS or part not in LAYERS:
                continue
            target = _part(imported)
            if LAYERS[target] > LAYERS[part]:
                found.append(Violation(module, imported, line, f"{part} is below {target}"))
            elif target == "frameworks" and part in (*NO_FRAMEWORKS, "layouts"):
                found.append(Violation(module, imported, line, f"{part} reaches plugins only through the registry"))
            elif _plugin(module) and _plugin(imported) and _plugin(module) != _plugin(imported):
                found.append(
                    Violation(module, imported, line, "plugins never import each other (share a part in layouts)")
                )
    return found


def main() -> int:
    violations = check()
    for violation in violations:
        print(violation)
    if violations:
        print(f"{len(violations)} import(s) break the contract (scripts/check_imports.py)", file=sys.stderr)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
