"""Asynchronous requests: ``Request``, ``waitall``, ``waitany``, ``gather`` and the I/O pool.

Background I/O runs on a bounded pool of ``CHEMIO_IO_THREADS`` threads that call
GIL-releasing positioned I/O. The pool is a C ``SimpleQueue`` feeding long-lived threads and
a request is completed by releasing a lock: a few microseconds per request, so that many
small requests in flight still pay off. ``CHEMIO_SYNC=1`` runs every request in the caller
before the call returns (for debugging); errors surface at ``wait()`` in both modes.
"""
from __future__ import annotations

import atexit
import collections
import os
import queue
import threading
import time
from typing import Any, Callable, Iterable, Sequence

from . import config
from .errors import CancelledError, UnobservedIOError

_PENDING, _RUNNING, _DONE, _CANCELLED = 0, 1, 2, 3
_state_lock = threading.Lock()      # guards pending -> running / cancelled transitions


class Request:
    """A pending (or finished) operation.

    ``wait(timeout)`` returns the result or raises the operation's original exception;
    ``done()`` is a non-blocking probe that stays True once complete.
    """

    __slots__ = ("_lock", "_state", "_value", "_exc", "_stats", "_callbacks", "_seen",
                 "__weakref__")

    def __init__(self, stats: Any = None):
        self._lock = threading.Lock()
        self._lock.acquire()            # released when the operation completes
        self._state = _PENDING
        self._value = None
        self._exc: BaseException | None = None
        self._stats = stats
        self._callbacks: list | None = None
        self._seen = False              # its error reached the caller (wait/exception)

    # -------------------------------------------------------------- completion
    def _finish(self, value: Any = None, exc: BaseException | None = None) -> None:
        self._value = value
        self._exc = exc
        with _state_lock:
            self._state = _DONE
            callbacks, self._callbacks = self._callbacks, None
        self._lock.release()
        if callbacks:
            for fn in callbacks:
                _run_callback(fn, self)

    def set_result(self, value: Any = None) -> None:
        """Complete the request with ``value`` (for a backend's native asynchronous path,
        which creates the ``Request`` and completes it from its own thread)."""
        self._finish(value)

    def set_exception(self, exc: BaseException) -> None:
        """Complete the request with the error ``exc`` (raised by ``wait()``)."""
        self._finish(None, exc)

    def complete_with(self, fn: Callable[..., Any], *args: Any) -> None:
        """Complete the request with ``fn(*args)``, or with the error it raises (a native
        path's continuation, e.g. ``then(count, t0, t1)``)."""
        try:
            value = fn(*args)
        except BaseException as e:  # noqa: BLE001 - delivered at wait()
            self._finish(None, e)
        else:
            self._finish(value)

    def _run(self, fn: Callable[..., Any], args: tuple) -> None:
        with _state_lock:
            if self._state != _PENDING:
                return                  # cancelled before it started
            self._state = _RUNNING
        self.complete_with(fn, *args)

    # -------------------------------------------------------------- public
    def done(self) -> bool:
        return self._state >= _DONE

    def _block(self, timeout: float | None) -> None:
        if self._state >= _DONE:
            return
        t0 = time.perf_counter()
        ok = self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout))
        if ok:
            self._lock.release()        # let any other waiter through
        if self._stats is not None:
            self._stats.waited(time.perf_counter() - t0)
        if not ok:
            raise TimeoutError(f"request not complete after {timeout} s")

    def wait(self, timeout: float | None = None) -> Any:
        self._block(timeout)
        if self._exc is not None:
            self._seen = True
            raise self._exc
        return self._value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error the operation raised (waiting for it), or None."""
        self._block(timeout)
        self._seen = True
        return self._exc

    @property
    def error(self) -> BaseException | None:
        """The error of a completed request, else None; reading it does not count as
        seeing it (a file's close still reports it)."""
        return self._exc if self._state >= _DONE else None

    def observed(self) -> None:
        """Mark this request's error as delivered to the user (a pipeline that raised it)."""
        self._seen = True

    def cancel(self) -> bool:
        """Cancel the operation if it has not started; True if it will not run."""
        with _state_lock:
            if self._state != _PENDING:
                return self._state == _CANCELLED
            self._exc = CancelledError("request was cancelled before it ran")
            self._state = _CANCELLED
            callbacks, self._callbacks = self._callbacks, None
        self._lock.release()
        for fn in callbacks or ():
            _run_callback(fn, self)
        return True

    def add_done_callback(self, fn: Callable[["Request"], Any]) -> None:
        """Call ``fn(request)`` when complete (at once, in this thread, if it already is)."""
        with _state_lock:
            if self._state < _DONE:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        _run_callback(fn, self)

    def __repr__(self) -> str:
        state = {0: "pending", 1: "running", 2: "done", 3: "cancelled"}[self._state]
        return f"<Request {state}>"


def _uninterrupted(step: Callable[[], bool]) -> None:
    """Call ``step()`` until it returns True; an interrupt (KeyboardInterrupt, an exception
    from a signal handler) meanwhile is re-raised once it has."""
    interrupt = None
    while True:
        try:
            if step():
                break
        except BaseException as e:  # noqa: BLE001 - re-raised below
            if interrupt is None:
                interrupt = e
    if interrupt is not None:
        raise interrupt


def settle(reqs: Iterable[Request]) -> None:
    """Wait until every request in ``reqs`` has ended, whatever happens meanwhile.

    An interrupt during the wait does not cut it short: no caller may get control back
    while I/O on its buffers is in flight. The interrupt is re-raised once every request
    has ended. Outcomes are not looked at (errors stay unobserved for their owner).
    """
    reqs = list(reqs)

    def ended() -> bool:
        for r in reqs:
            r._block(None)
        return True
    _uninterrupted(ended)


class TaskRun:
    """Tasks ``fn(task)`` of one operation, drained by ``streams`` pool threads at once.

    ``request`` completes when every task has run (with the first error, if one failed:
    the remaining tasks are then dropped). Only pool threads run tasks, so an interrupt of
    the caller never lands inside a backend call; ``stop()`` drops the tasks not started
    and waits, whatever happens meanwhile, until none is running.
    """

    __slots__ = ("_fn", "_tasks", "_lock", "_active", "_error", "request")

    def __init__(self, fn: Callable[[Any], Any], tasks: Iterable[Any], stats: Any = None):
        self._fn = fn
        self._tasks = collections.deque(tasks)
        self._lock = threading.Lock()
        self._active = 0
        self._error: BaseException | None = None
        self.request = Request(stats)
        self.request._state = _RUNNING          # under way: it cannot be cancelled

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
                if self.request._state < _DONE:
                    self.request._finish(None, self._error)
                return

    def stop(self) -> None:
        """Drop the tasks not started; return once none is running, whatever happens
        meanwhile (an interrupt is re-raised after). The caller takes no lock here: an
        interrupt inside a lock protocol could leave it broken for the pool threads."""
        _uninterrupted(self._idle)

    def _idle(self) -> bool:
        self._tasks.clear()
        if self._active:
            time.sleep(0.0005)
            return False
        return True

    def run(self, streams: int) -> None:
        """Start the tasks and wait for them. On any exception (an interrupt, a task's
        error) the tasks are stopped before it propagates: the caller never gets control
        back while a task may still touch its buffers."""
        try:
            self.start(streams)
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


def _run_callback(fn: Callable[[Request], Any], req: Request) -> None:
    try:
        fn(req)
    except Exception:  # a failing callback must not kill an I/O thread
        import traceback
        traceback.print_exc()


class _Pool:
    """Long-lived I/O threads fed by a SimpleQueue of (request, fn, args)."""

    def __init__(self, nthreads: int):
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._work, name=f"chemio-io_{i}", daemon=True)
                        for i in range(nthreads)]
        for t in self.threads:
            t.start()

    def _work(self) -> None:
        get = self.queue.get
        while True:
            item = get()
            if item is None:
                return
            item[0]._run(item[1], item[2])

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
    with _pool_lock:
        if not _pool:
            _pool.append(_Pool(config.get("io_threads")))
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
    # Threads do not survive fork: the child starts with no pool of its own.
    _pool.clear()
    _sync_mode.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(reset_pool)


