"""torch.save archives of one tensor: decoding through torch's allowlist, and locating the raw bytes."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch

from ckptctl.errors import CorruptCheckpoint, UnsafePickle
from ckptctl.formats.torch_save import decode_tensor, inspect_archive, inspect_archive_at, raw_record


def _saved(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _raw(tensor: torch.Tensor) -> bytes:
    flat = tensor.contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


TENSORS = {
    "float32": torch.randn(3, 5),
    "bfloat16": torch.randn(4, 2).to(torch.bfloat16),
    "float16": torch.randn(7).half(),
    "int64": torch.arange(6).reshape(2, 3),
    "uint16": torch.arange(5, dtype=torch.int32).to(torch.uint16),  # saved through _rebuild_tensor_v3
    "bool": torch.tensor([True, False]),
    "scalar": torch.tensor(2.5),
    "empty": torch.zeros(0, 3),
    "row": torch.randn(1, 4),
}


@pytest.mark.parametrize("name", list(TENSORS))
def test_decode_and_raw_record_agree_with_torch(name: str) -> None:
    tensor = TENSORS[name]
    blob = _saved(tensor)
    decoded = decode_tensor(blob, name)
    assert decoded.dtype == tensor.dtype and torch.equal(decoded, tensor)
    start, end = raw_record(blob) or (None, None)
    assert start is not None and end is not None
    assert blob[start:end] == _raw(tensor)
    info = inspect_archive(blob, name)
    assert (info.dtype, info.shape) == (str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


def test_views_into_a_larger_storage_point_at_their_own_bytes() -> None:
    base = torch.arange(40, dtype=torch.float32).reshape(8, 5)
    view = base[3:6]  # storage offset 15 elements, storage of 40
    blob = _saved(view)
    found = raw_record(blob)
    assert found is not None
    assert blob[found[0] : found[1]] == _raw(view)


def test_non_row_major_tensors_have_no_raw_record() -> None:
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    blob = _saved(tensor)
    assert raw_record(blob) is None
    assert torch.equal(decode_tensor(blob, "t"), tensor)


def test_memoryviews_of_a_larger_buffer_work_without_copying_the_data() -> None:
    tensor = torch.randn(64, 64)
    blob = _saved(tensor)
    buffer = bytearray(b"x" * 100 + blob + b"y" * 50)
    view = memoryview(buffer)[100 : 100 + len(blob)]
    found = raw_record(view)
    assert found is not None
    assert bytes(view[found[0] : found[1]]) == _raw(tensor)


def _range_reads(buffer: bytes, base: int, length: int) -> tuple[list[tuple[int, int]], object]:
    """A `read_at` over `length` bytes of `buffer` from `base` (fewer past the end), logging each read."""
    reads: list[tuple[int, int]] = []

    def read_at(start: int, n: int) -> bytes:
        reads.append((start, n))
        return buffer[base + start : base + min(start + n, length)]

    return reads, read_at


@pytest.mark.parametrize("name", [*TENSORS, "large"])
def test_range_reads_locate_what_the_whole_archive_does_without_reading_the_data(name: str) -> None:
    # An item inside its DCP data file: `read_at` reads relative to the item.
    tensor = torch.randn(256, 256) if name == "large" else TENSORS[name]
    blob = _saved(tensor)
    reads, read_at = _range_reads(b"x" * 100 + blob + b"y" * 50, 100, len(blob))
    found = inspect_archive_at(read_at, len(blob), name)  # type: ignore[arg-type]
    assert found == inspect_archive(blob, name)
    if name == "large":  # its first and last few KiB, one read each: not the 256 KiB of data in between
        assert len(reads) == 2 and sum(n for _, n in reads) <= 8 << 10


@pytest.mark.parametrize("cut", [40, 300, 1 << 20])
def test_range_reads_of_a_cut_short_archive_are_corrupt(cut: int) -> None:
    blob = _saved(torch.randn(256, 256))
    # The item says it is `len(blob)` long; the file ends `cut` bytes earlier (reads come back short).
    _, read_at = _range_reads(blob[: max(0, len(blob) - cut)], 0, len(blob))
    with pytest.raises(CorruptCheckpoint):
        inspect_archive_at(read_at, len(blob), "cut")  # type: ignore[arg-type]


class Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_hostile_archives_are_refused_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    blob = _saved(Evil(marker))
    with pytest.raises(UnsafePickle, match=r"posix\.system") as info:
        decode_tensor(blob, "evil")
    assert "weights_only=False" not in str(info.value)  # torch's advice to disable the allowlist is not passed on
    with pytest.raises(UnsafePickle, match=r"posix\.system"):
        inspect_archive(blob, "evil")
    assert not marker.exists()


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"not a zip at all",
        _saved(torch.randn(8, 8))[:-40],  # the zip directory is cut off
        _saved(torch.randn(8, 8))[:300],
    ],
)
def test_damaged_archives_are_corrupt(blob: bytes) -> None:
    with pytest.raises(CorruptCheckpoint):
        decode_tensor(blob, "bad")
    with pytest.raises(CorruptCheckpoint):
        inspect_archive(blob, "bad")


def test_an_archive_of_something_else_is_not_a_tensor() -> None:
    blob = _saved({"a": torch.ones(2)})
    with pytest.raises(CorruptCheckpoint, match="holds a dict"):
        decode_tensor(blob, "dict")
    with pytest.raises(CorruptCheckpoint, match="plain tensor"):
        inspect_archive(blob, "dict")


def test_archives_with_the_same_pickle_each_locate_their_own_bytes_and_name_their_own_failures() -> None:
    # Tensors of one dtype and shape pickle to the same data.pkl bytes, parsed once and shared.
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    for tensor in (a, b, a):
        blob = _saved(tensor)
        found = inspect_archive(blob, "same")
        assert blob[found.start : found.end] == _raw(tensor)
    # A pickle that fails is not kept: every archive holding it fails, each under its own name.
    for name in ("first", "second"):
        with pytest.raises(CorruptCheckpoint, match=f"^{name}: .*plain tensor"):
            inspect_archive(_saved({"a": torch.ones(2)}), name)
        with pytest.raises(UnsafePickle, match=f"^{name} data.pkl"):
            inspect_archive(_saved(Evil(Path(os.devnull))), name)
