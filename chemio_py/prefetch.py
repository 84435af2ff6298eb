"""Read-ahead and write-behind pipelines: ``prefetch``, ``iter_blocks``, ``WriteBehind``.

Double buffering without the juggling: the pipeline keeps ``depth`` requests in flight on
the I/O pool while the caller works on the buffer it was handed.

    >>> import numpy as np, chemio_py as cio
    >>> with cio.ExclusiveFile("pf.demo", "w+") as f:
    ...     _ = f.write(0, np.arange(10.0))
    ...     keys = range(0, 10, 4)                      # element offsets of blocks of 4
    ...     read = lambda k, buf: f.aread(8 * k, buf[:min(4, 10 - k)])
    ...     [float(b.sum()) for k, b in cio.prefetch(read, keys, lambda: np.empty(4), depth=2)]
    [6.0, 22.0, 17.0]

Contract (every pipeline here):

* items come in key order; a yielded buffer is valid until the next step, and the ring of
  ``depth + 1`` buffers is reused (no allocation per step);
* an error of a request surfaces as its original exception at the consumer's next step
  (then the pipeline is over);
* leaving early (``break``, an exception in the loop body, ``close()``, the end of a
  ``with`` block) cancels requests not started and waits for the ones running: nothing
  stays in flight;
* an interrupt (Ctrl-C, any signal handler that raises) inside a step or a ``close()``
  reaches the consumer, and the pipeline is then over; ``close()`` returns only once no
  request is in flight (one cut short by a second interrupt is finished by the next
  ``close()``: a ``with`` block's, or the collector's);
* ``depth=0`` is synchronous (each read completes before it is yielded) and
  ``CHEMIO_SYNC=1`` forces depth 0 everywhere;
* counters per pipeline (``.stats``; ``cio.report()`` shows the totals): time in I/O,
  time the consumer waited, overlap efficiency ``1 - wait/io``.

A pipeline belongs to one consumer thread.
"""
from __future__ import annotations

import collections
import itertools
import logging
import math
import mmap
import operator
import os
import sys
import threading
import time
import types
from stat import S_ISREG
from typing import Any, Callable, Iterable, Iterator, Literal

import numpy as np

from chemio_py.errors import ArgumentError, ChemIOError, fmt_bytes
from chemio_py.runtime import config, finalizers, pool, requests, stats

MAX_DEPTH = 1024
_counter = itertools.count(1)
_log = logging.getLogger(__name__)


def check_depth(depth: Any) -> int:
    """``depth`` as a validated int in [0, MAX_DEPTH]."""
    try:
        d = operator.index(depth)
    except TypeError:
        raise ArgumentError(f"depth must be an integer >= 0, got {type(depth).__name__} "
                            f"{depth!r}") from None
    if not 0 <= d <= MAX_DEPTH:
        raise ArgumentError(f"depth must be in [0, {MAX_DEPTH}], got {d}; depth is the number "
                            f"of requests kept in flight (0: synchronous)")
    return d


def effective_depth(depth: Any) -> int:
    """The depth a pipeline runs with: 0 in synchronous mode (``CHEMIO_SYNC=1``)."""
    d = check_depth(depth)
    return 0 if pool.sync_mode() else d


def _as_request(value: Any) -> requests.Request:
    return value if isinstance(value, requests.Request) else requests.completed(value)


def _nbytes(obj: Any) -> int:
    if obj is None:
        return 0
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    try:
        return memoryview(obj).nbytes
    except TypeError:
        n = getattr(obj, "nbytes", 0)
        return n if isinstance(n, int) else 0


def quiet_wait(req: requests.Request) -> None:
    """Wait for ``req`` to end (done, failed or cancelled), ignoring its outcome; an
    interrupt meanwhile is raised only once it has ended (``requests.settle``)."""
    requests.settle([req])


