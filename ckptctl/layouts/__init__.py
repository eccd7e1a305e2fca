"""The registry and the run walker: which layouts exist and in which order they are tried (`registry`), what one
folder or file is (`identify`), the one checkpoint a command acts on (`scan`) and every checkpoint of a run
(`walk`), with the generic reader of what no plugin claims (`generic`). This module re-exports their public names.

The plugin contract the layouts implement is `ckptctl.contract`; the format-family readers they share are
`ckptctl.families`.
"""

from __future__ import annotations

from ckptctl.contract.base import Layout
from ckptctl.contract.scan_context import ScanContext, peek, peek_dir, scan_context
from ckptctl.layouts.identify import pointed_children
from ckptctl.layouts.registry import (
    ConvertTarget,
    Plugin,
    all_layouts,
    capability,
    framework_pickle_classes,
    get_layout,
    layout_names,
    training_state_writer,
    training_state_writers,
)
from ckptctl.layouts.scan import detect, open_checkpoint, resolve
from ckptctl.layouts.walk import DEFAULT_SCAN_DEPTH, scan_run

__all__ = [
    "DEFAULT_SCAN_DEPTH",
    "ConvertTarget",
    "Layout",
    "Plugin",
    "ScanContext",
    "all_layouts",
    "capability",
    "detect",
    "framework_pickle_classes",
    "get_layout",
    "layout_names",
    "open_checkpoint",
    "peek",
    "peek_dir",
    "pointed_children",
    "resolve",
    "scan_context",
    "scan_run",
    "training_state_writer",
    "training_state_writers",
]
