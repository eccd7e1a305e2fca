"""A process that converts SRC into DST on an object store and stops once COUNT objects are uploaded, until
the test SIGKILLs it (run with `CKPTCTL_IO_WORKERS=1`, so that exactly COUNT objects are up by then).

Run: `python -m tests.s3._convert_kill_worker SRC DST COUNT` (with the S3 server's AWS_* variables set).
"""

from __future__ import annotations

import sys

from ckptctl.ops.convert import ConvertOptions, convert
from tests.s3._upload_kill import hang_after_uploads


def main(src: str, dst: str, count: int) -> None:
    hang_after_uploads(count)
    convert(src, dst, ConvertOptions(max_shard_size=100_000, mapping="none"))  # the demo's toy model: no config


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
