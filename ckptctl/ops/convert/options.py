"""What `convert` is asked to do (`ConvertOptions`) and what it did (`ConvertResult`)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from ckptctl.checkpoint import Component
from ckptctl.contract.wrapped import GivenScaling
from ckptctl.errors import CkptctlError
from ckptctl.formats.manifest import DIGESTS_NAME
from ckptctl.layouts import ConvertTarget
from ckptctl.ops.report import SCHEMA_VERSION

if TYPE_CHECKING:
    from ckptctl.ops.distributed_work import Ranks

#: What `convert` writes: the layouts it can write, by name.
Target = ConvertTarget


class Weights(enum.StrEnum):
    """Which weights make the model of a checkpoint that holds two copies (`ConvertSource.master_weights`)."""

    #: The fp32 master weights where the checkpoint has them, else the stored model weights.
    AUTO = "auto"
    #: The fp32 master weights (what the framework's own tool rebuilds); an error where there are none.
    MASTER = "master"
    #: The model weights as stored (mixed-precision training: its 16-bit weights).
    STORED = "stored"


class LoraMode(enum.StrEnum):
    """What `convert` does with adapters a model's state dict carries around its layers (`contract.wrapped`)."""

    #: Merge them into the base weights and write the model under its own names (what transformers loads).
    MERGE = "merge"
    #: Write the adapters alone, as their framework's adapter folder (PEFT's adapter_model.safetensors and
    #: adapter_config.json), which loads onto the base model.
    ADAPTER = "adapter"
    #: Write the tensors as stored (`base_layer`, `lora_A`, ... names), with no model check passing them.
    KEEP = "keep"


#: Accepted spellings of `dtype` -> torch dtype name.
DTYPE_NAMES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
}
DEFAULT_MAX_SHARD_SIZE = 5_000_000_000


def parse_dtype(text: str) -> str:
    """The torch dtype name of `bf16`, `fp16`, `fp32` (or their long names).

    Raises:
        ValueError: an unknown spelling.
    """
    found = DTYPE_NAMES.get(text.lower())
    if found is None:
        raise ValueError(f"{text!r} is not a dtype to convert to; choose bf16, fp16 or fp32")
    return found


@dataclass(frozen=True, slots=True)
class OutputOptions:
    """How a command that writes a model (`convert`, `average`) writes its output: the options the two share
    (their classes document each one as the command reads it).
    """

    to: Target = Target.HF
    dtype: str | None = None
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE
    dcp_file_size: int = DEFAULT_MAX_SHARD_SIZE
    mapping: str | None = None
    config_dir: str | None = None
    tokenizer_dir: str | None = None
    force: bool = False
    reread: bool = False
    workers: int | None = None
    check_model: bool = True
    ranks: Ranks | None = None

    def output_options(self) -> dict[str, Any]:
        """These options by name, as another command's options that write the same output take them."""
        return {f.name: getattr(self, f.name) for f in fields(OutputOptions)}


@dataclass(frozen=True, slots=True)
class ConvertOptions(OutputOptions):
    """What to convert and how.

    Attributes:
        to: `hf` or `dcp`.
        dtype: cast floating-point tensors to this torch dtype name (None keeps the stored dtypes).
        max_shard_size: most bytes of tensor data per output file (HF).
        component: which component's tensors to convert.
        strip_prefix: namespace prefix removed from names; None detects it as `diff` does (`ops.naming`:
            `model.` of DCP state dicts, the entry name of a save, training wrappers); "" keeps names as
            stored.
        renames: `(pattern, replacement)` regex substitutions applied in order after the prefix is removed
            (and after the name map).
        mapping: the source framework's map of its model's names to transformers' (`--to hf`;
            `ConvertSource.hf_name_map`): None picks one from the config, `"none"` keeps the names.
        config_dir: where `config.json`/`generation_config.json` come from (default: beside the source).
        tokenizer_dir: where tokenizer files come from (default: beside the source).
        dcp_file_size: most tensor bytes per data file of a `--to dcp` output (`max_shard_size` is the HF
            shards'); a file is the unit the ranks of a job share, and the output is the same on any number.
        force: replace a non-empty DST.
        layout: read the source as this layout instead of detecting it.
        reread: read every written file back from disk and compare its digest with the one computed while
            writing it (doubles the I/O; the headers are always read back and checked).
        workers: copy threads (default: cores, 2 to 8).
        weights: for sources that keep fp32 master weights apart from the model, those (`auto`, `master`)
            or the model weights as stored (`stored`); other sources have one copy of the model.
        check_model: build the architecture the output's config.json names with transformers (on the meta
            device) to resolve tied weights and check the model's tensors (`ops.convert.model_check`).
        check_logits: also compare the logits of the output (loaded by transformers) with those of the
            source tensors on a few fixed token ids (`--to hf`; holds two copies of the model in memory).
        merge_adapter: the base model (a checkpoint folder) to merge the source, an adapter, into; None
            takes the local folder the adapter itself names as its base, if any.
        lora: for a model whose layers carry LoRA adapters, merge them (`merge`), write the adapter alone
            (`adapter`), or keep the stored tensors.
        adapter_config: the adapter settings file (or its folder) that a wrapped model's merge takes the
            LoRA alpha from (default: found beside the checkpoint or its config).
        lora_alpha: the LoRA alpha of a wrapped model, for one without a settings file (wins over one found).
        lora_r: the rank the run was configured with (with `lora_alpha`; default: the factors' ranks).
        lora_rslora: with `lora_alpha`, the run used rsLoRA (scaling alpha/sqrt(r)).
        ranks: the ranks of a job (`ops.distributed_work.join`) that all run this conversion and share the
            writing of the output's data files; None: this process alone. The output is the same byte for byte.
    """

    component: Component = Component.MODEL
    strip_prefix: str | None = None
    renames: tuple[tuple[str, str], ...] = ()
    layout: str | None = None
    weights: Weights = Weights.AUTO
    check_logits: bool = False
    merge_adapter: str | None = None
    lora: LoraMode = LoraMode.MERGE
    adapter_config: str | None = None
    lora_alpha: float | None = None
    lora_r: int | None = None
    lora_rslora: bool = False

    def given_scaling(self) -> GivenScaling | None:
        """The LoRA scaling given by `lora_alpha` (with `lora_r`, `lora_rslora`), or None.

        Raises:
            CkptctlError: `lora_r` or `lora_rslora` without `lora_alpha`, an alpha that is not a finite number,
                a rank below 1, or `lora=keep`, which merges nothing.
        """
        if self.lora_alpha is None:
            if self.lora_r is not None or self.lora_rslora:
                raise CkptctlError("--lora-r and --lora-rslora go with --lora-alpha", "give the run's --lora-alpha too")
            return None
        if not math.isfinite(self.lora_alpha):  # nan would merge into NaN weights, and the merge "succeed"
            raise CkptctlError(f"--lora-alpha must be a finite number, not {self.lora_alpha}")
        if self.lora is LoraMode.KEEP:
            raise CkptctlError(
                "--lora-alpha scales adapters that are merged or written alone; --lora keep writes the tensors as stored",
                "drop --lora-alpha (--lora-r, --lora-rslora), or choose --lora merge or --lora adapter",
            )
        if self.lora_r is not None and self.lora_r < 1:
            raise CkptctlError(f"--lora-r must be at least 1, not {self.lora_r}")
        return GivenScaling(self.lora_alpha, self.lora_r, self.lora_rslora)


