"""Hugging Face model folders as `save_pretrained` writes them.

`model.safetensors`, or `model-0000i-of-0000N.safetensors` shards with `model.safetensors.index.json`
(`{"metadata": {"total_size"}, "weight_map": {name: file}}`), plus `config.json`, `generation_config.json`
and tokenizer files. Only headers are read: a 100 GB model opens with a few range reads.

Legacy folders (transformers before 5 with `safe_serialization=False`, and most models published before
2023) hold `pytorch_model.bin`, or `pytorch_model-0000i-of-0000N.bin` shards with
`pytorch_model.bin.index.json`: torch.save zip files of the state dict. They are read as torch zips (the
zip directory and `data.pkl` through the allowlisting unpickler; nothing in them runs), and each tensor
is a plain byte range of its storage record. As in transformers, safetensors weights win when a folder
has both.

`save_pretrained(distributed_checkpoint=True)` writes per-rank pieces of each tensor instead
(`shard-0000P-model-0000i-of-0000N.safetensors`): read as whole tensors with `hf_rank_shards`.

A shared part: the HF plugin's layout subclasses `HfFolderLayout` (adding its resume profile and the
model transformers builds), and the plugins whose checkpoints hold a model folder (the Trainer's
`checkpoint-N`, ROLL, AReaL, OpenRLHF, open-instruct, accelerate) read it with the functions below.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import cache, partial
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import (
    Checkpoint,
    CheckpointRef,
    CheckpointState,
    ChunkEncoding,
    Component,
    Problem,
    ProblemKind,
    TensorChunk,
    TensorEntry,
)
from ckptctl.contract.base import Layout, absent_numbers, newest_mtime, step_from_name, timestamp
from ckptctl.contract.load_set import LoadMember, MemberKind, Need, check_load_set
from ckptctl.contract.step_names import epoch_from_name
from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.families.hf_rank_shards import (
    SHARD_FILE,
    is_distributed,
    missing_rank_files,
    rank_files,
    shards_index,
    shards_problems,
)
from ckptctl.families.torch_file import torch_file_problems
from ckptctl.formats.documents import read_json
from ckptctl.formats.safetensors import read_header
from ckptctl.formats.torch_pickle import TorchPickle, open_torch_pickle
from ckptctl.io import DirEntry

INDEX_NAMES = ("model.safetensors.index.json", "adapter_model.safetensors.index.json")
_SHARD = re.compile(r"^(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.(?P<ext>safetensors|bin)$")
#: The index of legacy `pytorch_model-0000i-of-0000N.bin` shards (transformers' WEIGHTS_INDEX_NAME).
LEGACY_INDEX = "pytorch_model.bin.index.json"
_TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "vocab.json",
        "merges.txt",
        "vocab.txt",
        "special_tokens_map.json",
        "spiece.model",
    }
)
_CONFIG_FILES = frozenset({"config.json", "generation_config.json", "adapter_config.json"})
_LEGACY_WEIGHTS = ("pytorch_model.bin", LEGACY_INDEX)
#: Config fields worth showing in `inspect`.
_CONFIG_SUMMARY = (
    "model_type",
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
    "torch_dtype",
    "dtype",
    "tie_word_embeddings",
)


def _shards_missing(names: set[str]) -> tuple[list[str], int]:
    """Shard files a `-0000i-of-0000N` naming promises but the folder lacks (judged from names only): the
    first `LISTED_ABSENT` of each series (stem, N), and how many are missing in all."""
    series: dict[tuple[str, int, str], set[int]] = {}
    for name in names:
        if (m := _SHARD.match(name)) and (m.group("ext") == "safetensors" or _is_legacy_weight(name)):
            series.setdefault((m.group("stem"), int(m.group("n")), m.group("ext")), set()).add(int(m.group("i")) - 1)
    listed: list[str] = []
    total = 0
    for (stem, n, ext), present in series.items():
        numbers, absent = absent_numbers(present, n)
        listed += [f"{stem}-{i + 1:05d}-of-{n:05d}.{ext}" for i in numbers]
        total += absent
    return sorted(listed), total


def _is_legacy_weight(name: str) -> bool:
    """`pytorch_model.bin` or one of its `-0000i-of-0000N` shards (not `training_args.bin` beside them)."""
    return name == _LEGACY_WEIGHTS[0] or (name.startswith("pytorch_model") and bool(_SHARD.match(name)))


class HfFolderLayout(Layout):
    """The reader of a Hugging Face model folder (safetensors, single file or sharded with an index); the
    plugins whose checkpoints hold one open it with this (its refs read as `hf`).

    `save_pretrained` writes files only, and often into a folder that holds more: the Trainer's
    `output_dir` with `checkpoint-N/` beside the final model, a DCP or DeepSpeed run with an exported
    model beside its steps, a hub snapshot with `original/`. So a model folder has no member folders
    (`Layout.members`): its checkpoint is the files at its top, and every child folder is walked.
    """

    name = "hf"

    def identify(self, url: str, entries: Sequence[DirEntry]) -> CheckpointRef | None:
        names = {e.name for e in entries if not e.is_dir}
        if not has_weights(names):
            return None
        missing, missing_count = _shards_missing(names)
        if is_distributed(names):  # reads the pieces' headers: their offsets show a rank's files missing
            absent = missing_rank_files(url, {e.name: e.size for e in entries if not e.is_dir})
            missing, missing_count = missing + absent, missing_count + len(absent)
        index_without_shards = (
            any(n in names for n in INDEX_NAMES) and not any(n.endswith(".safetensors") for n in names)
        ) or (LEGACY_INDEX in names and not any(_is_legacy_weight(n) for n in names))
        state = CheckpointState.BROKEN if missing or index_without_shards else CheckpointState.COMPLETE
        more = f" and {missing_count - len(missing)} more" if missing_count > len(missing) else ""
        note = (
            f"missing {', '.join(missing)}{more}"
            if missing
            else ("index names no present file" if index_without_shards else "")
        )
        return CheckpointRef(
            url=url,
            layout=self.name,
            step=step_from_name(io.name_of(url)),
            epoch=epoch_from_name(io.name_of(url)),
            created=timestamp(newest_mtime(entries)),
            state=state,
            size_bytes=sum(e.size for e in entries if not e.is_dir),
            note=note,
        )

    def open(self, url: str) -> Checkpoint:
        entries = io.list_dir(url)
        ref = self.identify(url, entries)
        if ref is None:
            raise CorruptCheckpoint(f"{url} holds no model weights")
        files = {e.name: e.size for e in entries if not e.is_dir}  # its own files: none of a child folder's
        names = set(files)
        weights = weight_files(url, names) or legacy_weight_files(url, names)
        ranks = rank_files(names)
        metadata = model_metadata(url, names, weights)
        if ranks:
            metadata["distributed"] = (
                f"per-rank pieces of {len(ranks)} rank(s) (save_pretrained(distributed_checkpoint=True)); the full "
                "shapes are where the pieces end"
            )

        @cache
        def tensor_index() -> tuple[TensorEntry, ...]:
            if weights and weights[0].endswith(".bin"):
                return legacy_index(url, weights, files)
            return safetensors_index(url, weights, files)

        return Checkpoint(
            ref=ref,
            components=frozenset(model_components(names)),
            world_size=max(ranks) if ranks else None,
            metadata=metadata,
            tensor_index=tensor_index,
            files=files,
        )

    def verify(self, checkpoint: Checkpoint) -> list[Problem]:
        return verify_model_files(checkpoint.url, checkpoint.files)

    def completion_markers(self, files: Mapping[str, int]) -> tuple[str, ...]:
        """The index, then one shard (or the single weights file): see `model_markers`."""
        return model_markers({name: size for name, size in files.items() if "/" not in name})


# --------------------------------------------------------------------------------------------------
# Shared with the layouts whose checkpoints hold an HF model folder (the HF Trainer's `checkpoint-N`).
# --------------------------------------------------------------------------------------------------


def missing_shards(names: Iterable[str]) -> list[str]:
    """Shard files a `-0000i-of-0000N` naming promises but `names` lacks (judged from the names only; at
    most `LISTED_ABSENT` of each series)."""
    return _shards_missing(set(names))[0]


def model_markers(files: Mapping[str, int]) -> tuple[str, ...]:
    """What makes a model folder read as complete, from its top-level files (name -> size): the index files
    (they describe the shards), then one shard of each `-0000i-of-0000N` set, the smallest (with one
    missing, the naming shows the folder broken; the smallest is the quickest to write last), and the
    single weight files (without them it holds no model)."""
    found = [name for name in (*INDEX_NAMES, _LEGACY_WEIGHTS[1]) if name in files]
    stems: dict[str, list[str]] = {}
    for name in sorted(files):
        if m := _SHARD.match(name):
            stems.setdefault(f"{m.group('stem')}-of-{m.group('n')}", []).append(name)
        elif name.endswith(".safetensors") or name == _LEGACY_WEIGHTS[0]:
            found.append(name)
    found += [min(shards, key=lambda name: (files[name], name)) for shards in stems.values()]
    return tuple(found)


def has_weights(names: Iterable[str]) -> bool:
    """Whether a folder's top-level file names include model weights (safetensors, index or legacy bin)."""
    return any(
        n.endswith(".safetensors") or n in INDEX_NAMES or n in _LEGACY_WEIGHTS or _is_legacy_weight(n) for n in names
    )


