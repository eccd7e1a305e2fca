"""The allowlisting unpickler: hostile pickles are refused before anything runs, bad bytes come out clean."""

from __future__ import annotations

import importlib
import io
import os
import pickle
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptctl.errors import CorruptCheckpoint, UnsafePickle, UnsupportedClass
from ckptctl.formats.dcp_metadata import parse_dcp_metadata
from ckptctl.formats.dcp_metadata_classes import DCP_METADATA_GLOBALS
from ckptctl.formats.safe_pickle import check_opcodes, safe_loads


class Payload:
    """Pickles as a call of `func(*args)`: what a malicious checkpoint carries."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func = func
        self.args = args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.func, self.args


def payloads(marker: Path) -> dict[str, tuple[str, Payload]]:
    """name → (the global the pickle names, a payload that would create `marker` if it ran)."""
    touch = f"touch {marker}"
    return {
        "os.system": ("posix.system", Payload(os.system, touch)),
        "builtins.eval": ("builtins.eval", Payload(eval, f"__import__('os').system('{touch}')")),
        "builtins.exec": ("builtins.exec", Payload(exec, f"import os; os.system('{touch}')")),
        "subprocess.Popen": ("subprocess.Popen", Payload(subprocess.Popen, ["touch", str(marker)])),
        "importlib.import_module": ("importlib.import_module", Payload(importlib.import_module, "os")),
        "builtins.getattr": (
            "builtins.getattr",
            Payload(getattr, Payload(importlib.import_module, "os"), "system"),
        ),
    }


def _metadata_with(payload: Any) -> bytes:
    """A genuine torch Metadata whose planner_data hides a payload after all the allowed globals."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    return pickle.dumps(Metadata(state_dict_metadata={"x": BytesStorageMetadata()}, planner_data=payload))


@pytest.mark.parametrize("name", list(payloads(Path("/nonexistent"))))
@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_hostile_globals_are_refused_and_nothing_runs(name: str, protocol: int, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    global_name, payload = payloads(marker)[name]
    for data in (pickle.dumps(payload, protocol=protocol), _metadata_with(payload)):
        with pytest.raises(UnsafePickle) as info:
            parse_dcp_metadata(data, "evil/.metadata")
        assert global_name in str(info.value)
        assert "evil/.metadata" in str(info.value)
    assert not marker.exists()


def test_named_modules_are_never_imported() -> None:
    assert "this" not in sys.modules
    with pytest.raises(UnsupportedClass, match=r"this\.s"):  # refused, not accused: `this` runs no code
        safe_loads(b"cthis\ns\n.", DCP_METADATA_GLOBALS, "x")
    assert "this" not in sys.modules  # importing `this` prints the Zen of Python: nothing was imported


def test_persistent_ids_and_extension_codes_are_refused() -> None:
    with pytest.raises(UnsafePickle):
        safe_loads(b"\x80\x02X\x01\x00\x00\x00aQ.", DCP_METADATA_GLOBALS, "x")  # BINPERSID
    with pytest.raises(CorruptCheckpoint):
        safe_loads(b"\x80\x02\x82\x01.", DCP_METADATA_GLOBALS, "x")  # EXT1 of an unregistered code


@pytest.mark.parametrize(
    "data",
    [
        # The stand-ins take no arguments: REDUCE on an allowlisted class is refused.
        b"\x80\x04\x8c%torch.distributed.checkpoint.metadata\x8c\x08Metadata\x93K\x01\x85R.",
        # torch.Size of a list (copying it per call would amplify a small file into a huge heap).
        b"\x80\x04\x8c\x05torch\x8c\x04Size\x93]K\x01a\x85R.",
        # A dtype is a name, not something to call.
        b"\x80\x04\x8c\x05torch\x8c\x07float32\x93)R.",
        # A path of ten thousand parts.
        b"\x80\x04\x8c\x07pathlib\x8c\tPosixPath\x93(" + b"\x8c\x01a" * 10_000 + b"tR.",
    ],
)
def test_allowlisted_names_cannot_be_abused(data: bytes) -> None:
    with pytest.raises(CorruptCheckpoint):
        safe_loads(data, DCP_METADATA_GLOBALS, "x")


@pytest.mark.parametrize(
    "bomb",
    [
        b"\x80\x04N" + b"r\x00\x00\x00\x02" + b".",  # LONG_BINPUT at index 2**25: a 512 MiB memo
        b"(Np33554432\n.",  # the same through the text PUT opcode
        b"\x80\x04\x8e" + (1 << 40).to_bytes(8, "little") + b".",  # BINBYTES8 claiming a terabyte
        b"\x80\x04X\xff\xff\xff\x7f.",  # BINUNICODE claiming 2 GiB
    ],
)
def test_memory_bombs_are_refused_without_allocating(bomb: bytes) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    with pytest.raises(CorruptCheckpoint):
        parse_dcp_metadata(bomb, "bomb")
    assert time.monotonic() - start < 1.0
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 100_000


def test_deep_nesting_is_a_clean_error() -> None:
    deep = b"\x80\x04" + b"]" * 200_000 + b"a" * 199_999 + b"."
    with pytest.raises(CorruptCheckpoint, match="not a torch DCP metadata"):
        parse_dcp_metadata(deep, "deep")


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=300)
    | st.binary(max_size=300),
    lambda inner: (
        st.lists(inner, max_size=5) | st.tuples(inner, inner) | st.dictionaries(st.text(max_size=10), inner, max_size=5)
    ),
    max_leaves=30,
)


