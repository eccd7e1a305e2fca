"""verl FSDP1 (`strategy=fsdp`) W -> W' (`ckptctl.frameworks.verl.reshard.WRITER`): verl 0.9.1's own
`FSDPCheckpointManager.load_checkpoint`, with FSDP1 as verl wraps it, loads what the writer made on 1 rank (from
verl's 2-rank save) and on 3 ranks (from verl's 1-rank `NO_SHARD` save: FlatParameters padded), finding the step
through the tracker as `trainer.resume_mode=auto` does, and the state it then holds equals the source's exactly
(`tests.writers.verl_fsdp1_proof`). FSDP1 saves the writer cannot rewrite exactly are refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptctl.errors import CkptctlError
from ckptctl.frameworks.verl.fsdp1 import flat_numels
from ckptctl.frameworks.verl.layout import VerlLayout
from ckptctl.frameworks.verl.reshard import WRITER
from ckptctl.layouts import open_checkpoint
from tests.conftest import build_once
from tests.ops.same_state import assert_same_state
from tests.writers.verl_critic_writer import WrittenVerlCritic
from tests.writers.verl_fsdp1_proof import ROLES, VerlFsdp1Proof, prove_verl_fsdp1_reshard
from tests.writers.verl_writer import STEPS

pytestmark = pytest.mark.slow

LAST = f"global_step_{STEPS[-1]}"


@pytest.fixture(scope="session")
def verl_fsdp1(tmp_path_factory: pytest.TempPathFactory) -> VerlFsdp1Proof:
    return build_once(tmp_path_factory, "verl-fsdp1-reshard", prove_verl_fsdp1_reshard)


def _load(path: Path) -> Any:
    return torch.load(path, weights_only=False)  # written by the proof's own ranks, not a user file


@pytest.mark.parametrize(("loaded", "source"), [("loaded_1", "source_2"), ("loaded_3", "source_1")])
def test_verl_loads_the_resharded_fsdp1_state_equal_to_the_source(
    verl_fsdp1: VerlFsdp1Proof, loaded: str, source: str
) -> None:
    got, want = _load(verl_fsdp1.states[loaded]), _load(verl_fsdp1.states[source])
    assert list(got) == list(want) == list(ROLES)
    for role in ROLES:
        assert got[role]["model"] and got[role]["optim"]["state"]
        assert_same_state(got[role], want[role], role)


def test_resume_mode_auto_finds_the_written_step(verl_fsdp1: VerlFsdp1Proof) -> None:
    assert verl_fsdp1.found == {
        "loaded_1": str(verl_fsdp1.resharded[1] / LAST),
        "loaded_3": str(verl_fsdp1.resharded[3] / LAST),
    }


def test_the_sources_are_verls_fsdp1_saves_and_the_outputs_fsdp1_rank_files(verl_fsdp1: VerlFsdp1Proof) -> None:
    for world, folder in (*verl_fsdp1.runs.items(), *verl_fsdp1.resharded.items()):
        for role in ROLES:
            config = json.loads((folder / LAST / role / "fsdp_config.json").read_text())
            assert config == {"FSDP_version": 1, "world_size": world}
            # The optimizer is FSDP1's over FlatParameters: the root unit and one per decoder layer, each rank
            # holding ceil(N / W) elements of each.
            optim = _load(folder / LAST / role / f"optim_world_size_{world}_rank_{world - 1}.pt")
            assert sorted(optim["state"]) == [0, 1, 2]
            # embed_tokens, norm, then lm_head (actor) or the value head's weight and bias (critic).
            root = 128 * 32 + 32 + (128 * 32 if role == "actor" else 32 + 1)
            assert optim["state"][0]["exp_avg"].shape == (-(-root // world),)
        written = verl_fsdp1.written.get(world)
        if written is not None:
            assert written.files[-1] == "latest_checkpointed_iteration.txt"
            checkpoint = open_checkpoint(str(folder / LAST))
            assert checkpoint.world_size == world
            assert VerlLayout().verify(checkpoint) == []


def test_fsdp1_padding_is_zeros_after_the_flat_parameters_end(verl_fsdp1: VerlFsdp1Proof) -> None:
    # The actor's root FlatParameter: 8224 elements, 2742 per rank on 3: rank 2 ends with 2 elements of padding.
    optim = _load(verl_fsdp1.resharded[3] / LAST / "actor" / "optim_world_size_3_rank_2.pt")
    source = _load(verl_fsdp1.runs[1] / LAST / "actor" / "optim_world_size_1_rank_0.pt")
    for key in ("exp_avg", "exp_avg_sq"):
        piece = optim["state"][0][key]
        assert piece.shape == (2742,)
        assert torch.equal(piece[:-2], source["state"][0][key][2 * 2742 :])
        assert torch.equal(piece[-2:], torch.zeros(2))


def _toy(embed: int) -> list[tuple[str, int]]:
    layer = [("w", 4), ("b", 1)]
    return [("embed.weight", embed), *((f"layers.{i}.{n}", k) for i in (0, 1) for n, k in layer), ("head.w", embed)]


def test_the_flat_parameters_lengths_are_told_by_the_names_or_refused() -> None:
    # Root (embed + head) and one unit per layer: 16, 5, 5 elements; on 2 ranks 8, 3, 3 per rank.
    assert flat_numels(_toy(8), [8, 3, 3], 2) == (16, 5, 5)
    assert flat_numels(_toy(8), [16, 5, 5], 1) == (16, 5, 5)
    with pytest.raises(CkptctlError, match="no FSDP wrapping"):
        flat_numels(_toy(8), [8, 4, 3], 2)
    # With 6-element embeddings, (12, 5, 5) (a unit per layer) and (11, 6, 5) (units of the embeddings and the
    # first layer) both give 6, 3, 3 per rank: which elements are padding is not known, so it is refused.
    with pytest.raises(CkptctlError, match="different lengths"):
        flat_numels(_toy(6), [6, 3, 3], 2)


def test_fsdp1_with_use_orig_params_is_refused_by_name(verl_critic: WrittenVerlCritic, tmp_path: Path) -> None:
    # verl's FSDP1 critic saved with use_orig_params=True: one optimizer state per original parameter, cut where
    # FSDP1's aligned FlatParameter puts each rank's boundary.
    run = tmp_path / "run"
    shutil.copytree(verl_critic.run, run)
    refused = WRITER.refusal(open_checkpoint(str(run / "global_step_1")), 1)
    assert refused is not None and "use_orig_params" in refused
