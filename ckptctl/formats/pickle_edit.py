"""Dropping top-level entries of a pickled dict without unpickling it: `drop_dict_keys`.

`slim` of a whole-file checkpoint (a Lightning `.ckpt`: one torch.save zip whose `data.pkl` is the checkpoint
dict) keeps every entry but the training-only ones. Unpickling and pickling again would need the classes the
pickle names; editing the opcodes needs none. The opcodes are read with `pickletools.genops` (a parser: it
runs nothing), a stack of "which opcode started this object" is kept as they would run, and the root dict's
`MARK key value ... SETITEMS` (or `key value SETITEM`) tells where each entry's opcodes lie. The entries
asked for are cut out; every other byte of the pickle is kept as it was.

One link can cross a cut: pickle writes an object once and refers back to it (`BINPUT n` ... `BINGET n`),
so a kept entry may refer to an object first written inside a dropped one (the key `"lr"` of an optimizer's
param groups and of the module's hyperparameters: one interned string; a `betas` tuple given to both). Such a
reference gets the object's own opcodes and `BINPUT` in its place, when the object is whole where it is
memoised (a string, a number, a global, a tuple of such); a reference to a dict, list or object, which pickle
memoises empty and fills in after, is refused with `PickleEditError` (nothing is written), as is a pickle
that numbers its memo implicitly (`MEMOIZE`, protocol 4+: cutting would renumber it).
"""

from __future__ import annotations

import pickletools
from collections.abc import Collection
from dataclasses import dataclass

from ckptctl.errors import CorruptCheckpoint

__all__ = ["PickleEditError", "drop_dict_keys"]


class PickleEditError(CorruptCheckpoint):
    """The pickle cannot be edited safely (its entries are not where an edit can cut them apart)."""


@dataclass(slots=True)
class _Item:
    """An object on the simulated stack: where its opcodes start, and its value when one opcode made a
    string (a dict key)."""

    start: int
    key: str | None = None
    mark: bool = False


_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_STRINGS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING"})


def drop_dict_keys(data: bytes, keys: Collection[str]) -> bytes:
    """`data` (a pickle whose root object is a dict) with the root's entries under `keys` removed.

    Raises:
        PickleEditError: the root is not a dict built entry by entry, or a kept entry refers to an object inside
            a dropped one that is not whole where it is memoised (a dict or list, filled after), or the pickle
            numbers its memo implicitly.
        CorruptCheckpoint: `data` does not parse as a pickle.
    """
    try:
        ops: list[tuple[pickletools.OpcodeInfo, object, int]] = [
            (op, arg, pos or 0) for op, arg, pos in pickletools.genops(data)
        ]
    except Exception as exc:  # genops raises ValueError and others on damaged input
        raise CorruptCheckpoint(f"the pickle does not parse: {exc}") from exc
    ends = [pos for _, _, pos in ops[1:]] + [len(data)]
    spans, memo = _walk(ops, ends)
    cut = sorted((start, end) for key, start, end in spans if key in keys)
    if not cut:
        return data
    index_of = {pos: i for i, (_, _, pos) in enumerate(ops)}
    out = bytearray()
    defined: set[object] = set()

    def dropped(pos: int) -> bool:
        return any(start <= pos < stop for start, stop in cut)

    def emit(first: int, last: int, replay: bool) -> None:
        """Write ops[first:last], skipping what is cut (unless `replay`: an object's own opcodes written again)."""
        for i in range(first, last):
            op, arg, pos = ops[i]
            if not replay and dropped(pos):
                continue
            if op.name in _PUTS:
                defined.add(arg)
            elif op.name in _GETS and arg not in defined:
                found = memo.get(arg)
                if found is None or not dropped(found[1]):
                    raise PickleEditError("the pickle refers to an object before writing it")
                start, put, whole = found
                if not whole:
                    raise PickleEditError(
                        "a kept entry refers to a dict, list or object first written inside a dropped one: the "
                        "pickle cannot be cut apart without running it"
                    )
                emit(index_of[start], index_of[put] + 1, replay=True)
                continue
            out.extend(data[pos : ends[i]])

    emit(0, len(ops), replay=False)
    return bytes(out)


