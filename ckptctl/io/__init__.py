"""All file access of ckptctl: local paths on a fast path (os calls, mmap), anything else through fsspec.

Paths are strings: a local path, `file://...`, or any fsspec URL (`s3://bucket/run`, `memory://x`).
Every read is counted (`counting`: a counter per operation) so that commands can report how many bytes
they touched.

Object stores are reached the way their own tools reach them: `s3://` through s3fs and botocore, so the
standard AWS settings apply (`AWS_PROFILE`, `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`, `AWS_REGION`,
`AWS_ENDPOINT_URL` for S3-compatible stores such as MinIO), as does fsspec's own configuration
(`FSSPEC_S3_*` variables, `~/.config/fsspec/`). Remote calls are retried with exponential backoff on
transient failures (throttling, timeouts, dropped connections), and failures that retrying cannot fix
(missing credentials, a missing bucket, access denied) become a `StorageError` or `CheckpointNotFound`
with a hint. Transfers of many files or ranges run on a bounded pool of `workers()` threads.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import ctypes
import errno
import functools
import logging
import os
import posixpath
import random
import shutil
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, wait
from dataclasses import dataclass
from typing import IO, Any, TypeVar

from ckptctl.errors import CheckpointNotFound, CkptctlError, CorruptCheckpoint, StorageError
from ckptctl.io.counting import READ_STATS, ByteCounter, ReadStats, count_read, counting
from ckptctl.io.parallel import ContextThreadPool
from ckptctl.units import format_size

__all__ = [
    "MAX_MARKER_BYTES",
    "READ_STATS",
    "RETRY",
    "ByteCounter",
    "ContextThreadPool",
    "DirEntry",
    "ReadStats",
    "RetryPolicy",
    "count_read",
    "counting",
    "delete_file",
    "delete_files",
    "delete_tree",
    "download_file",
    "exists",
    "file_size",
    "fsync_dir",
    "is_dir",
    "is_local",
    "join",
    "list_dir",
    "list_tree",
    "listing_snapshot",
    "local_path",
    "name_of",
    "open_read",
    "parallel_map",
    "parent_of",
    "read_bytes",
    "read_ranges",
    "read_text",
    "relative_to",
    "upload_file",
    "workers",
    "write_bytes_atomic",
]

log = logging.getLogger("ckptctl.io")
T = TypeVar("T")
R = TypeVar("R")

#: Block size of streamed remote reads (downloads, digests): large enough to amortise a request.
REMOTE_BLOCK = 8 << 20
#: The largest marker or pointer file read (a `latest` naming a folder, a tracker holding a step number).
MAX_MARKER_BYTES = 64 << 10


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How remote calls are retried on transient failures, and how long they may take.

    A call is tried up to `attempts` times, sleeping a random time of up to `base_delay * 2**n` seconds
    (capped at `max_delay`) before try n + 2, and no new try starts once `timeout` seconds have passed since
    the call began. Each request to an object store waits at most `request_timeout` to connect and as long
    for each part of the answer, so that a store that stops answering (a dead host, a frozen server) ends a
    call in bounded time rather than hanging on an open connection. A store that failed that way is not
    asked again for `timeout` seconds: the calls that follow fail at once.

    Set from `CKPTCTL_IO_RETRIES` (attempts) and `CKPTCTL_IO_TIMEOUT` (seconds) when the module is imported.
    """

    attempts: int = 5
    base_delay: float = 0.2
    max_delay: float = 10.0
    timeout: float = 60.0

    def delay(self, failures: int) -> float:
        """Seconds to wait after `failures` failed tries ("full jitter" backoff)."""
        return random.uniform(0, min(self.max_delay, self.base_delay * 2 ** (failures - 1)))

    @property
    def request_timeout(self) -> float:
        """Seconds one request may wait to connect, or for the next bytes of an answer: long enough for a
        slow store, short enough that a try of a call that stopped being answered ends within the timeout."""
        return max(1.0, min(20.0, self.timeout / 3))


def _retry_policy_from_env() -> RetryPolicy:
    try:
        attempts = int(os.environ.get("CKPTCTL_IO_RETRIES", "5"))
    except ValueError:
        attempts = 5
    try:
        timeout = float(os.environ.get("CKPTCTL_IO_TIMEOUT", "60"))
    except ValueError:
        timeout = 60.0
    if not 1.0 <= timeout <= 86400.0:  # also refuses nan
        timeout = 60.0
    return RetryPolicy(attempts=max(1, attempts), timeout=timeout)


#: The retry policy of every remote call (tests and embedding applications may replace it).
RETRY = _retry_policy_from_env()


def workers() -> int:
    """Threads for parallel transfers (`CKPTCTL_IO_WORKERS`, default 8): enough to fill a fast link to an
    object store without opening hundreds of connections."""
    try:
        return max(1, int(os.environ.get("CKPTCTL_IO_WORKERS", "8")))
    except ValueError:
        return 8


