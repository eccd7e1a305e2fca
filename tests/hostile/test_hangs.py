"""Inputs that used to make a command run for minutes or forever (issue 16, point 6).

- `verify` of an HF folder whose index has a million entries and whose shard names promise thousands of
  shards: the index's shard set was rebuilt for every promised shard (quadratic); a million mismatches were
  a million problems. Now linear, with mismatches counted past the first few per file.
- A stray rank file name (`rng_state_99999999999.pth`, `__99999999999_0.distcp`) made `verify` and `list`
  loop over every rank below it.
- `prune` on `s3://` hung for minutes once the store stopped answering (botocore's retries within s3fs's
  within ours, each waiting a minute). Every remote call now has a deadline, retries included, and the
  command ends with exit 2 and a message saying the store did not answer.
"""

from __future__ import annotations

import json
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from ckptctl import io
from ckptctl.core.retention import RetentionPolicy
from ckptctl.errors import StorageError
from tests.hostile.conftest import Source, plant, problems_of
from tests.hostile.harness import run_ckptctl

INDEX = "model.safetensors.index.json"
#: More problems than this for one folder is a listing that was not bounded.
FEW = 200


@pytest.fixture(scope="session")
def huge_index(tmp_path_factory: pytest.TempPathFactory, sources: dict[str, Source]) -> Path:
    """The sharded `save_pretrained` model with 1M extra index entries (names its shards lack) and a shard
    copied under a name that promises 2,000 shards."""
    folder = plant(sources["hf-sharded"], tmp_path_factory.mktemp("hostile-index") / "model", INDEX)
    doc = json.loads((sources["hf-sharded"].run / INDEX).read_text())
    shards = sorted(set(doc["weight_map"].values()))
    with open(folder / INDEX, "w") as f:  # written as it goes: this process need not hold a million entries
        f.write(json.dumps(doc)[:-2])  # up to the weight map's closing brace
        for i in range(1_000_000):
            f.write(f',"w{i}":"{shards[i % len(shards)]}"')
        f.write("}}")
    shutil.copyfile(folder / shards[0], folder / "extra-00001-of-02000.safetensors")
    return folder


def test_verify_of_a_million_entry_index_is_linear_and_bounded(huge_index: Path) -> None:
    outcome = run_ckptctl(["verify", str(huge_index), "--json"])
    outcome.assert_refused(1)
    problems = problems_of(outcome)
    assert len(problems) < FEW
    messages = [p["message"] for p in problems]
    assert any("more tensors that model-00001-of-" in m for m in messages), messages
    assert any("more shards are missing" in m for m in messages), messages
    inspected = run_ckptctl(["inspect", str(huge_index), "--json"])
    inspected.assert_refused(0)


def test_human_verify_output_is_bounded(huge_index: Path) -> None:
    outcome = run_ckptctl(["verify", str(huge_index)])
    outcome.assert_refused(1)
    assert len(outcome.stdout.splitlines()) < FEW


@pytest.fixture(scope="session")
def stray_ranks(tmp_path_factory: pytest.TempPathFactory, sources: dict[str, Source]) -> dict[str, Path]:
    """A Trainer checkpoint with `rng_state_99999999999.pth` and a ROLL checkpoint with
    `dcp/__99999999999_0.distcp` (copies of the real rank-0 files)."""
    root = tmp_path_factory.mktemp("hostile-ranks")
    trainer = plant(sources["trainer"], root / "trainer", "checkpoint-4/rng_state_99999999999.pth")
    shutil.copyfile(trainer / "checkpoint-4" / "rng_state.pth", trainer / "checkpoint-4" / "rng_state_99999999999.pth")
    roll = sources["roll"]
    stray = f"{roll.checkpoint}/dcp/__99999999999_0.distcp"
    copy = plant(roll, root / "roll", stray)
    shutil.copyfile(copy / roll.checkpoint / "dcp" / "__0_0.distcp", copy / stray)
    return {"trainer": trainer / "checkpoint-4", "roll": copy}


