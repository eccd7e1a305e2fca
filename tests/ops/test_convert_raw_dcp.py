"""A raw `dcp.save(model.state_dict())` of a `...ForCausalLM` keeps its own names through convert and diff.

Its keys are `model.*` (the decoder) next to `lm_head.weight`: `model.` is the module's own name here, not
a namespace, so nothing may be stripped and `lm_head` must not be filed as something other than the model.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from ckptctl.checkpoint import Component
from ckptctl.layouts import open_checkpoint
from ckptctl.ops.convert import ConvertOptions, convert
from ckptctl.ops.diff import DiffOptions, diff
from tests.conftest import tiny_llama


def test_raw_causal_lm_save_converts_to_a_loadable_model(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = tiny_llama()
    reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert "lm_head.weight" in reference and any(k.startswith("model.") for k in reference)
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "raw"))

    ckpt = open_checkpoint(str(tmp_path / "raw"))
    assert {t.name for t in ckpt.tensors(Component.MODEL)} == set(reference)

    # A raw save keeps no config: the model's, given, proves the output is that model before it is written.
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.save_pretrained(tmp_path / "config")
    result = convert(str(tmp_path / "raw"), str(tmp_path / "hf"), ConvertOptions(config_dir=str(tmp_path / "config")))
    assert result.model is not None and result.model.architecture == "LlamaForCausalLM"
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, reference[name]), name

    assert diff(str(tmp_path / "raw"), str(tmp_path / "hf"), DiffOptions()).equal