class _Op:
    """One request of a pipeline: what it reads, where, and when it ran."""

    __slots__ = ("key", "slot", "req", "own", "out", "nbytes", "t_issue", "t_done")
    req: requests.Request           # set right after the request is started

    def __init__(self, key: Any, slot: int):
        self.key = key
        self.slot = slot
        self.own: requests.Request | None = None     # a pool task of ours: safe to cancel
        self.out: Any = None
        self.nbytes = 0
        self.t_issue = 0.0
        self.t_done: float | None = None

    def mark_done(self, _req: Any) -> None:
        if self.t_done is None:
            self.t_done = time.perf_counter()


# start(key, buffer) -> (request to wait for, the same if it is a plain pool task we submitted
# (cancelling it on close is safe) else None, object to yield or None, nbytes or None)
StartFn = Callable[[Any, Any], tuple]


class Pipeline:
    """Read-ahead over a sequence of keys: an iterator of items with ``depth`` reads in flight.

    Made by ``prefetch`` and ``iter_blocks``; also a context manager. ``close()`` ends it
    early (idempotent); ``in_flight`` is the number of requests not yet handed out;
    ``stats`` the counters of this run.
    """

    def __init__(self, start: StartFn, keys: Iterable[Any], make_buffer: Callable[[], Any],
                 depth: int, *, name: str, kind: str = "read-ahead", ramp: int = 0,
                 counters: stats.PipelineStats | None = None):
        self._start = start
        # ramp > 0: the first read runs alone while the buffers of the next ``ramp - 1``
        # are made (and their pages faulted in); the rest start once it is done (reads of
        # one device share its bandwidth: three at once make the first wait for all three)
        self._ramp = ramp
        self._keys: Iterator[Any] = iter(keys)
        self.depth = effective_depth(depth)
        self._make_buffer = make_buffer
        self._bufs: list[Any] = [None] * (self.depth + 1)
        self._next_slot = 0
        self._ring: collections.deque[_Op] = collections.deque()
        self._exhausted = False
        self._closed = False
        self._t_yield: float | None = None
        self.name = name
        self.stats = counters if counters is not None else stats.new_pipeline(name, kind)

    # ------------------------------------------------------------ state
    @property
    def in_flight(self) -> int:
        return len(self._ring)

    @property
    def closed(self) -> bool:
        return self._closed

    def buffers(self) -> list[Any]:
        """The ring buffers allocated so far (for inspection; do not write to them)."""
        return [b for b in self._bufs if b is not None]

    # ------------------------------------------------------------ iteration
    def __iter__(self) -> "Pipeline":
        return self

    def _issue(self) -> bool:
        """Start the read of the next key; False when there is none. The read is started
        and put in the ring under a shield: an interrupt can never leave a read in flight
        that the ring (and so ``close()``) does not know."""
        with requests.shield():
            try:
                key = next(self._keys)
            except StopIteration:
                self._exhausted = True
                return False
            slot = self._next_slot
            self._next_slot = (slot + 1) % len(self._bufs)
            buf = self._bufs[slot]
            if buf is None:
                buf = self._bufs[slot] = self._make_buffer()
            op = _Op(key, slot)
            op.t_issue = time.perf_counter()
            req, own, out, nbytes = self._start(key, buf)
            op.req, op.own, op.out, op.nbytes = req, own, out, nbytes
            self._ring.append(op)
        req.add_done_callback(op.mark_done)
        return True

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        try:
            return self._step()
        except StopIteration:
            raise
        except BaseException:
            self._closed = True     # no step after this one, even if the close is cut short
            self.close()
            raise

    def _step(self) -> Any:
        """One step: keep ``depth`` reads in flight, wait for the oldest and hand it out.
        A read stays in the ring until its outcome is taken, so whatever interrupts a step,
        ``close()`` finds every read still in flight."""
        t_enter = time.perf_counter()
        if self._t_yield is not None:
            self.stats.computed(self._t_yield, t_enter)
            self._t_yield = None
        if self._ramp:
            ramp, self._ramp = self._ramp, 0
            if self.depth and self._issue():
                for slot in range(1, min(ramp, len(self._bufs))):
                    if self._bufs[slot] is None:
                        self._bufs[slot] = self._make_buffer()
                quiet_wait(self._ring[0].req)     # its outcome: below, as any other
        while len(self._ring) <= self.depth and not self._exhausted:
            if not self._issue():
                break
        if not self._ring:
            self.close()
            raise StopIteration
        op = self._ring[0]
        error: BaseException | None = None
        try:
            value = op.req.wait()
        except BaseException as e:  # noqa: BLE001 - re-raised below, the original object
            error, value = e, None
        t_end = time.perf_counter()
        if error is None:
            self._ring.popleft()
            if op.out is not None:
                item = op.out
            else:
                got = value if value is not None else self._bufs[op.slot]
                item = (op.key, got)
                if op.nbytes is None:
                    op.nbytes = _nbytes(got)
        w0 = max(op.t_issue, t_enter)
        self.stats.op_done((op.nbytes or 0) if error is None else 0, op.t_issue,
                           max(op.t_done or t_end, t_end), t_end - w0, w0, op.slot)
        if error is not None:
            raise error             # (__next__ closes: it waits for the read, still in the ring)
        self._t_yield = time.perf_counter()
        return item

    # ------------------------------------------------------------ ending
    def close(self) -> None:
        """Stop: cancel reads not started, wait for running ones, release the buffers.

        Only requests the pipeline submitted itself are cancelled; a request made by the
        reader (which may stand for several I/O calls) is waited for. Idempotent, and an
        interrupt at any moment leaves the reads still in flight in the ring: the next
        ``close()`` (a ``with`` block's, the collector's) finishes the job.
        """
        self._closed = True
        ring = self._ring
        if ring:
            for op in ring:
                if op.own is not None:
                    op.own.cancel()
            requests.settle([op.req for op in ring])
            for op in ring:
                op.req.observed()   # read-ahead dropped by the pipeline: nobody needs it
            ring.clear()
        if self._t_yield is not None:
            self.stats.computed(self._t_yield, time.perf_counter())
            self._t_yield = None
        self._bufs = [None] * len(self._bufs)

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            finalizers.close_later(self.close)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._ring)} in flight"
        return f"<Pipeline {self.name!r} depth={self.depth} {state}>"


