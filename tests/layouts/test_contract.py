"""One contract every layout passes (in the manner of fsspec's shared tests).

Each subclass names a real checkpoint written by the real writer, the parameter count its model really
has, the file whose loss must make it not complete, and how to find a data file. The tests: detect,
list (also below a model folder that holds it), inspect totals equal the real parameter count, verify ok,
and verify fails on each corruption kind (a byte flipped in a torch.save zip too: plain verify checks the
CRC-32 torch recorded for each record of every zip the writer wrote, through `Layout.torch_archives`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptctl.checkpoint import CheckpointState, Component, Role
from ckptctl.contract.base import list_files
from ckptctl.errors import UnknownLayout
from ckptctl.layouts import detect, get_layout, open_checkpoint, scan_run
from ckptctl.ops.verification import RunVerifyReport, verify_checkpoint, verify_path
from tests.conftest import CliResult, copy_tree, torch_zip_records
from tests.writers.accelerate_writer import WrittenAccelerate
from tests.writers.areal_writer import WrittenAreal
from tests.writers.bytecheckpoint_writer import WrittenBytecheckpoint
from tests.writers.deepspeed_writer import WrittenDeepSpeed
from tests.writers.distributed_save_writer import WrittenDistributedSaves
from tests.writers.lightning_writer import WrittenLightning
from tests.writers.megatron_writer import WrittenMegatron
from tests.writers.openrlhf_writer import WrittenOpenRlhf
from tests.writers.peft_writer import WrittenPeft
from tests.writers.rl_runs import WrittenFsdpRuns
from tests.writers.torchtitan_writer import WrittenTorchtitan
from tests.writers.trainer_writer import WrittenTrainerRun
from tests.writers.universal_writer import WrittenUniversal
from tests.writers.verl_writer import WrittenVerl


class LayoutContract:
    layout: str
    #: A file whose removal must leave the checkpoint not complete (None: the layout has no marker).
    marker: str | None
    #: Glob of the data files inside the checkpoint.
    data_glob: str

    @pytest.fixture
    def source(self) -> tuple[Path, int]:
        """(checkpoint folder, real parameter count of its model); overridden by each layout."""
        raise NotImplementedError

    @pytest.fixture
    def checkpoint(self, source: tuple[Path, int], tmp_path: Path) -> Path:
        return copy_tree(source[0], tmp_path / "run" / source[0].name)

    def _largest_data_file(self, folder: Path) -> Path:
        files = [p for p in folder.glob(self.data_glob) if p.is_file()]
        assert files, f"no {self.data_glob} in {folder}"
        return max(files, key=lambda p: p.stat().st_size)

    def test_detect(self, checkpoint: Path) -> None:
        layout, ref = detect(str(checkpoint))
        assert layout.name == self.layout
        assert ref.state is CheckpointState.COMPLETE
        assert ref.size_bytes == sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())

    def test_list_finds_it_in_its_run(self, checkpoint: Path) -> None:
        refs = scan_run(str(checkpoint.parent))
        assert [(r.url, r.layout) for r in refs] == [(str(checkpoint), self.layout)]

    def test_a_model_beside_it_is_a_checkpoint_of_its_own(
        self, checkpoint: Path, hf_model_dirs: dict[str, Path]
    ) -> None:
        """The folder holding the checkpoint is also a model folder (a model exported beside the steps):
        both are listed, once each, and each verifies on its own."""
        run = checkpoint.parent
        for model_file in hf_model_dirs["single"].iterdir():
            shutil.copyfile(model_file, run / model_file.name)
        refs = scan_run(str(run))
        assert [(r.url, r.layout, r.holds) for r in refs] == [
            (str(run), "hf", (checkpoint.name,)),
            (str(checkpoint), self.layout, ()),
        ]
        report = verify_path(str(run))
        assert isinstance(report, RunVerifyReport)
        assert [(r.url, r.ok) for r in report.results] == [(str(run), True), (str(checkpoint), True)], report

    def test_inspect_totals_equal_the_real_parameter_count(self, checkpoint: Path, source: tuple[Path, int]) -> None:
        ckpt = open_checkpoint(str(checkpoint))
        assert Component.MODEL in ckpt.components
        assert sum(t.numel for t in ckpt.tensors(Component.MODEL)) == source[1]

    def test_typed_fields_agree_with_what_inspect_shows(self, source: tuple[Path, int]) -> None:
        # Commands decide from the typed fields, `inspect` shows the metadata: a user reads the same facts.
        ckpt = open_checkpoint(str(source[0]))
        meta = ckpt.metadata
        assert dict(ckpt.progress) == dict(meta.get("progress") or {})
        if "metrics" in meta:  # (the Trainer's come from trainer_state.json, which inspect summarises)
            assert dict(ckpt.metrics) == dict(meta["metrics"])
        assert ckpt.rng_keys == (None if meta.get("rng_keys") is None else frozenset(meta["rng_keys"]))
        assert (ckpt.role is Role.EXPORT) == (meta.get("kind") in ("hf_export", "hf_snapshot"))

    def test_verify_ok(self, checkpoint: Path) -> None:
        result = verify_checkpoint(str(checkpoint))
        assert result.ok, result.problems

    def test_every_torch_zip_it_wrote_is_crc_checked(self, source: tuple[Path, int]) -> None:
        folder = source[0]
        checkpoint = open_checkpoint(str(folder))
        covered = {a.file for a in get_layout(self.layout).torch_archives(checkpoint)}
        zips = set()
        for rel in checkpoint.files:
            with open(folder / rel, "rb") as f:
                if f.read(4) == b"PK\x03\x04":  # a torch.save zip, or a DCP file of them
                    zips.add(rel)
        assert zips <= covered

    def test_a_flipped_byte_in_a_torch_zip_fails_plain_verify_naming_the_record(
        self, checkpoint: Path, run_cli: Callable[..., CliResult]
    ) -> None:
        records = torch_zip_records(checkpoint, get_layout(self.layout))
        if not records:
            pytest.skip("the writer wrote no torch.save zip")
        file, member = max(records, key=lambda r: (r[1].size, r[0], r[1].start))  # the largest tensor record
        path = checkpoint / file
        data = bytearray(path.read_bytes())
        data[member.start + member.size // 2] ^= 0x20
        written = path.stat()
        path.write_bytes(bytes(data))
        # Bit rot keeps the file's times (AReaL's slot takes a data file newer than its metadata for an
        # unfinished overwrite).
        os.utime(path, ns=(written.st_atime_ns, written.st_mtime_ns))
        result = run_cli("verify", checkpoint, "--json")
        assert result.exit_code == 1, result.stdout
        assert any(
            p["kind"] == "crc_mismatch" and p["path"] == file and p["record"] == member.name
            for p in result.json["problems"]
        ), result.json["problems"]

    def test_truncated_data_file_fails(self, checkpoint: Path) -> None:
        victim = self._largest_data_file(checkpoint)
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
        assert not verify_checkpoint(str(checkpoint)).ok

    def test_missing_data_file_fails(self, checkpoint: Path) -> None:
        self._largest_data_file(checkpoint).unlink()
        try:
            _, ref = detect(str(checkpoint))
        except UnknownLayout:  # no longer recognisable at all is also a failure the user sees
            return
        assert ref.state is not CheckpointState.COMPLETE or not verify_checkpoint(str(checkpoint)).ok

    def test_missing_marker_is_not_complete(self, checkpoint: Path) -> None:
        if self.marker is None:
            pytest.skip("this layout has no completion marker")
        (checkpoint / self.marker).unlink()
        refs = scan_run(str(checkpoint.parent))
        assert [r.state for r in refs] != [CheckpointState.COMPLETE]

    def test_without_its_completion_markers_it_is_not_complete(self, checkpoint: Path) -> None:
        """What the layout names as completion markers (deleted first by `prune` on object stores, uploaded
        last by `convert`) are files of the checkpoint, include its marker, and without them it does not
        read as complete, as this layout or any other."""
        files = list_files(str(checkpoint))
        markers = get_layout(self.layout).completion_markers(files)
        assert set(markers) <= set(files)
        assert self.marker is None or self.marker in markers
        if not markers:
            pytest.skip("this layout names no completion marker")
        for name in markers:
            (checkpoint / name).unlink()
        refs = scan_run(str(checkpoint.parent))
        assert CheckpointState.COMPLETE not in [r.state for r in refs]


def _demo_parameters() -> int:
    from ckptctl.demo import _model

    return sum(p.numel() for p in _model().parameters())


class TestHfSharded(LayoutContract):
    layout = "hf"
    marker = None
    data_glob = "*.safetensors"

    @pytest.fixture
    def source(self, hf_model_dirs: dict[str, Path]) -> tuple[Path, int]:
        from tests.conftest import tiny_llama

        return hf_model_dirs["sharded"], sum(t.numel() for t in tiny_llama().state_dict().values())


class TestHfSingle(TestHfSharded):
    @pytest.fixture
    def source(self, hf_model_dirs: dict[str, Path]) -> tuple[Path, int]:
        from tests.conftest import tiny_llama

        return hf_model_dirs["single"], sum(t.numel() for t in tiny_llama().state_dict().values())


class TestNativeSingleProcess(LayoutContract):
    layout = "native"
    marker = "ckptctl-manifest.json"
    data_glob = "*.safetensors"

    @pytest.fixture
    def source(self, demo_dir: Path) -> tuple[Path, int]:
        return demo_dir / "native" / "step-30", _demo_parameters()


class TestNativeTwoRanks(LayoutContract):
    layout = "native"
    marker = "ckptctl-manifest.json"
    data_glob = "dcp/*.distcp"

    @pytest.fixture
    def source(self, demo_dir: Path) -> tuple[Path, int]:
        return demo_dir / "distributed" / "step-30", _demo_parameters()


class TestDcp(LayoutContract):
    layout = "dcp"
    marker = ".metadata"
    data_glob = "*.distcp"

    @pytest.fixture
    def source(self, demo_dir: Path) -> tuple[Path, int]:
        return demo_dir / "dcp" / "step-30", _demo_parameters()


class TestTorchtitan(LayoutContract):
    layout = "torchtitan"
    marker = ".metadata"
    data_glob = "*.distcp"

    @pytest.fixture
    def source(self, torchtitan_run: WrittenTorchtitan) -> tuple[Path, int]:
        from tests.writers.torchtitan_writer import model_parameters

        return torchtitan_run.step(2), model_parameters()


class TestDeepSpeedZero0(LayoutContract):
    """Without ZeRO: one model states file holding the weights and the optimizer."""

    layout = "deepspeed"
    marker = None
    data_glob = "*_model_states.pt"

    @pytest.fixture
    def source(self, deepspeed_runs: dict[int, WrittenDeepSpeed]) -> tuple[Path, int]:
        return deepspeed_runs[0].latest, deepspeed_runs[0].model_parameters


class TestDeepSpeedZero2(LayoutContract):
    layout = "deepspeed"
    marker = "mp_rank_00_model_states.pt"
    data_glob = "*_optim_states.pt"

    @pytest.fixture
    def source(self, deepspeed_runs: dict[int, WrittenDeepSpeed]) -> tuple[Path, int]:
        return deepspeed_runs[2].latest, deepspeed_runs[2].model_parameters


class TestDeepSpeedZero3(LayoutContract):
    layout = "deepspeed"
    marker = "zero_pp_rank_0_mp_rank_00_model_states.pt"
    data_glob = "*_optim_states.pt"

    @pytest.fixture
    def source(self, deepspeed_runs: dict[int, WrittenDeepSpeed]) -> tuple[Path, int]:
        return deepspeed_runs[3].latest, deepspeed_runs[3].model_parameters


class TestDeepSpeedUniversalZero2(LayoutContract):
    """`ds_to_universal`'s conversion of a ZeRO-2 tag: a folder per parameter, the model states copied last."""

    layout = "deepspeed_universal"
    marker = "mp_rank_00_model_states.pt"
    data_glob = "zero/*/fp32.pt"

    @pytest.fixture
    def source(self, deepspeed_universal: WrittenUniversal) -> tuple[Path, int]:
        return deepspeed_universal.universal(2), deepspeed_universal.runs[2].model_parameters


