"""The DCP layout on checkpoints written by torch: FSDP2 on 2 ranks and a plain single-process save."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptctl import io
from ckptctl.checkpoint import CheckpointState, Component, ProblemKind
from ckptctl.errors import CheckpointInProgress, CorruptCheckpoint, UnsafePickle
from ckptctl.families.dcp_folder import component_classifier, dcp_tensor_index, verify_dcp
from ckptctl.formats.chunks import read_tensor
from ckptctl.formats.torch_save import raw_record
from ckptctl.frameworks.dcp.layout import DcpLayout
from ckptctl.layouts import detect
from tests.writers.dcp_writer import WrittenDcp

LAYOUT = DcpLayout()


def _kinds(url: Path) -> dict[str, str]:
    problems = verify_dcp(str(url))
    return {p.kind: p.severity for p in problems}


def test_identify_from_the_listing(fsdp_dcp: WrittenDcp) -> None:
    url = str(fsdp_dcp.path)
    ref = LAYOUT.identify(url, io.list_dir(url))
    assert ref is not None
    assert ref.layout == "dcp" and ref.step == 3 and ref.state is CheckpointState.COMPLETE
    assert ref.size_bytes == sum(p.stat().st_size for p in fsdp_dcp.path.iterdir())
    assert ref.created is not None
    assert ref.created.timestamp() == pytest.approx((fsdp_dcp.path / ".metadata").stat().st_mtime)
    assert LAYOUT.latest_pointer(url, io.list_dir(url)) is None
    assert detect(url)[0].name == "dcp"


def test_identify_ignores_other_folders(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"x")
    assert LAYOUT.identify(str(tmp_path), io.list_dir(str(tmp_path))) is None


def test_open_index_and_verify_read_only_metadata_and_need_no_torch(fsdp_dcp: WrittenDcp) -> None:
    # A fresh process (nothing cached) in which any `import torch` fails.
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from ckptctl import io\n"
        "from ckptctl.frameworks.dcp.layout import DcpLayout\n"
        f"checkpoint = DcpLayout().open({str(fsdp_dcp.path)!r})\n"
        "entries = checkpoint.tensor_index()\n"
        "problems = DcpLayout().verify(checkpoint)\n"
        "print(io.READ_STATS.bytes_read, len(entries), len(problems))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    bytes_read, entries, problems = map(int, out.stdout.split())
    # `.metadata`, plus the non-tensor items (optimizer hyperparameters): verify reads them through the
    # allowlisting reader, since torch DCP would unpickle them with weights_only=False on resume.
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = FileSystemReader(str(fsdp_dcp.path)).read_metadata()
    bytes_items = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    item_bytes = sum(info.length for index, info in metadata.storage_data.items() if index.fqn in bytes_items)
    assert bytes_items and item_bytes < 100_000
    # `open` reads the loop's counters (`trainer_state.step`) for resume-plan, verify every item again.
    counters = sum(info.length for index, info in metadata.storage_data.items() if index.fqn == "trainer_state.step")
    assert bytes_read == (fsdp_dcp.path / ".metadata").stat().st_size + item_bytes + counters
    assert entries == len(fsdp_dcp.reference_tensors()) and problems == 0


def test_open_reports_components_world_size_and_metadata(fsdp_dcp: WrittenDcp) -> None:
    checkpoint = LAYOUT.open(str(fsdp_dcp.path))
    index = checkpoint.tensor_index()
    assert checkpoint.components == {Component.MODEL, Component.OPTIMIZER, Component.TRAINER_STATE}
    assert checkpoint.world_size == 2
    assert checkpoint.metadata["dcp_version"] == "1.0.0"
    assert checkpoint.metadata["bytes_items"] == len(fsdp_dcp.non_tensor_keys)
    assert checkpoint.metadata["keys"] == len(index) + len(fsdp_dcp.non_tensor_keys)


def test_tensor_index_matches_the_gathered_state(fsdp_dcp: WrittenDcp) -> None:
    reference = fsdp_dcp.reference_tensors()
    checkpoint = LAYOUT.open(str(fsdp_dcp.path))
    index = {e.name: e for e in checkpoint.tensor_index()}
    assert set(index) == set(reference)
    for name, entry in index.items():
        assert entry.dtype == str(reference[name].dtype).removeprefix("torch."), name
        assert entry.shape == tuple(reference[name].shape), name
        assert entry.component == (Component.MODEL if name.startswith("model.") else Component.OPTIMIZER)
    sharded = [e for e in index.values() if len(e.chunks) == 2]
    assert {e.name for e in sharded} >= {"model.embed.weight", "model.head.weight", "model.gate.weight"}
    params = sum(e.numel for e in checkpoint.tensors(Component.MODEL) if e.name != "model.counter")
    assert params == fsdp_dcp.model_parameters


def test_read_tensor_equals_the_reference_exactly(fsdp_dcp: WrittenDcp) -> None:
    reference = fsdp_dcp.reference_tensors()
    checkpoint = LAYOUT.open(str(fsdp_dcp.path))
    for entry in checkpoint.tensor_index():
        tensor = read_tensor(checkpoint.url, entry)
        assert tensor.dtype == reference[entry.name].dtype, entry.name
        assert torch.equal(tensor, reference[entry.name]), entry.name


def test_every_fsdp_chunk_is_a_plain_byte_range(fsdp_dcp: WrittenDcp) -> None:
    # What a streaming convert relies on: each item's tensor bytes sit in one range of its .distcp file.
    reference = fsdp_dcp.reference_tensors()
    for entry in LAYOUT.open(str(fsdp_dcp.path)).tensor_index():
        for chunk in entry.chunks:
            blob = io.read_bytes(str(fsdp_dcp.path / chunk.file), chunk.byte_offset, chunk.byte_length)
            found = raw_record(blob, entry.name)
            assert found is not None, entry.name
            region = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))
            want = reference[entry.name][region].contiguous()
            assert found[1] - found[0] == want.numel() * want.element_size()
            if want.numel():
                got = torch.frombuffer(bytearray(blob[found[0] : found[1]]), dtype=want.dtype).reshape(want.shape)
                assert torch.equal(got, want), entry.name


def test_raw_single_process_save(raw_dcp: WrittenDcp) -> None:
    checkpoint = LAYOUT.open(str(raw_dcp.path))
    # No recognised prefix at all: a raw model save, and its top-level `step` item a counter (issue 23).
    assert checkpoint.components == {Component.MODEL, Component.TRAINER_STATE}
    assert checkpoint.progress == {"step": 7} and checkpoint.ref.step == 7
    assert checkpoint.world_size == 1
    reference = raw_dcp.reference_tensors()
    for entry in checkpoint.tensor_index():
        assert torch.equal(read_tensor(checkpoint.url, entry), reference[entry.name]), entry.name
    assert LAYOUT.verify(checkpoint) == []


def test_verify_ok(fsdp_dcp: WrittenDcp) -> None:
    assert LAYOUT.verify(LAYOUT.open(str(fsdp_dcp.path))) == []


def test_truncated_shard(fsdp_copy: Path) -> None:
    shard = fsdp_copy / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    problems = verify_dcp(str(fsdp_copy))
    assert [(p.kind, p.path) for p in problems] == [(ProblemKind.TRUNCATED, "__1_0.distcp")]
    entry = next(
        e
        for e in LAYOUT.open(str(fsdp_copy)).tensor_index()
        if any(c.file == "__1_0.distcp" for c in e.chunks)
        and e.chunks[-1].byte_offset + e.chunks[-1].byte_length > shard.stat().st_size
    )
    with pytest.raises(CorruptCheckpoint, match="truncated"):
        read_tensor(str(fsdp_copy), entry)


def test_missing_shard(fsdp_copy: Path) -> None:
    (fsdp_copy / "__0_0.distcp").unlink()
    problems = verify_dcp(str(fsdp_copy))
    assert [(p.kind, p.path) for p in problems] == [(ProblemKind.MISSING_FILE, "__0_0.distcp")]


def test_missing_metadata_is_in_progress(fsdp_copy: Path) -> None:
    (fsdp_copy / ".metadata").unlink()
    ref = LAYOUT.identify(str(fsdp_copy), io.list_dir(str(fsdp_copy)))
    assert ref is not None and ref.state is CheckpointState.IN_PROGRESS
    checkpoint = LAYOUT.open(str(fsdp_copy))
    assert [p.kind for p in LAYOUT.verify(checkpoint)] == [ProblemKind.IN_PROGRESS]
    with pytest.raises(CheckpointInProgress):
        checkpoint.tensor_index()


def test_metadata_being_replaced_is_in_progress(fsdp_copy: Path) -> None:
    shutil.copy(fsdp_copy / ".metadata", fsdp_copy / ".metadata.tmp")
    ref = LAYOUT.identify(str(fsdp_copy), io.list_dir(str(fsdp_copy)))
    assert ref is not None and ref.state is CheckpointState.IN_PROGRESS
    assert _kinds(fsdp_copy) == {ProblemKind.IN_PROGRESS: "error"}


@pytest.mark.parametrize("damage", ["garbage", "flipped", "truncated", "empty"])
def test_unreadable_metadata_is_a_clean_problem(fsdp_copy: Path, damage: str) -> None:
    meta = fsdp_copy / ".metadata"
    data = bytearray(meta.read_bytes())
    if damage == "garbage":
        data = bytearray(os.urandom(len(data)))
    elif damage == "flipped":
        for i in range(0, len(data), 97):
            data[i] ^= 0xFF
    elif damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data = bytearray()
    meta.write_bytes(bytes(data))
    checkpoint = LAYOUT.open(str(fsdp_copy))
    assert checkpoint.ref.state is CheckpointState.BROKEN
    problems = LAYOUT.verify(checkpoint)
    assert [p.kind for p in problems] in ([ProblemKind.BAD_METADATA], [ProblemKind.UNSAFE_PICKLE])
    with pytest.raises(CorruptCheckpoint):
        checkpoint.tensor_index()


class _System:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (self.command,)


def test_hostile_metadata_is_unsafe_and_never_runs(fsdp_copy: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    (fsdp_copy / ".metadata").write_bytes(pickle.dumps(_System(f"touch {marker}")))
    checkpoint = LAYOUT.open(str(fsdp_copy))
    problems = LAYOUT.verify(checkpoint)
    assert [p.kind for p in problems] == [ProblemKind.UNSAFE_PICKLE]
    assert "posix.system" in problems[0].message
    with pytest.raises(UnsafePickle):
        checkpoint.tensor_index()
    assert not marker.exists()


def _rewrite_metadata(folder: Path, edit: object) -> None:
    # The test's own file, written by torch a moment ago: loading it with pickle is fine here.
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    edit(metadata)  # type: ignore[operator]
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def test_chunk_without_storage_record(fsdp_copy: Path) -> None:
    def drop(metadata: object) -> None:
        storage = metadata.storage_data  # type: ignore[attr-defined]
        del storage[next(k for k in storage if k.fqn == "model.embed.weight" and k.offset[0] > 0)]

    _rewrite_metadata(fsdp_copy, drop)
    problems = verify_dcp(str(fsdp_copy))
    assert [(p.kind, p.path) for p in problems] == [(ProblemKind.COVERAGE, "model.embed.weight")]
    entry = next(e for e in LAYOUT.open(str(fsdp_copy)).tensor_index() if e.name == "model.embed.weight")
    with pytest.raises(CorruptCheckpoint, match="cover"):
        read_tensor(str(fsdp_copy), entry)


def test_overlapping_and_out_of_bounds_chunks(fsdp_copy: Path) -> None:
    def damage(metadata: object) -> None:
        sd = metadata.state_dict_metadata  # type: ignore[attr-defined]
        sd["model.l1.weight"].chunks[1].offsets = torch.Size([5, 0])  # overlaps the first, leaves a hole
        sd["model.head.weight"].chunks[1].sizes = torch.Size([9, 12])  # runs past row 5

    _rewrite_metadata(fsdp_copy, damage)
    problems = {(p.kind, p.path) for p in verify_dcp(str(fsdp_copy))}
    assert (ProblemKind.COVERAGE, "model.l1.weight") in problems
    assert (ProblemKind.OUT_OF_BOUNDS, "model.head.weight") in problems


def test_stale_shard_is_a_warning(fsdp_copy: Path) -> None:
    shutil.copy(fsdp_copy / "__1_0.distcp", fsdp_copy / "__2_0.distcp")
    problems = verify_dcp(str(fsdp_copy))
    assert [(p.kind, p.path, p.severity) for p in problems] == [
        (ProblemKind.UNEXPECTED_FILE, "__2_0.distcp", "warning")
    ]
    assert LAYOUT.open(str(fsdp_copy)).world_size == 2


def test_native_style_nesting_uses_the_path_prefix(fsdp_dcp: WrittenDcp, tmp_path: Path) -> None:
    outer = tmp_path / "step-3"
    shutil.copytree(fsdp_dcp.path, outer / "dcp")
    entries = dcp_tensor_index(str(outer / "dcp"), lambda key: Component.EXTRA, path_prefix="dcp/")
    assert all(c.file.startswith("dcp/__") for e in entries for c in e.chunks)
    reference = fsdp_dcp.reference_tensors()
    entry = next(e for e in entries if e.name == "model.embed.weight")
    assert torch.equal(read_tensor(str(outer), entry), reference[entry.name])
    (outer / "dcp" / "__1_0.distcp").unlink()
    assert [(p.kind, p.path) for p in verify_dcp(str(outer / "dcp"), path_prefix="dcp/")] == [
        (ProblemKind.MISSING_FILE, "dcp/__1_0.distcp")
    ]


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        (
            ["model.a", "optim.state.a.exp_avg", "lr_scheduler.last_epoch", "rng_state.cpu", "extra.x"],
            ["model", "optimizer", "scheduler", "rng", "extra"],
        ),
        (["layers.0.w", "embed.weight"], ["model", "model"]),  # dcp.save(model.state_dict())
        (["app.model.w", "app.optim.state.w.step"], ["model", "optimizer"]),  # one wrapper segment
        (["dcp.model.w", "dcp.optim.param_groups.0.lr"], ["model", "optimizer"]),  # AReaL
        (["tok_embeddings.weight", "optimizer.state.x", "train_state"], ["model", "optimizer", "trainer_state"]),
        (
            ["module.w", "sampler.epoch", "dataloader.pos", "trainer_state.step"],
            ["model", "dataloader", "dataloader", "trainer_state"],
        ),
    ],
)
def test_component_classifier(keys: list[str], expected: list[str]) -> None:
    classify = component_classifier(keys)
    assert [classify(k).value for k in keys] == expected


def test_works_through_fsspec_urls(fsdp_dcp: WrittenDcp) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    root = "/ckptctl-test-dcp/step-3"
    try:
        for path in fsdp_dcp.path.iterdir():
            fs.pipe_file(f"{root}/{path.name}", path.read_bytes())
        url = f"memory://{root}"
        checkpoint = LAYOUT.open(url)
        assert checkpoint.ref.state is CheckpointState.COMPLETE and checkpoint.world_size == 2
        assert LAYOUT.verify(checkpoint) == []
        reference = fsdp_dcp.reference_tensors()
        entry = next(e for e in checkpoint.tensor_index() if e.name == "model.embed.weight")
        assert torch.equal(read_tensor(url, entry), reference[entry.name])
    finally:
        fs.rm(root, recursive=True)


class _AcmeStorageInfo:
    """Stands for another library's `_StorageInfo` subclass: the test gives it a module of its own below."""