def prefetch(read_into: Callable[[Any, Any], Any], keys: Iterable[Any],
             make_buffer: Callable[[], Any], depth: int = 2, *, blocking: bool = False,
             name: str | None = None) -> Pipeline:
    """Read ahead over ``keys``: yields ``(key, buffer)`` in key order, ``depth`` reads in flight.

    ``read_into(key, buf)`` starts reading item ``key`` into ``buf`` (one of ``depth + 1``
    buffers made by ``make_buffer()``, reused round-robin) and returns a ``Request``
    (e.g. ``lambda k, b: f.aread(k * n, b)``). The yielded buffer is the request's result
    when it has one (so a reader may fill and return a view of ``buf``), else ``buf``.
    With ``blocking=True``, ``read_into`` is an ordinary blocking function (compute an
    integral batch, read and decompress...) and runs on the I/O pool; it must not itself
    wait for chemio requests. A ``read_into`` that returns anything but a Request has
    completed its read when it returns. The yielded buffer is valid until the next step.
    """
    if not callable(read_into) or not callable(make_buffer):
        raise ArgumentError("prefetch(read_into, keys, make_buffer): read_into and make_buffer "
                            "must be callables")
    depth = check_depth(depth)
    name = name or f"prefetch#{next(_counter)}"

    def start(key: Any, buf: Any) -> tuple:
        if blocking:
            req = pool.submit(read_into, key, buf)
            return req, req, None, None
        return _as_request(read_into(key, buf)), None, None, None

    return Pipeline(start, keys, make_buffer, depth, name=name)


DEFAULT_BLOCK_BYTES = 64 << 20      # cap of a default block (the ring holds depth + 1)


