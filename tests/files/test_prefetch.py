"""Read-ahead and write-behind pipelines against a NumPy model, on every backend.

Failure paths are driven by real OS errors: a read past the end of a truncated file
(``EndOfFileError``) and ``os.preadv``/``os.pwritev`` in the local backend module returning
EIO for one offset (on the backends whose bytes go through that module). After every early
exit the test counts threads, requests and fds.
"""
from __future__ import annotations

import errno
import json
import os
import threading
import time

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.runtime import pool, stats, trace
from chemio_py.errors import EndOfFileError, StorageError
from chemio_py.prefetch import Pipeline, WriteBehind, iter_blocks

from conftest import process_threads, store_backends

N = 6000                       # float64 elements in the test file

# EIO is injected into ``os`` as the local backend module sees it, so those tests run on the
# backends whose bytes go through that module: ``local``, and ``auto`` with its file outside
# the shm directory (on disk from the start). ``shm`` copies through a mapping: no
# preadv/pwritev there could fail.
EIO_BACKENDS = [b for b in ("local", "auto") if b in store_backends()]


# ---------------------------------------------------------------- helpers

def _model(seed: int = 0, n: int = N) -> np.ndarray:
    return np.random.default_rng(seed).random(n)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _other_threads() -> set[int]:
    """Threads that are not the process's own (``conftest.process_threads``)."""
    return process_threads()


def _pool_idle() -> bool:
    """No task waits in the I/O pool's queue."""
    return pool.queued() == 0


def _assert_quiet(f, threads_before: set[int], *pipes) -> None:
    """Nothing in flight anywhere: pipeline rings, the file's requests, the pool queue."""
    for p in pipes:
        assert p.in_flight == 0
    assert f.outstanding == 0
    assert _pool_idle()
    assert _other_threads() == threads_before
    pool_threads = [t for t in threading.enumerate() if t.name.startswith("chemio-io_")]
    assert len(pool_threads) <= cio.settings()["io_threads"].value


class _EIO:
    """Stands in for ``os`` inside the local backend: the call at one offset (or the first
    call at or past ``from_offset``) fails with a real EIO."""

    def __init__(self, bad_offset: int | None, op: str, from_offset: int | None = None):
        self.bad, self.op, self.start, self.hits = bad_offset, op, from_offset, 0
        self._lock = threading.Lock()

    def _maybe_fail(self, offset, count=True):
        with self._lock:
            fail = offset == self.bad or (self.start is not None and offset >= self.start
                                          and not self.hits)
        if fail:
            if count:
                self.hits += 1
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    def __getattr__(self, name):
        fn = getattr(os, name)
        if name in ("preadv", "pread") and self.op == "read" or \
                name in ("pwritev", "pwrite") and self.op == "write":
            def positioned(fd, data, offset, *a):
                # a bad block fails RWF_NOWAIT probes (called with flags) too; the
                # probe's failure is not counted: the regular read that follows is
                self._maybe_fail(offset, count=not a)
                return fn(fd, data, offset, *a)
            return positioned
        return fn


@pytest.fixture(params=EIO_BACKENDS)
def disk_store(request, tmp_path) -> dict:
    """Where a file whose I/O runs through the local backend's ``os`` goes:
    ``backend=`` and, for ``auto``, ``dir=`` on disk (the job's scratch would be RAM)."""
    return {"backend": request.param, **({"dir": str(tmp_path)} if request.param == "auto" else {})}


def _inject_eio(monkeypatch, offset: int | None, op: str,
                from_offset: int | None = None) -> _EIO:
    from chemio_py.backends.local import backend as local
    fake = _EIO(offset, op, from_offset)
    monkeypatch.setattr(local, "os", fake)
    return fake


@pytest.fixture
def sync_mode():
    cio.configure(sync=True)
    try:
        yield
    finally:
        cio.configure(sync=None)