class TestDeepSpeedUniversalZero3(LayoutContract):
    """The same of a ZeRO-3 tag: flat states, and the frozen parameter only in the DP ranks' model states."""

    layout = "deepspeed_universal"
    marker = "zero_pp_rank_0_mp_rank_00_model_states.pt"
    data_glob = "zero/*/exp_avg.pt"

    @pytest.fixture
    def source(self, deepspeed_universal: WrittenUniversal) -> tuple[Path, int]:
        return deepspeed_universal.universal(3), deepspeed_universal.runs[3].model_parameters


class TestHfTrainer(LayoutContract):
    layout = "hf_trainer"
    marker = "trainer_state.json"
    data_glob = "*.safetensors"

    @pytest.fixture
    def source(self, trainer_run: WrittenTrainerRun) -> tuple[Path, int]:
        return trainer_run.checkpoints[-1], trainer_run.model_parameters


class TestHfTrainerOptimizer(TestHfTrainer):
    """The same checkpoint, damaged in its largest pickle (optimizer.pt) instead of its weights."""

    data_glob = "*.pt"


class TestPeftAdapter(LayoutContract):
    """A LoRA adapter as PEFT's `save_pretrained` writes it: its model is the adapter's trainable parameters."""

    layout = "peft"
    marker = "adapter_config.json"
    data_glob = "*.safetensors"

    @pytest.fixture
    def source(self, peft_adapters: WrittenPeft) -> tuple[Path, int]:
        return peft_adapters.adapters["rslora"], peft_adapters.trainable["rslora"]


