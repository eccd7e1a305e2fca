"""Writing torch.save files: whose objects were read with the safe unpickler, and whose tensors are byte ranges.

`reshard` writes files a framework's own loader `torch.load`s (DeepSpeed's `zero/<param>/fp32.pt`,
`optimizer_state.pt`), built from values ckptctl read without running anything: plain Python values, tensors,
and the stand-ins the safe unpickler handed back for the framework's own classes (`safe_pickle.FrameworkObject`:
a `LossScaler`, a `ZeroStageEnum` member). A stand-in is written back as the class it stands for, by name,
the way pickle wrote it: an enum member as `Class(value)` (GLOBAL + REDUCE), any other object as
`Class.__new__(Class)` given its stored state (GLOBAL + NEWOBJ + BUILD), so that the framework's loader
gets the object it saved. Nothing is imported to write a class name, and no file is ever loaded here.

Two ways in:

- `write_torch_file(obj, path)` writes the archive by hand, without importing torch: the tensors of `obj`
  are `RawTensor`s (a dtype, a shape, and where the row-major bytes are: in memory, or byte ranges of other
  files, streamed a block of a few MiB at a time (mapped, where the file system is local) and cast block by
  block when stored in another dtype). The
  archive is the one torch >= 1.6 writes (`torch/serialization.py` `_save`, `caffe2/serialize/
  inline_container.cc` `PyTorchStreamWriter`): records `<archive>/data.pkl` (pickle protocol 2, each tensor
  `torch._utils._rebuild_tensor_v2` of a persistent id `("storage", torch.<Type>Storage, key, "cpu", numel)`),
  `.format_version`, `.storage_alignment`, `byteorder`, `data/<key>` per storage, `version` and
  `.data/serialization_id`, each stored uncompressed with its data aligned to 64 bytes (an `FB` extra
  field of `Z`s, as torch pads), zip64 fields where a size or offset needs them. `torch.load(weights_only=True)`
  reads it (when it holds no stand-ins). The file is hashed as it is written (`formats.digest.HashingWriter`),
  so that the commit's digests file needs no second read of it: every byte goes out once and in order, so a
  tensor's CRC-32, which its local header holds before its bytes, is known before the header is written: a
  tensor of up to `BLOCK` bytes is gathered first (a single block: its map or read buffer, no copy); a
  larger one stored in files is gone over twice, a block at a time (its CRC, then its bytes), the second time
  from the page cache the first filled, through maps of a file on a local file system (`_block_reader`: no copy
  of either pass).
  Gathering a large tensor whole instead cost as much (measured on 2 cores, `bench/reshard.py` ZeRO-2 --to
  dcp) and doubled the peak memory; memory stays a block or two.
- `save_torch(obj, path)` is `torch.save` with the stand-ins written as their classes, for objects that hold
  torch tensors.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io as pyio
import math
import os
import pickle
import struct
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import dtype_itemsize
from ckptctl.errors import CorruptCheckpoint, StorageError
from ckptctl.formats.digest import HashingWriter
from ckptctl.formats.manifest import FileRecord
from ckptctl.formats.pickle_names import PickledName, PurePickler, global_opcode
from ckptctl.formats.raw_chunks import ByteRange
from ckptctl.formats.safe_pickle import FrameworkObject
from ckptctl.formats.torch_pickle import TorchPickle
from ckptctl.formats.torch_zip import crc32
from ckptctl.io.sweep import block_reader

__all__ = [
    "ByteRange",
    "FdWriter",
    "RawTensor",
    "copy_torch_file",
    "save_torch",
    "write_torch_archive",
    "write_torch_file",
]


@dataclass(frozen=True, slots=True)
class RawTensor:
    """A tensor to write, without torch: its dtype, its shape, and its row-major little-endian bytes.

    Attributes:
        dtype: the written tensor's dtype, torch-style (`float32`, `bfloat16`, ...).
        shape: its shape (`()` for a 0-dim tensor).
        data: its bytes in memory (a flat byte view), or the byte ranges of other files that hold them, in order.
        stored_as: the dtype of the bytes in `data` when it is not `dtype`: they are cast while written.
    """

    dtype: str
    shape: tuple[int, ...]
    data: bytes | memoryview | tuple[ByteRange, ...] = b""
    stored_as: str | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


#: torch's storage class of each dtype (`torch.storage._dtype_to_storage_type_map`), as data.pkl names it.
_STORAGE_TYPES = {
    "float64": "DoubleStorage",
    "float32": "FloatStorage",
    "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage",
    "int64": "LongStorage",
    "int32": "IntStorage",
    "int16": "ShortStorage",
    "int8": "CharStorage",
    "uint8": "ByteStorage",
    "bool": "BoolStorage",
    "complex64": "ComplexFloatStorage",
    "complex128": "ComplexDoubleStorage",
}
#: Bytes read (and, for a cast, produced) per step while streaming a tensor: memory stays this flat.
BLOCK = 4 << 20
#: blake3 threads per written file: one. Each part is hashed on a helper thread beside its write already (and
#: `reshard --threads` writes files side by side); blake3's own pool on top added 0.3-1.3 s of system time
#: (its idle threads spinning) to a 0.55 s `reshard --to dcp` of the ZeRO-2 save of `bench/reshard.py
#: --layers 4 --vocab 16000`, measured on 2 loaded cores.
HASH_THREADS = 1
#: A tensor record of at least this many bytes is written on its own, not copied in with its header: a copy
#: costs more than a write call from this size on.
_OWN_WRITE = 256 << 10
#: torch aligns every record's data to this many bytes (`kFieldAlignment`), so that it can be memory-mapped.
_ALIGNMENT = 64
#: Sizes and offsets from this one on go in zip64 extra fields (a module value so that tests can lower it).
_ZIP64_LIMIT = 0xFFFFFFFF
#: `version` record: the file format version torch >= 2.0 writes (`kProducedFileFormatVersion`).
_FORMAT_VERSION = b"3\n"


@dataclass(frozen=True, slots=True, eq=False)
class _StorageRef:
    """The storage of a `RawTensor`: pickled as its persistent id, as torch pickles a storage."""

    key: str
    tensor: RawTensor


_REBUILD_TENSOR = PickledName("torch._utils", "_rebuild_tensor_v2")


class _Pickler(PurePickler):
    def __init__(self, file: Any, protocol: int | None = None) -> None:
        super().__init__(file, protocol)
        self.storages: list[_StorageRef] = []
        self._globals: dict[str, PickledName] = {}

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is _StorageRef:
            storage_type = self._storage_global(obj.tensor.dtype)
            return ("storage", storage_type, obj.key, "cpu", obj.tensor.numel)
        return None

    def _storage_global(self, dtype: str) -> PickledName:
        name = _STORAGE_TYPES.get(dtype)
        if name is None:
            raise StorageError(f"cannot write a {dtype} tensor without torch")
        # One object per class, so that pickle's memo names it once and refers back to it after.
        return self._globals.setdefault(name, PickledName("torch", name))

    def _save_framework_object(self, obj: FrameworkObject) -> None:
        module, _, name = obj.stands_for.rpartition(".")
        if not module or not name.isidentifier():
            raise StorageError(f"cannot write an object of {obj.stands_for!r} by name")
        self.write(global_opcode(module, name))
        if obj.value is not None:  # an enum member: its class called with its value
            self.save((obj.value,))
            self.write(pickle.REDUCE)
            self.memoize(obj)
            return
        self.write(pickle.EMPTY_TUPLE + pickle.NEWOBJ)
        self.memoize(obj)
        state = getattr(obj, "state", None)
        if state is not None:
            self.save(state)
            self.write(pickle.BUILD)

    def _save_raw_tensor(self, tensor: RawTensor) -> None:
        """As `torch.Tensor.__reduce_ex__` pickles a contiguous CPU tensor with a storage of its own."""
        storage = _StorageRef(str(len(self.storages)), tensor)
        self.storages.append(storage)
        stride = tuple(math.prod(tensor.shape[i + 1 :]) for i in range(len(tensor.shape)))
        self.save(_REBUILD_TENSOR)
        self.save((storage, 0, tensor.shape, stride, False, collections.OrderedDict()))
        self.write(pickle.REDUCE)
        self.memoize(tensor)

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        # Stand-in classes are made per name, so no exact-type dispatch table can hold them.
        kind = type(obj)
        if kind is RawTensor or kind is PickledName or isinstance(obj, FrameworkObject):
            memo = self.memo.get(id(obj))
            if memo is not None:
                self.write(self.get(memo[0]))
            elif kind is RawTensor:
                self._save_raw_tensor(obj)
            elif kind is PickledName:
                self.write(global_opcode(obj.module, obj.name))
                self.memoize(obj)
            else:
                self._save_framework_object(obj)
            return
        super().save(obj, save_persistent_id)


class _PickleModule:
    """What `torch.save(pickle_module=...)` takes: a module-like object with a `Pickler`."""

    Pickler = _Pickler
    __name__ = "pickle"


def save_torch(obj: Any, path: str) -> None:
    """`torch.save(obj, path)` (the zip format torch 1.6+ writes), with safe-unpickler stand-ins of framework
    classes written as those classes. For objects holding torch tensors; `write_torch_file` needs no torch.

    Raises:
        StorageError: the file cannot be written.
    """
    import torch

    try:
        torch.save(obj, path, pickle_module=_PickleModule)
    except OSError as exc:
        raise StorageError(f"cannot write {path}: {exc.strerror or exc}") from exc


def write_torch_file(obj: Any, path: str) -> FileRecord:
    """Write `obj` as torch.save would, without torch: `RawTensor`s in it are written as tensors (their bytes
    read from where they are), stand-ins as their classes, anything else as pickle writes it. Returns the
    size and blake3 digest of the file written (hashed while writing; the file is not synced).

    Raises:
        StorageError: the file cannot be written, or a tensor has a dtype torch.save has no storage class for.
        CorruptCheckpoint: a source range is not there whole (a truncated file), or does not hold the
            tensor's bytes.
    """
    archive = os.path.basename(path).split(".", 1)[0] or "archive"
    fd = _create(path)
    try:
        out = HashingWriter(FdWriter(fd), threads=HASH_THREADS)
        size = write_torch_archive(out, obj, archive, path)
        io.start_writeback(fd, 0, size)  # the commit's fsync (ops.commit.write_digests) then waits less
        return FileRecord(size, out.hexdigest())
    except OSError as exc:
        raise StorageError(f"cannot write {path}: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)


def write_torch_archive(out: HashingWriter, obj: Any, archive: str, path: str) -> int:
    """Write `obj` as `write_torch_file` does, through `out` from where it is on (offsets in the archive count
    from there, as `torch.save` into an open stream counts them: a DCP data file holds one such archive per
    tensor); `archive` names the archive's folder (`torch.save` into a stream names it `archive`), `path` the
    file, for messages. Returns the archive's size.

    Raises:
        OSError: the file cannot be written; StorageError, CorruptCheckpoint: as `write_torch_file`.
    """
    buffer = pyio.BytesIO()
    pickler = _Pickler(buffer, protocol=2)
    pickler.dump(obj)
    zip_out = _ZipOut(out, archive + "/", path)
    zip_out.record("data.pkl", buffer.getvalue())
    zip_out.record(".format_version", b"1")
    zip_out.record(".storage_alignment", str(_ALIGNMENT).encode())
    zip_out.record("byteorder", b"little")  # what `RawTensor` bytes are, whatever this host's order
    for storage in pickler.storages:
        zip_out.tensor_record(f"data/{storage.key}", storage.tensor)
    zip_out.record("version", _FORMAT_VERSION)
    zip_out.record(".data/serialization_id", _serialization_id(zip_out.entries))
    return zip_out.finish()


def copy_torch_file(
    source: TorchPickle,
    path: str,
    data_pkl: bytes,
    keep_storages: Collection[str],
    extra: Mapping[str, bytes] | None = None,
    comment: bytes = b"",
) -> int:
    """Write the torch.save file `source` anew at `path` with `data_pkl` as its pickle, only the storages
    `keep_storages` (keys) of its own, each copied byte for byte (streamed), its other records as they are,
    `extra` records after them (name under the archive's folder -> bytes) and `comment` as the zip's comment.
    Returns the size written.

    Raises:
        StorageError: the file cannot be written.
        CorruptCheckpoint: a record of `source` is not there whole.
    """
    records = sorted(source.records.values(), key=lambda r: r.header_offset)
    prefix = source.prefix
    kept = [r for r in records if r.name.startswith(f"{prefix}data/") and r.name[len(prefix) + 5 :] in keep_storages]
    starts = source.data_starts_of(kept)
    fd = _create(path)
    try:
        out = _ZipOut(FdWriter(fd), prefix, path, patch_fd=fd)
        for record in records:
            name = record.name[len(prefix) :]
            if name == "data.pkl":
                out.record(name, data_pkl)
            elif name == ".data/serialization_id":
                continue  # derived from the records written: made anew below
            elif name.startswith("data/"):
                if name[len("data/") :] in keep_storages:
                    raw = RawTensor("uint8", (record.size,), (ByteRange(source.url, starts[record.name], record.size),))
                    out.tensor_record(name, raw)
            else:
                out.record(name, source.read_record(record))
        for name, data in (extra or {}).items():
            out.record(name, data)
        if f"{prefix}.data/serialization_id" in source.records:
            out.record(".data/serialization_id", _serialization_id(out.entries))
        size = out.finish(comment)
        io.start_writeback(fd, 0, size)
        return size
    except OSError as exc:
        raise StorageError(f"cannot write {path}: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)


class FdWriter:
    """A new file's fd as the binary stream `HashingWriter` (or `_ZipOut`) writes through: every write whole."""

    __slots__ = ("_fd",)

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        _write_all(self._fd, view)
        return len(view)

    def fileno(self) -> int:
        return self._fd


def _create(path: str) -> int:
    """A new file in a staging folder ckptctl made: never through a link, never over something there."""
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        return os.open(path, flags, 0o644)
    except OSError as exc:
        raise StorageError(f"cannot write {path}: {exc.strerror or exc}") from exc


def _serialization_id(entries: list[_Entry]) -> bytes:
    """40 decimal digits naming this save's content, as torch makes them (`PyTorchStreamWriter::
    writeSerializationId`): 20 from the records' CRC-32s, 20 from their names. Derived from the content, so the
    same state written twice gives the same bytes (and the same digests), as torch.save's files do."""
    crcs = hashlib.blake2b(digest_size=8)
    names = hashlib.blake2b(digest_size=8)
    for entry in entries:
        crcs.update(entry.crc.to_bytes(4, "little"))
        names.update(entry.name + b"\0")
    as_digits = [int.from_bytes(h.digest(), "little") % 10**20 for h in (crcs, names)]
    return "".join(f"{value:020d}" for value in as_digits).encode()


@dataclass(frozen=True, slots=True)
class _Entry:
    name: bytes
    offset: int
    size: int
    crc: int


class _ZipOut:
    """The records of one archive, written in order: headers and small records gathered and written at once.

    Through a `HashingWriter` every byte goes out once, in order: a tensor's CRC-32 is taken first (gathered
    whole up to a block, else read once for it), so that it is in its local header before its bytes follow. With `patch_fd` (a copy no one hashes while writing:
    `copy_torch_file`), a tensor's bytes are streamed through a buffer of `BLOCK` bytes instead, and its
    header's CRC-32 is written into `patch_fd` once they are, so that memory stays flat whatever its size.
    """

    def __init__(self, out: HashingWriter | FdWriter, prefix: str, path: str, patch_fd: int | None = None) -> None:
        self.out = out
        self.patch_fd = patch_fd
        self.prefix = prefix
        self.path = path
        self.position = 0
        self.pending = bytearray()
        self.entries: list[_Entry] = []

    def _flush(self) -> None:
        self.out.write(self.pending)
        self.position += len(self.pending)
        # A new buffer, not `clear()`: a hashing thread may still hold a view of the old one for a moment.
        self.pending = bytearray()

    def _header(self, name: bytes, size: int, crc: int) -> int:
        """Append a local header whose data starts aligned; the header's offset in the archive."""
        offset = self.position + len(self.pending)
        zip64 = b""
        if size >= _ZIP64_LIMIT:
            zip64 = struct.pack("<HHQQ", 1, 16, size, size)
        start = offset + 30 + len(name) + len(zip64) + 4
        padding = -start % _ALIGNMENT
        extra = zip64 + b"FB" + struct.pack("<H", padding) + b"Z" * padding
        stored = 0xFFFFFFFF if zip64 else size
        version = 45 if zip64 else 20
        self.pending += struct.pack(
            "<IHHHHHIIIHH", 0x04034B50, version, 0x0800, 0, 0, 0x21, crc, stored, stored, len(name), len(extra)
        )
        self.pending += name + extra
        return offset

    def record(self, name: str, data: bytes) -> None:
        encoded = (self.prefix + name).encode()
        crc = crc32(data, 0)
        offset = self._header(encoded, len(data), crc)
        self.pending += data
        self.entries.append(_Entry(encoded, offset, len(data), crc))

    def tensor_record(self, name: str, tensor: RawTensor) -> None:
        encoded = (self.prefix + name).encode()
        size = tensor.numel * dtype_itemsize(tensor.dtype)
        if self.patch_fd is not None:
            self._streamed_tensor_record(encoded, name, tensor, size, self.patch_fd)
            return
        what = f"{self.path}: {name}"
        data = _gathered(tensor, size, what)
        if data is None:  # larger than a block: its CRC from a first pass, its bytes from a second
            crc = _crc_of(_blocks(tensor, size, what), size, what)
            offset = self._header(encoded, size, crc)
            self._flush()
            # Not checked against the CRC again (a third pass over the bytes, measured +0.15 s of 0.6 s of CPU): a
            # source rewritten between the two reads leaves a record whose CRC `ckptctl verify` of DST refuses.
            written = 0
            for block in _blocks(tensor, size, what):
                self.out.write(block)
                written += len(block)
            if written != size:
                raise CorruptCheckpoint(f"{what}: its source changed while it was read")
            self.position += size
        else:
            crc = crc32(data, 0)
            offset = self._header(encoded, size, crc)
            if size < _OWN_WRITE:  # with its header, in one write (`pending` copies it: the buffer is reused)
                self.pending += data
            else:  # its own write, straight from its map or buffer, not copied into `pending` first
                self._flush()
                self.out.write(data)
                self.position += size
        self.entries.append(_Entry(encoded, offset, size, crc))

    def _streamed_tensor_record(self, encoded: bytes, name: str, tensor: RawTensor, size: int, fd: int) -> None:
        offset = self._header(encoded, size, 0)
        self._flush()
        crc = 0
        written = 0
        for block in _blocks(tensor, size, f"{self.path}: {name}"):
            crc = crc32(block, crc)
            self.out.write(block)
            written += len(block)
        if written != size:
            raise CorruptCheckpoint(f"{self.path}: {name}: its sources hold {written} bytes of its {size}")
        self.position += written
        if crc:
            os.pwrite(fd, struct.pack("<I", crc), offset + 14)
        self.entries.append(_Entry(encoded, offset, size, crc))

    def finish(self, comment: bytes = b"") -> int:
        directory_start = self.position + len(self.pending)
        for entry in self.entries:
            fields = []
            if entry.size >= _ZIP64_LIMIT:
                fields += [entry.size, entry.size]
            if entry.offset >= _ZIP64_LIMIT:
                fields.append(entry.offset)
            extra = struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields) if fields else b""
            stored = 0xFFFFFFFF if entry.size >= _ZIP64_LIMIT else entry.size
            self.pending += struct.pack(
                "<IHHHHHHIIIHHHHHII",
                0x02014B50,
                (3 << 8) | 45,  # made by: unix, zip 4.5
                45 if fields else 20,
                0x0800,
                0,
                0,
                0x21,
                entry.crc,
                stored,
                stored,
                len(entry.name),
                len(extra),
                0,
                0,
                0,
                0o100644 << 16,
                0xFFFFFFFF if entry.offset >= _ZIP64_LIMIT else entry.offset,
            )
            self.pending += entry.name + extra
        directory_end = self.position + len(self.pending)
        count = len(self.entries)
        size = directory_end - directory_start
        # zip64 end records always, as torch writes them; the classic one holds what fits.
        self.pending += struct.pack(
            "<IQHHIIQQQQ", 0x06064B50, 44, (3 << 8) | 45, 45, 0, 0, count, count, size, directory_start
        )
        self.pending += struct.pack("<IIQI", 0x07064B50, 0, directory_end, 1)
        self.pending += struct.pack(
            "<IHHHHIIH",
            0x06054B50,
            0,
            0,
            min(count, 0xFFFF),
            min(count, 0xFFFF),
            min(size, 0xFFFFFFFF),
            min(directory_start, 0xFFFFFFFF),
            len(comment),
        )
        self.pending += comment
        self._flush()
        return self.position