def test_a_stray_rank_file_name_does_not_enumerate_every_rank(stray_ranks: dict[str, Path]) -> None:
    verified = run_ckptctl(["verify", str(stray_ranks["trainer"]), "--json"])
    # The Trainer resumes without a rank's RNG state, with a warning of its own (`_load_rng_state`): so are they here.
    verified.assert_refused(0)
    problems = problems_of(verified)
    assert 0 < len(problems) < FEW
    assert all(p["severity"] == "warning" and p["path"].startswith("rng_state_") for p in problems), problems
    listed = run_ckptctl(["list", str(stray_ranks["roll"]), "--json"])
    listed.assert_refused(0)
    notes = " ".join(c["note"] for c in json.loads(listed.stdout)["checkpoints"])
    assert len(notes) < 10_000


# ------------------------------------------------------------------------------------------ object stores


class Store:
    """A moto S3 server in a child process of its own, which a test can freeze (SIGSTOP) or kill."""

    def __init__(self, tmp: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{port}"
        nothing = str(tmp / "absent")
        self.env = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": nothing,
            "AWS_SHARED_CREDENTIALS_FILE": nothing,
            "NO_PROXY": "127.0.0.1",
            "CKPTCTL_IO_TIMEOUT": "4",
        }
        code = (
            "import signal, sys; from moto.server import ThreadedMotoServer; "
            "ThreadedMotoServer(ip_address='127.0.0.1', port=int(sys.argv[1]), verbose=False).start(); signal.pause()"
        )
        self.process = subprocess.Popen(
            [sys.executable, "-c", code, str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError("the moto server did not start") from None
                time.sleep(0.1)

    def upload(self, local: Path, url: str) -> str:
        import s3fs

        fs = s3fs.S3FileSystem(
            key="testing", secret="testing", client_kwargs={"endpoint_url": self.endpoint}, skip_instance_cache=True
        )
        bucket, _, key = url.removeprefix("s3://").partition("/")
        fs.mkdir(bucket)
        fs.put(f"{local}/", f"{bucket}/{key}/", recursive=True)
        return url

    def freeze(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def close(self) -> None:
        self.process.send_signal(signal.SIGCONT)
        self.kill()


@pytest.fixture
def store(tmp_path: Path, sources: dict[str, Source]) -> Iterator[tuple[Store, str]]:
    """A fresh S3 server holding the demo's native run (three steps), and the run's URL."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    server = Store(tmp_path)
    try:
        # A bucket of its own: a store that stopped answering is not asked again for a while, in this process.
        yield server, server.upload(sources["native"].run, f"s3://hostile-{secrets.token_hex(4)}/native")
    finally:
        server.close()


@pytest.mark.parametrize("failure", ["frozen", "killed"])
def test_prune_on_a_store_that_stopped_answering_ends_with_exit_2(store: tuple[Store, str], failure: str) -> None:
    server, url = store
    server.freeze() if failure == "frozen" else server.kill()
    outcome = run_ckptctl(["prune", url, "--keep-last", "1", "--grace", "0", "--yes"], env=server.env)
    outcome.assert_refused(2)
    assert "did not answer" in outcome.stderr and url in outcome.stderr, outcome.stderr


@pytest.mark.parametrize("failure", ["frozen", "killed"])
def test_prune_ends_when_the_store_goes_away_mid_operation(
    store: tuple[Store, str], monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """The store stops answering between the plan and the deletions (the prune's confirmation hook)."""
    from ckptctl.ops.prune import prune
    from tests.s3.server import reset_s3fs

    server, url = store
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(io.failures, "RETRY", io.RetryPolicy(timeout=4.0))
    reset_s3fs()
    planned: list[int] = []
    outcome: list[BaseException | None] = []

    def confirm(plan: object) -> bool:
        planned.append(len(plan.delete))  # type: ignore[attr-defined]
        server.freeze() if failure == "frozen" else server.kill()
        return True

    def run() -> None:
        try:
            prune(url, RetentionPolicy(keep_last=1), grace=timedelta(0), confirm=confirm)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=120)
    reset_s3fs()
    assert not worker.is_alive(), "prune hung after the store went away"
    assert planned == [2]
    assert isinstance(outcome[0], StorageError), outcome
    assert "did not answer" in outcome[0].message
