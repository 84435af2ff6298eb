"""The I/O pool: long-lived threads fed by one C ``SimpleQueue`` that run requests
(``submit``) and the tasks of one operation (``TaskRun``), and the ``sync`` mode that runs
them in the caller instead.

``configure(io_threads=)`` starts a new pool of that size and ``configure(sync=)`` or
``CHEMIO_SYNC=1`` switches modes (both through ``config.on_change``); a forked child starts
its own pool on first use. Requests are ``requests.Request``; a pool thread completes them.
"""
from __future__ import annotations

import atexit
import collections
import os
import queue
import threading
import time
from typing import Any, Callable, Iterable

from chemio_py.runtime import config
from chemio_py.runtime.requests import (
    DONE,
    RUNNING,
    Request,
    main_ident,
    shield_state,
    uninterrupted,
)


class TaskRun:
    """Tasks ``fn(task)`` of one operation, drained by ``streams`` pool threads at once.

    ``request`` completes when every task has run (with the first error, if one failed:
    the remaining tasks are then dropped). Only pool threads run tasks (unless ``run(...,
    here=True)``), so an interrupt of the caller never lands inside a backend call;
    ``stop()`` drops the tasks not started and waits, whatever happens meanwhile, until
    none is running.
    """

    __slots__ = ("_fn", "_tasks", "_lock", "_active", "_error", "request")

    def __init__(self, fn: Callable[[Any], Any], tasks: Iterable[Any], stats: Any = None):
        self._fn = fn
        self._tasks = collections.deque(tasks)
        self._lock = threading.Lock()
        self._active = 0
        self._error: BaseException | None = None
        self.request = Request(stats)
        self.request._state = RUNNING          # under way: it cannot be cancelled

    def start(self, streams: int) -> Request:
        """Put ``streams`` drainers on the pool (in sync mode: run everything now)."""
        if not self._tasks:
            self.request._finish(None)
            return self.request
        if sync_mode():
            self._drain()
            return self.request
        try:
            put = _get_pool().queue.put
            for _ in range(max(1, streams)):
                put((_NO_REQUEST, self._drain, ()))
        except BaseException:
            self.stop()
            raise
        return self.request

    def _drain(self) -> None:
        fn, tasks, lock = self._fn, self._tasks, self._lock
        while True:
            with lock:
                self._active += 1               # before the pop: stop() sees it running
                try:
                    task = tasks.popleft()
                except IndexError:
                    self._active -= 1
                    return
            err = None
            try:
                fn(task)
            except BaseException as e:  # noqa: BLE001 - delivered through the request
                err = e
            with lock:
                self._active -= 1
                if err is not None:
                    tasks.clear()
                    if self._error is None:
                        self._error = err
                last = self._active == 0 and not tasks
            if last:
                if self.request._state < DONE:
                    self.request._finish(None, self._error)
                return

    def stop(self) -> None:
        """Drop the tasks not started; return once none is running, whatever happens
        meanwhile (an interrupt is re-raised after). The caller takes no lock here: an
        interrupt inside a lock protocol could leave it broken for the pool threads."""
        uninterrupted(self._idle)

    def _idle(self) -> bool:
        self._tasks.clear()
        if self._active:
            time.sleep(0.0005)
            return False
        return True

    def run(self, streams: int, here: bool = False) -> None:
        """Start the tasks and wait for them; ``here``: this thread drains them too (from
        a pool thread, or where the copy itself is the work: it never waits for a pool
        that is busy). On any exception (an interrupt, a task's error) the tasks are
        stopped before it propagates: the caller never gets control back while a task may
        still touch its buffers."""
        try:
            self.start(streams)
            if here:
                self._drain()
            self.request.wait()
        except BaseException:
            while True:                 # an interrupt inside stop(): stop again
                try:
                    self.stop()
                    break
                except BaseException:  # noqa: BLE001 - the first error is raised below
                    pass
            raise


class _NoRequest:
    """Stands for the request of a pool item whose function completes its own."""

    __slots__ = ()

    def _run(self, fn: Callable[..., Any], args: tuple) -> None:
        fn(*args)


_NO_REQUEST = _NoRequest()


