"""The ``mpiio`` backend (issue 13): the conformance suite, the MPICH facts it works around,
collective array I/O under a real ``mpiexec`` against NumPy and against ``local``'s files,
and the user API (ExclusiveFile, SharedFile, DiskArray) end to end on it."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("mpi4py")

import chemio_py.backends as backends  # noqa: E402
from chemio_py.runtime import config  # noqa: E402
from chemio_py.errors import OutOfSpaceError, StorageError  # noqa: E402
from chemio_py.testing import BackendTests  # noqa: E402

SHM = "/dev/shm"
GIB = 1 << 30
SILENT_LIMIT = 2_147_479_552            # what MPICH's Iwrite_at moves of a larger request


def _mpiio():
    from chemio_py.backends.mpiio import backend as mpiio
    return mpiio


class TestMpiioConformance(BackendTests):
    backend = "mpiio"
    mpi_ranks = 2


# ---------------------------------------------------------------- facts of the MPICH wheel

def _shm_room(nbytes: int) -> bool:
    try:
        st = os.statvfs(SHM)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize > nbytes + GIB


@pytest.mark.slow
def test_iwrite_iread_past_2gib_full_count_and_tail():
    """MPICH's Iwrite_at/Iread_at of 2 GiB + 8 KiB silently move 2,147,479,552 bytes; the
    store's native path (one request, pieces reissued until all moved) moves all of it."""
    n = 2 * GIB + 8192
    if not _shm_room(n):
        pytest.skip("not enough room in /dev/shm")
    mod = _mpiio()
    MPI = mod._mpi()
    path = os.path.join(SHM, f"chemio-test-mpiio-{os.getpid()}")
    data = np.empty(n, np.uint8)
    data[:] = 7
    data[-(1 << 20):] = np.arange(1 << 20, dtype=np.uint64).view(np.uint8)[:1 << 20]
    be = backends.resolve("mpiio")
    try:
        # the fact itself, with raw mpi4py: success, and only the status count tells
        st = be.open_bytes(path, "w+")
        s = MPI.Status()
        st._fh.Iwrite_at(0, [data, MPI.BYTE]).Wait(s)
        raw = s.Get_count(MPI.BYTE)
        assert raw in (SILENT_LIMIT, n)     # the wheel's MPICH: SILENT_LIMIT
        # the store, with one MPI request for the whole buffer (pieces larger than the
        # silent limit: the remainder must be reissued) and with its default pieces
        back = np.empty(n, np.uint8)            # one buffer: 2 GiB of page faults once
        head, w, tail = (slice(0, 1 << 20), slice(SILENT_LIMIT - 4096, SILENT_LIMIT + 4096),
                         slice(n - (1 << 21), n))
        for piece in (4 * GIB, mod.PIECE):
            old, mod.PIECE = mod.PIECE, piece
            try:
                st.truncate(0)
                req = st.native_write(0, memoryview(data), lambda c, t0, t1: c)
                assert req.wait(timeout=120) == n
                assert st.size() == n
                for checked in (head, w, tail):  # what is checked must come from this read
                    back[checked] = 0
                req = st.native_read(0, memoryview(back), lambda c, t0, t1: c)
                assert req.wait(timeout=120) == n
                assert np.array_equal(back[tail], data[tail])
                assert back[head].min() == 7 and np.array_equal(back[w], data[w])
            finally:
                mod.PIECE = old
        del back
        st.close()
        print(f"raw Iwrite_at of {n} bytes reported {raw}")
    finally:
        if os.path.lexists(path):
            os.unlink(path)


def test_counts_are_checked_at_end_of_file(tmp_path):
    """Reads count what MPI moved: short at the end of the file, 0 past it, on both paths."""
    st = backends.resolve("mpiio").open_bytes(str(tmp_path / "eof"), "w+")
    try:
        st.pwrite(0, b"a" * 1000)
        assert st.pread(990, bytearray(64)) == 10
        assert st.pread(5000, bytearray(64)) == 0
        got = st.native_read(995, memoryview(bytearray(64)), lambda c, t0, t1: c).wait(10)
        assert got == 5
        got = st.native_read(2000, memoryview(bytearray(64)), lambda c, t0, t1: c).wait(10)
        assert got == 0
        n = st.native_write(3000, memoryview(b"z" * 4096), lambda c, t0, t1: c).wait(10)
        assert n == 4096 and st.size() == 7096
    finally:
        st.close()