def _write_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])


_buffers = threading.local()


def _buffer(slot: str, size: int) -> memoryview:
    """A buffer of `size` bytes kept per thread and reused for every tensor the thread writes."""
    found = getattr(_buffers, slot, None)
    if found is None or len(found) < size:
        found = memoryview(bytearray(size))
        setattr(_buffers, slot, found)
    return found[:size]


def _blocks(tensor: RawTensor, size: int, what: str) -> Iterator[memoryview]:
    """The bytes of `tensor` as written (cast where stored in another dtype), in blocks of at most `BLOCK`
    (each valid until the next is asked for)."""
    if isinstance(tensor.data, tuple):
        return _cast_blocks(_read_ranges(tensor.data), tensor)
    if len(tensor.data) != size and tensor.stored_as is None:
        raise CorruptCheckpoint(f"{what} holds {len(tensor.data)} bytes but needs {size}")
    return _cast_blocks(iter([memoryview(tensor.data)]), tensor)


def _gathered(tensor: RawTensor, size: int, what: str) -> memoryview | None:
    """The `size` bytes of `tensor` as written, whole: its own bytes where it holds them in memory in its dtype,
    else, when they fit in a block, read (and cast) into a buffer kept per thread, which the next tensor reuses.
    None for a larger tensor, which is streamed instead (memory stays one block).

    Raises:
        CorruptCheckpoint: the sources hold more or fewer bytes than the tensor needs.
    """
    if not isinstance(tensor.data, tuple) and tensor.stored_as in (None, tensor.dtype):
        view = memoryview(tensor.data).cast("B")
        if len(view) != size:
            raise CorruptCheckpoint(f"{what} holds {len(view)} bytes but needs {size}")
        return view
    if size > BLOCK:
        return None
    blocks = _blocks(tensor, size, what)
    first = next(blocks, memoryview(b""))
    if len(first) == size:  # the whole tensor in one block (one range, or one cast): no copy
        if next(blocks, None) is not None:
            raise CorruptCheckpoint(f"{what}: its sources hold more than its {size} bytes")
        return first
    if len(first) > size:
        raise CorruptCheckpoint(f"{what}: its sources hold more than its {size} bytes")
    out = _buffer("gather", size)
    out[: len(first)] = first
    done = len(first)
    for block in blocks:
        if done + len(block) > size:
            raise CorruptCheckpoint(f"{what}: its sources hold more than its {size} bytes")
        out[done : done + len(block)] = block
        done += len(block)
    if done != size:
        raise CorruptCheckpoint(f"{what}: its sources hold {done} bytes of its {size}")
    return out


