"""Deletes on the local S3 server whose DeleteObjects answers (a 200) list keys as not deleted: keys that failed
for a reason that passes (`SlowDown`, `InternalError`) are tried again until they are gone, and keys that stay
undeleted are an error naming them (exit code 2), never objects silently left behind. Faults are injected
into both clients that send DeleteObjects: `io.s3`'s botocore client and s3fs's."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptctl import io
from ckptctl.errors import StorageError
from ckptctl.io import failures
from ckptctl.io.s3 import S3Backend
from tests.s3.server import S3Server

#: Whether DeleteObjects fails for a key this time (given the key and how many times it was asked for it).
Fault = Callable[[str, int], bool]


@pytest.fixture
def faulty_deletes(monkeypatch: pytest.MonkeyPatch) -> Callable[[Fault, str], dict[str, int]]:
    """Make DeleteObjects answer `code` for the keys `fault` picks, leaving them in place (as S3 does under
    load); returns how often each key was asked for."""
    import s3fs

    asked: dict[str, int] = {}
    monkeypatch.setattr(failures, "RETRY", failures.RetryPolicy(attempts=4, base_delay=0.01, timeout=30.0))

    def install(fault: Fault, code: str) -> dict[str, int]:
        def split(kwargs: dict[str, Any]) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
            keep, send = [], []
            for item in kwargs["Delete"]["Objects"]:
                asked[item["Key"]] = asked.get(item["Key"], 0) + 1
                (keep if fault(item["Key"], asked[item["Key"]]) else send).append(item)
            kwargs["Delete"] = {**kwargs["Delete"], "Objects": send}
            return keep, send

        def errors_for(keep: list[dict[str, str]]) -> list[dict[str, str]]:
            return [{"Key": item["Key"], "Code": code, "Message": "injected"} for item in keep]

        real_call = S3Backend.call_s3

        def call_s3(self: S3Backend, method: str, **kwargs: Any) -> Any:
            if method != "delete_objects":
                return real_call(self, method, **kwargs)
            keep, send = split(kwargs)
            answer = dict(real_call(self, method, **kwargs)) if send else {}
            return {**answer, "Errors": errors_for(keep)} if keep else answer

        real_async = s3fs.S3FileSystem._call_s3

        async def call_s3_async(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
            if method != "delete_objects":
                return await real_async(self, method, *args, **kwargs)
            keep, send = split(kwargs)
            answer = dict(await real_async(self, method, *args, **kwargs)) if send else {}
            return {**answer, "Errors": errors_for(keep)} if keep else answer

        monkeypatch.setattr(S3Backend, "call_s3", call_s3)
        monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", call_s3_async)
        return asked

    return install


def objects(bucket: str, count: int) -> tuple[str, list[str]]:
    folder = f"{bucket}/{secrets.token_hex(4)}"
    urls = [f"{folder}/sub/file-{i}" for i in range(count)]
    for url in urls:
        io.write_bytes_atomic(url, b"x")
    return folder, urls


@pytest.mark.parametrize("how", ["files", "tree"])
@pytest.mark.parametrize("code", ["SlowDown", "InternalError"])
def test_keys_a_delete_did_not_delete_for_a_passing_reason_are_tried_again(
    bucket: str, faulty_deletes: Callable[[Fault, str], dict[str, int]], how: str, code: str
) -> None:
    folder, urls = objects(bucket, 5)
    asked = faulty_deletes(lambda key, times: key.endswith(("-1", "-3")) and times <= 2, code)
    if how == "files":
        io.delete_files(urls)
    else:
        io.delete_tree(folder)
    assert io.list_tree(folder) == {}
    # the keys that failed were asked for again, and only they
    assert sorted(asked.values()) == [1, 1, 1, 3, 3]


@pytest.mark.parametrize("how", ["files", "tree"])
def test_keys_that_stay_undeleted_are_an_error_naming_them(
    bucket: str, faulty_deletes: Callable[[Fault, str], dict[str, int]], how: str
) -> None:
    folder, urls = objects(bucket, 3)
    faulty_deletes(lambda key, times: key.endswith("-2"), "SlowDown")
    with pytest.raises(StorageError, match=r"did not delete s3://.*/sub/file-2 \(SlowDown: injected\)") as caught:
        if how == "files":
            io.delete_files(urls)
        else:
            io.delete_tree(folder)
    assert caught.value.exit_code == 2
    assert set(io.list_tree(folder)) == {"sub/file-2"}


def test_a_key_refused_for_good_is_not_tried_again(
    bucket: str, faulty_deletes: Callable[[Fault, str], dict[str, int]]
) -> None:
    folder, _ = objects(bucket, 3)
    asked = faulty_deletes(lambda key, times: key.endswith("-0"), "AccessDenied")
    with pytest.raises(StorageError, match=r"did not delete s3://.*/sub/file-0 \(AccessDenied") as caught:
        io.delete_tree(folder)
    assert "s3:DeleteObject permission" in (caught.value.hint or "")
    assert set(io.list_tree(folder)) == {"sub/file-0"} and max(asked.values()) == 1


def test_prune_on_s3_keeps_reporting_a_checkpoint_whose_objects_stay(
    run_cli: Any,
    demo_dir: Path,
    bucket: str,
    s3_server: S3Server,
    faulty_deletes: Callable[[Fault, str], dict[str, int]],
) -> None:
    """`prune` of a run on S3 whose store keeps refusing to delete one of a doomed checkpoint's files reports
    that checkpoint as not deleted, with the key, and fails (exit 1, prune's for a deletion that failed),
    rather than reporting it deleted with its objects left there."""
    run = s3_server.upload(demo_dir / "native", f"{bucket}/run")
    faulty_deletes(lambda key, times: key.endswith("/step-10/rng.json"), "InternalError")
    result = run_cli("prune", run, "--keep-last", "1", "--grace", "0s", "--yes", "--json")
    assert result.exit_code == 1, result.stdout
    assert "step-10/rng.json" in result.stdout and "did not delete" in result.stdout
    assert "step-10/rng.json" in io.list_tree(run)
