"""The takeover of a stale lock on the local S3 server deletes the lock it judged and only that one: a lock
another process put in its place between the judgment and the delete stays (a DELETE on condition of the
judged object's ETag), so that two processes breaking the same stale lock cannot both hold it."""

from __future__ import annotations

import json
import socket
import warnings

import pytest

from ckptctl import io
from ckptctl.core.lock import RunLock, RunLocked, read_lock
from ckptctl.io import lockfile
from ckptctl.io.s3 import S3Backend


def test_a_lock_replaced_while_it_was_judged_stays(bucket: str) -> None:
    url = f"{bucket}/run/lock"
    assert lockfile.create(url, b"the stale one")

    def judged_then_overtaken(at: str) -> bool:
        found = lockfile.read(at, 100)
        # another process takes the stale lock away and makes its own right after this one's look
        io.delete_file(url)
        assert lockfile.create(url, b"the other's")
        return found is not None and found[0] == b"the stale one"

    assert not lockfile.take_away(url, judged_then_overtaken)
    found = lockfile.read(url, 100)
    assert found is not None and found[0] == b"the other's"


def test_a_stale_run_lock_on_s3_is_taken_over_once(bucket: str) -> None:
    """A dead holder's lock (its pid gone on this host) is taken over; a lock taken over meanwhile by another
    process is not deleted by a late takeover of the same stale lock."""
    run = f"{bucket}/run"
    dead = {"host": socket.gethostname(), "pid": 2**22 + 1, "token": "dead", "started": "2020-01-01T00:00:00+00:00"}
    io.write_bytes_atomic(f"{run}/.ckptctl-prune.lock", json.dumps(dead).encode())
    first, second = RunLock(run, command="first"), RunLock(run, command="second")
    stale = read_lock(first.url)
    assert stale is not None and stale[0] is not None
    with warnings.catch_warnings(record=True):
        first.acquire()  # takes the dead holder's lock over
    # the second judged the same stale lock before the first took it over, and breaks it only now
    assert not second._break(stale[0], stale[1])
    holder = read_lock(first.url)
    assert holder is not None and holder[0] is not None and holder[0].token == first.info.token
    first.check()
    first.release()


def test_a_stale_lock_the_store_will_not_delete_ends_in_locked_not_a_loop(
    bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Credentials that may write and read but not delete (a common bucket policy): the dead holder's lock
    cannot be taken away. Taking the lock gives up after its wait, as for a live holder, rather than asking
    the store again and again at once for ever."""
    run = f"{bucket}/run"
    dead = {"host": socket.gethostname(), "pid": 2**22 + 1, "token": "dead", "started": "2020-01-01T00:00:00+00:00"}
    io.write_bytes_atomic(f"{run}/.ckptctl-prune.lock", json.dumps(dead).encode())
    real = S3Backend.call_s3
    deletes: list[str] = []

    class Spinning(BaseException):  # passes every `except Exception`: ends the loop this test is about
        pass

    def no_delete(self: object, method: str, *args: object, **kwargs: object) -> object:
        if method == "delete_object":
            deletes.append(method)
            if len(deletes) > 50:
                raise Spinning(f"{len(deletes)} deletes of the same stale lock")
            raise PermissionError("Access Denied")
        return real(self, method, *args, **kwargs)

    monkeypatch.setattr(S3Backend, "call_s3", no_delete)
    lock = RunLock(run, wait=0.5, command="stuck")
    with warnings.catch_warnings(record=True), pytest.raises(RunLocked, match="could not be removed"):
        lock.acquire()
    assert 1 <= len(deletes) <= 20
    found = read_lock(lock.url)
    assert found is not None and found[0] is not None and found[0].token == "dead"
