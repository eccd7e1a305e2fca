"""ckptctl on what OpenRLHF 0.11.2's own saving code writes (`tests.writers.openrlhf_writer`: its
`DeepspeedStrategy.save_ckpt`/`save_model` for a PPO actor and critic, ZeRO-2 on 2 CPU ranks).

The run: `--ckpt.path` with `_actor/` and `_critic/` (tags `best_global_step2`, `global_step2`,
`global_step3`; OpenRLHF's retention removed `global_step1`), the `{tag}_hf` exports of `--ckpt.save_hf`,
and the final models in `--ckpt.output_dir` and `{output_dir}_critic`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckptctl import io
from ckptctl.checkpoint import CheckpointState, Component
from ckptctl.layouts import open_checkpoint, scan_run
from ckptctl.ops.convert import ConvertOptions, Weights, convert
from ckptctl.ops.resume_plan import plan_resume
from ckptctl.ops.verification import verify_run
from tests.conftest import CliResult, copy_tree
from tests.writers.openrlhf_writer import EVAL_METRIC, EVAL_VALUE, WrittenOpenRlhf

RANK1_OPTIM = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
RANK0_OPTIM = "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
Run = Callable[..., CliResult]


def _listing(run: Path) -> dict[str, tuple[str, int | None, CheckpointState, bool]]:
    return {io.relative_to(r.url, str(run)): (r.layout, r.step, r.state, r.latest) for r in scan_run(str(run))}


@pytest.fixture
def torn(openrlhf_ppo: WrittenOpenRlhf, tmp_path: Path) -> Path:
    """A copy of the run whose critic's newest tag (the one `_critic/latest` names) lost rank 1's optim file."""
    run = copy_tree(openrlhf_ppo.ckpt_path, tmp_path / "ckpt")
    (run / "_critic" / openrlhf_ppo.latest / RANK1_OPTIM).unlink()
    return run


# --- what OpenRLHF wrote, as list / verify / inspect read it ------------------------------------------------


def test_list_shows_every_tag_openrlhf_kept_and_its_exports(openrlhf_ppo: WrittenOpenRlhf) -> None:
    complete = CheckpointState.COMPLETE
    expected = {}
    for role in ("_actor", "_critic"):
        for tag, step in (("best_global_step2", 2), ("global_step2", 2), ("global_step3", 3)):
            expected[f"{role}/{tag}"] = ("openrlhf", step, complete, tag == openrlhf_ppo.latest)
    for export in openrlhf_ppo.exports:
        expected[export] = (
            "openrlhf",
            int(export.removeprefix("best_").split("_")[1].removeprefix("step")),
            complete,
            False,
        )
    assert _listing(openrlhf_ppo.ckpt_path) == expected
    assert not (openrlhf_ppo.actor / "global_step1").exists()  # OpenRLHF's max_num retention removed it


def test_the_run_verifies(openrlhf_ppo: WrittenOpenRlhf) -> None:
    report = verify_run(str(openrlhf_ppo.ckpt_path))
    assert report.ok, [(r.url, r.problems) for r in report.results if r.problems]
    assert len(report.results) == 10


def test_inspect_reads_ppo_counters_metric_and_role(openrlhf_ppo: WrittenOpenRlhf) -> None:
    actor = open_checkpoint(str(openrlhf_ppo.actor / "global_step3"))
    meta = actor.metadata
    assert (actor.ref.step, meta["role"], meta["kind"], meta["zero_stage"], actor.world_size) == (
        3,
        "actor",
        "tag",
        2,
        2,
    )
    assert actor.progress == {"global_step": 3, "episode": 0, "total_consumed_prompts": 12}
    assert actor.metrics == {EVAL_METRIC: EVAL_VALUE}
    assert {Component.MODEL, Component.OPTIMIZER, Component.SCHEDULER, Component.DATALOADER} <= actor.components
    reference = openrlhf_ppo.reference_tensors()
    assert sum(t.numel for t in actor.tensors(Component.MODEL)) == sum(t.numel() for t in reference.values())

    critic = open_checkpoint(str(openrlhf_ppo.critic / "global_step2"))
    assert (critic.ref.step, critic.metadata["role"], critic.progress, critic.metrics) == (2, "critic", {}, {})
    best = open_checkpoint(str(openrlhf_ppo.critic / "best_global_step2"))
    assert (best.metadata["kind"], best.metrics) == ("best", {EVAL_METRIC: EVAL_VALUE})


# --- a DeepSpeed tag missing one rank's file is never complete, whoever's layout reads it -------------------


def _as_layout(openrlhf_ppo: WrittenOpenRlhf, layout: str, tmp_path: Path) -> tuple[Path, Path]:
    """The critic's save folder as each DeepSpeed-based layout finds such folders: (run, the newest tag)."""
    run = tmp_path / layout
    if layout == "openrlhf":
        copy_tree(openrlhf_ppo.ckpt_path, run)
        return run, run / "_critic" / openrlhf_ppo.latest
    if layout == "hf_trainer":  # a Trainer checkpoint-N with DeepSpeed inside (transformers trainer.py)
        inner = run / "checkpoint-3"
        copy_tree(openrlhf_ppo.critic / openrlhf_ppo.latest, inner / openrlhf_ppo.latest)
        (inner / "latest").write_text(openrlhf_ppo.latest)
        (inner / "trainer_state.json").write_text(json.dumps({"global_step": 3, "epoch": 1.0}))
        for metric in inner.rglob("metric.json"):
            metric.unlink()
        return run, inner / openrlhf_ppo.latest
    copy_tree(openrlhf_ppo.critic, run)
    # Without OpenRLHF's evidence (metric.json, best_* tags beside), a plain DeepSpeed save folder.
    shutil.rmtree(run / "best_global_step2")
    for metric in run.rglob("metric.json"):
        metric.unlink()
    if layout == "open_instruct":  # open-instruct keeps its reference policy beside the tags (grpo_fast.py)
        (run / "ref_policy").mkdir()
    return run, run / openrlhf_ppo.latest


