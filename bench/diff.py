"""diff against a naive per-tensor torch script and against `cat` of both checkpoints, in one run.

Builds, in a separate process, an HF-style sharded safetensors checkpoint A of a Llama-like model in fp32
(hidden 2048, MLP 5632, as many layers as `--size-gib` allows; every layer has its small norm weights too)
and three partners:

  B   A cast to bf16 (half the bytes): `diff A B --ignore-dtype --rtol 2**-8`, the check of an export;
  A'  a byte copy of A (no digests, so every byte is read): `diff A A'`, identical;
  A'' A with one element changed in the middle of the largest tensor: `diff A A''`, near-identical.

Each pair is then measured, on a warm page cache (every file is read once first), by

  (d) `ckptctl diff` (the command line, in a fresh process: interpreter start and imports included),
  (n) a naive script: safetensors `safe_open` + `get_tensor` of each tensor from both sides, `torch.equal`
      when the dtypes agree, else the largest `|a - b|` after upcasting both to fp32 (torch import included),
  (k) the `diff()` call alone, in a child that imported ckptctl first (what a library user pays, and the
      figure against the read floor: interpreter start and imports are fixed costs, not reading),
  (c) `cat` of both checkpoints' files to /dev/null (the read floor),

interleaved (d, k, n, c, d, k, n, c, ...) `--repeat` times so that the machine's load hits all alike; the
median wall time of each is reported with the peak RSS of that child (`os.wait4`, that child alone), and
the medians of the pairwise ratios. Targets: (d) / (n) <= 0.5 (issue 14), with memory bounded by the
largest tensor pair; (k) / (c) <= 1.5 for the identical and near-identical pairs, <= 2.5 across dtypes
(issue 26).

The checkpoints are written by a child process so that this one stays small, free disk space is checked
first, and everything is deleted at the end unless `--keep`.

Usage: python bench/diff.py [--size-gib 2] [--repeat 3] [--dir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20
GIB = 1 << 30
HIDDEN, MLP, VOCAB = 2048, 5632, 32000
SHARD_BYTES = 512 * MIB


def layer_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{p}.self_attn.{name}.weight"] = (HIDDEN, HIDDEN)
        shapes[f"{p}.mlp.gate_proj.weight"] = (MLP, HIDDEN)
        shapes[f"{p}.mlp.up_proj.weight"] = (MLP, HIDDEN)
        shapes[f"{p}.mlp.down_proj.weight"] = (HIDDEN, MLP)
        shapes[f"{p}.input_layernorm.weight"] = (HIDDEN,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (HIDDEN,)
    shapes["model.norm.weight"] = (HIDDEN,)
    shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    return shapes


def layers_for(size_bytes: int) -> int:
    per_layer = sum(4 * n for n in _numels(layer_shapes(1))) - sum(4 * n for n in _numels(layer_shapes(0)))
    fixed = sum(4 * n for n in _numels(layer_shapes(0)))
    return max(1, round((size_bytes - fixed) / per_layer))


def _numels(shapes: dict[str, tuple[int, ...]]) -> list[int]:
    out = []
    for shape in shapes.values():
        n = 1
        for d in shape:
            n *= d
        out.append(n)
    return out


def _save_sharded(tensors: dict, folder: Path) -> None:
    """Shards of at most SHARD_BYTES and the index, as `save_pretrained` lays them out."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    shards: list[dict] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}}
    index["weight_map"] = weight_map
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": HIDDEN}))