def test_files_are_0600_and_links_are_not_followed(tmp_path):
    """MPI's file_perm is ignored (0644); the backend creates 0600 itself, never through a
    link: x+ on a link fails, w+ replaces the link, r+ refuses it; the target is intact."""
    be = backends.resolve("mpiio")
    old = os.umask(0)
    try:
        for mode in ("w+", "x+"):
            p = tmp_path / f"f{mode[0]}"
            be.open_bytes(str(p), mode).close()
            assert os.stat(p).st_mode & 0o777 == 0o600
        a = be.open_array(str(tmp_path / "a.dra"), "w+", shape=(10, 10), dtype="f8",
                          chunks=(5, 10))
        a.close()
        assert os.stat(tmp_path / "a.dra").st_mode & 0o777 == 0o600
    finally:
        os.umask(old)
    target = tmp_path / "target"
    target.write_bytes(b"precious")
    link = tmp_path / "link"
    os.symlink(target, link)
    with pytest.raises(OSError):
        be.open_bytes(str(link), "x+")
    with pytest.raises(OSError):
        be.open_bytes(str(link), "r+")
    with pytest.raises(OSError):
        be.open_array(str(link), "r+", shape=(1,), dtype="u1", chunks=(1,))
    st = be.open_bytes(str(link), "w+")
    st.pwrite(0, b"new")
    st.close()
    assert not os.path.islink(link) and link.read_bytes() == b"new"
    assert target.read_bytes() == b"precious"


def test_reserve_is_fallocate_not_preallocate(tmp_path):
    """reserve allocates blocks and keeps size and data (File.Preallocate would grow the
    file to the reserved size and, in ROMIO, rewrite the existing range)."""
    st = backends.resolve("mpiio").open_bytes(str(tmp_path / "r"), "w+")
    try:
        st.pwrite(0, b"keep" * 1000)
        st.reserve(8 << 20)
        assert st.size() == 4000
        assert os.stat(tmp_path / "r").st_blocks * 512 >= 8 << 20
        back = bytearray(4000)
        assert st.pread(0, back) == 4000 and back == b"keep" * 1000
    finally:
        st.close()


def test_hints_reach_mpi(tmp_path):
    """Default hints (cb_write enabled, ds_write disabled) and the mpiio_hints setting are
    passed to MPI_File_open."""
    config.configure(mpiio_hints={"cb_buffer_size": "1048576"})
    st = backends.resolve("mpiio").open_bytes(str(tmp_path / "h"), "w+")
    try:
        info = st._fh.Get_info()
        got = {k: info.Get(k) for k in ("romio_cb_write", "romio_ds_write", "cb_buffer_size")}
        info.Free()
    finally:
        st.close()
    assert got == {"romio_cb_write": "enable", "romio_ds_write": "disable",
                   "cb_buffer_size": "1048576"}
    assert "ufs" in _mpiio().romio_drivers()


def test_mpi_errors_map_to_chemio_errors(tmp_path):
    """MPI error classes become StorageError with an errno (and OutOfSpaceError)."""
    import errno
    mod = _mpiio()
    MPI = mod._mpi()
    try:
        MPI.File.Open(MPI.COMM_SELF, str(tmp_path / "none"), MPI.MODE_RDONLY)
    except MPI.Exception as e:
        err = mod.mpi_error(e, str(tmp_path / "none"), None, None, "open")
    assert isinstance(err, StorageError) and err.errno == errno.ENOENT
    (tmp_path / "ro").write_bytes(b"x")
    fh = MPI.File.Open(MPI.COMM_SELF, str(tmp_path / "ro"), MPI.MODE_RDONLY)
    try:
        fh.Write_at(0, [b"y", MPI.BYTE])
    except MPI.Exception as e:
        err = mod.mpi_error(e, str(tmp_path / "ro"), 0, 1, "write")
    fh.Close()
    assert isinstance(err, StorageError) and err.errno in (errno.EROFS, errno.EACCES,
                                                            errno.EBADF)
    st = backends.resolve("mpiio").open_bytes(str(tmp_path / "ro"), "r")
    with pytest.raises(StorageError):
        st.pwrite(0, b"no")
    st.close()


