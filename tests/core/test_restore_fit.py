"""`restore` says what it does not restore and refuses a state that does not fit, before loading any of it:
entries of the checkpoint the state does not ask for (an optimizer dropped by a renamed key) are named in a
`CheckpointWarning`, as entries of the state the checkpoint lacks already were; a module or optimizer of
another shape is a `StateMismatch` that names the entry, the tensors and both shapes, not torch's raw
`RuntimeError`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckptctl.core import CheckpointManager, CheckpointWarning
from ckptctl.errors import CkptctlError, StateMismatch


def build(width: int = 8, layers: int = 2) -> dict[str, Any]:
    torch.manual_seed(width * 10 + layers)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, width)).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer, "progress": {"tokens": 7}}


@pytest.fixture
def saved(run_dir: Path) -> tuple[CheckpointManager, dict[str, Any]]:
    manager = CheckpointManager(run_dir)
    state = build()
    manager.save(3, state)
    return manager, state


def test_entries_the_state_does_not_ask_for_are_named(saved: tuple[CheckpointManager, dict[str, Any]]) -> None:
    manager, original = saved
    model_only = {"model": build()["model"]}
    torch.nn.init.zeros_(model_only["model"][0].weight)
    with pytest.warns(
        CheckpointWarning,
        match=r"step-3 holds 'optimizer' \(optimizer\), 'progress' \(value\), which the state does not ask for: not restored",
    ):
        assert manager.restore(model_only) == 3
    for name, tensor in original["model"].state_dict().items():  # what was asked for is restored exactly
        assert torch.equal(model_only["model"].state_dict()[name], tensor)


def test_a_module_of_another_shape_names_the_entry_and_both_shapes(
    saved: tuple[CheckpointManager, dict[str, Any]],
) -> None:
    manager, _ = saved
    wider = build(width=16)
    before = {k: v.clone() for k, v in wider["model"].state_dict().items()}
    with pytest.raises(StateMismatch) as caught:
        manager.restore(wider)
    message = str(caught.value)
    assert "state['model'] does not fit the checkpoint's parameters and buffers" in message
    assert "0.weight is (8, 8) in the checkpoint and (16, 16) in the state" in message
    assert "0.bias is (8,) in the checkpoint and (16,) in the state" in message
    assert "1.weight is (8, 8) in the checkpoint and (16, 16) in the state" in message
    assert "same model configuration" in caught.value.hint
    assert isinstance(caught.value, CkptctlError) and not isinstance(caught.value, RuntimeError)
    for name, tensor in wider["model"].state_dict().items():  # nothing of the entry was loaded
        assert torch.equal(tensor, before[name])


def test_missing_and_extra_parameters_and_optimizer_groups_are_named(
    saved: tuple[CheckpointManager, dict[str, Any]],
) -> None:
    manager, _ = saved
    deeper = build(layers=3)
    with pytest.raises(
        StateMismatch, match=r"2 key\(s\) of the state missing from the checkpoint \(2\.weight, 2\.bias\)"
    ):
        manager.restore(deeper)

    shallower = build(layers=1)
    with pytest.raises(StateMismatch, match=r"2 key\(s\) of the checkpoint not in the state \(1\.weight, 1\.bias\)"):
        manager.restore(shallower)

    same_model = build()
    fewer = torch.optim.AdamW(list(same_model["model"].parameters())[:2], lr=1e-3)
    with pytest.raises(
        StateMismatch,
        match=r"state\['optimizer'\] does not fit the checkpoint's parameter groups: "
        r"group 0 holds 4 parameter\(s\) in the checkpoint, 2 in the state",
    ):
        manager.restore({"model": same_model["model"], "optimizer": fewer, "progress": None})
