"""The classes accelerate's `sampler.bin` pickles (accelerate 1.15, torch 2.13: disassembled with
pickletools), each read as an inert `FrameworkObject` stand-in by the torch-pickle allowlist
(`formats.framework_classes`).

`save_accelerator_state` saves the data loader's `SeedableRandomSampler` object itself; it holds the torch
`Generator` that shuffles (rebuilt from its device name, then given its state tensor) and its data source.
The RNG files (`random_states_{i}.pkl`) need nothing here: python's and numpy's states are tuples, a
numpy array and numpy scalars, which the allowlist reads already.
"""

from __future__ import annotations

from ckptctl.formats.framework_classes import FrameworkClasses

CLASSES = FrameworkClasses(
    classes=frozenset(
        {
            ("accelerate.data_loader", "SeedableRandomSampler"),
            ("torch._C", "Generator"),
        }
    )
)