def _reader(f, bs: int, n: int = N):
    return lambda k, buf: f.aread(8 * k, buf[:min(bs, n - k)])


# ---------------------------------------------------------------- data

@pytest.mark.parametrize("depth", [0, 1, 2, 8])
@pytest.mark.parametrize("bs", [500, 777])        # divides N, does not
def test_prefetch_yields_model_data(store, depth, bs):
    model = _model(depth)
    with cio.ExclusiveFile("pf", "w+", backend=store) as f:
        f.write(0, model)
        pipe = cio.prefetch(_reader(f, bs), range(0, N, bs), lambda: np.empty(bs), depth=depth)
        seen_keys, got, bases = [], [], set()
        for k, block in pipe:
            want = model[k:k + bs]
            assert block.shape == want.shape and np.array_equal(block, want)
            assert pipe.in_flight <= depth
            ring = pipe.buffers()
            assert len(ring) <= depth + 1
            assert sum(np.shares_memory(block, b) for b in ring) == 1    # a ring buffer
            bases.add(block.__array_interface__["data"][0])
            time.sleep(0.0005)            # let the reads in flight land ...
            assert np.array_equal(block, want)   # ... never into the buffer being used
            seen_keys.append(k)
            got.append(block.copy())
        assert seen_keys == list(range(0, N, bs))
        assert np.array_equal(np.concatenate(got), model)
        assert len(bases) == min(depth + 1, len(seen_keys))      # buffers reused
        assert pipe.closed and pipe.in_flight == 0


def test_prefetch_sync_env_forces_depth_zero(store, sync_mode):
    model = _model(3)
    with cio.ExclusiveFile("pfsync", "w+", backend=store) as f:
        f.write(0, model)
        pipe = cio.prefetch(_reader(f, 1000), range(0, N, 1000), lambda: np.empty(1000), depth=8)
        assert pipe.depth == 0
        got = np.concatenate([b.copy() for _, b in pipe])
        assert np.array_equal(got, model)
        assert len(pipe.stats.spans) and pipe.stats.efficiency < 0.05


def test_prefetch_blocking_reader_on_pool():
    """An integral-batch style producer: a blocking function run on the I/O pool."""
    def compute(key, buf):
        np.sin(np.arange(key, key + len(buf), dtype=np.float64), out=buf)

    keys = range(0, 4000, 400)
    pipe = cio.prefetch(compute, keys, lambda: np.empty(400), depth=3, blocking=True)
    for k, buf in pipe:
        assert np.array_equal(buf, np.sin(np.arange(k, k + 400, dtype=np.float64)))
    assert pipe.stats.ops == len(keys) and pipe.stats.bytes == len(keys) * 400 * 8


def test_prefetch_empty_and_bad_arguments():
    pipe = cio.prefetch(lambda k, b: None, [], lambda: np.empty(1))
    assert list(pipe) == [] and pipe.buffers() == []
    with pytest.raises(ValueError, match="depth"):
        cio.prefetch(lambda k, b: None, [1], lambda: np.empty(1), depth=-1)
    with pytest.raises(ValueError, match="depth"):
        cio.prefetch(lambda k, b: None, [1], lambda: np.empty(1), depth=2.5)
    with pytest.raises(ValueError, match="callable"):
        cio.prefetch(None, [1], lambda: np.empty(1))


# ---------------------------------------------------------------- leaving early