@dataclass(frozen=True, slots=True)
class DirEntry:
    """One entry of a directory listing: enough for layouts to detect and size checkpoints."""

    name: str
    is_dir: bool
    size: int
    mtime: float


def is_local(url: str) -> bool:
    """True for plain paths and `file://` URLs."""
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    """The OS path of a local URL (strips `file://`)."""
    return url[len("file://") :] if url.startswith("file://") else url


def join(url: str, *parts: str) -> str:
    """Join path parts with `/`, keeping the URL scheme. Empty parts add nothing: a single-file checkpoint
    names its one data file "" (itself), and `join(file, "")` is that file, not `file/`."""
    parts = tuple(p for p in parts if p)
    if not parts:
        return url
    if is_local(url):
        return os.path.join(url, *parts)
    return posixpath.join(url, *parts)


def name_of(url: str) -> str:
    """The last path component (`step-10` of `s3://b/run/step-10/`)."""
    return posixpath.basename(url.rstrip("/")) if not is_local(url) else os.path.basename(os.path.normpath(url))


def parent_of(url: str) -> str:
    """The containing folder."""
    if is_local(url):
        return os.path.dirname(os.path.normpath(local_path(url)))
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{posixpath.dirname(rest.rstrip('/'))}"


def relative_to(url: str, root: str) -> str:
    """`url` relative to `root`, with `/` separators."""
    if is_local(url):
        return os.path.relpath(local_path(url), local_path(root)).replace(os.sep, "/")
    return posixpath.relpath(url.partition("://")[2], root.partition("://")[2])


def _scheme(url: str) -> str:
    return url.split("://", maxsplit=1)[0].lower()


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
        if _scheme(url) in ("s3", "s3a"):
            _bound_s3(fs, fsspec.config.conf.get("s3", {}))
    except ImportError as exc:
        raise StorageError(
            f"no filesystem driver for {_scheme(url)}://",
            "install the extra, e.g. pip install 'ckptctl[s3]'",
        ) from exc
    except ValueError as exc:
        raise StorageError(f"cannot open {url}: {exc}") from exc
    return fs, path


#: Tries s3fs makes of each request (its default is 5).
_S3FS_TRIES = 2


def _bound_s3(fs: Any, configured: dict[str, Any]) -> None:
    """Bound how long a request of the s3fs instance `fs` may wait on a store that stopped answering.

    Each request gets `RETRY.request_timeout` to connect and to read, and botocore does not retry: its own
    tries (5), within each of s3fs's tries (5), each waiting up to a minute, are how a frozen store used to
    hang a command for many minutes. s3fs tries each request `_S3FS_TRIES` times, and `_call` retries the
    whole call within `RETRY.timeout`. What fsspec's own configuration sets (`FSSPEC_S3_*`,
    ~/.config/fsspec: `config_kwargs`, `retries`) wins. The settings are s3fs's attributes, read when the
    instance makes its client, so that fsspec's cache still hands out one instance per set of options.
    """
    timeout = RETRY.request_timeout
    if fs.__dict__.get("_ckptctl_timeout") == timeout:
        return
    fs.connect_timeout = fs.read_timeout = timeout  # unless config_kwargs name them
    fs.config_kwargs = {"retries": {"total_max_attempts": 1}, **(fs.config_kwargs or {})}
    if "retries" not in configured:
        fs.retries = _S3FS_TRIES
    fs._ckptctl_timeout = timeout


# ------------------------------------------------------------------------------------ error mapping

#: Object store error codes that go away when the request is repeated a moment later.
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        "OperationAborted",
        "500",
        "502",
        "503",
        "504",
    }
)
#: Exception classes (botocore, aiohttp, urllib3) of a dropped or timed-out connection, matched by name so
#: that this module imports none of those libraries.
_TRANSIENT_CLASSES = frozenset(
    {
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "ResponseStreamingError",
        "IncompleteReadError",
        "ClientPayloadError",
        "ServerDisconnectedError",
        "ServerTimeoutError",
        "ClientOSError",
        "ProtocolError",
    }
)
_CREDENTIAL_CODES = frozenset(
    {"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken", "TokenRefreshRequired"}
)
#: errno values that s3fs gives throttling (EBUSY) and server errors (EREMOTEIO).
_TRANSIENT_ERRNOS = frozenset({errno.EBUSY, getattr(errno, "EREMOTEIO", errno.EIO), errno.ETIMEDOUT, errno.EAGAIN})


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """The exception and its causes (s3fs raises Python errors `from` botocore's ClientError)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _error_code(exc: BaseException) -> str | None:
    """The object store's error code (`NoSuchBucket`, `AccessDenied`, ...) behind an exception, if any."""
    for e in _chain(exc):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            if code:
                return str(code)
    return None


