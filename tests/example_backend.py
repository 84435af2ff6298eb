"""A complete chemio_py backend in one file: plain POSIX files, arrays in C order.

    import chemio_py.backends as backends
    backends.register("plain", PlainBackend)
    f = cio.ExclusiveFile("x", "w+", backend="plain")     # SharedFile, DiskArray too

It implements the required contract only (no optional capability): blocking positioned
I/O; the user layer runs its asynchronous calls on the I/O pool.
"""
from __future__ import annotations

import errno
import math
import os
import stat
from typing import Any

import numpy as np

from chemio_py import scratch
from chemio_py.errors import MetadataError, OutOfSpaceError, StorageError

_FLAGS = {"r": os.O_RDONLY, "r+": os.O_RDWR, "w+": os.O_RDWR | os.O_CREAT | os.O_TRUNC,
          "x+": os.O_RDWR | os.O_CREAT | os.O_EXCL}


def _open(path: str, mode: str, perms: int = 0o600) -> int:
    """Open a regular file: never through a final symlink, never blocking on a FIFO."""
    if mode not in _FLAGS:
        raise ValueError(f"mode {mode!r} is not one of {sorted(_FLAGS)}")
    flags = _FLAGS[mode] | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, perms)
    except (FileNotFoundError, FileExistsError):
        raise                                   # the user layer tells these apart
    except OSError as e:
        raise StorageError(e.errno, path, None, None, "open") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StorageError(errno.EINVAL, path, None, None, "open", "not a regular file")
    os.set_blocking(fd, True)
    return fd


def _free(path: str) -> int:
    st = os.statvfs(os.path.dirname(os.path.abspath(path)))
    return st.f_bavail * st.f_frsize


class _File:
    """What both stores do with their descriptor."""

    def __init__(self, path: str, fd: int, writable: bool):
        self.path, self._fd, self.writable = path, fd, writable

    def _read(self, offset: int, buf: Any) -> int:
        mv = memoryview(buf).cast("B")
        done = 0
        try:
            while done < len(mv):
                k = os.preadv(self._fd, [mv[done:]], offset + done)
                if k == 0:
                    break                       # end of file: the caller decides
                done += k
        except OSError as e:
            raise StorageError(e.errno, self.path, offset, len(mv), "read") from e
        return done

    def _write(self, offset: int, buf: Any) -> int:
        mv = memoryview(buf).cast("B")
        done = 0
        try:
            while done < len(mv):
                done += os.pwritev(self._fd, [mv[done:]], offset + done)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OutOfSpaceError(self.path, len(mv) - done, _free(self.path)) from e
            raise StorageError(e.errno, self.path, offset, len(mv), "write") from e
        return done

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def flush(self) -> None:
        if self.writable:
            try:
                os.fdatasync(self._fd)
            except OSError as e:
                raise StorageError(e.errno, self.path, None, None, "flush") from e

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


class PlainByteStore(_File):
    """ByteStore: ExclusiveFile, SharedFile and RecordFile bytes."""

    def pread(self, offset: int, out: Any) -> int:
        return self._read(offset, out)

    def pwrite(self, offset: int, data: Any) -> int:
        return self._write(offset, data)

    def truncate(self, n: int) -> None:
        try:
            os.ftruncate(self._fd, n)
        except OSError as e:
            raise StorageError(e.errno, self.path, None, n, "truncate") from e

    def reserve(self, n: int) -> None:
        need = n - os.fstat(self._fd).st_blocks * 512
        if need > 0 and _free(self.path) < need:
            raise OutOfSpaceError(self.path, need, _free(self.path), what=f"reserve {n} bytes")


class PlainArrayStore(_File):
    """ArrayStore: the elements in C order, each row of a region one pread/pwrite."""

    byte_addressable = True         # a write touches only its region's bytes

    def __init__(self, path: str, fd: int, writable: bool, shape: tuple, dtype: np.dtype,
                 chunks: tuple):
        super().__init__(path, fd, writable)
        self.shape, self.dtype, self.chunks = shape, dtype, chunks
        self._steps = [dtype.itemsize * math.prod(shape[k + 1:]) for k in range(len(shape))]

    def _rows(self, region: tuple, arr: np.ndarray):
        """(file offset, 1-d view of ``arr``) for every contiguous row of ``region``."""
        if arr.ndim == 0:
            yield 0, arr.reshape(1)
            return
        if arr.size == 0:
            return
        for idx in np.ndindex(*arr.shape[:-1]):
            starts = [s.start + i for s, i in zip(region, idx)] + [region[-1].start]
            yield sum(k * step for k, step in zip(starts, self._steps)), arr[idx]

    def read(self, region: tuple, out: np.ndarray) -> np.ndarray:
        for offset, row in self._rows(region, out):
            if self._read(offset, row) < row.nbytes:
                raise StorageError(errno.EIO, self.path, offset, row.nbytes, "read",
                                   "the data file is shorter than the array")
        return out

    def write(self, region: tuple, data: np.ndarray) -> None:
        for offset, row in self._rows(region, data):
            self._write(offset, row)

    def read_all(self, region: tuple, out: np.ndarray, comm: Any = None) -> np.ndarray:
        return self.read(region, out)           # no collective I/O: independent reads

    def write_all(self, region: tuple, data: np.ndarray, comm: Any = None) -> None:
        self.write(region, data)


class PlainBackend:
    """The backend object: where files go, how stores open, how files go away."""

    name = "plain"
    description = "plain POSIX files, arrays in C order (the docs/architecture.md example)"
    array_formats = ("c-order",)    # the array metadata names it; other formats: MetadataError

    def root(self, scope: str, rank: int = 0) -> str:
        return scratch.shared_root() if scope == "shared" else scratch.private_root(rank)

    def open_bytes(self, path: str, mode: str, **options: Any) -> PlainByteStore:
        return PlainByteStore(path, _open(path, mode), mode != "r")

    def open_array(self, path: str, mode: str, *, shape: Any, dtype: Any, chunks: Any,
                   perms: int = 0o600, **options: Any) -> PlainArrayStore:
        shape, dtype = tuple(shape), np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if mode in ("w+", "x+"):
            if nbytes > _free(path):
                raise OutOfSpaceError(path, nbytes, _free(path), what="create the array")
            fd = _open(path, mode, perms)
            try:
                os.ftruncate(fd, nbytes)        # every element zero (a sparse file)
            except OSError as e:
                os.close(fd)
                os.unlink(path)
                raise StorageError(e.errno, path, None, nbytes, "create the array") from e
        else:
            fd = _open(path, mode)
            size = os.fstat(fd).st_size
            if size != nbytes:
                os.close(fd)
                raise MetadataError(f"{path!r} has {size} bytes but the array needs "
                                    f"{nbytes}: it was truncated or is another array's")
        return PlainArrayStore(path, fd, mode != "r", shape, dtype, tuple(chunks))

    def stat(self, path: str) -> scratch.FsInfo:
        return scratch.stat(path)

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def remove(self, path: str) -> bool:
        """Remove a file or a directory tree (never following links); False if absent."""
        return scratch.remove_path(path)
