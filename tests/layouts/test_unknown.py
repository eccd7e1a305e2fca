"""Unknown is a state (issue 23.1): runs written by the saving code of frameworks ckptctl was never taught are
listed as `unknown`, never "no checkpoints found"; `verify` never passes them (exit 2), `verify --latest` never
takes them for a fresh start, `prune` never deletes them and `resume-plan` says "unknown layout".

Each run is written by real saving code: `torch.save` of a real model's and optimizer's state dicts, and
transformers' `save_pretrained`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptctl.layouts.generic import NameFacts, name_facts
from tests.conftest import CliResult

torch = pytest.importorskip("torch")

Cli = Callable[..., CliResult]


def _trained() -> tuple[object, object]:
    """A small model and its AdamW optimizer after one step (the optimizer holds moments)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    return model, optimizer


def _step_folders(run: Path) -> Path:
    """`step-00000010/train.pth`: one torch.save of a state whose keys no rule knows per zero-padded step
    folder (a training state with known keys is read: see `test_generic_reader.py`)."""
    for step in (10, 20):
        folder = run / f"step-{step:08d}"
        folder.mkdir(parents=True)
        model, optimizer = _trained()
        state = {"net": model.state_dict(), "opt": optimizer.state_dict(), "it": step}
        torch.save(state, folder / "train.pth")
    return run


def _recipe_run(run: Path) -> Path:
    """A state file alone in a run folder (beside no model folder to go with): unknown."""
    run.mkdir(parents=True)
    _model, optimizer = _trained()
    torch.save({"optimizer": optimizer.state_dict(), "epochs_run": 2, "seed": 0}, run / "recipe_state.pt")
    return run


def _batch_files(run: Path) -> Path:
    """`ep{E}-ba{B}-rank{R}.pt` files of keys no rule knows, and a `latest-rank0.pt` symbolic link to the newest."""
    run.mkdir(parents=True)
    for batch in (10, 20):
        model, optimizer = _trained()
        state = {"weights": {"net": model.state_dict(), "opts": {"AdamW": optimizer.state_dict()}}}
        torch.save(state, run / f"ep0-ba{batch}-rank0.pt")
    os.symlink("ep0-ba20-rank0.pt", run / "latest-rank0.pt")
    return run


RUNS = {"step_folders": _step_folders, "recipe": _recipe_run, "batch_files": _batch_files}
#: What `list` finds in each run: (path relative to the run, step, epoch, layout).
LISTED = {
    "step_folders": [("step-00000010", 10, None, "unknown"), ("step-00000020", 20, None, "unknown")],
    "recipe": [(".", None, None, "unknown")],
    "batch_files": [("ep0-ba10-rank0.pt", 10, 0.0, "unknown"), ("ep0-ba20-rank0.pt", 20, 0.0, "unknown")],
}


def _snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.fixture(params=sorted(RUNS))
def unknown_run(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path]:
    name = request.param
    return name, RUNS[name](tmp_path / name)


def test_list_shows_unknown_checkpoints_with_their_steps(run_cli: Cli, unknown_run: tuple[str, Path]) -> None:
    name, run = unknown_run
    result = run_cli("list", run, "--json")
    assert result.exit_code == 0, result.stderr
    listed = json.loads(result.stdout)["checkpoints"]
    found = [(os.path.relpath(c["url"], run), c["step"], c["epoch"], c["layout"]) for c in listed]
    assert found == LISTED[name]
    unknown = [c for c in listed if c["layout"] == "unknown"]
    assert all(c["state"] == "unknown" and c["size_bytes"] > 0 for c in unknown)
    human = run_cli("list", run)
    assert human.exit_code == 0
    assert "no checkpoints found" not in human.stderr
    assert "read as generic files" in human.stdout
    assert "layout ckptctl does not know" in human.stderr


def test_the_latest_link_marks_its_target(run_cli: Cli, tmp_path: Path) -> None:
    run = _batch_files(tmp_path / "run")
    listed = json.loads(run_cli("list", run, "--json").stdout)["checkpoints"]
    assert {os.path.basename(c["url"]): c["latest"] for c in listed} == {
        "ep0-ba10-rank0.pt": False,
        "ep0-ba20-rank0.pt": True,
    }


