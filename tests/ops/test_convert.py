"""`convert`: real FSDP2 DCP saves, native checkpoints and HF folders, checked against references and transformers."""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from ckptctl.checkpoint import Component
from ckptctl.errors import CkptctlError
from ckptctl.formats.chunks import read_tensor
from ckptctl.formats.digest import file_digest
from ckptctl.formats.manifest import DIGESTS_NAME
from ckptctl.formats.raw_chunks import row_major_runs
from ckptctl.formats.safetensors import read_header, write_file
from ckptctl.formats.safetensors_stream import (
    BufferSource,
    RangeSource,
    StreamCopier,
    plan_shards,
    shard_file_names,
)
from ckptctl.layouts import open_checkpoint
from ckptctl.ops import commit
from ckptctl.ops.convert import ConvertOptions, Target, convert, parse_dtype, to_dcp
from ckptctl.ops.naming import parse_rename
from ckptctl.ops.verification import verify_checkpoint
from ckptctl.units import parse_size
from tests.conftest import CliResult, build_once, tiny_llama
from tests.writers.dcp_writer import write_single_process_dcp
from tests.writers.llama_dcp_writer import WrittenLlamaDcp, write_llama_fsdp_dcp

Cli = Callable[..., CliResult]
#: For sources that are no transformers model and carry no config (the demo's toy model, raw DCP saves): the
#: tensors are written under their stored names, as asked (without it such an HF output is refused).
RAW_NAMES = ConvertOptions(mapping="none")


@pytest.fixture(scope="session")
def llama_dcp(tmp_path_factory: pytest.TempPathFactory) -> WrittenLlamaDcp:
    """A tiny Llama trained one step on 2 FSDP2 ranks and saved with dcp.save (see the writer)."""
    return build_once(tmp_path_factory, "llama-dcp", write_llama_fsdp_dcp)


def _hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def _load_pretrained(folder: Path, **kwargs: Any) -> Any:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True, **kwargs)
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info.get("mismatched_keys"), info
    return model


def _assert_equal_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


# --- DCP (2-rank FSDP2) -> HF ----------------------------------------------------------------------


def test_fsdp2_dcp_to_hf_loads_in_transformers_and_equals_the_full_state_dict(
    llama_dcp: WrittenLlamaDcp, tmp_path: Path
) -> None:
    dst = tmp_path / "hf"
    result = convert(str(llama_dcp.path), str(dst), ConvertOptions(reread=True))
    reference = llama_dcp.reference_tensors()

    assert result.to == "hf" and result.layout == "dcp"
    assert result.tensors == len(reference)
    assert result.bytes == sum(t.numel() * t.element_size() for t in reference.values())
    assert result.streamed == result.tensors and result.assembled == 0  # every FSDP2 shard is a byte copy
    assert set(result.copied) == {"config.json", "generation_config.json"}  # found in the run folder
    assert sorted(os.listdir(dst)) == list(result.files)
    assert set(result.files) == {"model.safetensors", "config.json", "generation_config.json", DIGESTS_NAME}

    _assert_equal_tensors(_hf_tensors(dst), reference)
    model = _load_pretrained(dst)
    _assert_equal_tensors({k: v.detach() for k, v in model.state_dict().items()}, reference)

    verified = verify_checkpoint(str(dst))
    assert verified.ok and verified.digests_checked == len(result.files) - 1, verified