def _class_names(exc: BaseException) -> set[str]:
    return {cls.__name__ for e in _chain(exc) for cls in type(e).__mro__}


def _is_transient(exc: BaseException) -> bool:
    """Whether repeating the call may succeed: throttling, server errors, timeouts, dropped connections."""
    if isinstance(exc, CkptctlError | FileNotFoundError | PermissionError | IsADirectoryError | NotADirectoryError):
        return False
    code = _error_code(exc)
    if code is not None:
        return code in _TRANSIENT_CODES
    if _class_names(exc) & (_TRANSIENT_CLASSES | {"EndpointConnectionError"}):
        return True
    if isinstance(exc, TimeoutError | ConnectionError):
        return True
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS


def _call(fn: Callable[[], T], what: str, url: str) -> T:
    """Run one remote call on the store of `url`, retrying transient failures with exponential backoff and
    jitter within the `RETRY` policy's attempts and timeout.

    Raises:
        StorageError: the store kept failing (or stopped answering) until the attempts or the time ran out,
            or it stopped answering a moment ago (then nothing is tried).
    """
    store = _store_of(url)
    _refuse_if_unreachable(store, url)
    start = time.monotonic()
    failures = 0
    while True:
        tried = time.monotonic()
        try:
            return fn()
        except Exception as exc:
            failures += 1
            if not _is_transient(exc):
                raise
            delay = RETRY.delay(failures)
            now = time.monotonic()
            elapsed = now - start
            # A try that failed slowly (a timeout) will likely fail as slowly again: start one only if it
            # can end within the timeout.
            if failures < RETRY.attempts and elapsed + delay + (now - tried) < RETRY.timeout:
                log.debug("%s failed (%s: %s); retry %d in %.2fs", what, type(exc).__name__, exc, failures, delay)
                time.sleep(delay)
                continue
            if not _is_unreachable(exc):
                raise StorageError(
                    f"the object store kept failing for {url} after {_tries(failures)} ({elapsed:.0f}s): {exc}",
                    "try again later, or raise CKPTCTL_IO_RETRIES (tries) or CKPTCTL_IO_TIMEOUT (seconds)",
                ) from exc
            error = StorageError(
                f"the object store for {url} did not answer ({_tries(failures)} in {elapsed:.0f}s): "
                f"{type(exc).__name__}: {exc}",
                "check the network and the endpoint (AWS_ENDPOINT_URL, or the fsspec endpoint_url option); "
                "CKPTCTL_IO_TIMEOUT sets how long to wait",
            )
            _mark_unreachable(store, error)
            raise error from exc


def _tries(n: int) -> str:
    return "1 try" if n == 1 else f"{n} tries"


#: Exception classes of a store that does not answer (refused or timed-out connections, a read that got no
#: bytes in time), by name as in `_TRANSIENT_CLASSES`: a retry a moment later is unlikely to do better.
_UNREACHABLE_CLASSES = frozenset(
    {
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "ClientConnectorError",
        "ServerDisconnectedError",
        "ServerTimeoutError",
        "FSTimeoutError",
    }
)
#: Stores that stopped answering: store -> (until when calls to it fail at once, the error they fail with).
_UNREACHABLE: dict[str, tuple[float, StorageError]] = {}
_UNREACHABLE_LOCK = threading.Lock()


def _is_unreachable(exc: BaseException) -> bool:
    if _class_names(exc) & _UNREACHABLE_CLASSES:
        return True
    return any(isinstance(e, TimeoutError | ConnectionError) for e in _chain(exc))


def _store_of(url: str) -> str:
    """What one outage takes down: a bucket of a scheme (`s3://bucket`)."""
    return f"{_scheme(url)}://{_bucket(url)}"


def _mark_unreachable(store: str, error: StorageError) -> None:
    with _UNREACHABLE_LOCK:
        _UNREACHABLE[store] = (time.monotonic() + RETRY.timeout, error)


def _refuse_if_unreachable(store: str, url: str) -> None:
    """Fail at once for a store that stopped answering less than `RETRY.timeout` ago: a command that goes
    on after one failure (a prune skipping a checkpoint it could not delete) must not wait that long again
    for every call that follows."""
    with _UNREACHABLE_LOCK:
        until, error = _UNREACHABLE.get(store, (0.0, None))
        if error is not None and time.monotonic() >= until:
            del _UNREACHABLE[store]
            error = None
    if error is not None:
        raise StorageError(error.message, error.hint)


def _bucket(url: str) -> str:
    return url.partition("://")[2].split("/", 1)[0]


