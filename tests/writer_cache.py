"""The writers' outputs kept between test runs: each slow writer runs once per machine, not once per run.

What a writer wrote depends on its code, the frameworks' versions and torch's, not on the run. So
`tests.conftest.build_once` asks this cache for an entry under a key made of those, builds it on a miss, and
hands every later run (every xdist worker, every checkout on the machine) the same folder:

- The key: a SHA-256 of the build function's source and the files of every project module it reaches (its
  module and, transitively, the `tests`/`ckptctl` modules those import or run as `python -m NAME`), the
  versions of the distributions those modules import (importlib.metadata), Python's and torch's versions,
  and the data the build is handed (another entry's paths). A changed writer or helper rebuilds the
  entries that reach it; a fresh clone (or machine) builds them all.
- Where: `$CKPTCTL_TEST_CACHE`, else `$XDG_CACHE_HOME/ckptctl-tests`, else `~/.cache/ckptctl-tests`;
  `CKPTCTL_TEST_CACHE=off` builds into the run's temp folder, as before the cache. Deleting it is safe.
- Safe to share: an entry is built under a file lock on its key (other workers and runs wait, then read)
  and exists only once its record is renamed into place after the build: a run killed mid-build leaves no
  record, and the next one builds that folder again from empty. The build writes in the entry's own
  folder rather than into one renamed afterwards, because writers record absolute paths in what they write
  (PEFT's `base_model_name_or_path`, the Trainer's `training_args.bin`) and the tests compare them.
- Read only: tests copy what they change (`copy_tree`). The record lists the entry's files (type, size,
  SHA-256); when the session ends, the entries it used are listed again and a difference fails the session
  (and drops the entry, which the next run builds again).
- Fresh: each run moves the times of an entry's files forward (`Entry.refresh`), so that its newest file
  is dated at the run's start, as when every run wrote its own.
- Bounded: a new entry removes those of the same fixture that no run used for a day, beyond the newest 3.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import dis
import functools
import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import pickle
import re
import shutil
import stat
import sys
import textwrap
import time
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any, TypeVar

from filelock import FileLock, Timeout

__all__ = ["ENV", "Entry", "Unkeyable", "cache_root", "changed_entries", "entry_for", "key_of"]

T = TypeVar("T")

ENV = "CKPTCTL_TEST_CACHE"
REPO = Path(__file__).resolve().parents[1]
_PROJECT = ("tests", "ckptctl")
#: Part of every key: a change to what an entry holds or how it is keyed here makes all entries new.
_FORMAT = "1"
#: A string constant naming a project module (`[sys.executable, "-m", "tests.core._workers"]`, or something in
#: it: "ckptctl.frameworks.dcp.layout:DcpLayout"): that module is reached too.
_MODULE_NAME = re.compile(r"(?:tests|ckptctl)(?:[.:]\w+)+")
_KEEP_NEWEST = 3
_KEEP_USED_WITHIN_S = 86400


def cache_root() -> Path | None:
    """The cache folder, or None when `CKPTCTL_TEST_CACHE=off`."""
    value = os.environ.get(ENV, "")
    if value == "off":
        return None
    if value:
        return Path(value).expanduser().resolve()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser().resolve() / "ckptctl-tests"


@dataclass(frozen=True)
class Entry:
    """One fixture's output under one key: `out/` (what the build wrote), `record.pickle` (what it returned,
    written last), `used` (touched by every run that reads it)."""

    root: Path
    name: str
    key: str

    @property
    def folder(self) -> Path:
        return self.root / f"{self.name}-{self.key}"

    @property
    def out(self) -> Path:
        return self.folder / "out"

    @property
    def record(self) -> Path:
        return self.folder / "record.pickle"

    def lock(self) -> FileLock:
        return FileLock(str(self.root / f"{self.folder.name}.lock"))

    def get(self, build: Callable[[Path], T]) -> T:
        """What `build(out)` returned, building it first (under the entry's lock) when no run has yet; its
        files dated as if written now (`Entry.refresh`)."""
        with self.lock():
            found = self._read()
            if found is not None:
                self.refresh()
                return found[0]  # type: ignore[no-any-return]
            if self.folder.exists():
                shutil.rmtree(self.folder)  # a killed build's, or a dropped entry's
            self.out.mkdir(parents=True)
            with _timed(self.name):
                value = build(self.out)
            pending = self.folder / f".record.{os.getpid()}"
            pending.write_bytes(pickle.dumps((str(self.out), _listing(self.out), value)))
            os.replace(pending, self.record)
            (self.folder / "used").touch()
        _evict_siblings(self)
        return value

    def refresh(self) -> None:
        """Move the times of the files forward, keeping their order and gaps, so that the newest is dated now:
        the run reads the entry as written at its start, as it did when each run wrote its own (layouts call a
        checkpoint without its completion marker in progress while its files are recent, broken after). The
        newest go first, so that a run reading it meanwhile never sees two files in another order."""
        paths = [self.out, *self.out.rglob("*")]
        times = {path: os.lstat(path).st_mtime_ns for path in paths}
        shift = time.time_ns() - max(times.values())
        for path in sorted(paths, key=times.__getitem__, reverse=True):
            os.utime(path, ns=(times[path] + shift, times[path] + shift), follow_symlinks=False)

    def _read(self) -> tuple[Any, dict[str, tuple[object, ...]]] | None:
        if not self.record.exists():
            return None
        built_at, listing, value = pickle.loads(self.record.read_bytes())  # written by this cache's own code
        if built_at != str(self.out):
            return None  # the cache folder was moved: the files name where they were written
        with contextlib.suppress(OSError):
            (self.folder / "used").touch()
        return value, listing

    def changes(self) -> list[str]:
        """The files of `out/` added, removed or changed since the build (empty when untouched)."""
        found = self._read()
        if found is None:
            return []
        _, before = found
        now = _listing(self.out)
        return sorted(rel for rel in before.keys() | now.keys() if before.get(rel) != now.get(rel))

    def drop(self) -> None:
        """Forget the entry (the next run builds it again)."""
        with self.lock():
            self.record.unlink(missing_ok=True)


#: Where `Entry.get` appends one JSON line per build (the fixture, its wall and CPU seconds): a cold run's cost
#: per writer, e.g. `CKPTCTL_TEST_CACHE=/tmp/cold CKPTCTL_WRITER_TIMES=/tmp/cold.jsonl pytest ...`.
TIMES_ENV = "CKPTCTL_WRITER_TIMES"


@contextlib.contextmanager
def _timed(name: str) -> Iterator[None]:
    """Log the build's wall and CPU time to `$CKPTCTL_WRITER_TIMES` when set. The CPU is this process tree's
    (this process, its live descendants and the children they reaped): ranks forked by the forkserver are its
    children, not this process's, and only the server's own counts reach them."""
    log = os.environ.get(TIMES_ENV)
    if not log:
        yield
        return
    wall, cpu = time.monotonic(), _tree_cpu()
    try:
        yield
    finally:
        line = {"name": name, "wall": round(time.monotonic() - wall, 2), "cpu": round(_tree_cpu() - cpu, 2)}
        with open(log, "a") as f:
            f.write(json.dumps(line) + "\n")


def _tree_cpu() -> float:
    """User + system seconds of this process, its descendants alive now and the children they have reaped
    (Linux /proc; 0 for processes that went meanwhile)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, list[str]]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry.name}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
                stats[int(entry.name)] = (int(fields[1]), fields)
    tree, grew = {os.getpid()}, True
    while grew:
        found = {pid for pid, (parent, _) in stats.items() if parent in tree} - tree
        tree |= found
        grew = bool(found)
    # fields after the name: state ppid ... utime(11) stime(12) cutime(13) cstime(14)
    return sum(sum(int(stats[pid][1][i]) for i in (11, 12, 13, 14)) for pid in tree if pid in stats) / tick


