"""Positioned, blocking and asynchronous I/O on a backend ByteStore, with accounting.

``ByteFile`` holds what ExclusiveFile and SharedFile have in common: argument checks,
end-of-file semantics, counters, async requests and waiting for them at close. The
subclasses decide where the file lives and who may create or destroy it.
"""
from __future__ import annotations

import ctypes
import operator
import os
import time
from typing import Any

import numpy as np

import chemio_py.backends as _backends
from chemio_py.errors import (
    ArgumentError,
    EndOfFileError,
    LimitExceededError,
    ModeError,
    PointerBufferError,
)
from chemio_py.runtime import pool, reprs, requests, stats, trace
from chemio_py.runtime.lifecycle import StoreHandle
from chemio_py.scratch import jobs

MODES = ("r", "r+", "w+", "x+")


def check_mode(mode: Any) -> str:
    if mode not in MODES:
        raise ModeError(f"mode {mode!r} is not one of {', '.join(MODES)} "
                        f"(r: read, r+: read/write existing, w+: create or truncate, "
                        f"x+: create, must not exist)")
    return mode


MAX_OFFSET = (1 << 63) - 1          # the largest file offset (and size) the OS knows
FOLD_AT = stats.FileStats.FOLD_AT   # logged blocking calls folded into the counters
_clock = time.perf_counter
_ndarray = np.ndarray
_tracing = trace.trace_state


def check_offset(offset: Any, what: str = "offset") -> int:
    """``offset`` as an int in ``[0, MAX_OFFSET]``, else ``ArgumentError``."""
    try:
        off = operator.index(offset)
    except TypeError:
        raise ArgumentError(f"{what} must be an integer, got {type(offset).__name__} "
                            f"{offset!r}") from None
    if off < 0:
        raise ArgumentError(f"{what} must be >= 0, got {off}")
    if off > MAX_OFFSET:
        raise ArgumentError(f"{what} {off} is past the largest file offset, 2**63 - 1; "
                            f"files cannot be that large")
    return off