@pytest.mark.parametrize("rank_file", [RANK1_OPTIM, RANK0_OPTIM])
@pytest.mark.parametrize("layout", ["openrlhf", "deepspeed", "open_instruct", "hf_trainer"])
def test_a_tag_missing_a_rank_file_is_never_complete(
    openrlhf_ppo: WrittenOpenRlhf, layout: str, rank_file: str, tmp_path: Path
) -> None:
    run, tag = _as_layout(openrlhf_ppo, layout, tmp_path)
    (tag / rank_file).unlink()
    refs = {r.url: r for r in scan_run(str(run))}
    ref = refs[str(tag.parent) if layout == "hf_trainer" else str(tag)]
    assert ref.layout == layout
    if layout == "open_instruct" and rank_file == RANK1_OPTIM:
        # Fewer files than the tag beside it, just written: it may still be arriving (open-instruct's layout
        # counts entries as its start-up cleanup does).
        assert ref.state is CheckpointState.IN_PROGRESS and "fewer than" in ref.note
    else:
        assert ref.state is CheckpointState.BROKEN
        assert rank_file in ref.note


# --- prune and slim: OpenRLHF's best tags are its convention, not a problem ---------------------------------


def test_prune_keeps_the_best_tags_with_a_note_and_exits_0_and_1_only_for_a_broken_one(
    openrlhf_ppo: WrittenOpenRlhf, tmp_path: Path, run_cli: Run
) -> None:
    """OpenRLHF's own retention never rotates `best*` tags (`DeepspeedStrategy.save_ckpt`, openrlhf
    utils/deepspeed/deepspeed.py: best tags do not count toward `max_num`, a new best replaces the old one), so
    prune keeps them whatever the rules: a note, exit 0 (issue 33: cron mailed a failure every night). A best tag
    that is torn is a problem (exit 1): a protection keeps a checkpoint no resume can load."""
    run = copy_tree(openrlhf_ppo.ckpt_path, tmp_path / "ckpt")
    best = ("best_global_step2_hf", "_actor/best_global_step2", "_critic/best_global_step2")
    # slim first (the same mistake was possible there): the older tags slim, the best ones stay whole, exit 0.
    slimmed = run_cli("slim", run, "--grace", "0", "-y", "--json")
    assert slimmed.exit_code == 0 and slimmed.json["skipped"] == [], slimmed.stderr
    assert sorted(io.relative_to(i["url"], str(run)) for i in slimmed.json["slim"]) == [
        "_actor/global_step2",
        "_critic/global_step2",
    ]
    kept = {io.relative_to(k["url"], str(run)): k["reasons"] for k in slimmed.json["keep"]}
    assert all(kept[b][0].startswith("a best checkpoint") for b in best)
    result = run_cli("prune", run, "--keep-last", "1", "--grace", "0", "-y", "--json")
    assert result.exit_code == 0, result.stderr
    why = "(a best checkpoint (best* folders are kept, as OpenRLHF does)) although no rule keeps it"
    assert (result.json["unmet"], result.json["notes"]) == ([], [f"{b} is protected {why}" for b in best])
    assert "warning" not in result.stderr and f"note: {best[1]} is protected" in result.stderr
    assert sorted(io.relative_to(d["url"], str(run)) for d in result.json["delete"]) == [
        "_actor/global_step2",
        "_critic/global_step2",
        *openrlhf_ppo.exports[:2],  # global_step1_hf and global_step2_hf: rules keep only the newest
    ]
    assert all((run / b).is_dir() for b in best)
    (run / best[1] / RANK1_OPTIM).unlink()
    torn = run_cli("prune", run, "--keep-last", "1", "--grace", "0", "-y", "--json")
    assert torn.exit_code == 1 and torn.json["unmet"] == [f"{best[1]} is protected {why}"]
    assert (run / best[1]).is_dir()


