"""A real DCP `.metadata` (written by torch in this process) for the parser and fuzz tests."""

from __future__ import annotations

import pytest

from tests.writers.dcp_writer import WrittenDcp, write_single_process_dcp


@pytest.fixture(scope="session")
def raw_dcp(tmp_path_factory: pytest.TempPathFactory) -> WrittenDcp:
    return write_single_process_dcp(tmp_path_factory.mktemp("dcp-raw") / "raw")


@pytest.fixture(scope="session")
def real_metadata(raw_dcp: WrittenDcp) -> bytes:
    return (raw_dcp.path / ".metadata").read_bytes()