def test_out_of_space_is_out_of_space_error(small_fs):
    """A full file system: the write and an array creation raise OutOfSpaceError (ROMIO
    reports ENOSPC as "Other I/O error"; its text names the errno)."""
    if small_fs is None:
        pytest.skip("cannot mount a small tmpfs here (not root)")
    be = backends.resolve("mpiio")
    st = be.open_bytes(os.path.join(small_fs, "full"), "w+")
    try:
        with pytest.raises(OutOfSpaceError) as ei:
            st.pwrite(0, np.ones(4 << 20, np.uint8))
        assert ei.value.filename.endswith("full")
        # ROMIO's Iwrite_at on a full file system never completes: not issued then
        assert st.native_write(0, memoryview(np.ones(4 << 20, np.uint8)),
                               lambda c, t0, t1: c) is None
    finally:
        st.close()
    with pytest.raises(OutOfSpaceError):
        be.open_array(os.path.join(small_fs, "big.dra"), "w+", shape=(1 << 20,), dtype="f8",
                      chunks=(1 << 16,))
    assert not os.path.exists(os.path.join(small_fs, "big.dra"))


def test_without_thread_multiple_async_uses_the_pool(tmp_path):
    """MPI initialised below THREAD_MULTIPLE: native_read declines (None), aread still works."""
    script = tmp_path / "lowthread.py"
    script.write_text(textwrap.dedent(f"""
        import mpi4py
        mpi4py.rc.thread_level = "serialized"
        from mpi4py import MPI
        import numpy as np, chemio_py as cio, chemio_py.backends as backends
        st = backends.resolve("mpiio").open_bytes({str(tmp_path / 'lt')!r}, "w+")
        assert st.native_read(0, memoryview(bytearray(8)), lambda c, t0, t1: c) is None
        st.close()
        with cio.ExclusiveFile("lt.eaf", "w+", backend="mpiio") as f:
            f.awrite(0, np.arange(1000.0)).wait()
            assert (f.aread(0, np.empty(1000)).wait() == np.arange(1000.0)).all()
            f.delete()
        print("ok")
    """))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=60, cwd=str(tmp_path))
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-3000:]


# ---------------------------------------------------------------- collective array I/O

_COMMON = """
import os, sys, json, resource
import numpy as np
import chemio_py as cio
import chemio_py.backends as backends
from chemio_py.errors import ChemIOError, CollectiveError
c = cio.comm()
be = backends.resolve("mpiio")
local = backends.resolve("local")
FULL = lambda shape: tuple(slice(0, n) for n in shape)

def model(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 1000
    if np.dtype(dtype).kind == "c":
        x = x + 1j * rng.standard_normal(shape)
    return x.astype(dtype)

def cuts(n, parts, rng):
    # random non-aligned cut points, some parts possibly empty
    pts = np.sort(rng.integers(0, n + 1, parts - 1))
    return [0] + pts.tolist() + [n]

def my_region(shape, rng, rank, size):
    # a random partition: axis 0 cut for every rank, one axis-1 cut shared by pairs
    rows = cuts(shape[0], size, rng)
    return (slice(rows[rank], rows[rank + 1]),) + FULL(shape[1:])

def strided(shape, dtype):
    # an out/data buffer that is a strided view (every other element of a bigger array)
    big = np.zeros(tuple(2 * n + 1 for n in shape), dtype)
    return big[tuple(slice(1, 1 + 2 * n, 2) for n in shape)]
"""


