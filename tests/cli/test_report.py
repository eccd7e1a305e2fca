"""`ckptctl report` and `diff --html`: the page holds what the run holds, is self-contained and safe, and a real
browser draws it (headless Chromium, where it is installed)."""

from __future__ import annotations

import math
import re
import shutil
import struct
import subprocess
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from ckptctl.checkpoint import CheckpointRef, CheckpointState
from ckptctl.ops.report_html import render_run
from ckptctl.ops.report_page import CheckpointRow, Curve, Drift, DriftPair, LayerChange, RunReport
from tests.conftest import CliResult

Cli = Callable[..., CliResult]

DEMO_LAYERS = ["blocks.0", "blocks.1", "embed", "head", "norm"]
TWO_MB = 2 * 1024 * 1024


@dataclass
class Page(HTMLParser):
    """The elements of a page that the tests count, and every URL it names."""

    classes: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    urls: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    text: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {k: v or "" for k, v in attrs}
        self.tags.append(tag)
        for name in values.get("class", "").split():
            self.classes.setdefault(name, []).append(values)
        self.urls += [v for k, v in values.items() if k in ("src", "href", "xlink:href", "action")]

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def parsed(html: str) -> Page:
    page = Page()
    page.feed(html)
    page.close()
    return page


def assert_self_contained(html: str, page: Page) -> None:
    assert "script" not in page.tags and "img" not in page.tags and "link" not in page.tags
    assert all(not re.match(r"\s*(https?:|//)", url) for url in page.urls), page.urls
    assert not re.search(r"url\(\s*['\"]?(https?:|//)", html)
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:|//)""", html)


