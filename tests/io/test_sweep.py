"""`io.sweep`: every span gets exactly its bytes, in order within each part, however the pass cuts them."""

from __future__ import annotations

import os
from pathlib import Path

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptctl import io
from ckptctl.formats.digest import DigestSink
from ckptctl.io import local, sweep
from ckptctl.io.sweep import Feed, Job, Span, Sweep, job_groups


class Collect:
    """A sink that keeps the parts it is fed, by offset."""

    def __init__(self) -> None:
        self.parts: dict[int, bytearray] = {}
        self.error: str | None = None

    def piece(self, offset: int) -> Feed:
        part = self.parts.setdefault(offset, bytearray())
        return part.extend

    def failed(self, message: str) -> None:
        self.error = message

    def joined(self) -> bytes:
        out = bytearray()
        for offset in sorted(self.parts):
            assert offset == len(out), "parts must tile the span"
            out += self.parts[offset]
        return bytes(out)


DATA = os.urandom(300_000)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sweep") / "data"
    path.write_bytes(DATA)
    return path


@settings(max_examples=60, deadline=None)
@given(
    ranges=st.lists(st.tuples(st.integers(0, len(DATA)), st.integers(0, 40_000)), min_size=1, max_size=12),
    block=st.sampled_from([7, 4096, 65_536]),
    piece=st.sampled_from([1_000, 50_000, 1 << 20]),
    gap=st.sampled_from([0, 10_000]),
    workers=st.sampled_from([1, 3]),
    maps=st.sampled_from([None, 4096, 65_536]),
)
def test_each_span_gets_its_bytes(
    data_file: Path, ranges: list[tuple[int, int]], block: int, piece: int, gap: int, workers: int, maps: int | None
) -> None:
    """Read into buffers of `block` bytes (`maps` None: a file system not known local), or mapped `maps` bytes at
    a time (one known local)."""
    spans = [Span(str(data_file), start, min(start + n, len(DATA)), Collect()) for start, n in ranges]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sweep, "maps_safely", lambda fd: maps is not None)
        patch.setattr(sweep, "MAP_BLOCK", maps or sweep.MAP_BLOCK)
        Sweep(spans, block=block, large_block=block, piece=piece, gap=gap).run(workers)
    for span in spans:
        assert isinstance(span.sink, Collect)
        assert span.sink.error is None
        assert span.sink.joined() == DATA[span.start : span.end]


def test_overlapping_bytes_are_read_once(data_file: Path) -> None:
    spans = [Span(str(data_file), 0, 200_000, Collect()), Span(str(data_file), 100_000, 300_000, Collect())]
    with io.counting() as read:
        Sweep(spans, piece=64_000).run(2)
    assert read.bytes_read == len(DATA)
    assert [s.sink.joined() for s in spans] == [DATA[:200_000], DATA[100_000:]]  # type: ignore[attr-defined]


def test_an_ordered_span_is_fed_in_one_part(data_file: Path) -> None:
    ordered = Collect()
    Sweep([Span(str(data_file), 0, len(DATA), ordered, ordered=True)], piece=1_000, block=999).run(4)
    assert list(ordered.parts) == [0]
    assert ordered.joined() == DATA


@pytest.mark.parametrize("mapped", [False, True])
def test_a_short_file_fails_the_spans_past_its_end(
    data_file: Path, mapped: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sweep, "maps_safely", lambda fd: mapped)
    monkeypatch.setattr(sweep, "MAP_BLOCK", 64 << 10)  # the file's end falls inside a map
    inside, past = Collect(), Collect()
    Sweep([Span(str(data_file), 0, 1_000, inside), Span(str(data_file), 299_000, 400_000, past)]).run(1)
    assert inside.error is None and inside.joined() == DATA[:1_000]
    assert past.error is not None and "ends at byte 300000" in past.error


