"""The encoded-tree format (docs/native-format.md): what encodes, how, and what is refused."""

from __future__ import annotations

import enum
import json
import math
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

from ckptctl.errors import CorruptCheckpoint, SerializationError
from ckptctl.formats import state_tree
from ckptctl.formats.digest import file_digest
from ckptctl.formats.safetensors import read_header
from tests.core.util import assert_same


def roundtrip(value: Any, tmp_path: Path, stem: str = "entry") -> Any:
    written = state_tree.write_files(str(tmp_path), stem, state_tree.encode(value, name="x", root_key=stem))
    for name, record in written.items():  # digests computed while writing equal a fresh read
        assert file_digest(str(tmp_path / name)) == record.blake3
        assert (tmp_path / name).stat().st_size == record.size
    return state_tree.read_files(str(tmp_path), stem).value


def test_every_supported_type_round_trips(tmp_path: Path) -> None:
    value = {
        "int": 3,
        "big": 2**70,
        "float": 0.1,
        "specials": [math.inf, -math.inf, math.nan],
        "str": "héllo",
        "bool": True,
        "none": None,
        "bytes": b"\x00\xffdata",
        "dtype": torch.bfloat16,
        "tuple": (1, (2, "x"), []),
        "int_keys": {0: "a", 1: {"nested": (3,)}},
        "mixed_keys": {"a": 1, 2: 2, (3, 4): 5, None: 6},
        "tensor": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "bf16": torch.ones(3, dtype=torch.bfloat16) / 3,
        "bool_tensor": torch.tensor([True, False]),
        "scalar": torch.tensor(1.5),
        "empty": torch.empty(0, 4),
        "ndarray": np.arange(4, dtype=np.uint16),
        "big_endian": np.arange(3, dtype=">i4"),
        "np_scalars": [np.float32(0.5), np.int64(7), np.bool_(True)],
    }
    out = roundtrip(value, tmp_path)
    expected = dict(value)
    expected["big_endian"] = np.arange(3, dtype="<i4")
    expected["np_scalars"] = [0.5, 7, True]  # documented: numpy scalars come back as Python numbers
    assert_same(expected, out)


def test_layout_matches_the_spec(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.LayerNorm(3))
    state_tree.write_files(str(tmp_path), "model", state_tree.encode(model.state_dict(), name="m"))
    doc = json.loads((tmp_path / "model.json").read_text())
    assert doc["tree"] == {k: {"__tensor__": k} for k in model.state_dict()}
    assert [t.name for t in read_header(str(tmp_path / "model.safetensors")).tensors] == list(model.state_dict())

    opt_tree = state_tree.encode(
        {"state": {0: {"step": torch.tensor(1.0)}}, "param_groups": [{"betas": (0.9, 0.99)}]}, name="o"
    ).tree
    assert opt_tree == {
        "state": {"__dict__": [[0, {"step": {"__tensor__": "state.0.step"}}]]},
        "param_groups": [{"betas": {"__tuple__": [0.9, 0.99]}}],
    }


def test_marker_lookalikes_are_escaped(tmp_path: Path) -> None:
    value = {"__tensor__": "not a tensor", "ok": {"__tuple__": [1], "other": 2}}
    encoded = state_tree.encode(value, name="x")
    assert encoded.tree["ok"] == {"__tuple__": [1], "other": 2}  # two keys: not a marker
    inner = state_tree.encode({"__tuple__": [1]}, name="x").tree
    assert inner == {"__dict__": [["__tuple__", [1]]]}
    assert_same(value, roundtrip(value, tmp_path))


def test_colliding_tensor_keys_get_a_suffix(tmp_path: Path) -> None:
    value = {"a.b": torch.zeros(1), "a": {"b": torch.ones(1)}}
    encoded = state_tree.encode(value, name="x")
    assert set(encoded.tensors) == {"a.b", "a.b#2"}
    assert_same(value, roundtrip(value, tmp_path))


