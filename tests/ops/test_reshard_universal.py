"""`reshard --to deepspeed-universal`: the universal checkpoint DeepSpeed's own `ds_to_universal` writes, tensor
for tensor, from the suite's ZeRO-2 and ZeRO-3 saves (2 gloo CPU ranks, `deepspeed_writer`), and its refusals.

DeepSpeed's conversion of the same tags is `deepspeed_universal` (`universal_writer`, `ds_to_universal.py
--inject_missing_state`). Both outputs are read back here with `torch.load(weights_only=False)`: they are
files this suite wrote, and `optimizer_state.pt` holds DeepSpeed's `LossScaler`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptctl.errors import CkptctlError
from ckptctl.formats.digest import file_digest
from ckptctl.formats.manifest import DIGESTS_NAME, FileRecord, load_manifest
from ckptctl.ops import commit
from ckptctl.ops.reshard import ReshardOptions, reshard
from tests.conftest import CliResult, copy_tree
from tests.ops.same_state import assert_same_state as _assert_same
from tests.ops.same_state import files as _files
from tests.writers.deepspeed_writer import WrittenDeepSpeed
from tests.writers.lightning_writer import WrittenLightning
from tests.writers.universal_writer import WrittenUniversal

Cli = Callable[..., CliResult]
TO = ReshardOptions(to="deepspeed-universal")


@pytest.mark.parametrize("stage", [2, 3])
def test_every_tensor_equals_ds_to_universal(stage: int, deepspeed_universal: WrittenUniversal, tmp_path: Path) -> None:
    """The save folder (holding `latest`) in, DeepSpeed's own conversion of the tag `latest` names as the
    reference: the same files, and in each the same tensors bit for bit and the same other values. One
    departure, by design: under ZeRO-3, DeepSpeed keeps DP rank 0's own flat partitions in
    `optimizer_state.pt` (which its universal load does not read); ckptctl leaves them out."""
    save_dir = deepspeed_universal.runs[stage].save_dir  # `latest` and the tags, without the conversion
    dst = tmp_path / "universal"
    result = reshard(str(save_dir), str(dst), TO)
    reference = deepspeed_universal.universal(stage)
    ours = dst / "global_step4"
    assert (dst / "latest_universal").read_text() == "global_step4"
    assert _files(ours) == _files(reference)
    assert sorted(result.files) == sorted(f for f in _files(dst) if f != "ckptctl-digests.json")
    for rel in _files(reference):
        expected = torch.load(reference / rel, weights_only=False)
        got = torch.load(ours / rel, weights_only=False)
        if stage == 3 and rel == "zero/optimizer_state.pt":
            expected.pop("fp32_flat_groups")
            expected["optimizer_state_dict"]["state"] = {
                g: {"step": s["step"]} for g, s in expected["optimizer_state_dict"]["state"].items()
            }
        _assert_same(expected, got, rel)
    assert result.to == "deepspeed-universal" and result.world_size is None
    assert result.tensors == sum(1 for f in _files(ours) if f.endswith(("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt")))
    assert {n.what for n in result.not_carried} >= {"rng"}


#: Runs the command in a fresh interpreter, then says which heavy modules it imported.
_COMMAND_IMPORTS = """
import json, runpy, sys
sys.argv = ["ckptctl", *sys.argv[1:]]
try:
    runpy.run_module("ckptctl", run_name="__main__")
except SystemExit as exc:
    code = exc.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "numpy", "ml_dtypes", "deepspeed"})