def test_a_step_without_its_config_is_refused_and_converts_with_config_given(
    llama_dcp: WrittenLlamaDcp, hf_model_dirs: dict[str, Path], tmp_path: Path, run_cli: Cli
) -> None:
    """The Llama step copied away from its run folder has no config.json beside it: nothing proves its names are
    transformers', so `--to hf` is refused before writing (exit 2, naming --config and --mapping); given the
    model's config with `--config` (save_pretrained's, which names the architecture), the output is checked
    against LlamaForCausalLM and from_pretrained loads it whole."""
    alone = tmp_path / "copied" / "step-1"
    shutil.copytree(llama_dcp.path, alone)
    dst = tmp_path / "hf"
    refused = run_cli("convert", alone, dst, "--json")
    assert refused.exit_code == 2, refused.stderr
    assert refused.json["error"]["type"] == "UnprovedModel"
    assert "--config PATH" in refused.json["error"]["hint"] and "--mapping none" in refused.json["error"]["hint"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copied"]  # nothing at DST, no staging folder

    done = run_cli("convert", alone, dst, "--config", hf_model_dirs["single"], "--json")
    assert done.exit_code == 0, done.stderr
    assert done.json["model_check"]["architecture"] == "LlamaForCausalLM" and done.json["mapping"] is None
    reference = llama_dcp.reference_tensors()
    model = _load_pretrained(dst)
    _assert_equal_tensors({k: v.detach() for k, v in model.state_dict().items()}, reference)


def test_fsdp2_dcp_to_hf_in_bfloat16(llama_dcp: WrittenLlamaDcp, tmp_path: Path) -> None:
    dst = tmp_path / "hf-bf16"
    result = convert(str(llama_dcp.path), str(dst), ConvertOptions(dtype="bfloat16"))
    assert result.dtype == "bfloat16" and result.streamed == result.tensors  # cast while streaming
    want = {k: v.to(torch.bfloat16) for k, v in llama_dcp.reference_tensors().items()}
    _assert_equal_tensors(_hf_tensors(dst), want)
    config = json.loads((dst / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    model = _load_pretrained(dst)
    assert next(model.parameters()).dtype == torch.bfloat16
    _assert_equal_tensors({k: v.detach() for k, v in model.state_dict().items()}, want)


def test_fsdp2_dcp_to_sharded_hf(llama_dcp: WrittenLlamaDcp, tmp_path: Path) -> None:
    dst = tmp_path / "hf-sharded"
    result = convert(str(llama_dcp.path), str(dst), ConvertOptions(max_shard_size=parse_size("20KB")))
    shards = sorted(f for f in result.files if f.endswith(".safetensors"))
    assert len(shards) >= 4
    assert shards == shard_file_names(len(shards))
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    reference = llama_dcp.reference_tensors()
    assert set(index["weight_map"]) == set(reference)
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == result.bytes
    for shard in shards:
        header = read_header(str(dst / shard))
        names = {t.name for t in header.tensors}
        assert names == {n for n, f in index["weight_map"].items() if f == shard}
        data_bytes = sum(t.end - t.begin for t in header.tensors)
        assert data_bytes <= 20_000 or len(names) == 1
    _assert_equal_tensors(_hf_tensors(dst), reference)
    _load_pretrained(dst)
    assert verify_checkpoint(str(dst)).ok


def test_other_components_and_renames(llama_dcp: WrittenLlamaDcp, tmp_path: Path) -> None:
    optim = convert(str(llama_dcp.path), str(tmp_path / "optim"), ConvertOptions(component=Component.OPTIMIZER))
    names = set(_hf_tensors(tmp_path / "optim"))
    assert "state.model.embed_tokens.weight.exp_avg" in names and optim.tensors == len(names)

    renamed = tmp_path / "renamed"
    convert(
        str(llama_dcp.path),
        str(renamed),
        ConvertOptions(renames=(parse_rename(r"^model\.=backbone."), parse_rename(r"\.weight$=.w"))),
    )
    names = set(_hf_tensors(renamed))
    assert "backbone.embed_tokens.w" in names and "lm_head.w" in names

    kept = tmp_path / "kept"
    convert(str(llama_dcp.path), str(kept), ConvertOptions(strip_prefix=""))
    assert "model.model.embed_tokens.weight" in _hf_tensors(kept)

    with pytest.raises(CkptctlError, match="would both be written"):
        convert(str(llama_dcp.path), str(tmp_path / "clash"), ConvertOptions(renames=(parse_rename(r".*=same"),)))
    assert not (tmp_path / "clash").exists()


# --- native -> HF ----------------------------------------------------------------------------------


@pytest.mark.parametrize("run", ["native", "distributed"])
def test_native_to_hf_equals_the_model_entry(demo_dir: Path, tmp_path: Path, run: str) -> None:
    src = demo_dir / run / "step-30"
    dst = tmp_path / "hf"
    result = convert(str(src), str(dst), RAW_NAMES)
    checkpoint = open_checkpoint(str(src))
    want = {
        entry.name.removeprefix("model."): read_tensor(str(src), entry) for entry in checkpoint.tensors(Component.MODEL)
    }
    assert result.layout == "native" and result.streamed == len(want) and result.mapping == "none"
    _assert_equal_tensors(_hf_tensors(dst), want)
    assert verify_checkpoint(str(dst)).ok


def test_a_run_folder_converts_the_checkpoint_its_latest_pointer_names(demo_dir: Path, tmp_path: Path) -> None:
    """A folder no layout recognises, where a layout's `latest`-style pointer names a checkpoint inside it
    (ckptctl's own run here, as a DeepSpeed save folder's `latest`), converts that checkpoint."""
    run = demo_dir / "native"
    result = convert(str(run), str(tmp_path / "hf"), RAW_NAMES)
    assert (result.checkpoint, result.layout) == (str(run / (run / "latest").read_text().strip()), "native")
    assert verify_checkpoint(str(tmp_path / "hf")).ok


# --- HF -> DCP -> HF ---------------------------------------------------------------------------------


def test_hf_to_dcp_loads_into_a_model_and_round_trips_bit_exactly(
    hf_model_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed.checkpoint as dcp

    read_back: list[str] = []
    for module in (commit, to_dcp):
        monkeypatch.setattr(module, "file_digest", lambda path: read_back.append(path) or file_digest(path))
    original = _hf_tensors(hf_model_dirs["sharded"])
    dcp_dir = tmp_path / "dcp"
    result = convert(str(hf_model_dirs["sharded"]), str(dcp_dir), ConvertOptions(to=Target.DCP))
    assert result.to == "dcp" and result.tensors == len(original)
    # The data files were hashed as torch's writer wrote them: only side files (config, .metadata) read back.
    assert read_back and not [path for path in read_back if path.endswith(".distcp")]
    assert ".metadata" in result.files and "config.json" in result.copied
    assert verify_checkpoint(str(dcp_dir)).ok

    model = tiny_llama()
    torch.nn.init.zeros_(model.lm_head.weight)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(dcp_dir))
    model.load_state_dict(state["model"])
    reference = torch.load(hf_model_dirs["reference"], weights_only=True)
    _assert_equal_tensors({k: v.detach() for k, v in model.state_dict().items()}, reference)

    back = tmp_path / "hf-again"
    again = convert(str(dcp_dir), str(back))
    assert again.streamed == again.tensors
    _assert_equal_tensors(_hf_tensors(back), original)
    assert (back / "config.json").read_bytes() == (hf_model_dirs["sharded"] / "config.json").read_bytes()
    _load_pretrained(back)


# --- odd tensors: views, dtypes, empty and 0-d, casts -----------------------------------------------


def test_single_process_dcp_with_odd_tensors(tmp_path: Path) -> None:
    written = write_single_process_dcp(tmp_path / "raw")
    reference = written.reference_tensors()
    dst = tmp_path / "hf"
    result = convert(str(written.path), str(dst), RAW_NAMES)
    _assert_equal_tensors(_hf_tensors(dst), reference)  # raw keys: nothing stripped
    assert result.assembled >= 1  # the transposed view is not row-major in its archive

    cast = tmp_path / "hf-fp16"
    convert(str(written.path), str(cast), ConvertOptions(dtype=parse_dtype("fp16"), mapping="none"))
    got = _hf_tensors(cast)
    for name, tensor in reference.items():
        expected = (
            tensor.to(torch.float16) if tensor.dtype in (torch.float32, torch.float64, torch.bfloat16) else tensor
        )
        assert got[name].dtype == expected.dtype and torch.equal(got[name], expected), name


def test_bad_input_leaves_nothing_behind(tmp_path: Path, demo_dir: Path) -> None:
    written = write_single_process_dcp(tmp_path / "raw")
    with pytest.raises(CkptctlError, match="no optimizer tensors"):
        convert(str(written.path), str(tmp_path / "out"), ConvertOptions(component=Component.OPTIMIZER))
    data = sorted(written.path.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:-100])  # truncated: structural verification refuses it
    with pytest.raises(CkptctlError, match="fails structural verification"):
        convert(str(written.path), str(tmp_path / "out"))
    with pytest.raises(CkptctlError, match="contains the source"):
        convert(str(demo_dir / "native" / "step-30"), str(demo_dir / "native"), ConvertOptions(force=True))
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw", "raw.reference.safetensors"]


def test_stale_staging_is_cleaned_and_a_live_one_is_respected(demo_dir: Path, tmp_path: Path) -> None:
    import fcntl

    src = str(demo_dir / "dcp" / "step-30")
    stale = tmp_path / ".hf.ckptctl-convert-999999999"
    (stale / "out").mkdir(parents=True)
    (stale / "lock").touch()
    (stale / "out" / "model.safetensors").write_bytes(b"half")
    convert(src, str(tmp_path / "hf"), RAW_NAMES)
    assert not stale.exists()

    live = tmp_path / ".other.ckptctl-convert-1"
    live.mkdir()
    fd = os.open(live / "lock", os.O_RDWR | os.O_CREAT)
    # flock conflicts between open files, even within one process.
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(CkptctlError, match="another conversion"):
            convert(src, str(tmp_path / "other"), RAW_NAMES)
    finally:
        os.close(fd)
    assert live.exists() and not (tmp_path / "other").exists()


# --- the pieces: size parsing, shard plans, spans, the streaming copier ------------------------------


def test_parse_size_and_dtype() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("20KB") == 20_000
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("1234") == 1234
    for bad in ("", "5XB", "-1", "0", "GB"):
        with pytest.raises(ValueError):
            parse_size(bad, minimum=1)
    assert parse_dtype("bf16") == parse_dtype("BFLOAT16") == "bfloat16"
    with pytest.raises(ValueError):
        parse_dtype("int8")
    assert parse_rename(r"(?=x)a=b") == ("(?=x)a", "b")
    with pytest.raises(ValueError):
        parse_rename("no-equals")


def test_plan_shards_follows_transformers() -> None:
    assert plan_shards([], 10) == [[]]
    assert plan_shards([4, 4, 4], 8) == [[0, 1], [2]]
    assert plan_shards([20, 1, 1], 8) == [[0], [1, 2]]
    assert plan_shards([1, 20, 1], 8) == [[0], [1], [2]]
    assert shard_file_names(1) == ["model.safetensors"]
    assert shard_file_names(2) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


@st.composite
def _boxes(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=4)))
    offsets = tuple(draw(st.integers(0, d - 1)) for d in shape)
    sizes = tuple(draw(st.integers(1, d - o)) for d, o in zip(shape, offsets, strict=True))
    return shape, offsets, sizes