def _credentials_hint(url: str) -> str:
    scheme = _scheme(url)
    if scheme in ("s3", "s3a"):
        return (
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE (see `aws configure`); "
            "for an S3-compatible store also AWS_ENDPOINT_URL"
        )
    if scheme in ("gs", "gcs"):
        return "run `gcloud auth application-default login` or set GOOGLE_APPLICATION_CREDENTIALS"
    return f"configure credentials for {scheme}:// as its fsspec driver documents"


def _remote_error(url: str, exc: BaseException) -> CkptctlError | None:
    """A clear error for a failure of a remote call, or None to let it propagate unchanged."""
    code = _error_code(exc)
    names = _class_names(exc)
    if code in ("NoSuchBucket", "NoSuchBucketPolicy") or (
        isinstance(exc, FileNotFoundError) and "bucket does not exist" in str(exc).lower()
    ):
        return CheckpointNotFound(
            f"bucket {_bucket(url)!r} does not exist ({url})",
            "check the bucket name, and the endpoint and region it lives in (AWS_ENDPOINT_URL, AWS_REGION)",
        )
    if code in _CREDENTIAL_CODES:
        return StorageError(
            f"the object store rejected the credentials for {url} ({code})",
            _credentials_hint(url),
        )
    if "NoCredentialsError" in names or "PartialCredentialsError" in names:
        return StorageError(f"no credentials found for {url}", _credentials_hint(url))
    if "NoRegionError" in names:
        return StorageError(f"no region configured for {url}", "set AWS_REGION (or AWS_DEFAULT_REGION)")
    if isinstance(exc, PermissionError) or code in ("AccessDenied", "AllAccessDisabled", "403"):
        return StorageError(
            f"access denied: {url}",
            "the credentials in use lack a permission this needs (reading: s3:ListBucket and s3:GetObject; "
            "saving: also s3:PutObject and s3:DeleteObject); check AWS_PROFILE and the bucket policy",
        )
    if "EndpointConnectionError" in names or "ClientConnectorError" in names:
        return StorageError(
            f"cannot reach the object store for {url}: {exc}",
            "check the network and the endpoint (AWS_ENDPOINT_URL, or the fsspec endpoint_url option)",
        )
    if _is_transient(exc):
        return StorageError(
            f"the object store kept failing for {url} after {RETRY.attempts} tries: {exc}",
            "try again later, or raise CKPTCTL_IO_RETRIES",
        )
    return None


@contextlib.contextmanager
def _translate_errors(url: str) -> Iterator[None]:
    try:
        yield
    except CkptctlError:
        raise
    except Exception as exc:
        if not is_local(url):
            mapped = _remote_error(url, exc)
            if mapped is not None:
                raise mapped from exc
        if isinstance(exc, FileNotFoundError):
            raise CheckpointNotFound(f"no such file or folder: {url}") from exc
        if isinstance(exc, PermissionError):
            raise StorageError(f"permission denied: {url}", "check the file permissions or credentials") from exc
        if isinstance(exc, IsADirectoryError):
            raise StorageError(f"expected a file but found a folder: {url}") from exc
        if isinstance(exc, NotADirectoryError):
            raise CheckpointNotFound(f"not a folder: {url}") from exc
        if isinstance(exc, OSError):
            if exc.errno == errno.ENOSPC:
                raise StorageError(f"no space left on device while writing {url}", "free some space") from exc
            raise StorageError(f"cannot access {url}: {exc.strerror or exc}") from exc
        raise


_BUCKETS_SEEN: set[tuple[str, str]] = set()
_BUCKETS_LOCK = threading.Lock()


def _check_bucket(url: str, fs: Any) -> None:
    """Raise `CheckpointNotFound` naming the bucket when a path is absent because its bucket is.

    Called only when a path was not found, so that "no such folder" says when the bucket is what is
    missing; a bucket seen once is not asked about again.
    """
    scheme = _scheme(url)
    if scheme not in ("s3", "s3a", "gs", "gcs"):
        return
    key = (scheme, _bucket(url))
    with _BUCKETS_LOCK:
        if key in _BUCKETS_SEEN:
            return
    try:
        found = _call(lambda: fs.exists(key[1]), f"looking up bucket {key[1]}", url)
    except CkptctlError:
        raise
    except Exception as exc:
        mapped = _remote_error(url, exc)
        if mapped is not None and not _is_transient(exc):
            raise mapped from exc
        return  # the store is struggling: let the caller report the path as not found
    if not found:
        raise CheckpointNotFound(
            f"bucket {key[1]!r} does not exist ({url})",
            "check the bucket name, and the endpoint and region it lives in (AWS_ENDPOINT_URL, AWS_REGION)",
        )
    with _BUCKETS_LOCK:
        _BUCKETS_SEEN.add(key)


# ------------------------------------------------------------------------------------ queries