def test_the_note_names_the_files_that_made_it_a_checkpoint(run_cli: Cli, tmp_path: Path) -> None:
    run = _recipe_run(tmp_path / "run")
    listed = json.loads(run_cli("list", run, "--json").stdout)["checkpoints"]
    assert listed[0]["url"] == str(run)
    assert listed[0]["note"] == "not a layout ckptctl knows; read as generic files: recipe_state.pt (torch.save zip)"


def test_verify_latest_is_no_fresh_start(run_cli: Cli, unknown_run: tuple[str, Path]) -> None:
    _, run = unknown_run
    result = run_cli("verify", run, "--latest")
    assert result.exit_code == 2, result.stderr
    assert "layout ckptctl does not know" in result.stderr
    assert "not a fresh start" in result.stderr
    assert "from scratch" not in result.stderr + result.stdout


def test_verify_of_the_run_fails_with_exit_2_naming_the_files(run_cli: Cli, unknown_run: tuple[str, Path]) -> None:
    _, run = unknown_run
    result = run_cli("verify", run, "--json")
    assert result.exit_code == 2, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is False
    # A folder that is one checkpoint (the lone state file's) is verified as one, a run as its results.
    unknown = [r for r in report.get("results", [report]) if r["layout"] == "unknown"]
    assert unknown
    for verdict in unknown:
        kinds = [p["kind"] for p in verdict["problems"]]
        assert kinds == ["unknown_layout"], verdict  # every file read whole: no other problem
        assert verdict["problems"][0]["message"].startswith("not a layout ckptctl knows; read as generic files: ")


def test_verify_of_one_unknown_checkpoint(run_cli: Cli, tmp_path: Path) -> None:
    run = _step_folders(tmp_path / "run")
    result = run_cli("verify", run / "step-00000010")
    assert result.exit_code == 2, result.stderr
    assert "unknown_layout" in result.stdout
    assert "not a layout ckptctl knows; read as generic files: train.pth (torch.save zip)" in result.stdout
    inspected = run_cli("inspect", run / "step-00000010")
    assert inspected.exit_code == 2
    assert "not a layout ckptctl knows" in inspected.stderr


def test_verify_reads_the_files_and_names_a_damaged_one(run_cli: Cli, tmp_path: Path) -> None:
    run = _step_folders(tmp_path / "run")
    state = run / "step-00000020" / "train.pth"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])  # half a zip: its directory is gone
    result = run_cli("verify", run / "step-00000020", "--json")
    assert result.exit_code == 2
    problems = json.loads(result.stdout)["problems"]
    assert problems[0]["kind"] == "unknown_layout"
    assert [p["path"] for p in problems[1:]] == ["train.pth"]


def test_prune_never_deletes_an_unknown_checkpoint(run_cli: Cli, unknown_run: tuple[str, Path]) -> None:
    name, run = unknown_run
    before = _snapshot(run)
    result = run_cli("prune", run, "-y", "--keep-last", "1", "--grace", "0s", "--json")
    report = json.loads(result.stdout)
    assert report["delete"] == []
    kept = {k["url"]: k["reasons"] for k in report["keep"]}
    unknown = [url for url, reasons in kept.items() if any(r.startswith("unknown layout: ") for r in reasons)]
    assert unknown == [
        str(run / path) if path != "." else str(run) for path, *_, layout in LISTED[name] if layout == "unknown"
    ]
    assert _snapshot(run) == before
    # keep_last=1 would delete the older step: the policy cannot be met, which the exit code says (the run
    # folder itself of the recipe run is kept whatever the rules).
    assert result.exit_code == (0 if name == "recipe" else 1), result.stderr
    if name != "recipe":
        assert any("unknown layout" in line for line in report["unmet"])


def test_resume_plan_says_unknown_layout(run_cli: Cli, unknown_run: tuple[str, Path]) -> None:
    _, run = unknown_run
    result = run_cli("resume-plan", run)
    assert result.exit_code == 2, result.stderr
    assert "unknown layout" in result.stdout
    assert "nothing resumable" not in result.stdout
    plan = json.loads(run_cli("resume-plan", run, "--json").stdout)
    assert plan["checkpoint"] is None
    assert plan["unknown_layout"]


