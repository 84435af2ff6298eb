"""Chunk layout of a Disk Resident Array: chunk shape from hints; section -> pieces -> byte runs.

Pure geometry (NumPy and the standard library only): the user layer uses it to split a
section into tasks for the I/O pool, byte-addressable backends use it to turn a region into
positioned vector I/O. Nothing here touches a file.

**The raw "grid" format.** The array is cut into chunks of one shape (edge chunks are
trimmed, not padded). Chunks are stored one after another in C order of their grid index,
each chunk in C order of its own extent, so the file holds exactly ``nbytes`` bytes and a
chunk's offset follows from its index (no index table). Recursively: the file is the row
of slabs of ``chunks[0]`` along axis 0; each slab is the row of its slabs along axis 1, and
so on. Consequences: with ``chunks = (c0, *shape[1:])`` the file is the plain C-ordered
array; a request that is exactly one chunk, or a band of whole rows of a chunk, is one
contiguous byte range.

**Requests to byte runs.** A region (tuple of step-1 slices) meets a set of chunks; each
meeting is a *piece*. A piece is contiguous on disk along its trailing axes from the last
axis where it is narrower than its chunk; in memory from the last axis where the caller's
buffer is strided. The finer of the two cuts the piece into *segments*; consecutive
segments that follow each other on disk merge into one *run*, read or written with one
``preadv``/``pwritev`` whose I/O vectors point straight into the caller's array.
"""
from __future__ import annotations
import math
import os
from dataclasses import dataclass
from itertools import product
from typing import Callable, Iterator, NamedTuple, Sequence
import numpy as np

MIB = 1 << 20
PAGE = 4096
SIEVE_HOLE = 64 << 10         # largest hole a read fills through a scratch buffer
BATCH = 1 << 15               # segments or pieces planned at once (bounds plan memory)
try:
    IOV_MAX = max(16, min(1024, os.sysconf("SC_IOV_MAX")))
except (ValueError, OSError, AttributeError):  # pragma: no cover
    IOV_MAX = 1024

Region = tuple  # tuple of slice(start, stop) with step 1, inside the shape


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------- regions

def region_shape(region: Region) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in region)


def region_nbytes(region: Region, itemsize: int) -> int:
    return math.prod(region_shape(region)) * itemsize


def full_region(shape: Sequence[int]) -> Region:
    return tuple(slice(0, int(n)) for n in shape)


def relative(region: Region, inner: Region) -> tuple[slice, ...]:
    """``inner`` (absolute) as slices relative to the start of ``region``."""
    return tuple(slice(i.start - o.start, i.stop - o.start) for o, i in zip(region, inner))


def c_strides(extent: Sequence[int], itemsize: int) -> list[int]:
    """Byte strides of a C-ordered block of ``extent`` items of ``itemsize`` bytes."""
    st = [0] * len(extent)
    acc = itemsize
    for k in range(len(extent) - 1, -1, -1):
        st[k] = acc
        acc *= extent[k]
    return st


def _contiguous_from(extent: Sequence[int], strides: Sequence[int], itemsize: int) -> int:
    """The first axis of the longest trailing block that is one contiguous byte range."""
    acc = itemsize
    for k in range(len(extent) - 1, -1, -1):
        if extent[k] > 1 and strides[k] != acc:
            return k + 1
        acc *= extent[k]
    return 0


@dataclass(frozen=True)
class Piece:
    """Where a region meets one chunk."""
    index: tuple[int, ...]        # chunk grid index
    extent: tuple[int, ...]       # the chunk's extent (trimmed at the edges)
    offset: int                   # the chunk's first byte in the file
    start: tuple[int, ...]        # the piece's first element, absolute
    shape: tuple[int, ...]        # the piece's extent


