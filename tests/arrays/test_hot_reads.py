"""Hot DiskArray reads on the local backend: copies from a persistent read-only mapping
of the data file, guarded against SIGBUS, droppable (evict, a cap on mapped bytes)."""
import mmap
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.backends import posix
from conftest import REPO
from chemio_py.backends.local import mappings

pytestmark = pytest.mark.skipif(not posix.sigbus_guard_ok(), reason="needs Linux, 64-bit")


def _mapped(store) -> bool:
    return id(store) in mappings.live_maps


def _resident_pages(path: str) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        n = os.fstat(fd).st_size
        mm = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ)
        try:
            addr = np.frombuffer(mm, np.uint8).ctypes.data
            assert posix.mincore_ok()
            return int(posix.mincore_pages(addr, n).sum())
        finally:
            mm.close()
    finally:
        os.close(fd)


def _spy(store):
    used = {"mapped": 0}
    real = store._copy_mapped

    def spy(region, out):
        got = real(region, out)
        used["mapped"] += got is True
        return got
    store._copy_mapped = spy
    return used


@pytest.mark.parametrize("shape,chunks,dtype", [
    ((97, 131), (16, 40), "f8"), ((40, 33, 17), (7, 10, 5), "complex64"),
    ((1000,), (64,), "i2"), ((64, 64), (64, 64), "f4"), ((30, 1, 50), (4, 1, 7), "u1")])
def test_mapped_reads_agree_with_the_data(tmp_path, shape, chunks, dtype):
    rng = np.random.default_rng(7)
    model = (rng.standard_normal(shape) * 100).astype(dtype)
    d = cio.DiskArray.create("h", shape, dtype, chunks=chunks, path=tmp_path)
    d[...] = model
    used = _spy(d.store)
    for _ in range(40):
        a = [int(rng.integers(0, n)) for n in shape]
        b = [int(rng.integers(x + 1, n + 1)) for x, n in zip(a, shape)]
        sec = tuple(slice(x, y) for x, y in zip(a, b))
        np.testing.assert_array_equal(d[sec], model[sec])
        big = np.zeros(tuple(n + 2 for n in model[sec].shape), dtype)     # a strided out
        view = big[tuple(slice(1, 1 + n) for n in model[sec].shape)]
        d.read(sec, view)
        np.testing.assert_array_equal(view, model[sec])
        assert not big[0].any() and not big[-1].any()
        np.testing.assert_array_equal(d.read(sec, transpose=True), model[sec].T)
    assert used["mapped"] >= 40                        # the mapped path did the work
    d.delete()


def test_large_mapped_copies_split_across_threads_agree(tmp_path, monkeypatch):
    """A large hot read is copied in row parts by this thread and pool threads at once
    (here any read over 1 KiB, so small arrays take that path): same bytes, strided and
    transposed outputs included, and nothing outside the output touched."""
    from chemio_py.backends.local import backend
    monkeypatch.setattr(backend, "_SPLIT_COPY", 1024)
    from chemio_py.runtime import blas
    rng = np.random.default_rng(3)
    model = rng.standard_normal((203, 77))
    d = cio.DiskArray.create("s", model.shape, "f8", chunks=(16, 20), path=tmp_path)
    d[...] = model
    store = d.store
    sec0, out0 = (slice(5, 200), slice(3, 70)), np.empty((195, 67))
    # a node packed with ranks (one a core, as the launcher says): no extra copy threads
    monkeypatch.setenv("MPI_LOCALNRANKS", str(int(blas.cpu_set())))
    assert len(store._split_rows(sec0, out0)) == 1
    monkeypatch.setattr(backend, "cpu_share", lambda: 3.0)
    parts = store._split_rows(sec0, out0)
    assert len(parts) == 3 and parts[1][0][0].start % 16 == 0      # cut at chunk edges
    used = _spy(store)
    for sec in [(slice(5, 200), slice(3, 70)), (slice(0, 203), slice(0, 77)),
                (slice(17, 21), slice(0, 77)), (slice(100, 101), slice(9, 10))]:
        np.testing.assert_array_equal(d[sec], model[sec])
        big = np.zeros(tuple(n + 2 for n in model[sec].shape))
        view = big[1:-1, 1:-1]
        d.read(sec, view)
        np.testing.assert_array_equal(view, model[sec])
        assert not big[0].any() and not big[-1].any() and not big[:, 0].any()
        np.testing.assert_array_equal(d.read(sec, transpose=True), model[sec].T)
    assert used["mapped"] >= 12
    d.delete()


