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
from typing import Iterator, Sequence

import numpy as np

MIB = 1 << 20
CHUNK_MIN = 1 * MIB           # a default or hint-grown chunk is at least this ...
CHUNK_MAX = 4 * MIB           # ... and a default chunk at most this (when the array allows)
PAGE = 4096
SIEVE_HOLE = 64 << 10         # largest hole a read fills through a scratch buffer
try:
    IOV_MAX = max(16, min(1024, os.sysconf("SC_IOV_MAX")))
except (ValueError, OSError, AttributeError):  # pragma: no cover
    IOV_MAX = 1024

Region = tuple  # tuple of slice(start, stop) with step 1, inside the shape


class Part(tuple):
    """A region cut from a larger one by ``Layout.split``: a plain region (tuple of slices)
    that also knows the region it was cut from, ``whole``, so that a store moving one part
    can plan for the whole request (e.g. where its contiguous byte ranges end)."""

    whole: Region

    def __new__(cls, region: Region, whole: Region) -> "Part":
        part = super().__new__(cls, region)
        part.whole = tuple(whole)
        return part

    def __reduce__(self) -> tuple:
        return Part, (tuple(self), self.whole)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------- chunk shapes

def clip_chunks(chunks: Sequence[int], shape: Sequence[int]) -> tuple[int, ...]:
    """``chunks`` limited to the shape (each at least 1)."""
    return tuple(max(1, min(int(c), max(int(n), 1))) for c, n in zip(chunks, shape))


def default_chunks(shape: Sequence[int], itemsize: int,
                   max_bytes: int = CHUNK_MAX) -> tuple[int, ...]:
    """Chunks of at most ``max_bytes`` (2–4 MiB by default) and close to square.

    Starts from the whole array and halves its longest chunk dimension (the first one on a
    tie, which keeps the trailing axes whole) until the chunk fits.
    """
    ch = [max(1, int(n)) for n in shape]
    while math.prod(ch) * itemsize > max_bytes:
        k = max(range(len(ch)), key=lambda i: (ch[i], -i))
        if ch[k] == 1:
            break
        ch[k] = _ceil_div(ch[k], 2)
    return tuple(ch)


def hinted_chunks(shape: Sequence[int], itemsize: int, request_shape: Sequence[int | None],
                  min_bytes: int = CHUNK_MIN) -> tuple[int, ...]:
    """Chunks that make a request of shape ``request_shape`` one contiguous byte range.

    The request (each entry clipped to the array; ``None`` means the whole dimension) is
    the chunk; a chunk smaller than ``min_bytes`` is grown by whole requests along the first
    axis, so requests aligned to the request grid stay contiguous bands of a chunk.
    """
    ch = [max(1, min(int(n if r is None else r), max(int(n), 1)))
          for r, n in zip(request_shape, shape)]
    size = math.prod(ch) * itemsize
    if size < min_bytes and shape[0] > ch[0]:
        k = min(_ceil_div(min_bytes, size), _ceil_div(int(shape[0]), ch[0]))
        ch[0] = min(ch[0] * k, int(shape[0]))
    return tuple(ch)


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


