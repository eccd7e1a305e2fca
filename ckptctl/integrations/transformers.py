"""A Hugging Face `Trainer` callback: digests for every checkpoint, and retention with ckptctl's rules.

    from ckptctl.core import RetentionPolicy
    from ckptctl.integrations.transformers import CkptctlCallback

    trainer = Trainer(..., callbacks=[CkptctlCallback(RetentionPolicy(keep_last=3, keep_every=1000))])

After each checkpoint the Trainer writes (`on_save`, main process only):

1. every file of `checkpoint-N/` is hashed (blake3, in parallel) into `checkpoint-N/ckptctl-digests.json`,
   together with the step and the metrics the Trainer logged at that step, so that `ckptctl verify` later
   tells a checkpoint that was damaged after training from one that was written that way;
2. the policy, if any, is applied to the `checkpoint-N` folders of `output_dir` through `ckptctl.ops.prune`,
   with all its protections: the newest checkpoint, the Trainer's `best_model_checkpoint`, pinned steps, and
   anything still being written are never deleted. Leave the Trainer's own `save_total_limit` unset.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ckptctl import io
from ckptctl.contract.base import list_files
from ckptctl.core.retention import RetentionPolicy
from ckptctl.formats.manifest import DIGESTS_NAME
from ckptctl.ops.digests import write_digests
from ckptctl.ops.prune import PruneReport, prune
from ckptctl.ops.report import NoProgress

__all__ = ["CkptctlCallback"]

log = logging.getLogger("ckptctl.integrations.transformers")


class CkptctlCallback(TrainerCallback):
    """Records ckptctl digests for every Trainer checkpoint and applies a retention policy after each save.

    Args:
        policy: which `checkpoint-N` folders of `output_dir` to keep; None keeps all of them.
        workers: files hashed at once (default: one per core, 2 to 8).

    Attributes:
        last_prune: the report of the latest retention pass (None before the first one).
    """

    def __init__(self, policy: RetentionPolicy | None = None, *, workers: int | None = None) -> None:
        self.policy = policy
        self.workers = workers
        self.last_prune: PruneReport | None = None

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        run = args.output_dir
        if not state.is_world_process_zero or run is None:
            return control
        folder = os.path.join(run, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if not os.path.isdir(folder):  # a hyperparameter-search trial saves into a folder of its own
            log.warning("ckptctl: no checkpoint folder %s; nothing recorded", folder)
            return control
        record_digests(folder, state.global_step, step_metrics(state), self.workers)
        if self.policy is not None and not self.policy.keeps_everything:
            # The Trainer has finished writing: no grace period is needed to tell a checkpoint being written.
            self.last_prune = prune(run, self.policy, grace=timedelta(0), max_depth=1)
            for item in self.last_prune.deleted:
                log.info("ckptctl: retention deleted %s", item.url)
            for skipped in self.last_prune.skipped:
                log.warning("ckptctl: retention kept %s: %s", skipped.item.url, skipped.reason)
        return control


def step_metrics(state: TrainerState) -> dict[str, Any]:
    """What the Trainer logged at its current step (training loss, learning rate, eval metrics, epoch)."""
    metrics: dict[str, Any] = {}
    for entry in state.log_history:
        if isinstance(entry, Mapping) and entry.get("step") == state.global_step:
            metrics.update({k: v for k, v in entry.items() if k != "step"})
    if state.epoch is not None:
        metrics.setdefault("epoch", state.epoch)
    return metrics


def record_digests(folder: str, step: int, metrics: Mapping[str, Any], workers: int | None = None) -> None:
    """Write `ckptctl-digests.json` into a checkpoint folder: every file's size and blake3 digest, the step
    and the metrics (`ckptctl verify` checks the digests; `ckptctl prune --keep-best` can read the metrics)."""
    manifest = write_digests(folder, list_files(folder), workers, NoProgress())
    document = json.loads(manifest.to_json())
    document.update(step=step, metrics=dict(metrics))
    io.write_bytes_atomic(os.path.join(folder, DIGESTS_NAME), json.dumps(document, indent=1, default=str).encode())