def model_components(names: set[str]) -> set[Component]:
    """MODEL, CONFIG and TOKENIZER, as far as the file names of a model folder show them."""
    components = set()
    if any(n.endswith(".safetensors") or n in _LEGACY_WEIGHTS or _is_legacy_weight(n) for n in names):
        components.add(Component.MODEL)
    if names & _CONFIG_FILES:
        components.add(Component.CONFIG)
    if names & _TOKENIZER_FILES:
        components.add(Component.TOKENIZER)
    return components


def model_metadata(url: str, names: set[str], weights: Sequence[str]) -> dict[str, Any]:
    """The config summary of a model folder (a small read of `config.json`) and its weight-file count."""
    metadata: dict[str, Any] = {}
    config = _read_json_or_none(io.join(url, "config.json")) if "config.json" in names else None
    if isinstance(config, dict):
        metadata["config"] = {k: config[k] for k in _CONFIG_SUMMARY if k in config}
    if not weights and any(n in names for n in _LEGACY_WEIGHTS) and not any(n.endswith(".safetensors") for n in names):
        metadata["note"] = "pickle weights (pytorch_model.bin) are not indexed; convert them to safetensors"
    elif weights and weights[0].endswith(".bin"):
        metadata["format"] = "pytorch_model.bin: torch.save zip (read without unpickling code)"
    metadata["weight_files"] = len(weights)
    return metadata


