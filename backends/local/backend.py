"""The ``local`` backend: POSIX files with positioned vector I/O.

``os.preadv``/``os.pwritev`` release the GIL and move bytes straight between the file and
the caller's buffer, so a pool of threads reaches the device's queue depth without copies.
Space is reserved with ``posix_fallocate`` (fast writes, and ENOSPC up front instead of
half-way). O_DIRECT for byte files is opt-in (``direct=True`` or ``CHEMIO_DIRECT=1``; the
default ``auto`` concerns array read-ahead, which picks ``native_read_region``): requests whose
buffer address, offset and length are aligned go through an O_DIRECT descriptor, the rest
through the page cache; a file system that refuses O_DIRECT falls back to buffered I/O.

This module holds the stores and the backend; the system-call helpers they share with
``shm`` (safe opening, preallocation, buffer views, page residency) are in ``posix``.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import math
import mmap
import logging
import os
import threading
import time
from bisect import bisect_right
from typing import Any

import numpy as np
import numpy.ctypeslib  # noqa: F401 - imported lazily, it races between pool threads

from chemio_py.backends import posix
from chemio_py.backends.contract import Region
from chemio_py.backends.local import io_uring, linux_aio
from chemio_py.backends.local.mappings import (ReadMap, drop_map, live_maps, make_room,
                                               map_cap, maps_lock)
from chemio_py.backends.posix import (
    DIRECT_ALIGN,
    SPACE_ERRNOS,
    ScratchPlaces,
    buffer_address,
    byte_span,
    bytes_view,
    copy_runs,
    fallocate_keep_size,
    mincore_ok,
    mincore_pages,
    open_checked,
    process_vm,
    sieve_buffer,
    unlink_regular,
)
from chemio_py.errors import OutOfSpaceError, StorageError
from chemio_py.runtime import config, finalizers, pool
from chemio_py.runtime.blas import cpu_share
from chemio_py.scratch import fs

_log = logging.getLogger(__name__)

_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", None)
_MODES = {
    "r": os.O_RDONLY,
    "r+": os.O_RDWR,
    "w+": os.O_RDWR | os.O_CREAT | os.O_TRUNC,
    "x+": os.O_RDWR | os.O_CREAT | os.O_EXCL,
}
_ADVICE = {
    "normal": getattr(os, "POSIX_FADV_NORMAL", 0),
    "sequential": getattr(os, "POSIX_FADV_SEQUENTIAL", 2),
    "random": getattr(os, "POSIX_FADV_RANDOM", 1),
    "willneed": getattr(os, "POSIX_FADV_WILLNEED", 3),
    "dontneed": getattr(os, "POSIX_FADV_DONTNEED", 4),
}
_PREFETCH_GAP_PAGES = 16        # partial pages closer than this are fetched in one request
_BIG_SEGMENT = 1 << 20          # runs this long on average use preadv/pwritev, cached or not
_SPLIT_COPY = 16 << 20          # a mapped copy copies this much per thread at least
_IN_PLACE_FS = ("ext2", "ext3", "ext4", "xfs", "tmpfs")   # overwrite allocated blocks in place
# Bytes of array files that stay mapped (read-only) for copies from the page cache, over all
# open stores, are capped by the ``map_cap`` setting; the least recently used mapping is
# dropped first. A file larger than the cap is read from the page cache by the kernel
# (process_vm_readv) instead. Mapped pages escape posix_fadvise(DONTNEED):
# ``DiskArray.evict()`` (the store's ``evict``) and ``drop_mappings()`` unmap first.
# Reads through preadv of at least this many bytes fill their pages' entries in the read
# mapping beside the I/O (``posix.page_tables``): the next copy from the mapping then takes
# no page faults (~10 ms per 128 MB), as a memmap's first read maps its pages.
FILL_AFTER_READ = 1 << 20
# A read run longer than this is read in calls of at most this many bytes: the kernel's
# read-ahead then keeps the next window in flight while a call copies (a 128 MB run in one
# call measured ~0.9x a loop of 4 MiB calls), and the page-table fill of each part
# overlaps the I/O of the next instead of following the whole run.
READ_CALL = 4 << 20


def _cut_views(views: list, offset: int, limit: int) -> Any:
    """``(file offset, views, bytes)`` of consecutive calls of at most ``limit`` bytes
    (a vector longer than that cut) that together read ``views`` from ``offset``."""
    part: list = []
    size = 0
    for v in views:
        while len(v):
            take = min(len(v), limit - size)
            part.append(v[:take])
            size += take
            v = v[take:]
            if size == limit:
                yield offset, part, size
                offset += size
                part, size = [], 0
    if part:
        yield offset, part, size


class _PosixFile:
    """What every local store does with its descriptor: size, space, flush, eviction."""

    path: str
    writable: bool
    _fd: int

    @property
    def fd(self) -> int:
        return self._fd

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def _free(self) -> int | None:
        return posix.free_bytes(self._fd)

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def allocated(self) -> int:
        """Bytes the file occupies on the device (holes excluded)."""
        return os.fstat(self._fd).st_blocks * 512

    def flush(self) -> None:
        """Make written data durable (fdatasync)."""
        if self.writable:
            posix.datasync(self._fd, self.path)

    def evict(self) -> None:
        """Drop the file's pages from the page cache (fsync, then POSIX_FADV_DONTNEED)."""
        if self.writable:
            os.fsync(self._fd)
        os.posix_fadvise(self._fd, 0, 0, _ADVICE["dontneed"])