class Layout:
    """The fixed chunk grid of an array of ``shape`` and ``itemsize``-byte elements."""

    def __init__(self, shape: Sequence[int], chunks: Sequence[int], itemsize: int):
        self.shape = tuple(int(n) for n in shape)
        self.chunks = tuple(int(c) for c in chunks)
        self.itemsize = int(itemsize)
        if len(self.chunks) != len(self.shape) or min(self.chunks, default=1) < 1:
            raise ValueError(f"chunks {self.chunks} do not fit shape {self.shape}")
        self.ndim = len(self.shape)
        self.grid = tuple(_ceil_div(n, c) for n, c in zip(self.shape, self.chunks))
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
    def _axis_cuts(self, region: Region) -> list[list[tuple[int, int, int]]]:
        """Per axis: (chunk index, lo, hi) of each chunk the region meets."""
        cuts = []
        for s, c in zip(region, self.chunks):
            lo, hi = s.start, s.stop
            cuts.append([(i, max(lo, i * c), min(hi, (i + 1) * c))
                         for i in range(lo // c, _ceil_div(hi, c))])
        return cuts

    def pieces(self, region: Region) -> Iterator[Piece]:
        """The pieces of ``region``, in file order."""
        if any(s.stop <= s.start for s in region):
            return
        for combo in product(*self._axis_cuts(region)):
            index = tuple(t[0] for t in combo)
            yield Piece(index, self.chunk_extent(index), self.chunk_offset(index),
                        tuple(t[1] for t in combo), tuple(t[2] - t[1] for t in combo))

    # ------------------------------------------------------------ work split
    def split(self, region: Region, task_bytes: int, within_chunks: bool = True) -> list[Region]:
        """Cut ``region`` into sub-regions of about ``task_bytes`` for parallel I/O.

        Cuts fall on chunk boundaries, leading axes first (so runs of chunks that follow
        each other on disk stay together). A single chunk piece larger than twice
        ``task_bytes`` is cut into bands along its first long axis only when
        ``within_chunks`` (stores that write bytes, not whole chunks). The sub-regions are
        ``Part``s whose ``whole`` is ``region``.
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
                parts = min(_ceil_div(nb, task_bytes), s.stop - s.start)
                step = _ceil_div(s.stop - s.start, parts)
                for a in range(s.start, s.stop, step):
                    out.append(r[:j] + (slice(a, min(a + step, s.stop)),) + r[j + 1:])
        out.sort(key=lambda r: tuple(s.start for s in r))
        whole = tuple(region)
        return [Part(r, whole) for r in out]

    # ------------------------------------------------------------ byte runs
    def extents(self, region: Region) -> tuple[np.ndarray, np.ndarray]:
        """First and end byte (sorted arrays) of the stretches of the file that ``region``
        spans: the byte spans of its pieces, from each piece's first to its last element,
        merged where they are at most ``SIEVE_HOLE`` apart (a read fills such holes)."""
        isz = self.itemsize
        firsts, ends = [], []
        for p in self.pieces(region):
            st = c_strides(p.extent, isz)
            local = [a - i * c for a, i, c in zip(p.start, p.index, self.chunks)]
            first = p.offset + sum(x * t for x, t in zip(local, st))
            firsts.append(first)
            ends.append(first + sum((n - 1) * t for n, t in zip(p.shape, st)) + isz)
        if not firsts:
            e = np.zeros(0, dtype=np.int64)
            return e, e
        a, b = np.array(firsts, dtype=np.int64), np.array(ends, dtype=np.int64)
        order = np.argsort(a, kind="stable")
        a, b = a[order], np.maximum.accumulate(b[order])
        cut = np.flatnonzero(a[1:] > b[:-1] + SIEVE_HOLE) + 1
        return a[np.concatenate(([0], cut))], b[np.concatenate((cut - 1, [b.size - 1]))]

    def segments(self, region: Region, mem_strides: Sequence[int]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Disk offsets, memory offsets and lengths (bytes) of the contiguous segments.

        ``mem_strides`` are the byte strides of the caller's buffer, which has the region's
        shape; memory offsets are relative to its first element. Segments come in disk
        order; segments adjacent both on disk and in memory are coalesced.
        """
        isz = self.itemsize
        rstart = [s.start for s in region]
        ds, ms, ns = [], [], []
        for p in self.pieces(region):
            dstr = c_strides(p.extent, isz)
            local = [a - i * c for a, i, c in zip(p.start, p.index, self.chunks)]
            a = max(_contiguous_from(p.shape, dstr, isz),
                    _contiguous_from(p.shape, mem_strides, isz))
            d = np.array([p.offset + sum(l * s for l, s in zip(local, dstr))], dtype=np.int64)
            m = np.array([sum((x - r0) * s for x, r0, s in zip(p.start, rstart, mem_strides))],
                         dtype=np.int64)
            for k in range(a):
                if p.shape[k] > 1:
                    r = np.arange(p.shape[k], dtype=np.int64)
                    d = (d[:, None] + r * dstr[k]).ravel()
                    m = (m[:, None] + r * int(mem_strides[k])).ravel()
            ds.append(d)
            ms.append(m)
            ns.append(np.full(d.size, math.prod(p.shape[a:]) * isz, dtype=np.int64))
        if not ds:
            e = np.zeros(0, dtype=np.int64)
            return e, e, e
        d, m, n = (np.concatenate(x) for x in (ds, ms, ns))
        if d.size > 1:
            join = (d[1:] == d[:-1] + n[:-1]) & (m[1:] == m[:-1] + n[:-1])
            if join.any():
                starts = np.flatnonzero(np.concatenate(([True], ~join)))
                n = np.add.reduceat(n, starts)
                d, m = d[starts], m[starts]
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
        many small ones.
        """
        d, m, n = self.segments(region, mem_strides)
        if d.size == 0:
            return []
        hole = d[1:] - d[:-1] - n[:-1]
        if sieve > 0:
            lim = np.minimum(sieve, np.maximum(PAGE, 3 * np.minimum(n[:-1], n[1:])))
            inner = np.maximum(0, d[1:] // PAGE - -(-(d[:-1] + n[:-1]) // PAGE))
            touched = np.minimum((d[:-1] + n[:-1] - 1) // PAGE - d[:-1] // PAGE,
                                 (d[1:] + n[1:] - 1) // PAGE - d[1:] // PAGE) + 1
            join = (hole <= lim) | ((hole <= sieve) & (inner <= 3 * touched))
        else:
            join = hole == 0
        starts = np.concatenate(([True], ~join))
        fill = np.flatnonzero(join & (hole > 0))
        if fill.size:
            key = np.concatenate((2 * np.arange(d.size), 2 * fill + 1))
            order = np.argsort(key, kind="stable")
            d = np.concatenate((d, d[fill] + n[fill]))[order]
            m = np.concatenate((m, np.full(fill.size, -1, dtype=np.int64)))[order]
            n = np.concatenate((n, hole[fill]))[order]
            starts = np.concatenate((starts, np.zeros(fill.size, dtype=bool)))[order]
        bounds = np.concatenate((np.flatnonzero(starts), [d.size])).tolist()
        dl, ml, nl = d.tolist(), m.tolist(), n.tolist()
        out = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            for s in range(a, b, max_iov):
                e = min(s + max_iov, b)
                out.append((dl[s], ml[s:e], nl[s:e]))
        return out


def block_bounds(n: int, parts: int, index: int, unit: int = 1) -> tuple[int, int]:
    """``[lo, hi)`` of share ``index`` when ``n`` items (in blocks of ``unit``) go to ``parts``.

    Shares differ by at most one block; the first ``blocks % parts`` shares get the extra one.
    """
    blocks = _ceil_div(n, unit) if n else 0
    q, r = divmod(blocks, parts)
    lo = index * q + min(index, r)
    hi = lo + q + (1 if index < r else 0)
    return min(lo * unit, n), min(hi * unit, n)