def verify_model_files(url: str, files: Mapping[str, int]) -> list[Problem]:
    """Structural problems of the model files of a folder: config and index parse, every shard the index
    or the shard naming promises is present, headers are valid, and each tensor is where the index says.

    Safetensors files and legacy `pytorch_model*.bin` files are checked apart (a folder on the hub often
    holds both, the same tensors in each): a torch zip's directory and `data.pkl` must read with the
    allowlist and every storage it names must lie whole inside the file (a truncated bin fails here).

    Args:
        url: the model folder.
        files: the files at its top (name -> size): a safetensors file in a child folder belongs to
            another model, and its tensors would read as duplicates of this one's.
    """
    problems: list[Problem] = []
    config = None
    if "config.json" in files:
        try:
            config = read_json(io.join(url, "config.json"))
        except CorruptCheckpoint as exc:
            problems.append(
                Problem(ProblemKind.BAD_METADATA, "config.json", f"config.json does not parse: {exc.message}")
            )
    problems += check_load_set(url, model_load_set(files, config), files, problems)
    safetensors = sorted(n for n in files if n.endswith(".safetensors") and not SHARD_FILE.match(n))
    legacy = sorted(n for n in files if _is_legacy_weight(n))
    weight_map, indexed = _index_problems(url, files, INDEX_NAMES, problems)
    legacy_map, legacy_indexed = _index_problems(url, files, (LEGACY_INDEX,), problems)
    promised, promised_count = _shards_missing(set(files))
    problems += [
        Problem(ProblemKind.MISSING_FILE, shard, f"shard {shard} is missing")
        for shard in promised
        if shard not in indexed | legacy_indexed
    ]
    if promised_count > len(promised):
        problems.append(
            Problem(ProblemKind.MISSING_FILE, "", f"{promised_count - len(promised)} more shards are missing")
        )
    if is_distributed(files):
        problems += shards_problems(url, files)
    located: dict[str, str] = {}
    for rel in safetensors:
        try:
            header = read_header(io.join(url, rel), files[rel])
        except CkptctlError as exc:
            problems.append(Problem.from_error(exc, rel))
            continue
        problems += _locate(located, rel, (rec.name for rec in header.tensors))
    problems += _placement_problems(weight_map, located, files)
    located = {}
    for rel in legacy:
        opened, found = torch_file_problems(rel, partial(open_torch_pickle, io.join(url, rel), files[rel]))
        problems += found
        if opened is None:
            continue
        problems += _locate(located, rel, (name for name, _ in opened.tensors()))
    problems += _placement_problems(legacy_map, located, files)
    return problems


