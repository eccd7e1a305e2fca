"""`ckptctl sync` of a run to a local S3 endpoint against `aws s3 sync` (pip awscli) in one run, interleaved.

The run: `--checkpoints` native checkpoints of about `--mib` MiB each, written here by `CheckpointManager` (random
fp32 tensors). The store: moto's S3 server in a process of its own on 127.0.0.1, reached by both tools through a
byte-counting relay (this process) that counts what goes to the store and what comes back. Each tool runs as a
fresh process (interpreter start included) into its own prefix:

- full: the whole run into an empty prefix, `--repeat` times, the two tools' order alternating (each round
  into new prefixes);
- incremental: one more checkpoint is saved, and each tool syncs the run again into the prefix of its last
  full round: ckptctl sends only the new checkpoint (the others are skipped from the listing without being
  read); `aws s3 sync` lists and compares everything (size and time) too, and sends what changed.

Reported: wall seconds (median of the full rounds), the ratio to the fastest peer, CPU seconds of the tool and
of the server (of the last full round and of the incremental one, as what follows), bytes sent to and received
from the store and the requests it answered, by kind (PART: parts of multipart uploads; MPU: their starts and
completions), of the last full round and of the incremental one.
Target (DESIGN §5): <= 1.0x the peer's wall time. `rclone` is used too when it is on PATH.

Usage: python bench/sync.py [--checkpoints 5] [--mib 64] [--repeat 3] [--baseline CHECKOUT]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SERVER = """
import collections, json, sys, threading
from werkzeug.serving import make_server
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app

app = DomainDispatcherApplication(create_backend_app)
counts = collections.Counter()
lock = threading.Lock()


def kind(environ):
    method, query = environ["REQUEST_METHOD"], environ.get("QUERY_STRING", "")
    if method == "GET" and ("list-type" in query or environ["PATH_INFO"].strip("/").count("/") == 0):
        return "LIST"
    if "partNumber" in query:
        return "PART"
    if method == "POST" and ("uploads" in query or "uploadId" in query):
        return "MPU"
    return method


def counted(environ, start_response):
    if environ["PATH_INFO"] == "/__counts":
        with lock:
            body = json.dumps(counts).encode()
            counts.clear()
        start_response("200 OK", [("Content-Type", "application/json")])
        return [body]
    with lock:
        counts[kind(environ)] += 1
    return app(environ, start_response)


