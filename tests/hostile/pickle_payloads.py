"""Hostile pickles, written opcode by opcode: what no pickler writes but a file on disk can hold.

Each payload is a complete protocol-4 pickle of a few megabytes at most. None of them names a global
outside the allowlists unless it says so: they attack the unpickler's memory and stack, not its
allowlist. `plant` puts one where a checkpoint keeps a pickle (a bare pickle file, or the `data.pkl` of a
torch.save zip file).
"""

from __future__ import annotations

import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

_PROTO = b"\x80\x04"
#: Nesting of the deep payloads: enough to overflow an 8 MiB C stack many times over.
DEPTH = 1_000_000


def _get(index: int) -> bytes:
    return b"j" + struct.pack("<I", index)  # LONG_BINGET


def _put(index: int) -> bytes:
    return b"r" + struct.pack("<I", index)  # LONG_BINPUT


def _text(value: str) -> bytes:
    raw = value.encode()
    return b"\x8c" + bytes([len(raw)]) + raw if len(raw) < 256 else b"X" + struct.pack("<I", len(raw)) + raw


def _global(module: str, name: str) -> bytes:
    return _text(module) + _text(name) + b"\x93"  # STACK_GLOBAL


def deep_tuple_key() -> bytes:
    """A dict whose key is a million nested tuples: hashing the key recurses once per level in C."""
    return _PROTO + b"}" + b")" + b"\x85" * DEPTH + b"K\x01s."


def deep_lists() -> bytes:
    """A million lists nested through MARKs (the unpickler's mark stack holds them all)."""
    return _PROTO + b"(" * DEPTH + b"]" + b"l" * DEPTH + b"."


def deep_dicts() -> bytes:
    """{"a": {"a": ...}} 200,000 deep, built through the memo with a constant stack: dict k+1 goes into
    dict k after both exist (memo 0 holds "a", memo k + 1 dict k)."""
    levels = 200_000
    links = (b"}" + _put(k + 1) + b"0" + _get(k) + _get(0) + _get(k + 1) + b"s0" for k in range(1, levels))
    return _PROTO + _text("a") + _put(0) + b"0" + b"}" + _put(1) + b"".join(links) + b"."


def object_flood() -> bytes:
    """Eight million empty lists kept in one list: one opcode byte each, 72 bytes of memory each."""
    return _PROTO + b"(" + b"]" * 8_000_000 + b"l."


def repeated_set() -> bytes:
    """`builtins.set` of one memoised 100,000-item list, called 4,000 times (4 bytes of pickle per call)."""
    items = b"(" + b"".join(b"J" + struct.pack("<i", i) for i in range(100_000)) + b"l" + _put(1)
    calls = b"".join(_get(0) + _get(1) + b"\x85R" for _ in range(4_000))
    return _PROTO + _global("builtins", "set") + _put(0) + items + b"0(" + calls + b"l."


def repeated_encode(size: int = 400_000) -> bytes:
    """`_codecs.encode` of one memoised 400 KB string, called 4,000 times."""
    text = b"X" + struct.pack("<I", size) + b"a" * size + _put(1) + _text("latin1") + _put(2)
    calls = b"".join(_get(0) + _get(1) + _get(2) + b"\x86R" for _ in range(4_000))
    return _PROTO + _global("_codecs", "encode") + _put(0) + text + b"0(" + calls + b"l."


def repeated_large_encode() -> bytes:
    """`_codecs.encode` of one memoised 1 MiB string, called 4,000 times: each call copies more than the
    unpickler reads between two memory checks."""
    return repeated_encode(1 << 20)


def long_key_paths() -> bytes:
    """{K: [{K: 0}, ...20,000]} with one memoised 16 MiB key K: every dotted path through it is 16 MiB."""
    key = "k" * (16 << 20)
    children = b"".join(b"}" + _get(0) + b"K\x00s" for _ in range(20_000))
    return _PROTO + b"}" + _text(key) + _put(0) + b"(" + children + b"ls."


#: name → builder. Each is refused by every reader; none may crash, hang or run out of memory.
PAYLOADS: dict[str, Callable[[], bytes]] = {
    "deep_tuple_key": deep_tuple_key,
    "deep_lists": deep_lists,
    "deep_dicts": deep_dicts,
    "object_flood": object_flood,
    "repeated_set": repeated_set,
    "repeated_encode": repeated_encode,
    "repeated_large_encode": repeated_large_encode,
    "long_key_paths": long_key_paths,
}


def plant(target: Path, payload: bytes) -> None:
    """Replace the pickle of `target` with `payload`: the whole file, or the `data.pkl` of a torch.save zip."""
    if not zipfile.is_zipfile(target):
        target.write_bytes(payload)
        return
    with zipfile.ZipFile(target) as old:
        records = [(info.filename, old.read(info)) for info in old.infolist()]
    replacement = target.with_name(target.name + ".hostile")
    with zipfile.ZipFile(replacement, "w", zipfile.ZIP_STORED) as new:
        for name, data in records:
            new.writestr(name, payload if name.endswith("/data.pkl") else data)
    replacement.replace(target)
