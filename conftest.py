"""Loaded by pytest before tests/conftest.py and before xdist starts its workers: compiled bytecode is kept
between runs, in the __pycache__ folders git ignores, also where the environment turns it off
(PYTHONDONTWRITEBYTECODE).

Without it every process the suite starts (xdist workers, spawned ranks, torchrun jobs, `python -m ckptctl`)
compiles ckptctl's and the tests' modules from source again, and pytest rewrites every test module's asserts
again: ~4 CPU-s per worker and up to ~0.4 s per process, most of the margin in the suite's time budget. (Here
rather than in tests/conftest.py, whose text is part of the writer cache's keys.)
"""

import os
import sys

os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # the processes the suite starts
sys.dont_write_bytecode = False  # this one: pytest keeps the test modules it rewrote

try:  # no test may fail for being slow on a loaded machine: speed is bench/'s to measure, never asserted
    from hypothesis import settings

    settings.register_profile("ckptctl", deadline=None)
    settings.load_profile("ckptctl")
except ImportError:  # pragma: no cover - hypothesis is a test dependency
    pass
