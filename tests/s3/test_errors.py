"""What a user sees when the object store says no: a missing bucket, no credentials, rejected credentials,
access denied (exit 2, one clear message and a hint, no traceback); and transient failures retried."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ckptctl import io
from ckptctl.errors import CheckpointNotFound, StorageError
from ckptctl.io import remote as io_remote
from tests.conftest import CliResult
from tests.s3.server import S3Server, reset_s3fs

Cli = Callable[..., CliResult]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def fresh_clients() -> Iterator[None]:
    """Credentials are read when an s3fs client is made: make new ones for this test, and after it."""
    reset_s3fs()
    yield
    reset_s3fs()


def assert_clean_failure(result: CliResult, message: str, hint: str) -> None:
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert f"error: {message}" in result.stderr, result.stderr
    assert f"hint: {hint}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    assert result.stdout == ""


def test_a_missing_bucket_names_the_bucket(run_cli: Cli, s3_server: S3Server) -> None:
    for command in ("list", "inspect", "verify"):
        result = run_cli(command, "s3://ckptctl-no-such-bucket/run")
        assert_clean_failure(result, "bucket 'ckptctl-no-such-bucket' does not exist", "check the bucket name")


def test_a_store_that_stops_answering_is_not_a_missing_bucket(
    s3_server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A path was not found, and the store died before its bucket was looked up: s3fs's `exists` answers
    False for a bucket it cannot probe, which ckptctl reported as "bucket ... does not exist" (issue 21.5)."""
    import socket

    import s3fs

    monkeypatch.setattr(
        io.failures, "RETRY", io.RetryPolicy(attempts=2, base_delay=0.001, max_delay=0.001, timeout=5.0)
    )
    with socket.create_server(("127.0.0.1", 0)) as closed:
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"  # nothing listens there once closed
    store = s3fs.S3FileSystem(
        skip_instance_cache=True,
        endpoint_url=dead,
        config_kwargs={"connect_timeout": 1, "retries": {"max_attempts": 1}},
    )
    down = f"{bucket}-down"  # a store is marked unreachable by bucket: the live checks below use others
    assert store.exists(down.removeprefix("s3://")) is False  # what s3fs says of a store that is down
    with pytest.raises(StorageError, match="did not answer"):
        io_remote._check_bucket(f"{down}/run/step-1", store)
    live = s3_server.filesystem()
    io_remote._check_bucket(f"{bucket}/run/step-1", live)  # the bucket is there: nothing to say
    with pytest.raises(CheckpointNotFound, match="does not exist"):
        io_remote._check_bucket("s3://ckptctl-no-such-bucket/run", live)


def test_missing_credentials(run_cli: Cli, bucket: str, monkeypatch: pytest.MonkeyPatch, fresh_clients: None) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    result = run_cli("list", bucket)
    assert_clean_failure(result, f"no credentials found for {bucket}", "set AWS_ACCESS_KEY_ID")


