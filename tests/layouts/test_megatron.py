"""Megatron dist-ckpt folders as megatron-core 0.16.1 writes them (`tests/writers/megatron_writer.py`: its
`GPTModel` on 2 ranks with tensor parallelism 2, `dist_checkpointing.save(..., ("torch_dist", 1))` into
Megatron-LM's `iter_NNNNNNN/` folders, and Megatron-LM's tracker beside them), read by every command.

Before the megatron layout, these folders passed for plain DCP folders that `list` called complete while
`inspect`, `verify` and `resume-plan` refused their `.metadata` as a forgery (megatron-core pickles every
rank's save plan into it, naming `torch.distributed.checkpoint.planner` classes).
"""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from ckptctl.checkpoint import CheckpointState
from ckptctl.errors import CkptctlError
from ckptctl.formats.dcp_metadata_classes import DCP_METADATA_GLOBALS
from ckptctl.formats.safe_pickle import SafeUnpickler
from ckptctl.frameworks.megatron.hf import hf_config, shape_from_args, shape_from_config
from ckptctl.frameworks.megatron.names import LOCAL_SPEC_KEYS, spec_keys
from ckptctl.layouts import detect, open_checkpoint
from tests.conftest import CliResult, copy_tree
from tests.writers.megatron_writer import TRACKER, WrittenMegatron

Cli = Any


def _megatron_rows(result: CliResult, root: Path) -> dict[str, dict[str, Any]]:
    assert result.exit_code == 0, result.stderr
    rows = result.json["checkpoints"]
    return {Path(r["url"]).relative_to(root).as_posix(): r for r in rows if r["layout"] == "megatron"}


def test_list_names_every_iteration_and_what_the_trackers_name(megatron_runs: WrittenMegatron, run_cli: Cli) -> None:
    root = megatron_runs.save.parent
    rows = _megatron_rows(run_cli("list", "--json", root), root)
    assert {k: (r["step"], r["state"], r["latest"]) for k, r in rows.items()} == {
        "save/iter_0000001": (1, "complete", False),
        "save/iter_0000002": (2, "complete", True),
        "release-save/release": (None, "complete", True),
        "tied/dist_ckpt": (None, "complete", False),
    }


def test_a_dist_ckpt_is_found_where_verl_nests_it(megatron_runs: WrittenMegatron, run_cli: Cli, tmp_path: Path) -> None:
    """verl 0.9.1 (installed): `{default_local_dir}/global_step_{N}/actor/model/dist_ckpt/` (`trainer/ppo/
    ray_trainer.py` `_save_checkpoint`, `utils/megatron_utils.py` `get_model_dist_checkpoint_path`), the HF
    export in `model/huggingface/`, and `latest_checkpointed_iteration.txt` holding the global step."""
    run = tmp_path / "checkpoints"
    model = run / "global_step_5" / "actor" / "model"
    copy_tree(megatron_runs.tied, model / "dist_ckpt")
    copy_tree(megatron_runs.tied_source, model / "huggingface")
    (run / TRACKER).write_text("5")
    rows = _megatron_rows(run_cli("list", "--json", run), run)
    assert {k: (r["state"], r["latest"]) for k, r in rows.items()} == {
        "global_step_5/actor/model/dist_ckpt": ("complete", False)
    }
    assert run_cli("verify", run).exit_code == 0


