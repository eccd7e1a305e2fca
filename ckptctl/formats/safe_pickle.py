"""Unpickling untrusted files without running them: an allowlisting unpickler and its stand-ins.

A pickle is a small program: `GLOBAL`/`STACK_GLOBAL` name any importable callable and `REDUCE` calls it,
so `pickle.load` on a file from disk is code execution. This module is the one place in ckptctl that
reads pickles, and it follows these rules:

1. Every global a pickle asks for goes through `find_class`, which answers from a fixed allowlist of
   *inert stand-ins* (plain classes that only store what BUILD hands them, and small
   functions that validate their arguments). Nothing named by the file is imported. Anything else is
   refused with `UnsafePickle` naming the global (`posix.system`), before any of the pickle runs.
2. Before the C unpickler sees the bytes, `check_opcodes` walks the opcode stream. The C unpickler
   grows its memo table to twice the index a `LONG_BINPUT`/`PUT` opcode names and fills it, so a 9-byte
   file can make it allocate and touch gigabytes (CPython before the fix of python/cpython#115952,
   3.11 included); the walk refuses memo indices that no real pickler writes and string/bytes lengths
   that run past the end of the data, and frames larger than any pickler writes.
3. What unpickling builds is bounded while it runs. One-byte opcodes build objects of 50-230 bytes (a
   20 MB file of `EMPTY_LIST`s alone takes 1.5 GB), so the C unpickler reads the pickle through
   `_WatchedInput`, at most 128 KiB at a time, and each read checks that the process's resident memory
   has grown by less than `MAX_GROWTH_PER_BYTE` times the pickle's size (real files need about half).
   Stand-ins that copy what they are given (`_codecs.encode`, `set`, paths) check before each copy, as
   one four-byte REDUCE of a memoised argument can copy megabytes.
4. Hashing a tuple recurses in C without a depth check, so a dict key of a million nested tuples
   overflows the C stack (SIGSEGV). Every nesting level is a tuple of at least 48 bytes, so the memory
   bound also bounds the depth, and a large pickle is unpickled on a thread with a stack that deep
   (`parse_pickle`).
5. Whatever else goes wrong (truncation, wrong types, bad states) comes out as `CorruptCheckpoint`.

This module is the engine and knows no file format. The allowlists are what the real files need and
nothing more, and live beside the parser of their format: `formats.dcp_metadata_classes`
(`DCP_METADATA_GLOBALS`), `formats.torch_save_classes` (`TORCH_SAVE_GLOBALS`, `OBJECT_READ_GLOBALS`),
`formats.torch_pickle_classes` (`TORCH_PICKLE_GLOBALS`: whole training-state files, DeepSpeed, HF Trainer),
`formats.dtensor_classes` (`DTENSOR_PICKLE_GLOBALS`); framework packages add the classes their files pickle
through `formats.framework_classes`. See the notes on each entry.
"""

from __future__ import annotations

import _compat_pickle
import gc
import io
import itertools
import os
import pickle
import pickletools
import re
import resource
import struct
import sys
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Any, ClassVar, TypeVar

from ckptctl.errors import CkptctlError, CorruptCheckpoint, UnsafePickle, UnsupportedClass
from ckptctl.formats import framework_classes

__all__ = [
    "CODE_RUNNING_MODULES",
    "MAX_DIMS",
    "MAX_GROWTH_PER_BYTE",
    "MAX_NESTING",
    "Allowlist",
    "FrameworkMapping",
    "FrameworkObject",
    "OpaqueObject",
    "SafeUnpickler",
    "StandIn",
    "check_growth",
    "check_nesting",
    "check_opcodes",
    "gc_paused",
    "opaque_values",
    "parse_pickle",
    "runs_code",
    "safe_loads",
    "stand_in_class",
    "state_fields",
]

#: More dimensions than any real tensor has; bounds the work one `torch.Size` stand-in can do.
MAX_DIMS = 64
#: How much a pickle may grow the process's resident memory, per byte of pickle. Real files need about 12 (a
#: 100k-tensor DCP `.metadata` of 20 MB builds 235 MB of objects); hostile ones reach 240.
MAX_GROWTH_PER_BYTE = 20
#: What any pickle may grow memory by regardless of its size.
_MIN_GROWTH = 192 << 20
#: Larger frames are refused: Python's picklers cut frames at 64 KiB, and the C unpickler reads a whole
#: frame at once, so a frame is the most it builds between two memory checks.
_MAX_FRAME = 256 << 10
#: Distinct globals one pickle may name: real files name a few dozen, and each pattern-matched framework
#: class is a new class object of about a kilobyte.
_MAX_GLOBALS = 1024


