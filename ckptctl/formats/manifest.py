"""The ckptctl manifest: the commit marker of native checkpoints and the digest record of foreign ones.

Two files share one schema:
- `ckptctl-manifest.json`, written last by the core into each native checkpoint: its presence means the
  checkpoint was committed; it lists every file with size and blake3 digest, the step, metrics, world size,
  library versions and which state entries (components) were saved and how.
- `ckptctl-digests.json`, written by `ckptctl verify --write-manifest` into a foreign checkpoint (DCP, HF,
  ...): only `files` (and `created`), so that later verifies can check digests. It is a separate name so that
  adding digests never turns a foreign checkpoint into a "native" one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ckptctl import io
from ckptctl.errors import CorruptCheckpoint
from ckptctl.formats.documents import MAX_JSON_BYTES, parse_json, real_number, whole_number

MANIFEST_NAME = "ckptctl-manifest.json"
DIGESTS_NAME = "ckptctl-digests.json"
FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class FileRecord:
    """Size and digest of one file, as recorded when it was written."""

    size: int
    blake3: str


@dataclass(frozen=True, slots=True)
class ComponentRecord:
    """How one entry of the saved state was stored.

    Attributes:
        kind: what the object was: `module`, `optimizer`, `scheduler`, `rng`, `dataloader`, `stateful`
            (any object with state_dict/load_state_dict) or `value` (a plain value stored as is).
        storage: `safetensors` (tensors in `<name>.safetensors`, the rest in `<name>.json`) or `dcp`
            (sharded through torch.distributed.checkpoint into the `dcp/` folder under key prefix `<name>.`).
        files: files that hold it, relative to the checkpoint folder.
    """

    kind: str
    storage: str
    files: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Manifest:
    """A parsed manifest (or digests file: then `components` is empty and `native` False)."""

    files: Mapping[str, FileRecord]
    created: str
    native: bool = False
    step: int | None = None
    epoch: float | None = None
    metrics: Mapping[str, Any] = field(default_factory=dict)
    world_size: int | None = None
    versions: Mapping[str, str] = field(default_factory=dict)
    components: Mapping[str, ComponentRecord] = field(default_factory=dict)

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {
            "format": "ckptctl" if self.native else "ckptctl-digests",
            "format_version": FORMAT_VERSION,
            "created": self.created,
        }
        if self.native:
            doc.update(
                step=self.step,
                epoch=self.epoch,
                metrics=dict(self.metrics),
                world_size=self.world_size,
                versions=dict(self.versions),
                components={
                    name: {"kind": c.kind, "storage": c.storage, "files": list(c.files)}
                    for name, c in self.components.items()
                },
            )
        doc["files"] = {name: {"size": r.size, "blake3": r.blake3} for name, r in sorted(self.files.items())}
        return json.dumps(doc, indent=1, allow_nan=True).encode("utf-8")


def now_iso() -> str:
    return datetime.now(tz=UTC).isoformat(timespec="seconds")


def parse_manifest(text: bytes | str, source: str) -> Manifest:
    """Parse and validate a manifest or digests document.

    Raises:
        CorruptCheckpoint: not JSON, or a field of the wrong type (sizes, step and world size must be whole
            numbers, the epoch a finite number).
    """
    doc = parse_json(text, source)
    if not isinstance(doc, dict) or doc.get("format") not in ("ckptctl", "ckptctl-digests"):
        raise CorruptCheckpoint(f"{source}: not a ckptctl manifest")
    try:
        files = {
            _relative_name(k, source): FileRecord(
                whole_number(v["size"], source, f"files[{k!r}].size"), str(v["blake3"])
            )
            for k, v in dict(doc["files"]).items()
        }
        native = doc["format"] == "ckptctl"
        components = {
            str(k): ComponentRecord(str(v["kind"]), str(v["storage"]), tuple(str(f) for f in v["files"]))
            for k, v in dict(doc.get("components") or {}).items()
        }
        step = doc.get("step")
        epoch = doc.get("epoch")
        world_size = doc.get("world_size")
        return Manifest(
            files=files,
            created=str(doc.get("created", "")),
            native=native,
            step=None if step is None else whole_number(step, source, "step"),
            epoch=_epoch(epoch, source),
            metrics=dict(doc.get("metrics") or {}),
            world_size=None if world_size is None else whole_number(world_size, source, "world_size", minimum=1),
            versions={str(k): str(v) for k, v in dict(doc.get("versions") or {}).items()},
            components=components,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptCheckpoint(f"{source}: malformed manifest ({exc!r})") from exc


def _epoch(value: Any, source: str) -> float | None:
    # The core records whatever number the training loop passed as metrics["epoch"]: a NaN there reads as
    # "no epoch", while a value that is no number at all means the manifest is damaged.
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None
    return real_number(value, source, "epoch")


def _relative_name(name: object, source: str) -> str:
    """A file name from a manifest, refused unless it stays inside the checkpoint folder.

    Restores write to these names and verify hashes them: `/etc/x` or `../../x` in a hostile manifest
    must never reach the filesystem.
    """
    text = str(name)
    parts = text.split("/")
    if not text or text.startswith("/") or "\\" in text or "\0" in text or any(p in ("", ".", "..") for p in parts):
        raise CorruptCheckpoint(
            f"{source}: file name {text!r} leaves the checkpoint folder", "the manifest was tampered with"
        )
    return text


def load_manifest(url: str) -> Manifest:
    """Read and parse the manifest or digests file at `url` (a regular file of at most `MAX_JSON_BYTES`).

    Raises:
        CheckpointNotFound: there is no such file.
        CorruptCheckpoint: what `parse_manifest` refuses, a file too large, or not a regular file.
    """
    return parse_manifest(io.read_bytes(url, max_size=MAX_JSON_BYTES), url)


def read_manifest(checkpoint_url: str) -> Manifest | None:
    """The manifest of a checkpoint folder (native first, then foreign digests), or None if it has neither."""
    for name in (MANIFEST_NAME, DIGESTS_NAME):
        url = io.join(checkpoint_url, name)
        if io.exists(url):
            return load_manifest(url)
    return None
