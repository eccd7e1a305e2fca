"""ckptctl: checkpoints of large-model training runs, for training loops and for the people running them.

`from ckptctl import CheckpointManager` is the save/load core a training loop uses; it is imported lazily
so that `import ckptctl` (and `ckptctl --help`) stays cheap and does not pull in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptctl.formats import framework_classes as _framework_classes
from ckptctl.version import __version__

__all__ = ["AutoSaver", "CheckpointManager", "RetentionPolicy", "__version__"]

if TYPE_CHECKING:
    from ckptctl.core import AutoSaver, CheckpointManager, RetentionPolicy


def __getattr__(name: str) -> Any:
    if name in ("CheckpointManager", "AutoSaver", "RetentionPolicy"):
        import ckptctl.core

        return getattr(ckptctl.core, name)
    raise AttributeError(f"module 'ckptctl' has no attribute {name!r}")


def _framework_pickle_classes() -> list[_framework_classes.FrameworkClasses]:
    from ckptctl.layouts import framework_pickle_classes

    return framework_pickle_classes()


# `formats` may not import the framework packages, whose classes its torch-pickle allowlist reads as inert
# stand-ins: the layout registry lists them, and is asked the first time an allowlist needs them.
_framework_classes.add_source(_framework_pickle_classes)
