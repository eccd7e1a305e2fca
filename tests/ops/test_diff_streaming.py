"""`diff`'s streamed comparison: raw bytes first, only differing blocks decoded, blocks on many threads.

Real checkpoints of the shared fixtures (the tiny Llama `save_pretrained` wrote, the demo's DCP and native
steps) are compared with blocks shrunk to a few hundred elements, so that their tensors span many blocks
and every path of a large checkpoint runs: byte-identical blocks skipped, a changed element in the middle
of a tensor, identical blocks read again for the norms, fp32 against bf16, NaN and infinities. The
streamed reports must be those of the whole-tensor comparison, to the last bit.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from ckptctl.formats import chunks, raw_chunks
from ckptctl.ops import diff as diff_module
from ckptctl.ops import tensor_stats
from ckptctl.ops.diff import ChangeKind, DiffOptions, DiffReport, compare_values, diff
from tests.conftest import copy_tree

BLOCK, READ_BLOCK = 256, 1024
READ_TENSOR = chunks.read_tensor
#: The tiny Llama's largest tensors (128 x 32); the element in the middle of the third block of 1024.
EMBED = "model.embed_tokens.weight"
MIDDLE = (64, 16)


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 256 elements, read 1,024 at a time: the fixtures' tensors stream in several blocks."""
    monkeypatch.setattr(diff_module, "_BLOCK", BLOCK)
    monkeypatch.setattr(diff_module, "_READ_BLOCK", READ_BLOCK)


