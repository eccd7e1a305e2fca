"""What `convert` reads from OpenRLHF's checkpoints beyond their tensor index (`ConvertSource`): a tag's master
weights, and the HF exports and model folders that hold the config a tag lacks."""

from __future__ import annotations

from collections.abc import Sequence

from ckptctl import io
from ckptctl.checkpoint import Checkpoint
from ckptctl.contract.capabilities import ConvertSource, MasterWeights, default_config_folders
from ckptctl.families.value_head import HeadTask
from ckptctl.families.zero_tag.master_weights import checkpoint_master_weights, tag_prefix
from ckptctl.frameworks.openrlhf.layout import EXPORT_RE, TAG_RE, role_of
from ckptctl.io import DirEntry
from ckptctl.layouts import peek

__all__ = ["SOURCE"]


def _master_weights(checkpoint: Checkpoint, *, required: bool, notes: list[str]) -> MasterWeights | None:
    """A tag's fp32 master weights, as DeepSpeed's zero_to_fp32 rebuilds them; an export has none."""
    prefix = tag_prefix(checkpoint)
    return checkpoint_master_weights(checkpoint, prefix, required=required, notes=notes)


def _config_folders(checkpoint: Checkpoint) -> Sequence[str]:
    """Where OpenRLHF wrote the model's config for a tag: its HF exports.

    An actor tag (or an SFT/DPO/RM tag): the `{tag}_hf` exports in `--ckpt.path`
    (`PolicyModelActor.save_checkpoint` with `--ckpt.save_hf`), the one of the same tag first, then the
    others of the same step, then the newest; then the folders of the default, and the folder above
    `--ckpt.path`, where `save_model` writes the final model (`--ckpt.output_dir`, formerly
    `--save_path`, defaults to it). A critic tag: none of the actor's folders (another model), but
    `{output_dir}_critic`, where `CriticModelActor.save_model` writes the critic. An export holds its own.
    """
    url = checkpoint.url
    if EXPORT_RE.match(io.name_of(url)):
        return default_config_folders(checkpoint)
    save_dir = io.parent_of(url)
    role = role_of(url)
    ckpt_path = io.parent_of(save_dir) if role is not None else save_dir
    output_dir = io.parent_of(ckpt_path)
    if role == "critic":
        return (url, save_dir, f"{output_dir.rstrip('/')}_critic")
    defaults = (url, save_dir, ckpt_path, output_dir)
    exports = peek(ckpt_path, _exports) or []
    tag = TAG_RE.match(io.name_of(url))
    step = int(tag.group(2)) if tag is not None else checkpoint.ref.step
    own = f"{io.name_of(url)}_hf"
    ordered = sorted(exports, key=lambda e: (e[0] != own, e[1] != step, -e[1], -e[2]))
    return (*(io.join(ckpt_path, name) for name, _, _ in ordered), *dict.fromkeys(defaults))


def _exports(ckpt_path: str, entries: Sequence[DirEntry]) -> list[tuple[str, int, float]]:
    """The `{tag}_hf` exports of a `--ckpt.path`: (name, step, mtime)."""
    return [(e.name, int(m.group(2)), e.mtime or 0.0) for e in entries if e.is_dir and (m := EXPORT_RE.match(e.name))]


def _value_head_task(checkpoint: Checkpoint) -> HeadTask:
    """OpenRLHF's `get_llm_for_sequence_regression` (openrlhf/models/model.py) builds a `CriticModel` (a value per
    token: a critic tag, `_critic/`) or a `RewardModel` (a value at each sequence's last token: the tags of
    `train_rm`); its config names which when it was saved with the model (`save_model`)."""
    return HeadTask.TOKEN if role_of(checkpoint.url) == "critic" else HeadTask.SEQUENCE


SOURCE = ConvertSource(master_weights=_master_weights, config_folders=_config_folders, value_head_task=_value_head_task)