def _crc_of(blocks: Iterator[memoryview], size: int, what: str) -> int:
    """The CRC-32 of `blocks`, which must hold `size` bytes.

    Raises:
        CorruptCheckpoint: they hold more or fewer.
    """
    crc = 0
    done = 0
    for block in blocks:
        crc = crc32(block, crc)
        done += len(block)
    if done != size:
        raise CorruptCheckpoint(f"{what}: its sources hold {done} bytes of its {size}")
    return crc


def _read_ranges(ranges: Sequence[ByteRange]) -> Iterator[memoryview]:
    """The bytes of `ranges` in order, in blocks of at most `BLOCK` (each valid until the next is asked for):
    mapped where the file system is local, else read into one reused buffer (`_block_reader`)."""
    for byte_range in ranges:
        if byte_range.length <= 0:
            continue
        with _block_reader(byte_range.url) as read_block:
            done = 0
            while done < byte_range.length:
                want = min(BLOCK, byte_range.length - done)
                block = read_block(byte_range.offset + done, want)
                got = len(block)
                io.count_read(got)
                if got != want:
                    raise CorruptCheckpoint(
                        f"{byte_range.url}: ends before byte {byte_range.offset + byte_range.length} "
                        f"(read {got} of {want} bytes at {byte_range.offset + done})",
                        "the file is truncated",
                    )
                yield block
                done += got


