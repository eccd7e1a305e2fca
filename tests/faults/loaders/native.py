"""ckptctl's own native format, loaded by its own manager: `ckptctl/core/manager.py: CheckpointManager.restore`
(with `step=` the checkpoint's own, `verify=False` as a training script calls it) into the demo's freshly
built TinyLM, AdamW and LambdaLR, and the random generators it restores (python, numpy, torch CPU)."""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.faults.cells import loader_verdicts
from tests.faults.loaders.common import run


def load(path: str, options: Mapping[str, Any]) -> Any:
    import numpy as np
    import torch

    from ckptctl.core import CheckpointManager
    from ckptctl.demo import _model

    torch.manual_seed(1234)  # another model and other generators than the saved ones: a skipped load shows
    random.seed(1234)
    np.random.seed(1234)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler}
    folder = Path(path)
    step = int(re.fullmatch(r"step-(\d+)", folder.name).group(1))  # type: ignore[union-attr]
    CheckpointManager(str(folder.parent)).restore(state, step=step)
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"},
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
    }


def build(checkpoint: Path, _out: Path) -> dict[str, str]:
    """The manager's verdict on each cell of a native checkpoint folder (`step-N` of a single-process run)."""
    return loader_verdicts(__name__, checkpoint)


if __name__ == "__main__":
    run(load)
