"""The docs' examples save to a local S3 server (the object storage tests' fixture)."""

from __future__ import annotations

from tests.s3.server import s3_server

__all__ = ["s3_server"]
