"""Whole torch.save files read without running them: structure, tensor facts, framework stand-ins, refusals.

Files here are written by torch.save in the test (optimizer-style state dicts, a module state dict,
`TrainingArguments`, an HF Trainer RNG state); the real DeepSpeed and Trainer files are exercised, and
fuzzed, in `tests/layouts`.
"""

from __future__ import annotations

import argparse
import pickle
import random
import subprocess
import sys
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckptctl import io
from ckptctl.errors import CorruptCheckpoint, UnsafePickle, UnsupportedClass
from ckptctl.formats.safe_pickle import FrameworkObject, state_fields
from ckptctl.formats.torch_pickle import load_tensor, open_torch_pickle, read_pickled_structure, tensor_refs
from ckptctl.formats.torch_pickle_classes import OrderedDictStandIn, TensorRef
from ckptctl.formats.torch_save_classes import NumpyArray
from tests.formats.test_safe_pickle import payloads


def _save(obj: Any, path: Path, **kwargs: Any) -> Path:
    torch.save(obj, path, **kwargs)
    return path


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(8, 6, generator=g)
    return {
        "state": {
            0: {"step": torch.tensor(4.0), "exp_avg": torch.randn(64, 32, generator=g), "exp_avg_sq": base},
            1: {"step": torch.tensor(4.0), "exp_avg": base[2:5], "exp_avg_sq": base.t()},
        },
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1]}],
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "param": torch.nn.Parameter(torch.arange(6.0).reshape(2, 3)),
        "empty": torch.zeros(0, 4),
        "ids": torch.arange(5, dtype=torch.int64),
        "uint16": torch.arange(3, dtype=torch.int32).to(torch.uint16),
    }


def _flat(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list | tuple) else ()
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def test_tensors_are_facts_and_their_bytes_are_not_read(tmp_path: Path) -> None:
    state = _state()
    path = _save(state, tmp_path / "optimizer.pt")
    before = io.READ_STATS.bytes_read
    opened = open_torch_pickle(str(path))
    read = io.READ_STATS.bytes_read - before
    expected = _flat(state)
    refs = dict(opened.tensors())
    assert set(refs) == set(expected)
    for name, tensor in expected.items():
        ref = refs[name]
        assert type(ref) is TensorRef
        assert (ref.dtype, ref.shape, ref.stride) == (str(tensor.dtype)[6:], tuple(tensor.shape), tensor.stride())
        assert ref.nbytes == tensor.numel() * tensor.element_size()
    assert refs["state.1.exp_avg"].storage_offset == 12 and refs["state.1.exp_avg"].is_contiguous
    assert not refs["state.1.exp_avg_sq"].is_contiguous
    assert opened.root["param_groups"] == [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1]}]
    # The zip directory and data.pkl only: the 8 KiB tail read cannot hold the 8 KiB first tensor.
    assert read < 8192 + 4096
    for name, ref in refs.items():
        got = load_tensor(str(path), ref, opened)
        assert got.dtype == expected[name].dtype and torch.equal(got, expected[name]), name
        assert torch.equal(load_tensor(str(path), ref), expected[name]), name  # without the opened file


def test_byte_ranges_of_contiguous_tensors(tmp_path: Path) -> None:
    state = _state()
    path = _save(state, tmp_path / "optimizer.pt")
    opened = open_torch_pickle(str(path))
    blob = path.read_bytes()
    for name, ref in opened.tensors():
        found = opened.byte_range(ref)
        if not ref.is_contiguous:
            assert found is None
            continue
        assert found is not None
        want = _flat(state)[name].contiguous().reshape(-1)
        assert blob[found[0] : found[1]] == (want.view(torch.uint8).numpy().tobytes() if want.numel() else b"")


def test_module_state_dict_keeps_its_metadata(tmp_path: Path) -> None:
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    root = read_pickled_structure(str(_save(module.state_dict(), tmp_path / "m.pt")))
    assert type(root) is OrderedDictStandIn and list(root) == list(module.state_dict())
    assert root.state["_metadata"][""] == {"version": 1}


def test_training_arguments_become_an_inert_object(tmp_path: Path) -> None:
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "out"), learning_rate=3e-4, seed=11, report_to=[])
    root = read_pickled_structure(str(_save(args, tmp_path / "training_args.bin")))
    assert isinstance(root, FrameworkObject)
    assert root.stands_for == "transformers.training_args.TrainingArguments"
    fields = state_fields(root, "training_args.bin")
    assert (fields["learning_rate"], fields["seed"]) == (3e-4, 11)
    scheduler = fields["lr_scheduler_type"]
    assert isinstance(scheduler, FrameworkObject) and scheduler.value == "linear"


