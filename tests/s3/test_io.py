"""The transfer helpers of `ckptctl.io` on an fsspec store: parallel range reads and downloads keep their
order and count every byte; a failed transfer stops the ones not yet started; a listing snapshot answers
as the store does, without asking it; a large upload goes in parts, and a failed part aborts it (nothing listed)."""

from __future__ import annotations

import hashlib
import secrets
import threading
from pathlib import Path

import fsspec
import pytest

from ckptctl import io
from ckptctl.errors import CheckpointNotFound, StorageError
from ckptctl.io import remote as io_remote
from ckptctl.io.s3 import S3Backend
from tests.s3.server import copy_to_store


@pytest.fixture
def blob(memory_store: str) -> tuple[str, bytes]:
    data = secrets.token_bytes(100_003)
    url = f"{memory_store}/io/{secrets.token_hex(4)}.bin"
    io.write_bytes_atomic(url, data)
    return url, data


def test_read_ranges_returns_each_range_in_request_order(blob: tuple[str, bytes]) -> None:
    url, data = blob
    requests = [(url, start, 1000) for start in range(99_000, -1, -9_000)]
    before = io.READ_STATS.bytes_read
    chunks = io.read_ranges(requests, max_workers=4)
    assert chunks == [data[s : s + 1000] for _, s, _ in requests]
    assert io.READ_STATS.bytes_read - before == sum(len(c) for c in chunks)