def _block_size(shape: tuple, itemsize: int, chunks: tuple[int, ...] | None, axis: int,
                size: Any) -> int:
    if size is None:
        per_index: int = itemsize * math.prod(shape[:axis] + shape[axis + 1:])
        cap = max(1, DEFAULT_BLOCK_BYTES // max(1, per_index))
        return max(1, min(chunks[axis] if chunks else cap, cap))
    try:
        s = operator.index(size)
    except TypeError:
        raise ArgumentError(f"size must be a positive integer (elements along the axis), got "
                            f"{type(size).__name__} {size!r}") from None
    if s < 1:
        raise ArgumentError(f"size must be >= 1 element along the axis, got {s}")
    return s


def _ring_array(count: int, dtype: np.dtype) -> np.ndarray:
    """An uninitialised 1-d ring buffer for ``iter_blocks``, aligned for O_DIRECT, on
    transparent huge pages from 2 MiB on (``aligned_empty``: an O_DIRECT read pins a few
    huge pages instead of thousands of small ones; measured: a third of the kernel's CPU
    time per 8 MiB read, and a faster device), its pages faulted in now, not in the first
    read."""
    from chemio_py.backends.posix import aligned_empty
    ring = aligned_empty((count,), dtype)
    ring.view(np.uint8)[::mmap.PAGESIZE] = 0
    return ring


# ------------------------------------------------------------ the read path of iter_blocks
# direct="auto" (the default) reads a block through O_DIRECT + Linux AIO when that wins: the
# store can (``local``), its file system takes O_DIRECT and keeps data on a device, the block
# is at least DIRECT_MIN_BLOCK bytes, and, block by block, its byte runs are 4 KiB-aligned
# and its pages not in the page cache (the store's mincore sample); the page cache otherwise.
#
# DIRECT_MIN_BLOCK, measured 2026-11-26 on the 2-core VM (virtio disk, ext4): cold
# iter_blocks streams (depth 2, no compute) of a 256 MiB DiskArray of 8 KiB rows, chunks of
# whole rows, direct=True against direct=False in the same run, interleaved; throughput
# ratio direct/page, range over the rounds (3 rounds at load 3-6 | 5 rounds at load 8-18):
#   64 KiB  -         | 0.89-3.38     512 KiB 0.91-1.27 | 0.89-2.91
#   128 KiB -         | 0.85-3.25     1 MiB   0.27-1.63 | 0.93-2.00
#   256 KiB 1.03-2.05 | 0.55-2.72     2 MiB   1.37-2.51 | 2.24-6.09
#   4 MiB   2.40-5.34 | 1.79-5.65     8 MiB   4.49-5.38 | 1.14-6.90
# Under 2 MiB either path can win a round (the kernel's read-ahead keeps pace, and a rerun
# on cached data needs no device at all); from 2 MiB on (also where the ring buffers become
# huge pages) O_DIRECT won every round, and beside BLAS on every core it also frees the
# CPU the kernel's copy would take.
DIRECT_MIN_BLOCK = 2 << 20
_IN_RAM = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})
_fs_verdicts: dict[int, str | None] = {}    # st_dev -> why not O_DIRECT there, or None
_fs_lock = threading.Lock()


def direct_fs_verdict(path: str) -> str | None:
    """Why the file system holding ``path`` is no place for O_DIRECT read-ahead (its data
    is in RAM: tmpfs, ramfs; or it refuses O_DIRECT), or None when it is one. Probed once
    per file system (device number) and remembered; the O_DIRECT probe opens a regular
    file (for a directory only the file-system type is looked at, and not remembered)."""
    try:
        st = os.stat(path)
    except OSError as e:
        return f"cannot stat {path!r}: {e.strerror}"
    with _fs_lock:
        if st.st_dev in _fs_verdicts:
            return _fs_verdicts[st.st_dev]
    from chemio_py.scratch import fstype
    kind = fstype(path)
    verdict: str | None = None
    if kind in _IN_RAM:
        verdict = f"{kind}: the data is in RAM already"
    elif not hasattr(os, "O_DIRECT"):
        verdict = "no O_DIRECT on this system"
    elif not S_ISREG(st.st_mode):
        return None
    else:
        try:
            os.close(os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC))
        except OSError as e:
            verdict = f"{kind} refuses O_DIRECT ({e.strerror})"
    with _fs_lock:
        _fs_verdicts[st.st_dev] = verdict
    return verdict


