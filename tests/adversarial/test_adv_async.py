"""Issue 11, items 4 and 6: asynchronous errors never vanish, interrupted calls never leave
I/O running on the caller's buffers."""
import errno
import gc
import os
import signal
import threading
import time

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.backends.local import backend as local
from chemio_py.errors import OutOfSpaceError, StorageError, UnobservedIOError
from chemio_py.runtime import pool, requests

MiB = 1 << 20


def _need(small_fs):
    if small_fs is None:
        pytest.skip("needs a real tmpfs mount (root)")


# ---------------------------------------------------------------- item 4

def test_fire_and_forget_enospc_is_raised_by_flush_once(small_fs):
    _need(small_fs)
    f = cio.ExclusiveFile("ff", "w+", dir=small_fs)
    f.awrite(0, np.zeros(2 * MiB, np.uint8))           # does not fit a 1 MiB tmpfs
    time.sleep(0.05)                                    # let it fail in the background
    with pytest.raises(UnobservedIOError) as ei:
        f.flush()
    assert isinstance(ei.value.__cause__, OutOfSpaceError)
    assert ei.value.errno == errno.ENOSPC and ei.value.filename == f.path
    assert "nobody waited for" in str(ei.value)
    f.flush()                                          # once: it was reported
    f.close()
    f.delete()


def test_fire_and_forget_failure_is_raised_by_close(small_fs):
    _need(small_fs)
    f = cio.ExclusiveFile("fc", "w+", dir=small_fs)
    f.write(0, b"kept")
    for k in range(4):
        f.awrite(k * MiB, np.ones(MiB, np.uint8))       # the later ones cannot fit
    with pytest.raises(UnobservedIOError) as ei:
        f.close()
    assert len(ei.value.errors) >= 1
    assert all(isinstance(e, OutOfSpaceError) for e in ei.value.errors)
    assert f.closed
    f.close()                                          # idempotent, nothing raised again
    os.unlink(os.path.join(small_fs, "fc.0"))


def test_waited_failure_is_not_reported_again(small_fs):
    _need(small_fs)
    with cio.ExclusiveFile("fw", "w+", dir=small_fs) as f:
        r = f.awrite(0, np.zeros(2 * MiB, np.uint8))
        with pytest.raises(OutOfSpaceError):
            r.wait()
        f.flush()                                      # the caller saw it: not raised again
    os.unlink(os.path.join(small_fs, "fw.0"))


def test_many_completed_failures_are_not_pruned_away(small_fs):
    """Pending prunes completed requests past 64; a failed unseen one must survive it."""
    _need(small_fs)
    f = cio.ExclusiveFile("fp", "w+", dir=small_fs)
    f.awrite(0, np.zeros(2 * MiB, np.uint8))
    time.sleep(0.05)
    for k in range(200):                               # many successful requests afterwards
        f.awrite(k * 8, np.full(1, k, np.int64)).wait()
    with pytest.raises(UnobservedIOError):
        f.close()
    os.unlink(os.path.join(small_fs, "fp.0"))


def test_write_behind_error_reaches_the_caller_once(small_fs):
    _need(small_fs)
    f = cio.ExclusiveFile("wb", "w+", dir=small_fs)
    wb = cio.WriteBehind(depth=2)
    blk = np.ones(512 * 1024, np.uint8)
    with pytest.raises(OutOfSpaceError):
        for k in range(8):
            wb.submit(f.awrite, k * blk.nbytes, blk)
        wb.flush()
    with pytest.raises(OutOfSpaceError):
        wb.close()                                     # the pipeline stays broken
    f.close()                                          # already delivered: not raised twice
    os.unlink(os.path.join(small_fs, "wb.0"))


