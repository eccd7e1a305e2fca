"""`s3://` through botocore's own client for the calls that a transfer makes many of: listings, small reads,
PUTs, multipart uploads and deletes (`S3Backend`); everything else as `remote.FsspecBackend` does it.

s3fs runs botocore on aiobotocore and aiohttp, driven from one event-loop thread: importing the three costs
about a second of a command's start, and every request's signing, checksum and body copy runs on that one
thread, whatever the number of transfers in flight (a sync of a run to a local S3 server took twice as long
as rclone's). botocore's blocking client signs and sends in the calling thread, so parallel transfers stay
parallel, and it is a quarter of the import.

It is used only where it reaches the store exactly as s3fs would: a plain `s3://bucket/key` URL (no access
point, no version), and no fsspec configuration for `s3` (`FSSPEC_S3_*`, `~/.config/fsspec`), which s3fs
would apply and this does not. Then both build their client from botocore's defaults: the standard AWS
settings (`AWS_PROFILE`, `AWS_ACCESS_KEY_ID`, `AWS_REGION`, `AWS_ENDPOINT_URL`, ...), with the same
per-request timeouts and no retries of botocore's own (`failures.call` retries every call).
"""

from __future__ import annotations

import functools
import os
import posixpath
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ckptctl.errors import StorageError
from ckptctl.io import failures, remote
from ckptctl.io.counting import count_read
from ckptctl.io.failures import call
from ckptctl.io.parallel import workers
from ckptctl.io.paths import DirEntry, bucket_of, scheme_of
from ckptctl.io.remote import FsspecBackend, check_bucket, multipart_upload

__all__ = ["S3", "S3Backend", "serves"]

#: Keys one DeleteObjects request takes.
_DELETE_BATCH = 1000
#: HTTP status codes and S3 error codes of a missing key.
_MISSING = frozenset({"404", "NoSuchKey", "NotFound"})
#: ... of a conditional PUT refused because the key has an object.
_EXISTS = frozenset({"412", "PreconditionFailed"})
#: ... of a conditional PUT that met another one of the same key under way (AWS: try again).
_CONFLICT = frozenset({"409", "ConditionalRequestConflict"})
#: Seconds between the tries of a conditional PUT that met another one under way.
_CONFLICT_WAITS = (0.1, 0.3, 1.0, 3.0)
#: ... of a store that has no conditional PUT, or refuses the header as a bad request.
_NO_CONDITION = frozenset({"501", "NotImplemented", "InvalidArgument", "InvalidRequest"})


def serves(url: str) -> bool:
    """Whether `S3` reaches `url` as s3fs would (see the module docstring)."""
    if scheme_of(url) not in ("s3", "s3a") or "?" in url or ":" in bucket_of(url) or not bucket_of(url):
        return False
    return not _fsspec_configures_s3()


def _fsspec_configures_s3() -> bool:
    """Whether fsspec's configuration has settings for `s3`, without importing fsspec (a tenth of a second)
    where it cannot have any: none of its variables (`FSSPEC_S3...`) and no file in its folder (where
    `fsspec.config` reads them from when it is imported)."""
    if "fsspec.config" not in sys.modules:
        folder = os.environ.get("FSSPEC_CONFIG_DIR", os.path.join(os.path.expanduser("~"), ".config/fsspec"))
        try:
            files = any(name.endswith((".ini", ".json")) for name in os.listdir(folder))
        except OSError:
            files = False
        if not files and not any(key.upper().startswith("FSSPEC_S3") for key in os.environ):
            return False
    import fsspec.config

    return any(fsspec.config.conf.get(name) for name in ("s3", "s3a"))


