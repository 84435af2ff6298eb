"""Hostile and corrupt Zarr v3 arrays on the ``zarr`` backend: each a clear
``MetadataError`` (or a refusal), nothing written, nothing outside the array touched."""
from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

import chemio_py as cio
import chemio_py.backends as backends
from chemio_py.errors import ChemIOError, MetadataError

zarr = pytest.importorskip("zarr")
numcodecs = pytest.importorskip("numcodecs")


def _be():
    return backends.resolve("zarr")


def _make(path, compressor="zstd", inner=(4, 5), shape=(16, 20), chunks=(8, 10)):
    st = _be().open_array(str(path), "w+", shape=shape, dtype=np.dtype("f8"), chunks=chunks,
                          compressor=compressor, inner_chunks=inner)
    st.write(tuple(slice(0, n) for n in shape),
             np.arange(np.prod(shape), dtype="f8").reshape(shape) + 1)
    st.close()
    return str(path)


def _read_all(path, shape=(16, 20), chunks=(8, 10)):
    st = _be().open_array(str(path), "r", shape=shape, dtype=np.dtype("f8"), chunks=chunks)
    try:
        out = np.empty(shape)
        st.read(tuple(slice(0, n) for n in shape), out)
        return out
    finally:
        st.close()


def _tree(root):
    """Every path under ``root`` with its size and content hash (to prove no change)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            st = os.lstat(p)
            data = open(p, "rb").read() if os.path.isfile(p) and not os.path.islink(p) else b""
            out[p] = (st.st_mode, st.st_size, hash(data))
    return out


def _shard_file(path):
    return os.path.join(path, "c", "0", "0")


# ---------------------------------------------------------------- shards

def test_bad_index_checksum(tmp_path):
    p = _make(tmp_path / "a.zarr")
    f = _shard_file(p)
    raw = bytearray(open(f, "rb").read())
    raw[-10] ^= 0xFF                                    # inside the index
    open(f, "wb").write(raw)
    with pytest.raises(MetadataError, match="checksum") as e:
        _read_all(p)
    assert f in str(e.value)


def test_index_offsets_past_the_end(tmp_path):
    from chemio_py.backends.zarr.format import crc32c
    p = _make(tmp_path / "a.zarr")
    f = _shard_file(p)
    raw = bytearray(open(f, "rb").read())
    n = 4                                                # (8,10) / (4,5) inner chunks
    index = np.frombuffer(bytes(raw[-(16 * n + 4):-4]), "<u8").reshape(n, 2).copy()
    index[1, 0] = len(raw) + 1000                        # offset past the end
    body = index.tobytes()
    raw[-(16 * n + 4):] = body + struct.pack("<I", crc32c(body))   # a valid checksum
    open(f, "wb").write(raw)
    with pytest.raises(MetadataError, match="outside"):
        _read_all(p)
    index[1] = (0, (1 << 63))                            # overflowing length
    body = index.tobytes()
    raw[-(16 * n + 4):] = body + struct.pack("<I", crc32c(body))
    open(f, "wb").write(raw)
    with pytest.raises(MetadataError, match="outside"):
        _read_all(p)


def test_truncated_shard(tmp_path):
    p = _make(tmp_path / "a.zarr")
    f = _shard_file(p)
    open(f, "r+b").truncate(10)
    with pytest.raises(MetadataError, match="truncated"):
        _read_all(p)


def test_corrupt_inner_chunk(tmp_path):
    p = _make(tmp_path / "a.zarr")
    f = _shard_file(p)
    raw = bytearray(open(f, "rb").read())
    raw[0:4] = b"\0\0\0\0"                               # the first inner chunk's zstd magic
    open(f, "wb").write(raw)
    with pytest.raises(MetadataError, match="corrupt|decode"):
        _read_all(p)


def test_inner_chunk_that_inflates_is_refused(tmp_path):
    """A hostile shard whose inner chunk decodes to more than an inner chunk holds."""
    from chemio_py.backends.zarr.format import crc32c
    p = _make(tmp_path / "a.zarr")
    f = _shard_file(p)
    bomb = numcodecs.Zstd(level=1).encode(np.zeros(1 << 20, np.uint8))
    n = 4
    index = np.full((n, 2), (1 << 64) - 1, "<u8")
    index[0] = (0, len(bomb))
    body = index.tobytes()
    open(f, "wb").write(bomb + body + struct.pack("<I", crc32c(body)))
    with pytest.raises(MetadataError, match="decode"):
        _read_all(p)


def test_wrong_size_plain_chunk(tmp_path):
    p = _make(tmp_path / "a.zarr", compressor="none", inner=False)
    open(_shard_file(p), "ab").write(b"extra")
    with pytest.raises(MetadataError, match="bytes"):
        _read_all(p)


def test_corrupt_object_partial_write_changes_nothing(tmp_path):
    p = _make(tmp_path / "a.zarr")
    f = _shard_file(p)
    raw = bytearray(open(f, "rb").read())
    raw[-10] ^= 0xFF
    open(f, "wb").write(raw)
    before = _tree(p)
    st = _be().open_array(p, "r+", shape=(16, 20), dtype=np.dtype("f8"), chunks=(8, 10))
    with pytest.raises(MetadataError):
        st.write((slice(0, 3), slice(0, 3)), np.zeros((3, 3)))
    st.close()
    assert _tree(p) == before


# ---------------------------------------------------------------- zarr.json

def _edit(path, fn):
    mp = os.path.join(path, "zarr.json")
    doc = json.load(open(mp))
    fn(doc)
    open(mp, "w").write(json.dumps(doc))


HOSTILE = {
    "huge shape": lambda d: d.update(shape=[1 << 40, 1 << 40]),
    "negative shape": lambda d: d.update(shape=[-1, 20]),
    "negative chunk": lambda d: d["chunk_grid"]["configuration"].update(chunk_shape=[-8, 10]),
    "zero chunk": lambda d: d["chunk_grid"]["configuration"].update(chunk_shape=[0, 10]),
    "overflowing chunk": lambda d: d["chunk_grid"]["configuration"].update(
        chunk_shape=[1 << 40, 1 << 40]),
    "bool chunk": lambda d: d["chunk_grid"]["configuration"].update(chunk_shape=[True, 10]),
    "float shape": lambda d: d.update(shape=[16.0, 20]),
    "ndim mismatch": lambda d: d["chunk_grid"]["configuration"].update(chunk_shape=[8]),
    # a valid transpose codec opens read-only through zarr-python (test_zarr_foreign.py)
    "transpose codec": lambda d: d.update(codecs=[{"name": "transpose", "configuration":
                                                    {"order": [0, 0]}}] + d["codecs"]),
    "unknown codec": lambda d: d["codecs"][0]["configuration"]["codecs"].append(
        {"name": "lzma"}),
    "escaping separator": lambda d: d["chunk_key_encoding"].update(
        configuration={"separator": "/../"}),
    "inner not dividing": lambda d: d["codecs"][0]["configuration"].update(chunk_shape=[3, 5]),
    "too many inner": lambda d: d["codecs"][0]["configuration"].update(chunk_shape=[1, 1])
    or d["chunk_grid"]["configuration"].update(chunk_shape=[4096, 4096]),
    "string dtype": lambda d: d.update(data_type="string"),
    "group": lambda d: d.update(node_type="group"),
    "v2": lambda d: d.update(zarr_format=2),
    "fill of wrong type": lambda d: d.update(fill_value="zero"),
    "storage transformer": lambda d: d.update(storage_transformers=[{"name": "x"}]),
    "must understand": lambda d: d.update(extension={"must_understand": True}),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_zarr_json(tmp_path, case):
    p = _make(tmp_path / "a.zarr")
    _edit(p, HOSTILE[case])
    before = _tree(str(tmp_path))
    with pytest.raises(MetadataError) as e:
        _be().describe(p)
    if "codec" in case:
        assert ("transpose" if "transpose" in case else "lzma") in str(e.value)
    if case in ("group", "v2"):
        assert not _be().recognizes(p)
    with pytest.raises((MetadataError, ChemIOError)):
        cio.DiskArray.open(p, "r+", backend="zarr")
    assert _tree(str(tmp_path)) == before                # nothing written


def test_broken_json_and_oversized_json(tmp_path):
    p = _make(tmp_path / "a.zarr")
    mp = os.path.join(p, "zarr.json")
    open(mp, "w").write('{"zarr_format": 3, "shape": [1, ')
    with pytest.raises(MetadataError, match="JSON"):
        _be().describe(p)
    assert not _be().recognizes(p)
    open(mp, "w").write(" " * (2 << 20) + "{}")
    with pytest.raises(MetadataError, match="bytes"):
        _be().describe(p)
    os.unlink(mp)
    with pytest.raises(MetadataError, match="missing"):
        _be().describe(p)


# ---------------------------------------------------------------- links

def test_links_are_refused_and_nothing_outside_is_touched(tmp_path):
    p = _make(tmp_path / "a.zarr", inner=False, compressor="none")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "0").write_bytes(b"secret")
    # a chunk file that is a link: refused on read
    f = _shard_file(p)
    os.unlink(f)
    os.symlink(outside / "0", f)
    with pytest.raises(MetadataError, match="symbolic link"):
        _read_all(p)
    # a chunk directory that is a link: refused on write, nothing lands outside
    import shutil
    shutil.rmtree(os.path.join(p, "c", "1"))
    os.symlink(outside, os.path.join(p, "c", "1"))
    st = _be().open_array(p, "r+", shape=(16, 20), dtype=np.dtype("f8"), chunks=(8, 10))
    with pytest.raises(MetadataError, match="symbolic link"):
        st.write((slice(8, 16), slice(0, 10)), np.ones((8, 10)))
    st.close()
    assert sorted(os.listdir(outside)) == ["0"] and (outside / "0").read_bytes() == b"secret"
    # zarr.json itself a link: refused
    mp = os.path.join(p, "zarr.json")
    os.rename(mp, tmp_path / "real.json")
    os.symlink(tmp_path / "real.json", mp)
    with pytest.raises(MetadataError, match="symbolic link"):
        _be().describe(p)
    # remove() takes the array and leaves what its links point to
    assert _be().remove(p) is True and not os.path.lexists(p)
    assert (outside / "0").read_bytes() == b"secret" and (tmp_path / "real.json").exists()


def test_replacing_a_foreign_directory_is_refused(tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "precious").write_text("keep")
    with pytest.raises(ChemIOError, match="not a Zarr array"):
        _be().open_array(str(d), "w+", shape=(4,), dtype=np.dtype("f8"), chunks=(2,))
    assert (d / "precious").read_text() == "keep"
