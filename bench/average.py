"""average against the peers a team would otherwise run, measured side by side in one run.

(a) N Hugging Face checkpoints of a Llama-shaped model (`save_pretrained`-style folders: config.json +
    model.safetensors, random weights of another seed each), once in fp32 and once in bf16; with the
    defaults about 1 GB of fp32 weights each. Each in a fresh process, on a warm page cache:
    - `ckptctl average CKPT... DST` (uniform; float64 accumulation, one rounding; fsyncs its output);
    - mergekit's linear merge through its own CLI (`mergekit-yaml`, mergekit 0.1.5, `make bench` installs it:
      bench/peers-nodeps.txt), the same inputs, weight 1.0 each (its default `normalize: true` divides by
      their sum, 5: the uniform average), `dtype` the inputs' own, no tokenizer or model card to write;
    - the naive torch script people write: `safetensors.torch.load_file` of every input (all in memory at
      once), `sum(x.float() for x in inputs) / N` per tensor (fp32 arithmetic), cast back to the stored
      dtype, `save_file`.
    mergekit's arithmetic (mergekit/merge_methods/linear.py: `linear_merge`): a float32 accumulator (float64
    only for float64 inputs), `result.addcmul_(x, w)` for each input in order (torch's vectorised CPU loop
    fuses that multiply-add), then `result.div_(sum of weights)` and a cast to the loaded dtype. So its fp32
    output rounds at each of the N adds and at the division, and its bf16 output rounds to fp32 first and to
    bf16 after; ours rounds once from float64. The outputs are compared (elements that differ and the
    largest difference): identical outputs are not expected, differences of an fp32 or a bf16 unit are.
(b) N FSDP2 DCP checkpoints of 2 ranks (Linear layers + AdamW state, as `bench/convert.py` writes them):
    `ckptctl average --to hf` in one pass against `dcp_to_torch_save` of each + `torch.load` + the average
    + `save_file` (what torch offers without ckptctl).

Reported for each: wall time of the whole process (interpreter start and imports included), the work time
the process measured, and its peak RSS (`os.wait4`: that child only). Ratios ours / peer's, side by side.

Usage: python bench/average.py [--inputs 5] [--layers 3] [--hidden 2048] [--vocab 32000] [--dcp-width 4096]
                               [--skip-dcp] [--dir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import build_checkpoint  # a sibling script: the 2-rank FSDP2 DCP writer
from convert_zero import MIB, REPO, Measured, measure

NAIVE_HF = """
import json, sys, time
import torch
from safetensors.torch import load_file, save_file
*inputs, out = sys.argv[1:]
start = time.perf_counter()
states = [load_file(path + "/model.safetensors") for path in inputs]
averaged = {}
for name, first in states[0].items():
    total = sum(state[name].float() for state in states)
    averaged[name] = (total / len(states)).to(first.dtype)
save_file(averaged, out + "/model.safetensors", metadata={"format": "pt"})
print(json.dumps({"seconds": time.perf_counter() - start}))
"""

NAIVE_DCP = """
import json, os, sys, time, warnings
warnings.simplefilter("ignore")
import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
*inputs, out = sys.argv[1:]
start = time.perf_counter()
models = []
for i, path in enumerate(inputs):
    dcp_to_torch_save(path, out + f"/{i}.pt")
    models.append(torch.load(out + f"/{i}.pt", weights_only=True)["model"])
    os.remove(out + f"/{i}.pt")
averaged = {name: (sum(m[name].float() for m in models) / len(models)).to(t.dtype) for name, t in models[0].items()}
save_file({k: v.contiguous() for k, v in averaged.items()}, out + "/model.safetensors", metadata={"format": "pt"})
print(json.dumps({"seconds": time.perf_counter() - start}))
"""


MERGEKIT_YAML = str(Path(sys.executable).with_name("mergekit-yaml"))


def _mergekit_config(folders: list[Path], dtype: str, path: Path) -> None:
    """mergekit's linear merge of `folders`, weight 1.0 each (normalised by their sum), in `dtype` (JSON is YAML)."""
    models = [{"model": str(folder), "parameters": {"weight": 1.0}} for folder in folders]
    path.write_text(json.dumps({"merge_method": "linear", "dtype": dtype, "models": models}, indent=1))