#: JSON side files of a model folder and what reads them: a truncated one fails the load that reads it.
_JSON_SIDE_FILES = {
    "config.json": "transformers PretrainedConfig.from_pretrained",
    "generation_config.json": "transformers GenerationConfig.from_pretrained (from_pretrained of a generative model)",
    "tokenizer.json": "tokenizers Tokenizer.from_file (AutoTokenizer.from_pretrained)",
    "tokenizer_config.json": "transformers PreTrainedTokenizerBase.from_pretrained (AutoTokenizer)",
    "special_tokens_map.json": "transformers PreTrainedTokenizerBase.from_pretrained (AutoTokenizer)",
    "added_tokens.json": "transformers PreTrainedTokenizerBase.from_pretrained (AutoTokenizer)",
    "vocab.json": "the tokenizer's own from_pretrained (AutoTokenizer)",
    "chat_template.json": "transformers PreTrainedTokenizerBase.from_pretrained (AutoTokenizer, AutoProcessor)",
    "preprocessor_config.json": "transformers AutoProcessor.from_pretrained",
    "adapter_config.json": "peft PeftConfig.from_pretrained",
}
#: Files only `save_pretrained` (of a model or its tokenizer) writes: a folder holding one of them beside its
#: weights is a model folder meant for `from_pretrained`, which reads config.json first. Not a shard index:
#: `convert` without a config, accelerate's `save_model` and `save_torch_state_dict` write one too.
_SAVE_PRETRAINED_FILES = (_TOKENIZER_FILES | {"generation_config.json"}) - {"vocab.txt"}