@pytest.fixture
def streamed(small_blocks: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small blocks, and no tensor may be read whole: everything streams."""

    def whole(url: str, entry: Any) -> torch.Tensor:
        raise AssertionError(f"{entry.name} was read whole")

    monkeypatch.setattr(chunks, "read_tensor", whole)


def whole_report(monkeypatch: pytest.MonkeyPatch, a: Path, b: Path, options: DiffOptions) -> DiffReport:
    """The report of the whole-tensor comparison, with the same small blocks."""
    with monkeypatch.context() as m:
        m.setattr(diff_module, "_BLOCK", BLOCK)
        m.setattr(raw_chunks, "flat_ranges", lambda *args: None)
        m.setattr(chunks, "read_tensor", READ_TENSOR)
        return diff(str(a), str(b), options)


def same_document(streamed_report: DiffReport, whole: DiffReport) -> None:
    ours, theirs = streamed_report.to_json(), whole.to_json()
    ours.pop("bytes_read")  # identical blocks may be read twice for their norms
    theirs.pop("bytes_read")
    assert ours == theirs


def write_changed(src: Path, dst: Path, change: Any) -> Path:
    """A copy of the HF folder `src` whose `model.safetensors` tensors went through `change` (in place)."""
    copy_tree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def bf16_cast(tensors: dict[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        tensors[name] = tensor.to(torch.bfloat16)


# --- the same reports as the whole-tensor comparison -------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "options"),
    [
        ("dcp/step-30", "distributed/step-30", DiffOptions(read_all=True)),  # DCP items of 2 ranks, both sides
        ("dcp/step-20", "dcp/step-30", DiffOptions()),
        ("dcp/step-20", "native/step-30", DiffOptions(atol=0.05, keep_equal=True)),
        ("native/step-10", "native/step-30", DiffOptions(rtol=0.5, keep_equal=True)),
    ],
)
def test_streamed_reports_equal_whole_tensor_reports(
    demo_dir: Path, streamed: None, monkeypatch: pytest.MonkeyPatch, a: str, b: str, options: DiffOptions
) -> None:
    report = diff(str(demo_dir / a), str(demo_dir / b), options)
    assert report.compared == 16
    same_document(report, whole_report(monkeypatch, demo_dir / a, demo_dir / b, options))


# --- byte-identical regions are not decoded -----------------------------------------------------------------


def test_identical_tensors_are_compared_as_bytes(
    hf_model_dirs: dict[str, Path], streamed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoded: list[int] = []
    real = diff_module.compare_block
    monkeypatch.setattr(diff_module, "compare_block", lambda *args: decoded.append(1) or real(*args))
    monkeypatch.setattr(diff_module, "norms_block", lambda *args: pytest.fail("an identical pair was decoded"))
    report = diff(str(hf_model_dirs["single"]), str(hf_model_dirs["sharded"]), DiffOptions(read_all=True))
    assert report.equal and report.identical_count == report.compared == 21
    assert not decoded
    data = sum(p.stat().st_size for p in hf_model_dirs["single"].glob("*.safetensors"))
    assert report.bytes_read >= 2 * data * 0.95  # every byte of both sides was read, and compared


@pytest.mark.parametrize("workers", [1, 3])
def test_one_element_changed_in_the_middle_of_a_large_tensor(
    hf_model_dirs: dict[str, Path], tmp_path: Path, streamed: None, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """Only the block holding the change is decoded for its differences; the relative L2 difference is
    over the whole tensor, so the identical blocks add their norms (read again when they were compared
    before the change was met: always with one worker)."""
    single = hf_model_dirs["single"]

    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[EMBED][MIDDLE] += 0.25

    changed = write_changed(single, tmp_path / "changed", change)
    monkeypatch.setattr(diff_module, "_workers", lambda url_a, url_b: workers)
    decoded: list[int] = []
    real = diff_module.compare_block
    monkeypatch.setattr(diff_module, "compare_block", lambda *args: decoded.append(1) or real(*args))
    report = diff(str(single), str(changed))

    assert [d.name for d in report.changed] == [EMBED]
    (found,) = report.changed
    assert found.kind is ChangeKind.VALUES and found.mismatched == 1 and not found.identical
    x = load_file(str(single / "model.safetensors"))[EMBED].double()
    y = load_file(str(changed / "model.safetensors"))[EMBED].double()
    assert found.max_abs_diff == float((x - y).abs().max())
    assert found.rel_l2 == pytest.approx(float((x - y).norm() / max(x.norm(), y.norm())), rel=1e-12)
    assert len(decoded) == READ_BLOCK // BLOCK  # the sub-blocks of the one block that differs
    assert report.identical_count == report.compared - 1
    same_document(report, whole_report(monkeypatch, single, changed, DiffOptions()))


def test_reads_stay_within_a_block(
    hf_model_dirs: dict[str, Path], tmp_path: Path, streamed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    cast = write_changed(hf_model_dirs["single"], tmp_path / "bf16", bf16_cast)
    sizes: list[int] = []
    real = diff_module._RawSide.read

    def read(side: Any, start: int, stop: int) -> bytes:
        data = real(side, start, stop)
        sizes.append(len(data))
        return data

    monkeypatch.setattr(diff_module._RawSide, "read", read)
    diff(str(hf_model_dirs["single"]), str(cast))
    assert sizes and max(sizes) == READ_BLOCK * 4  # fp32 blocks; bf16 ones are half that


# --- fp32 against bf16 -------------------------------------------------------------------------------------


def test_fp32_against_its_bf16_cast_within_and_over_the_tolerance(
    hf_model_dirs: dict[str, Path], tmp_path: Path, streamed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    single = hf_model_dirs["single"]
    cast = write_changed(single, tmp_path / "bf16", bf16_cast)
    exact = diff(str(single), str(cast))
    assert {d.kind for d in exact.changed} == {ChangeKind.DTYPE} and len(exact.changed) == exact.compared
    assert diff(str(single), str(cast), DiffOptions(ignore_dtype=True, rtol=2**-8)).equal  # bf16 rounding

    options = DiffOptions(ignore_dtype=True, rtol=2**-10, keep_equal=True)
    tight = diff(str(single), str(cast), options)
    assert not tight.equal and {d.kind for d in tight.changed} == {ChangeKind.VALUES}
    fp32 = load_file(str(single / "model.safetensors"))
    bf16 = load_file(str(cast / "model.safetensors"))
    for found in (*tight.changed, *tight.equal_tensors):
        x, y = fp32[found.name].double(), bf16[found.name].double()
        assert found.mismatched == int(((x - y).abs() > 2**-10 * x.abs()).sum())
        assert found.max_abs_diff == float((x - y).abs().max())
        # The L2 sums are float64 too, in another order: equal to the last few bits.
        norm = math.sqrt(max(float((x * x).sum()), float((y * y).sum())))
        assert found.rel_l2 == pytest.approx(math.sqrt(float(((x - y) ** 2).sum())) / norm, rel=1e-12)
    same_document(tight, whole_report(monkeypatch, single, cast, options))


# --- NaN and infinities ------------------------------------------------------------------------------------


def test_nan_and_infinities_in_large_tensors(
    hf_model_dirs: dict[str, Path], tmp_path: Path, streamed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NaN equals NaN (whatever its payload: the bytes differ, the values do not), an infinity equals the
    same infinity; NaN against a number, or inf against -inf, is a mismatch with an infinite difference."""
    single = hf_model_dirs["single"]
    nan_payload = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)

    def both(tensors: dict[str, torch.Tensor]) -> None:
        tensors[EMBED][MIDDLE] = math.nan
        tensors[EMBED][0, 0] = math.inf
        tensors["lm_head.weight"][3, 3] = -math.inf

    def other(tensors: dict[str, torch.Tensor]) -> None:
        both(tensors)
        tensors[EMBED][MIDDLE] = nan_payload[0]  # another NaN
        tensors["lm_head.weight"][3, 3] = math.inf
        tensors["lm_head.weight"][100, 1] = math.nan

    a = write_changed(single, tmp_path / "a", both)
    b = write_changed(single, tmp_path / "b", other)
    report = diff(str(a), str(b), DiffOptions(keep_equal=True))
    assert [d.name for d in report.changed] == ["lm_head.weight"]
    (head,) = report.changed
    assert head.nonfinite_mismatched == 2 and head.mismatched == 2 and head.max_abs_diff == math.inf
    embed = next(d for d in report.equal_tensors if d.name == EMBED)
    assert not embed.identical and embed.mismatched == 0 and embed.max_abs_diff == 0.0
    assert embed.rel_l2 == 0.0
    json.dumps(report.to_json(), allow_nan=False)
    same_document(report, whole_report(monkeypatch, a, b, DiffOptions(keep_equal=True)))