def completed(value: Any = None) -> Request:
    """A request that is already complete with ``value`` (nothing to wait for)."""
    r = Request()
    r._finish(value)
    return r


def submit(fn: Callable[..., Any], *args: Any, stats: Any = None) -> Request:
    """Run ``fn(*args)`` on the I/O pool (or now, in sync mode) and return its Request."""
    r = Request(stats)
    if sync_mode():
        r._run(fn, args)
    else:
        _get_pool().queue.put((r, fn, args))
    return r


def gather(reqs: Sequence[Request], value: Any = None, then: Callable[[], Any] | None = None,
           stats: Any = None) -> Request:
    """One request that completes when all of ``reqs`` have.

    It fails with the first error among them; otherwise ``then()`` runs (if given, in the
    thread that completed the last one) and the request completes with ``value``.
    """
    out = Request(stats)
    out._state = _RUNNING           # its parts are already under way: it cannot be cancelled
    if not reqs:
        try:
            if then is not None:
                then()
        except BaseException as e:  # noqa: BLE001 - delivered at wait()
            out._finish(None, e)
        else:
            out._finish(value)
        return out
    lock = threading.Lock()
    state: dict[str, Any] = {"left": len(reqs), "error": None}

    def one_done(r: Request) -> None:
        with lock:
            if r._exc is not None:
                r._seen = True          # the gathered request carries it
                if state["error"] is None:
                    state["error"] = r._exc
            state["left"] -= 1
            if state["left"]:
                return
        if state["error"] is None and then is not None:
            try:
                then()
            except BaseException as e:  # noqa: BLE001 - delivered at wait()
                state["error"] = e
        out._finish(None if state["error"] else value, state["error"])

    for r in reqs:
        r.add_done_callback(one_done)
    return out


