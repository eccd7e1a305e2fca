"""The transformers and accelerate classes a Trainer's `training_args.bin` pickles (transformers 5,
accelerate 1.x: disassembled with pickletools), each read as an inert `FrameworkObject` stand-in by the
torch-pickle allowlist (`formats.framework_classes`)."""

from __future__ import annotations

from ckptctl.formats.framework_classes import FrameworkClasses

CLASSES = FrameworkClasses(
    classes=frozenset(
        {
            # TrainingArguments' enum fields and the objects it carries.
            *(
                ("transformers.trainer_utils", name)
                for name in (
                    "IntervalStrategy",
                    "SaveStrategy",
                    "HubStrategy",
                    "SchedulerType",
                    "EvaluationStrategy",
                    "FSDPOption",
                    "ShardedDDPOption",
                )
            ),
            ("transformers.trainer_pt_utils", "AcceleratorConfig"),
            ("transformers.debug_utils", "DebugOption"),
            # `TrainingArguments(deepspeed=...)`: its DeepSpeed config (a dict and a few fields) held by the
            # `DeepSpeedPlugin` (`hf_ds_config`) and its `dschf` (transformers 5.24, a real ZeRO-2 save).
            ("transformers.integrations.deepspeed", "HfTrainerDeepSpeedConfig"),
            ("transformers.integrations.deepspeed", "HfDeepSpeedConfig"),
            ("accelerate.state", "PartialState"),
            ("accelerate.state", "AcceleratorState"),
        }
    ),
    # Whole modules of plain config classes and enums: `transformers.training_args*` (TrainingArguments,
    # Seq2SeqTrainingArguments, OptimizerNames, ...), accelerate's plugin dataclasses and enums, and the
    # FSDP option enums a TrainingArguments may carry; TRL's `*Config` classes subclass TrainingArguments.
    modules=(
        ("transformers.training_args", ""),
        ("accelerate.utils.dataclasses", ""),
        ("torch.distributed.fsdp.api", ""),
        ("trl.trainer.", "Config"),
    ),
    packages=frozenset({"transformers", "accelerate", "trl"}),
)