class _RunningLoad(threading.local):
    """The input of the load running on this thread (None: no load), for the stand-ins' memory checks."""

    watch: _WatchedInput | None = None


_RUNNING = _RunningLoad()


def check_growth(nbytes: int) -> None:
    """Check that the running load may grow memory by `nbytes` more, before a stand-in copies that much.

    A stand-in's output can be far larger than the opcodes that call it (a REDUCE of memoised arguments
    is four bytes), and a whole chunk of opcodes runs between two reads of `_WatchedInput`, so the copying
    stand-ins check before each copy.
    """
    watch = _RUNNING.watch
    if watch is not None:  # None: a `SafeUnpickler` used directly, without the guards of `parse_pickle`
        watch.check(nbytes)


# --------------------------------------------------------------------------------------------------
# Stand-ins. None of them calls anything it is given; each either stores it or checks and returns it.
# --------------------------------------------------------------------------------------------------


class StandIn:
    """An object of an allowlisted class: holds the state that the pickle's BUILD gave it, nothing more.

    NEWOBJ creates it without arguments (`object.__new__` refuses any), BUILD hands it a state that is
    stored as is; parsers read and validate the state afterwards with `state_fields`.
    """

    __slots__ = ("state",)
    #: The class this stands in for, for messages.
    stands_for: ClassVar[str] = "object"

    def __setstate__(self, state: Any) -> None:
        self.state = state


_C = TypeVar("_C", bound=type)


def stand_in_class(name: str, base: _C, **attributes: Any) -> _C:
    """A subclass of the stand-in class `base` named `name`, with `attributes` as class attributes (no
    instance attributes of its own): the allowlists declare their plain stand-ins as tables of this."""
    return type(name, (base,), {"__slots__": (), **attributes})  # type: ignore[return-value]


_SCALAR_TYPES = (str, int, float, bool, type(None))


class FrameworkObject(StandIn):
    """An object of an allowlisted framework class (one a framework package registers, see `Allowlist`).

    NEWOBJ + BUILD give an object its fields (`state_fields` reads them); an enum member is rebuilt by
    calling its class with its value, which is kept as `value` (None for plain objects).
    """

    __slots__ = ("value",)
    value: Any

    def __new__(cls, *args: Any) -> FrameworkObject:
        if len(args) > 1 or (args and type(args[0]) not in _SCALAR_TYPES):
            raise ValueError(f"{cls.stands_for} takes at most one plain value")
        obj = object.__new__(cls)
        obj.value = args[0] if args else None
        return obj

    def __repr__(self) -> str:
        return f"<{self.stands_for} {self.value!r}>" if self.value is not None else f"<{self.stands_for}>"


class FrameworkMapping(dict[Any, Any]):
    """An object of an allowlisted framework class that subclasses dict (Lightning's `AttributeDict`): the
    items the pickle sets, and the state a BUILD gives it in `state`."""

    __slots__ = ("state",)
    #: The class this stands in for, for messages.
    stands_for: ClassVar[str] = "dict"

    def __setstate__(self, state: Any) -> None:
        self.state = state


@cache
def _framework_mapping(qualified_name: str) -> type[FrameworkMapping]:
    return type("FrameworkMapping", (FrameworkMapping,), {"__slots__": (), "stands_for": qualified_name})


@cache
def _framework_class(qualified_name: str) -> type[FrameworkObject]:
    # Exact names only (a bounded set): pattern matches get a fresh class per file, see Allowlist.
    return type("FrameworkObject", (FrameworkObject,), {"__slots__": (), "stands_for": qualified_name})


class OpaqueObject(StandIn):
    """An object of a class no allowlist holds, from a known ML library or the standard library, read where the
    reader can skip it (`Allowlist.opaque_unknown`): whatever REDUCE or NEWOBJ hands it (`args`) and BUILD
    gives it (`state`) is stored, nothing is called. `stands_for` names the class, `package` its library, for
    the "unsupported class X (from P)" notes of `opaque_values`."""

    __slots__ = ("args", "items")
    package: ClassVar[str] = ""
    args: tuple[Any, ...]
    items: list[Any]

    def __new__(cls, *args: Any, **kwargs: Any) -> OpaqueObject:
        obj = object.__new__(cls)
        obj.args = args
        obj.state = None
        obj.items = []
        return obj

    def __setstate__(self, state: Any) -> None:
        self.state = state

    # A dict or list subclass is filled by SETITEMS/APPENDS: its items are kept, nothing else happens.
    def __setitem__(self, key: Any, value: Any) -> None:
        check_growth(64)
        self.items.append((key, value))

    def append(self, value: Any) -> None:
        check_growth(64)
        self.items.append(value)

    def extend(self, values: Any) -> None:
        for value in values:
            self.append(value)

    def __repr__(self) -> str:
        return f"<unsupported {self.stands_for}>"