# --- resume-plan: the critic's `latest` tag loads along with the actor --------------------------------------


def test_resume_plan_of_the_whole_run(openrlhf_ppo: WrittenOpenRlhf, run_cli: Run) -> None:
    result = run_cli("resume-plan", openrlhf_ppo.ckpt_path, "--json")
    assert result.exit_code == 0, result.stderr
    plan = result.json
    assert plan["checkpoint"]["url"] == str(openrlhf_ppo.actor / "global_step3")
    assert (plan["blockers"], plan["warnings"], plan["world_size_ok"]) == ([], [], True)
    assert plan["continues_from"]["total_consumed_prompts"] == 12


def test_a_torn_critic_blocks_the_resume(torn: Path, run_cli: Run) -> None:
    result = run_cli("resume-plan", torn, "--json")
    assert result.exit_code == 1
    plan = result.json
    assert plan["checkpoint"]["url"] == str(torn / "_actor" / "global_step3")  # the actor tag itself is whole
    (blocker,) = plan["blockers"]
    assert blocker["url"] == str(torn / "_critic" / "global_step3")
    assert blocker["reason"].startswith("the critic's `latest` tag global_step3 is broken (missing " + RANK1_OPTIM)
    # No critic tag of step 3 is whole: both roles go back to the newest step both saved whole.
    assert blocker["fix"].startswith("write best_global_step2 into _critic/latest and into _actor/latest")

    human = run_cli("resume-plan", torn)
    assert human.exit_code == 1
    assert "fails" in human.stdout and "write best_global_step2 into _critic/latest" in human.stdout


@pytest.mark.parametrize("damage", ["truncated", "missing tag"])
def test_a_critic_latest_that_does_not_load_blocks_the_resume(
    openrlhf_ppo: WrittenOpenRlhf, damage: str, tmp_path: Path
) -> None:
    run = copy_tree(openrlhf_ppo.ckpt_path, tmp_path / "ckpt")
    if damage == "truncated":  # every file there, one cut short: only structural verify sees it
        victim = run / "_critic" / openrlhf_ppo.latest / RANK1_OPTIM
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
        expected = "the critic's `latest` tag global_step3 fails verify: " + RANK1_OPTIM
        fix = "write best_global_step2 into _critic/latest and into _actor/latest (both resume from step 2"
    else:
        (run / "_critic" / "latest").write_text("global_step4")
        expected = "the critic's `latest` tag global_step4 does not exist"
        fix = "write global_step3 into _critic/latest"
    plan = plan_resume(str(run))
    assert plan.checkpoint is not None and plan.checkpoint.url == str(run / "_actor" / "global_step3")
    (blocker,) = plan.blockers
    assert blocker.reason.startswith(expected), blocker.reason
    assert blocker.fix.startswith(fix), blocker.fix


