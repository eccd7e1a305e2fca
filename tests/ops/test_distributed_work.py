"""`convert`, `verify` and `diff` split over 2 ranks (`ops.distributed_work`): launched by torchrun
(`torch.distributed.run`, what the `torchrun` script runs, in a process forked from a server that has imported
torch: tests/ops/_torchrun.py; its ranks are fresh interpreters) or by `--workers 2`, on real multi-rank
checkpoints (the demo's 2-rank FSDP2 DCP run, DeepSpeed ZeRO-3), against the single-process result.

Each launch starts two processes that import torch and join a gloo group: few launches. The commands that
succeed or report a problem run in one torchrun job (`two_rank_job`: its ranks run them one after another,
tests/ops/_commands_in_ranks.py); `--workers 2` launches the verify of a run, and a job whose rank is killed
is a job of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ckptctl.formats.manifest import DIGESTS_NAME
from ckptctl.layouts import get_layout
from ckptctl.ops.distributed_work import balance
from tests.conftest import CliResult, copy_tree, torch_zip_records
from tests.ops._torchrun import launch as _torchrun_launch
from tests.writers.deepspeed_writer import WrittenDeepSpeed

Cli = Callable[..., CliResult]
REPO = Path(__file__).resolve().parents[2]
#: `torchrun`'s arguments before the module (tests/ops/_torchrun.py starts it).
TORCHRUN = ["--standalone", "--nproc-per-node", "2"]
#: Small shards: a tiny model still makes a dozen files to share between the ranks. The sources (the demo's toy
#: model, a DeepSpeed save) keep no config: their stored names are written, as asked.
SHARDS = ["--max-shard-size", "20KB", "--mapping", "none"]


def _environment() -> dict[str, str]:
    """This process's environment with this checkout first on the path and no rank variables of an outer job."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", CKPTCTL_DEBUG="0")
    return env


def _aborted(done: subprocess.CompletedProcess[str]) -> bool:
    """Whether gloo aborted a rank at start-up or teardown (SIGABRT on a loaded machine, see conftest._build_retrying)."""
    return any(s in done.stderr for s in ("exitcode: -6", "Signal 6", "killed by SIGABRT"))


def _retried(start: Callable[[], subprocess.CompletedProcess[str]]) -> subprocess.CompletedProcess[str]:
    """`start()`; once more when gloo aborted a rank."""
    for _ in range(2):
        done = start()
        if not _aborted(done):
            break
    return done


def _ckptctl(*args: str | Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "ckptctl", *map(str, args), "--workers", "2"]
    return _retried(
        lambda: subprocess.run(command, capture_output=True, text=True, env=_environment(), cwd=REPO, timeout=300)
    )


def _torchrun(*args: str | Path, module: str = "ckptctl") -> subprocess.CompletedProcess[str]:
    """`torchrun --nproc-per-node 2 -m MODULE ARGS` (tests/ops/_torchrun.py) under `_environment()`."""
    command = [*TORCHRUN, "-m", module, *map(str, args)]
    return _retried(lambda: _torchrun_launch(command, _environment(), REPO, timeout=300))


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


@dataclass(frozen=True)
class TwoRankJob:
    """What the commands of one torchrun job (`run_two_rank_job`) did, by name: exit codes, streams, outputs."""

    folder: Path
    #: The record `verify_flipped` finds changed: (file in the checkpoint, record name).
    flipped: tuple[str, str] = ("", "")

    def code(self, name: str) -> int:
        """The command's exit code, the same on every rank (each rank exits with the report's code)."""
        codes = [json.loads((self.folder / f"codes.{rank}.json").read_text())[name] for rank in (0, 1)]
        assert codes[0] == codes[1], (name, codes, self.stderr(name))
        return int(codes[0])

    def stderr(self, name: str) -> str:
        return "".join((self.folder / f"{name}.{rank}.err").read_text() for rank in (0, 1))

    def document(self, name: str) -> dict[str, Any]:
        """The one JSON document rank 0 printed (the other ranks print none)."""
        assert (self.folder / f"{name}.1.out").read_text() == ""
        return _document((self.folder / f"{name}.0.out").read_text())

    def args(self, name: str) -> list[str]:
        """The command's arguments (after `ckptctl`)."""
        args: list[str] = json.loads((self.folder / "spec.json").read_text())[name]
        return args

    def path(self, name: str) -> Path:
        """A command's DST, or the checkpoint it verified: a folder named as the command."""
        return self.folder / name


