"""Linux native asynchronous I/O (io_submit / io_getevents) for O_DIRECT requests.

A thread pool pays several thread hand-offs per request under the GIL; the kernel's AIO
interface queues O_DIRECT reads and writes to the device without any thread: the caller
submits (one system call) and a single reaper thread collects completions in batches. This
is what fio's ``libaio`` engine does, reached here through ``syscall(2)`` with ctypes, so no
library is needed. Only O_DIRECT requests are truly asynchronous in Linux AIO, so the local
backend uses it for aligned requests on its O_DIRECT descriptor and the pool for the rest.

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

from chemio_py import requests

# io_setup, io_destroy, io_getevents, io_submit
_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
IOCB_CMD_PREAD, IOCB_CMD_PWRITE = 0, 1
QUEUE_DEPTH = 256          # single requests in flight
BLOCK = 32                 # control blocks of one submitted group (submit_many)
BLOCKS = 8                 # groups in flight: BLOCKS * BLOCK more requests
BATCH = 64
REAP_WAIT_NS = 200_000


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
_EVENT_DTYPE = np.dtype([("data", "<u8"), ("obj", "<u8"), ("res", "<i8"), ("res2", "<i8")])


class _Group:
    """One submit_many call: its request, the per-transfer results, what is left."""

    __slots__ = ("req", "keep", "then", "t0", "results", "left")

    def __init__(self, req: requests.Request, keep: Any, then: Callable, n: int):
        self.req, self.keep, self.then = req, keep, then
        self.t0 = time.perf_counter()
        self.results = [0] * n
        self.left = n


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


class _Event(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64),
                ("res", ctypes.c_int64), ("res2", ctypes.c_int64)]


class Engine:
    """One AIO context and its reaper thread; thread-safe submission.

    ``QUEUE_DEPTH`` control blocks (and the pointer arrays io_submit takes) are made once and
    reused through a free list: submitting allocates no ctypes objects.
    """

    def __init__(self, nr: tuple[int, int, int, int]):
        self._nr = nr
        libc = ctypes.CDLL(None, use_errno=True)
        self._syscall = libc.syscall
        self._syscall.restype = ctypes.c_long
        self._ctx = ctypes.c_ulong(0)
        if self._syscall(nr[0], QUEUE_DEPTH + BLOCKS * BLOCK, ctypes.byref(self._ctx)) != 0:
            raise OSError(ctypes.get_errno(), "io_setup failed")
        self._cbs = [_IOCB() for _ in range(QUEUE_DEPTH)]
        for slot, cb in enumerate(self._cbs):
            cb.data = slot
        self._ptrs = [(ctypes.POINTER(_IOCB) * 1)(ctypes.pointer(cb)) for cb in self._cbs]
        self._entries: list[tuple | None] = [None] * QUEUE_DEPTH
        self._free = list(range(QUEUE_DEPTH))
        self._lock = threading.Lock()
        self._events = (_Event * BATCH)()
        # ctypes arrays are buffers; typeshed says so for Python 3.12+ only
        self._event_rec = np.frombuffer(self._events, dtype=_EVENT_DTYPE)  # type: ignore[call-overload]
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
        self._gowner: list[tuple | None] = [None] * BLOCKS    # (group, first index, count)
        self._gleft = [0] * BLOCKS
        self._gfree = list(range(BLOCKS))
        self._busy = 0
        self._deliver_lock = threading.Lock()
        self._poll_lock = threading.Lock()
        self._poll_events = (_Event * BATCH)()
        self._poll_rec = np.frombuffer(self._poll_events, dtype=_EVENT_DTYPE)  # type: ignore[call-overload]
        self._no_wait = _Timespec(0, 0)
        self._reaper = threading.Thread(target=self._reap, name="chemio-aio", daemon=True)
        self._reaper.start()

    def submit(self, write: bool, fd: int, address: int, nbytes: int, offset: int,
               keep: Any, then: Callable[[int, float, float], Any],
               stats: Any = None) -> requests.Request | None:
        """Queue one O_DIRECT transfer; ``then(result, t0, t1)`` gives the request's value.

        ``result`` is the byte count or a negative errno; ``then`` raises for errors.
        ``keep`` (the buffer) stays referenced until completion. Returns None when the
        kernel refuses the request or all slots are in use (the caller then uses the pool).
        """
        req = requests.Request(stats)
        with self._lock:
            if not self._free:
                return None                 # the kernel queue is full: use the pool
            slot = self._free.pop()
            self._busy += 1
            self._entries[slot] = (req, keep, then, time.perf_counter())
        cb = self._cbs[slot]
        cb.opcode = IOCB_CMD_PWRITE if write else IOCB_CMD_PREAD
        cb.fildes = fd
        cb.buf = address
        cb.nbytes = nbytes
        cb.offset = offset
        if self._syscall(self._nr[3], self._ctx, 1, self._ptrs[slot]) != 1:
            err = ctypes.get_errno()
            self._release(slot)
            if err in (errno.EINVAL, errno.EAGAIN, errno.EOPNOTSUPP, errno.ENOSYS):
                return None
            raise OSError(err, os.strerror(err))
        return req

    def submit_many(self, write: bool, fd: int, addresses: np.ndarray, sizes: Any,
                    offsets: np.ndarray, keep: Any,
                    then: Callable[[list, float, float], Any],
                    stats: Any = None) -> requests.Request | None:
        """Queue many O_DIRECT transfers with one system call per ``BLOCK`` of them.

        ``sizes`` is an array or one int for all. One request stands for all of them;
        ``then(results, t0, t1)`` gives its value, with
        ``results[i]`` the byte count of transfer ``i`` or a negative errno. Returns None
        (nothing queued) when there are not enough free blocks or the kernel refuses the
        first block: the caller then moves the data another way.
        """
        n = len(offsets)
        need = -(-n // BLOCK)
        req = requests.Request(stats)
        group = _Group(req, keep, then, n)
        with self._lock:
            if len(self._gfree) < need:
                return None
            blocks = [self._gfree.pop() for _ in range(need)]
            self._busy += n
        op_fd = (IOCB_CMD_PWRITE if write else IOCB_CMD_PREAD) | (fd << 32)
        for j, b in enumerate(blocks):
            lo, hi = j * BLOCK, min(n, (j + 1) * BLOCK)
            k = hi - lo
            self._gowner[b] = (group, lo, k)
            self._gleft[b] = k
            w = self._gwords[b, :k]
            w[:, 2] = op_fd
            w[:, 3] = addresses[lo:hi]
            w[:, 4] = sizes if type(sizes) is int else sizes[lo:hi]
            w[:, 5] = offsets[lo:hi]
            got = self._syscall(self._nr[3], self._ctx, ctypes.c_long(k), self._gptr_addr[b])
            if got == k:
                continue
            err = ctypes.get_errno() if got < 0 else errno.EAGAIN
            if j == 0 and got <= 0:
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
            self._complete_unqueued(group, blocks[j:], max(got, 0), err)
            break
        return req

    def _complete_unqueued(self, group: _Group, blocks: list, queued_in_first: int,
                           err: int) -> None:
        events = []
        for j, b in enumerate(blocks):
            _, lo, k = self._gowner[b]
            start = queued_in_first if j == 0 else 0
            events += [(QUEUE_DEPTH + b * BLOCK + i, -err) for i in range(start, k)]
        self._complete(events, time.perf_counter())

    def _release(self, slot: int) -> tuple | None:
        with self._lock:
            entry, self._entries[slot] = self._entries[slot], None
            self._free.append(slot)
            self._busy -= 1
        return entry

    def _complete(self, events: Any, t1: float) -> None:
        """Deliver ``(data, res)`` completions: single requests and group members."""
        with self._deliver_lock:            # the reaper, or a submitter failing a group's rest
            self._deliver(events, t1)

    def _deliver(self, events: Any, t1: float) -> None:
        finished_groups, freed, members = [], [], 0
        for data, res in events:
            if data < QUEUE_DEPTH:
                entry = self._release(data)
                if entry is None:
                    continue
                req, _keep, then, t0 = entry
                req.complete_with(then, res, t0, t1)
                continue
            b, i = divmod(data - QUEUE_DEPTH, BLOCK)
            owner = self._gowner[b]
            if owner is None:
                continue
            group, lo, _k = owner
            members += 1
            group.results[lo + i] = res
            group.left -= 1
            if group.left == 0:
                finished_groups.append(group)
            self._gleft[b] -= 1
            if self._gleft[b] == 0:
                self._gowner[b] = None
                freed.append(b)
        if members:
            with self._lock:
                self._busy -= members
                self._gfree.extend(freed)
        for group in finished_groups:
            group.req.complete_with(group.then, group.results, group.t0, t1)

    def _reap(self) -> None:
        events, nr_getevents = self._events, self._nr[2]
        # Waking for every completion costs a GIL hand-off each; with many in flight, wait
        # for a quarter of them (at most REAP_WAIT_NS) and complete them in one go.
        timeout = _Timespec(0, REAP_WAIT_NS)
        while True:
            busy = self._busy
            if busy >= 8:
                n = self._syscall(nr_getevents, self._ctx, busy // 4, BATCH, events,
                                  ctypes.byref(timeout))
            else:
                n = self._syscall(nr_getevents, self._ctx, 1, BATCH, events, None)
            if n < 0:
                if ctypes.get_errno() == errno.EINTR:
                    continue
                return                      # context destroyed
            rec = self._event_rec[:n]
            self._complete(zip(rec["data"].tolist(), rec["res"].tolist()),
                           time.perf_counter())

    def poll(self) -> int:
        """Complete the transfers that have finished, in the calling thread; returns how
        many. A consumer that polls before it waits needs no hand-off to the reaper
        thread, which beside compute on every core may wait for a time slice."""
        if not self._busy or not self._poll_lock.acquire(blocking=False):
            return 0
        try:
            n = self._syscall(self._nr[2], self._ctx, 0, BATCH, self._poll_events,
                              ctypes.byref(self._no_wait))
            if n > 0:
                rec = self._poll_rec[:n]
                self._complete(zip(rec["data"].tolist(), rec["res"].tolist()),
                               time.perf_counter())
            return max(n, 0)
        finally:
            self._poll_lock.release()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._busy


_engine: list[Engine | None] = []
_engine_lock = threading.Lock()


def engine() -> Engine | None:
    """This process's AIO engine, or None where Linux AIO is not available."""
    if _engine:
        return _engine[0]
    with _engine_lock:
        if not _engine:
            nr = _SYSCALLS.get(platform.machine())
            eng = None
            if nr is not None and os.environ.get("CHEMIO_NO_AIO") != "1":
                try:
                    eng = Engine(nr)
                except (OSError, AttributeError):
                    eng = None
            _engine.append(eng)
        return _engine[0]


def _after_fork_in_child() -> None:
    _engine.clear()         # the AIO context and the reaper belong to the parent


os.register_at_fork(after_in_child=_after_fork_in_child)