@dataclass(frozen=True, slots=True)
class ModelCheck:
    """What the model check found (`ConvertResult.model`).

    Attributes:
        architecture: the class the output's config names, as transformers built it.
        tensors: output tensors checked against it.
        tied: tied copies left out of an HF output, or written as keys of their own into a DCP output.
        logits_max_abs_diff: the largest difference between the output's and the source's logits
            (`check_logits`), or None when they were not compared.
    """

    architecture: str
    tensors: int
    tied: tuple[str, ...] = ()
    logits_max_abs_diff: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "architecture": self.architecture,
            "tensors": self.tensors,
            "tied": list(self.tied),
            "logits_max_abs_diff": self.logits_max_abs_diff,
        }


@dataclass(frozen=True, slots=True)
class ConvertResult:
    """What a conversion wrote.

    Attributes:
        src: the source checkpoint.
        dst: the output folder.
        to: `hf` or `dcp`.
        layout: the source's layout.
        tensors: tensors written.
        bytes: bytes of tensor data written.
        files: files of the output folder, relative to it.
        bytes_read: bytes read from the source.
        seconds: wall time.
        dtype: the dtype floating-point tensors were cast to, or None.
        copied: config and tokenizer files copied into the output.
        streamed: tensors byte-copied from their raw records.
        assembled: tensors decoded and assembled in memory (non-contiguous chunks, remote archives).
        warnings: things a person should know (no config found, ...).
        checkpoint: the checkpoint folder converted (the one a `latest` pointer names, given its run folder).
        weights: `master` (fp32 master weights rebuilt from optimizer partitions) or `stored`.
        uploaded: bytes uploaded to an object store DST (every file of the output; 0 for a local DST).
        model: what the check against the architecture of the output's config found, or None when there
            was none (no config, no architecture named, transformers not importable, `check_model` off).
        base: the base model an adapter was merged into ("" when the source is a model).
        derived: tensors computed rather than copied (the weights an adapter was merged into).
        mapping: how an HF model's names were made transformers': the name of the framework's tensor name map
            applied (`llama3`), `none` when the tensors keep their stored names as asked (`--mapping none`; with
            no config, nothing proves the output loads), None otherwise (names as stored, checked by the config,
            or a layout's own transformers model: Megatron's).
    """

    src: str
    dst: str
    to: str
    layout: str
    tensors: int
    bytes: int
    files: tuple[str, ...]
    bytes_read: int
    seconds: float
    dtype: str | None
    copied: tuple[str, ...] = ()
    streamed: int = 0
    assembled: int = 0
    warnings: tuple[str, ...] = field(default_factory=tuple)
    checkpoint: str = ""
    weights: str = Weights.STORED.value
    uploaded: int = 0
    model: ModelCheck | None = None
    base: str = ""
    derived: int = 0
    mapping: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "src": self.src,
            "checkpoint": self.checkpoint or self.src,
            "dst": self.dst,
            "to": self.to,
            "layout": self.layout,
            "tensors": self.tensors,
            "bytes": self.bytes,
            "files": list(self.files),
            "bytes_read": self.bytes_read,
            "bytes_uploaded": self.uploaded,
            "seconds": round(self.seconds, 3),
            "dtype": self.dtype,
            "weights": self.weights,
            "copied": list(self.copied),
            "streamed_tensors": self.streamed,
            "assembled_tensors": self.assembled,
            "digests": DIGESTS_NAME,
            "warnings": list(self.warnings),
            "model_check": self.model.to_json() if self.model is not None else None,
            "base": self.base or None,
            "derived_tensors": self.derived,
            "mapping": self.mapping,
        }
