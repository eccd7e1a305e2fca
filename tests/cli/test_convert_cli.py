"""`ckptctl convert` as scripts use it: exit codes, JSON, refusals, and what an interrupted run leaves."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import CliResult

Cli = Callable[..., CliResult]
REPO = Path(__file__).resolve().parents[2]


#: The demo's toy model is no transformers model and its runs carry no config: its tensors are written under their
#: stored names, as asked (`test_no_config_is_refused_unless_the_stored_names_are_asked_for`).
RAW = ("--mapping", "none")


def test_json_document_and_verifiable_output(run_cli: Cli, demo_dir: Path, tmp_path: Path) -> None:
    dst = tmp_path / "hf"
    result = run_cli("convert", demo_dir / "dcp" / "step-30", dst, "--json", "--max-shard-size", "100KB", *RAW)
    assert result.exit_code == 0, result.stderr
    doc = result.json
    assert doc["schema_version"] == 1
    for key in ("src", "dst", "to", "tensors", "bytes", "files", "bytes_read", "seconds", "dtype"):
        assert key in doc, key
    assert doc["to"] == "hf" and doc["dst"] == str(dst) and doc["tensors"] == 16
    assert sorted(doc["files"]) == sorted(os.listdir(dst))
    assert "model.safetensors.index.json" in doc["files"]
    assert "no config.json found" in result.stderr  # the demo's DCP run has none: said on stderr

    verified = run_cli("verify", dst, "--json")
    assert verified.exit_code == 0 and verified.json["ok"] and verified.json["digests_checked"] > 0


def test_human_output_and_dtype(run_cli: Cli, demo_dir: Path, tmp_path: Path) -> None:
    result = run_cli("convert", demo_dir / "native" / "step-30", tmp_path / "hf", "--dtype", "bf16", *RAW)
    assert result.exit_code == 0, result.stderr
    assert "converted 16 tensors" in result.stdout and "bfloat16" in result.stdout
    assert "names: the source's own (--mapping none), not proved to load with from_pretrained" in result.stdout
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}


def test_non_empty_destination_is_refused_untouched_and_replaced_with_force(
    run_cli: Cli, demo_dir: Path, tmp_path: Path
) -> None:
    dst = tmp_path / "hf"
    dst.mkdir()
    (dst / "keep.txt").write_text("precious")
    before = (dst / "keep.txt").stat().st_mtime_ns
    refused = run_cli("convert", demo_dir / "dcp" / "step-30", dst, "--json", *RAW)
    assert refused.exit_code == 2
    assert "not empty" in refused.json["error"]["message"]
    assert "not empty" in refused.stderr and "--force" in refused.stderr and "Traceback" not in refused.stderr
    assert os.listdir(dst) == ["keep.txt"] and (dst / "keep.txt").stat().st_mtime_ns == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no staging left behind

    forced = run_cli("convert", demo_dir / "dcp" / "step-30", dst, "--force", "--json", *RAW)
    assert forced.exit_code == 0, forced.stderr
    assert "keep.txt" not in os.listdir(dst) and "model.safetensors" in os.listdir(dst)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]

    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_cli("convert", demo_dir / "dcp" / "step-30", empty, "-q", *RAW).exit_code == 0
    assert "model.safetensors" in os.listdir(empty)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dtype", "int3"], "dtype"),
        (["--to", "onnx"], "to"),
        (["--max-shard-size", "lots"], "max-shard-size"),
        (["--component", "weights"], "component"),
        (["--rename", "([=x"], "rename"),
    ],
)
def test_usage_errors_exit_2(run_cli: Cli, demo_dir: Path, tmp_path: Path, args: list[str], message: str) -> None:
    result = run_cli("convert", demo_dir / "dcp" / "step-30", tmp_path / "out", *args)
    assert result.exit_code == 2
    assert message in result.stderr
    assert not (tmp_path / "out").exists()


def test_input_errors_exit_2(run_cli: Cli, demo_dir: Path, tmp_path: Path) -> None:
    missing = run_cli("convert", tmp_path / "nope", tmp_path / "out")
    assert missing.exit_code == 2 and missing.stderr.startswith("error: ")
    no_optim = run_cli("convert", demo_dir / "hf", tmp_path / "out", "--component", "optimizer")
    assert no_optim.exit_code == 2 and "no optimizer tensors" in no_optim.stderr
    onto_source = run_cli("convert", demo_dir / "hf", demo_dir / "hf", "--force")
    assert onto_source.exit_code == 2 and "source" in onto_source.stderr
    assert not (tmp_path / "out").exists()


def test_no_config_is_refused_unless_the_stored_names_are_asked_for(
    run_cli: Cli, demo_dir: Path, tmp_path: Path
) -> None:
    """With no config.json nothing proves an HF output is a transformers model (its names may be the framework's
    own): `convert` and `average` refuse before writing anything (exit 2) and say what to pass; `--mapping none`
    writes the stored names (less DCP's `model.` namespace) and says the output is not proved loadable."""
    src = demo_dir / "dcp" / "step-30"
    dst = tmp_path / "hf"
    for command in (("convert", src), ("average", demo_dir / "native" / "step-10", demo_dir / "native" / "step-20")):
        refused = run_cli(*command, dst, "--json")
        assert refused.exit_code == 2, refused.stderr
        error = refused.json["error"]
        assert error["type"] == "UnprovedModel" and "no config.json" in error["message"], error
        assert all(flag in error["hint"] for flag in ("--config PATH", "--mapping MAP", "--mapping none")), error
        assert "no config.json" in refused.stderr and "Traceback" not in refused.stderr
        assert list(tmp_path.iterdir()) == []  # nothing at DST, no staging folder left

    raw = run_cli("convert", src, dst, "--json", *RAW)
    assert raw.exit_code == 0, raw.stderr
    assert raw.json["mapping"] == "none" and raw.json["model_check"] is None
    assert "--mapping none" in raw.stderr and "not proved to load with transformers' from_pretrained" in raw.stderr
    stored = run_cli("inspect", src, "--json").json["tensors"]
    model = {t["name"].removeprefix("model.") for t in stored if t["component"] == "model"}
    assert model and set(load_file(str(dst / "model.safetensors"))) == model


def test_hf_to_dcp(run_cli: Cli, hf_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    result = run_cli("convert", hf_model_dirs["single"], tmp_path / "dcp", "--to", "dcp", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json["to"] == "dcp" and ".metadata" in result.json["files"]
    inspected = run_cli("inspect", tmp_path / "dcp", "--json")
    assert inspected.json["layout"] == "dcp"
    assert all(t["name"].startswith("model.") for t in inspected.json["tensors"])


# --- interruption -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_dcp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~400 MB single-process DCP save of a few big tensors: long enough a conversion to interrupt."""
    import torch.distributed.checkpoint as dcp

    path = tmp_path_factory.mktemp("big") / "step-1"
    state = {"model": {f"layers.{i}.weight": torch.full((2500, 10_000), float(i)) for i in range(4)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path))
    return path


def _start_and_interrupt(src: Path, dst: Path, sig: int) -> subprocess.CompletedProcess[str]:
    """Start `ckptctl convert` in a fresh process, send `sig` once its staging folder exists, wait for it.

    On a loaded machine the conversion can finish between seeing its staging folder and the signal: such a
    run proves nothing, so it is thrown away and started again (at most three times)."""
    for _attempt in range(3):
        done = _try_interrupt(src, dst, sig)
        if done is not None:
            return done
        shutil.rmtree(dst, ignore_errors=True)
    raise AssertionError("the conversion finished before it could be interrupted, three times")


def _try_interrupt(src: Path, dst: Path, sig: int) -> subprocess.CompletedProcess[str] | None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptctl", "convert", str(src), str(dst), "--json", *RAW],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    staged = None
    while staged is None and time.monotonic() < deadline and proc.poll() is None:
        staged = next((p for p in dst.parent.glob(f".{dst.name}.ckptctl-convert-*/out/*.safetensors")), None)
        time.sleep(0.002)
    if proc.poll() is not None:
        proc.communicate()
        return None
    assert staged is not None
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    if proc.returncode == 0:  # it finished before the signal arrived
        return None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_sigkill_leaves_no_destination_and_the_next_run_cleans_up(run_cli: Cli, big_dcp: Path, tmp_path: Path) -> None:
    dst = tmp_path / "hf"
    killed = _start_and_interrupt(big_dcp, dst, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    assert not dst.exists()
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert len(leftovers) == 1 and leftovers[0].startswith(".hf.ckptctl-convert-")

    # A hidden folder holding model.safetensors would list as a complete HF checkpoint; the staging
    # folder keeps its output one level down, where no layout looks.
    listed = run_cli("list", tmp_path, "--json")
    assert listed.exit_code == 0 and listed.json["checkpoints"] == []

    rerun = run_cli("convert", big_dcp, dst, "--json", *RAW)
    assert rerun.exit_code == 0, rerun.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
    tensors = load_file(str(dst / "model.safetensors"))
    assert sorted(tensors) == [f"layers.{i}.weight" for i in range(4)]
    assert all(bool((t == float(i)).all()) for i, t in enumerate(tensors[f"layers.{i}.weight"] for i in range(4)))


def test_ctrl_c_exits_130_and_removes_the_staging_folder(big_dcp: Path, tmp_path: Path) -> None:
    dst = tmp_path / "hf"
    interrupted = _start_and_interrupt(big_dcp, dst, signal.SIGINT)
    assert interrupted.returncode == 130, interrupted.stderr
    assert "interrupted" in interrupted.stderr and "nothing was written" in interrupted.stderr
    assert "Traceback" not in interrupted.stderr
    # --json: no result, but one document that says the command was interrupted
    assert json.loads(interrupted.stdout)["error"] == {
        "type": "Interrupted",
        "message": "interrupted before the command finished",
        "hint": None,
        "exit_code": 130,
    }
    assert list(tmp_path.iterdir()) == []


def test_help_lists_convert_without_importing_torch() -> None:
    code = "import sys; sys.modules['torch'] = None; from ckptctl.cli.app import main; main(['convert', '--help'])"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--max-shard-size" in proc.stdout and "Examples" in proc.stdout
