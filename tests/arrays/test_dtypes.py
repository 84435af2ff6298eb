"""Every fixed-size NumPy dtype in a DiskArray, on every backend, against NumPy: float16,
structured (nested, subarray and padded fields), S/U/V, datetime64/timedelta64 with units,
big-endian byte order kept on disk and in what is read; through to_dask, to_xarray,
checksums, HDF5, zarr-python; under ``mpiexec -n 3``; bad dtypes refused clearly."""
import json
import os
import warnings

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.arrays import meta
from chemio_py.errors import ArgumentError, MetadataError

BACKENDS = ["local", "shm", "auto", "mpiio", "zarr"]

DTYPES = {
    "float16": "f2",
    "big f8": ">f8",
    "big i4": ">i4",
    "little c8": "<c8",
    "bool": "?",
    "bytes": "S10",
    "raw": "V8",
    "unicode": "<U5",
    "big unicode": ">U3",
    "datetime s": "M8[s]",
    "big timedelta": ">m8[10ms]",
    "record": [("x", "<f8"), ("y", "<i4"), ("tag", "S3")],
    "padded record": np.dtype([("a", "u1"), ("b", "<f8")], align=True),
    "subarray field": [("a", "<f4"), ("b", ">i8", (2, 3))],
    "nested": [("a", "u1"), ("n", [("x", ">u2"), ("y", "S3"), ("t", "<M8[us]")])],
}
SHAPE, CHUNKS = (9, 7), (4, 3)