def test_resume_plan_of_the_critic_folder(openrlhf_ppo: WrittenOpenRlhf, torn: Path, run_cli: Run) -> None:
    result = run_cli("resume-plan", openrlhf_ppo.critic, "--json")
    assert result.exit_code == 0, result.stdout
    plan = result.json
    assert (plan["checkpoint"]["url"], plan["checkpoint"]["framework"]) == (
        str(openrlhf_ppo.critic / "global_step3"),
        "OpenRLHF",
    )
    assert plan["resume_hint"].startswith(f"--load_checkpoint --ckpt_path {openrlhf_ppo.ckpt_path} ")

    plan = run_cli("resume-plan", torn / "_critic", "--json").json
    assert plan["checkpoint"]["url"] == str(torn / "_critic" / "best_global_step2")
    assert [(s["url"], s["step"]) for s in plan["skipped"]] == [(str(torn / "_critic" / "global_step3"), 3)]
    assert plan["resume_hint"].endswith(
        "; it loads the tag `_critic/latest` names: write best_global_step2 into _critic/latest first"
    )
    assert any(
        "the actor resumes from global_step3 (step 3) and the critic from best_global_step2" in w
        for w in plan["warnings"]
    )


# --- convert without --config: the config OpenRLHF exported beside the tag -----------------------------------


def test_convert_takes_the_config_of_the_tags_export_and_loads_in_transformers(
    openrlhf_ppo: WrittenOpenRlhf, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    result = convert(str(openrlhf_ppo.actor / "global_step3"), str(tmp_path / "hf"))
    export = openrlhf_ppo.ckpt_path / "global_step3_hf"
    assert f"config.json taken from {export}" in result.warnings
    written, exported = (json.loads((folder / "config.json").read_text()) for folder in (tmp_path / "hf", export))
    # the export's config but for its dtype: OpenRLHF exported bf16 weights, the conversion holds the fp32 masters
    dtype_key = "dtype" if "dtype" in exported else "torch_dtype"
    assert exported[dtype_key] == "bfloat16" and written.pop(dtype_key) == "float32"
    assert written == {k: v for k, v in exported.items() if k != dtype_key}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    loaded = model.state_dict()
    reference = openrlhf_ppo.reference_tensors()  # DeepSpeed's own zero_to_fp32 of the same tag
    assert loaded.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(loaded[name], tensor), name


def test_convert_of_the_stored_weights_equals_openrlhfs_own_export(
    openrlhf_ppo: WrittenOpenRlhf, tmp_path: Path
) -> None:
    convert(str(openrlhf_ppo.actor / "global_step3"), str(tmp_path / "hf"), ConvertOptions(weights=Weights.STORED))
    ours = load_file(str(tmp_path / "hf" / "model.safetensors"))
    theirs = load_file(str(openrlhf_ppo.ckpt_path / "global_step3_hf" / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) and ours[k].dtype == theirs[k].dtype for k in theirs)


def test_convert_takes_the_best_tags_own_export_else_the_newest(openrlhf_ppo: WrittenOpenRlhf, tmp_path: Path) -> None:
    ckpt = openrlhf_ppo.ckpt_path
    best = convert(str(ckpt / "_actor" / "best_global_step2"), str(tmp_path / "best"))
    assert f"config.json taken from {ckpt / 'best_global_step2_hf'}" in best.warnings

    run = copy_tree(ckpt, tmp_path / "ckpt")
    shutil.rmtree(run / "global_step3_hf")  # no export of step 3: the newest one (step 2's best, saved last)
    newest = convert(str(run / "_actor" / "global_step3"), str(tmp_path / "newest"))
    assert f"config.json taken from {run / 'best_global_step2_hf'}" in newest.warnings


def test_convert_of_a_critic_takes_the_critics_final_model(openrlhf_ppo: WrittenOpenRlhf, tmp_path: Path) -> None:
    result = convert(str(openrlhf_ppo.critic / "global_step3"), str(tmp_path / "hf"))
    assert f"config.json taken from {openrlhf_ppo.critic_output_dir}" in result.warnings
    written, exported = (
        json.loads((folder / "config.json").read_text()) for folder in (tmp_path / "hf", openrlhf_ppo.critic_output_dir)
    )
    dtype_key = "dtype" if "dtype" in exported else "torch_dtype"  # bf16 export, fp32 masters converted
    assert exported[dtype_key] == "bfloat16" and written.pop(dtype_key) == "float32"
    # OpenRLHF names its own CriticModel: the output names transformers' class computing its values
    # (tests/ops/test_convert_value_heads.py).
    assert written.pop("architectures") == ["LlamaForTokenClassification"] and exported.pop("architectures") == [
        "CriticModel"
    ]
    made = {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}, "token_classification_bias": False}
    assert written == {k: v for k, v in exported.items() if k != dtype_key} | made
    assert "score.weight" in load_file(str(tmp_path / "hf" / "model.safetensors"))