class TestLightningSharded(LayoutContract):
    """A sharded FSDP `.ckpt` folder as Lightning's FSDPStrategy writes it (DCP, then meta.pt). Its `.ckpt` files
    are single files, which this folder contract cannot copy: tests/layouts/test_lightning.py covers them."""

    layout = "lightning"
    marker = "meta.pt"
    data_glob = "*.distcp"

    @pytest.fixture
    def source(self, lightning_run: WrittenLightning) -> tuple[Path, int]:
        return lightning_run.sharded, lightning_run.model_parameters


# --- The RL frameworks' layouts (run folders arranged from real pieces by tests.writers.rl_runs) ---------


class TestOpenRlhfTag(LayoutContract):
    """An actor tag with its metric.json (the evidence that makes it OpenRLHF's, wherever it is copied)."""

    layout = "openrlhf"
    marker = "mp_rank_00_model_states.pt"
    data_glob = "*_optim_states.pt"

    @pytest.fixture
    def source(self, openrlhf_run: Path, deepspeed_runs: dict[int, WrittenDeepSpeed]) -> tuple[Path, int]:
        return openrlhf_run / "_actor" / "global_step4", deepspeed_runs[2].model_parameters


class TestOpenRlhfExport(LayoutContract):
    layout = "openrlhf"
    marker = None
    data_glob = "*.safetensors"

    @pytest.fixture
    def source(self, openrlhf_run: Path, deepspeed_runs: dict[int, WrittenDeepSpeed]) -> tuple[Path, int]:
        return openrlhf_run / "global_step4_hf", deepspeed_runs[2].model_parameters


