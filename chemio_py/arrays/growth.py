"""Growth of DiskArrays: ``maxshape`` at creation, ``resize`` and ``append`` (h5py, zarr).

    >>> d = cio.DiskArray.create("v", (0, 100), "f8", maxshape=(None, 100))
    >>> d.append(np.ones(100))          # one row more: shape (1, 100)
    >>> d.resize((10, 100))             # rows 1..9 read as zero

An array is resizable when it is created with ``maxshape`` (a tuple with ``None`` for an
axis without limit); without it, its shape is fixed (``d.maxshape == d.shape``). No stored
chunk ever moves: the raw chunk grid (``local``, ``shm``, ``auto``, ``mpiio``) is laid out
for the capacity (``backends.grid.capacity``): axis 0 grows by whole chunk rows at the end
of the file, every other axis has the room of its (finite) ``maxshape`` reserved from the
start, so only axis 0 may be unlimited there; ``zarr`` names its objects by grid index,
so any axis grows. Shrinking drops the elements outside the new shape (growing again
brings zeros, as in a fresh array). Checksummed arrays are fixed.

``resize`` and ``append`` are collective: every rank passes the same new shape (the same
data for ``append``) or every rank raises and nothing changes. Rank 0 changes the object
and its metadata (written atomically), then every rank has the new shape.
"""
from __future__ import annotations

import dataclasses
import math
import operator
import os
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np

from chemio_py.arrays import meta as _meta
from chemio_py.errors import ArgumentError, SectionError
from chemio_py.runtime import requests

if TYPE_CHECKING:
    from chemio_py.arrays.diskarray import DiskArray

UNLIMITED_BASIS = 1024      # the length an unlimited axis counts as when chunks are chosen


def check_maxshape(maxshape: Any, shape: tuple, grid: bool, backend: str) -> tuple | None:
    """``maxshape`` of ``create`` as a tuple (``None`` entries: no limit), or None for a
    fixed array; ``ArgumentError`` for anything else."""
    if maxshape is None:
        return None
    if isinstance(maxshape, (int, np.integer)) and not isinstance(maxshape, bool):
        maxshape = (maxshape,)
    try:
        items = list(maxshape)
    except TypeError:
        raise ArgumentError(f"maxshape must be a tuple of ints or None (one per axis), got "
                            f"{maxshape!r}") from None
    if len(items) != len(shape):
        raise ArgumentError(f"maxshape {tuple(items)} has {len(items)} entries but shape "
                            f"{shape} has {len(shape)} axes; give one per axis (None: no limit)")
    out: list[int | None] = []
    for k, (m, n) in enumerate(zip(items, shape)):
        if m is None:
            if grid and k > 0:
                raise ArgumentError(
                    f"maxshape {tuple(items)} leaves axis {k} unlimited, but backend "
                    f"{backend!r} keeps its chunks in one C-ordered grid where only axis 0 "
                    f"can grow without moving stored chunks; give axis {k} a finite maximum "
                    f"(its room is laid out in the file from the start), put the growing "
                    f"axis first, or use backend='zarr' (any axis grows)")
            out.append(None)
            continue
        if isinstance(m, bool):
            raise ArgumentError(f"maxshape {tuple(items)} holds a bool; sizes are ints")
        try:
            m = operator.index(m)
        except TypeError:
            raise ArgumentError(f"maxshape {tuple(items)} holds {m!r}, which is neither an "
                                f"int nor None") from None
        if m < n:
            raise ArgumentError(f"maxshape {tuple(items)} is smaller than shape {shape} on "
                                f"axis {k} ({m} < {n}); a maximum is at least the shape")
        out.append(int(m))
    return tuple(out)


def chunk_basis(shape: tuple, maxshape: tuple | None, chunks: Any = None) -> tuple:
    """The shape chunks are chosen for (and clipped to): ``maxshape``, an unlimited axis
    counting as ``UNLIMITED_BASIS`` (or its chunk when given) at least."""
    if maxshape is None:
        return shape
    given = list(chunks) if chunks is not None and len(list(chunks)) == len(shape) \
        else [1] * len(shape)
    out = []
    for n, m, c in zip(shape, maxshape, given):
        try:
            c = operator.index(c)
        except TypeError:
            c = 1
        out.append(m if m is not None else max(n, UNLIMITED_BASIS, c))
    return tuple(out)


def capacity_nbytes(shape: tuple, maxshape: tuple | None, itemsize: int) -> int:
    """The bytes the most the array may hold (its shape where an axis is unlimited)."""
    if maxshape is None:
        return math.prod(shape) * itemsize
    return math.prod(n if m is None else m for n, m in zip(shape, maxshape)) * itemsize


def new_shape(d: "DiskArray", size: Any, axis: Any) -> tuple:
    """The shape ``d.resize(size, axis)`` asks for, checked against ``d.maxshape``."""
    shape, ndim = d.shape, d.ndim
    if axis is None:
        new = _meta.check_shape(size, "new shape")
        if len(new) != ndim:
            raise ArgumentError(f"resize of DiskArray {d.name!r} to {new}: the array has "
                                f"{ndim} axes, the new shape {len(new)}; resize changes sizes, "
                                f"never the number of axes")
    else:
        ax = _axis(axis, ndim)
        if isinstance(size, bool) or not hasattr(size, "__index__"):
            raise ArgumentError(f"resize(size, axis={axis}) takes an int size, got {size!r}")
        n = operator.index(size)
        if n < 0:
            raise ArgumentError(f"resize(size={n}, axis={axis}): a size is >= 0")
        new = shape[:ax] + (n,) + shape[ax + 1:]
    limit = d.maxshape
    if d._meta.maxshape is None and new != shape:
        raise ArgumentError(f"DiskArray {d.name!r} has a fixed shape {shape} (created without "
                            f"maxshape); create it with maxshape= (None for an axis without "
                            f"limit) to resize it; nothing changed")
    for k, (n, m) in enumerate(zip(new, limit)):
        if m is not None and n > m:
            raise ArgumentError(f"resize of DiskArray {d.name!r} to {new}: axis {k} would be "
                                f"{n}, beyond its maxshape {m} (maxshape {limit}); create "
                                f"the array with a larger maxshape; nothing changed")
    nbytes = math.prod(new) * d.dtype.itemsize
    if nbytes > _meta.MAX_NBYTES:
        raise ArgumentError(f"resize of DiskArray {d.name!r} to {new} makes {nbytes} bytes, "
                            f"more than the limit of {_meta.MAX_NBYTES}")
    return new


