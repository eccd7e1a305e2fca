"""`convert`, `verify` and `diff` split over 2 ranks (`ops.distributed_work`): launched by torchrun
(`python -m torch.distributed.run`, what the `torchrun` script runs) or by `--workers 2`, on real multi-rank
checkpoints (the demo's 2-rank FSDP2 DCP run, DeepSpeed ZeRO-3), against the single-process result.

Each launch starts two processes that import torch and join a gloo group: few launches, one per behaviour.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptctl.formats.manifest import DIGESTS_NAME
from ckptctl.layouts import get_layout
from ckptctl.ops.distributed_work import balance
from tests.conftest import CliResult, copy_tree, torch_zip_records
from tests.writers.deepspeed_writer import WrittenDeepSpeed

Cli = Callable[..., CliResult]
REPO = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
#: Small shards: a tiny model still makes a dozen files to share between the ranks.
SHARDS = ["--max-shard-size", "20KB"]


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    """`command` with this checkout first on the path and no rank variables of an outer job; once more when
    gloo aborted a rank at start-up or teardown (SIGABRT on a loaded machine, see conftest._build_retrying)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", CKPTCTL_DEBUG="0")
    for _ in range(2):
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
        if not any(s in done.stderr for s in ("exitcode: -6", "Signal 6", "killed by SIGABRT")):
            break
    return done


def _ckptctl(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, "-m", "ckptctl", *map(str, args), "--workers", "2"])


def _torchrun(*args: str | Path, module: str = "ckptctl") -> subprocess.CompletedProcess[str]:
    return _run([*TORCHRUN, "-m", module, *map(str, args)])


def _document(stdout: str) -> dict[str, Any]:
    """The one JSON document rank 0 printed (the other ranks print none)."""
    doc: dict[str, Any] = json.loads(stdout)
    return doc


def _same_report(single: dict[str, Any], two: dict[str, Any]) -> None:
    """The same report but for `bytes_read`, which counts every rank's reads (a measurement: this test
    process's caches spare the single-process run some header reads that fresh ranks make)."""

    def counts(doc: Any) -> list[int]:
        if isinstance(doc, dict):
            return [n for k, v in doc.items() for n in ([v] if k == "bytes_read" else counts(v))]
        return [n for v in doc for n in counts(v)] if isinstance(doc, list) else []

    def without(doc: Any) -> Any:
        if isinstance(doc, dict):
            return {k: without(v) for k, v in doc.items() if k != "bytes_read"}
        return [without(v) for v in doc] if isinstance(doc, list) else doc

    assert without(two) == without(single)
    for one, both in zip(counts(single), counts(two), strict=True):
        assert both >= 0.75 * one  # rank 0 alone reads about half of what is read


def _assert_same_output(
    one: Path, two: Path, doc_one: dict[str, Any], doc_two: dict[str, Any], data: str = ".safetensors"
) -> None:
    """Every file byte for byte, the digests' records (not their time), and the report but for DST and time."""
    names = sorted(p.name for p in one.iterdir())
    assert names == sorted(p.name for p in two.iterdir())
    assert len([n for n in names if n.endswith(data)]) > 2  # something to share between the ranks
    for name in names:
        if name != DIGESTS_NAME:
            assert (one / name).read_bytes() == (two / name).read_bytes(), name
    records = [json.loads((folder / DIGESTS_NAME).read_text())["files"] for folder in (one, two)]
    assert records[0] == records[1]
    # Every rank's reads count (rank 0 alone reads about half the tensor bytes); the exact count is a
    # measurement, like the time: each rank reads the headers of the source files it copies from.
    assert doc_two["bytes_read"] >= doc_two["bytes"]
    for doc in (doc_one, doc_two):
        del doc["dst"], doc["seconds"], doc["bytes_read"]
    assert doc_one == doc_two


def test_balance_shares_items_by_bytes() -> None:
    # Largest first to the least loaded rank: 50 | 40, 30 | 20 (70 = 70: rank 0) | 10 | 0.
    assert balance([50, 10, 40, 30, 20, 0], 2) == [[0, 1, 4], [2, 3, 5]]
    assert sorted(i for share in balance(list(range(100)), 7) for i in share) == list(range(100))
    loads = [sum(share) for share in balance(list(range(100)), 4)]
    assert max(loads) - min(loads) <= 99  # never more apart than the largest item
    assert balance([5], 3) == [[0], [], []]


