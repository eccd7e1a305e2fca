"""The classes Megatron's `common.pt` pickles (Megatron-LM's `args` with megatron-core's enum values; disassembled
with pickletools from megatron-core 0.16.1 saves), each read as an inert `FrameworkObject` stand-in by the
torch-pickle allowlist (`formats.framework_classes`)."""

from __future__ import annotations

from ckptctl.formats.framework_classes import FrameworkClasses

CLASSES = FrameworkClasses(
    classes=frozenset({("argparse", "Namespace")}),
    # The enums Megatron-LM's arguments hold (`--attention-backend` is an `AttnBackend`, the model type a
    # `ModelType`): modules of plain enums.
    modules=(
        ("megatron.core.transformer.enums", ""),
        ("megatron.core.enums", ""),
    ),
    packages=frozenset({"megatron"}),
)