@given(_boxes())
def test_row_major_runs_cover_exactly_the_chunk_in_order(box: tuple[tuple[int, ...], ...]) -> None:
    shape, offsets, sizes = box
    flat = torch.arange(math.prod(shape)).reshape(shape)
    covered = flat[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].reshape(-1).tolist()
    runs = row_major_runs(shape, offsets, sizes)
    assert runs is not None
    assert [i for start, _, count in runs for i in range(start, start + count)] == covered
    assert [first for _, first, _ in runs] == [sum(c for _, _, c in runs[:i]) for i in range(len(runs))]
    if len(runs) > 1:  # as few runs as possible: consecutive runs never touch in the tensor
        assert all(a[0] + a[2] < b[0] for a, b in itertools.pairwise(runs))
    assert row_major_runs(shape, offsets, sizes, limit=len(runs) - 1) is None


def test_tensor_parallel_column_shards_stream_and_scattered_ones_are_assembled(
    llama_dcp: WrittenLlamaDcp, tmp_path: Path
) -> None:
    from safetensors.torch import load_file as load_reference

    dst = tmp_path / "hf"
    result = convert(str(llama_dcp.tp_path), str(dst), ConvertOptions(dtype="bfloat16", mapping="none"))
    reference = load_reference(str(llama_dcp.tp_reference))
    _assert_equal_tensors(_hf_tensors(dst), {k: v.to(torch.bfloat16) for k, v in reference.items()})
    assert (result.streamed, result.assembled) == (2, 1)  # "last" has 20-byte runs: assembled