def _opaque_class(qualified_name: str, package: str) -> type[OpaqueObject]:
    # A fresh class per name and load (bounded by `_MAX_GLOBALS`), like pattern-matched framework classes.
    return type("OpaqueObject", (OpaqueObject,), {"__slots__": (), "stands_for": qualified_name, "package": package})


def opaque_values(root: Any, limit: int = 64) -> list[str]:
    """ "unsupported class X (from P)" for each distinct opaque class in `root` (dicts, lists, tuples and stand-ins
    walked iteratively, each container once), at most `limit`."""
    found: dict[str, str] = {}
    seen: set[int] = set()
    todo = [root]
    while todo and len(found) < limit:
        value = todo.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, OpaqueObject):
            found.setdefault(value.stands_for, f"unsupported class {value.stands_for} (from {value.package})")
            continue
        if isinstance(value, StandIn):
            todo.append(getattr(value, "state", None))
        elif isinstance(value, dict):
            todo.extend(value.values())
        elif type(value) in (list, tuple):
            todo.extend(value)
    return [found[name] for name in sorted(found)]


class Allowlist(Mapping[tuple[str, str], Any]):
    """Exact (module, name) entries, plus the framework classes the framework packages register
    (`formats.framework_classes`: exact names and module prefixes), which become `FrameworkObject`s."""

    def __init__(self, exact: Mapping[tuple[str, str], Any], *, opaque_unknown: bool = False) -> None:
        self._exact = dict(exact)
        #: Whether a class of a known ML library (or of the standard library) outside the entries is read as
        #: an `OpaqueObject` instead of refusing the file: the generic reader's choice, for files of
        #: frameworks ckptctl was never taught (a layout that knows its files refuses what it does not know).
        self.opaque_unknown = opaque_unknown

    def __getitem__(self, key: tuple[str, str]) -> Any:
        found = self._exact.get(key)
        if found is not None:
            return found
        module, name = key
        frameworks = framework_classes.registered()
        if key in frameworks.mappings:
            return _framework_mapping(f"{module}.{name}")
        if key in frameworks.classes:
            return _framework_class(f"{module}.{name}")
        covered = any(module.startswith(prefix) and name.endswith(suffix) for prefix, suffix in frameworks.modules)
        if covered and len(module) + len(name) <= 200 and name.isidentifier():
            return type("FrameworkObject", (FrameworkObject,), {"__slots__": (), "stands_for": f"{module}.{name}"})
        raise KeyError(key)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        registered = framework_classes.registered()
        return iter([*self._exact, *sorted((registered.classes | registered.mappings) - self._exact.keys())])

    def __len__(self) -> int:
        registered = framework_classes.registered()
        return len(self._exact.keys() | registered.classes | registered.mappings)


#: The packages whose file formats ckptctl reads (torch.save, DCP, numpy values in them): a global of theirs
#: outside the allowlists is refused as an unsupported class, not as a forgery; framework packages add
#: their own, and the generic reader the ML libraries of the long tail (`FrameworkClasses.packages`).
_FORMAT_PACKAGES = frozenset({"torch", "numpy"})

#: Modules whose globals run code, open files or processes, or import anything when called (the tools of a
#: pickle exploit): naming one is the sign of a forged file. A module matches itself and its submodules.
CODE_RUNNING_MODULES = frozenset(
    {"os", "posix", "nt", "subprocess", "_posixsubprocess", "sys", "importlib", "runpy", "shutil", "pickle"}
    | {"_pickle", "marshal", "ctypes", "_ctypes", "code", "codeop", "pty", "socket", "multiprocessing", "webbrowser"}
    | {"pdb", "bdb", "timeit", "cProfile", "profile", "trace", "threading", "_thread", "signal", "asyncio"}
    | {"tempfile", "io", "_io", "codecs", "functools", "operator", "_operator", "types", "builtins", "copyreg"}
    | {"pydoc", "zipimport", "pkgutil", "site", "sysconfig", "compileall", "py_compile", "gc", "atexit"}
    | {"commands", "popen2", "platform", "glob", "fileinput", "linecache", "tarfile", "zipfile", "sqlite3"}
    | {"urllib", "http.client", "http.server", "ftplib", "smtplib", "telnetlib", "xmlrpc", "ensurepip", "venv"}
    | {"__builtin__", "exceptions", "inspect", "ast", "dis", "tkinter", "turtle", "_winapi", "msvcrt", "winreg"}
)

#: The classes of standard-library enums and plain values the allowlists read as data are named in
#: `formats.stdlib_classes`; every other standard-library global is unknown (or code-running, above).
_STDLIB_MODULES = frozenset(sys.stdlib_module_names)


