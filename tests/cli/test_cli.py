"""The command line as scripts and cron jobs use it: exit codes, JSON on stdout, messages on stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ckptctl.formats.safetensors import read_header
from ckptctl.layouts import layout_names
from tests.conftest import CliResult, copy_tree

Cli = Callable[..., CliResult]
REPO = Path(__file__).resolve().parents[2]


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# --- commands that need no torch ------------------------------------------------------------------


def _run_without_torch(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI in a fresh interpreter where importing torch fails, as on a login node without it."""
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        from ckptctl.cli.app import main
        main({list(argv)!r})
        """
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)


def test_help_does_not_import_torch() -> None:
    for argv in (["--help"], ["list", "--help"], ["inspect", "--help"], ["verify", "--help"], ["demo", "--help"]):
        proc = _run_without_torch(*argv)
        assert proc.returncode == 0, proc.stderr
        assert "Usage" in proc.stdout
        assert "Examples" in proc.stdout or argv == ["--help"]


def test_list_inspect_verify_work_without_torch(hf_model_dirs: dict[str, Path]) -> None:
    folder = str(hf_model_dirs["sharded"])
    inspected = _run_without_torch("inspect", folder, "--json")
    assert inspected.returncode == 0, inspected.stderr
    assert json.loads(inspected.stdout)["totals"]["parameters"] > 0
    verified = _run_without_torch("verify", folder, "--json")
    assert verified.returncode == 0, verified.stderr
    assert json.loads(verified.stdout)["ok"] is True
    listed = _run_without_torch("list", str(hf_model_dirs["sharded"].parent), "--json")
    assert listed.returncode == 0, listed.stderr


# --- errors ---------------------------------------------------------------------------------------


def test_missing_path_exits_2_with_a_message_and_no_traceback(run_cli: Cli, tmp_path: Path) -> None:
    for command in ("list", "inspect", "verify"):
        result = run_cli(command, tmp_path / "nope", "--json")
        assert result.exit_code == 2, (command, result)
        assert result.json == {"schema_version": 1, "error": {**result.json["error"], "exit_code": 2}}
        assert result.stderr.startswith("error: ")
        assert "Traceback" not in result.stderr


def test_unknown_folder_names_the_layouts_tried(run_cli: Cli, tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    result = run_cli("inspect", tmp_path)
    assert result.exit_code == 2
    assert f"tried: {', '.join(layout_names())})" in result.stderr


def test_run_folder_passed_to_inspect_gets_a_hint(run_cli: Cli, hf_model_dirs: dict[str, Path]) -> None:
    result = run_cli("inspect", hf_model_dirs["single"].parent)
    assert result.exit_code == 2
    assert "ckptctl list" in result.stderr


def test_bad_option_value_is_a_usage_error(run_cli: Cli, tmp_path: Path) -> None:
    result = run_cli("list", tmp_path, "--sort", "colour")
    assert result.exit_code == 2
    assert "--sort" in result.stderr


def test_interrupt_exits_130(run_cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptctl.ops.listing

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(ckptctl.ops.listing, "list_run", interrupted)
    assert run_cli("list", tmp_path).exit_code == 130


def test_internal_error_is_reported_without_traceback(
    run_cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckptctl.ops.listing

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(ckptctl.ops.listing, "list_run", broken)
    result = run_cli("list", tmp_path)
    assert result.exit_code == 2
    assert "internal error: RuntimeError: boom" in result.stderr
    assert "Traceback" not in result.stderr


# --- verify on foreign checkpoints ----------------------------------------------------------------


def test_write_manifest_then_catch_a_flipped_byte(run_cli: Cli, hf_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    folder = copy_tree(hf_model_dirs["sharded"], tmp_path / "m")
    first = run_cli("verify", folder, "--write-manifest", "--json")
    assert first.exit_code == 0, first.stderr
    assert first.json["wrote_digests"] is True
    assert (folder / "ckptctl-digests.json").exists()

    again = run_cli("verify", folder, "--json")
    assert again.exit_code == 0
    assert again.json["digests_checked"] == len([p for p in folder.iterdir() if p.name != "ckptctl-digests.json"])

    shard = sorted(folder.glob("model-*.safetensors"))[0]
    header = read_header(str(shard))
    _flip_byte(shard, header.tensors[0].begin + 3)  # inside tensor data: headers still parse
    flipped = run_cli("verify", folder, "--json")
    assert flipped.exit_code == 1
    assert flipped.json["ok"] is False
    assert [p["kind"] for p in flipped.json["problems"]] == ["digest_mismatch"]
    assert flipped.json["problems"][0]["path"] == shard.name


def test_deep_check_finite_reports_nan(run_cli: Cli, hf_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    folder = copy_tree(hf_model_dirs["single"], tmp_path / "m")
    path = folder / "model.safetensors"
    record = next(t for t in read_header(str(path)).tensors if t.dtype == "float32")
    data = bytearray(path.read_bytes())
    data[record.begin : record.begin + 4] = torch.tensor([float("nan")]).numpy().tobytes()
    path.write_bytes(bytes(data))
    assert run_cli("verify", folder, "--json").exit_code == 0  # structure alone cannot see it
    result = run_cli("verify", folder, "--check-finite", "--json")
    assert result.exit_code == 1
    problems = result.json["problems"]
    assert [(p["kind"], p["path"]) for p in problems] == [("not_finite", record.name)]
    assert result.json["tensors_read"] > 0


def test_quiet_prints_nothing_and_keeps_the_exit_code(
    run_cli: Cli, hf_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    folder = copy_tree(hf_model_dirs["single"], tmp_path / "m")
    assert run_cli("verify", folder, "-q") == CliResult(0, "", "")
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    result = run_cli("verify", folder, "-q")
    assert (result.exit_code, result.stdout) == (1, "")


# --- the demo runs --------------------------------------------------------------------------------


def test_demo_runs_list_with_states_and_latest(run_cli: Cli, demo_dir: Path) -> None:
    result = run_cli("list", demo_dir, "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json
    assert doc["schema_version"] == 1
    by_run: dict[str, list[dict[str, object]]] = {}
    for ckpt in doc["checkpoints"]:
        assert set(ckpt) >= {"url", "layout", "step", "epoch", "state", "size_bytes", "latest", "created"}
        by_run.setdefault(Path(str(ckpt["url"])).parent.name, []).append(ckpt)
    native = by_run["native"]
    assert [c["step"] for c in native] == [10, 20, 30]
    assert [c["latest"] for c in native] == [False, False, True]
    assert all(c["layout"] == "native" and c["state"] == "complete" for c in native)
    assert [c["step"] for c in by_run["dcp"]] == [10, 20, 30]
    assert all(c["layout"] == "dcp" for c in by_run["dcp"])
    assert [c["step"] for c in by_run["distributed"]] == [10, 20, 30]
    hf = [c for c in doc["checkpoints"] if c["layout"] == "hf"]
    assert len(hf) == 1


def test_demo_inspect_counts_the_real_parameters(run_cli: Cli, demo_dir: Path) -> None:
    from ckptctl.demo import _model

    expected = sum(p.numel() for p in _model().parameters())
    for folder, world_size in ((demo_dir / "native" / "step-30", 1), (demo_dir / "distributed" / "step-30", 2)):
        result = run_cli("inspect", folder, "--json")
        assert result.exit_code == 0, result.stderr
        doc = result.json
        assert doc["totals"]["parameters"] == expected
        assert {"model", "optimizer", "scheduler", "rng"} <= set(doc["components"])
        assert "optimizer" not in doc["missing_components"]
        assert doc["world_size"] == world_size
        assert doc["step"] == 30
    dcp = run_cli("inspect", demo_dir / "dcp" / "step-30", "--json").json
    assert dcp["layout"] == "dcp"
    assert dcp["totals"]["parameters"] == expected
    assert dcp["world_size"] == 2


def test_demo_verify_passes_then_fails_on_corruption(run_cli: Cli, demo_dir: Path, tmp_path: Path) -> None:
    result = run_cli("verify", demo_dir, "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["ok"] is True
    assert len(result.json["results"]) >= 10

    run = copy_tree(demo_dir / "native", tmp_path / "native")
    victim = run / "step-30" / "model.safetensors"
    _flip_byte(victim, victim.stat().st_size - 1)
    failed = run_cli("verify", run, "--json")
    assert failed.exit_code == 1
    bad = [r for r in failed.json["results"] if not r["ok"]]
    assert [r["step"] for r in bad] == [30]
    assert bad[0]["problems"][0]["kind"] == "digest_mismatch"

    latest = run_cli("verify", run, "--latest", "--json")
    assert latest.exit_code == 1
    assert [r["step"] for r in latest.json["results"]] == [30]


def test_human_output_goes_to_stdout_and_names_the_checkpoints(run_cli: Cli, demo_dir: Path) -> None:
    result = run_cli("list", demo_dir / "native")
    assert result.exit_code == 0
    assert "step-30" in result.stdout and "complete" in result.stdout
    verified = run_cli("verify", demo_dir / "native" / "step-30")
    assert verified.exit_code == 0
    assert verified.stdout.startswith("ok")


def test_python_m_ckptctl_runs(demo_dir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ckptctl", "list", str(demo_dir / "native"), "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["checkpoints"]) == 3