def test_evict_unmaps_and_drops_the_pages(tmp_path):
    d = cio.DiskArray.create("e", (512, 512), "f8", chunks=(64, 512), path=tmp_path)
    d[...] = 1.0
    d.flush()
    assert d[:].sum() == 512 * 512
    assert _mapped(d.store)
    assert _resident_pages(d.path) > 0
    d.store.evict()
    assert not _mapped(d.store)                       # unmapped, so fadvise could drop
    assert _resident_pages(d.path) == 0
    assert d[:].sum() == 512 * 512                     # and reads still work
    mappings.drop_mappings()
    assert not mappings.live_maps
    d.delete()


def test_mapped_bytes_stay_under_the_cap(tmp_path):
    a = cio.DiskArray.create("a", (256, 256), "f8", path=tmp_path)    # 512 KiB each
    b = cio.DiskArray.create("b", (256, 256), "f8", path=tmp_path)
    big = cio.DiskArray.create("c", (512, 512), "f8", path=tmp_path)  # 2 MiB
    for x, v in ((a, 1.0), (b, 2.0), (big, 3.0)):
        x[...] = v
    cio.configure(map_cap=600 * 1024)               # the setting (CHEMIO_MAP_CAP, TOML)
    mappings.drop_mappings()
    assert a[:].sum() == 256 * 256 and _mapped(a.store)
    assert b[:].sum() == 2 * 256 * 256 and _mapped(b.store)
    assert not _mapped(a.store)                       # least recently used went first
    assert sum(m.nbytes for m in mappings.live_maps.values()) <= mappings.map_cap() == 600 * 1024
    assert big[:].sum() == 3 * 512 * 512               # over the cap: read without a mapping
    assert not _mapped(big.store)
    for x in (a, b, big):
        x.delete()
    assert not mappings.live_maps                             # closing a store unmaps it


READER = """
import os, sys, time, numpy as np, chemio_py as cio
from chemio_py.backends import posix
d = cio.DiskArray.open(sys.argv[1], "r")
assert d[:, :].sum() > 0                            # cached and mapped
print("OPEN", flush=True)
n = errors = other = 0
msg = ""
t_end = time.time() + float(sys.argv[2])
while time.time() < t_end and (posix.sigbus_caught() < 3 or n + errors < 5):
    try:
        x = d[:, :]
        n += 1
        if not np.isin(x, (0.0, 1.0)).all():
            other += 1                              # neither the data nor a hole
    except cio.ChemIOError as e:
        errors += 1
        msg = str(e)
print("READS", n, errors, other, posix.sigbus_caught(), flush=True)
print(msg, flush=True)
d.close()
"""