print(json.dumps({"code": code, "heavy": heavy}), file=sys.stderr)
"""


def test_command_imports_neither_torch_nor_numpy(deepspeed_universal: WrittenUniversal, tmp_path: Path) -> None:
    """`ckptctl reshard SAVE_DIR DST --to deepspeed-universal` streams every tensor from the partitions' bytes
    into archives written by hand: the whole command (source verification included) runs without torch,
    numpy or DeepSpeed imported (torch alone costs ~220 MiB of resident memory). ZeRO-2: `step.pt` and
    DeepSpeed's classes in `optimizer_state.pt` too; the values are those of the tests above (same code)."""
    save_dir = deepspeed_universal.runs[2].save_dir
    dst = tmp_path / "universal"
    argv = ["reshard", str(save_dir), str(dst), "--to", "deepspeed-universal", "--json", "-q", "--threads", "2"]
    done = subprocess.run([sys.executable, "-c", _COMMAND_IMPORTS, *argv], capture_output=True, text=True, check=False)
    report = json.loads(done.stderr.strip().splitlines()[-1])
    assert report == {"code": 0, "heavy": []}, done.stderr[-2000:]
    assert json.loads(done.stdout)["tensors"] > 0
    assert _files(dst / "global_step4") == _files(deepspeed_universal.universal(2))