def test_the_real_metadata_names_the_save_plans_and_nothing_outside_the_allowlist(
    megatron_runs: WrittenMegatron,
) -> None:
    seen: set[tuple[str, str]] = set()

    class Recording(SafeUnpickler):
        def find_class(self, module: str, name: str) -> Any:
            seen.add((module, name))
            return super().find_class(module, name)

    data = (megatron_runs.iteration(1) / ".metadata").read_bytes()
    Recording(io.BytesIO(data), DCP_METADATA_GLOBALS, "x").load()
    planner = "torch.distributed.checkpoint.planner"
    assert {(planner, n) for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")} <= seen
    assert seen <= set(DCP_METADATA_GLOBALS)


def test_inspect_reads_args_parallelism_and_counters(megatron_runs: WrittenMegatron, run_cli: Cli) -> None:
    result = run_cli("inspect", "--json", megatron_runs.iteration(2))
    assert result.exit_code == 0, result.stderr
    doc = result.json
    assert (doc["layout"], doc["step"], doc["state"], doc["world_size"]) == ("megatron", 2, "complete", 2)
    assert doc["components"] == ["config", "dataloader", "model", "optimizer", "rng", "scheduler", "trainer_state"]
    assert doc["missing_components"] == ["tokenizer"]
    meta = doc["metadata"]
    assert meta["sharded_backend"] == "torch_dist" and meta["checkpoint_version"] == 3.0
    assert meta["parallelism"]["tensor_model_parallel_size"] == 2
    assert meta["parallelism"]["pipeline_model_parallel_size"] == 1
    assert meta["model"]["num_query_groups"] == 2 and meta["model"]["params_dtype"] == "float32"
    assert meta["model"]["transformer_impl"] == "local"  # the spec whose names `convert --mapping none` writes
    assert meta["progress"] == {
        "iteration": 2,
        "consumed_train_samples": 8,
        "num_floating_point_operations_so_far": 2000,
    }
    assert doc["totals"]["parameters"] == megatron_runs.parameters
    shapes = {t["name"]: (t["component"], t["shape"]) for t in doc["tensors"]}
    assert shapes["decoder.layers.self_attention.linear_qkv.weight"] == ("model", [2, 128, 64])
    assert shapes["optimizer.state.exp_avg.output_layer.weight"] == ("optimizer", [128, 64])


def test_tensor_parallelism_is_derived_from_the_chunks_without_args(megatron_runs: WrittenMegatron) -> None:
    # megatron-core alone saves no Megatron-LM arguments; the chunks still tell the TP size.
    ckpt = open_checkpoint(str(megatron_runs.tied))
    assert ckpt.metadata["parallelism"]["tensor_model_parallel_size"] == 2
    assert "model" not in ckpt.metadata and ckpt.ref.step is None
    assert sum(t.numel for t in ckpt.tensors()) == megatron_runs.tied_parameters


def test_a_release_has_no_step_and_says_so(megatron_runs: WrittenMegatron) -> None:
    ckpt = open_checkpoint(str(megatron_runs.release_save / "release"))
    assert ckpt.metadata["release"] is True and ckpt.ref.step is None


def test_verify_passes_every_real_save_and_reads_the_rng_items(megatron_runs: WrittenMegatron, run_cli: Cli) -> None:
    result = run_cli("verify", "--json", megatron_runs.save.parent)
    assert result.exit_code == 0, result.stdout
    assert result.json["ok"] is True
    verified = {Path(r["url"]).name for r in result.json["results"]}
    assert {"iter_0000001", "iter_0000002", "release"} <= verified
    deep = run_cli("verify", "--deep", "--json", megatron_runs.iteration(2))
    assert deep.exit_code == 0 and deep.json["ok"] is True, deep.stdout


def test_resume_plan_follows_the_tracker_and_reshards(megatron_runs: WrittenMegatron, run_cli: Cli) -> None:
    result = run_cli("resume-plan", "--json", "--world-size", "4", megatron_runs.save)
    assert result.exit_code == 0, result.stderr
    plan = result.json
    assert plan["checkpoint"]["url"] == str(megatron_runs.iteration(2))
    assert plan["checkpoint"]["layout"] == "megatron"
    assert set(plan["restores"]) == {"model", "optimizer", "scheduler", "rng", "dataloader", "trainer_state"}
    assert plan["world_size_ok"] is True
    assert plan["resume_hint"] == f"--load {megatron_runs.save} --ckpt-format torch_dist"


def test_resume_plan_of_a_release_loads_weights_only(megatron_runs: WrittenMegatron, run_cli: Cli) -> None:
    result = run_cli("resume-plan", "--json", megatron_runs.release_save)
    assert result.exit_code == 0, result.stderr
    plan = result.json
    assert Path(plan["checkpoint"]["url"]).name == "release"
    assert "optimizer" in plan["missing"]
    assert any("release checkpoint" in w for w in plan["warnings"]), plan


def test_a_save_without_its_metadata_json_is_in_progress_and_skipped(
    megatron_runs: WrittenMegatron, run_cli: Cli, tmp_path: Path
) -> None:
    """megatron-core writes metadata.json after every rank's data: a save that died before it left the tracker
    at the previous iteration, and Megatron's load refuses the folder."""
    save = copy_tree(megatron_runs.save, tmp_path / "save")
    (save / "iter_0000002" / "metadata.json").unlink()
    (save / TRACKER).write_text("1")
    _, ref = detect(str(save / "iter_0000002"))
    assert ref.state is CheckpointState.IN_PROGRESS
    verified = run_cli("verify", "--json", save / "iter_0000002")
    assert verified.exit_code == 1
    assert {p["kind"] for p in verified.json["problems"]} == {"in_progress"}
    plan = run_cli("resume-plan", "--json", save)
    assert plan.exit_code == 0, plan.stderr
    assert plan.json["checkpoint"]["url"] == str(save / "iter_0000001")
    assert [s["step"] for s in plan.json["skipped"]] == [2]
    assert plan.json["resume_hint"] == f"--load {save} --ckpt-format torch_dist"


def test_resume_plan_names_the_iteration_when_the_tracker_names_another(
    megatron_runs: WrittenMegatron, run_cli: Cli, tmp_path: Path
) -> None:
    save = copy_tree(megatron_runs.save, tmp_path / "save")
    shutil.rmtree(save / "iter_0000002")  # the tracker still says 2: --load alone would fail
    plan = run_cli("resume-plan", "--json", save)
    assert plan.exit_code == 0, plan.stderr
    assert plan.json["resume_hint"] == f"--load {save} --ckpt-format torch_dist --ckpt-step 1"


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return os.system, (f"touch {self.marker}",)


def test_a_common_pt_with_a_payload_is_refused_as_a_forgery(
    megatron_runs: WrittenMegatron, run_cli: Cli, tmp_path: Path
) -> None:
    import torch

    ckpt = copy_tree(megatron_runs.iteration(1), tmp_path / "save" / "iter_0000001")
    marker = tmp_path / "pwned"
    torch.save({"iteration": 1, "args": _Payload(marker)}, ckpt / "common.pt")
    verified = run_cli("verify", "--json", ckpt)
    assert verified.exit_code == 1
    problems = [p for p in verified.json["problems"] if p["path"] == "common.pt"]
    assert [p["kind"] for p in problems] == ["unsafe_pickle"] and "posix.system" in problems[0]["message"]
    inspected = run_cli("inspect", ckpt)
    assert inspected.exit_code == 0  # the tensors are still listed; verify says what is wrong
    assert not marker.exists()


def test_an_unknown_megatron_class_is_unsupported_not_a_forgery(
    megatron_runs: WrittenMegatron, run_cli: Cli, tmp_path: Path
) -> None:
    """A newer Megatron may pickle classes ckptctl has not been taught: the file is refused, not accused."""
    ckpt = copy_tree(megatron_runs.iteration(1), tmp_path / "save" / "iter_0000001")
    common = (ckpt / "common.pt").read_bytes()
    # The same length, so that the pickle's and the archive's lengths still hold.
    renamed = common.replace(b"megatron.core.transformer.enums", b"megatron.core.transformer.enumz")
    assert renamed != common
    (ckpt / "common.pt").write_bytes(renamed)
    verified = run_cli("verify", "--json", ckpt)
    assert verified.exit_code == 1
    message = next(p["message"] for p in verified.json["problems"] if p["path"] == "common.pt")
    assert "unsupported class megatron.core.transformer.enumz.AttnBackend (from megatron)" in message
    assert "not what it claims" not in verified.stdout


_ARGS = {
    "num_layers": 2,
    "hidden_size": 64,
    "ffn_hidden_size": 128,
    "num_attention_heads": 4,
    "group_query_attention": True,
    "num_query_groups": 2,
    "kv_channels": 16,
    "padded_vocab_size": 128,
    "max_position_embeddings": 64,
    "position_embedding_type": "rope",
    "normalization": "RMSNorm",
    "norm_epsilon": 1e-6,
    "swiglu": True,
    "untie_embeddings_and_output_weights": True,
    "rotary_base": 500000,
}


@pytest.mark.parametrize(
    ("extra", "architecture"),
    [
        ({}, "LlamaForCausalLM"),
        ({"use_rope_scaling": True, "rope_scaling_factor": 32.0}, "LlamaForCausalLM"),
        ({"add_qkv_bias": True}, "Qwen2ForCausalLM"),
        ({"qk_layernorm": True}, "Qwen3ForCausalLM"),
    ],
)
def test_the_config_made_from_megatron_arguments_is_one_transformers_reads(
    extra: dict[str, Any], architecture: str
) -> None:
    from transformers import AutoConfig

    made = hf_config({**_ARGS, **extra}, "bfloat16")
    assert made["architectures"] == [architecture]
    config = AutoConfig.for_model(**made)
    assert (config.num_key_value_heads, config.head_dim, config.intermediate_size) == (2, 16, 128)
    assert config.tie_word_embeddings is False and config.vocab_size == 128
    assert shape_from_config(made) == shape_from_args({**_ARGS, **extra})
    if "use_rope_scaling" in extra:
        assert config.rope_parameters["rope_type"] == "llama3" and config.rope_parameters["factor"] == 32.0


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"num_experts": 8}, "experts"),
        ({"normalization": "LayerNorm"}, "RMSNorm"),
        ({"position_embedding_type": "learned_absolute"}, "RoPE"),
        ({"add_bias_linear": True}, "biases"),
    ],
)
def test_models_outside_the_llama_family_are_refused(change: dict[str, Any], reason: str) -> None:
    with pytest.raises(CkptctlError, match=reason):
        hf_config({**_ARGS, **change}, "float32")


