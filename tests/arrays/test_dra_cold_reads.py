"""Cold DiskArray reads on the local backend: how a section becomes system calls.

* Holes between the pieces of a read are filled through a scratch buffer when the device
  reads their pages anyway (few pages against the pages the data touches), so a section of
  narrow row pieces is a few large calls, not one call per row; wide holes stay unread.
* The tasks of a section know it (``Part.whole``): its short stretches of the file, but
  the last, are read without read-ahead, which would fetch the gaps between them too; a
  section that is one stretch keeps read-ahead.
"""
import pickle
import time

import numpy as np

import chemio_py as cio
from chemio_py.backends import grid
from test_layout import apply_runs


def _image(shape, chunks):
    """A file image of the grid format whose every 8-byte element holds its own offset."""
    lay = grid.Layout(shape, chunks, 8)
    return lay, np.arange(lay.nbytes // 8, dtype=np.int64).view(np.uint8)


def _want(lay, region):
    want = np.empty(grid.region_shape(region), np.int64)
    for p in lay.pieces(region):
        st = grid.c_strides(p.extent, 8)
        local = [a - i * c for a, i, c in zip(p.start, p.index, lay.chunks)]
        idx = np.indices(p.shape).reshape(len(p.shape), -1).T
        offs = p.offset + ((idx + local) * st).sum(axis=1)
        dst = tuple(slice(a - r.start, a - r.start + n)
                    for a, r, n in zip(p.start, region, p.shape))
        want[dst] = (offs // 8).reshape(p.shape)
    return want


def test_narrow_row_pieces_are_read_in_a_few_calls():
    # chunks of 200 x 4000 f8 (rows of 32000 bytes); a piece 750 wide: 6000 bytes of each
    # row, holes of 26000 bytes whose pages a read-ahead fetches anyway
    lay, image = _image((200, 8000), (200, 4000))
    region = (slice(0, 200), slice(4000, 4750))
    out = np.zeros(grid.region_shape(region), np.int64)
    runs = apply_runs(lay, region, out, image, grid.SIEVE_HOLE)
    np.testing.assert_array_equal(out, _want(lay, region))
    assert len(runs) == 1                       # was one call per row: 200
    for _, moffs, lens in runs:                 # every filled hole is one row's rest
        assert all(n == 26000 for m, n in zip(moffs, lens) if m < 0)
    assert len(lay.runs(region, out.strides)) == 200     # writes never fill holes


def test_holes_much_wider_than_the_data_stay_unread():
    # one column: 8 bytes of every 32000-byte row; filling would read 4000 times the data
    lay, image = _image((400, 4000), (400, 4000))
    region = (slice(0, 400), slice(5, 6))
    out = np.zeros((400, 1), np.int64)
    runs = apply_runs(lay, region, out, image, grid.SIEVE_HOLE)
    np.testing.assert_array_equal(out, _want(lay, region))
    assert len(runs) == 400 and all(m >= 0 for r in runs for m in r[1])


def test_filled_pages_stay_within_three_times_the_touched_pages():
    rng = np.random.default_rng(3)
    page = grid.PAGE
    for _ in range(30):
        cols = int(rng.integers(1, 4000))
        c0 = int(rng.integers(0, 4000 - cols + 1))
        lay, image = _image((600, 4000), (600, 4000))
        region = (slice(0, 600), slice(c0, c0 + cols))
        out = np.zeros(grid.region_shape(region), np.int64)
        runs = apply_runs(lay, region, out, image, grid.SIEVE_HOLE)
        np.testing.assert_array_equal(out, _want(lay, region))
        vecs = []                               # (file offset, memory offset, length)
        for off, moffs, lens in runs:
            for m, n in zip(moffs, lens):
                vecs.append((off, m, n))
                off += n
        for i, (pos, m, n) in enumerate(vecs):
            if m < 0:                           # a hole between two data vectors
                (a, _, left), (b, _, right) = vecs[i - 1], vecs[i + 1]
                assert a + left == pos and pos + n == b
                inner = max(0, b // page - -(-pos // page))
                touched = min((pos - 1) // page - a // page,
                              (b + right - 1) // page - b // page) + 1
                assert n <= 3 * min(left, right) or inner <= 3 * touched


def test_split_parts_are_plain_regions_and_the_section_has_its_stretches():
    """Parts are plain regions (the section travels beside them, ``PartRead.read_part``)."""
    lay = grid.Layout((8000, 8000), (500, 1000), 8)
    sec = (slice(0, 4000), slice(0, 4000))
    parts = lay.split(sec, 4 << 20)
    assert len(parts) == 32 and all(type(p) is tuple for p in parts)
    assert parts[0] == (slice(0, 500), slice(0, 1000))
    assert pickle.loads(pickle.dumps(parts[5])) == parts[5]
    firsts, ends = lay.extents(sec)             # a row of four chunks every 32 MB
    assert firsts.tolist() == [k * 32_000_000 for k in range(8)]
    assert (ends - firsts).tolist() == [16_000_000] * 8
    firsts, ends = lay.extents((slice(0, 8000), slice(0, 8000)))
    assert firsts.tolist() == [0] and ends.tolist() == [lay.nbytes]
    # pieces a few bytes apart (a read fills such holes) are one stretch
    lay = grid.Layout((100, 100), (10, 100), 8)
    assert len(lay.extents((slice(0, 100), slice(0, 99)))[0]) == 1


def test_a_cold_sieved_read_through_the_store_returns_the_data(tmp_path):
    # chunks of 1000 x 1000 f8: the piece of chunk (0, 1) is 187 of its 1000 columns
    shape, req = (1250, 2000), (1000, 1000)
    x = np.random.default_rng(9).standard_normal(shape)
    d = cio.DiskArray.create("n", shape, "f8", request_shape=req, path=tmp_path)
    try:
        d[...] = x
        d.flush()
        calls = [0]
        real = d.store._vector_io

        def counting(write, offset, views, total, fd=None):
            calls[0] += 1
            return real(write, offset, views, total, fd)
        d.store._vector_io = counting
        d.evict()
        sec = (slice(250, 1250), slice(187, 1187))
        np.testing.assert_array_equal(d.read(sec), x[sec])
        rows = sec[0].stop - sec[0].start
        assert calls[0] < rows // 10, calls[0]       # was more than one call per row
    finally:
        d.delete()


def _resident(path: str) -> np.ndarray:
    """Per page of ``path``: in the page cache (mincore)."""
    import mmap
    import os
    from chemio_py.backends import posix
    fd = os.open(path, os.O_RDONLY)
    try:
        n = os.fstat(fd).st_size
        mm = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ)
        try:
            return posix.mincore_pages(np.frombuffer(mm, np.uint8).ctypes.data, n).copy()
        finally:
            mm.close()
    finally:
        os.close(fd)


def _exact_fds(store) -> list:
    opened = []
    real = store._exact_fd

    def spy():
        fd = real()
        opened.append(fd)
        return fd
    store._exact_fd = spy
    return opened


def test_short_stretches_are_read_without_read_ahead(tmp_path):
    import pytest
    from chemio_py.backends import posix
    # 8 stretches of one 4 MiB chunk, 4 MiB apart (each a task of its own): read-ahead
    # would fetch the gaps too
    shape, chunks = (1024, 8192), (128, 4096)
    x = np.random.default_rng(11).standard_normal((1024, 4096))
    d = cio.DiskArray.create("r", shape, "f8", chunks=chunks, path=tmp_path)
    try:
        store = d.store
        ra = store._readahead_bytes(store._fd)
        if ra < (1 << 20) or not posix.mincore_ok():
            pytest.skip(f"read-ahead of {ra} bytes here: too small to tell")
        sec = (slice(0, 1024), slice(0, 4096))
        d[sec] = x
        d.flush()
        opened = _exact_fds(store)
        d.evict()
        np.testing.assert_array_equal(d.read(sec), x)
        time.sleep(0.2)                         # read-ahead still under way lands now
        pages = _resident(d.path)
        stretch = 4 << 20
        gaps = np.concatenate([pages[(2 * k + 1) * stretch // grid.PAGE:
                                     (2 * k + 2) * stretch // grid.PAGE] for k in range(7)])
        assert gaps.mean() < 0.05, gaps.mean()   # was about 1: every gap read
        assert opened and all(fd >= 0 for fd in opened)
    finally:
        d.delete()


def test_one_stretch_keeps_read_ahead(tmp_path):
    n = 1024                                    # 8 MiB, whole rows: one stretch
    x = np.random.default_rng(12).standard_normal((n, n))
    d = cio.DiskArray.create("o", (n, 2 * n), "f8", chunks=(128, 2 * n), path=tmp_path)
    try:
        d[:, :] = np.hstack((x, x))
        d.flush()
        opened = _exact_fds(d.store)
        d.evict()
        np.testing.assert_array_equal(d.read((slice(0, n), slice(0, 2 * n))), np.hstack((x, x)))
        assert opened == []
    finally:
        d.delete()


def test_long_stretches_are_read_as_streams(tmp_path, monkeypatch):
    # (LONG_STRETCH and the task sizes lowered so that a small array shows it) a cold
    # section of long stretches is read one stretch per task, at most LONG_STREAMS at once,
    # in file order; short stretches keep small tasks on every I/O thread; the data is
    # NumPy's either way
    from chemio_py.arrays import diskarray as da
    shape, chunks = (256, 512), (32, 128)      # chunks of 32 KiB, chunk rows of 128 KiB
    x = np.random.default_rng(13).standard_normal(shape)
    d = cio.DiskArray.create("l", shape, "f8", chunks=chunks, path=tmp_path)
    try:
        d[...] = x
        d.flush()
        plans = []
        real = d._taskrun

        def spy(store, write, tasks):
            run, streams = real(store, write, tasks)
            plans.append(([t[0] for t in tasks], streams))
            return run, streams
        monkeypatch.setattr(d, "_taskrun", spy)
        monkeypatch.setattr(da, "TASK_MIN", 32 << 10)
        monkeypatch.setattr(da, "TASK_MAX", 32 << 10)
        whole = (slice(0, 256), slice(0, 512))          # whole rows: one 1 MiB stretch
        column = (slice(0, 256), slice(0, 128))         # 32 KiB of each 128 KiB chunk row
        for long, sec, tasks, streams in ((256 << 10, whole, 0, None),
                                          (1 << 60, whole, 32, "all"),
                                          (64 << 10, column, 8, "all"),
                                          (32 << 10, column, 8, da.LONG_STREAMS)):
            monkeypatch.setattr(da, "LONG_STRETCH", long)
            d.evict()
            plans.clear()
            np.testing.assert_array_equal(d.read(sec), x[sec])
            if not tasks:
                assert plans == []                      # one task: run in this thread
                continue
            (regions, got), = plans
            assert len(regions) == tasks, (long, sec, len(regions))
            assert got == streams if streams != "all" else got > da.LONG_STREAMS
            starts = [r[0].start for r in regions]
            assert starts == sorted(starts)             # file order
    finally:
        d.delete()