def test_torchrun_convert_of_a_two_rank_dcp_checkpoint_is_byte_identical(
    run_cli: Cli, demo_dir: Path, tmp_path: Path
) -> None:
    src = demo_dir / "dcp" / "step-30"  # 2-rank FSDP2 save
    single = run_cli("convert", src, tmp_path / "one", *SHARDS, "--json")
    assert single.exit_code == 0, single.stderr
    two = _torchrun("convert", src, tmp_path / "two", *SHARDS, "--json")
    assert two.returncode == 0, two.stderr
    _assert_same_output(tmp_path / "one", tmp_path / "two", single.json, _document(two.stdout))


def test_workers_convert_of_a_zero_checkpoint_is_byte_identical(
    run_cli: Cli, deepspeed_runs: dict[int, WrittenDeepSpeed], tmp_path: Path
) -> None:
    src = deepspeed_runs[3].save_dir  # fp32 master weights rebuilt from the ZeRO-3 partitions of 2 ranks
    single = run_cli("convert", src, tmp_path / "one", *SHARDS, "--json")
    assert single.exit_code == 0, single.stderr
    two = _ckptctl("convert", src, tmp_path / "two", *SHARDS, "--json")
    assert two.returncode == 0, two.stderr
    _assert_same_output(tmp_path / "one", tmp_path / "two", single.json, _document(two.stdout))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load in this one process
