"""`diff` on real checkpoints: across layouts, across steps, casts, reshapes, tolerances, and what it reads."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from ckptctl import io
from ckptctl.checkpoint import ChunkEncoding, Component, TensorChunk, TensorEntry
from ckptctl.errors import CkptctlError
from ckptctl.ops import diff as diff_module
from ckptctl.ops.convert import ConvertOptions, convert
from ckptctl.ops.diff import ChangeKind, DiffOptions, Evidence, compare_values, diff
from ckptctl.ops.naming import compile_renames, normalised_names, parse_rename
from tests.conftest import copy_tree


@pytest.fixture(scope="module")
def dcp_export(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's 2-rank DCP step-30 converted to a sharded HF folder by `convert`."""
    out = tmp_path_factory.mktemp("export") / "hf"
    convert(str(demo_dir / "dcp" / "step-30"), str(out), ConvertOptions(max_shard_size=200_000, mapping="none"))
    return out


def _write_cast(src: Path, dst: Path, dtype: torch.dtype) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    save_file(
        {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}, str(dst / "model.safetensors")
    )
    return dst


# --- across layouts ---------------------------------------------------------------------------------


def test_dcp_save_equals_its_hf_conversion(demo_dir: Path, dcp_export: Path) -> None:
    report = diff(str(demo_dir / "dcp" / "step-30"), str(dcp_export))
    assert report.equal
    assert report.compared == report.equal_count == report.identical_count == 16
    assert not report.only_in_a and not report.only_in_b and not report.changed
    assert (report.a_layout, report.b_layout) == ("dcp", "hf")
    # Tensor bytes of both sides were read: the DCP side's torch.save records and the HF side's data.
    assert report.bytes_read >= 2 * sum(p.stat().st_size for p in dcp_export.glob("*.safetensors")) * 0.9
    assert {(m.field, m.a, m.b) for m in report.metadata} >= {("step", 30, None), ("layout", "dcp", "hf")}


def test_native_dcp_backed_dcp_and_hf_export_hold_the_same_weights(demo_dir: Path) -> None:
    # The 2-rank run saved step 30 both through the core (native, DCP inside) and with plain dcp.save;
    # the single-process native run exported its final weights as an HF folder.
    assert diff(str(demo_dir / "dcp" / "step-30"), str(demo_dir / "distributed" / "step-30")).equal
    assert diff(str(demo_dir / "native" / "step-30"), str(demo_dir / "hf")).equal


def test_single_file_and_sharded_hf_of_one_model_are_equal(hf_model_dirs: dict[str, Path]) -> None:
    report = diff(str(hf_model_dirs["single"]), str(hf_model_dirs["sharded"]))
    assert report.equal and report.compared == len(load_file(str(hf_model_dirs["single"] / "model.safetensors")))
    assert report.identical_count == report.compared
    # Configs are identical; the number of weight files is the only recorded difference.
    assert [m.field for m in report.metadata] == ["weight_files"]


# --- across steps -----------------------------------------------------------------------------------


def test_two_steps_differ_and_the_most_changed_tensors_come_first(demo_dir: Path) -> None:
    a, b = demo_dir / "native" / "step-20", demo_dir / "native" / "step-30"
    report = diff(str(a), str(b), DiffOptions(top=3))
    assert not report.equal and report.equal_count == 0
    assert len(report.changed) == report.compared == 16
    assert all(d.kind is ChangeKind.VALUES for d in report.changed)
    rel = [d.rel_l2 for d in report.changed]
    assert rel == sorted(rel, reverse=True)  # type: ignore[type-var]

    # The numbers are those torch computes on the two state dicts.
    before = load_file(str(a / "model.safetensors"))
    after = load_file(str(b / "model.safetensors"))
    top = report.changed[0]
    x, y = before[top.name].double(), after[top.name].double()
    assert top.max_abs_diff == pytest.approx(float((x - y).abs().max()))
    assert top.rel_l2 == pytest.approx(float((x - y).norm() / max(x.norm(), y.norm())))
    assert top.mismatched == x.numel()
    doc = report.to_json()
    assert [d["name"] for d in doc["changed"]] == [d.name for d in report.changed[:3]]
    assert doc["changed_count"] == 16 and doc["equal"] is False
    assert {"field": "step", "a": 20, "b": 30} in doc["metadata"]


