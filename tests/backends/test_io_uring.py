"""The io_uring engine (backends/local/io_uring.py) on real O_DIRECT files: random batches
against a bytearray model, end of file, continued and retried transfers, errors, registered
buffers, a forked child, threads, the engine choice, and the local conformance suite with
the engine forced."""
import errno
import gc
import os
import threading
import time

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.backends.local import io_uring
from chemio_py.prefetch import iter_blocks
from chemio_py.errors import ConfigError, EndOfFileError, OutOfSpaceError, StorageError
from chemio_py.runtime import config, requests
from chemio_py.testing import BackendTests
from aio_cases import reaper_lives_on_after_a_callback_escapes, threads_write_and_read
from conftest import in_forked_child

pytestmark = pytest.mark.skipif(io_uring.engine() is None, reason="no io_uring here")

K = 4096


@pytest.fixture(autouse=True)
def _forced(monkeypatch):
    """io_uring forced, here and in the processes a test starts."""
    monkeypatch.setenv("CHEMIO_AIO_ENGINE", "io_uring")
    config.configure(aio_engine="io_uring")
    yield
    config.configure(aio_engine=None)


@pytest.fixture
def spy(monkeypatch):
    """Counts the transfers the io_uring engine takes."""
    eng = io_uring.engine()
    orig = eng._submit
    seen = {"transfers": 0, "calls": 0}

    def counting(write, fd, addrs, sizes, offs, *rest):
        req = orig(write, fd, addrs, sizes, offs, *rest)
        if req is not None:
            seen["transfers"] += len(offs)
            seen["calls"] += 1
        return req
    monkeypatch.setattr(eng, "_submit", counting)
    return seen


def _settled(eng, timeout=10.0):
    t_end = time.monotonic() + timeout
    while eng.in_flight and time.monotonic() < t_end:
        time.sleep(0.001)
    return eng.idle()


def _direct(f):
    if f.store._dfd is None:
        pytest.skip("this file system refuses O_DIRECT")


def test_the_engine_is_chosen_and_the_setting_forces_another():
    assert io_uring.engine_name() == "io_uring"
    assert isinstance(io_uring.native_engine(), io_uring.Engine)
    config.configure(aio_engine="threads")
    assert io_uring.native_engine() is None and io_uring.engine_name() == "threads"
    config.configure(aio_engine="aio")
    assert io_uring.engine_name() in ("aio", "threads")
    config.configure(aio_engine="auto")                 # AIO first (measured no slower)
    assert io_uring.engine_name() in ("aio", "io_uring")
    config.configure(aio_engine="io_uring")
    with pytest.raises(ConfigError, match="io_uring"):
        config.configure(aio_engine="uring")
    assert io_uring.engine_name() == "io_uring"         # nothing changed