class LocalByteStore(_PosixFile):
    """A byte-addressable POSIX file (see ``chemio_py.backends`` for the protocol)."""

    def __init__(self, path: str, fd: int, writable: bool, direct_fd: int | None = None):
        self.path = path
        self._fd = fd
        self._dfd = direct_fd
        self.writable = writable
        self._nowait = _RWF_NOWAIT

    def pread_once(self) -> Any:
        """``(buffers, offset) -> count``: one buffered ``preadv`` and nothing else (the
        ``OnceIO`` capability); None when reads may go through O_DIRECT."""
        if self._dfd is not None:
            return None
        return functools.partial(os.preadv, self._fd)

    def pwrite_once(self) -> Any:
        """``(buffers, offset) -> count``: one buffered ``pwritev``; None as ``pread_once``."""
        if self._dfd is not None or not self.writable:
            return None
        return functools.partial(os.pwritev, self._fd)

    def _fd_for(self, mv: memoryview, offset: int) -> int:
        if self._dfd is not None and not (offset | len(mv)) % DIRECT_ALIGN \
                and not buffer_address(mv) % DIRECT_ALIGN:
            return self._dfd
        return self._fd

    def pread(self, offset: int, out: Any) -> int:
        """Fill ``out`` from ``offset``; returns the bytes read (fewer only at end of file)."""
        mv = out if type(out) is memoryview else memoryview(out)
        if mv.format != "B" or mv.readonly or not mv.c_contiguous or mv.ndim != 1:
            mv = bytes_view(mv, writable=True)     # checks, or a byte cast
        n = mv.nbytes
        fd = self._fd if self._dfd is None else self._fd_for(mv, offset)
        try:
            done = os.preadv(fd, (mv,), offset)
            while done < n:
                k = os.preadv(fd, (mv[done:],), offset + done)
                if k == 0:
                    break
                done += k
        except OSError as e:
            if e.errno == errno.EINVAL and fd == self._dfd:
                self._dfd = None            # the file system refused O_DIRECT after all
                return self.pread(offset, mv)
            raise StorageError(e.errno, self.path, offset, n, "read") from e
        return done

    def pwrite(self, offset: int, data: Any) -> int:
        """Write all of ``data`` at ``offset`` (extending the file); returns its length."""
        mv = data if type(data) is memoryview else memoryview(data)
        if mv.format != "B" or not mv.c_contiguous or mv.ndim != 1:
            mv = bytes_view(mv, writable=False)    # checks, or a byte cast
        n = mv.nbytes
        fd = self._fd if self._dfd is None else self._fd_for(mv, offset)
        done = 0
        try:
            done = os.pwrite(fd, mv, offset)
            while done < n:
                done += os.pwrite(fd, mv[done:], offset + done)
        except OSError as e:
            if e.errno in SPACE_ERRNOS:
                raise OutOfSpaceError(self.path, n - done, self._free(), what="write") from e
            if e.errno == errno.EINVAL and fd == self._dfd:
                self._dfd = None
                return self.pwrite(offset, mv)
            raise StorageError(e.errno, self.path, offset, n, "write") from e
        return n

    # -------------------------------------------------------------- native asynchrony
    def read_nowait(self, offset: int, out: Any) -> int:
        """Read now if all the data is in the page cache (RWF_NOWAIT); -1 if it would block.

        Lets an async read of cached data complete in the caller, with no thread hand-off.
        """
        if self._nowait is None:
            return -1
        mv = bytes_view(out, writable=True)
        try:
            got = os.preadv(self._fd, (mv,), offset, self._nowait)
        except BlockingIOError:
            return -1
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                self._nowait = None         # this file system does not take the flag
            return -1                       # the regular path reports real errors
        return got if got == len(mv) else -1

    def _aio_target(self, mv: memoryview, offset: int) -> int | None:
        if self._dfd is None or (offset | len(mv)) % DIRECT_ALIGN or not len(mv):
            return None
        addr = buffer_address(mv)
        return None if addr % DIRECT_ALIGN else addr

    def native_read(self, offset: int, out: Any, then: Any, stats: Any = None) -> Any:
        """Start an aligned O_DIRECT read through Linux AIO; None when not eligible.

        The request's value is ``then(count, t0, t1)`` (count may be short at end of file).
        """
        mv = bytes_view(out, writable=True)
        addr = self._aio_target(mv, offset)
        eng = io_uring.native_engine() if addr is not None else None
        if eng is None or addr is None or self._dfd is None:
            return None

        def done(res: int, t0: float, t1: float) -> Any:
            if res < 0:
                raise StorageError(-res, self.path, offset, len(mv), "read")
            return then(res, t0, t1)
        return eng.submit(False, self._dfd, addr, len(mv), offset, mv, done, stats)

    def native_write(self, offset: int, data: Any, then: Any, stats: Any = None) -> Any:
        """Start an aligned O_DIRECT write through Linux AIO; None when not eligible."""
        mv = bytes_view(data, writable=False)
        addr = self._aio_target(mv, offset)
        eng = io_uring.native_engine() if addr is not None else None
        if eng is None or addr is None or self._dfd is None:
            return None
        n = len(mv)

        def done(res: int, t0: float, t1: float) -> Any:
            if res < 0:
                if -res in SPACE_ERRNOS:
                    raise OutOfSpaceError(self.path, n, self._free(), what="write")
                raise StorageError(-res, self.path, offset, n, "write")
            if res < n:                     # rare: finish the rest through the page cache
                self.pwrite(offset + res, mv[res:])
            return then(n, t0, time.perf_counter())
        return eng.submit(True, self._dfd, addr, n, offset, mv, done, stats)

    def _many_engine(self, many: Any) -> Any:
        """The AIO engine when every transfer of ``many`` can go to it, else None."""
        if self._dfd is None or many.bits % DIRECT_ALIGN:
            return None
        return io_uring.native_engine()

    def native_read_many(self, many: Any, then: Any, stats: Any = None) -> Any:
        """Start many aligned O_DIRECT reads as one request; None when not eligible.

        ``many`` carries ``offsets``, ``addresses`` (into buffers its ``views`` keep alive),
        ``sizes`` and ``bits`` (their OR). The request's value is ``then(counts, t0, t1)``
        (a count may be short at end of file).
        """
        eng = self._many_engine(many)
        if eng is None:
            return None

        def done(results: list, t0: float, t1: float) -> Any:
            self._raise_first_error(results, many, "read")
            return then(results, t0, t1)
        return eng.submit_many(False, self._dfd, many.addresses, many.sizes, many.offsets,
                               many.views, done, stats)

    def native_write_many(self, many: Any, then: Any, stats: Any = None) -> Any:
        """Start many aligned O_DIRECT writes as one request; None when not eligible."""
        eng = self._many_engine(many)
        if eng is None:
            return None

        def done(results: list, t0: float, t1: float) -> Any:
            if type(many.sizes) is int and min(results) == many.sizes:
                return then(results, t0, t1)        # all written whole: the usual case
            self._raise_first_error(results, many, "write")
            for i, got in enumerate(results):
                n = many.size(i)
                if got < n:                 # rare: finish the rest through the page cache
                    at = int(many.addresses[i]) + got
                    view = (ctypes.c_char * (n - got)).from_address(at)
                    self.pwrite(int(many.offsets[i]) + got, memoryview(view).cast("B"))
                    results[i] = n
            return then(results, t0, time.perf_counter())
        return eng.submit_many(True, self._dfd, many.addresses, many.sizes, many.offsets,
                               many.views, done, stats)

    def _raise_first_error(self, results: list, many: Any, op: str) -> None:
        if min(results) >= 0:
            return
        i = next(k for k, r in enumerate(results) if r < 0)
        err, n = -results[i], many.size(i)
        if op == "write" and err in SPACE_ERRNOS:
            raise OutOfSpaceError(self.path, n, self._free(), what="write")
        raise StorageError(err, self.path, int(many.offsets[i]), n, op)

    def truncate(self, n: int) -> None:
        try:
            os.ftruncate(self._fd, n)
        except OSError as e:
            raise StorageError(e.errno, self.path, None, n, "truncate") from e

    def reserve(self, n: int) -> None:
        """Allocate blocks for the first ``n`` bytes without changing the size.

        Checks free space first; a file system that cannot preallocate keeps the check only.
        """
        need = n - self.allocated()
        if need <= 0:
            return
        fs.check_space(self.path, need, what=f"reserve {n} bytes", free=self._free())
        err = fallocate_keep_size(self._fd, n)
        if err in SPACE_ERRNOS:
            raise OutOfSpaceError(self.path, need, self._free(), what="reserve")
        if err not in (0, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise StorageError(err, self.path, 0, n, "reserve")

    def advise(self, offset: int, length: int, advice: str) -> None:
        """Pass an access-pattern hint (normal, sequential, random, willneed, dontneed)."""
        os.posix_fadvise(self._fd, offset, length, _ADVICE[advice])

    def flush(self) -> None:
        """Make written data durable (fdatasync), O_DIRECT writes in flight included."""
        io_uring.settle_descriptor(self._dfd)     # (also one an interrupt cut off)
        super().flush()

    def close(self) -> None:
        io_uring.settle_descriptor(self._dfd)     # no transfer may outlive the close
        for name in ("_dfd", "_fd"):
            fd = getattr(self, name)
            if fd is not None and fd >= 0:
                setattr(self, name, None if name == "_dfd" else -1)
                os.close(fd)

    def __del__(self):
        finalizers.close_later(self.close)


class LocalBackend(ScratchPlaces):
    """POSIX files on a local or parallel file system."""

    name = "local"
    description = "POSIX files (preadv/pwritev, posix_fallocate, optional O_DIRECT)"
    resizable_arrays = True

    def open_bytes(self, path: str, mode: str, *, direct: bool | None = None) -> LocalByteStore:
        if mode not in _MODES:
            raise ValueError(f"mode {mode!r} is not one of {sorted(_MODES)}")
        flags = _MODES[mode] | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = open_checked(path, flags, mode)
        dfd = None
        if direct is None:              # the setting; its "auto" is for read-ahead only
            direct = config.get("direct") is True
        if direct:
            try:
                dfd = os.open(path, (flags & ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC)) | os.O_DIRECT)
            except OSError:
                dfd = None          # e.g. tmpfs without O_DIRECT: buffered I/O only
        return LocalByteStore(path, fd, mode != "r", dfd)

    # ------------------------------------------------------------ the ArrayStore half
    def open_array(self, path: str, mode: str, *, shape: Any, dtype: Any, chunks: Any,
                   reserve: bool = True, perms: int = 0o600,
                   maxshape: Any = None) -> "LocalArrayStore":
        """Open the data file of an array in the raw grid format (``chemio_py.backends.grid``).

        ``w+``/``x+`` create it at its full size (holes read as zero) after a free-space
        check and, with ``reserve``, allocate its blocks up front (``OutOfSpaceError`` now
        rather than half-way). ``r``/``r+`` require the file to have exactly the array's size.
        A resizable array (``maxshape``) is laid out for its capacity (``grid.capacity``).
        """
        from chemio_py.backends.grid import Layout, capacity
        from chemio_py.errors import MetadataError
        if mode not in _MODES:
            raise ValueError(f"mode {mode!r} is not one of {sorted(_MODES)}")
        layout = Layout(capacity(shape, chunks, maxshape), chunks, np.dtype(dtype).itemsize)
        create = mode in ("w+", "x+")
        if create:
            have = 0
            try:
                have = os.stat(path, follow_symlinks=False).st_blocks * 512
            except OSError:
                pass
            fs.check_space(path, layout.nbytes - have,
                                what=f"array of {layout.nbytes} bytes")
        flags = _MODES[mode] | os.O_NOFOLLOW | os.O_CLOEXEC
        if mode == "w+":
            # A new array is a new file: readers of the old one (mapped, in other
            # processes) keep their intact inode instead of seeing it shrink under them.
            unlink_regular(path)
            flags = _MODES["x+"] | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = open_checked(path, flags, mode, perms)
        try:
            st = os.fstat(fd)
            if create:
                try:
                    os.ftruncate(fd, layout.nbytes)
                except OSError as e:
                    raise StorageError(e.errno, path, None, layout.nbytes, "truncate") from e
                if reserve and layout.nbytes:
                    err = fallocate_keep_size(fd, layout.nbytes)
                    if err in SPACE_ERRNOS:
                        raise OutOfSpaceError(path, layout.nbytes, fs.stat(path).free,
                                              what="reserve the array")
            elif st.st_size != layout.nbytes:
                raise MetadataError(
                    f"data file {path!r} has {st.st_size} bytes but the array's metadata "
                    f"(shape {layout.shape}, {np.dtype(dtype)}) needs {layout.nbytes}; the file "
                    f"was truncated or belongs to another array: restore it or recreate the array")
        except BaseException:
            os.close(fd)
            if create:
                try:
                    os.unlink(path)
                except OSError:
                    pass
            raise
        return LocalArrayStore(path, fd, mode != "r", layout, np.dtype(dtype), shape, maxshape)


