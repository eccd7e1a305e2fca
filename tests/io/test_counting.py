"""`io.counting`: each operation counts the bytes it read, in its own threads too, apart from operations
running at the same time."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from ckptctl import io
from ckptctl.core import CheckpointManager
from ckptctl.ops.verification import VerifyResult, verify_checkpoint


def test_a_counter_sees_its_block_and_the_threads_it_starts(tmp_path: Path) -> None:
    data = tmp_path / "data.bin"
    data.write_bytes(bytes(range(256)) * 64)  # 16 KiB
    url = str(data)
    with io.counting() as outer:
        io.read_bytes(url, 0, 100)
        with io.counting() as inner:
            io.read_ranges([(url, 0, 1000), (url, 1000, 24), (url, 4096, 4096)], max_workers=3)
            with io.ContextThreadPool(max_workers=2) as pool:
                assert len(pool.submit(io.read_bytes, url, 0, 10).result()) == 10
            elsewhere = threading.Thread(target=io.read_bytes, args=(url, 0, 7))  # not started through io
            elsewhere.start()
            elsewhere.join()
        io.read_bytes(url)
    assert inner.bytes_read == 1000 + 24 + 4096 + 10
    assert outer.bytes_read == 100 + inner.bytes_read + 16384
    with io.counting() as after:
        pass
    assert after.bytes_read == 0


def test_operations_running_at_once_count_apart(tmp_path: Path) -> None:
    run = tmp_path / "run"
    manager = CheckpointManager(run)
    manager.save(1, {"w": torch.zeros(10)})
    manager.save(2, {"w": torch.zeros(100_000)})  # a bigger step: the counts differ
    urls = [str(run / "step-1"), str(run / "step-2")]
    for url in urls:
        verify_checkpoint(url)  # the layout's caches are warm from here on: every call reads the same
    alone = [verify_checkpoint(url).bytes_read for url in urls]
    data = [sum(f.stat().st_size for f in (run / name).iterdir()) for name in ("step-1", "step-2")]
    assert alone[0] >= data[0] and alone[1] >= data[1] > alone[0]  # every byte, read by the hashing threads

    results: dict[str, VerifyResult] = {}
    barrier = threading.Barrier(2)

    def verify(url: str) -> None:
        barrier.wait()
        results[url] = verify_checkpoint(url)

    threads = [threading.Thread(target=verify, args=(url,)) for url in urls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[url].bytes_read for url in urls] == alone