@settings(max_examples=150, deadline=None)
@given(value=_values, protocol=st.integers(3, 5))
def test_opcode_walk_accepts_what_python_pickles(value: Any, protocol: int) -> None:
    data = pickle.dumps(value, protocol=protocol)
    check_opcodes(data, "x")
    assert safe_loads(data, {}, "x") == value


@settings(max_examples=50, deadline=None)
@given(value=st.recursive(st.integers() | st.text(max_size=20), lambda i: st.lists(i, max_size=4), max_leaves=20))
def test_opcode_walk_accepts_protocol_0_and_1(value: Any) -> None:
    for protocol in (0, 1):
        data = pickle.dumps(value, protocol=protocol)
        check_opcodes(data, "x")
        assert safe_loads(data, {}, "x") == value


def _parse_or_corrupt(data: bytes) -> None:
    start = time.monotonic()
    try:
        parse_dcp_metadata(data, "fuzzed/.metadata")
    except CorruptCheckpoint:  # UnsafePickle included
        pass
    assert time.monotonic() - start < 2.0


_fuzz = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_fuzz
@given(data=st.binary(max_size=512), framed=st.booleans())
def test_fuzz_random_bytes(data: bytes, framed: bool) -> None:
    _parse_or_corrupt((b"\x80\x04" if framed else b"") + data)


@_fuzz
@given(flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 7)), min_size=1, max_size=8))
def test_fuzz_bit_flips_of_a_real_metadata(real_metadata: bytes, flips: list[tuple[float, int]]) -> None:
    data = bytearray(real_metadata)
    for where, bit in flips:
        data[int(where * len(data))] ^= 1 << bit
    _parse_or_corrupt(bytes(data))


@_fuzz
@given(cut=st.floats(0, 1), splice=st.binary(max_size=16), where=st.floats(0, 1))
def test_fuzz_truncated_and_spliced_real_metadata(
    real_metadata: bytes, cut: float, splice: bytes, where: float
) -> None:
    _parse_or_corrupt(real_metadata[: int(cut * len(real_metadata))])
    at = int(where * len(real_metadata))
    _parse_or_corrupt(real_metadata[:at] + splice + real_metadata[at + len(splice) :])


def test_unpickler_input_is_a_plain_stream() -> None:
    # The same bytes through a memoryview parse the same (callers pass slices of mapped files).
    data = pickle.dumps({"a": [1, 2, (3, "x")]}, protocol=4)
    assert safe_loads(memoryview(data), {}, "x") == safe_loads(io.BytesIO(data).getvalue(), {}, "x")


@pytest.mark.parametrize(
    ("pickled", "qualified", "package"),
    [
        # A class of a newer megatron-core (the classes of older ones, too: MCoreMetadata of 0.15 saves).
        (
            b"\x80\x02cmegatron.core.dist_checkpointing.strategies.torch\nMCoreMetadata\n)\x81.",
            "megatron.core.dist_checkpointing.strategies.torch.MCoreMetadata",
            "megatron",
        ),
        # A torch class no DCP metadata allowlist holds.
        (
            b"\x80\x02ctorch.distributed.checkpoint.planner\nLoadPlan\n)\x81.",
            "torch.distributed.checkpoint.planner.LoadPlan",
            "torch",
        ),
        (
            b"\x80\x02cdeepspeed.runtime.engine\nDeepSpeedEngine\n)\x81.",
            "deepspeed.runtime.engine.DeepSpeedEngine",
            "deepspeed",
        ),
    ],
)
def test_an_unknown_class_of_a_known_framework_is_unsupported_not_a_forgery(
    pickled: bytes, qualified: str, package: str
) -> None:
    import ckptctl  # noqa: F401  (registers the framework packages' classes)

    with pytest.raises(UnsupportedClass) as info:
        safe_loads(pickled, DCP_METADATA_GLOBALS, "iter_0000100/.metadata")
    assert f"unsupported class {qualified} (from {package})" in info.value.message
    assert "not what it claims" not in f"{info.value.message} {info.value.hint}"


@pytest.mark.parametrize("name", list(payloads(Path("/nonexistent"))))
def test_a_foreign_global_is_still_called_a_forgery(name: str) -> None:
    global_name, payload = payloads(Path("/nonexistent"))[name]
    with pytest.raises(UnsafePickle) as info:
        safe_loads(pickle.dumps(payload, protocol=2), DCP_METADATA_GLOBALS, "iter_0000100/.metadata")
    assert global_name in info.value.message and "unsupported class" not in info.value.message
    assert "not what it claims" in info.value.hint