def test_metadata_differences_leave_out_save_ids_and_what_reading_met(demo_dir: Path) -> None:
    """A layout's `error` and `*_error` keys (their messages name each checkpoint's paths) and save ids differ
    between any two saves: not reported; the counters a layout records are."""
    from dataclasses import replace

    from ckptctl.layouts import open_checkpoint
    from ckptctl.ops.diff import metadata_differences

    a, b = open_checkpoint(str(demo_dir / "dcp" / "step-20")), open_checkpoint(str(demo_dir / "dcp" / "step-30"))
    a = replace(a, metadata={**a.metadata, "error": "a", "role": {"dcp_error": "a", "steps": 1}})
    b = replace(b, metadata={**b.metadata, "error": "b", "role": {"dcp_error": "b", "steps": 2}})
    fields = [d.field for d in metadata_differences(a, b)]
    assert "step" in fields and "role.steps" in fields
    assert not {"save_id", "error", "role.dcp_error"} & set(fields)


def test_a_large_tolerance_makes_two_steps_equal(demo_dir: Path) -> None:
    a, b = str(demo_dir / "native" / "step-20"), str(demo_dir / "native" / "step-30")
    loose = diff(a, b, DiffOptions(atol=1.0, keep_equal=True))
    assert loose.equal and loose.equal_count == 16 and loose.identical_count == 0
    assert all(d.kind is None and d.max_abs_diff and d.max_abs_diff < 1.0 for d in loose.equal_tensors)
    # rtol alone is relative to A's values: small values change by more than 100 % between steps.
    assert not diff(a, b, DiffOptions(rtol=1.0)).equal


def test_optimizer_component_of_two_steps(demo_dir: Path) -> None:
    report = diff(
        str(demo_dir / "native" / "step-20"),
        str(demo_dir / "native" / "step-30"),
        DiffOptions(component=Component.OPTIMIZER),
    )
    assert report.compared > 0 and not report.equal
    assert any(d.name.endswith("exp_avg_sq") for d in report.changed)


# --- dtypes, shapes, names ----------------------------------------------------------------------------