class Block(NamedTuple):
    """Pieces of a region on a regular grid of chunks, all the same slice of same-extent
    chunks: piece ``(j0, j1, ...)`` (``j < counts``) starts at byte ``first + sum(j * gstrides)``
    of the file and at element ``where + j * chunks`` of the region; each is ``shape`` with
    in-chunk byte strides ``cstrides``. (A tuple: made on every hot read, so cheap to make.)"""
    first: int
    counts: tuple[int, ...]
    gstrides: tuple[int, ...]
    shape: tuple[int, ...]
    cstrides: tuple[int, ...]
    where: tuple[int, ...]


class Layout:
    """The fixed chunk grid of an array of ``shape`` and ``itemsize``-byte elements."""

    def __init__(self, shape: Sequence[int], chunks: Sequence[int], itemsize: int):
        self.shape = tuple(int(n) for n in shape)
        self.chunks = tuple(int(c) for c in chunks)
        self.itemsize = int(itemsize)
        if len(self.chunks) != len(self.shape) or min(self.chunks, default=1) < 1:
            raise ValueError(f"chunks {self.chunks} do not fit shape {self.shape}")
        self.ndim = len(self.shape)
        self.grid = tuple(ceil_div(n, c) for n, c in zip(self.shape, self.chunks))
        self.nbytes = math.prod(self.shape) * self.itemsize
        self.chunk_nbytes = math.prod(self.chunks) * self.itemsize
        # element counts of the full trailing extent after each axis
        self._trail = [math.prod(self.shape[k + 1:]) for k in range(self.ndim)]

    def __repr__(self) -> str:
        return f"Layout(shape={self.shape}, chunks={self.chunks}, itemsize={self.itemsize})"

    def chunk_extent(self, index: Sequence[int]) -> tuple[int, ...]:
        return tuple(min(c, n - i * c) for i, c, n in zip(index, self.chunks, self.shape))

    def chunk_offset(self, index: Sequence[int]) -> int:
        """The byte offset of chunk ``index`` in the file."""
        off = 0
        lead = 1                                  # product of chunk extents of earlier axes
        for k, (i, c, n) in enumerate(zip(index, self.chunks, self.shape)):
            off += i * c * lead * self._trail[k]
            lead *= min(c, n - i * c)
        return off * self.itemsize

    # ------------------------------------------------------------ pieces
    def pieces(self, region: Region) -> Iterator[Piece]:
        """The pieces of ``region``, in file order (made one at a time: the memory does
        not grow with the number of chunks)."""
        if any(s.stop <= s.start for s in region):
            return
        first = [s.start // c for s, c in zip(region, self.chunks)]
        counts = [ceil_div(s.stop, c) - a for s, c, a in zip(region, self.chunks, first)]
        for rel in np.ndindex(*counts):
            index = tuple(a + int(j) for a, j in zip(first, rel))
            lo = tuple(max(s.start, i * c) for s, i, c in zip(region, index, self.chunks))
            hi = tuple(min(s.stop, (i + 1) * c) for s, i, c in zip(region, index, self.chunks))
            yield Piece(index, self.chunk_extent(index), self.chunk_offset(index), lo,
                        tuple(b - a for a, b in zip(lo, hi)))

    # ------------------------------------------------------------ blocks of pieces
    def axis_groups(self, region: Region) -> list[list[tuple[int, ...]]]:
        """Per axis, the chunks the region meets as at most three groups of consecutive
        chunks met alike: ``(first chunk index, count, lo, hi, extent)`` with ``lo:hi`` the
        piece's range inside each chunk and ``extent`` the chunk's. Only the first chunk can
        start inside, only the last end inside or be trimmed, so it takes O(1) per axis."""
        out: list[list[tuple[int, ...]]] = []
        for s, c, n in zip(region, self.chunks, self.shape):
            start, stop = s.start, s.stop
            a, b = start // c, (stop - 1) // c
            if a == b:                                  # inside one chunk: the usual case
                out.append([(a, 1, start - a * c, stop - a * c, min(c, n - a * c))])
                continue
            g: list[tuple[int, ...]] = [(a, 1, start - a * c, c, c)]
            if b - a >= 2:
                x = (a + 1, b - a - 1, 0, c, c)
                if g[-1][2:] == x[2:]:
                    g[-1] = (a, b - a, *x[2:])
                else:
                    g.append(x)
            last = (b, 1, 0, stop - b * c, min(c, n - b * c))
            if g[-1][2:] == last[2:]:
                g[-1] = (g[-1][0], g[-1][1] + 1, *last[2:])
            else:
                g.append(last)
            out.append(g)
        return out

    def blocks(self, region: Region) -> list[Block]:
        """The non-empty ``region`` as at most 3**ndim ``Block``s of pieces that sit on a
        regular grid in the file (same extent, same slice of each chunk). Pure geometry,
        O(3**ndim) whatever the number of chunks."""
        isz, chunks, trail = self.itemsize, self.chunks, self._trail
        groups = self.axis_groups(region)
        combos = [tuple(g[0] for g in groups)] if all(len(g) == 1 for g in groups) \
            else product(*groups)
        starts = [s.start for s in region]
        out = []
        for combo in combos:
            lead, gstr, first, acc = 1, [], 0, isz
            for k, g in enumerate(combo):
                t = chunks[k] * lead * trail[k] * isz
                gstr.append(t)
                first += g[0] * t                       # the chunk's offset
                lead *= g[4]
            cs = [0] * len(combo)
            for k in range(len(combo) - 1, -1, -1):     # C strides inside the chunk
                cs[k] = acc
                first += combo[k][2] * acc
                acc *= combo[k][4]
            out.append(Block(first, tuple([g[1] for g in combo]), tuple(gstr),
                             tuple([g[3] - g[2] for g in combo]), tuple(cs),
                             tuple([g[0] * c + g[2] - s0
                                    for g, c, s0 in zip(combo, chunks, starts)])))
        return out

    def copy_blocks(self, region: Region, stored: np.ndarray, dtype: np.dtype,
                    arr: np.ndarray, write: bool, blocks: Sequence[Block] | None = None
                    ) -> None:
        """Copy the non-empty ``region`` between ``stored`` (the whole file in memory,
        bytes, e.g. a mapping; elements of ``dtype``) and ``arr`` (the region's shape, any
        strides): one NumPy copy per block (``blocks``, else ``self.blocks(region)``), so
        time and memory do not grow with the number of chunks. ``write`` copies into
        ``stored``; element types are converted as by assignment."""
        ms = tuple([t if n > 1 else 0 for n, t in zip(arr.shape, arr.strides)])
        gms = tuple([c * t for c, t in zip(self.chunks, ms)])
        # Views of ``arr`` are made from its buffer where it has one (a C-ordered array:
        # the common case, and ~10x cheaper than ``as_strided``), else by slicing.
        flat = arr if arr.flags.c_contiguous else None
        for b in blocks if blocks is not None else self.blocks(region):
            shape = (*b.counts, *b.shape)
            disk = np.ndarray(shape, dtype, stored, b.first, (*b.gstrides, *b.cstrides))
            if flat is not None:
                at = 0
                for w, t in zip(b.where, ms):
                    at += w * t
                mem = np.ndarray(shape, arr.dtype, flat, at, (*gms, *ms))
            else:
                at_: tuple = (*(slice(w, None) for w in b.where), ...)
                sub = arr[at_]
                mem = np.lib.stride_tricks.as_strided(sub, shape, (*gms, *ms),
                                                      writeable=not write)
            if write:
                np.copyto(disk, mem, casting="unsafe")
            else:
                np.copyto(mem, disk, casting="unsafe")

    def _seg_plan(self, b: Block, mem_strides: Sequence[int]) -> tuple:
        """``(outer dims, their disk strides, their memory strides, run length, memory
        offset of the block)``: the block's segments are the points of the outer dims, each
        ``run length`` bytes (trailing dims contiguous both on disk and in memory merged)."""
        isz = self.itemsize
        ms = [int(t) for t in mem_strides]
        dims = list(b.counts) + list(b.shape)
        dstr = list(b.gstrides) + list(b.cstrides)
        mstr = [c * t for c, t in zip(self.chunks, ms)] + ms
        keep = [j for j, n in enumerate(dims) if n > 1]
        dims = [dims[j] for j in keep]
        dstr = [dstr[j] for j in keep]
        mstr = [mstr[j] for j in keep]
        run = isz
        while dims and dstr[-1] == run and mstr[-1] == run:
            run *= dims.pop()
            dstr.pop()
            mstr.pop()
        return dims, dstr, mstr, run, sum(w * t for w, t in zip(b.where, ms))

    def _cost(self, region: Region, mem_strides: Sequence[int] | None) -> int:
        """Segments (``mem_strides`` given) or pieces (None) of ``region`` before merging."""
        total = 0
        for b in self.blocks(region):
            dims = b.counts if mem_strides is None else self._seg_plan(b, mem_strides)[0]
            total += math.prod(dims)
        return total

    def ordered_parts(self, region: Region, mem_strides: Sequence[int] | None = None,
                      limit: int = BATCH) -> Iterator[Region]:
        """``region`` (non-empty) cut at chunk boundaries into sub-regions in file order
        (every byte of one comes before every byte of the next) of at most about ``limit``
        segments (for ``mem_strides``) or pieces (None) each, where chunk boundaries allow.

        A run of chunk rows along axis k, every earlier axis inside one chunk, is one
        stretch of the file; a row with too much in it is cut along the next axis."""
        def rec(r: tuple, k: int) -> Iterator[Region]:
            if k == self.ndim:
                yield r
                return
            cost = self._cost(r, mem_strides)
            if cost <= limit:
                yield r
                return
            s, c = r[k], self.chunks[k]
            a, b = s.start // c, (s.stop - 1) // c
            if a == b:
                yield from rec(r, k + 1)
                return
            rows = max(1, limit // max(1, cost // (b - a + 1)))
            for i in range(a, b + 1, rows):
                sub = r[:k] + (slice(max(s.start, i * c), min(s.stop, (i + rows) * c)),) \
                    + r[k + 1:]
                if rows == 1:
                    yield from rec(sub, k + 1)
                elif self._cost(sub, mem_strides) <= limit:
                    yield sub
                else:
                    for j in range(i, min(i + rows, b + 1)):
                        yield from rec(sub[:k] + (slice(max(s.start, j * c),
                                                        min(s.stop, (j + 1) * c)),)
                                       + sub[k + 1:], k + 1)
        if any(s.stop <= s.start for s in region):
            return
        yield from rec(tuple(region), 0)

    def _batch_segments(self, part: Region, rstart: Sequence[int],
                        mem_strides: Sequence[int]) -> tuple[np.ndarray, ...]:
        """Segments of ``part`` (memory offsets relative to ``rstart``), sorted by disk
        offset, not merged."""
        ms = [int(t) for t in mem_strides]
        shift = sum((p.start - r0) * t for p, r0, t in zip(part, rstart, ms))
        ds, mo, ns = [], [], []
        for b in self.blocks(part):
            dims, dstr, mstr, run, m0 = self._seg_plan(b, ms)
            d = np.array([b.first], dtype=np.int64)
            m = np.array([m0 + shift], dtype=np.int64)
            for n, td, tm in zip(dims, dstr, mstr):
                r = np.arange(n, dtype=np.int64)
                d = (d[:, None] + r * td).ravel()
                m = (m[:, None] + r * tm).ravel()
            ds.append(d)
            mo.append(m)
            ns.append(np.full(d.size, run, dtype=np.int64))
        if len(ds) == 1:
            return ds[0], mo[0], ns[0]
        d, m, n = np.concatenate(ds), np.concatenate(mo), np.concatenate(ns)
        order = np.argsort(d, kind="stable")
        return d[order], m[order], n[order]

    def iter_segments(self, region: Region, mem_strides: Sequence[int],
                      limit: int = BATCH) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``segments`` in batches of about ``limit`` (disk offsets, memory offsets,
        lengths), in disk order, merged as ``segments`` merges them (across batches too)."""
        rstart = [s.start for s in region]
        carry = None
        for part in self.ordered_parts(region, mem_strides, limit):
            d, m, n = self._batch_segments(part, rstart, mem_strides)
            if carry is not None:
                d, m, n = (np.concatenate((c, x)) for c, x in zip(carry, (d, m, n)))
            if d.size > 1:
                join = (d[1:] == d[:-1] + n[:-1]) & (m[1:] == m[:-1] + n[:-1])
                if join.any():
                    starts = np.flatnonzero(np.concatenate(([True], ~join)))
                    n = np.add.reduceat(n, starts)
                    d, m = d[starts], m[starts]
            if d.size > 1:
                yield d[:-1], m[:-1], n[:-1]
            carry = (d[-1:], m[-1:], n[-1:])
        if carry is not None:
            yield carry

    # ------------------------------------------------------------ work split
    def split(self, region: Region, task_bytes: int, within_chunks: bool = True) -> list[Region]:
        """Cut ``region`` into sub-regions of about ``task_bytes`` for parallel I/O.

        Cuts fall on chunk boundaries, leading axes first (so runs of chunks that follow
        each other on disk stay together). A single chunk piece larger than twice
        ``task_bytes`` is cut into bands along its first long axis only when
        ``within_chunks`` (stores that write bytes, not whole chunks). A store that plans
        for the whole section gets it beside each sub-region (``PartRead.read_part``).
        """
        if any(s.stop <= s.start for s in region):
            return []
        task_bytes = max(int(task_bytes), self.itemsize)
        out: list[Region] = []
        stack = [tuple(region)]
        while stack:
            r = stack.pop()
            nb = region_nbytes(r, self.itemsize)
            if nb <= task_bytes * 3 // 2:
                out.append(r)
                continue
            for k, (s, c) in enumerate(zip(r, self.chunks)):
                first, last = s.start // c, (s.stop - 1) // c
                if last > first:                         # cut at the middle chunk boundary
                    cut = ((first + last + 1) // 2) * c
                    lo = r[:k] + (slice(s.start, cut),) + r[k + 1:]
                    hi = r[:k] + (slice(cut, s.stop),) + r[k + 1:]
                    stack.append(hi)
                    stack.append(lo)
                    break
            else:
                if not within_chunks:
                    out.append(r)
                    continue
                j = next((j for j, s in enumerate(r) if s.stop - s.start > 1), None)
                if j is None:
                    out.append(r)
                    continue
                s = r[j]
                parts = min(ceil_div(nb, task_bytes), s.stop - s.start)
                step = ceil_div(s.stop - s.start, parts)
                for a in range(s.start, s.stop, step):
                    out.append(r[:j] + (slice(a, min(a + step, s.stop)),) + r[j + 1:])
        out.sort(key=lambda r: tuple(s.start for s in r))
        return out

    # ------------------------------------------------------------ byte runs
    def extents(self, region: Region, limit: int = BATCH) -> tuple[np.ndarray, np.ndarray]:
        """First and end byte (sorted arrays) of the stretches of the file that ``region``
        spans: the byte spans of its pieces, from each piece's first to its last element,
        merged where they are at most ``SIEVE_HOLE`` apart (a read fills such holes)."""
        return self.spans(region, 1, SIEVE_HOLE, limit)

    def spans(self, region: Region, unit: int = 1, hole: int = 0, limit: int = BATCH
              ) -> tuple[np.ndarray, np.ndarray]:
        """First and end (sorted arrays, in ``unit``s of bytes: the first unit a piece
        touches, one past its last) of the stretches the pieces of ``region`` span, merged
        where at most ``hole`` units apart. Planned a batch of pieces at a time."""
        isz = self.itemsize
        if any(s.stop <= s.start for s in region):
            e = np.zeros(0, dtype=np.int64)
            return e, e
        blocks = self.blocks(region)
        if sum(math.prod(b.counts) for b in blocks) <= limit:
            return self.block_spans(blocks, unit, hole)    # one batch: no cutting
        fa, fb = [], []
        carry = None
        for part in self.ordered_parts(region, None, limit):
            firsts, ends = [], []
            for blk in self.blocks(part):
                f = np.array([blk.first], dtype=np.int64)
                for n, t in zip(blk.counts, blk.gstrides):
                    if n > 1:
                        f = (f[:, None] + np.arange(n, dtype=np.int64) * t).ravel()
                firsts.append(f)
                ends.append(f + (sum((n - 1) * t for n, t in zip(blk.shape, blk.cstrides))
                                 + isz))
            a, b = np.concatenate(firsts), np.concatenate(ends)
            if unit > 1:
                a, b = a // unit, -(-b // unit)
            if carry is not None:
                a, b = np.concatenate((carry[0], a)), np.concatenate((carry[1], b))
            order = np.argsort(a, kind="stable")
            a, b = a[order], np.maximum.accumulate(b[order])
            cut = np.flatnonzero(a[1:] > b[:-1] + hole) + 1
            a, b = a[np.concatenate(([0], cut))], b[np.concatenate((cut - 1, [b.size - 1]))]
            fa.append(a[:-1])
            fb.append(b[:-1])
            carry = (a[-1:], b[-1:])
        if carry is None:
            e = np.zeros(0, dtype=np.int64)
            return e, e
        fa.append(carry[0])
        fb.append(carry[1])
        return np.concatenate(fa), np.concatenate(fb)

    def block_spans(self, blocks: Sequence[Block], unit: int, hole: int
                     ) -> tuple[np.ndarray, np.ndarray]:
        """``spans`` of the pieces of ``blocks`` (``blocks(region)``, non-empty) in one
        batch, whatever their number (``spans`` bounds it): a few pieces in plain Python (a
        hot read of a small section pays only this), more with one NumPy pass over the grid
        of each block."""
        isz = self.itemsize
        few: list[tuple[int, int]] = []
        big_a, big_b = [], []
        for blk in blocks:
            length = isz
            for n, t in zip(blk.shape, blk.cstrides):
                length += (n - 1) * t
            if math.prod(blk.counts) <= 8:
                firsts = [blk.first]
                for n, t in zip(blk.counts, blk.gstrides):
                    if n > 1:
                        firsts = [f + j * t for f in firsts for j in range(n)]
                few += [(f // unit, -(-(f + length) // unit)) for f in firsts]
                continue
            f = np.array([blk.first], dtype=np.int64)
            for n, t in zip(blk.counts, blk.gstrides):
                if n > 1:
                    f = (f[:, None] + np.arange(n, dtype=np.int64) * t).ravel()
            big_a.append(f // unit)
            big_b.append(-(-(f + length) // unit))
        if not big_a:
            few.sort()
            out_a, out_b = [few[0][0]], [few[0][1]]
            for lo, hi in few[1:]:
                if lo > out_b[-1] + hole:
                    out_a.append(lo)
                    out_b.append(hi)
                elif hi > out_b[-1]:
                    out_b[-1] = hi
            return np.array(out_a, dtype=np.int64), np.array(out_b, dtype=np.int64)
        if few:
            big_a.append(np.array([x[0] for x in few], dtype=np.int64))
            big_b.append(np.array([x[1] for x in few], dtype=np.int64))
        a, b = np.concatenate(big_a), np.concatenate(big_b)
        order = np.argsort(a, kind="stable")
        a, b = a[order], np.maximum.accumulate(b[order])
        cut = np.flatnonzero(a[1:] > b[:-1] + hole) + 1
        return a[np.concatenate(([0], cut))], b[np.concatenate((cut - 1, [b.size - 1]))]

    def segments(self, region: Region, mem_strides: Sequence[int]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Disk offsets, memory offsets and lengths (bytes) of the contiguous segments.

        ``mem_strides`` are the byte strides of the caller's buffer, which has the region's
        shape; memory offsets are relative to its first element. Segments come in disk
        order; segments adjacent both on disk and in memory are coalesced. (Planned in
        batches, ``iter_segments``: the memory is that of the answer, whatever the number
        of chunks; a whole C-ordered array of tiny chunks is one segment.)
        """
        parts = list(self.iter_segments(region, mem_strides))
        if not parts:
            e = np.zeros(0, dtype=np.int64)
            return e, e, e
        if len(parts) == 1:
            return parts[0]
        d, m, n = (np.concatenate(x) for x in zip(*parts))
        return d, m, n

    def runs(self, region: Region, mem_strides: Sequence[int], max_iov: int = IOV_MAX,
             sieve: int = 0) -> list[tuple[int, list[int], list[int]]]:
        """``(file offset, memory offsets, lengths)`` per vector I/O call, in disk order.

        Each call moves one contiguous byte range of the file (at most ``max_iov`` vectors).
        With ``sieve`` > 0 (reads only) a hole between two segments is read too, into a
        scratch buffer (memory offset -1), when it is at most ``sieve`` bytes and either at
        most a page or three times the smaller neighbour, or the pages only the hole covers
        are at most three times the pages the smaller neighbour touches (the device reads
        whole pages, and read-ahead those of a short hole anyway): one call then replaces
        many small ones. ``iter_runs`` gives the same calls in batches.
        """
        return [r for batch in self.iter_runs(region, mem_strides, max_iov, sieve)
                for r in batch]

    def iter_runs(self, region: Region, mem_strides: Sequence[int], max_iov: int = IOV_MAX,
                  sieve: int = 0, limit: int = BATCH
                  ) -> Iterator[list[tuple[int, list[int], list[int]]]]:
        """The calls of ``runs`` as lists of a bounded number of segments each, planned a
        batch of segments at a time (memory bounded whatever the number of chunks)."""
        carry = None                     # segments of the run still open
        for d, m, n in self.iter_segments(region, mem_strides, limit):
            if carry is not None:
                d, m, n = (np.concatenate((c, x)) for c, x in zip(carry, (d, m, n)))
            out, carry = self._runs_of(d, m, n, max_iov, sieve)
            if out:
                yield out
        if carry is not None:
            d, m, n = carry
            yield self._runs_of(d, m, n, max_iov, sieve, close=True)[0]

    @staticmethod
    def _runs_of(d: np.ndarray, m: np.ndarray, n: np.ndarray, max_iov: int, sieve: int,
                 close: bool = False) -> tuple[list, tuple | None]:
        """Calls of the segments ``d, m, n`` (disk order) and, unless ``close``, the
        entries of the last run that the next batch may continue: its whole calls of
        ``max_iov`` vectors go out now, the rest (1 to ``max_iov`` entries, the last one a
        segment) is kept, so the calls are those of one plan of all segments."""
        if d.size > 1:
            hole = d[1:] - d[:-1] - n[:-1]
            if sieve > 0:
                lim = np.minimum(sieve, np.maximum(PAGE, 3 * np.minimum(n[:-1], n[1:])))
                inner = np.maximum(0, d[1:] // PAGE - -(-(d[:-1] + n[:-1]) // PAGE))
                touched = np.minimum((d[:-1] + n[:-1] - 1) // PAGE - d[:-1] // PAGE,
                                     (d[1:] + n[1:] - 1) // PAGE - d[1:] // PAGE) + 1
                join = (hole <= lim) | ((hole <= sieve) & (inner <= 3 * touched))
            else:
                join = hole == 0
        else:
            hole, join = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
        starts = np.concatenate(([True], ~join))
        fill = np.flatnonzero(join & (hole > 0))
        if fill.size:
            key = np.concatenate((2 * np.arange(d.size), 2 * fill + 1))
            order = np.argsort(key, kind="stable")
            d = np.concatenate((d, d[fill] + n[fill]))[order]
            m = np.concatenate((m, np.full(fill.size, -1, dtype=np.int64)))[order]
            n = np.concatenate((n, hole[fill]))[order]
            starts = np.concatenate((starts, np.zeros(fill.size, dtype=bool)))[order]
        bl = np.flatnonzero(starts).tolist() + [d.size]
        carry = None
        end = d.size
        if not close:
            a = bl[-2]                                  # the last run starts here
            end = a + (d.size - a - 1) // max_iov * max_iov
            carry = (d[end:], m[end:], n[end:])
            bl = bl[:-1] + ([end] if end > a else [])
        dl, ml, nl = d[:end].tolist(), m[:end].tolist(), n[:end].tolist()
        out = []
        for a, b in zip(bl[:-1], bl[1:]):
            for s_ in range(a, b, max_iov):
                e = min(s_ + max_iov, b)
                out.append((dl[s_], ml[s_:e], nl[s_:e]))
        return out, carry


def block_bounds(n: int, parts: int, index: int, unit: int = 1) -> tuple[int, int]:
    """``[lo, hi)`` of share ``index`` when ``n`` items (in blocks of ``unit``) go to ``parts``.

    Shares differ by at most one block; the first ``blocks % parts`` shares get the extra one.
    """
    blocks = ceil_div(n, unit) if n else 0
    q, r = divmod(blocks, parts)
    lo = index * q + min(index, r)
    hi = lo + q + (1 if index < r else 0)
    return min(lo * unit, n), min(hi * unit, n)


# ---------------------------------------------------------------- growth (resizable arrays)

def capacity(shape: Sequence[int], chunks: Sequence[int],
             maxshape: Sequence[int | None] | None = None) -> tuple[int, ...]:
    """The shape the chunk grid of an array is laid out for: ``shape`` for a fixed array
    (``maxshape`` None); for a resizable one, axis 0 rounded up to whole chunk rows (at
    most ``maxshape[0]``) and every other axis at its ``maxshape``. Growing or shrinking
    axis 0 then adds or drops whole chunk rows at the end of the file, and the other
    axes already have their room: no chunk of the array ever moves (``Layout`` of the
    capacity gives every chunk's offset; regions stay inside the logical shape)."""
    if maxshape is None:
        return tuple(int(n) for n in shape)
    m0 = maxshape[0]
    cap0 = ceil_div(int(shape[0]), int(chunks[0])) * int(chunks[0])
    if m0 is not None:
        cap0 = min(cap0, int(m0))
    rest = []
    for n, m in zip(shape[1:], maxshape[1:]):
        if m is None:
            raise ValueError(f"axis of size {n} is unlimited: only axis 0 of a raw chunk grid "
                             f"can grow without limit")
        rest.append(int(m))
    return (cap0, *rest)


def stale_regions(old: Sequence[int], new: Sequence[int], kept: Sequence[int]) -> list[Region]:
    """Regions of an array of shape ``old`` outside shape ``new`` whose bytes a store
    keeps after shrinking (``kept[k]``: how far along axis ``k`` it keeps them: the
    capacity, or the end of the last chunk it keeps). A store zeroes them before it
    shrinks, so that elements brought back by a later growth read as zero."""
    out = []
    for k in range(len(old)):
        lo, hi = int(new[k]), min(int(old[k]), int(kept[k]))
        if hi <= lo:
            continue
        box = tuple(slice(lo, hi) if j == k else slice(0, min(int(old[j]), int(kept[j])))
                    for j in range(len(old)))
        if all(s.stop > s.start for s in box):
            out.append(box)
    return out


def zero_regions(write: Callable[[Region, np.ndarray], None], regions: Sequence[Region],
                 chunks: Sequence[int], dtype: np.dtype, limit: int = 16 * MIB) -> None:
    """Write zeros of ``dtype`` into ``regions`` with ``write(region, zeros)``, in pieces
    of about ``limit`` bytes cut on chunk boundaries (bounded memory)."""
    dt = np.dtype(dtype)
    for r in regions:
        lay = Layout([s.stop for s in r], chunks, dt.itemsize)
        for sub in lay.split(r, limit):
            write(sub, np.zeros(region_shape(sub), dt))
