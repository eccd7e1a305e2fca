"""`write_torch_file`: torch.save's archive written by hand, read back by torch itself (`torch.load` with
`weights_only=True` where it holds only tensors and plain values; with `mmap=True`, which needs its records
aligned), by Python's zipfile (every CRC-32 checked), and by ckptctl's own reader; stand-ins written back as
their classes; tensors streamed from byte ranges of other files and cast on the way."""

from __future__ import annotations

import enum
import mmap
import struct
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptctl.errors import CorruptCheckpoint, StorageError
from ckptctl.formats import torch_save_writer
from ckptctl.formats.digest import file_digest
from ckptctl.formats.manifest import FileRecord
from ckptctl.formats.safe_pickle import _framework_class
from ckptctl.formats.torch_pickle import load_tensor, open_torch_pickle
from ckptctl.formats.torch_save_writer import ByteRange, RawTensor, write_torch_file
from ckptctl.io import local

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]


class Point:  # written back by name, as `tests.formats.test_torch_save_writer.Point`
    pass


class Stage(enum.IntEnum):
    OPTIMIZER = 1
    GRADIENTS = 2


def _raw(tensor: torch.Tensor) -> RawTensor:
    name = str(tensor.dtype).removeprefix("torch.")
    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return RawTensor(name, tuple(tensor.shape), data)


def _values(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for dtype in DTYPES:
        base = torch.randn(3, 5, generator=generator, dtype=torch.float64) * 100
        out[str(dtype)] = base > 0 if dtype is torch.bool else base.to(dtype)
    out["0-dim"] = torch.tensor(7.25)
    out["empty"] = torch.empty(0, 4, dtype=torch.bfloat16)
    out["large"] = torch.randn(300, 257, generator=generator)  # several blocks (BLOCK is lowered below)
    return out


def _assert_equal(got: Any, want: torch.Tensor) -> None:
    assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)
    assert not got.requires_grad and got.is_contiguous()


def test_every_dtype_loads_with_weights_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_save_writer, "BLOCK", 4096)
    values = _values()
    raw = {name: _raw(t) for name, t in values.items()}
    obj = {"cat_dim": 0, "tensors": raw, "again": raw["torch.float32"], "plain": [1, 2.5, "x", None, (True, b"b")]}
    path = tmp_path / "fp32.pt"
    record = write_torch_file(obj, str(path))
    # Hashed while written: the digest of the bytes on disk, which were not read back to make it.
    assert record == FileRecord(path.stat().st_size, file_digest(str(path)))
    for mapped in (False, True):
        got = torch.load(path, weights_only=True, mmap=mapped)
        assert list(got) == ["cat_dim", "tensors", "again", "plain"] and got["cat_dim"] == 0
        for name, want in values.items():
            _assert_equal(got["tensors"][name], want)
        assert got["again"] is got["tensors"]["torch.float32"]  # one storage, as torch.save writes it
        assert got["plain"] == [1, 2.5, "x", None, (True, b"b")]
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None  # every record's CRC-32
        names = [info.filename for info in archive.infolist()]
        headers = [(info.header_offset, info.filename) for info in archive.infolist()]
    assert names[:4] == ["fp32/data.pkl", "fp32/.format_version", "fp32/.storage_alignment", "fp32/byteorder"]
    assert names[4:-2] == [f"fp32/data/{k}" for k in range(len(values))]
    assert names[-2:] == ["fp32/version", "fp32/.data/serialization_id"]
    raw = path.read_bytes()
    for offset, name in headers:  # each record's data aligned as torch aligns them (its local header's padding)
        name_length, extra_length = struct.unpack_from("<HH", raw, offset + 26)
        assert (offset + 30 + name_length + extra_length) % 64 == 0, name
    # ckptctl's own reader finds each tensor's bytes where the writer put them.
    opened = open_torch_pickle(str(path))
    ref = opened.root["tensors"]["torch.bfloat16"]
    _assert_equal(load_tensor(str(path), ref, opened), values["torch.bfloat16"])