def test_rng_state_as_the_trainer_saves_it(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    saved = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    root = read_pickled_structure(str(_save(saved, tmp_path / "rng_state.pth")))
    assert root["python"] == saved["python"]
    name, keys, pos, has_gauss, cached = root["numpy"]
    assert (name, pos, has_gauss, cached) == ("MT19937", saved["numpy"][2], saved["numpy"][3], saved["numpy"][4])
    assert isinstance(keys, NumpyArray)
    _version, shape, _dtype, _fortran, raw = keys.state
    assert shape == (624,) and raw == saved["numpy"][1].tobytes()
    assert type(root["cpu"]) is TensorRef and root["cpu"].dtype == "uint8"


def test_other_allowed_objects(tmp_path: Path) -> None:
    saved = {
        "args": argparse.Namespace(lr=0.1, layers=[1, 2]),
        "device": torch.device("cuda", 1),
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "ordered": OrderedDict(a=1),
        "tags": {"x", "y"},
    }
    root = read_pickled_structure(str(_save(saved, tmp_path / "x.pt")))
    assert state_fields(root["args"], "args") == {"lr": 0.1, "layers": [1, 2]}
    assert (root["device"], root["size"], root["dtype"]) == ("cuda:1", (2, 3), "bfloat16")
    assert root["ordered"] == {"a": 1} and root["tags"] == {"x", "y"}


@pytest.mark.parametrize("name", list(payloads(Path("/nonexistent"))))
def test_hostile_globals_are_refused_and_nothing_runs(name: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    global_name, payload = payloads(marker)[name]
    state = _state()
    state["state"][0]["evil"] = payload  # after real tensors and framework objects
    path = _save(state, tmp_path / "optimizer.pt")
    with pytest.raises(UnsafePickle) as info:
        read_pickled_structure(str(path))
    assert global_name in str(info.value) and "optimizer.pt" in str(info.value)
    assert not marker.exists()


def _archive(path: Path, pickled: bytes) -> Path:
    """A zip laid out like torch.save's, holding the given data.pkl."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", pickled)
        archive.writestr("archive/byteorder", b"little")
    return path


@pytest.mark.parametrize(
    "pickled",
    [
        # An enum stand-in takes one plain value, not a list.
        b"\x80\x02cdeepspeed.runtime.zero.config\nZeroStageEnum\n]\x85R.",
        # _rebuild_from_type_v2 only calls the tensor stand-ins.
        b"\x80\x02ctorch._tensor\n_rebuild_from_type_v2\nctorch\nSize\nctorch\nTensor\n)}tR.",
        # _codecs.encode only makes latin-1 bytes.
        b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00aX\x05\x00\x00\x00rot13\x86R.",
        # A parameter wraps a tensor, nothing else.
        b"\x80\x02ctorch._utils\n_rebuild_parameter\nK\x01\x88}\x87R.",
        # numpy arrays are rebuilt as plain ndarrays only.
        b"\x80\x02cnumpy.core.multiarray\n_reconstruct\nctorch\nTensor\nK\x00\x85C\x01b\x87R.",
    ],
)
def test_allowed_names_cannot_be_abused(tmp_path: Path, pickled: bytes) -> None:
    with pytest.raises(CorruptCheckpoint) as info:
        read_pickled_structure(str(_archive(tmp_path / "x.pt", pickled)))
    assert type(info.value) is CorruptCheckpoint  # allowed names, refused arguments


def test_unknown_framework_classes_are_refused(tmp_path: Path) -> None:
    pickled = b"\x80\x02cdeepspeed.runtime.engine\nDeepSpeedEngine\n)\x81."
    with pytest.raises(UnsupportedClass, match=r"deepspeed\.runtime\.engine\.DeepSpeedEngine"):
        read_pickled_structure(str(_archive(tmp_path / "x.pt", pickled)))


def test_unreadable_files_say_why(tmp_path: Path) -> None:
    path = _save(_state(), tmp_path / "optimizer.pt")
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(path.read_bytes()[:-200])
    with pytest.raises(CorruptCheckpoint, match="truncated"):
        open_torch_pickle(str(truncated))
    legacy = _save(_state(), tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(CorruptCheckpoint, match="legacy"):
        open_torch_pickle(str(legacy))
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"hello world" * 10)
    with pytest.raises(CorruptCheckpoint, match=r"not a torch\.save zip file"):
        open_torch_pickle(str(garbage))
    not_torch = _archive(tmp_path / "plain.zip", pickle.dumps([1, 2]))
    with zipfile.ZipFile(not_torch, "a") as archive:
        archive.writestr("other/data.pkl", b"")
    with pytest.raises(CorruptCheckpoint, match=r"no single data\.pkl"):
        open_torch_pickle(str(not_torch))


def test_a_storage_record_missing_from_the_directory(tmp_path: Path) -> None:
    path = _save({"w": torch.randn(4, 4)}, tmp_path / "x.pt")
    damaged = tmp_path / "damaged.pt"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(damaged, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            if "/data/" not in info.filename:
                dst.writestr(info.filename, src.read(info))
    opened = open_torch_pickle(str(damaged))
    [(_, ref)] = opened.tensors()
    with pytest.raises(CorruptCheckpoint, match="storage record data/0 is missing"):
        opened.byte_range(ref)


def test_cycles_and_shared_containers_are_walked_once() -> None:
    shared: list[Any] = [TensorRef("float32", (1,), "0", 0, (1,), 4, 4)]
    shared.append(shared)
    assert [name for name, _ in tensor_refs({"a": shared, "b": shared})] == ["a.0"]


def test_reading_needs_no_torch_numpy_or_frameworks(tmp_path: Path) -> None:
    from transformers import TrainingArguments

    _save(TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[]), tmp_path / "training_args.bin")
    _save({"numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}, tmp_path / "rng_state.pth")
    _save(_state(), tmp_path / "optimizer.pt")
    code = (
        "import sys\n"
        "for m in ('torch', 'numpy', 'transformers', 'accelerate', 'deepspeed'): sys.modules[m] = None\n"
        "from ckptctl.formats.torch_pickle import open_torch_pickle\n"
        f"for name in ('training_args.bin', 'rng_state.pth', 'optimizer.pt'):\n"
        f"    opened = open_torch_pickle({str(tmp_path)!r} + '/' + name)\n"
        "    print(name, len(opened.tensors()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["training_args.bin", "0", "rng_state.pth", "1", "optimizer.pt", str(len(_flat(_state())))]


def test_object_stores_read_the_same(tmp_path: Path) -> None:
    import fsspec

    path = _save(_state(), tmp_path / "optimizer.pt")
    url = "memory://ckptctl-test/optimizer.pt"
    with fsspec.open(url, "wb") as f:
        f.write(path.read_bytes())
    opened = open_torch_pickle(url)
    refs = dict(opened.tensors())
    assert torch.equal(load_tensor(url, refs["state.0.exp_avg"], opened), _state()["state"][0]["exp_avg"])
    assert opened.size == path.stat().st_size


def test_framework_classes_come_from_the_framework_packages() -> None:
    """`formats` names no framework: its allowlist reads each framework package's `pickle_classes`, which
    the layout registry lists, and refuses a class nobody registered."""
    import ast

    from ckptctl.formats import framework_classes
    from ckptctl.formats.torch_pickle_classes import TORCH_PICKLE_GLOBALS

    formats = Path(framework_classes.__file__).parent
    for source in formats.glob("*.py"):
        literals = [
            node.value
            for node in ast.walk(ast.parse(source.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
        ]
        assert not [s for s in literals if s.startswith(("deepspeed", "transformers", "accelerate", "trl."))], source
    registered = framework_classes.registered()
    assert ("deepspeed.runtime.zero.config", "ZeroStageEnum") in registered.classes
    assert ("transformers.trainer_utils", "SchedulerType") in registered.classes
    assert ("deepspeed.runtime.zero.config", "ZeroStageEnum") in set(TORCH_PICKLE_GLOBALS)
    stand_in = TORCH_PICKLE_GLOBALS["trl.trainer.sft_config", "SFTConfig"]
    assert issubclass(stand_in, FrameworkObject) and stand_in.stands_for == "trl.trainer.sft_config.SFTConfig"
    with pytest.raises(KeyError):
        TORCH_PICKLE_GLOBALS["trl.trainer.sft_trainer", "SFTTrainer"]
