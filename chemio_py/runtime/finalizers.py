"""Where a finalizer's blocking work runs: now, or on the closer thread.

A ``__del__`` or ``weakref.finalize`` callback runs on whichever thread the garbage collector
or the last ``del`` happens to be on, at any allocation, possibly while that thread holds a
lock of this library (or of ``threading``, ``queue``, ``logging``, the import system, zarr,
h5py) that the close needs, or while another thread holding it waits for this one. Closing
there can deadlock. ``close_later(job)`` therefore runs ``job`` at once only when no frame of
such a module is on this thread's stack (user code dropped the object: ``del f`` or
``gc.collect()`` closes it before returning, as h5py does), and otherwise hands it to one
closer thread through a ``SimpleQueue`` (whose ``put`` takes no lock a finalizer could
meet). ``settle()`` waits until everything handed over so far has run; interpreter exit
settles first, what is still queued then runs in the exiting thread, and from then on
finalizers close where they are.
"""
from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
from typing import Callable

# Modules whose frames may hold a lock that a close takes, or that wait for a thread that
# would need it. The bare loops at the bottom of a thread (NEUTRAL) hold nothing.
LOCKING = ("chemio_py", "threading", "queue", "concurrent.futures", "logging", "importlib",
           "zarr", "numcodecs", "h5py")
NEUTRAL = {("threading", "_bootstrap"), ("threading", "_bootstrap_inner"),
           ("threading", "run"), ("concurrent.futures.thread", "_worker")}
EXIT_WAIT = 60.0        # seconds cleanup and exit wait for the closer (once: not again)

_jobs: queue.SimpleQueue = queue.SimpleQueue()
_closer: list = [None, -1]          # the thread and the pid that started it
_starting = threading.Lock()
_exiting = [False]                  # exit has settled the closer: close where dropped
_stuck = [False]                    # a settle gave up waiting for the closer


def close_later(job: Callable[[], object]) -> None:
    """Run a finalizer's ``job`` (drain, close) now if this thread is in user code, else on
    the closer thread; errors are swallowed (a finalizer has nobody to tell)."""
    try:
        frame = sys._getframe(2)        # the frame the finalizer interrupted
    except ValueError:                  # none: the interpreter is tearing down
        frame = None
    if _exiting[0] or sys.is_finalizing() or _safe_here(frame):
        _quietly(job)               # (at exit no new thread would run: close here)
        return
    _jobs.put(job)
    _start_closer(frame)


def settle(timeout: float | None = None) -> bool:
    """Wait until every job handed to the closer before this call has run (True), or
    ``timeout`` seconds have passed (False). With no closer running here, or called by a
    job on the closer itself, runs them now."""
    if not _closer_alive() or threading.current_thread() is _closer[0]:
        _run_queued()
        return True
    done = threading.Event()
    _jobs.put(done.set)
    if done.wait(timeout):
        return True
    _stuck[0] = True                    # exit does not wait for it a second time
    return False


def _safe_here(frame) -> bool:
    """True when closing on this thread now cannot meet a lock held below it."""
    outside_loops = threading.current_thread() is threading.main_thread()
    while frame is not None:
        mod = frame.f_globals.get("__name__", "")
        if (mod, frame.f_code.co_name) not in NEUTRAL:
            if mod.startswith(LOCKING):
                return False
            outside_loops = True
        frame = frame.f_back
    return outside_loops        # a thread still starting (or ending) holds threading's locks


def _closer_alive() -> bool:
    t, pid = _closer
    return t is not None and pid == os.getpid() and t.is_alive()


def _start_closer(frame) -> None:
    # Starting a thread takes threading's own locks: never from inside threading's code.
    if _closer_alive() or not _starting.acquire(blocking=False):
        return
    try:
        while frame is not None:
            if frame.f_globals.get("__name__", "") == "threading" and \
                    ("threading", frame.f_code.co_name) not in NEUTRAL:
                return
            frame = frame.f_back
        t = threading.Thread(target=_work, name="chemio-closer", daemon=True)
        _closer[:] = [t, os.getpid()]
        t.start()
    except RuntimeError:                # interpreter shutdown: exit runs the queue
        _closer[:] = [None, -1]
    finally:
        _starting.release()


def _work() -> None:
    while True:
        job = _jobs.get()
        if job is None:
            return
        _quietly(job)


def _quietly(job: Callable[[], object]) -> None:
    try:
        job()
    except Exception:
        pass


def _run_queued() -> None:
    while True:
        try:
            job = _jobs.get_nowait()
        except queue.Empty:
            return
        if job is not None:
            _quietly(job)


def _settle_at_exit() -> None:
    """Let the closer finish what it was given (a job stuck for EXIT_WAIT seconds is left
    with a message), then run in this thread whatever is still queued."""
    _exiting[0] = True
    if _closer_alive():
        _jobs.put(None)
        t = _closer[0]
        t.join(0.0 if _stuck[0] else EXIT_WAIT)
        if t.is_alive():
            sys.stderr.write("chemio_py: at exit, the close of a garbage-collected file had "
                             "not ended (a call stuck in the kernel?); leaving without it\n")
            return
    _closer[:] = [None, -1]
    _run_queued()


def _after_fork_in_child() -> None:
    # The closer did not survive the fork; what the parent queued is the parent's to close.
    global _jobs, _starting
    _jobs = queue.SimpleQueue()
    _starting = threading.Lock()
    _closer[:] = [None, -1]
    _exiting[0] = _stuck[0] = False


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_settle_at_exit)