def test_bare_tensor_and_zip64_fields(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Records and offsets past 4 GiB get zip64 fields; with the limit lowered every record has them.
    monkeypatch.setattr(torch_save_writer, "_ZIP64_LIMIT", 16)
    values = _values(1)
    path = tmp_path / "exp_avg.pt"
    write_torch_file({name: _raw(t) for name, t in values.items()}, str(path))
    got = torch.load(path, weights_only=True)
    for name, want in values.items():
        _assert_equal(got[name], want)
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None
    bare = tmp_path / "step.pt"
    write_torch_file(_raw(values["0-dim"]), str(bare))
    _assert_equal(torch.load(bare, weights_only=True), values["0-dim"])


def test_streamed_from_ranges_and_cast(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_save_writer, "BLOCK", 1001)  # blocks that cut elements in two
    weights = torch.randn(64, 33, dtype=torch.float32)
    bf16 = torch.randn(40, 7).bfloat16()
    half = torch.randn(50).half()
    source = tmp_path / "partitions"
    parts = [weights.reshape(-1)[:1000], weights.reshape(-1)[1000:]]
    blobs = [b"head", *(p.numpy().tobytes() for p in parts), bf16.view(torch.uint8).numpy().tobytes()]
    blobs.append(half.numpy().tobytes())
    source.write_bytes(b"".join(blobs))
    starts = [sum(len(b) for b in blobs[:i]) for i in range(len(blobs))]
    url = str(source)
    # Two ranges in the order of the elements (a parameter spanning two ranks' partitions).
    ranges = (ByteRange(url, starts[1], len(blobs[1])), ByteRange(url, starts[2], len(blobs[2])))
    obj = {
        "param": RawTensor("float32", (64, 33), ranges),
        "frozen": RawTensor("float32", (40, 7), (ByteRange(url, starts[3], len(blobs[3])),), stored_as="bfloat16"),
        "half": RawTensor("float32", (50,), (ByteRange(url, starts[4], len(blobs[4])),), stored_as="float16"),
    }
    path = tmp_path / "fp32.pt"
    write_torch_file(obj, str(path))
    got = torch.load(path, weights_only=True)
    _assert_equal(got["param"], weights)
    _assert_equal(got["frozen"], bf16.float())  # as torch's `.float()`
    _assert_equal(got["half"], half.float())


#: `statfs` magic numbers (`linux/magic.h`).
EXT4, NFS, FUSE, LUSTRE = 0xEF53, 0x6969, 0x65735546, 0x0BD00BD0


def test_source_mapped_only_on_a_local_file_system(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A map of a file on NFS/Lustre/FUSE dies of SIGBUS where a read raises: such a file (or one on a file
    system not known) is read, and both ways write the same bytes."""
    monkeypatch.setattr(torch_save_writer, "BLOCK", 1024)
    large = torch.randn(40, 33)  # several blocks: its CRC, then its bytes
    small = torch.randn(50)  # one block: handed over whole
    split = torch.randn(90)  # one block, from two ranges
    bf16 = torch.randn(30).bfloat16()
    blobs = [b"head", *(t.numpy().tobytes() for t in (large, small, split)), bf16.view(torch.uint8).numpy().tobytes()]
    source = tmp_path / "partition"
    source.write_bytes(b"".join(blobs))
    starts = [sum(len(b) for b in blobs[:i]) for i in range(len(blobs))]
    url = str(source)
    half = len(blobs[3]) // 2
    obj = {
        "large": RawTensor("float32", (40, 33), (ByteRange(url, starts[1], len(blobs[1])),)),
        "small": RawTensor("float32", (50,), (ByteRange(url, starts[2], len(blobs[2])),)),
        "split": RawTensor(
            "float32", (90,), (ByteRange(url, starts[3], half), ByteRange(url, starts[3] + half, len(blobs[3]) - half))
        ),
        "cast": RawTensor("float32", (30,), (ByteRange(url, starts[4], len(blobs[4])),), stored_as="bfloat16"),
    }
    maps: list[int] = []

    class CountedMmap(mmap.mmap):
        def __new__(cls, *args: Any, **kwargs: Any) -> CountedMmap:
            maps.append(args[1])
            return super().__new__(cls, *args, **kwargs)

    monkeypatch.setattr(mmap, "mmap", CountedMmap)
    written = {}
    for name, magic in (("ext4", EXT4), ("nfs", NFS), ("fuse", FUSE), ("lustre", LUSTRE), ("unknown", None)):
        monkeypatch.setattr(local, "fs_type", lambda fd, magic=magic: magic)
        monkeypatch.setattr(local, "_MAPS_SAFELY", {})
        maps.clear()
        path = tmp_path / name / "fp32.pt"
        path.parent.mkdir()
        record = write_torch_file(obj, str(path))
        assert record == FileRecord(path.stat().st_size, file_digest(str(path)))
        assert bool(maps) == (name == "ext4"), name
        written[name] = path.read_bytes()
    assert len(set(written.values())) == 1
    got = torch.load(tmp_path / "nfs" / "fp32.pt", weights_only=True)
    for name, want in (("large", large), ("small", small), ("split", split), ("cast", bf16.float())):
        _assert_equal(got[name], want)


def test_file_system_probe_of_this_machine(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    with open(tmp_path / "f", "rb") as f:
        kind = local.fs_type(f.fileno())
        assert local.maps_safely(f.fileno()) == (kind in local._LOCAL_FS_TYPES)
    if sys.platform.startswith("linux"):
        assert kind is not None
        with open("/proc/self/status", "rb") as f:  # procfs: not a local disk's
            assert local.fs_type(f.fileno()) == 0x9FA0 and not local.maps_safely(f.fileno())


def test_truncated_source_and_unknown_dtype_refused(tmp_path: Path) -> None:
    source = tmp_path / "short"
    source.write_bytes(bytes(100))
    short = RawTensor("float32", (40,), (ByteRange(str(source), 0, 160),))
    with pytest.raises(CorruptCheckpoint, match="ends before byte 160"):
        write_torch_file({"param": short}, str(tmp_path / "a.pt"))
    too_few = RawTensor("float32", (40,), (ByteRange(str(source), 0, 100),))
    with pytest.raises(CorruptCheckpoint, match="100 bytes of its 160"):
        write_torch_file(too_few, str(tmp_path / "b.pt"))
    with pytest.raises(StorageError, match="float8_e4m3fn"):
        write_torch_file(RawTensor("float8_e4m3fn", (1,), b"\0"), str(tmp_path / "c.pt"))


def test_stand_ins_written_back_as_their_classes(tmp_path: Path) -> None:
    """A stand-in with state is `Class.__new__` + BUILD, an enum member `Class(value)`, as pickle wrote them."""
    point = _framework_class(f"{__name__}.Point")()
    point.__setstate__({"x": 1, "scale": 2.0**16})
    stage = _framework_class(f"{__name__}.Stage")(2)
    path = tmp_path / "optimizer_state.pt"
    write_torch_file({"scaler": point, "zero_stage": stage, "same": point, "step": _raw(torch.tensor(3.0))}, str(path))
    got = torch.load(path, weights_only=False)  # a file this test wrote
    assert type(got["scaler"]) is Point and vars(got["scaler"]) == {"x": 1, "scale": 2.0**16}
    assert got["zero_stage"] is Stage.GRADIENTS
    assert got["same"] is got["scaler"]
    _assert_equal(got["step"], torch.tensor(3.0))


def test_writing_imports_no_torch(tmp_path: Path) -> None:
    source = tmp_path / "raw"
    source.write_bytes(torch.arange(10, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes())
    code = (
        "import sys\n"
        "from ckptctl.formats.torch_save_writer import ByteRange, RawTensor, write_torch_file\n"
        f"t = RawTensor('float32', (10,), (ByteRange({str(source)!r}, 0, 20),), stored_as='bfloat16')\n"
        f"write_torch_file({{'param': t}}, {str(tmp_path / 'out.pt')!r})\n"
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
    _assert_equal(torch.load(tmp_path / "out.pt", weights_only=True)["param"], torch.arange(10).float())


def test_same_state_gives_same_bytes(tmp_path: Path) -> None:
    """Digests of a reshard are reproducible: the archive (its serialization id too) depends on the content
    only, and a different value changes the id as torch's does."""
    values = _values()
    first, again, other = tmp_path / "a" / "x.pt", tmp_path / "b" / "x.pt", tmp_path / "c" / "x.pt"
    for path, tensors in ((first, values), (again, _values()), (other, {**values, "large": values["large"] + 1})):
        path.parent.mkdir()
        write_torch_file({k: _raw(v) for k, v in tensors.items()}, str(path))
    assert first.read_bytes() == again.read_bytes()

    def serialization_id(path: Path) -> bytes:
        with zipfile.ZipFile(path) as archive:
            return archive.read("x/.data/serialization_id")

    assert len(serialization_id(first)) == 40
    assert serialization_id(first) != serialization_id(other)
