"""Config and tokenizer files: found beside the source (or where the options say), copied into the output; and
the settings files of adapters a model's layers carry, which a merge needs (`find_adapter_settings`)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ckptctl import io
from ckptctl.checkpoint import Checkpoint
from ckptctl.errors import CheckpointNotFound, CkptctlError, CorruptCheckpoint
from ckptctl.formats.documents import parse_json, read_json
from ckptctl.layouts import Layout
from ckptctl.ops.commit import write_small
from ckptctl.ops.convert.options import ConvertOptions
from ckptctl.ops.convert_source import convert_source

CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def find_side_files(
    src: str, options: ConvertOptions, beside: Sequence[str] | None = None, *, config_made: bool = False
) -> tuple[dict[str, str], list[str]]:
    """Config and tokenizer files to copy (name -> URL), and notes for the user.

    Args:
        src: the checkpoint converted.
        options: `--config`/`--tokenizer` folders, which win when given.
        beside: folders to look in otherwise, best first (the layout's `config_folders`); default: the
            checkpoint's folder and its parent.
        config_made: the config is made from the checkpoint's own records (`HfModel.config`), so none is
            looked for unless `--config` names one.
    """
    beside = list(beside) if beside is not None else [src, io.parent_of(src)]
    notes: list[str] = []
    found: dict[str, str] = {}
    for names, explicit, what, flag in (
        (CONFIG_FILES, options.config_dir, "config.json", "--config"),
        (TOKENIZER_FILES, options.tokenizer_dir, "tokenizer files", "--tokenizer"),
    ):
        if names is CONFIG_FILES and config_made and explicit is None:
            continue
        if explicit is not None:
            files = _present(explicit, names)
            if not files:
                raise CheckpointNotFound(f"{explicit} holds no {what}", f"pass the folder that holds them to {flag}")
            found.update(files)
            continue
        for folder in beside:
            files = _present(folder, names)
            if files and (names is TOKENIZER_FILES or "config.json" in files):
                found.update(files)
                if folder not in (src, io.parent_of(src)):
                    notes.append(f"{what} taken from {folder}")
                break
        else:
            notes.append(f"no {what} found beside {src}; pass {flag} DIR to include them")
    return found, notes


def find_adapter_settings(
    names: Sequence[str], options: ConvertOptions, checkpoint: Checkpoint, layout: Layout, notes: list[str]
) -> dict[str, Any]:
    """The files of `names` that hold the settings of the adapters a model's layers carry (name -> parsed
    JSON): `--adapter-config` (a file, read as the first of `names` unless it has another of them as its
    name; or a folder), else the first of the checkpoint's folder, `--config` and the layout's config
    folders that holds any of them. Empty when none does.

    Raises:
        CheckpointNotFound: `--adapter-config` names no such file, or a folder holding none of them.
        CorruptCheckpoint: a settings file does not parse.
    """
    explicit = options.adapter_config
    if explicit is not None and not io.is_dir(explicit):
        if not io.exists(explicit):
            raise CheckpointNotFound(f"no such adapter settings file: {explicit}")
        name = io.name_of(explicit)
        return {name if name in names else names[0]: read_json(explicit)}
    folders = (
        [explicit]
        if explicit is not None
        else [
            checkpoint.url,
            *([options.config_dir] if options.config_dir else []),
            *convert_source(layout).config_folders(checkpoint),
        ]
    )
    for folder in folders:
        present = _present(folder, names)
        if present:
            if folder != checkpoint.url:
                notes.append(f"adapter settings ({', '.join(present)}) taken from {folder}")
            return {name: read_json(url) for name, url in present.items()}
    if explicit is not None:
        raise CheckpointNotFound(f"{explicit} holds none of {', '.join(names)}")
    return {}


def _present(folder: str, names: Sequence[str]) -> dict[str, str]:
    try:
        entries = {e.name for e in io.list_dir(folder) if not e.is_dir}
    except CkptctlError:
        return {}
    return {name: io.join(folder, name) for name in names if name in entries}


#: The largest config or tokenizer file copied (a large vocabulary's tokenizer.json is tens of MB).
_MAX_SIDE_FILE = 256 << 20


def copy_side_files(
    files: dict[str, str], out: str, dtype: str | None, cast: bool, config: Mapping[str, Any] | None = None
) -> tuple[str, ...]:
    """Copy config/tokenizer files, or write `config` as config.json when no config.json is copied;
    config.json's dtype is made to say `dtype`, what the output holds.

    Args:
        files: name -> URL, from `find_side_files`.
        out: the output folder.
        dtype: the floating-point dtype of the output's tensors (None: it has none).
        cast: the tensors were cast to `dtype` (`--dtype`): a config without a dtype field gets one.
        config: a config the layout made from what the checkpoint records (Megatron's saved arguments, a
            transformers config among a Lightning module's hyperparameters).
    """
    written = dict.fromkeys(files)
    if config is not None and "config.json" not in files:
        data = json.dumps(dict(config), indent=2, sort_keys=True).encode() + b"\n"
        write_small(
            os.path.join(out, "config.json"), _config_with_dtype(data, dtype, True) if dtype is not None else data
        )
        written["config.json"] = None
    for name, url in files.items():
        data = io.read_bytes(url, max_size=_MAX_SIDE_FILE)
        if name == "config.json" and dtype is not None:
            data = _config_with_dtype(data, dtype, cast)
        write_small(os.path.join(out, name), data)
    return tuple(sorted(written))


def _config_with_dtype(data: bytes, dtype: str, add: bool) -> bytes:
    """config.json saying `dtype` in the fields it has (`dtype` since transformers 5, `torch_dtype` before),
    or in a new `torch_dtype` field when `add`: a config from a bf16 export over fp32 tensors would have
    transformers load them in bf16. Unchanged bytes when it already says so."""
    try:
        config = parse_json(data, "config.json")
    except CorruptCheckpoint:
        return data
    if not isinstance(config, dict):
        return data
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or (["torch_dtype"] if add else [])
    if all(config.get(key) == dtype for key in keys):
        return data
    for key in keys:
        config[key] = dtype
    return json.dumps(config, indent=2, sort_keys=True).encode() + b"\n"