@contextlib.contextmanager
def _block_reader(url: str) -> Iterator[Callable[[int, int], memoryview]]:
    """Reads of the file at `url`: (offset, length) -> a view of those bytes (fewer where the file ends), valid
    until the next read (`io.sweep.block_reader`, into one buffer kept per thread where it reads).

    A file on a local file system (`io.maps_safely`) is mapped, one map a block, and its bytes handed over
    with no copy: a tensor larger than a block is gone over twice (its CRC, then its bytes), and read into a
    buffer each time cost a copy of every byte twice (`reshard --to dcp` of `bench/reshard.py`'s ZeRO-2 save,
    `--layers 4 --vocab 16000`, 2 loaded cores: the whole command's CPU 10% less than reading, median of 16
    interleaved pairs). A map goes when its last view does, so memory stays a block or two. Its pages are not
    populated first (`io.map_block`: that cost a cached read ~12%).
    """
    with block_reader(url, _buffer("read", BLOCK), populate=False) as (read_block, _):
        yield read_block


def _cast_blocks(blocks: Iterator[memoryview], tensor: RawTensor) -> Iterator[memoryview]:
    """`blocks` of `tensor.stored_as` elements as `tensor.dtype` elements (unchanged when they are the same)."""
    source = tensor.stored_as
    if source is None or source == tensor.dtype:
        yield from blocks
        return
    in_size, out_size = dtype_itemsize(source), dtype_itemsize(tensor.dtype)
    carry = b""  # an element cut by a block boundary (a range of a file need not end on one)
    for block in blocks:
        data = memoryview(carry + bytes(block)) if carry else block
        whole = len(data) - len(data) % in_size
        carry = bytes(data[whole:])
        count = whole // in_size
        if count:
            out = _buffer("cast", count * out_size)
            cast_elements(data[:whole], source, out, tensor.dtype, count)
            yield out
    if carry:
        raise CorruptCheckpoint(f"a {source} tensor's bytes end inside an element")


def cast_elements(raw: memoryview, dtype: str, out: memoryview, out_dtype: str, count: int) -> None:
    """Cast `count` elements of `dtype` in `raw` into `out` as `out_dtype`: bfloat16 -> float32 by placing the
    16 bits (exact, no import), any other pair through numpy (`safetensors_stream`'s cast)."""
    if dtype == "bfloat16" and out_dtype == "float32":
        # A float32 whose low half is zero is the bfloat16 of its high half: exactly torch's `.float()`
        # (little-endian in and out, so the high half is the last two bytes of each element).
        out[0::4] = out[1::4] = b"\0" * count
        out[2::4] = raw[0::2]
        out[3::4] = raw[1::2]
        return
    from ckptctl.formats.safetensors_stream import cast_block

    cast_block(raw, dtype, out, out_dtype, count)