#: Builtins that are plain value types (a `defaultdict(list)` names `builtins.list` as its factory): unknown,
#: not code-running. Every other builtin (eval, exec, getattr, __import__, open, ...) is.
_BUILTIN_VALUE_TYPES = frozenset(
    {"list", "dict", "int", "float", "str", "bytes", "bool", "tuple", "complex", "bytearray", "slice", "range"}
)


def runs_code(module: str, name: str) -> bool:
    """Whether the global `module.name` is a tool of a pickle exploit (see `CODE_RUNNING_MODULES`): every global
    of such a module (none is a plain value class a file needs), but the builtins' plain value types."""
    if module in ("builtins", "__builtin__") and name in _BUILTIN_VALUE_TYPES:
        return False
    parts = module.split(".")
    return any(".".join(parts[:n]) in CODE_RUNNING_MODULES for n in range(1, len(parts) + 1))


# Real torch dtypes the data model has no itemsize for: refused as unsupported rather than as unsafe.
_UNSUPPORTED_DTYPES = frozenset(
    {"complex32", "qint8", "quint8", "qint32", "quint4x2", "quint2x4", "bits1x8", "bits2x4", "bits4x2", "bits8"}
    | {"bits16", "float4_e2m1fn_x2", "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7"}
    | {"int1", "int2", "int3", "int4", "int5", "int6", "int7"}
)


# --------------------------------------------------------------------------------------------------
# The unpickler.
# --------------------------------------------------------------------------------------------------


