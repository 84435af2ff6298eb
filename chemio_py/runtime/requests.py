"""Asynchronous requests: ``Request``, ``NativeRequest``, ``waitall``, ``waitany``, ``gather``.

Background I/O runs on a bounded pool of ``CHEMIO_IO_THREADS`` threads that call
GIL-releasing positioned I/O. The pool is a C ``SimpleQueue`` feeding long-lived threads and
a request is completed by releasing a lock: a few microseconds per request, so that many
small requests in flight still pay off. ``CHEMIO_SYNC=1`` runs every request in the caller
before the call returns (for debugging); errors surface at ``wait()`` in both modes.
A backend that completes requests itself (Linux AIO) makes ``NativeRequest``s.

Interrupts: a signal handler that raises may run between any two bytecodes of the main
thread. ``shield``/``shielded`` let bookkeeping finish whole and raise the handler's
exception after it; ``shielded_start`` also lets a started request reach its owner first;
``settle`` waits for requests whatever happens meanwhile.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterable, Sequence

try:                        # the C module: signal's wrappers convert to enums, 10x slower
    import _signal as _sig  # type: ignore[import-not-found]
except ImportError:         # pragma: no cover - other Pythons
    _sig = signal

from chemio_py.errors import CancelledError, UnobservedIOError

_MOVED_TO_POOL = frozenset({"TaskRun", "submit", "queued", "sync_mode", "reset_pool",
                            "forget_settings"})


def __getattr__(name: str) -> object:
    """The pool's names, found here as before the pool had a module of its own."""
    if name in _MOVED_TO_POOL:
        from chemio_py._imports import moved_name
        return moved_name(__name__, name, "chemio_py.runtime.pool")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_PENDING, RUNNING, DONE, _CANCELLED = 0, 1, 2, 3
POLL = 0.05                 # seconds: a waiter looks at the request's state at least this often
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
            self._state = DONE
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
            self._state = RUNNING
        self.complete_with(fn, *args)

    # -------------------------------------------------------------- public
    def done(self) -> bool:
        return self._state >= DONE

    def _block(self, timeout: float | None) -> None:
        if shield_state.parked:
            raise_parked()              # an interrupt held back while a request started
        if self._state >= DONE:
            return
        t0 = time.perf_counter()
        self._wait_until(None if timeout is None else t0 + max(0.0, timeout))
        if self._stats is not None:
            self._stats.waited(time.perf_counter() - t0)
        if self._state < DONE:
            raise TimeoutError(f"request not complete after {timeout} s")

    def _wait_until(self, end: float | None) -> None:
        """Wait for completion until ``end`` (a ``perf_counter`` time; None: no limit)."""
        lock = self._lock
        while self._state < DONE:
            # the lock opens when the request completes; a waiter takes it and lets the
            # next one through. Waits are slices: if an interrupt kept a waiter from
            # letting the next through, the state still says the request is complete.
            left = POLL if end is None else min(POLL, end - time.perf_counter())
            if left < 0:
                break
            if lock.acquire(timeout=left):
                lock.release()

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
        return self._exc if self._state >= DONE else None

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
            if self._state < DONE:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        _run_callback(fn, self)

    def __repr__(self) -> str:
        state = {0: "pending", 1: "running", 2: "done", 3: "cancelled"}[self._state]
        return f"<Request {state}>"


