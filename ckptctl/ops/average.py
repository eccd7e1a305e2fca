"""`average`: the uniform, weighted or exponential moving average of checkpoints of any layouts, in one pass.

Each input is read as `convert` reads it (`ops.convert.prepare`: the layout's model tensors under the names
`diff` matches them by, a DeepSpeed ZeRO tag's fp32 master weights, a framework's name map for an HF output,
tied weights resolved by the model check), so a DCP step, a ZeRO tag and an HF export of the same model pair
up by name. Every input must hold the same tensors with the same shapes and kinds of dtype (floating point,
integer, bool, complex); the first that does not is named and nothing is written. Non-floating tensors (int
buffers, counters) must be equal in every input and are written as they are.

The arithmetic is defined element by element, in float64, in the inputs' order (`AverageOptions`):
- weighted (uniform: every weight 1/N): `acc = w_1·x_1`, then `acc = acc + w_i·x_i` for each next input;
- EMA with decay d, inputs ordered by step: `acc = x_oldest`, then `acc = d·acc + (1 - d)·x` for each newer
  input;
where `x` is the stored value widened to float64 (exact) and each product and sum is rounded once (no fused
multiply-add). The result is rounded once, to nearest even, to the output dtype (`formats.safetensors_stream.
cast_block`: float64 -> bfloat16 straight, never through float32). So identical inputs average to the
input bit for bit, whatever N, for every dtype narrower than float64.

The output is written as `convert` writes it (`ops.convert.write_prepared`): one tensor at a time, staged,
checked, digested and renamed into DST (or uploaded), over a job's ranks when asked, the config and
tokenizer files taken as `convert` finds them for the last input (the newest with `--last`, `--steps`,
`--ema`). Each tensor of each input is read once. Local inputs whose tensors are stored raw (safetensors, the
records of DCP's torch.save items) are read block by block straight from their files (`_StreamedInputs`):
memory holds the output's copy of the tensor and a few float64 blocks per thread. Otherwise (a remote input,
float8, reordered rows) each input's copy is read whole: at most 3x the largest tensor in float64. Either way,
whatever N and the model size.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import CheckpointRef, CheckpointState, Component, TensorEntry, dtype_itemsize
from ckptctl.contract.capabilities import DerivedTensor
from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.formats.safetensors_stream import cast_block
from ckptctl.layouts import resolve
from ckptctl.ops.convert import (
    ConvertOptions,
    ModelCheck,
    Prepared,
    Weights,
    prepare,
    write_prepared,
)
from ckptctl.ops.convert.options import OutputOptions
from ckptctl.ops.convert.plan import Planned, read_planned
from ckptctl.ops.listing import list_run
from ckptctl.ops.report import SCHEMA_VERSION, NoProgress, Progress

__all__ = ["AverageInput", "AverageOptions", "AverageResult", "average", "run_inputs"]

#: How far weights may sum from 1 (decimal weights such as 0.1 are not exact in binary).
WEIGHT_SUM_TOLERANCE = 1e-9
#: Elements widened and accumulated at a time: the float64 scratch of one block stays in the CPU's cache.
_BLOCK = 1 << 16
#: Elements of a block read from every input and summed by one thread (`_StreamedInputs`): the float64
#: accumulator and term (4 MiB) stay near the core, and the Python work per block is small beside its reads.
_STREAM_BLOCK = 1 << 18
_FLOATING = frozenset({"float64", "float32", "float16", "bfloat16"})


@dataclass(frozen=True, slots=True)
class AverageOptions(OutputOptions):
    """How to average and what to write.

    Attributes:
        weights: one weight per input, in the order given (None: uniform, 1/N each).
        normalize: the weights must sum to 1 (within `WEIGHT_SUM_TOLERANCE`); False takes any finite weights.
        ema: the decay d of an exponential moving average over the inputs ordered by step (no `weights`).
        to: `hf` or `dcp`.
        dtype: the output's floating-point dtype (None: the last input's, its fp32 master weights where its
            layout keeps them, as `convert`).
        max_shard_size: most tensor bytes per safetensors shard (`--to hf`).
        dcp_file_size: most tensor bytes per data file (`--to dcp`).
        source_weights: which copy of the model a checkpoint that keeps two gives (`convert --model-weights`).
        config_dir: where config.json comes from (default: found beside the last input, as `convert`).
        tokenizer_dir: where tokenizer files come from (default: as `convert`).
        mapping: the inputs' map of tensor names to transformers' (`convert --mapping`): `none` writes an HF
            output under the inputs' own names, the only way to write one with no config to check it.
        force: replace a non-empty DST.
        check_model: build the config's architecture on the meta device and check every input's tensors
            against it (and resolve tied weights), as `convert`.
        reread: read every written file back and check its digest.
        workers: copy threads of the writer.
        ranks: the ranks of a job that share the writing (`ops.distributed_work.join`); None: this process.
    """

    weights: tuple[float, ...] | None = None
    normalize: bool = True
    ema: float | None = None
    source_weights: Weights = Weights.AUTO

    def convert_options(self) -> ConvertOptions:
        return ConvertOptions(**self.output_options(), weights=self.source_weights)


@dataclass(frozen=True, slots=True)
class AverageInput:
    """One input: the checkpoint read (the one a run's `latest` pointer names, given its run folder), its
    layout and step, and its weight in the average (for `--ema`, the weight the recurrence gives it:
    d^(N-1) for the oldest, (1 - d)·d^(N-1-i) for the others)."""

    url: str
    layout: str
    step: int | None
    weight: float

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "layout": self.layout, "step": self.step, "weight": self.weight}


@dataclass(frozen=True, slots=True)
class AverageResult:
    """What an average wrote.

    Attributes:
        inputs: the inputs in the order they were accumulated.
        dst: the output folder.
        to: `hf` or `dcp`.
        method: `uniform`, `weighted` or `ema`.
        ema: the decay of an EMA, else None.
        tensors: tensors written.
        bytes_written: bytes of tensor data written.
        files: the output's files, relative to it.
        bytes_read: bytes read from the inputs.
        seconds: wall time.
        dtype: the dtype floating-point tensors were written in when one was asked, else None.
        copied: config and tokenizer files copied into the output.
        model: what the model check found for the output, or None when there was none.
        warnings: what a person should know.
        mapping: how the output's names were made transformers' (`ConvertResult.mapping`).
    """

    inputs: tuple[AverageInput, ...]
    dst: str
    to: str
    method: str
    ema: float | None
    tensors: int
    bytes_written: int
    files: tuple[str, ...]
    bytes_read: int
    seconds: float
    dtype: str | None
    copied: tuple[str, ...] = ()
    model: ModelCheck | None = None
    warnings: tuple[str, ...] = ()
    mapping: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "inputs": [i.to_json() for i in self.inputs],
            "dst": self.dst,
            "to": self.to,
            "method": self.method,
            "ema": self.ema,
            "tensors": self.tensors,
            "bytes_written": self.bytes_written,
            "files": list(self.files),
            "bytes_read": self.bytes_read,
            "seconds": round(self.seconds, 3),
            "dtype": self.dtype,
            "copied": list(self.copied),
            "model_check": self.model.to_json() if self.model is not None else None,
            "warnings": list(self.warnings),
            "mapping": self.mapping,
        }


def run_inputs(run: str, *, last: int | None = None, steps: Sequence[int] | None = None) -> list[str]:
    """The checkpoints of the run folder `run` to average, oldest first: its `last` newest complete ones with
    a step (as `list` orders them), or those of `steps`.

    Raises:
        CkptctlError: neither or both of `last` and `steps`, too few checkpoints, a step not found, or two
            checkpoints of the same step (pass their paths instead).
    """
    if (last is None) == (steps is None):
        raise CkptctlError("choose the checkpoints of the run with either --last K or --steps S1,S2,...")
    if last is not None and last < 1:
        raise CkptctlError(f"--last must be at least 1, not {last}")
    found = [
        ref
        for ref in list_run(run, states=frozenset({CheckpointState.COMPLETE, CheckpointState.SLIM})).checkpoints
        if ref.step is not None
    ]
    by_step: dict[int, list[CheckpointRef]] = {}
    for ref in found:
        assert ref.step is not None
        by_step.setdefault(ref.step, []).append(ref)
    if steps is not None:
        missing = [s for s in steps if s not in by_step]
        if missing:
            have = ", ".join(str(s) for s in sorted(by_step)) or "none"
            raise CkptctlError(
                f"{run} has no complete checkpoint of step {missing[0]}", f"complete checkpoints' steps: {have}"
            )
        wanted = list(dict.fromkeys(steps))
    else:
        assert last is not None
        ordered = sorted(by_step)
        if len(ordered) < last:
            raise CkptctlError(
                f"{run} has {len(ordered)} complete checkpoint(s) with a step, --last asks for {last}",
                f"run `ckptctl list {run}` to see them",
            )
        wanted = ordered[len(ordered) - last :]
    for step in wanted:
        if len(by_step[step]) > 1:
            urls = ", ".join(ref.url for ref in by_step[step])
            raise CkptctlError(f"{run} holds more than one checkpoint of step {step}: {urls}", "pass their paths")
    return [by_step[step][0].url for step in wanted]


def average(
    inputs: Sequence[str], dst: str, options: AverageOptions | None = None, progress: Progress | None = None
) -> AverageResult:
    """Average the checkpoints `inputs` into a new folder `dst` (see the module docstring).

    Raises:
        CkptctlError: bad weights or decay, inputs whose tensors do not match (named), DST not empty (without
            `force`) or overlapping an input, an input that is incomplete or broken; nothing is written.
        CorruptCheckpoint: an input's bytes disagree with its metadata (nothing is left at DST).
        StorageError: the output cannot be written.
    """
    options = options or AverageOptions()
    started = time.perf_counter()
    convert_options = options.convert_options()
    made: dict[str, Any] = {}

    def make() -> Prepared:
        plan = made["plan"] = _plan(inputs, dst, options, convert_options)
        return plan.prepared

    with io.counting() as read:
        written = write_prepared(make, convert_options, progress or NoProgress(), read)
    if "plan" not in made:  # another rank planned: this rank reports nothing of its own
        made["plan"] = None
    plan = made["plan"]
    return AverageResult(
        inputs=plan.inputs if plan is not None else (),
        dst=written.dst,
        to=written.to,
        method=plan.method if plan is not None else "",
        ema=options.ema,
        tensors=written.tensors,
        bytes_written=written.bytes,
        files=written.files,
        bytes_read=written.bytes_read,
        seconds=time.perf_counter() - started,
        dtype=options.dtype,
        copied=written.copied,
        model=written.model,
        warnings=written.warnings,
        mapping=written.mapping,
    )


@dataclass(frozen=True, slots=True)
class _Plan:
    """The inputs as they are accumulated, and the output prepared from the last one with computed tensors."""

    inputs: tuple[AverageInput, ...]
    method: str
    prepared: Prepared


def _plan(inputs: Sequence[str], dst: str, options: AverageOptions, convert_options: ConvertOptions) -> _Plan:
    if not inputs:
        raise CkptctlError("average needs at least one checkpoint")
    urls = list(inputs)
    if options.ema is not None:
        if options.weights is not None:
            raise CkptctlError("--ema weighs the inputs by their steps: drop --weights")
        if not (0.0 <= options.ema < 1.0) or math.isnan(options.ema):
            raise CkptctlError(f"the EMA decay must be at least 0 and below 1, not {options.ema}")
        urls = _by_step(urls)
    weights = _weights(len(urls), options)
    # The last input gives the output its config, tokenizer and tied weights, and is checked against the
    # model (`convert`'s check). The others are read with its config (the same name map) and matched with it
    # by name, shape and kind, which names the first difference, rather than each checked against the model.
    last = prepare(urls[-1], dst, convert_options)
    config = last.side_files.get("config.json")
    if config is not None and options.config_dir is None:
        convert_options = replace(convert_options, config_dir=io.parent_of(config))
    convert_options = replace(convert_options, check_model=False)
    others = [prepare(url, dst, convert_options) for url in urls[:-1]]
    prepared = [*others, last]
    output = [_averaged(planned, prepared, weights, options.ema) for planned in _matched(prepared)]
    method = "ema" if options.ema is not None else ("weighted" if options.weights is not None else "uniform")
    effective = _ema_weights(len(urls), options.ema) if options.ema is not None else weights
    described = tuple(
        AverageInput(p.url, p.layout, p.checkpoint.ref.step, w) for p, w in zip(prepared, effective, strict=True)
    )
    # The other inputs' notes are about their own side files, which the output does not take.
    return _Plan(described, method, replace(last, plan=output))


def _by_step(urls: list[str]) -> list[str]:
    """`urls` ordered by the steps of their checkpoints (stable), for the EMA.

    Raises:
        CkptctlError: a checkpoint whose step nothing records.
    """
    steps: list[int] = []
    for url in urls:
        _, ref = resolve(url)
        if ref.step is None:
            raise CkptctlError(f"{url}: no step recorded, and --ema orders the inputs by step", "pass --weights")
        steps.append(ref.step)
    return [url for _, url in sorted(zip(steps, urls, strict=True), key=lambda pair: pair[0])]


def _weights(count: int, options: AverageOptions) -> tuple[float, ...]:
    """The weight of each input (for an EMA, unused: the recurrence weighs them).

    Raises:
        CkptctlError: not one weight per input, a weight that is not finite, or weights that do not sum to 1
            (unless `normalize` is off).
    """
    if options.weights is None:
        return tuple(1.0 / count for _ in range(count))
    weights = tuple(float(w) for w in options.weights)
    if len(weights) != count:
        raise CkptctlError(f"{len(weights)} weight(s) for {count} checkpoint(s): give one weight per checkpoint")
    bad = [w for w in weights if not math.isfinite(w)]
    if bad:
        raise CkptctlError(f"weights must be finite numbers, not {bad[0]}")
    total = math.fsum(weights)
    if options.normalize and abs(total - 1.0) > WEIGHT_SUM_TOLERANCE:
        raise CkptctlError(
            f"the weights sum to {total:g}, not 1",
            "give weights that sum to 1, or pass --no-normalize to use them as given",
        )
    return weights


def _ema_weights(count: int, decay: float) -> tuple[float, ...]:
    """The weight the EMA recurrence gives each input, oldest first (for the report; the recurrence computes)."""
    return tuple(decay ** (count - 1) if i == 0 else (1.0 - decay) * decay ** (count - 1 - i) for i in range(count))


def _kind(dtype: str) -> str:
    if dtype in _FLOATING or dtype.startswith("float8"):
        return "floating point"
    if dtype == "bool":
        return "bool"
    if dtype.startswith("complex"):
        return "complex"
    return "integer"


def _matched(prepared: Sequence[Prepared]) -> list[list[Planned]]:
    """For each tensor of the last input's output, in its order, that tensor of every input (inputs' order).

    Raises:
        CkptctlError: the first tensor an input lacks or holds beyond the last one's (tied copies aside), or
            holds with another shape or another kind of dtype.
    """
    last = prepared[-1]
    # A tied copy the last input's model check added (a DCP output holds `lm_head.weight`) is, in an input
    # that does not store it, the tensor it is tied to.
    tied_to = dict(last.spec.tied) if last.spec is not None else {}
    by_input = [{p.name: p for p in item.plan} for item in prepared]
    for item, named in zip(prepared, by_input, strict=True):
        extra = [n for n in named if n not in by_input[-1] and n not in last.tied]
        if extra:
            raise CkptctlError(
                f"{extra[0]!r} is in {item.url} but not in {last.url}: the inputs hold different models",
                "average checkpoints of the same model",
            )
    matched: list[list[Planned]] = []
    for want in last.plan:
        row: list[Planned] = []
        for item, named in zip(prepared, by_input, strict=True):
            got = named.get(want.name)
            if got is None and want.name in tied_to and tied_to[want.name] in named:
                got = replace(named[tied_to[want.name]], name=want.name)
            if got is None:
                raise CkptctlError(
                    f"{want.name!r} is in {last.url} but not in {item.url}: the inputs hold different models",
                    "average checkpoints of the same model",
                )
            if got.shape != want.shape:
                raise CkptctlError(
                    f"{want.name!r} has shape {list(got.shape)} in {item.url} but {list(want.shape)} in {last.url}",
                    "average checkpoints of the same model",
                )
            if _kind(got.entry.dtype) != _kind(want.entry.dtype):
                raise CkptctlError(
                    f"{want.name!r} is {got.entry.dtype} in {item.url} but {want.entry.dtype} in {last.url}: "
                    f"{_kind(got.entry.dtype)} and {_kind(want.entry.dtype)} values cannot be averaged",
                    "average checkpoints of the same model",
                )
            row.append(got)
        matched.append(row)
    return matched


def _averaged(
    row: list[Planned], prepared: Sequence[Prepared], weights: tuple[float, ...], ema: float | None
) -> Planned:
    """The output tensor of one matched row: floating-point tensors computed (`_Average`), the others checked
    equal in every input now (so that a difference is refused before anything is written) and kept."""
    want = row[-1]
    sources = tuple(
        (p.checkpoint.url, replace(planned, dtype=planned.entry.dtype))
        for p, planned in zip(prepared, row, strict=True)
    )
    compute_bytes: Callable[[], memoryview] | None = None
    if _kind(want.entry.dtype) == "floating point":
        averaged = _Average(sources, weights, ema, want.dtype, want.shape)
        compute: Callable[[], Any] = averaged
        compute_bytes = averaged.raw
    else:
        compute = _Equal.check(sources, want.dtype)
    entry = TensorEntry(want.name, Component.MODEL, want.dtype, want.shape, ())
    derived = DerivedTensor(want.name, want.dtype, want.shape, compute, compute_bytes)
    return Planned(entry, want.name, want.dtype, derived=derived)


@dataclass(frozen=True, slots=True)
class _Equal:
    """A non-floating tensor that every input holds with the same values (read while planning)."""

    value: Any

    @classmethod
    def check(cls, sources: Sequence[tuple[str, Planned]], dtype: str) -> _Equal:
        """The tensor of the first source, after checking that every other one equals it.

        Raises:
            CkptctlError: an input holds other values.
        """
        import torch

        first = read_planned(*sources[0])
        for url, planned in sources[1:]:
            other = read_planned(url, planned)
            if other.dtype != first.dtype:
                other = other.to(first.dtype)
            if not torch.equal(other, first):
                raise CkptctlError(
                    f"{planned.name!r} ({planned.entry.dtype}) holds other values in {url} than in {sources[0][0]}: "
                    "integer and bool tensors are not averaged, they must be equal in every input",
                    "average checkpoints of the same model and training setup",
                )
        return cls(first.to(getattr(torch, dtype)))

    def __call__(self) -> Any:
        return self.value


@dataclass(frozen=True, slots=True)
class _Average:
    """Computes one output tensor when the writer reaches it (see the module docstring for the arithmetic).

    numpy does the arithmetic: `np.multiply(x, w, dtype=float64)` widens each element exactly and rounds the
    product once, `np.add` rounds the sum once, and neither fuses them (torch's `add_(x, alpha=w)` is a fused
    multiply-add in its vectorised loop and not in its scalar one). A large tensor is cut into blocks that a
    pool of threads works on (numpy lets the GIL go), while the next input's copy of the tensor is read;
    the last input's pass rounds each block into the output as soon as it is summed.

    A module-level dataclass, not a closure: a plan is sent to the other ranks of a job, which pickles it.

    Attributes:
        sources: each input's checkpoint folder and planned tensor (read as stored: no cast), in order.
        weights: one per input (unused for an EMA).
        ema: the EMA's decay, or None for the weighted sum.
        dtype: the output dtype.
        shape: the output shape.
    """

    sources: tuple[tuple[str, Planned], ...]
    weights: tuple[float, ...]
    ema: float | None
    dtype: str
    shape: tuple[int, ...]

    def __call__(self) -> Any:
        import torch

        data = self._streamed_bytes()
        if data is not None:
            return torch.frombuffer(data, dtype=getattr(torch, self.dtype)).view(self.shape)
        return self._whole()

    def raw(self) -> memoryview:
        """The result as raw bytes (`DerivedTensor.compute_bytes`): without torch where the inputs are streamed."""
        from ckptctl.formats.safetensors import tensor_bytes

        data = self._streamed_bytes()
        return data if data is not None else tensor_bytes(self._whole())

    def _streamed_bytes(self) -> memoryview | None:
        """The result's bytes computed from the inputs' files block by block, or None where an input's copy must
        be read whole (`_StreamedInputs.open`)."""
        import numpy as np

        numel = math.prod(self.shape)
        streamed = _StreamedInputs.open(self.sources, numel) if numel else None
        if streamed is None:
            return None
        out: Any = np.empty(numel * dtype_itemsize(self.dtype), dtype=np.uint8)
        written = memoryview(out)
        with streamed:
            self._streamed(streamed, out.view(np.float64) if self.dtype == "float64" else None, written)
        return written

    def _whole(self) -> Any:
        """The result computed from each input's copy of the tensor read whole (a torch tensor)."""
        import numpy as np
        import torch

        from ckptctl.formats.safetensors import tensor_bytes

        numel = math.prod(self.shape)
        out = torch.empty(numel, dtype=getattr(torch, self.dtype))
        acc = out.numpy() if self.dtype == "float64" else np.empty(numel, dtype=np.float64)
        written = tensor_bytes(out)
        itemsize = dtype_itemsize(self.dtype)
        last = len(self.sources) - 1

        def step(i: int, values: Any, start: int) -> None:
            end = min(start + _BLOCK, numel)
            self._step(i, acc[start:end], values[start:end])
            if i == last and self.dtype != "float64":
                summed: Any = acc[start:end]
                cast_block(
                    memoryview(summed).cast("B"),
                    "float64",
                    written[start * itemsize : end * itemsize],
                    self.dtype,
                    end - start,
                )

        blocks = range(0, numel, _BLOCK)
        if numel <= _BLOCK:  # one block: no threads to start
            for i, source in enumerate(self.sources):
                values = _flat_values(*source, numel)
                for start in blocks:
                    step(i, values, start)
            return out.view(self.shape)
        with io.ContextThreadPool(max_workers=1) as reader, io.ContextThreadPool(max_workers=_workers()) as pool:
            pending = reader.submit(_flat_values, *self.sources[0], numel)
            for i in range(len(self.sources)):
                values = pending.result()
                if i < last:  # read the next input's copy while this one is summed
                    pending = reader.submit(_flat_values, *self.sources[i + 1], numel)
                for _ in pool.map(lambda start, i=i, values=values: step(i, values, start), blocks):
                    pass
                del values
        return out.view(self.shape)

    def _streamed(self, inputs: _StreamedInputs, out64: Any, written: memoryview) -> None:
        """The tensor computed block by block straight from the inputs' files: each thread reads one block of
        every input into its own buffer (pread, the GIL let go) and sums it in a float64 block that stays in
        the CPU's cache, then rounds it into the output. No copy of a whole input tensor is ever made."""
        itemsize = dtype_itemsize(self.dtype)

        def block(start: int) -> None:
            end = min(start + _STREAM_BLOCK, numel)
            acc = out64[start:end] if out64 is not None else _scratch(end - start, "acc")
            for i in range(len(self.sources)):
                self._step(i, acc, inputs.read(i, start, end))
            if out64 is None:
                cast_block(
                    memoryview(acc).cast("B"),
                    "float64",
                    written[start * itemsize : end * itemsize],
                    self.dtype,
                    end - start,
                )

        numel = inputs.numel
        starts = range(0, numel, _STREAM_BLOCK)
        if len(starts) <= 1:
            for start in starts:
                block(start)
            return
        with io.ContextThreadPool(max_workers=_workers()) as pool:
            for _ in pool.map(block, starts):
                pass

    def _step(self, i: int, acc: Any, values: Any) -> None:
        """One block of input `i` into the accumulator (float64 numpy arrays of the block's elements)."""
        import numpy as np

        if i == 0:
            if self.ema is None:
                np.multiply(values, self.weights[0], out=acc, dtype=np.float64)
            else:
                np.copyto(acc, values, casting="unsafe")  # widening: exact
            return
        term = _scratch(len(acc), "term")
        if self.ema is None:
            np.multiply(values, self.weights[i], out=term, dtype=np.float64)
        else:
            np.multiply(acc, self.ema, out=acc)
            np.multiply(values, 1.0 - self.ema, out=term, dtype=np.float64)
        np.add(acc, term, out=acc)


