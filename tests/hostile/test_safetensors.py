"""safetensors files that safetensors itself refuses: `verify` must not call them ok.

Each rule of the reference reader (tensors contiguous from data offset 0, in offset order, covering the data
section to the end of the file) is broken in a real `save_pretrained` file; `safe_open` refuses the result,
and so must `verify` (exit 1) and `inspect` (exit 2) on the HF folder, the Trainer checkpoint and a native
checkpoint holding it. An index whose `total_size` is not a byte count its shards can hold is flagged too.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import copy_tree
from tests.hostile.conftest import BIG_INT, demo_state, refresh_manifest
from tests.hostile.harness import Outcome, run_ckptctl
from tests.writers.trainer_writer import WrittenTrainerRun

Header = dict[str, Any]


def _split(path: Path) -> tuple[Header, bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def _join(header: Header, data: bytes) -> bytes:
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body + data


def _in_offset_order(header: Header) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


def _shift_from(header: Header, first: int, by: int) -> None:
    for name in _in_offset_order(header)[first:]:
        begin, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = [begin + by, end + by]


def gap(header: Header, data: bytes) -> bytes:
    """Eight unused bytes between the first and the second tensor (safetensors: invalid offset)."""
    end = header[_in_offset_order(header)[0]]["data_offsets"][1]
    _shift_from(header, 1, 8)
    return _join(header, data[:end] + bytes(8) + data[end:])


def overlap(header: Header, data: bytes) -> bytes:
    """The second tensor starts 4 bytes inside the first (safetensors: invalid offset)."""
    _shift_from(header, 1, -4)
    end = header[_in_offset_order(header)[0]]["data_offsets"][1]
    return _join(header, data[: end - 4] + data[end:])


def not_from_zero(header: Header, data: bytes) -> bytes:
    """The data section starts with 8 bytes no tensor claims (safetensors: invalid offset)."""
    _shift_from(header, 0, 8)
    return _join(header, bytes(8) + data)


def trailing(header: Header, data: bytes) -> bytes:
    """Bytes after the last tensor (safetensors: file not fully covered)."""
    return _join(header, data + bytes(16))


RULES: dict[str, Callable[[Header, bytes], bytes]] = {
    "gap": gap,
    "overlap": overlap,
    "not_from_zero": not_from_zero,
    "trailing": trailing,
}


def _break(path: Path, rule: str) -> None:
    header, data = _split(path)
    path.write_bytes(RULES[rule](header, data))


def _safe_open_refuses(path: Path) -> str:
    from safetensors import safe_open

    # safetensors raises its own SafetensorError, which it does not export under a stable name
    with pytest.raises(Exception) as info, safe_open(str(path), framework="pt") as f:
        list(f.keys())
    return str(info.value)


def _assert_refused(ckpt: Path, broken: Path) -> None:
    verify = run_ckptctl(["verify", "--json", str(ckpt)])
    verify.assert_refused(1)
    problems = json.loads(verify.stdout)["problems"]
    assert any(broken.name in p["path"] + p["message"] and p["kind"] == "bad_metadata" for p in problems), problems
    run_ckptctl(["verify", str(ckpt)]).assert_refused(1)
    run_ckptctl(["inspect", str(ckpt)]).assert_refused(2)


@pytest.mark.parametrize("rule", list(RULES))
def test_a_broken_layout_is_refused_like_safetensors_does(
    rule: str, hf_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    folder = copy_tree(hf_model_dirs["single"], tmp_path / "model")
    run_ckptctl(["verify", str(folder)]).assert_refused(0)  # the untouched copy is fine
    broken = folder / "model.safetensors"
    _break(broken, rule)
    reason = _safe_open_refuses(broken)
    assert ("invalid offset" if rule != "trailing" else "not fully covered") in reason
    _assert_refused(folder, broken)


@pytest.mark.parametrize("rule", ["gap", "trailing"])
def test_a_broken_shard_is_refused(rule: str, hf_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    folder = copy_tree(hf_model_dirs["sharded"], tmp_path / "model")
    broken = sorted(folder.glob("model-*.safetensors"))[1]
    _break(broken, rule)
    _safe_open_refuses(broken)
    _assert_refused(folder, broken)


def test_a_broken_trainer_checkpoint_is_refused(trainer_run: WrittenTrainerRun, tmp_path: Path) -> None:
    ckpt = copy_tree(trainer_run.checkpoints[-1], tmp_path / trainer_run.checkpoints[-1].name)
    broken = ckpt / "model.safetensors"
    _break(broken, "gap")
    _safe_open_refuses(broken)
    _assert_refused(ckpt, broken)


def test_a_broken_native_checkpoint_is_refused(tmp_path: Path) -> None:
    import torch

    from ckptctl.core import CheckpointManager

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    CheckpointManager(str(tmp_path / "run")).save(1, {"model": model})
    ckpt = next(p for p in (tmp_path / "run").iterdir() if p.is_dir())
    run_ckptctl(["verify", str(ckpt)]).assert_refused(0)
    broken = next(ckpt.rglob("*.safetensors"))
    _break(broken, "trailing")
    _safe_open_refuses(broken)
    verify = run_ckptctl(["verify", "--json", str(ckpt)])
    verify.assert_refused(1)
    assert not json.loads(verify.stdout)["ok"]


@pytest.mark.parametrize("total", [float("nan"), -1, 10**15, "107136", True])
def test_an_index_total_size_that_is_no_byte_count_is_flagged(
    total: Any, hf_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    folder = copy_tree(hf_model_dirs["sharded"], tmp_path / "model")
    index = folder / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["metadata"]["total_size"] = total
    index.write_text(json.dumps(doc))  # NaN is written as the JavaScript literal, which Python reads back
    verify = run_ckptctl(["verify", "--json", str(folder)])
    verify.assert_refused(1)
    problems = json.loads(verify.stdout)["problems"]
    assert [p["path"] for p in problems] == [index.name], problems
    assert "total_size" in problems[0]["message"]


#: Header fields of a type no writer writes (issue 21.5): a list as the dtype (unhashable: a dict lookup raised
#: TypeError) and an integer of 5,000 digits (Python's JSON parser raises a plain ValueError on it).
FIELDS = {"list_dtype": '["F32"]', "huge_int_dtype": BIG_INT}


def _with_dtype(path: Path, raw: str) -> None:
    """Give the first tensor of the safetensors file at `path` the JSON text `raw` as its dtype."""
    header, data = _split(path)
    header[_in_offset_order(header)[0]]["dtype"] = "\x00dtype\x00"
    body = json.dumps(header).replace(json.dumps("\x00dtype\x00"), raw).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + b" " * (-len(body) % 8) + data)


def _error_of(outcome: Outcome) -> dict[str, Any]:
    outcome.assert_refused(2)
    error: dict[str, Any] = json.loads(outcome.stdout)["error"]
    return error


@pytest.mark.parametrize("field", list(FIELDS))
def test_a_header_field_of_the_wrong_type_is_a_ckptctl_error_in_every_command(
    field: str, hf_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    folder = copy_tree(hf_model_dirs["single"], tmp_path / "model")
    broken = folder / "model.safetensors"
    _with_dtype(broken, FIELDS[field])
    for args in (
        ["inspect", str(folder)],
        ["convert", str(folder), str(tmp_path / "out"), "--to", "dcp"],
        ["diff", str(folder), str(hf_model_dirs["single"])],
    ):
        error = _error_of(run_ckptctl([*args, "--json"]))
        assert error["type"] == "CorruptCheckpoint" and str(broken) in error["message"], (args, error)
        assert error["exit_code"] == 2
    assert not (tmp_path / "out").exists()
    for deep in ([], ["--deep"]):
        verify = run_ckptctl(["verify", str(folder), "--json", *deep])
        verify.assert_refused(1)  # verify ran and found the problem (DESIGN §4)
        problems = json.loads(verify.stdout)["problems"]
        assert [(p["kind"], p["path"]) for p in problems] == [("bad_metadata", broken.name)], problems


@pytest.mark.parametrize("field", list(FIELDS))
def test_a_header_field_of_the_wrong_type_in_a_native_step(field: str, demo_dir: Path, tmp_path: Path) -> None:
    # The file is planted as an attacker sharing the run would: the manifest's size and digest match it.
    from ckptctl.core import CheckpointManager
    from ckptctl.errors import CorruptCheckpoint

    run = copy_tree(demo_dir / "native", tmp_path / "run")
    broken = run / "step-30" / "model.safetensors"
    _with_dtype(broken, FIELDS[field])
    refresh_manifest(broken.parent, broken.name)
    with pytest.raises(CorruptCheckpoint) as caught:
        CheckpointManager(str(run)).restore(demo_state(), step=30)
    assert str(broken) in caught.value.message
    plan = run_ckptctl(["resume-plan", str(run), "--json"])
    plan.assert_refused(0)  # the broken step is skipped, with the file named; the step before it resumes
    doc = json.loads(plan.stdout)
    assert doc["checkpoint"]["step"] == 20
    assert [(s["step"], broken.name in s["reason"]) for s in doc["skipped"]] == [(30, True)], doc["skipped"]
