"""`check_load_set`: every member of a load set present and whole, judged the same way for every framework."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ckptctl.checkpoint import ProblemKind
from ckptctl.contract.load_set import LoadMember, MemberKind, Need, check_load_set


def _members() -> list[LoadMember]:
    return [
        LoadMember(
            "optimizer.pt", MemberKind.TORCH_SAVE, "the optimizer state", "Trainer._load_optimizer_and_scheduler"
        ),
        LoadMember("model.safetensors", MemberKind.SAFETENSORS, "the model", "from_pretrained"),
        LoadMember("trainer_state.json", MemberKind.JSON, "the trainer state", "TrainerState.load_from_json"),
        LoadMember("rng_state.pth", MemberKind.TORCH_SAVE, "the RNG state", "Trainer._load_rng_state", Need.WARNS),
    ]


def _write_whole(folder: Path) -> None:
    torch.save({"state": {0: {"exp_avg": torch.ones(64)}}}, folder / "optimizer.pt")
    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(folder / "model.safetensors"))
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    torch.save({"python": 1}, folder / "rng_state.pth")


def _files(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in folder.iterdir()}


def test_a_whole_load_set_has_no_problems(tmp_path: Path) -> None:
    _write_whole(tmp_path)
    assert check_load_set(str(tmp_path), _members(), _files(tmp_path)) == []


def test_a_missing_member_is_an_error_or_a_warning_as_the_framework_treats_it(tmp_path: Path) -> None:
    _write_whole(tmp_path)
    (tmp_path / "optimizer.pt").unlink()
    (tmp_path / "rng_state.pth").unlink()
    problems = {p.path: p for p in check_load_set(str(tmp_path), _members(), _files(tmp_path))}
    assert set(problems) == {"optimizer.pt", "rng_state.pth"}
    assert problems["optimizer.pt"].kind == ProblemKind.MISSING_FILE
    assert problems["optimizer.pt"].severity == "error"
    assert "the optimizer state" in problems["optimizer.pt"].message
    assert problems["rng_state.pth"].severity == "warning"


def test_truncated_members_of_each_kind_are_errors_naming_the_file(tmp_path: Path) -> None:
    _write_whole(tmp_path)
    for name in ("optimizer.pt", "model.safetensors", "trainer_state.json"):
        data = (tmp_path / name).read_bytes()
        (tmp_path / name).write_bytes(data[: len(data) // 2])
    problems = check_load_set(str(tmp_path), _members(), _files(tmp_path))
    assert sorted(p.path for p in problems) == ["model.safetensors", "optimizer.pt", "trainer_state.json"]
    assert all(p.severity == "error" for p in problems)


def test_a_file_the_layout_already_reported_is_not_reported_twice(tmp_path: Path) -> None:
    _write_whole(tmp_path)
    (tmp_path / "optimizer.pt").unlink()
    first = check_load_set(str(tmp_path), _members(), _files(tmp_path))
    assert check_load_set(str(tmp_path), _members(), _files(tmp_path), first) == []