@pytest.mark.parametrize("how", ["break", "break-unnamed", "exception", "close", "with"])
def test_leaving_early_leaves_nothing(warm_store, how):
    store = warm_store
    bs = 1 << 17                                   # 1 MiB blocks of float64
    n = 24 * bs
    model = _model(7, n)
    threads = _other_threads()
    fds = _fds()
    f = cio.ExclusiveFile("early", "w+", backend=store)
    f.write(0, model)
    pipe = None

    def make():
        return cio.prefetch(_reader(f, bs, n), range(0, n, bs), lambda: np.empty(bs), depth=8)

    if how == "break":
        pipe = make()
        for i, (k, b) in enumerate(pipe):
            assert np.array_equal(b, model[k:k + bs])
            if i == 2:
                break
        pipe.close()        # what leaving the function would do; the ring is already busy
    elif how == "break-unnamed":
        for i, (_k, _b) in enumerate(make()):    # dropped when the loop ends: finalised
            if i == 2:
                break
    elif how == "exception":
        with pytest.raises(KeyError):
            for i, (_k, _b) in enumerate(make()):
                if i == 3:
                    raise KeyError("consumer failed")
    elif how == "close":
        pipe = make()
        next(pipe)
        assert pipe.in_flight == 8
        pipe.close()
        assert list(pipe) == []
    else:
        with make() as pipe:
            next(pipe)
    _assert_quiet(f, threads, *([pipe] if pipe is not None else []))
    f.close()
    f.delete()
    assert _fds() == fds


def test_eof_error_in_the_middle_surfaces_at_that_step(store):
    bs = 1000
    model = _model(11)
    threads = _other_threads()
    with cio.ExclusiveFile("eof", "w+", backend=store) as f:
        f.write(0, model)
        f.truncate(8 * 3500)                       # blocks 0-2 whole, 3 cut, 4-5 gone
        pipe = cio.prefetch(_reader(f, bs), range(0, N, bs), lambda: np.empty(bs), depth=4)
        got = []
        with pytest.raises(EndOfFileError) as ei:
            for k, b in pipe:
                got.append(k)
                assert np.array_equal(b, model[k:k + bs])
        assert got == [0, 1000, 2000]
        assert ei.value.offset == 8 * 3000 and ei.value.size == 8 * 3500
        assert pipe.closed and list(pipe) == []
        _assert_quiet(f, threads, pipe)


def test_eio_in_the_middle_surfaces_as_storage_error(disk_store, monkeypatch):
    bs = 1000
    model = _model(12)
    threads = _other_threads()
    with cio.ExclusiveFile("eio", "w+", **disk_store) as f:
        f.write(0, model)
        fake = _inject_eio(monkeypatch, 8 * 2000, "read")
        pipe = cio.prefetch(_reader(f, bs), range(0, N, bs), lambda: np.empty(bs), depth=3)
        got = []
        with pytest.raises(StorageError) as ei:
            for k, _b in pipe:
                got.append(k)
        assert got == [0, 1000] and fake.hits == 1
        assert ei.value.errno == errno.EIO and ei.value.offset == 8 * 2000
        _assert_quiet(f, threads, pipe)


# ---------------------------------------------------------------- write-behind

@pytest.mark.parametrize("depth", [0, 1, 2, 8])
def test_write_behind_writes_everything(store, depth):
    bs = 700
    model = _model(20 + depth)
    with cio.ExclusiveFile("wb", "w+", backend=store) as f:
        blocks = [model[k:k + bs].copy() for k in range(0, N, bs)]
        with WriteBehind(depth=depth) as wb:
            for i, blk in enumerate(blocks):
                req = wb.submit(f.awrite, 8 * i * bs, blk)
                assert isinstance(req, cio.Request)
                assert wb.in_flight <= max(depth, 0)
                if depth == 0:
                    assert req.done()
        assert wb.in_flight == 0 and f.outstanding == 0
        assert np.array_equal(f.read(0, np.empty(N)), model)
        st = wb.stats
        assert st.ops == len(blocks) and st.bytes == model.nbytes
        assert 0 < st.io_seconds and st.wait_seconds <= st.io_seconds
        if depth == 0:
            assert st.wait_seconds > 0          # each submit waited for its own write
        with pytest.raises(cio.ChemIOError, match="closed"):
            wb.submit(f.awrite, 0, blocks[0])