class S3Backend(FsspecBackend):
    """`s3://` through botocore's client (the rest through s3fs, as `FsspecBackend`)."""

    def call_s3(self, method: str, **kwargs: Any) -> Any:
        """One S3 API call (`method`: the client's name of it, `put_object`); not retried here."""
        return getattr(_client(), method)(**kwargs)

    # ---- queries

    def list_dir(self, url: str) -> list[DirEntry]:
        bucket, key = _split(url)
        prefix = f"{key}/" if key else ""
        out: dict[str, DirEntry] = {}
        for page in self._pages(url, Bucket=bucket, Prefix=prefix, Delimiter="/"):
            for common in page.get("CommonPrefixes", []):
                name = common["Prefix"][len(prefix) :].rstrip("/")
                out[name] = DirEntry(name, True, 0, 0.0)
            for item in page.get("Contents", []):
                name = item["Key"][len(prefix) :]
                if name:  # not the placeholder object of the folder itself
                    out[name] = _entry(name, item)
        if not out and key:
            # Not a folder: a file lists as itself (as s3fs's `ls` answers), nothing at all is not found.
            head = self._head(url, bucket, key)
            if head is None:
                if self._has_below(url, bucket, key):  # an empty folder: only its `key/` placeholder object
                    return []
                raise FileNotFoundError(url)
            return [DirEntry(posixpath.basename(key), False, int(head["ContentLength"]), _time(head))]
        return sorted(out.values(), key=lambda d: d.name)

    def list_tree(self, url: str) -> dict[str, DirEntry]:
        bucket, key = _split(url)
        prefix = f"{key}/" if key else ""
        return {
            item["Key"][len(prefix) :]: _entry(posixpath.basename(item["Key"]), item)
            for page in self._pages(url, Bucket=bucket, Prefix=prefix)
            for item in page.get("Contents", [])
            if not item["Key"].endswith("/")  # placeholder objects of folders
        }

    def exists(self, url: str) -> bool:
        bucket, key = _split(url)
        if not key:
            return self._bucket_exists(url, bucket)
        found = self._head(url, bucket, key) is not None or self._has_below(url, bucket, key)
        if not found:
            check_bucket(url, lambda b: self._bucket_exists(url, b))
        return found

    def is_dir(self, url: str) -> bool:
        bucket, key = _split(url)
        if not key:
            return self._bucket_exists(url, bucket)
        found = self._has_below(url, bucket, key)
        if not found:
            check_bucket(url, lambda b: self._bucket_exists(url, b))
        return found

    def file_size(self, url: str) -> int:
        bucket, key = _split(url)
        head = self._head(url, bucket, key)
        if head is None:
            raise FileNotFoundError(url)
        return int(head["ContentLength"])

    # ---- reads

    def read(self, url: str, start: int, length: int | None, cap: int | None) -> bytes:
        """A GET, of the range asked for (`cap`: at most `cap + 1` bytes, one over saying "too large")."""
        want = length if length is not None else (None if cap is None else cap + 1)
        if want == 0:
            return b""
        bucket, key = _split(url)
        ranged = (
            {}
            if start == 0 and want is None
            else {"Range": f"bytes={start}-{'' if want is None else start + want - 1}"}
        )

        def get() -> bytes:
            try:
                answer = self.call_s3("get_object", Bucket=bucket, Key=key, **ranged)
            except Exception as exc:
                code = failures.error_code(exc)
                if code in _MISSING:
                    raise FileNotFoundError(url) from exc
                if code == "InvalidRange":  # from at or past the end: nothing there
                    return b""
                raise
            with answer["Body"] as body:
                return bytes(body.read())

        data = call(get, f"reading {url}", url)
        count_read(len(data))
        return data

    def read_stamped(self, url: str, length: int) -> tuple[bytes, float]:
        """One ranged GET, whose answer carries the object's time (no listing of its folder)."""
        if length <= 0:
            return super().read_stamped(url, length)
        bucket, key = _split(url)

        def get() -> tuple[bytes, float]:
            try:
                answer = self.call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes=0-{length - 1}")
            except Exception as exc:
                code = failures.error_code(exc)
                if code in _MISSING:
                    raise FileNotFoundError(url) from exc
                if code != "InvalidRange":
                    raise
                # an empty object: nothing in range, and no time in the answer
                return b"", _time(self._head(url, bucket, key) or {})
            with answer["Body"] as body:
                return bytes(body.read()), _time(answer)

        data, mtime = call(get, f"reading {url}", url)
        count_read(len(data))
        return data, mtime or time.time()

    # ---- writes and deletes

    def write_atomic(self, url: str, data: bytes) -> None:
        """A single PUT, which is atomic."""
        bucket, key = _split(url)
        call(lambda: self.call_s3("put_object", Bucket=bucket, Key=key, Body=data), f"writing {url}", url)

    def create_new(self, url: str, data: bytes) -> bool | None:
        """A PUT on condition that no object has the key (`If-None-Match: *`, which S3 has kept since 2024):
        False when one has (412; a conflict with another conditional write of it under way, 409, is tried
        again). None where the store (501, or a 400 refusing the header) or this botocore has no such PUT.

        A PUT that succeeded but whose answer was lost is sent again by the retries and refused because of
        its own object: what is there is read and compared, as `data` (a lock's, naming its writer's token)
        is this writer's alone.
        """
        bucket, key = _split(url)

        def put() -> bool | None:
            for wait in _CONFLICT_WAITS:
                try:
                    self.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
                except Exception as exc:
                    code = failures.error_code(exc)
                    if code in _CONFLICT:
                        # Another conditional write of the key is under way, perhaps our own earlier try whose
                        # answer was lost: sent again once it is done, the answer is 412 (and the compare) or 200.
                        time.sleep(wait)
                        continue
                    if code in _EXISTS:
                        return False
                    if _no_condition(exc):
                        return None
                    raise
                return True
            return False

        made = call(put, f"creating {url}", url)
        if made is False:
            try:
                return self.read(url, 0, len(data) + 1, None) == data
            except FileNotFoundError:
                return False
        return made

    def delete_if_unchanged(self, url: str, judge: Callable[[], bool]) -> bool:
        """A DELETE on condition that the object is still the one `judge` read (`If-Match` its ETag, taken
        before the judgment: S3 since 2024); a store without the condition deletes it all the same."""
        bucket, key = _split(url)
        head = self._head(url, bucket, key)
        if head is None or not judge():
            return False

        def delete() -> bool:
            try:
                self.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=head["ETag"])
            except Exception as exc:
                code = failures.error_code(exc)
                if code in _EXISTS or code in _MISSING:  # replaced or deleted since the HEAD
                    return False
                if not _no_condition(exc):
                    raise
                self.call_s3("delete_object", Bucket=bucket, Key=key)
            return True

        return call(delete, f"deleting {url}", url)

    def upload(self, path: str, url: str) -> None:
        """A PUT of the file (read by botocore as it is sent), or a multipart upload with parts in parallel
        from `MULTIPART_THRESHOLD` bytes."""
        bucket, key = _split(url)
        size = os.path.getsize(path)
        if size >= remote.MULTIPART_THRESHOLD:
            multipart_upload(self.call_s3, bucket, key, path, size, url, checksum=_checksum())
            return

        def put() -> None:
            with open(path, "rb") as f:
                self.call_s3("put_object", Bucket=bucket, Key=key, Body=f)

        call(put, f"uploading {url}", url)

    def delete_file(self, url: str) -> None:
        bucket, key = _split(url)
        call(lambda: self.call_s3("delete_object", Bucket=bucket, Key=key), f"deleting {url}", url)

    def delete_files(self, urls: Sequence[str]) -> None:
        """Batched deletes (S3 takes 1,000 keys a request). DeleteObjects answers 200 and lists the keys it did
        not delete: those are tried again while every error is one that passes (`SlowDown`, `InternalError`),
        as `call` tries a failed request again; an error that stays, or one that does not pass (`AccessDenied`),
        is a `StorageError`, never objects silently left behind."""
        bucket = _split(urls[0])[0]
        if any(_split(url)[0] != bucket for url in urls):  # one request names one bucket
            raise StorageError(f"cannot delete objects of several buckets at once (s3://{bucket}, ...)")
        keys = [_split(url)[1] for url in urls]
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = [{"Key": key} for key in keys[start : start + _DELETE_BATCH]]

            def delete(left: list[dict[str, str]] = batch) -> None:
                answer = self.call_s3("delete_objects", Bucket=bucket, Delete={"Objects": left, "Quiet": True})
                errors = answer.get("Errors") or []
                if not errors:
                    return
                left[:] = [{"Key": str(e.get("Key"))} for e in errors]  # the next try sends only these
                first = errors[0]
                what = (
                    f"the object store did not delete s3://{bucket}/{first.get('Key')} "
                    f"({first.get('Code')}: {first.get('Message')}) and {len(errors) - 1} more"
                )
                if all(failures.transient_code(e.get("Code")) for e in errors):
                    raise _NotDeleted(what, first.get("Code"))
                raise StorageError(what, "check the credentials' s3:DeleteObject permission")

            call(delete, f"deleting {len(batch)} objects of s3://{bucket}", urls[0])

    def delete_tree(self, url: str) -> None:
        """The objects below the folder, listed and deleted in batches (`delete_files`: s3fs's recursive `rm`
        ignores the keys a DeleteObjects answer says it did not delete)."""
        bucket, key = _split(url)
        if not key:
            super().delete_tree(url)
            return
        found = [
            item["Key"]
            for page in self._pages(url, Bucket=bucket, Prefix=f"{key}/")
            for item in page.get("Contents", [])
        ]
        if found:
            self.delete_files([f"s3://{bucket}/{k}" for k in found])

    # ---- helpers

    def _pages(self, url: str, **kwargs: Any) -> Iterator[dict[str, Any]]:
        """The pages of a ListObjectsV2, each one call (retried on its own)."""
        token: dict[str, str] = {}
        while True:
            page = call(functools.partial(self.call_s3, "list_objects_v2", **kwargs, **token), f"listing {url}", url)
            yield page
            if not page.get("IsTruncated"):
                return
            if not page.get("NextContinuationToken"):  # a store that says "truncated" and not where to go on
                raise StorageError(f"listing {url}: the object store cut the listing short and gave no way on")
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def _head(self, url: str, bucket: str, key: str) -> dict[str, Any] | None:
        """The object's HEAD answer, or None when there is none (a folder's name, or nothing)."""
        if not key:
            return None

        def head() -> dict[str, Any] | None:
            try:
                return dict(self.call_s3("head_object", Bucket=bucket, Key=key))
            except Exception as exc:
                if failures.error_code(exc) in _MISSING:
                    return None
                raise

        return call(head, f"looking up {url}", url)

    def _has_below(self, url: str, bucket: str, key: str) -> bool:
        """Whether any object's key starts with the folder `key/`."""
        page = next(self._pages(url, Bucket=bucket, Prefix=f"{key}/", MaxKeys=1))
        return bool(page.get("KeyCount") or page.get("Contents"))

    def _bucket_exists(self, url: str, bucket: str) -> bool:
        def head() -> bool:
            try:
                self.call_s3("head_bucket", Bucket=bucket)
            except Exception as exc:
                if failures.error_code(exc) in {"404", "NoSuchBucket", "NotFound"}:
                    return False
                raise
            return True

        return call(head, f"looking up bucket {bucket}", url)