def test_a_file_the_file_system_will_not_map_is_read(data_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system said to be local that refuses the map after all: the buffer's reads, the same bytes."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(19, "No such device")

    monkeypatch.setattr(sweep, "maps_safely", lambda fd: True)
    monkeypatch.setattr(local.mmap, "mmap", refuse)
    spans = [Span(str(data_file), 0, 200_000, Collect()), Span(str(data_file), 150_000, 400_000, Collect())]
    with io.counting() as read:
        Sweep(spans, block=4096).run(2)
    assert read.bytes_read == len(DATA)
    assert [s.sink.joined() for s in spans] == [DATA[:200_000], DATA[150_000:]]  # type: ignore[attr-defined]
    assert spans[1].sink.error is not None and "ends at byte 300000" in spans[1].sink.error  # type: ignore[attr-defined]


def test_a_missing_file_fails_its_spans(tmp_path: Path) -> None:
    sink = Collect()
    Sweep([Span(str(tmp_path / "gone"), 0, 10, sink)]).run(1)
    assert sink.error is not None and "gone" in sink.error


def test_jobs_reading_the_same_bytes_are_one_group_weighed_by_the_bytes_read_once() -> None:
    """What the ranks of a job share (`ops.sweeping`): a file's digest with the records inside it, records
    that overlap; apart, jobs on other bytes, and a job with no span weighed by what it reads itself."""

    def job(*ranges: tuple[str, int, int], extra: int = 0) -> Job[None]:
        return Job([Span(url, lo, hi, Collect()) for url, lo, hi in ranges], lambda: None, extra)

    jobs = [
        job(("a", 0, 100)),  # a whole file's digest ...
        job(("a", 10, 20)),  # ... and records inside it
        job(("a", 50, 150)),  # crosses the digest's end: 150 bytes of a in all
        job(("a", 200, 210)),  # apart
        job(("b", 0, 40), ("a", 205, 300)),  # links itself to the previous one through a
        job(extra=7),  # decodes a chunk on its own
        job(("c", 5, 5)),  # empty: reads nothing
    ]
    assert job_groups(jobs) == [([0, 1, 2], 150), ([3, 4], 140), ([5], 7), ([6], 0)]


class ThreadCounting(DigestSink):
    """A digest sink that records the threads the sweep gives it."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[int] = []

    def use_threads(self, threads: int) -> None:
        self.threads.append(threads)
        super().use_threads(threads)


@pytest.fixture
def large_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, bytes]:
    """A file 'large' for the sweep (thresholds scaled down to 1 MiB), of 3 buffers and a partial one, on a
    machine of 8 cores."""
    monkeypatch.setattr(sweep, "THREADED_PIECE", 1 << 20)
    monkeypatch.setattr(sweep, "HASH_BLOCK", 1 << 20)
    monkeypatch.setattr(sweep.os, "cpu_count", lambda: 8)
    data = os.urandom(3 * (1 << 20) + 4097)
    path = tmp_path / "large"
    path.write_bytes(data)
    return path, data


def test_a_large_file_alone_is_hashed_on_spare_threads_to_the_same_digest_in_one_read(
    large_file: tuple[Path, bytes],
) -> None:
    path, data = large_file
    digest, crc = ThreadCounting(), Collect()
    spans = [Span(str(path), 0, len(data), digest, ordered=True), Span(str(path), 0, len(data), crc)]
    with io.counting() as read:
        Sweep(spans, block=64 << 10).run(4)
    assert digest.threads == [4]
    assert digest.error is None
    assert digest.hexdigest() == blake3.blake3(data).hexdigest()
    # The span fed from the same (larger) buffers gets every byte, and nothing is read twice.
    assert crc.joined() == data
    assert read.bytes_read == len(data)


def test_files_as_many_as_threads_get_no_threads_of_their_own(large_file: tuple[Path, bytes], tmp_path: Path) -> None:
    path, data = large_file
    other = tmp_path / "other"
    other.write_bytes(data[::-1])
    sinks = [ThreadCounting(), ThreadCounting()]
    Sweep([Span(str(p), 0, len(data), s, ordered=True) for p, s in zip([path, other], sinks, strict=True)]).run(2)
    assert [s.threads for s in sinks] == [[], []]
    assert [s.hexdigest() for s in sinks] == [blake3.blake3(data).hexdigest(), blake3.blake3(data[::-1]).hexdigest()]


def test_a_large_file_gets_no_threads_where_the_cores_are_too_few(
    large_file: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, data = large_file
    monkeypatch.setattr(sweep.os, "cpu_count", lambda: 2)
    digest = ThreadCounting()
    Sweep([Span(str(path), 0, len(data), digest, ordered=True)]).run(8)
    assert digest.threads == []
    assert digest.hexdigest() == blake3.blake3(data).hexdigest()


def test_files_as_many_as_cores_are_hashed_on_their_readers_threads_alone(
    large_file: tuple[Path, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """blake3's default threads would contend with the pool's, which keep every core busy already."""
    monkeypatch.setattr(sweep.os, "cpu_count", lambda: 2)
    path, data = large_file
    other = tmp_path / "other"
    other.write_bytes(data[::-1])
    sinks = [ThreadCounting(), ThreadCounting()]
    Sweep([Span(str(p), 0, len(data), s, ordered=True) for p, s in zip([path, other], sinks, strict=True)]).run(4)
    assert [s.threads for s in sinks] == [[1], [1]]
    assert [s.hexdigest() for s in sinks] == [blake3.blake3(data).hexdigest(), blake3.blake3(data[::-1]).hexdigest()]


def test_a_file_cut_short_while_it_is_swept_is_reported_as_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process truncates the file after its first block was fed: the next map would reach past the new
    end, which is a short file reported on the span (not an exception out of the sweep, nor a SIGBUS)."""
    monkeypatch.setattr(sweep, "maps_safely", lambda fd: True)
    monkeypatch.setattr(sweep, "MAP_BLOCK", 1 << 20)
    path = tmp_path / "shrinking"
    path.write_bytes(bytes(range(256)) * (12 << 12))  # 12 MiB

    class Truncating(Collect):
        def piece(self, offset: int) -> Feed:
            feed = super().piece(offset)

            def cut_then_feed(data: memoryview) -> None:
                if path.stat().st_size > 1 << 20:
                    os.truncate(path, 1 << 20)
                feed(data)

            return cut_then_feed

    sink = Truncating()
    Sweep([Span(str(path), 0, 12 << 20, sink)], piece=12 << 20).run(1)
    assert sink.error is not None and "ends at byte 1048576" in sink.error


def test_where_the_kernel_cannot_bring_a_maps_pages_in_first_the_block_is_read(
    data_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without MADV_POPULATE_READ (Linux before 5.14; here an advice the kernel refuses) a page the disk cannot
    read would be a SIGBUS under the map: the block is read instead, the same bytes."""
    monkeypatch.setattr(sweep, "maps_safely", lambda fd: True)
    monkeypatch.setattr(local, "MADV_POPULATE_READ", 0x7FFF)  # EINVAL
    spans = [Span(str(data_file), 0, 200_000, Collect()), Span(str(data_file), 150_000, 300_000, Collect())]
    Sweep(spans, block=4096).run(2)
    assert [s.sink.joined() for s in spans] == [DATA[:200_000], DATA[150_000:]]  # type: ignore[attr-defined]
