"""What megatron-core 0.16.1's own load gives the model: the truth for `convert --mapping none` of a dist-ckpt.

One gloo rank on the CPU builds the `GPTModel` that `tests/writers/megatron_writer.py` saved (the local layer
spec its arguments record, `transformer_impl="local"`), with tensor parallelism 1, loads each folder as
Megatron-LM's `load_checkpoint` loads the model (`dist_checkpointing.load({"model": model.sharded_state_dict()},
folder)`, resharding the saved TP 2 parts), puts the result in with `model.load_state_dict` (strict), and writes
the model's `state_dict()` tensors as safetensors: names, shapes and values as the model holds them. It also
writes the local spec's `sharded_state_dict_keys_map` (`spec-keys.json`: without and with multi-latent
attention), the map from the model's names to the saved keys.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from tests.writers.megatron_writer import gpt_model
from tests.writers.ranks import run_ranks

__all__ = ["SPEC_KEYS", "megatron_loaded"]


#: Written beside the loaded states: `{"dense": map, "mla": map}`.
SPEC_KEYS = "spec-keys.json"


def _worker(rank: int, rendezvous: str, cases: list[tuple[str, bool, str]], out: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    # megatron-core's load strategies wait for devices and put their flags on the current one (see the writer).
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=1)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    maps = {
        kind: get_gpt_layer_local_spec(multi_latent_attention=kind == "mla").submodules.sharded_state_dict_keys_map
        for kind in ("dense", "mla")
    }
    Path(out, SPEC_KEYS).write_text(json.dumps(maps))
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        for folder, tied, out in cases:
            model = gpt_model(tied, tensor_parallel=1)
            loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, folder)
            model.load_state_dict(loaded["model"], strict=True)
            state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if torch.is_tensor(v)}
            save_file(state, out)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def megatron_loaded(cases: list[tuple[Path, bool]], out: Path) -> list[Path]:
    """Load each `(folder, tied)` into a fresh `GPTModel` by megatron-core's own code in one spawned process;
    returns the safetensors file of each one's `state_dict()`, in order (and writes `out / SPEC_KEYS`)."""
    out.mkdir(parents=True, exist_ok=True)
    files = [out / f"loaded-{i}.safetensors" for i in range(len(cases))]
    jobs = [(str(folder), tied, str(f)) for (folder, tied), f in zip(cases, files, strict=True)]
    run_ranks(_worker, (str(out / ".rendezvous"), jobs, str(out)), 1)
    return files
