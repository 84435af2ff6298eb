"""GAMESS-like I/O mixes on a per-process EAF file: async API vs a bare ctypes AIO loop and fio.

After the distributed-file-system study of GAMESS: as its scratch files grow, the
read/write mix moves through 0/100, 5/95, 65/35 and 85/15 (percent reads/writes). Each mix
runs on one per-process ``cio.ExclusiveFile`` (1 GiB; 64 MiB in quick mode, filled with
random bytes first, opened with ``direct=True`` so that every side bypasses the page cache)
with random, size-aligned requests of 4 KiB and of 8 MiB, 32 requests in flight, issued two
ways through the async API: grouped, ``GROUP`` requests per ``aread_many``/``awrite_many``
call (the library's way to issue many requests; the targets apply to it), and one request
per ``aread``/``awrite`` call in a ring of 32, the oldest waited for before its slot is
reused (reported for information).

Two references run the same file, mix, request size and queue depth in the same run:

* the pure-Python ceiling (issue 15): a bare ctypes ``io_submit``/``io_getevents`` loop with
  no chemio_py code (its own control blocks, syscall numbers, O_DIRECT descriptor and
  buffers), which refills every finished slot and submits the refills with one system call.
  Its buffers are the same kind of memory as ``cio.aligned_empty``'s: private, on a 2 MiB
  boundary, marked for transparent huge pages. Without O_DIRECT or Linux AIO it is skipped
  (the note says why);
* the same loop in the grouped calls' shape (``run_grouped``): groups of ``GROUP``, one
  ``io_submit`` for a group's reads and one for its writes, the oldest group reaped whole
  before its slots are refilled: what the grouped calls would reach with no Python cost
  of their own. At 4 KiB it ran 1.2-1.4x the loop above (2026-11-27: fuller
  ``io_submit`` calls, each of which has a fixed cost), so the grouped calls' distance to
  it is their own Python per call, not their shape;
* fio (``ioengine=libaio``, ``iodepth=32``, ``direct=1``, time based), when installed. Its
  buffers are in small pages, so an 8 MiB transfer of fio's reaches the device in requests
  of at most ``max_segments`` pages (254 x 4 KiB on this VM's virtio disk), where a
  transfer from huge pages goes in requests of ``max_sectors_kb`` (4 MiB): at 8 MiB the
  loop is the like-for-like reference (2026-11-27: loop 2.4-3.2x fio, chemio 0.97-1.08x
  the loop).

The grouped calls, the loop and fio alternate (ABBA) in slices of the case's time (10 at
4 KiB, 4 at 8 MiB), so that the disk's drift hits all of them alike; their rates are the
sums over the slices.

The grouped calls run on the engine the local backend chooses (``aio_engine``, or
``CHEMIO_AIO_ENGINE``); when that is not Linux AIO (``CHEMIO_AIO_ENGINE=io_uring``) they run a
second time with Linux AIO forced, alternating with the rest, so that the two engines are
compared in the same run. The slots are not registered with io_uring: at 4 KiB the check of
each submission against the registered buffers cost more Python time than the page pinning it
saves (measured 2026-11-26).

Targets (issue 28): the grouped calls on the chosen engine >= 0.9x fio at 4 KiB on every mix
and at 8 MiB (fio's bandwidth); the Linux AIO rows carry their ratio to the ceiling loop (the
issue-15 target, 0.9x) and the ceiling row its ratio to fio.
"""
from __future__ import annotations

import collections
import ctypes
import errno
import mmap
import os
import platform
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (GiB, KiB, MiB, fio_available, mib_s, payload, raw_write_seq,  # noqa: E402
                    row, run_fio)

MIXES = ((0, 100), (5, 95), (65, 35), (85, 15))       # percent reads / writes
# request size, label, target of the grouped calls, metric, what the target is against
SIZES = ((4 * KiB, "4 KiB", 0.9, "IOPS", "fio"), (8 * MiB, "8 MiB", 0.9, "MiB/s", "fio"))
IN_FLIGHT = 32
GROUP = 8               # requests per aread_many/awrite_many call in the grouped variant
NAME = "gamess"
CEILING = "ctypes io_submit loop"
_HUGE = 2 * MiB          # a transparent huge page
_REAP_MIN = 1            # the ceiling loop refills as soon as one request has finished


