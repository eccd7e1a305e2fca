"""Honest refusals of the allowlisting unpickler (issue 23.2): standard-library values are read as data, an
unknown class of a known ML library is "unsupported class X (from P)" (read as an opaque value by the generic
reader, so the file is not failed whole), and only a code-running global is called a forgery, its payload never
run."""

from __future__ import annotations

import collections
import datetime
import http
import json
import os
import pathlib
import pickle
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptctl.errors import UnsafePickle, UnsupportedClass
from ckptctl.formats.safe_pickle import opaque_values, safe_loads
from ckptctl.formats.torch_pickle_classes import OPAQUE_PICKLE_GLOBALS, TORCH_PICKLE_GLOBALS
from tests.conftest import CliResult

Cli = Callable[..., CliResult]

VALUES: dict[str, Any] = {
    "timeout": datetime.timedelta(days=1, seconds=2, microseconds=3),
    "saved_at": datetime.datetime(2026, 11, 28, 7, 9, 5, 123, tzinfo=datetime.UTC),
    "local": datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone(datetime.timedelta(hours=2), "CEST")),
    "day": datetime.date(2026, 11, 28),
    "at": datetime.time(7, 9, 5, 11),
    "ordered": collections.OrderedDict([("b", 1), ("a", 2)]),
    "output_dir": pathlib.PurePosixPath("/runs/a/b"),
    "relative": pathlib.Path("runs/x"),
    "windows": pathlib.PureWindowsPath("C:/runs/x"),
    "status": http.HTTPStatus.OK,
}


@pytest.mark.parametrize("protocol", [2, 4, 5])
@pytest.mark.parametrize("allowed", [TORCH_PICKLE_GLOBALS, OPAQUE_PICKLE_GLOBALS], ids=["strict", "opaque"])
def test_standard_library_values_are_read_exactly(protocol: int, allowed: Any) -> None:
    read = safe_loads(pickle.dumps(VALUES, protocol=protocol), allowed, "state.pt")
    for key in ("timeout", "saved_at", "local", "day", "at"):
        assert read[key] == VALUES[key] and type(read[key]) is type(VALUES[key]), key
    assert list(read["ordered"].items()) == [("b", 1), ("a", 2)]
    assert read["output_dir"] == "/runs/a/b" and read["relative"] == "runs/x"
    assert read["windows"] == str(VALUES["windows"])
    assert read["status"].value == 200
    assert opaque_values(read) == []


def test_a_standard_library_enum_member_keeps_its_value() -> None:
    read = safe_loads(pickle.dumps({"s": http.HTTPStatus.NOT_FOUND}), TORCH_PICKLE_GLOBALS, "x")
    assert read["s"].value == 404 and "HTTPStatus" in repr(read["s"])


class _Payload:
    """Pickles as a call of `func(*args)`."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.func, self.args


def _payloads(marker: Path) -> dict[str, tuple[str, Any]]:
    return {
        "os.system": ("posix.system", _Payload(os.system, f"touch {marker}")),
        "subprocess.Popen": ("subprocess.Popen", _Payload(subprocess.Popen, ["touch", str(marker)])),
        "builtins.eval": ("builtins.eval", _Payload(eval, f"__import__('os').system('touch {marker}')")),
    }


@pytest.mark.parametrize("name", ["os.system", "subprocess.Popen", "builtins.eval"])
@pytest.mark.parametrize("allowed", [TORCH_PICKLE_GLOBALS, OPAQUE_PICKLE_GLOBALS], ids=["strict", "opaque"])
def test_a_code_running_global_is_still_a_forgery(name: str, allowed: Any, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    global_name, payload = _payloads(marker)[name]
    with pytest.raises(UnsafePickle) as info:
        safe_loads(pickle.dumps({"ok": VALUES["timeout"], "evil": payload}, protocol=2), allowed, "state.pt")
    assert global_name in info.value.message and "unsupported class" not in info.value.message
    assert "not what it claims to be" in (info.value.hint or "")
    assert not marker.exists()


def _generation_config() -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.GenerationConfig(max_new_tokens=7)


def test_an_unknown_class_of_a_known_library_is_unsupported_not_a_forgery() -> None:
    import ckptctl  # noqa: F401  (registers the framework packages' libraries)

    data = pickle.dumps({"generation": _generation_config(), "step": 3}, protocol=2)
    qualified = "transformers.generation.configuration_utils.GenerationConfig"
    with pytest.raises(UnsupportedClass) as info:
        safe_loads(data, TORCH_PICKLE_GLOBALS, "state.pt")
    assert f"unsupported class {qualified} (from transformers)" in info.value.message
    assert "not what it claims" not in f"{info.value.message} {info.value.hint}"
    read = safe_loads(data, OPAQUE_PICKLE_GLOBALS, "state.pt")  # the generic reader skips it
    assert read["step"] == 3
    assert opaque_values(read) == [f"unsupported class {qualified} (from transformers)"]


def test_verify_of_a_file_with_an_unknown_library_class_warns(run_cli: Cli, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    saved = tmp_path / "train.pth"
    model = torch.nn.Linear(4, 2)
    torch.save({"model": model.state_dict(), "generation": _generation_config(), "step": 5}, saved)
    verified = run_cli("verify", saved, "--json")
    assert verified.exit_code == 0, verified.stdout
    problems = json.loads(verified.stdout)["problems"]
    assert [(p["kind"], p["severity"]) for p in problems] == [("unsupported_class", "warning")]
    assert (
        "unsupported class transformers.generation.configuration_utils.GenerationConfig (from transformers)"
        in (problems[0]["message"])
    )
    inspected = run_cli("inspect", saved, "--json")
    assert inspected.exit_code == 0 and json.loads(inspected.stdout)["step"] == 5