class _Pool:
    """Long-lived I/O threads fed by a SimpleQueue of (request, fn, args)."""

    def __init__(self, nthreads: int):
        self.finished = 0               # items run (progress, for the wait at exit)
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._work, name=f"chemio-io_{i}", daemon=True)
                        for i in range(nthreads)]

    def start(self) -> None:
        """Start the threads, with no lock held: a new thread may run the garbage collector
        before it signals that it has started, and a finalizer there (a dropped array's
        close) may take any of our locks, so a thread started under one can deadlock
        (seen: the zarr reaper's thread, started under its condition)."""
        for t in self.threads:
            t.start()

    def _work(self) -> None:
        get = self.queue.get
        while True:
            item = get()
            if item is None:
                return
            item[0]._run(item[1], item[2])
            self.finished += 1

    def shutdown(self, wait: bool = True) -> None:
        for _ in self.threads:
            self.queue.put(None)        # after queued work: it still runs
        if wait:
            me = threading.current_thread()
            for t in self.threads:
                if t is not me:
                    t.join()


_pool_lock = threading.Lock()
_pool: list[_Pool] = []
_sync_mode: list[bool] = []


def _get_pool() -> _Pool:
    if _pool:
        return _pool[0]
    made = None
    with _pool_lock:
        if not _pool:
            made = _Pool(config.get("io_threads"))
            _pool.append(made)
    if made is not None:
        made.start()                    # queued work waits the moment until then
    return _pool[0]


def queued() -> int:
    """Requests waiting in the I/O pool's queue (not yet picked up by a thread)."""
    return _pool[0].queue.qsize() if _pool else 0


def sync_mode() -> bool:
    """True when every async call completes before returning (``CHEMIO_SYNC=1``)."""
    if not _sync_mode:
        _sync_mode.append(bool(config.get("sync")))
    return _sync_mode[0]


def reset_pool(wait: bool = True) -> None:
    """Re-read ``io_threads`` and ``sync``: the next request starts a new pool."""
    with _pool_lock:
        old = _pool[:]
        _pool.clear()
        _sync_mode.clear()
    for p in old:
        p.shutdown(wait=wait)


EXIT_STALL = 300.0      # seconds the exit waits for a pool that finishes nothing


def _drain_at_exit() -> None:
    """At interpreter exit the queued work still runs (writes behind land), but a pool
    that finishes nothing for ``EXIT_STALL`` seconds (a call stuck in the kernel, on a hung
    network file system say) no longer holds the exit for ever: it is left behind with a
    message on stderr that says so."""
    with _pool_lock:
        old = _pool[:]
        _pool.clear()
        _sync_mode.clear()
    me = threading.current_thread()
    for p in old:
        p.shutdown(wait=False)
        seen, since = p.finished, time.monotonic()
        while True:
            alive = [t for t in p.threads if t.is_alive() and t is not me]
            if not alive:
                break
            alive[0].join(0.25)
            now = time.monotonic()
            if p.finished != seen:
                seen, since = p.finished, now
            elif now - since > EXIT_STALL:
                import sys
                sys.stderr.write(
                    f"chemio_py: at exit, {len(alive)} I/O thread(s) finished nothing for "
                    f"{EXIT_STALL:g} s (a call stuck in the kernel?); leaving without them: "
                    f"I/O still queued or running was not done\n")
                break


def forget_settings() -> None:
    """Drop the cached sync mode (the next request reads the setting again)."""
    _sync_mode.clear()


def _settings_changed(changes: dict, reset: bool) -> None:
    # configure(io_threads=/sync=) starts a new pool; reset() only drops the cached sync mode.
    if reset:
        forget_settings()
    else:
        reset_pool()


config.on_change(("io_threads", "sync"), _settings_changed)


def _after_fork_in_child() -> None:
    # Threads do not survive fork: the child starts with no pool of its own (and, if the
    # fork came from another thread than the main one, with no shield up).
    _pool.clear()
    _sync_mode.clear()
    shield_state.reset()
    main_ident[0] = threading.main_thread().ident


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_drain_at_exit)


def submit(fn: Callable[..., Any], *args: Any, stats: Any = None) -> Request:
    """Run ``fn(*args)`` on the I/O pool (or now, in sync mode) and return its Request."""
    r = Request(stats)
    if sync_mode():
        r._run(fn, args)
    else:
        _get_pool().queue.put((r, fn, args))
    return r