def test_the_fused_qkv_rows_follow_the_query_groups() -> None:
    # 4 heads of 16 channels in 2 groups: [q0 q1 k0 v0 | q2 q3 k1 v1], 64 rows per group.
    shape = shape_from_args(_ARGS)
    assert shape is not None
    q, k, v = shape.qkv_rows()
    assert (q, k, v) == (((0, 32), (64, 96)), ((32, 48), (96, 112)), ((48, 64), (112, 128)))


@pytest.mark.parametrize(
    ("args", "local_names"),
    [
        ({"transformer_impl": "local"}, True),
        ({"transformer_impl": "local", "multi_latent_attention": True}, False),
        ({"transformer_impl": "transformer_engine"}, False),
        ({}, False),  # Megatron-LM's default: Transformer Engine
        ({"transformer_impl": "local", "spec": ["my_specs", "layer_spec"]}, False),
    ],
)
def test_the_saved_args_name_the_layer_specs_key_map(args: dict[str, Any], local_names: bool) -> None:
    """Megatron-LM's `gpt_builder` picks the spec; only the local one (without MLA) saves under other names
    (the map is megatron-core's own: `tests/ops/test_convert_megatron.py` compares it with the spec's)."""
    notes: list[str] = []
    assert spec_keys(args, notes) == (LOCAL_SPEC_KEYS if local_names else {})
    assert bool(notes) == ("spec" in args)