def test_collective_regions_dtypes_and_byte_equality_with_local(mpirun, tmp_path):
    """3 ranks: random non-aligned (and empty) regions, strided buffers, int/float/complex;
    compared with NumPy and byte for byte with the same array written by local; local's
    file opened by mpiio and mpiio's by local; independent writes and write_all
    interleaved are visible everywhere after flush + barrier; a failure on one rank
    raises on every rank."""
    mpirun(3, _COMMON + f"""
D = {str(tmp_path)!r}
shape, chunks = (53, 29, 6), (8, 7, 4)
for k, dtype in enumerate(["i4", "f8", "c16"]):
    want = model(shape, dtype, 100 + k)
    p = os.path.join(D, f"m{{k}}.dra")
    st = be.open_array(p, "w+", shape=shape, dtype=dtype, chunks=chunks, comm=c)
    rng = np.random.default_rng(k)
    for rnd in range(4):
        # random column band, rows split among ranks (rank 2 often empty)
        lo = int(rng.integers(0, shape[1])); hi = int(rng.integers(lo, shape[1] + 1))
        rows = cuts(shape[0], c.size, rng)
        if rnd == 1:
            rows = [0, shape[0], shape[0], shape[0]]          # ranks 1 and 2 empty
        reg = (slice(rows[c.rank], rows[c.rank + 1]), slice(lo, hi), slice(0, shape[2]))
        part = want[reg]
        buf = strided(part.shape, dtype) if rnd % 2 == 0 else np.array(part)
        buf[...] = part
        st.write_all(reg, buf, c)
    # the rest, independent writes by rank 0 (so the whole array is written)
    if c.rank == 0:
        st.write(FULL(shape), want)
    st.flush(); c.barrier()
    for rnd in range(3):
        rows = cuts(shape[0], c.size, rng)
        reg = (slice(rows[c.rank], rows[c.rank + 1]), slice(2, 27), slice(1, 5))
        out = strided(want[reg].shape, dtype)
        st.read_all(reg, out, c)
        assert np.array_equal(out, want[reg]), (k, rnd)
    st.close()
    # byte for byte against local
    if c.rank == 0:
        q = os.path.join(D, f"l{{k}}.dra")
        ls = local.open_array(q, "w+", shape=shape, dtype=dtype, chunks=chunks)
        ls.write(FULL(shape), want); ls.close()
        assert open(p, "rb").read() == open(q, "rb").read()
        # local's file through mpiio (serially) and mpiio's through local
        st = be.open_array(q, "r", shape=shape, dtype=dtype, chunks=chunks)
        out = np.empty(shape, dtype); st.read(FULL(shape), out); st.close()
        assert np.array_equal(out, want)
        ls = local.open_array(p, "r", shape=shape, dtype=dtype, chunks=chunks)
        out = np.empty(shape, dtype); ls.read(FULL(shape), out); ls.close()
        assert np.array_equal(out, want)
    c.barrier()

# independent write and write_all interleaved, visible to all after flush + barrier
p = os.path.join(D, "mix.dra")
st = be.open_array(p, "w+", shape=(30, 10), dtype="i8", chunks=(4, 10), comm=c)
r0 = slice(10 * c.rank, 10 * c.rank + 10)
for step in range(3):
    st.write((slice(10 * c.rank, 10 * c.rank + 5), slice(0, 10)),
             np.full((5, 10), 100 * step + c.rank))
    st.write_all((slice(10 * c.rank + 5, 10 * c.rank + 10), slice(0, 10)),
                 np.full((5, 10), 100 * step + 50 + c.rank), c)
    st.flush(); c.barrier()
    full = np.empty((30, 10), "i8")
    st.read_all(FULL((30, 10)) if c.rank == 1 else (slice(0, 0), slice(0, 0)),
                full if c.rank == 1 else np.empty((0, 0), "i8"), c)
    st.read(FULL((30, 10)), full)
    for r in range(c.size):
        assert (full[10 * r:10 * r + 5] == 100 * step + r).all()
        assert (full[10 * r + 5:10 * r + 10] == 100 * step + 50 + r).all()
    c.barrier()

# one rank fails (a buffer of the wrong shape): every rank raises, nobody hangs
for fn in ("write_all", "read_all"):
    try:
        bad = (3, 10) if c.rank == 1 else (5, 10)
        getattr(st, fn)((slice(5 * c.rank, 5 * c.rank + 5), slice(0, 10)),
                        np.zeros(bad, "i8"), c)
    except (ValueError, ChemIOError) as e:
        assert (c.rank == 1) == (not isinstance(e, CollectiveError)), repr(e)
    else:
        raise AssertionError("no error on rank %d" % c.rank)
# and the store still works afterwards
st.write_all((slice(10 * c.rank, 10 * c.rank + 10), slice(0, 10)), np.full((10, 10), -1), c)
st.close()
print("ok", flush=True)
""", timeout=120)


