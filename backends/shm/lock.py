"""Locking of shm segments between threads and processes.

* ``Gate``: the readers/exclusive gate of one store. Threads inside it hold a shared
  ``flock`` on the segment (so no other process can shrink the file under them); the lock
  is kept across a burst of accesses and let go by ``_Janitor``, one daemon thread, once
  the store idles (``IDLE_RELEASE``) or has held it too long (``MAX_HOLD``, then
  ``DRAIN_GAP`` without it).
* ``flock_fd``: ``flock`` with a deadline (``LOCK_WAIT``) instead of an endless wait.
* ``ofd_lock``: open-file-description locks on byte 0, the presence lock of every open
  (``lock_sole`` of a store upgrades it); ``ofd_lock_wait`` waits for one with a deadline.
"""
from __future__ import annotations

import fcntl
import os
import threading
import time
import weakref

from chemio_py.backends.posix import ofd_lock, wait_until
from chemio_py.errors import ChemIOError

LOCK_WAIT = 600.0               # seconds to wait for another process's exclusive lock
IDLE_RELEASE = 0.002            # seconds an unused shared lock is kept
MAX_HOLD = 0.05                 # seconds a shared lock is kept however busy the store is
DRAIN_GAP = 0.002               # seconds without it after such a forced release


class Gate:
    """Readers/exclusive gate of one store.

    Any number of threads may be inside (``enter``/``leave``). While a thread is inside,
    the store's descriptor holds a shared ``flock``, which keeps other processes from
    shrinking the file (shrinking takes the exclusive lock), so a size seen under it stays
    a valid lower bound: ``size`` caches it and accesses below it need no system call.
    The lock is kept across a burst of accesses and dropped by the janitor thread once the
    store has been idle ``IDLE_RELEASE`` seconds, or after ``MAX_HOLD`` seconds (new
    accesses then wait until the current ones finish and the lock has been let go), so a
    shrinking process waits a few milliseconds at most. ``enter_excl`` waits until no
    thread is inside and drops the lock (for remapping, shrinking, closing).
    With ``fd=None`` it is a plain readers/writer lock.
    """

    __slots__ = ("_fd", "_cv", "_inside", "_excl", "_waiting", "_held", "_taking", "_drain",
                 "_drained", "_since", "_last", "size", "__weakref__")

    def __init__(self, fd: int | None):
        self._fd = fd
        self._cv = threading.Condition(threading.Lock())
        self._inside = 0
        self._excl = False
        self._waiting = 0
        self._held = False          # the shared flock is held
        self._taking = False        # a thread is waiting for it (outside ``_cv``)
        self._drain = False         # the janitor asked for the lock to be let go
        self._drained = False       # ... and it was: wait DRAIN_GAP before taking it again
        self._since = 0.0
        self._last = 0.0
        self.size = -1              # file size seen under the held lock (-1: unknown)

    def enter(self) -> None:
        with self._cv:
            while True:
                while self._excl or self._waiting or self._drain or self._taking:
                    self._cv.wait()
                if self._held or self._fd is None:
                    self._inside += 1
                    return
                pause = self._last + DRAIN_GAP - time.monotonic() if self._drained else 0.0
                if pause > 0:                   # let a waiting shrinker in after a drain
                    self._cv.wait(pause)
                    continue
                self._drained = False
                self._taking = True
                break
        # The wait for the shared lock (up to LOCK_WAIT) is outside the gate's own lock:
        # the janitor, which serves every store of the process, must never block on it.
        try:
            flock_fd(self._fd, fcntl.LOCK_SH)
        except BaseException:
            with self._cv:
                self._taking = False
                self._cv.notify_all()
            raise
        with self._cv:
            self._taking = False
            self._held = True
            self._since = time.monotonic()
            self.size = -1
            self._inside += 1
            self._cv.notify_all()
        _janitor.watch(self)

    def leave(self) -> None:
        with self._cv:
            self._inside -= 1
            if self._inside == 0:
                self._last = time.monotonic()
                if self._drain:
                    self._unlock()
                    self._drain = False
                    self._drained = True
                    self._cv.notify_all()
                elif self._waiting:
                    self._cv.notify_all()

    def _unlock(self) -> None:
        if self._held:
            self._held = False
            self.size = -1
            assert self._fd is not None         # held: the descriptor is open
            try:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            except OSError:
                pass

    def tick(self, now: float) -> bool:
        """Janitor: let an idle or long-held lock go; True while it is still held."""
        with self._cv:
            if not self._held:
                return False
            if self._inside == 0 and (now - self._last > IDLE_RELEASE
                                      or now - self._since > MAX_HOLD):
                self._unlock()
                return False
            if now - self._since > MAX_HOLD:
                self._drain = True
            return True

    def enter_excl(self) -> None:
        with self._cv:
            self._waiting += 1
            try:
                while self._excl or self._inside or self._taking:
                    self._cv.wait()
            finally:
                self._waiting -= 1
            self._excl = True
            self._unlock()

    def leave_excl(self) -> None:
        with self._cv:
            self._excl = False
            self._cv.notify_all()