def model(dt, seed=0):
    """A (9, 7) array of ``dt`` with distinct, valid values in every field."""
    rng = np.random.default_rng(seed)
    a = np.zeros(SHAPE, dt)
    if dt.names is not None:
        for name in dt.names:
            sub = dt.fields[name][0]
            base = sub.base
            part = model(base, seed + 1).reshape(SHAPE + (1,) * len(sub.shape))
            a[name] = np.broadcast_to(part, a[name].shape)
        return a
    n = a.size
    if dt.kind == "f" or dt.kind == "c":
        v = rng.integers(-500, 500, n) / 4
        a.flat[:] = v + (1j * v[::-1] if dt.kind == "c" else 0)
    elif dt.kind in "iu":
        a.flat[:] = rng.integers(0, 100, n)
    elif dt.kind == "b":
        a.flat[:] = rng.integers(0, 2, n).astype(bool)
    elif dt.kind == "S":
        a.flat[:] = [f"b{i}".encode()[:dt.itemsize] for i in range(n)]
    elif dt.kind == "U":
        a.flat[:] = [f"é{i}"[:dt.itemsize // 4] for i in range(n)]
    elif dt.kind == "V":
        a.view(np.uint8).flat[:] = rng.integers(0, 256, a.nbytes)
    elif dt.kind in "mM":
        a.flat[:] = rng.integers(-10**6, 10**6, n).astype(dt)
    return a


def same(got, want):
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.dtype.str == want.dtype.str                    # byte order kept
    if want.dtype.names is None:
        assert got.tobytes() == want.tobytes()
    else:
        for name in want.dtype.names:                         # padding bytes are not data
            same(got[name], want[name])


def _path(tmp_path, backend, name="a"):
    return str(tmp_path / (name + (".zarr" if backend == "zarr" else ".dra")))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("label", sorted(DTYPES))
def test_round_trip_on_every_backend(tmp_path, backend, label):
    dt = np.dtype(DTYPES[label])
    m = model(dt)
    p = _path(tmp_path, backend)
    d = cio.DiskArray.create("a", SHAPE, dt, chunks=CHUNKS, backend=backend, path=p,
                             persistent=True)
    assert d.dtype == dt and d.dtype.str == dt.str
    same(d[...], np.zeros(SHAPE, dt))                         # created zero
    d[...] = m
    d[2:7, 1:5] = m[2:7, 1:5][::-1]                            # a write across chunks
    want = m.copy()
    want[2:7, 1:5] = m[2:7, 1:5][::-1]
    same(d[...], want)
    same(d[1:8, 2:6], want[1:8, 2:6])
    same(np.asarray(d[3]), want[3])
    d.close()
    e = cio.DiskArray.open(p)
    try:
        assert e.dtype == dt and e.dtype.str == dt.str
        same(e[...], want)
        x = e.to_dask()
        assert x.dtype == dt
        same(x[1:8].compute(), want[1:8])
        if backend in ("local", "zarr"):
            pytest.importorskip("xarray")
            same(e.to_xarray().values, want)
    finally:
        e.delete()


def test_big_endian_stays_big_endian_on_disk(tmp_path):
    """The raw grid stores the bytes of the dtype as given: a '>f8' array's file holds
    big-endian doubles, and its metadata says '>f8'."""
    p = str(tmp_path / "be.dra")
    m = np.arange(12, dtype=">f8").reshape(3, 4)
    d = cio.DiskArray.create("be", (3, 4), ">f8", chunks=(3, 4), backend="local", path=p,
                             persistent=True)
    d[...] = m
    d.close()
    assert open(p, "rb").read(16) == m.tobytes()[:16]          # big-endian bytes
    assert json.load(open(p + ".json"))["dtype"] == ">f8"
    e = cio.DiskArray.open(p, "r+")
    assert e[...].dtype.str == ">f8"
    e[0, 0] = np.float64(7.5)                                  # a native value is cast
    assert e[0, 0] == 7.5 and open(p, "rb").read(8) == np.array(7.5, ">f8").tobytes()
    e.delete()


def test_structured_metadata_is_json_lists(tmp_path):
    dt = np.dtype([("a", "<f4"), ("b", ">i8", (2,)), ("n", [("x", "S2")])])
    p = str(tmp_path / "s.dra")
    d = cio.DiskArray.create("s", (3,), dt, backend="local", path=p, persistent=True)
    d.close()
    doc = json.load(open(p + ".json"))
    assert doc["dtype"] == [["a", "<f4"], ["b", ">i8", [2]], ["n", [["x", "|S2"]]]]
    assert cio.DiskArray.open(p).dtype == dt
    cio.DiskArray.open(p).delete()


@pytest.mark.parametrize("backend", ["local", "zarr"])
def test_checksums_with_new_dtypes(tmp_path, backend):
    for k, label in enumerate(["nested", "datetime s", "unicode", "float16"]):
        dt = np.dtype(DTYPES[label])
        p = _path(tmp_path, backend, f"c{k}")
        try:
            d = cio.DiskArray.create("c", SHAPE, dt, chunks=CHUNKS, backend=backend, path=p,
                                     persistent=True, checksum=True)
        except ArgumentError as e:                  # a backend without checksums says so
            assert "checksum" in str(e)
            return
        m = model(dt, k)
        d[...] = m
        d.close()
        e = cio.DiskArray.open(p)
        same(e[...], m)
        e.delete()


@pytest.mark.parametrize("label", sorted(DTYPES))
def test_zarr_python_reads_chemios_arrays(tmp_path, label):
    """zarr-python reads every dtype chemio writes as Zarr v3: the same values (its own
    byte order for numbers), or, for a structured dtype zarr's ``structured`` cannot hold
    exactly (padding, subarray or big-endian fields), the raw records of the same bytes."""
    zarr = pytest.importorskip("zarr")
    dt = np.dtype(DTYPES[label])
    m = model(dt)
    p = _path(tmp_path, "zarr")
    d = cio.DiskArray.create("a", SHAPE, dt, chunks=CHUNKS, backend="zarr", path=p,
                             persistent=True)
    d[...] = m
    want = d[...]
    d.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        z = zarr.open_array(p, mode="r")[...]
    if z.dtype.kind == "V" and z.dtype.names is None and dt.names is not None:
        same(z.view(dt), want)                               # raw records
    elif dt.names is not None:
        same(z.astype(dt), want)
    else:
        assert np.array_equal(z, want.astype(z.dtype)) and z.dtype.itemsize == dt.itemsize
    cio.DiskArray.open(p).delete()


@pytest.mark.parametrize("label", ["float16", "big f8", "bytes", "raw", "record",
                                   "subarray field", "padded record"])
def test_hdf5_round_trip(tmp_path, label):
    h5py = pytest.importorskip("h5py")
    dt = np.dtype(DTYPES[label])
    m = model(dt)
    d = cio.DiskArray.create("h", SHAPE, dt, chunks=CHUNKS, backend="local")
    d[...] = m
    h5 = tmp_path / "x.h5"
    d.to_hdf5(h5, "x")
    d.delete()
    with h5py.File(h5, "r") as f:
        same(f["x"][...].astype(dt), m)
    e = cio.DiskArray.from_hdf5(h5, "x", backend="local")
    assert e.dtype == dt
    same(e[...], m)
    e.delete()


@pytest.mark.parametrize("label", ["unicode", "datetime s"])
def test_hdf5_refuses_types_it_has_not(tmp_path, label):
    pytest.importorskip("h5py")
    d = cio.DiskArray.create("h", SHAPE, DTYPES[label], backend="local")
    try:
        with pytest.raises(ArgumentError, match="HDF5 has no type") as e:
            d.to_hdf5(tmp_path / "x.h5", "x")
        assert "nothing was written" in str(e.value)
        assert not (tmp_path / "x.h5").exists()
    finally:
        d.delete()


BAD = [("object", "O", "Python objects"), ("string", np.dtypes.StringDType(), "variable"),
       ("object field", [("a", "O")], "object"), ("generic datetime", "M8", "unit"),
       ("empty bytes", "S0", "length"), ("long double", np.longdouble, "long double"),
       ("subarray", ("f8", (3,)), "shape"),
       ("overlapping", np.dtype({"names": ["a", "b"], "formats": ["u1", "u2"],
                                 "offsets": [0, 0], "itemsize": 2}), "overlapping"),
       ("titles", np.dtype([(("T", "a"), "u1")]), "field")]


@pytest.mark.parametrize("backend", ["local", "zarr"])
@pytest.mark.parametrize("label,dtype,word", BAD, ids=[b[0] for b in BAD])
def test_bad_dtypes_are_refused_clearly(tmp_path, backend, label, dtype, word):
    if label == "long double" and np.dtype(np.longdouble).itemsize == 8:
        pytest.skip("long double is float64 here")
    with pytest.raises(ArgumentError) as e:
        cio.DiskArray.create("bad", (3,), dtype, backend=backend, path=tmp_path / "b",
                             persistent=True)
    msg = str(e.value)
    assert word.lower() in msg.lower() and "fixed-size" in msg, msg
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("backend", ["local", "zarr"])
def test_writes_of_other_dtypes(tmp_path, backend):
    """Into records, bytes, text and times only what NumPy casts safely; Python values
    (tuples, str, dates) by NumPy's rule; nothing written on refusal."""
    rec = np.dtype([("x", "<f8"), ("y", "<i4")])
    d = cio.DiskArray.create("w", (4,), rec, backend=backend)
    d[0] = (1.5, 2)
    d[1:3] = [(2.5, 3), (3.5, 4)]
    assert d[...].tolist() == [(1.5, 2), (2.5, 3), (3.5, 4), (0.0, 0)]
    before = d[...]
    with pytest.raises(ArgumentError, match="cast"):
        d[...] = np.zeros(4, "f8")
    with pytest.raises(ArgumentError, match="nothing was written"):
        d[...] = np.zeros(4, [("x", "<f8"), ("y", "<f8")])    # f8 into i4: not safe
    same(d[...], before)
    d.delete()
    s = cio.DiskArray.create("s", (3,), "S4", backend=backend)
    s[...] = np.array([b"ab", b"cd", b"e"], "S2")                # S2 into S4: safe
    s[2] = "xyz"
    assert s[...].tolist() == [b"ab", b"cd", b"xyz"]
    with pytest.raises(ArgumentError, match="nothing was written"):
        s[...] = np.array([b"abcdef"] * 3, "S6")              # would cut
    with pytest.raises(ArgumentError):
        s[...] = np.arange(3)
    s.delete()
    t = cio.DiskArray.create("t", (2,), "M8[s]", backend=backend)
    t[0] = "2020-01-02T03:04:05"
    t[1] = np.datetime64("2021-01-01", "D")                   # D into s: safe
    assert t[0] == np.datetime64("2020-01-02T03:04:05") and str(t[1])[:10] == "2021-01-01"
    with pytest.raises(ArgumentError, match="cast"):
        t[...] = np.array(["2020-01-01T00:00:00.5"] * 2, "M8[ms]")   # ms into s: lossy
    with pytest.raises(ArgumentError, match="not of dtype"):
        t[0] = "not a date"
    t.delete()


def test_hostile_dtypes_in_metadata(tmp_path):
    """Structured dtypes in a metadata file are untrusted: bounded, no objects."""
    good = meta.Meta(name="a", shape=(2,), dtype=np.dtype("f8"), chunks=(2,), backend="local",
                     data="a.dra", persistent=True, uuid="u").to_doc()
    for bad, word in [([["a", "|O"]], "dtype"), ([["a", "<f8", [10 ** 9]]], "subarray"),
                      ([["a", "|S9999999"]], "bytes"), ("(3,)f8", "dtype"),
                      ([["a", "<f8"], ["a", "<f8"]], "twice"), ({"a": "f8"}, "dtype")]:
        doc = dict(good, dtype=bad)
        doc.pop("nbytes")
        with pytest.raises(MetadataError, match=word):
            meta.loads(json.dumps(doc), "'x.json'")


WRITE = """
import numpy as np, chemio_py as cio
c = cio.comm()
dt = np.dtype({dt!r})
d = cio.DiskArray.create("mpi", (13, 5), dt, chunks=(4, 5), path={path!r},
                         backend={backend!r})
m = np.zeros((13, 5), dt)
m["x"] = np.arange(65).reshape(13, 5) * 0.5
m["t"] = np.arange(65).reshape(13, 5).astype("M8[s]")
m["s"] = [[str(i * 5 + j).encode() for j in range(5)] for i in range(13)]
sec = cio.block_section(d.shape)
d.write_all(sec, m[sec])
got = d.read_all(())
assert got.tobytes() == m.tobytes() and got.dtype == dt
d.close()
print(f"rank{{c.rank}}:ok", flush=True)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["local", "mpiio", "zarr"])
def test_collective_round_trip_under_mpi(mpirun, tmp_path, backend):
    dt = [("x", ">f8"), ("t", "<M8[s]"), ("s", "S3")]
    path = _path(tmp_path, backend, "mpi")
    p = mpirun(3, WRITE.format(dt=dt, path=path, backend=backend))
    assert p.stdout.count(":ok") == 3, p.stdout
    d = cio.DiskArray.open(path)                         # reopened by one rank
    assert d.dtype == np.dtype(dt)
    assert d[12, 4]["x"] == 32.0 and d[12, 4]["s"] == b"64"
    assert d[...]["t"][3, 1] == np.datetime64(16, "s")
    d.delete()
