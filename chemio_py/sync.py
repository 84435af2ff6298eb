"""Synchronisation across processes: a global ``Counter`` and a ``Mutex``.

Both are collective to create (every rank of ``comm`` calls the constructor) and to
``free()``; every other call is independent. One interface, three implementations:

* ``serial`` — a process of its own (no MPI): a thread-safe counter and lock;
* ``mpi4py`` — ``mpi4py.util.sync.Counter`` / ``Mutex`` (mpi4py >= 4), the default under MPI
  (the counter's word is changed by compare-and-swap, see below);
* ``rma`` — MPI one-sided windows used directly (atomic compare-and-swap on rank 0), the
  fallback for an older mpi4py.

Every implementation refuses to leave the signed 64-bit range with ``LimitExceededError``,
changing nothing: under MPI a ``next()`` is a compare-and-swap from the value this process
last saw (one atomic when nobody else moved the counter, two when someone did, more under
contention) instead of a Fetch_and_op, which would wrap past 2**63-1.

``Counter`` is GA's ``nxtval`` for dynamic load balancing::

    tasks = cio.sync.Counter()               # collective
    t = tasks.next()
    while t < ntasks:
        do(t); t = tasks.next()
    tasks.free()                             # collective

``Mutex`` guards read-modify-write of shared data. A write must be complete before the
mutex is released: use blocking writes or ``wait()`` for ``awrite`` inside the block::

    with mutex:
        sf.read(0, seg); seg += mine; sf.write(0, seg)

The mutex is held by one thread of one process at a time and is not recursive.
mpi4py is imported only when an MPI implementation is created.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Self

from chemio_py.runtime.comm import Comm, resolve as _resolve_comm
from chemio_py.errors import ArgumentError, LimitExceededError, SyncError

IMPLEMENTATIONS = ("serial", "mpi4py", "rma")
_INT64 = (-(1 << 63), (1 << 63) - 1)



def _int64(v: Any, what: str) -> int:
    import operator
    try:
        i = operator.index(v)
    except TypeError:
        raise ArgumentError(f"{what} must be an integer, got {type(v).__name__} {v!r}") from None
    if not _INT64[0] <= i <= _INT64[1]:
        raise ArgumentError(f"{what} = {i} does not fit in a signed 64-bit integer")
    return i


def _choose(c: Comm, impl: str | None) -> str:
    if impl is None:
        if c.mpi is None:
            return "serial"
        try:
            import mpi4py.util.sync  # noqa: F401
        except ImportError:
            return "rma"
        return "mpi4py"
    if impl not in IMPLEMENTATIONS:
        raise ArgumentError(f"impl {impl!r} is not one of {IMPLEMENTATIONS} (or None: automatic)")
    if impl == "serial" and c.size > 1:
        raise ArgumentError(f"impl 'serial' cannot synchronise {c.size} ranks; use None, "
                            f"'mpi4py' or 'rma'")
    if impl != "serial" and c.mpi is None:
        raise ArgumentError(f"impl {impl!r} needs an MPI communicator, but this process runs "
                            f"without MPI; use impl=None or 'serial'")
    if impl == "mpi4py":
        try:
            import mpi4py.util.sync  # noqa: F401
        except ImportError:
            raise ArgumentError("impl 'mpi4py' needs mpi4py >= 4 (mpi4py.util.sync); "
                                "pip install -U mpi4py, or use impl='rma'") from None
    return impl


class _Collective:
    """Creation under agreement and a collective, idempotent free()."""

    impl: str
    _what = "object"

    def _setup(self, comm: Any, impl: str | None,
               check: Callable[[], Any] = lambda: None) -> tuple[Comm, str, Any]:
        """Check the arguments on every rank (a failure anywhere raises everywhere)."""
        c = _resolve_comm(comm)
        c.begin(f"sync.{type(self).__name__}()")
        with c.agree(f"sync.{type(self).__name__}() creation"):
            checked = check()
            kind = _choose(c, impl)
        self.comm = c
        self.impl = kind
        self._freed = False
        self._tlock = threading.Lock()
        return c, kind, checked

    def _alive(self) -> None:
        if self._freed:
            raise SyncError(f"this {type(self).__name__} was freed; create a new one")

    def free(self) -> None:
        """Collective: release the MPI windows. Calling it again does nothing."""
        if self._freed:
            return
        self._freed = True
        if self.comm.broken is None:
            self.comm.begin(f"sync.{type(self).__name__}.free()")
            self._free()

    close = free

    def _free(self) -> None:
        pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()


# ---------------------------------------------------------------------- Counter

class Counter(_Collective):
    """A global integer counter with atomic fetch-and-add (GA ``nxtval``).

    ``Counter(start=0, *, comm=None, impl=None)`` is collective; the start value is rank 0's.
    ``next()`` returns the current value and adds one; ``fetch_and_add(n)`` returns the
    current value and adds ``n`` (``fetch_and_add(0)`` reads it). Values are signed 64-bit:
    an addition that would leave ``[-2**63, 2**63-1]`` raises ``LimitExceededError`` and
    changes nothing, in every implementation.
    ``free()`` (also ``close()`` or leaving a ``with`` block) is collective.
    """

    def __init__(self, start: int = 0, *, comm: Any = None, impl: str | None = None):
        c, kind, start = self._setup(comm, impl, lambda: _int64(start, "start"))
        self._guess = start                 # the last value this process saw (see _rma_add)
        if kind == "serial":
            self._value = start
        elif kind == "mpi4py":
            from mpi4py.util import sync
            self._mc = sync.Counter(start, typecode="q", comm=c.mpi)
            try:
                self._win, self._loc = _mpi4py_counter_word(self._mc)
            except SyncError:                   # the same on every rank
                self._mc.free()
                raise
        else:
            self._win, self._loc = _rma_window(c.mpi, start), (0, 0)

    def next(self) -> int:
        """The current value; the counter is incremented by one for everyone."""
        return self.fetch_and_add(1)

    def fetch_and_add(self, n: int) -> int:
        """The current value; the counter is incremented by ``n`` for everyone, atomically."""
        n = _int64(n, "n")
        self._alive()
        with self._tlock:
            if self.impl == "serial":
                prev = self._value
                if not _INT64[0] <= prev + n <= _INT64[1]:
                    raise self._overflow(prev, n)
                self._value += n
                return prev
            root, disp = self._loc
            if n == 0:
                prev = _rma_fetch_op(self._win, 0, "NO_OP", root, disp)
                self._guess = prev
                return prev
            prev, self._guess = _rma_add(self._win, n, self._guess, root, disp)
            return prev

    @staticmethod
    def _overflow(prev: int, n: int) -> LimitExceededError:
        return LimitExceededError(
            f"Counter at {prev} cannot add {n}: the value would leave the signed 64-bit range "
            f"[-2**63, 2**63-1] (the MPI counter is a 64-bit word); nothing was added. Start "
            f"the counter lower or keep steps smaller")

    def _free(self) -> None:
        if self.impl == "mpi4py":
            self._mc.free()
        elif self.impl == "rma":
            self._win.Free()

    def __repr__(self) -> str:
        return f"<Counter impl={self.impl}{' freed' if self._freed else ''}>"


# ---------------------------------------------------------------------- Mutex

class Mutex(_Collective):
    """Mutual exclusion across the ranks of ``comm`` and the threads of each rank.

    ``Mutex(*, comm=None, impl=None)`` is collective. ``with mutex:`` or
    ``acquire(blocking=True) -> bool`` / ``release()``. Not recursive: acquiring it again
    from the thread that holds it raises ``SyncError``, as does releasing it from a thread
    that does not hold it. ``locked()`` says whether this process holds it. ``free()`` is
    collective and releases the mutex first if this process holds it.
    """

    def __init__(self, *, comm: Any = None, impl: str | None = None):
        c, kind, _ = self._setup(comm, impl)
        self._owner: int | None = None           # thread ident of the holder in this process
        if kind == "mpi4py":
            from mpi4py.util import sync
            self._mm = sync.Mutex(comm=c.mpi)
        elif kind == "rma":
            self._win = _rma_window(c.mpi, 0)
            self._me = c.rank + 1

    def acquire(self, blocking: bool = True) -> bool:
        """Take the mutex (waiting when ``blocking``); True when this thread now holds it."""
        self._alive()
        if self._owner == threading.get_ident():
            raise SyncError("this thread already holds the Mutex (it is not recursive); "
                            "release() it first")
        if not self._tlock.acquire(blocking):
            return False
        try:
            if self.impl == "mpi4py":
                ok = self._mm.acquire(blocking)
            elif self.impl == "rma":
                ok = self._rma_acquire(blocking)
            else:
                ok = True
        except BaseException:
            self._tlock.release()
            raise
        if not ok:
            self._tlock.release()
            return False
        self._owner = threading.get_ident()
        return True

    def release(self) -> None:
        """Give the mutex up; the calling thread must hold it."""
        self._alive()
        if self._owner != threading.get_ident():
            raise SyncError("release() of a Mutex this thread does not hold; call acquire() "
                            "(or use `with mutex:`) first")
        self._release()

    def _release(self) -> None:
        try:
            if self.impl == "mpi4py":
                self._mm.release()
            elif self.impl == "rma":
                prev = _rma_fetch_op(self._win, 0, "REPLACE")
                if prev != self._me:
                    raise SyncError(f"Mutex word held {prev}, expected this rank's {self._me}: "
                                    f"the mutex state is corrupt")
        finally:
            self._owner = None
            self._tlock.release()

    def locked(self) -> bool:
        """True when a thread of this process holds the mutex."""
        return self._owner is not None

    def _rma_acquire(self, blocking: bool) -> bool:
        import numpy as np
        from mpi4py import MPI
        mine = np.array([self._me], dtype=np.int64)
        free = np.zeros(1, dtype=np.int64)
        got = np.zeros(1, dtype=np.int64)
        delay = 1e-6
        while True:
            self._win.Lock(0, MPI.LOCK_SHARED)
            self._win.Compare_and_swap(mine, free, got, 0, 0)
            self._win.Unlock(0)
            if got[0] == 0:
                return True
            if not blocking:
                return False
            time.sleep(delay)
            delay = min(2 * delay, 1e-3)

    def __enter__(self) -> "Mutex":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _free(self) -> None:
        if self._owner is not None:
            self._release()
        if self.impl == "mpi4py":
            self._mm.free()
        elif self.impl == "rma":
            self._win.Free()

    def __repr__(self) -> str:
        state = "freed" if self._freed else ("held here" if self.locked() else "not held here")
        return f"<Mutex impl={self.impl} {state}>"


# ---------------------------------------------------------------------- raw RMA helpers

def _rma_window(mpi_comm: Any, start: int) -> Any:
    """A window of one int64 on rank 0 (none elsewhere), set to ``start``. Collective."""
    import numpy as np
    from mpi4py import MPI
    rank = mpi_comm.Get_rank()
    win = MPI.Win.Allocate(8 if rank == 0 else 0, 8, comm=mpi_comm)
    if rank == 0:
        win.Lock(0, MPI.LOCK_EXCLUSIVE)
        win.Put(np.array([start], dtype=np.int64), 0)
        win.Unlock(0)
    mpi_comm.Barrier()
    return win


def _rma_fetch_op(win: Any, value: int, op: str, root: int = 0, disp: int = 0) -> int:
    import numpy as np
    from mpi4py import MPI
    arg = np.array([value], dtype=np.int64)
    prev = np.zeros(1, dtype=np.int64)
    win.Lock(root, MPI.LOCK_SHARED)
    try:
        win.Fetch_and_op(arg, prev, root, disp, getattr(MPI, op))
    finally:
        win.Unlock(root)
    return int(prev[0])


def _rma_add(win: Any, n: int, guess: int, root: int = 0, disp: int = 0) -> tuple[int, int]:
    """Add ``n`` to the int64 word at ``(root, disp)`` unless the sum leaves the signed
    64-bit range; ``(value before, this process's next guess)``. ``LimitExceededError``
    (the word unchanged) when it would.

    A compare-and-swap loop: MPI's Fetch_and_op(SUM) wraps past 2**63-1 and a wrap cannot
    be undone atomically (others may already have seen and used the wrapped value), so
    every change is a CAS from a value known to be in range to one checked to be in range.
    The first CAS expects ``guess`` (the value this process last saw), so a process that
    has the counter to itself pays one atomic, as Fetch_and_op did; a failed CAS returns
    the current value, which the next try expects (two atomics when another process moved
    it, more only under contention; some process always succeeds). A refusal is decided
    on a value read from the window, never on the guess.
    """
    import numpy as np
    from mpi4py import MPI
    lo, hi = _INT64
    new = np.zeros(1, dtype=np.int64)
    expect = np.zeros(1, dtype=np.int64)
    got = np.zeros(1, dtype=np.int64)
    cur, seen = guess, False            # seen: cur was read from the window
    spins = 0
    while True:
        nxt = cur + n
        if not lo <= nxt <= hi:
            if not seen:
                cur, seen = _rma_fetch_op(win, 0, "NO_OP", root, disp), True
                continue
            raise Counter._overflow(cur, n)
        new[0], expect[0] = nxt, cur
        win.Lock(root, MPI.LOCK_SHARED)
        try:
            win.Compare_and_swap(new, expect, got, root, disp)
        finally:
            win.Unlock(root)
        if int(got[0]) == cur:
            return cur, nxt
        cur, seen = int(got[0]), True
        spins += 1
        if spins % 16 == 0:             # heavy contention: let the others through
            time.sleep(1e-6 * min(spins, 1000))


def _mpi4py_counter_word(mc: Any) -> tuple[Any, tuple[int, int]]:
    """The window and ``(root, disp)`` of an ``mpi4py.util.sync.Counter``'s int64 word.

    Its ``next()`` is a Fetch_and_op(SUM), which wraps at 2**63-1; the counter's word is
    changed with ``_rma_add`` instead (mpi4py's Counter still allocates and frees it).
    """
    win, loc = getattr(mc, "_window", None), getattr(mc, "_location", None)
    if win is None or not (isinstance(loc, tuple) and len(loc) == 2):
        raise SyncError("this mpi4py's util.sync.Counter does not expose its window "
                        "(_window, _location); use impl='rma'")
    return win, (int(loc[0]), int(loc[1]))


__all__ = ["Counter", "Mutex", "SyncError", "IMPLEMENTATIONS"]