def test_signed_zeros_and_bf16_nans_are_equal_values_not_identical_bytes(
    hf_model_dirs: dict[str, Path], tmp_path: Path, streamed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The byte comparison comes first, so bytes that differ while values do not decide only `identical`:
    -0.0 against 0.0, and bf16 NaNs of different payloads, are equal values (no mismatch, no difference,
    rel L2 0) in a tensor that is not bit-identical; a block that differs in nothing else adds nothing."""
    single = hf_model_dirs["single"]
    # The same NaN bytes on both sides: only the payload of the one at MIDDLE differs.
    bf16_nan = torch.tensor([0x7FC0, 0x7FC1], dtype=torch.int16).view(torch.bfloat16)

    def zeros(negative: bool) -> Any:
        def change(tensors: dict[str, torch.Tensor]) -> None:
            tensors[EMBED][MIDDLE] = -0.0 if negative else 0.0
            bf16 = tensors["lm_head.weight"].to(torch.bfloat16)
            bf16[5, 5] = bf16_nan[1 if negative else 0]
            tensors["lm_head.weight"] = bf16

        return change

    a = write_changed(single, tmp_path / "a", zeros(False))
    b = write_changed(single, tmp_path / "b", zeros(True))
    report = diff(str(a), str(b), DiffOptions(keep_equal=True))
    assert report.equal and not report.changed
    for name in (EMBED, "lm_head.weight"):
        found = next(d for d in report.equal_tensors if d.name == name)
        assert not found.identical, name
        assert (found.mismatched, found.nonfinite_mismatched, found.max_abs_diff, found.rel_l2) == (0, 0, 0.0, 0.0)
    same_document(report, whole_report(monkeypatch, a, b, DiffOptions(keep_equal=True)))


# --- the engine against the former torch implementation -----------------------------------------------------


def torch_reference(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> tuple[float, float, int, int]:
    """`compare_values` as it was written on torch, in one block: (max_abs_diff, rel_l2, mismatched,
    nonfinite_mismatched)."""
    x, y = a.reshape(-1), b.reshape(-1)
    floating = any(t.is_floating_point() or t.is_complex() for t in (a, b))
    compute = torch.complex128 if (a.is_complex() or b.is_complex()) else (torch.float64 if floating else torch.int64)
    x, y = x.to(compute), y.to(compute)
    same = x == y
    if floating:
        same |= torch.isnan(x) & torch.isnan(y)
    d = (x - y).abs().to(torch.float64)
    d[same] = 0.0
    finite = torch.isfinite(d)
    bad = int((~finite).sum())
    d = torch.where(finite, d, 0.0)
    ax = torch.where(finite & torch.isfinite(x.abs().double()), x.abs().double(), 0.0)
    ay = torch.where(finite & torch.isfinite(y.abs().double()), y.abs().double(), 0.0)
    norm = math.sqrt(max(float((ax * ax).sum()), float((ay * ay).sum())))
    sq = float((d * d).sum())
    rel = math.sqrt(sq) / norm if norm > 0 else (0.0 if sq == 0 else math.inf)
    top = math.inf if bad else (float(d.max()) if d.numel() else 0.0)
    return top, rel, int((d > atol + rtol * ax).sum()) + bad, bad


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2]
SPECIAL = st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.one_of(st.floats(-300, 300, width=32), SPECIAL), min_size=1, max_size=60),
    st.lists(st.floats(-1, 1, width=32), min_size=1, max_size=60),
    st.sampled_from(DTYPES),
    st.sampled_from(DTYPES),
    st.sampled_from([(0.0, 0.0), (1e-3, 0.0), (0.0, 2**-8), (0.5, 0.1)]),
)
def test_engine_matches_the_torch_reference(
    values: list[float], deltas: list[float], dtype_a: torch.dtype, dtype_b: torch.dtype, tol: tuple[float, float]
) -> None:
    base = torch.tensor(values, dtype=torch.float64)
    a = base.to(dtype_a)
    b = (base + torch.tensor((deltas * len(values))[: len(values)], dtype=torch.float64)).to(dtype_b)
    original = diff_module._BLOCK
    diff_module._BLOCK = 7  # several blocks, the masked and the fast path side by side
    try:
        stats = compare_values(a, b, *tol)
    finally:
        diff_module._BLOCK = original
    top, rel, mismatched, bad = torch_reference(a, b, *tol)
    assert (stats.mismatched, stats.nonfinite_mismatched) == (mismatched, bad)
    assert stats.max_abs_diff == top
    assert stats.rel_l2 == pytest.approx(rel, rel=1e-12, abs=1e-300)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (torch.tensor([1, -2, 3], dtype=torch.int8), torch.tensor([1, 2, 3], dtype=torch.int64)),
        (torch.tensor([True, False]), torch.tensor([True, True])),
        (torch.tensor([1 + 2j, math.nan]), torch.tensor([1 + 1j, complex(math.nan, 1)])),
        (torch.tensor([0, 40000, 65535], dtype=torch.uint16), torch.tensor([1.0, 40000.0, -1.0])),
    ],
)
def test_integers_bools_and_complex_match_the_torch_reference(a: torch.Tensor, b: torch.Tensor) -> None:
    stats = compare_values(a, b, 0.5, 0.0)
    top, rel, mismatched, bad = torch_reference(a, b, 0.5, 0.0)
    assert (stats.max_abs_diff, stats.mismatched, stats.nonfinite_mismatched) == (top, mismatched, bad)
    assert stats.rel_l2 == pytest.approx(rel, rel=1e-12)


def test_bf16_and_float8_decode_exactly() -> None:
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    decoded = tensor_stats.decode(tensor_stats.raw_from_tensor(bits), "bfloat16", np.dtype(np.float64))
    np.testing.assert_array_equal(decoded, bits.double().numpy())
    for dtype in ("float8_e4m3fn", "float8_e5m2"):
        values = torch.arange(256, dtype=torch.uint8).view(getattr(torch, dtype))
        decoded = tensor_stats.decode(tensor_stats.raw_from_tensor(values), dtype, np.dtype(np.float64))
        np.testing.assert_array_equal(decoded, values.double().numpy())


FLOATS = ["float64", "float32", "float16", "bfloat16"]


def stored(values: np.ndarray, dtype: str) -> np.ndarray:
    """`values` rounded to `dtype`, as `raw_from_bytes` gives its stored elements (bfloat16 as bit patterns)."""
    return tensor_stats.raw_from_tensor(torch.from_numpy(values).to(getattr(torch, dtype)))


@settings(max_examples=80, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.sampled_from([1, 7, 4095, 4096, 4097, 3 * 4096 + 5]),
    st.sampled_from(FLOATS),
    st.sampled_from(FLOATS),
    st.sampled_from([0.02, 1e-30, 2.0**-140, 1e30]),  # subnormal in fp32/bf16 at 2**-140, over fp16 at 1e30
    st.booleans(),
    st.lists(st.tuples(st.integers(0, 2**16), st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.0])), max_size=4),
    st.sampled_from([(0.0, 0.0), (1e-3, 0.0), (0.0, 2**-8), (0.5, 0.1)]),
)
def test_the_statistics_of_any_float_mix_are_those_of_its_float64_values_to_the_last_bit(
    seed: int,
    n: int,
    dtype_a: str,
    dtype_b: str,
    scale: float,
    gaps: bool,
    special: list[tuple[int, float]],
    tol: tuple[float, float],
) -> None:
    """Each side is decoded exactly, so a block of bf16 against fp32 (or any other mix) gives the numbers that
    the same values given as float64 give, bit for bit: NaN, infinities, -0.0, subnormals, exponents far apart
    (where a difference is not exact even in float64, it is rounded once, the same way), several rows."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(n) * scale
    if gaps:
        a *= 2.0 ** rng.integers(-60, 60, n)
    b = a + rng.standard_normal(n) * scale * rng.choice([0.0, 2**-9, 1.0])
    for index, value in special:
        (a if index % 2 else b)[index % n] = value
    raw_a, raw_b = stored(a, dtype_a), stored(b, dtype_b)
    wide_a, wide_b = (
        torch.from_numpy(values).to(getattr(torch, dtype)).double().numpy()
        for values, dtype in ((a, dtype_a), (b, dtype_b))
    )
    found = tensor_stats.compare_block(raw_a, dtype_a, raw_b, dtype_b, *tol)
    assert found == tensor_stats.compare_block(wide_a, "float64", wide_b, "float64", *tol)
    assert tensor_stats.norms_block(raw_b, dtype_b) == tensor_stats.norms_block(wide_b, "float64")
    assert all(math.isfinite(number) for number in found[:4])


# --- what a streamed comparison costs --------------------------------------------------------------------


def test_a_streamed_comparison_does_not_import_torch(hf_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """Reading safetensors raw needs numpy only: a comparison of large tensors starts without torch's
    second or two of imports, nor ml_dtypes' half second (bf16 against fp32 here)."""
    cast = write_changed(hf_model_dirs["single"], tmp_path / "bf16", bf16_cast)
    script = (
        "import json, sys\n"
        "import ckptctl.ops.diff as d\n"
        f"d._BLOCK, d._READ_BLOCK = {BLOCK}, {READ_BLOCK}\n"
        "r = d.diff(sys.argv[1], sys.argv[2], d.DiffOptions(ignore_dtype=True, rtol=2**-8))\n"
        "print(json.dumps({'equal': r.equal, 'torch': 'torch' in sys.modules, 'ml_dtypes': 'ml_dtypes' in sys.modules}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(hf_model_dirs["single"]), str(cast)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert json.loads(proc.stdout) == {"equal": True, "torch": False, "ml_dtypes": False}
