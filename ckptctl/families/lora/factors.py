"""LoRA factors found by their tensor names, checked against each other, and merged into base weights.

Two namings (peft 0.21.2):

- an adapter file (`save_pretrained`, `get_peft_model_state_dict`): the adapter name removed,
  `base_model.model.<module>.lora_A.weight` / `.lora_B.weight` (Linear layers) and
  `base_model.model.<module>.lora_embedding_A` / `_B` (Embedding layers); the `modules_to_save` copies
  under the module's own name (`base_model.model.lm_head.weight`);
- a PEFT-wrapped model's own state dict (what FSDP, DeepSpeed and DCP saves of it hold): the base layer as
  `<module>.base_layer.weight`, the factors as `<module>.lora_A.<adapter>.weight`, and a module to save as
  `<module>.original_module.weight` beside `<module>.modules_to_save.<adapter>.weight`.

`<module>` is the layer's name inside the base model (`model.layers.0.self_attn.q_proj`), the name PEFT
matches `rank_pattern` keys against. The merge is PEFT's own (`tuners/lora/layer.py`: `Linear.merge` and
`get_delta_weight`, `Embedding.get_delta_weight`): `W += transpose(B @ A, fan_in_fan_out) * scaling`, an
Embedding's product transposed, the sum rounded to W's dtype. 16-bit factors are taken in float32, as
`PeftModel.from_pretrained` loads them (`autocast_adapter_dtype=True` upcasts float16 and bfloat16 adapter
weights), so the delta is float32 and W is rounded once.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from ckptctl.checkpoint import Problem, ProblemKind, TensorEntry
from ckptctl.errors import CkptctlError
from ckptctl.families.lora.settings import LoraSettings

if TYPE_CHECKING:
    import torch

    from ckptctl.contract.capabilities import DerivedTensor

__all__ = [
    "PEFT_PREFIX",
    "Factors",
    "adapter_factors",
    "factor_problems",
    "merged_weight",
    "read_from",
]

#: What `PeftModel` puts in front of the base model's names (`PeftModel.base_model` is the `LoraModel`,
#: whose `model` is the base model).
PEFT_PREFIX = "base_model.model."
_FILE_FACTOR = re.compile(r"^(?P<module>.+)\.lora_(?P<side>A|B)\.weight$")
_FILE_EMBEDDING = re.compile(r"^(?P<module>.+)\.lora_embedding_(?P<side>A|B)$")
#: Other LoRA parameters an adapter may hold (a lora_B bias, DoRA magnitudes): never a base tensor.
_FILE_OTHER_LORA = re.compile(r"\.lora_(?:B\.bias|magnitude_vector(?:\.weight)?)$")
#: Reads one stored tensor (bound to the folder its chunks are relative to).
ReadTensor = Callable[[TensorEntry], "torch.Tensor"]


@dataclass(frozen=True, slots=True)
class Factors:
    """One adapted module's LoRA factors.

    Attributes:
        module: the module's name inside the base model.
        a: `lora_A` ([r, in]; an Embedding's `lora_embedding_A` is [r, num_embeddings]), or None when absent.
        b: `lora_B` ([out, r]; an Embedding's `lora_embedding_B` is [embedding_dim, r]), or None.
        embedding: the module is an Embedding (its product is transposed).
    """

    module: str
    a: TensorEntry | None
    b: TensorEntry | None
    embedding: bool = False


def adapter_factors(entries: Sequence[TensorEntry]) -> tuple[dict[str, Factors], dict[str, TensorEntry], list[str]]:
    """The LoRA factors of an adapter file's tensors by module, its other tensors by the base model's name
    (`modules_to_save` copies, and the embedding layers PEFT saves whole when it adapts them or the
    vocabulary was resized: `embed_tokens.base_layer.weight`), and the names of LoRA parameters that are
    neither (DoRA magnitudes, biases)."""
    halves: dict[str, dict[str, TensorEntry]] = {}
    embeddings: set[str] = set()
    others: dict[str, TensorEntry] = {}
    extra: list[str] = []
    for entry in entries:
        name = entry.name.removeprefix(PEFT_PREFIX)
        found = _FILE_FACTOR.match(name) or _FILE_EMBEDDING.match(name)
        if found is not None:
            halves.setdefault(found.group("module"), {})[found.group("side")] = entry
            if found.re is _FILE_EMBEDDING:
                embeddings.add(found.group("module"))
        elif _FILE_OTHER_LORA.search(name):
            extra.append(entry.name)
        else:  # a saved embedding layer keeps its wrapper's `base_layer` (save_embedding_layers)
            head, found_base, tail = name.rpartition(".base_layer.")
            others[f"{head}.{tail}" if found_base else name] = entry
    factors = {
        module: Factors(module, sides.get("A"), sides.get("B"), module in embeddings)
        for module, sides in halves.items()
    }
    return factors, others, extra


def factor_problems(factors: Mapping[str, Factors], settings: LoraSettings | None) -> list[Problem]:
    """What is wrong with the factors: a module with one factor only, factors that are not matrices, or whose
    ranks disagree with each other or with the rank the settings give the module."""
    problems = []
    for module, pair in factors.items():
        if pair.a is None or pair.b is None:
            have, lack = ("lora_A", "lora_B") if pair.b is None else ("lora_B", "lora_A")
            present = pair.a or pair.b
            problems.append(
                Problem(
                    ProblemKind.MISSING_FILE,
                    present.name if present is not None else module,
                    f"{module} has {have} but no {lack}: PEFT cannot load the adapter",
                )
            )
            continue
        if len(pair.a.shape) != 2 or len(pair.b.shape) != 2:
            problems.append(
                Problem(
                    ProblemKind.BAD_METADATA,
                    pair.a.name,
                    f"{module}: lora_A is {list(pair.a.shape)} and lora_B {list(pair.b.shape)}, not matrices "
                    "(a convolution's LoRA, which ckptctl does not check)",
                    severity="warning",
                )
            )
            continue
        rank_a, rank_b = pair.a.shape[0], pair.b.shape[1]
        if rank_a != rank_b:
            problems.append(
                Problem(
                    ProblemKind.BAD_METADATA,
                    pair.b.name,
                    f"{module}: lora_A is {list(pair.a.shape)} but lora_B {list(pair.b.shape)}: their ranks differ",
                )
            )
        elif settings is not None and settings.peft_type == "LORA" and rank_a != settings.rank(module):
            problems.append(
                Problem(
                    ProblemKind.BAD_METADATA,
                    pair.a.name,
                    f"{module}: the factors have rank {rank_a} but {settings.source} gives the module "
                    f"r={settings.rank(module)} (r and rank_pattern): PEFT cannot load them into the layers it builds",
                )
            )
    return problems


def merged_weight(
    pair: Factors,
    base: TensorEntry,
    settings: LoraSettings,
    read_base: ReadTensor,
    read_factor: ReadTensor,
    name: str,
    dtype: str | None = None,
) -> DerivedTensor:
    """The base weight `base` with the module's `B @ A` merged in, computed when written.

    Args:
        pair: the module's factors (both present).
        base: the base layer's weight.
        settings: the adapter's rank, alpha and layout settings.
        read_base: reads `base`.
        read_factor: reads the factors.
        name: the merged weight's name in the output.
        dtype: the output's dtype when it is not `base`'s (a layer the adapter saved whole, which PEFT loads
            into the base model's layer, of the base model's dtype).

    Raises:
        CkptctlError: the factors do not fit the base weight.
    """
    from ckptctl.contract.capabilities import DerivedTensor  # a merge's alone: a scan reads no factors

    assert pair.a is not None and pair.b is not None  # factor_problems reports a module missing one
    if len(pair.a.shape) != 2 or len(pair.b.shape) != 2 or len(base.shape) != 2:
        raise CkptctlError(
            f"{pair.module}: LoRA factors {list(pair.a.shape)} and {list(pair.b.shape)} on a weight of shape "
            f"{list(base.shape)}: ckptctl merges the LoRA of Linear and Embedding layers only",
            "merge it with PEFT's merge_and_unload()",
        )
    out, rank = pair.b.shape
    inner = pair.a.shape[1]
    transposed = pair.embedding or settings.fan_in_fan_out
    want = (inner, out) if transposed else (out, inner)
    if base.shape != want or pair.a.shape[0] != rank:
        raise CkptctlError(
            f"{pair.module}: the adapter's factors are {list(pair.a.shape)} and {list(pair.b.shape)}, which do not fit "
            f"the base weight {base.name} of shape {list(base.shape)}",
            "is the base model the one the adapter was trained on (adapter_config.json's base_model_name_or_path)?",
        )
    out_dtype = dtype or base.dtype
    compute = partial(
        _merge, read_base, base, read_factor, pair.a, pair.b, settings.scaling(pair.module), transposed, name, out_dtype
    )
    return DerivedTensor(name, out_dtype, base.shape, compute)


def read_from(url: str) -> ReadTensor:
    """A reader of the tensors whose chunks are relative to the folder `url`."""
    return partial(_read, url)


def _read(url: str, entry: TensorEntry) -> torch.Tensor:
    from ckptctl.formats.chunks import read_tensor

    return read_tensor(url, entry)


def _merge(
    read_base: ReadTensor,
    base: TensorEntry,
    read_factor: ReadTensor,
    a: TensorEntry,
    b: TensorEntry,
    scaling: float,
    transposed: bool,
    name: str,
    dtype: str,
) -> torch.Tensor:
    import torch

    weight_a, weight_b = read_factor(a), read_factor(b)
    if weight_b.dtype in (torch.float16, torch.bfloat16):  # as from_pretrained loads them: see the module
        weight_a, weight_b = weight_a.float(), weight_b.float()
    product = weight_b @ weight_a
    delta = (product.T if transposed else product) * scaling
    merged = read_base(base).to(getattr(torch, dtype), copy=True)
    if not merged.is_floating_point():
        raise CkptctlError(f"{name}: the base weight is {base.dtype}; a LoRA merge needs floating-point weights")
    merged += delta  # as PEFT's `base_layer.weight.data += delta_weight`: summed, then rounded to W's dtype
    return merged