@pytest.fixture(scope="module")
def demo_report(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One `report --json -o` of the demo (native, 2-rank FSDP2 native, plain DCP and HF export)."""
    from ckptctl.cli.app import main

    out = tmp_path_factory.mktemp("report") / "report.html"
    import contextlib
    import io
    import json

    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), pytest.raises(SystemExit) as exited:
        main(["report", str(demo_dir), "-o", str(out), "--json", "-q"])
    assert exited.value.code == 0
    return out, json.loads(stdout.getvalue())


def test_demo_report_shows_every_checkpoint_and_its_state(
    run_cli: Cli, demo_dir: Path, demo_report: tuple[Path, dict[str, Any]]
) -> None:
    out, doc = demo_report
    listed = run_cli("list", demo_dir, "--json").json["checkpoints"]
    assert doc["schema_version"] == 1
    assert {(c["url"], c["state"], c["latest"]) for c in doc["checkpoints"]} == {
        (c["url"], c["state"], c["latest"]) for c in listed
    }
    # resume-plan's pick of each folder: the newest step of each training run, never the HF export.
    assert sorted(c["path"] for c in doc["checkpoints"] if c["resume"]) == [
        "dcp/step-30",
        "distributed/step-30",
        "native/step-30",
    ]
    native = next(c for c in doc["checkpoints"] if c["path"] == "native/step-10")
    parts = native["bytes_by_part"]
    from safetensors.numpy import load_file

    weights = load_file(demo_dir / "native" / "step-10" / "model.safetensors")
    assert parts["model"] == sum(t.nbytes for t in weights.values())
    assert parts["model"] + parts["optimizer"] + parts["other"] == native["size_bytes"]
    assert parts["optimizer"] == 2 * parts["model"] + 4 * len(weights)  # Adam: two moments and a step per tensor

    html = out.read_text()
    page = parsed(html)
    rows = page.classes["ckpt-row"]
    assert [r["data-path"] for r in rows] == [c["path"] for c in doc["checkpoints"]]
    assert {r["data-state"] for r in rows} == {"complete"}
    assert len(page.classes["ckpt-mark"]) == len(listed)
    assert len(html.encode()) < 200_000
    assert_self_contained(html, page)


def test_demo_drift_is_each_layers_relative_change(demo_dir: Path, demo_report: tuple[Path, dict[str, Any]]) -> None:
    from safetensors.numpy import load_file

    out, doc = demo_report
    drift = {d["folder"]: d for d in doc["drift"]}
    assert set(drift) == {"dcp", "distributed", "native"}
    for folder in drift.values():
        assert folder["layers"] == DEMO_LAYERS
        assert [(p["a_step"], p["b_step"]) for p in folder["pairs"]] == [(10, 20), (20, 30)]
    # The head is one tensor: its drift is ||a - b|| / max(||a||, ||b||) of the saved weights themselves.
    a = load_file(demo_dir / "native" / "step-10" / "model.safetensors")["head.weight"].astype("float64")
    b = load_file(demo_dir / "native" / "step-20" / "model.safetensors")["head.weight"].astype("float64")
    expected = math.sqrt(((a - b) ** 2).sum()) / max(math.sqrt((a**2).sum()), math.sqrt((b**2).sum()))
    head = next(c for c in drift["native"]["pairs"][0]["layers"] if c["layer"] == "head")
    assert head["rel_l2"] == pytest.approx(expected, rel=1e-12)
    # FSDP2 on 2 ranks and one process trained the same model from the same seed: the same drift.
    assert drift["distributed"]["pairs"] == [
        {**p, "a": p["a"].replace("native", "distributed"), "b": p["b"].replace("native", "distributed")}
        for p in drift["native"]["pairs"]
    ]
    curves = {(c["folder"], c["metric"]): c for c in doc["curves"]}
    assert [p[0] for p in curves["native", "loss"]["points"]] == [10, 20, 30]
    assert curves["native", "loss"]["source"] == "checkpoints"

    page = parsed(out.read_text())
    assert len(page.classes["drift-row"]) == 3 * len(DEMO_LAYERS)
    assert {r["data-layer"] for r in page.classes["drift-row"]} == set(DEMO_LAYERS)
    assert len(page.classes["curve"]) == len(doc["curves"])


def test_trainer_report_draws_log_history(run_cli: Cli, trainer_run: Any, tmp_path: Path) -> None:
    out = tmp_path / "trainer.html"
    result = run_cli("report", trainer_run.output_dir, "-o", out, "--json", "--last", "1")
    assert result.exit_code == 0, result.stderr
    doc = result.json
    assert [c["path"] for c in doc["checkpoints"]] == ["checkpoint-2", "checkpoint-4"]
    assert [c["path"] for c in doc["checkpoints"] if c["resume"]] == ["checkpoint-4"]
    curves = {c["metric"]: c for c in doc["curves"]}
    # Every logging step of trainer_state.json's log_history, not only the checkpoints' steps.
    assert [p[0] for p in curves["loss"]["points"]] == [1, 2, 3, 4]
    assert curves["loss"]["source"] == "log" and {"grad_norm", "learning_rate"} <= set(curves)
    (drift,) = doc["drift"]
    layers = drift["layers"]
    assert "model.embed_tokens" in layers and "model.layers.0" in layers and "lm_head" in layers
    assert all(c["rel_l2"] > 0 for c in drift["pairs"][0]["layers"] if c["layer"] != "model.norm")
    page = parsed(out.read_text())
    assert [r["data-path"] for r in page.classes["ckpt-row"]] == ["checkpoint-2", "checkpoint-4"]
    assert len(page.classes["drift-row"]) == len(layers)


def _hostile_run(root: Path) -> Path:
    import torch
    from torch import nn

    from ckptctl.core import CheckpointManager

    model = nn.Module()
    model.register_parameter("<script>alert(1)</script>", nn.Parameter(torch.ones(4)))
    inner = nn.Module()
    inner.register_parameter("w", nn.Parameter(torch.ones(3)))
    model.add_module('<img src=x onerror="alert(2)">', inner)
    run = root / "<img src=x onerror=alert(3)>"
    manager = CheckpointManager(str(run))
    for step in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(step)
        manager.save(step, {"model": model}, metrics={"<b>loss</b>": 1.0 / step})
    return run


def test_names_from_checkpoints_are_shown_never_run(run_cli: Cli, tmp_path: Path) -> None:
    run = _hostile_run(tmp_path)
    out = tmp_path / "page.html"
    result = run_cli("report", run, "-o", out, "--json")
    assert result.exit_code == 0, result.stderr
    (drift,) = result.json["drift"]
    # 1+1 -> 2+2 (and 2 -> 4 for w): ||a - b|| / max(||a||, ||b||) = 1/2 in both layers.
    assert {c["layer"]: c["rel_l2"] for c in drift["pairs"][0]["layers"]} == {
        '<img src=x onerror="alert(2)">': 0.5,
        "<script>alert(1)</script>": 0.5,
    }
    html = out.read_text()
    page = parsed(html)
    assert "<script" not in html and "<img" not in html and "<b>loss" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html and "&lt;b&gt;loss&lt;/b&gt;" in html
    assert {r["data-layer"] for r in page.classes["drift-row"]} == {
        '<img src=x onerror="alert(2)">',
        "<script>alert(1)</script>",
    }
    assert_self_contained(html, page)
    _browser_check(out, tmp_path, expect_rows=2, expect_layers=2)


def test_a_hundred_checkpoints_stay_under_two_megabytes() -> None:
    """The page's worst case at 100 checkpoints: long names, every drift pair over 48 layers, 16 full curves."""
    folder = "runs/" + "x" * 80
    rows = tuple(
        CheckpointRow(
            CheckpointRef(
                f"/data/{folder}/step-{i * 1000:07d}",
                "native",
                i * 1000,
                None,
                datetime(2026, 1, 1, tzinfo=UTC),
                CheckpointState.COMPLETE if i % 7 else CheckpointState.BROKEN,
                10**9 + i,
                latest=i == 99,
            ),
            f"{folder}/step-{i * 1000:07d}",
            resume=i == 99,
            bytes_by_part={"model": 3 * 10**8, "optimizer": 6 * 10**8, "other": 10**8 + i},
            prune="keep" if i > 96 else "delete",
            prune_reasons=("keep_last=3",) * 3,
            prune_frees=0 if i > 96 else 10**9,
        )
        for i in range(100)
    )
    layers = tuple(f"model.language_model.decoder.layers.{k}" for k in range(48))
    pairs = tuple(
        DriftPair(
            rows[i].path,
            rows[i + 1].path,
            i * 1000,
            (i + 1) * 1000,
            tuple(LayerChange(name, 1e-3 * (k + 1), 2e-3, 9, 10**7) for k, name in enumerate(layers)),
        )
        for i in range(99)
    )
    curves = tuple(
        Curve(folder, f"train/metric_{m}", tuple((s, 1.0 / (s + 1)) for s in range(1000)), "log") for m in range(16)
    )
    report = RunReport(
        "/data/" + folder,
        datetime(2026, 1, 2, tzinfo=UTC),
        rows,
        "keep_last=3",
        "keep_full=1",
        97 * 10**9,
        0,
        curves,
        (Drift(folder, pairs, layers),),
        True,
    )
    html = render_run(report)
    assert len(html.encode()) <= TWO_MB
    page = parsed(html)
    assert len(page.classes["ckpt-row"]) == len(page.classes["ckpt-mark"]) == 100
    assert len(page.classes["drift-row"]) == 48 and len(page.classes["curve"]) == 16


def test_diff_html_draws_each_layer(run_cli: Cli, demo_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "diff.html"
    a, b = demo_dir / "native" / "step-10", demo_dir / "native" / "step-30"
    result = run_cli("diff", a, b, "--html", out, "--json")
    assert result.exit_code == 1, result.stderr
    assert "equal_tensors" not in result.json  # the page needs them; the document lists them only with --all
    html = out.read_text()
    page = parsed(html)
    assert [r["data-layer"] for r in page.classes["diff-row"]] == DEMO_LAYERS
    assert_self_contained(html, page)


def test_report_without_output_is_a_usage_error(run_cli: Cli, demo_dir: Path) -> None:
    result = run_cli("report", demo_dir / "native")
    assert result.exit_code == 2 and "--output" in result.stderr


# --------------------------------------------------------------------------------------------------
# A real browser.
# --------------------------------------------------------------------------------------------------


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if found is None:
        pytest.skip("headless Chromium is not on PATH (Debian: apt-get install -y chromium; .ci/run installs it)")
    return found


def _browser(page: Path, profile: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]
    return subprocess.run(
        [_chromium(), *flags, f"--user-data-dir={profile}", *extra, page.as_uri()],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )


def _browser_check(page: Path, tmp: Path, *, expect_rows: int, expect_layers: int) -> None:
    """Chromium's DOM of the page: the rows and drift rows are there, and no element it parsed runs anything."""
    dom = _browser(page, tmp / "profile", "--dump-dom").stdout
    shown = parsed(dom)
    assert len(shown.classes["ckpt-row"]) == expect_rows
    assert len(shown.classes["drift-row"]) == expect_layers
    assert "script" not in shown.tags and "img" not in shown.tags
    assert "svg" in shown.tags and "rect" in shown.tags


def test_chromium_draws_the_demo_report(demo_report: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    out, doc = demo_report
    _browser_check(out, tmp_path, expect_rows=len(doc["checkpoints"]), expect_layers=3 * len(DEMO_LAYERS))
    shot = tmp_path / "shot.png"
    _browser(out, tmp_path / "profile2", "--hide-scrollbars", "--window-size=1100,1400", f"--screenshot={shot}")
    width, height, pixels = _png_bytes(shot.read_bytes())
    assert (width, height) == (1100, 1400)
    # Not blank: a page of text, bars and a heatmap has many colours; an empty one a handful.
    assert len(set(pixels)) > 64


def _png_bytes(data: bytes) -> tuple[int, int, bytes]:
    """(width, height, the decompressed scanlines) of a PNG, with the standard library only."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    chunks, position = [], 8
    while position < len(data):
        (length,) = struct.unpack(">I", data[position : position + 4])
        kind = data[position + 4 : position + 8]
        if kind == b"IDAT":
            chunks.append(data[position + 8 : position + 8 + length])
        position += 12 + length
    return width, height, zlib.decompress(b"".join(chunks))