def _rates(nread: int, nwrite: int, size: int, dt: float) -> dict:
    ops = nread + nwrite
    return {"iops": ops / dt, "mib_s": mib_s(ops * size, dt), "read_iops": nread / dt,
            "write_iops": nwrite / dt, "seconds": dt}


def _ours(cio: Any, workdir: str, size: int, fsize: int, read_pct: int, seconds: float,
          bufs: list, seed: int) -> dict:
    """Random ``size``-byte requests, ``read_pct`` % reads, 32 in flight for ``seconds``."""
    rng = np.random.default_rng(seed)
    nslots = fsize // size
    batch = max(1, min(256, (32 * MiB) // size))     # ops between two looks at the clock
    with cio.ExclusiveFile(NAME, "r+", dir=workdir, backend="local", direct=True) as f:
        aread, awrite = f.aread, f.awrite
        ring: collections.deque = collections.deque()
        nread = nwrite = 0
        t0 = time.perf_counter()
        deadline = t0 + seconds
        slot = 0
        while time.perf_counter() < deadline:
            offs = (rng.integers(0, nslots, batch) * size).tolist()
            reads = (rng.integers(0, 100, batch) < read_pct).tolist()
            for off, is_read in zip(offs, reads):
                if len(ring) >= IN_FLIGHT:
                    ring.popleft().wait()
                buf = bufs[slot]
                slot = (slot + 1) % IN_FLIGHT
                if is_read:
                    ring.append(aread(off, buf))
                    nread += 1
                else:
                    ring.append(awrite(off, buf))
                    nwrite += 1
        while ring:
            ring.popleft().wait()
        dt = time.perf_counter() - t0
    return _rates(nread, nwrite, size, dt)


def _with_engine(engine: str | None, fn: Any) -> Any:
    """``fn`` run with the ``aio_engine`` setting forced to ``engine`` (None: as it is)."""
    if engine is None:
        return fn
    from chemio_py.runtime import config

    def run(*a: Any) -> Any:
        s = config.get_setting("aio_engine")
        config.configure(aio_engine=engine)
        try:
            return fn(*a)
        finally:
            config.configure(aio_engine=s.value if s.source == "explicit" else None)
    return run


def _engine_name() -> str:
    from chemio_py.backends.local import io_uring
    return {"io_uring": "io_uring", "aio": "Linux AIO", "threads": "I/O threads"}[
        io_uring.engine_name()]


def _ours_grouped(cio: Any, workdir: str, size: int, fsize: int, read_pct: int,
                  seconds: float, bufs: np.ndarray, seed: int) -> tuple[int, int, float]:
    """The same random mix, issued ``GROUP`` at a time with ``aread_many``/``awrite_many``.

    Each group of ``GROUP`` random requests becomes one read call and one write call (the
    mix decides the split); groups are waited for oldest first, so that exactly
    ``IN_FLIGHT`` requests are in flight whenever a new group is issued. Returns
    ``(reads, writes, seconds)``.
    """
    rng = np.random.default_rng(seed)
    nslots = fsize // size
    groups = IN_FLIGHT // GROUP
    batch = max(1, min(64, (32 * MiB) // (size * GROUP)))
    with cio.ExclusiveFile(NAME, "r+", dir=workdir, backend="local", direct=True) as f:
        aread_many, awrite_many = f.aread_many, f.awrite_many
        ring: collections.deque = collections.deque()
        nread = nwrite = 0
        t0 = time.perf_counter()
        deadline = t0 + seconds
        g = 0
        while time.perf_counter() < deadline:
            offs = rng.integers(0, nslots, (batch, GROUP)) * size
            nreads = (rng.integers(0, 100, (batch, GROUP)) < read_pct).sum(axis=1).tolist()
            for k in range(batch):
                if len(ring) >= groups:
                    for r in ring.popleft():
                        r.wait()
                rows = bufs[(g % groups) * GROUP:(g % groups + 1) * GROUP]
                g += 1
                nr = nreads[k]
                reqs = []
                if nr:
                    reqs.append(aread_many(offs[k, :nr], rows[:nr]))
                if nr < GROUP:
                    reqs.append(awrite_many(offs[k, nr:], rows[nr:]))
                ring.append(reqs)
                nread += nr
                nwrite += GROUP - nr
        while ring:
            for r in ring.popleft():
                r.wait()
        dt = time.perf_counter() - t0
    return nread, nwrite, dt


# ------------------------------------------------------------------ the pure-Python ceiling
# Deliberately independent of chemio_py: the kernel ABI written out here.
_AIO_SYSCALLS = {"x86_64": (206, 207, 208, 209),   # io_setup, io_destroy, io_getevents,
                 "aarch64": (0, 1, 4, 2)}           # io_submit
_OP_PREAD, _OP_PWRITE = 0, 1


class _Iocb(ctypes.Structure):          # struct iocb (linux/aio_abi.h), little endian
    _fields_ = [("aio_data", ctypes.c_uint64), ("aio_key", ctypes.c_uint32),
                ("aio_rw_flags", ctypes.c_int32), ("aio_lio_opcode", ctypes.c_uint16),
                ("aio_reqprio", ctypes.c_int16), ("aio_fildes", ctypes.c_uint32),
                ("aio_buf", ctypes.c_uint64), ("aio_nbytes", ctypes.c_uint64),
                ("aio_offset", ctypes.c_int64), ("aio_reserved2", ctypes.c_uint64),
                ("aio_flags", ctypes.c_uint32), ("aio_resfd", ctypes.c_uint32)]


class _IoEvent(ctypes.Structure):       # struct io_event
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64),
                ("res", ctypes.c_int64), ("res2", ctypes.c_int64)]


class _CeilingLoop:
    """A bare ``io_submit``/``io_getevents`` loop over one O_DIRECT descriptor.

    ``IN_FLIGHT`` control blocks, each with its own page-aligned buffer, are made once;
    the loop waits for finished ones, refills exactly those slots (opcode and offset, two
    NumPy assignments over the control blocks as 64-bit words) and submits them with one
    system call. Raises OSError where the file system refuses O_DIRECT or the kernel has
    no AIO (``errno`` says which).
    """

    def __init__(self, path: str, size: int):
        nr = _AIO_SYSCALLS.get(platform.machine())
        if nr is None:
            raise OSError(errno.ENOSYS, f"no Linux AIO syscall numbers for "
                                        f"{platform.machine()}")
        self.size = size
        self._setup, self._destroy, self._getevents, self._submit = nr
        self._sys = ctypes.CDLL(None, use_errno=True).syscall
        self._sys.restype = ctypes.c_long
        self.fd = os.open(path, os.O_RDWR | os.O_DIRECT)   # EINVAL: no O_DIRECT here
        self.ctx = ctypes.c_ulong(0)
        if self._sys(self._setup, IN_FLIGHT, ctypes.byref(self.ctx)) != 0:
            err = ctypes.get_errno()
            os.close(self.fd)
            raise OSError(err, f"io_setup: {os.strerror(err)}")
        # private memory on a 2 MiB boundary, marked for transparent huge pages: the same
        # kind chemio_py's aligned_empty gives (physically contiguous pieces make the device
        # requests of a large O_DIRECT transfer larger; small pages would handicap the loop)
        self._mem = mmap.mmap(-1, IN_FLIGHT * size + _HUGE,
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            self._mem.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError, ValueError):
            pass
        bufs = np.frombuffer(self._mem, np.uint8)
        bufs = bufs[(-bufs.ctypes.data) % _HUGE:][:IN_FLIGHT * size]
        bufs[:] = 7                                          # touched before timing
        self._cbs = (_Iocb * IN_FLIGHT)()
        self._events = (_IoEvent * IN_FLIGHT)()
        slots = np.arange(IN_FLIGHT, dtype=np.uint64)
        # word 0 aio_data, 2 opcode | fildes << 32, 3 aio_buf, 4 aio_nbytes, 5 aio_offset
        self._words = np.frombuffer(self._cbs, np.uint64).reshape(IN_FLIGHT, 8)
        self._words[:, 0] = slots
        self._words[:, 3] = bufs.ctypes.data + slots * size
        self._words[:, 4] = size
        self._ev = np.frombuffer(self._events, np.int64).reshape(IN_FLIGHT, 4)
        self._ptrs = (ctypes.addressof(self._cbs) + slots * ctypes.sizeof(_Iocb))
        self._submit_list = np.empty(IN_FLIGHT, np.uint64)
        del bufs

    def run(self, fsize: int, read_pct: int, seconds: float,
            seed: int) -> tuple[int, int, float]:
        """``read_pct`` % random reads, the rest writes, for ``seconds``: (reads, writes, s)."""
        size, words, ptrs, todo = self.size, self._words, self._ptrs, self._submit_list
        sysc, ctx, submit = self._sys, self.ctx, self._submit
        todo_addr = ctypes.c_void_p(todo.ctypes.data)
        rng = np.random.default_rng(seed)
        nslots = fsize // size
        batch = max(4 * IN_FLIGHT, min(4096, (64 * MiB) // size))
        ops = np.array([_OP_PWRITE | self.fd << 32, _OP_PREAD | self.fd << 32], np.uint64)

        def draw() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            reads = rng.integers(0, 100, batch) < read_pct
            return (rng.integers(0, nslots, batch) * size).astype(np.uint64), ops[reads + 0], \
                reads

        offs, opfd, reads = draw()
        nread = nwrite = 0
        t0 = time.perf_counter()
        deadline = t0 + seconds
        words[:, 2] = opfd[:IN_FLIGHT]
        words[:, 5] = offs[:IN_FLIGHT]
        todo[:] = ptrs
        pos = self._submit_all(IN_FLIGHT, todo_addr)
        in_flight = IN_FLIGHT
        while True:
            done = self._reap(_REAP_MIN)
            n = len(done)
            in_flight -= n
            if time.perf_counter() >= deadline:
                break
            if pos + n > batch:
                k = int(reads[:pos].sum())
                nread, nwrite = nread + k, nwrite + pos - k
                offs, opfd, reads = draw()
                pos = 0
            slots = done[:, 0]
            words[slots, 2] = opfd[pos:pos + n]
            words[slots, 5] = offs[pos:pos + n]
            todo[:n] = ptrs[slots]
            if sysc(submit, ctx, n, todo_addr) != n:
                err = ctypes.get_errno()
                raise OSError(err, f"io_submit: {os.strerror(err)}")
            pos += n
            in_flight += n
        while in_flight:                     # drain: every submitted request counts
            in_flight -= len(self._reap(1))
        dt = time.perf_counter() - t0
        k = int(reads[:pos].sum())
        return nread + k, nwrite + pos - k, dt

    def run_grouped(self, fsize: int, read_pct: int, seconds: float,
                    seed: int) -> tuple[int, int, float]:
        """The grouped calls' own shape with no chemio_py code: ``IN_FLIGHT // GROUP`` groups
        of ``GROUP`` requests, drawn as ``_ours_grouped`` draws them; a group's reads go in
        one ``io_submit`` and its writes in another (one ``aread_many`` and one
        ``awrite_many`` call), and the oldest group is reaped whole before its slots are
        refilled. What the grouped calls would reach with no Python cost of their own.
        Returns ``(reads, writes, seconds)``."""
        size, words, ptrs, todo = self.size, self._words, self._ptrs, self._submit_list
        todo_addr = ctypes.c_void_p(todo.ctypes.data)
        rng = np.random.default_rng(seed)
        nslots = fsize // size
        groups = IN_FLIGHT // GROUP
        batch = max(1, min(64, (32 * MiB) // (size * GROUP)))
        op_read, op_write = _OP_PREAD | self.fd << 32, _OP_PWRITE | self.fd << 32
        left = [0] * groups                  # requests of each group not reaped yet

        def reap(g: int) -> None:
            while left[g]:
                for slot in self._reap(1)[:, 0].tolist():
                    left[slot // GROUP] -= 1

        def submit(g: int, offs: np.ndarray, nr: int) -> None:
            first = g * GROUP
            words[first:first + GROUP, 5] = offs
            words[first:first + nr, 2] = op_read
            words[first + nr:first + GROUP, 2] = op_write
            for lo, hi in ((first, first + nr), (first + nr, first + GROUP)):
                if hi > lo:
                    todo[:hi - lo] = ptrs[lo:hi]
                    self._submit_all(hi - lo, todo_addr)
            left[g] = GROUP

        def draws() -> Any:                  # (offsets, reads) of each group, as drawn
            while True:
                offs = (rng.integers(0, nslots, (batch, GROUP)) * size).astype(np.uint64)
                reads = (rng.integers(0, 100, (batch, GROUP)) < read_pct).sum(axis=1)
                yield from zip(offs, reads.tolist())

        nread = nwrite = started = 0
        t0 = time.perf_counter()
        deadline = t0 + seconds
        for offs, nr in draws():
            g = started % groups
            if started >= groups:
                reap(g)                      # the oldest group, as the grouped calls wait
            if time.perf_counter() >= deadline:
                break
            submit(g, offs, nr)
            nread += nr
            nwrite += GROUP - nr
            started += 1
        for g in range(groups):              # drain: every submitted request counts
            reap(g)
        return nread, nwrite, time.perf_counter() - t0

    def _reap(self, min_nr: int) -> np.ndarray:
        """Wait for at least ``min_nr`` finished transfers (EINTR retried); their events'
        rows (data, obj, res, res2). Raises OSError for a transfer that did not move
        ``size`` bytes."""
        events = ctypes.c_void_p(ctypes.addressof(self._events))
        while True:
            n = self._sys(self._getevents, self.ctx, min_nr, IN_FLIGHT, events, None)
            if n > 0:
                break
            err = ctypes.get_errno()
            if n < 0 and err == errno.EINTR:
                continue
            raise OSError(err, f"io_getevents: {os.strerror(err)}")
        done = self._ev[:n]
        if (done[:, 2] != self.size).any():
            res = int(done[:, 2][done[:, 2] != self.size][0])
            raise OSError(-res if res < 0 else errno.EIO,
                          f"AIO transfer returned {res}, expected {self.size}")
        return done

    def _submit_all(self, n: int, todo_addr: ctypes.c_void_p) -> int:
        if self._sys(self._submit, self.ctx, n, todo_addr) != n:
            err = ctypes.get_errno()
            raise OSError(err, f"io_submit: {os.strerror(err)}")
        return n

    def close(self) -> None:
        self._sys(self._destroy, self.ctx)
        os.close(self.fd)
        del self._words, self._ev
        self._mem.close()


def _ceiling_loop(path: str, size: int) -> tuple[_CeilingLoop | None, str]:
    """The ceiling loop for ``path``, or None and why it cannot run here."""
    try:
        return _CeilingLoop(path, size), ""
    except OSError as e:
        why = ("no O_DIRECT on this file system" if e.errno == errno.EINVAL
               else f"no Linux AIO here ({e})")
        return None, f"{CEILING} skipped: {why}"


def _fio(path: str, size: int, fsize: int, read_pct: int, seconds: float,
         seed: int) -> tuple[int, int, float]:
    """fio on the same file, mix, size and depth for ``seconds``: (reads, writes, seconds)."""
    rw = "randwrite" if read_pct == 0 else "randread" if read_pct == 100 else "randrw"
    res = run_fio(name=f"gamess{read_pct}", filename=path, rw=rw,
                  rwmixread=read_pct if rw == "randrw" else None, bs=size, size=fsize,
                  ioengine="libaio", iodepth=IN_FLIGHT, direct=1,
                  runtime=f"{max(1, round(seconds * 1000))}ms", time_based=True,
                  randseed=seed, norandommap=True)
    assert res is not None
    dt = sum(j.get("job_runtime", 0) for j in res["raw"]["jobs"]) / 1000.0 or seconds
    return round(res["read_iops"] * dt), round(res["write_iops"] * dt), dt


def _interleaved(runs: dict, slices: int, seconds: float, seed: int) -> dict:
    """Run each of ``runs`` (name -> fn(seconds, seed) -> (reads, writes, s)) in ``slices``
    slices of ``seconds / slices``, in ABBA order; their summed rates by name."""
    names = list(runs)
    tot = {n: [0, 0, 0.0] for n in names}
    for s in range(slices):
        for k, name in enumerate(names if s % 2 == 0 else names[::-1]):
            r, w, dt = runs[name](seconds / slices, seed + 10 * s + k)
            t = tot[name]
            t[0], t[1], t[2] = t[0] + r, t[1] + w, t[2] + dt
    return {n: tot[n] for n in names}


def run(quick: bool, workdir: str) -> list[dict]:
    """Quick: a 64 MiB file, 1 s per case; full: 1 GiB, 5 s per case."""
    import chemio_py as cio
    from chemio_py.runtime import config

    fsize = 64 * MiB if quick else 1 * GiB
    seconds = 1.0 if quick else 5.0
    path = os.path.join(workdir, f"{NAME}.0")
    raw_write_seq(path, fsize, chunk=8 * MiB, buf=payload(8 * MiB, seed=9))
    # no cached pages of the file, as fio leaves it (invalidate=1): a cached page in the
    # range of an O_DIRECT write sends io_uring's write to its worker threads (the
    # non-blocking first try refuses), where Linux AIO drops the page inline
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        direct_note = "O_DIRECT"
    except OSError:
        direct_note = "no O_DIRECT on this file system: page cache for chemio_py"
    have_fio = fio_available()
    s = config.get_setting("io_threads")
    changed = s.value < IN_FLIGHT
    restore = s.value if s.source == "explicit" else None
    if changed:
        config.configure(io_threads=IN_FLIGHT)      # 32 blocking preadv in flight = QD 32
    rows = []
    try:
        for size, label, target, metric, against in SIZES:
            key = "iops" if metric == "IOPS" else "mib_s"
            # the grouped calls, the loop and fio alternate (ABBA) in slices of the case's time
            slices = 2 if quick else 10 if size < MiB else 4
            bufs = [cio.aligned_empty(size) for _ in range(IN_FLIGHT)]
            for b in bufs:
                b[:] = 7                              # touched: no page faults while timing
            grouped = cio.aligned_empty((IN_FLIGHT, size))
            grouped[...] = 7
            loop, skipped = _ceiling_loop(path, size)
            if size == SIZES[0][0]:
                # untimed: the disk is still writing back the fill when the first case starts
                _ours_grouped(cio, workdir, size, fsize, 0, seconds / 2, grouped, seed=1)
            try:
                for i, (rd, wr) in enumerate(MIXES):
                    rows += _mix_rows(cio, workdir, path, size, label, target, metric, against,
                                      key, fsize, rd, wr, seconds, slices, bufs, grouped, loop,
                                      skipped, have_fio, direct_note, seed=100 + 1000 * i)
            finally:
                if loop is not None:
                    loop.close()
            del bufs, grouped
    finally:
        if changed:
            config.configure(io_threads=restore)
        os.unlink(path)
    return rows


def _mix_rows(cio: Any, workdir: str, path: str, size: int, label: str, target: float,
              metric: str, against: str, key: str, fsize: int, rd: int, wr: int,
              seconds: float, slices: int, bufs: list, grouped: np.ndarray,
              loop: _CeilingLoop | None, skipped: str, have_fio: bool, direct_note: str,
              seed: int) -> list[dict]:
    ours = _ours(cio, workdir, size, fsize, rd, seconds, bufs, seed=seed)
    runs = {"grouped": lambda sec, sd: _ours_grouped(cio, workdir, size, fsize, rd, sec,
                                                     grouped, sd)}
    engine = _engine_name()
    if engine != "Linux AIO":
        runs["grouped_aio"] = _with_engine("aio", runs["grouped"])
    if loop is not None:
        runs["ceiling"] = lambda sec, sd: loop.run(fsize, rd, sec, sd)
        runs["shape"] = lambda sec, sd: loop.run_grouped(fsize, rd, sec, sd)
    if have_fio:
        runs["fio"] = lambda sec, sd: _fio(path, size, fsize, rd, sec, sd)
    tot = {name: _rates(r, w, size, dt)
           for name, (r, w, dt) in _interleaved(runs, slices, seconds, seed + 1).items()}
    mine, ceil, theirs = tot["grouped"], tot.get("ceiling"), tot.get("fio")
    shape = tot.get("shape")
    aio = tot.get("grouped_aio")

    where = (f"{rd}/{wr} reads/writes, random {label} over {fsize // MiB} MiB, {IN_FLIGHT} "
             f"in flight, {seconds:g} s; {direct_note}")
    fio_txt = (f"; fio {theirs['read_iops']:.0f} r + {theirs['write_iops']:.0f} w ops/s"
               if theirs else "; no fio")

    def ops(res: dict, who: str) -> str:
        return f"; {who} {res['read_iops']:.0f} r + {res['write_iops']:.0f} w ops/s"

    fio_name, fio_val = ("fio libaio QD32", theirs[key]) if theirs else (None, None)
    out = [row(f"gamess {rd}/{wr} {label}: EAF async x{IN_FLIGHT}", metric, ours[key],
               fio_name, fio_val, None,
               where + ops(ours, "chemio") + fio_txt
               + "; one request per call, informational (target: grouped)")]
    note = where + ops(mine, "chemio") + fio_txt + f"; engine {engine}"
    note += (f"; {slices} alternating slices with the {CEILING}" if ceil is not None
             else "; " + skipped) + (" and fio" if theirs else "")
    if aio is not None:
        note += f" and the Linux AIO engine ({mine[key] / aio[key]:.2f}x it)"
    if shape is not None and shape[key]:
        note += f"; {mine[key] / shape[key]:.2f}x the {CEILING} in the grouped calls' shape"
    if against == "ceiling" and ceil is not None:
        base_name, base, tgt = f"{CEILING} QD{IN_FLIGHT}", ceil[key], target
        if theirs and theirs[key]:
            note += f"; {mine[key] / theirs[key]:.2f}x fio"
    else:                   # against fio; or the ceiling is missing: fio's figure, no target
        base_name, base = fio_name, fio_val
        tgt = target if theirs and against == "fio" else None
        if ceil is not None and ceil[key]:
            note += f"; {mine[key] / ceil[key]:.2f}x the {CEILING}"
    out.append(row(f"gamess {rd}/{wr} {label}: EAF async {GROUP} per call x{IN_FLIGHT}",
                   metric, mine[key], base_name, base, tgt, note))
    if aio is not None:
        a_note = where + ops(aio, "chemio") + fio_txt + "; Linux AIO engine forced"
        if theirs and theirs[key]:
            a_note += f"; {aio[key] / theirs[key]:.2f}x fio"
        a_base = (f"{CEILING} QD{IN_FLIGHT}", ceil[key]) if ceil is not None else (fio_name,
                                                                                  fio_val)
        out.append(row(f"gamess {rd}/{wr} {label}: EAF async {GROUP} per call x{IN_FLIGHT} "
                       f"(Linux AIO)", metric, aio[key], a_base[0], a_base[1], None, a_note))
    if ceil is not None:
        out.append(row(f"gamess {rd}/{wr} {label}: {CEILING} x{IN_FLIGHT} (ceiling)", metric,
                       ceil[key], fio_name, fio_val, None,
                       where + ops(ceil, "loop") + fio_txt
                       + "; bare ctypes io_submit/io_getevents, no chemio_py code"))
    if shape is not None:
        out.append(row(f"gamess {rd}/{wr} {label}: {CEILING} in the grouped calls' shape "
                       f"x{IN_FLIGHT} (their ceiling)", metric, shape[key], fio_name, fio_val,
                       None, where + ops(shape, "loop") + fio_txt
                       + f"; bare ctypes, groups of {GROUP}: one io_submit for a group's "
                       f"reads and one for its writes, the oldest group reaped before its "
                       f"slots are refilled"))
    return out


if __name__ == "__main__":
    import json
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        for r in run(quick="--full" not in sys.argv, workdir=d):
            print(json.dumps(r))
