"""Linux native asynchronous I/O (io_submit / io_getevents) for O_DIRECT requests.

A thread pool pays several thread hand-offs per request under the GIL; the kernel's AIO
interface queues O_DIRECT reads and writes to the device without any thread: the caller
submits (one system call) and completions are collected in batches. This is what fio's
``libaio`` engine does, reached here through ``syscall(2)`` with ctypes, so no library is
needed. Only O_DIRECT requests are truly asynchronous in Linux AIO, so the local backend
uses it for aligned requests on its O_DIRECT descriptor and the pool for the rest.

Who collects completions: one thread at a time holds the engine's reaping token. A thread
waiting for one of the engine's requests takes it and reaps in its own thread, so a waiter
is woken by the kernel directly, with no hand-off through another thread. A thread that
submits first collects what has finished (one non-blocking ``io_getevents``), as fio's loop
does. The reaper thread collects only while nobody waits or submits (and for ``GRACE``
seconds after, so that a loop that submits and waits in turn keeps the token to itself and
pays no thread hand-off, or contention for the GIL, per request). Whoever delivers does so
under the reaper's thread name (the trace track of the I/O, what callbacks see).

Interrupts. Completions that ``io_getevents`` returned are gone from the kernel: if a
signal handler that raises (Ctrl-C's, a SIGALRM timeout's, any) cut the delivery short,
their requests would never complete and their waiters would wait forever. So in the main
thread, the only one that runs signal handlers, every piece of the engine's bookkeeping
(submitting, reaping and delivering, taking and giving back the token) runs under a
deferring shield (``requests.shielded``): no handler runs inside it, the handlers run
when it ends and what they raise propagates from there, or, for a submission, once the
request is registered with its file (``requests.shielded_start``). Every wait in the
kernel has a timeout and is followed by a look at the request's state, so a waiter never
depends on a count of completions still to come. A request that an interrupt still
separates from its caller (one arriving on the way out) completes all the same, and
``settle_descriptor`` lets a store that closes its descriptor wait for it.

``engine()`` returns the process's engine, or None where the kernel or architecture lacks
AIO (the callers then use the pool).
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import threading
import time
from typing import Any, Callable

import numpy as np

from chemio_py.runtime import requests

# io_setup, io_destroy, io_getevents, io_submit
_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
IOCB_CMD_PREAD, IOCB_CMD_PWRITE = 0, 1
QUEUE_DEPTH = 256          # single requests in flight
BLOCK = 32                 # control blocks of one submitted group (submit_many)
BLOCKS = 8                 # groups in flight: BLOCKS * BLOCK more requests
BATCH = 64
REAP_WAIT_NS = 200_000     # the reaper's wait for a batch of completions
IDLE_WAIT_NS = 50_000_000  # its longest wait for one (then it gives the token back)
WAITER_WAIT_NS = 20_000_000    # a waiter's longest single io_getevents (it then looks again)
GRACE = 0.001              # seconds the reaper leaves the token alone after a wait or submit
NAP_MAX = 0.01             # the reaper's longest nap while other threads wait or submit
TOKEN_POLL = 0.0002        # a waiter without the token looks again this often
TRACK = "chemio-aio"       # the thread name completions are delivered under (trace track),
                           # whichever engine (this or io_uring) moves them
_is_done = requests.Request.done    # the state alone (_Req.done also collects completions)


class _IOCB(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("key", ctypes.c_uint32),
                ("rw_flags", ctypes.c_int32), ("opcode", ctypes.c_uint16),
                ("reqprio", ctypes.c_int16), ("fildes", ctypes.c_uint32),
                ("buf", ctypes.c_uint64), ("nbytes", ctypes.c_uint64),
                ("offset", ctypes.c_int64), ("reserved2", ctypes.c_uint64),
                ("flags", ctypes.c_uint32), ("resfd", ctypes.c_uint32)]


# The same control block as a NumPy record: submit_many fills a group's fields with a few
# vector assignments instead of one ctypes attribute store per field and request.
_IOCB_DTYPE = np.dtype([("data", "<u8"), ("key", "<u4"), ("rw_flags", "<i4"),
                        ("opcode", "<u2"), ("reqprio", "<i2"), ("fildes", "<u4"),
                        ("buf", "<u8"), ("nbytes", "<u8"), ("offset", "<i8"),
                        ("reserved2", "<u8"), ("flags", "<u4"), ("resfd", "<u4")])


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


class _Event(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64),
                ("res", ctypes.c_int64), ("res2", ctypes.c_int64)]


class EngineRequest(requests.NativeRequest):
    """A request of a kernel engine (this one or io_uring's) whose callers collect its
    completions themselves: ``wait()`` reaps in the waiting thread (``progress``), and a
    ``done()`` probe of a pending request first collects the transfers that have finished
    (``poll``, no wait), as ``wait()`` would."""

    __slots__ = ("_eng",)
    _eng: Any

    def progress(self, deadline: float | None) -> bool:
        return self._eng._wait(self, deadline)

    def done(self) -> bool:
        if _is_done(self):
            return True
        self._eng.poll()
        return _is_done(self)


class _Req(EngineRequest):
    """A request of the engine: one transfer (``results`` None) or a group of them.

    It is under way in the kernel from the start, so it cannot be cancelled; ``wait()``
    reaps completions in the waiting thread (see the module docstring).
    """

    __slots__ = ("_keep", "_then", "_t0", "_results", "_left")

    def __init__(self, eng: "Engine", stats: Any, keep: Any, then: Callable, n: int,
                 group: bool):
        super().__init__(stats)
        self._eng, self._keep, self._then = eng, keep, then
        self._t0 = time.perf_counter()
        self._results = [0] * n if group else None
        self._left = n                      # transfers not reaped yet


def _results(req: _Req) -> Any:
    req._left = 0
    return req._results


def complete_all(finished: list, value: Callable[[Any], Any], t1: float) -> None:
    """Complete each request of ``finished`` with ``req._then(value(req), req._t0, t1)``,
    under the I/O track's thread name (what traces and callbacks see), and let go of its
    buffer. An exception escaping one (a callback's ``BaseException``) leaves none of the
    others behind: it is raised once all are complete."""
    me = threading.current_thread()
    name = me.name
    if name != TRACK:          # a waiter delivering: as the AIO thread
        me.name = TRACK
    first = None
    try:
        for req in finished:
            try:
                req.complete_with(req._then, value(req), req._t0, t1)
            except BaseException as e:  # noqa: BLE001 - raised once all are complete
                if first is None:
                    first = e
            req._keep = None
    finally:
        if name != TRACK:
            me.name = name
    if first is not None:
        raise first


class TokenReaper:
    """The wait of an engine whose waiters reap for themselves: one thread at a time holds
    ``_token`` and collects completions (``_wait_step``: a count, -errno, or None when
    another thread holds it); the others poll until their request is settled. The engine
    keeps ``_waiting`` (one entry per waiting thread) and ``_last_wait``."""

    _waiting: list
    _last_wait: float

    def _wait_step(self, req: Any, deadline: float | None) -> int | None:
        raise NotImplementedError

    def _wait(self, req: Any, deadline: float | None) -> bool:
        """Reap in this thread until ``req`` is complete (or ``deadline`` passes)."""
        waiting = self._waiting
        try:
            waiting.append(None)            # list append/pop: atomic, no lock needed
            while not _is_done(req):
                n = requests.shielded(self._wait_step, req, deadline)
                if n is None:               # another thread reaps: for us too, or it stops
                    req.settle(TOKEN_POLL)
                elif n < 0 and n != -errno.EINTR:
                    break                   # no context here (a forked child): plain wait
                if deadline is not None and time.perf_counter() >= deadline:
                    return _is_done(req)
        finally:
            waiting.pop()
            self._last_wait = time.perf_counter()
        # another thread reaps (or no context here)
        return req.settle(None if deadline is None else deadline - time.perf_counter())


class Engine(TokenReaper):
    """One AIO context, its reaping token and its reaper thread; thread-safe submission.

    ``QUEUE_DEPTH`` control blocks for single requests and ``BLOCKS`` blocks of ``BLOCK``
    for groups are made once and reused through free lists: submitting allocates no
    ctypes objects.
    """

    def __init__(self, nr: tuple[int, int, int, int]):
        self._nr = nr
        libc = ctypes.CDLL(None, use_errno=True)
        self._syscall = libc.syscall
        self._syscall.restype = ctypes.c_long
        # The same call keeping the GIL, for io_getevents that does not wait (it reads the
        # completion ring): letting the GIL go costs more than the call, and on a busy node
        # a thread that takes it meanwhile and is descheduled stalls the caller for its
        # time slice.
        self._syscall_now = ctypes.PyDLL(None, use_errno=True).syscall
        self._syscall_now.restype = ctypes.c_long
        self._ctx = ctypes.c_ulong(0)
        if self._syscall(nr[0], QUEUE_DEPTH + BLOCKS * BLOCK, ctypes.byref(self._ctx)) != 0:
            raise OSError(ctypes.get_errno(), "io_setup failed")
        self._cbs = [_IOCB() for _ in range(QUEUE_DEPTH)]
        for slot, cb in enumerate(self._cbs):
            cb.data = slot
        self._ptrs = [(ctypes.POINTER(_IOCB) * 1)(ctypes.pointer(cb)) for cb in self._cbs]
        self._entries: list[_Req | None] = [None] * QUEUE_DEPTH
        self._free = list(range(QUEUE_DEPTH))
        self._lock = threading.Lock()       # free lists, owners and counters
        # The right to reap (io_getevents + delivery); reentrant: a completion callback may
        # wait for, or submit, more of the engine's requests.
        self._token = threading.RLock()
        self._events = (_Event * BATCH)()
        # ctypes arrays are buffers; typeshed says so for Python 3.12+ only
        self._event_rows = np.frombuffer(self._events, dtype=np.int64).reshape(BATCH, 4)  # type: ignore[call-overload]
        # Group control blocks: block b holds BLOCK records whose ``data`` is
        # QUEUE_DEPTH + b * BLOCK + i, so a completion names its group and its place.
        self._gcbs = np.zeros((BLOCKS, BLOCK), dtype=_IOCB_DTYPE)
        self._gcbs["data"] = QUEUE_DEPTH + np.arange(BLOCKS * BLOCK).reshape(BLOCKS, BLOCK)
        # The same blocks as 8 little-endian words per control block: word 2 holds opcode
        # (bits 0-15) and fildes (bits 32-63), words 3-5 buf, nbytes and offset.
        self._gwords = self._gcbs.view(np.uint64).reshape(BLOCKS, BLOCK, 8)
        self._gptrs = (self._gcbs.ctypes.data + _IOCB_DTYPE.itemsize
                       * np.arange(BLOCKS * BLOCK, dtype=np.uint64)).reshape(BLOCKS, BLOCK)
        self._gptr_addr = [ctypes.c_void_p(self._gptrs[b].ctypes.data) for b in range(BLOCKS)]
        self._gowner: list[tuple | None] = [None] * BLOCKS    # (request, first index)
        self._gleft = [0] * BLOCKS
        self._gfree = list(range(BLOCKS))
        self._gkind = [(-1, -1, 0)] * BLOCKS   # (op_fd, size, rows) last written per block
        self._counts = [ctypes.c_long(k) for k in range(BLOCK + 1)]
        self._busy = 0                      # transfers submitted, not delivered yet
        # Completions taken from the kernel, and of them those whose delivery ended (the two
        # differ only while one is delivered, or if a delivery was cut short: last_error)
        self.reaped = self.handed = 0
        self.last_error: str | None = None
        self._waiting: list = []            # one item per thread in _wait
        self._last_wait = 0.0
        self._no_wait = ctypes.byref(_Timespec(0, 0))
        self._reaper_wait = ctypes.byref(_Timespec(0, REAP_WAIT_NS))
        self._idle_wait = ctypes.byref(_Timespec(0, IDLE_WAIT_NS))
        self._waiter_wait = ctypes.byref(_Timespec(WAITER_WAIT_NS // 10**9,
                                                   WAITER_WAIT_NS % 10**9))
        # started by ``engine()`` once published and its lock let go
        self._reaper = threading.Thread(target=self._reap_loop, name=TRACK, daemon=True)

    # -------------------------------------------------------------- submission
    def submit(self, write: bool, fd: int, address: int, nbytes: int, offset: int,
               keep: Any, then: Callable[[int, float, float], Any],
               stats: Any = None) -> requests.Request | None:
        """Queue one O_DIRECT transfer; ``then(result, t0, t1)`` gives the request's value.

        ``result`` is the byte count or a negative errno; ``then`` raises for errors.
        ``keep`` (the buffer) stays referenced until completion. Returns None when the
        kernel refuses the request or all slots are in use (the caller then uses the pool).
        """
        return requests.shielded_start(self._submit, write, fd, address, nbytes, offset,
                                       keep, then, stats)

    def _before_submit(self, stats: Any, keep: Any, then: Callable, n: int,
                       group: bool) -> _Req:
        """The submitter collects what has finished and keeps the reaper away (GRACE)."""
        if self._busy:
            self._poll_step()
        self._last_wait = time.perf_counter()
        return _Req(self, stats, keep, then, n, group)

    def _submit(self, write: bool, fd: int, address: int, nbytes: int, offset: int,
                keep: Any, then: Callable, stats: Any) -> requests.Request | None:
        req = self._before_submit(stats, keep, then, 1, False)
        with self._lock:
            if not self._free:
                return None                 # the kernel queue is full: use the pool
            slot = self._free.pop()
            self._busy += 1
            self._entries[slot] = req
        cb = self._cbs[slot]
        cb.opcode = IOCB_CMD_PWRITE if write else IOCB_CMD_PREAD
        cb.fildes = fd
        cb.buf = address
        cb.nbytes = nbytes
        cb.offset = offset
        if self._syscall(self._nr[3], self._ctx, 1, self._ptrs[slot]) != 1:
            err = ctypes.get_errno()
            with self._lock:
                self._entries[slot] = None
                self._free.append(slot)
                self._busy -= 1
            if err in (errno.EINVAL, errno.EAGAIN, errno.EOPNOTSUPP, errno.ENOSYS):
                return None
            raise OSError(err, os.strerror(err))
        return req

    def submit_many(self, write: bool, fd: int, addresses: Any, sizes: Any,
                    offsets: Any, keep: Any,
                    then: Callable[[list, float, float], Any],
                    stats: Any = None) -> requests.Request | None:
        """Queue many O_DIRECT transfers with one system call per ``BLOCK`` of them.

        ``addresses``, ``sizes`` and ``offsets`` are arrays or lists; ``sizes`` may be one
        int for all. One request stands for all of them; ``then(results, t0, t1)`` gives
        its value, with ``results[i]`` the byte count of transfer ``i`` or a negative
        errno. Returns None (nothing queued) when there are not enough free blocks or the
        kernel refuses the first block: the caller then moves the data another way.
        """
        return requests.shielded_start(self._submit_many, write, fd, addresses, sizes,
                                       offsets, keep, then, stats)

    def _submit_many(self, write: bool, fd: int, addresses: Any, sizes: Any, offsets: Any,
                     keep: Any, then: Callable, stats: Any) -> requests.Request | None:
        n = len(offsets)
        req = self._before_submit(stats, keep, then, n, True)
        gfree = self._gfree
        with self._lock:
            if n <= BLOCK and gfree:
                blocks = [gfree.pop()]
            else:
                need = -(-n // BLOCK)
                if len(gfree) < need:
                    return None
                blocks = [gfree.pop() for _ in range(need)]
            self._busy += n
        lo = 0
        for b in blocks:
            self._gowner[b] = (req, lo)
            self._gleft[b] = min(BLOCK, n - lo)
            lo += BLOCK
        op_fd = (IOCB_CMD_PWRITE if write else IOCB_CMD_PREAD) | (fd << 32)
        same = type(sizes) is int
        for j, b in enumerate(blocks):
            lo = j * BLOCK
            hi = min(n, lo + BLOCK)
            k = hi - lo
            w = self._gwords[b, :k]
            kind = self._gkind[b]           # opcode, descriptor and size as last written
            if not same or kind[0] != op_fd or kind[1] != sizes or kind[2] < k:
                w[:, 2] = op_fd
                w[:, 4] = sizes if same else sizes[lo:hi]
                self._gkind[b] = (op_fd, sizes, k) if same else (-1, -1, 0)
            w[:, 3] = addresses[lo:hi]
            w[:, 5] = offsets[lo:hi]
            got = self._syscall(self._nr[3], self._ctx, self._counts[k], self._gptr_addr[b])
            if got == k:
                continue
            got, err = self._submit_rest(b, k, max(got, 0),
                                         ctypes.get_errno() if got < 0 else errno.EAGAIN)
            if got == k:
                continue
            if j == 0 and got == 0:
                with self._lock:                      # nothing queued: let the caller decide
                    self._busy -= n
                    self._gfree.extend(blocks)
                    for b2 in blocks:
                        self._gowner[b2] = None
                if err in (errno.EINVAL, errno.EAGAIN, errno.EOPNOTSUPP, errno.ENOSYS):
                    return None
                raise OSError(err, os.strerror(err))
            # Part of the group is queued and cannot be taken back: fail the rest, which
            # completes the request (with this error) once the queued part is done.
            rows = [(QUEUE_DEPTH + b * BLOCK + i, 0, -err, 0) for i in range(got, k)]
            for j2 in range(j + 1, len(blocks)):
                rows += [(QUEUE_DEPTH + blocks[j2] * BLOCK + i, 0, -err, 0)
                         for i in range(min(BLOCK, n - j2 * BLOCK))]
            with self._token:
                self._deliver(rows, time.perf_counter())
            break
        return req

    def _submit_rest(self, b: int, k: int, got: int, err: int) -> tuple[int, int]:
        """After io_submit queued ``got`` < ``k`` control blocks of group block ``b``:
        submit the rest again, which queues them or names the error of the first one
        refused (a short count says none). Returns (queued, errno)."""
        while got < k:
            at = ctypes.c_void_p(int(self._gptrs[b, got:].ctypes.data))
            more = self._syscall(self._nr[3], self._ctx, ctypes.c_long(k - got), at)
            if more <= 0:
                return got, ctypes.get_errno() if more < 0 else err
            got += more
        return got, 0

    # -------------------------------------------------------------- completion
    def _deliver(self, rows: Any, t1: float) -> None:
        """Complete the requests of finished transfers: ``rows`` of (data, obj, res, res2).
        Called holding the token."""
        finished, singles, freed, members = [], [], [], 0
        entries, gowner, gleft = self._entries, self._gowner, self._gleft
        for data, _obj, res, _res2 in rows:
            if data < QUEUE_DEPTH:
                req = entries[data]
                if req is None:
                    continue
                entries[data] = None
                singles.append(data)
                req._results = res
                finished.append(req)
                continue
            b, i = divmod(data - QUEUE_DEPTH, BLOCK)
            owner = gowner[b]
            if owner is None:
                continue
            req, lo = owner
            req._results[lo + i] = res
            req._left -= 1
            if not req._left:
                finished.append(req)
            members += 1
            gleft[b] -= 1
            if not gleft[b]:
                gowner[b] = None
                freed.append(b)
        with self._lock:
            self._busy -= members + len(singles)
            self._gfree.extend(freed)
            self._free.extend(singles)
        if finished:
            complete_all(finished, _results, t1)

    def _reap(self, min_nr: int, timeout: Any) -> int:
        """Holding the token: collect finished transfers and complete their requests.
        Returns how many, or -errno."""
        call = self._syscall_now if timeout is self._no_wait else self._syscall
        n = call(self._nr[2], self._ctx, min_nr, BATCH, self._events, timeout)
        if n > 0:
            self.reaped += n
            try:
                self._deliver(self._event_rows[:n].tolist(), time.perf_counter())
            except BaseException as e:
                self.last_error = repr(e)
                raise
            self.handed += n
            return n
        return -ctypes.get_errno() if n < 0 else 0

    def _wait_step(self, req: _Req, deadline: float | None) -> int | None:
        """Reap once if no other thread does (else None)."""
        if not self._token.acquire(False):
            return None
        try:
            if _is_done(req):
                return 0
            # each of its transfers not reaped yet will complete: wait for as many
            return self._reap(min(req._left, BATCH), self._timeout(deadline))
        finally:
            self._token.release()

    def _timeout(self, deadline: float | None) -> Any:
        if deadline is not None:
            left = max(0.0, deadline - time.perf_counter())
            if left < WAITER_WAIT_NS * 1e-9:
                return ctypes.byref(_Timespec(0, int(left * 1e9)))
        return self._waiter_wait

    def _reap_loop(self) -> None:
        nap = GRACE
        while True:
            if self._waiting or time.perf_counter() - self._last_wait < GRACE:
                # A waiter (or submitter) reaps for itself. The naps double while that
                # lasts (up to NAP_MAX): each look takes the GIL from the caller, and on a
                # busy node a reaper that is not scheduled at once stalls it meanwhile.
                time.sleep(nap)
                nap = min(2 * nap, NAP_MAX)
                continue
            nap = GRACE
            if not self._token.acquire(timeout=GRACE):
                continue
            try:
                # Waking for every completion costs a GIL hand-off each; with many in
                # flight, wait for a quarter of them (at most REAP_WAIT_NS).
                busy = self._busy
                if busy >= 8:
                    n = self._reap(min(busy // 4, BATCH), self._reaper_wait)
                else:               # a timeout: others may need the token meanwhile
                    n = self._reap(1, self._idle_wait)
            except BaseException:  # noqa: BLE001 - a callback's; all were completed first
                n = 0               # (kept in last_error): the reaper must live on
            finally:
                self._token.release()
            if n < 0 and n != -errno.EINTR:
                time.sleep(GRACE)           # unexpected: never leave the requests behind

    def poll(self) -> int:
        """Complete the transfers that have finished, in the calling thread; returns how
        many. A consumer that polls before it waits needs no hand-off to the reaper
        thread, which beside compute on every core may wait for a time slice."""
        return requests.shielded(self._poll_step) if self._busy else 0

    def _poll_step(self) -> int:
        if not self._token.acquire(False):
            return 0
        try:
            return max(self._reap(0, self._no_wait), 0)
        finally:
            self._token.release()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._busy

    def requests_on(self, fd: int) -> list[requests.Request]:
        """The requests with a transfer on descriptor ``fd`` still in flight."""
        with self._lock:
            found: list[requests.Request] = [
                req for slot, req in enumerate(self._entries)
                if req is not None and self._cbs[slot].fildes == fd]
            for b, owner in enumerate(self._gowner):
                if owner is not None and int(self._gwords[b, 0, 2]) >> 32 == fd:
                    found.append(owner[0])
        return found


_engine: list[Engine | None] = []
_engine_lock = threading.Lock()


def engine() -> Engine | None:
    """This process's AIO engine, or None where Linux AIO is not available."""
    if _engine:
        return _engine[0]
    made = None
    with _engine_lock:
        if not _engine:
            nr = _SYSCALLS.get(platform.machine())
            eng = None
            if nr is not None and os.environ.get("CHEMIO_NO_AIO") != "1":
                try:
                    eng = made = Engine(nr)
                except (OSError, AttributeError):
                    eng = None
            _engine.append(eng)
    if made is not None:
        made._reaper.start()    # outside the lock: see ``_Pool.start`` in runtime.pool
    return _engine[0]


def settle_descriptor(fd: int | None) -> None:
    """Wait until no transfer on descriptor ``fd`` is in flight, whatever happens meanwhile
    (``requests.settle``): for a store about to close or sync it. This also covers a
    request that an interrupt separated from its caller after it was submitted."""
    eng = _engine[0] if _engine else None
    if eng is None or fd is None or fd < 0:
        return
    reqs = eng.requests_on(fd)
    if reqs:
        requests.settle(reqs)


def _after_fork_in_child() -> None:
    _engine.clear()         # the AIO context and the reaper belong to the parent


os.register_at_fork(after_in_child=_after_fork_in_child)