class SafeUnpickler(pickle.Unpickler):
    """An unpickler that resolves globals only from an allowlist of stand-ins.

    Args:
        file: the pickle stream.
        allowed: (module, name) → the object to hand back instead of importing anything.
        source: the file's name, for messages.
    """

    def __init__(self, file: io.BytesIO | _WatchedInput, allowed: Mapping[tuple[str, str], Any], source: str) -> None:
        super().__init__(file)
        self._allowed = allowed
        self._source = source
        #: What each global resolved to: a pickle may name one global many times, and a pattern-matched
        #: framework class is built anew on each lookup.
        self._found: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        found = self._found.get((module, name))
        if found is not None:
            return found
        if len(self._found) >= _MAX_GLOBALS:
            raise CorruptCheckpoint(f"{self._source}: the pickle names more than {_MAX_GLOBALS} distinct globals")
        found = self._found[(module, name)] = self._resolve(module, name)
        return found

    def _resolve(self, module: str, name: str) -> Any:
        # Protocol 0-2 pickles name Python 2 modules (`__builtin__.eval`); translate as pickle does, so
        # that messages (and the allowlist) speak of the global that would really be loaded.
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        try:
            return self._allowed[(module, name)]
        except (KeyError, TypeError):
            pass
        if module == "torch" and name in _UNSUPPORTED_DTYPES:
            raise CorruptCheckpoint(f"{self._source}: tensor dtype torch.{name} is not supported by ckptctl")
        qualified = f"{_printable(module)}.{_printable(name)}"
        package = _printable(module.partition(".")[0])
        if runs_code(module, name):
            raise UnsafePickle(
                f"{self._source}: the pickle asks for {qualified}, which is not allowed; nothing in it was executed",
                "this file is not what it claims to be: do not load it with pickle or torch.load(weights_only=False)",
            )
        known = package in _FORMAT_PACKAGES or package in framework_classes.registered().packages
        # Only the globals above run code. Any other class (of a known library, the standard library, or a
        # library ckptctl was never taught) is inert in this unpickler: a reader that can skip the value
        # reads it as opaque, "unsupported class X (from P)".
        if getattr(self._allowed, "opaque_unknown", False) and len(module) + len(name) <= 200:
            return _opaque_class(f"{module}.{name}", package)
        # A genuine file of a newer framework version (or of a library ckptctl was never taught) can name a
        # class ckptctl does not know: it is refused all the same, without calling the file a forgery.
        what = f"ckptctl reads only the {package} classes it knows" if known else f"ckptctl does not know {package}"
        raise UnsupportedClass(
            f"{self._source}: unsupported class {qualified} (from {package}): {what}; nothing in the pickle was "
            "executed",
            (
                f"a {package} version newer than ckptctl knows may pickle this class: please report it with the "
                f"{package} version; "
                if known
                else ""
            )
            + "load the file with torch.load(weights_only=False) only if you trust its origin",
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickle(f"{self._source}: the pickle uses persistent ids, which this file type never has")


def _printable(name: str) -> str:
    return name if len(name) <= 200 and name.isprintable() else repr(name[:200])


def safe_loads(
    data: bytes | memoryview,
    allowed: Mapping[tuple[str, str], Any],
    source: str,
    unpickler: type[SafeUnpickler] | None = None,
) -> Any:
    """Unpickle `data`, resolving globals only from `allowed`.

    Args:
        data: the whole pickle.
        allowed: (module, name) → stand-in (`DCP_METADATA_GLOBALS`, `TORCH_SAVE_GLOBALS`, or your own).
        source: the file's name, for messages.
        unpickler: the `SafeUnpickler` subclass to use (default `SafeUnpickler`).

    Returns:
        The unpickled object, built from builtins and stand-ins only.

    Raises:
        UnsafePickle: the pickle names a global outside the allowlist (nothing of it ran).
        CorruptCheckpoint: anything else that makes it unreadable, or it would build more than a real
            file of its size.
    """
    return parse_pickle(data, allowed, source, _as_is, unpickler)


def parse_pickle(
    data: bytes | memoryview,
    allowed: Mapping[tuple[str, str], Any],
    source: str,
    parse: Callable[[Any], _T],
    unpickler: type[SafeUnpickler] | None = None,
) -> _T:
    """Unpickle `data` like `safe_loads` and hand the result to `parse`, on a stack deep enough for it.

    Hashing a tuple (as a dict key, or in `parse`) recurses in C once per nesting level and nothing checks
    the depth, so both run on a thread whose stack holds the deepest nesting the pickle can build within
    its memory bound: pass a `parse` that hashes unvalidated values (the DCP parser keys its caches by
    them); what `safe_loads` returns must not be hashed deeper than its callers validated.

    Args:
        data: the whole pickle.
        allowed: (module, name) → stand-in.
        source: the file's name, for messages.
        parse: turns the unpickled object into the caller's result.
        unpickler: the `SafeUnpickler` subclass to use (default `SafeUnpickler`).

    Raises:
        UnsafePickle: the pickle names a global outside the allowlist (nothing of it ran).
        CorruptCheckpoint: anything else that makes it unreadable, or it would build more than a real
            file of its size.
    """
    buf = bytes(data) if isinstance(data, memoryview) else data
    check_opcodes(buf, source)
    growth = max(_MIN_GROWTH, MAX_GROWTH_PER_BYTE * len(buf))
    kind = unpickler or SafeUnpickler

    def run() -> _T:
        memory = _ResidentMemory()
        watch = _RUNNING.watch = _WatchedInput(buf, growth, source, memory)
        try:
            return parse(_unpickle(watch, allowed, source, kind))
        finally:
            _RUNNING.watch = None
            memory.close()

    # A nesting level is a tuple opcode (one byte at least) and a tuple object (48 bytes at least).
    depth = min(len(buf), (growth + _MAX_FRAME * _MAX_BYTES_PER_OPCODE) // 48)
    if depth <= _INLINE_DEPTH:
        return run()
    return _on_deep_stack(run, depth * _STACK_PER_LEVEL + (1 << 20), source)


_T = TypeVar("_T")
#: Pickles that cannot nest tuples deeper than this are unpickled on the caller's thread: hashing them
#: needs 2 MiB of C stack, which every thread has.
_INLINE_DEPTH = 16_384
#: C stack per nesting level that `hash` walks (measured: about 55 bytes on x86-64 CPython 3.11), with margin.
_STACK_PER_LEVEL = 128
#: The most one opcode byte builds (EMPTY_SET: a 232-byte set and a stack slot).
_MAX_BYTES_PER_OPCODE = 240
_STACK_LOCK = threading.Lock()
#: ru_maxrss is in KiB on Linux and in bytes on macOS.
_MAXRSS_UNIT = 1 if sys.platform == "darwin" else 1024
_PAGE = resource.getpagesize()


class _ResidentMemory:
    """The process's resident memory: `/proc/self/statm` where there is one (read with one pread), else the
    peak that getrusage reports (which only grows, so sequential loads add up: a looser bound)."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            self._fd = None

    def bytes(self) -> int:
        if self._fd is not None:
            return int(os.pread(self._fd, 128, 0).split()[1]) * _PAGE
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _MAXRSS_UNIT

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _WatchedInput:
    """The pickle as a file for the C unpickler, checking memory growth on every read.

    With `peek`, the C unpickler buffers at most 128 KiB of input at a time (or one frame, which the walk
    bounds), so it comes back here at least that often: each time, the process's resident memory must
    have grown by less than `limit` since the load began.
    """

    __slots__ = ("_buf", "_copied", "_limit", "_memory", "_pos", "_source", "_start")

    def __init__(self, buf: bytes, limit: int, source: str, memory: _ResidentMemory) -> None:
        self._buf = buf
        self._pos = 0
        self._limit = limit
        self._source = source
        self._memory = memory
        self._start = memory.bytes()
        self._copied = 0

    def check(self, more: int = 0) -> None:
        """Raise `CorruptCheckpoint` once memory has grown (or would grow by `more`) past the limit.

        What the stand-ins copy (`more`) is also counted: resident memory alone undercounts it when the
        allocator reuses memory an earlier load freed but kept (a second read of a refused file would
        build its bound again on top of the first's), so the copies are bounded before they are made.
        """
        self._copied += more
        if self._copied > self._limit or self._memory.bytes() + more - self._start > self._limit:
            raise CorruptCheckpoint(
                f"{self._source}: unpickling took more than {self._limit >> 20} MiB, more than a real "
                "checkpoint file of its size needs",
                "the file is damaged or made to exhaust memory",
            )

    def peek(self, n: int = 1) -> bytes:
        self.check()
        return self._buf[self._pos : self._pos + max(n, 1)]

    def read(self, n: int = -1) -> bytes:
        self.check()
        start = self._pos
        self._pos = len(self._buf) if n < 0 else min(len(self._buf), start + n)
        return self._buf[start : self._pos]

    def readinto(self, into: Any) -> int:
        chunk = self.read(len(into))
        into[: len(chunk)] = chunk
        return len(chunk)

    def readline(self) -> bytes:
        self.check()
        end = self._buf.find(b"\n", self._pos)
        return self.read(-1 if end < 0 else end + 1 - self._pos)


def _as_is(value: Any) -> Any:
    return value


def _unpickle(
    file: _WatchedInput, allowed: Mapping[tuple[str, str], Any], source: str, kind: type[SafeUnpickler]
) -> Any:
    unpickler = kind(file, allowed, source)
    try:
        return unpickler.load()
    except CkptctlError as exc:
        error = exc
    # Bytes from disk can make the unpickler (and the stand-ins' checks) fail in many ways: unpickling
    # errors, EOF, wrong types for NEWOBJ/REDUCE/BUILD, bad memo references, MemoryError. All of them
    # mean the same thing here, a file that is not what it claims to be.
    except Exception as exc:
        error = CorruptCheckpoint(f"{source}: not a readable pickle ({type(exc).__name__}: {_short(exc)})")
        error.__cause__ = exc
    # A refused load leaves up to its memory bound built in the unpickler's stack and memo, which the
    # traceback's frames keep alive: freed here, or a caller that keeps the error (or reads the file again)
    # holds one bound's worth per refusal (five reads of one hostile file took 700 MiB).
    traceback.clear_frames(error.__traceback__)
    if error.__cause__ is not None:
        traceback.clear_frames(error.__cause__.__traceback__)
    del unpickler
    raise error


def _on_deep_stack(fn: Callable[[], _T], stack_bytes: int, source: str) -> _T:
    """Run `fn` on a new thread with a C stack of `stack_bytes` and return (or raise) what it did.

    The stack is reserved address space: only the pages a deep recursion touches become memory.
    """
    outcome: list[tuple[bool, Any]] = []

    def target() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # handed to the caller's thread, which raises it
            outcome.append((False, exc))

    # threading.stack_size is process-wide: set it only for the start of this one thread.
    with _STACK_LOCK:
        previous = threading.stack_size(-(-stack_bytes // 65536) * 65536)
        try:
            worker = threading.Thread(target=target, name="ckptctl-unpickle", daemon=True)
            worker.start()
        except RuntimeError as exc:  # no address space for the stack
            raise CorruptCheckpoint(f"{source}: the pickle nests more tuples than ckptctl can check") from exc
        finally:
            threading.stack_size(previous)
    worker.join()
    ok, value = outcome[0]
    if ok:
        return value
    raise value


def _short(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= 200 else text[:200] + "..."


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while building many small objects that are all kept.

    Unpickling 100k tensor records creates millions of objects; without this the collector walks the
    growing heap again and again, which costs more than the unpickling itself. Wrap the whole of a
    parse in one pause: each time collection resumes, it walks what was built once more.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


#: Containers nested deeper than this are refused by `check_nesting`: real state dicts nest a dozen levels.
MAX_NESTING = 100


def check_nesting(obj: Any, source: str, limit: int = MAX_NESTING) -> None:
    """Refuse an unpickled object whose containers nest deeper than `limit` (dict keys and sets included).

    Walks each container once, with one frame per level, so a hostile object costs time linear in its
    size and memory bounded by `limit`. A pickle can build a million nested tuples within its memory
    bound; hashing or printing one recurses that deep.

    Raises:
        CorruptCheckpoint: the nesting is deeper than `limit`.
    """
    seen: set[int] = set()
    frames: list[Iterator[Any]] = [iter((obj,))]
    while frames:
        value = next(frames[-1], _END)
        if value is _END:
            frames.pop()
            continue
        if isinstance(value, dict):
            children: Iterator[Any] = itertools.chain.from_iterable(value.items())
        elif isinstance(value, (list, tuple, set, frozenset)):
            children = iter(value)
        elif isinstance(value, StandIn):
            children = iter((getattr(value, "state", None),))
        else:
            continue
        if id(value) in seen:
            continue
        seen.add(id(value))
        if len(frames) > limit:
            raise CorruptCheckpoint(
                f"{source}: containers nest deeper than {limit} levels, deeper than any real checkpoint"
            )
        frames.append(children)


_END = object()


def state_fields(obj: StandIn, source: str) -> dict[str, Any]:
    """The fields a stand-in's BUILD state sets: a dict, or the (dict, slots-dict) pair form.

    Parsers read only the fields they know with `.get`, so unknown ones are ignored.

    Raises:
        CorruptCheckpoint: the state is something else.
    """
    try:
        state = obj.state
    except AttributeError:  # NEWOBJ without BUILD
        return {}
    if type(state) is dict:
        return state
    if type(state) is tuple and len(state) == 2:
        merged: dict[str, Any] = {}
        for part in state:
            # Bounded: the real classes have a handful of fields, and merging copies.
            if part is not None and (type(part) is not dict or len(part) > 16):
                break
            merged.update(part or {})
        else:
            return merged
    raise CorruptCheckpoint(f"{source}: a {obj.stands_for} has an invalid state")


# --------------------------------------------------------------------------------------------------
# The opcode walk (memo, length and size guard).
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _OpcodeTables:
    """The opcode walk's tables, derived from `pickletools.opcodes` (the stdlib's opcode reference)."""

    fast_run: re.Pattern[bytes]
    newline_ops: frozenset[int]
    len1_ops: frozenset[int]
    len4_ops: frozenset[int]
    len8_ops: frozenset[int]


_LONG_BINPUT, _PUT, _STOP, _FRAME = ord("r"), ord("p"), ord("."), 0x95
_GLOBAL, _INST = ord("c"), ord("i")
_SIGNED_LEN4 = frozenset({ord("T"), 0x8B})  # BINSTRING, LONG4: the pickle module reads a signed length


def _by_frequency(item: tuple[int, list[int]]) -> tuple[int, int]:
    """Argument lengths in the order opcodes take them in real pickles (BINGET, LONG_BINGET, BININT1 and
    BININT2 make up most of them), so that the regex tries the likely alternative first."""
    return ({1: 0, 4: 1, 2: 2}.get(item[0], 3), item[0])


#: Below this many bytes a pickle is walked with a small regex (no short-string alternatives, one unit per
#: repetition), which compiles in well under a millisecond; the large one takes tens of milliseconds to
#: compile, which only pays off on pickles big enough to walk for longer than that (a first `verify` or
#: `list` of a small checkpoint would otherwise spend most of its time compiling it).
_SMALL_PICKLE = 256 << 10


@cache
def _opcode_tables(large: bool = True) -> _OpcodeTables:
    fixed: dict[int, list[int]] = {}
    newline_ops, len1_ops, len4_ops, len8_ops = set(), set(), set(), set()
    for op in pickletools.opcodes:
        code = op.code.encode("latin-1")[0]
        n = 0 if op.arg is None else op.arg.n
        if code in (_LONG_BINPUT, _PUT, _STOP, _FRAME):
            continue  # handled one by one
        if n >= 0:
            fixed.setdefault(n, []).append(code)
        elif n == pickletools.UP_TO_NEWLINE:
            newline_ops.add(code)
        elif n == pickletools.TAKEN_FROM_ARGUMENT1:
            len1_ops.add(code)
        elif n in (pickletools.TAKEN_FROM_ARGUMENT4, pickletools.TAKEN_FROM_ARGUMENT4U):
            len4_ops.add(code)
        elif n == pickletools.TAKEN_FROM_ARGUMENT8U:
            len8_ops.add(code)
        else:  # pragma: no cover - a future opcode kind; refuse rather than guess its length
            raise RuntimeError(f"unknown pickle argument kind for {op.name}")

    def one_of(codes: Iterable[int]) -> bytes:
        return b"[" + b"".join(re.escape(bytes([c])) for c in sorted(codes)) + b"]"

    # Runs of opcodes are consumed by one regex match in C: fixed-length ones, and those with a one-byte
    # length (short strings) through one alternative per length. Python handles the rest: long
    # strings and bytes, text opcodes, and the memo writes. Argument-less opcodes come in runs (MEMOIZE
    # follows nearly everything), so the unit is "a run of them, then one opcode with an argument"
    # (`N A`); eight units per repetition of the outer loop halve the regex engine's per-opcode overhead.
    runs = one_of(fixed.pop(0, [])) + b"*+"
    by_length = b"|".join(re.escape(bytes([n])) + (b".{%d}" % n if n else b"") for n in range(256))
    with_argument = [one_of(codes) + b".{%d}" % n for n, codes in sorted(fixed.items(), key=_by_frequency)]
    if large:  # short strings by their one-byte length: otherwise the Python loop below takes them
        with_argument.append(one_of(len1_ops) + b"(?:" + by_length + b")")
    unit = runs + b"(?:" + b"|".join(with_argument) + b")"
    repeated = b"(?:" + unit * 8 + b")*+" if large else b""
    fast = re.compile(repeated + b"(?:" + unit + b")*+" + runs, re.DOTALL)
    return _OpcodeTables(fast, frozenset(newline_ops), frozenset(len1_ops), frozenset(len4_ops), frozenset(len8_ops))


def check_opcodes(data: bytes | memoryview, source: str) -> None:
    """Walk a pickle's opcodes and refuse what could make the C unpickler allocate without bound.

    A memo index beyond the opcode's own position is refused (real picklers number memo entries
    consecutively, one per memoised object), so the unpickler's memo stays within 16 bytes per input
    byte; a string or bytes length beyond the end of the data is refused before anything allocates it.
    A frame longer than `_MAX_FRAME` is refused (the memory checks of `_WatchedInput` run between
    frames). The walk costs about 20 ns per opcode (regex matches consume runs of opcodes in C), a fifth
    of what unpickling costs.

    Raises:
        CorruptCheckpoint: an unknown opcode, a truncated stream, or one of the above.
    """
    buf = bytes(data) if isinstance(data, memoryview) else data
    n = len(buf)
    tables = _opcode_tables(n >= _SMALL_PICKLE)
    pos = 0
    fast = tables.fast_run.match
    unpack_from = struct.unpack_from
    while True:
        pos = fast(buf, pos).end()  # type: ignore[union-attr]  # a `*+` pattern always matches
        if pos >= n:
            raise CorruptCheckpoint(f"{source}: the pickle is truncated (no STOP opcode)")
        op = buf[pos]
        if op in tables.len1_ops:
            if pos + 1 >= n:
                break
            pos += 2 + buf[pos + 1]
        elif op in tables.len4_ops:
            if pos + 5 > n:
                break
            (length,) = unpack_from("<i" if op in _SIGNED_LEN4 else "<I", buf, pos + 1)
            if length < 0:
                raise CorruptCheckpoint(f"{source}: the pickle has a negative length at byte {pos}")
            pos += 5 + length
        elif op in tables.len8_ops:
            if pos + 9 > n:
                break
            (length,) = unpack_from("<Q", buf, pos + 1)
            pos += 9 + length
        elif op == _LONG_BINPUT:
            if pos + 5 > n:
                break
            (index,) = unpack_from("<I", buf, pos + 1)
            _check_memo_index(index, pos, source)
            pos += 5
        elif op == _PUT:
            end = buf.find(b"\n", pos + 1, pos + 12)
            digits = buf[pos + 1 : end]
            if end < 0 or not digits.isdigit():
                raise CorruptCheckpoint(f"{source}: the pickle has an invalid PUT at byte {pos}")
            _check_memo_index(int(digits), pos, source)
            pos = end + 1
        elif op in tables.newline_ops:
            lines = 2 if op in (_GLOBAL, _INST) else 1
            for _ in range(lines):
                end = buf.find(b"\n", pos + 1)
                if end < 0:
                    raise CorruptCheckpoint(f"{source}: the pickle is truncated at byte {pos}")
                pos = end
            pos += 1
        elif op == _FRAME:
            if pos + 9 > n:
                break
            (length,) = unpack_from("<Q", buf, pos + 1)
            if length > _MAX_FRAME:
                raise CorruptCheckpoint(
                    f"{source}: the pickle has a frame of {length} bytes, larger than picklers write"
                )
            pos += 9
        elif op == _STOP:
            return
        else:
            raise CorruptCheckpoint(f"{source}: not a pickle (invalid opcode 0x{op:02x} at byte {pos})")
        if pos > n:
            break
    raise CorruptCheckpoint(f"{source}: the pickle is truncated (data ends inside an opcode)")


def _check_memo_index(index: int, pos: int, source: str) -> None:
    if index > pos:
        raise CorruptCheckpoint(f"{source}: the pickle writes memo entry {index} at byte {pos}, which no pickler does")