def _generate(root: Path, layers: int) -> None:
    import torch

    generator = torch.Generator().manual_seed(0)
    tensors = {
        name: torch.randn(shape, generator=generator) * (0.02 if len(shape) > 1 else 1.0)
        for name, shape in layer_shapes(layers).items()
    }
    _save_sharded(tensors, root / "a")
    _save_sharded({k: v.to(torch.bfloat16) for k, v in tensors.items()}, root / "b-bf16")
    shutil.copytree(root / "a", root / "a-copy")
    largest = max(tensors, key=lambda k: tensors[k].numel())
    middle = tensors[largest].view(-1)
    middle[middle.numel() // 2] += 1.0
    _save_sharded(tensors, root / "a-one-changed")
    (root / "changed.json").write_text(json.dumps({"name": largest}))


NAIVE = """
import json, os, sys, time
import torch
from safetensors import safe_open
start = time.perf_counter()
def index(folder):
    doc = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
    return doc["weight_map"]
a, b = sys.argv[1], sys.argv[2]
map_a, map_b = index(a), index(b)
opened = {}
def handle(folder, file):
    key = (folder, file)
    if key not in opened:
        opened[key] = safe_open(os.path.join(folder, file), "pt")
    return opened[key]
identical = changed = 0
worst = 0.0
for name, file in map_a.items():
    x = handle(a, file).get_tensor(name)
    y = handle(b, map_b[name]).get_tensor(name)
    if x.dtype == y.dtype and torch.equal(x, y):
        identical += 1
        continue
    diff = float((x.float() - y.float()).abs().max())
    changed += diff > 0
    worst = max(worst, diff)
print(json.dumps({"seconds": time.perf_counter() - start, "identical": identical, "changed": changed, "worst": worst}))
"""


def diff_call(a: str, b: str, options: list[str]) -> None:
    """A child that imports diff, then times the call alone and prints `{"seconds": ...}`."""
    from ckptctl.ops.diff import DiffOptions, diff

    rtol = float(options[options.index("--rtol") + 1]) if "--rtol" in options else 0.0
    diff_options = DiffOptions(rtol=rtol, ignore_dtype="--ignore-dtype" in options)
    start = time.perf_counter()
    diff(a, b, diff_options)
    print(json.dumps({"seconds": time.perf_counter() - start}))


@dataclass(frozen=True)
class Run:
    wall: float
    peak_rss: int
    stdout: str


def measure(argv: list[str], ok_codes: tuple[int, ...] = (0,), discard: bool = False) -> Run:
    """Run `argv` in a fresh process: its wall time and its own peak RSS (`wait4`: that child alone)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        stdout_to = subprocess.DEVNULL if discard else out
        proc = subprocess.Popen(argv, stdout=stdout_to, stderr=err, env=env, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        code = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    if code not in ok_codes:
        sys.stderr.write(stderr)
        raise SystemExit(f"{argv[:4]} failed with exit code {code}")
    return Run(wall, usage.ru_maxrss * 1024, stdout)


def files_of(folder: Path) -> list[str]:
    return sorted(str(p) for p in folder.iterdir() if p.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=2.0, help="size of the fp32 checkpoint A (default 2)")
    parser.add_argument("--repeat", type=int, default=3, help="measurements of each method per pair (default 3)")
    parser.add_argument("--dir", type=Path, default=None, help="work folder (default: a temp dir beside the repo)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--generate", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--diff-call", nargs=2, default=None, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.diff_call is not None:
        diff_call(*args.diff_call, rest)
        return 0
    if args.generate is not None:
        _generate(args.generate, args.layers)
        return 0

    layers = layers_for(int(args.size_gib * GIB))
    size_a = sum(4 * n for n in _numels(layer_shapes(layers)))
    largest = max(_numels(layer_shapes(layers))) * 4
    need = int(size_a * 3.5) + GIB  # A, A', A'' and B, and some room
    root = args.dir or Path(tempfile.mkdtemp(prefix="ckptctl-bench-diff-", dir=REPO.parent))
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    print(f"free disk at {root}: {free / GIB:.1f} GiB; the checkpoints need {need / GIB:.1f} GiB")
    if free < need + 5 * GIB:
        shutil.rmtree(root, ignore_errors=True)
        raise SystemExit("not enough free disk (keeping 5 GiB for others)")
    try:
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, __file__, "--generate", str(root), "--layers", str(layers)], check=True, cwd=REPO
        )
        changed_name = json.loads((root / "changed.json").read_text())["name"]
        print(
            f"A: {size_a / GIB:.2f} GiB fp32, {len(layer_shapes(layers))} tensors ({layers} layers), largest "
            f"{largest / MIB:.0f} MiB; B (bf16) {size_a / 2 / GIB:.2f} GiB; written in {time.perf_counter() - started:.0f} s"
        )
        python = sys.executable
        a = root / "a"
        pairs = {
            "fp32 vs bf16 (--ignore-dtype --rtol 2**-8)": (root / "b-bf16", ["--ignore-dtype", "--rtol", str(2**-8)]),
            "identical copy": (root / "a-copy", []),
            "one element changed": (root / "a-one-changed", []),
        }
        print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        rows = []
        for label, (b, options) in pairs.items():
            files = files_of(a) + files_of(b)
            read_bytes = sum(os.path.getsize(f) for f in files)
            subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)  # warm the page cache
            ours: list[Run] = []
            call: list[Run] = []
            naive: list[Run] = []
            cat: list[Run] = []
            for _ in range(args.repeat):
                ours.append(
                    measure([python, "-m", "ckptctl", "diff", str(a), str(b), "--json", "-q", *options], (0, 1))
                )
                call.append(measure([python, __file__, "--diff-call", str(a), str(b), *options]))
                naive.append(measure([python, "-c", NAIVE, str(a), str(b)]))
                cat.append(measure(["cat", *files], discard=True))
            doc = json.loads(ours[-1].stdout)
            check = _check(label, doc, changed_name)
            naive_doc = json.loads(naive[-1].stdout)
            rows.append((label, read_bytes, ours, naive, cat, check, naive_doc, call))
        print(f"load average after:  {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(f"\n{'pair':44}{'read':>9}{'method':>8}{'wall s':>9}{'MB/s':>8}{'peak RSS':>12}")
        for label, read_bytes, ours, naive, cat, check, _naive_doc, _call in rows:
            for method, runs in (("diff", ours), ("naive", naive), ("cat", cat)):
                wall = statistics.median(r.wall for r in runs)
                rss = max(r.peak_rss for r in runs)
                print(
                    f"{label if method == 'diff' else '':44}{read_bytes / GIB if method == 'diff' else 0:>8.2f}"
                    f"{'G' if method == 'diff' else ' '}{method:>8}{wall:9.2f}{read_bytes / wall / 1e6:8.0f}"
                    f"{rss / MIB:9.0f} MiB"
                )
            print(f"{'':44}  result: {check}")
        print(f"\nlargest tensor pair: {largest * 2 / MIB:.0f} MiB (fp32 + fp32)")
        target_met = True
        for label, _read, ours, naive, cat, _check_text, _doc, call in rows:
            d, n, c = (statistics.median(r.wall for r in runs) for runs in (ours, naive, cat))
            k = statistics.median(json.loads(r.stdout)["seconds"] for r in call)
            # Pair by pair (each round ran the methods back to back), then the median: drift cancels.
            d_n = statistics.median(x.wall / y.wall for x, y in zip(ours, naive, strict=True))
            d_c = statistics.median(x.wall / y.wall for x, y in zip(ours, cat, strict=True))
            k_c = statistics.median(json.loads(x.stdout)["seconds"] / y.wall for x, y in zip(call, cat, strict=True))
            k_n = statistics.median(json.loads(x.stdout)["seconds"] / y.wall for x, y in zip(call, naive, strict=True))
            peak = max(r.peak_rss for r in ours)
            floor_target = 2.5 if label.startswith("fp32") else 1.5
            target_met &= d_n <= 0.5 and k_c <= floor_target
            print(
                f"{label:44} diff/naive {d_n:5.2f} (target <= 0.5)   diff/cat {d_c:5.1f}   call {k:5.2f} s, "
                f"call/cat {k_c:4.2f} (target <= {floor_target})   peak RSS diff/naive "
                f"{peak / max(r.peak_rss for r in naive):.2f}"
            )
            what = f"diff {label.split(' (')[0]}"
            line = {"bench": "diff", "what": what + " (call)", "ours_s": k, "floor": "cat both", "floor_s": c}
            line |= {"peer": "naive safetensors+torch", "peer_s": n, "target": f"<= {floor_target}x cat"}
            print("RATIO " + json.dumps(line | {"ratio_floor": k_c, "ratio_peer": k_n, "ours_rss": peak}))
            line = {"bench": "diff", "what": what + " (command)", "ours_s": d, "floor": "cat both", "floor_s": c}
            line |= {"peer": "naive safetensors+torch", "peer_s": n, "target": "<= 0.5x naive"}
            print("RATIO " + json.dumps(line | {"ratio_floor": d_c, "ratio_peer": d_n, "ours_rss": peak}))
        return 0 if target_met else 1
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def _check(label: str, doc: dict, changed_name: str) -> str:
    """What `ckptctl diff` said, checked against what the pair holds."""
    if label.startswith("fp32"):
        ok = doc["equal"] and doc["compared"] == doc["equal_count"] and doc["identical_count"] == 0
    elif label.startswith("identical"):
        ok = doc["equal"] and doc["identical_count"] == doc["compared"]
    else:
        ok = (
            not doc["equal"]
            and [c["name"] for c in doc["changed"]] == [changed_name]
            and doc["changed"][0]["mismatched"] == 1
        )
    summary = f"equal={doc['equal']} compared={doc['compared']} identical={doc['identical_count']}"
    summary += f" changed={doc['changed_count']} read={doc['bytes_read'] / GIB:.2f} GiB"
    if not ok:
        raise SystemExit(f"ckptctl diff gave a wrong answer for {label}: {summary}")
    return summary + " (as expected)"


if __name__ == "__main__":
    raise SystemExit(main())
