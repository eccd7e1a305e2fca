"""Lightning's slimmer (`SLIMMER`): what only `trainer.fit(ckpt_path=...)` restores goes, the model and the rest of
the checkpoint dict stay (lightning 2.6.6 `pytorch/trainer/connectors/checkpoint_connector.py`
`dump_checkpoint`, `restore_optimizers_and_schedulers`).

- A `.ckpt` file: the entries `optimizer_states` and `lr_schedulers` of its dict, with the storages only they
  use. The file is written anew without running its pickle: `formats.pickle_edit` cuts those entries out of
  `data.pkl` (every other byte kept), and `formats.torch_save_writer.copy_torch_file` copies the kept records,
  storages byte for byte, with the slim marker inside (`formats.slim_marker`). What is kept is read back
  through the allowlist and compared with the original's before the file is used. A file whose
  hyperparameters hold a class Lightning does not write, or whose kept entries share a dict or list with the
  dropped ones, is kept whole, saying why. `LightningModule.load_from_checkpoint` reads only `state_dict` and
  `hyper_parameters` (`core/saving.py` `_load_from_checkpoint`), so it loads the slim file as the whole one; a
  resume from it stops with Lightning's own "contains only the model" error, as for `save_weights_only`.
- A sharded `.ckpt/` folder (FSDP `state_dict_type="sharded"`): its DCP items `optimizer_0.*`, ... go
  (`families.dcp_slim`); `meta.pt` (the dict without `state_dict` and `optimizer_states`) stays as it is.
- A DeepSpeed `.ckpt/` folder: its tag `checkpoint/` loses its optimizer partitions and keeps its fp32
  masters as a model file (`families.zero_tag.slim`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import partial
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, Problem
from ckptctl.contract.capabilities import OneLookSlimmer, SlimRecipe, SlimRewrite
from ckptctl.errors import CkptctlError
from ckptctl.families.dcp_slim import slim_dcp_folder
from ckptctl.families.zero_tag.slim import expected_tag_problem, tag_slim
from ckptctl.formats.manifest import now_iso
from ckptctl.formats.pickle_edit import drop_dict_keys
from ckptctl.formats.slim_marker import SLIM_COMMENT, SLIM_MARKER, SlimMarker
from ckptctl.formats.torch_pickle import TorchPickle, tensor_refs
from ckptctl.formats.torch_pickle_classes import TORCH_PICKLE_GLOBALS, load_torch_pickle
from ckptctl.formats.torch_save_writer import copy_torch_file
from ckptctl.frameworks.lightning.files import DEEPSPEED_TAG
from ckptctl.frameworks.lightning.layout import open_lightning_file

__all__ = ["SLIMMER", "LightningSlimmer"]

#: Entries of a `.ckpt` file's dict that only a resume restores -> what they hold.
TRAINING_ONLY: Mapping[str, str] = {"optimizer_states": "optimizer", "lr_schedulers": "scheduler"}
_SHARDED_OPTIMIZER = re.compile(r"^optimizer_\d+(?:\.|$)")


def sharded_training_only(key: str) -> str | None:
    """What a DCP item of a sharded `.ckpt/` folder holds when only a resume reads it (`optimizer_0.*`)."""
    return "optimizer" if _SHARDED_OPTIMIZER.match(key) else None


class LightningSlimmer(OneLookSlimmer):
    """See the module docstring."""

    def expected(self, problem: Problem) -> bool:
        return expected_tag_problem(problem)

    def decide(self, checkpoint: Checkpoint) -> SlimRecipe | str:
        url = checkpoint.url
        if "" not in checkpoint.files:
            if io.is_dir(io.join(url, DEEPSPEED_TAG)):
                return tag_slim(checkpoint, f"{DEEPSPEED_TAG}/")
            return slim_dcp_folder(url, checkpoint.files, sharded_training_only)
        opened = open_lightning_file(url, checkpoint.files[""])
        root = opened.root
        if not isinstance(root, dict):
            return "its pickle holds no checkpoint dict"
        drop = [key for key in TRAINING_ONLY if key in root]
        if not any(root.get(key) for key in drop):
            return "it holds no optimizer or scheduler state (a save_weights_only file)"
        slim = _slim_pickle(opened, drop)
        if isinstance(slim, str):
            return slim
        data, kept = slim
        dropped = tuple(sorted({TRAINING_ONLY[key] for key in drop}))
        shed = sum(
            record.size
            for name, record in opened.records.items()
            if name.startswith(f"{opened.prefix}data/") and name[len(opened.prefix) + 5 :] not in kept
        )
        write = partial(_write, opened=opened, data=data, kept=kept, dropped=dropped, keys=tuple(drop))
        return SlimRecipe(drop=(), dropped=dropped, rewrites=(SlimRewrite("", write),), shed_bytes=shed)


def _slim_pickle(opened: TorchPickle, drop: list[str]) -> tuple[bytes, frozenset[str]] | str:
    """`data.pkl` without the entries `drop`, and the storages it still uses; or why it cannot be cut.

    The new pickle is read back through the allowlist: it must hold the same entries but `drop`, with the same
    tensors (dtype, shape, storage, offset, stride) under the same paths, as the original."""
    record = opened.records[f"{opened.prefix}data.pkl"]
    try:
        data = drop_dict_keys(opened.read_record(record), drop)
        root: Any = load_torch_pickle(data, f"{opened.url} (data.pkl, slim)", TORCH_PICKLE_GLOBALS)
    except CkptctlError as exc:
        return f"its data.pkl cannot be cut apart safely: {exc.message}"
    expected = {key: value for key, value in opened.root.items() if key not in drop}
    if not isinstance(root, dict) or list(root) != list(expected):
        return "its data.pkl, cut apart, does not hold the other entries as they were"
    if list(tensor_refs(root)) != list(tensor_refs(expected)):
        return "its data.pkl, cut apart, does not hold the model's tensors as they were"
    return data, frozenset(ref.storage_key for _, ref in tensor_refs(root))


def _write(
    target: str,
    *,
    opened: TorchPickle,
    data: bytes,
    kept: frozenset[str],
    dropped: tuple[str, ...],
    keys: tuple[str, ...],
) -> None:
    """Write the slim `.ckpt` at `target`: the kept records and the marker inside (`formats.slim_marker`)."""
    prefix = opened.prefix
    storages = sorted(
        name[len(prefix) :]
        for name in opened.records
        if name.startswith(f"{prefix}data/") and name[len(prefix) + 5 :] not in kept
    )
    marker = SlimMarker(
        dropped_files=tuple(storages),
        dropped=dropped,
        kept_files={},
        created=now_iso(),
        extra={"dropped_entries": list(keys)},
    )
    copy_torch_file(opened, target, data, kept, extra={SLIM_MARKER: marker.to_json()}, comment=SLIM_COMMENT)


SLIMMER = LightningSlimmer()
