"""Requests: wait/done/exception, waitall/waitany, the no-op request, CHEMIO_SYNC."""
import threading
import time

import pytest

import chemio_py as cio
from chemio_py.runtime import pool, requests


class Boom(Exception):
    pass


def test_completed_noop():
    r = cio.completed(42)
    assert r.done() and r.wait() == 42 and r.exception() is None
    assert cio.waitall([r, cio.completed()]) == [42, None]
    assert cio.waitany([r]) == (0, 42)


def test_original_exception_at_wait():
    err = Boom("from the pool")

    def fail():
        raise err
    r = pool.submit(fail)
    with pytest.raises(Boom) as ei:
        r.wait()
    assert ei.value is err
    assert r.done() and r.exception() is err


def test_waitall_waits_for_every_request_then_raises_first_error():
    finished = []

    def slow(i):
        time.sleep(0.05)
        finished.append(i)
        return i

    def fail():
        raise Boom("x")
    reqs = [pool.submit(fail)] + [pool.submit(slow, i) for i in range(4)]
    with pytest.raises(Boom):
        cio.waitall(reqs)
    assert sorted(finished) == [0, 1, 2, 3]
    assert cio.waitall(reqs[1:]) == [0, 1, 2, 3]


def test_waitany_returns_first_complete():
    gate = threading.Event()
    blocked = pool.submit(gate.wait)
    quick = pool.submit(lambda: "fast")
    i, val = cio.waitany([blocked, quick])
    assert (i, val) == (1, "fast")
    gate.set()
    assert blocked.wait() is True


def test_wait_timeout():
    gate = threading.Event()
    r = pool.submit(gate.wait)
    with pytest.raises(TimeoutError):
        r.wait(timeout=0.01)
    assert not r.done()
    gate.set()
    r.wait()


def test_sync_mode_completes_before_returning():
    cio.configure(sync=True)
    try:
        ran_in = []
        r = pool.submit(lambda: ran_in.append(threading.current_thread().name))
        assert r.done() and ran_in == [threading.current_thread().name]
        r2 = pool.submit(lambda: (_ for _ in ()).throw(Boom("late")))
        assert r2.done()
        with pytest.raises(Boom):
            r2.wait()
    finally:
        cio.configure(sync=None)


def test_pool_is_bounded_by_io_threads():
    cio.configure(io_threads=3)
    try:
        active, peak, lock = [0], [0], threading.Lock()

        def work():
            with lock:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            time.sleep(0.02)
            with lock:
                active[0] -= 1
        cio.waitall([pool.submit(work) for _ in range(12)])
        assert peak[0] == 3
    finally:
        cio.configure(io_threads=None)


def test_gather_combines_and_cannot_be_cancelled():
    gate = threading.Event()
    parts = [pool.submit(gate.wait), pool.submit(lambda: 1)]
    after = []
    g = requests.gather(parts, value="all", then=lambda: after.append(True))
    assert g.cancel() is False and not g.done()
    gate.set()
    assert g.wait() == "all" and after == [True]
    empty = requests.gather([], value=5)
    assert empty.done() and empty.wait() == 5

    def fail():
        raise Boom("part")
    bad = requests.gather([pool.submit(fail), pool.submit(lambda: 2)])
    with pytest.raises(Boom):
        bad.wait()


def test_cancel_before_start():
    cio.configure(io_threads=1)
    try:
        gate = threading.Event()
        blocker = pool.submit(gate.wait)
        queued = pool.submit(lambda: "ran")
        assert queued.cancel() is True and queued.done()
        with pytest.raises(requests.CancelledError):
            queued.wait()
        gate.set()
        blocker.wait()
        assert blocker.cancel() is False
    finally:
        cio.configure(io_threads=None)


def test_queued_counts_requests_not_yet_picked_up():
    cio.configure(io_threads=1)
    try:
        gate, started = threading.Event(), threading.Event()
        blocker = pool.submit(lambda: (started.set(), gate.wait()))
        assert started.wait(10)                # the single thread has taken it
        waiting = [pool.submit(lambda: None) for _ in range(3)]
        assert pool.queued() == 3
        gate.set()
        cio.waitall([blocker, *waiting])
        assert pool.queued() == 0
    finally:
        cio.configure(io_threads=None)
