"""The OpenRLHF layout on a PPO `--ckpt.path` arranged from real DeepSpeed tags (tests.writers.rl_runs)."""

from __future__ import annotations

import json
from pathlib import Path

from ckptctl import io
from ckptctl.checkpoint import CheckpointState, Component, ProblemKind
from ckptctl.layouts import detect, open_checkpoint, scan_run
from ckptctl.ops.prune import checkpoint_metrics
from ckptctl.ops.verification import verify_checkpoint, verify_run
from tests.conftest import copy_tree
from tests.writers.deepspeed_writer import WrittenDeepSpeed


def _listing(run: Path) -> list[tuple[str, str, int | None, CheckpointState, bool]]:
    refs = scan_run(str(run))
    return sorted((io.relative_to(r.url, str(run)), r.layout, r.step, r.state, r.latest) for r in refs)


def test_list_finds_actor_critic_best_tags_and_the_export(openrlhf_run: Path) -> None:
    complete = CheckpointState.COMPLETE
    assert _listing(openrlhf_run) == [
        ("_actor/best_global_step4", "openrlhf", 4, complete, True),  # saved after global_step4: `latest` names it
        ("_actor/global_step2", "openrlhf", 2, complete, False),
        ("_actor/global_step4", "openrlhf", 4, complete, False),
        ("_critic/best_global_step4", "openrlhf", 4, complete, True),
        ("_critic/global_step2", "openrlhf", 2, complete, False),
        ("_critic/global_step4", "openrlhf", 4, complete, False),
        ("global_step4_hf", "openrlhf", 4, complete, False),
    ]


def test_inspect_reports_role_counters_metric_and_parallelism(
    openrlhf_run: Path, deepspeed_runs: dict[int, WrittenDeepSpeed]
) -> None:
    actor = open_checkpoint(str(openrlhf_run / "_actor" / "global_step4"))
    meta = actor.metadata
    assert (actor.layout, actor.ref.step, meta["role"], meta["kind"]) == ("openrlhf", 4, "actor", "tag")
    assert meta["progress"] == {"global_step": 4, "episode": 0, "total_consumed_prompts": 32}
    assert meta["metrics"] == {"eval_gsm8k_pass1": 0.5}
    assert (actor.world_size, meta["zero_stage"], meta["dp_world_size"]) == (2, 2, 2)
    assert {Component.MODEL, Component.OPTIMIZER, Component.SCHEDULER, Component.DATALOADER} <= actor.components
    assert sum(t.numel for t in actor.tensors(Component.MODEL)) == deepspeed_runs[2].model_parameters

    critic = open_checkpoint(str(openrlhf_run / "_critic" / "global_step2"))
    assert (critic.ref.step, critic.metadata["role"], critic.metadata["zero_stage"]) == (2, "critic", 3)
    assert critic.metadata["progress"] == {}  # the critic saves no client state: the step is the tag's
    assert critic.metadata["metrics"] == {}  # metric.json with a null value (no evaluation yet)

    export = open_checkpoint(str(openrlhf_run / "global_step4_hf"))
    assert (export.layout, export.ref.step, export.metadata["kind"]) == ("openrlhf", 4, "hf_export")


def test_the_whole_run_verifies(openrlhf_run: Path) -> None:
    report = verify_run(str(openrlhf_run))
    assert report.ok, [(r.url, r.problems) for r in report.results if r.problems]
    assert len(report.results) == 7


def test_prune_sees_the_metric(openrlhf_run: Path) -> None:
    refs = {io.relative_to(r.url, str(openrlhf_run)): r for r in scan_run(str(openrlhf_run))}
    assert checkpoint_metrics(refs["_actor/global_step4"]) == {"eval_gsm8k_pass1": 0.5}
    assert checkpoint_metrics(refs["_actor/global_step2"]) == {}


def test_a_tag_cut_off_before_its_metric_is_a_warning(openrlhf_run: Path, tmp_path: Path) -> None:
    run = copy_tree(openrlhf_run, tmp_path / "ckpt")
    (run / "_actor" / "global_step4" / "metric.json").unlink()
    _, ref = detect(str(run / "_actor" / "global_step4"))
    assert ref.layout == "openrlhf"  # still OpenRLHF's: its save folder is `_actor`
    result = verify_checkpoint(str(run / "_actor" / "global_step4"))
    assert result.ok
    assert [(p.kind, p.path, p.severity) for p in result.problems] == [("missing_file", "metric.json", "warning")]


def test_a_damaged_metric_fails_verify(openrlhf_run: Path, tmp_path: Path) -> None:
    run = copy_tree(openrlhf_run, tmp_path / "ckpt")
    (run / "_critic" / "global_step4" / "metric.json").write_text("{not json")
    result = verify_checkpoint(str(run / "_critic" / "global_step4"))
    assert [(p.kind, p.path) for p in result.problems] == [(ProblemKind.BAD_METADATA, "metric.json")]


def test_latest_naming_a_missing_tag_fails_verify(openrlhf_run: Path, tmp_path: Path) -> None:
    run = copy_tree(openrlhf_run, tmp_path / "ckpt")
    (run / "_actor" / "latest").write_text("global_step6")
    result = verify_checkpoint(str(run / "_actor" / "global_step4"))
    assert [(p.kind, p.path) for p in result.problems] == [(ProblemKind.MISSING_FILE, "../latest")]


def test_sft_tags_beside_their_export_are_openrlhf_and_plain_deepspeed_stays_deepspeed(
    openrlhf_run: Path, deepspeed_runs: dict[int, WrittenDeepSpeed], tmp_path: Path
) -> None:
    sft = tmp_path / "sft"  # SFT/DPO/RM: tags directly in --ckpt.path, old versions without metric.json
    copy_tree(deepspeed_runs[2].save_dir, sft)
    assert {r.layout for r in scan_run(str(sft))} == {"deepspeed"}
    copy_tree(openrlhf_run / "global_step4_hf", sft / "global_step4_hf")
    assert {(io.name_of(r.url), r.layout) for r in scan_run(str(sft))} == {
        ("global_step2", "openrlhf"),
        ("global_step4", "openrlhf"),
        ("global_step4_hf", "openrlhf"),
    }
    metric = json.loads((openrlhf_run / "_actor" / "global_step2" / "metric.json").read_text())
    assert metric == {"metric_key": None, "metric_value": None}


def test_a_tag_keeps_fp32_master_weights_and_the_export_none(openrlhf_run: Path) -> None:
    """The layout's convert source reads DeepSpeed's `master_weights`: `convert` writes a tag's fp32 masters by
    default."""
    from ckptctl.layouts import get_layout
    from ckptctl.ops.convert_source import convert_source

    layout, source = get_layout("openrlhf"), convert_source("openrlhf")
    notes: list[str] = []
    tag = layout.open(str(openrlhf_run / "_actor" / "global_step4"))
    masters = source.master_weights(tag, required=True, notes=notes)
    assert masters is not None and notes == []
    trainable = [e for e in masters.entries if e.dtype == "float32" and e.name not in masters.upcast]
    assert trainable and all(c.file.endswith("_optim_states.pt") for e in trainable for c in e.chunks)
    export = layout.open(str(openrlhf_run / "global_step4_hf"))
    assert source.master_weights(export, required=False, notes=notes) is None and notes == []