def test_root_tensor_uses_the_root_key(tmp_path: Path) -> None:
    encoded = state_tree.encode(torch.ones(2), name="x", root_key="weights")
    assert encoded.tree == {"__tensor__": "weights"}
    assert_same(torch.ones(2), roundtrip(torch.ones(2), tmp_path, "weights"))


def test_sync_encoding_does_not_copy_cpu_tensors() -> None:
    t = torch.ones(4)
    assert state_tree.encode({"t": t}, name="x").tensors["t"].data_ptr() == t.data_ptr()


def test_views_and_conjugates_are_stored_as_their_values(tmp_path: Path) -> None:
    base = torch.arange(12.0).reshape(3, 4)
    value = {
        "transposed": base.t(),
        "strided": base[:, ::2],
        "conj": torch.tensor([1 + 2j], dtype=torch.complex64).conj(),
    }
    out = roundtrip(value, tmp_path)
    for k, v in value.items():
        assert torch.equal(out[k], v.resolve_conj()), k


class Color(enum.IntEnum):
    RED = 1


def test_int_and_str_subclasses_are_stored_as_plain_values(tmp_path: Path) -> None:
    assert roundtrip({"c": Color.RED}, tmp_path) == {"c": 1}


@pytest.mark.parametrize(
    ("value", "where", "what"),
    [
        ({"cfg": {"a": [1, object()]}}, "x['cfg']['a'][1]", "builtins.object"),
        ({"fn": lambda: 0}, "x['fn']", "function"),
        ({"s": {1, 2}}, "x['s']", "set"),
        ({"t": torch.ones(2).to_sparse()}, "x['t']", "sparse"),
        ({"t": torch.ones(2, dtype=torch.complex128)}, "x['t']", "complex128"),
        ({"a": np.array(["x"], dtype=object)}, "x['a']", "object"),
        ({"a": np.array([1], dtype=np.float128)}, "x['a']", "float128"),
    ],
)
def test_unsupported_values_are_refused_with_their_path(value: Any, where: str, what: str) -> None:
    with pytest.raises(SerializationError) as info:
        state_tree.encode(value, name="x")
    assert where in str(info.value) and what in str(info.value)


@pytest.mark.parametrize(
    "tree",
    [
        {"__tensor__": "missing"},
        {"__tuple__": 3},
        {"__dict__": [[1]]},
        {"__dict__": [[[1], 2]]},
        {"__bytes__": "***"},
        {"__dtype__": "not_a_dtype"},
        {"__dtype__": "Tensor"},
    ],
)
def test_malformed_trees_are_corrupt(tree: Any) -> None:
    with pytest.raises(CorruptCheckpoint):
        state_tree.decode(tree, {}, source="f.json")


def test_malformed_files_are_corrupt(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text("{not json")
    (tmp_path / "b.json").write_text('{"no_tree": 1}')
    (tmp_path / "c.json").write_text('{"tree": {"__tensor__": "w"}}')
    (tmp_path / "c.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    for stem in "abc":
        with pytest.raises(CorruptCheckpoint):
            state_tree.read_files(str(tmp_path), stem)


def test_module_state_dict_loads_from_the_decoded_tree(tmp_path: Path) -> None:
    src = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    dst = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    dst.load_state_dict(OrderedDict(roundtrip(src.state_dict(), tmp_path)))
    assert_same(dict(src.state_dict()), dict(dst.state_dict()))


json_leaves = hs.none() | hs.booleans() | hs.integers() | hs.floats(allow_nan=False) | hs.text() | hs.binary()
keys = hs.text() | hs.integers() | hs.booleans()
trees = hs.recursive(
    json_leaves,
    lambda children: (
        hs.lists(children, max_size=4)
        | hs.lists(children, max_size=4).map(tuple)
        | hs.dictionaries(keys, children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(trees)
def test_plain_trees_survive_a_json_round_trip(value: Any) -> None:
    encoded = state_tree.encode(value, name="x")
    assert not encoded.tensors
    text = json.dumps(encoded.tree, allow_nan=True)
    assert_same(value, state_tree.decode(json.loads(text), {}, source="t"))
