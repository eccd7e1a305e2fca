"""The writers' output cache (tests/writer_cache.py): keys, a killed build, a test that writes into an entry,
the files' times."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import writer_cache


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(writer_cache.ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _write(folder: Path) -> dict[str, Path]:
    (folder / "weights.bin").write_bytes(b"\x01" * 64)
    return {"weights": folder / "weights.bin"}


def _write_other(folder: Path) -> dict[str, Path]:
    (folder / "weights.bin").write_bytes(b"\x02" * 64)
    return {"weights": folder / "weights.bin"}


def _from(source: object) -> Callable[[Path], dict[str, Path]]:
    return lambda root: {**_write(root), "source": source}


def test_an_entry_is_built_once_and_read_after(cache: Path) -> None:
    calls = []

    def build(folder: Path) -> dict[str, Path]:
        calls.append(folder)
        return _write(folder)

    entry = writer_cache.entry_for("fixture", _write)
    assert entry is not None and entry.folder.parent == cache
    first = entry.get(build)
    again = writer_cache.entry_for("fixture", _write)
    assert again == entry and again.get(build) == first == {"weights": entry.out / "weights.bin"}
    assert calls == [entry.out]


def test_the_key_holds_the_writer_source_and_what_it_is_given() -> None:
    base = writer_cache.key_of("fixture", _write)
    assert writer_cache.key_of("fixture", _write) == base
    assert writer_cache.key_of("fixture", _write_other) != base  # another source
    assert writer_cache.key_of("other", _write) != base
    # The same lambda given another entry's folder (a fixture built from another one's output).
    assert writer_cache.key_of("fixture", _from(Path("/x/a"))) == writer_cache.key_of("fixture", _from(Path("/x/a")))
    assert writer_cache.key_of("fixture", _from(Path("/x/a"))) != writer_cache.key_of("fixture", _from(Path("/x/b")))
    # Another entry's value as its build returned it, and as a later run reads it back from the record: pickle
    # writes the parts the paths share once in the first, and the same key stands for both.
    root = Path("/x/run")
    built = {"single": root / "single", "sharded": root / "sharded"}
    read_back = pickle.loads(pickle.dumps(built))
    assert pickle.dumps(read_back, protocol=4) != pickle.dumps(built, protocol=4)
    assert writer_cache.key_of("fixture", _from(read_back)) == writer_cache.key_of("fixture", _from(built))


def test_the_key_follows_imports_and_modules_run_by_name(tmp_path: Path) -> None:
    reach = writer_cache._Reach()
    reach.add(writer_cache.key_of)  # a module-level function: its module and what that imports
    files = {p.relative_to(writer_cache.REPO).as_posix() for p in reach.files}
    assert files == {"tests/__init__.py", "tests/writer_cache.py"}
    assert {"filelock", "torch"} <= reach.imports

    from tests.core.conftest import _fsdp_run

    reach = writer_cache._Reach()
    reach.add(_fsdp_run)  # defined in a conftest: its own source, and what it calls (`_workers.fsdp`)
    files = {p.relative_to(writer_cache.REPO).as_posix() for p in reach.files}
    assert {"tests/core/_workers.py", "ckptctl/core/__init__.py"} <= files
    assert "tests/core/conftest.py" not in files and reach.texts[0].startswith("def _fsdp_run(")

    from tests.core.util import run_fresh_worker

    reach = writer_cache._Reach()
    reach.add(run_fresh_worker)  # `worker_command`'s `-m tests.core._workers`: a module run by name
    files = {p.relative_to(writer_cache.REPO).as_posix() for p in reach.files}
    assert {"tests/core/util.py", "tests/core/_workers.py", "ckptctl/core/__init__.py"} <= files


@pytest.mark.long
def test_a_killed_build_leaves_no_entry(cache: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(writer_cache.REPO)!r})
        from tests import writer_cache
        from tests.test_writer_cache import _write

        def build(folder):
            _write(folder)
            os.kill(os.getpid(), signal.SIGKILL)

        writer_cache.entry_for("fixture", _write).get(build)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ}, check=False)
    assert done.returncode == -9
    entry = writer_cache.entry_for("fixture", _write)
    assert entry is not None and (entry.out / "weights.bin").exists() and not entry.record.exists()

    assert entry.get(_write_other) == {"weights": entry.out / "weights.bin"}  # built again, from empty
    assert (entry.out / "weights.bin").read_bytes() == b"\x02" * 64 and sorted(os.listdir(entry.out)) == ["weights.bin"]


def test_a_changed_entry_is_named_and_dropped(cache: Path) -> None:
    entry = writer_cache.entry_for("fixture", _write)
    assert entry is not None
    entry.get(_write)
    assert entry.changes() == []
    with (entry.out / "weights.bin").open("r+b") as f:
        f.write(b"\x00")
    (entry.out / "new").write_text("x")
    assert entry.changes() == ["new", "weights.bin"]
    assert entry in writer_cache.changed_entries()
    assert not entry.record.exists()  # the next run builds it again


def test_a_refresh_dates_the_newest_file_now_and_keeps_the_order(cache: Path) -> None:
    def build(folder: Path) -> None:
        for age, name in ((7200, "old"), (3600, "newer")):
            (folder / name).write_text(name)
            os.utime(folder / name, (time.time() - age, time.time() - age))
        os.utime(folder, (time.time() - 3600, time.time() - 3600))

    entry = writer_cache.entry_for("fixture", build)
    assert entry is not None
    entry.get(build)
    entry.get(build)  # read again: dated now
    old, newer = (os.stat(entry.out / name).st_mtime for name in ("old", "newer"))
    assert abs(time.time() - newer) < 60 and 3590 < newer - old < 3610
    assert entry.changes() == []  # times are not the files' content


def test_off_builds_per_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(writer_cache.ENV, "off")
    assert writer_cache.entry_for("fixture", _write) is None
