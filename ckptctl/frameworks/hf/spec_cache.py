"""The model checks' specs kept on disk, so that checking a model transformers has built once costs no import.

`architecture.model_spec` builds the model a config.json names with transformers on the meta device. The
build is cheap; importing transformers and its model class is not (about 3 s of interpreter work: torch's
distributed tensors and dynamo, pulled in by `modeling_utils`), which for `average` and `convert` of a small
model is most of the command. The spec is a pure function of the config and of the code that computes it,
so it is kept under a key made of exactly those: the config (canonical JSON), the versions of transformers,
torch and ckptctl, and `_FORMAT`. A later check of the same model under the same versions reads the same
spec back; any other version, config or a file that does not parse builds it again. Only specs are kept:
a config transformers refuses, or a note (no class, no transformers), is found anew every time.

The cache is the user's (`$CKPTCTL_CACHE_DIR`, else `$XDG_CACHE_HOME/ckptctl`, else `~/.cache/ckptctl`),
like pip's or huggingface_hub's: whoever can write it can already change the installed packages it stands
for. Writing is best effort (a read-only home only costs the build next time).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from ckptctl.contract.capabilities import ModelSpec
from ckptctl.version import __version__

__all__ = ["cache_key", "load", "store"]

#: Bumped when `model_spec` computes its fields differently, or this file's layout changes.
_FORMAT = 1
#: A spec file larger than this is not one of ours (a spec of 100k tensors is a few MiB).
_MAX_BYTES = 64 << 20


def cache_key(config: Mapping[str, Any]) -> str | None:
    """The key of the spec of `config` under the installed versions, or None when one is not installed or the
    config is not plain JSON."""
    try:
        versions = [metadata.version("transformers"), metadata.version("torch")]
        canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (metadata.PackageNotFoundError, TypeError, ValueError):
        return None
    text = json.dumps([_FORMAT, __version__, *versions, canonical])
    return hashlib.sha256(text.encode()).hexdigest()


def load(key: str) -> ModelSpec | None:
    """The spec kept under `key`, or None when there is none or it does not parse as one."""
    path = _folder() / f"{key}.json"
    try:
        if path.stat().st_size > _MAX_BYTES:
            return None
        doc = json.loads(path.read_bytes())
        return _spec(doc) if doc.get("key") == key else None
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        return None


def store(key: str, spec: ModelSpec) -> None:
    """Keep `spec` under `key` (written whole, then renamed: a reader never sees half of it)."""
    folder = _folder()
    doc = {
        "key": key,
        "architecture": spec.architecture,
        "saved": {name: list(shape) for name, shape in spec.saved.items()},
        "state": {name: list(shape) for name, shape in spec.state.items()},
        "tied": dict(spec.tied),
        "ignored_leftovers": list(spec.ignored_leftovers),
        "ignored_missing": list(spec.ignored_missing),
    }
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, staged = tempfile.mkstemp(prefix=f".{key}.", dir=folder)
        try:
            with os.fdopen(fd, "w") as out:
                json.dump(doc, out)
            os.replace(staged, folder / f"{key}.json")
        except BaseException:
            os.unlink(staged)
            raise
    except OSError:
        pass


def _folder() -> Path:
    root = os.environ.get("CKPTCTL_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = os.path.join(xdg if xdg else os.path.expanduser("~/.cache"), "ckptctl")
    return Path(root) / "model-specs"


def _spec(doc: dict[str, Any]) -> ModelSpec:
    """A `ModelSpec` from its JSON document, every field checked for its type.

    Raises:
        TypeError: a field of another type.
    """

    def shapes(value: Any) -> dict[str, tuple[int, ...]]:
        if not isinstance(value, dict):
            raise TypeError("shapes")
        out = {}
        for name, shape in value.items():
            if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
                raise TypeError(name)
            out[name] = tuple(shape)
        return out

    def strings(value: Any) -> tuple[str, ...]:
        if not (isinstance(value, list) and all(isinstance(s, str) for s in value)):
            raise TypeError("strings")
        return tuple(value)

    tied = doc["tied"]
    if not (isinstance(tied, dict) and all(isinstance(v, str) for v in tied.values())):
        raise TypeError("tied")
    if not isinstance(doc["architecture"], str):
        raise TypeError("architecture")
    return ModelSpec(
        architecture=doc["architecture"],
        saved=shapes(doc["saved"]),
        state=shapes(doc["state"]),
        tied=dict(tied),
        ignored_leftovers=strings(doc["ignored_leftovers"]),
        ignored_missing=strings(doc["ignored_missing"]),
    )