def _check_direct(direct: Any) -> bool | str:
    """``direct`` of ``iter_blocks`` as True, False or "auto" (None: the setting)."""
    if direct is None:
        direct = config.get("direct")
    if direct is True or direct is False:
        return bool(direct)
    if direct == "auto":
        return "auto"
    raise ArgumentError(f"direct must be None (the 'direct' setting, CHEMIO_DIRECT), 'auto', "
                        f"True or False, got {direct!r}")


def _auto_refusal(darray: Any, block_nbytes: int) -> str | None:
    """Why ``direct="auto"`` reads ``darray`` through the page cache whatever its blocks
    (small blocks, a store without native reads, a file system in RAM), or None."""
    if block_nbytes < DIRECT_MIN_BLOCK:
        return (f"{fmt_bytes(block_nbytes)} blocks, under the {fmt_bytes(DIRECT_MIN_BLOCK)} "
                f"threshold for O_DIRECT")
    if pool.sync_mode():
        return "synchronous mode (CHEMIO_SYNC)"
    store = getattr(darray, "store", None)
    if store is None or getattr(darray, "aread_direct", None) is None:
        return f"{type(darray).__name__} has no direct reads"
    from chemio_py.backends import capabilities
    if capabilities(store).native_read_region is None:
        return f"backend {getattr(darray, 'backend', '?')!r} reads its own way"
    path = getattr(darray, "path", None)
    return direct_fs_verdict(path) if isinstance(path, str) else "no file path"


class _ReadPath:
    """Which way the blocks of one ``iter_blocks`` went, told to its stats (``read_path``,
    shown by ``cio.report()``) and, on each change of verdict, to the ``chemio_py`` logger
    at DEBUG."""

    __slots__ = ("setting", "refusal", "block", "aligned", "direct", "page", "_kind", "_st",
                 "_name")

    def __init__(self, setting: bool | str, refusal: str | None, block: int,
                 aligned: bool | None, st: stats.PipelineStats, name: str):
        self.setting, self.refusal, self.block, self.aligned = setting, refusal, block, aligned
        self.direct = self.page = 0
        self._kind = ""
        self._st, self._name = st, name
        self._tell("start")

    @property
    def tries(self) -> bool:
        """Whether blocks are offered to the native direct read."""
        return self.setting is not False and self.refusal is None

    def text(self) -> str:
        head = f"direct: {self.setting} \u2192 "
        if self.setting is False:
            return head + "page cache (forced)"
        if self.refusal is not None:
            return head + f"page cache ({self.refusal})"
        size = fmt_bytes(self.block)
        if not self.direct and not self.page:
            return head + f"O_DIRECT where cold and 4 KiB-aligned ({size} blocks)"
        if not self.page:
            return head + f"O_DIRECT (cold, {size} aligned blocks)"
        why = ("cached or byte runs not 4 KiB-aligned" if self.aligned is None
               else "cached" if self.aligned else "byte runs not 4 KiB-aligned")
        if not self.direct:
            return head + f"page cache ({size} blocks: {why})"
        return head + (f"O_DIRECT for {self.direct} of {self.direct + self.page} {size} "
                       f"blocks (page cache for the rest: {why})")

    def _tell(self, kind: str) -> None:
        self._kind = kind
        text = self.text()
        self._st.set_read_path(text)
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug("iter_blocks %s: %s", self._name, text)

    def went(self, native: bool) -> None:
        if native:
            self.direct += 1
        else:
            self.page += 1
        kind = "mixed" if self.direct and self.page else ("direct" if self.direct else "page")
        if kind != self._kind:
            self._tell(kind)
        elif kind == "mixed":
            self._st.set_read_path(self.text())


