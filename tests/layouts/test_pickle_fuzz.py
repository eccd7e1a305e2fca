"""Bit flips in real torch.save files (DeepSpeed rank files, HF Trainer pickles): only ckptctl errors escape."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptctl.errors import CkptctlError
from ckptctl.formats.torch_pickle import load_tensor, open_torch_pickle, storage_problems
from tests.writers.deepspeed_writer import WrittenDeepSpeed
from tests.writers.trainer_writer import WrittenTrainerRun


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_bit_flips_of_real_files(
    deepspeed_runs: dict[int, WrittenDeepSpeed], trainer_run: WrittenTrainerRun, tmp_path: Path, data: st.DataObject
) -> None:
    files = sorted(p for run in deepspeed_runs.values() for p in run.latest.iterdir())
    files += sorted(p for p in trainer_run.checkpoints[-1].iterdir() if p.suffix in (".pt", ".pth", ".bin"))
    source = data.draw(st.sampled_from(files))
    blob = bytearray(source.read_bytes())
    for _ in range(data.draw(st.integers(1, 8))):
        # Most flips hit data.pkl (at the start) and the zip directory (at the end): what the reader reads.
        region = data.draw(st.sampled_from(["pickle", "directory", "anywhere"]))
        lo, hi = {"pickle": (0, 6000), "directory": (len(blob) - 3000, len(blob)), "anywhere": (0, len(blob))}[region]
        where = data.draw(st.integers(max(0, lo), min(len(blob), hi) - 1))
        blob[where] ^= 1 << data.draw(st.integers(0, 7))
    if data.draw(st.booleans()):
        blob = blob[: data.draw(st.integers(0, len(blob)))]
    target = tmp_path / source.name
    target.write_bytes(bytes(blob))
    try:
        opened = open_torch_pickle(str(target))
        storage_problems(opened)
        for _, ref in opened.tensors()[:3]:
            opened.byte_range(ref)
            load_tensor(str(target), ref, opened)
    except CkptctlError:
        pass
