"""A real DCP `.metadata` (of tests/conftest.py's single-process save) for the parser and fuzz tests."""

from __future__ import annotations

import pytest

from tests.writers.dcp_writer import WrittenDcp


@pytest.fixture(scope="session")
def real_metadata(raw_dcp: WrittenDcp) -> bytes:
    return (raw_dcp.path / ".metadata").read_bytes()
