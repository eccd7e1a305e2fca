"""The CRC-32s torch records in its zip archives: combined from parts, read from directories, checked."""

from __future__ import annotations

import io
import sys
import warnings
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ckptctl.errors import CorruptCheckpoint
from ckptctl.formats import torch_zip
from ckptctl.formats.torch_pickle import open_torch_pickle
from ckptctl.formats.torch_zip import archive_members, check_zip_crcs, crc32, crc32_combine


@given(st.binary(max_size=3000), st.binary(max_size=3000))
def test_crc32_combine_is_zlibs(a: bytes, b: bytes) -> None:
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_crc32_is_zlib_ngs_and_zlibs_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # zlib-ng is a dependency: the default CRC-32 is its own (found on first use), with zlib's values.
    data = bytes(range(256)) * 4099
    assert torch_zip.crc32_function().__module__.startswith("zlib_ng")
    assert crc32(data, 0) == zlib.crc32(data)
    assert crc32(data[100:], crc32(data[:100], 0)) == zlib.crc32(data)
    # Where it does not import (no wheel for the platform), stdlib zlib's is used.
    torch_zip.crc32_function.cache_clear()
    monkeypatch.setitem(sys.modules, "zlib_ng", None)
    try:
        assert torch_zip.crc32_function() is zlib.crc32
    finally:
        torch_zip.crc32_function.cache_clear()  # the next caller finds zlib-ng again


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "optimizer.pt"
    torch.save({"state": {0: {"exp_avg": torch.randn(64, 64), "step": torch.tensor(3.0)}}, "lr": 0.1}, path)
    return path


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_clean_file_checks_every_record(saved: Path) -> None:
    found = check_zip_crcs(str(saved))
    names = set(open_torch_pickle(str(saved)).records)
    assert found.crc_recorded and found.damaged == () and found.checked == len(names)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_flipped_byte_names_its_record(saved: Path, workers: int) -> None:
    opened = open_torch_pickle(str(saved))
    [ref] = [r for p, r in opened.tensors() if p == "state.0.exp_avg"]
    start, _ = opened.byte_range(ref)  # type: ignore[misc]
    _flip(saved, start + 1000)
    [damaged] = check_zip_crcs(str(saved), workers=workers).damaged
    assert damaged.name == f"{opened.prefix}data/{ref.storage_key}"
    assert damaged.computed is not None and damaged.computed != damaged.recorded


def test_crcs_written_as_zero_are_not_recorded(saved: Path) -> None:
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"w": torch.ones(10)}, saved)
    finally:
        torch.serialization.set_crc32_options(True)
    assert check_zip_crcs(str(saved)).crc_recorded is False


def test_a_damaged_directory_is_an_error(saved: Path) -> None:
    saved.write_bytes(saved.read_bytes()[:-30])
    with pytest.raises(CorruptCheckpoint, match="zip directory"):
        check_zip_crcs(str(saved))


def _dcp_items(folder: Path) -> Iterator[tuple[str, bytes]]:
    from ckptctl.formats.dcp_folder_metadata import load_dcp_metadata

    metadata = load_dcp_metadata(str(folder))
    for (key, _), record in metadata.storage.items():
        blob = (folder / record.relative_path).read_bytes()[record.offset : record.offset + record.length]
        yield key, blob


def test_every_item_of_a_real_dcp_save_is_an_archive_with_crcs(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.randn(8, 4), "b": torch.zeros(4)}, "extra": {"step": 7, "name": "run"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    items = dict(_dcp_items(tmp_path / "dcp"))
    # Tensor chunks and bytes items alike: torch.save archives, every record's CRC-32 recorded and right.
    assert set(items) == {"model.w", "model.b", "extra.step", "extra.name"}
    for key, blob in items.items():
        found = archive_members(lambda start, n, b=blob: b[start : start + n], len(blob), 0, key)
        assert found.crc_recorded, key
        for member in found.members:
            assert zlib.crc32(blob[member.start : member.start + member.size]) == member.crc, (key, member.name)
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:  # the same records zipfile lists
            assert {m.name for m in found.members} == set(archive.namelist())
