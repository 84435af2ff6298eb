"""MPI derived datatypes for a region of a raw chunk-grid array (``chemio_py.backends.grid``).

A region meets chunks in *pieces*. ``region_types`` describes the region twice, in file
order: as a **file type** (the pieces inside their chunks at the chunks' offsets: the
displacements rise, as a file view requires) and as a **memory type** over the caller's
NumPy buffer, whatever its (non-negative) strides, relative to its first element. Byte
``k`` of one matches byte ``k`` of the other, so one MPI-IO call moves the whole region,
collectively or not, with no staging copy.

The types are built from the chunk grid's regular structure, not piece by piece: along
each axis the chunks a region meets form at most three groups met alike (``Layout.
axis_groups``), each a vector of chunks, so a region of any number of chunks takes at most
about 3**ndim types, and runs contiguous on disk (or in memory) become single blocks (a
whole C-ordered array of tiny chunks is one contiguous type).

Every type made here is freed: ``RegionTypes.free()`` (the pair) after the I/O call; the
building blocks are freed as soon as the two committed structs exist.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from chemio_py.backends.grid import Layout, c_strides

# A type before it is made: ("c", nbytes) contiguous bytes at 0; ("v", count, stride, inner)
# ``count`` copies of ``inner`` ``stride`` bytes apart; ("s", [(disp, inner), ...]) in order.
_BIG = 1 << 30                     # contiguous types larger than this are built in two steps


def _contig(n: int) -> tuple:
    return ("c", n)


def _vec(count: int, stride: int, inner: tuple) -> tuple:
    if count == 1:
        return inner
    if inner[0] == "c" and stride == inner[1]:
        return ("c", count * inner[1])
    return ("v", count, stride, inner)


def _struct(entries: list) -> tuple:
    # A struct entry that is itself a struct contributes its blocks, shifted, so touching
    # blocks merge: MPICH 5.0.2's ROMIO aborts (ADIOI_Flatten_datatype: Assertion
    # `actual == num_iovs') on a vector of a struct whose blocks touch.
    flat: list = []
    for disp, t in entries:
        if t[0] == "s":
            flat.extend((disp + d, u) for d, u in t[1])
        else:
            flat.append((disp, t))
    merged: list = []
    for disp, t in flat:
        if merged and t[0] == "c" and merged[-1][1][0] == "c" \
                and merged[-1][0] + merged[-1][1][1] == disp:
            merged[-1] = (merged[-1][0], ("c", merged[-1][1][1] + t[1]))
        else:
            merged.append((disp, t))
    if len(merged) == 1 and merged[0][0] == 0:
        return merged[0][1]
    return ("s", merged)


def _strided(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> tuple:
    """A block of ``shape`` items at byte ``strides`` (C traversal order)."""
    t = _contig(itemsize)
    for ax in range(len(shape) - 1, -1, -1):
        t = _vec(shape[ax], strides[ax], t)
    return t


def _make(MPI: Any, spec: tuple, made: list) -> Any:
    kind = spec[0]
    if kind == "c":
        n = spec[1]
        if n <= _BIG:
            t = MPI.BYTE.Create_contiguous(n)
            made.append(t)
            return t
        unit = 1 << 20
        q, r = divmod(n, unit)
        parts = [(0, ("v", q, unit, ("c", unit)))] + ([(q * unit, ("c", r))] if r else [])
        return _make(MPI, ("s", parts), made)
    if kind == "v":
        inner = _make(MPI, spec[3], made)
        t = inner.Create_hvector(spec[1], 1, spec[2])
        made.append(t)
        return t
    disps = [d for d, _ in spec[1]]
    types = [_make(MPI, t, made) for _, t in spec[1]]
    t = MPI.Datatype.Create_struct([1] * len(types), disps, types)
    made.append(t)
    return t


def region_specs(layout: Layout, region: Any, mem_strides: Sequence[int]
                 ) -> tuple[tuple, tuple, int] | None:
    """(file type, memory type, bytes) of a region as specs (see ``_make``); None when
    the region is empty. Pure geometry: no MPI."""
    if any(s.stop <= s.start for s in region):
        return None
    isz = layout.itemsize
    ndim = layout.ndim
    ms = [int(t) for t in mem_strides]
    groups = layout.axis_groups(region)
    trail = [math.prod(layout.shape[k + 1:]) for k in range(ndim)]

    def level(k: int, lead: int, chosen: list) -> tuple[tuple, tuple]:
        if k == ndim:
            cs = c_strides([g[4] for g in chosen], isz)
            shape = [g[3] - g[2] for g in chosen]
            f = _strided(shape, cs, isz)
            disp = sum(g[2] * t for g, t in zip(chosen, cs))
            return (_struct([(disp, f)]) if disp else f), _strided(shape, ms, isz)
        fe, me = [], []
        c = layout.chunks[k]
        gstr = c * lead * trail[k] * isz
        for g in groups[k]:
            a, count, lo, _, e = g
            f, m = level(k + 1, lead * e, chosen + [g])
            fe.append((a * gstr, _vec(count, gstr, f)))
            me.append(((a * c + lo - region[k].start) * ms[k], _vec(count, c * ms[k], m)))
        return _struct(fe), _struct(me)

    f, m = level(0, 1, [])
    return f, m, isz * math.prod(s.stop - s.start for s in region)


class RegionTypes:
    """The committed (file type, memory type) pair of one region; ``nbytes`` it moves."""

    __slots__ = ("filetype", "memtype", "nbytes", "mem_contiguous")

    def __init__(self, filetype: Any, memtype: Any, nbytes: int,
                 mem_contiguous: bool = False):
        self.filetype, self.memtype, self.nbytes = filetype, memtype, nbytes
        self.mem_contiguous = mem_contiguous        # the memory type is one block at 0

    def free(self) -> None:
        for name in ("filetype", "memtype"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, None)
                t.Free()


def region_types(MPI: Any, layout: Layout, region: Any, mem_strides: Sequence[int]
                 ) -> RegionTypes | None:
    """The types of a non-empty ``region`` of ``layout`` for a buffer of the region's shape
    with byte ``mem_strides`` (all >= 0); None for an empty region."""
    specs = region_specs(layout, region, mem_strides)
    if specs is None:
        return None
    fspec, mspec, nbytes = specs
    made: list = []
    try:
        # the committed pair are structs of one entry, so freeing the blocks leaves them be
        ft = MPI.Datatype.Create_struct([1], [0], [_make(MPI, fspec, made)])
        try:
            mt = MPI.Datatype.Create_struct([1], [0], [_make(MPI, mspec, made)])
        except BaseException:
            ft.Free()
            raise
        ft.Commit()
        mt.Commit()
        return RegionTypes(ft, mt, nbytes, mspec[0] == "c")
    finally:
        for t in made:
            t.Free()
