"""The run walker and the scan context (`ckptctl.layouts`): a folder that is a checkpoint and holds
checkpoints, the one identification every command goes through, and peeks owned by one operation."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ckptctl import io
from ckptctl.errors import UnknownLayout
from ckptctl.frameworks.hf.layout import HfModelLayout
from ckptctl.layouts import detect, peek_dir, resolve, scan_context, scan_run
from tests.writers.deepspeed_writer import WrittenDeepSpeed
from tests.writers.trainer_writer import WrittenTrainerRun


def test_a_checkpoint_holding_checkpoints_is_listed_before_them(trainer_run: WrittenTrainerRun) -> None:
    run = trainer_run.saved_run
    refs = scan_run(str(run))
    assert [(r.url, r.layout, r.holds) for r in refs] == [
        (str(run), "hf", ("checkpoint-2", "checkpoint-4")),
        (str(run / "checkpoint-2"), "hf_trainer", ()),
        (str(run / "checkpoint-4"), "hf_trainer", ()),
    ]
    assert refs[0].size_bytes == sum(p.stat().st_size for p in run.iterdir() if p.is_file())


def test_a_model_folder_is_made_of_its_own_files(trainer_run: WrittenTrainerRun) -> None:
    """The final model beside `checkpoint-N/` indexes and verifies its own files only (before, the
    checkpoints' weights read as duplicates of its tensors)."""
    run = trainer_run.saved_run
    checkpoint = HfModelLayout().open(str(run))
    assert set(checkpoint.files) == {p.name for p in run.iterdir() if p.is_file()}
    assert {c.file for e in checkpoint.tensors() for c in e.chunks} == {"model.safetensors"}
    assert HfModelLayout().verify(checkpoint) == []


def test_the_depth_limit_stops_below_a_checkpoint(trainer_run: WrittenTrainerRun) -> None:
    [ref] = scan_run(str(trainer_run.saved_run), max_depth=0)
    assert (ref.url, ref.holds) == (str(trainer_run.saved_run), ())


def test_resolve_takes_the_folder_itself_or_what_its_pointer_names(
    deepspeed_runs: dict[int, WrittenDeepSpeed], trainer_run: WrittenTrainerRun, tmp_path: Path
) -> None:
    written = deepspeed_runs[2]
    layout, ref = resolve(str(written.save_dir))
    assert (layout.name, ref.url) == ("deepspeed", str(written.latest))
    with_model = shutil.copytree(written.save_dir, tmp_path / "save")
    shutil.copyfile(written.reference, with_model / "model.safetensors")
    layout, ref = resolve(str(with_model))
    assert (layout.name, ref.url) == ("hf", str(with_model))
    with pytest.raises(UnknownLayout, match="not a checkpoint of any known layout") as refused:
        resolve(str(trainer_run.output_dir))
    assert "run folder with 2 checkpoint(s)" in refused.value.hint


def _count_listings(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    listed: list[str] = []
    real = io.list_dir

    def counting(url: str) -> list[io.DirEntry]:
        listed.append(url)
        return real(url)

    monkeypatch.setattr(io, "list_dir", counting)
    return listed


def test_peeks_belong_to_the_scan_context(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a").mkdir()
    listed = _count_listings(monkeypatch)
    with scan_context() as outer:
        assert peek_dir(str(tmp_path)) == peek_dir(str(tmp_path))
        with scan_context() as inner:  # a `detect` inside a scan shares the scan's context
            assert inner is outer
            peek_dir(str(tmp_path))
    assert listed == [str(tmp_path)]
    with scan_context():  # a new operation lists afresh
        peek_dir(str(tmp_path))
    peek_dir(str(tmp_path))  # outside any context nothing is kept
    peek_dir(str(tmp_path))
    assert listed == [str(tmp_path)] * 4


def test_a_local_folder_that_changed_is_peeked_again(tmp_path: Path) -> None:
    with scan_context():
        assert [e.name for e in peek_dir(str(tmp_path)) or []] == []
        (tmp_path / "new").mkdir()
        assert [e.name for e in peek_dir(str(tmp_path)) or []] == ["new"]


def test_detect_leaves_an_open_scan_context_alone(
    deepspeed_runs: dict[int, WrittenDeepSpeed], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`detect` used to clear the process-wide peeks; inside a scan context it shares them instead."""
    save_dir = str(deepspeed_runs[2].save_dir)
    listed = _count_listings(monkeypatch)
    with scan_context():
        peek_dir(save_dir)
        detect(str(deepspeed_runs[2].latest))
        peek_dir(save_dir)
    assert listed.count(save_dir) == 1