def _runs_aligned(darray: Any, ax: int, shape: tuple, itemsize: int, lo: int, size: int,
                  n: int) -> bool | None:
    """Whether every block's byte run is 4 KiB-aligned, where the layout tells (chunks of
    whole rows read along axis 0: one run per block); None elsewhere."""
    chunks = getattr(darray, "chunks", None)
    if ax != 0 or chunks is None or tuple(chunks[1:]) != shape[1:]:
        return None
    row: int = itemsize * math.prod(shape[1:])
    return (lo * row) % 4096 == 0 and (size * row) % 4096 == 0 and ((n - lo) * row) % 4096 == 0


def iter_blocks(darray: Any, axis: int = 0, size: int | None = None, depth: int = 2,
                out_dtype: Any = None, *, name: str | None = None,
                direct: bool | str | None = None, start: int | None = None,
                stop: int | None = None) -> Pipeline:
    """Read a DiskArray in blocks along ``axis``: yields ``(section, block)``, depth reads ahead.

    ``start``/``stop`` bound the elements read along ``axis`` as a slice ``start:stop``
    would (negative counts from the end, out-of-range bounds clipped); the blocks start at
    ``start``.

    ``size`` elements per block along ``axis`` (default: the chunk extent there, reduced
    so that a block stays under 64 MiB); the last block is shorter when ``size`` does not
    divide the length. ``block`` is a C-contiguous
    array of the section's shape, one of ``depth + 1`` reused buffers (a view of one for a
    shorter last block): valid
    until the next step. ``out_dtype`` converts each block (off the consumer's thread).
    Works on any object with ``shape``, ``dtype``, ``chunks`` and
    ``aread(section, out) -> Request``.

    ``direct`` chooses how blocks are read. O_DIRECT and Linux AIO move a block that is
    not in the page cache straight into a ring buffer, when the store can (``local``) and
    its byte runs on disk are 4 KiB-aligned (chunks of whole rows of a multiple of 4 KiB,
    say): no CPU copy and no I/O thread, so read-ahead keeps pace beside compute that uses
    every core (threaded BLAS). ``"auto"`` offers a block to that path only when it wins:
    blocks of at least ``DIRECT_MIN_BLOCK`` bytes (2 MiB), a file system that keeps data
    on a device and takes O_DIRECT (not tmpfs; probed once per file system), the block
    cold and aligned; ``True`` offers every block (cold, aligned ones go direct);
    ``False`` reads all through the page cache (I/O threads). ``None`` (default): the
    ``direct`` setting (``CHEMIO_DIRECT``: ``auto``, the default, ``1`` or ``0``). The
    choice is in ``.stats.read_path`` (``"direct: auto → O_DIRECT (cold, 8.0 MiB aligned
    blocks)"``), in ``cio.report()`` and, at DEBUG, on the ``chemio_py`` logger. Every
    path gives the same data.
    """
    shape = tuple(int(n) for n in darray.shape)
    ndim = len(shape)
    try:
        ax = operator.index(axis)
    except TypeError:
        raise ArgumentError(f"axis must be an integer, got {type(axis).__name__}") from None
    if not -ndim <= ax < ndim:
        raise ArgumentError(f"axis {axis} is out of range for a {ndim}-d array of shape {shape}")
    ax %= ndim
    dtype = np.dtype(darray.dtype)
    size = _block_size(shape, dtype.itemsize, getattr(darray, "chunks", None), ax, size)
    depth = check_depth(depth)
    odt = dtype if out_dtype is None else np.dtype(out_dtype)
    convert = odt != dtype
    setting = _check_direct(direct)
    for v, what in ((start, "start"), (stop, "stop")):
        if v is not None and (isinstance(v, bool) or not hasattr(v, "__index__")):
            raise ArgumentError(f"{what} must be an int or None, got {v!r}")
    lo, n, _ = slice(start, stop).indices(shape[ax])
    n = max(lo, n)
    full = shape[:ax] + (min(size, n - lo),) + shape[ax + 1:]
    count = math.prod(full)
    full_nbytes = count * dtype.itemsize
    pname = name or f"iter_blocks:{getattr(darray, 'name', None) or 'array'}#{next(_counter)}"
    pstats = stats.new_pipeline(pname, "read-ahead")
    refusal = _auto_refusal(darray, full_nbytes) if setting == "auto" else None
    path = _ReadPath(setting, refusal, full_nbytes,
                     _runs_aligned(darray, ax, shape, dtype.itemsize, lo, size, n), pstats,
                     pname)
    native = getattr(darray, "aread_direct", None) if path.tries else None

    def aread(section: tuple, view: np.ndarray) -> requests.Request:
        if native is not None:
            req = native(section, view)
            if isinstance(req, requests.Request):
                path.went(True)
                return req
            path.went(False)
        return _as_request(darray.aread(section, view))
    # a block's section: these slices before and after the one along the axis
    pre = tuple(slice(0, s) for s in shape[:ax])
    post = tuple(slice(0, s) for s in shape[ax + 1:])

    def make_buffer() -> Any:
        # buffers in the shape of a whole block: most steps hand them out as they are
        raw = _ring_array(count, dtype).reshape(full)
        return (raw, np.empty(full, odt)) if convert else raw

    def begin(k: int, buf: Any) -> tuple:
        # runs once per step on the consumer's thread, right after its compute step,
        # with cold caches: kept short
        stop = k + size
        if stop <= n:                                   # a whole block
            section = pre + (slice(k, stop),) + post
            if not convert:
                return aread(section, buf), None, (section, buf), full_nbytes
            raw, conv = buf
            rv, cv = raw, conv
        else:                                           # the last, shorter one
            stop = n
            section = pre + (slice(k, stop),) + post
            bshape = shape[:ax] + (stop - k,) + shape[ax + 1:]
            cnt = math.prod(bshape)
            if not convert:
                view = buf.reshape(-1)[:cnt].reshape(bshape)
                return aread(section, view), None, (section, view), view.nbytes
            raw, conv = buf
            rv = raw.reshape(-1)[:cnt].reshape(bshape)
            cv = conv.reshape(-1)[:cnt].reshape(bshape)
        inner = aread(section, rv)
        # convert in the thread that completes the read, off the consumer's thread
        req = requests.gather([inner], cv, lambda: np.copyto(cv, rv, casting="unsafe"))
        return req, None, (section, cv), rv.nbytes

    keys = range(lo, n, size) if count or n > lo else range(0)
    return Pipeline(begin, keys, make_buffer, depth, name=pname, ramp=len(keys),
                    counters=pstats)