def _parameters(safetensors_file: Path) -> int:
    from safetensors.torch import load_file

    return sum(t.numel() for t in load_file(str(safetensors_file)).values())


class TestOpenRlhfWrittenActorTag(LayoutContract):
    """An actor tag written by OpenRLHF's own `DeepspeedStrategy.save_ckpt` (tests.writers.openrlhf_writer)."""

    layout = "openrlhf"
    marker = "mp_rank_00_model_states.pt"
    data_glob = "*_optim_states.pt"

    @pytest.fixture
    def source(self, openrlhf_ppo: WrittenOpenRlhf) -> tuple[Path, int]:
        return openrlhf_ppo.actor / openrlhf_ppo.latest, _parameters(openrlhf_ppo.reference)


class TestOpenRlhfWrittenCriticTag(LayoutContract):
    """A critic tag (a Llama body and a value head) written by OpenRLHF's `save_ckpt`."""

    layout = "openrlhf"
    marker = "mp_rank_00_model_states.pt"
    data_glob = "*_optim_states.pt"

    @pytest.fixture
    def source(self, openrlhf_ppo: WrittenOpenRlhf) -> tuple[Path, int]:
        return openrlhf_ppo.critic / openrlhf_ppo.latest, _parameters(
            openrlhf_ppo.critic_output_dir / "model.safetensors"
        )


