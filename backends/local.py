"""The ``local`` backend: POSIX files with positioned vector I/O.

``os.preadv``/``os.pwritev`` release the GIL and move bytes straight between the file and
the caller's buffer, so a pool of threads reaches the device's queue depth without copies.
Space is reserved with ``posix_fallocate`` (fast writes, and ENOSPC up front instead of
half-way). O_DIRECT is opt-in (``direct=True`` or ``CHEMIO_DIRECT=1``): requests whose
buffer address, offset and length are aligned go through an O_DIRECT descriptor, the rest
through the page cache; a file system that refuses O_DIRECT falls back to buffered I/O.
"""
from __future__ import annotations

import errno
import mmap
import os
import stat as _stat
from typing import Any

import numpy as np

from chemio_py import config, scratch
from chemio_py.errors import OutOfSpaceError, StorageError

DIRECT_ALIGN = 4096
_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
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


_libc: list[Any] = []
FALLOC_FL_KEEP_SIZE = 1


def _fallocate_keep_size(fd: int, n: int) -> int:
    """fallocate(2) with FALLOC_FL_KEEP_SIZE (not in the os module); returns errno or 0."""
    if not _libc:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        fn = getattr(libc, "fallocate", None)
        if fn is not None:
            fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            fn.restype = ctypes.c_int
        _libc.append((fn, ctypes))
    fn, ctypes = _libc[0]
    if fn is None:
        return errno.ENOSYS
    return 0 if fn(fd, FALLOC_FL_KEEP_SIZE, 0, n) == 0 else ctypes.get_errno()