def list_dir(url: str) -> list[DirEntry]:
    """Entries of a folder, sorted by name; raises `CheckpointNotFound` when it does not exist."""
    snapshot, rel = _snapshot_of(url)
    if snapshot is not None and rel not in snapshot.files:
        listing = snapshot.folders.get(rel)
        if listing is None:
            raise CheckpointNotFound(f"no such file or folder: {url}")
        return list(listing)
    with _translate_errors(url):
        if is_local(url):
            entries = []
            with os.scandir(local_path(url)) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=True)
                    except FileNotFoundError:  # a dangling symlink or a file deleted meanwhile
                        continue
                    entries.append(DirEntry(e.name, e.is_dir(), 0 if e.is_dir() else st.st_size, st.st_mtime))
            return sorted(entries, key=lambda d: d.name)
        fs, path = _fs(url)
        out = [_entry(info) for info in _call(lambda: fs.ls(path, detail=True), f"listing {url}", url)]
        return sorted(out, key=lambda d: d.name)


def _entry(info: dict[str, Any]) -> DirEntry:
    mtime = info.get("mtime") or info.get("LastModified") or info.get("created") or 0.0
    if hasattr(mtime, "timestamp"):
        mtime = mtime.timestamp()
    return DirEntry(
        posixpath.basename(info["name"].rstrip("/")),
        info["type"] == "directory",
        int(info.get("size") or 0),
        float(mtime),
    )


def list_tree(url: str) -> dict[str, DirEntry]:
    """Every file below a folder, keyed by its path relative to it (with `/`); empty when there is none.

    On object stores this is one paginated listing of the whole prefix rather than one per folder.
    """
    snapshot, rel = _snapshot_of(url)
    if snapshot is not None:
        return snapshot.tree(rel)
    with _translate_errors(url):
        if is_local(url):
            base = local_path(url)
            files: dict[str, DirEntry] = {}
            for root, _dirs, names in os.walk(base):
                for n in names:
                    full = os.path.join(root, n)
                    try:
                        st = os.stat(full)
                    except FileNotFoundError:
                        continue
                    rel = os.path.relpath(full, base).replace(os.sep, "/")
                    files[rel] = DirEntry(n, False, st.st_size, st.st_mtime)
            return files
        fs, path = _fs(url)
        found = _call(lambda: fs.find(path, detail=True), f"listing {url}", url)
        prefix = path.rstrip("/") + "/"
        return {
            name[len(prefix) :]: _entry(info)
            for name, info in found.items()
            if name.startswith(prefix) and info.get("type") != "directory"
        }


def exists(url: str) -> bool:
    if is_local(url):
        return os.path.exists(local_path(url))
    snapshot, rel = _snapshot_of(url)
    if snapshot is not None:
        return rel in snapshot.folders or rel in snapshot.files
    with _translate_errors(url):
        fs, path = _fs(url)
        found = bool(_call(lambda: fs.exists(path), f"looking up {url}", url))
        if not found:
            _check_bucket(url, fs)
        return found


def is_dir(url: str) -> bool:
    if is_local(url):
        return os.path.isdir(local_path(url))
    snapshot, rel = _snapshot_of(url)
    if snapshot is not None:
        return rel in snapshot.folders
    with _translate_errors(url):
        fs, path = _fs(url)
        found = bool(_call(lambda: fs.isdir(path), f"looking up {url}", url))
        if not found:
            _check_bucket(url, fs)
        return found


def file_size(url: str) -> int:
    snapshot, rel = _snapshot_of(url)
    if snapshot is not None and rel in snapshot.files:
        return snapshot.files[rel].size
    with _translate_errors(url):
        if is_local(url):
            return os.stat(local_path(url)).st_size
        fs, path = _fs(url)
        return int(_call(lambda: fs.size(path), f"sizing {url}", url))


# ------------------------------------------------------------------------------------ listing snapshots


