"""The training state of a native checkpoint (`ckptctl.CheckpointManager`), parameter by parameter
(`TrainingStateSource`).

A multi-rank save keeps its module and optimizer entries in `dcp/`, as `get_model_state_dict` and
`get_optimizer_state_dict` give them: the optimizer keyed by parameter name, which is read. A single-process
save keeps the optimizer's own `state_dict()`, keyed by the index of each parameter in the order the optimizer
was given them, which nothing in the checkpoint maps to the model's names: it is refused rather than guessed.
"""

from __future__ import annotations

from ckptctl.checkpoint import Checkpoint
from ckptctl.contract.capabilities import NotCarried, ParamState
from ckptctl.errors import CkptctlError
from ckptctl.families.dcp_state import dcp_param_state
from ckptctl.formats.native import DCP_FOLDER, read_native_manifest

__all__ = ["SOURCE"]

_WHY = {
    "rng": "RNG streams are per rank of the source's world size; the resuming run seeds its own",
    "scheduler": "the output holds the model and optimizer only (get_state_dict's shape): load the scheduler "
    "from the source's {name}.json or rebuild it at the resumed step",
    "dataloader": "a data-loader position is kept per entry of the source; the output holds the model and "
    "optimizer only: load it from the source's {name}.json",
}


def SOURCE(checkpoint: Checkpoint) -> ParamState:
    manifest = read_native_manifest(checkpoint.url)
    components = manifest.components
    modules = [name for name, c in components.items() if c.kind == "module"]
    optimizers = [name for name, c in components.items() if c.kind == "optimizer"]
    if len(modules) != 1 or len(optimizers) != 1:
        raise CkptctlError(
            f"{checkpoint.url}: holds {len(modules)} module and {len(optimizers)} optimizer entries; one of each "
            "is written as a get_state_dict state",
        )
    module, optimizer = modules[0], optimizers[0]
    if components[module].storage != "dcp" or components[optimizer].storage != "dcp":
        raise CkptctlError(
            f"{checkpoint.url}: a single-process save, whose optimizer state is keyed by parameter index (torch's "
            "optimizer.state_dict()), which nothing in the checkpoint maps to the model's parameter names",
            "reshard a checkpoint saved on several ranks (kept in dcp/, keyed by name)",
        )
    not_carried = [
        NotCarried(
            name,
            _WHY.get(c.kind, "saved beside the model and optimizer: load {name} from the source").format(name=name),
        )
        for name, c in components.items()
        if name not in (module, optimizer)
    ]
    if manifest.step is not None:
        not_carried.append(
            NotCarried(
                "step",
                f"the training step ({manifest.step}) is no part of get_state_dict's state: resume the loop at it",
            )
        )
    return dcp_param_state(checkpoint, DCP_FOLDER, (module,), (optimizer,), not_carried)