def test_json_verify_and_resume_plan(
    run_cli: Cli, deepspeed_runs: dict[int, WrittenDeepSpeed], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read_back: list[str] = []
    monkeypatch.setattr(commit, "file_digest", lambda path: read_back.append(path) or file_digest(path))
    dst = tmp_path / "out"
    done = run_cli(
        "reshard",
        deepspeed_runs[2].save_dir / "global_step4",
        dst,
        "--to",
        "deepspeed-universal",
        "--threads",
        "2",
        "--json",
    )
    assert done.exit_code == 0, done.stderr
    doc = done.json
    for key in ("src", "dst", "to", "world_size", "tensors", "bytes", "files", "not_carried"):
        assert key in doc, key
    assert doc["schema_version"] == 1 and doc["dst"] == str(dst) and doc["to"] == "deepspeed-universal"
    assert all(set(item) >= {"what", "why"} for item in doc["not_carried"])
    assert doc["files"][-1] == "latest_universal"
    # Every file was hashed while written (or copied): none read back, and each digest is its bytes'.
    assert read_back == []
    manifest = load_manifest(str(dst / DIGESTS_NAME))
    assert set(manifest.files) == set(doc["files"])
    for name, record in manifest.files.items():
        assert record == FileRecord((dst / name).stat().st_size, file_digest(str(dst / name))), name
    assert run_cli("verify", dst, "--json").json["ok"]
    plan = run_cli("resume-plan", dst, "--world-size", "1", "--json").json
    assert plan["checkpoint"]["layout"] == "deepspeed_universal" and plan["world_size_ok"] is True


def test_torn_source_refused_before_writing(deepspeed_runs: dict[int, WrittenDeepSpeed], tmp_path: Path) -> None:
    tag = copy_tree(deepspeed_runs[2].save_dir / "global_step4", tmp_path / "global_step4")
    (tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    dst = tmp_path / "out"
    with pytest.raises(CkptctlError, match=re.escape("bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")):
        reshard(str(tag), str(dst), TO)
    assert sorted(os.listdir(tmp_path)) == ["global_step4"]


def test_refusals_exit_2(run_cli: Cli, deepspeed_runs: dict[int, WrittenDeepSpeed], tmp_path: Path) -> None:
    src = deepspeed_runs[2].save_dir
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    not_empty = run_cli("reshard", src, full, "--to", "deepspeed-universal", "--json")
    assert not_empty.exit_code == 2 and "not empty" in not_empty.json["error"]["message"]
    assert os.listdir(full) == ["keep.txt"]
    unknown = run_cli("reshard", src, tmp_path / "a", "--to", "nowhere")
    assert unknown.exit_code == 2 and "deepspeed-universal" in unknown.stderr  # the targets that exist
    no_zero = run_cli("reshard", deepspeed_runs[0].save_dir, tmp_path / "b", "--to", "deepspeed-universal")
    assert no_zero.exit_code == 2 and "no ZeRO optimizer partitions" in no_zero.stderr
    assert sorted(os.listdir(tmp_path)) == ["full"]


def test_interrupted_reshard_leaves_nothing(
    deepspeed_runs: dict[int, WrittenDeepSpeed], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptctl.frameworks.deepspeed import reshard as writer

    written = []
    real = writer.write_torch_file

    def interrupted(obj: Any, path: str) -> int:
        if len(written) == 5:
            raise KeyboardInterrupt
        written.append(path)
        return real(obj, path)

    monkeypatch.setattr(writer, "write_torch_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        reshard(str(deepspeed_runs[3].save_dir), str(tmp_path / "out"), TO)
    assert len(written) == 5 and os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("where", "layout"),
    [("openrlhf/_actor", "openrlhf"), ("openrlhf/_critic", "openrlhf"), ("open-instruct/state", "open_instruct")],
)
def test_frameworks_built_on_deepspeed(
    where: str, layout: str, deepspeed_universal: WrittenUniversal, tmp_path: Path
) -> None:
    """The tag `latest` names in OpenRLHF's `_actor/` (ZeRO-2) and `_critic/` (ZeRO-3) and in open-instruct's
    state folder, against the conversion each framework runs (`ds_to_universal`, as `universal_writer` says)."""
    base = deepspeed_universal.openrlhf.parent
    folder = base / where
    tag = (folder / "latest").read_text().strip()
    reference = folder / (f"ds_universal_{tag}" if layout == "open_instruct" else f"{tag}_uni")
    result = reshard(str(folder / tag), str(tmp_path / "out"), TO)
    assert result.layout == layout
    ours = tmp_path / "out" / tag
    assert _files(ours) == _files(reference)
    for rel in _files(reference):
        expected = torch.load(reference / rel, weights_only=False)
        got = torch.load(ours / rel, weights_only=False)
        if rel == "zero/optimizer_state.pt" and "fp32_flat_groups" in expected:
            expected.pop("fp32_flat_groups")
            expected["optimizer_state_dict"]["state"] = {
                g: {"step": s["step"]} for g, s in expected["optimizer_state_dict"]["state"].items()
            }
        _assert_same(expected, got, rel)


def test_lightning_deepspeed_checkpoint(lightning_run: WrittenLightning, tmp_path: Path) -> None:
    """A Lightning DeepSpeed `.ckpt/` folder (the tag is its `checkpoint/`): the masters in `zero/<param>/fp32.pt`
    are the weights DeepSpeed's own zero_to_fp32 rebuilt for the writer (`deepspeed_reference`)."""
    src = lightning_run.deepspeed / "epoch=0-step=2.ckpt"
    result = reshard(str(src), str(tmp_path / "out"), TO)
    assert result.layout == "lightning"
    assert (tmp_path / "out" / "latest_universal").read_text() == "checkpoint"
    reference = torch.load(lightning_run.deepspeed_reference, weights_only=True)
    zero = tmp_path / "out" / "checkpoint" / "zero"
    for name, tensor in reference.items():
        got = torch.load(zero / name / "fp32.pt", weights_only=True)["param"]
        assert got.dtype == torch.float32 and torch.equal(got, tensor.float()), name


def test_strided_module_tensor_written_through_torch(tmp_path: Path) -> None:
    """A module tensor saved as a strided view (DeepSpeed saves none, but a state dict may hold one) is not one
    byte range: it is read with torch, then written like the others (cast to float32 as ds_to_universal's
    `.float()`)."""
    from types import SimpleNamespace

    from ckptctl.formats.torch_pickle import open_torch_pickle
    from ckptctl.formats.torch_save_writer import write_torch_file
    from ckptctl.frameworks.deepspeed.reshard import _raw_tensor

    weight = torch.randn(6, 4).bfloat16()
    torch.save({"module": {"w": weight.t()}}, tmp_path / "model_states.pt")
    opened = open_torch_pickle(str(tmp_path / "model_states.pt"))
    ref = opened.root["module"]["w"]
    assert opened.byte_range(ref) is None
    tag = SimpleNamespace(url=str(tmp_path), open_file=lambda name: opened)
    write_torch_file({"param": _raw_tensor(ref, tag, "model_states.pt", "float32")}, str(tmp_path / "fp32.pt"))  # type: ignore[arg-type]
    got = torch.load(tmp_path / "fp32.pt", weights_only=True)["param"]
    assert got.dtype == torch.float32 and torch.equal(got, weight.t().float())
