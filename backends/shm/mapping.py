"""The mmap window of a shm segment: a large virtual mapping the file grows inside.

Python's ``mmap`` refuses to map past the end of a file and cannot be unmapped while a
buffer of it is exported; libc's ``mmap`` can do both, so a store maps a large virtual
window once (``MIN_MAP``, or less under ``ulimit -v``) and the file grows inside it without
remapping (and without losing the pages already faulted in). A ``Window`` is that mapping
with a NumPy byte view; it knows nothing of locks or budgets.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
from typing import Any

import numpy as np

PAGE = mmap.PAGESIZE
MIN_MAP = 16 << 30              # virtual size mapped up front: growth rarely needs a remap


def round_up(n: int, q: int = PAGE) -> int:
    return -(-n // q) * q


_libc_fns: list[Any] = []


def libc_calls() -> Any:
    if not _libc_fns:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_int64]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.restype = ctypes.c_int
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc_fns.append(libc)
    return _libc_fns[0]


_MAP_FAILED = ctypes.c_void_p(-1).value


class Window:
    """``length`` bytes of a file mapped shared at its offset 0, with a NumPy byte view."""

    __slots__ = ("addr", "length", "view")

    def __init__(self, fd: int, length: int, writable: bool):
        libc = libc_calls()
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        addr = libc.mmap(None, length, prot, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        self.addr = addr
        self.length = length

        class _Iface:
            __array_interface__ = {"shape": (length,), "typestr": "|u1", "version": 3,
                                   "data": (addr, not writable)}
        self.view = np.asarray(_Iface())

    def close(self) -> None:
        if self.addr:
            del self.view               # drop the array over the pages before unmapping them
            libc_calls().munmap(self.addr, self.length)
            self.addr = 0


def map_window(fd: int, needed: int, writable: bool) -> Window:
    """Map at least ``needed`` bytes (more when the address space allows)."""
    want = round_up(max(MIN_MAP, 2 * needed, PAGE))
    floor = round_up(max(needed, PAGE))
    while True:
        try:
            return Window(fd, want, writable)
        except OSError as e:
            if e.errno != errno.ENOMEM or want <= floor:
                raise
            want = max(floor, round_up(want // 4))      # e.g. under ulimit -v
