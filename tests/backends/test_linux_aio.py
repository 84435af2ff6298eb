"""The Linux AIO engine (backends/linux_aio.py) on real O_DIRECT files: requests that cannot
be cancelled once queued, partly refused submissions, waiters that reap their own
completions, and waits that an interrupt or another thread cannot break."""
import errno
import gc
import os
import signal
import threading
import time

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.backends.local import linux_aio
from chemio_py.runtime import config, requests
from aio_cases import Escape, reaper_lives_on_after_a_callback_escapes, threads_write_and_read

pytestmark = pytest.mark.skipif(linux_aio.engine() is None, reason="no Linux AIO here")

K = 4096


@pytest.fixture(autouse=True)
def _aio_engine():
    """The files of these tests use Linux AIO (io_uring has its own tests)."""
    config.configure(aio_engine="aio")
    yield
    config.configure(aio_engine=None)


def _direct_file(tmp_path, name, nbytes=1 << 20):
    """A file of ``nbytes`` and an O_DIRECT descriptor on it (skips without O_DIRECT)."""
    path = str(tmp_path / name)
    with open(path, "wb") as f:
        f.write(bytes(nbytes))
    try:
        return path, os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")


def _settled(eng, timeout=10.0):
    t_end = time.monotonic() + timeout
    while eng.in_flight and time.monotonic() < t_end:
        time.sleep(0.001)
    return eng.in_flight == 0


def test_a_queued_request_cannot_be_cancelled_and_the_engine_goes_on(tmp_path):
    # cancel() used to say True for a transfer already in the kernel; its completion then
    # released the request's lock a second time and killed the reaper thread
    with cio.ExclusiveFile("cancel", "w+", dir=str(tmp_path), direct=True) as f:
        if f.store._dfd is None:
            pytest.skip("this file system refuses O_DIRECT")
        big = cio.aligned_empty(4 << 20)
        big[:] = 5
        for i in range(8):
            f.write(i * (4 << 20), big)
        outs = [cio.aligned_empty(4 << 20) for _ in range(8)]
        reqs, in_flight = [], 0
        for i in range(8):
            reqs.append(f.aread(i * (4 << 20), outs[i]))
            in_flight += not reqs[-1].done()
            assert reqs[-1].cancel() is False
        assert in_flight                    # (4 MiB from the device: not done at once)
        assert [o is outs[i] for i, o in enumerate(cio.waitall(reqs, timeout=30))] == \
            [True] * 8
        assert all((o == 5).all() for o in outs)
        time.sleep(0.01)
        out = cio.aligned_empty((16, K))
        assert f.aread_many(np.arange(16) * K * 512, out).wait(timeout=10) is out
        assert (out == 5).all()
        f.delete()


def test_partly_refused_group_completes_with_the_kernels_error(tmp_path):
    # 100 transfers are 4 blocks of io_submit; the 41st has an address the kernel refuses
    # (EFAULT at submission): the 40 before it are queued and done, it and every later one
    # fail with that error, and the request still completes (it used to raise a TypeError
    # in submit_many and leave the queued part of the request without an owner)
    eng = linux_aio.engine()
    path, fd = _direct_file(tmp_path, "partial")
    try:
        buf = cio.aligned_empty((100, K))
        buf[...] = (np.arange(100) % 200 + 1)[:, None]
        addrs = buf.ctypes.data + K * np.arange(100, dtype=np.uint64)
        addrs[40] = 0xFFFF_FFFF_FFFF_0000                  # kernel space: never valid
        req = eng.submit_many(True, fd, addrs, K, np.arange(100) * K, buf,
                              lambda res, t0, t1: res)
        res = req.wait(timeout=10)
        assert res[:40] == [K] * 40
        assert res[40:] == [-errno.EFAULT] * 60
        assert _settled(eng)
        with open(path, "rb") as f:
            data = np.frombuffer(f.read(), np.uint8).reshape(-1, K)
        assert (data[:40] == buf[:40]).all() and not data[40:100].any()
        # refused from the first transfer on: nothing queued, the caller hears of it
        addrs[40], addrs[0] = buf.ctypes.data + 40 * K, 0xFFFF_FFFF_FFFF_0000
        with pytest.raises(OSError) as ei:
            eng.submit_many(True, fd, addrs, K, np.arange(100) * K, buf, lambda *a: a)
        assert ei.value.errno == errno.EFAULT
        assert _settled(eng)
    finally:
        os.close(fd)