def test_written_by_3_ranks_reopened_by_1_2_4_and_by_local(mpirun, tmp_path):
    """An array written collectively by 3 ranks reads back the same with 1, 2 and 4 ranks
    and through local; one written by local reads back through mpiio on 4 ranks."""
    shape, chunks, dtype = (61, 35), (9, 8), "f8"
    head = _COMMON + f"""
D = {str(tmp_path)!r}
shape, chunks, dtype = {shape!r}, {chunks!r}, {dtype!r}
want = model(shape, dtype, 5)
from chemio_py.backends.grid import block_bounds
def colreg(size, rank):
    lo, hi = block_bounds(shape[1], size, rank)
    return (slice(0, shape[0]), slice(lo, hi))
"""
    mpirun(3, head + """
st = be.open_array(os.path.join(D, "w3.dra"), "w+", shape=shape, dtype=dtype, chunks=chunks, comm=c)
reg = colreg(c.size, c.rank)
st.write_all(reg, want[reg], c)
st.close()
if c.rank == 0:
    ls = local.open_array(os.path.join(D, "loc.dra"), "w+", shape=shape, dtype=dtype, chunks=chunks)
    ls.write(FULL(shape), want); ls.close()
print("ok", flush=True)
""")
    for n in (1, 2, 4):
        mpirun(n, head + """
for name in ("w3.dra", "loc.dra"):
    st = be.open_array(os.path.join(D, name), "r", shape=shape, dtype=dtype, chunks=chunks, comm=c)
    lo, hi = block_bounds(shape[0], c.size, c.rank)
    reg = ((slice(lo, hi), slice(0, shape[1])))
    out = np.empty((hi - lo, shape[1]), dtype)
    st.read_all(reg, out, c)
    assert np.array_equal(out, want[reg])
    st.close()
print("ok", flush=True)
""")
    want = np.random.default_rng(5).standard_normal(shape) * 1000
    ls = backends.resolve("local").open_array(str(tmp_path / "w3.dra"), "r", shape=shape,
                                              dtype=dtype, chunks=chunks)
    out = np.empty(shape)
    ls.read(tuple(slice(0, n) for n in shape), out)
    ls.close()
    assert np.array_equal(out, want)


def test_no_datatype_leak_in_10000_collective_calls(mpirun, tmp_path):
    """10,000 small collective calls: the resident memory does not grow (10,000 leaked
    region types, made on purpose at the end, do grow it: the measure can see a leak)."""
    mpirun(2, _COMMON + f"""
from chemio_py.backends.mpiio import types as mpi_types
from mpi4py import MPI
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGESIZE")
shape = (40, 30)
st = be.open_array(os.path.join({str(tmp_path)!r}, "leak.dra"), "w+", shape=shape, dtype="f8",
                   chunks=(7, 6), comm=c)
reg = (slice(3 + c.rank * 10, 12 + c.rank * 10), slice(4, 19))
buf = np.ones((9, 15))
def calls(n):
    for i in range(n):
        if i % 2:
            st.write_all(reg, buf, c)
        else:
            st.read_all(reg, buf, c)
calls(500)
before = rss()
calls(9500)
grew = rss() - before
leaked = []
before2 = rss()
for i in range(10000):
    t = mpi_types.region_types(MPI, st.layout, reg, buf.strides)
    leaked.append(t)
grew_leaking = rss() - before2
for t in leaked:
    t.free()
st.close()
assert grew < 1 << 20 and grew_leaking > 4 * max(grew, 1 << 18), (grew, grew_leaking)
print("ok", grew, grew_leaking, flush=True)
""", timeout=120)


@pytest.mark.slow
def test_collective_write_past_2gib_through_a_noncontiguous_view(mpirun):
    """One rank writes 2.16 GB of columns (a non-contiguous file view) in one write_all,
    another a small band; both read back through read_all (in /dev/shm)."""
    rows, cols, split = 18000, 16000, 15000
    if not _shm_room(rows * cols * 8 * 2):
        pytest.skip("not enough room in /dev/shm")
    path = os.path.join(SHM, f"chemio-test-mpiio-big-{os.getpid()}.dra")
    try:
        mpirun(2, _COMMON + f"""
rows, cols, split = {rows}, {cols}, {split}
st = be.open_array({path!r}, "w+", shape=(rows, cols), dtype="f8", chunks=(1000, cols),
                   comm=c, reserve=False)
lo, hi = (0, split) if c.rank == 0 else (split, cols)
reg = (slice(0, rows), slice(lo, hi))
data = np.empty((rows, hi - lo))
data[...] = np.arange(lo, hi, dtype="f8")[None, :]
data[:, -1] += np.arange(rows)
assert c.rank != 0 or data.nbytes > 2**31
st.write_all(reg, data, c)
data[...] = 0
st.read_all(reg, data, c)
assert (data[:, :-1] == np.arange(lo, hi - 1, dtype="f8")[None, :]).all()
assert (data[:, -1] == hi - 1 + np.arange(rows)).all()
st.close()
print("ok", flush=True)
""", timeout=300)
    finally:
        if os.path.lexists(path):
            os.unlink(path)