def _no_condition(exc: BaseException) -> bool:
    """Whether a conditional request failed because the store (501, or a 400 refusing the header) or this
    botocore (a conditional PUT before 1.35) has no such condition, rather than because it did not hold."""
    return failures.error_code(exc) in _NO_CONDITION or type(exc).__name__ == "ParamValidationError"


class _NotDeleted(Exception):
    """Keys a DeleteObjects answer (a 200) lists as not deleted, each for a reason that passes: raised for
    `failures.call` to try them again (`response` carries the code it judges by)."""

    def __init__(self, message: str, code: object) -> None:
        super().__init__(message)
        self.response = {"Error": {"Code": str(code)}}


#: The one `S3Backend`.
S3 = S3Backend()


def _split(url: str) -> tuple[str, str]:
    """The bucket and the key (no trailing `/`) of `s3://bucket/key`."""
    bucket, _, key = url.partition("://")[2].partition("/")
    return bucket, key.rstrip("/")


def _time(answer: dict[str, Any]) -> float:
    modified = answer.get("LastModified")
    return float(modified.timestamp()) if modified is not None else 0.0


def _entry(name: str, item: dict[str, Any]) -> DirEntry:
    return DirEntry(name, False, int(item.get("Size") or 0), _time(item))


_CLIENTS: dict[tuple[Any, ...], Any] = {}
_CLIENTS_LOCK = threading.Lock()