class TestOpenRlhfWrittenExport(LayoutContract):
    """A `{tag}_hf` export written by OpenRLHF's `save_model` (`--ckpt.save_hf`)."""

    layout = "openrlhf"
    marker = None
    data_glob = "*.safetensors"

    @pytest.fixture
    def source(self, openrlhf_ppo: WrittenOpenRlhf) -> tuple[Path, int]:
        return openrlhf_ppo.ckpt_path / f"{openrlhf_ppo.latest}_hf", _parameters(openrlhf_ppo.reference)


class TestOpenInstructTag(LayoutContract):
    """A tag holding driver_state.pt (the evidence that makes it open-instruct's without its ref_policy/)."""

    layout = "open_instruct"
    marker = "mp_rank_00_model_states.pt"
    data_glob = "*_optim_states.pt"

    @pytest.fixture
    def source(self, open_instruct_run: Path, deepspeed_runs: dict[int, WrittenDeepSpeed]) -> tuple[Path, int]:
        return open_instruct_run / "state" / "global_step4", deepspeed_runs[2].model_parameters

    @pytest.fixture
    def checkpoint(self, source: tuple[Path, int], tmp_path: Path) -> Path:
        copy_tree(source[0].parent / "ref_policy", tmp_path / "run" / "ref_policy")  # shared by the tags
        return copy_tree(source[0], tmp_path / "run" / source[0].name)


class TestArealRecoverSlot(LayoutContract):
    """The recover slot AReaL's RecoverHandler dumped, copied with the `recover_info/` it belongs with (and
    nothing else of the trial)."""

    layout = "areal"
    marker = ".metadata"
    data_glob = "*.distcp"

    @pytest.fixture
    def source(self, areal_run: WrittenAreal) -> tuple[Path, int]:
        return areal_run.slot, areal_run.model_parameters

    @pytest.fixture
    def checkpoint(self, source: tuple[Path, int], tmp_path: Path) -> Path:
        trial = source[0].parent.parent
        copy_tree(trial / "recover_info", tmp_path / "trial" / "recover_info")
        return copy_tree(source[0], tmp_path / "trial" / "default" / "recover_checkpoint")


class TestArealExport(LayoutContract):
    """An HF export AReaL's Saver wrote."""

    layout = "areal"
    marker = None
    data_glob = "*.safetensors"

    @pytest.fixture
    def source(self, areal_run: WrittenAreal) -> tuple[Path, int]:
        return areal_run.export(1), areal_run.model_parameters


class TestVerlStep(LayoutContract):
    """A `global_step_N/` verl's own FSDPCheckpointManager wrote (actor and critic role folders, data.pt)."""

    layout = "verl"
    marker = "actor/fsdp_config.json"
    data_glob = "*/model_world_size_*.pt"

    @pytest.fixture
    def source(self, verl_run: WrittenVerl) -> tuple[Path, int]:
        return verl_run.step(2), verl_run.actor_parameters


class TestBytecheckpointStep(LayoutContract):
    """A `global_step_N/` ByteCheckpoint's own `bcp.save` wrote (FSDP2 on 2 ranks: model, optimizer, extra state)."""

    layout = "bytecheckpoint"
    marker = "model/.metadata"
    data_glob = "*/__*_*.distcp"

    @pytest.fixture
    def source(self, bytecheckpoint_run: WrittenBytecheckpoint) -> tuple[Path, int]:
        return bytecheckpoint_run.step(2), bytecheckpoint_run.model_parameters