server = make_server("127.0.0.1", int(sys.argv[1]), counted, True, request_handler=MotoRequestHandler)
print("up", flush=True)
server.serve_forever()
"""
#: The kinds of request the server counts (PART: a part of a multipart upload; MPU: its start and completion).
KINDS = ("PUT", "PART", "MPU", "GET", "HEAD", "LIST", "DELETE")


class Relay:
    """A TCP relay to the S3 server that counts the bytes each way."""

    def __init__(self, port: int) -> None:
        self.upstream = ("127.0.0.1", port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.sent = self.received = 0
        self.lock = threading.Lock()
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        while True:
            client, _ = self.listener.accept()
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self.pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self.pump, args=(server, client, False), daemon=True).start()

    def pump(self, source: socket.socket, sink: socket.socket, up: bool) -> None:
        try:
            while data := source.recv(1 << 18):
                with self.lock:
                    if up:
                        self.sent += len(data)
                    else:
                        self.received += len(data)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def take(self) -> tuple[int, int]:
        with self.lock:
            counts = (self.sent, self.received)
            self.sent = self.received = 0
        return counts


def save(run: Path, step: int, mib: int) -> None:
    import torch

    from ckptctl import CheckpointManager

    torch.manual_seed(step)
    width = 1024
    rows = max(1, mib * (1 << 20) // (4 * width * 4))
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(4)))
    with torch.no_grad():
        for layer in model:
            layer.weight = torch.nn.Parameter(torch.randn(rows, width))
    CheckpointManager(str(run)).save(step, {"model": model})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: Wall seconds, bytes sent and received, requests by kind, CPU seconds of the tool and of the server.
Timing = tuple[float, int, int, dict[str, int], float, float]


def server_cpu(pid: int) -> float:
    """CPU seconds (user and system) the server process has used so far (Linux's /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def requests_made(port: int) -> dict[str, int]:
    """The requests the server answered since the last call, by kind (asked of it directly, not counted)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/__counts") as answer:
        return dict(json.loads(answer.read()))


def timed(command: list[str], env: dict[str, str], relay: Relay, port: int, server: int) -> Timing:
    """Wall seconds, bytes sent and received, requests by kind, and CPU seconds of the tool and of the server
    (`server`: its process id) of one run of `command`. The machine's cores are shared by the tool, the
    server and this relay: a tool's CPU per byte is wall time too where the cores are few."""
    relay.take()
    requests_made(port)
    cpu = sum(resource.getrusage(resource.RUSAGE_CHILDREN)[:2])
    served = server_cpu(server)
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{command[:3]} failed ({done.returncode}): {done.stderr[-2000:]}")
    cpu = sum(resource.getrusage(resource.RUSAGE_CHILDREN)[:2]) - cpu
    return (seconds, *relay.take(), requests_made(port), cpu, server_cpu(server) - served)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoints", type=int, default=5)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--baseline", metavar="CHECKOUT", help="also run ckptctl from this checkout (`base`: before and after a change)"
    )
    args = parser.parse_args()
    aws = shutil.which("aws")
    if aws is None:
        raise SystemExit("aws (pip install awscli) is not on PATH")
    rclone = shutil.which("rclone")

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "up"
        relay = Relay(port)
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
            "AWS_ENDPOINT_URL": relay.endpoint,
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "PYTHONPATH": str(REPO),
        }
        os.environ.update(env)
        import s3fs

        s3fs.S3FileSystem(skip_instance_cache=True).mkdir("bench")
        with tempfile.TemporaryDirectory(prefix="ckptctl-bench-sync-") as tmp:
            run = Path(tmp) / "run"
            for step in range(1, args.checkpoints + 1):
                save(run, step * 100, args.mib)
            size = sum(p.stat().st_size for p in run.rglob("*") if p.is_file())
            print(f"run: {args.checkpoints} checkpoints, {size / (1 << 20):.0f} MiB; store: moto on 127.0.0.1")

            def tools(prefix: str) -> dict[str, list[str]]:
                found = {
                    "ckptctl": [
                        sys.executable,
                        "-m",
                        "ckptctl",
                        "sync",
                        str(run),
                        f"s3://bench/{prefix}/ckptctl",
                        "-q",
                    ],
                    "aws": [aws, "s3", "sync", "--only-show-errors", str(run), f"s3://bench/{prefix}/aws"],
                }
                if args.baseline:
                    ours = found["ckptctl"]
                    found["base"] = [
                        "env",
                        f"PYTHONPATH={args.baseline}",
                        *ours[:-2],
                        f"s3://bench/{prefix}/base",
                        "-q",
                    ]
                if rclone:
                    remote = (
                        f":s3,provider=Other,endpoint='{relay.endpoint}',access_key_id=bench,secret_access_key=bench:"
                    )
                    found["rclone"] = [rclone, "copy", str(run), f"{remote}bench/{prefix}/rclone", "--transfers", "8"]
                return found

            full: dict[str, list[Timing]] = {}
            for round_ in range(args.repeat):
                names = list(tools(""))
                for name in names if round_ % 2 == 0 else names[::-1]:
                    full.setdefault(name, []).append(timed(tools(f"r{round_}")[name], env, relay, port, server.pid))
            save(run, (args.checkpoints + 1) * 100, args.mib)
            last = f"r{args.repeat - 1}"
            incremental = {name: timed(command, env, relay, port, server.pid) for name, command in tools(last).items()}

        def row(label: str, name: str, timing: Timing, seconds: float, base: float) -> None:
            _, sent, received, requests, cpu, served = timing
            kinds = " ".join(f"{k} {requests[k]}" for k in KINDS if requests.get(k))
            print(
                f"{label:<12} {name:<8} {seconds:8.2f} s  {seconds / base:5.2f}x  cpu {cpu:6.2f} s  server cpu "
                f"{served:6.2f} s  sent {sent / (1 << 20):8.1f} MiB  received {received / (1 << 20):6.2f} MiB  "
                f"requests {sum(requests.values()):4d} ({kinds})"
            )

        print(f"{'':<12} {'tool':<8} {'wall':>10}  ratio to the fastest peer")
        peers = [n for n in full if n not in ("ckptctl", "base")]
        median = {name: statistics.median(t[0] for t in runs) for name, runs in full.items()}
        best_full = min(median[n] for n in peers)
        for name, runs in full.items():
            row("full", name, runs[-1], median[name], best_full)
        best_incremental = min(incremental[n][0] for n in peers)
        for name, timing in incremental.items():
            row("incremental", name, timing, timing[0], best_incremental)
        print(
            f"ratio ckptctl / fastest peer: full {median['ckptctl'] / best_full:.2f}x, incremental "
            f"{incremental['ckptctl'][0] / best_incremental:.2f}x (target <= 1.0x)"
        )
        # For bench/summary.py's table: the fastest peer is both the floor and the peer of each row.
        for what, ours, times in (
            ("full sync (command)", median["ckptctl"], {n: median[n] for n in peers}),
            ("incremental sync (command)", incremental["ckptctl"][0], {n: incremental[n][0] for n in peers}),
        ):
            fastest = min(times, key=times.__getitem__)
            line = {"bench": "sync", "what": what, "ours_s": ours, "floor": fastest, "floor_s": times[fastest]}
            print("RATIO " + json.dumps(line | {"peer": fastest, "peer_s": times[fastest], "target": "<= 1.0x peer"}))
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()