def waitall(reqs: Iterable[Request], timeout: float | None = None) -> list:
    """Wait for every request; return their results, or raise the first error after all end."""
    reqs = list(reqs)
    deadline = None if timeout is None else time.monotonic() + timeout
    results: list[Any] = []
    first_error: BaseException | None = None
    for r in reqs:
        left = None if deadline is None else deadline - time.monotonic()
        e = r.exception(left)
        results.append(r._value)
        if e is not None and first_error is None:
            first_error = e
    if first_error is not None:
        raise first_error
    return results


def waitany(reqs: Sequence[Request], timeout: float | None = None) -> tuple[int, Any]:
    """Wait until one request is complete; return ``(index, result)`` (raises its error)."""
    if not reqs:
        raise ValueError("waitany() needs at least one request")
    for i, r in enumerate(reqs):
        if r.done():
            return i, r.wait()
    event = threading.Event()
    for r in reqs:
        r.add_done_callback(lambda _r: event.set())
    if not event.wait(timeout):
        raise TimeoutError(f"no request complete after {timeout} s")
    for i, r in enumerate(reqs):
        if r.done():
            return i, r.wait()
    raise AssertionError("unreachable: an event was set with no request done")  # pragma: no cover


class Pending:
    """The outstanding requests of one file, so that closing it can wait for them.

    A request that failed and whose error nobody looked at (``wait()``/``exception()``)
    stays here after it completes: the file's ``flush()``/``close()`` reports it once.
    """

    __slots__ = ("_reqs", "_lock", "_pid")

    def __init__(self) -> None:
        self._reqs: list[Request] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def add(self, req: Request) -> Request:
        with self._lock:
            self._reqs.append(req)
            if len(self._reqs) > 64:
                self._reqs = [r for r in self._reqs if r._state < _DONE or _unseen_error(r)]
        return req

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for r in self._reqs if r._state < _DONE)

    def drain(self) -> list[BaseException]:
        """Wait for all outstanding requests (see ``settle``); return the errors nobody
        has seen, each only once (they count as seen from now on)."""
        with self._lock:
            reqs, self._reqs = self._reqs, []
        if self._pid != os.getpid():
            return []           # a forked child: the I/O was the parent's, its threads are not here
        try:
            settle(reqs)
        except BaseException:
            with self._lock:                     # an interrupt: keep them for the next drain
                self._reqs[:0] = [r for r in reqs if _unseen_error(r)]
            raise
        errors: list[BaseException] = []
        for r in reqs:
            if _unseen_error(r) and r._exc is not None:     # (_unseen_error checks it too)
                r._seen = True
                errors.append(r._exc)
        return errors


def _unseen_error(r: Request) -> bool:
    return (r._state >= _DONE and r._exc is not None and not r._seen
            and not isinstance(r._exc, CancelledError))


def failure(path: str, errors: list[BaseException]) -> BaseException | None:
    """The error a file's ``flush()``/``close()`` raises for ``errors`` from ``drain()``."""
    if not errors:
        return None
    err = UnobservedIOError(path, errors)
    err.__cause__ = errors[0]
    return err
