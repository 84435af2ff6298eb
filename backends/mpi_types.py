"""MPI derived datatypes for a region of a raw chunk-grid array (``chemio_py.layout``).

A region meets chunks in *pieces*. ``region_types`` describes the region twice, piece by
piece in the same order: as a **file type** (each piece a strided block inside its chunk,
at the chunk's offset: the displacements rise, as a file view requires) and as a **memory
type** over the caller's NumPy buffer, whatever its (non-negative) strides, relative to its
first element. Byte ``k`` of one matches byte ``k`` of the other, so one MPI-IO call moves
the whole region, collectively or not, with no staging copy.

Every type made here is freed: ``RegionTypes.free()`` (the pair) after the I/O call; the
building blocks are freed as soon as the two committed structs exist.
"""
from __future__ import annotations

from typing import Any, Sequence

from chemio_py.layout import Layout, c_strides


def _strided(MPI: Any, shape: Sequence[int], strides: Sequence[int], itemsize: int,
             made: list) -> Any:
    """A type for a block of ``shape`` items at byte ``strides`` (C traversal order)."""
    k = len(shape)
    block = itemsize
    while k > 0 and (shape[k - 1] == 1 or strides[k - 1] == block):
        block *= shape[k - 1]                 # trailing axes that are one contiguous run
        k -= 1
    t = MPI.BYTE.Create_contiguous(block)
    made.append(t)
    for ax in range(k - 1, -1, -1):
        if shape[ax] == 1:
            continue
        t = t.Create_hvector(shape[ax], 1, strides[ax])
        made.append(t)
    return t


class RegionTypes:
    """The committed (file type, memory type) pair of one region; ``nbytes`` it moves."""

    __slots__ = ("filetype", "memtype", "nbytes")

    def __init__(self, filetype: Any, memtype: Any, nbytes: int):
        self.filetype, self.memtype, self.nbytes = filetype, memtype, nbytes

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
    isz = layout.itemsize
    rstart = [s.start for s in region]
    made: list = []
    ftypes, fdisp, mtypes, mdisp = [], [], [], []
    nbytes = 0
    try:
        for p in layout.pieces(region):
            dstr = c_strides(p.extent, isz)
            local = [a - i * c for a, i, c in zip(p.start, p.index, layout.chunks)]
            fdisp.append(p.offset + sum(l * s for l, s in zip(local, dstr)))
            ftypes.append(_strided(MPI, p.shape, dstr, isz, made))
            mdisp.append(sum((a - r0) * s for a, r0, s in zip(p.start, rstart, mem_strides)))
            mtypes.append(_strided(MPI, p.shape, mem_strides, isz, made))
            n = isz
            for x in p.shape:
                n *= x
            nbytes += n
        if not ftypes:
            return None
        ones = [1] * len(ftypes)
        ft = MPI.Datatype.Create_struct(ones, fdisp, ftypes)
        try:
            mt = MPI.Datatype.Create_struct(ones, mdisp, mtypes)
        except BaseException:
            ft.Free()
            raise
        ft.Commit()
        mt.Commit()
        return RegionTypes(ft, mt, nbytes)
    finally:
        for t in made:
            t.Free()