def _walk(
    ops: list[tuple[pickletools.OpcodeInfo, object, int]], ends: list[int]
) -> tuple[list[tuple[str, int, int]], dict[object, tuple[int, int, bool]]]:
    """The root dict's entries as (key, start, end), in the order written; and each memo index's object as
    (where its opcodes start, where its PUT is, whether it is whole there: made by one opcode or a tuple's)."""
    stack: list[_Item] = []
    strings: dict[object, str] = {}  # memo index -> the string stored there (a key may be written as BINGET)
    memo: dict[object, tuple[int, int, bool]] = {}
    entries: list[tuple[str, int, int]] = []
    root_start: int | None = None
    previous = ""
    for (op, arg, pos), end in zip(ops, ends, strict=True):
        name = op.name
        if name in {"MEMOIZE", "FRAME"}:
            raise PickleEditError(f"the pickle uses {name} (protocol 4 or later): not edited")
        if name == "STOP":
            break
        if name in _PUTS:
            if not stack or stack[-1].mark:
                raise PickleEditError(f"{name} at byte {pos} memoises nothing")
            if stack[-1].key is not None:
                strings[arg] = stack[-1].key
            memo[arg] = (stack[-1].start, pos, previous in _WHOLE)
            continue
        previous = name
        if name == "PROTO":
            continue
        if name == "MARK":
            stack.append(_Item(pos, mark=True))
            continue
        before = list(op.stack_before)
        items: list[_Item] = []
        if pickletools.markobject in before:  # what lies above the last MARK, then what the opcode takes below it
            at = _last_mark(stack)
            items = stack[at + 1 :]
            del stack[at:]
            before = before[: before.index(pickletools.markobject)]
        if len(stack) < len(before):
            raise PickleEditError(f"{name} at byte {pos} pops more than the stack holds")
        taken = stack[len(stack) - len(before) :] if before else []
        if before:
            del stack[len(stack) - len(before) :]
        if name == "SETITEMS" and not stack and taken and taken[0].start == root_start:
            entries += _pairs(items, pos)
        elif name == "SETITEM" and not stack and taken and taken[0].start == root_start:
            entries += _pairs(taken[1:], end)  # its one entry: the SETITEM goes with it
        start = min([i.start for i in (*taken, *items)] + [pos])
        key = arg if name in _STRINGS and isinstance(arg, str) else strings.get(arg) if name in _GETS else None
        stack.extend(_Item(start, key) for _ in op.stack_after)
        if root_start is None and name == "EMPTY_DICT" and len(stack) == 1:
            root_start = pos
    if root_start is None:
        raise PickleEditError("the pickle's root is not a dict")
    return entries, memo


def _pairs(items: list[_Item], end: int) -> list[tuple[str, int, int]]:
    if len(items) % 2:
        raise PickleEditError("the root dict's items do not pair up")
    found = []
    for i in range(0, len(items), 2):
        key = items[i].key
        stop = items[i + 2].start if i + 2 < len(items) else end
        if key is None:
            raise PickleEditError("a key of the root dict is not a string written in place")
        found.append((key, items[i].start, stop))
    return found


def _last_mark(stack: list[_Item]) -> int:
    for i in range(len(stack) - 1, -1, -1):
        if stack[i].mark:
            return i
    raise PickleEditError("the pickle pops to a MARK it never set")


#: Opcodes that push a whole object made from their own argument (nothing popped, nothing referred to).
_ATOMS = _STRINGS | {
    "GLOBAL",
    "BININT",
    "BININT1",
    "BININT2",
    "LONG1",
    "LONG4",
    "BINFLOAT",
    "INT",
    "LONG",
    "FLOAT",
    "BINBYTES",
    "SHORT_BINBYTES",
}

#: The last opcode before a PUT when the object memoised is whole there (nothing fills it in after).
_WHOLE = _ATOMS | {"EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "NONE", "NEWTRUE", "NEWFALSE"}