def aligned_empty(shape: Any, dtype: Any = np.uint8, align: int = DIRECT_ALIGN) -> np.ndarray:
    """An uninitialised C-ordered array whose data starts on an ``align``-byte boundary."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = count * dtype.itemsize
    if nbytes >= mmap.PAGESIZE and align <= mmap.PAGESIZE:
        raw = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)   # page-aligned, lazy zero
    else:
        raw = np.empty(nbytes + align, dtype=np.uint8)
        start = (-raw.ctypes.data) % align
        raw = raw[start:start + nbytes]
    return raw.view(dtype).reshape(shape)


def _bytes_view(buf: Any, writable: bool) -> memoryview:
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if writable and mv.readonly:
        raise TypeError(f"read buffer must be writable, got a read-only {type(buf).__name__}")
    if not mv.c_contiguous:
        raise TypeError(f"buffer must be C-contiguous, got {type(buf).__name__} "
                        f"with strides {mv.strides}")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def _address(mv: memoryview) -> int:
    return np.frombuffer(mv, dtype=np.uint8).ctypes.data if len(mv) else 0


class LocalByteStore:
    """A byte-addressable POSIX file (see ``chemio_py.backends`` for the protocol)."""

    def __init__(self, path: str, fd: int, writable: bool, direct_fd: int | None = None):
        self.path = path
        self._fd = fd
        self._dfd = direct_fd
        self.writable = writable

    @property
    def fd(self) -> int:
        return self._fd

    def _fd_for(self, mv: memoryview, offset: int) -> int:
        if self._dfd is not None and not (offset | len(mv)) % DIRECT_ALIGN \
                and not _address(mv) % DIRECT_ALIGN:
            return self._dfd
        return self._fd

    def pread(self, offset: int, out: Any) -> int:
        """Fill ``out`` from ``offset``; returns the bytes read (fewer only at end of file)."""
        mv = _bytes_view(out, writable=True)
        n = len(mv)
        fd = self._fd_for(mv, offset)
        done = 0
        try:
            while done < n:
                k = os.preadv(fd, [mv[done:]], offset + done)
                if k == 0:
                    break
                done += k
        except OSError as e:
            if e.errno == errno.EINVAL and fd == self._dfd:
                self._dfd = None            # the file system refused O_DIRECT after all
                return done + self.pread(offset + done, mv[done:])
            raise StorageError(e.errno, self.path, offset, n, "read") from e
        return done

    def pwrite(self, offset: int, data: Any) -> int:
        """Write all of ``data`` at ``offset`` (extending the file); returns its length."""
        mv = _bytes_view(data, writable=False)
        n = len(mv)
        fd = self._fd_for(mv, offset)
        done = 0
        try:
            while done < n:
                done += os.pwritev(fd, [mv[done:]], offset + done)
        except OSError as e:
            if e.errno in _SPACE_ERRNOS:
                raise OutOfSpaceError(self.path, n - done, self._free(), what="write") from e
            if e.errno == errno.EINVAL and fd == self._dfd:
                self._dfd = None
                return done + self.pwrite(offset + done, mv[done:])
            raise StorageError(e.errno, self.path, offset, n, "write") from e
        return n

    def _free(self) -> int | None:
        try:
            st = os.fstatvfs(self._fd)
            return st.f_bavail * st.f_frsize
        except OSError:
            return None

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def allocated(self) -> int:
        """Bytes the file occupies on the device (holes excluded)."""
        return os.fstat(self._fd).st_blocks * 512

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
        scratch.check_space(self.path, need, what=f"reserve {n} bytes", free=self._free())
        err = _fallocate_keep_size(self._fd, n)
        if err in _SPACE_ERRNOS:
            raise OutOfSpaceError(self.path, need, self._free(), what="reserve")
        if err not in (0, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise StorageError(err, self.path, 0, n, "reserve")

    def advise(self, offset: int, length: int, advice: str) -> None:
        """Pass an access-pattern hint (normal, sequential, random, willneed, dontneed)."""
        os.posix_fadvise(self._fd, offset, length, _ADVICE[advice])

    def flush(self) -> None:
        """Make written data durable (fdatasync)."""
        try:
            os.fdatasync(self._fd)
        except OSError as e:
            if e.errno in _SPACE_ERRNOS:
                raise OutOfSpaceError(self.path, None, self._free(), what="flush") from e
            raise StorageError(e.errno, self.path, None, None, "flush") from e

    def evict(self) -> None:
        """Drop the file's pages from the page cache (fsync, then POSIX_FADV_DONTNEED)."""
        if self.writable:
            os.fsync(self._fd)
        os.posix_fadvise(self._fd, 0, 0, _ADVICE["dontneed"])

    def close(self) -> None:
        for name in ("_dfd", "_fd"):
            fd = getattr(self, name)
            if fd is not None and fd >= 0:
                setattr(self, name, None if name == "_dfd" else -1)
                os.close(fd)

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class LocalBackend:
    """POSIX files on a local or parallel file system."""

    name = "local"
    description = "POSIX files (preadv/pwritev, posix_fallocate, optional O_DIRECT)"

    def root(self, scope: str, rank: int = 0) -> str:
        return scratch.shared_root() if scope == "shared" else scratch.private_root(rank)

    def open_bytes(self, path: str, mode: str, *, direct: bool | None = None) -> LocalByteStore:
        if mode not in _MODES:
            raise ValueError(f"mode {mode!r} is not one of {sorted(_MODES)}")
        flags = _MODES[mode] | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)
        try:
            st = os.fstat(fd)
            if not _stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, f"{path!r} is not a regular file", path)
        except BaseException:
            os.close(fd)
            raise
        dfd = None
        if direct if direct is not None else config.get("direct"):
            try:
                dfd = os.open(path, (flags & ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC)) | os.O_DIRECT)
            except OSError:
                dfd = None          # e.g. tmpfs without O_DIRECT: buffered I/O only
        return LocalByteStore(path, fd, mode != "r", dfd)

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def stat(self, path: str) -> scratch.FsInfo:
        return scratch.stat(path)

    def remove(self, path: str) -> bool:
        """Delete ``path``; False when it did not exist."""
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False