def _save_with_a_foreign_storage_info(folder: Path, state: dict[str, torch.Tensor]) -> None:
    """`dcp.save` through a FileSystemWriter whose storage records are a subclass of DCP's `_StorageInfo` from a
    library ckptctl was never taught (`acme_storage`), as some storage writers pickle their own."""
    import types

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.storage import WriteResult

    module = types.ModuleType("acme_storage")
    info_class = type("AcmeStorageInfo", (_StorageInfo,), {"__module__": "acme_storage"})
    module.AcmeStorageInfo = info_class  # type: ignore[attr-defined]
    sys.modules["acme_storage"] = module

    class AcmeWriter(dcp.FileSystemWriter):
        def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
            foreign = [
                [WriteResult(r.index, r.size_in_bytes, info_class(**vars(r.storage_data))) for r in rank_results]
                for rank_results in results
            ]
            super().finish(metadata, foreign)

    dcp.save(state, storage_writer=AcmeWriter(str(folder)))


def test_a_foreign_storage_info_subclass_is_read_as_dcp(tmp_path: Path) -> None:
    """Only globals that run code make a pickle unsafe: another library's `_StorageInfo` subclass with DCP's
    fields is read as DCP and its files checked; torch's own `dcp.load` reads the same folder."""
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5)}
    folder = tmp_path / "ckpt"
    try:
        _save_with_a_foreign_storage_info(folder, state)
        assert b"acme_storage" in (folder / ".metadata").read_bytes()
        loaded = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(loaded, checkpoint_id=str(folder))
        assert all(torch.equal(loaded[k], state[k]) for k in state)
    finally:
        sys.modules.pop("acme_storage", None)
    layout, _ = detect(str(folder))
    assert verify_dcp(str(folder)) == []
    assert {e.name for e in layout.open(str(folder)).tensors()} == {"w", "b"}
    for data in folder.glob("*.distcp"):
        data.unlink()
    problems = verify_dcp(str(folder))
    assert problems and all(p.kind == ProblemKind.MISSING_FILE for p in problems)
