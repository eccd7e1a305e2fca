"""What `convert` reads from AReaL's checkpoints beyond their tensor index (`ConvertSource`): the Saver's
exports, which hold the config and tokenizer its recover slot lacks."""

from __future__ import annotations

from collections.abc import Sequence

from ckptctl import io
from ckptctl.checkpoint import Checkpoint
from ckptctl.contract.capabilities import ConvertSource, default_config_folders
from ckptctl.families.value_head import HeadTask
from ckptctl.frameworks.areal.layout import EXPORT_RE
from ckptctl.layouts import peek_dir

__all__ = ["SOURCE"]


def _config_folders(checkpoint: Checkpoint) -> Sequence[str]:
    """The slot: the Saver's exports beside it in the model folder (`epoch{E}epochstep{S}globalstep{G}/`,
    each written with the model's config and tokenizer), the one of the slot's step first, then the
    others newest first; the slot keeps neither. An export: its own folder."""
    url = checkpoint.ref.url
    if EXPORT_RE.match(io.name_of(url)):
        return default_config_folders(checkpoint)
    model_folder = io.parent_of(url)
    exports = [
        (int(m.group(3)), e.name)
        for e in peek_dir(model_folder) or []
        if e.is_dir and (m := EXPORT_RE.match(e.name)) and not m.group(4)
    ]
    step = checkpoint.ref.step
    exports.sort(key=lambda export: (export[0] != step, -export[0]))
    return (*(io.join(model_folder, name) for _, name in exports), *default_config_folders(checkpoint))


def _value_head_task(checkpoint: Checkpoint) -> HeadTask:
    """A critic (`actor.is_critic`): AReaL builds it as `AutoModelForTokenClassification` with `num_labels=1`
    (areal/engine/fsdp_engine.py, `FSDPEngine._create_llm_actor_or_critic`), and its exports carry the base causal
    LM's config (`_save_model_to_hf` saves `model_config` over the model's own)."""
    return HeadTask.TOKEN


SOURCE = ConvertSource(config_folders=_config_folders, value_head_task=_value_head_task)
