"""Paths are strings: a local path, `file://...`, or any fsspec URL (`s3://bucket/run`, `memory://x`).

These helpers take either kind and keep it: a URL stays a URL (with `/`), a local path an OS path.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass

__all__ = [
    "DirEntry",
    "bucket_of",
    "is_local",
    "join",
    "local_path",
    "name_of",
    "parent_of",
    "relative_to",
    "scheme_of",
]


@dataclass(frozen=True, slots=True)
class DirEntry:
    """One entry of a directory listing: enough for layouts to detect and size checkpoints."""

    name: str
    is_dir: bool
    size: int
    mtime: float


def is_local(url: str) -> bool:
    """True for plain paths and `file://` URLs."""
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    """The OS path of a local URL (strips `file://`)."""
    return url[len("file://") :] if url.startswith("file://") else url


def absolute(url: str) -> str:
    """One spelling of a folder, to compare and print: a local path made absolute (`file://` stripped), any
    other URL without a trailing `/`."""
    return os.path.abspath(local_path(url)) if is_local(url) else url.rstrip("/")


def inside(url: str, folder: str) -> bool:
    """Whether `url` is `folder` or lies below it: locally after resolving links (two spellings of one place
    are one place), elsewhere by prefix; never across a local path and a URL."""
    if is_local(url) != is_local(folder):
        return False
    if is_local(url):
        path, top = os.path.realpath(local_path(url)), os.path.realpath(local_path(folder))
        return path == top or path.startswith(top.rstrip(os.sep) + os.sep)
    path, top = url.rstrip("/"), folder.rstrip("/")
    return path == top or path.startswith(top + "/")


def join(url: str, *parts: str) -> str:
    """Join path parts with `/`, keeping the URL scheme. Empty parts add nothing: a single-file checkpoint
    names its one data file "" (itself), and `join(file, "")` is that file, not `file/`."""
    parts = tuple(p for p in parts if p)
    if not parts:
        return url
    if is_local(url):
        return os.path.join(url, *parts)
    return posixpath.join(url, *parts)


def name_of(url: str) -> str:
    """The last path component (`step-10` of `s3://b/run/step-10/`)."""
    return posixpath.basename(url.rstrip("/")) if not is_local(url) else os.path.basename(os.path.normpath(url))


def parent_of(url: str) -> str:
    """The containing folder."""
    if is_local(url):
        return os.path.dirname(os.path.normpath(local_path(url)))
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{posixpath.dirname(rest.rstrip('/'))}"


def relative_to(url: str, root: str) -> str:
    """`url` relative to `root`, with `/` separators."""
    if is_local(url):
        return os.path.relpath(local_path(url), local_path(root)).replace(os.sep, "/")
    return posixpath.relpath(url.partition("://")[2], root.partition("://")[2])


def scheme_of(url: str) -> str:
    """The URL's scheme, lower case (`s3`)."""
    return url.split("://", maxsplit=1)[0].lower()


def bucket_of(url: str) -> str:
    """The first component after the scheme: an object store's bucket."""
    return url.partition("://")[2].split("/", 1)[0]
