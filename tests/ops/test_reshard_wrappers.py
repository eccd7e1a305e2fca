"""`reshard --to deepspeed-universal` of the frameworks that wrap DeepSpeed, on their real saves (2 gloo CPU ranks,
ZeRO-2, `deepspeed_wrappers_writer`): the HF Trainer's `checkpoint-N/` (`global_stepN/` and `latest` beside the
Trainer's files and `model.safetensors`) and accelerate's `save_state` folder (the tag `pytorch_model/`).

Each output equals, file for file and value for value, DeepSpeed's own `ds_to_universal` of the same tag, and
`resume-plan` names it. Both outputs are read back with `torch.load(weights_only=False)`: they are files this
suite wrote, and `optimizer_state.pt` holds DeepSpeed's `LossScaler`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import CliResult
from tests.ops.same_state import assert_same_state, files
from tests.writers.deepspeed_wrappers_writer import WrittenWrapperRuns

Cli = Callable[..., CliResult]

#: framework -> (its layout, the run folder, its last checkpoint, its tag, its file beside the tag holding the
#: LR scheduler)
_RUNS: dict[str, Callable[[WrittenWrapperRuns], tuple[str, Path, Path, str, str]]] = {
    "trainer": lambda w: ("hf_trainer", w.trainer, w.trainer_checkpoint, "global_step4", "scheduler.pt"),
    "accelerate": lambda w: ("accelerate", w.accelerate, w.accelerate_checkpoint, "pytorch_model", "scheduler.bin"),
}


@pytest.mark.parametrize("framework", sorted(_RUNS))
def test_equals_ds_to_universal_and_resume_plan_names_it(
    framework: str, run_cli: Cli, deepspeed_wrappers: WrittenWrapperRuns, tmp_path: Path
) -> None:
    layout, run, checkpoint, tag, scheduler = _RUNS[framework](deepspeed_wrappers)
    listed = {Path(c["url"]): c for c in run_cli("list", run, "--json").json["checkpoints"]}
    assert (listed[checkpoint]["layout"], listed[checkpoint]["state"]) == (layout, "complete")

    dst = tmp_path / "universal"
    done = run_cli("reshard", checkpoint, dst, "--to", "deepspeed-universal", "--json")
    assert done.exit_code == 0, done.stderr
    doc = done.json
    assert (doc["checkpoint"], doc["layout"], doc["to"]) == (str(checkpoint), layout, "deepspeed-universal")
    assert (dst / "latest_universal").read_text() == tag
    assert doc["files"][-1] == "latest_universal"
    assert sorted(doc["files"]) == sorted(f for f in files(dst) if f != "ckptctl-digests.json")
    beside = {n["what"]: n["why"] for n in doc["not_carried"]}[f"{layout} files beside the DeepSpeed tag"]
    assert scheduler in beside and "latest" not in beside.split(":")[0].split(", ")

    reference = deepspeed_wrappers.universal / framework / tag
    ours = dst / tag
    assert files(ours) == files(reference)
    assert any(f.endswith("exp_avg_sq.pt") for f in files(ours))
    for rel in files(reference):
        assert_same_state(
            torch.load(reference / rel, weights_only=False), torch.load(ours / rel, weights_only=False), rel
        )

    assert run_cli("verify", dst, "--json").json["ok"] is True
    plan = run_cli("resume-plan", dst, "--world-size", "1", "--json").json
    assert plan["checkpoint"]["url"] == str(ours) and plan["checkpoint"]["layout"] == "deepspeed_universal"
    assert plan["checkpoint"]["step"] == 4 and plan["world_size_ok"] is True
