"""The converted model against the model its `config.json` describes, before a byte is written.

Bytes copied exactly can still make a model that does not load, or loads wrong: a tensor left behind (an
expert, a bias), one of another shape (a (1,) buffer turned into (8,)), a tied `lm_head.weight` missing
where `dcp.load` wants it. When the output carries a config that names an architecture, the HF layout
builds that model with transformers on the meta device (`ConvertSource.model_spec`: no memory, no weights) and
the plan is held against it:

- tied copies: an HF output leaves them out as transformers' `save_pretrained` does (after checking they
  equal the tensor they are tied to); a DCP output gets them as keys of their own, since
  `dcp.load({"model": model.state_dict()})` asks for every key of the state dict.
- every tensor the model expects is planned with its shape (an HF output: what `save_pretrained` would
  write; a DCP output: the model's state dict), and nothing is left over, except what transformers itself
  ignores on load.

The writers check that the output holds exactly the plan, so this is a check of the output. A mismatch
raises `ModelMismatch` (exit 1) and nothing reaches DST. `check_logits` goes further, after writing: the
output loaded by `from_pretrained` against the source tensors loaded into the same architecture, on a
few fixed token ids.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import Checkpoint
from ckptctl.contract.capabilities import ModelSpec
from ckptctl.errors import CkptctlError, ModelMismatch
from ckptctl.families.hf_model_class import excess_layers
from ckptctl.formats.documents import parse_json
from ckptctl.ops.convert.options import Target
from ckptctl.ops.convert.plan import Planned, float_dtype, read_planned
from ckptctl.ops.convert_source import convert_source

#: Names of each kind listed in a mismatch message; the rest are counted.
_LISTED = 5
#: Relative tolerance of the logits comparison by the dtype the weights are held in: the same weights in
#: the same dtype give the same logits; this only absorbs kernels that reduce in another order.
_LOGITS_RTOL = {"float64": 1e-9, "float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-3}
_NO_CHECK_HINT = "pass --no-check-model to write it anyway"


def read_config(files: Mapping[str, str], notes: list[str]) -> dict[str, Any] | None:
    """The parsed config.json among the side files the output gets, or None (with a note if it is bad)."""
    url = files.get("config.json")
    if url is None:
        return None
    try:
        config = parse_json(io.read_bytes(url, max_size=_MAX_CONFIG), "config.json")
    except CkptctlError as exc:
        notes.append(f"config.json does not parse ({exc.message}): the tensors were not checked against a model")
        return None
    return config if isinstance(config, dict) else None


#: The largest config.json read for the check (real ones are a few KiB; multimodal ones tens of KiB).
_MAX_CONFIG = 16 << 20


def model_spec(config: Mapping[str, Any], plan: Sequence[Planned], notes: list[str]) -> ModelSpec | None:
    """The model the output's `config` describes (`ConvertSource.model_spec` of the HF layout: config.json is a
    transformers config whatever the target), or None with a note.

    Raises:
        ModelMismatch: the config asks for more layers or experts than the checkpoint could hold, or
            transformers cannot build a model from it.
    """
    excess = excess_layers(config, len(plan))
    if excess is not None:
        raise ModelMismatch(
            f"config.json says {excess}, more than the {len(plan)} tensors of the checkpoint can make up",
            f"pass the config of this model with --config, or {_NO_CHECK_HINT}",
        )
    return convert_source(Target.HF).model_spec(config, notes)


def apply_ties(
    checkpoint: Checkpoint, plan: list[Planned], spec: ModelSpec, target: Target
) -> tuple[list[Planned], tuple[str, ...]]:
    """The plan with the tied copies of `spec` resolved for `target`, and the copies left out (HF) or added
    (DCP).

    Raises:
        ModelMismatch: a tied copy the source holds differs from the tensor the config ties it to.
    """
    by_name = {p.name: p for p in plan}
    dropped: set[str] = set()
    added: list[Planned] = []
    for alias, source in spec.tied.items():
        kept = by_name.get(source)
        if kept is None:
            continue  # the check names the missing tensor
        copy = by_name.get(alias)
        if copy is None:
            if target is Target.DCP:
                added.append(replace(kept, name=alias))
            continue
        if not _same_values(checkpoint, copy, kept):
            raise ModelMismatch(
                f"{alias} differs from {source}, and config.json ties them (tie_word_embeddings): transformers "
                "would load one tensor for both",
                f"if the model was trained with them untied, pass a config saying tie_word_embeddings=false with "
                f"--config; or {_NO_CHECK_HINT}",
            )
        if target is Target.HF:
            dropped.add(alias)
    resolved = [p for p in plan if p.name not in dropped] + added
    return resolved, tuple(sorted(dropped | {p.name for p in added}))


def _same_values(checkpoint: Checkpoint, a: Planned, b: Planned) -> bool:
    """Whether two planned tensors hold the same elements: the same bytes of the source, or read and compared
    (a DCP checkpoint stores a tied copy as an item of its own)."""
    if (a.entry.dtype, a.shape, a.dtype) != (b.entry.dtype, b.shape, b.dtype):
        return False
    if a.derived is None and b.derived is None and a.entry.chunks == b.entry.chunks:
        return True
    import torch

    return torch.equal(read_planned(checkpoint.url, a), read_planned(checkpoint.url, b))


def check_plan(plan: Sequence[Planned], spec: ModelSpec, target: Target) -> None:
    """Every tensor the model expects is planned with its shape, and nothing is left over.

    Raises:
        ModelMismatch: what is missing, of another shape, or left over (a few of each, and how many).
    """
    expected = spec.saved if target is Target.HF else spec.state
    planned = {p.name: p.shape for p in plan}
    ignored_missing = [re.compile(pattern) for pattern in spec.ignored_missing]
    ignored_leftovers = [re.compile(pattern) for pattern in spec.ignored_leftovers]
    missing = [name for name in expected if name not in planned and not any(p.search(name) for p in ignored_missing)]
    reshaped = []
    leftovers = []
    for name, shape in planned.items():
        want = expected.get(name, spec.state.get(name) if name in spec.tied else None)
        if want is None:
            if not any(p.search(name) for p in ignored_leftovers):
                leftovers.append(name)
        elif want != shape:
            reshaped.append(f"{name} is {list(shape)} where the model's is {list(want)}")
    if not (missing or reshaped or leftovers):
        return
    parts = [
        _listed(what, names)
        for what, names in (("missing", missing), ("wrong shape", reshaped), ("left over", leftovers))
        if names
    ]
    raise ModelMismatch(
        f"the output does not match {spec.architecture}, the model its config.json names: {'; '.join(parts)}",
        "check the source, --rename and --strip-prefix (and --config: is it this model's?); " + _NO_CHECK_HINT,
    )


def _listed(what: str, names: Sequence[str]) -> str:
    more = f" and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    return f"{what}: {', '.join(names[:_LISTED])}{more}"


def compare_logits(checkpoint: Checkpoint, plan: Sequence[Planned], out: str, config: Mapping[str, Any]) -> float:
    """The largest difference between the logits of the output in `out` (as `from_pretrained` loads it) and
    those of the source tensors, cast as planned, in the same architecture.

    Holds the source tensors and two copies of the model in memory.

    Raises:
        ModelMismatch: either model loads with tensors missing or left over, or the logits differ by more
            than the dtype of the weights explains.
    """
    hf = convert_source(Target.HF)
    got = hf.model_logits(out, config, None)
    source = {planned.name: read_planned(checkpoint.url, planned) for planned in plan}
    want = hf.model_logits(out, config, source)
    source.clear()
    if got.shape != want.shape:
        raise ModelMismatch(f"the output's logits have shape {list(got.shape)}, the source's {list(want.shape)}")
    difference = float((got - want).abs().max()) if got.numel() else 0.0
    scale = float(want.abs().max()) if want.numel() else 0.0
    held = float_dtype(plan) or "float32"
    if not difference <= _LOGITS_RTOL.get(held, 2e-2) * max(scale, 1.0):  # also catches NaN
        raise ModelMismatch(
            f"the output's logits differ from the source's by up to {difference:.3g} (largest logit {scale:.3g}) "
            "on a few fixed token ids",
            "the converted model does not compute what the source does: compare them with `ckptctl diff`",
        )
    return difference
