"""The ``zarr`` backend: conformance, standard Zarr v3 output, many writers without loss.

zarr-python, dask (and xarray when installed) are the reference readers; the MPI cases run
under a real mpiexec. The negative control proves the loss test can see a loss: the same
unaligned two-writer race through plain zarr-python loses updates in this run.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import chemio_py as cio
import chemio_py.backends as backends
from chemio_py.errors import ArgumentError, BackendUnavailableError
from chemio_py.testing import ArrayStoreTests

zarr = pytest.importorskip("zarr")
da = pytest.importorskip("dask.array")


def _be():
    return backends.resolve("zarr")


def _open(path, mode="w+", shape=(37, 23), dtype="f8", chunks=(8, 10), **kw):
    return _be().open_array(str(path), mode, shape=shape, dtype=np.dtype(dtype),
                            chunks=chunks, **kw)


def _all(shape):
    return tuple(slice(0, n) for n in shape)


class TestZarrConformance(ArrayStoreTests):
    backend = "zarr"
    mpi_ranks = 2


def test_backend_attributes():
    be = _be()
    assert be.name == "zarr" and be.collective_open is True
    assert be.array_formats == ("zarr-v3",) and be.suffix == ".zarr"
    assert be.array_options == frozenset({"compressor", "inner_chunks", "lock"})
    assert isinstance(be, backends.SelfDescribing) and isinstance(be, backends.ArrayBackend)
    assert not isinstance(be, backends.ByteBackend)


def test_byte_files_on_zarr_name_the_backends_that_serve_them():
    for make in (lambda: cio.ExclusiveFile("x.eaf", "w+", backend="zarr"),
                 lambda: cio.SharedFile("x.sf", backend="zarr")):
        with pytest.raises(BackendUnavailableError) as e:
            make()
        assert "zarr" in str(e.value) and "'local'" in str(e.value)


CASES = [(None, False), ("zstd:5", False), ("blosc:lz4:5:shuffle", False),
         (None, (4, 5)), ("zstd", (2, 5)), ("blosc", (8, 5))]


@pytest.mark.parametrize("compressor,inner", CASES)
def test_standard_readers_see_what_numpy_sees(tmp_path, compressor, inner):
    """Random regions (edge objects included) against a NumPy model; zarr-python and dask
    read the same; objects holding only zeros are absent and read as zeros."""
    shape, chunks = (37, 23), (8, 10)
    p = tmp_path / "a.zarr"
    st = _open(p, shape=shape, chunks=chunks, compressor=compressor, inner_chunks=inner)
    model = np.zeros(shape)
    rng = np.random.default_rng(1)
    try:
        for _ in range(25):
            lo = [int(rng.integers(0, n)) for n in shape]
            hi = [int(rng.integers(a + 1, n + 1)) for a, n in zip(lo, shape)]
            region = tuple(slice(a, b) for a, b in zip(lo, hi))
            data = rng.random([b - a for a, b in zip(lo, hi)])
            st.write(region, data)
            model[region] = data
        st.write((slice(8, 16), slice(10, 20)), np.zeros((8, 10)))    # back to all zeros
        model[8:16, 10:20] = 0
        st.write((slice(32, 37), slice(20, 23)), np.arange(15.).reshape(5, 3))  # edge object
        model[32:37, 20:23] = np.arange(15.).reshape(5, 3)
        got = np.empty(shape)
        st.read(_all(shape), got)
        assert np.array_equal(got, model)
    finally:
        st.close()
    assert not (p / "c" / "1" / "1").exists()               # all-zero object: absent
    z = zarr.open_array(str(p), mode="r")
    assert z.shape == shape and np.array_equal(z[:], model)
    assert (z.shards if inner else z.chunks) == chunks
    assert np.array_equal(da.from_zarr(str(p)).compute(), model)


def test_xarray_reads_it(tmp_path):
    xr = pytest.importorskip("xarray")
    zarr.open_group(str(tmp_path / "g"), mode="w")          # xarray opens groups
    p = tmp_path / "g" / "x.zarr"
    st = _open(p, compressor="zstd")
    st.write(_all((37, 23)), np.arange(37 * 23.).reshape(37, 23))
    st.close()
    got = xr.open_zarr(str(tmp_path / "g"), consolidated=False)["x.zarr"]
    assert got.dims == ("dim_0", "dim_1")                   # default axis names
    assert np.array_equal(got.values, np.arange(37 * 23.).reshape(37, 23))


def test_default_sharding_and_options():
    from chemio_py.backends.zarr.backend import default_inner
    assert default_inner((64, 64), 8) is None                       # 32 KiB: one object
    inner = default_inner((1000, 500), 8)                           # 4 MB object
    assert inner and all(c % i == 0 for c, i in zip((1000, 500), inner))
    assert 128 << 10 <= np.prod(inner) * 8 <= 1 << 20
    inner = default_inner((4001, 1000), 8)                          # a prime axis
    assert inner[0] == 4001 and np.prod(inner) * 8 <= 1 << 20


def test_options_are_checked_and_change_nothing(tmp_path):
    for bad in ({"inner_chunks": (3, 5)}, {"inner_chunks": (0, 5)}, {"compressor": "lzma"},
                {"lock": "yes"}):
        with pytest.raises((ArgumentError, cio.ChemIOError, ValueError)):
            _open(tmp_path / "o.zarr", **bad)
        assert not (tmp_path / "o.zarr").exists()
    _open(tmp_path / "o.zarr", compressor="zstd", inner_chunks=(4, 5)).close()
    with pytest.raises(ArgumentError, match="compressor"):
        _open(tmp_path / "o.zarr", "r", compressor="blosc")
    _open(tmp_path / "o.zarr", "r", compressor="zstd:3", inner_chunks=(4, 5)).close()


def test_compressor_setting_and_file_rules(tmp_path):
    cio.configure(compressor="blosc:zstd:3:bitshuffle")
    with cio.DiskArray.create("cfg", (64, 64), "f8", chunks=(32, 32), backend="zarr",
                              path=tmp_path) as d:
        d[:, :] = 1.0
        codecs = zarr.open_array(d.path).metadata.codecs
        assert [c.to_dict()["name"] for c in codecs] == ["bytes", "blosc"]
        d.delete()
    with cio.DiskArray.create("cfg2", (64, 64), "f8", chunks=(32, 32), backend="zarr",
                              path=tmp_path, compressor="none") as d:
        assert [c.to_dict()["name"] for c in zarr.open_array(d.path).metadata.codecs] == \
            ["bytes"]
        d.delete()


def test_diskarray_on_zarr_end_to_end(tmp_path):
    model = np.random.default_rng(2).random((100, 60))
    with cio.DiskArray.create("keep", (100, 60), "f8", chunks=(16, 16), path=tmp_path,
                              backend="zarr", persistent=True, compressor="zstd") as d:
        d.write_all((), model)
        path = d.path
    assert path.endswith("keep.zarr") and os.path.isdir(path)
    assert not os.path.exists(path + ".json")                       # metadata inside
    assert zarr.open_array(path).attrs["chemio"]["name"] == "keep"
    e = cio.DiskArray.open(path, "r+")                              # found by recognition
    assert e.backend == "zarr" and np.array_equal(e[:, :], model)
    assert np.array_equal(e.to_dask().compute(), model)
    e.delete()
    assert not os.path.lexists(path)


def test_foreign_zarr_arrays_open(tmp_path):
    from zarr.codecs import GzipCodec
    p = str(tmp_path / "f.zarr")
    a = zarr.create_array(p, shape=(50, 31), shards=(20, 10), chunks=(5, 5), dtype=">i4",
                          compressors=GzipCodec(level=4), fill_value=7)
    m = np.arange(50 * 31, dtype="i4").reshape(50, 31)
    m[:20, :10] = 7
    a[:] = m
    with cio.DiskArray.open(p, "r", backend="zarr") as d:
        assert d.shape == (50, 31) and np.array_equal(d[:, :], m)


def test_negative_control_zarr_python_loses_updates(mpirun, tmp_path):
    """Two processes write the two halves of one chunk through plain zarr-python at the
    same moment: at least one trial loses an update (the race chemio's write_all avoids)."""
    p = mpirun(2, f"""
        import numpy as np, zarr
        from mpi4py import MPI
        c = MPI.COMM_WORLD
        lost = 0
        for trial in range(40):
            path = {str(tmp_path)!r} + f"/race{{trial}}.zarr"
            if c.rank == 0:
                zarr.create_array(path, shape=(64, 64), chunks=(64, 64), dtype="i8",
                                  fill_value=0, compressors=None)
            c.Barrier()
            z = zarr.open_array(path, mode="r+")
            c.Barrier()
            z[32 * c.rank:32 * (c.rank + 1), :] = c.rank + 1
            c.Barrier()
            if c.rank == 0:
                got = zarr.open_array(path, mode="r")[:]
                lost = int((got[:32] != 1).sum() + (got[32:] != 2).sum())
            lost = c.bcast(lost)
            if lost:
                break
        if c.rank == 0:
            print("LOST", lost, "trial", trial, flush=True)
    """, timeout=120)
    lost = int(p.stdout.split("LOST")[1].split()[0])
    assert lost > 0, p.stdout


_LOSS_BODY = """
import numpy as np, sys, chemio_py as cio
import chemio_py.backends as B
from chemio_py.backends.zarr import exchange as X
c = cio.comm()
be = B.resolve("zarr")
shape, chunks = (203, 61), (32, 20)
configs = [("none", False), ("zstd", (8, 5)), ("blosc", False), ("none", (16, 10))]
stores = [be.open_array(f"{tmp}/loss{k}-{c.size}.zarr", "w+", shape=shape, dtype="i8",
                        chunks=chunks, comm=c, compressor=comp, inner_chunks=inner)
          for k, (comp, inner) in enumerate(configs)]
full = np.empty(shape, "i8")
lost = 0
for rep in range(REPS):
    rng = np.random.default_rng(rep)
    st = stores[rep % len(stores)]
    X.ROUND_BYTES = 2000 if rep % 5 == 0 else 256 << 20      # many rounds and split objects
    ax = rep % 2
    cuts = np.sort(rng.choice(np.arange(1, shape[ax]), c.size - 1, replace=False))
    b = np.concatenate(([0], cuts, [shape[ax]]))
    reg = [slice(0, n) for n in shape]
    reg[ax] = slice(int(b[c.rank]), int(b[c.rank + 1]))
    reg = tuple(reg)
    st.write_all(reg, np.full([s.stop - s.start for s in reg], rep * 10 + c.rank + 1), c)
    st.read_all(tuple(slice(0, n) for n in shape), full, c)
    want = np.empty(shape, "i8")
    for r in range(c.size):
        rr = [slice(0, n) for n in shape]
        rr[ax] = slice(int(b[r]), int(b[r + 1]))
        want[tuple(rr)] = rep * 10 + r + 1
    lost += int((full != want).sum())
for st in stores:
    st.close()
lost = c.mpi.allreduce(lost) if c.mpi is not None else lost
if c.rank == 0:
    print("LOST", lost, flush=True)
"""


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_write_all_loses_nothing(mpirun, tmp_path, ranks):
    """Unaligned regions cutting storage objects and inner chunks, 50 repetitions in one
    launch, compressed/uncompressed, sharded/unsharded, tiny exchange rounds too."""
    body = f"tmp = {str(tmp_path)!r}\nREPS = 50\n" + _LOSS_BODY
    p = mpirun(ranks, body, timeout=150)
    assert "LOST 0" in p.stdout, p.stdout + p.stderr[-2000:]


def test_written_with_3_ranks_reopened_with_1_and_4(mpirun, tmp_path):
    path = str(tmp_path / "three.zarr")
    model = np.arange(90 * 70, dtype="f8").reshape(90, 70)
    np.save(tmp_path / "model.npy", model)
    mpirun(3, f"""
        import numpy as np, chemio_py as cio
        model = np.load({str(tmp_path / "model.npy")!r})
        c = cio.comm()
        d = cio.DiskArray.create("three", (90, 70), "f8", chunks=(25, 30), backend="zarr",
                                 path={path!r}, compressor="zstd", inner_chunks=(5, 10))
        lo, hi = [0, 31, 58, 90][c.rank], [0, 31, 58, 90][c.rank + 1]   # cuts objects
        d.write_all(np.s_[lo:hi, :], model[lo:hi])
        d.close()
        print("ok", flush=True)
    """)
    with cio.DiskArray.open(path, "r") as d:
        assert np.array_equal(d[:, :], model)
    mpirun(4, f"""
        import numpy as np, chemio_py as cio
        model = np.load({str(tmp_path / "model.npy")!r})
        c = cio.comm()
        with cio.DiskArray.open({path!r}, "r+") as d:
            sec = cio.block_section(d.shape, axis=1)
            assert np.array_equal(d.read_all(sec), model[sec])
            d.write_all(sec, model[sec] + 1)
        print("ok", flush=True)
    """)
    assert np.array_equal(zarr.open_array(path)[:], model + 1)


def test_independent_partial_writes_refused_unless_locked(mpirun, tmp_path):
    p = mpirun(2, """
        import numpy as np, chemio_py as cio
        from chemio_py.errors import ArgumentError
        c = cio.comm()
        with cio.DiskArray.create("ind", (64, 64), "i8", chunks=(32, 32), backend="zarr") as d:
            try:
                d[c.rank * 16:(c.rank + 1) * 16, :] = 1       # half an object row each
            except ArgumentError as e:
                assert "write_all" in str(e) and "lock=True" in str(e)
                print("refused", flush=True)
            assert not d.read_all(()).any()                     # nothing was written
            if c.rank == 0:             # whole objects (rows 0:32) and part of one (32:48)
                try:
                    d[0:48, :] = 3
                    raise SystemExit("a partial write was accepted")
                except ArgumentError:
                    pass
            assert not d.read_all(()).any()                     # not even the whole ones
            d[32 * c.rank:32 * (c.rank + 1), :] = 5             # whole objects: fine
            c.barrier()
            assert (d.read_all(()) == 5).all()
        # lock=True: both ranks rewrite single rows of one object, no barrier in between
        # (without the lock about half the rows are lost in this pattern)
        d = cio.DiskArray.create("lck", (128, 256), "i8", chunks=(128, 256), backend="zarr",
                                 lock=True, compressor="zstd")
        for k in range(64):
            d[2 * k + c.rank, :] = 2 * k + c.rank + 1
        c.barrier()
        got = d[:, :]
        assert (got == np.arange(1, 129)[:, None]).all(), "lost rows"
        d.close()
        print("ok", flush=True)
    """)
    assert p.stdout.count("refused") == 2


def test_reader_never_sees_a_torn_object(mpirun, tmp_path):
    """While 2 ranks rewrite the whole array (regions cutting every object) 40 times, a
    reader in this process reads every object: each holds one repetition's values only."""
    path = str(tmp_path / "torn.zarr")
    st = _open(path, shape=(64, 64), dtype="i8", chunks=(16, 64), compressor="zstd")
    st.close()
    script = tmp_path / "writer.py"
    script.write_text(f"""
import numpy as np, chemio_py as cio, chemio_py.backends as B
c = cio.comm()
st = B.resolve("zarr").open_array({path!r}, "r+", shape=(64, 64), dtype=np.dtype("i8"),
                                  chunks=(16, 64), comm=c)
for rep in range(1, 41):
    reg = (slice(0, 64), slice(0, 29)) if c.rank == 0 else (slice(0, 64), slice(29, 64))
    st.write_all(reg, np.full((64, reg[1].stop - reg[1].start), rep), c)
st.close()
""")
    from conftest import mpiexec_path
    proc = subprocess.Popen([mpiexec_path(), "-n", "2", sys.executable, "-m", "mpi4py",
                             str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=str(tmp_path))
    reader = _open(path, "r", shape=(64, 64), dtype="i8", chunks=(16, 64))
    seen, reads = set(), 0
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            for i in range(4):
                obj = np.empty((16, 64), "i8")
                reader.read((slice(16 * i, 16 * i + 16), slice(0, 64)), obj)
                assert len(np.unique(obj)) == 1, f"torn object {i}: {np.unique(obj)}"
                seen.add(int(obj[0, 0]))
                reads += 1
    finally:
        reader.close()
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert reads > 10 and len(seen) > 2
    assert (zarr.open_array(path)[:] == 40).all()


def test_dask_distributed_cluster_computes_it(tmp_path):
    distributed = pytest.importorskip("distributed")
    model = np.arange(200 * 30, dtype="f8").reshape(200, 30)
    with cio.DiskArray.create("dd", (200, 30), "f8", chunks=(40, 30), backend="zarr",
                              path=tmp_path, compressor="zstd") as d:
        d.write_all((), model)
        x = d.to_dask()
        with distributed.LocalCluster(processes=True, n_workers=2, threads_per_worker=1,
                                      dashboard_address=None) as cluster, \
                distributed.Client(cluster) as client:
            assert client.compute(x.sum()).result() == model.sum()
        d.delete()


def test_read_only_store_refuses_writes(tmp_path):
    _open(tmp_path / "ro.zarr").close()
    st = _open(tmp_path / "ro.zarr", "r")
    with pytest.raises(OSError):
        st.write((slice(0, 1), slice(0, 1)), np.ones((1, 1)))
    st.close()
    assert not (tmp_path / "ro.zarr" / "c").exists()


def test_threads_writing_one_object_lose_nothing(tmp_path):
    """Several threads of one process rewriting disjoint parts of the same objects."""
    st = _open(tmp_path / "t.zarr", shape=(64, 64), dtype="i8", chunks=(64, 64),
               compressor="zstd", inner_chunks=(16, 16))
    try:
        def work(k):
            for rep in range(20):
                st.write((slice(8 * k, 8 * k + 8), slice(0, 64)),
                         np.full((8, 64), rep * 10 + k + 1))
        threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        got = np.empty((64, 64), "i8")
        st.read(_all((64, 64)), got)
        assert (got.reshape(8, 8, 64) == (190 + np.arange(1, 9))[:, None, None]).all()
    finally:
        st.close()