def test_the_console_script_fails_cleanly_in_a_fresh_process(bucket: str) -> None:
    env = {**os.environ, "PYTHONPATH": REPO}
    del env["AWS_SECRET_ACCESS_KEY"]
    code = "from ckptctl.cli.app import main; main()"
    done = subprocess.run(
        [sys.executable, "-c", code, "verify", f"{bucket}/run"], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 2
    assert done.stderr.startswith(f"error: no credentials found for {bucket}/run\nhint: "), done.stderr


@pytest.fixture
def moto_auth(s3_server: S3Server) -> Iterator[Callable[[], tuple[str, str]]]:
    """Turn on the server's IAM checks for one test; yields a maker of a user with no permissions."""
    import boto3
    from moto import settings
    from moto.core.authorization import ActionAuthenticatorMixin

    def user_without_permissions() -> tuple[str, str]:
        iam = boto3.client("iam", region_name="us-east-1")
        name = f"nobody-{os.urandom(3).hex()}"
        iam.create_user(UserName=name)
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return key["AccessKeyId"], key["SecretAccessKey"]

    previous = settings.INITIAL_NO_AUTH_ACTION_COUNT
    enabled = False

    def make() -> tuple[str, str]:
        nonlocal enabled
        credentials = user_without_permissions()  # while checks are still off
        settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
        ActionAuthenticatorMixin.request_count = 0
        enabled = True
        return credentials

    reset_s3fs()
    try:
        yield make
    finally:
        if enabled:
            settings.INITIAL_NO_AUTH_ACTION_COUNT = previous
        reset_s3fs()


def test_rejected_credentials(
    run_cli: Cli, bucket: str, monkeypatch: pytest.MonkeyPatch, moto_auth: Callable[[], tuple[str, str]]
) -> None:
    moto_auth()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOTAREALKEY00000")
    result = run_cli("inspect", f"{bucket}/step-1")
    assert_clean_failure(
        result, f"the object store rejected the credentials for {bucket}/step-1 (InvalidAccessKeyId)", "set AWS_"
    )


def test_access_denied(
    run_cli: Cli, bucket: str, monkeypatch: pytest.MonkeyPatch, moto_auth: Callable[[], tuple[str, str]]
) -> None:
    key, secret = moto_auth()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    result = run_cli("list", f"{bucket}/run")
    assert_clean_failure(result, f"access denied: {bucket}/run", "the credentials in use lack a permission")


# --- retries ------------------------------------------------------------------------------------------


class FlakyStore:
    """An fsspec filesystem whose first `failures` calls of `method` fail with `error()`."""

    def __init__(self, inner: Any, method: str, failures: int, error: Callable[[], Exception]) -> None:
        self._inner, self._method, self._failures, self._error = inner, method, failures, error
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name != self._method:
            return attr

        def flaky(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls <= self._failures:
                raise self._error()
            return attr(*args, **kwargs)

        return flaky


def slow_down() -> Exception:
    """Throttling as s3fs raises it: an OSError(EBUSY) caused by botocore's ClientError `SlowDown`."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    error = ClientError({"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."}}, "GetObject")
    try:
        raise translate_boto_error(error) from error
    except OSError as exc:
        return exc


def no_such_key() -> Exception:
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    return translate_boto_error(ClientError({"Error": {"Code": "NoSuchKey", "Message": "gone"}}, "GetObject"))


@pytest.fixture
def flaky(monkeypatch: pytest.MonkeyPatch) -> Callable[..., FlakyStore]:
    monkeypatch.setattr(io.failures, "RETRY", io.RetryPolicy(attempts=4, base_delay=0.001, max_delay=0.001))
    real_fs = io_remote._fs

    def install(method: str, failures: int, error: Callable[[], Exception]) -> FlakyStore:
        fs, _ = real_fs("memory://x")
        store = FlakyStore(fs, method, failures, error)
        monkeypatch.setattr(io_remote, "_fs", lambda url: (store, real_fs(url)[1]))
        return store

    return install


@pytest.mark.parametrize(
    "error", [slow_down, lambda: ConnectionResetError(errno.ECONNRESET, "reset"), lambda: TimeoutError("slow")]
)
def test_transient_failures_are_retried(flaky: Callable[..., FlakyStore], error: Callable[[], Exception]) -> None:
    io.write_bytes_atomic("memory://ckptctl-retry/a.bin", b"payload")
    store = flaky("cat_file", 3, error)
    assert io.read_bytes("memory://ckptctl-retry/a.bin", 1, 3) == b"ayl"
    assert store.calls == 4


def test_retries_give_up_with_a_clear_message(flaky: Callable[..., FlakyStore]) -> None:
    store = flaky("cat_file", 10, slow_down)
    with pytest.raises(StorageError, match=r"kept failing .* after 4 tries") as caught:
        io.read_bytes("memory://ckptctl-retry/a.bin")
    assert store.calls == 4 and "CKPTCTL_IO_RETRIES" in caught.value.hint


def test_permanent_failures_are_not_retried(flaky: Callable[..., FlakyStore]) -> None:
    store = flaky("cat_file", 10, no_such_key)
    with pytest.raises(CheckpointNotFound):
        io.read_bytes("memory://ckptctl-retry/a.bin")
    assert store.calls == 1