def test_workers_convert_to_dcp_is_byte_identical_and_loads(run_cli: Cli, demo_dir: Path, tmp_path: Path) -> None:
    """`--to dcp`: the ranks share the data files (`--dcp-file-size`), rank 0 writes `.metadata`, which is
    byte-identical too (no random save id), and `dcp.load` reads the tensors of the HF source."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    src, args = demo_dir / "hf", ["--to", "dcp", "--dcp-file-size", "100KB", "--json"]
    single = run_cli("convert", src, tmp_path / "one", *args)
    assert single.exit_code == 0, single.stderr
    two = _ckptctl("convert", src, tmp_path / "two", *args)
    assert two.returncode == 0, two.stderr
    _assert_same_output(tmp_path / "one", tmp_path / "two", single.json, _document(two.stdout), data=".distcp")
    want = {k: v for path in src.glob("*.safetensors") for k, v in load_file(path).items()}
    state = {"model": {k: torch.zeros_like(v) for k, v in want.items()}}
    dcp.load(state, checkpoint_id=str(tmp_path / "two"), no_dist=True)
    assert want and all(torch.equal(state["model"][k], v) for k, v in want.items())


@pytest.mark.parametrize("source", ["dcp", "zero"])
def test_a_rank_killed_mid_conversion_leaves_nothing_at_dst(
    run_cli: Cli, demo_dir: Path, deepspeed_runs: dict[int, WrittenDeepSpeed], tmp_path: Path, source: str
) -> None:
    src = demo_dir / "dcp" / "step-30" if source == "dcp" else deepspeed_runs[3].save_dir
    parent = tmp_path / "exports"
    parent.mkdir()
    done = _torchrun("convert", src, parent / "out", *SHARDS, "--json", module="tests.ops._killed_rank")
    assert done.returncode != 0
    error = _document(done.stdout)["error"]  # rank 0 reports the failure it met
    if error["type"] == "Interrupted":
        # torchrun's SIGTERM to the rest of a failed job reached rank 0 before it noticed rank 1 was gone
        # (1 run in 3 on a loaded machine): it stopped as on Ctrl-C and said so.
        assert error["exit_code"] == 130
    else:
        assert error["type"] == "RankFailed" and error["exit_code"] == 2
        assert "rank 0 lost contact with the other ranks" in error["message"]
    # No DST. Rank 0 removes its staging folder unless torchrun's SIGTERM ends it first (seen with the ZeRO
    # source on a loaded machine): then, as after a SIGKILL of one process, the next conversion removes it.
    assert all(p.name.startswith(".out.ckptctl-convert-") for p in parent.iterdir()), list(parent.iterdir())
    again = run_cli("convert", src, parent / "out", *SHARDS, "--json")  # the next conversion, in one process
    assert again.exit_code == 0, again.stderr
    assert [p.name for p in parent.iterdir()] == ["out"]


def test_verify_over_two_ranks_gives_the_single_process_report(run_cli: Cli, demo_dir: Path, tmp_path: Path) -> None:
    run = copy_tree(demo_dir / "distributed", tmp_path / "run")  # 3 native 2-rank checkpoints with manifests
    victim = max((p for p in (run / "step-20").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    single = run_cli("verify", run, "--deep", "--check-finite", "--json")
    assert single.exit_code == 1, single.stderr
    two = _ckptctl("verify", run, "--deep", "--check-finite", "--json")
    assert two.returncode == 1, two.stderr  # every rank exits with the report's code
    _same_report(single.json, _document(two.stdout))
    assert not single.json["ok"] and any(r["problems"] for r in single.json["results"])


def test_workers_verify_checks_the_crc_32s_of_a_two_rank_dcp_checkpoint(
    run_cli: Cli, demo_dir: Path, tmp_path: Path
) -> None:
    """No manifest: the ranks share the CRC-32 checks of the DCP items by bytes; a clean save passes with
    every record checked, and a flipped byte is named by its record, as in one process."""
    checkpoint = copy_tree(demo_dir / "dcp" / "step-30", tmp_path / "step-30")  # 2-rank FSDP2 save
    clean = _ckptctl("verify", checkpoint, "--json")
    assert clean.returncode == 0, clean.stderr
    _same_report(run_cli("verify", checkpoint, "--json").json, _document(clean.stdout))
    assert _document(clean.stdout)["crc_records_checked"] > 0
    file, member = max(torch_zip_records(checkpoint, get_layout("dcp")), key=lambda r: (r[1].size, r[0]))
    data = bytearray((checkpoint / file).read_bytes())
    data[member.start + member.size // 2] ^= 0xFF
    (checkpoint / file).write_bytes(bytes(data))
    single = run_cli("verify", checkpoint, "--json")
    assert single.exit_code == 1, single.stdout
    two = _ckptctl("verify", checkpoint, "--json")
    assert two.returncode == 1, two.stderr
    _same_report(single.json, _document(two.stdout))
    assert [(p["kind"], p["path"], p.get("record")) for p in single.json["problems"]] == [
        ("crc_mismatch", file, member.name)
    ]


def test_diff_over_two_ranks_gives_the_single_process_report(run_cli: Cli, demo_dir: Path) -> None:
    a, b = demo_dir / "dcp" / "step-20", demo_dir / "dcp" / "step-30"
    single = run_cli("diff", a, b, "--all", "--json")
    assert single.exit_code == 1, single.stderr
    two = _ckptctl("diff", a, b, "--all", "--json")  # (torchrun itself is launched by the convert tests)
    assert two.returncode == 1, two.stderr
    _same_report(single.json, _document(two.stdout))
    assert single.json["changed"] and single.json["bytes_read"] > 0


def test_without_a_launcher_nothing_joins(run_cli: Cli, demo_dir: Path, tmp_path: Path) -> None:
    """Rank variables inherited from a training job's rank (a subprocess of train.py) do not make ckptctl
    join that job: the parent has them too, so this is one process of its own."""
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    env.update(PYTHONPATH=str(REPO))
    env.pop("CKPTCTL_DISTRIBUTED", None)
    shutil.copytree(demo_dir / "hf", tmp_path / "hf")
    code = "import os, sys; from ckptctl.cli.app import main; main(sys.argv[1:])"
    wrapper = f"import os, subprocess, sys; sys.exit(subprocess.run([sys.executable, '-c', {code!r}, *sys.argv[1:]]).returncode)"
    done = subprocess.run(
        [sys.executable, "-c", wrapper, "verify", str(tmp_path / "hf"), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ok"] is True