class _Janitor:
    """One daemon thread that lets go of the shared locks of idle stores."""

    def __init__(self):
        self._cv = threading.Condition(threading.Lock())
        self._gates: "weakref.WeakSet[Gate]" = weakref.WeakSet()
        self._thread: threading.Thread | None = None

    def watch(self, gate: Gate) -> None:
        made = None
        with self._cv:
            self._gates.add(gate)
            t = self._thread                # (one made but not started yet has no ident)
            if t is None or (t.ident is not None and not t.is_alive()):
                self._thread = made = threading.Thread(target=self._run, daemon=True,
                                                       name="chemio-shm-locks")
            self._cv.notify()
        if made is not None:
            made.start()        # outside the lock: see ``_Pool.start`` in runtime.pool

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._gates:
                    self._cv.wait()
            time.sleep(IDLE_RELEASE)
            now = time.monotonic()
            with self._cv:
                gates = list(self._gates)
            for g in gates:
                if not g.tick(now):
                    with self._cv:
                        self._gates.discard(g)

    def after_fork(self) -> None:
        # The child shares the parent's open file descriptions (and so their flocks):
        # it must not unlock them; it starts with no janitor and re-locks on next use.
        for g in list(self._gates):
            g._held = False
            g._taking = False
            g._drain = False
            g.size = -1
        self._gates = weakref.WeakSet()
        self._thread = None
        self._cv = threading.Condition(threading.Lock())


_janitor = _Janitor()
os.register_at_fork(after_in_child=_janitor.after_fork)


def flock_fd(fd: int, op: int, timeout: float = LOCK_WAIT) -> None:
    """``flock`` that gives up with a clear error instead of waiting forever."""
    def attempt() -> bool:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
    if not wait_until(attempt, timeout, DRAIN_GAP / 4 if op == fcntl.LOCK_EX else 0.01):
        raise ChemIOError(
            f"another process has held an exclusive lock on a shm segment for more "
            f"than {timeout:.0f} s (descriptor {fd}); it may be stuck: check the job's "
            f"other processes")


def ofd_lock_wait(fd: int, kind: int, path: str, timeout: float | None = None) -> None:
    """``ofd_lock(fd, kind)``, waiting at most ``timeout`` seconds for another open that
    holds the segment alone (``lock_sole``: ``auto`` moving it to disk) instead of for
    ever (None: ``LOCK_WAIT``); then a ``ChemIOError`` (the caller undoes its open)."""
    timeout = LOCK_WAIT if timeout is None else timeout
    if not wait_until(lambda: ofd_lock(fd, kind, wait=False), timeout):
        raise ChemIOError(
            f"shm segment {path!r} has been held alone by another open (a file of "
            f"backend 'auto' moving to disk) for more than {timeout:.0f} s; it may be "
            f"stuck: check the job's other processes. Nothing was opened")
