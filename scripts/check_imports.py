"""The import contract of ckptctl (DESIGN.md §1), checked by `make lint` and by the suite.

Layers, from the top; a module imports from its own layer and those below it, never above:

    cli, demo, integrations          what people and training loops run
    ops                              the logic of each command (names no framework)
    core                             what a training loop imports (imports no framework package)
    frameworks                       one plugin per framework: imports `layouts`, `families` and `contract`,
                                     never another framework package
    layouts                          registry, run scan and walker, generic reader (imports no framework
                                     package: the registry names plugins by dotted strings, imports them lazily)
    families                         the format-family readers plugins share (DCP folder, HF folder, ZeRO tag,
                                     LoRA): never the registry, never a plugin
    contract                         what a reader is and may provide (`Layout`, capabilities, load set,
                                     resume profile, naming), which the readers above subclass and fill
    formats                          file formats, no layout knowledge
    io                               every file access
    errors, units, checkpoint,       the vocabulary every layer uses
    quoting, version

And no module reaches itself through others (no import cycle, also inside a layer): a cycle that a
function-level import hides at run time is still one knot that cannot be read, tested or moved in parts.

Only static imports count (`import x`, `from x import y`, also inside functions and under `TYPE_CHECKING`):
importing a plugin by its dotted name through `importlib` is how the registry is meant to reach the
frameworks.

Usage: `python -m scripts.check_imports` (exit 1 and one line per broken rule).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ckptctl"

#: Each top-level part of the package and its layer (a higher number is a higher layer).
LAYERS = {
    "errors": 0,
    "units": 0,
    "checkpoint": 0,
    "quoting": 0,
    "version": 0,
    "io": 1,
    "formats": 2,
    "contract": 3,
    "families": 4,
    "layouts": 5,
    "frameworks": 6,
    "core": 7,
    "ops": 8,
    "cli": 9,
    "demo": 9,
    "integrations": 9,
    "__main__": 10,
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
            elif target == "frameworks" and part in (*NO_FRAMEWORKS, "layouts", "families", "contract"):
                found.append(Violation(module, imported, line, f"{part} reaches plugins only through the registry"))
            elif _plugin(module) and _plugin(imported) and _plugin(module) != _plugin(imported):
                found.append(
                    Violation(module, imported, line, "plugins never import each other (share a reader in families)")
                )
    return found + cycle_violations(package)


def import_graph(package: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """Module -> the ckptctl modules it imports, each with the line of its first import.

    An import names the module whose names it takes: `from ckptctl.io import DirEntry` the package
    `ckptctl.io`, `from ckptctl.core import rng` the module `ckptctl.core.rng`. That importing `a.b` first
    runs `a/__init__.py` does not count: otherwise a package that imports its own modules would be a cycle
    with every one of them that imports a sibling.
    """
    paths = {module_name(path, package): path for path in sorted(package.rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for module, path in paths.items():
        edges = graph.setdefault(module, {})
        for imported, line in imports(path, package):
            target = imported
            while target and target not in paths:
                target = target.rpartition(".")[0]
            if target and target != module:
                edges[target] = min(edges.get(target, line), line)
    return graph


def cycles(graph: Mapping[str, Mapping[str, int]]) -> list[list[str]]:
    """One shortest cycle through the first module (by name) of each group of modules that import each other
    (a strongly connected component of more than one module), as the modules along it."""
    found = []
    for component in _components(graph):
        start = min(component)
        paths = {start: [start]}
        queue = [start]
        while queue:  # breadth first, inside the component: the first way back to `start` is a shortest one
            module = queue.pop(0)
            for target in sorted(graph[module]):
                if target == start:
                    found.append(paths[module])
                    queue = []
                    break
                if target in component and target not in paths:
                    paths[target] = [*paths[module], target]
                    queue.append(target)
    return sorted(found)


def _components(graph: Mapping[str, Mapping[str, int]]) -> list[set[str]]:
    """Tarjan's strongly connected components of more than one module, without recursion."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, {})))))
                elif target in on_stack:
                    low[module] = min(low[module], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == module:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def cycle_violations(package: Path = PACKAGE) -> list[Violation]:
    """One violation per import cycle, at the import that closes it back to the first module."""
    graph = import_graph(package)
    found = []
    for cycle in cycles(graph):
        closing = graph[cycle[-1]][cycle[0]]
        loop = " -> ".join([*cycle, cycle[0]])
        found.append(Violation(cycle[-1], cycle[0], closing, f"import cycle: {loop}"))
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
