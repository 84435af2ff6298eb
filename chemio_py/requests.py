"""Asynchronous requests: ``Request``, ``waitall``, ``waitany`` and the I/O thread pool.

Background I/O runs on a bounded pool of ``CHEMIO_IO_THREADS`` threads that call
GIL-releasing positioned I/O. ``CHEMIO_SYNC=1`` runs every request in the caller before the
call returns (for debugging); errors still surface at ``wait()`` in both modes.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
from typing import Any, Callable, Iterable, Sequence

from . import config

_pool_lock = threading.Lock()
_pool: list[cf.ThreadPoolExecutor] = []
_sync_mode: list[bool] = []


def _get_pool() -> cf.ThreadPoolExecutor:
    with _pool_lock:
        if not _pool:
            _pool.append(cf.ThreadPoolExecutor(max_workers=config.get("io_threads"),
                                               thread_name_prefix="chemio-io"))
        return _pool[0]


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


def _after_fork_in_child() -> None:
    # Threads do not survive fork: the child starts with no pool of its own.
    _pool.clear()
    _sync_mode.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Request:
    """A pending (or finished) operation.

    ``wait(timeout)`` returns the result or raises the operation's original exception;
    ``done()`` is a non-blocking probe that stays True once complete.
    """

    __slots__ = ("_future", "_value", "_stats", "__weakref__")

    def __init__(self, future: cf.Future | None = None, value: Any = None, stats: Any = None):
        self._future = future
        self._value = value
        self._stats = stats

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def wait(self, timeout: float | None = None) -> Any:
        f = self._future
        if f is None:
            return self._value
        if not f.done():
            t0 = time.perf_counter()
            try:
                cf.wait((f,), timeout=timeout)
            finally:
                if self._stats is not None:
                    self._stats.waited(time.perf_counter() - t0)
            if not f.done():
                raise TimeoutError(f"request not complete after {timeout} s")
        return f.result()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error the operation raised (waiting for it), or None."""
        if self._future is None:
            return None
        cf.wait((self._future,), timeout=timeout)
        if not self._future.done():
            raise TimeoutError(f"request not complete after {timeout} s")
        return self._future.exception()

    def cancel(self) -> bool:
        """Cancel the operation if it has not started; True if it will not run."""
        return self._future is not None and self._future.cancel()

    def add_done_callback(self, fn: Callable[["Request"], Any]) -> None:
        if self._future is None:
            fn(self)
        else:
            self._future.add_done_callback(lambda _f: fn(self))

    def __repr__(self) -> str:
        return f"<Request {'done' if self.done() else 'pending'}>"


def completed(value: Any = None) -> Request:
    """A request that is already complete with ``value`` (nothing to wait for)."""
    return Request(None, value)


def submit(fn: Callable[..., Any], *args: Any, stats: Any = None) -> Request:
    """Run ``fn(*args)`` on the I/O pool (or now, in sync mode) and return its Request."""
    if sync_mode():
        f: cf.Future = cf.Future()
        try:
            f.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - delivered at wait()
            f.set_exception(e)
        return Request(f, stats=stats)
    return Request(_get_pool().submit(fn, *args), stats=stats)


def waitall(reqs: Iterable[Request], timeout: float | None = None) -> list:
    """Wait for every request; return their results, or raise the first error after all end."""
    reqs = list(reqs)
    deadline = None if timeout is None else time.monotonic() + timeout
    results, first_error = [], None
    for r in reqs:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            results.append(r.wait(left))
        except TimeoutError:
            raise
        except BaseException as e:  # noqa: BLE001 - re-raised below, original object
            results.append(None)
            if first_error is None:
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
    futures = {r._future: i for i, r in enumerate(reqs)}
    done, _ = cf.wait(list(futures), timeout=timeout, return_when=cf.FIRST_COMPLETED)
    if not done:
        raise TimeoutError(f"no request complete after {timeout} s")
    i = min(futures[f] for f in done)
    return i, reqs[i].wait()


class Pending:
    """The outstanding requests of one file, so that closing it can wait for them."""

    __slots__ = ("_reqs", "_lock")

    def __init__(self):
        self._reqs: set[Request] = set()
        self._lock = threading.Lock()

    def add(self, req: Request) -> Request:
        if req.done():
            return req
        with self._lock:
            self._reqs.add(req)
        req.add_done_callback(self._discard)
        return req

    def _discard(self, req: Request) -> None:
        with self._lock:
            self._reqs.discard(req)

    def __len__(self) -> int:
        with self._lock:
            return len(self._reqs)

    def drain(self) -> BaseException | None:
        """Wait for all outstanding requests; return the first error (not raised)."""
        with self._lock:
            reqs = list(self._reqs)
        first = None
        for r in reqs:
            e = r.exception()
            if e is not None and first is None:
                first = e
        return first