class TestRollFsdp2(LayoutContract):
    layout = "roll"
    marker = "pipeline/worker_state_pipeline.json"
    data_glob = "dcp/*.distcp"

    @pytest.fixture
    def source(self, fsdp_runs: WrittenFsdpRuns) -> tuple[Path, int]:
        return fsdp_runs.roll_launch / "checkpoint-1", fsdp_runs.model_parameters


class TestRollMegatron(LayoutContract):
    """Megatron's dist-ckpt variant: the model tensors come from `dist_model/`'s DCP metadata."""

    layout = "roll"
    marker = "pipeline/worker_state_pipeline.json"
    data_glob = "iter_0000001/dist_model/*.distcp"

    @pytest.fixture
    def source(self, roll_megatron: Path, fsdp_runs: WrittenFsdpRuns) -> tuple[Path, int]:
        return roll_megatron / "20250102-080000" / "checkpoint-3", fsdp_runs.model_parameters


class TestMegatron(LayoutContract):
    """An iteration folder of megatron-core's own save (TP 2), with the optimizer and RNG state."""

    layout = "megatron"
    marker = "metadata.json"
    data_glob = "*.distcp"

    @pytest.fixture
    def source(self, megatron_runs: WrittenMegatron) -> tuple[Path, int]:
        return megatron_runs.iteration(2), megatron_runs.parameters


# --- accelerate save_state folders (tests.writers.accelerate_writer: accelerate 1.15's own code) -------


class TestAcceleratePlain(LayoutContract):
    layout = "accelerate"
    marker = "random_states_0.pkl"
    data_glob = "*.safetensors"

    @pytest.fixture
    def source(self, accelerate_runs: WrittenAccelerate) -> tuple[Path, int]:
        return accelerate_runs.plain_checkpoints()[-1], accelerate_runs.model_parameters


class TestAccelerateNamedBin(TestAcceleratePlain):
    """A user-named folder saved with `safe_serialization=False`: the model in `pytorch_model.bin`."""

    data_glob = "pytorch_model.bin"

    @pytest.fixture
    def source(self, accelerate_runs: WrittenAccelerate) -> tuple[Path, int]:
        return accelerate_runs.named, accelerate_runs.model_parameters


class TestAccelerateDeepSpeed(TestAcceleratePlain):
    data_glob = "pytorch_model/*_optim_states.pt"

    @pytest.fixture
    def source(self, accelerate_runs: WrittenAccelerate) -> tuple[Path, int]:
        return accelerate_runs.deepspeed_checkpoints()[-1], accelerate_runs.model_parameters


class TestAccelerateFsdp(TestAcceleratePlain):
    data_glob = "pytorch_model_fsdp_0/*.distcp"

    @pytest.fixture
    def source(self, accelerate_runs: WrittenAccelerate) -> tuple[Path, int]:
        return accelerate_runs.fsdp, accelerate_runs.model_parameters


# --- per-rank saves without a global index (tests.writers.distributed_save_writer) --------------------


class TestHfDistributed(LayoutContract):
    """`save_pretrained(distributed_checkpoint=True)`. Its damage is done to rank 1's file (plan number 1): the
    files record no full shapes, so a folder that lost the LAST rank's files reads as a smaller model that
    tiles (torch's own HuggingFaceStorageReader reads it so too); losing any other rank shows."""

    layout = "hf"
    marker = None
    data_glob = "shard-00001-*.safetensors"

    @pytest.fixture
    def source(self, distributed_saves: WrittenDistributedSaves) -> tuple[Path, int]:
        return distributed_saves.hf, distributed_saves.model_parameters


class TestDcpWithoutCollectives(LayoutContract):
    layout = "dcp"
    marker = "__0.metadata"
    data_glob = "*.distcp"

    @pytest.fixture
    def source(self, distributed_saves: WrittenDistributedSaves) -> tuple[Path, int]:
        return distributed_saves.dcp, distributed_saves.model_parameters