def _axis(axis: Any, ndim: int) -> int:
    try:
        ax = operator.index(axis)
    except TypeError:
        raise ArgumentError(f"axis must be an int, got {axis!r}") from None
    if not -ndim <= ax < ndim:
        raise ArgumentError(f"axis {axis} is out of range for an array of {ndim} axes")
    return ax % ndim


def resize(d: "DiskArray", size: Any, axis: Any = None) -> tuple:
    """``DiskArray.resize``: collective; returns the new shape."""
    c = d.comm
    what = f"DiskArray {d.name!r} resize"
    c.begin(what + "()")
    with c.agree(what):
        d._writable_store()
        new = new_shape(d, size, axis)
    c.same_everywhere(new, what, lambda mine, first: (
        f"rank {c.rank} asked to resize DiskArray {d.name!r} to {mine} but rank 0 to "
        f"{first}; every rank must pass the same new shape; nothing changed"))
    if new == d.shape:
        return new
    with c.agree(what + " (outstanding requests)"):
        err = requests.failure(d.path, d._pending.drain())
        if err is not None:
            raise err
    resize_store = d.capabilities.resize
    if resize_store is None:                # a store opened without growth: cannot happen
        raise ArgumentError(f"the store of DiskArray {d.name!r} cannot change its shape")
    old, m = d._meta, dataclasses.replace(d._meta, shape=new)
    if d.meta_path == d.path:               # the store keeps its own metadata (zarr)
        resize_store(new, c)
    elif any(n < o for n, o in zip(new, d.shape)):
        # A shrink drops data: the metadata goes first, so a failed write changes nothing,
        # and a store that refuses puts the old metadata back.
        _write_meta(d, m, what)
        try:
            resize_store(new, c)
        except BaseException:
            _write_meta(d, old, what + " (putting the old shape back)")
            raise
    else:
        # A growth adds only zeros: the store goes first (it may be out of space), and a
        # failed metadata write shrinks it back, which loses nothing.
        resize_store(new, c)
        try:
            _write_meta(d, m, what)
        except BaseException:
            resize_store(d.shape, c)
            raise
    d._reshaped(m)
    return new


def _write_meta(d: "DiskArray", m: _meta.Meta, what: str) -> None:
    """Rank 0 writes ``m`` as ``d``'s metadata, atomically; collective: all return or raise."""
    c = d.comm
    with c.agree(what + " metadata"):
        if c.rank == 0:
            _meta.write_atomic(d.meta_path, _meta.dumps(m), _mode_of(d.meta_path),
                               durable=m.persistent)


def _mode_of(path: str) -> int:
    try:
        return os.stat(path).st_mode & 0o777
    except OSError:
        return 0o600


def append(d: "DiskArray", data: Any, axis: Any = 0) -> tuple:
    """``DiskArray.append``: collective; returns the new shape."""
    c = d.comm
    what = f"DiskArray {d.name!r} append"
    c.begin(what + "()")
    with c.agree(what):
        d._writable_store()
        ax = _axis(axis, d.ndim)
        arr = np.asarray(data)
        if arr.ndim == d.ndim - 1:
            arr = np.expand_dims(arr, ax)           # one element along the axis
        if arr.ndim != d.ndim:
            raise SectionError(f"append to DiskArray {d.name!r} of shape {d.shape}: data has "
                               f"{np.ndim(data)} axes, need {d.ndim} (or {d.ndim - 1} for one "
                               f"slice); nothing was written")
        other = [k for k in range(d.ndim) if k != ax and arr.shape[k] != d.shape[k]]
        if other:
            raise SectionError(f"append along axis {ax} to DiskArray {d.name!r} of shape "
                               f"{d.shape}: data of shape {arr.shape} differs on axis "
                               f"{other[0]}; nothing was written")
        _meta.check_cast(arr.dtype, d.dtype, f"DiskArray {d.name!r}")
        arr = np.ascontiguousarray(arr, dtype=d.dtype)
        key = (arr.shape, zlib.crc32(arr.tobytes()))
    if c.size > 1:
        c.same_everywhere(key, what, lambda mine, first: (
            f"rank {c.rank} appends data of shape {mine[0]} (crc {mine[1]:#x}) to DiskArray "
            f"{d.name!r} but rank 0 data of shape {first[0]} (crc {first[1]:#x}); every rank "
            f"passes the same data; nothing changed"))
    old = d.shape[ax]
    n = arr.shape[ax]
    new = resize(d, old + n, ax)
    section = tuple(slice(old, old + n) if k == ax else slice(0, s) for k, s in enumerate(new))
    if c.size == 1:
        d.write(section, arr)
    else:
        from chemio_py.arrays.diskarray import block_section
        share = block_section(arr.shape, c, axis=ax, chunks=None)
        mine = tuple(slice(old + s.start, old + s.stop) if k == ax else s
                     for k, s in enumerate(share))
        d.write_all(mine, arr[share])
    return new