class _Snapshot:
    """Every file and folder below a remote folder, from one recursive listing.

    Object stores have no folders: a per-folder listing is one request per folder, while one listing of
    the whole prefix returns every key below it, 1,000 per page. A scan of a run (`layouts.scan_run`)
    asks about every folder of the run, so it takes one snapshot and answers from it.
    """

    def __init__(self, root: str, found: dict[str, dict[str, Any]], prefix: str) -> None:
        self.root = root.rstrip("/")
        self.files: dict[str, DirEntry] = {}
        folders: dict[str, dict[str, DirEntry]] = {"": {}}

        def add(rel: str, entry: DirEntry) -> None:
            parent = rel.rpartition("/")[0]
            if parent not in folders:
                add(parent, DirEntry(posixpath.basename(parent), True, 0, 0.0))
            folders[parent][entry.name] = entry
            if entry.is_dir:
                folders.setdefault(rel, {})

        for name, info in sorted(found.items()):  # sorted: a folder's own entry comes before its content
            rel = name[len(prefix) :].strip("/") if name.startswith(prefix) else ""
            if not rel:
                continue
            entry = _entry(info)
            if name.endswith("/") and not entry.is_dir:  # a placeholder object some tools create for a folder
                entry = DirEntry(entry.name, True, 0, entry.mtime)
            if not entry.is_dir:
                self.files[rel] = entry
            add(rel, entry)
        self.folders = {rel: sorted(entries.values(), key=lambda d: d.name) for rel, entries in folders.items()}
        self._paths = sorted(self.files)
        self._small: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def read_small(self, rel: str, read: Callable[[], bytes]) -> bytes:
        """`read()` of the file `rel`, made once when the file is small (a marker such as `latest`, which
        several layouts read while identifying a folder), every time otherwise."""
        entry = self.files.get(rel)
        keep = entry is not None and entry.size <= _SMALL_FILE
        if keep:
            with self._lock:
                data = self._small.get(rel)
            if data is not None:
                return data
        token = _SNAPSHOT.set(None)  # this read goes to the store
        try:
            data = read()
        finally:
            _SNAPSHOT.reset(token)
        if keep:
            with self._lock:
                self._small[rel] = data
        return data

    def relative(self, url: str) -> str | None:
        """`url` relative to the root ("" for the root), or None when it is not at or below it."""
        if url.startswith("file://") or "://" not in url:
            return None
        path = url.rstrip("/")
        if path == self.root:
            return ""
        if path.startswith(self.root + "/"):
            rel = path[len(self.root) + 1 :]
            return None if "//" in rel or any(part in (".", "..") for part in rel.split("/")) else rel
        return None

    def tree(self, rel: str) -> dict[str, DirEntry]:
        """The files below the folder `rel`, keyed by their path relative to it."""
        if not rel:
            return dict(self.files)
        start = rel + "/"
        first = bisect.bisect_left(self._paths, start)
        last = bisect.bisect_left(self._paths, rel + "0")  # "0" follows "/": the end of the keys below rel/
        return {path[len(start) :]: self.files[path] for path in self._paths[first:last]}


_SNAPSHOT: contextvars.ContextVar[_Snapshot | None] = contextvars.ContextVar("ckptctl_io_snapshot", default=None)
#: Files up to this size are read once per snapshot.
_SMALL_FILE = 64 << 10


def _snapshot_of(url: str) -> tuple[_Snapshot | None, str]:
    snapshot = _SNAPSHOT.get()
    if snapshot is None:
        return None, ""
    rel = snapshot.relative(url)
    return (None, "") if rel is None else (snapshot, rel)


@contextlib.contextmanager
def listing_snapshot(url: str) -> Iterator[None]:
    """While the block runs, answer `list_dir`, `list_tree`, `is_dir`, `exists` and `file_size` of `url`
    and of everything below it from one recursive listing taken on entry (paginated by the store).

    For walks that ask about many folders of one tree (`list` of a run: one request in all instead of a
    few per checkpoint). Whole reads of small files (up to 64 KiB: markers and pointers that several
    layouts read) are made once in the block. What changes below `url` during the block is not seen.
    A no-op for local paths (the os calls are cheap), for a `url` that an enclosing snapshot already
    covers, and when nothing is found (the calls then go to the store, which says what is missing).
    The snapshot is visible to the threads of `parallel_map` started inside the block.
    """
    if is_local(url) or _snapshot_of(url)[0] is not None:
        yield
        return
    with _translate_errors(url):
        fs, path = _fs(url)
        found = _call(lambda: fs.find(path, detail=True, withdirs=True), f"listing {url}", url)
    snapshot = _Snapshot(url, found, path.rstrip("/") + "/")
    if not snapshot.files and len(snapshot.folders) == 1:
        yield
        return
    token = _SNAPSHOT.set(snapshot)
    try:
        yield
    finally:
        _SNAPSHOT.reset(token)


# ------------------------------------------------------------------------------------ reads


def read_bytes(url: str, start: int = 0, length: int | None = None, *, max_size: int | None = None) -> bytes:
    """Read `length` bytes from `start` (to the end when None); a range read on object stores.

    Only regular files are read: a FIFO, a device or a socket in a checkpoint would block or never end, so
    it is refused before a byte is read.

    Args:
        url: the file.
        start: the first byte to read.
        length: how many bytes, or None for the rest of the file.
        max_size: refuse a whole-file read (`length` None) of a file larger than this many bytes: metadata
            (markers, pointers, JSON documents) is small, and a huge or endless file in its place must not
            be loaded into memory.

    Raises:
        CorruptCheckpoint: not a regular file, or larger than `max_size`.
    """
    snapshot, rel = _snapshot_of(url)
    if snapshot is not None and start == 0 and length is None:
        data = snapshot.read_small(rel, lambda: read_bytes(url, max_size=max_size))
        if max_size is not None:
            _check_size(url, len(data), max_size)
        return data
    cap = None if length is not None else max_size
    want = length if length is not None else (None if cap is None else cap + 1)  # one byte over: too large
    with _translate_errors(url):
        if is_local(url):
            with _open_regular(url) as f:
                if cap is not None:
                    _check_size(url, os.fstat(f.fileno()).st_size - start, cap)
                if start:
                    f.seek(start)
                data = f.read(-1 if want is None else want)
        else:
            fs, path = _fs(url)
            end = None if want is None else start + want
            data = _call(lambda: fs.cat_file(path, start=start, end=end), f"reading {url}", url)
    if cap is not None:
        _check_size(url, len(data), cap)  # a file that grew after it was sized, or a remote one
    count_read(len(data))
    return data


