"""`formats.dcp_metadata_write`: a `.metadata` written back from ckptctl's parse of a real one is what torch's
own reader reads from the original, and what ckptctl's parser reads back."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ckptctl.errors import CkptctlError
from ckptctl.formats.dcp_metadata import METADATA_NAME, DcpTensor, parse_dcp_metadata
from ckptctl.formats.dcp_metadata_write import dcp_metadata_bytes, write_dcp_metadata


def test_rewritten_metadata_reads_as_the_original_in_torch_and_in_ckptctl(demo_dir: Path, tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    original = demo_dir / "dcp" / "step-10"
    copy = Path(shutil.copytree(original, tmp_path / "step-10"))
    parsed = parse_dcp_metadata((original / METADATA_NAME).read_bytes(), str(original))
    write_dcp_metadata(str(copy / METADATA_NAME), parsed)

    theirs = FileSystemReader(str(original)).read_metadata()
    ours = FileSystemReader(str(copy)).read_metadata()
    assert list(ours.state_dict_metadata) == list(theirs.state_dict_metadata)
    for key, want in theirs.state_dict_metadata.items():
        got = ours.state_dict_metadata[key]
        assert type(got) is type(want)
        if hasattr(want, "size"):  # the deprecated properties (requires_grad, ...) are torch's defaults
            assert (got.size, got.chunks, got.properties.dtype) == (want.size, want.chunks, want.properties.dtype)
    assert ours.storage_data == theirs.storage_data  # MetadataIndex -> _StorageInfo, index hints aside
    assert ours.planner_data == theirs.planner_data and ours.version == theirs.version
    assert ours.storage_meta.save_id == theirs.storage_meta.save_id

    again = parse_dcp_metadata((copy / METADATA_NAME).read_bytes(), str(copy))
    assert (again.entries, again.storage, again.planner_data) == (parsed.entries, parsed.storage, parsed.planner_data)
    assert (again.version, again.save_id, again.checkpoint_id) == (parsed.version, parsed.save_id, parsed.checkpoint_id)


def test_a_record_of_no_entry_and_an_unknown_dtype_are_refused(demo_dir: Path) -> None:
    source = demo_dir / "dcp" / "step-10" / METADATA_NAME
    parsed = parse_dcp_metadata(source.read_bytes(), str(source))
    (key, tensor), *_ = parsed.tensors()
    with pytest.raises(CkptctlError, match="not an entry"):
        dcp_metadata_bytes({}, parsed.storage, version=parsed.version)
    odd = {key: DcpTensor("no_such_dtype", tensor.size, tensor.chunks)}
    with pytest.raises(CkptctlError, match="not one torch has"):
        dcp_metadata_bytes(odd, {}, version=parsed.version)