def model_load_set(files: Mapping[str, int], config: Any) -> list[LoadMember]:
    """What `from_pretrained` (and `AutoTokenizer.from_pretrained`) read of a model folder beyond its weights, given
    its files and its parsed config.json (None when it has none, or one that does not parse).

    - Every JSON side file present must parse (transformers `configuration_utils.PretrainedConfig.
      _dict_from_json_file`, `tokenization_utils_base.PreTrainedTokenizerBase._from_pretrained` and tokenizers'
      `Tokenizer.from_file` raise on a truncated one).
    - config.json: `AutoModel*.from_pretrained` and `AutoConfig.from_pretrained` raise without it
      (`configuration_utils.PretrainedConfig._get_config_dict`). A folder that also holds files only
      `save_pretrained` writes (tokenizer files, a generation config) is a model folder that lost it: an
      error. A folder of bare weights (with a shard index or not) may be meant for `safetensors.load_file`
      (accelerate's model file, a `save_file` output, `convert` without a config): nothing is required of it.
      A PEFT adapter folder has adapter_config.json instead.
    - The shard index of `-0000i-of-0000N` shards: `modeling_utils._get_resolved_checkpoint_files` looks for
      `model.safetensors` or the index, and raises with shards alone.
    - generation_config.json of a generative model that transformers >= 4.26 saved (`save_pretrained` writes
      it whenever `can_generate()`): without it `from_pretrained` catches the error and builds one from the
      model config (`modeling_utils.PreTrainedModel.from_pretrained`). That loses nothing when the file was
      itself made from the model config (`_from_model_config`, most saves), and the settings of its own when
      it had any (sampling defaults, stop ids): which one cannot be told once it is gone, so its absence is a
      warning. One that is there but does not parse is damage: an error, like every JSON side file.
    """
    members = [
        LoadMember(name, MemberKind.JSON, name, read_by)
        for name, read_by in _JSON_SIDE_FILES.items()
        if name in files and name != "config.json"
    ]
    if "adapter_config.json" in files or not has_weights(files):
        return members
    if any(n in files for n in _SAVE_PRETRAINED_FILES):
        members.append(
            LoadMember("config.json", MemberKind.JSON, "the model's config.json", _JSON_SIDE_FILES["config.json"])
        )
    for stem, index in (("model", INDEX_NAMES[0]), ("pytorch_model", LEGACY_INDEX)):
        if any((m := _SHARD.match(n)) and m.group("stem") == stem and m.group("n") != "00001" for n in files):
            members.append(
                LoadMember(
                    index, MemberKind.JSON, f"the shard index {index}", "transformers _get_resolved_checkpoint_files"
                )
            )
    if _saves_generation_config(config):
        members.append(
            LoadMember(
                "generation_config.json",
                MemberKind.JSON,
                "the saved generation config",
                "transformers PreTrainedModel.from_pretrained (GenerationConfig.from_pretrained)",
                Need.WARNS,
            )
        )
    return members


#: Architectures whose models generate (`can_generate()`), by the ends of their class names.
_GENERATIVE = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def _saves_generation_config(config: Any) -> bool:
    """Whether config.json says transformers >= 4.26 saved a generative model (and so generation_config.json)."""
    if not isinstance(config, dict):
        return False
    architectures = config.get("architectures")
    version = config.get("transformers_version")
    if not isinstance(architectures, list) or not isinstance(version, str):
        return False
    release = tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    return release >= (4, 26) and any(isinstance(a, str) and a.endswith(_GENERATIVE) for a in architectures)


def _index_problems(
    url: str, files: Mapping[str, int], index_names: Sequence[str], problems: list[Problem]
) -> tuple[Mapping[str, str], set[str]]:
    """The weight map of the first of `index_names` present (later ones replace it) and the files it names,
    appending to `problems` what is wrong with each index: unparseable, files missing, a wrong total size."""
    weight_map: Mapping[str, str] = {}
    for index_name in index_names:
        if index_name not in files:
            continue
        try:
            weight_map, total_size = _read_index_and_total(io.join(url, index_name))
        except CorruptCheckpoint as exc:
            problems.append(Problem(ProblemKind.BAD_METADATA, index_name, exc.message))
            continue
        absent_shards = sorted(set(weight_map.values()) - set(files))
        problems += [
            Problem(ProblemKind.MISSING_FILE, shard, f"{index_name} names {shard}, which is missing")
            for shard in absent_shards[:_LISTED]
        ]
        problems += _more(
            ProblemKind.MISSING_FILE, index_name, len(absent_shards), "{path} names {count} more files that are missing"
        )
        problems.extend(_total_size_problems(index_name, total_size, weight_map, files))
    return weight_map, set(weight_map.values())


