"""A crafted non-tensor ("bytes") item in a multi-rank native checkpoint must never run (issue 16, point 1).

torch DCP stores every non-tensor value of a state dict (an optimizer's `lr`, `betas`, `params`) as a
torch.save archive and its own load planner reads it back with `torch.load(weights_only=False)`, which
runs whatever the archive's pickle asks for. The checkpoint here is the real 2-rank FSDP2 save of
`ckptctl demo` (written by `CheckpointManager` through DCP); one bytes item is replaced by an archive
carrying a payload, `.metadata` re-pointed at it and the manifest's size and digest updated, as an
attacker sharing a checkpoint would. `restore()` must raise a ckptctl error and `verify` (structure,
`--deep`, JSON) must report `unsafe_pickle`, and the payload's marker file must never appear.
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ckptctl.core import CheckpointManager
from ckptctl.errors import CkptctlError, CorruptCheckpoint, UnsafePickle
from tests.hostile.conftest import demo_state, refresh_manifest
from tests.hostile.harness import run_ckptctl
from tests.hostile.pickle_payloads import PAYLOADS

#: The bytes item replaced in every case: AdamW's learning rate of the first parameter group.
TARGET_ITEM = "optimizer.param_groups.0.lr"


def _payloads(marker: Path) -> dict[str, bytes]:
    """Pickles (data.pkl contents) that create `marker` when unpickled by `pickle`/`torch.load`."""
    m = str(marker)
    touch = f"touch {m}"
    py_touch = f"open({m!r}, 'w').close()"

    def reduce(module: str, name: str, arg: str, proto: int = 2) -> bytes:
        # GLOBAL + one-string tuple + REDUCE, the classic payload, in a chosen protocol framing
        head = b"\x80" + bytes([proto]) if proto >= 2 else b""
        arg_bytes = arg.encode()
        return (
            head
            + b"c"
            + module.encode()
            + b"\n"
            + name.encode()
            + b"\n"
            + b"X"
            + len(arg_bytes).to_bytes(4, "little")
            + arg_bytes
            + b"\x85R."
        )

    class Popen:
        def __reduce__(self) -> tuple[object, ...]:
            import subprocess

            return (subprocess.call, (["touch", m],))

    class InList:
        def __reduce__(self) -> tuple[object, ...]:
            import os

            return (os.system, (touch,))

    return {
        "os_system_proto2": reduce("os", "system", touch),
        "posix_system_proto0": b"cposix\nsystem\n(V" + touch.encode() + b"\ntR.",
        "builtins_eval": reduce("builtins", "eval", py_touch),
        "builtins_exec": reduce("builtins", "exec", py_touch),
        "py2_builtin_eval": reduce("__builtin__", "eval", py_touch, proto=1),
        "subprocess_call": pickle.dumps(Popen(), protocol=4),
        "inst_opcode": b"(S'" + touch.encode() + b"'\nios\nsystem\n.",
        "obj_opcode": b"(cos\nsystem\nS'" + touch.encode() + b"'\no.",
        "stack_global_proto4": pickle.dumps(InList(), protocol=4),
        "nested_in_dict": pickle.dumps({"lr": 0.1, "hook": [InList()]}, protocol=2),
        "nested_in_tuple": pickle.dumps((0.9, (0.999, InList())), protocol=5),
        # a persistent id that is itself a payload: torch.load builds the pid before looking at it
        "persistent_id": b"\x80\x02cos\nsystem\nX" + len(touch).to_bytes(4, "little") + touch.encode() + b"\x85RQ.",
        "importlib_getattr": (
            b"\x80\x02cbuiltins\ngetattr\ncimportlib\nimport_module\nX\x02\x00\x00\x00os\x85RX\x06\x00\x00\x00system\x86R"
            + b"X"
            + len(touch).to_bytes(4, "little")
            + touch.encode()
            + b"\x85R."
        ),
    }


def _torch_save_archive_with(data_pkl: bytes) -> bytes:
    """A torch.save archive (as `DefaultSavePlanner` writes a bytes item) whose `data.pkl` is replaced."""
    template = io.BytesIO()
    torch.save(0.003, template)
    out = io.BytesIO()
    with zipfile.ZipFile(template) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            body = data_pkl if info.filename.endswith("/data.pkl") else src.read(info)
            dst.writestr(info.filename, body)
    return out.getvalue()


def _plant(step_dir: Path, archive: bytes) -> None:
    """Append `archive` to a data file, point TARGET_ITEM's storage record at it, fix the manifest."""
    dcp_dir = step_dir / "dcp"
    with open(dcp_dir / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own test checkpoint, written by torch in this session
    index = next(i for i in metadata.storage_data if i.fqn == TARGET_ITEM)
    info = metadata.storage_data[index]
    data_file = dcp_dir / info.relative_path
    offset = data_file.stat().st_size
    with open(data_file, "ab") as f:
        f.write(archive)
    metadata.storage_data[index] = _StorageInfo(info.relative_path, offset, len(archive))
    with open(dcp_dir / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    refresh_manifest(step_dir, "dcp/.metadata", f"dcp/{info.relative_path}")


@pytest.fixture(scope="session")
def hostile_runs(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Path], Path]:
    """One copy of the demo's 2-rank run per payload, its newest step planted; and the marker path."""
    root = tmp_path_factory.mktemp("hostile-bytes-items")
    marker = root / "PAYLOAD_RAN"
    runs = {}
    for name, data_pkl in _payloads(marker).items():
        run = root / name
        shutil.copytree(demo_dir / "distributed", run)
        _plant(run / "step-30", _torch_save_archive_with(data_pkl))
        runs[name] = run
    return runs, marker


def test_the_payloads_are_live(tmp_path: Path) -> None:
    """Each crafted archive does run under torch DCP's own reader (`torch.load(weights_only=False)`), so the
    tests below would catch a restore or verify that let it through."""
    marker = tmp_path / "ran"
    for name, data_pkl in _payloads(marker).items():
        marker.unlink(missing_ok=True)
        try:
            torch.load(io.BytesIO(_torch_save_archive_with(data_pkl)), weights_only=False)
        except Exception:
            pass  # most payloads return a non-value (an exit status) and torch.load complains afterwards
        assert marker.exists(), f"payload {name} did not run under torch.load(weights_only=False)"


PAYLOAD_NAMES = sorted(_payloads(Path("/x")))


@pytest.mark.parametrize("name", PAYLOAD_NAMES)
def test_restore_refuses_a_crafted_bytes_item(name: str, hostile_runs: tuple[dict[str, Path], Path]) -> None:
    runs, marker = hostile_runs
    with pytest.raises(CkptctlError) as caught:
        CheckpointManager(str(runs[name])).restore(demo_state(), step=30)
    assert not marker.exists(), f"the {name} payload ran inside restore()"
    assert isinstance(caught.value, UnsafePickle) or "pickle" in caught.value.message
    assert TARGET_ITEM in caught.value.message


def test_restore_of_the_clean_run_loads_the_saved_values(demo_dir: Path, tmp_path: Path) -> None:
    """The safe reader loads real bytes items with their saved values (not defaults)."""
    run = shutil.copytree(demo_dir / "distributed", tmp_path / "run")
    state = demo_state()
    optimizer: torch.optim.AdamW = state["optimizer"]  # type: ignore[assignment]
    optimizer.param_groups[0]["lr"] = 123.0
    optimizer.param_groups[0]["betas"] = (0.1, 0.2)
    CheckpointManager(str(run)).restore(state, step=30)
    group = optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(3e-3)
    assert tuple(group["betas"]) == (0.9, 0.999)
    assert group["weight_decay"] == 0.01


@pytest.mark.parametrize("deep", [False, True])
@pytest.mark.parametrize("name", ["os_system_proto2", "inst_opcode", "nested_in_tuple", "persistent_id"])
def test_verify_reports_unsafe_pickle(name: str, deep: bool, hostile_runs: tuple[dict[str, Path], Path]) -> None:
    runs, marker = hostile_runs
    args = ["verify", str(runs[name] / "step-30"), "--json", *(["--deep"] if deep else [])]
    outcome = run_ckptctl(args)
    outcome.assert_refused(1)
    report = json.loads(outcome.stdout)
    assert report["ok"] is False
    unsafe = [p for p in report["problems"] if p["kind"] == "unsafe_pickle"]
    assert unsafe, report["problems"]
    assert any(TARGET_ITEM in p["message"] for p in unsafe)
    assert not marker.exists()


def test_verify_of_the_run_fails_and_resume_plan_skips_the_step(hostile_runs: tuple[dict[str, Path], Path]) -> None:
    runs, marker = hostile_runs
    run = runs["builtins_eval"]
    verify = run_ckptctl(["verify", str(run), "--json"])
    verify.assert_refused(1)
    plan = run_ckptctl(["resume-plan", str(run), "--json"])
    assert plan.returncode == 0, plan.stderr
    chosen = json.loads(plan.stdout)["checkpoint"]
    assert chosen is not None and chosen["step"] == 20
    assert not marker.exists()


@pytest.fixture(scope="session")
def flooded_runs(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """(where, payload) -> a copy of the demo's 2-rank run whose newest step holds a hostile pickle of
    `pickle_payloads` (deep, flooding, copying; no code-running global) as `dcp/.metadata` or as the pickle
    of TARGET_ITEM's bytes item."""
    root = tmp_path_factory.mktemp("hostile-dcp-pickles")
    runs = {}
    for name, build in PAYLOADS.items():
        for where in ("metadata", "bytes_item"):
            run = shutil.copytree(demo_dir / "distributed", root / f"{where}-{name}")
            step = run / "step-30"
            if where == "metadata":
                (step / "dcp" / ".metadata").write_bytes(build())
                refresh_manifest(step, "dcp/.metadata")
            else:
                _plant(step, _torch_save_archive_with(build()))
            runs[where, name] = run
    return runs


@pytest.mark.parametrize("where", ["metadata", "bytes_item"])
@pytest.mark.parametrize("name", list(PAYLOADS))
def test_restore_raises_a_ckptctl_error_for_a_hostile_dcp_pickle(
    name: str, where: str, flooded_runs: dict[tuple[str, str], Path]
) -> None:
    # Before (issue 21.5): torch's CheckpointException for every hostile .metadata (torch swallowed our
    # refusal and retried per-rank metadata), a SIGSEGV for the deep tuple key as a bytes item.
    with pytest.raises(CorruptCheckpoint) as caught:  # UnsafePickle is one
        CheckpointManager(str(flooded_runs[where, name])).restore(demo_state(), step=30)
    assert (".metadata" if where == "metadata" else TARGET_ITEM) in caught.value.message