class LocalArrayStore(_PosixFile):
    """A DiskArray's data: one POSIX file in the raw grid format (see ``chemio_py.backends.grid``).

    ``read(region, out)`` / ``write(region, data)`` move a region (tuple of step-1 slices
    inside the shape) between the file and a NumPy array of the region's shape, which may
    be a strided view: each contiguous byte run of the file is one ``preadv``/``pwritev``
    whose vectors point into that array. A write touches only the region's bytes, so
    writers of disjoint regions never disturb each other, even inside one chunk
    (``byte_addressable``). Thread-safe for disjoint regions. ``read_all`` / ``write_all``
    are independent I/O here; the caller synchronises the ranks.
    """

    byte_addressable = True
    # Buffered writes to one file take its inode lock in turn: more writers than this only
    # contend (measured on ext4: 16 writers of a 128 MB section lose 10-15 % against 2).
    write_streams = 2

    def __init__(self, path: str, fd: int, writable: bool, layout: Any, dtype: Any = None,
                 shape: Any = None, maxshape: Any = None):
        self.path = path
        self._fd = fd
        self.writable = writable
        self.layout = layout                       # of the capacity (a resizable array)
        self.shape = layout.shape if shape is None else tuple(int(n) for n in shape)
        self.maxshape = self.shape if maxshape is None else tuple(maxshape)
        self.chunks = layout.chunks
        self.dtype = np.dtype(dtype if dtype is not None else f"V{layout.itemsize}")
        self._map: Any = None                      # (mmap, uint8 view, address), on demand
        self._map_lock = threading.Lock()
        self._map_write_ok: bool | None = None
        self._plans: dict = {}                     # region -> _plan(region), LRU order
        self._big_plan: tuple | None = None        # (key, plan) of a plan too big for them
        self._extents: dict = {}                   # section -> _exact_runs' stretches

    def _check(self, region: Any, arr: np.ndarray) -> None:
        want = tuple(s.stop - s.start for s in region)
        if tuple(arr.shape) != want:
            raise ValueError(f"buffer shape {arr.shape} does not match region {want}")

    def _vector_io(self, write: bool, offset: int, views: list, total: int,
                   fd: int | None = None) -> None:
        fn = os.pwritev if write else os.preadv
        fd = self._fd if fd is None else fd
        i, first = 0, offset
        try:
            k = fn(fd, views, offset)
            if k == total:
                return                              # the usual case: all in one call
            while True:
                if k <= 0:
                    raise OSError(errno.EIO, "no progress (end of file?)")
                offset += k
                while i < len(views) and k >= len(views[i]):
                    k -= len(views[i])
                    i += 1
                if i == len(views):
                    return
                if k:
                    views[i] = views[i][k:]
                k = fn(fd, views[i:], offset)
        except OSError as e:
            op = "write" if write else "read"
            if write and e.errno in SPACE_ERRNOS:
                raise OutOfSpaceError(self.path, total - (offset - first), None, what=op) from e
            hint = "" if e.errno != errno.EIO or write else \
                "the data file is shorter than the array: it was truncated behind chemio's back"
            raise StorageError(e.errno or errno.EIO, self.path, first, total, op, hint) from e

    def _move(self, write: bool, region: Region, arr: np.ndarray,
              section: Region | None = None) -> None:
        """Move ``region`` between the file and ``arr``; a read plans for ``section``, the
        request ``region`` was cut from (itself when None)."""
        if arr.size == 0:
            return
        base = byte_span(arr, writable=not write)
        if base is None:                          # odd strides: go through a C-ordered copy
            tmp = np.ascontiguousarray(arr)
            self._move(write, region, tmp, section)
            if not write:
                arr[...] = tmp
            return
        from chemio_py.backends.grid import SIEVE_HOLE
        sieve = 0 if write else SIEVE_HOLE
        trash = sieve_buffer(sieve)
        efd = None
        fill = None if write or arr.nbytes < FILL_AFTER_READ else self._start_filling()
        try:
            # planned a batch at a time: the plan's memory is bounded, not one entry per chunk
            for runs in self.layout.iter_runs(region, arr.strides, sieve=sieve):
                if write:
                    self._prefetch_partial_pages(runs)
                    exact = None
                else:
                    self._prefetch_runs(runs)
                    exact = self._exact_runs(region if section is None else section, runs)
                for i, (off, moffs, lens) in enumerate(runs):
                    views = [base[m:m + n] if m >= 0 else trash[:n]
                             for m, n in zip(moffs, lens)]
                    fd = None
                    if exact is not None and exact[i]:
                        if efd is None:
                            efd = self._exact_fd()
                        fd = efd if efd >= 0 else None
                    n = sum(lens)
                    if write or n <= READ_CALL:
                        self._vector_io(write, off, views, n, fd)
                        if fill is not None:
                            posix.page_tables.add(fill[1].addr + off, n)
                        continue
                    for at, part, k in _cut_views(views, off, READ_CALL):
                        self._vector_io(False, at, part, k, fd)
                        if fill is not None:
                            posix.page_tables.add(fill[1].addr + at, k)
        finally:
            if efd is not None and efd >= 0:
                os.close(efd)
            if fill is not None:
                posix.page_tables.wait(fill[0])
                self._unpin_map(fill[1])

    def _start_filling(self) -> tuple | None:
        """``(batch, pinned read mapping)`` when the page tables of what a read brings into
        the page cache can be filled beside its I/O (``posix.page_tables``), else None."""
        if not posix.page_tables.ok:
            return None
        m = self._pin_map()
        if m is None:
            return None
        batch = posix.page_tables.start()
        if batch is None:
            self._unpin_map(m)
            return None
        return batch, m

    # Short stretches of a read (see ``Layout.extents``) go through a descriptor without
    # read-ahead (POSIX_FADV_RANDOM): read-ahead fetches up to two of its windows past the
    # end of each, bytes nobody asked for (measured with 8 MB windows: a section of 16 MB
    # stretches read 1.5x its bytes, at 0.73x raw speed against 0.84x read exactly). Long
    # stretches keep read-ahead (its requests are larger; what it reads past them is a
    # small share), and so does a request's last stretch (a scan reads on from there).
    _readahead: int | None = None           # the device's read-ahead window; 0: unknown
    EXACT_WINDOWS = 4                       # stretches up to this many windows: exact

    def _exact_runs(self, whole: Region, runs: list) -> list | None:
        """Per run of a read of a task of the section ``whole``, whether to read it without
        read-ahead; None: none."""
        ra = self._readahead
        if ra is None:
            ra = self._readahead = self._readahead_bytes(self._fd)
        if not ra or not runs:
            return None
        key = tuple((s.start, s.stop) for s in whole)
        ext = self._extents.get(key)
        if ext is None:
            firsts, ends = self.layout.extents(whole)
            ext = (firsts.tolist(), (ends - firsts <= self.EXACT_WINDOWS * ra).tolist())
            if len(self._extents) >= 16:
                self._extents.clear()
            self._extents[key] = ext
        firsts, short = ext
        if len(firsts) < 2:
            return None
        last = len(firsts) - 1
        out = []
        for off, _, _ in runs:
            k = bisect_right(firsts, off) - 1
            out.append(0 <= k < last and short[k])
        return out if any(out) else None

    def _exact_fd(self) -> int:
        """A new read descriptor of this very file with read-ahead off (the caller closes
        it), or -1 where that is impossible (the reads then use the store's descriptor)."""
        try:
            fd = os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return -1
        try:
            a, b = os.fstat(self._fd), os.fstat(fd)
            if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):
                os.posix_fadvise(fd, 0, 0, _ADVICE["random"])
                return fd
        except OSError:
            pass
        os.close(fd)
        return -1

    @staticmethod
    def _readahead_bytes(fd: int) -> int:
        """The kernel's read-ahead window for the device under ``fd`` (0: unknown)."""
        try:
            dev = os.fstat(fd).st_dev
        except OSError:
            return 0
        name = f"{os.major(dev)}:{os.minor(dev)}"
        for path in (f"/sys/class/bdi/{name}/read_ahead_kb",
                     f"/sys/dev/block/{name}/queue/read_ahead_kb",
                     f"/sys/dev/block/{name}/../queue/read_ahead_kb"):
            try:
                with open(path) as f:
                    return max(0, int(f.read())) * 1024
            except (OSError, ValueError):
                continue
        return 0

    def _prefetch_runs(self, runs: list) -> None:
        """Ask the kernel to read the runs ahead, nearby runs in one request.

        Tasks of one section read different parts of the file at once through one
        descriptor, which the kernel's readahead takes for random access; announcing the
        ranges keeps the device busy with large requests. A task that reads one range is
        left to the kernel's sequential readahead, which a synchronous advice only slows
        (measured: a 4 MB WILLNEED before each 4 MB read costs a third of the bandwidth).
        """
        ranges: list[list[int]] = []
        for off, _, lens in runs:
            stop = off + sum(lens)
            if ranges and off - ranges[-1][1] <= _PREFETCH_GAP_PAGES * mmap.PAGESIZE:
                ranges[-1][1] = max(ranges[-1][1], stop)
            else:
                ranges.append([off, stop])
        if len(ranges) > 1:
            for start, end in ranges:
                self._willneed(start, end)

    def _willneed(self, start: int, end: int) -> None:
        try:
            os.posix_fadvise(self._fd, start, end - start, _ADVICE["willneed"])
        except OSError:
            pass

    def _prefetch_partial_pages(self, runs: list) -> None:
        """Ask the kernel to read, in bulk and ahead, the pages a write covers only in part.

        The kernel must read such a page before it can change some of its bytes; left to
        the writes, that is one synchronous read per page. Nearby pages go in one request.
        """
        pages = []
        for off, _, lens in runs:
            end = off + sum(lens)
            if off % mmap.PAGESIZE:
                pages.append(off // mmap.PAGESIZE)
            if end % mmap.PAGESIZE:
                pages.append(end // mmap.PAGESIZE)
        if not pages:
            return
        p = np.unique(np.array(pages, dtype=np.int64))
        cut = np.flatnonzero(np.diff(p) > _PREFETCH_GAP_PAGES) + 1
        for grp in np.split(p, cut):
            try:
                os.posix_fadvise(self._fd, int(grp[0]) * mmap.PAGESIZE,
                                 (int(grp[-1]) - int(grp[0]) + 1) * mmap.PAGESIZE,
                                 _ADVICE["willneed"])
            except OSError:
                return

    def read(self, region: Region, out: np.ndarray) -> np.ndarray:
        """Fill ``out`` (the region's shape, this array's dtype) from the file; returns it.

        When every page the region needs is in the page cache, the bytes are copied from
        a read-only mapping of the file (``read_cached``); otherwise with ``preadv``.
        """
        return self.read_part(region, out, region)

    def read_part(self, region: Region, out: np.ndarray, section: Region) -> np.ndarray:
        """``read`` of a task cut from ``section`` (``PartRead``): the short stretches of
        the file the whole section touches, but its last, are read without read-ahead,
        which would fetch the gaps between them too."""
        self._check(region, out)
        if out.size and not self.read_cached(region, out):
            self._move(False, region, out, section)
        return out

    def write(self, region: Any, data: np.ndarray) -> None:
        """Write ``data`` (the region's shape, this array's dtype) into the region.

        Short runs whose pages are all cached are copied through a shared mapping when the
        file's blocks are allocated on a file system that overwrites in place (so a store
        through the mapping cannot meet a full disk); otherwise ``pwritev``.
        """
        if not self.writable:
            raise StorageError(errno.EBADF, self.path, None, None, "write",
                               "the array store is open read-only")
        self._check(region, data)
        if data.size:
            segs = self._short_runs(region, data)
            if not (segs and self._map_writes_safe() and self._copy_resident(segs, data, True)):
                self._move(True, region, data)

    # ------------------------------------------------------------ page-cache fast path
    def read_cached(self, region: Any, out: np.ndarray) -> bool:
        """Fill ``out`` from the page cache if every page of ``region`` is there (True);
        otherwise do nothing and return False (the caller then uses ``read``)."""
        self._check(region, out)
        if out.size == 0:
            return True
        got = self._copy_mapped(region, out)
        if got is not None:
            return got
        segs = self._short_runs(region, out)
        return segs is not None and self._copy_resident(segs, out, False)

    def _pin_map(self) -> ReadMap | None:
        """This store's read-only mapping (made on first use), pinned against unmapping;
        None when the file is empty, larger than the ``map_cap`` setting or cannot be mapped."""
        n = self.layout.nbytes
        if not n or self._fd < 0:
            return None
        key = id(self)
        with maps_lock:
            m = live_maps.get(key)
            if m is None:
                cap = map_cap()
                if n > cap:
                    return None
                make_room(n, cap)
                addr = posix.map_file(self._fd, n)
                if addr is None:
                    return None
                m = live_maps[key] = ReadMap(addr, n)
            else:
                live_maps.move_to_end(key)
            m.pins += 1
            return m

    def _unpin_map(self, m: ReadMap) -> None:
        with maps_lock:
            m.pins -= 1
            if m.dead and not m.pins:
                m.release()

    PLANS = 256                     # hot-read plans kept per store (least recent dropped)
    PLAN_RANGES = 1024              # ... of at most this many page ranges (a larger one: 1)

    def _plan(self, region: Any) -> tuple:
        """``(blocks, page ranges, pages)`` of a region: its blocks (``Layout.blocks``) and the
        file's pages its pieces touch as sorted disjoint ``(first, end)`` ranges. Kept for
        the last ``PLANS`` regions (a hot section is read again and again, a NumPy-style
        selection reads the same boxes each time)."""
        from chemio_py.backends.grid import BATCH
        key = tuple([(s.start, s.stop) for s in region])
        plans = self._plans
        plan = plans.pop(key, None)
        if plan is None:
            big = self._big_plan
            if big is not None and big[0] == key:
                return big[1]
            lay = self.layout
            blocks = lay.blocks(region)
            if sum(math.prod(b.counts) for b in blocks) <= BATCH:
                firsts, lasts = lay.block_spans(blocks, mmap.PAGESIZE, 0)
            else:
                firsts, lasts = lay.spans(region, mmap.PAGESIZE, 0)
            ranges = list(zip(firsts.tolist(), lasts.tolist()))
            plan = (blocks, ranges, int((lasts - firsts).sum()))
            if len(ranges) > self.PLAN_RANGES:
                self._big_plan = (key, plan)
                return plan
            while len(plans) >= self.PLANS:
                try:
                    del plans[next(iter(plans))]
                except (StopIteration, RuntimeError, KeyError):
                    break                   # another thread changed the dict: next time
        plans[key] = plan                   # (re)inserted last: the most recently used
        return plan

    def _copy_mapped(self, region: Any, out: np.ndarray) -> bool | None:
        """Copy ``region`` into ``out`` from the store's read-only mapping (one NumPy copy
        per block of chunk pieces, in the order of ``out``) if every page it needs is in
        the page cache: True when done, False when a page is not cached (nothing copied)
        or the file shrank during the copy (a guarded SIGBUS; the caller's ``preadv``
        then reports it), None when there is no mapping to copy from.
        """
        if out.dtype != self.dtype or not mincore_ok():
            return None
        m = self._pin_map()
        if m is None:
            return None
        try:
            blocks, ranges, pages = self._plan(region)
            cached = posix.resident(m.addr, ranges, pages)
            if cached is None:
                return None
            if not cached:
                return False
            if not posix.sigbus_guard_arm():
                return None
            assert m.base is not None               # pinned: not released
            self._copy_from_map(region, m.base, out, blocks)
            if m.guard.poisoned:                # the file shrank under the copy
                _log.warning("%s shrank under a mapped read (SIGBUS caught); reading it with "
                             "system calls instead", self.path)
                with maps_lock:
                    if live_maps.get(id(self)) is m:
                        drop_map(id(self))
                return False
            return True
        finally:
            self._unpin_map(m)

    def _copy_from_map(self, region: Any, base: np.ndarray, out: np.ndarray,
                       blocks: list) -> None:
        """Copy ``region`` from the mapping ``base`` into ``out``: one NumPy copy per block,
        or for a region of several ``_SPLIT_COPY`` bytes its rows cut at chunk edges into
        one part per core of this rank's share (``cpu_share``, at most 4), copied by this
        thread and pool threads at once (one core's copy bandwidth is the limit of a hot
        read; ``TaskRun.run(here=True)``: this thread copies every part no pool thread has
        started, and returns only when no part is being copied)."""
        parts = self._split_rows(region, out)
        if len(parts) < 2:
            self.layout.copy_blocks(region, base, self.dtype, out, False, blocks)
            return
        dtype, copy = self.dtype, self.layout.copy_blocks
        pool.TaskRun(lambda part: copy(part[0], base, dtype, part[1], False),
                     parts).run(len(parts) - 1, here=True)

    def _split_rows(self, region: Any, out: np.ndarray) -> list:
        """``[(sub-region, rows of out)]``: ``region`` cut along its first axis for
        ``_copy_from_map`` (at chunk edges where there are enough), or one part."""
        if out.nbytes < 2 * _SPLIT_COPY or not region:
            return [(region, out)]
        # the cores this rank may keep busy: a packed node (one rank per core) does not split
        k = min(4, int(cpu_share()), out.nbytes // _SPLIT_COPY)
        if k < 2 or out.shape[0] < k:
            return [(region, out)]
        lo, hi = region[0].start, region[0].stop
        c = self.layout.chunks[0]
        cuts = [lo]
        for i in range(1, k):
            at = lo + (hi - lo) * i // k
            edge = (at + c // 2) // c * c           # the nearest chunk edge, if inside
            at = edge if cuts[-1] < edge < hi else at
            if cuts[-1] < at < hi:
                cuts.append(at)
        cuts.append(hi)
        rest = tuple(region[1:])
        return [((slice(a, b), *rest), out[a - lo:b - lo]) for a, b in zip(cuts, cuts[1:])]

    def _short_runs(self, region: Any, arr: np.ndarray) -> tuple | None:
        """The region's contiguous runs (file offsets, memory offsets, lengths) when they
        average under ``_BIG_SEGMENT`` bytes, else None (for long runs one system call
        each copies at least as fast as a mapping)."""
        segs = self.layout.segments(region, arr.strides)
        lens = segs[2]
        return segs if lens.size and lens.sum() < _BIG_SEGMENT * lens.size else None

    def _map_writes_safe(self) -> bool:
        """Whether writes through the mapping overwrite allocated blocks in place (the
        file is fully allocated on a file system that does so); found once per store, by
        one ``fstat`` and one ``fstatfs`` of the descriptor."""
        if self._map_write_ok is None:
            ok = False
            try:
                allocated = os.fstat(self._fd).st_blocks * 512 >= self.layout.nbytes
                if allocated:
                    kind = posix.fs_type(self._fd)
                    ok = (kind if kind is not None else fs.fstype(self.path)) \
                        in _IN_PLACE_FS
            except OSError:
                pass
            self._map_write_ok = ok
        return self._map_write_ok

    def _mapping(self) -> tuple | None:
        if self._map is None and self.layout.nbytes and self._fd >= 0:
            with self._map_lock:
                if self._map is None:
                    prot = mmap.PROT_READ | (mmap.PROT_WRITE if self.writable else 0)
                    try:
                        mm = mmap.mmap(self._fd, self.layout.nbytes, mmap.MAP_SHARED, prot)
                    except (OSError, ValueError):
                        return None
                    view = np.frombuffer(mm, dtype=np.uint8)
                    self._map = (mm, view, view.ctypes.data)
        return self._map

    def _copy_resident(self, segs: tuple, arr: np.ndarray, write: bool) -> bool:
        """Copy the runs ``segs`` (from ``_short_runs``) between the file and ``arr``
        through the mapping, if every page they touch is in the page cache (so no access
        can wait for the device).

        The kernel does the copy (``process_vm_readv``/``writev`` on this process): a page
        that vanished because the file shrank behind our back makes it stop short instead
        of raising SIGBUS, and the caller falls back to ``preadv``/``pwritev``.
        """
        if arr.dtype != self.dtype or not mincore_ok() or process_vm() is None:
            return False
        m = self._mapping()
        if m is None or (write and not self.writable):
            return False
        if byte_span(arr, writable=not write) is None:
            return False
        _, _, addr = m
        d, mo, n = segs
        if not n.size:
            return True
        page = mmap.PAGESIZE
        lo = int(d.min()) // page
        hi = -(-int((d + n).max()) // page)
        vec = mincore_pages(addr + lo * page, (hi - lo) * page)
        if vec is None:
            return False
        first, last = d // page - lo, (d + n - 1) // page - lo
        if not vec.all():
            resident = np.concatenate(([0], np.cumsum(vec, dtype=np.int64)))
            if (resident[last + 1] - resident[first] != last - first + 1).any():
                return False
        try:
            return copy_runs(write, addr + d, arr.ctypes.data + mo, n)
        finally:
            # Unmap what we touched (the page cache keeps it, dirty pages stay dirty):
            # mapped pages would otherwise stay pinned in this process and escape
            # posix_fadvise(DONTNEED) evictions.
            try:
                m[0].madvise(mmap.MADV_DONTNEED, lo * page, (hi - lo) * page)
            except (OSError, ValueError, AttributeError):
                pass

    # ------------------------------------------------------------ native region reads
    # O_DIRECT descriptor of the region reads (opened on first use; -1: none possible).
    _region_dfd: int | None = None
    _region_dfd_lock = threading.Lock()
    REGION_PIECE = 64 << 20        # longest single transfer of a native region read

    def _direct_fd(self) -> int | None:
        """An O_DIRECT read descriptor of this very file (reopened through /proc, so a file
        replaced at the same path is not read), or None where that is impossible."""
        dfd = self._region_dfd
        if dfd is None:
            with self._region_dfd_lock:
                dfd = self._region_dfd
                if dfd is None:
                    dfd = -1
                    fd = self._fd
                    if fd >= 0:
                        try:
                            dfd = os.open(f"/proc/self/fd/{fd}",
                                          os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
                            a, b = os.fstat(fd), os.fstat(dfd)
                            if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
                                os.close(dfd)
                                dfd = -1
                        except OSError:
                            dfd = -1
                    self._region_dfd = dfd
        return dfd if dfd >= 0 else None

    def _looks_cached(self, offsets: Any, lengths: Any) -> bool:
        """Whether the first and the last page of the page-aligned byte runs are in the
        page cache: a sample (every page costs several times more), so a wrong guess
        costs speed, never correctness. False when unknown."""
        m = self._mapping() if mincore_ok() else None
        if m is None:
            return False
        page, fn, vec = mmap.PAGESIZE, posix.mincore_fn[0], ctypes.c_ubyte(0)
        at = ctypes.addressof(vec)
        for first in (int(offsets[0]), int(offsets[-1] + lengths[-1]) - page):
            if fn(m[2] + first // page * page, page, at) != 0 or not vec.value & 1:
                return False
        return True

    def native_read_region(self, region: Any, out: np.ndarray, then: Any, stats: Any = None,
                           *, cached: bool = False) -> Any:
        """Start reading ``region`` into ``out`` through O_DIRECT and Linux AIO: the device
        fills ``out`` with no CPU copy and no thread of ours (the read-ahead of
        ``iter_blocks`` beside compute that uses every core).

        Returns a ``Request`` whose value is ``then(nbytes, t0, t1)``, or None (nothing
        started; read the ordinary way) when not eligible: no Linux AIO or O_DIRECT here,
        ``out`` not of this dtype and writable, a byte run of the region whose file offset,
        memory address or length is not a multiple of 4096, more runs than the AIO queue
        takes at once, or, unless ``cached``, the region in the page cache (judged from a
        sample of its pages: a copy from there is faster than the device). Errors surface
        at ``wait()`` as ``StorageError``; a file system that refuses O_DIRECT at completion
        is read the ordinary way instead (and no longer offered).
        """
        self._check(region, out)
        if out.dtype != self.dtype or not out.size or not out.flags.writeable:
            return None
        eng = io_uring.native_engine()
        if eng is None:
            return None
        eng.poll()                  # finished reads of ours: completed here, not handed off
        runs = self._direct_runs(region, out)
        if runs is None:
            return None
        d, addr, n = runs
        if not cached and self._looks_cached(d, n):
            return None
        dfd = self._direct_fd()
        if dfd is None:
            return None
        sizes = n if type(n) is list else n.tolist()
        total = sum(sizes)

        def failed(results: list, t0: float) -> Any:
            i, r = next((i, r) for i, r in enumerate(results) if r != sizes[i])
            if r == -errno.EINVAL:                  # O_DIRECT refused after all
                self._region_dfd = -1
                self._move(False, region, out)
                return then(total, t0, time.perf_counter())
            if r < 0:
                raise StorageError(-r, self.path, int(d[i]), sizes[i], "read")
            raise StorageError(errno.EIO, self.path, int(d[0]), total, "read",
                               "the data file is shorter than the array: it was "
                               "truncated behind chemio's back")

        if len(sizes) == 1:
            # one transfer (a block of whole rows): a single control block, the cheapest
            # submission, since each step of a read-ahead beside compute pays it
            def done_one(result: int, t0: float, t1: float) -> Any:
                if result == total:
                    return then(total, t0, t1)
                return failed([result], t0)
            return eng.submit(False, dfd, int(addr[0]), total, int(d[0]), out, done_one, stats)

        def done(results: list, t0: float, t1: float) -> Any:
            if results == sizes:
                return then(total, t0, t1)
            return failed(results, t0)
        return eng.submit_many(False, dfd, addr, n, d, out, done, stats)

    def _direct_runs(self, region: Any, out: np.ndarray) -> tuple | None:
        """The O_DIRECT transfers of reading ``region`` into ``out``: file offsets, memory
        addresses and lengths (lists for a single transfer, else arrays), runs longer than
        ``REGION_PIECE`` cut; None when one is not 4096-aligned or there are more than the
        AIO queue takes at once."""
        shape, chunks = self.layout.shape, self.chunks
        if out.flags.c_contiguous and all(
                s.start == 0 and s.stop == k == c
                for s, k, c in zip(region[1:], shape[1:], chunks[1:])):
            # chunks of whole rows: the file is in C order, the region one byte range
            row = self.layout.itemsize * math.prod(shape[1:])
            off, at, size = region[0].start * row, out.ctypes.data, out.nbytes
            if (off | at | size) % DIRECT_ALIGN:
                return None
            if size <= self.REGION_PIECE:       # the common case, without arrays
                return [off], [at], [size]
            d = np.array([off], dtype=np.int64)
            m = np.zeros(1, dtype=np.int64)
            n = np.array([size], dtype=np.int64)
        else:
            if byte_span(out, writable=True) is None:
                return None
            d, m, n = self.layout.segments(region, out.strides)
            if not d.size:
                return None
        addr = m + out.ctypes.data
        if int(np.bitwise_or.reduce(d | addr | n)) % DIRECT_ALIGN:
            return None
        piece = self.REGION_PIECE
        if int(n.max()) > piece:                    # split very long runs
            k = -(-n // piece)
            idx = np.repeat(np.arange(n.size), k)
            within = np.arange(idx.size) - np.repeat(np.cumsum(k) - k, k)
            d = d[idx] + within * piece
            addr = addr[idx] + within * piece
            n = np.minimum(n[idx] - within * piece, piece)
        if n.size > linux_aio.BLOCKS * linux_aio.BLOCK:
            return None
        return d, addr.astype(np.uint64), n

    def read_all(self, region: Any, out: np.ndarray, comm: Any = None) -> np.ndarray:
        return self.read(region, out)

    def write_all(self, region: Any, data: np.ndarray, comm: Any = None) -> None:
        self.write(region, data)

    def resize(self, shape: Any, comm: Any = None) -> None:
        """``Resizable.resize``: rank 0 zeroes what a shrink leaves in the file outside the
        new shape, then sets the file to the new capacity (a growth is checked against
        the free space and allocated first: ``OutOfSpaceError`` changes nothing); every
        rank then drops its mappings and plans and takes the new shape."""
        from chemio_py.backends.grid import Layout, capacity
        new = tuple(int(n) for n in shape)
        lay = Layout(capacity(new, self.chunks, self.maxshape), self.chunks, self.layout.itemsize)
        with _agree(comm, f"resize array {self.path}"):
            if comm is None or comm.rank == 0:
                self._resize_file(new, lay)
        self._forget_maps()
        self.layout, self.shape = lay, new
        self._map_write_ok = None

    def _resize_file(self, new: tuple, lay: Any) -> None:
        from chemio_py.backends.grid import stale_regions, zero_regions
        if not self.writable:
            raise StorageError(errno.EBADF, self.path, None, None, "resize",
                               "the array store is open read-only")
        old_n, n = self.layout.nbytes, lay.nbytes
        if n > old_n:
            have = os.fstat(self._fd).st_blocks * 512
            fs.check_space(self.path, n - have, what=f"grow the array to {n} bytes",
                           free=self._free())
            err = fallocate_keep_size(self._fd, n)
            if err in SPACE_ERRNOS:
                raise OutOfSpaceError(self.path, n - have, self._free(), what="grow the array")
        kept = (min(lay.shape[0], self.layout.shape[0]), *self.layout.shape[1:])
        zero_regions(self.write, stale_regions(self.shape, new, kept), self.chunks,
                     self.dtype)
        self._forget_maps()
        try:
            os.ftruncate(self._fd, n)
        except OSError as e:
            raise StorageError(e.errno, self.path, None, n, "resize") from e

    def _forget_maps(self) -> None:
        """Drop the mappings and plans made for the old size."""
        with maps_lock:
            drop_map(id(self))
        with self._map_lock:
            self._unmap()
        self._plans.clear()
        self._big_plan = None
        self._extents.clear()

    def _unmap(self) -> None:
        """Close this store's own mapping (a view still alive elsewhere: the GC unmaps)."""
        m, self._map = self._map, None
        if m is not None:
            mm = m[0]
            del m
            try:
                mm.close()
            except BufferError:
                pass

    def evict(self) -> None:
        """Unmap the file (read mapping and mapped pages of writes), then drop its pages
        from the page cache (fsync, then POSIX_FADV_DONTNEED)."""
        with maps_lock:
            drop_map(id(self))
        m = self._map
        if m is not None:
            try:
                m[0].madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError, AttributeError):
                pass
        super().evict()

    def close(self) -> None:
        io_uring.settle_descriptor(self._region_dfd)      # no region read outlives it
        with maps_lock:
            drop_map(id(self))
        dfd, self._region_dfd = self._region_dfd, -1
        if dfd is not None and dfd >= 0:
            os.close(dfd)
        self._unmap()
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self):
        finalizers.close_later(self.close)


class _NoAgreement:
    def __enter__(self) -> "_NoAgreement":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def _agree(comm: Any, what: str) -> Any:
    """``comm.agree(what)``, or nothing for a store of one process."""
    return _NoAgreement() if comm is None else comm.agree(what)