def _locate(located: dict[str, str], rel: str, names: Iterable[str]) -> list[Problem]:
    """Record that the tensors `names` are in `rel`; a problem for each one another file holds already."""
    problems = []
    for name in names:
        if name in located:
            problems.append(Problem(ProblemKind.BAD_METADATA, rel, f"tensor {name!r} is also in {located[name]}"))
        located[name] = rel
    return problems


def _placement_problems(
    weight_map: Mapping[str, str], located: Mapping[str, str], files: Mapping[str, int]
) -> list[Problem]:
    """Where the index puts a tensor in another file than the one holding it, or in a file that lacks it."""
    problems: list[Problem] = []
    misplaced: dict[str, list[str]] = {}
    absent: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        if shard in files and located.get(name) not in (None, shard):
            misplaced.setdefault(shard, []).append(name)
        elif shard in files and name not in located:
            absent.setdefault(shard, []).append(name)
    for shard, names in misplaced.items():
        problems += [
            Problem(ProblemKind.BAD_METADATA, shard, f"index puts {n!r} in {shard} but it is in {located[n]}")
            for n in names[:_LISTED]
        ]
        problems += _more(
            ProblemKind.BAD_METADATA,
            shard,
            len(names),
            "index puts {count} more tensors in {path} that are in other files",
        )
    for shard, names in absent.items():
        problems += [
            Problem(ProblemKind.MISSING_FILE, shard, f"index names tensor {n!r} but {shard} lacks it")
            for n in names[:_LISTED]
        ]
        problems += _more(
            ProblemKind.MISSING_FILE, shard, len(names), "index names {count} more tensors that {path} lacks"
        )
    return problems


#: Problems of one kind listed one by one per file; past that, one problem counts the rest: an index of a
#: million entries that does not match its shards must not turn into a million problems.
_LISTED = 20


def _more(kind: ProblemKind, path: str, count: int, message: str) -> list[Problem]:
    """One problem counting what is left of `count` once `_LISTED` were listed (`message` has `{count}`
    and `{path}`); none when all were."""
    if count <= _LISTED:
        return []
    return [Problem(kind, path, message.format(count=count - _LISTED, path=path))]


def _read_json_or_none(url: str) -> Any:
    try:
        return read_json(url)
    except CkptctlError:
        return None


def _total_size_problems(
    index_name: str, total: Any, weight_map: Mapping[str, str], files: Mapping[str, int]
) -> list[Problem]:
    """What is wrong with the index's `metadata.total_size` (optional): transformers writes the bytes of the
    tensors there, so it is a non-negative integer that the shards it names can hold."""
    if total is None:
        return []
    if type(total) is float and math.isfinite(total) and total.is_integer():
        total = int(total)
    if type(total) is not int or total < 0:
        shown = repr(total) if type(total) is not int else "negative"
        return [Problem(ProblemKind.BAD_METADATA, index_name, f"metadata.total_size {shown:.40} is not a byte count")]
    shards = set(weight_map.values())
    held = sum(files[shard] for shard in shards) if shards <= set(files) else None
    if held is not None and total > held:
        claimed = total if total < 1 << 63 else "more than 2**63"
        message = f"metadata.total_size claims {claimed} bytes but the shards it names hold {held}"
        return [Problem(ProblemKind.BAD_METADATA, index_name, message)]
    return []


def _read_index(url: str) -> dict[str, str]:
    return _read_index_and_total(url)[0]


def _read_index_and_total(url: str) -> tuple[dict[str, str], Any]:
    """The index's weight_map (validated) and its `metadata.total_size` as written (None when absent)."""
    try:
        doc = read_json(url)
    except CorruptCheckpoint as exc:
        raise CorruptCheckpoint(f"{io.name_of(url)} does not parse: {exc.message}") from exc
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CorruptCheckpoint(f"{io.name_of(url)} has no valid weight_map")
    for shard in weight_map.values():
        if "/" in shard or shard.startswith(".."):
            raise CorruptCheckpoint(f"{io.name_of(url)} names a file outside the folder: {shard!r}")
    metadata = doc.get("metadata")
    return weight_map, metadata.get("total_size") if isinstance(metadata, dict) else None


