"""Verifying a checkpoint file reads each record once, in place, the large ones on several threads: any changed
byte still shows, for a local file and for bytes fetched from another store; files read ahead together load as
files read one by one."""

from __future__ import annotations

import io

import pytest
import torch

from fabric_lite.checkpoint import checksums
from fabric_lite.checkpoint.files import CheckpointError
from fabric_lite.checkpoint.loading import load_file, start_reading


@pytest.fixture
def saved(tmp_path):
    """A torch.save file with two records over the parallel threshold (4 MiB) and small ones."""
    obj = {"a": torch.arange(1_500_000, dtype=torch.float32), "b": torch.ones(1_200_000), "c": torch.tensor([1, 2]),
           "meta": {"step": 3}}
    path = tmp_path / "obj.pt"
    torch.save(obj, path)
    return path, obj, checksums.zip_listing_digest(str(path))


def _record_offsets(path):
    import zipfile

    with zipfile.ZipFile(path) as archive:
        return {info.filename.rsplit("/", 1)[-1]: (info.header_offset, info.compress_size)
                for info in archive.infolist()}


def test_an_intact_file_gives_its_listing_digest_from_a_path_and_from_bytes(saved):
    path, _, listing = saved
    assert checksums.zip_digest(str(path)) == listing
    assert checksums.zip_digest(io.BytesIO(path.read_bytes())) == listing


@pytest.mark.parametrize("where", ["large record", "second large record", "small record", "pickle", "local header name"])
def test_any_changed_byte_shows(saved, where):
    path, _, listing = saved
    data = bytearray(path.read_bytes())
    offsets = _record_offsets(path)
    by_size = sorted((size, offset) for name, (offset, size) in offsets.items() if name.isdigit())
    if where == "large record":
        offset, size = by_size[-1][1], by_size[-1][0]
        data[offset + 200 + size // 2] ^= 0x10
    elif where == "second large record":
        offset, size = by_size[-2][1], by_size[-2][0]
        data[offset + 200 + size // 3] ^= 0x01
    elif where == "small record":
        data[by_size[0][1] + 100] ^= 0x01  # inside the small tensor's bytes or its header padding
    elif where == "pickle":
        offset, size = offsets["data.pkl"]
        data[offset + 100 + size // 2] ^= 0x01
    else:
        offset, _ = offsets["data.pkl"]
        name_at = offset + 30
        data[name_at] = ord("X") if data[name_at] != ord("X") else ord("Y")
    path.write_bytes(bytes(data))
    assert checksums.zip_digest(str(path)) != listing
    assert checksums.zip_digest(io.BytesIO(bytes(data))) != listing


def test_a_truncated_file_is_damaged(saved):
    path, _, _ = saved
    data = path.read_bytes()
    for cut in (0, 10, len(data) // 2, len(data) - 10):
        path.write_bytes(data[:cut])
        assert checksums.zip_digest(str(path)) == checksums.ZIP_DAMAGED


def test_files_read_ahead_load_as_files_read_one_by_one(tmp_path, saved):
    path, obj, listing = saved
    url = str(tmp_path)
    manifest = {"checksum": "crc32", "files": {"obj.pt": listing, "gone.pt": listing}}
    started = start_reading(url, ["obj.pt", "gone.pt", "unlisted.pt"], manifest)
    assert set(started) == {"obj.pt", "gone.pt"}
    got = load_file(url, "obj.pt", manifest, started=started)
    assert torch.equal(got["a"], obj["a"]) and torch.equal(got["b"], obj["b"]) and got["meta"] == obj["meta"]
    with pytest.raises(CheckpointError, match="missing gone.pt"):
        load_file(url, "gone.pt", manifest, started=started)
    with pytest.raises(CheckpointError, match="no file 'unlisted.pt'"):
        load_file(url, "unlisted.pt", manifest, started=started)
    assert not started  # each taken once


def test_a_damaged_file_read_ahead_is_refused_before_unpickling_when_unsafe(tmp_path, saved):
    path, _, listing = saved
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    manifest = {"checksum": "crc32", "files": {"obj.pt": listing}}
    for weights_only in (True, False):
        started = start_reading(str(tmp_path), ["obj.pt"], manifest)
        with pytest.raises(CheckpointError, match="does not match its checksum"):
            load_file(str(tmp_path), "obj.pt", manifest, weights_only=weights_only, started=started)


def test_memory_store_reads_ahead_as_bytes(saved):
    fsspec = pytest.importorskip("fsspec")
    path, obj, _ = saved
    fs = fsspec.filesystem("memory")
    fs.pipe("/ra/obj.pt", path.read_bytes())
    crc = checksums.digest("crc32")
    crc.update(path.read_bytes())
    manifest = {"checksum": "crc32", "files": {"obj.pt": crc.hexdigest()}}
    started = start_reading("memory://ra", ["obj.pt"], manifest)
    got = load_file("memory://ra", "obj.pt", manifest, started=started)
    assert torch.equal(got["a"], obj["a"])
