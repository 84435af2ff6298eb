"""Zarr v3 arrays written by zarr-python open through ``DiskArray.open(path, backend="zarr")``
and read what zarr-python reads: codecs chemio implements (gzip, crc32c, zstd, sharding,
big-endian ``bytes``) on chemio's own pipeline, the others (transpose = F order, codecs
inside shards it does not know) read-only through zarr-python's codec pipeline; every
fill value type; writes to an array chemio cannot encode are refused, nothing changed."""
import hashlib
import os
import warnings

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.errors import MetadataError, ModeError

zarr = pytest.importorskip("zarr")
from zarr.codecs import (  # noqa: E402
    BloscCodec,
    BytesCodec,
    Crc32cCodec,
    GzipCodec,
    ShardingCodec,
    TransposeCodec,
    ZstdCodec,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _tree(path):
    h = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(path)):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(root, f)
            h.update(p.encode() + open(p, "rb").read())
    return h.hexdigest()


def _write(path, data, chunks, *, written=None, **kw):
    """A zarr-python array of ``data`` (only the ``written`` region stored: the rest is
    the fill value)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = zarr.create_array(str(path), shape=data.shape, chunks=chunks, dtype=data.dtype,
                              **kw)
        region = written if written is not None else tuple(slice(None) for _ in data.shape)
        a[region] = data[region]
    return str(path)


def _zarr_reads(path, key=Ellipsis):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return zarr.open_array(path, mode="r")[key]


def _same(got, want):
    assert got.shape == want.shape
    if got.dtype.names is None and got.dtype.kind in "fc":
        np.testing.assert_array_equal(got, want)          # NaN == NaN here
    else:
        assert got.dtype.itemsize == want.dtype.itemsize
        assert (got.astype(want.dtype) == want).all(), (got, want)


X = np.arange(6 * 10 * 3, dtype="f8").reshape(6, 10, 3) / 7.0

CODECS = {
    "transpose (F order)": dict(filters=[TransposeCodec(order=(2, 1, 0))], compressors=None),
    "transpose + gzip": dict(filters=[TransposeCodec(order=(1, 0, 2))],
                             compressors=[GzipCodec(level=5)]),
    "gzip": dict(compressors=[GzipCodec(level=1)]),
    "crc32c": dict(compressors=[Crc32cCodec()]),
    "gzip + crc32c": dict(compressors=[GzipCodec(), Crc32cCodec()]),
    "zstd": dict(compressors=[ZstdCodec(level=3)]),
    "blosc": dict(compressors=[BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")]),
    "big-endian": dict(serializer=BytesCodec(endian="big"), compressors=None),
    "big-endian + zstd": dict(serializer=BytesCodec(endian="big"), compressors=[ZstdCodec()]),
    "sharding": dict(shards=(4, 6, 3), compressors=[ZstdCodec()]),
    "sharding + transpose": dict(serializer=ShardingCodec(
        chunk_shape=(2, 3, 3), codecs=[TransposeCodec(order=(2, 0, 1)), BytesCodec(),
                                       GzipCodec()]), compressors=None),
    "sharding + big-endian + crc32c": dict(serializer=ShardingCodec(
        chunk_shape=(2, 3, 3), codecs=[BytesCodec(endian="big"), Crc32cCodec()]),
        compressors=None),
    "sharding, then zstd": dict(serializer=ShardingCodec(chunk_shape=(2, 3, 3))),
}
NATIVE = {"gzip", "crc32c", "gzip + crc32c", "zstd", "blosc", "big-endian",
          "big-endian + zstd", "sharding", "sharding + big-endian + crc32c"}


@pytest.mark.parametrize("case", sorted(CODECS))
def test_foreign_codecs_read_as_zarr_python_reads(tmp_path, case):
    kw = dict(CODECS[case])
    chunks = (4, 3, 2)
    if isinstance(kw.get("serializer"), ShardingCodec):
        chunks = (4, 6, 3)
    if "shards" in kw:
        chunks = (2, 3, 3)
    p = _write(tmp_path / "f.zarr", X, chunks, written=(slice(0, 5), slice(1, 9)),
               fill_value=-1.5, **kw)
    before = _tree(p)
    d = cio.DiskArray.open(p, backend="zarr")
    try:
        assert d.shape == X.shape and d.mode == "r"
        assert (d.store.meta.foreign is None) == (case in NATIVE), d.store.meta.foreign
        if "big-endian" in case:
            assert d.dtype == np.dtype(">f8")                   # byte order kept
        _same(d[...], _zarr_reads(p))
        for key in [(slice(1, 4), slice(2, 9), slice(0, 2)), (5, slice(None), 1),
                    (slice(0, 6), 9, slice(None))]:
            _same(np.asarray(d[key]), _zarr_reads(p, key))
        np.testing.assert_allclose(d.to_dask().sum().compute(), _zarr_reads(p).sum())
    finally:
        d.close()
    if case not in NATIVE:
        with pytest.raises(ModeError, match="zarr-python") as e:
            cio.DiskArray.open(p, "r+", backend="zarr")
        assert "nothing was changed" in str(e.value)
    assert _tree(p) == before                                 # reading wrote nothing


FILLS = [
    ("int", np.int32, -7), ("uint", np.uint16, 65535), ("float", np.float32, 2.5),
    ("NaN", np.float64, float("nan")), ("Infinity", np.float64, float("inf")),
    ("-Infinity", np.float32, float("-inf")), ("float16", np.float16, 0.25),
    ("complex", np.complex128, 1 - 2j), ("complex NaN", np.complex64, complex("nan+1j")),
    ("bool", np.bool_, True), ("bytes", "S4", b"ab"), ("unicode", "<U3", "xyz"),
    ("raw", "V4", b"\x01\x02\x03\x04"), ("datetime", "M8[s]", np.datetime64(5, "s")),
    ("NaT", "M8[ms]", np.datetime64("NaT")), ("timedelta", "m8[us]", np.timedelta64(-3, "us")),
    ("structured", [("a", "<f4"), ("b", "<i2"), ("c", "S2")], (1.5, -2, b"z")),
]


@pytest.mark.parametrize("label,dtype,fill", FILLS, ids=[f[0] for f in FILLS])
def test_every_fill_value_type(tmp_path, label, dtype, fill):
    dt = np.dtype(dtype)
    data = np.zeros((5, 4), dt)
    if dt.names is None:
        data[...] = np.array(fill, dtype=dt) if label in ("raw",) else data
    fv = np.array(fill, dtype=dt)[()] if dt.kind == "V" and dt.names is not None else fill
    p = _write(tmp_path / "fill.zarr", data, (2, 2), written=(slice(0, 2), slice(0, 2)),
               fill_value=fv, compressors=None)
    want = _zarr_reads(p)
    d = cio.DiskArray.open(p, backend="zarr")
    try:
        got = d[...]
        assert got.dtype == want.dtype or got.dtype.newbyteorder("=") == want.dtype
        if dt.names is None and dt.kind in "fc":
            np.testing.assert_array_equal(got, want)
        elif dt.kind in "mM":
            assert np.array_equal(got, want, equal_nan=True)
        else:
            assert got.tobytes() == want.tobytes()
        assert got[4:, 3:].tobytes() == np.array(fill, dtype=dt).tobytes()   # unwritten
    finally:
        d.close()


def test_foreign_arrays_keep_chemios_limits(tmp_path):
    """A transposed (zarr-python read) array is still bounded: too many inner chunks per
    shard, a huge shape and an unknown codec are refused before anything is read."""
    import json
    p = _write(tmp_path / "lim.zarr", X, (4, 6, 3), serializer=ShardingCodec(
        chunk_shape=(2, 3, 3), codecs=[TransposeCodec(order=(2, 0, 1)), BytesCodec()]))
    mp = os.path.join(p, "zarr.json")
    good = open(mp).read()

    def edit(fn):
        doc = json.loads(good)
        fn(doc)
        open(mp, "w").write(json.dumps(doc))

    edit(lambda d: d.update(shape=[1 << 40, 1 << 40, 3]))
    with pytest.raises(MetadataError, match="limit"):
        cio.DiskArray.open(p, backend="zarr")
    edit(lambda d: d["codecs"][0]["configuration"]["codecs"].append({"name": "lzma"}))
    with pytest.raises(MetadataError, match="lzma"):
        cio.DiskArray.open(p, backend="zarr")

    def many(d):
        d["chunk_grid"]["configuration"]["chunk_shape"] = [2048, 1024, 3]
        d["codecs"][0]["configuration"]["chunk_shape"] = [1, 1, 3]
        d["shape"] = [2048, 1024, 3]
    edit(many)
    with pytest.raises(MetadataError, match="inner chunks"):
        cio.DiskArray.open(p, backend="zarr")


def test_zarr_python_reads_what_chemio_writes_and_chemio_what_it_writes(tmp_path):
    """Round trip both ways for a big-endian array: chemio writes ``bytes`` endian big,
    zarr-python reads the same values; zarr-python's big-endian array opens in chemio
    as ``>f8``."""
    p = str(tmp_path / "be.zarr")
    m = (np.arange(48, dtype=">f8") * 1.25).reshape(6, 8)
    d = cio.DiskArray.create("be", m.shape, ">f8", chunks=(3, 4), backend="zarr", path=p,
                             persistent=True)
    d[...] = m
    d.close()
    np.testing.assert_array_equal(_zarr_reads(p), m)
    e = cio.DiskArray.open(p, backend="zarr")
    assert e.dtype.str == ">f8" and e[...].dtype.str == ">f8"
    np.testing.assert_array_equal(e[...], m)
    e.delete()


def test_chemio_check_verifies_a_foreign_array(tmp_path, capsys):
    from chemio_py.tools import check
    p = _write(tmp_path / "chk.zarr", X, (4, 3, 2), filters=[TransposeCodec(order=(2, 1, 0))],
               compressors=[GzipCodec()])
    assert check.main([p]) == 0, capsys.readouterr().out
    assert "zarr-python" in capsys.readouterr().out
    d = cio.DiskArray.open(p, backend="zarr")
    assert "zarr-python" in d.store.compression and "transpose" in d.store.compression
    d.close()
