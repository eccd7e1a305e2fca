"""torchtitan's `CheckpointManager` folders: `{dump_folder}/{checkpoint.folder}/step-N/`, each one DCP save.

Facts from torchtitan 0.3.0 (`torchtitan/components/checkpointer/dcp.py`, `CheckpointManager`):

- `_save` writes `dcp.save(states, checkpoint_id="{folder}/step-{N}")` of one flat state dict: the model's
  own tensor names with no namespace (`ModelWrapper` flattens them: `tok_embeddings.weight`, `layers.0.
  attention.qkv_linear.wq.weight`, ...) beside `optimizer.*`, `lr_scheduler.*`, `dataloader.*` (each data
  rank's `dp_rank_R` pickle and `world_size`) and `train_state.*` (the trainer's `step`, `ntokens_seen`).
- The last step is saved model-only by default (`last_save_model_only`, in `export_dtype`), as a DCP
  folder or, with `last_save_in_hf`, as safetensors (the HF layout reads those); step 0 is the model-only
  seed checkpoint (`create_seed_checkpoint`).
- There is no pointer: `_find_load_step` resumes from the highest `step-N` holding `.metadata` (or
  `model.safetensors.index.json`); `keep_latest_k` deletes the lowest steps.

Plain DCP folders that happen to be named `step-N` stay DCP: a folder is torchtitan's when its keys are
(the trainer's `train_state.step`, or a model-only save of torchtitan's own model names).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ckptctl import io
from ckptctl.checkpoint import Checkpoint, CheckpointRef, Role
from ckptctl.errors import CkptctlError
from ckptctl.families.dcp_folder import DcpFolderLayout
from ckptctl.formats.dcp_folder_metadata import load_dcp_metadata
from ckptctl.formats.dcp_metadata import METADATA_NAME, DcpMetadata
from ckptctl.formats.torch_save import read_object_archive
from ckptctl.io import DirEntry

if TYPE_CHECKING:
    from ckptctl.contract.resume import ResumeProfile

__all__ = ["TorchtitanLayout", "data_ranks"]

#: `_create_checkpoint_id`: `step-{N}`.
STEP_RE = re.compile(r"^step-(\d+)$")
#: The trainer's counters (`Trainer.state_dict`), saved under `train_state`.
_TRAIN_STATE = ("step", "ntokens_seen")
_DATA_RANK = re.compile(r"^dataloader\.dp_rank_(\d+)$")
#: The largest counter item read at open (a torch.save of an int is well under 1 KiB).
_MAX_COUNTER_BYTES = 64 << 10


def _is_torchtitan(metadata: DcpMetadata) -> bool:
    keys = metadata.entries
    if "train_state.step" in keys:
        return True
    # A model-only save (the last step, the seed checkpoint): torchtitan's own names, no namespace.
    return "tok_embeddings.weight" in keys and not any(k.startswith("model.") for k in keys)


def data_ranks(metadata: DcpMetadata) -> int | None:
    """The data-parallel ranks whose loader state the save holds (`dataloader.dp_rank_R` keys), or None."""
    ranks = {int(m.group(1)) for key in metadata.entries if (m := _DATA_RANK.match(key))}
    return max(ranks) + 1 if ranks else None


#: torchtitan's default `--checkpoint.folder` (below `--dump_folder`).
CHECKPOINT_FOLDER = "checkpoint"


class TorchtitanLayout(DcpFolderLayout):
    """A `step-N` DCP folder written by torchtitan's `CheckpointManager` (see the module docstring)."""

    name = "torchtitan"

    def identify(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        """A ref when the folder is `step-N` and its `.metadata` holds torchtitan's keys (one small read;
        a folder without `.metadata` yet is left to the DCP layout, which lists it in progress).

        On an object store, where each read is a request, only `step-N` folders in a `checkpoint/` folder
        (torchtitan's `--checkpoint.folder` default) are read: other DCP folders there are judged from
        their listing alone, so a run of thousands is listed with no request per folder. A torchtitan run
        uploaded under another folder name reads as plain DCP (its tensors keep torchtitan's names)."""
        match = STEP_RE.match(io.name_of(url))
        if match is None:
            return None
        # Remote: reading every step's metadata costs a request per folder, so only torchtitan's folder name pays.
        if not io.is_local(url) and io.name_of(io.parent_of(url)) != CHECKPOINT_FOLDER:
            return None
        meta = next((e for e in entries if e.name == METADATA_NAME and not e.is_dir), None)
        if meta is None:
            return None
        try:
            metadata = load_dcp_metadata(url, meta)
        except CkptctlError:  # the DCP layout opens it and verify says why
            return None
        if not _is_torchtitan(metadata):
            return None
        ref = self._listed(url, entries)  # the metadata is parsed whole above
        return replace(ref, layout=self.name, step=int(match.group(1))) if ref is not None else None

    def open(self, url: str) -> Checkpoint:
        """The DCP folder, with torchtitan's counters (`train_state`) and data ranks; a model-only save
        after step 0 (the last step's `last_save_model_only`) is an export, not a resume point."""
        checkpoint = super().open(url)
        meta = next((e for e in io.list_dir(url) if e.name == METADATA_NAME and not e.is_dir), None)
        if meta is None:
            return checkpoint
        metadata = load_dcp_metadata(url, meta)
        progress = _counters(url, metadata)
        model_only = not any(k.startswith(("optimizer.", "train_state.")) for k in metadata.entries)
        info = dict(checkpoint.metadata)
        info.update({"format": "torchtitan CheckpointManager (DCP)", "model_only": model_only, "progress": progress})
        ranks = data_ranks(metadata)
        if ranks is not None:
            info["data_parallel_ranks"] = ranks
        export = model_only and checkpoint.ref.step not in (None, 0)
        return replace(checkpoint, progress=progress, metadata=info, role=Role.EXPORT if export else Role.TRAINING)

    def resume_profile(self) -> ResumeProfile:
        """See `frameworks.torchtitan.resume`."""
        from ckptctl.frameworks.torchtitan.resume import PROFILE

        return PROFILE


def _counters(url: str, metadata: DcpMetadata) -> dict[str, Any]:
    """The trainer's `step` and `ntokens_seen`: small torch.save items read through the safe reader."""
    found: dict[str, Any] = {}
    for name in _TRAIN_STATE:
        record = metadata.storage.get((f"train_state.{name}", None))
        if record is None or record.transforms or record.length > _MAX_COUNTER_BYTES:
            continue
        try:
            blob = io.read_bytes(io.join(url, record.relative_path), record.offset, record.length)
            value = read_object_archive(blob, f"{record.relative_path}: train_state.{name}")
        except CkptctlError:  # verify reports unreadable items
            continue
        if type(value) is int:
            found[name] = value
    return found
