"""Any fsspec URL (`s3://`, `gs://`, `memory://`, ...): object stores reached the way their own tools reach
them.

`s3://` goes through s3fs and botocore, so the standard AWS settings apply (`AWS_PROFILE`,
`AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ENDPOINT_URL` for S3-compatible stores such
as MinIO), as does fsspec's own configuration (`FSSPEC_S3_*` variables, `~/.config/fsspec/`). Every call is
retried and bounded in time by `failures.call`.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import itertools
import os
import posixpath
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

from ckptctl.errors import CheckpointNotFound, CkptctlError, StorageError
from ckptctl.io import failures
from ckptctl.io.backend import Backend
from ckptctl.io.counting import count_read
from ckptctl.io.failures import call, is_transient, remote_error
from ckptctl.io.parallel import parallel_map, workers
from ckptctl.io.paths import DirEntry, bucket_of, parent_of, scheme_of

__all__ = [
    "FSSPEC",
    "MULTIPART_THRESHOLD",
    "PART_SIZE",
    "FsspecBackend",
    "check_bucket",
    "entry_of",
    "multipart_upload",
]

#: Files at least this large go to S3 as a multipart upload whose parts are sent in parallel; smaller ones as
#: one PUT, which costs the store less (rclone's `upload_cutoff`, 200 MiB; the suite's S3 server, moto, took
#: about twice as long for a 64 MiB file sent in parts as for one PUT of it).
MULTIPART_THRESHOLD = 200 << 20
#: The size of a part (S3 takes 5 MiB to 5 GiB, at most 10,000 parts: larger files get larger parts).
PART_SIZE = 16 << 20


class FsspecBackend(Backend):
    """Any URL with a scheme fsspec has a driver for (no listings cache: see `_fs`)."""

    def list_dir(self, url: str) -> list[DirEntry]:
        fs, path = _fs(url)
        out = [entry_of(info) for info in call(lambda: fs.ls(path, detail=True), f"listing {url}", url)]
        return sorted(out, key=lambda d: d.name)

    def list_tree(self, url: str) -> dict[str, DirEntry]:
        """One paginated listing of the whole prefix rather than one per folder."""
        found, prefix = self.find(url, withdirs=False)
        return {
            name[len(prefix) :]: entry_of(info)
            for name, info in found.items()
            if name.startswith(prefix) and info.get("type") != "directory"
        }

    def find(self, url: str, *, withdirs: bool) -> tuple[dict[str, dict[str, Any]], str]:
        """Every object below the folder `url` (and its folders, `withdirs`) as fsspec details keyed by path,
        and the prefix of those paths that the folder is."""
        fs, path = _fs(url)
        found = call(lambda: fs.find(path, detail=True, withdirs=withdirs), f"listing {url}", url)
        return found, path.rstrip("/") + "/"

    def exists(self, url: str) -> bool:
        fs, path = _fs(url)
        found = bool(call(lambda: fs.exists(path), f"looking up {url}", url))
        if not found:
            _check_bucket(url, fs)
        return found

    def is_dir(self, url: str) -> bool:
        fs, path = _fs(url)
        found = bool(call(lambda: fs.isdir(path), f"looking up {url}", url))
        if not found:
            _check_bucket(url, fs)
        return found

    def file_size(self, url: str) -> int:
        fs, path = _fs(url)
        return int(call(lambda: fs.size(path), f"sizing {url}", url))

    def read(self, url: str, start: int, length: int | None, cap: int | None) -> bytes:
        """A range read (`cat_file`)."""
        want = length if length is not None else (None if cap is None else cap + 1)  # one byte over: too large
        fs, path = _fs(url)
        end = None if want is None else start + want
        data: bytes = call(lambda: fs.cat_file(path, start=start, end=end), f"reading {url}", url)
        count_read(len(data))
        return data

    @contextlib.contextmanager
    def open_read(self, url: str) -> Iterator[IO[bytes]]:
        """Opened without a read-ahead cache: every `read(n)` is one range request of `n` bytes, so that what
        the caller counts is what crossed the network."""
        fs, path = _fs(url)
        f = call(lambda: fs.open(path, "rb", cache_type="none"), f"opening {url}", url)
        with f:
            yield f

    def write_atomic(self, url: str, data: bytes) -> None:
        """A single PUT, which is atomic."""
        fs, path = _fs(url)
        call(lambda: fs.pipe_file(path, data), f"writing {url}", url)

    def upload(self, path: str, url: str) -> None:
        """A PUT; on S3 a multipart upload with parts in parallel from `MULTIPART_THRESHOLD` bytes."""
        fs, remote = _fs(url)
        size = os.path.getsize(path)
        if size >= MULTIPART_THRESHOLD and scheme_of(url) in ("s3", "s3a"):
            bucket, key, _ = fs.split_path(remote)
            multipart_upload(fs.call_s3, bucket, key, path, size, url)
        else:
            call(lambda: fs.put_file(path, remote), f"uploading {url}", url)

    def delete_file(self, url: str) -> None:
        fs, path = _fs(url)
        with contextlib.suppress(FileNotFoundError):
            call(lambda: fs.rm_file(path), f"deleting {url}", url)

    def delete_files(self, urls: Sequence[str]) -> None:
        """Batched deletes (S3 takes 1,000 keys a request)."""
        fs, _ = _fs(urls[0])
        paths = [_fs(url)[1] for url in urls]
        with contextlib.suppress(FileNotFoundError):
            call(lambda: fs.rm(paths), f"deleting {len(paths)} objects below {parent_of(urls[0])}", urls[0])

    def delete_tree(self, url: str) -> None:
        fs, path = _fs(url)
        with contextlib.suppress(FileNotFoundError):
            call(lambda: fs.rm(path, recursive=True), f"deleting {url}", url)


class _PartSlots:
    """The parts in flight in this process, all files together (each holds a part's bytes in memory), handed
    out in the order the uploads began, and within an upload in part order, rather than to whichever thread
    asks first.

    The files of a sync go up side by side (each checkpoint's weights file is one of its completion markers,
    and the checkpoints' markers go in parallel), each a multipart upload with a thread for each of its parts.
    Served first come, every upload advanced at the pace of the others and all of them ended together: their
    completions, in which the store builds each object out of its parts (seconds for a large one, with
    nothing sent meanwhile), came last, side by side, with no part left to send (at 5 x 256 MiB to moto, the
    last 9 of a sync's 28 seconds). Served in order, one upload's parts go at a time, as `aws s3 sync`'s do
    (its queue of parts is first in, first out), and each completion but the last overlaps the parts of the
    uploads after it.
    """

    def __init__(self, count: int) -> None:
        self.lock = threading.Lock()
        self.free = count
        self.waiting: list[tuple[tuple[int, int], threading.Event]] = []  # a heap, by (upload, part)
        self.uploads = itertools.count()

    def ticket(self) -> int:
        """An upload's place in the order (taken as it begins)."""
        return next(self.uploads)

    @contextlib.contextmanager
    def hold(self, upload: int, part: int) -> Iterator[None]:
        with self.lock:
            if self.free:
                self.free -= 1
                turn = None
            else:
                turn = threading.Event()
                heapq.heappush(self.waiting, ((upload, part), turn))
        if turn is not None:
            turn.wait()  # the slot is handed over by the part that ends (`free` stays as it is)
        try:
            yield
        finally:
            with self.lock:
                if self.waiting:
                    heapq.heappop(self.waiting)[1].set()
                else:
                    self.free += 1


_PART_SLOTS: _PartSlots | None = None
_PART_SLOTS_LOCK = threading.Lock()


def _part_slots() -> _PartSlots:
    """The process's `_PartSlots` (`workers()` of them)."""
    global _PART_SLOTS
    with _PART_SLOTS_LOCK:
        if _PART_SLOTS is None:
            _PART_SLOTS = _PartSlots(workers())
        return _PART_SLOTS


class _PartBuffers:
    """The buffers parts are read into, reused from part to part while multipart uploads are under way in the
    process (at most one a part in flight, `_part_slots`), and let go when none is.

    A part is read into a `bytearray` and sent as it is: botocore hashes a bytearray body (its SigV4 payload
    hash over HTTP, its CRC32) and sends it without copying it, while a `bytes` body is wrapped in a `BytesIO`
    and copied a chunk at a time by each of the three (at 5 x 512 MiB to a local S3 server, a tenth of the
    client's CPU, and as much again in page faults of a fresh 16 MiB buffer each part).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.free: dict[int, list[bytearray]] = {}
        self.uploads = 0

    @contextlib.contextmanager
    def upload(self) -> Iterator[None]:
        with self.lock:
            self.uploads += 1
        try:
            yield
        finally:
            with self.lock:
                self.uploads -= 1
                if not self.uploads:
                    self.free.clear()

    def take(self, size: int) -> bytearray:
        with self.lock:
            free = self.free.get(size)
            if free:
                return free.pop()
        return bytearray(size)

    def give(self, buffer: bytearray) -> None:
        with self.lock:
            if self.uploads:
                self.free.setdefault(len(buffer), []).append(buffer)


_BUFFERS = _PartBuffers()


def _read_part(path: str, start: int, buffer: bytearray) -> None:
    """Fill `buffer` with the bytes of `path` from `start` (read straight into it: no copy)."""
    view = memoryview(buffer)
    got = 0
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                raise StorageError(f"{path} changed while it was uploaded", "upload it again")
            got += n


def multipart_upload(
    call_s3: Callable[..., Any], bucket: str, key: str, path: str, size: int, url: str, *, checksum: str | None = None
) -> None:
    """Upload `path` to `key` of `bucket` in parts of `PART_SIZE`, sent in parallel (at most `workers()` parts
    in flight in the process, whatever the number of files being sent), each retried on its own by `call`;
    the object appears only when the upload is completed. A failed upload is aborted (a killed one stays
    invisible, as its parts until the bucket's lifecycle rule for incomplete uploads removes them).
    `call_s3(operation, **arguments)`: one S3 API call (s3fs's `call_s3`, or a botocore client's method).

    `checksum` ("CRC32"): the upload is begun with that checksum algorithm, each part sent with its checksum,
    and the completion lists them, as `aws s3` does by default (s3transfer's `set_default_checksum_algorithm`,
    where botocore's `request_checksum_calculation` is `when_supported`): the store checks each part against
    its checksum as it completes the upload and keeps the object's checksum as the composite of the parts',
    where without one S3 computes a CRC64NVME of the whole object, reading it again (moto: 1.1 CPU-s of
    the completion of a 256 MiB object instead of 0.7).

    s3fs's own `put_file` sends parts in parallel only from 100 MiB on, reads them on its event loop's thread,
    and its concurrency is per file (`s3fs/core.py: S3FileSystem._put_file, _upload_file_part_concurrent`).
    """
    part = max(PART_SIZE, -(-size // 10_000))
    slots = _part_slots()
    ticket = slots.ticket()
    algorithm = {"ChecksumAlgorithm": checksum} if checksum else {}
    created = call(
        lambda: call_s3("create_multipart_upload", Bucket=bucket, Key=key, **algorithm), f"uploading {url}", url
    )
    upload_id = created["UploadId"]

    def send(number: int) -> dict[str, Any]:
        start = (number - 1) * part
        length = min(part, size - start)
        with slots.hold(ticket, number):
            # the last part, shorter, in a buffer of its own length: the body's length is the part's
            data = _BUFFERS.take(part) if length == part else bytearray(length)
            try:
                _read_part(path, start, data)
                done = call(
                    lambda: call_s3(
                        "upload_part",
                        Bucket=bucket,
                        Key=key,
                        UploadId=upload_id,
                        PartNumber=number,
                        Body=data,
                        **algorithm,
                    ),
                    f"uploading part {number} of {url}",
                    url,
                )
            finally:
                if length == part:  # sent, or given up on: nothing holds it any more
                    _BUFFERS.give(data)
        sent = {"PartNumber": number, "ETag": done["ETag"]}
        if checksum and done.get(f"Checksum{checksum}"):
            sent[f"Checksum{checksum}"] = done[f"Checksum{checksum}"]
        return sent

    def send_completion(parts: list[dict[str, Any]]) -> None:
        call_s3(
            "complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
        )

    def complete(parts: list[dict[str, Any]]) -> None:
        try:
            send_completion(parts)
        except Exception as exc:
            # A completion that timed out is most likely still at work in the store, which builds the object
            # of its parts meanwhile (a while for a large one, and a store such as moto sends nothing until it
            # is done): sent again at once, the store builds it twice, or refuses the second (no such upload,
            # or a server error). So the object is waited for first, as these parts' completion.
            if not failures.is_read_timeout(exc):
                raise
            if _await_completion(call_s3, bucket, key, parts):
                return
            # It did not come within the timeout: the completion was lost on its way (or the store is slower
            # than that). Sent once more: a store that built it meanwhile answers no such upload, and the
            # object is then looked at as ours or not. The wait took the retry policy's time, so `call` would
            # not try again, and would call a store that answered every HEAD unreachable: every other call on
            # it would fail at once for as long. Its failure now is this upload's own (a StorageError).
            try:
                send_completion(parts)
            except Exception as again:
                raise StorageError(
                    f"the object store did not complete the upload of {url} (its completion timed out, and the "
                    f"object did not appear within {failures.RETRY.timeout:.0f}s): {again}",
                    "upload it again; CKPTCTL_IO_TIMEOUT sets how long to wait",
                ) from again

    try:
        with _BUFFERS.upload():
            parts = parallel_map(send, range(1, -(-size // part) + 1), max_workers=workers())
        try:
            call(lambda: complete(parts), f"uploading {url}", url)
        except Exception:
            # Completing is not idempotent: when a completion's answer was lost, its retry finds no such
            # upload although the object is there. The object is ours when its ETag is the one S3 gives an
            # object completed from exactly these parts.
            if not _completed_from(call_s3, bucket, key, parts):
                raise
    except BaseException:
        with contextlib.suppress(Exception):
            call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        raise


def _await_completion(call_s3: Callable[..., Any], bucket: str, key: str, parts: list[dict[str, Any]]) -> bool:
    """Whether the object `key` becomes the completion of `parts` within the retry policy's timeout (asked
    every second or so: a HEAD each time)."""
    deadline = time.monotonic() + failures.RETRY.timeout
    wait = 0.25
    while time.monotonic() < deadline:
        if _completed_from(call_s3, bucket, key, parts):
            return True
        time.sleep(min(wait, max(0.0, deadline - time.monotonic())))
        wait = min(2.0, wait * 2)
    return False


def _completed_from(call_s3: Callable[..., Any], bucket: str, key: str, parts: list[dict[str, Any]]) -> bool:
    """Whether the object `key` is the completion of the uploaded `parts`: S3's ETag of a multipart object is
    the MD5 of its parts' MD5s, then `-` and their number."""
    digests = b"".join(bytes.fromhex(str(p["ETag"]).strip('"')) for p in parts)
    expected = f"{hashlib.md5(digests, usedforsecurity=False).hexdigest()}-{len(parts)}"
    try:
        head = call_s3("head_object", Bucket=bucket, Key=key)
    except Exception:
        return False
    return str(head.get("ETag", "")).strip('"') == expected


#: The one fsspec backend.
FSSPEC = FsspecBackend()


def entry_of(info: dict[str, Any]) -> DirEntry:
    """A listing entry from fsspec's details of one path."""
    mtime = info.get("mtime") or info.get("LastModified") or info.get("created") or 0.0
    if hasattr(mtime, "timestamp"):
        mtime = mtime.timestamp()
    return DirEntry(
        posixpath.basename(info["name"].rstrip("/")),
        info["type"] == "directory",
        int(info.get("size") or 0),
        float(mtime),
    )


def _fs(url: str) -> tuple[Any, str]:
    try:
        import fsspec
    except ImportError as exc:  # pragma: no cover - fsspec is a dependency
        raise StorageError("fsspec is not installed", "pip install fsspec") from exc
    try:
        # No listings cache: another process (a trainer, a prune) changes the store behind our back, and
        # a stale listing would show a deleted checkpoint or miss a new one.
        try:
            fs, path = fsspec.core.url_to_fs(url, use_listings_cache=False)
        except TypeError:  # a filesystem that takes no such option
            fs, path = fsspec.core.url_to_fs(url)
        if scheme_of(url) in ("s3", "s3a"):
            _bound_s3(fs, fsspec.config.conf.get("s3", {}))
    except ImportError as exc:
        raise StorageError(
            f"no filesystem driver for {scheme_of(url)}://",
            "install the extra, e.g. pip install 'ckptctl[s3]'",
        ) from exc
    except ValueError as exc:
        raise StorageError(f"cannot open {url}: {exc}") from exc
    return fs, path


#: Tries s3fs makes of each request (its default is 5).
_S3FS_TRIES = 2


def _bound_s3(fs: Any, configured: dict[str, Any]) -> None:
    """Bound how long a request of the s3fs instance `fs` may wait on a store that stopped answering.

    Each request gets `failures.RETRY.request_timeout` to connect and to read, and botocore does not retry: its own
    tries (5), within each of s3fs's tries (5), each waiting up to a minute, are how a frozen store used to
    hang a command for many minutes. s3fs tries each request `_S3FS_TRIES` times, and `failures.call` retries the
    whole call within `RETRY.timeout`. What fsspec's own configuration sets (`FSSPEC_S3_*`,
    ~/.config/fsspec: `config_kwargs`, `retries`) wins. The settings are s3fs's attributes, read when the
    instance makes its client, so that fsspec's cache still hands out one instance per set of options.
    """
    timeout = failures.RETRY.request_timeout
    if fs.__dict__.get("_ckptctl_timeout") == timeout:
        return
    fs.connect_timeout = fs.read_timeout = timeout  # unless config_kwargs name them
    fs.config_kwargs = {"retries": {"total_max_attempts": 1}, **(fs.config_kwargs or {})}
    if "retries" not in configured:
        fs.retries = _S3FS_TRIES
    fs._ckptctl_timeout = timeout


_BUCKETS_SEEN: set[tuple[str, str]] = set()
_BUCKETS_LOCK = threading.Lock()


def _check_bucket(url: str, fs: Any) -> None:
    """`check_bucket` with s3fs's `exists` and `ls` of the bucket."""
    # s3fs's `exists` answers False when its probes fail for any reason, a store that stopped answering
    # included: a False is checked by listing the bucket, which raises what really happened (the bucket is
    # missing, or the store does not answer: the StorageError of `call`, never "does not exist")
    check_bucket(
        url,
        lambda bucket: (
            call(lambda: fs.exists(bucket), f"looking up bucket {bucket}", url)
            or call(lambda: fs.ls(bucket) is not None, f"listing bucket {bucket}", url)
        ),
    )


def check_bucket(url: str, probe: Callable[[str], bool]) -> None:
    """Raise `CheckpointNotFound` naming the bucket when a path is absent because its bucket is.

    Called only when a path was not found, so that "no such folder" says when the bucket is what is
    missing; a bucket seen once is not asked about again. `probe(bucket)`: whether the bucket is there
    (False, or `FileNotFoundError`: it is not), raising what happened when the store cannot tell.
    """
    scheme = scheme_of(url)
    if scheme not in ("s3", "s3a", "gs", "gcs"):
        return
    key = (scheme, bucket_of(url))
    with _BUCKETS_LOCK:
        if key in _BUCKETS_SEEN:
            return
    try:
        found = probe(key[1])
    except CkptctlError:
        raise
    except FileNotFoundError:
        found = False
    except Exception as exc:
        mapped = remote_error(url, exc)
        if mapped is not None and not is_transient(exc):
            raise mapped from exc
        return  # the store is struggling: let the caller report the path as not found
    if not found:
        raise CheckpointNotFound(
            f"bucket {key[1]!r} does not exist ({url})",
            "check the bucket name, and the endpoint and region it lives in (AWS_ENDPOINT_URL, AWS_REGION)",
        )
    with _BUCKETS_LOCK:
        _BUCKETS_SEEN.add(key)