def test_a_bf16_copy_is_a_dtype_change_unless_dtypes_are_ignored(
    hf_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    single = hf_model_dirs["single"]
    cast = _write_cast(single, tmp_path / "bf16", torch.bfloat16)
    report = diff(str(single), str(cast))
    assert not report.equal
    assert {d.kind for d in report.changed} == {ChangeKind.DTYPE}
    assert all((d.a_dtype, d.b_dtype) == ("float32", "bfloat16") for d in report.changed)
    worst = max(d.rel_l2 or 0.0 for d in report.changed)
    assert 0 < worst < 2**-7  # bf16 keeps 8 bits of mantissa
    # bf16 rounding stays within rtol=2**-8 relative to the fp32 values.
    assert diff(str(single), str(cast), DiffOptions(ignore_dtype=True, rtol=2**-8)).equal
    assert not diff(str(single), str(cast), DiffOptions(ignore_dtype=True)).equal


def test_shape_changes_and_names_on_one_side_only(hf_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    single = hf_model_dirs["single"]
    changed = copy_tree(single, tmp_path / "changed")
    tensors = load_file(str(single / "model.safetensors"))
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:100].clone()
    tensors["output.weight"] = tensors.pop("lm_head.weight")
    save_file(tensors, str(changed / "model.safetensors"))

    report = diff(str(single), str(changed))
    assert not report.equal
    assert report.only_in_a == ("lm_head.weight",) and report.only_in_b == ("output.weight",)
    assert report.changed[0].kind is ChangeKind.SHAPE  # shape changes come first
    assert report.changed[0].max_abs_diff is None and report.changed[0].b_shape == (100, 32)
    assert len(report.changed) == 1

    renamed = diff(str(single), str(changed), DiffOptions(renames=compile_renames([parse_rename("^output=lm_head")])))
    assert not renamed.only_in_a and not renamed.only_in_b and len(renamed.changed) == 1


def test_names_that_collide_after_renaming_are_an_error(hf_model_dirs: dict[str, Path]) -> None:
    with pytest.raises(CkptctlError, match="would both be named"):
        diff(
            str(hf_model_dirs["single"]),
            str(hf_model_dirs["sharded"]),
            DiffOptions(renames=compile_renames([(r"\d+", "N")])),
        )


def test_a_component_one_side_lacks_is_an_error(demo_dir: Path) -> None:
    with pytest.raises(CkptctlError, match="holds no optimizer tensors") as info:
        diff(str(demo_dir / "native" / "step-30"), str(demo_dir / "hf"), DiffOptions(component=Component.OPTIMIZER))
    assert "model" in info.value.hint


# --- what is read --------------------------------------------------------------------------------------


def test_recorded_digests_prove_copies_equal_without_reading(dcp_export: Path, tmp_path: Path) -> None:
    copy = copy_tree(dcp_export, tmp_path / "copy")
    before = io.READ_STATS.bytes_read
    report = diff(str(dcp_export), str(copy))
    data = sum(p.stat().st_size for p in dcp_export.glob("*.safetensors"))
    assert report.equal and report.proven_count == report.compared == 16
    assert io.READ_STATS.bytes_read - before < data  # headers and digests, not the tensors
    assert report.to_json()["proven_without_reading"] == 16

    # The proof trusts the records, as `verify` checks them; --read-all reads every pair.
    shard = sorted(copy.glob("model-*.safetensors"))[0]
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0x40
    shard.write_bytes(bytes(raw))
    assert diff(str(dcp_export), str(copy)).equal
    strict = diff(str(dcp_export), str(copy), DiffOptions(read_all=True))
    assert not strict.equal and strict.proven_count == 0 and len(strict.changed) == 1

    # A file whose size no longer matches its record proves nothing: it is read. (Its header is padded with
    # 8 spaces, which safetensors allows, so the file stays valid while its size changes.)
    raw = shard.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    shard.write_bytes(
        (header_len + 8).to_bytes(8, "little") + raw[8 : 8 + header_len] + b" " * 8 + raw[8 + header_len :]
    )
    assert diff(str(dcp_export), str(copy)).proven_count < 16


def test_the_same_files_are_equal_without_reading(demo_dir: Path) -> None:
    step = str(demo_dir / "dcp" / "step-30")
    report = diff(step, step)
    assert report.equal and report.proven_count == 16
    assert {d.evidence for d in diff(step, step, DiffOptions(keep_equal=True)).equal_tensors} == {Evidence.SAME_FILE}


def test_pairs_are_read_one_at_a_time(hf_model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptctl.formats.chunks as chunks

    live: list[int] = []
    peak = 0
    real = chunks.read_tensor

    def counting(url: str, entry: TensorEntry) -> torch.Tensor:
        nonlocal peak
        tensor = real(url, entry)
        live.append(entry.nbytes)
        peak = max(peak, len(live))
        return tensor

    def compare(a: torch.Tensor, b: torch.Tensor, atol: float = 0.0, rtol: float = 0.0) -> diff_module.ValueStats:
        result = compare_values(a, b, atol, rtol)
        live.clear()
        return result

    monkeypatch.setattr(chunks, "read_tensor", counting)
    monkeypatch.setattr(diff_module, "compare_values", compare)
    assert diff(str(hf_model_dirs["single"]), str(hf_model_dirs["sharded"]), DiffOptions(read_all=True)).equal
    assert peak == 2


# --- values ----------------------------------------------------------------------------------------------


def test_compare_values_edge_cases() -> None:
    nan, inf = math.nan, math.inf
    a = torch.tensor([1.0, nan, inf, -0.0, 2.0])
    same = compare_values(a, a.clone())
    assert same.identical and same.mismatched == 0
    b = torch.tensor([1.0, nan, inf, 0.0, 2.0])  # -0.0 == 0.0: equal, not bitwise identical
    signed = compare_values(a, b)
    assert not signed.identical and signed.mismatched == 0 and signed.max_abs_diff == 0.0
    c = torch.tensor([1.0, 3.0, -inf, 0.0, 2.5])
    stats = compare_values(a, c)
    assert stats.nonfinite_mismatched == 2 and stats.mismatched == 3
    assert stats.max_abs_diff == inf
    assert stats.rel_l2 == pytest.approx(0.5 / math.sqrt(1 + 6.25))  # over positions with a finite difference
    ints = compare_values(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 7], dtype=torch.int32))
    assert ints.max_abs_diff == 4 and ints.mismatched == 1
    assert compare_values(torch.tensor([0.0]), torch.tensor([0.0])).rel_l2 == 0.0
    assert compare_values(torch.tensor(True), torch.tensor(True)).identical


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(-1e6, 1e6, width=32), min_size=1, max_size=40),
    st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=40),
    st.floats(0, 10),
    st.floats(0, 1),
)
def test_blockwise_statistics_match_torch(values: list[float], deltas: list[float], atol: float, rtol: float) -> None:
    a = torch.tensor(values, dtype=torch.float32)
    b = a + torch.tensor((deltas * len(values))[: len(values)], dtype=torch.float32)
    original = diff_module._BLOCK
    diff_module._BLOCK = 7  # several blocks per tensor
    try:
        stats = compare_values(a, b, atol, rtol)
    finally:
        diff_module._BLOCK = original
    x, y = a.double(), b.double()
    d = (x - y).abs()
    assert stats.max_abs_diff == pytest.approx(float(d.max()))
    norm = max(float(x.norm()), float(y.norm()))
    assert stats.rel_l2 == pytest.approx(float(d.norm()) / norm if norm else 0.0, abs=1e-12)
    assert stats.mismatched == int((d > atol + rtol * x.abs()).sum())


