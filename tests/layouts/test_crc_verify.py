"""Plain `verify` checks the CRC-32 torch recorded for every record of every torch.save zip, on checkpoints
written by torch DCP (2 FSDP2 ranks), DeepSpeed (ZeRO-2), the Hugging Face Trainer and transformers 4's
`pytorch_model.bin` folders and a Lightning `.ckpt` file, none of which has a manifest: a byte flipped in a tensor's bytes fails verify with the file, the zip record and the tensor
named; clean checkpoints pass with every record checked; `--quick` checks the structure only.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckptctl.formats.dcp_folder_metadata import load_dcp_metadata
from ckptctl.formats.torch_pickle import open_torch_pickle
from ckptctl.formats.torch_save import inspect_archive
from ckptctl.formats.torch_zip import archive_members
from ckptctl.layouts import get_layout
from tests.conftest import CliResult, copy_tree, torch_zip_records
from tests.writers.dcp_writer import WrittenDcp
from tests.writers.deepspeed_writer import WrittenDeepSpeed
from tests.writers.hf_legacy_writer import WrittenLegacy
from tests.writers.lightning_writer import WrittenLightning
from tests.writers.trainer_writer import WrittenTrainerRun

Cli = Callable[..., CliResult]
FRAMEWORKS = ("dcp", "deepspeed", "trainer")


@dataclass(frozen=True)
class Damage:
    """A checkpoint with one byte flipped, and what verify must name."""

    checkpoint: Path
    path: str  # the file, relative to the checkpoint
    record: str  # the zip record holding the byte
    entry: str  # the tensor stored in that record


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x20
    path.write_bytes(bytes(data))


def _clean(framework: str, fsdp: WrittenDcp, zero: WrittenDeepSpeed, trainer: WrittenTrainerRun) -> Path:
    if framework == "dcp":
        return fsdp.path
    if framework == "deepspeed":
        return zero.save_dir / zero.tags[-1]
    return trainer.checkpoints[-1]


def _damage_dcp(checkpoint: Path) -> Damage:
    """A byte of the element bytes of one FSDP shard of `model.l1.weight` (an item of a `.distcp` file)."""
    metadata = load_dcp_metadata(str(checkpoint))
    (key, _), record = next((k, r) for k, r in metadata.storage.items() if k[0] == "model.l1.weight")
    file = checkpoint / record.relative_path
    blob = file.read_bytes()[record.offset : record.offset + record.length]
    tensor = inspect_archive(blob, key)
    [member] = [
        m
        for m in archive_members(lambda s, n: blob[s : s + n], len(blob), 0, key).members
        if m.start <= tensor.start < m.start + m.size
    ]
    _flip(file, record.offset + tensor.start + 3)
    return Damage(checkpoint, record.relative_path, member.name, key)


def _damage_torch_file(checkpoint: Path, name: str, pick: Callable[[list[str]], str]) -> Damage:
    """A byte in the middle of one tensor of the torch.save file `name`."""
    opened = open_torch_pickle(str(checkpoint / name))
    tensors = dict(opened.tensors())
    path = pick(list(tensors))
    ref = tensors[path]
    start, end = opened.byte_range(ref)  # type: ignore[misc]
    _flip(checkpoint / name, (start + end) // 2)
    sharing = ", ".join(p for p, r in tensors.items() if r.storage_key == ref.storage_key)  # tied weights
    return Damage(checkpoint, name, f"{opened.prefix}data/{ref.storage_key}", sharing)


@pytest.fixture(params=FRAMEWORKS)
def damaged(
    request: pytest.FixtureRequest,
    fsdp_dcp: WrittenDcp,
    deepspeed_runs: dict[int, WrittenDeepSpeed],
    trainer_run: WrittenTrainerRun,
    tmp_path: Path,
) -> Damage:
    source = _clean(request.param, fsdp_dcp, deepspeed_runs[2], trainer_run)
    checkpoint = copy_tree(source, tmp_path / source.name)
    if request.param == "dcp":
        return _damage_dcp(checkpoint)
    if request.param == "deepspeed":
        # Rank 1's partition of the fp32 master weights (ZeRO-2 `single_partition_of_fp32_groups`).
        optim = next(p.name for p in sorted(checkpoint.glob("*optim_states.pt")) if "rank_1_" in p.name)
        return _damage_torch_file(checkpoint, optim, lambda names: next(n for n in names if "fp32_groups" in n))
    return _damage_torch_file(checkpoint, "optimizer.pt", lambda names: "state.0.exp_avg")


def test_a_flipped_byte_fails_plain_verify_naming_the_record(damaged: Damage, run_cli: Cli) -> None:
    result = run_cli("verify", damaged.checkpoint, "--json")
    assert result.exit_code == 1, result.stdout
    errors = [p for p in result.json["problems"] if p["severity"] == "error"]
    assert [(p["kind"], p["path"], p.get("record"), p.get("entry")) for p in errors] == [
        ("crc_mismatch", damaged.path, damaged.record, damaged.entry)
    ]
    assert damaged.entry in errors[0]["message"] and damaged.record in errors[0]["message"]
    human = run_cli("verify", damaged.checkpoint)
    assert human.exit_code == 1 and "crc_mismatch" in human.stdout


@pytest.mark.parametrize("variant", ["single", "sharded"])
def test_a_flipped_byte_in_a_legacy_bin_is_named(
    legacy_models: WrittenLegacy, tmp_path: Path, run_cli: Cli, variant: str
) -> None:
    """`pytorch_model.bin` folders as transformers 4 wrote them; the sharded one ties `lm_head.weight` to the
    embeddings, which share one storage record: both are named."""
    folder = copy_tree(getattr(legacy_models, variant), tmp_path / variant)
    embeddings = "model.embed_tokens.weight"
    victim = next(
        p for p in sorted(folder.glob("pytorch_model*.bin")) if embeddings in dict(open_torch_pickle(str(p)).tensors())
    )
    damage = _damage_torch_file(folder, victim.name, lambda names: embeddings)
    assert ("lm_head.weight" in damage.entry) == (variant == "sharded")
    result = run_cli("verify", folder, "--json")
    assert result.exit_code == 1, result.stdout
    assert [(p["kind"], p["path"], p.get("record"), p.get("entry")) for p in result.json["problems"]] == [
        ("crc_mismatch", damage.path, damage.record, damage.entry)
    ]


def test_quick_checks_the_structure_only(damaged: Damage, run_cli: Cli) -> None:
    result = run_cli("verify", damaged.checkpoint, "--quick", "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["ok"] is True and result.json["crc_records_checked"] == 0
    assert run_cli("verify", damaged.checkpoint, "--quick", "--deep").exit_code == 2


def _records_in(checkpoint: Path) -> int:
    """Zip records of every torch.save archive of a checkpoint, counted with zipfile."""
    count = 0
    for path in checkpoint.rglob("*"):
        if path.suffix in (".pt", ".pth", ".bin"):
            with zipfile.ZipFile(path) as archive:
                count += len(archive.infolist())
    if (checkpoint / ".metadata").exists():
        for record in load_dcp_metadata(str(checkpoint)).storage.values():
            blob = (checkpoint / record.relative_path).read_bytes()[record.offset : record.offset + record.length]
            with zipfile.ZipFile(io.BytesIO(blob)) as archive:
                count += len(archive.infolist())
    return count


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_clean_checkpoints_pass_with_every_record_checked(
    framework: str,
    fsdp_dcp: WrittenDcp,
    deepspeed_runs: dict[int, WrittenDeepSpeed],
    trainer_run: WrittenTrainerRun,
    run_cli: Cli,
) -> None:
    checkpoint = _clean(framework, fsdp_dcp, deepspeed_runs[2], trainer_run)
    result = run_cli("verify", checkpoint, "--deep", "--check-finite", "--json")
    assert result.exit_code == 0, result.stdout
    assert result.json["digests_checked"] == 0  # no manifest: the CRCs are the content check
    assert result.json["crc_records_checked"] == _records_in(checkpoint) > 0
    assert result.json["tensors_read"] > 0


def test_a_failed_digest_names_the_damaged_record(fsdp_dcp: WrittenDcp, tmp_path: Path, run_cli: Cli) -> None:
    checkpoint = copy_tree(fsdp_dcp.path, tmp_path / "step-3")
    recorded = run_cli("verify", checkpoint, "--write-manifest", "--json")
    assert recorded.exit_code == 0 and recorded.json["wrote_digests"] is True
    checked = run_cli("verify", checkpoint, "--json").json
    assert checked["ok"] and checked["digests_checked"] > 0 and checked["crc_records_checked"] == 0
    damage = _damage_dcp(checkpoint)
    result = run_cli("verify", checkpoint, "--json")
    assert result.exit_code == 1
    assert [(p["kind"], p["path"], p.get("record")) for p in result.json["problems"]] == [
        ("digest_mismatch", damage.path, None),
        ("crc_mismatch", damage.path, damage.record),
    ]


def test_a_flipped_byte_in_a_lightning_ckpt_file_is_named(
    lightning_run: WrittenLightning, tmp_path: Path, run_cli: Cli
) -> None:
    """A `.ckpt` file ModelCheckpoint wrote (one torch.save zip; the layout's file checkpoints, which the
    layout contract's folders do not cover)."""
    victim = tmp_path / "epoch=0-step=4.ckpt"
    victim.write_bytes(lightning_run.step(4).read_bytes())
    clean = run_cli("verify", victim, "--json")
    assert clean.exit_code == 0, clean.stdout
    with zipfile.ZipFile(victim) as archive:
        assert clean.json["layout"] == "lightning" and clean.json["crc_records_checked"] == len(archive.infolist())
    _, member = max(torch_zip_records(victim, get_layout("lightning")), key=lambda r: r[1].size)
    _flip(victim, member.start + member.size // 2)
    result = run_cli("verify", victim, "--json")
    assert result.exit_code == 1, result.stdout
    assert [(p["kind"], p.get("record")) for p in result.json["problems"]] == [("crc_mismatch", member.name)]