def test_random_batches_against_a_bytearray_model(tmp_path, spy):
    rng = np.random.default_rng(28)
    nblocks = 256
    model = bytearray(nblocks * K)
    with cio.ExclusiveFile("model", "w+", dir=str(tmp_path), direct=True) as f:
        _direct(f)
        f.write(0, np.zeros(nblocks * K, np.uint8))
        for step in range(60):
            k = int(rng.integers(1, 40))
            # disjoint transfers of one or two blocks (in flight together: any order)
            blocks = rng.choice(nblocks // 2, k, replace=False) * 2
            sizes = rng.integers(1, 3, k) * K if step % 3 else np.full(k, K)
            offs = blocks * K
            if rng.random() < 0.5:
                data = [cio.aligned_empty(int(s)) for s in sizes]
                for d in data:
                    d[:] = rng.integers(0, 256, d.size, dtype=np.uint8)
                reqs = [f.awrite_many(offs, data)] if step % 2 else \
                    [f.awrite(int(o), d) for o, d in zip(offs, data)]
                for r in reqs:
                    r.wait(timeout=10)
                for o, d in zip(offs.tolist(), data):
                    model[o:o + d.size] = d.tobytes()
            else:
                outs = [cio.aligned_empty(int(s)) for s in sizes]
                f.aread_many(offs, outs).wait(timeout=10)
                for o, d in zip(offs.tolist(), outs):
                    assert d.tobytes() == bytes(model[o:o + d.size])
        back = cio.aligned_empty(nblocks * K)
        f.read(0, back)
        assert back.tobytes() == bytes(model)
        f.delete()
    assert spy["transfers"] > 500
    assert _settled(io_uring.engine())


def test_reads_at_end_of_file(tmp_path):
    eng = io_uring.engine()
    path = str(tmp_path / "eof")
    data = np.random.default_rng(1).integers(0, 256, 64 * K + 100, dtype=np.uint8)
    data.tofile(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    try:
        buf = cio.aligned_empty(4 * K)
        # crossing the end: the bytes up to it (aligned part continued, then the tail)
        r = eng.submit(False, fd, buf.ctypes.data, 4 * K, 62 * K, buf, lambda n, *_: n)
        assert r.wait(timeout=10) == 2 * K + 100
        assert (buf[:2 * K + 100] == data[62 * K:]).all()
        # at and past the end: nothing
        r = eng.submit_many(False, fd, [buf.ctypes.data, buf.ctypes.data + K], K,
                            [64 * K, 80 * K], buf, lambda n, *_: n)
        assert r.wait(timeout=10) == [100, 0]
    finally:
        os.close(fd)
    with cio.ExclusiveFile("eof2", "w+", dir=str(tmp_path), direct=True) as f:
        _direct(f)
        f.write(0, np.ones(8 * K, np.uint8))
        outs = cio.aligned_empty((4, K))
        with pytest.raises(EndOfFileError):
            f.aread_many([0, 4 * K, 8 * K, K], outs).wait(timeout=10)
        with pytest.raises(EndOfFileError):
            f.aread(6 * K, cio.aligned_empty(4 * K)).wait(timeout=10)
        f.delete()
    assert _settled(eng)


def _inject(monkeypatch, eng, change):
    """Rewrite results as the kernel would have returned them: ``change(result)`` once
    per transfer (its first completion), the later ones as they come."""
    orig = eng._deliver
    seen = set()

    def deliver(uds, results):
        out = []
        for ud, res in zip(uds, results):
            if ud not in seen and res > 0:
                seen.add(ud)
                res = change(res)
            out.append(res)
        return orig(uds, out)
    monkeypatch.setattr(eng, "_deliver", deliver)


@pytest.mark.parametrize("kind", ["short", "eagain", "eintr"])
def test_short_and_interrupted_transfers_are_continued(tmp_path, monkeypatch, kind):
    eng = io_uring.engine()
    change = {"short": lambda r: r - K if r > K else r,
              "eagain": lambda r: -errno.EAGAIN, "eintr": lambda r: -errno.EINTR}[kind]
    with cio.ExclusiveFile("short", "w+", dir=str(tmp_path), direct=True) as f:
        _direct(f)
        rows = cio.aligned_empty((8, 2 * K))
        rows[...] = np.arange(8, dtype=np.uint8)[:, None] + 1
        _inject(monkeypatch, eng, change)
        assert f.awrite_many(np.arange(8) * 2 * K, rows).wait(timeout=10) == 16 * 2 * K // 2
        back = cio.aligned_empty((8, 2 * K))
        assert f.aread_many(np.arange(8) * 2 * K, back).wait(timeout=10) is back
        assert (back == rows).all()
        monkeypatch.undo()
        f.delete()
    assert _settled(eng)


def test_errors_are_mapped_like_the_aio_engine(tmp_path, monkeypatch):
    eng = io_uring.engine()
    path = str(tmp_path / "err")
    with open(path, "wb") as fh:
        fh.write(bytes(64 * K))
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    try:
        buf = cio.aligned_empty((8, K))
        addrs = buf.ctypes.data + K * np.arange(8, dtype=np.uint64)
        addrs[3] = 0xFFFF_FFFF_FFFF_0000                 # kernel space: never valid
        r = eng.submit_many(True, fd, addrs, K, np.arange(8) * K, buf, lambda n, *_: n)
        res = r.wait(timeout=10)
        assert res[3] == -errno.EFAULT and res[:3] + res[4:] == [K] * 7
    finally:
        os.close(fd)
    with cio.ExclusiveFile("nospace", "w+", dir=str(tmp_path), direct=True) as f:
        _direct(f)
        rows = cio.aligned_empty((4, K))
        _inject(monkeypatch, eng, lambda r: -errno.ENOSPC)
        with pytest.raises(OutOfSpaceError):
            f.awrite_many(np.arange(4) * K, rows).wait(timeout=10)
        with pytest.raises(StorageError) as ei:
            f.aread(0, cio.aligned_empty(K)).wait(timeout=10)
        assert ei.value.errno == errno.ENOSPC
        monkeypatch.undo()
        f.delete()
    assert _settled(eng)


def test_registered_buffers_use_the_fixed_operations(tmp_path, monkeypatch):
    eng = io_uring.engine()
    ops = []
    orig = eng._use_fixed

    def use_fixed(w, write):
        hit = orig(w, write)
        ops.extend((w[:, 0] & 0xFF).tolist())
        return hit          # the engine rewrites a block's SQEs next time when True
    monkeypatch.setattr(eng, "_use_fixed", use_fixed)
    with cio.ExclusiveFile("fixed", "w+", dir=str(tmp_path), direct=True) as f:
        _direct(f)
        ring = cio.aligned_empty((16, K))
        ring[...] = np.arange(16, dtype=np.uint8)[:, None]
        assert eng.register(ring)
        assert f.awrite_many(np.arange(16) * K, ring).wait(timeout=10) == 16 * K
        out = cio.aligned_empty((16, K))              # not registered: the plain operation
        f.aread_many(np.arange(16)[::-1] * K, out).wait(timeout=10)
        assert (out == ring[::-1]).all()
        ring[...] = 0
        f.aread_many(np.arange(16) * K, ring).wait(timeout=10)
        assert (ring == np.arange(16, dtype=np.uint8)[:, None]).all()
        assert ops.count(io_uring._OP_WRITE_FIXED) == 16
        assert ops.count(io_uring._OP_READ_FIXED) == 16 and ops.count(io_uring._OP_READ) == 16
        f.delete()
    key = (ring.ctypes.data, ring.ctypes.data + ring.nbytes)
    assert key in eng._regs
    del ring
    gc.collect()
    assert key not in eng._regs                       # unregistered when its memory goes
    held = bytearray(2 * K)                           # no weak references: kept alive
    assert eng.register(held)
    assert len(eng._pinned) == 1
    eng.unregister(held)
    assert not eng._pinned and not any(eng._regs)
    assert _settled(eng)


def test_a_probe_collects_what_has_finished(tmp_path):
    # done() on a pending request collects the finished transfers from the CQ in the
    # calling thread (no reaper, no system call), as wait() would
    me = threading.get_ident()
    eng = io_uring.engine()
    with cio.ExclusiveFile("collect", "w+", dir=str(tmp_path), direct=True) as f:
        _direct(f)
        f.write(0, np.arange(8 * K // 8, dtype=np.int64))
        rows = cio.aligned_empty((8, K))
        where = []
        with eng._token:                    # the reaper thread collects nothing meanwhile
            first = f.aread_many(np.arange(8) * K, rows)
            first.add_done_callback(lambda _r: where.append(threading.get_ident()))
            t_end = time.monotonic() + 10
            while not first.done() and time.monotonic() < t_end:
                time.sleep(0.001)
            assert requests.Request.done(first) and where == [me]
        assert first.wait() is rows
        assert (rows.view(np.int64).ravel() == np.arange(8 * K // 8)).all()
        f.delete()
    assert _settled(eng)


def test_a_completion_nobody_waits_for_still_completes(tmp_path):
    with cio.ExclusiveFile("nowait", "w+", dir=str(tmp_path), direct=True) as f:
        _direct(f)
        f.write(0, np.full(2 * K, 4, np.uint8))
        got = []

        def then(_r):                 # in the reaper thread, which may wait for more
            inner = f.aread(K, cio.aligned_empty(K))
            got.append(int(inner.wait(timeout=10)[0]))

        first = f.aread(0, cio.aligned_empty(K))
        first.add_done_callback(then)
        t_end = time.monotonic() + 10
        while not got and time.monotonic() < t_end:
            time.sleep(0.005)                       # polling: nobody waits
        assert got == [4] and first.done()
        f.delete()


def test_a_forked_child_makes_its_own_ring(tmp_path):
    eng = io_uring.engine()
    with cio.ExclusiveFile("fork", "w+", dir=str(tmp_path), direct=True) as f:
        _direct(f)
        rows = cio.aligned_empty((8, K))
        rows[...] = 7
        f.awrite_many(np.arange(8) * K, rows).wait(timeout=10)
        f.flush()

        def child() -> bool:
            mine = io_uring.engine()
            back = cio.aligned_empty((8, K))
            with cio.ExclusiveFile("fork", "r", dir=str(tmp_path), direct=True) as g:
                g.aread_many(np.arange(8)[::-1] * K, back).wait(timeout=10)
            return (mine is not None and mine is not eng and mine._pid == os.getpid()
                    and bool((back == 7).all()) and eng.poll() == 0)
        in_forked_child(child)
        # the parent's ring goes on
        assert f.aread_many(np.arange(8) * K, rows).wait(timeout=10) is rows
        f.delete()
    assert _settled(eng)


def test_threads_share_the_ring(tmp_path):
    with cio.ExclusiveFile("threads", "w+", dir=str(tmp_path), direct=True) as f:
        _direct(f)
        threads_write_and_read(f)
        f.delete()
    assert _settled(io_uring.engine())


def test_more_transfers_than_the_ring_holds(tmp_path):
    # groups over several blocks (one enter), and more transfers than the slots hold
    # (refused: those run on the I/O threads)
    eng = io_uring.engine()
    with cio.ExclusiveFile("big", "w+", dir=str(tmp_path), direct=True) as f:
        _direct(f)
        n = io_uring.BLOCKS * io_uring.BLOCK + 400
        data = cio.aligned_empty((n, K))
        data[...] = (np.arange(n) % 251).astype(np.uint8)[:, None]
        assert f.awrite_many(np.arange(200) * K, data[:200]).wait(timeout=20) == 200 * K
        reqs = [f.awrite_many(np.arange(200, n) * K, data[200:])]
        reqs += [f.awrite(i * K, data[i]) for i in range(400)]
        cio.waitall(reqs, timeout=20)
        back = cio.aligned_empty((n, K))
        f.read(0, back)
        assert (back == data).all()
        f.delete()
    assert _settled(eng)


def test_direct_read_ahead_goes_through_the_ring(tmp_path, spy):
    model = np.random.default_rng(2).random((256, 1024))
    d = cio.DiskArray.create("ra", model.shape, model.dtype, backend="local",
                             chunks=(64, 1024))
    try:
        d[...] = model
        d.flush()
        d.evict()
        with iter_blocks(d, size=32, depth=2, direct=True) as pipe:
            for section, block in pipe:
                assert np.array_equal(block, model[section])
        assert d.outstanding == 0
    finally:
        d.delete()
    assert spy["calls"] >= 4
    assert _settled(io_uring.engine())


class TestLocalIoUring(BackendTests):
    """The conformance suite of the local backend with O_DIRECT and io_uring forced."""
    backend = "local"
    mpi_ranks = 2

    @pytest.fixture(autouse=True)
    def _direct_too(self, monkeypatch):
        monkeypatch.setenv("CHEMIO_DIRECT", "1")
        config.configure(direct=True)
        yield
        config.configure(direct=None)


def test_the_reaper_lives_on_after_a_callback_escapes(tmp_path):
    """As for Linux AIO (``aio_cases``): a callback that lets a BaseException escape on the
    reaper thread neither kills it nor strands the read."""
    path = str(tmp_path / "reaper")
    with open(path, "wb") as f:
        f.write(bytes(1 << 20))
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    try:
        reaper_lives_on_after_a_callback_escapes(io_uring.engine(), fd)
    finally:
        os.close(fd)