@pytest.mark.parametrize("piece", [None, 36])
@pytest.mark.parametrize("where", ["disk", "tmpfs", "buffered"])
def test_stream_copier_with_small_blocks_casts_and_hashes(
    tmp_path: Path, where: str, piece: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks of 4 KiB after a 5-byte header: converted elements straddle block boundaries (and, with
    36-byte cast pieces, piece boundaries inside a block). On disk the blocks go out with O_DIRECT; tmpfs
    refuses O_DIRECT and gets buffered writes."""
    import blake3

    from ckptctl.formats import safetensors_stream

    if piece is not None:
        monkeypatch.setattr(safetensors_stream, "CAST_PIECE_BYTES", piece)

    out_dir = tmp_path
    if where == "tmpfs":
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm")
        out_dir = Path(tempfile.mkdtemp(dir="/dev/shm"))
    source = torch.randn(1000, 3)
    src = tmp_path / "src.safetensors"
    write_file(str(src), {"x": source, "y": source[:10].to(torch.bfloat16)})
    header = read_header(str(src))
    x, y = (next(t for t in header.tensors if t.name == n) for n in ("x", "y"))
    out = out_dir / "out.bin"
    seen: list[int] = []
    try:
        with StreamCopier(workers=3, block_bytes=4096, on_bytes=seen.append, direct=where != "buffered") as copier:
            written = copier.write_file(
                str(out),
                b"HEADX",
                [
                    RangeSource(str(src), x.begin, x.end - x.begin, "float32", "bfloat16"),
                    RangeSource(str(src), y.begin, y.end - y.begin, "bfloat16", "float32"),
                    BufferSource(lambda: b"assembled", 9),
                    RangeSource(str(src), x.begin, 1200, "float32", "float32"),
                ],
            )
            reread = copier.digest(str(out))
        data = out.read_bytes()
    finally:
        if where == "tmpfs":
            shutil.rmtree(out_dir)
    expected = (
        b"HEADX"
        + source.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
        + source[:10].to(torch.bfloat16).float().view(torch.uint8).numpy().tobytes()
        + b"assembled"
        + source.reshape(-1)[:300].numpy().tobytes()
    )
    assert data == expected
    assert written.size == len(expected) and written.blake3 == blake3.blake3(expected).hexdigest()
    assert reread == written.blake3
    assert len(seen) > 3 and sum(seen) >= 2 * len(expected)  # written, then read back


def test_remote_source_through_fsspec(hf_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    for path in hf_model_dirs["sharded"].iterdir():
        fs.pipe_file(f"/convert-src/{path.name}", path.read_bytes())
    try:
        result = convert("memory://convert-src", str(tmp_path / "hf"), ConvertOptions(dtype="bfloat16"))
    finally:
        fs.rm("/convert-src", recursive=True)
    assert "config.json" in result.copied
    want = {k: v.to(torch.bfloat16) for k, v in _hf_tensors(hf_model_dirs["sharded"]).items()}
    _assert_equal_tensors(_hf_tensors(tmp_path / "hf"), want)


def test_off_a_known_local_file_system_sources_are_read_not_mapped_and_give_the_same_results(
    hf_model_dirs: dict[str, Path], demo_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On NFS, Lustre or FUSE a page the storage fails to bring in under a map is a SIGBUS that kills the
    command with no message: there `convert --to dcp`, `diff` and the DCP archive reader read instead, with
    the same results as the mapped path a local disk takes."""
    import mmap

    from ckptctl.io import local
    from ckptctl.ops.diff import DiffOptions, diff

    maps: list[int] = []

    class CountedMmap(mmap.mmap):
        def __new__(cls, *args: Any, **kwargs: Any) -> CountedMmap:
            maps.append(args[1])
            return super().__new__(cls, *args, **kwargs)

    monkeypatch.setattr(mmap, "mmap", CountedMmap)  # the one mmap module, as diff, raw_chunks and to_dcp use it
    big = tmp_path / "big"  # one tensor above the archive reader's whole-read size, so that it would map
    big.mkdir()
    save_file({"w": torch.arange(300_000, dtype=torch.float32)}, str(big / "model.safetensors"))
    (big / "config.json").write_text("{}")

    def run(name: str) -> tuple[bytes, Any, Any]:
        out = tmp_path / name
        convert(str(hf_model_dirs["sharded"]), str(out / "dcp"), ConvertOptions(to=Target.DCP))
        convert(str(big), str(out / "big-dcp"), ConvertOptions(to=Target.DCP))
        data = b"".join(p.read_bytes() for p in sorted((out / "dcp").glob("*.distcp")))
        steps = diff(str(demo_dir / "native" / "step-20"), str(demo_dir / "native" / "step-30"), DiffOptions())
        archives = diff(str(big), str(out / "big-dcp"), DiffOptions())
        return data, _values(steps.to_json()), _values(archives.to_json())

    local_disk = run("local")
    fd = os.open(big / "model.safetensors", os.O_RDONLY)
    try:
        assert maps or not local.maps_safely(fd)  # where this disk is known local, the mapped path ran
    finally:
        os.close(fd)
    maps.clear()
    monkeypatch.setattr(local, "fs_type", lambda fd: 0x6969)  # NFS_SUPER_MAGIC
    monkeypatch.setattr(local, "_MAPS_SAFELY", {})
    network = run("nfs")
    assert maps == []
    assert network == local_disk


def _values(report: dict[str, Any]) -> dict[str, Any]:
    """What a diff found, without the paths it was given and its count of bytes read (a mapped block counts
    what it covers, a read what the read returned: a few KiB apart over a run's headers)."""
    return {k: v for k, v in report.items() if k not in ("a", "b", "seconds", "bytes_read")}
