"""Finalizers close where they cannot deadlock: at once in user code, else on the closer
thread (``chemio_py.runtime.finalizers``)."""
import gc
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.runtime import finalizers, pool

from conftest import in_forked_child, usable_backends
from chemio_py import backends


ARRAY_BACKENDS = [b for b in usable_backends(backends.ArrayBackend) if b != "auto"]


def _files(d) -> list[str]:
    return sorted(n for _, _, names in os.walk(d) for n in names)


@pytest.mark.parametrize("backend", ARRAY_BACKENDS)
def test_an_array_dropped_in_user_code_is_closed_when_del_returns(backend, tmp_path):
    """As with h5py: ``del a``, then ``gc.collect()`` (an array is in a reference cycle with
    what ``cio.cleanup`` holds of it) closes it before returning."""
    a = cio.DiskArray.create("u", (16, 16), "f8", backend=backend, path=tmp_path)
    a[...] = 1.0
    st = a.store
    del a
    gc.collect()
    assert st.closed


@pytest.mark.parametrize("backend", ARRAY_BACKENDS)
def test_an_array_dropped_inside_the_library_closes_on_the_closer_thread(backend, tmp_path):
    """A pool thread (library frames below it, perhaps holding a lock the close needs) that
    drops the last reference only hands the close over; ``settle`` waits for it."""
    a = cio.DiskArray.create("p", (16, 16), "f8", backend=backend, path=tmp_path)
    a[...] = np.arange(256.0).reshape(16, 16)
    st = a.store
    box = [a]
    del a
    hold = threading.Event()

    def drop() -> bool:
        finalizers.close_later(lambda: hold.wait(30))   # the closer is busy meanwhile
        box.clear()
        gc.collect()                # the handle's finalizer runs here, on a pool thread
        return st.closed

    closed_on_pool_thread = pool.submit(drop).wait()
    hold.set()
    assert finalizers.settle(30)
    assert not closed_on_pool_thread and st.closed


def test_a_finalizer_never_waits_for_a_lock_whose_holder_waits_for_it(tmp_path):
    """The deadlock class: one library thread holds a lock the close needs (here the read
    mappings' lock, which every local array's close takes) and waits for another; that
    other drops an array. Before, its finalizer blocked on the lock (the holder gave up
    after 5 s here); now the close waits on the closer thread and the holder is answered."""
    from chemio_py.backends.local import mappings
    a = cio.DiskArray.create("m", (64, 64), "f8", backend="local", path=tmp_path)
    a[...] = 1.0
    st = a.store
    box = [a]
    del a
    dropped = threading.Event()

    def holder() -> bool:
        with mappings.maps_lock:
            pool.submit(dropper)
            return dropped.wait(5)

    def dropper() -> None:
        box.clear()
        gc.collect()                # the array's finalizer runs here
        dropped.set()

    assert pool.submit(holder).wait(), "the dropping thread blocked in the finalizer"
    assert finalizers.settle(30) and st.closed


def test_the_closer_thread_runs_jobs_in_order_and_settle_waits_for_them():
    ran: list = []
    gate = threading.Event()
    r = pool.submit(lambda: [finalizers.close_later(lambda i=i: ran.append(
        (i, threading.current_thread().name))) for i in range(5)] and gate.set())
    r.wait()
    assert gate.wait(5) and finalizers.settle(30)
    assert ran == [(i, "chemio-closer") for i in range(5)]


def test_a_close_that_settles_on_the_closer_thread_does_not_wait_for_itself():
    """``cio.cleanup()`` (which settles) called by a job on the closer runs what is queued."""
    ran: list = []
    pool.submit(lambda: (finalizers.close_later(lambda: ran.append(finalizers.settle(5))),
                         finalizers.close_later(lambda: ran.append("after")))).wait()
    assert finalizers.settle(30)
    assert ran == ["after", True]          # the queued close ran inside the settle


def test_a_failing_close_on_the_closer_thread_stops_nothing_after_it():
    ran: list = []
    pool.submit(lambda: (finalizers.close_later(lambda: 1 / 0),
                         finalizers.close_later(lambda: ran.append(1)))).wait()
    assert finalizers.settle(30) and ran == [1]


def test_a_thread_still_starting_does_not_close_there():
    """The garbage collector may run in a thread's bootstrap, before its target, while
    the starting thread waits for it: threading's own frames only, so the close waits."""
    where: list = []
    assert finalizers._safe_here(sys._getframe())         # this test's own frames: user code
    done = threading.Event()

    def target():
        bottom = sys._getframe().f_back     # threading's run / _bootstrap_inner
        where.append(finalizers._safe_here(bottom))
        done.set()
    t = threading.Thread(target=target)
    t.start()
    t.join(10)
    assert done.is_set() and where == [False]


EXIT_DROP = """
import gc, sys, time, chemio_py as cio
from chemio_py.runtime import finalizers, pool
a = cio.DiskArray.create("x", (64, 64), "f8", backend={backend!r})
a[...] = 1.0
box = [a]
del a
st = box[0].store
slow = lambda: time.sleep(0.5)                  # keeps the closer busy meanwhile
pool.submit(lambda: (finalizers.close_later(slow), box.clear(), gc.collect())).wait()
print("dropped", st.closed, flush=True)        # and the process exits at once
"""


@pytest.mark.parametrize("backend", ["local", "zarr"])
def test_a_close_handed_over_just_before_exit_still_happens(backend, tmp_path):
    """Interpreter exit settles the closer: the dropped scratch array is closed and
    removed, nothing is printed to stderr."""
    d = tmp_path / "scratch"
    d.mkdir()
    r = subprocess.run([sys.executable, "-c", EXIT_DROP.format(backend=backend)],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "CHEMIO_SCRATCH": str(d)})
    assert r.returncode == 0 and "dropped False" in r.stdout, (r.stdout, r.stderr)
    assert r.stderr == ""
    assert _files(d) == []


def test_a_stuck_close_delays_the_exit_once_and_says_so():
    """A close that never ends (a call stuck in the kernel) holds ``cio.cleanup()`` for
    ``EXIT_WAIT`` seconds, not the exit for ever, and the exit does not wait again."""
    code = ("import threading, chemio_py as cio\n"
            "from chemio_py.runtime import finalizers, pool\n"
            "finalizers.EXIT_WAIT = 1.0\n"
            "pool.submit(lambda: finalizers.close_later(threading.Event().wait)).wait()\n"
            "print('handed', flush=True)\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "handed" in r.stdout, r.stderr
    assert time.monotonic() - t0 < 20
    assert r.stderr.count("had not ended") == 1, r.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_closes_on_its_own_closer(tmp_path):
    """The closer thread does not survive fork: the child starts its own when it needs one,
    and the parent's queue is the parent's."""
    pool.submit(lambda: finalizers.close_later(lambda: None)).wait()
    assert finalizers.settle(30)

    def child() -> bool:
        ran: list = []
        pool.submit(lambda: finalizers.close_later(
            lambda: ran.append(threading.current_thread().name))).wait()
        return finalizers.settle(30) and ran == ["chemio-closer"]
    in_forked_child(child)
