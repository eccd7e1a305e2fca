"""The DeepSpeed classes its files pickle (DeepSpeed 0.19, disassembled with pickletools), each read as an
inert `FrameworkObject` stand-in by the torch-pickle allowlist (`formats.framework_classes`)."""

from __future__ import annotations

from ckptctl.formats.framework_classes import FrameworkClasses

CLASSES = FrameworkClasses(
    classes=frozenset(
        {
            # *_optim_states.pt: `loss_scaler`, `zero_stage`, `param_slice_mappings` values.
            ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
            ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
            ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
            ("deepspeed.utils.tensor_fragment", "fragment_address"),
            # Megatron-style `args` in client states.
            ("argparse", "Namespace"),
        }
    ),
    packages=frozenset({"deepspeed"}),
)