# --- names ------------------------------------------------------------------------------------------------


def _entries(*names: str, encoding: ChunkEncoding = ChunkEncoding.TORCH_SAVE) -> list[TensorEntry]:
    chunk = TensorChunk("f", 0, 4, (0,), (1,), encoding)
    return [TensorEntry(n, Component.MODEL, "float32", (1,), (chunk,)) for n in names]


def test_namespace_rules() -> None:
    # DCP saves of {"model": state_dict}, and AReaL's wrapper key around it, lose the namespace.
    assert list(normalised_names("dcp", _entries("model.a.w", "model.b"))) == ["a.w", "b"]
    assert list(normalised_names("areal", _entries("dcp.model.a.w", "dcp.model.b"))) == ["a.w", "b"]
    # A raw dcp.save(model.state_dict()) of a ...ForCausalLM keeps its names (lm_head is not under model.).
    assert list(normalised_names("dcp", _entries("model.layers.0.w", "lm_head.weight"))) == [
        "model.layers.0.w",
        "lm_head.weight",
    ]
    # HF names are the model's own, even when every key starts with model. (tied embeddings, no lm_head).
    raw = _entries("model.embed.weight", "model.norm.weight", encoding=ChunkEncoding.RAW)
    assert list(normalised_names("hf", raw)) == ["model.embed.weight", "model.norm.weight"]
    # Native checkpoints lose the state entry name, whatever it is.
    assert list(normalised_names("native", _entries("policy.w", "policy.b", encoding=ChunkEncoding.RAW))) == ["w", "b"]
    assert list(normalised_names("native", _entries("policy.w", "ema.w"))) == ["policy.w", "ema.w"]
    # DeepSpeed modules lose the prefixes of training wrappers (DDP's module., OpenRLHF's Actor model.).
    ds = [
        TensorEntry(
            n, Component.MODEL, "bfloat16", (1,), (TensorChunk("mp_rank_00_model_states.pt", 0, 2, (0,), (1,)),)
        )
        for n in ("module.model.model.embed.weight", "module.model.lm_head.weight")
    ]
    assert list(normalised_names("openrlhf", ds)) == ["model.embed.weight", "lm_head.weight"]
    # An explicit prefix replaces detection; "" keeps names as stored.
    assert list(normalised_names("dcp", _entries("model.a"), strip_prefix="")) == ["model.a"]
    assert list(normalised_names("hf", raw, strip_prefix="model.")) == ["embed.weight", "norm.weight"]
    with pytest.raises(ValueError, match="PATTERN=REPL"):
        parse_rename("no-equals-sign")
    with pytest.raises(ValueError, match="regular expression"):
        parse_rename("(=x")


def test_report_json_is_strict_json(demo_dir: Path, tmp_path: Path) -> None:
    nan_run = copy_tree(demo_dir / "hf", tmp_path / "nan")
    tensors = load_file(str(nan_run / "model.safetensors"))
    tensors["norm.weight"][0] = math.nan
    save_file(tensors, str(nan_run / "model.safetensors"))
    doc = diff(str(demo_dir / "hf"), str(nan_run)).to_json()
    json.dumps(doc, allow_nan=False)
    (entry,) = doc["changed"]
    assert entry["name"] == "norm.weight" and entry["max_abs_diff"] is None and entry["nonfinite_mismatched"] == 1