def test_truncation_under_a_copying_reader_is_an_error_not_a_crash(tmp_path):
    """Another process shrinks the file while this one copies from its mapping: the
    guarded copy survives the SIGBUS, and the read says the file is short (or, when the
    file grew back first, returns its bytes)."""
    a = cio.DiskArray.create("t", (2048, 2048), "f8", chunks=(256, 2048), path=tmp_path,
                             persistent=True)
    a[...] = 1.0
    a.flush()
    path = a.path
    a.close()
    size = os.path.getsize(path)
    half = np.ones((size // 2) // 8)
    reader = subprocess.Popen([sys.executable, "-c", READER, path, "20"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "OPEN"
        fd = os.open(path, os.O_RDWR)
        try:
            while reader.poll() is None:
                os.ftruncate(fd, size // 2)
                os.pwrite(fd, half.tobytes(), size // 2)   # back in full, cached again
        finally:
            os.close(fd)
        out, err = reader.communicate(timeout=60)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.communicate()
    assert reader.returncode == 0, (reader.returncode, err[-2000:])   # -7 is SIGBUS
    _, n, errors, other, caught = out.split("\n")[0].split()
    assert int(caught) >= 1, out                       # the guard was really needed
    assert int(other) == 0, out
    assert int(n) + int(errors) > 0
    if int(errors):
        assert "truncated" in out or "shorter" in out, out
    cio.DiskArray.open(path, "r+").delete()


def test_a_sigbus_elsewhere_still_kills(tmp_path):
    """The guard takes only faults in its own mappings: a program's own bad memmap access
    dies of SIGBUS as before (after the guard was installed by a hot read)."""
    code = textwrap.dedent("""
        import os, sys, numpy as np, chemio_py as cio
        from chemio_py.backends import posix
        d = cio.DiskArray.create("k", (64, 64), "f8", path=sys.argv[1])
        d[...] = 1.0
        assert d[:].sum() == 4096 and posix.sigbus_guard_arm()
        p = os.path.join(sys.argv[1], "plain.bin")
        np.ones(4096).tofile(p)
        m = np.memmap(p, dtype="f8", mode="r")
        os.truncate(p, 0)
        print("ALIVE", float(m[100]), flush=True)
    """)
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == -signal.SIGBUS, (p.returncode, p.stdout, p.stderr[-2000:])
    assert "ALIVE" not in p.stdout
    for name in os.listdir(tmp_path):
        os.unlink(os.path.join(tmp_path, name))


@pytest.mark.parametrize("sec", [(slice(33, 590), slice(70, 650)),     # runs of chunk rows
                                 (slice(64, 128), slice(0, 700)),      # one whole chunk row
                                 (slice(5, 6), slice(3, 4))])          # one element
def test_a_cold_read_leaves_its_pages_mapped(tmp_path, sec):
    """A read through preadv hands its ranges to the page-table filler as it goes, so the
    next read of the section from the page cache copies without page faults (as a
    ``numpy.memmap``'s first read maps its pages), and nothing is left running after it."""
    import resource
    if not posix.page_tables.ok:
        pytest.skip("the kernel lacks MADV_POPULATE_READ (Linux 5.14+)")
    model = np.arange(600 * 700, dtype="f8").reshape(600, 700)
    d = cio.DiskArray.create("m", model.shape, "f8", chunks=(64, 128), path=tmp_path)
    d[...] = model
    d.flush()
    d.evict()
    np.testing.assert_array_equal(d[sec], model[sec])   # cold: preadv, page tables filled
    assert _mapped(d.store)
    out = np.empty(model[sec].shape)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    assert d.store.read_cached(sec, out)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0 < 20   # ~300 without
    np.testing.assert_array_equal(out, model[sec])
    d.evict()                                            # unmapped: the pages can go
    assert not _mapped(d.store)
    np.testing.assert_array_equal(d[sec], model[sec])
    d.delete()


def test_cold_reads_without_the_filler_are_unchanged(tmp_path, monkeypatch):
    """Where the kernel lacks the advice (``ok`` False), reads take the plain preadv path."""
    monkeypatch.setattr(posix.page_tables, "ok", False)
    model = np.arange(300 * 200, dtype="i4").reshape(300, 200)
    d = cio.DiskArray.create("n", model.shape, "i4", chunks=(32, 64), path=tmp_path)
    d[...] = model
    d.evict()
    np.testing.assert_array_equal(d[10:290, 7:199], model[10:290, 7:199])
    np.testing.assert_array_equal(d[10:290, 7:199], model[10:290, 7:199])
    d.delete()


def test_diskarray_evict_drops_pages_and_mapping(tmp_path):
    """``DiskArray.evict()`` is the public way to make the next read cold: it unmaps the
    store's read mapping and drops the file's pages (mincore says so)."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from common import resident_fraction
    d = cio.DiskArray.create("ev", (512, 512), "f8", path=tmp_path)
    d[...] = 1.0
    assert d[:].sum() == 512 * 512 and _mapped(d.store)   # hot: through the mapping
    d.evict()
    assert not _mapped(d.store)
    resident = resident_fraction(d.path)
    assert resident is not None and resident < 0.5, resident
    assert d[:].sum() == 512 * 512                           # and it reads back correctly
    d.delete()


# ---------------------------------------------------------------- planning of hot reads
# The plans a hot read makes (blocks of pieces, the pages they touch, the copy per block)
# against brute force: every element's byte offset from the format's definition.

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from chemio_py.backends import grid  # noqa: E402


def _model_offsets(shape, chunks, itemsize):
    offs = np.zeros(shape, dtype=np.int64)
    pos = 0
    for idx in np.ndindex(*[-(-n // c) for n, c in zip(shape, chunks)]):
        sl = tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(idx, chunks, shape))
        ext = tuple(s.stop - s.start for s in sl)
        offs[sl] = pos + np.arange(int(np.prod(ext)), dtype=np.int64).reshape(ext) * itemsize
        pos += int(np.prod(ext)) * itemsize
    return offs


@st.composite
def _grids(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 40)) for _ in range(ndim))
    chunks = tuple(draw(st.integers(1, n + 3)) for n in shape)
    lo = [draw(st.integers(0, n - 1)) for n in shape]
    hi = [draw(st.integers(a + 1, n)) for a, n in zip(lo, shape)]
    return shape, chunks, tuple(slice(a, b) for a, b in zip(lo, hi)), draw(st.sampled_from(
        [1, 2, 8]))


def _piece_spans(lay, region, offs, unit):
    """(first, end) in units of every piece of ``region``: brute force over its chunks."""
    out = []
    for p in lay.pieces(region):
        box = offs[tuple(slice(a, a + n) for a, n in zip(p.start, p.shape))]
        out.append((int(box.min()) // unit, -(-(int(box.max()) + lay.itemsize) // unit)))
    return sorted(out)


def _merge(spans, hole):
    out = []
    for a, b in spans:
        if out and a <= out[-1][1] + hole:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [tuple(x) for x in out]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_grids(), st.sampled_from([1, 64, 4096]), st.sampled_from([0, 3]))
def test_spans_of_blocks_match_brute_force(case, unit, hole):
    shape, chunks, region, isz = case
    lay = grid.Layout(shape, chunks, isz)
    offs = _model_offsets(shape, chunks, isz)
    want = _merge(_piece_spans(lay, region, offs, unit), hole)
    blocks = lay.blocks(region)
    for got in (lay.block_spans(blocks, unit, hole), lay.spans(region, unit, hole),
                lay.spans(region, unit, hole, limit=2)):        # batched: the same answer
        assert list(zip(got[0].tolist(), got[1].tolist())) == want
    # every piece is in exactly one block, at the block's place
    seen = set()
    for b in blocks:
        for j in np.ndindex(*b.counts):
            first = b.first + sum(x * t for x, t in zip(j, b.gstrides))
            at = tuple(w + x * c + s.start for w, x, c, s in zip(b.where, j, chunks, region))
            assert offs[at] == first
            assert at not in seen
            seen.add(at)
    assert seen == {p.start for p in lay.pieces(region)}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_grids(), st.sampled_from(["c", "strided", "fortran"]), st.booleans())
def test_copy_blocks_match_numpy(case, kind, write):
    shape, chunks, region, isz = case
    dtype = {1: np.uint8, 2: np.int16, 8: np.float64}[isz]
    lay = grid.Layout(shape, chunks, isz)
    offs = _model_offsets(shape, chunks, isz) // isz
    rng = np.random.default_rng(sum(shape) + isz)
    model = (rng.standard_normal(shape) * 100).astype(dtype)
    image = np.zeros(int(np.prod(shape)), dtype)
    image[offs.reshape(-1)] = model.reshape(-1)
    stored = image.view(np.uint8)
    want = model[region]
    if kind == "c":
        arr = np.zeros(want.shape, dtype)
    elif kind == "strided":
        big = np.zeros(tuple(n + 2 for n in want.shape), dtype)
        arr = big[tuple(slice(1, 1 + n) for n in want.shape)]
    else:
        arr = np.zeros(want.shape, dtype, order="F")
    if write:
        arr[...] = -want
        lay.copy_blocks(region, stored, np.dtype(dtype), arr, True)
        back = np.zeros(shape, dtype)
        back.reshape(-1)[...] = image[offs.reshape(-1)]
        expect = model.copy()
        expect[region] = -want
        np.testing.assert_array_equal(back, expect)
    else:
        lay.copy_blocks(region, stored, np.dtype(dtype), arr, False)
        np.testing.assert_array_equal(arr, want)


def test_residency_over_ranges_close_together(tmp_path):
    """``posix.resident`` with one mincore over ranges close together says the same as
    one call per range, whichever pages are cached."""
    assert posix.mincore_ok()
    page = mmap.PAGESIZE
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(b"\1" * 64 * page)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)      # no read-ahead
        mm = mmap.mmap(fd, 64 * page, mmap.MAP_SHARED, mmap.PROT_READ)
        addr = np.frombuffer(mm, np.uint8).ctypes.data
        ranges = [(0, 4), (6, 10), (12, 20), (30, 31)]
        pages = sum(b - a for a, b in ranges)
        assert posix.resident(addr, ranges, pages) is False
        for a, b in ranges:                         # bring exactly the ranges in
            os.pread(fd, (b - a) * page, a * page)
        vec = posix.mincore_pages(addr, 64 * page)
        if not all(vec[a:b].all() for a, b in ranges) or vec[21:30].any():
            pytest.skip("the kernel's read-ahead brought other pages in")
        assert posix.resident(addr, ranges, pages) is True        # gaps not cached: True
        assert posix.resident(addr, ranges + [(40, 41)], pages + 1) is False
        mm.close()
    finally:
        os.close(fd)


def test_a_small_hot_aread_is_copied_inline(tmp_path, monkeypatch):
    """An ``aread`` of at most ``HOT_INLINE`` bytes whose pages are all cached is copied
    in the calling thread and returns complete (a hand-off to an I/O thread cost more than
    the copy); a larger one, a strided ``out`` and a checksummed array keep the pool path;
    every one reads the same values and counts as a read."""
    from chemio_py.arrays import diskarray
    monkeypatch.setattr(diskarray, "HOT_INLINE", 64 * 1024)
    rng = np.random.default_rng(5)
    model = rng.standard_normal((300, 100))
    d = cio.DiskArray.create("h", model.shape, "f8", chunks=(10, 100), path=tmp_path)
    d[...] = model
    d.read((slice(0, 300), slice(0, 100)))              # every page cached and mapped
    used = _spy(d.store)
    reads = d.stats.reads
    r = d.aread((slice(10, 60), slice(0, 100)))         # 40 KB
    assert r.done() and used["mapped"] == 1
    np.testing.assert_array_equal(r.wait(), model[10:60])
    big = d.aread((slice(0, 200), slice(0, 100)))       # 160 KB: the pool
    np.testing.assert_array_equal(big.wait(), model[:200])
    t = d.aread((slice(0, 50), slice(0, 100)), transpose=True)   # copied back: the pool
    np.testing.assert_array_equal(t.wait(), model[:50].T)
    assert used["mapped"] >= 3 and d.stats.reads >= reads + 3
    d.delete()
    c = cio.DiskArray.create("c", model.shape, "f8", chunks=(10, 100), path=tmp_path,
                             checksum=True)
    c[...] = model
    c.read((slice(0, 300), slice(0, 100)))
    r = c.aread((slice(10, 60), slice(0, 100)))         # checked on the pool, as before
    np.testing.assert_array_equal(r.wait(), model[10:60])
    c.delete()