_local = threading.local()


def _scratch(count: int, name: str, dtype: Any = None) -> Any:
    """A block of this thread's own (float64 unless `dtype`), reused: a fresh one per block would be mapped and
    faulted in anew. `name` tells a thread's buffers apart."""
    import numpy as np

    dtype = np.dtype(np.float64 if dtype is None else dtype)
    buffers = _local.__dict__.setdefault("scratch", {})
    buffer = buffers.get((name, dtype))
    if buffer is None or len(buffer) < count:
        buffer = buffers[(name, dtype)] = np.empty(max(count, _BLOCK), dtype=dtype)
    return buffer[:count]


@dataclass(slots=True)
class _StreamedInputs:
    """Every input's copy of one tensor as raw byte ranges of local files, read a block at a time.

    The ranges are those `convert` copies bytes from (`formats.raw_chunks.flat_ranges`: a safetensors
    tensor, or the tensor records inside a DCP rank file's torch.save items, checked against their file's
    size and the metadata): reading block [a, b) of an input is one pread per range it overlaps, straight
    into a buffer numpy reads the elements from.

    Attributes:
        numel: elements of the tensor.
        ranges: per input, its flat ranges (row-major, in order, covering the tensor).
        dtypes: per input, the numpy type of its stored elements.
        fds: open files by path.
    """

    numel: int
    ranges: list[list[Any]]
    dtypes: list[Any]
    fds: dict[str, int]

    @classmethod
    def open(cls, sources: Sequence[tuple[str, Planned]], numel: int) -> _StreamedInputs | None:
        """The inputs' ranges, or None where one must be read whole (`read_planned`): rows reordered, a
        computed tensor, a remote file, a dtype numpy has no type for (float8), records not stored raw.

        Raises:
            CorruptCheckpoint: a record lies outside its file or disagrees with the metadata.
        """
        from ckptctl.formats.raw_chunks import ChunkLocator, flat_ranges
        from ckptctl.formats.safetensors_stream import numpy_type

        ranges, dtypes = [], []
        for url, planned in sources:
            entry = planned.entry
            dtype = numpy_type(entry.dtype)
            if planned.rows is not None or planned.derived is not None or dtype is None or not io.is_local(url):
                return None
            if entry.numel != numel:
                raise CorruptCheckpoint(f"{planned.name}: {entry.numel} elements, expected {numel}")
            with ChunkLocator(url) as locator:
                found = flat_ranges(entry, locator)
            if found is None:
                return None
            ranges.append(found)
            dtypes.append(dtype)
        streamed = cls(numel, ranges, dtypes, {})
        try:
            for found in ranges:
                for r in found:
                    if r.url not in streamed.fds:
                        streamed.fds[r.url] = os.open(io.local_path(r.url), os.O_RDONLY)
        except BaseException:
            streamed.close()
            raise
        return streamed

    def __enter__(self) -> _StreamedInputs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def read(self, i: int, start: int, end: int) -> Any:
        """Elements [start, end) of input `i`, in this thread's buffer of its dtype (valid until its next read).

        Raises:
            CorruptCheckpoint: the file ends before the range.
        """
        import numpy as np

        from ckptctl.formats.safetensors_stream import pread_into

        dtype = self.dtypes[i]
        itemsize = np.dtype(dtype).itemsize
        raw = _scratch((end - start) * itemsize, "read", np.uint8)  # bytes: ml_dtypes' bfloat16 has no buffer
        view = memoryview(raw)
        for r in self.ranges[i]:
            lo, hi = max(start, r.start), min(end, r.start + r.count)
            if lo >= hi:
                continue
            target = view[(lo - start) * itemsize : (hi - start) * itemsize]
            pread_into(self.fds[r.url], target, r.offset + (lo - r.start) * itemsize, r.url)
            io.count_read(len(target))
        return raw.view(dtype)


def _workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _flat_values(url: str, planned: Planned, numel: int) -> Any:
    """The tensor of `planned` as stored (`read_planned`), flat, as a numpy array that widens exactly to float64.

    Raises:
        CorruptCheckpoint: it does not hold `numel` elements.
    """
    import ml_dtypes
    import torch

    tensor = read_planned(url, planned).reshape(-1)
    if tensor.numel() != numel:
        raise CorruptCheckpoint(f"{planned.name}: read {tensor.numel()} elements, expected {numel}")
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if tensor.dtype in (torch.float64, torch.float32, torch.float16):
        return tensor.numpy()
    return tensor.to(torch.float64).numpy()  # float8: numpy has no type, the widening is exact