def _check_size(url: str, size: int, max_size: int) -> None:
    if size > max_size:
        raise CorruptCheckpoint(
            f"{url} is larger than {format_size(max_size)}, more than a file of its kind ever holds",
            "it is not the metadata file its name says; replace it with the real file",
        )


#: What `stat` calls the kinds of file ckptctl refuses to read.
_FILE_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _require_regular(url: str, mode: int) -> None:
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, "Is a directory", local_path(url))
    kind = next((name for test, name in _FILE_KINDS if test(mode)), "a special file")
    raise CorruptCheckpoint(
        f"{url} is {kind}, not a regular file: ckptctl reads only regular files",
        "replace it with the real file (reading it could block forever or never end)",
    )


@contextlib.contextmanager
def _open_regular(url: str) -> Iterator[IO[bytes]]:
    """Open a local file for reading, refusing anything but a regular file (symbolic links are followed).

    Checked with `stat` before opening (opening some devices has effects), and again on the open file: it is
    opened with O_NONBLOCK, so that a FIFO swapped in between the two does not block the open, and then
    refused by the second check. O_NONBLOCK does nothing to reads of regular files.
    """
    path = local_path(url)
    _require_regular(url, os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        _require_regular(url, os.fstat(fd).st_mode)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f


def read_ranges(requests: Sequence[tuple[str, int, int]], max_workers: int | None = None) -> list[bytes]:
    """Read many `(url, start, length)` ranges, in parallel on object stores; results in request order."""
    return parallel_map(lambda r: read_bytes(r[0], r[1], r[2]), requests, max_workers)


def read_text(url: str, *, max_size: int | None = None) -> str:
    """A whole file as UTF-8 text (`max_size` as in `read_bytes`).

    Raises:
        CorruptCheckpoint: not UTF-8, not a regular file, or larger than `max_size`.
    """
    data = read_bytes(url, max_size=max_size)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptCheckpoint(f"{url} is not UTF-8 text") from exc


@contextlib.contextmanager
def open_read(url: str) -> Iterator[IO[bytes]]:
    """A binary file object for sequential reads (bytes are counted by the caller, with `count_read`).

    Remote files are opened without a read-ahead cache: every `read(n)` is one range request of `n`
    bytes, so that what the caller counts is what crossed the network.
    """
    with _translate_errors(url):
        if is_local(url):
            with _open_regular(url) as f:
                yield f
        else:
            fs, path = _fs(url)
            f = _call(lambda: fs.open(path, "rb", cache_type="none"), f"opening {url}", url)
            with f:
                yield f


def download_file(url: str, path: str, on_block: Callable[[bytes], object] | None = None, max_workers: int = 1) -> int:
    """Copy a file (remote or local) to the local `path` in blocks of `REMOTE_BLOCK`, with up to
    `max_workers` range reads in flight; blocks are written, and passed to `on_block` (a hasher's
    `update`), in order. Returns the size; bytes are counted (`counting`)."""
    total = file_size(url)
    window = max(1, max_workers)
    offset = 0
    with _translate_errors(path), open(path, "wb") as out:
        while offset < total:
            ranges = [
                (url, start, min(REMOTE_BLOCK, total - start))
                for start in range(offset, min(total, offset + window * REMOTE_BLOCK), REMOTE_BLOCK)
            ]
            for (_, start, length), block in zip(ranges, read_ranges(ranges, window), strict=True):
                if len(block) != length:
                    raise StorageError(f"{url} changed while it was downloaded (byte {start} of {total})", "try again")
                out.write(block)
                if on_block is not None:
                    on_block(block)
            offset = ranges[-1][1] + ranges[-1][2]
    return total


def parallel_map(fn: Callable[[T], R], items: Sequence[T], max_workers: int | None = None) -> list[R]:
    """`[fn(item) for item in items]` on a bounded thread pool, results in order.

    On the first error (or an interrupt) the calls not yet started are cancelled, and the error is raised
    once the running ones have ended, so that no transfer is left running in the background. Each call runs in a copy of
    the caller's context (a `listing_snapshot` or byte counter the caller is inside applies to it).
    """
    if len(items) <= 1:
        return [fn(item) for item in items]
    with ContextThreadPool(max_workers=min(max_workers or workers(), len(items))) as pool:
        futures = [pool.submit(fn, item) for item in items]
        try:
            _done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        except BaseException:  # Ctrl-C: start nothing more, let the running calls end
            for future in futures:
                future.cancel()
            raise
        for future in pending:
            future.cancel()
    for future in futures:
        if not future.cancelled() and future.exception() is not None:
            raise future.exception()  # type: ignore[misc]
    return [f.result() for f in futures]


# ------------------------------------------------------------------------------------ writes


def fsync_dir(path: str) -> None:
    """Make a rename or a new entry in a local folder durable (no-op where the OS cannot)."""
    try:
        fd = os.open(local_path(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes_atomic(url: str, data: bytes) -> None:
    """Write a small file so that readers see either the old content or the new, never a mix.

    Locally: temporary file in the same folder, fsync, rename, fsync the folder. On object stores a
    single PUT is already atomic.
    """
    with _translate_errors(url):
        if is_local(url):
            path = local_path(url)
            folder = os.path.dirname(os.path.abspath(path))
            tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{os.getpid()}-{threading.get_ident()}")
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(folder)
            return
        fs, path = _fs(url)
        _call(lambda: fs.pipe_file(path, data), f"writing {url}", url)


def upload_file(path: str, url: str) -> None:
    """Copy the local file `path` to `url` (an object store PUT, multipart for large files; a plain copy
    for a local destination). An object appears only once its upload has completed."""
    with _translate_errors(url):
        if is_local(url):
            dest = local_path(url)
            os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
            shutil.copyfile(path, dest)
            return
        fs, remote = _fs(url)
        _call(lambda: fs.put_file(path, remote), f"uploading {url}", url)


def delete_file(url: str) -> None:
    """Remove one file (a missing one is not an error)."""
    with _translate_errors(url):
        if is_local(url):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(local_path(url))
            return
        fs, path = _fs(url)
        with contextlib.suppress(FileNotFoundError):
            _call(lambda: fs.rm_file(path), f"deleting {url}", url)


def delete_files(urls: Sequence[str]) -> None:
    """Remove many files (missing ones are not an error): batched deletes on object stores (S3 takes
    1,000 keys a request), one by one locally. Every URL must be on the same store as the first."""
    if not urls:
        return
    if is_local(urls[0]) or len(urls) == 1:
        for url in urls:
            delete_file(url)
        return
    with _translate_errors(urls[0]):
        fs, _ = _fs(urls[0])
        paths = [_fs(url)[1] for url in urls]
        with contextlib.suppress(FileNotFoundError):
            _call(lambda: fs.rm(paths), f"deleting {len(paths)} objects below {parent_of(urls[0])}", urls[0])


def delete_tree(url: str) -> None:
    """Remove a folder and everything below it (a missing one is not an error). Symbolic links inside
    are removed as links; what they point to is never touched."""
    with _translate_errors(url):
        if is_local(url):
            path = local_path(url)
            if os.path.islink(path):
                os.unlink(path)
                return

            def gone_is_fine(function: Any, target: str, excinfo: Any) -> None:
                # Another process (a concurrent prune, the manager's retention) may delete the same files.
                if not isinstance(excinfo[1], FileNotFoundError):
                    raise excinfo[1]

            if os.path.lexists(path):
                shutil.rmtree(path, onerror=gone_is_fine)
            return
        fs, path = _fs(url)
        with contextlib.suppress(FileNotFoundError):
            _call(lambda: fs.rm(path, recursive=True), f"deleting {url}", url)


def refuse_to_replace_precious(path: str, what: str) -> None:
    """Refuse a `--force` that would replace the root, the home folder, or the working folder or a parent.

    Args:
        path: local folder about to be replaced.
        what: the command's phrase for the hint ("choose a new folder for the demo").

    Raises:
        CkptctlError: `path` is one of those folders, whatever it holds.
    """
    from ckptctl.errors import CkptctlError

    real = os.path.realpath(local_path(path))
    cwd = os.path.realpath(os.getcwd())
    guarded = {os.path.realpath(os.sep), os.path.realpath(os.path.expanduser("~"))}
    if real in guarded or os.path.commonpath([real, cwd]) == real:
        raise CkptctlError(
            f"refusing to replace {path}: it is the root, home or working folder or one of its parents", what
        )


@functools.cache
def _renameat2() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def exchange(a: str, b: str) -> bool:
    """Atomically swap two local paths (Linux `renameat2(RENAME_EXCHANGE)`).

    Returns False where the OS or filesystem cannot (then the caller falls back to two renames); raises
    OSError for real failures.
    """
    fn = _renameat2()
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(local_path(a)), at_fdcwd, os.fsencode(local_path(b)), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), a)