def test_write_behind_eio_surfaces_and_sticks(disk_store, monkeypatch):
    bs = 1000
    model = _model(30)
    threads = _other_threads()
    with cio.ExclusiveFile("wbeio", "w+", **disk_store) as f:
        fake = _inject_eio(monkeypatch, 8 * 2000, "write")
        submitted = 0
        with pytest.raises(StorageError) as ei:
            with WriteBehind(depth=2) as wb:
                for k in range(0, N, bs):
                    wb.submit(f.awrite, 8 * k, model[k:k + bs])
                    submitted += 1
        assert ei.value.errno == errno.EIO and fake.hits == 1
        assert submitted < N // bs or wb.error is ei.value      # raised at a later step
        assert wb.error is ei.value
        with pytest.raises(StorageError):
            wb.flush()
        _assert_quiet(f, threads)
        assert np.array_equal(f.read(0, np.empty(2000)), model[:2000])


def test_write_behind_body_exception_drains(store):
    model = _model(31)
    threads = _other_threads()
    with cio.ExclusiveFile("wbexc", "w+", backend=store) as f:
        with pytest.raises(ZeroDivisionError):
            with WriteBehind(depth=4) as wb:
                for i in range(3):
                    wb.submit(f.awrite, 8 * 1000 * i, model[1000 * i:1000 * (i + 1)])
                1 / 0  # noqa: B018 - raises inside the with block
        assert wb.in_flight == 0
        _assert_quiet(f, threads)
        assert np.array_equal(f.read(0, np.empty(3000)), model[:3000])


# ---------------------------------------------------------------- accounting

@pytest.mark.parametrize("depth", [0, 2])
def test_accounting_adds_up(store, depth):
    bs = 1 << 15
    n = 8 * bs
    model = _model(40, n)
    with cio.ExclusiveFile("acct", "w+", backend=store) as f:
        f.write(0, model)
        r0, b0 = f.stats.reads, f.stats.bytes_read
        pipe = cio.prefetch(_reader(f, bs, n), range(0, n, bs), lambda: np.empty(bs),
                            depth=depth, name=f"acct-{store}-{depth}")
        for _, b in pipe:
            b.sum()
        st = pipe.stats
        assert st.ops == 8 == f.stats.reads - r0
        assert st.bytes == model.nbytes == f.stats.bytes_read - b0
        assert 0 < st.wait_seconds <= st.io_seconds    # the first read is always waited for
        assert st.efficiency == pytest.approx(1 - st.wait_seconds / st.io_seconds)
        if depth == 0:
            assert st.efficiency < 0.05            # the consumer waited for every byte
        total = stats.for_pipeline(f"acct-{store}-{depth}", "read-ahead")
        assert total.ops >= st.ops
        assert f"acct-{store}-{depth}" in cio.report(print_it=False)
        names = {p["pipeline"] for p in stats.snapshot()["pipelines"]}
        assert f"acct-{store}-{depth}" in names


SLOW = 0.05                     # seconds each deliberately slow read or write takes


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_read_ahead_waits_measured_against_known_sleeps(depth):
    """Reads that take a known time: without read-ahead the consumer waits for all of
    them, whole; with it, at least for the first. A deliberately slow consumer (2 x SLOW
    per step) has that time counted as compute, and waits plus compute fit in the loop."""
    def slow_read(key, buf):
        time.sleep(SLOW)
        buf[:] = key

    n = 6
    pipe = cio.prefetch(slow_read, range(n), lambda: np.empty(4), depth=depth, blocking=True)
    t0 = time.perf_counter()
    for k, buf in pipe:
        assert (buf == k).all()
        if depth:
            time.sleep(2 * SLOW)
    wall = time.perf_counter() - t0
    st = pipe.stats
    assert st.ops == n and st.io_seconds >= n * SLOW
    assert st.wait_seconds <= st.io_seconds and st.wait_seconds <= wall
    if depth == 0:
        assert st.wait_seconds >= n * SLOW      # every read, waited for whole
    else:
        assert st.wait_seconds >= SLOW          # the first read has nothing to hide behind
        assert st.compute_seconds >= n * 2 * SLOW
        assert st.wait_seconds + st.compute_seconds <= wall