# ---------------------------------------------------------------- the user API end to end

def test_user_api_end_to_end_under_mpiexec(mpirun, tmp_path):
    """ExclusiveFile, SharedFile (with sync) and DiskArray create/open/read_all/write_all on
    mpiio with 3 ranks; overlapping write_all regions raise on every rank."""
    mpirun(3, f"""
import os, numpy as np, chemio_py as cio
from chemio_py.errors import ChemIOError
c = cio.comm()
with cio.ExclusiveFile("e2e.eaf", "w+", backend="mpiio") as f:
    reqs = [f.awrite(k * 8000, np.full(1000, float(k + c.rank))) for k in range(16)]
    cio.waitall(reqs)
    for k in range(16):
        assert (f.aread(k * 8000, np.empty(1000)).wait() == k + c.rank).all()
    f.delete()
with cio.SharedFile("e2e.sf", backend="mpiio") as sf:
    sf.write(c.rank * 4096, np.full(512, float(c.rank)))
    sf.sync()
    for r in range(c.size):
        assert (sf.read(r * 4096, np.empty(512)) == r).all()
    sf.destroy()
model = np.arange(50 * 70, dtype="f8").reshape(50, 70)
d = cio.DiskArray.create("e2e", (50, 70), "f8", chunks=(8, 16), path={str(tmp_path)!r},
                         persistent=True, backend="mpiio")
sec = cio.block_section(d.shape, chunks=d.chunks)
d.write_all(sec, model[sec])
assert np.array_equal(d.read_all(()), model)
try:
    d.write_all((slice(0, 20 + c.rank), slice(0, 70)), np.zeros((20 + c.rank, 70)))
except ChemIOError:
    pass
else:
    raise AssertionError("overlapping write_all regions did not raise")
path = d.path
d.close()
e = cio.DiskArray.open(path, "r", backend="mpiio")
assert np.array_equal(e.read_all(()), model)
e.close()
f = cio.DiskArray.open(path, "r", backend="local")
assert np.array_equal(f[:, :], model)
f.delete()
print("ok", flush=True)
""", timeout=120)


def test_dense_scattered_reads_are_sieved_sparse_ones_not(mpirun, tmp_path):
    """2 ranks: a region dense in the file whose rows land in memory in short blocks is
    read through ROMIO's sieving (few large reads), on the independent handle and as this
    rank's part of ``read_all``; a sparse region after it turns sieving off again; every
    read equals NumPy, strided buffers and empty ranks included."""
    mpirun(2, _COMMON + f"""
D = {str(tmp_path)!r}
shape, chunks = (64, 48), (8, 12)          # a chunk row: 4 chunks, contiguous in the file
want = model(shape, "f8", 7)
st = be.open_array(os.path.join(D, "s.dra"), "w+", shape=shape, dtype="f8", chunks=chunks,
                   comm=c)
if c.rank == 0:
    st.write(FULL(shape), want)
st.flush(); c.barrier()
dense = (slice(8 * c.rank, 8 * c.rank + 24), slice(0, 48))      # whole chunk rows
sparse = (slice(0, 64), slice(12 * c.rank, 12 * c.rank + 5))     # 5 of every 48 columns
for rnd, reg in enumerate([dense, sparse, dense, (slice(9, 9), slice(0, 48)), sparse]):
    out = strided(want[reg].shape, "f8") if rnd % 2 else np.zeros(want[reg].shape)
    st.read_all(reg, out, c)
    assert np.array_equal(out, want[reg]), ("read_all", rnd)
    if reg is dense:
        assert st._sieving, rnd                 # this rank's part read with sieving
    before = bool(st._sieving)
    out[...] = 0
    st.read(reg, out)
    assert np.array_equal(out, want[reg]), ("read", rnd)
    assert bool(st._sieving) == (reg is dense if out.size else before), rnd
# a user's own romio_ds_read is left alone
cio.configure(mpiio_hints="romio_ds_read=disable")
st2 = be.open_array(os.path.join(D, "s.dra"), "r", shape=shape, dtype="f8", chunks=chunks,
                    comm=c)
out = np.zeros(want[dense].shape)
st2.read_all(dense, out, c)
st2.read(dense, out)
assert np.array_equal(out, want[dense]) and not st2._sieving
st2.close(); st.close()
print("ok", flush=True)
""", timeout=120)