def _client() -> Any:
    """botocore's S3 client for the current AWS settings (a new one when they change: a test, a profile
    switched in-process), bounded in time as `remote._bound_s3` bounds s3fs's."""
    timeout = failures.RETRY.request_timeout
    key = (timeout, workers(), tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            import botocore.session
            from botocore.config import Config

            config = Config(
                connect_timeout=timeout,
                read_timeout=timeout,
                retries={"total_max_attempts": 1},
                # every transfer thread (a sync's pool of files and its pool of checkpoints' markers), and the
                # parts in flight of the multipart uploads they send
                max_pool_connections=max(10, 3 * workers()),
            )
            session = botocore.session.Session()
            session.register_component("data_loader", _s3_loader(session))
            client = session.create_client("s3", config=config)
            _CLIENTS.clear()
            _CLIENTS[key] = client
        return client


def _checksum() -> str | None:
    """The checksum algorithm a multipart upload is made with (`remote.multipart_upload`): CRC32, as `aws s3`
    uses, unless botocore is told to send checksums only where an operation requires them
    (`AWS_REQUEST_CHECKSUM_CALCULATION=when_required`: S3-compatible stores that refuse them)."""
    supported = getattr(_client().meta.config, "request_checksum_calculation", None) == "when_supported"
    return "CRC32" if supported else None


#: The loaders of `_s3_loader`, by data path (called under `_CLIENTS_LOCK`).
_LOADERS: dict[Any, Any] = {}


def _s3_loader(session: Any) -> Any:
    """botocore's loader of its data files (the same search path as the session's own: botocore's data, then
    `~/.aws/models` and `AWS_DATA_PATH`), told that S3 is the one service there is: the loader lists every
    service folder of every search path (some 400, a stat of each) before loading any model, a quarter of
    making the client.

    One loader a data path, kept for the clients made after (new AWS settings): it keeps what it parsed, and
    parsing S3's model and the endpoint rules again is most of making a client (about 90 ms of CPU of 100)."""
    import botocore.loaders

    path = session.get_config_variable("data_path")
    if path not in _LOADERS:

        class S3Loader(botocore.loaders.Loader):
            def list_available_services(self, type_name: str) -> list[str]:
                return ["s3"]

        loader = botocore.loaders.create_loader(path)
        _LOADERS[path] = S3Loader(extra_search_paths=loader.search_paths, include_default_search_paths=False)
    return _LOADERS[path]