def check_size_hint(size_hint: int, name: str) -> None:
    """Refuse a ``size_hint`` (already a checked int) above this process's file-size limit
    (``RLIMIT_FSIZE``, ``ulimit -f``) with ``LimitExceededError``: the reservation would
    fail with EFBIG (or, where SIGXFSZ is not ignored, kill the process)."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    except (ImportError, AttributeError, OSError, ValueError):     # no such limit here
        return
    if soft == resource.RLIM_INFINITY or size_hint <= soft:
        return
    room = ("`ulimit -f unlimited`" if hard == resource.RLIM_INFINITY
            else f"`ulimit -f {hard // 1024}` (the hard limit)")
    raise LimitExceededError(
        f"size_hint of {name!r} is {size_hint} bytes, above this process's file-size limit of "
        f"{soft} bytes (RLIMIT_FSIZE, `ulimit -f` {soft // 1024} blocks of 1 KiB); raise the "
        f"limit in the shell that starts the job, e.g. {room}, or give a smaller size_hint")


_PLAIN_FORMATS = frozenset([p + c for p in ("", "<", ">", "=", "@", "!")
                            for c in [*"bBhHiIlLqQnNefdg?cx", "Ze", "Zf", "Zd", "Zg"]])


def refuse_pointers(mv: memoryview, obj: Any) -> memoryview:
    """Return ``mv`` unless its items hold pointers (NumPy ``object`` fields, ``P``), which
    must never be written to or read from a file: raise ``ArgumentError`` then."""
    fmt = mv.format
    if fmt in _PLAIN_FORMATS:
        return mv
    try:
        bad = np.asarray(mv).dtype.hasobject or "P" in fmt
    except (TypeError, ValueError):         # NumPy cannot describe it: object fields?
        bad = "O" in fmt or "P" in fmt
    if bad:
        dt = getattr(obj, "dtype", fmt)
        raise PointerBufferError(f"a buffer of {type(obj).__name__} with dtype {dt} holds Python "
                                 f"object pointers, which cannot be stored in or read from a file; "
                                 f"use a numeric dtype (or pickle the objects and store the bytes)")
    return mv


def byte_view(data: Any) -> memoryview:
    """A C-contiguous memoryview of ``data`` (a strided array is copied first)."""
    mv = out_view(data)
    # numpy's stubs make ndarray a Buffer for Python 3.12+ only
    return mv if mv.c_contiguous else memoryview(np.ascontiguousarray(data))  # type: ignore[arg-type]


def _tail(mv: memoryview, k: int) -> memoryview:
    """The bytes of the contiguous view ``mv`` from byte ``k`` on."""
    return (mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B"))[k:]


def out_view(buf: Any) -> memoryview:
    """A memoryview of the buffer ``buf`` (to read into, the store checks that it is
    writable and contiguous); ``ArgumentError`` unless it is a buffer of plain values."""
    try:
        mv = memoryview(buf)
    except TypeError:
        raise ArgumentError(f"expected a bytes-like object or NumPy array, got "
                            f"{type(buf).__name__}") from None
    if mv.format not in _PLAIN_FORMATS:
        refuse_pointers(mv, buf)
    return mv


def read_view(buf: Any, what: str = "read") -> memoryview:
    """A writable C-contiguous memoryview of ``buf`` for ``what()`` to read into; else
    ``ArgumentError`` saying what was given and what to pass (the checks of ``read`` and
    ``aread``: a backend's own TypeError/BufferError would not say it)."""
    try:
        mv = buf if type(buf) is memoryview else memoryview(buf)
    except TypeError:
        raise ArgumentError(f"{what}() needs a writable buffer to read into, got "
                            f"{type(buf).__name__}; pass a bytearray(n) or np.empty(n, 'u1') "
                            f"(or an array of the dtype wanted)") from None
    if mv.readonly or not mv.c_contiguous:
        shape = tuple(getattr(buf, "shape", None) or mv.shape or ())
        kind = ("a read-only" if mv.readonly else
                f"a non-C-contiguous (strides {getattr(buf, 'strides', mv.strides)})")
        raise ArgumentError(f"{what}() needs a writable C-contiguous buffer to read into, got "
                            f"{kind} {type(buf).__name__} of shape {shape}; pass "
                            f"e.g. bytearray(n) or np.empty(n, 'u1') (for an array: "
                            f"np.empty(shape, dtype), then copy it where it belongs)")
    if mv.format not in _PLAIN_FORMATS:
        refuse_pointers(mv, buf)
    return mv


def _plain_view(buf: Any) -> memoryview:
    mv = memoryview(buf)
    return mv if mv.format in _PLAIN_FORMATS else refuse_pointers(mv, buf)


class _Rows:
    """The rows of an array as byte buffers, made only when iterated (the rare slow path)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array

    def __len__(self) -> int:
        return len(self.array)

    def __iter__(self):
        return iter(self.array.reshape(len(self.array), -1).view(np.uint8))


class _Many:
    """The checked arguments of an ``a*_many`` call.

    ``sizes`` is one int when all buffers have the same size (the rows of an array), else
    an int64 array; ``bits`` is the OR of every offset, address and size, so one test
    tells whether all are aligned; ``views`` are the buffers as byte buffers.
    """

    __slots__ = ("offsets", "addresses", "sizes", "bits", "total", "views")
    offsets: np.ndarray
    addresses: np.ndarray
    sizes: Any                          # see above: an int or an int64 array
    bits: int
    total: int
    views: Any                          # a list of memoryviews, or _Rows

    def size(self, i: int) -> int:
        return self.sizes if type(self.sizes) is int else int(self.sizes[i])


_I8 = np.dtype(np.int64)
_c_char_from = ctypes.c_char.from_buffer
_addressof = ctypes.addressof


def _many_rows(offsets: Any, buffers: Any, writable: bool) -> _Many | None:
    """``_many_args`` for its usual case, with a few scalar checks: int64 offsets, all
    ``>= 0``, one per row of a non-empty C-contiguous array of plain values (writable when
    ``writable``). None for anything else: the general path then checks it, and names
    what is wrong."""
    k = len(buffers)
    if offsets.dtype is not _I8 or offsets.ndim != 1 or len(offsets) != k or not k:
        return None
    flags = buffers.flags
    nbytes = buffers.nbytes
    if not flags.c_contiguous or buffers.dtype.hasobject or not nbytes:
        return None
    if flags.writeable:             # a third of the cost of __array_interface__
        base = _addressof(_c_char_from(buffers))
    elif writable:
        return None
    else:
        base = buffers.__array_interface__["data"][0]
    rowbytes = nbytes // k
    if k <= 16:
        bits = base | rowbytes
        for o in offsets.tolist():
            bits |= o
    else:
        bits = int(np.bitwise_or.reduce(offsets)) | base | rowbytes
    if bits < 0:                    # the OR is negative exactly when an offset is
        return None
    m = _Many()
    m.offsets, m.bits, m.views = offsets, bits, _Rows(buffers)
    m.addresses = np.arange(base, base + nbytes, rowbytes, dtype=np.uint64)
    m.sizes, m.total = rowbytes, nbytes
    return m


def _many_args(offsets: Any, buffers: Any, writable: bool) -> _Many:
    if type(buffers) is _ndarray and type(offsets) is _ndarray and buffers.ndim >= 2:
        m = _many_rows(offsets, buffers, writable)
        if m is not None:
            return m
    what = "aread_many" if writable else "awrite_many"
    try:
        offs = np.asarray(offsets)
    except (TypeError, ValueError):
        offs = np.asarray([], dtype=object)
    if offs.ndim != 1 or (offs.size and offs.dtype.kind not in "iu"):
        raise ArgumentError(f"{what}() needs a 1-D sequence of integer offsets, got "
                            f"{type(offsets).__name__} of dtype {offs.dtype} and shape "
                            f"{offs.shape}")
    if offs.size and offs.dtype == np.uint64 and int(offs.max()) > MAX_OFFSET:
        raise ArgumentError(f"{what}() offset {int(offs.max())} is past the largest file "
                            f"offset, 2**63 - 1")
    offs = offs.astype(np.int64, copy=False)
    bits = int(np.bitwise_or.reduce(offs)) if offs.size else 0
    if bits < 0:                        # the OR is negative exactly when an offset is
        raise ArgumentError(f"{what}() offsets must be >= 0, got {int(offs.min())}")
    m = _Many()
    if isinstance(buffers, np.ndarray) and buffers.ndim >= 2 and buffers.flags.c_contiguous:
        if writable and not buffers.flags.writeable:
            raise ArgumentError(f"{what}() needs writable buffers, got a read-only array")
        # numpy's stubs make ndarray a Buffer for Python 3.12+ only
        refuse_pointers(memoryview(buffers), buffers)  # type: ignore[arg-type]
        k = len(buffers)
        rowbytes = buffers.nbytes // k if k else 0
        base = buffers.__array_interface__["data"][0]
        m.addresses = np.arange(base, base + rowbytes * k, rowbytes, dtype=np.uint64) \
            if rowbytes else np.zeros(k, dtype=np.uint64)
        m.sizes, m.total = rowbytes, rowbytes * k
        bits |= base | rowbytes
        views: Any = _Rows(buffers)
    else:
        # a write takes any buffer (a strided one is copied, as in awrite); a read must
        # land in the caller's own memory
        view = _plain_view if writable else byte_view
        try:
            items = list(buffers)
            views = [view(b) for b in items]
        except PointerBufferError:
            raise
        except (TypeError, ArgumentError):
            raise ArgumentError(f"{what}() needs a sequence of buffers (bytes-like objects "
                                f"or arrays), got {type(buffers).__name__}") from None
        if writable:
            for i, v in enumerate(views):
                if v.readonly or not v.c_contiguous:
                    raise ArgumentError(
                        f"{what}() needs writable C-contiguous buffers; buffer {i} is a "
                        f"{'read-only' if v.readonly else 'strided'} "
                        f"{type(items[i]).__name__}; read into a contiguous one and copy")
        addrs = [np.frombuffer(v, np.uint8).__array_interface__["data"][0] if v.nbytes else 0
                 for v in views]
        lens = [v.nbytes for v in views]
        for a, n in zip(addrs, lens):
            bits |= a | n
        m.addresses = np.array(addrs, dtype=np.uint64)
        m.sizes, m.total = np.array(lens, dtype=np.int64), sum(lens)
        if 0 in lens:
            bits |= 1                   # an empty transfer is not for the kernel's queue
    if len(views) != offs.size:
        raise ArgumentError(f"{what}() got {offs.size} offsets for {len(views)} buffers; "
                            f"give one offset per buffer")
    m.offsets, m.bits, m.views = offs, bits, views
    return m


class ByteFile(StoreHandle):
    """A byte-addressable file over a ByteStore (see ExclusiveFile for the API)."""

    close_alone = staticmethod(_backends.close_local)

    def __init__(self, store: Any, backend_name: str, mode: str):
        self._hold(store, store.path, mode)
        self._caps = _backends.capabilities(store)
        self.backend = backend_name
        self._stats = stats.for_file(store.path, backend_name)
        self._read_once = self._caps.pread_once     # one syscall per small blocking call
        self._write_once = self._caps.pwrite_once
        self._log = self._stats.log                 # the blocking calls' fast accounting
        self._logged = self._stats.log_entries
        jobs.register_open(self)

    # ------------------------------------------------------------ properties
    @property
    def path(self) -> str:
        """Where the bytes live now (an ``auto`` file moves from RAM to disk on a spill)."""
        store = self._store
        return store.path if store is not None else self._path

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def size(self) -> int:
        """Current size in bytes."""
        return self._open_store().size()

    @property
    def stats(self) -> stats.FileStats:
        return self._stats

    def _forget_store(self) -> None:
        self._caps = _backends.NO_CAPABILITIES
        self._read_once = self._write_once = None

    # ------------------------------------------------------------ hooks for subclasses
    _limited = False        # True in subclasses whose _before_write checks something

    def _before_write(self, offset: int, nbytes: int) -> None:
        """Check a write before any byte moves (limits); set ``_limited`` when overriding."""

    # ------------------------------------------------------------ the I/O bodies
    def _do_write(self, store: Any, offset: int, data: Any, n: int) -> int:
        t0 = time.perf_counter()
        store.pwrite(offset, data)
        self._stats.record("write", n, t0, time.perf_counter(), offset)
        return n

    def _do_read(self, store: Any, offset: int, out: Any, n: int) -> Any:
        t0 = time.perf_counter()
        got = store.pread(offset, out)
        self._stats.record("read", got, t0, time.perf_counter(), offset)
        if got < n or (n == 0 and offset > store.size()):
            raise EndOfFileError(self.path, offset, n, store.size())
        return out

    # ------------------------------------------------------------ blocking
    # The blocking calls are the hot path of small records: one frame, one clock pair and
    # one counter update per call.
    def write(self, offset: int, data: Any) -> int:
        """Write ``data`` (any buffer: bytes, ndarray) at ``offset``; returns bytes written.

        Writing past the end extends the file; skipped bytes read as zeros.
        """
        store = self._store
        if store is None or self._mode == "r":
            store = self._writable_store()
        if type(offset) is not int or not 0 <= offset <= MAX_OFFSET:
            offset = check_offset(offset)
        # bytes, bytearray and exact ndarrays without object fields are plain by type alone;
        # the OS call refuses a non-contiguous one, which the checked path then copies
        t = type(data)
        if t is bytes or t is bytearray:
            n = len(data)
        elif t is _ndarray and not data.dtype.hasobject:
            n = data.nbytes
        else:
            data = byte_view(data)
            n = data.nbytes
        if self._limited:
            self._before_write(offset, n)
        t0 = _clock()
        try:
            once = self._write_once
            done = 0
            if once is not None:
                try:
                    done = once((data,), offset)
                except (OSError, ValueError, BufferError):
                    done = 0                    # the full path copies, retries, maps errors
            if done < n:
                mv = byte_view(data)
                store.pwrite(offset + done, _tail(mv, done) if done else mv)
        except BaseException:
            self._stats.record("write", n, t0, _clock(), offset, True)
            raise
        t1 = _clock()
        if _tracing.on:
            self._stats.record("write", n, t0, t1, offset, True)
        else:
            self._log((False, n, t1 - t0))
            if len(self._logged) > FOLD_AT:
                self._stats.fold()
        return n

    def read(self, offset: int, out: Any) -> Any:
        """Fill ``out`` (writable buffer) from ``offset``; returns ``out``.

        Raises ``EndOfFileError`` when the range passes the end of the file.
        """
        store = self._store
        if store is None:
            store = self._open_store()
        if type(offset) is not int or not 0 <= offset <= MAX_OFFSET:
            offset = check_offset(offset)
        # bytearray and exact ndarrays without object fields are plain by type alone; the OS
        # call refuses a read-only or non-contiguous one, which the checked path then names
        t = type(out)
        if t is bytearray:
            n, out_mv = len(out), out
        elif t is _ndarray and not out.dtype.hasobject:
            n, out_mv = out.nbytes, out
        else:
            out_mv = read_view(out, "read")
            n = out_mv.nbytes
        t0 = _clock()
        try:
            once = self._read_once
            got = -1
            if once is not None:
                try:
                    got = once((out_mv,), offset)
                except (OSError, ValueError, BufferError, TypeError):
                    got = -1                    # the full path checks, retries, maps errors
            if got < 0:
                got = store.pread(offset, read_view(out, "read"))
            elif got < n:
                got += store.pread(offset + got, _tail(out_view(out), got))
        except BaseException:
            self._stats.record("read", 0, t0, _clock(), offset, True)
            raise
        t1 = _clock()
        if _tracing.on:
            self._stats.record("read", got, t0, t1, offset, True)
        else:
            self._log((True, got, t1 - t0))
            if len(self._logged) > FOLD_AT:
                self._stats.fold()
        if got < n or (n == 0 and offset > store.size()):
            raise EndOfFileError(self.path, offset, n, store.size())
        return out

    _READ_BYTES_CHECK = 1 << 20     # read_bytes of more: the file size is checked first

    def read_bytes(self, offset: int, n: int) -> bytes:
        """Read ``n`` bytes at ``offset`` into a new ``bytes`` object.

        Like ``read``, raises ``EndOfFileError`` when the range passes the end of the file
        (before allocating anything); ``LimitExceededError`` when this process cannot hold
        ``n`` bytes (then ``read(offset, out)`` into a reused buffer, chunk by chunk).
        """
        n = check_offset(n, "n")
        if n > self._READ_BYTES_CHECK:
            store = self._open_store()
            offset = check_offset(offset)
            size = store.size()
            if offset + n > size:               # refused before a huge zeroed allocation
                raise EndOfFileError(self.path, offset, n, size)
        try:
            buf = bytearray(n)
        except MemoryError as e:
            raise self._no_memory(offset, n) from e
        self.read(offset, buf)
        try:
            return bytes(buf)
        except MemoryError as e:
            raise self._no_memory(offset, n) from e

    def _no_memory(self, offset: Any, n: int) -> LimitExceededError:
        return LimitExceededError(
            f"read_bytes({offset}, {n}) of {self.path!r}: this process cannot allocate "
            f"{n} bytes ({n / 2**30:.1f} GiB) for them; read in chunks with read(offset, out) "
            f"into one reused buffer, e.g. out = np.empty(64 << 20, 'u1')")

    # ------------------------------------------------------------ asynchronous
    def awrite(self, offset: int, data: Any) -> requests.Request:
        """Start writing ``data`` at ``offset``; do not modify ``data`` until it completes."""
        store = self._store
        if store is None or self._mode == "r":
            store = self._writable_store()
        if type(offset) is not int or not 0 <= offset <= MAX_OFFSET:
            offset = check_offset(offset)
        mv = byte_view(data)
        n = mv.nbytes
        if self._limited:
            self._before_write(offset, n)
        native = self._caps.native_write
        if native is not None and not pool.sync_mode():
            req = native(offset, mv, self._write_done(n, offset), self._stats)
            if req is not None:
                return self._pending.add(req)
        return self._pool_start(self._do_write, store, offset, mv, n)

    def aread(self, offset: int, out: Any) -> requests.Request:
        """Start filling ``out`` from ``offset``; ``wait()`` returns ``out``.

        Data already in the page cache is read at once (the request is complete on return);
        aligned O_DIRECT reads go to the kernel's AIO queue, the rest to the I/O pool.
        Past-the-end reads fail with ``EndOfFileError`` at ``wait()``.
        """
        store = self._store
        if store is None:
            store = self._open_store()
        if type(offset) is not int or not 0 <= offset <= MAX_OFFSET:
            offset = check_offset(offset)
        mv = read_view(out, "aread")
        n = mv.nbytes
        native = self._caps.native_read
        if native is not None and not pool.sync_mode():
            req = native(offset, mv, self._read_done(out, n, offset, store), self._stats)
            if req is not None:
                return self._pending.add(req)
        nowait = self._caps.read_nowait
        if nowait is not None and n:
            t0 = time.perf_counter()
            if nowait(offset, mv) == n:
                self._stats.record("read", n, t0, time.perf_counter(), offset)
                return requests.completed(out)
        return self._pool_start(self._do_read, store, offset, out, n)

    def _pool_start(self, fn: Any, store: Any, offset: int, buf: Any, n: int) -> requests.Request:
        """Put ``fn(store, offset, buf, n)`` on the I/O pool and register its request, whole:
        an interrupt between the two would leave a transfer on ``buf`` (and on the store)
        that ``close()`` does not wait for. The handler's exception comes after the
        registration (the request is lost to the caller then, not to ``close()``)."""
        if pool.sync_mode():            # complete before it returns: nothing to lose
            return self._pending.add(pool.submit(fn, store, offset, buf, n,
                                                     stats=self._stats))
        return requests.shielded(self._submit_registered, fn, store, offset, buf, n)

    def _submit_registered(self, fn: Any, store: Any, offset: int, buf: Any,
                           n: int) -> requests.Request:
        return self._pending.add(pool.submit(fn, store, offset, buf, n, stats=self._stats))

    # ------------------------------------------------------------ many at once
    def aread_many(self, offsets: Any, buffers: Any) -> requests.Request:
        """Start filling ``buffers[i]`` from ``offsets[i]`` for every ``i``: one request.

        ``buffers`` is a sequence of writable buffers or an array whose rows are the
        buffers (``out.reshape(k, size)``); ``wait()`` returns ``buffers``. Aligned O_DIRECT
        transfers are queued to the kernel with one system call per group of them, which
        is what makes many small requests cheap; the rest run on the I/O pool. Transfers
        of one call run in any order. If any fails, ``wait()`` raises the first error once
        all have finished.
        """
        store = self._store
        if store is None:
            store = self._open_store()
        m = _many_args(offsets, buffers, writable=True)
        if not len(m.offsets):
            return requests.completed(buffers)
        native = self._caps.native_read_many
        if native is not None and not pool.sync_mode():
            req = native(m, self._read_many_done(buffers, m, store), self._stats)
            if req is not None:
                return self._pending.add(req)
        reqs = [self.aread(o, v) for o, v in zip(m.offsets.tolist(), m.views)]
        return self._pending.add(requests.gather(reqs, buffers, stats=self._stats))

    def awrite_many(self, offsets: Any, buffers: Any) -> requests.Request:
        """Start writing ``buffers[i]`` at ``offsets[i]`` for every ``i``: one request.

        ``buffers`` as in ``aread_many`` (read-only buffers are fine); leave them alone
        until the request completes. ``wait()`` returns the number of bytes written.
        """
        store = self._store
        if store is None or self._mode == "r":
            store = self._writable_store()
        m = _many_args(offsets, buffers, writable=False)
        if not len(m.offsets):
            return requests.completed(0)
        if self._limited:
            for i, o in enumerate(m.offsets.tolist()):
                self._before_write(o, m.size(i))
        native = self._caps.native_write_many
        if native is not None and not pool.sync_mode():
            req = native(m, self._write_many_done(m), self._stats)
            if req is not None:
                return self._pending.add(req)
        reqs = [self.awrite(o, v) for o, v in zip(m.offsets.tolist(), m.views)]
        return self._pending.add(requests.gather(reqs, m.total, stats=self._stats))

    def _read_many_done(self, buffers: Any, m: _Many, store: Any):
        def done(counts: list, t0: float, t1: float) -> Any:
            got = sum(counts)
            self._stats.record("read", got, t0, t1, int(m.offsets[0]), count=len(counts))
            if got < m.total:
                i = next(i for i, c in enumerate(counts) if c < m.size(i))
                raise EndOfFileError(self.path, int(m.offsets[i]), m.size(i), store.size())
            return buffers
        return done

    def _write_many_done(self, m: _Many):
        def done(counts: list, t0: float, t1: float) -> int:
            total = sum(counts)
            self._stats.record("write", total, t0, t1, int(m.offsets[0]), count=len(counts))
            return total
        return done

    def _read_done(self, out: Any, n: int, offset: int, store: Any):
        def done(got: int, t0: float, t1: float) -> Any:
            self._stats.record("read", got, t0, t1, offset)
            if got < n:
                raise EndOfFileError(self.path, offset, n, store.size())
            return out
        return done

    def _write_done(self, n: int, offset: int):
        def done(wrote: int, t0: float, t1: float) -> int:
            self._stats.record("write", wrote, t0, t1, offset)
            return wrote
        return done

    @property
    def outstanding(self) -> int:
        """Number of async requests not yet complete."""
        return len(self._pending)

    # ------------------------------------------------------------ management
    def truncate(self, n: int) -> None:
        """Set the size to ``n`` bytes (waits for outstanding requests first)."""
        store = self._writable_store()
        n = check_offset(n, "size")
        err = requests.failure(self.path, self._pending.drain())
        if err is not None:
            raise err
        store.truncate(n)

    def flush(self) -> None:
        """Wait for outstanding requests and make written data durable."""
        store = self._open_store()
        err = requests.failure(self.path, self._pending.drain())
        if self._mode != "r":
            store.flush()
        if err is not None:
            raise err

    def _size_or_none(self) -> int | None:
        store = self._store
        try:
            return store.size() if store is not None else None
        except Exception:       # a repr never raises
            return None

    def __reduce__(self) -> Any:
        """A byte file pickles as the way to reopen it (``chemio_py.files.pickling``), never
        its descriptors or mappings; a subclass that does not say how is refused."""
        raise TypeError(f"a {type(self).__name__} cannot be pickled (its descriptors and "
                        f"mappings belong to this process); ExclusiveFile, SharedFile and "
                        f"RecordFile pickle as the way to reopen them")

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"mode {self._mode!r}"
        size = self._size_or_none()
        shown = "" if size is None else f" size={size}"
        return f"<{type(self).__name__} {self.path!r} {state}{shown} backend={self.backend}>"

    def _html_rows(self) -> list[tuple[str, object]]:
        return [("size", reprs.size_text(self._size_or_none())),
                ("on disk", reprs.size_text(reprs.disk_usage(self.path))),
                ("backend", self.backend),
                ("state", "closed" if self.closed else f"open, mode {self._mode!r}"),
                ("open requests", len(self._pending)), ("path", self.path)]

    def _repr_html_(self) -> str:
        """The notebook view: size, bytes on disk, backend, state, open requests, path."""
        return reprs.table(f"{type(self).__name__} {os.path.basename(self.path)!r}",
                           self._html_rows())