@pytest.mark.parametrize("depth", [1, 2])
def test_write_behind_waits_measured_against_known_sleeps(depth):
    """Writes that take a known time, submitted as fast as possible: with at most ``depth``
    in flight they take SLOW * ceil(n / depth) at least, and the producer, which does
    nothing else, spends most of that waiting (in ``submit`` and at the final drain)."""
    def slow_write(buf):
        time.sleep(SLOW)
        return buf.nbytes

    n = 6
    t0 = time.perf_counter()
    with WriteBehind(depth=depth) as wb:
        for i in range(n):
            wb.submit(pool.submit, slow_write, np.full(4, i))
    wall = time.perf_counter() - t0
    st = wb.stats
    assert st.ops == n and st.io_seconds >= n * SLOW
    # in flight at most `depth` at once: the writes end by SLOW * ceil(n / depth)
    assert wall >= SLOW * -(-n // depth)
    # ... and the producer, which does nothing else, spends that time waiting for them
    assert st.wait_seconds >= 0.5 * SLOW * -(-n // depth)
    assert st.wait_seconds <= min(st.io_seconds, wall)


def test_trace_tracks_and_timeline_plot(tmp_path):
    pytest.importorskip("matplotlib")
    cio.configure(trace=str(tmp_path / "t.json"))
    try:
        with cio.ExclusiveFile("tr", "w+") as f:
            f.write(0, _model(50))
            pipe = cio.prefetch(_reader(f, 1000), range(0, N, 1000), lambda: np.empty(1000),
                                depth=2, name="traced")
            for _, b in pipe:
                np.sort(b)
        path = trace.write_trace(str(tmp_path / "t.json"))
    finally:
        cio.configure(trace=None)
    events = json.load(open(path))["traceEvents"]
    tracks = {e["tid"] for e in events if e.get("args", {}).get("pipeline") == "traced"}
    assert "traced compute" in tracks
    assert any(t.startswith("traced io.") for t in tracks)
    fig = stats.plot_timeline(pipe.stats, path=str(tmp_path / "timeline.png"))
    assert os.path.getsize(tmp_path / "timeline.png") > 1000
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert "traced compute" in labels and any("io." in t for t in labels)


# ---------------------------------------------------------------- DiskArray.iter_blocks

def _create(name, shape, dtype, store, **kw):
    """A scratch DiskArray on ``store`` (skips where the backend's arrays are not)."""
    try:
        return cio.DiskArray.create(name, shape, dtype, backend=store, **kw)
    except cio.BackendUnavailableError as e:
        pytest.skip(f"no DiskArrays on {store}: {e}")


@pytest.mark.parametrize("depth", [0, 1, 2, 8])
@pytest.mark.parametrize("axis,size", [(0, 5), (0, 8), (1, 4), (1, 5)])   # divide or not
def test_iter_blocks_matches_model(store, depth, axis, size):
    model = np.random.default_rng(60).random((35, 12, 3))
    d = _create("ib", model.shape, model.dtype, store)
    try:
        d[:, :, :] = model
        seen = []
        pipe = d.iter_blocks(axis=axis, size=size, depth=depth)
        for section, block in pipe:
            assert block.flags.c_contiguous
            assert np.array_equal(block, model[section])
            assert sum(np.shares_memory(block, b) for b in pipe.buffers()) == 1
            time.sleep(0.0005)                     # reads in flight land elsewhere
            assert np.array_equal(block, model[section])
            seen.append(section[axis])
        n = model.shape[axis]
        assert seen == [slice(k, min(k + size, n)) for k in range(0, n, size)]
        assert len(pipe.buffers()) <= depth + 1
    finally:
        d.delete()


def test_iter_blocks_out_dtype_and_default_size(store):
    model = np.arange(40 * 6, dtype=np.float64).reshape(40, 6)
    d = _create("ibdt", model.shape, model.dtype, store)
    try:
        d[0:40, 0:6] = model
        got = [(s, b.copy()) for s, b in iter_blocks(d, size=9, depth=2, out_dtype=np.float32)]
        assert all(b.dtype == np.float32 for _, b in got)
        assert np.array_equal(np.concatenate([b for _, b in got]), model.astype(np.float32))
        default = [s for s, _ in d.iter_blocks()]
        assert default[0][0].stop - default[0][0].start == min(d.chunks[0], 40)
        for bad in ({"axis": 2}, {"axis": 1.0}, {"size": 0}, {"size": "4"}, {"depth": -2}):
            with pytest.raises(ValueError):
                d.iter_blocks(**bad)
    finally:
        d.delete()


def test_iter_blocks_early_break(store):
    model = np.random.default_rng(61).random((64, 1024))
    threads = _other_threads()
    d = _create("ibbrk", model.shape, model.dtype, store)
    try:
        d[0:64, 0:1024] = model
        pipe = d.iter_blocks(axis=0, size=4, depth=8)
        for i, (s, b) in enumerate(pipe):
            assert np.array_equal(b, model[s])
            if i == 1:
                break
        pipe.close()
        assert pipe.in_flight == 0 and _pool_idle() and _other_threads() == threads
    finally:
        d.delete()


@pytest.mark.parametrize("out_dtype", [None, np.float32])
def test_iter_blocks_eio_surfaces(disk_store, monkeypatch, out_dtype, tmp_path):
    model = np.random.default_rng(62).random((64, 16384))      # 8 chunks of 1 MiB
    threads = _other_threads()
    where = {"path": tmp_path} if "dir" in disk_store else {}   # auto: on disk, not in RAM
    d = _create("ibeio", model.shape, model.dtype, disk_store["backend"], chunks=(8, 16384),
                **where)
    try:
        d[0:64, 0:16384] = model
        # out of the page cache, and no read mapping (kernel read-ahead would bring later
        # blocks back into the cache, and cached blocks are copied from a mapping): every
        # block is read with preadv, where the error is injected
        cio.configure(map_cap=0)
        d.evict()
        fake = _inject_eio(monkeypatch, None, "read", from_offset=model.nbytes // 2)
        got = []
        pipe = d.iter_blocks(axis=0, size=8, depth=2, out_dtype=out_dtype)
        with pytest.raises(StorageError) as ei:
            for s, b in pipe:
                assert np.array_equal(b, model[s].astype(b.dtype))
                got.append(s)
        assert ei.value.errno == errno.EIO and fake.hits == 1
        assert 0 < len(got) < 8
        assert pipe.in_flight == 0 and _pool_idle() and _other_threads() == threads
    finally:
        monkeypatch.undo()
        d.delete()


def test_pipeline_class_is_the_iterator_type():
    assert isinstance(cio.prefetch(lambda k, b: None, [], lambda: None), Pipeline)


def test_chemio_py_prefetch_is_the_module_and_calls_the_function():
    """``from chemio_py import prefetch`` is the module (its ``iter_blocks``, ``Pipeline``);
    ``cio.prefetch(read, keys, make)`` still calls the function; the documented
    ``d.iter_blocks(..., direct=...)`` takes ``direct``."""
    import chemio_py.prefetch as module
    from chemio_py import prefetch
    assert prefetch is module and prefetch.iter_blocks is iter_blocks
    got = [k for k, _ in cio.prefetch(lambda k, b: None, [3, 1], lambda: np.empty(1))]
    assert got == [3, 1]
    with cio.DiskArray.create("pf.direct", (64, 512), "f8") as d:
        d[...] = 2.0
        total = sum(float(b.sum()) for _, b in d.iter_blocks(size=16, direct=True))
        assert total == 2.0 * 64 * 512
