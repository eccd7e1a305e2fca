"""Slimming one checkpoint (`ckptctl slim`, `prune --slim`, the manager's `keep_full_last`): its layout's
slimmer (`capabilities.Slimmer`) says what is training-only state and what to write instead; this module
builds the slim version and swaps it in, the same for every layout.

The slim version is built in a folder inside the trash beside the checkpoint (`io.trash.workspace`: every scan
skips the trash), the kept files hard-linked from the original, the slimmer's new files written and fsynced,
and the marker (`formats.slim_marker`) written last; then `io.commit.install` swaps it in atomically
(renameat2) and the original goes to the trash and is deleted. A kill at any moment leaves the whole
original (and a leftover in the trash that the next deletion empties) or the whole slim checkpoint.

A checkpoint that is one file (a Lightning `.ckpt`) is written anew by its slimmer's one rewrite (path ""),
which puts the marker inside it (`formats.slim_marker`), in a workspace of the same trash, and swapped in the
same way.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field

from ckptctl import io
from ckptctl.checkpoint import CheckpointRef, Role
from ckptctl.contract.capabilities import SLIMMER, Slimmer, SlimRecipe
from ckptctl.errors import CkptctlError, UnsafePath
from ckptctl.formats.manifest import now_iso
from ckptctl.formats.slim_marker import SLIM_MARKER, SlimMarker
from ckptctl.io import commit, trash
from ckptctl.layouts.registry import capability, get_layout

__all__ = ["Slimmable", "slim_checkpoint", "slimmable"]

#: The path of a `SlimRewrite` that writes a one-file checkpoint anew.
_WHOLE_FILE = ""


@dataclass(frozen=True, slots=True)
class Slimmable:
    """A checkpoint its slimmer takes: the slimmer, its recipe, and the sizes of the files it drops."""

    slimmer: Slimmer
    recipe: SlimRecipe
    drop_sizes: Mapping[str, int] = field(default_factory=dict)


def slimmable(ref: CheckpointRef) -> str | Slimmable:
    """Why `ref` cannot be slimmed (a sentence), or what slimming it takes: its layout's slimmer (`SLIMMER`)
    asked about it. Reads metadata only."""
    if not io.is_local(ref.url):
        return "slim works on local folders only (yet)"
    if ref.holds:
        return f"its folder holds other checkpoints ({', '.join(ref.holds)})"
    one_file = not io.is_dir(ref.url)
    slimmer = capability(ref.layout, SLIMMER)
    if slimmer is None:
        if one_file:
            return "a checkpoint that is one file: nothing to drop beside its model"
        return f"{ref.layout} checkpoints cannot be slimmed safely yet (no slimmer for this layout)"
    try:
        checkpoint = get_layout(ref.layout).open(ref.url)
        if checkpoint.role is Role.EXPORT:
            return "model weights only (an export): nothing to drop"
        refused = slimmer.refusal(checkpoint)
        if refused:
            return f"cannot be slimmed safely: {refused}"
        recipe = slimmer.recipe(checkpoint)
    except CkptctlError as exc:
        return f"cannot be read: {exc.message}"
    if one_file:
        if recipe.drop or [r.path for r in recipe.rewrites] != [_WHOLE_FILE]:
            return "cannot be slimmed safely: its slimmer does not write the file anew"
        return Slimmable(slimmer, recipe)
    files = {rel: entry.size for rel, entry in io.list_tree(ref.url).items()}
    missing = [rel for rel in recipe.drop if rel not in files]
    if missing:
        return f"cannot be slimmed safely: {', '.join(missing)} to drop is not there"
    return Slimmable(slimmer, recipe, {rel: files[rel] for rel in recipe.drop})


def slim_checkpoint(ref: CheckpointRef, *, kill_at: str | None = None) -> int:
    """Build the slim version of the local checkpoint `ref` inside the trash beside it and swap it in (see the
    module docstring); returns the bytes freed.

    Args:
        ref: a complete checkpoint (the caller checked it is not one a resume loads or a framework protects).
        kill_at: a test hook: SIGKILL this process at that point (`staged`, `marked`, `installed`).

    Raises:
        CkptctlError: its slimmer refuses it now.
        UnsafePath: a link where the slim version would be built, or inside the checkpoint.
        OSError: building or swapping failed (the original is left whole).
    """
    found = slimmable(ref)
    if isinstance(found, str):
        raise CkptctlError(found)
    recipe = found.recipe
    path = os.path.abspath(io.local_path(ref.url))
    if not os.path.isdir(path):
        return _slim_file(path, recipe, kill_at)
    bin_ = trash.trash_of(path)
    staging = trash.workspace(bin_, f"slim-{os.path.basename(path)}")
    try:
        before = _tree_bytes(path)
        written = {r.path for r in recipe.rewrites}
        _link_kept(path, staging, skip=set(recipe.drop) | written | {SLIM_MARKER})
        for rewrite in recipe.rewrites:
            target = os.path.join(staging, *rewrite.path.split("/"))
            if os.path.lexists(target):
                os.unlink(target)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            rewrite.write(target)
            _fsync_file(target)
        kept = _tree_files(staging)
        _kill_point("staged", kill_at)
        freed = before - sum(kept.values())
        marker = SlimMarker(
            dropped_files=recipe.drop,
            dropped=recipe.dropped,
            kept_files=kept,
            written=tuple(sorted(written)),
            freed_bytes=freed,
            created=now_iso(),
        )
        for folder, _dirs, _files in os.walk(staging, topdown=False):
            io.fsync_dir(folder)
        commit.write_marker(staging, SLIM_MARKER, marker.to_json())
        _kill_point("marked", kill_at)
        retired = commit.install(staging, path)
    except BaseException:
        if os.path.lexists(staging):
            trash.purge(trash.Retired(staging, bin_))
        raise
    _kill_point("installed", kill_at)
    if retired is not None:
        trash.purge(retired)
    marker_size = os.path.getsize(os.path.join(path, SLIM_MARKER))
    return freed - marker_size


def _slim_file(path: str, recipe: SlimRecipe, kill_at: str | None) -> int:
    """`slim_checkpoint` of a checkpoint that is one file: its slimmer writes it anew (with the marker inside)
    in a workspace of the trash beside it, which is swapped in as a folder is."""
    bin_ = trash.trash_of(path)
    staging = trash.workspace(bin_, f"slim-{os.path.basename(path)}")
    target = os.path.join(staging, os.path.basename(path))
    try:
        original = os.lstat(path)
        before = original.st_size
        recipe.rewrites[0].write(target)
        # Dated as the save it is (ModelCheckpoint's files are listed and aged by their times), not as the slim.
        os.utime(target, ns=(original.st_atime_ns, original.st_mtime_ns), follow_symlinks=False)
        _fsync_file(target)
        io.fsync_dir(staging)
        _kill_point("staged", kill_at)
        freed = before - os.lstat(target).st_size
        retired = commit.install(target, path)
    finally:
        trash.purge(trash.Retired(staging, bin_))
    _kill_point("installed", kill_at)
    if retired is not None:
        trash.purge(retired)
    return freed


def _link_kept(src: str, dst: str, skip: set[str]) -> None:
    """Hard-link every file of `src` but `skip` (relative paths) into `dst`, folders made as they are; a
    file that cannot be linked (another filesystem below) is copied and fsynced."""
    for root, dirs, files in os.walk(src):
        rel_root = os.path.relpath(root, src)
        for name in dirs:
            if os.path.islink(os.path.join(root, name)):
                raise UnsafePath(f"{os.path.join(root, name)} is a symbolic link inside the checkpoint: not slimmed")
            os.makedirs(os.path.join(dst, rel_root, name), exist_ok=True)
        for name in files:
            rel = os.path.normpath(os.path.join(rel_root, name)).replace(os.sep, "/")
            if rel in skip:
                continue
            source = os.path.join(root, name)
            st = os.lstat(source)
            if not stat.S_ISREG(st.st_mode):
                raise UnsafePath(f"{source} is not a regular file (a link?): the checkpoint is not slimmed")
            target = os.path.join(dst, rel_root, name)
            try:
                os.link(source, target, follow_symlinks=False)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                    raise
                shutil.copy2(source, target, follow_symlinks=False)
                _fsync_file(target)


def _tree_files(path: str) -> dict[str, int]:
    """Relative path -> size of every regular file below `path` (links not followed)."""
    found = {}
    for root, _dirs, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            st = os.lstat(full)
            if stat.S_ISREG(st.st_mode):
                found[os.path.relpath(full, path).replace(os.sep, "/")] = st.st_size
    return found


def _tree_bytes(path: str) -> int:
    return sum(_tree_files(path).values())


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _kill_point(point: str, kill_at: str | None) -> None:
    if kill_at == point:
        os.kill(os.getpid(), signal.SIGKILL)
