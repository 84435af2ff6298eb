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

from chemio_py import requests

# io_setup, io_destroy, io_getevents, io_submit
_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
IOCB_CMD_PREAD, IOCB_CMD_PWRITE = 0, 1
QUEUE_DEPTH = 256
BATCH = 64
REAP_WAIT_NS = 200_000


class _IOCB(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("key", ctypes.c_uint32),
                ("rw_flags", ctypes.c_int32), ("opcode", ctypes.c_uint16),
                ("reqprio", ctypes.c_int16), ("fildes", ctypes.c_uint32),
                ("buf", ctypes.c_uint64), ("nbytes", ctypes.c_uint64),
                ("offset", ctypes.c_int64), ("reserved2", ctypes.c_uint64),
                ("flags", ctypes.c_uint32), ("resfd", ctypes.c_uint32)]


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
        if self._syscall(nr[0], QUEUE_DEPTH, ctypes.byref(self._ctx)) != 0:
            raise OSError(ctypes.get_errno(), "io_setup failed")
        self._cbs = [_IOCB() for _ in range(QUEUE_DEPTH)]
        for slot, cb in enumerate(self._cbs):
            cb.data = slot
        self._ptrs = [(ctypes.POINTER(_IOCB) * 1)(ctypes.pointer(cb)) for cb in self._cbs]
        self._entries: list[tuple | None] = [None] * QUEUE_DEPTH
        self._free = list(range(QUEUE_DEPTH))
        self._lock = threading.Lock()
        self._events = (_Event * BATCH)()
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

    def _release(self, slot: int) -> tuple | None:
        with self._lock:
            entry, self._entries[slot] = self._entries[slot], None
            self._free.append(slot)
        return entry

    def _reap(self) -> None:
        events, nr_getevents = self._events, self._nr[2]
        # Waking for every completion costs a GIL hand-off each; with many in flight, wait
        # for a quarter of them (at most REAP_WAIT_NS) and complete them in one go.
        timeout = _Timespec(0, REAP_WAIT_NS)
        while True:
            busy = QUEUE_DEPTH - len(self._free)
            if busy >= 8:
                n = self._syscall(nr_getevents, self._ctx, busy // 4, BATCH, events,
                                  ctypes.byref(timeout))
            else:
                n = self._syscall(nr_getevents, self._ctx, 1, BATCH, events, None)
            if n < 0:
                if ctypes.get_errno() == errno.EINTR:
                    continue
                return                      # context destroyed
            t1 = time.perf_counter()
            for k in range(n):
                ev = events[k]
                entry = self._release(ev.data)
                if entry is None:
                    continue
                req, _keep, then, t0 = entry
                try:
                    value = then(ev.res, t0, t1)
                except BaseException as e:  # noqa: BLE001 - delivered at wait()
                    req._finish(None, e)
                else:
                    req._finish(value)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return QUEUE_DEPTH - len(self._free)


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
