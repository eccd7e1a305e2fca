"""Fixtures of the object storage tests: a local S3 server (see `tests/s3/server.py`), buckets, stores."""

from __future__ import annotations

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

from tests.s3.server import bucket, counting_proxy, memory_store, s3_server, stores

__all__ = ["bucket", "counting_proxy", "memory_store", "s3_server", "stores"]