class WriteBehind:
    """Bounded write-behind: ``submit(fn, *args)`` queues a write and returns at once.

    ``fn(*args)`` starts the write and returns a ``Request`` (``f.awrite``, ``d.awrite``,
    ``cio.requests.submit`` of a blocking function...); anything else means the write is
    already complete. ``submit`` blocks only when ``depth`` writes are in flight, until
    the oldest completes. An error of a queued write is raised by the next ``submit``,
    ``flush`` or ``close`` (the first error, again each time: the pipeline is broken).
    ``flush()`` waits for every queued write. Leaving the ``with`` block writes everything
    or raises the first error; when the block itself raised, the queued writes are waited
    for and its exception propagates. ``depth=0`` waits for each write in ``submit``.
    Do not modify a submitted buffer until its write completes.
    """

    def __init__(self, depth: int = 2, *, name: str | None = None):
        self.depth = effective_depth(depth)
        self.name = name or f"write-behind#{next(_counter)}"
        self.stats = stats.new_pipeline(self.name, "write-behind")
        self._ops: collections.deque[_Op] = collections.deque()
        self._error: BaseException | None = None
        self._failed: list[requests.Request] = []     # failed writes, reported by us
        self._closed = False
        self._count = 0

    @property
    def in_flight(self) -> int:
        """Writes queued and not yet seen complete."""
        return len(self._ops)

    @property
    def error(self) -> BaseException | None:
        """The first error of a queued write, or None."""
        return self._error

    def _finish(self, op: _Op, wait: float = 0.0, w0: float | None = None) -> None:
        t_now = time.perf_counter()
        done = op.t_done if op.t_done is not None else t_now
        if wait and w0 is not None:     # (callers that pass a wait pass its start)
            done = max(done, w0 + wait)
        self.stats.op_done(op.nbytes, op.t_issue, done, wait, w0, op.slot)
        exc = op.req.error
        if exc is not None:
            self._failed.append(op.req)
            if self._error is None:
                self._error = exc

    def _wait_oldest(self, w0: float | None = None) -> None:
        """Wait for the oldest write; it stays queued until its outcome is recorded."""
        op = self._ops[0]
        w0 = time.perf_counter() if w0 is None else w0
        quiet_wait(op.req)
        with requests.shield(defer=True):      # recorded and dequeued, whole
            self._finish(op, time.perf_counter() - w0, w0)
            self._ops.popleft()

    def _reap(self) -> None:
        if any(op.req.done() for op in self._ops):
            with requests.shield(defer=True):
                keep: collections.deque[_Op] = collections.deque()
                for op in self._ops:
                    if op.req.done():
                        self._finish(op)
                    else:
                        keep.append(op)
                self._ops = keep

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            for r in self._failed:              # raised here: their files need not again
                r.observed()
            raise self._error

    def submit(self, fn: Callable[..., Any], *args: Any,
               nbytes: int | None = None) -> requests.Request:
        """Queue the write ``fn(*args)``; returns its Request.

        ``nbytes`` (for the counters) defaults to the size of the buffer arguments.
        """
        if self._closed:
            raise ChemIOError(f"submit() on a closed WriteBehind {self.name!r}")
        if not callable(fn):
            raise ArgumentError(f"submit(fn, *args) needs a callable, got {type(fn).__name__}")
        self._reap()
        self._raise_if_failed()
        while self.depth and len(self._ops) >= self.depth:
            self._wait_oldest()
            self._reap()
        self._raise_if_failed()
        op = _Op(None, self._count % max(1, self.depth))
        self._count += 1
        op.nbytes = nbytes if nbytes is not None else sum(
            _nbytes(a) for a in args if isinstance(a, (np.ndarray, bytes, bytearray, memoryview)))
        op.t_issue = time.perf_counter()
        with requests.shield():     # started and queued, whole: close() waits for it
            req = _as_request(fn(*args))
            op.req = req
            self._ops.append(op)
        req.add_done_callback(op.mark_done)
        if self.depth == 0:
            self._wait_oldest(op.t_issue)
            self._raise_if_failed()
        return req

    def _drain(self) -> None:
        while self._ops:
            self._wait_oldest()

    def flush(self) -> None:
        """Wait for every queued write; raise the first error if one failed."""
        self._drain()
        self._raise_if_failed()

    def close(self) -> None:
        """``flush()`` and refuse further writes. Idempotent (raises a recorded error again)."""
        try:
            self._drain()
        finally:
            self._closed = True
        self._raise_if_failed()

    def __enter__(self) -> "WriteBehind":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        if exc_type is None:
            self.close()
        else:
            try:
                self._drain()
            finally:
                self._closed = True
        return False

    def __del__(self) -> None:
        finalizers.close_later(self._drain)

    def __repr__(self) -> str:
        return f"<WriteBehind {self.name!r} depth={self.depth} {len(self._ops)} in flight>"


class _CallableModule(types.ModuleType):
    """``chemio_py.prefetch`` is this module, and calling it calls ``prefetch()``: both
    ``from chemio_py import prefetch`` (the module) and ``cio.prefetch(read, keys, make)``
    (the function) mean what they say."""

    def __call__(self, *args: Any, **kw: Any) -> Pipeline:
        return prefetch(*args, **kw)


sys.modules[__name__].__class__ = _CallableModule
