"""The slim marker: the small JSON file `ckptctl slim` writes last into a checkpoint whose training-only state
it dropped (DESIGN §4 `slim`), so that every command reads the checkpoint as `slim` rather than as one that
lost its optimizer.

`.ckptctl-slim.json` holds what was dropped (files and, for people, the components), the bytes freed, and
the files kept with their sizes, which `verify` checks the slim checkpoint against. Being written last into
the slim version before it is swapped in, its presence means the whole slim version is there.

A checkpoint that is one torch.save file (a Lightning `.ckpt`) is slimmed by writing the file anew, so its
marker goes inside it: the same JSON as a record `<archive>/.ckptctl-slim.json` of its zip, and the zip's
comment `SLIM_COMMENT`, which `is_slim_file` reads from the file's last bytes (one small read, so that `list`
tells a slim file from a whole one at no cost). torch.load reads neither.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptctl import io
from ckptctl.errors import CkptctlError, CorruptCheckpoint
from ckptctl.formats.documents import MAX_JSON_BYTES, parse_json, whole_number

__all__ = ["SLIM_COMMENT", "SLIM_MARKER", "SLIM_NOTE", "SlimMarker", "is_slim_file", "read_slim_marker"]

#: The marker's name, in the checkpoint folder.
SLIM_MARKER = ".ckptctl-slim.json"
#: Why a slim checkpoint is no resume candidate (resume-plan's reason, list's note).
SLIM_NOTE = "slim: training-only state dropped"
_FORMAT = "ckptctl-slim"
#: The zip comment of a slim torch.save file (see the module docstring).
SLIM_COMMENT = b"ckptctl-slim/1"
#: The end of a zip whose comment is `SLIM_COMMENT`: the end-of-central-directory record's signature, its
#: fields (18 bytes, the last being the comment's length), then the comment.
_EOCD_SIGNATURE = b"PK\x05\x06"
_TAIL = 22 + len(SLIM_COMMENT)


@dataclass(frozen=True, slots=True)
class SlimMarker:
    """What `slim` did to one checkpoint.

    Attributes:
        dropped_files: files removed, relative to the checkpoint folder (`/` separated).
        dropped: what they held, for people (`optimizer`, `scheduler`, `rng`).
        kept_files: every file of the slim checkpoint but the marker -> its size in bytes.
        written: files `slim` wrote anew (a rewritten manifest, a model file made of master weights).
        freed_bytes: bytes the checkpoint shrank by.
        created: when it was slimmed (ISO 8601).
    """

    dropped_files: tuple[str, ...]
    dropped: tuple[str, ...]
    kept_files: Mapping[str, int]
    written: tuple[str, ...] = ()
    freed_bytes: int = 0
    created: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        doc = {
            "format": _FORMAT,
            "format_version": 1,
            "created": self.created,
            "dropped": list(self.dropped),
            "dropped_files": list(self.dropped_files),
            "written": list(self.written),
            "freed_bytes": self.freed_bytes,
            "kept_files": dict(sorted(self.kept_files.items())),
            **self.extra,
        }
        return json.dumps(doc, indent=1).encode("utf-8")


def read_slim_marker(checkpoint_url: str) -> SlimMarker | None:
    """The marker of a checkpoint folder, or None when it has none (it is not slim).

    Raises:
        CorruptCheckpoint: the marker is there but is not one.
    """
    url = io.join(checkpoint_url, SLIM_MARKER)
    if not io.exists(url):
        return None
    doc = parse_json(io.read_bytes(url, max_size=MAX_JSON_BYTES), url)
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        raise CorruptCheckpoint(f"{url} is not a ckptctl slim marker")
    kept = doc.get("kept_files")
    if not isinstance(kept, dict):
        raise CorruptCheckpoint(f"{url}: kept_files must be an object")
    return SlimMarker(
        dropped_files=_strings(doc.get("dropped_files"), url, "dropped_files"),
        dropped=_strings(doc.get("dropped"), url, "dropped"),
        kept_files={str(name): whole_number(size, url, f"kept_files.{name}") for name, size in kept.items()},
        written=_strings(doc.get("written", []), url, "written"),
        freed_bytes=whole_number(doc.get("freed_bytes", 0), url, "freed_bytes"),
        created=str(doc.get("created", "")),
    )


def is_slim_file(url: str, size: int | None = None) -> bool:
    """Whether the file at `url` is a torch.save zip that `slim` wrote (its comment is `SLIM_COMMENT`); reads its
    last few bytes. False for anything shorter or unreadable."""
    try:
        size = io.file_size(url) if size is None else size
        if size < _TAIL:
            return False
        tail = io.read_bytes(url, size - _TAIL, _TAIL)
    except (CkptctlError, OSError):
        return False
    return (
        tail[:4] == _EOCD_SIGNATURE
        and tail[20:22] == len(SLIM_COMMENT).to_bytes(2, "little")
        and tail[22:] == SLIM_COMMENT
    )


def _strings(value: Any, url: str, name: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise CorruptCheckpoint(f"{url}: {name} must be a list of strings")
    return tuple(value)
