"""What `convert` and `diff` read from ckptctl's own checkpoints beyond their tensor index (`ConvertSource`)."""

from __future__ import annotations

from collections.abc import Sequence

from ckptctl.checkpoint import TensorEntry
from ckptctl.contract.capabilities import ConvertSource
from ckptctl.contract.naming import NameStripper, keep_name, shared_first_segment, strip_segments

__all__ = ["SOURCE"]


def _namespace_stripper(entries: Sequence[TensorEntry]) -> NameStripper:
    """`<entry>.<key>` names lose the entry name (the key of the saved state, `model` for `state["model"]`)
    when every tensor of the component carries the same one."""
    return keep_name if shared_first_segment(entries) is None else strip_segments(1)


SOURCE = ConvertSource(namespace_stripper=_namespace_stripper)
