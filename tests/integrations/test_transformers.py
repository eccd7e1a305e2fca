"""`CkptctlCallback` in a real `transformers.Trainer` run: every checkpoint gets ckptctl digests (and its
step's metrics) that `ckptctl verify` checks, and retention keeps the newest `keep_last` plus the best."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptctl.formats.manifest import DIGESTS_NAME
from tests.conftest import CliResult, build_once
from tests.integrations._trainer_worker import KEEP_LAST, STEPS, write_run

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

Cli = Callable[..., CliResult]


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The Trainer run with the callback, and its last retention report (slow: a subprocess; cached between
    runs while the worker, the ckptctl code it reaches and the frameworks stay the same)."""
    return build_once(tmp_path_factory, "trainer-callback", write_run)


def _best(output_dir: Path) -> str:
    newest = max(output_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return Path(json.loads((newest / "trainer_state.json").read_text())["best_model_checkpoint"]).name


def test_retention_keeps_the_newest_and_the_best(trainer_run: tuple[Path, dict[str, Any]]) -> None:
    output_dir, report = trainer_run
    best = _best(output_dir)
    newest = {f"checkpoint-{s}" for s in range(STEPS - KEEP_LAST + 1, STEPS + 1)}
    assert best not in newest, "the run is built so that the best checkpoint is an old one"
    assert {p.name for p in output_dir.glob("checkpoint-*")} == newest | {best}
    kept_best = next(k for k in report["keep"] if k["url"].endswith(best))
    assert any("best" in reason for reason in kept_best["reasons"])


def test_every_kept_checkpoint_has_digests_and_verifies(trainer_run: tuple[Path, dict[str, Any]], run_cli: Cli) -> None:
    output_dir, _ = trainer_run
    for folder in sorted(output_dir.glob("checkpoint-*")):
        step = int(folder.name.split("-")[1])
        digests = json.loads((folder / DIGESTS_NAME).read_text())
        assert digests["step"] == step
        assert {"loss", "eval_loss", "learning_rate", "epoch"} <= set(digests["metrics"])
        assert set(digests["files"]) == {p.name for p in folder.iterdir()} - {DIGESTS_NAME}
        result = run_cli("verify", folder, "--json")
        assert result.exit_code == 0, result.stdout
        assert result.json["ok"] is True and result.json["digests_checked"] == len(digests["files"])
        assert result.json["layout"] == "hf_trainer"


def test_a_damaged_checkpoint_fails_verify(
    trainer_run: tuple[Path, dict[str, Any]], run_cli: Cli, tmp_path: Path
) -> None:
    import shutil

    output_dir, _ = trainer_run
    folder = shutil.copytree(max(output_dir.glob("checkpoint-*")), tmp_path / "checkpoint")
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-2] ^= 0x10
    weights.write_bytes(bytes(data))
    result = run_cli("verify", folder, "--json")
    assert result.exit_code == 1
    assert [p["kind"] for p in result.json["problems"]] == ["digest_mismatch"]