def test_diskarray_awrite_failure_is_raised_by_flush_and_close(monkeypatch):
    """DiskArrays reserve their blocks at creation, so a real ENOSPC cannot reach a write:
    the failure is injected at the system call."""
    d = cio.DiskArray.create("dfail", (512, 512), "f8", chunks=(64, 512))
    real = local.os.pwritev

    def failing(fd, bufs, offset, *a):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(local.os, "pwritev", failing)
    monkeypatch.setattr(local.os, "pwrite", lambda *a: failing(*a))
    d.awrite(np.s_[0:256], np.ones((256, 512)))
    time.sleep(0.05)
    with pytest.raises(UnobservedIOError) as ei:
        d.flush()
    assert isinstance(ei.value.__cause__, StorageError) or isinstance(ei.value.__cause__, OSError)
    d.awrite(np.s_[256:512], np.ones((256, 512)))
    with pytest.raises(UnobservedIOError):
        d.close()
    monkeypatch.setattr(local.os, "pwritev", real)
    assert d.closed
    d.close()


# ---------------------------------------------------------------- item 6

class _Interrupts:
    """Raise KeyboardInterrupt from SIGALRM ``n`` times, every ``every`` seconds, but only
    while ``within`` (a function) is on the main thread's stack: a tick that lands in the
    test's own code (entering or leaving the block) does nothing, so no interrupt can
    escape the ``try`` that expects it."""

    def __init__(self, within, n: int = 6, every: float = 0.002):
        self.code = within.__code__
        self.left = n
        self.every = every

    def _inside(self, frame) -> bool:
        while frame is not None:
            if frame.f_code is self.code:
                return True
            frame = frame.f_back
        return False

    def __enter__(self):
        # no cyclic-GC finaliser may run under the storm (an interrupted __del__ is an
        # "unraisable" exception that pytest reports against the test); not a collection
        # here either: it could outlast what the test times
        gc.disable()

        def handler(sig, frame):
            if self.left > 0 and self._inside(frame):
                self.left -= 1
                raise KeyboardInterrupt
        self.old = signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, self.every, self.every)
        return self

    def __exit__(self, *exc):
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.old)
        gc.enable()


def _quiet_after(out: np.ndarray) -> None:
    """``out`` must not change any more: nothing is writing into it."""
    snap = out.copy()
    time.sleep(0.3)
    assert np.array_equal(snap, out, equal_nan=True), "I/O kept writing after the call returned"


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.parametrize("backend", ["local", "shm"])
def test_interrupted_blocking_read_leaves_nothing_in_flight(backend):
    """Cold reads (local, evicted) are slow enough that the interrupts land mid-read."""
    n = 4096
    with cio.DiskArray.create("intr", (n, n), "f8", backend=backend, chunks=(256, n)) as d:
        d.write((), np.ones((n, n)))
        hit = 0
        for _attempt in range(20):
            out = np.full((n, n), np.nan)
            if backend == "local":
                d.flush()
                _evict(d.path)
            try:
                with _Interrupts(cio.DiskArray.read):
                    d.read((), out=out)
            except KeyboardInterrupt:
                hit += 1
                _quiet_after(out)
            if hit >= 3:
                break
        assert hit >= 1, "no interrupt landed inside the read"
        assert d.outstanding == 0 and pool.queued() == 0


def test_interrupted_close_waits_for_requests():
    n = 4096
    d = cio.DiskArray.create("intrc", (n, n), "f8", chunks=(256, n))
    d.write((), np.ones((n, n)))
    out = np.full((n, n), np.nan)
    d.aread((), out)
    try:
        with _Interrupts(cio.DiskArray.close, n=3, every=0.001):
            d.close()
    except KeyboardInterrupt:
        pass
    if d.closed:                        # closed: its request ended before close() returned
        _quiet_after(out)
        assert np.all(out == 1.0)
    # else the interrupt came before close() began: the read is still the caller's own
    d.close()
    assert d.closed and np.all(out == 1.0)


def test_settle_swallows_nothing_and_waits_for_all():
    started = threading.Event()

    def slow():
        started.set()
        time.sleep(0.2)
        return 1
    r = pool.submit(slow)
    started.wait()
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        with _Interrupts(requests.settle, n=2, every=0.01):
            requests.settle([r])
    assert r.done() and time.perf_counter() - t0 >= 0.15
