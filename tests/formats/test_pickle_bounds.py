"""The unpickler's bounds: memory, stand-in copies, nesting, frames and tensor paths.

Each hostile pickle runs in a child process (`python -c`), so that a crash or a runaway allocation shows up
as the child's exit status and peak RSS instead of taking the test run down.
"""

from __future__ import annotations

import pickle
import struct
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from ckptctl.errors import CorruptCheckpoint
from ckptctl.formats.dcp_metadata_classes import DCP_METADATA_GLOBALS
from ckptctl.formats.safe_pickle import MAX_NESTING, check_nesting, check_opcodes, safe_loads
from ckptctl.formats.torch_pickle import tensor_refs
from ckptctl.formats.torch_pickle_classes import TORCH_PICKLE_GLOBALS, load_torch_pickle
from tests.hostile.pickle_payloads import PAYLOADS


def _in_child(payload: str, call: str) -> tuple[int, str, int]:
    """Run `call` on `PAYLOADS[payload]()` in a child; its exit status, output and peak RSS in MiB."""
    code = textwrap.dedent(f"""
        import resource
        from ckptctl.errors import CorruptCheckpoint
        from ckptctl.formats.dcp_metadata import parse_dcp_metadata
        from ckptctl.formats.torch_pickle_classes import load_torch_pickle
        from tests.hostile.pickle_payloads import PAYLOADS
        data = PAYLOADS[{payload!r}]()
        start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            {call}(data, "hostile")
            print("accepted")
        except CorruptCheckpoint as exc:
            print("refused:", exc.message)
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start) >> 10)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = done.stdout.strip().splitlines()
    return done.returncode, "\n".join(lines[:-1]) + done.stderr, int(lines[-1]) if lines else -1


@pytest.mark.parametrize("payload", ["object_flood", "repeated_set", "repeated_encode"])
def test_runaway_memory_is_refused_near_the_bound(payload: str) -> None:
    code, output, grown_mib = _in_child(payload, "load_torch_pickle")
    assert code == 0, output
    assert output.startswith("refused:"), output
    assert "real checkpoint file" in output
    # The bound is 192 MiB for these sizes; one 128 KiB read of EMPTY_LISTs adds at most ~30 MiB.
    assert grown_mib < 256, (grown_mib, output)


@pytest.mark.parametrize("call", ["load_torch_pickle", "parse_dcp_metadata"])
def test_a_million_deep_tuple_key_does_not_crash(call: str) -> None:
    # Hashing the key recursed a million C frames deep: SIGSEGV (exit -11) before.
    code, output, _ = _in_child("deep_tuple_key", call)
    assert code == 0, output
    if call == "parse_dcp_metadata":
        assert "not a torch DCP metadata pickle" in output


def test_the_deep_key_itself_is_refused_when_walked() -> None:
    root = load_torch_pickle(PAYLOADS["deep_tuple_key"](), "x")
    with pytest.raises(CorruptCheckpoint, match="nest deeper"):
        list(tensor_refs(root))


def test_check_nesting_counts_keys_sets_and_stand_in_states() -> None:
    deep: Any = 0
    for _ in range(MAX_NESTING + 1):
        deep = (deep,)
    for holder in ({deep: 1}, [{1, deep}], {"a": [deep]}):
        with pytest.raises(CorruptCheckpoint, match="nest deeper"):
            check_nesting(holder, "x")
    shallow: Any = 0
    for _ in range(MAX_NESTING - 5):
        shallow = [shallow]
    check_nesting({"a": shallow}, "x")
    cycle: list[Any] = []
    cycle.append(cycle)
    check_nesting(cycle, "x")  # visited once: a cycle is not infinitely deep


def test_tensor_paths_are_bounded_without_copying_long_keys() -> None:
    root = load_torch_pickle(PAYLOADS["long_key_paths"](), "x")
    with pytest.raises(CorruptCheckpoint, match="longer than"):
        list(tensor_refs(root))


def test_frames_larger_than_picklers_write_are_refused() -> None:
    body = b"(" + b"]" * (300 << 10) + b"l."
    with pytest.raises(CorruptCheckpoint, match="frame"):
        check_opcodes(b"\x80\x04\x95" + struct.pack("<Q", len(body)) + body, "x")


def test_real_frames_and_protocol_2_pickles_still_load() -> None:
    value = {"state": {i: {"step": i, "name": "x" * 300} for i in range(2_000)}, "groups": [(0.9, 0.999)]}
    for protocol in (2, 4, 5):
        data = pickle.dumps(value, protocol=protocol)
        assert safe_loads(data, {}, "x") == value
        assert safe_loads(memoryview(data), {}, "x") == value


def test_format_encoding_stand_in_takes_only_ints() -> None:
    # int() would parse a 4,000-digit string into a new object on every call of a memoised REDUCE.
    reduce_on_text = (
        b"\x80\x04\x8c%torch.distributed.checkpoint.metadata\x8c\x14_MEM_FORMAT_ENCODING\x93\x8c\x0212\x85R."
    )
    with pytest.raises(CorruptCheckpoint):
        safe_loads(reduce_on_text, DCP_METADATA_GLOBALS, "x")


def test_a_pattern_matched_global_is_one_class_per_load() -> None:
    module = b"transformers.training_args_x"
    name = b"\x8c" + bytes([len(module)]) + module + b"\x8c\x03Foo\x93"
    data = b"\x80\x04(" + name * 3 + b"t."
    first, second, third = safe_loads(data, TORCH_PICKLE_GLOBALS, "x")
    assert first is second is third
