"""io_uring for the O_DIRECT requests of the local backend, through ctypes (no library).

Linux AIO pays one ``io_submit`` per group and one ``io_getevents`` per reap; io_uring
shares two rings with the kernel: requests are written into the submission queue (SQ) in
memory and handed over by one ``io_uring_enter`` per batch, and completions are read from
the completion queue (CQ) in memory, with no system call at all when they are already
there. The ring is set up with ``io_uring_setup`` and mapped with ``mmap`` (one mapping
for both rings, IORING_FEAT_SINGLE_MMAP, one for the SQE array); SQEs are written as
64-bit words through NumPy views of the mapping.

Memory ordering (x86-64 only, see ``_NR``). We store the SQ tail after the SQEs, and only
before the ``io_uring_enter`` that submits them, in the thread that calls it; without
SQPOLL the kernel reads the tail inside that call, on the same CPU and after it in program
order, so no fence is needed on any architecture for submission. The kernel publishes CQEs
with a release store of the CQ tail, possibly from another CPU: we load the tail, then the
CQEs; x86-64 (TSO) never reorders a load with an older load, so the CQEs we read are at
least as new as the tail we saw. We store the CQ head after reading those CQEs: TSO never
reorders a store before older loads, so the kernel cannot reuse a slot we still read. The
system calls are full barriers besides. On weaker architectures (aarch64) the CQ side would
need acquire/release instructions that plain ctypes/NumPy loads do not give: the engine is
offered on x86-64 only, and Linux AIO or the threads serve elsewhere.

Who reaps: as in ``linux_aio``, one thread at a time holds the reaping token. A waiter
takes it and collects completions itself (first from memory, then with
``io_uring_enter(GETEVENTS, min_complete)``), so it is woken by the kernel directly; a
``done()`` probe collects from memory too. Unlike ``linux_aio``, a submitting thread does
not collect: the waiter's look at the CQ costs no system call already, and a look before
or after each submitting enter split the collection into smaller batches (measured 0.8-0.9x
on 4 KiB GAMESS mixes, 2026-11-26). The submitting ``io_uring_enter`` keeps the GIL (it
does not wait: a transfer that would block goes to the kernel's workers). A reaper thread
collects (from memory) only while nobody waits or submits, napping up to ``NAP_MAX``
meanwhile, so that callbacks and requests nobody waits for still progress. Transfers
that end short (and still aligned) are continued, EINTR/EAGAIN results are retried, other
errors are passed on as negative errnos, which the backend maps (ENOSPC:
``OutOfSpaceError``). Submission is under one lock (one ring per process: a per-thread
ring would need a reaper per ring); interrupts are deferred over the bookkeeping as in
``linux_aio`` (``requests.shielded``).

Registered buffers: ``Engine.register(buffer)`` pins a buffer the caller keeps stable (a
read-ahead ring, a benchmark's slots) with ``io_uring_register``; transfers that fall inside
it then use IORING_OP_READ_FIXED/WRITE_FIXED (no page pinning per request).
``unregister`` (or the buffer's owner being freed) drops it again.

Fork: a ring belongs to the process that made it (its mappings are shared with the kernel);
a forked child never touches its parent's ring: every entry point checks the process id and
the child makes its own on first use. ``native_engine()`` chooses the engine of the local
backend: io_uring, else Linux AIO, else None (the I/O threads), or what the ``aio_engine``
setting (``CHEMIO_AIO_ENGINE``) forces.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import threading
import time
import weakref
from typing import Any, Callable

import numpy as np

from chemio_py.backends.local import linux_aio
from chemio_py.runtime import config, requests

# io_uring_setup, io_uring_enter, io_uring_register: the same numbers on every architecture
# since Linux 5.1, but the memory-ordering argument above holds for x86-64 only
_NR = {"x86_64": (425, 426, 427)}
_OFF_SQ_RING, _OFF_SQES = 0, 0x10000000
_OP_READ_FIXED, _OP_WRITE_FIXED, _OP_READ, _OP_WRITE = 4, 5, 22, 23
_ENTER_GETEVENTS, _ENTER_EXT_ARG = 1, 8
_FEAT_SINGLE_MMAP, _FEAT_NODROP, _FEAT_EXT_ARG = 1, 2, 1 << 8
_SETUP_CLAMP, _SETUP_SUBMIT_ALL = 1 << 4, 1 << 7
_REGISTER_BUFFERS2, _REGISTER_BUFFERS_UPDATE = 15, 16
_SQE_FIXED_FILE = 1

ENTRIES = 512              # SQ entries = SQEs, one per transfer in flight; the CQ has 2x
BLOCK = 32                 # SQEs of one block of a group (submit_many)
BLOCKS = 8                 # blocks for groups; the other SQEs serve single transfers
REGISTERED = 32            # slots of the registered-buffer table
RETRIES = 16               # EINTR/EAGAIN results retried this often per transfer
ALIGN = 4096               # a short transfer is continued when it ends on this boundary
WAITER_WAIT_NS = 20_000_000
GRACE = 0.001              # seconds the reaper leaves the ring alone after a wait or submit
NAP_MAX = 0.01             # the reaper's longest nap while other threads wait or submit
IDLE_SLEEP = 0.02          # the reaper's look at an idle ring (requests nobody waits for)
_M32 = 0xFFFF_FFFF
_is_done = requests.Request.done    # the state alone (_Req.done also collects completions)


class _SQOff(ctypes.Structure):
    _fields_ = [("head", ctypes.c_uint32), ("tail", ctypes.c_uint32),
                ("ring_mask", ctypes.c_uint32), ("ring_entries", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("dropped", ctypes.c_uint32),
                ("array", ctypes.c_uint32), ("resv1", ctypes.c_uint32),
                ("user_addr", ctypes.c_uint64)]


class _CQOff(ctypes.Structure):
    _fields_ = [("head", ctypes.c_uint32), ("tail", ctypes.c_uint32),
                ("ring_mask", ctypes.c_uint32), ("ring_entries", ctypes.c_uint32),
                ("overflow", ctypes.c_uint32), ("cqes", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("resv1", ctypes.c_uint32),
                ("user_addr", ctypes.c_uint64)]


class _Params(ctypes.Structure):          # struct io_uring_params (120 bytes)
    _fields_ = [("sq_entries", ctypes.c_uint32), ("cq_entries", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("sq_thread_cpu", ctypes.c_uint32),
                ("sq_thread_idle", ctypes.c_uint32), ("features", ctypes.c_uint32),
                ("wq_fd", ctypes.c_uint32), ("resv", ctypes.c_uint32 * 3),
                ("sq_off", _SQOff), ("cq_off", _CQOff)]


class _Timespec(ctypes.Structure):        # struct __kernel_timespec
    _fields_ = [("sec", ctypes.c_int64), ("nsec", ctypes.c_int64)]


class _GetEventsArg(ctypes.Structure):    # struct io_uring_getevents_arg
    _fields_ = [("sigmask", ctypes.c_uint64), ("sigmask_sz", ctypes.c_uint32),
                ("min_wait_usec", ctypes.c_uint32), ("ts", ctypes.c_uint64)]


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _RsrcRegister(ctypes.Structure):    # struct io_uring_rsrc_register
    _fields_ = [("nr", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("resv2", ctypes.c_uint64), ("data", ctypes.c_uint64),
                ("tags", ctypes.c_uint64)]


class _RsrcUpdate2(ctypes.Structure):     # struct io_uring_rsrc_update2
    _fields_ = [("offset", ctypes.c_uint32), ("resv", ctypes.c_uint32),
                ("data", ctypes.c_uint64), ("tags", ctypes.c_uint64),
                ("nr", ctypes.c_uint32), ("resv2", ctypes.c_uint32)]


def _wait_arg(ns: int) -> tuple:
    ts = _Timespec(ns // 10**9, ns % 10**9)
    arg = _GetEventsArg(0, 0, 0, ctypes.addressof(ts))
    return ts, arg, ctypes.c_void_p(ctypes.addressof(arg))


def _value(req: "_Req") -> Any:
    """What a finished request's ``then`` gets: the results of a group, one transfer's."""
    return req._results if req._group else req._results[0]


class _Req(linux_aio.EngineRequest):
    """A request of the engine: one transfer (``results`` a list of one) or a group.

    Under way in the kernel from the start, so it cannot be cancelled; ``wait()`` reaps
    completions in the waiting thread, ``done()`` collects them from memory first.
    """

    __slots__ = ("_keep", "_then", "_t0", "_results", "_left", "_group", "_fd",
                 "_write", "_addrs", "_sizes", "_offs", "_done", "_tries")

    def __init__(self, eng: "Engine", stats: Any, keep: Any, then: Callable, n: int,
                 group: bool, write: bool, fd: int, addrs: Any, sizes: Any, offs: Any):
        super().__init__(stats)
        self._eng, self._keep, self._then = eng, keep, then
        self._t0 = time.perf_counter()
        self._results = [0] * n
        self._left = n                  # transfers not finished yet
        self._group, self._write, self._fd = group, write, fd
        self._addrs, self._sizes, self._offs = addrs, sizes, offs
        self._done: dict | None = None  # bytes done of a transfer that was continued
        self._tries: dict | None = None

    def part(self, i: int) -> tuple[int, int, int]:
        """Address, size and offset of transfer ``i``."""
        s = self._sizes
        return (int(self._addrs[i]), s if type(s) is int else int(s[i]), int(self._offs[i]))


class Engine(linux_aio.TokenReaper):
    """One io_uring of this process: a submission lock, a reaping token, a reaper thread.

    Each SQE belongs to one transfer slot for good (its user_data is the slot): ``BLOCKS``
    blocks of ``BLOCK`` slots for groups, whose opcode, descriptor and size stay written
    from one group to the next when they do not change, and single slots for the rest, as
    many transfers in flight as SQEs (half the CQ, which never overflows). A request that
    finds no free slots is refused (None: the caller uses the I/O threads).
    """

    def __init__(self, nr: tuple[int, int, int], entries: int = ENTRIES):
        self._nr = nr
        self._pid = os.getpid()
        libc = ctypes.CDLL(None, use_errno=True)
        self._sys = libc.syscall
        self._sys.restype = ctypes.c_long
        p = _Params()
        p.flags = _SETUP_CLAMP | _SETUP_SUBMIT_ALL
        fd = self._sys(nr[0], entries, ctypes.byref(p))
        if fd < 0 and ctypes.get_errno() == errno.EINVAL:      # before Linux 5.18
            p = _Params()
            p.flags = _SETUP_CLAMP
            fd = self._sys(nr[0], entries, ctypes.byref(p))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"io_uring_setup: {os.strerror(err)}")
        self._fd = fd
        need = _FEAT_SINGLE_MMAP | _FEAT_NODROP | _FEAT_EXT_ARG
        try:
            if p.features & need != need:
                raise OSError(errno.ENOSYS, "io_uring without SINGLE_MMAP, NODROP or EXT_ARG")
            sq, cq = p.sq_off, p.cq_off
            size = max(sq.array + 4 * p.sq_entries, cq.cqes + 16 * p.cq_entries)
            size = -(-size // 8) * 8
            prot = mmap.PROT_READ | mmap.PROT_WRITE
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._ring = mmap.mmap(fd, size, flags, prot, offset=_OFF_SQ_RING)
            self._sqes = mmap.mmap(fd, 64 * p.sq_entries, flags, prot, offset=_OFF_SQES)
        except BaseException:
            os.close(fd)
            raise
        u32 = np.frombuffer(self._ring, np.uint32)
        self._u32 = u32
        self._sq_head_i, self._sq_tail_i = sq.head // 4, sq.tail // 4
        self._cq_head_i, self._cq_tail_i = cq.head // 4, cq.tail // 4
        self._sq_n, self._cq_n = p.sq_entries, p.cq_entries
        self._sq_mask, self._cq_mask = int(u32[sq.ring_mask // 4]), int(u32[cq.ring_mask // 4])
        if p.sq_entries < BLOCKS * BLOCK + 32:
            raise OSError(errno.ENOMEM, f"io_uring gave {p.sq_entries} SQ entries")
        self._sq_array = u32[sq.array // 4:sq.array // 4 + p.sq_entries]
        self._stail = int(u32[self._sq_tail_i])         # ours: only we move the SQ tail
        self._chead = int(u32[self._cq_head_i])         # ours: only we move the CQ head
        # SQE i belongs to transfer slot i for good: its user_data is i, written once;
        # slots below G are BLOCKS blocks of BLOCK (groups), the others single transfers
        self._sqe = np.frombuffer(self._sqes, np.uint64).reshape(p.sq_entries, 8)
        self._sqe[...] = 0
        self._sqe[:, 4] = np.arange(p.sq_entries)
        self._ids = np.arange(p.sq_entries, dtype=np.uint32)
        cqe = np.dtype([("ud", "<u8"), ("res", "<i4"), ("flags", "<u4")])
        self._cqe = np.frombuffer(self._ring, cqe, p.cq_entries, cq.cqes)
        self._g = BLOCKS * BLOCK
        self._gowner: list[tuple | None] = [None] * BLOCKS    # (request, first index)
        self._gleft = [0] * BLOCKS
        self._gfree = list(range(BLOCKS))
        self._gkind = [(-1, -1, 0)] * BLOCKS   # (op_fd, size, rows) last written per block
        self._entries: list[_Req | None] = [None] * (p.sq_entries - self._g)
        self._sfree = list(range(p.sq_entries - self._g))
        self._nreg = 0
        self._lock = threading.Lock()       # SQ, free ids, counters
        self._token = threading.RLock()     # the right to reap (reentrant: callbacks)
        self._busy = 0
        self._waiting: list = []
        self._last_wait = 0.0
        # the same call keeping the GIL, for the enter that submits and does not wait:
        # letting the GIL go costs more than the call, and on a busy node a thread that
        # takes it meanwhile and is descheduled stalls the submitter for its time slice
        self._enter_now = ctypes.PyDLL(None, use_errno=True).syscall
        self._enter_now.restype = ctypes.c_long
        self._enter = self._sys
        self._waiter_wait = _wait_arg(WAITER_WAIT_NS)
        # the 6th argument of syscall(2) goes on the stack: a whole 64-bit word, or its
        # upper half is whatever was there
        self._argsz = ctypes.c_long(ctypes.sizeof(_GetEventsArg))
        self._null = ctypes.c_void_p(0)
        self._zero = ctypes.c_long(0)
        # registered buffers: slot -> (start, end); owners' finalizers free the slots
        self._regs: list[tuple[int, int] | None] = [None] * REGISTERED
        self._pinned: dict[int, Any] = {}
        self._reg_ok = self._register_table()
        # started by ``engine()`` once published and its lock let go
        self._reaper = threading.Thread(target=self._reap_loop, name=linux_aio.TRACK, daemon=True)

    # -------------------------------------------------------------- registered buffers
    def _register_table(self) -> bool:
        """An empty (sparse) table of ``REGISTERED`` buffer slots; False if refused."""
        reg = _RsrcRegister(REGISTERED, 1, 0, 0, 0)       # IORING_RSRC_REGISTER_SPARSE
        return self._sys(self._nr[2], self._fd, _REGISTER_BUFFERS2, ctypes.byref(reg),
                         ctypes.sizeof(reg)) == 0

    def _update_slot(self, slot: int, start: int, length: int) -> int:
        iov = _Iovec(start, length)
        tag = ctypes.c_uint64(0)
        upd = _RsrcUpdate2(slot, 0, ctypes.addressof(iov), ctypes.addressof(tag), 1, 0)
        got = self._sys(self._nr[2], self._fd, _REGISTER_BUFFERS_UPDATE, ctypes.byref(upd),
                        ctypes.sizeof(upd))
        return 0 if got == 1 else (ctypes.get_errno() or errno.EINVAL)

    def register(self, buffer: Any) -> bool:
        """Pin ``buffer`` (a NumPy array or writable buffer) so that transfers inside it use
        the fixed-buffer operations, until ``unregister`` or until the object that owns its
        memory is freed (one without weak references, a bytearray, is kept alive until
        ``unregister``). Returns False (nothing changed) when the table is full, the kernel
        refuses (memlock limit) or the buffer is not contiguous."""
        arr = np.asarray(buffer)
        if not arr.flags.c_contiguous or not arr.nbytes or self._pid != os.getpid() \
                or not self._reg_ok:
            return False
        start, end = arr.ctypes.data, arr.ctypes.data + arr.nbytes
        owner: Any = arr                # what owns the memory: arrays, views, buffers
        while True:
            if isinstance(owner, np.ndarray) and owner.base is not None:
                owner = owner.base
            elif isinstance(owner, memoryview) and owner.obj is not None:
                owner = owner.obj
            else:
                break
        with self._lock:
            if (start, end) in self._regs:
                return True
            try:
                slot = self._regs.index(None)
            except ValueError:
                return False
            if self._update_slot(slot, start, end - start):
                return False
            self._regs[slot] = (start, end)
            self._nreg += 1
        try:
            weakref.finalize(owner, self._drop_slot, slot, start, end)
        except TypeError:
            # an owner without weak references (bytearray): kept alive until unregister,
            # so that its pages never go back to the allocator while the kernel uses them
            self._pinned[slot] = owner
        return True

    def unregister(self, buffer: Any) -> None:
        """Stop using ``buffer`` as a registered buffer (waits for nothing: transfers in
        flight keep their pages)."""
        arr = np.asarray(buffer)
        key = (arr.ctypes.data, arr.ctypes.data + arr.nbytes)
        with self._lock:
            if key in self._regs:
                slot = self._regs.index(key)
                self._drop_slot_locked(slot, *key)

    def _drop_slot(self, slot: int, start: int, end: int) -> None:
        if self._pid != os.getpid():
            return
        with self._lock:
            self._drop_slot_locked(slot, start, end)

    def _drop_slot_locked(self, slot: int, start: int, end: int) -> None:
        if self._regs[slot] == (start, end):
            self._regs[slot] = None
            self._nreg -= 1
            self._pinned.pop(slot, None)
            self._update_slot(slot, 0, 0)

    # -------------------------------------------------------------- submission
    def submit(self, write: bool, fd: int, address: int, nbytes: int, offset: int,
               keep: Any, then: Callable[[int, float, float], Any],
               stats: Any = None) -> requests.Request | None:
        """Queue one O_DIRECT transfer; ``then(result, t0, t1)`` gives the request's value.

        ``result`` is the byte count (short only at end of file, or for a write that the
        kernel ended off the alignment) or a negative errno; ``then`` raises for errors.
        ``keep`` stays referenced until completion. None when the ring is full or refuses
        (the caller then uses the I/O threads).
        """
        return requests.shielded_start(self._submit, write, fd, [address], nbytes,
                                       [offset], keep, then, stats, False)

    def submit_many(self, write: bool, fd: int, addresses: Any, sizes: Any,
                    offsets: Any, keep: Any,
                    then: Callable[[list, float, float], Any],
                    stats: Any = None) -> requests.Request | None:
        """Queue many O_DIRECT transfers, one ``io_uring_enter`` per ``ENTRIES`` of them.

        As ``linux_aio.Engine.submit_many``: ``sizes`` may be one int for all; one request
        stands for all, its value ``then(results, t0, t1)`` with ``results[i]`` the byte
        count of transfer ``i`` or a negative errno; None when nothing was queued.
        """
        return requests.shielded_start(self._submit, write, fd, addresses, sizes, offsets,
                                       keep, then, stats, True)

    def _submit(self, write: bool, fd: int, addrs: Any, sizes: Any, offs: Any, keep: Any,
                then: Callable, stats: Any, group: bool) -> requests.Request | None:
        n = len(offs)
        if self._pid != os.getpid() or not n:
            return None
        self._last_wait = time.perf_counter()       # the reaper stays away (GRACE)
        if type(sizes) is not int:
            sizes = sizes if type(sizes) is list else np.asarray(sizes).tolist()
        req = _Req(self, stats, keep, then, n, group, write, fd, addrs, sizes, offs)
        opfd = (_OP_WRITE if write else _OP_READ) | (fd << 32)
        slots: list[Any]                # (first SQE, count) per block, or one SQE index
        with self._lock:
            if group:
                gfree = self._gfree
                if len(gfree) * BLOCK < n:
                    return None
                if n <= BLOCK:          # one block: the common case, written out here
                    b = gfree.pop()
                    self._gowner[b] = (req, 0)
                    self._gleft[b] = n
                    first = b * BLOCK
                    w = self._sqe[first:first + n]
                    kind = self._gkind[b]
                    if type(sizes) is not int or kind[0] != opfd or kind[1] != sizes \
                            or kind[2] < n:
                        w[:, 0] = opfd
                        w[:, 3] = sizes
                        w[:, 5] = 0
                        self._gkind[b] = (opfd, sizes, n) if type(sizes) is int \
                            else (-1, -1, 0)
                    w[:, 1] = offs
                    w[:, 2] = addrs
                    if self._nreg and self._use_fixed(w, write):
                        self._gkind[b] = (-1, -1, 0)
                    slots = [(first, n)]
                else:
                    blocks = [gfree.pop() for _ in range(-(-n // BLOCK))]
                    slots = self._fill_blocks(req, blocks, opfd, addrs, sizes, offs, n,
                                              write)
            else:
                if not self._sfree:
                    return None
                slot = self._sfree.pop()
                self._entries[slot] = req
                slot += self._g
                self._sqe[slot, :4] = (opfd, offs[0], addrs[0], sizes)
                self._sqe[slot, 5] = 0
                if self._nreg:
                    self._use_fixed(self._sqe[slot:slot + 1], write)
                slots = [slot]
            self._busy += n
            self._push(slots)
            queued, err = self._enter_submit(n)
            if queued == 0:
                self._release(req, slots, group)
        if queued == 0:
            if err in (errno.EINVAL, errno.EAGAIN, errno.EBUSY, errno.EOPNOTSUPP,
                       errno.ENOSYS, errno.ENOMEM):
                return None
            raise OSError(err, os.strerror(err))
        if queued < n:                  # queued in part: the rest fails with the error
            rest = self._ids_of(slots)[queued:]
            with self._token:
                self._deliver(rest, [-err] * len(rest))
        return req

    def _fill_blocks(self, req: _Req, blocks: list, opfd: int, addrs: Any, sizes: Any,
                     offs: Any, n: int, write: bool) -> list:
        """Holding the lock: write the SQEs of a group into its blocks; returns the
        (first SQE, count) of each block."""
        same = type(sizes) is int
        slots = []
        for j, b in enumerate(blocks):
            lo = j * BLOCK
            hi = min(n, lo + BLOCK)
            k = hi - lo
            self._gowner[b] = (req, lo)
            self._gleft[b] = k
            first = b * BLOCK
            w = self._sqe[first:first + k]
            kind = self._gkind[b]       # opcode, descriptor and size as last written
            if not same or kind[0] != opfd or kind[1] != sizes or kind[2] < k:
                w[:, 0] = opfd
                w[:, 3] = sizes if same else sizes[lo:hi]
                w[:, 5] = 0
                self._gkind[b] = (opfd, sizes, k) if same else (-1, -1, 0)
            w[:, 1] = offs[lo:hi]
            w[:, 2] = addrs[lo:hi]
            if self._nreg and self._use_fixed(w, write):
                self._gkind[b] = (-1, -1, 0)
            slots.append((first, k))
        return slots

    def _ids_of(self, slots: list) -> list:
        return [i for s in slots for i in ((s,) if type(s) is int else
                                           range(s[0], s[0] + s[1]))]

    def _push(self, slots: list) -> None:
        """Holding the lock: append the SQE indices of ``slots`` to the SQ array (the SQ
        tail itself is stored by ``_enter_submit``)."""
        arr, mask, at = self._sq_array, self._sq_mask, self._stail
        for s in slots:
            if type(s) is int:
                arr[at & mask] = s
                at += 1
                continue
            first, k = s
            start = at & mask
            m = min(k, self._sq_n - start)
            arr[start:start + m] = self._ids[first:first + m]
            if m < k:                               # the ring wraps
                arr[:k - m] = self._ids[first + m:first + k]
            at += k

    def _release(self, req: _Req, slots: list, group: bool) -> None:
        """Holding the lock: give back the slots of a request the kernel took nothing of."""
        self._busy -= req._left
        if not group:
            self._entries[slots[0] - self._g] = None
            self._sfree.append(slots[0] - self._g)
            return
        for first, _k in slots:
            b = first // BLOCK
            self._gowner[b] = None
            self._gfree.append(b)

    def _use_fixed(self, w: np.ndarray, write: bool) -> bool:
        """Switch the SQE rows ``w`` whose buffers are registered to the fixed operation;
        True if any was."""
        op = np.uint64(_OP_WRITE_FIXED if write else _OP_READ_FIXED)
        start = w[:, 2]
        end = start + (w[:, 3] & np.uint64(_M32))
        hit = False
        for slot, r in enumerate(self._regs):
            if r is None:
                continue
            m = (start >= np.uint64(r[0])) & (end <= np.uint64(r[1]))
            if m.any():
                w[m, 0] = (w[m, 0] & np.uint64(~0xFF & (2**64 - 1))) | op
                w[m, 5] = slot
                hit = True
        return hit

    def _enter_submit(self, k: int) -> tuple[int, int]:
        """Publish ``k`` written SQEs (the tail store) and submit them with one enter."""
        self._stail = (self._stail + k) & _M32
        self._u32[self._sq_tail_i] = self._stail
        got = self._enter_now(self._nr[1], self._fd, k, 0, 0, self._null, self._zero)
        if got == k:
            return k, 0
        err = ctypes.get_errno() if got < 0 else errno.EAGAIN
        head = int(self._u32[self._sq_head_i])      # what the kernel took
        taken = (head - (self._stail - k)) & _M32
        if taken < k:
            # Not taken: take the SQEs back (only a submitting enter, under our lock,
            # reads them, so the kernel cannot see them after this store)
            self._stail = head
            self._u32[self._sq_tail_i] = head
        return taken, err

    def _requeue(self, again: list) -> None:
        """Submit the rest of continued or retried transfers: (slot, request, index)."""
        failed: tuple[list, list] = ([], [])
        with self._lock:
            for slot, req, i in again:
                addr, size, off = req.part(i)
                done = req._done.get(i, 0) if req._done else 0
                opfd = (_OP_WRITE if req._write else _OP_READ) | (req._fd << 32)
                self._sqe[slot, :4] = (opfd, off + done, addr + done, size - done)
                self._sqe[slot, 5] = 0
                if self._nreg:
                    self._use_fixed(self._sqe[slot:slot + 1], req._write)
                if slot < self._g:
                    self._gkind[slot // BLOCK] = (-1, -1, 0)
                self._push([slot])
                got, err = self._enter_submit(1)
                if not got:
                    req._tries = req._tries or {}
                    req._tries[i] = RETRIES + 1         # no retry of a refused one
                    failed[0].append(slot)
                    failed[1].append(-err)
        if failed[0]:
            self._deliver(*failed)

    # -------------------------------------------------------------- completion
    def _collect(self) -> int:
        """Holding the token: read the CQEs in the ring (no system call), give the slots
        back and complete their requests. Returns how many CQEs."""
        tail = int(self._u32[self._cq_tail_i])
        head = self._chead
        n = (tail - head) & _M32
        if not n:
            return 0
        start = head & self._cq_mask
        rows = self._cqe[start:start + n]
        uds, res = rows["ud"].tolist(), rows["res"].tolist()
        if len(uds) < n:                            # the ring wraps
            rows = self._cqe[:n - len(uds)]
            uds += rows["ud"].tolist()
            res += rows["res"].tolist()
        self._chead = tail
        self._u32[self._cq_head_i] = tail        # after the loads above (see module doc)
        self._deliver(uds, res)
        return n

    def _deliver(self, slots: list, results: list) -> None:
        """Complete transfers (slot, result); continue short ones, retry EINTR/EAGAIN."""
        finished, blocks, singles, again, ended = [], [], [], [], 0
        gowner, gleft, entries, g = self._gowner, self._gleft, self._entries, self._g
        t1 = time.perf_counter()
        for slot, res in zip(slots, results):
            if slot < g:
                b, i = divmod(slot, BLOCK)
                owner = gowner[b]
                if owner is None:
                    continue
                req, lo = owner
                i += lo
            else:
                req = entries[slot - g]
                if req is None:
                    continue
                i = 0
            s = req._sizes
            if res != (s if type(s) is int else s[i]):
                if not self._settle_odd(req, i, res, s if type(s) is int else s[i]):
                    again.append((slot, req, i))
                    continue
            else:
                req._results[i] = res
            req._left -= 1
            ended += 1
            if not req._left:
                finished.append(req)
            if slot < g:
                gleft[b] -= 1
                if not gleft[b]:
                    gowner[b] = None
                    blocks.append(b)
            else:
                entries[slot - g] = None
                singles.append(slot - g)
        if ended:
            with self._lock:
                self._busy -= ended
                self._gfree.extend(blocks)
                self._sfree.extend(singles)
        if again:
            self._requeue(again)
        if finished:
            linux_aio.complete_all(finished, _value, t1)

    def _settle_odd(self, req: _Req, i: int, res: int, size: int) -> bool:
        """A result other than the full size: True when transfer ``i`` is over (its final
        count or errno in ``req._results[i]``), False to submit (the rest of) it again."""
        done = req._done.get(i, 0) if req._done else 0
        if res in (-errno.EINTR, -errno.EAGAIN):
            tries = req._tries or {}
            req._tries = tries
            tries[i] = tries.get(i, 0) + 1
            if tries[i] <= RETRIES:
                return False
        elif 0 < res < size - done and (done + res) % ALIGN == 0:
            req._done = req._done or {}
            req._done[i] = done + res
            return False
        elif res == size - done:
            req._results[i] = size
            return True
        req._results[i] = res if res < 0 else done + res
        return True

    def _reap(self, min_nr: int, wait: tuple) -> int:
        """Holding the token: collect what is there, else wait in the kernel for
        ``min_nr`` completions (at most the ``wait`` timeout). Returns how many, or
        -errno."""
        n = self._collect()
        if n or min_nr <= 0:
            return n
        got = self._enter(self._nr[1], self._fd, 0, min_nr,
                          _ENTER_GETEVENTS | _ENTER_EXT_ARG, wait[2], self._argsz)
        if got < 0:
            err = ctypes.get_errno()
            if err not in (errno.ETIME, errno.EINTR, errno.EAGAIN):
                return -err
        return self._collect()

    def _wait(self, req: _Req, deadline: float | None) -> bool:
        """Reap in this thread until ``req`` is complete (or ``deadline`` passes)."""
        if self._pid != os.getpid():    # a forked child: the parent's ring is not ours
            return req.settle(None if deadline is None else deadline - time.perf_counter())
        return super()._wait(req, deadline)

    def _wait_step(self, req: _Req, deadline: float | None) -> int | None:
        if not self._token.acquire(False):
            return None
        try:
            if _is_done(req):
                return 0
            wait = self._waiter_wait
            if deadline is not None:
                left = max(0.0, deadline - time.perf_counter())
                if left < WAITER_WAIT_NS * 1e-9:
                    wait = _wait_arg(int(left * 1e9))
            return self._reap(min(req._left, self._cq_n), wait)
        finally:
            self._token.release()

    def _reap_loop(self) -> None:
        """Collect completions nobody waits for, from memory only: a wait in the kernel
        would hold the token against a waiter, and cannot hurry a completion anyway (the
        kernel posts it through the submitting thread, which it interrupts to do so)."""
        nap = GRACE
        while self._pid == os.getpid():
            if not self._busy:
                time.sleep(IDLE_SLEEP)  # nothing in flight: look again now and then
                continue
            if self._waiting or time.perf_counter() - self._last_wait < GRACE:
                # A waiter reaps for itself (a submitter's next wait will). The naps
                # double while that lasts (up to NAP_MAX): each look takes the GIL from
                # the caller, and on a busy node a reaper not scheduled at once stalls it.
                time.sleep(nap)
                nap = min(2 * nap, NAP_MAX)
                continue
            nap = GRACE
            if self._token.acquire(False):
                try:
                    self._collect()
                except BaseException:  # noqa: BLE001 - a callback's; all were completed
                    pass            # first: the reaper must live on
                finally:
                    self._token.release()
            time.sleep(GRACE)

    def poll(self) -> int:
        """Complete the transfers that have finished, in the calling thread (a look at
        the CQ in memory, no system call); returns how many."""
        if not self._busy or self._pid != os.getpid():
            return 0
        return requests.shielded(self._poll_step)

    def _poll_step(self) -> int:
        if not self._token.acquire(False):
            return 0
        try:
            return self._collect()
        finally:
            self._token.release()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._busy

    def requests_on(self, fd: int) -> list[requests.Request]:
        """The requests with a transfer on descriptor ``fd`` still in flight."""
        with self._lock:
            found: dict[int, requests.Request] = {}
            for owner in self._gowner:
                if owner is not None and owner[0]._fd == fd:
                    found[id(owner[0])] = owner[0]
            for req in self._entries:
                if req is not None and req._fd == fd:
                    found[id(req)] = req
        return list(found.values())

    def idle(self) -> bool:
        """True when no transfer is in flight and every slot is free."""
        with self._lock:
            return not self._busy and len(self._gfree) == BLOCKS \
                and len(self._sfree) == len(self._entries)


_engine: list[Engine | None] = []
_engine_lock = threading.Lock()
_chosen: list = []          # the engine native_engine() gives, once chosen
ENGINES = ("auto", "io_uring", "aio", "threads")


def engine() -> Engine | None:
    """This process's io_uring engine, or None where the kernel, the architecture or a
    seccomp filter refuses io_uring (probed once per process)."""
    if _engine:
        return _engine[0]
    made = None
    with _engine_lock:
        if not _engine:
            nr = _NR.get(platform.machine())
            eng = None
            if nr is not None:
                try:
                    eng = made = Engine(nr)
                except (OSError, AttributeError, ValueError):
                    eng = None      # ENOSYS, EPERM (io_uring_disabled, seccomp), ENOMEM
            _engine.append(eng)
    if made is not None:
        made._reaper.start()    # outside the lock: see ``_Pool.start`` in runtime.pool
    return _engine[0]


def native_engine() -> Any:
    """The engine of the local backend's aligned O_DIRECT requests: the ``aio_engine``
    setting's choice; by default ('auto') Linux AIO, else io_uring, else None (the I/O
    threads). 'auto' prefers AIO because io_uring measured no faster here (4 KiB GAMESS
    mixes 0.85-1.05x AIO, 8 MiB 0.99x, quiet machine, interleaved; again 2026-11-26,
    load 1.2-1.8: 0.76-1.19x, behind in 6 of 12 mix/round pairs, 8 MiB 0.92-1.10x) and AIO
    has the longer record; ``aio_engine='io_uring'`` chooses it.
    A forced engine the kernel does not offer gives None. ``CHEMIO_NO_AIO=1`` still means
    'threads'."""
    if _chosen:
        return _chosen[0]
    want = config.get("aio_engine")
    if os.environ.get("CHEMIO_NO_AIO") == "1":
        want = "threads"
    eng: Any = None
    if want in ("auto", "aio"):
        eng = linux_aio.engine()
    if eng is None and want in ("auto", "io_uring"):
        eng = engine()
    _chosen[:] = [eng]
    return eng


def engine_name() -> str:
    """Which engine ``native_engine()`` gives: 'io_uring', 'aio' or 'threads'."""
    eng = native_engine()
    return "threads" if eng is None else "io_uring" if isinstance(eng, Engine) else "aio"


def settle_descriptor(fd: int | None) -> None:
    """Wait until no transfer on descriptor ``fd`` is in flight in either engine (see
    ``linux_aio.settle_descriptor``): for a store about to close or sync it."""
    linux_aio.settle_descriptor(fd)
    eng = _engine[0] if _engine else None
    if eng is None or fd is None or fd < 0 or eng._pid != os.getpid():
        return
    reqs = eng.requests_on(fd)
    if reqs:
        requests.settle(reqs)


def _setting_changed(changes: dict, reset: bool) -> None:
    _chosen.clear()


config.on_change(("aio_engine",), _setting_changed)


def _after_fork_in_child() -> None:
    _engine.clear()         # the ring and the reaper belong to the parent
    _chosen.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