def weight_files(url: str, names: set[str]) -> list[str]:
    """The safetensors files holding the weights: those the index names, else every *.safetensors at the top.

    Args:
        url: the model folder.
        names: file names relative to it.
    """
    for index_name in INDEX_NAMES:
        if index_name in names:
            try:
                return sorted(set(_read_index(io.join(url, index_name)).values()) & names)
            except CorruptCheckpoint:
                break
    return sorted(n for n in names if n.endswith(".safetensors") and "/" not in n)


def legacy_weight_files(url: str, names: set[str]) -> list[str]:
    """The legacy torch.save files holding the weights: those `pytorch_model.bin.index.json` names, else
    `pytorch_model.bin` and every `pytorch_model-0000i-of-0000N.bin` at the top.

    Args:
        url: the model folder.
        names: file names relative to it.
    """
    if LEGACY_INDEX in names:
        try:
            return sorted(set(_read_index(io.join(url, LEGACY_INDEX)).values()) & names)
        except CorruptCheckpoint:
            pass
    return sorted(n for n in names if _is_legacy_weight(n))


def legacy_index(url: str, weights: Sequence[str], files: Mapping[str, int]) -> tuple[TensorEntry, ...]:
    """The tensors of the torch.save files `weights` (relative to `url`), from their zip directories and
    `data.pkl` (read with the allowlist), all of the model. See `torch_file_entries` for tied weights."""
    entries: list[TensorEntry] = []
    for rel in weights:
        opened = open_torch_pickle(io.join(url, rel), files.get(rel))
        entries += torch_file_entries(opened, rel, lambda _name: Component.MODEL)
    return tuple(entries)


def torch_file_entries(opened: TorchPickle, rel: str, classify: Callable[[str], Component]) -> list[TensorEntry]:
    """Every tensor of an opened torch.save file, as RAW chunks of the file `rel` (none for a tensor that is
    not one contiguous range), its component given by `classify(name)`.

    A state dict of a model with tied weights pickles one tensor under two names (`lm_head.weight` is
    `model.embed_tokens.weight`): the later names of the same elements are left out, as transformers leaves
    them out of a safetensors save, so that they count once and convert to what transformers writes.
    """
    entries = []
    seen: set[tuple[str, int, str, tuple[int, ...], tuple[int, ...]]] = set()
    for name, ref in opened.tensors():
        same = (ref.storage_key, ref.storage_offset, ref.dtype, ref.shape, ref.stride)
        if ref.numel and same in seen:
            continue
        seen.add(same)
        found = opened.byte_range(ref)
        chunks = (
            (TensorChunk(rel, found[0], found[1] - found[0], (0,) * len(ref.shape), ref.shape, ChunkEncoding.RAW),)
            if found is not None
            else ()
        )
        entries.append(TensorEntry(name, classify(name), ref.dtype, ref.shape, chunks))
    return entries


def safetensors_index(url: str, weights: Sequence[str], files: Mapping[str, int]) -> tuple[TensorEntry, ...]:
    """The tensors of the safetensors files `weights` (relative to `url`), from their headers; per-rank
    pieces (`shard-0000P-...`) as the whole tensors they make up."""
    entries = list(shards_index(url, {w: files[w] for w in weights if SHARD_FILE.match(w)}))
    for rel in weights:
        if SHARD_FILE.match(rel):
            continue
        header = read_header(io.join(url, rel), files.get(rel))
        for rec in header.tensors:
            chunk = TensorChunk(
                rel, rec.begin, rec.end - rec.begin, (0,) * len(rec.shape), rec.shape, ChunkEncoding.RAW
            )
            entries.append(TensorEntry(rec.name, Component.MODEL, rec.dtype, rec.shape, (chunk,)))
    return tuple(entries)