class NativeRequest(Request):
    """A request completed by someone other than the I/O pool: a backend's native
    asynchronous path (e.g. Linux AIO) creates it, and its own thread completes it with
    ``set_result``, ``set_exception`` or ``complete_with``.

    It is under way from the start, so ``cancel()`` refuses. ``wait()`` calls ``progress``
    in the waiting thread, which a subclass overrides to drive completion itself (reap
    the kernel's events); the default waits for whoever completes it.
    """

    __slots__ = ()

    def __init__(self, stats: Any = None):
        super().__init__(stats)
        self._state = RUNNING

    def progress(self, deadline: float | None) -> bool:
        """Bring the request to completion, or wait for it, until ``deadline``
        (``time.perf_counter()``; None: no limit); return ``done()``."""
        return self.settle(None if deadline is None else deadline - time.perf_counter())

    def settle(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds (None: until complete) for someone to complete
        the request, without raising or counting the wait; return ``done()``."""
        self._wait_until(None if timeout is None else time.perf_counter() + max(0.0, timeout))
        return self._state >= DONE

    def _block(self, timeout: float | None) -> None:
        if self._state >= DONE:
            return
        t0 = time.perf_counter()
        done = self.progress(None if timeout is None else t0 + max(0.0, timeout))
        if self._stats is not None:
            self._stats.waited(time.perf_counter() - t0)
        if not done:
            raise TimeoutError(f"request not complete after {timeout} s")


# ---------------------------------------------------------------- interrupts
# Python runs a signal handler in the main thread between two bytecodes, wherever that
# thread is: a handler that raises (Ctrl-C's, a SIGALRM timeout's) can cut any piece of
# bookkeeping in two. A shield lets the main thread finish such a piece whole: while it is
# up, every Python signal handler is replaced by a stand-in that catches what the handler
# raises, and the first such exception is raised when the shield comes down. Other threads
# never run handlers and need no shield.

# the signals a Python handler can be installed for (not SIGKILL, SIGSTOP)
_SIGNALS = tuple(sorted(int(s) for s in signal.valid_signals()
                        if s not in (getattr(signal, "SIGKILL", None),
                                     getattr(signal, "SIGSTOP", None))))
_get_ident = threading.get_ident
main_ident = [threading.main_thread().ident]    # where handlers run (renewed at fork)


class _ShieldState:
    """The main thread's shields: how deep, how many defer handlers, what is kept."""

    __slots__ = ("depth", "deferring", "swapped", "deferred", "raised", "parked")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.depth = 0              # shields up, nested
        self.deferring = 0          # of them, those that defer handlers to their end
        self.swapped: list = []     # (signal number, stand-in) to put back (read only)
        self.deferred: list = []    # (handler, signal number) to call at the end
        self.raised: list = []      # what handlers raised meanwhile
        self.parked: list = []      # raised once a started request is registered


shield_state = _ShieldState()


class _Standin:
    """Stands in for a Python signal handler while the main thread is shielded.

    Under a deferring shield it records the signal (the handler runs when that shield
    comes down); otherwise it runs the handler at once and keeps what it raises. Left in
    place when an interrupt cut a shield's restore short, it is the handler itself.
    """

    __slots__ = ("handler",)

    def __init__(self, handler: Callable) -> None:
        self.handler = handler

    def __call__(self, signum: int, frame: Any) -> Any:
        st = shield_state
        if not st.depth:
            return self.handler(signum, frame)
        if st.deferring:
            st.deferred.append((self.handler, signum))
            return None
        try:
            self.handler(signum, frame)
        except BaseException as e:  # noqa: BLE001 - raised when the shield comes down
            st.raised.append(e)
        return None

    def __repr__(self) -> str:
        return f"<chemio stand-in for {self.handler!r}>"


# The handlers of every signal at the last look, and the stand-ins made for them: a look
# that finds the same handlers (the usual case) makes no new stand-ins.
_last_look: list = [(), []]
_getsignal, _setsignal = _sig.getsignal, _sig.signal


def _plan(handlers: tuple) -> None:
    """Stand-ins for the Python handlers among ``handlers`` (of ``_SIGNALS``)."""
    plan = [(signum, h if type(h) is _Standin else _Standin(h))
            for signum, h in zip(_SIGNALS, handlers)
            if h is not None and callable(h)]   # not SIG_DFL, SIG_IGN or C code's
    _last_look[:] = handlers, plan


def _restore(swapped: list) -> None:
    """Put the handlers back in place of their stand-ins. ``signal.signal`` runs pending
    handlers first: one that raises does not stop the rest (its exception is raised at
    the end); a stand-in that an interrupt still leaves in place is the handler itself."""
    first = None
    i, n = 0, len(swapped)
    while i < n:
        signum, standin = swapped[i]
        try:
            if _getsignal(signum) is standin:   # (unless someone installed another)
                _setsignal(signum, standin.handler)
            i += 1
        except BaseException as e:  # noqa: BLE001 - raised below
            if first is None:
                first = e
    if first is not None:
        raise first


def _shield_up(defer: bool) -> int:
    """Raise a shield in the main thread; the token for ``_shield_down`` (0: no shield)."""
    if _get_ident() != main_ident[0]:
        return 0
    return _main_shield_up(defer)


def _main_shield_up(defer: bool) -> int:
    st = shield_state
    if st.depth:
        st.depth += 1
        st.deferring += defer
        return 1 + defer
    if st.parked:
        raise_parked()
    # every signal, every time: a handler installed since the last look needs a stand-in
    handlers = tuple(map(_getsignal, _SIGNALS))
    if handlers != _last_look[0]:
        _plan(handlers)
    plan = _last_look[1]
    # up before the first stand-in goes in: a signal from here on is the shield's
    st.depth, st.deferring, st.swapped = 1, defer, plan
    try:
        for signum, standin in plan:
            _setsignal(signum, standin)     # runs pending handlers first: may raise
    except BaseException as e:  # noqa: BLE001 - a handler not swapped yet raised
        st.raised.insert(0, e)
        _shield_down(1 + defer)             # puts back what was swapped, raises it
    return 1 + defer


def _shield_down(token: int, park: bool = False) -> None:
    """Lower the shield of ``token``; the outermost one puts the handlers back, calls the
    deferred ones and raises the first exception a handler raised meanwhile (with
    ``park``, keeps it for ``raise_parked``)."""
    if not token:
        return
    st = shield_state
    st.deferring -= token - 1
    if st.depth > 1:
        st.depth -= 1
        if st.deferred and not st.deferring:    # an inner deferring shield: run them now
            deferred, st.deferred = st.deferred, []
            for handler, signum in deferred:
                try:
                    handler(signum, sys._getframe())
                except BaseException as e:  # noqa: BLE001 - raised by the outermost shield
                    st.raised.append(e)
        return
    late = None
    try:                        # stand-ins still catch what arrives meanwhile
        for signum, standin in st.swapped:
            if _getsignal(signum) is standin:   # (unless someone installed another)
                _setsignal(signum, standin.handler)
    except BaseException as e:  # noqa: BLE001 - a handler put back ran: raised below
        late = e
    st.depth = 0                # (no call since the try: nothing lands in between)
    if late is not None:        # the rest, whatever runs on the way
        try:
            _restore(st.swapped)
        except BaseException:  # noqa: BLE001 - one exception is enough
            pass
    if late is None and not st.deferred and not st.raised:
        return
    deferred, raised = st.deferred, st.raised
    st.deferred, st.raised = [], []
    if late is not None:
        raised.append(late)
    for handler, signum in deferred:
        try:
            handler(signum, sys._getframe())
        except BaseException as e:  # noqa: BLE001 - the first is raised below
            raised.append(e)
    if raised:
        if park:
            st.parked += raised
            return
        raise raised[0]


def raise_parked() -> None:
    """Raise what a signal handler raised while a request was being started (see
    ``shielded_start``), in the main thread, now that the request is in its owner's hands."""
    st = shield_state
    if st.parked and _get_ident() == main_ident[0]:
        parked, st.parked = st.parked, []
        raise parked[0]


class shield:
    """``with requests.shield():`` a block the main thread's signal handlers cannot cut.

    Handlers still run when their signal arrives (``defer=False``) or only when the block
    ends (``defer=True``, for short bookkeeping that a handler must not re-enter); the
    first exception one of them raised is raised when the block ends, after it has run to
    its end. Nested shields are cheap; in other threads (which never run handlers) a
    shield does nothing.
    """

    __slots__ = ("_defer", "_token")

    def __init__(self, defer: bool = False) -> None:
        self._defer = defer
        self._token = 0

    def __enter__(self) -> "shield":
        self._token = _shield_up(self._defer)
        return self

    def __exit__(self, *exc: Any) -> None:
        token, self._token = self._token, 0
        _shield_down(token)


def shielded(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` under a deferring shield: in the main thread no signal handler runs
    until it returns; then they run and the first exception they raise propagates (the
    value of ``fn`` is lost then: put what must not be lost where its owner finds it)."""
    if _get_ident() != main_ident[0]:
        return fn(*args)                    # other threads never run handlers
    token = _main_shield_up(True)
    try:
        return fn(*args)
    finally:
        _shield_down(token)


def shielded_start(fn: Callable[..., Any], *args: Any) -> Any:
    """``shielded(fn, *args)`` for a call that starts a request and returns it.

    An interrupt must not separate a started request from its owner (a file's ``Pending``,
    which ``close()`` waits for): when ``fn`` returns a ``Request``, what a handler raised
    meanwhile is raised by the ``Pending.add`` that registers it, or else when the main
    thread next waits or raises a shield, not on the way back to the owner. So a caller
    registers the request at once (or waits for it).
    """
    if _get_ident() != main_ident[0]:
        return fn(*args)
    token = _main_shield_up(True)
    try:
        value = fn(*args)
    except BaseException:
        _shield_down(token)
        raise
    _shield_down(token, isinstance(value, Request))
    return value


def uninterrupted(step: Callable[[], bool]) -> None:
    """Call ``step()`` until it returns True, under a shield: signal handlers run, and the
    first exception one raised is raised once ``step()`` has returned True."""
    with shield():
        while not step():
            pass


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
    uninterrupted(ended)


def _run_callback(fn: Callable[[Request], Any], req: Request) -> None:
    try:
        fn(req)
    except Exception:  # a failing callback must not kill an I/O thread
        import traceback
        traceback.print_exc()


def completed(value: Any = None) -> Request:
    """A request that is already complete with ``value`` (nothing to wait for)."""
    r = Request()
    r._finish(value)
    return r


def gather(reqs: Sequence[Request], value: Any = None, then: Callable[[], Any] | None = None,
           stats: Any = None) -> Request:
    """One request that completes when all of ``reqs`` have.

    It fails with the first error among them; otherwise ``then()`` runs (if given, in the
    thread that completed the last one) and the request completes with ``value``.
    """
    out = Request(stats)
    out._state = RUNNING           # its parts are already under way: it cannot be cancelled
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

    def watch() -> Request:
        for r in reqs:
            r.add_done_callback(one_done)
        return out
    # shielded: parts already complete complete ``out`` here, whole; an interrupt waits
    # until ``out`` is registered with its owner
    watched: Request = shielded_start(watch)
    return watched


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
        """Register ``req``; then raise an interrupt that its start held back
        (``shielded_start``), now that ``close()`` will wait for it."""
        with self._lock:
            self._reqs.append(req)
            if len(self._reqs) > 64:
                self._reqs = [r for r in self._reqs if r._state < DONE or _unseen_error(r)]
        if shield_state.parked:
            raise_parked()
        return req

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for r in self._reqs if r._state < DONE)

    def drain(self) -> list[BaseException]:
        """Wait for all outstanding requests (see ``settle``); return the errors nobody
        has seen, each only once (they count as seen from now on).

        The requests stay listed until they have ended and their errors are handed over:
        an interrupt at any moment leaves them for the next ``drain``, which waits for
        them again and reports what this one did not.
        """
        if self._pid != os.getpid():
            with self._lock:
                self._reqs = []
            return []           # a forked child: the I/O was the parent's, its threads are not here
        with self._lock:
            reqs = list(self._reqs)
        settle(reqs)
        errors = [r for r in reqs if _unseen_error(r)]
        try:
            with shield(defer=True):
                ended = set(reqs)
                with self._lock:
                    self._reqs = [r for r in self._reqs if r not in ended]
                for r in errors:
                    r._seen = True
                found = [r._exc for r in errors if r._exc is not None]
        except BaseException:
            with self._lock:                    # a handler raised at the end: report them later
                self._reqs[:0] = [r for r in errors if r not in self._reqs]
            for r in errors:
                r._seen = False
            raise
        return found


def _unseen_error(r: Request) -> bool:
    return (r._state >= DONE and r._exc is not None and not r._seen
            and not isinstance(r._exc, CancelledError))


def failure(path: str, errors: list[BaseException]) -> BaseException | None:
    """The error a file's ``flush()``/``close()`` raises for ``errors`` from ``drain()``."""
    if not errors:
        return None
    err = UnobservedIOError(path, errors)
    err.__cause__ = errors[0]
    return err