def _measure_plain(label: str, argv: list[str]) -> Measured:
    """`measure` for a command that prints no work time (mergekit-yaml): its work time is its wall time."""
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)  # that child's own rusage, unlike RUSAGE_CHILDREN
        wall = time.perf_counter() - start
        if os.waitstatus_to_exitcode(status) != 0:
            err.seek(0)
            sys.stderr.write(err.read().decode()[-4000:])
            raise SystemExit(f"{label} failed with exit code {os.waitstatus_to_exitcode(status)}")
    return Measured(label, wall, wall, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime)


#: mergekit-yaml's options: CPU, the defaults otherwise; the inputs carry no tokenizer, and a model card is text.
MERGEKIT_OPTIONS = ["--no-copy-tokenizer", "--no-write-model-card", "--quiet"]


def _write_hf_inputs(root: Path, count: int, layers: int, hidden: int, vocab: int, dtype: str) -> list[Path]:
    """`count` HF folders of one Llama shape, random weights of another seed each, in `dtype`."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 128,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        torch_dtype=dtype,
        architectures=["LlamaForCausalLM"],
    )
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in LlamaForCausalLM(config).state_dict().items()}
    folders = []
    for i in range(count):
        folder = root / f"{dtype}-{i}"
        folder.mkdir(parents=True)
        config.save_pretrained(str(folder))
        GenerationConfig.from_model_config(config).save_pretrained(str(folder))  # as save_pretrained writes it
        generator = torch.Generator().manual_seed(i)
        state = {
            name: (torch.randn(shape, generator=generator) * 0.02).to(getattr(torch, dtype))
            for name, shape in shapes.items()
        }
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        del state
        folders.append(folder)
    return folders


def _generate_hf(root: Path, args: argparse.Namespace) -> None:
    for dtype in ("float32", "bfloat16"):
        _write_hf_inputs(root, args.inputs, args.layers, args.hidden, args.vocab, dtype)


def _warm(folders: list[Path]) -> tuple[int, float]:
    """Read every input file once (a warm page cache for every measurement); their tensor bytes, and the
    seconds a second `cat` of them takes (the floor: reading the inputs once)."""
    files = [f for folder in folders for f in sorted(folder.iterdir()) if f.is_file()]
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    start = time.perf_counter()
    subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
    floor = time.perf_counter() - start
    return sum(f.stat().st_size for f in files if f.suffix in (".safetensors", ".distcp")), floor


def _compare(ours: Path, theirs: Path) -> tuple[float, int, int]:
    """(largest absolute difference, elements that differ, elements) between two HF outputs."""
    from safetensors import safe_open

    def files(folder: Path) -> dict[str, Path]:  # tensor name -> its shard
        found = {}
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(str(path), "pt") as f:
                found.update(dict.fromkeys(f.keys(), path))
        return found

    mine, other = files(ours), files(theirs)
    if sorted(mine) != sorted(other):
        raise SystemExit(f"{ours} and {theirs} hold other tensor names")
    largest, differ, total = 0.0, 0, 0
    for name, path in mine.items():
        with safe_open(str(path), "pt") as a, safe_open(str(other[name]), "pt") as b:
            x, y = a.get_tensor(name), b.get_tensor(name)
            if x.dtype != y.dtype:
                raise SystemExit(f"{name}: {x.dtype} in {ours}, {y.dtype} in {theirs}")
            gap = (x.double() - y.double()).abs()
            largest = max(largest, float(gap.max()))
            differ += int((gap != 0).sum())
            total += x.numel()
    return largest, differ, total


def _row(label: str, m: Measured) -> str:
    return f"  {label:<46} {m.wall:7.2f} s  (work {m.work:6.2f} s, CPU {m.cpu:6.2f} s)  peak RSS {m.peak_rss / MIB:6.0f} MiB"


def _ratio(label: str, ours: Measured, peer: Measured, time_target: float | None, rss_target: float | None) -> str:
    t, r = ours.wall / peer.wall, ours.peak_rss / peer.peak_rss
    targets = []
    if time_target is not None:
        targets.append(f"time target <= {time_target}x: {'met' if t <= time_target else 'NOT met'}")
    if rss_target is not None:
        targets.append(f"RSS target <= {rss_target}x: {'met' if r <= rss_target else 'NOT met'}")
    return f"  {label:<46} time {t:5.2f}x  peak RSS {r:5.2f}x   " + "; ".join(targets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", type=int, default=5, help="checkpoints averaged (default 5)")
    parser.add_argument(
        "--layers", type=int, default=3, help="decoder layers of the HF model (default 3: ~1.1 GB fp32)"
    )
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size of the HF model (default 2048)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary of the HF model (default 32000)")
    parser.add_argument("--dcp-width", type=int, default=4096, help="Linear width of the DCP model (default 4096)")
    parser.add_argument("--dcp-layers", type=int, default=4, help="Linear layers of the DCP model (default 4)")
    parser.add_argument("--skip-dcp", action="store_true", help="only (a)")
    parser.add_argument("--dir", type=Path, default=None, help="work folder (default: a temp dir beside the repo)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints and outputs")
    parser.add_argument("--generate-hf", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--compare", type=Path, nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compare is not None:
        print(json.dumps(_compare(*args.compare)))
        return
    if args.generate_hf is not None:
        _generate_hf(args.generate_hf, args)
        return

    if not Path(MERGEKIT_YAML).exists():
        raise SystemExit(
            f"{MERGEKIT_YAML} is missing: install the peer with `pip install --no-deps -r bench/peers-nodeps.txt` (make bench does)"
        )
    root = args.dir or Path(tempfile.mkdtemp(prefix="bench-average-", dir=REPO.parent))
    root.mkdir(parents=True, exist_ok=True)
    python = sys.executable
    ckptctl = [python, "-m", "ckptctl", "average"]
    try:
        # Written by another process: a child's ru_maxrss starts from its parent's, so this one stays small.
        inputs = root / "hf"
        subprocess.run([python, __file__, "--generate-hf", str(inputs), *_shape_args(args)], check=True, cwd=REPO)
        print(f"(a) {args.inputs} HF checkpoints, Llama {args.layers} layers x {args.hidden}, vocab {args.vocab}")
        table = []
        colds = []
        spec_cache = root / "spec-cache"
        os.environ["CKPTCTL_CACHE_DIR"] = str(spec_cache)  # the children's, not the user's
        for dtype in ("float32", "bfloat16"):
            folders = [inputs / f"{dtype}-{i}" for i in range(args.inputs)]
            size, floor = _warm(folders)
            outs = {name: root / f"{name}-{dtype}" for name in ("ours", "mergekit", "naive")}
            for d in outs.values():
                shutil.rmtree(d, ignore_errors=True)
            outs["naive"].mkdir()
            config = root / f"mergekit-{dtype}.yaml"
            _mergekit_config(folders, dtype, config)
            mergekit_argv = [MERGEKIT_YAML, str(config), str(outs["mergekit"]), *MERGEKIT_OPTIONS]
            # The model check's spec of this config: built by the first run (transformers imported), read back
            # by the second (`frameworks/hf/spec_cache.py`), as every later average or convert of the model does.
            shutil.rmtree(spec_cache, ignore_errors=True)
            average_argv = [*ckptctl, *map(str, folders), str(outs["ours"]), "--json", "--quiet"]
            subprocess.run(["sync"], check=True)
            cold = measure("ckptctl average (cold)", average_argv)
            shutil.rmtree(outs["ours"])
            subprocess.run(["sync"], check=True)
            ours = measure("ckptctl average", average_argv)
            subprocess.run(["sync"], check=True)
            merged = _measure_plain("mergekit-yaml", mergekit_argv)
            subprocess.run(["sync"], check=True)
            naive = measure("naive", [python, "-c", NAIVE_HF, *map(str, folders), str(outs["naive"])])
            print(f" {dtype}: {args.inputs} x {size / args.inputs / MIB:.0f} MiB")
            print(_row("ckptctl average, first check of this model", cold))
            print(_row("ckptctl average (float64, one rounding)", ours))
            print(_row("mergekit-yaml linear (fp32 addcmul, / 5)", merged))
            print(_row("naive torch: load all, fp32 sum / N", naive))
            for peer in ("mergekit", "naive"):
                # In a child: a child's ru_maxrss starts from its parent's at fork, so this process loads no tensor.
                compared = subprocess.run(
                    [python, __file__, "--compare", str(outs["ours"]), str(outs[peer])],
                    check=True,
                    cwd=REPO,
                    capture_output=True,
                    text=True,
                )
                largest, differ, total = json.loads(compared.stdout)
                print(
                    f"  outputs vs {peer}: {differ} of {total} elements differ (its fp32 arithmetic rounds at each "
                    f"add, ours once from float64), largest difference {largest:.3g}"
                )
            table.append((dtype, ours, merged, naive, floor))
            colds.append((dtype, cold, merged))
            for d in outs.values():
                shutil.rmtree(d, ignore_errors=True)
        if not args.skip_dcp:
            dcp_inputs = [root / "dcp" / f"step-{i}" for i in range(args.inputs)]
            for path in dcp_inputs:
                if not (path / ".metadata").exists():
                    path.parent.mkdir(parents=True, exist_ok=True)
                    build_checkpoint(path, args.dcp_layers, args.dcp_width)
            size, floor = _warm(dcp_inputs)
            ours_dir, naive_dir = root / "ours-dcp", root / "naive-dcp"
            for d in (ours_dir, naive_dir):  # a kept folder (--dir, --keep) from an earlier run
                shutil.rmtree(d, ignore_errors=True)
            naive_dir.mkdir()
            subprocess.run(["sync"], check=True)
            # The stored names, as the peer writes them: these saves come with no config that proves a model.
            dcp_argv = [*ckptctl, *map(str, dcp_inputs), str(ours_dir), "--mapping", "none", "--json", "--quiet"]
            ours = measure("ckptctl average", dcp_argv)
            subprocess.run(["sync"], check=True)
            naive = measure("dcp_to_torch_save", [python, "-c", NAIVE_DCP, *map(str, dcp_inputs), str(naive_dir)])
            print(
                f"(b) {args.inputs} FSDP2 DCP checkpoints of 2 ranks ({size / args.inputs / MIB:.0f} MiB each, "
                "model + AdamW state)"
            )
            print(_row("ckptctl average --to hf (one pass)", ours))
            print(_row("dcp_to_torch_save each + torch average", naive))
            table.append(("dcp", ours, naive, naive, floor))
        print("\nratios, ckptctl / peer (same run, same machine, under the load of whatever else runs):")
        for label, ours, merged, naive, _ in table:
            if label == "dcp":
                print(_ratio("(b) DCP: vs dcp_to_torch_save + average", ours, naive, 0.35, None))
            else:
                print(_ratio(f"(a) HF {label}: vs mergekit-yaml linear", ours, merged, 0.5, 0.2))
                print(_ratio(f"(a) HF {label}: vs naive torch script", ours, naive, None, None))
        for label, cold, merged in colds:
            print(_ratio(f"(a) HF {label}, first check: vs mergekit-yaml", cold, merged, 0.5, 0.2))
        for label, ours, merged, naive, floor in table:  # for bench/summary.py's table (process wall times)
            if label == "dcp":
                peer, peer_s, target = "dcp_to_torch_save + average", naive.wall, "<= 0.35x peer"
            else:
                peer, peer_s, target = "mergekit-yaml linear", merged.wall, "<= 0.5x mergekit"
            what = f"average {args.inputs} {'DCP' if label == 'dcp' else 'HF ' + label} (command)"
            line = {"bench": "average", "what": what, "ours_s": ours.wall, "floor": "cat inputs", "floor_s": floor}
            print("RATIO " + json.dumps(line | {"peer": peer, "peer_s": peer_s, "target": target}))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


def _shape_args(args: argparse.Namespace) -> list[str]:
    return [
        "--inputs",
        str(args.inputs),
        "--layers",
        str(args.layers),
        "--hidden",
        str(args.hidden),
        "--vocab",
        str(args.vocab),
    ]


if __name__ == "__main__":
    main()
