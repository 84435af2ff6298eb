"""Persistent read-only mappings of local array files (hot reads copy from them): at most
``map_cap`` bytes mapped per process, each guarded against SIGBUS, and all of them
droppable at once (``drop_mappings``) when memory is wanted back.
"""
from __future__ import annotations

import ctypes
import os
import threading
from collections import OrderedDict

import numpy as np
import numpy.ctypeslib  # noqa: F401 - imported lazily, it races between pool threads

from chemio_py.backends import posix
from chemio_py.runtime import config


def map_cap() -> int:
    """The ``map_cap`` setting in bytes (a share of memory resolved against MemTotal)."""
    text = config.get("map_cap")
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 1 << 34
    return config.parse_limit(text, total)


class ReadMap:
    """A read-only mapping of a whole array file, guarded against SIGBUS."""

    __slots__ = ("addr", "nbytes", "base", "guard", "pins", "dead")

    def __init__(self, addr: int, nbytes: int):
        self.addr, self.nbytes = addr, nbytes
        self.base: np.ndarray | None = np.ctypeslib.as_array(
            (ctypes.c_uint8 * nbytes).from_address(addr))
        self.base.flags.writeable = False          # the pages are mapped PROT_READ
        self.guard = posix.guard_register(addr, addr + nbytes)
        self.pins = 0
        self.dead = False

    def release(self) -> None:
        """Unmap (the caller holds ``maps_lock`` and no copy uses the mapping)."""
        posix.guard_unregister(self.guard)
        self.base = None
        posix.unmap(self.addr, self.nbytes)


live_maps: "OrderedDict[int, ReadMap]" = OrderedDict()     # id(store) -> mapping, LRU first
maps_lock = threading.RLock()           # RLock: a store closed by GC while held


def drop_map(key: int) -> None:
    """Forget a store's mapping; unmapped now, or by the last copy still using it."""
    m = live_maps.pop(key, None)
    if m is not None:
        m.dead = True
        if not m.pins:
            m.release()


def make_room(n: int, cap: int) -> None:
    """Drop the least recently used mappings until ``n`` more bytes fit under ``cap``
    (the caller holds ``maps_lock``)."""
    total = sum(x.nbytes for x in live_maps.values())
    while live_maps and total + n > cap:
        total -= next(iter(live_maps.values())).nbytes
        drop_map(next(iter(live_maps)))


def drop_mappings() -> None:
    """Unmap every array file mapped for cached reads (their pages stay in the page cache,
    where ``posix_fadvise(DONTNEED)`` and memory pressure can now drop them)."""
    with maps_lock:
        for key in list(live_maps):
            drop_map(key)
