"""Typed errors of the library.

Every error carries a message for a person and, where one helps, a hint saying what to do next.
`ckptctl.cli.app.main` is the single place that turns them into exit codes; library users catch
`CkptctlError` or one of its subclasses.
"""

from __future__ import annotations


class CkptctlError(Exception):
    """Base class: something ckptctl could not do, explained for a person.

    Attributes:
        message: what went wrong.
        hint: what the user can do about it, or an empty string.
        exit_code: the CLI exit code (2: bad usage or unreadable input, per DESIGN §4).
    """

    exit_code = 2

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} (hint: {self.hint})" if self.hint else self.message


class CheckpointNotFound(CkptctlError):
    """The path or URL does not exist or holds no checkpoint."""


class UnknownLayout(CkptctlError):
    """No registered layout recognises the folder."""


class CorruptCheckpoint(CkptctlError):
    """A file exists but its content is not what its format promises."""


class UnsafePickle(CorruptCheckpoint):
    """A pickle asks for a global that runs code (`formats.safe_pickle.CODE_RUNNING_MODULES`): the file is not
    what it claims to be; nothing of it was executed."""


class UnsupportedClass(CorruptCheckpoint):
    """A pickle names a class ckptctl was not taught that runs no code (a newer framework's, a library's of its
    own): the file is not accused, and a reader that can skip the value reads it as opaque; one that needs it
    refuses the file with this. Nothing of the pickle was executed."""


class StorageError(CkptctlError):
    """A file could not be read or written (permissions, network, missing bucket)."""


class UnsafePath(StorageError):
    """A path that ckptctl creates or deletes under (its trash, a staging folder, a lock) is a symbolic link
    or not a folder: following it could move or delete files outside the run, so nothing is done (exit 2)."""


class SerializationError(CkptctlError):
    """A value in the training state has a type the core cannot store without pickle."""


class CheckpointInProgress(CkptctlError):
    """The checkpoint has not been committed yet (or is being written right now)."""


class ModelMismatch(CkptctlError):
    """A converted model is not the model its config describes (a tensor missing, left over or of another
    shape; logits that differ from the source's). The command ran and found a problem: exit code 1."""

    exit_code = 1


class UnprovedModel(CkptctlError):
    """A Hugging Face model folder was asked for, and nothing can prove the output would be one: there is no
    config.json to build the model from and hold the tensors against, so they may keep a framework's own
    names and row orders. Refused before anything is written (exit 2); asking for the raw names is the way
    to write them anyway."""


class StateMismatch(CkptctlError):
    """The training state does not fit the checkpoint being restored into it (a module with other parameter
    names or shapes, an optimizer over other parameters): a different model, not a damaged checkpoint."""


class RankFailed(CkptctlError):
    """Another rank of a multi-rank job failed (or a rank was lost): this rank stops with that rank's
    message and exit code, so that every rank of the job reports the failure the same way."""

    def __init__(self, message: str, hint: str = "", exit_code: int = 2) -> None:
        super().__init__(message, hint)
        self.exit_code = exit_code
