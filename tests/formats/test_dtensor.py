"""`formats.dtensor` on DTensor specs as the allowlisting unpickler rebuilds them (stand-ins built directly here,
as NEWOBJ + BUILD of a hostile pickle would build them); real verl rank files are read in tests/layouts/test_verl.py."""

from __future__ import annotations

from typing import Any

import pytest

from ckptctl.errors import CorruptCheckpoint
from ckptctl.formats.dtensor import Placement, dtensor_facts, state_tensors
from ckptctl.formats.dtensor_classes import DTENSOR_STAND_INS, DTENSOR_TUPLES, DTensorRef, PlacementStandIn
from ckptctl.formats.torch_pickle_classes import TensorRef


def _built(cls: type, state: Any) -> Any:
    obj = cls()
    obj.__setstate__(state)
    return obj


def _dtensor(tensor_meta: Any) -> DTensorRef:
    """A (4,) float32 DTensor `Shard(0)` on a 2-rank mesh (its local half, on disk)."""
    mesh = _built(DTENSOR_STAND_INS["DeviceMesh"], {"mesh": TensorRef("int64", (2,), "m", 0, (1,), 16, 16)})
    shard = type("PlacementStandIn", (PlacementStandIn,), {"__slots__": (), "kind": "Shard"})
    spec = {"mesh": mesh, "placements": (_built(shard, {"dim": 0}),), "tensor_meta": tensor_meta}
    local = TensorRef("float32", (2,), "0", 0, (1,), 8, 8)
    return DTensorRef("float32", (4,), local, _built(DTENSOR_STAND_INS["DTensorSpec"], spec))


def test_a_spec_whose_tensor_meta_agrees_is_read() -> None:
    facts = dtensor_facts(_dtensor(DTENSOR_TUPLES["TensorMeta"]((4,), (1,), "float32")), "f")
    assert facts.placements == (Placement("shard", 0),) and facts.mesh_shape == (2,)
    assert facts.local_box((1,)) == ((2,), (2,))


@pytest.mark.parametrize("shape", [5, None, (8,)])
def test_a_tensor_meta_without_the_dtensors_shape_is_corrupt(shape: Any) -> None:
    """A shape that is no sequence at all is a CorruptCheckpoint too, not a TypeError traceback."""
    with pytest.raises(CorruptCheckpoint, match="tensor_meta"):
        dtensor_facts(_dtensor(DTENSOR_TUPLES["TensorMeta"](shape, (1,), "float32")), "f")


def test_walking_a_hostile_state_is_bounded() -> None:
    """One tensor reached from many places through long keys (memo references make that cheap in a pickle):
    the paths would add up to gigabytes; the walk stops at the same bound as `tensor_refs`. A key no real
    state has (an integer of thousands of digits) is named by its type, not printed (a ValueError before)."""
    tensor = TensorRef("float32", (2,), "0", 0, (1,), 8, 8)
    root: Any = {i: tensor for i in range(20_000)}
    for level in range(3):
        root = {f"{level}" * 1300: root}
    with pytest.raises(CorruptCheckpoint, match="more text"):
        for _ in state_tensors(root):
            pass
    assert [path for path, _ in state_tensors({10**5000: tensor})] == ["<int>"]
