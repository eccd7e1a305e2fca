"""The training state of a verl role folder (`actor/`, `critic/` of a `global_step_N`), parameter by parameter
(`TrainingStateSource`): what `reshard --to dcp` reads.

verl 0.9.1 saves, per rank, `model.state_dict()` (DTensors, named as the model names its tensors) and
`optimizer.state_dict()`: torch's own, keyed by parameter index, of an optimizer `build_optimizer` makes from
`module.parameters()` in one group (verl/workers/config/optimizer.py), so the index order is the model's
parameter order; `families.indexed_optimizer` takes it only where the checkpoint proves it. The full
tensors come from the role's tensor index (every rank's shard placed by its DTensor placements).
"""

from __future__ import annotations

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, TensorEntry
from ckptctl.contract.capabilities import NotCarried, ParamState
from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.families.param_state import indexed_optimizer, name_indexed_state, stored_tensor
from ckptctl.formats.dtensor import state_tensors
from ckptctl.formats.dtensor_classes import DTENSOR_PICKLE_GLOBALS, DTensorRef
from ckptctl.formats.torch_pickle import open_torch_pickle
from ckptctl.formats.torch_pickle_classes import TensorRef
from ckptctl.frameworks.verl.layout import rank_file_name
from ckptctl.frameworks.verl.reshard import role_fsdp_config, source_roles, torn_file

__all__ = ["SOURCE"]

_BUILT = "verl builds its optimizer from module.parameters()"
_TENSORS = (TensorRef, DTensorRef)


def SOURCE(checkpoint: Checkpoint) -> ParamState:
    _, roles = source_roles(checkpoint)
    if len(roles) != 1:
        names = ", ".join(role.facts.name for role in roles) or "none"
        raise CkptctlError(
            f"{checkpoint.url}: a verl step folder holds {len(roles)} roles ({names}); a DCP state holds one model",
            "reshard one role folder of it (its actor/ folder)",
        )
    role = roles[0]
    torn = torn_file(role)
    if torn is not None:
        raise CorruptCheckpoint(torn, "reshard a whole save")
    if role_fsdp_config(role).get("FSDP_version") != 2:
        raise CkptctlError(f"{role.url}: only verl's FSDP2 saves are read (fsdp_config.json FSDP_version 2)")
    index = {entry.name: entry for entry in checkpoint.tensor_index()}
    model_file = io.join(role.url, rank_file_name("model", role.world, 0))
    model_root = open_torch_pickle(model_file, role.facts.files.get(io.name_of(model_file)), DTENSOR_PICKLE_GLOBALS)
    model = [
        (path, stored_tensor(checkpoint.url, _entry(index, path, model_file)))
        for path, _ in state_tensors(model_root.root)
    ]
    optim_file = io.join(role.url, rank_file_name("optim", role.world, 0))
    root = open_torch_pickle(optim_file, role.facts.files.get(io.name_of(optim_file)), DTENSOR_PICKLE_GLOBALS).root
    state, groups = indexed_optimizer(
        root, optim_file, lambda name: stored_tensor(checkpoint.url, _entry(index, name, optim_file)), _TENSORS
    )
    optimizer, param_groups = name_indexed_state(model, state, groups, optim_file, _BUILT)
    extra = io.join(role.url, rank_file_name("extra_state", role.world, 0))
    not_carried = (
        NotCarried(
            "extra_state.lr_scheduler",
            f"verl's LR scheduler state is no part of get_state_dict's: load it from the source's {io.name_of(extra)}",
        ),
        NotCarried("extra_state.rng", "RNG streams of the source's ranks; the resuming run seeds its own"),
        NotCarried("huggingface/", "the model's config and tokenizer: copy the folder beside the output"),
        NotCarried("data.pt", "verl's data-loader position, in the step folder beside the roles: load it from there"),
    )
    return ParamState(tuple(model), optimizer, param_groups, not_carried)


def _entry(index: dict[str, TensorEntry], name: str, where: str) -> TensorEntry:
    entry = index.get(name)
    if entry is None:
        raise CorruptCheckpoint(f"{where}: {name} is not in the role's tensor index")
    return entry