@pytest.mark.parametrize("workers", [1, 3, 16])
def test_download_file_in_parallel_blocks(
    blob: tuple[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    url, data = blob
    monkeypatch.setattr(io, "REMOTE_BLOCK", 7_000)  # 15 blocks, the last one short
    hasher = hashlib.sha256()
    size = io.download_file(url, str(tmp_path / "copy.bin"), hasher.update, max_workers=workers)
    assert size == len(data) and (tmp_path / "copy.bin").read_bytes() == data
    assert hasher.digest() == hashlib.sha256(data).digest()  # blocks reached the hasher in order


def test_download_of_a_missing_file_is_not_found(memory_store: str, tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFound):
        io.download_file(f"{memory_store}/io/absent.bin", str(tmp_path / "x"))


def test_parallel_map_stops_after_the_first_failure() -> None:
    started: list[int] = []
    gate = threading.Event()

    def work(i: int) -> int:
        started.append(i)
        if i == 0:
            raise StorageError("upload failed")
        gate.wait(0.05)
        return i

    with pytest.raises(StorageError, match="upload failed"):
        io.parallel_map(work, list(range(200)), max_workers=2)
    assert len(started) < 200  # the calls not yet started were cancelled
    assert io.parallel_map(lambda i: i * i, [3, 1, 2]) == [9, 1, 4]


@pytest.mark.parametrize("scheme", ["s3", "memory"])
def test_a_listing_snapshot_answers_as_the_store_does(
    demo_dir: Path, stores: dict[str, str], scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = copy_to_store(demo_dir / "native", f"{stores[scheme]}/snapshot-{secrets.token_hex(3)}")
    fs, path = fsspec.core.url_to_fs(root, use_listings_cache=False)
    fs.pipe_file(f"{path}/deep/a/b/c.txt", b"deep")
    folders = ["", "step-10", "step-30", "deep", "deep/a", "deep/a/b", "nothing"]
    files = ["latest", "step-30/ckptctl-manifest.json", "deep/a/b/c.txt", "nothing.txt"]

    def answers() -> list[object]:
        out: list[object] = []
        for rel in folders:
            url = f"{root}/{rel}".rstrip("/")
            try:
                listing: object = [(e.name, e.is_dir, e.size) for e in io.list_dir(url)]
            except CheckpointNotFound:
                listing = "not found"
            out += [listing, io.is_dir(url), io.exists(url), sorted((k, e.size) for k, e in io.list_tree(url).items())]
        for rel in files:
            url = f"{root}/{rel}"
            out += [io.exists(url), io.is_dir(url), io.file_size(url) if io.exists(url) else None]
        out.append(io.read_bytes(f"{root}/latest"))
        return out

    expected = answers()
    with io.listing_snapshot(f"{root}/"):
        calls: list[str] = []
        real_fs = io_remote._fs  # counts what reaches the store

        def counting_fs(url: str) -> tuple[object, str]:
            calls.append(url)
            return real_fs(url)

        monkeypatch.setattr(io_remote, "_fs", counting_fs)
        assert answers() == expected
        assert answers() == expected  # `latest`, a small file, is read once
        in_threads = io.parallel_map(lambda rel: io.is_dir(f"{root}/{rel}"), folders)
        assert calls == [f"{root}/latest"]
    assert in_threads == [True] * 6 + [False]


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Multipart from 8 MiB in parts of 5 MiB (S3's smallest part but the last; the suite's server, moto,
    refuses smaller ones as S3 does: `moto/s3/models.py`, `EntityTooSmall` below `S3_UPLOAD_PART_MIN_SIZE`), and
    a 12 MiB file: three parts, the last one short."""
    monkeypatch.setattr(io_remote, "MULTIPART_THRESHOLD", 8 << 20)
    monkeypatch.setattr(io_remote, "PART_SIZE", 5 << 20)
    source = tmp_path / "big.bin"
    source.write_bytes(secrets.token_bytes((12 << 20) + 123))
    return source


def s3_calls(monkeypatch: pytest.MonkeyPatch, fail_part: int | None = None) -> list[str]:
    """Record the S3 operations ckptctl's multipart upload asks botocore for (`io.s3`: s3:// as the suite
    reaches it); make part `fail_part` fail as a store that refuses it would (access denied: not retried)."""
    calls: list[str] = []
    real = S3Backend.call_s3

    def recorded(self: object, method: str, *args: object, **kwargs: object) -> object:
        calls.append(method)
        if method == "upload_part" and kwargs.get("PartNumber") == fail_part:
            raise PermissionError(f"Access Denied (part {fail_part})")
        return real(self, method, *args, **kwargs)

    monkeypatch.setattr(S3Backend, "call_s3", recorded)
    return calls


def test_a_large_file_goes_up_in_parts_and_arrives_whole(
    small_parts: Path, bucket: str, s3_server: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = s3_calls(monkeypatch)
    url = f"{bucket}/up/big.bin"
    io.upload_file(str(small_parts), url)
    assert sorted(calls) == ["complete_multipart_upload", "create_multipart_upload", *["upload_part"] * 3]
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    assert fs.cat_file(url) == small_parts.read_bytes()
    assert fs.info(url)["ETag"].strip('"').endswith("-3")  # S3's ETag of an object completed from 3 parts


def test_a_multipart_upload_is_made_with_crc32_checksums_as_aws_makes_it(
    small_parts: Path, bucket: str, s3_server: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Begun with CRC32 as its algorithm, each part sent with its checksum and the completion listing them,
    as `aws s3` does (the store checks each part's, and keeps their composite rather than computing a
    checksum of the whole object); none where botocore is told to send checksums only where required."""
    asked: list[tuple[str, dict[str, object]]] = []
    real = S3Backend.call_s3

    def recorded(self: S3Backend, method: str, *args: object, **kwargs: object) -> object:
        asked.append((method, kwargs))
        return real(self, method, *args, **kwargs)

    monkeypatch.setattr(S3Backend, "call_s3", recorded)
    url = f"{bucket}/up/big.bin"
    io.upload_file(str(small_parts), url)
    made = dict(asked)
    assert made["create_multipart_upload"]["ChecksumAlgorithm"] == "CRC32"
    assert made["upload_part"]["ChecksumAlgorithm"] == "CRC32"
    parts = made["complete_multipart_upload"]["MultipartUpload"]["Parts"]  # type: ignore[index]
    assert len(parts) == 3 and all(part["ChecksumCRC32"] for part in parts)
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    assert fs.cat_file(url) == small_parts.read_bytes()

    asked.clear()
    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
    io.upload_file(str(small_parts), url)
    assert not any("ChecksumAlgorithm" in kwargs for _, kwargs in asked)
    assert fs.cat_file(url) == small_parts.read_bytes()


def test_parts_in_flight_go_in_the_order_their_uploads_began() -> None:
    """The process's part slots are handed out by (upload, part), not to whichever thread asks first: one
    upload's parts go before the next one's, so that each upload's completion overlaps the next's parts."""
    slots = io_remote._PartSlots(1)
    order: list[tuple[int, int]] = []
    first, second = slots.ticket(), slots.ticket()
    threads = []
    with slots.hold(first, 1):
        for upload, part in [(second, 1), (first, 3), (second, 2), (first, 2)]:
            thread = threading.Thread(target=lambda u=upload, p=part: _take(slots, u, p, order))
            thread.start()
            threads.append(thread)
        while len(slots.waiting) < 4:
            threading.Event().wait(0.01)
    for thread in threads:
        thread.join(10)
    assert order == [(first, 2), (first, 3), (second, 1), (second, 2)]
    assert slots.free == 1 and not slots.waiting


def _take(slots: io_remote._PartSlots, upload: int, part: int, order: list[tuple[int, int]]) -> None:
    with slots.hold(upload, part):
        order.append((upload, part))


def test_a_failed_part_aborts_the_upload_and_leaves_nothing(
    small_parts: Path, bucket: str, s3_server: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = s3_calls(monkeypatch, fail_part=2)
    url = f"{bucket}/up/big.bin"
    with pytest.raises(StorageError, match="access denied"):
        io.upload_file(str(small_parts), url)
    assert calls[-1] == "abort_multipart_upload" and "complete_multipart_upload" not in calls
    assert io.list_tree(f"{bucket}/up") == {}
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    assert fs.call_s3("list_multipart_uploads", Bucket=bucket.removeprefix("s3://")).get("Uploads", []) == []


def test_a_completion_whose_answer_was_lost_is_not_a_failure(
    small_parts: Path, bucket: str, s3_server: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store completes the upload but the answer is lost (a reset connection, retried): the retry finds
    no such upload, and the object there is proved the completion of these parts by its multipart ETag."""
    real = S3Backend.call_s3
    completions: list[str] = []

    def answer_lost(self: object, method: str, *args: object, **kwargs: object) -> object:
        if method != "complete_multipart_upload":
            return real(self, method, *args, **kwargs)
        completions.append(method)
        if len(completions) > 1:  # S3 forgets a completed upload (moto answers a repeat with 200)
            raise FileNotFoundError("NoSuchUpload: The specified upload does not exist")
        real(self, method, *args, **kwargs)
        raise ConnectionResetError("Connection reset by peer")  # completed, but the answer never came

    monkeypatch.setattr(S3Backend, "call_s3", answer_lost)
    url = f"{bucket}/up/big.bin"
    io.upload_file(str(small_parts), url)
    assert len(completions) == 2  # the lost answer was retried, and the retry refused
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    assert fs.cat_file(url) == small_parts.read_bytes()


def test_a_completion_that_timed_out_is_waited_for_not_sent_again(
    small_parts: Path, bucket: str, s3_server: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store is still building the object when the answer times out (moto sends nothing until it is
    done): the object is waited for as these parts' completion, and the completion is not sent again (a
    second one would build the object twice, or be refused as no such upload)."""

    class ReadTimeoutError(Exception):  # botocore's, by name, as `io.failures` matches it
        pass

    real = S3Backend.call_s3
    completions: list[str] = []
    done = threading.Event()

    def slow(self: object, method: str, *args: object, **kwargs: object) -> object:
        if method != "complete_multipart_upload":
            return real(self, method, *args, **kwargs)
        completions.append(method)
        # completed a moment after the answer was given up on
        threading.Timer(0.3, lambda: (real(self, method, *args, **kwargs), done.set())).start()
        raise ReadTimeoutError("Read timeout on endpoint URL")

    monkeypatch.setattr(S3Backend, "call_s3", slow)
    url = f"{bucket}/up/big.bin"
    io.upload_file(str(small_parts), url)
    assert done.wait(10) and completions == ["complete_multipart_upload"]
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    assert fs.cat_file(url) == small_parts.read_bytes()
    assert io_remote._BUFFERS.free == {}  # the part buffers are let go once no upload is under way


def test_a_completion_that_timed_out_and_never_came_is_sent_again(
    small_parts: Path, bucket: str, s3_server: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The completion's answer timed out and the store never built the object (the request was lost on its
    way): once the wait for it is over the completion is sent again, rather than the upload failing with the
    store called unreachable (which makes every other call on it fail at once) while it answered each HEAD."""

    class ReadTimeoutError(Exception):  # botocore's, by name, as `io.failures` matches it
        pass

    monkeypatch.setattr(io.failures, "RETRY", io.RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.01, timeout=2.0))
    real = S3Backend.call_s3
    completions: list[str] = []

    def lost(self: object, method: str, *args: object, **kwargs: object) -> object:
        if method == "complete_multipart_upload":
            completions.append(method)
            if len(completions) == 1:
                raise ReadTimeoutError("Read timeout on endpoint URL")  # never reached the store
        return real(self, method, *args, **kwargs)

    monkeypatch.setattr(S3Backend, "call_s3", lost)
    url = f"{bucket}/up/big.bin"
    io.upload_file(str(small_parts), url)
    assert completions == ["complete_multipart_upload"] * 2
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    assert fs.cat_file(url) == small_parts.read_bytes()


def test_a_completion_that_never_came_fails_without_calling_the_store_unreachable(
    small_parts: Path, bucket: str, s3_server: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every completion times out and no object comes, while the store answers everything else: the upload
    fails, and the calls that follow on the store are made (not refused as to a store that stopped answering)."""

    class ReadTimeoutError(Exception):
        pass

    monkeypatch.setattr(io.failures, "RETRY", io.RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.01, timeout=2.0))
    real = S3Backend.call_s3

    def lost(self: object, method: str, *args: object, **kwargs: object) -> object:
        if method == "complete_multipart_upload":
            raise ReadTimeoutError("Read timeout on endpoint URL")
        return real(self, method, *args, **kwargs)

    monkeypatch.setattr(S3Backend, "call_s3", lost)
    url = f"{bucket}/up/big.bin"
    with pytest.raises(StorageError):
        io.upload_file(str(small_parts), url)
    io.write_bytes_atomic(f"{bucket}/up/small.bin", b"the store answers")
    assert io.read_bytes(f"{bucket}/up/small.bin") == b"the store answers"


def test_a_lost_completion_of_other_bytes_is_still_a_failure(
    small_parts: Path, bucket: str, s3_server: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the object at the key is not these parts' completion (another writer's), the failure stands."""
    real = S3Backend.call_s3
    url = f"{bucket}/up/big.bin"

    def refused(self: object, method: str, *args: object, **kwargs: object) -> object:
        if method == "complete_multipart_upload":
            real(self, "put_object", Bucket=kwargs["Bucket"], Key=kwargs["Key"], Body=b"someone else's")
            raise PermissionError("Access Denied (complete)")
        return real(self, method, *args, **kwargs)

    monkeypatch.setattr(S3Backend, "call_s3", refused)
    with pytest.raises(StorageError, match="access denied"):
        io.upload_file(str(small_parts), url)


@pytest.mark.parametrize("scheme", ["s3", "memory"])
def test_a_stamped_read_gives_the_bytes_and_the_time_the_listing_gives(stores: dict[str, str], scheme: str) -> None:
    url = f"{stores[scheme]}/stamped/{secrets.token_hex(4)}"
    io.write_bytes_atomic(url, b"0123456789")
    data, mtime = io.read_stamped(url, 4)
    assert data == b"0123"
    listed = {e.name: e for e in io.list_dir(io.parent_of(url))}[io.name_of(url)]
    assert mtime == listed.mtime
    with pytest.raises(CheckpointNotFound):
        io.read_stamped(f"{url}-absent", 4)


def test_an_object_store_lock_is_taken_and_released_in_five_calls(bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Taking a lock: is one there (HEAD), write ours (PUT), read it back with its time (GET); releasing
    it: is it still ours (GET), remove it (DELETE). No listing: each is a round trip a sync waits for."""
    from ckptctl.core.lock import RunLock, RunLocked

    calls: list[str] = []
    real = S3Backend.call_s3

    def recorded(self: object, method: str, *args: object, **kwargs: object) -> object:
        calls.append(method)
        return real(self, method, *args, **kwargs)

    monkeypatch.setattr(S3Backend, "call_s3", recorded)
    lock = RunLock(f"{bucket}/run", name=".lock")
    lock.acquire()
    assert calls == ["head_object", "put_object", "get_object"]
    with pytest.raises(RunLocked):  # held: another cannot take it
        RunLock(f"{bucket}/run", name=".lock").acquire()
    calls.clear()
    lock.release()
    assert calls == ["get_object", "delete_object"]
    assert not io.exists(f"{bucket}/run/.lock")


def test_an_empty_folder_lists_empty_as_it_is_a_folder(bucket: str) -> None:
    """A folder whose only object is its `key/` placeholder (what consoles and other tools create) lists as
    empty where `is_dir` says it is a folder; a name with nothing at or below it is not found."""
    from ckptctl.io.s3 import S3

    name = bucket.partition("://")[2]
    S3.call_s3("put_object", Bucket=name, Key="empty/", Body=b"")
    assert io.is_dir(f"{bucket}/empty") and io.list_dir(f"{bucket}/empty") == []
    with pytest.raises(CheckpointNotFound):
        io.list_dir(f"{bucket}/nothing")


def test_of_two_lock_creators_in_the_same_instant_the_store_refuses_the_second(
    bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both looked before either wrote (the look is made to find nothing): the second PUT is conditional on no
    object having the key, so it is refused and the first writer's lock stays; a PUT sent again after its
    answer was lost finds its own object and knows it is its own."""
    from ckptctl.io import lockfile

    url = f"{bucket}/run/.lock"
    monkeypatch.setattr(lockfile, "_file_there", lambda url: False)
    assert lockfile.create(url, b"first")
    assert not lockfile.create(url, b"second")
    assert io.read_bytes(url) == b"first"
    assert io.create_new(url, b"first") is True  # the retry of a PUT that went through


@pytest.mark.parametrize("refusal", ["NotImplemented", "InvalidArgument", "ParamValidationError"])
def test_a_store_without_conditional_puts_still_gets_the_lock_written_and_read_back(
    bucket: str, monkeypatch: pytest.MonkeyPatch, refusal: str
) -> None:
    """A store that answers 501 (or 400) to `If-None-Match` (some S3-compatible stores), or a botocore that
    does not know the parameter (before 1.35), is written to as before the condition: one PUT, read back."""
    from botocore.exceptions import ClientError, ParamValidationError

    from ckptctl.io import lockfile

    real = S3Backend.call_s3

    def no_condition(self: object, method: str, **kwargs: object) -> object:
        if kwargs.get("IfNoneMatch"):
            if refusal == "ParamValidationError":
                raise ParamValidationError(report="Unknown parameter in input: IfNoneMatch")
            raise ClientError({"Error": {"Code": refusal, "Message": "no"}}, method)
        return real(self, method, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(S3Backend, "call_s3", no_condition)
    url = f"{bucket}/plain-{refusal}/.lock"
    assert io.create_new(url, b"mine") is None
    assert lockfile.create(url, b"mine") and io.read_bytes(url) == b"mine"
    assert not lockfile.create(url, b"theirs")


def test_a_conditional_put_that_meets_another_under_way_is_sent_again(
    bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """409 ConditionalRequestConflict (another conditional write of the key under way, perhaps this writer's
    own earlier try whose answer was lost) is tried again rather than taken for a lock held by someone."""
    from botocore.exceptions import ClientError

    from ckptctl.io import s3

    real = S3Backend.call_s3
    conflicts = [1]

    def conflict_once(self: object, method: str, **kwargs: object) -> object:
        if kwargs.get("IfNoneMatch") and conflicts:
            conflicts.pop()
            raise ClientError({"Error": {"Code": "ConditionalRequestConflict", "Message": "busy"}}, method)
        return real(self, method, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(S3Backend, "call_s3", conflict_once)
    monkeypatch.setattr(s3, "_CONFLICT_WAITS", (0.0, 0.0))
    url = f"{bucket}/conflict/.lock"
    assert io.create_new(url, b"mine") is True and not conflicts
    assert io.read_bytes(url) == b"mine"
