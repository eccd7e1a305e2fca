"""What a failed storage call becomes: retries with backoff and deadlines for remote calls, and typed
errors with a hint for everything that retrying cannot fix.

Remote calls are retried with exponential backoff on transient failures (throttling, timeouts, dropped
connections) within the `RETRY` policy; failures that retrying cannot fix (missing credentials, a missing
bucket, access denied) become a `StorageError` or `CheckpointNotFound` with a hint. The policy is read from
this module on every call, so that replacing `failures.RETRY` (tests, embedding applications) takes effect
at once; it lives here, where it is read, so that `io` and its backends do not import each other.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from ckptctl.errors import CheckpointNotFound, CkptctlError, CorruptCheckpoint, StorageError
from ckptctl.io.paths import bucket_of, is_local, scheme_of
from ckptctl.units import format_size

__all__ = [
    "RETRY",
    "RetryPolicy",
    "call",
    "check_size",
    "error_code",
    "is_read_timeout",
    "is_transient",
    "policy_from_env",
    "remote_error",
    "transient_code",
    "translate_errors",
]

T = TypeVar("T")


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
        import random  # a retry's: not the import of every command (DESIGN §5)

        return random.uniform(0, min(self.max_delay, self.base_delay * 2 ** (failures - 1)))

    @property
    def request_timeout(self) -> float:
        """Seconds one request may wait to connect, or for the next bytes of an answer: long enough for a
        slow store, short enough that a try of a call that stopped being answered ends within the timeout."""
        return max(1.0, min(20.0, self.timeout / 3))


def policy_from_env() -> RetryPolicy:
    """The policy `CKPTCTL_IO_RETRIES` and `CKPTCTL_IO_TIMEOUT` ask for (defaults where unset or invalid)."""
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


#: The retry policy of every remote call, from `CKPTCTL_IO_RETRIES` and `CKPTCTL_IO_TIMEOUT` (tests and
#: embedding applications may replace it: `monkeypatch.setattr(io.failures, "RETRY", ...)`).
RETRY = policy_from_env()


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


def error_code(exc: BaseException) -> str | None:
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


def transient_code(code: object) -> bool:
    """Whether an object store's error code (a request's, or one key's in a batched delete) is one that
    goes away when the request is repeated a moment later."""
    return str(code) in _TRANSIENT_CODES


def is_transient(exc: BaseException) -> bool:
    """Whether repeating the call may succeed: throttling, server errors, timeouts, dropped connections."""
    if isinstance(exc, CkptctlError | FileNotFoundError | PermissionError | IsADirectoryError | NotADirectoryError):
        return False
    code = error_code(exc)
    if code is not None:
        return code in _TRANSIENT_CODES
    if _class_names(exc) & (_TRANSIENT_CLASSES | {"EndpointConnectionError"}):
        return True
    if isinstance(exc, TimeoutError | ConnectionError):
        return True
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS


def is_read_timeout(exc: BaseException) -> bool:
    """Whether a request was sent and its answer did not come in time (the store may still be at work on it)."""
    return bool(_class_names(exc) & {"ReadTimeoutError", "ServerTimeoutError"})


def call(fn: Callable[[], T], what: str, url: str) -> T:
    """Run one remote call on the store of `url`, retrying transient failures with exponential backoff and
    jitter within the `RETRY` policy's attempts and timeout.

    Raises:
        StorageError: the store kept failing (or stopped answering) until the attempts or the time ran out,
            or it stopped answering a moment ago (then nothing is tried).
    """
    policy = RETRY
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
            if not is_transient(exc):
                raise
            delay = policy.delay(failures)
            now = time.monotonic()
            elapsed = now - start
            # A try that failed slowly (a timeout) will likely fail as slowly again: start one only if it
            # can end within the timeout.
            if failures < policy.attempts and elapsed + delay + (now - tried) < policy.timeout:
                import logging  # on a retry only: not the import of every command (DESIGN §5)

                logging.getLogger("ckptctl.io").debug(
                    "%s failed (%s: %s); retry %d in %.2fs", what, type(exc).__name__, exc, failures, delay
                )
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
    return f"{scheme_of(url)}://{bucket_of(url)}"


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


def _credentials_hint(url: str) -> str:
    scheme = scheme_of(url)
    if scheme in ("s3", "s3a"):
        return (
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE (see `aws configure`); "
            "for an S3-compatible store also AWS_ENDPOINT_URL"
        )
    if scheme in ("gs", "gcs"):
        return "run `gcloud auth application-default login` or set GOOGLE_APPLICATION_CREDENTIALS"
    return f"configure credentials for {scheme}:// as its fsspec driver documents"


def remote_error(url: str, exc: BaseException) -> CkptctlError | None:
    """A clear error for a failure of a remote call, or None to let it propagate unchanged."""
    code = error_code(exc)
    names = _class_names(exc)
    if code in ("NoSuchBucket", "NoSuchBucketPolicy") or (
        isinstance(exc, FileNotFoundError) and "bucket does not exist" in str(exc).lower()
    ):
        return CheckpointNotFound(
            f"bucket {bucket_of(url)!r} does not exist ({url})",
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
    if is_transient(exc):
        return StorageError(
            f"the object store kept failing for {url} after {RETRY.attempts} tries: {exc}",
            "try again later, or raise CKPTCTL_IO_RETRIES",
        )
    return None


@contextlib.contextmanager
def translate_errors(url: str) -> Iterator[None]:
    try:
        yield
    except CkptctlError:
        raise
    except Exception as exc:
        if not is_local(url):
            mapped = remote_error(url, exc)
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


def check_size(url: str, size: int, max_size: int) -> None:
    if size > max_size:
        raise CorruptCheckpoint(
            f"{url} is larger than {format_size(max_size)}, more than a file of its kind ever holds",
            "it is not the metadata file its name says; replace it with the real file",
        )
