"""A torch.save file as a verify sees it: opened through the allowlist, then each storage it names checked to
lie whole inside it. Every reader reports the same three things of such a file (a refused pickle, a file that
does not read, a truncated storage) under the same problem kinds, so they are mapped here once.
"""

from __future__ import annotations

from collections.abc import Callable

from ckptctl.checkpoint import Problem, ProblemKind
from ckptctl.errors import CkptctlError, UnsafePickle
from ckptctl.formats.torch_pickle import TorchPickle, storage_problems

__all__ = ["torch_file_problems"]


def torch_file_problems(
    path: str,
    open_file: Callable[[], TorchPickle],
    *,
    unreadable: ProblemKind | None = None,
    storages: Callable[[TorchPickle], list[str]] = storage_problems,
) -> tuple[TorchPickle | None, list[Problem]]:
    """Open a torch.save file with `open_file` and say what is wrong with it.

    Args:
        path: the file as the problems name it (relative to the checkpoint).
        open_file: opens it (`open_torch_pickle` with the reader's allowlist, or a reader's cache of opened files).
        unreadable: the kind of a file that fails to read for any reason but a refused pickle; None for the
            kind `Problem.from_error` gives (`truncated` or `bad_metadata`).
        storages: why the storages of the opened file do not all lie whole inside it, one message each
            (`storage_problems`; a reader of DTensor shards passes its own).

    Returns:
        The opened file (None when it did not read) and its problems: one `unsafe_pickle` (nothing of it ran)
        or one read failure, else a `truncated` problem per message of `storages`.
    """
    try:
        opened = open_file()
    except UnsafePickle as exc:
        return None, [Problem(ProblemKind.UNSAFE_PICKLE, path, exc.message)]
    except CkptctlError as exc:
        return None, [
            Problem(unreadable, path, exc.message) if unreadable is not None else Problem.from_error(exc, path)
        ]
    return opened, [Problem(ProblemKind.TRUNCATED, path, message) for message in storages(opened)]