def run_two_rank_job(base: Path, spec: Callable[[Path], dict[str, list[Any]]]) -> Path:
    """Run the commands `spec(FOLDER)` names in one `torchrun --nproc-per-node 2` job (their outputs go to
    FOLDER, in `base`) and return FOLDER; once more, with a fresh FOLDER, when gloo aborted a rank before
    the commands ended (at start-up)."""
    for attempt in range(2):
        folder = base / f"job-{attempt}"
        folder.mkdir()
        commands = {name: [str(a) for a in args] for name, args in spec(folder).items()}
        (folder / "spec.json").write_text(json.dumps(commands))
        done = _torchrun_launch(
            [*TORCHRUN, "-m", "tests.ops._commands_in_ranks", str(folder / "spec.json"), str(folder)],
            _environment(),
            REPO,
            timeout=600,
        )
        if not _aborted(done) or all((folder / f"codes.{rank}.json").exists() for rank in (0, 1)):
            # An abort once every rank's commands ended came at `leave` or at interpreter teardown: what a user's
            # `torchrun ckptctl ...` would see after the work is done, a failure of ckptctl's (see
            # test_leaving_the_group_stops_its_threads), not retried.
            break
    assert done.returncode == 0, done.stderr[-4000:]
    return folder


@pytest.fixture(scope="module")
def two_rank_job(
    demo_dir: Path, deepspeed_runs: dict[int, WrittenDeepSpeed], tmp_path_factory: pytest.TempPathFactory
) -> TwoRankJob:
    """One `torchrun --nproc-per-node 2` job running each command the tests below compare with one process.

    Its inputs are made first: `verify_clean` and `verify_flipped` verify copies of the demo's 2-rank FSDP2
    DCP save, the second with one byte of its largest CRC-checked record flipped."""
    flipped_records: list[tuple[str, str]] = []

    def spec(folder: Path) -> dict[str, list[Any]]:
        copy_tree(demo_dir / "dcp" / "step-30", folder / "verify_clean")
        flipped = copy_tree(demo_dir / "dcp" / "step-30", folder / "verify_flipped")
        file, member = max(torch_zip_records(flipped, get_layout("dcp")), key=lambda r: (r[1].size, r[0]))
        data = bytearray((flipped / file).read_bytes())
        data[member.start + member.size // 2] ^= 0xFF
        (flipped / file).write_bytes(bytes(data))
        flipped_records.append((file, member.name))
        return {
            "convert_dcp": ["convert", demo_dir / "dcp" / "step-30", folder / "convert_dcp", *SHARDS, "--json"],
            "convert_zero": ["convert", deepspeed_runs[3].save_dir, folder / "convert_zero", *SHARDS, "--json"],
            "convert_to_dcp": ["convert", demo_dir / "hf", folder / "convert_to_dcp", *TO_DCP],
            "verify_clean": ["verify", folder / "verify_clean", "--json"],
            "verify_flipped": ["verify", flipped, "--json"],
            "diff": ["diff", demo_dir / "dcp" / "step-20", demo_dir / "dcp" / "step-30", "--all", "--json"],
        }

    folder = run_two_rank_job(tmp_path_factory.mktemp("two-rank-job"), spec)
    return TwoRankJob(folder, flipped_records[-1])


#: `convert --to dcp` in small data files, so that the ranks share several.
TO_DCP = ["--to", "dcp", "--dcp-file-size", "100KB", "--json"]
#: The tests sharing `two_rank_job` run on one xdist worker: the job runs once.
shares_the_job = pytest.mark.xdist_group("two_rank_job")


def test_balance_shares_items_by_bytes() -> None:
    # Largest first to the least loaded rank: 50 | 40, 30 | 20 (70 = 70: rank 0) | 10 | 0.
    assert balance([50, 10, 40, 30, 20, 0], 2) == [[0, 1, 4], [2, 3, 5]]
    assert sorted(i for share in balance(list(range(100)), 7) for i in share) == list(range(100))
    loads = [sum(share) for share in balance(list(range(100)), 4)]
    assert max(loads) - min(loads) <= 99  # never more apart than the largest item
    assert balance([5], 3) == [[0], [], []]


@shares_the_job
def test_torchrun_convert_of_a_two_rank_dcp_checkpoint_is_byte_identical(
    run_cli: Cli, demo_dir: Path, two_rank_job: TwoRankJob, tmp_path: Path
) -> None:
    src = demo_dir / "dcp" / "step-30"  # 2-rank FSDP2 save
    single = run_cli("convert", src, tmp_path / "one", *SHARDS, "--json")
    assert single.exit_code == 0, single.stderr
    assert two_rank_job.code("convert_dcp") == 0, two_rank_job.stderr("convert_dcp")
    two = two_rank_job.path("convert_dcp")
    _assert_same_output(tmp_path / "one", two, single.json, two_rank_job.document("convert_dcp"))


@shares_the_job
def test_two_rank_convert_of_a_zero_checkpoint_is_byte_identical(
    run_cli: Cli, deepspeed_runs: dict[int, WrittenDeepSpeed], two_rank_job: TwoRankJob, tmp_path: Path
) -> None:
    src = deepspeed_runs[3].save_dir  # fp32 master weights rebuilt from the ZeRO-3 partitions of 2 ranks
    single = run_cli("convert", src, tmp_path / "one", *SHARDS, "--json")
    assert single.exit_code == 0, single.stderr
    assert two_rank_job.code("convert_zero") == 0, two_rank_job.stderr("convert_zero")
    two = two_rank_job.path("convert_zero")
    _assert_same_output(tmp_path / "one", two, single.json, two_rank_job.document("convert_zero"))


@shares_the_job
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.load in this one process
def test_two_rank_convert_to_dcp_is_byte_identical_and_loads(
    run_cli: Cli, demo_dir: Path, two_rank_job: TwoRankJob, tmp_path: Path
) -> None:
    """`--to dcp`: the ranks share the data files (`--dcp-file-size`), rank 0 writes `.metadata`, which is
    byte-identical too (no random save id), and `dcp.load` reads the tensors of the HF source."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    src = demo_dir / "hf"
    single = run_cli("convert", src, tmp_path / "one", *TO_DCP)
    assert single.exit_code == 0, single.stderr
    assert two_rank_job.code("convert_to_dcp") == 0, two_rank_job.stderr("convert_to_dcp")
    two = two_rank_job.path("convert_to_dcp")
    _assert_same_output(tmp_path / "one", two, single.json, two_rank_job.document("convert_to_dcp"), data=".distcp")
    want = {k: v for path in src.glob("*.safetensors") for k, v in load_file(path).items()}
    state = {"model": {k: torch.zeros_like(v) for k, v in want.items()}}
    dcp.load(state, checkpoint_id=str(two), no_dist=True)
    assert want and all(torch.equal(state["model"][k], v) for k, v in want.items())


@shares_the_job
def test_leaving_the_group_stops_its_threads(two_rank_job: TwoRankJob) -> None:
    """After the job's commands, `convert --to dcp` among them (it imports torch.distributed.checkpoint, which
    imports torch.distributed.nn.functional), `leave` stops gloo's threads on every rank: a group kept alive
    by a reference has them free the last exchange's tensors while the interpreter shuts down, taking the GIL
    then, which aborts the rank (SIGABRT, "terminate called without an active exception") after its work."""
    for rank in (0, 1):
        threads = json.loads((two_rank_job.folder / f"threads.{rank}.json").read_text())
        if threads is None:
            pytest.skip("no /proc/self/task to list the threads of a rank")
        assert threads and not [name for name in threads if "gloo" in name], (rank, threads)


def test_workers_convert_spawns_its_ranks_and_is_byte_identical(run_cli: Cli, demo_dir: Path, tmp_path: Path) -> None:
    """`--workers 2` (ckptctl starts the ranks itself, no launcher) writes what one process writes."""
    src = demo_dir / "dcp" / "step-30"
    single = run_cli("convert", src, tmp_path / "one", *SHARDS, "--json")
    assert single.exit_code == 0, single.stderr
    two = _ckptctl("convert", src, tmp_path / "two", *SHARDS, "--json")
    assert two.returncode == 0, two.stderr
    _assert_same_output(tmp_path / "one", tmp_path / "two", single.json, _document(two.stdout))


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


@shares_the_job
def test_two_rank_verify_checks_the_crc_32s_of_a_two_rank_dcp_checkpoint(
    run_cli: Cli, two_rank_job: TwoRankJob
) -> None:
    """No manifest: the ranks share the CRC-32 checks of the DCP items by bytes; a clean save passes with
    every record checked, and a flipped byte is named by its record, as in one process."""
    assert two_rank_job.code("verify_clean") == 0, two_rank_job.stderr("verify_clean")
    clean = two_rank_job.document("verify_clean")
    _same_report(run_cli("verify", two_rank_job.path("verify_clean"), "--json").json, clean)
    assert clean["crc_records_checked"] > 0
    checkpoint, (file, record) = two_rank_job.path("verify_flipped"), two_rank_job.flipped
    single = run_cli("verify", checkpoint, "--json")
    assert single.exit_code == 1, single.stdout
    assert two_rank_job.code("verify_flipped") == 1, two_rank_job.stderr("verify_flipped")
    _same_report(single.json, two_rank_job.document("verify_flipped"))
    assert [(p["kind"], p["path"], p.get("record")) for p in single.json["problems"]] == [
        ("crc_mismatch", file, record)
    ]


@shares_the_job
def test_diff_over_two_ranks_gives_the_single_process_report(
    run_cli: Cli, demo_dir: Path, two_rank_job: TwoRankJob
) -> None:
    a, b = demo_dir / "dcp" / "step-20", demo_dir / "dcp" / "step-30"
    single = run_cli("diff", a, b, "--all", "--json")
    assert single.exit_code == 1, single.stderr
    assert two_rank_job.code("diff") == 1, two_rank_job.stderr("diff")
    _same_report(single.json, two_rank_job.document("diff"))
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