#: The entries this process's fixtures asked for (its tests may have read them), in order.
_used: dict[Entry, None] = {}


def entry_for(name: str, build: Callable[..., Any]) -> Entry | None:
    """The cache entry of fixture `name` built by `build` (None when the cache is off)."""
    root = cache_root()
    if root is None:
        return None
    try:
        key = key_of(name, build)
    except Unkeyable as exc:
        warnings.warn(str(exc), stacklevel=2)
        return None
    root.mkdir(parents=True, exist_ok=True)
    entry = Entry(root, name, key)
    _used.setdefault(entry, None)
    return entry


def changed_entries() -> dict[Entry, list[str]]:
    """The entries this process used whose files changed since they were built, each dropped."""
    changed = {}
    for entry in _used:
        if changes := entry.changes():
            entry.drop()
            changed[entry] = changes
    return changed


def _listing(folder: Path) -> dict[str, tuple[object, ...]]:
    """Each file's and folder's type and permissions, size and SHA-256 (a link's target), by relative path:
    what a test may not change. (Times are left out: `Entry.refresh` moves them.)"""
    listing: dict[str, tuple[object, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in (*dirnames, *filenames):
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                content: str | None = os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    content = hashlib.file_digest(f, "sha256").hexdigest()
            else:
                content = None
            listing[os.path.relpath(path, folder)] = (st.st_mode, st.st_size, content)
    return listing


def _evict_siblings(entry: Entry) -> None:
    """Remove the entries of the same fixture (other keys: older writers) unused for a day, but the newest."""
    siblings = []
    for folder in entry.root.glob(f"{entry.name}-" + "?" * len(entry.key)):
        if folder != entry.folder:
            with contextlib.suppress(OSError):
                siblings.append((os.stat(folder / "used").st_mtime, folder))
    siblings.sort(reverse=True)
    for used, folder in siblings[_KEEP_NEWEST - 1 :]:
        if time.time() - used < _KEEP_USED_WITHIN_S:
            continue
        with contextlib.suppress(Timeout), FileLock(str(entry.root / f"{folder.name}.lock"), timeout=0):
            shutil.rmtree(folder, ignore_errors=True)


# --- the key ---------------------------------------------------------------------------------------------


def key_of(name: str, build: Callable[..., Any]) -> str:
    """20 hex digits of the SHA-256 of what `build`'s output depends on (see the module's doc)."""
    reach = _Reach()
    reach.add(build)
    digest = hashlib.sha256()

    def feed(*parts: object) -> None:
        for part in parts:
            digest.update(repr(part).encode() + b"\0")

    import torch

    feed(_FORMAT, name, sys.version_info[:3], torch.__version__)
    for text in reach.texts:
        feed("text", text)
    for path in sorted(reach.files):
        feed("file", path.relative_to(REPO).as_posix(), hashlib.sha256(path.read_bytes()).hexdigest())
    for dist, version in sorted(_versions(reach.imports).items()):
        feed("dist", dist, version)
    for value in reach.data:
        try:
            feed("data", hashlib.sha256(_canonical(value)).hexdigest())
        except Exception as exc:  # whatever pickle raises: no key stands for this value
            raise Unkeyable(f"{name!r} is built from a value pickle cannot write ({exc}): built per run") from exc
    return digest.hexdigest()[:20]


def _canonical(value: Any) -> bytes:
    """Bytes standing for `value`, the same for equal values however they were made. Not pickle's own: it
    writes an object met twice once, so a fixture's value as built in this process (paths sharing their
    parent's parts) and the same value read back from a record give other bytes, and the entries built from
    it were built again by the next run. Paths, dataclasses and containers by what they hold; anything else
    by its pickle."""
    return repr(_plain(value)).encode()


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, str | bytes | bool | int | float):
        return value
    if isinstance(value, PurePath):
        return (type(value).__name__, str(value))
    if isinstance(value, list | tuple):
        return (type(value).__name__, *map(_plain, value))
    if isinstance(value, dict):
        return ("dict", *((_plain(k), _plain(v)) for k, v in value.items()))
    if isinstance(value, set | frozenset):
        return (type(value).__name__, *sorted(map(repr, map(_plain, value))))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        return (kind, *((f.name, _plain(getattr(value, f.name))) for f in dataclasses.fields(value)))
    return ("pickle", hashlib.sha256(pickle.dumps(value, protocol=4)).hexdigest())


class Unkeyable(Exception):
    """A build closes over data with no stable bytes: it is built per run, not cached."""


@dataclass
class _Reach:
    """What a build reaches: project files, source texts (of functions defined in a conftest or inside
    another function), top-level names of the other modules imported, and data it closes over."""

    files: set[Path] = field(default_factory=set)
    texts: list[str] = field(default_factory=list)
    imports: set[str] = field(default_factory=set)
    data: list[Any] = field(default_factory=list)
    _seen: set[int] = field(default_factory=set)

    def add(self, obj: Any) -> None:
        if id(obj) in self._seen:
            return
        self._seen.add(id(obj))
        if isinstance(obj, types.ModuleType):
            self.module(obj.__name__)
        elif isinstance(obj, functools.partial):
            self.add(obj.func)
            for arg in (*obj.args, *obj.keywords.values()):
                self.add(arg)
        elif isinstance(obj, types.FunctionType | type):
            self.definition(obj)
        elif isinstance(obj, types.BuiltinFunctionType):
            self.imports.add((obj.__module__ or "builtins").split(".")[0])
        else:
            self.data.append(obj)

    def definition(self, obj: types.FunctionType | type) -> None:
        module = obj.__module__ or ""
        if _top(module) not in _PROJECT:
            self.imports.add(_top(module))
            return
        local = "<locals>" in obj.__qualname__ or obj.__name__ == "<lambda>"
        if not local and module.rsplit(".", 1)[-1] != "conftest":
            self.texts.append(f"{module}:{obj.__qualname__}")  # a module-level definition: by its name, and
            self.module(module)  # its whole module (and what that reaches)
            return
        # Defined in a conftest or inside a function: its own source, and what it names.
        try:
            source = textwrap.dedent(inspect.getsource(obj))
        except (OSError, TypeError) as exc:  # defined in a string, or in a file gone since
            raise Unkeyable(f"no source for {obj.__qualname__} ({exc}): built per run") from exc
        self.texts.append(source)
        with contextlib.suppress(SyntaxError):  # a lambda's lines may not parse alone
            self.statements(ast.parse(source), module)
        functions = [obj] if isinstance(obj, types.FunctionType) else list(_methods(obj))
        for function in functions:
            for name in _global_names(function.__code__):
                if name in function.__globals__:
                    self.add(function.__globals__[name])
            for cell in function.__closure__ or ():
                self.add(cell.cell_contents)

    def module(self, name: str) -> None:
        path = _module_file(name)
        if path is None:
            if _top(name) not in _PROJECT:
                self.imports.add(_top(name))
            return
        parts = name.split(".")
        for depth in range(1, len(parts)):  # importing a.b.c runs a/__init__.py and a/b/__init__.py first
            self.module(".".join(parts[:depth]))
        if path in self.files:
            return
        self.files.add(path)
        for reference in _references(path.read_bytes(), name if path.name != "__init__.py" else name + ".__init__"):
            self.module(reference)

    def statements(self, tree: ast.AST, module: str) -> None:
        for reference in _referenced(tree, module):
            self.module(reference)


def _references(source: bytes, module: str) -> list[str]:
    """The modules that `source` (of `module`) imports or names, read from a file under the cache root that
    the first run wrote for the same text (parsing the reach of `ckptctl.core` takes seconds)."""
    digest = hashlib.sha256(module.encode() + b"\0" + source).hexdigest()
    if digest in _known_references:
        return _known_references[digest]
    root = cache_root()
    stored = None if root is None else root / ".references" / f"{digest}.json"
    if stored is not None and stored.exists():
        found: list[str] = json.loads(stored.read_text())
    else:
        found = _referenced(ast.parse(source), module)
        if stored is not None:
            stored.parent.mkdir(parents=True, exist_ok=True)
            pending = stored.with_name(f".{stored.name}.{os.getpid()}")
            pending.write_text(json.dumps(found))
            os.replace(pending, stored)
    _known_references[digest] = found
    return found


_known_references: dict[str, list[str]] = {}


def _referenced(tree: ast.AST, module: str) -> list[str]:
    """The absolute names of the modules `tree` imports (and of the names it imports from a package, which
    may be modules), and the project modules it names in strings (`python -m tests.core._workers`)."""
    package = module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.append(base)
            if _top(base) in _PROJECT:  # `from tests.writers import openrlhf_writer`: a module too
                found += [f"{base}.{alias.name}" for alias in node.names if _module_file(f"{base}.{alias.name}")]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_NAME.fullmatch(node.value):
            # `-m tests.core._workers`, a registry's "ckptctl.frameworks.dcp.layout:DcpLayout": the module named
            parts = re.split(r"[.:]", node.value)
            named = (".".join(parts[:n]) for n in range(len(parts), 1, -1))
            found += [name for name in named if _module_file(name)][:1]
    return list(dict.fromkeys(found))


def _methods(cls: type) -> Iterator[types.FunctionType]:
    """The functions written in `cls`'s body (not those `dataclass` generates, nor its `__repr__` wrapper)."""
    source = getattr(sys.modules.get(cls.__module__), "__file__", None)
    for value in vars(cls).values():
        if isinstance(value, staticmethod | classmethod):
            value = value.__func__
        if isinstance(value, property):
            value = value.fget
        if isinstance(value, types.FunctionType) and value.__code__.co_filename == source:
            yield value


def _global_names(code: types.CodeType) -> Iterator[str]:
    """The globals `code` reads (and the functions, lambdas and comprehensions inside it)."""
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            yield instruction.argval
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_names(const)


def _top(name: str) -> str:
    return name.partition(".")[0]


@functools.cache
def _module_file(name: str) -> Path | None:
    if not name or _top(name) not in _PROJECT:
        return None
    base = REPO.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _versions(imports: set[str]) -> dict[str, str]:
    """The version of the distribution providing each of `imports` (top-level module names) but the
    standard library's ("absent" for one not installed: a writer's stand-in)."""
    return {name: _version(name) for name in imports - set(sys.stdlib_module_names) - {"__main__"}}


@functools.cache
def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)  # most distributions are named as their module
    except importlib.metadata.PackageNotFoundError:
        if importlib.util.find_spec(name) is None:
            return "absent"
    dists = importlib.metadata.packages_distributions().get(name, [])  # yaml: PyYAML (reads every dist: slow)
    return ",".join(f"{dist}=={importlib.metadata.version(dist)}" for dist in sorted(dists)) or "absent"
