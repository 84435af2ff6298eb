"""DiskArray <-> dask and HDF5 (h5py), checked against NumPy and h5py's own reading."""
import subprocess
import sys

import dask.array as da
import h5py
import numpy as np
import pytest

import chemio_py as cio
import chemio_py.backends as backends
from chemio_py.arrays import interop
from chemio_py.errors import ArgumentError


@pytest.fixture
def arr_store(store):
    if not hasattr(backends.resolve(store), "open_array"):
        pytest.skip(f"backend {store!r} has no open_array: it cannot hold DiskArrays")
    return store


def test_import_stays_light():
    code = ("import sys, chemio_py; "
            "print(sorted(m for m in ('mpi4py', 'dask', 'h5py', 'zarr') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_to_dask_chunks_follow_the_disk(arr_store):
    rng = np.random.default_rng(0)
    m = rng.standard_normal((70, 45))
    d = cio.DiskArray.create("dk", m.shape, "f8", chunks=(8, 9), backend=arr_store)
    d[...] = m
    x = d.to_dask()
    for dchunks, disk in zip(x.chunks, d.chunks):
        assert all(c % disk == 0 for c in dchunks[:-1])
    np.testing.assert_allclose(float(x.sum().compute()), m.sum(), rtol=1e-12)
    np.testing.assert_array_equal((x[10:30, 5:40] * 2).compute(), m[10:30, 5:40] * 2)
    y = d.to_dask(chunks=(16, 9))
    assert y.chunks[0][0] == 16 and y.chunks[1][0] == 9
    np.testing.assert_array_equal(y.compute(), m)
    assert interop.dask_chunks((8, 9), (70, 45), 8, target=8 * 9 * 8 * 3) == (8, 27)
    assert interop.dask_chunks((8, 9), (70, 45), 8, target=1 << 30) == (70, 45)
    d.close()


@pytest.mark.parametrize("chunks", [(10, 7), ((10, 5, 15), (7, 13))])
def test_from_dask_stores_every_block(arr_store, chunks):
    rng = np.random.default_rng(1)
    m = rng.integers(-1000, 1000, (30, 20)).astype(np.int32)
    x = da.from_array(m, chunks=chunks)
    d = cio.DiskArray.from_dask(x + 1, "fromdask", backend=arr_store)
    if chunks == (10, 7):
        assert d.chunks == (10, 7)                   # regular blocks are the disk chunks
    np.testing.assert_array_equal(d[...], m + 1)
    assert d.dtype == np.int32
    d.close()
    with pytest.raises(ArgumentError):
        cio.DiskArray.from_dask(da.from_array(np.array(["a", None], dtype=object), chunks=1),
                                "objs", backend=arr_store)


def test_hdf5_round_trip_with_progress(arr_store, tmp_path):
    rng = np.random.default_rng(2)
    m = (rng.standard_normal((50, 12, 3)) + 1j).astype(np.complex128)
    d = cio.DiskArray.create("h5rt", m.shape, m.dtype, chunks=(7, 12, 3), backend=arr_store)
    d[...] = m
    h5 = tmp_path / "pyscf_like.h5"
    with h5py.File(h5, "w") as f:                     # a PySCF-style file with other content
        f["mol"] = np.bytes_("H2O")
        f.create_group("scf")["e_tot"] = -76.0
    seen = []
    d.to_hdf5(h5, "mp2/t2", progress=lambda done, total: seen.append((done, total)),
              slab_bytes=7 * 12 * 3 * 16 * 2)
    assert seen[-1] == (m.nbytes, m.nbytes) and len(seen) == 4
    assert [a for a, _ in seen] == sorted(a for a, _ in seen)
    with h5py.File(h5, "r") as f:
        np.testing.assert_array_equal(f["mp2/t2"][...], m)
        assert f["scf/e_tot"][()] == -76.0
    with pytest.raises(ArgumentError, match="overwrite"):
        d.to_hdf5(h5, "mp2/t2")
    d.to_hdf5(h5, "mp2/t2", overwrite=True, progress=True)
    d.close()

    e = cio.DiskArray.from_hdf5(h5, "mp2/t2", backend=arr_store, slab_bytes=5000,
                                progress=lambda a, b: None)
    assert e.name == "mp2_t2" and e.shape == m.shape and e.dtype == m.dtype
    np.testing.assert_array_equal(e[...], m)
    e.close()
    with pytest.raises(ArgumentError, match="no dataset"):
        cio.DiskArray.from_hdf5(h5, "nope", backend=arr_store)
    with pytest.raises(ArgumentError, match="scalar"):     # S3 is a dtype DiskArray holds
        cio.DiskArray.from_hdf5(h5, "mol", backend=arr_store)


def test_from_hdf5_big_endian_and_persistent(arr_store, tmp_path):
    h5 = tmp_path / "be.h5"
    m = np.arange(600, dtype=">f8").reshape(20, 30)
    with h5py.File(h5, "w") as f:
        f.create_dataset("eri", data=m, chunks=(4, 30))
    out = tmp_path / "eri.dra"
    e = cio.DiskArray.from_hdf5(h5, "eri", "eri", path=out, request_shape=(5, None),
                                backend=arr_store)
    assert e.dtype == np.dtype(">f8") and e.chunks[1] == 30      # byte order kept
    e.close()
    f = cio.DiskArray.open(out)
    np.testing.assert_array_equal(f[...], m.astype("f8"))
    f.delete()


# ---------------------------------------------------------------- xarray

@pytest.mark.parametrize("backend", ["local", "zarr"])
def test_to_xarray_is_lazy_and_labelled(tmp_path, backend):
    xr = pytest.importorskip("xarray")
    model = np.arange(30 * 20, dtype="f8").reshape(30, 20)
    d = cio.DiskArray.create("lab", (30, 20), "f8", chunks=(10, 10), backend=backend,
                             path=tmp_path)
    d[...] = model
    before = d.stats.reads
    x = d.to_xarray(dims=("occ", "vir"), coords={"occ": np.arange(30) * 0.5},
                    attrs={"units": "hartree"})
    assert isinstance(x, xr.DataArray) and x.dims == ("occ", "vir") and x.name == "lab"
    assert x.attrs["units"] == "hartree" and x.attrs["chemio_backend"] == backend
    assert d.stats.reads == before                       # nothing read yet
    assert float(x.sel(occ=slice(1.0, 2.0)).sum()) == model[2:5].sum()
    np.testing.assert_array_equal(x.values, model)
    assert d.to_xarray().dims == ("dim_0", "dim_1")
    with pytest.raises(ArgumentError, match="must name each of the 2 axes"):
        d.to_xarray(dims=("only",))
    d.delete()


def test_to_dask_of_an_empty_array_with_a_huge_axis():
    """Issue 27: shape (0, 10**18) gave an empty MemoryError (a graph of 10**11 blocks)."""
    d = cio.DiskArray.create("empty_huge", (0, 10**18), "u1")
    try:
        x = d.to_dask()
        assert x.shape == (0, 10**18) and x.npartitions == 1
        assert int(x.sum().compute()) == 0
    finally:
        d.close()


TO_DASK_BOMB = """
import json, os, sys
import chemio_py as cio
path = sys.argv[1]

def hwm():
    return int(next(ln for ln in open("/proc/self/status")
                    if ln.startswith("VmHWM:")).split()[1]) / 1024

with cio.DiskArray.open(path) as d:
    d.to_dask()[:1, :1]                       # the default chunks: the whole array
    x = d.to_dask(chunks=(32, 256))           # a task per storage object
    x[:1, :1].compute()                       # imports and warm-up; the bomb is not read
    import numpy as np, dask
    base = hwm()
    try:
        x.compute(scheduler="threads")
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    print(json.dumps({"error": error, "growth_mib": hwm() - base}))
"""


def _zstd_rle_frame(blocks):
    """A zstd frame without content size of ``blocks`` RLE blocks of 128 KiB of zeros."""
    out = bytearray(b"\x28\xb5\x2f\xfd\x00\x38")
    for i in range(blocks):
        out += (int(i == blocks - 1) | (1 << 1) | ((1 << 17) << 3)).to_bytes(3, "little")
        out += b"\0"
    return bytes(out)


def test_to_dask_of_a_zarr_array_decodes_with_chemio_bounds(tmp_path):
    """``to_dask()`` of a zarr-backed array reads through chemio's bounded decoders, as
    ``d[...]`` does: a decompression bomb in one storage object (a 32 KB zstd frame of
    512 MiB for a 64 KiB chunk) is chemio's ``MetadataError`` naming the object, and
    memory stays flat (zarr-python's own decoder inflates the frame whole)."""
    import os
    import json
    pytest.importorskip("zarr")
    path = str(tmp_path / "bomb.zarr")
    d = cio.DiskArray.create("bomb", (64, 256), "f8", chunks=(32, 256), backend="zarr",
                             path=str(tmp_path), compressor="zstd", inner_chunks=False)
    d.write_all((), np.ones((64, 256)))
    d.close()
    obj = os.path.join(path, "c", "1", "0")
    with open(obj, "wb") as f:
        f.write(_zstd_rle_frame(4096))
    r = subprocess.run([sys.executable, "-c", TO_DASK_BOMB, path], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["error"] is not None and out["error"].startswith("MetadataError"), out
    assert obj in out["error"], out
    assert out["growth_mib"] < 64, out


def test_to_dask_of_a_zarr_array_reads_it_and_pickles_by_path(tmp_path):
    import pickle
    pytest.importorskip("zarr")
    model = np.arange(40 * 30, dtype="f8").reshape(40, 30)
    with cio.DiskArray.create("z", (40, 30), "f8", chunks=(10, 30), backend="zarr",
                              path=str(tmp_path), compressor="zstd") as d:
        d.write_all((), model)
        x = d.to_dask(chunks=(20, 30))
        assert x.chunks == ((20, 20), (30,))
        assert (x.compute() == model).all()
        assert float(x[5:25].sum().compute()) == model[5:25].sum()
        # a worker that only sees the path reopens the array with chemio, read-only
        y = pickle.loads(pickle.dumps(x))
        assert (y.compute() == model).all()
        d.delete()


def test_hdf5_copies_take_open_h5py_and_h5tmpfile_objects(tmp_path):
    """``from_hdf5``/``to_hdf5`` take what PySCF holds: open h5py Files, Groups and
    Datasets, and chemio H5TmpFile objects (left open), as well as paths."""
    import h5py
    x = np.arange(48.0).reshape(8, 6)
    p = tmp_path / "open.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("g/x", data=x)
        a = cio.DiskArray.from_hdf5(f, "g/x", "from.file")          # an open File
        b = cio.DiskArray.from_hdf5(f["g"], "x", "from.group")      # an open Group
        c = cio.DiskArray.from_hdf5(f["g/x"], name="from.dataset")  # an open Dataset
        for d in (a, b, c):
            assert np.array_equal(d[...], x)
        a.to_hdf5(f, "copy")                                         # into the open File
        assert np.array_equal(f["copy"][...], x) and f.id.valid     # left open
        with pytest.raises(ArgumentError, match="already a dataset|leave dataset"):
            cio.DiskArray.from_hdf5(f["g/x"], "x")
    with h5py.File(p, "r") as f:
        with pytest.raises(ArgumentError, match="read-only"):
            a.to_hdf5(f, "again")
    with cio.H5TmpFile() as t:
        a.to_hdf5(t, "in/tmp")                                       # into an H5TmpFile
        assert np.array_equal(t["in/tmp"][...], x)
        e = cio.DiskArray.from_hdf5(t, "in/tmp", "from.tmp")         # and back
        assert np.array_equal(e[...], x)
        e.close()
    for d in (a, b, c):
        d.close()
    with pytest.raises(ArgumentError, match="H5TmpFile"):
        cio.DiskArray.from_hdf5(object(), "x")
