"""A process that syncs SRC into DST and stops once COUNT files are up, until the test SIGKILLs it (run with
`CKPTCTL_IO_WORKERS=1`, so that exactly COUNT files are up by then).

Run: `python -m tests.s3._sync_kill_worker SRC DST COUNT` (with the S3 server's AWS_* variables set).
"""

from __future__ import annotations

import sys

from ckptctl.ops.sync import sync
from tests.s3._upload_kill import hang_after_uploads


def main(src: str, dst: str, count: int) -> None:
    hang_after_uploads(count)
    sync(src, dst)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