def test_a_waiter_completes_its_requests_in_its_own_thread(tmp_path):
    # no hand-off through the reaper thread: the thread that waits collects the
    # completion (the first round may still be the reaper's, which then steps aside)
    me = threading.get_ident()
    with cio.ExclusiveFile("own", "w+", dir=str(tmp_path), direct=True) as f:
        if f.store._dfd is None:
            pytest.skip("this file system refuses O_DIRECT")
        rows = cio.aligned_empty((8, K))
        rows[...] = 1
        f.write(0, np.zeros(40 * 8 * K, np.uint8))  # overwrites below: queued, not synchronous
        where = []
        for i in range(40):
            r = f.awrite_many(np.arange(8) * K + i * 8 * K, rows)
            r.add_done_callback(lambda _r: where.append(threading.get_ident()))
            assert r.wait(timeout=10) == 8 * K
        assert len(where) == 40
        assert where.count(me) >= 20, f"{where.count(me)} of 40 completed by the waiter"
        # the trace track of the I/O stays the AIO thread's whoever delivered it
        assert threading.current_thread().name != "chemio-aio"
        f.delete()


def test_a_submitter_and_a_probe_collect_what_has_finished(tmp_path):
    # a thread that submits (or asks done()) first collects the finished transfers in its
    # own thread, so a submit/wait loop needs no reaper thread and no GIL hand-off to it
    me = threading.get_ident()
    eng = linux_aio.engine()
    with cio.ExclusiveFile("collect", "w+", dir=str(tmp_path), direct=True) as f:
        if f.store._dfd is None:
            pytest.skip("this file system refuses O_DIRECT")
        f.write(0, np.arange(16 * K // 8, dtype=np.int64))
        rows = cio.aligned_empty((16, K))
        where = []
        with eng._token:                    # the reaper thread collects nothing meanwhile
            first = f.aread_many(np.arange(8) * K, rows[:8])
            first.add_done_callback(lambda _r: where.append(threading.get_ident()))
            t_end = time.monotonic() + 10
            while not requests.Request.done(first) and time.monotonic() < t_end:
                time.sleep(0.001)
                f.aread_many(np.arange(8, 16) * K, rows[8:])    # collects `first`
            assert where == [me]
            third = f.aread(0, rows[0])
            t_end = time.monotonic() + 10
            while not third.done() and time.monotonic() < t_end:   # a probe collects
                time.sleep(0.001)
            assert requests.Request.done(third)
        assert first.wait().shape == (8, K)        # wait() returns the buffers
        f.flush()
        np.testing.assert_array_equal(rows.view(np.int64).ravel(), np.arange(16 * K // 8))
        f.delete()
    assert _settled(eng)


class _Interrupt(Exception):
    """What the test's SIGINT handler raises (a KeyboardInterrupt would stop pytest)."""


# The storm also lands in interpreter finalizers (weakref callbacks), where Python reports
# the handler's exception as unraisable and goes on: not the engine's concern here.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_interrupts_during_waits_lose_no_completion(tmp_path):
    # SIGINT at random moments while the main thread waits, i.e. reaps: the completions it
    # collected are still delivered (the handler's exception comes after), none is lost
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    eng = linux_aio.engine()
    stop = threading.Event()
    pid = os.getpid()
    pauses = (np.random.default_rng(3).random(100_000) * 0.002).tolist()

    go = threading.Event()

    def storm():
        go.wait()
        i = 0
        while not stop.is_set():
            time.sleep(pauses[i % len(pauses)])
            i += 1
            os.kill(pid, signal.SIGINT)

    interrupted = 0

    def interrupt(signum, frame):
        nonlocal interrupted
        interrupted += 1
        raise _Interrupt()

    # Earlier tests' garbage must not be finalised under the storm: a __del__ the signal
    # interrupts is an "unraisable" exception, which pytest reports against this test.
    gc.collect()
    gc.disable()
    old = signal.signal(signal.SIGINT, interrupt)
    try:
        with cio.ExclusiveFile("intr", "w+", dir=str(tmp_path), direct=True) as f:
            if f.store._dfd is None:
                pytest.skip("this file system refuses O_DIRECT")
            rows = cio.aligned_empty((32, K))
            rows[...] = 9
            reqs = []
            t = threading.Thread(target=storm, daemon=True)
            t.start()
            go.set()
            t_end = time.monotonic() + 2.0
            while time.monotonic() < t_end:
                # an interrupt may land anywhere, this loop's own bookkeeping included: the
                # outer try catches one that lands outside the inner one
                try:
                    try:
                        while reqs:             # first what an interrupt left behind
                            assert reqs[0].wait(timeout=10) == 8 * K
                            reqs.pop(0)
                        for g in range(4):
                            reqs.append(f.awrite_many(np.arange(8) * K + g * 8 * K,
                                                      rows[g * 8:(g + 1) * 8]))
                        while reqs:
                            assert reqs[0].wait(timeout=10) == 8 * K
                            reqs.pop(0)
                    except _Interrupt:
                        pass
                except _Interrupt:
                    pass
            while True:                     # the storm goes on until the handler is quiet
                try:
                    signal.signal(signal.SIGINT, lambda signum, frame: None)
                    break
                except _Interrupt:
                    pass
            stop.set()
            t.join()
            for r in reqs:                  # every request still completes
                assert r.wait(timeout=10) == 8 * K
            f.delete()
    finally:
        stop.set()
        signal.signal(signal.SIGINT, lambda signum, frame: None)
        time.sleep(0.01)                    # a signal still on its way lands here
        signal.signal(signal.SIGINT, old)
        gc.enable()
    assert interrupted > 10
    assert _settled(eng)
    assert len(eng._gfree) == linux_aio.BLOCKS and not eng._waiting     # nothing leaked


def test_threads_waiting_at_once_all_complete(tmp_path):
    # one thread reaps at a time; the others are completed by it or take over after it
    with cio.ExclusiveFile("threads", "w+", dir=str(tmp_path), direct=True) as f:
        if f.store._dfd is None:
            pytest.skip("this file system refuses O_DIRECT")
        threads_write_and_read(f)
        f.delete()


def test_a_completion_callback_may_wait_for_another_request(tmp_path):
    # the callback runs in the thread that reaps (holding the engine's token); a wait
    # there used to deadlock the reaper thread
    with cio.ExclusiveFile("cb", "w+", dir=str(tmp_path), direct=True) as f:
        if f.store._dfd is None:
            pytest.skip("this file system refuses O_DIRECT")
        buf = cio.aligned_empty(K)
        buf[:] = 4
        f.write(0, buf)
        f.write(K, buf)
        got = []

        def then(_r):
            inner = f.aread(K, cio.aligned_empty(K))
            got.append(int(inner.wait(timeout=10)[0]))

        first = f.aread(0, cio.aligned_empty(K))
        first.add_done_callback(then)
        time.sleep(0.2)                 # nobody waits: the reaper thread completes it
        assert first.wait(timeout=10)[0] == 4
        t_end = time.monotonic() + 10
        while not got and time.monotonic() < t_end:
            time.sleep(0.001)
        assert got == [4]
        f.delete()


def test_the_reaper_completes_hundreds_in_flight_that_nobody_waits_for(tmp_path, monkeypatch):
    # with more than 4 * BATCH transfers in flight the reaper asked io_getevents for more
    # completions at once than its buffer holds (EINVAL) and stopped for good
    eng = linux_aio.engine()
    done = requests.Request.done            # the state alone: _Req.done would collect
    with cio.ExclusiveFile("many", "w+", dir=str(tmp_path), direct=True) as f:
        if f.store._dfd is None:
            pytest.skip("this file system refuses O_DIRECT")
        n = linux_aio.QUEUE_DEPTH + linux_aio.BLOCKS * linux_aio.BLOCK
        f.truncate(n * K)
        outs = cio.aligned_empty((n, K))
        half = linux_aio.QUEUE_DEPTH
        eng._waiting.append(None)           # "a waiter reaps": the reaper steps aside
        monkeypatch.setattr(eng, "_poll_step", lambda: 0)   # and the submitter collects none
        try:
            reqs = [f.aread(i * K, outs[i]) for i in range(half)]
            reqs += [f.aread_many(np.arange(i, i + linux_aio.BLOCK) * K,
                                  outs[i:i + linux_aio.BLOCK])
                     for i in range(half, n, linux_aio.BLOCK)]
            assert eng.in_flight > 4 * linux_aio.BATCH
        finally:
            eng._waiting.pop()
            monkeypatch.undo()
        t_end = time.monotonic() + 20
        while not all(done(r) for r in reqs) and time.monotonic() < t_end:
            time.sleep(0.005)               # looking, not waiting: the reaper's work
        assert all(done(r) for r in reqs)
        assert eng._reaper.is_alive()
        assert all(r.exception() is None for r in reqs)
        f.delete()
    assert _settled(eng)


def test_a_callback_escaping_leaves_no_completion_of_its_batch_behind(tmp_path):
    """Three reads reaped in one batch; the first one's callback raises a BaseException.
    The other two still complete, the exception comes out once all are complete, and the
    engine's counts show the delivery that was cut short."""
    path, fd = _direct_file(tmp_path, "batch")
    eng = linux_aio.engine()
    bufs = [cio.aligned_empty(K) for _ in range(3)]
    held, go, out = threading.Event(), threading.Event(), {}

    def reaper() -> None:                   # holds the token: nobody else reaps meanwhile
        with eng._token:
            held.set()
            go.wait(10)
            time.sleep(0.2)                 # the three reads are done in the kernel
            got = 0
            try:
                while got < 3:
                    got += max(eng._reap(3 - got, eng._waiter_wait), 0)
            except BaseException as e:  # noqa: BLE001 - what the test looks at
                out["raised"] = e
    t = threading.Thread(target=reaper)
    t.start()
    try:
        assert held.wait(10)
        reaped, handed = eng.reaped, eng.handed
        reqs = [eng.submit(False, fd, b.ctypes.data, K, i * K, b, lambda n, t0, t1: n)
                for i, b in enumerate(bufs)]
        assert all(r is not None for r in reqs)
        reqs[0].add_done_callback(lambda r: (_ for _ in ()).throw(Escape("cb")))
        go.set()
        t.join(20)
        assert isinstance(out.get("raised"), Escape)
        assert all(requests.Request.done(r) for r in reqs)
        assert [r.wait() for r in reqs] == [K, K, K]
        assert eng.reaped - reaped == 3 and eng.handed - handed < 3
        assert "Escape" in eng.last_error
        assert eng.in_flight == 0
    finally:
        go.set()
        t.join(20)
        os.close(fd)


def test_the_reaper_lives_on_after_a_callback_escapes(tmp_path):
    """A callback that lets a BaseException escape on the reaper thread neither kills it
    nor strands the read (``aio_cases``)."""
    path, fd = _direct_file(tmp_path, "reaper")
    try:
        reaper_lives_on_after_a_callback_escapes(linux_aio.engine(), fd)
        assert linux_aio.engine()._reaper.is_alive()
    finally:
        os.close(fd)
