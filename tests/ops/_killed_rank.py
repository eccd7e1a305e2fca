"""`python -m tests.ops._killed_rank ARGS`: `ckptctl ARGS` in which rank 1 of the job is SIGKILLed right after
it has written its first output file (a crash mid-conversion, at a known point; see test_distributed_work),
or, with `KILL_AFTER=upload`, right after it has uploaded its first object (tests/s3/test_convert)."""

from __future__ import annotations

import os
import signal

from ckptctl import io
from ckptctl.cli.app import main
from ckptctl.formats.safetensors_stream import StreamCopier

if os.environ.get("RANK") == "1" and os.environ.get("KILL_AFTER") == "upload":
    upload_file = io.upload_file

    def upload_then_die(path: str, url: str) -> None:
        upload_file(path, url)
        os.kill(os.getpid(), signal.SIGKILL)

    io.upload_file = upload_then_die
elif os.environ.get("RANK") == "1":
    write_file = StreamCopier.write_file

    def write_then_die(self: StreamCopier, *args: object, **kwargs: object) -> object:
        write_file(self, *args, **kwargs)  # type: ignore[arg-type]
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")

    StreamCopier.write_file = write_then_die  # type: ignore[method-assign]

main()