@pytest.mark.parametrize("contents", [{}, {"notes.txt": b"hello", "config.yaml": b"lr: 1", "tiny.pt": b"x" * 100}])
def test_a_folder_without_checkpoint_like_files_is_still_empty(
    run_cli: Cli, tmp_path: Path, contents: dict[str, bytes]
) -> None:
    run = tmp_path / "run"
    (run / "step-10").mkdir(parents=True)
    for name, data in contents.items():
        (run / "step-10" / name).write_bytes(data)
    listed = run_cli("list", run)
    assert listed.exit_code == 0
    assert "no checkpoints found" in listed.stderr
    latest = run_cli("verify", run, "--latest")
    assert latest.exit_code == 0, latest.stderr
    assert "a resume starts from scratch" in latest.stderr


@pytest.mark.parametrize(
    ("name", "facts"),
    [
        ("step-10", NameFacts(10)),
        ("step_10", NameFacts(10)),
        ("step-00000010", NameFacts(10)),
        ("global_step7", NameFacts(7)),
        ("global_step_7", NameFacts(7)),
        ("iter_0000100", NameFacts(100)),
        ("iter_5", NameFacts(5)),
        ("checkpoint-30", NameFacts(30)),
        ("checkpoint_3", NameFacts(3)),
        ("epoch_2", NameFacts(None, 2)),
        ("epoch=1-step=40.ckpt", NameFacts(40, 1)),
        ("ep0-ba10-rank0.pt", NameFacts(10, 0)),
        ("ep3-ba250.pt", NameFacts(250, 3)),
        ("globalstep7", NameFacts(7)),
        ("iteration_5", NameFacts(5)),
        ("ckpt_12.pt", NameFacts(12)),
        ("step-10-rank1.pt", NameFacts(10)),
        ("100", NameFacts(100)),
        ("epoch-3", NameFacts(None, 3)),
        ("train.pth", NameFacts()),
        ("recipe_state.pt", NameFacts()),
        ("latest-rank0.pt", NameFacts()),
    ],
)
def test_naming_rules(name: str, facts: NameFacts) -> None:
    assert name_facts(name) == facts


def _dcp_step(run: Path, step: int) -> Path:
    """A torch DCP checkpoint written by `dcp.save` in one process."""
    import torch.distributed.checkpoint as dcp

    model, optimizer = _trained()
    folder = run / f"step-{step}"
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=folder, no_dist=True)
    return folder


#: A pickle of another library's metadata class (ByteCheckpoint's), as its first bytes name it.
FOREIGN_METADATA = b"\x80\x02cbytecheckpoint.checkpointer.meta_type\nMetadata\nq\x00)\x81q\x01}q\x02b."


@pytest.mark.parametrize(
    ("metadata", "state", "layout"),
    [
        (None, "complete", "dcp"),
        (FOREIGN_METADATA, "unknown", "unknown"),
        (b"\x80\x04\x95\xb0\x03\x00\x00\x00\x00\x00\x00\x8c%torch.distrib", "broken", "dcp"),  # cut short
        (b"not a pickle", "broken", "dcp"),
    ],
)
def test_a_dcp_folder_whose_metadata_cannot_be_read_is_never_complete(
    run_cli: Cli, tmp_path: Path, metadata: bytes | None, state: str, layout: str
) -> None:
    folder = _dcp_step(tmp_path / "run", 5)
    if metadata is not None:
        (folder / ".metadata").write_bytes(metadata)
    listed = json.loads(run_cli("list", tmp_path / "run", "--json").stdout)["checkpoints"]
    assert [(c["step"], c["state"], c["layout"]) for c in listed] == [(5, state, layout)]
    verified = run_cli("verify", folder)
    assert verified.exit_code == {"complete": 0, "broken": 1, "unknown": 2}[state], verified.stdout


def test_list_orders_unknown_checkpoints_by_the_naming_rules_then_time(run_cli: Cli, tmp_path: Path) -> None:
    run = tmp_path / "run"
    model, _ = _trained()
    for name, mtime in [("epoch_10", 100), ("epoch_2", 200), ("checkpoint-7", 400), ("step-7", 300)]:
        (run / name).mkdir(parents=True)
        torch.save(model.state_dict(), run / name / "model.pth")
        os.utime(run / name / "model.pth", (mtime, mtime))
    listed = json.loads(run_cli("list", run, "--json").stdout)["checkpoints"]
    # Epoch folders have no step (they come first), ordered by number, not by name; at equal steps the older first.
    assert [(os.path.basename(c["url"]), c["step"], c["epoch"]) for c in listed] == [
        ("epoch_2", None, 2.0),
        ("epoch_10", None, 10.0),
        ("step-7", 7, None),
        ("checkpoint-7", 7, None),
    ]
