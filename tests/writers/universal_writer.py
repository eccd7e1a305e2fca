"""DeepSpeed universal checkpoints for tests, written by DeepSpeed's own `ds_to_universal`.

`write_universal_runs` copies the session's ZeRO-2 and ZeRO-3 save folders (`deepspeed_writer`), arranges an
open-instruct checkpoint state folder and an OpenRLHF `--ckpt_path` from them (`rl_runs`), and converts, in
one subprocess running `python -m deepspeed.checkpoint.ds_to_universal`'s own `main` and argument parser
(DeepSpeed 0.19.8, on CPU), the tags each framework converts, into the folders each names:

- DeepSpeed (`deepspeed/checkpoint/ds_to_universal.py`): the latest tag `global_step4` into
  `global_step4_universal` beside it. The tags of a plain engine record no `universal_checkpoint_info`, so
  the conversion needs `--inject_missing_state`, as the frameworks below pass it.
- open-instruct (allenai/open-instruct @ e6c3044a, `open_instruct/utils.py`,
  `ensure_universal_checkpoint_exists`, run at start-up by `grpo_utils.py` under
  `--deepspeed_checkpoint_load_universal`): the tag `latest` names into `ds_universal_{tag}` with
  `--inject_missing_state`.
- OpenRLHF (OpenRLHF/OpenRLHF @ 3c3be623, `examples/scripts/ckpt_ds_zero_to_universal.sh`): in `_actor/` and
  `_critic/`, the tag `latest` names into `{tag}_uni` with `--inject_missing_state`.

`ds_to_universal` writes `latest_universal` beside each output folder. One worker per pass
(`--num_extract_workers 1 --num_merge_workers 1`) keeps it from starting a process pool on a small machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.writers.deepspeed_writer import WrittenDeepSpeed
from tests.writers.rl_runs import arrange_open_instruct, arrange_openrlhf

__all__ = ["UNIVERSAL_TAG", "WrittenUniversal", "write_universal_runs"]

#: The folder DeepSpeed's conversion of the latest tag is written to here.
UNIVERSAL_TAG = "global_step4_universal"

_CONVERT = """
import sys
from deepspeed.checkpoint.ds_to_universal import main, parse_arguments

pairs = sys.argv[1:]
for source, output in zip(pairs[::2], pairs[1::2]):
    sys.argv = [
        "ds_to_universal", "--input_folder", source, "--output_folder", output, "--inject_missing_state",
        "--num_extract_workers", "1", "--num_merge_workers", "1",
    ]
    main(parse_arguments())
"""


@dataclass(frozen=True)
class WrittenUniversal:
    """Save folders holding universal checkpoints written by `ds_to_universal` beside the tags they convert.

    Attributes:
        save_dirs: ZeRO stage -> a DeepSpeed save folder (`global_step2`, `global_step4`, `latest`,
            `global_step4_universal`, `latest_universal`).
        open_instruct: open-instruct's checkpoint state folder with `ds_universal_global_step4`.
        openrlhf: OpenRLHF's `--ckpt_path`, with `best_global_step4_uni` in `_actor/` (ZeRO-2) and `_critic/`
            (ZeRO-3).
        runs: the DeepSpeed runs the tags come from (their reference weights and parameter counts).
    """

    save_dirs: dict[int, Path]
    open_instruct: Path
    openrlhf: Path
    runs: dict[int, WrittenDeepSpeed]

    def universal(self, stage: int) -> Path:
        return self.save_dirs[stage] / UNIVERSAL_TAG


def write_universal_runs(root: Path, runs: dict[int, WrittenDeepSpeed], hf_model: Path) -> WrittenUniversal:
    """Copy and arrange the folders under `root`, then convert their tags with `ds_to_universal` (a few
    seconds, mostly DeepSpeed's import); use it from a session-scoped fixture."""
    save_dirs = {stage: Path(shutil.copytree(runs[stage].save_dir, root / f"zero{stage}")) for stage in (2, 3)}
    state = arrange_open_instruct(
        root / "open-instruct" / "state", root / "open-instruct" / "output", runs[2], hf_model
    )
    ckpt = arrange_openrlhf(root / "openrlhf", runs[2], runs[3], hf_model)
    pairs = [(save_dirs[stage] / "global_step4", save_dirs[stage] / UNIVERSAL_TAG) for stage in (2, 3)]
    latest = (state / "latest").read_text().strip()
    pairs.append((state / latest, state / f"ds_universal_{latest}"))
    for role in ("_actor", "_critic"):
        tag = (ckpt / role / "latest").read_text().strip()
        pairs.append((ckpt / role / tag, ckpt / role / f"{tag}_uni"))
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    args = [str(path) for pair in pairs for path in pair]
    done = subprocess.run([sys.executable, "-c", _CONVERT, *args], env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ds_to_universal failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return WrittenUniversal(save_dirs, state, ckpt, runs)
