"""`prune` where it cannot write its lock file (issue 16, point 4): a full disk (ENOSPC), a read-only mount,
a folder it may not write. Each used to end in "internal error"; now exit 2 with a message naming the lock
file and the cause, nothing deleted, and no empty lock left behind to hold off the next prune.

The real conditions need mounts (a small tmpfs, a read-only bind mount) and `chattr +i` (root ignores
permission bits): where this machine does not allow them, those tests skip, and the in-process tests at the
end, which make the lock's system calls fail with the same errors, still cover the code.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptctl.core.lock import LOCK_NAME, LockUnusable, RunLock
from ckptctl.io import lockfile
from tests.hostile.conftest import Source
from tests.hostile.harness import run_ckptctl

STEPS = ["step-10", "step-20", "step-30"]


def _steps(run: Path) -> list[str]:
    return sorted(p.name for p in run.iterdir() if p.name.startswith("step-"))


def _try(*command: str) -> bool:
    return subprocess.run(command, capture_output=True).returncode == 0


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[Callable[..., bool]]:
    """`mount(*args, target)`: mount, unmounted after the test; False where this machine does not allow it."""
    mounted: list[Path] = []

    def mount(*args: str, target: Path) -> bool:
        target.mkdir(parents=True, exist_ok=True)
        if not _try("mount", *args, str(target)):
            return False
        mounted.append(target)
        return True

    yield mount
    for target in reversed(mounted):
        _try("umount", "-l", str(target))


def _prune(run: Path) -> Any:
    return run_ckptctl(["prune", str(run), "--keep-last", "1", "--grace", "0", "--yes", "--wait", "0"], timeout=60)


def test_prune_on_a_full_disk(mounts: Callable[..., bool], tmp_path: Path, sources: dict[str, Source]) -> None:
    disk = tmp_path / "disk"
    if not mounts("-t", "tmpfs", "-o", "size=8m", "tmpfs", target=disk):
        pytest.skip("mounting a tmpfs is not permitted here (the in-process test below covers ENOSPC)")
    run = Path(shutil.copytree(sources["native"].run, disk / "run"))
    with open(disk / "filler", "wb") as filler:
        try:
            while True:
                filler.write(b"\0" * (64 << 10))
                filler.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    outcome = _prune(run)
    outcome.assert_refused(2)
    assert f"cannot create the lock file {run / LOCK_NAME}: no space left" in outcome.stderr, outcome.stderr
    assert _steps(run) == STEPS and not (run / LOCK_NAME).exists()


def test_prune_on_a_read_only_mount(mounts: Callable[..., bool], tmp_path: Path, sources: dict[str, Source]) -> None:
    source = Path(shutil.copytree(sources["native"].run, tmp_path / "source"))
    run = tmp_path / "mounted"
    # Older mount(8) ignores "ro" on a bind: a mount that takes a new file is not read-only.
    if not mounts("--bind", "-o", "ro", str(source), target=run) or _try("touch", str(run / "probe")):
        pytest.skip("a read-only bind mount is not possible here (the in-process test below covers EROFS)")
    outcome = _prune(run)
    outcome.assert_refused(2)
    assert f"cannot create the lock file {run / LOCK_NAME}: the file system is read-only" in outcome.stderr
    assert _steps(run) == STEPS
    planned = run_ckptctl(["prune", str(run), "--keep-last", "1", "--grace", "0", "--dry-run"])
    planned.assert_refused(0)


@pytest.fixture
def immutable(tmp_path: Path, sources: dict[str, Source]) -> Iterator[Path]:
    """A copy of the native run in a folder nobody may write, root included (`chattr +i`)."""
    run = Path(shutil.copytree(sources["native"].run, tmp_path / "run"))
    if not _try("chattr", "+i", str(run)):
        pytest.skip("chattr +i is not possible here (the in-process test below covers EACCES)")
    try:
        yield run
    finally:
        _try("chattr", "-i", str(run))


def test_prune_in_a_folder_it_may_not_write(immutable: Path) -> None:
    outcome = _prune(immutable)
    outcome.assert_refused(2)
    assert f"cannot create the lock file {immutable / LOCK_NAME}: permission denied" in outcome.stderr
    assert _steps(immutable) == STEPS


# ------------------------------------------------------------------------------------------ in-process


def _failing_os(monkeypatch: pytest.MonkeyPatch, call: str, code: int) -> None:
    """Make `os.<call>` of the module that creates lock files (`io.lockfile`) fail with `code` (the rest of `os`
    unchanged)."""

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise OSError(code, os.strerror(code))

    proxy = types.SimpleNamespace(**{name: getattr(os, name) for name in dir(os) if not name.startswith("__")})
    setattr(proxy, call, fail)
    monkeypatch.setattr(lockfile, "os", proxy)


@pytest.mark.parametrize(
    ("call", "code", "said"),
    [
        ("write", errno.ENOSPC, "no space left on the device"),
        ("open", errno.EROFS, "the file system is read-only"),
        ("open", errno.EACCES, "permission denied"),
    ],
)
def test_a_lock_that_cannot_be_written_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, call: str, code: int, said: str
) -> None:
    """Simulated: the lock's `os.open`/`os.write` fail as they do on a read-only, unwritable or full disk."""
    _failing_os(monkeypatch, call, code)
    with pytest.raises(LockUnusable, match=f"cannot create the lock file {tmp_path / LOCK_NAME}: {said}") as caught:
        RunLock(str(tmp_path)).acquire()
    assert caught.value.exit_code == 2 and caught.value.hint
    assert not (tmp_path / LOCK_NAME).exists()  # a half-written lock is removed
