"""Boxes of an N-d integer index space, and the two questions collective writes ask of them.

A box is a half-open range ``[start, stop)`` per axis. An array of ``n`` boxes is given as
``lo`` and ``hi``, int64 arrays of shape ``(n, ndim)``, or packed as one array of shape
``(n, ndim, 2)`` (``[..., 0]`` the starts, ``[..., 1]`` the stops). A box with
``stop <= start`` on some axis is empty: it holds no point and meets no box.

* ``first_meeting(boxes, me)``: among the pairs ``(i, j)``, ``i < j``, of boxes that share a
  point and of which one is box ``me``, the lowest (``i`` first, then ``j``), as the code
  ``i * n + j``; ``n * n`` when box ``me`` meets no other. O(n·ndim) time and memory. The
  lowest meeting pair of all is the minimum of these codes over ``me``: when every rank asks
  about its own box, one ``allreduce(min)`` gives every rank the same answer.
* ``shared_cells(lo, hi)``: the points covered by two boxes or more, as disjoint cells (boxes)
  each with the list of boxes that cover all of it. Sort and sweep along one axis at a time,
  each time along the axis that leaves the fewest (box, segment covered twice) memberships;
  boxes alone on their segments drop out. The work is O(m log m), m the memberships a sweep
  keeps: O(n) plus the size of the answer for block distributions and process grids (with
  or without contested cells); more only when many boxes' projections overlap on every axis.
  No step compares all pairs.

NumPy and the standard library only; nothing here communicates.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np


def pack(region: Sequence[slice]) -> bytes:
    """The bounds of ``region`` (slices with int start and stop) as bytes for ``unpack``."""
    return np.array([(s.start, s.stop) for s in region], np.int64).tobytes()


def unpack(blobs: Sequence[bytes]) -> np.ndarray:
    """The ``(n, ndim, 2)`` box array of the ``pack``ed regions of ``n`` ranks (one ``ndim``)."""
    return np.frombuffer(b"".join(blobs), np.int64).reshape(len(blobs), -1, 2)


def first_meeting(boxes: np.ndarray, me: int) -> int:
    """The code ``i * n + j`` of the lowest pair ``i < j`` of boxes sharing a point with one
    of them ``me``, or ``n * n`` (see the module docstring). ``boxes``: ``(n, ndim, 2)``."""
    n = len(boxes)
    mine = boxes[me]
    if n < 2 or not (mine[:, 1] > mine[:, 0]).all():
        return n * n
    meet = np.ones(n, bool)
    for (a, b), axis in zip(mine, np.moveaxis(boxes, 1, 0)):
        lo, hi = axis[:, 0], axis[:, 1]
        meet &= (lo < b) & (a < hi) & (hi > lo)
    meet[me] = False
    other = np.flatnonzero(meet)
    if other.size == 0:
        return n * n
    j = int(other[0])
    return min(me, j) * n + max(me, j)


def concat_ranges(start: np.ndarray, count: np.ndarray) -> np.ndarray:
    """``range(start[0], start[0] + count[0])``, then the next, ... as one int64 array."""
    start = np.asarray(start, np.int64)
    count = np.asarray(count, np.int64)
    offset = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    return np.repeat(start, count) + offset


def pair_of(code: int, n: int) -> tuple[int, int] | None:
    """``(i, j)`` of a ``first_meeting`` code, None for ``n * n`` (no pair)."""
    return None if code >= n * n else divmod(int(code), n)


class Cells(NamedTuple):
    """Disjoint boxes ``lo[g]:hi[g]`` (``(G, ndim)`` int64), each covered exactly by the boxes
    ``members[start[g]:start[g + 1]]`` (ascending, at least two)."""

    lo: np.ndarray
    hi: np.ndarray
    start: np.ndarray
    members: np.ndarray


def _no_cells(ndim: int) -> Cells:
    none = np.zeros((0, ndim), np.int64)
    return Cells(none, none.copy(), np.zeros(1, np.int64), np.zeros(0, np.int64))


def shared_cells(lo: np.ndarray, hi: np.ndarray) -> Cells:
    """The points covered by two boxes or more, as ``Cells`` (see the module docstring).

    Every such point lies in exactly one cell, and the cell's members are exactly the boxes
    that hold the point. ``lo``, ``hi``: ``(n, ndim)`` integer arrays."""
    lo = np.asarray(lo, np.int64)
    hi = np.asarray(hi, np.int64)
    ndim = lo.shape[1]
    live = np.flatnonzero((hi > lo).all(axis=1))
    if live.size < 2:
        return _no_cells(ndim)
    group = np.zeros(live.size, np.int64)
    box = live
    cell_lo = np.zeros((1, ndim), np.int64)
    cell_hi = np.zeros((1, ndim), np.int64)
    axes = list(range(ndim))
    while axes:
        sweeps = {}
        for k in axes:
            sweeps[k] = _Sweep(group, lo[box, k], hi[box, k])
            if sweeps[k].memberships == 0:
                return _no_cells(ndim)
        k = min(axes, key=lambda a: sweeps[a].memberships)
        axes.remove(k)
        group, take, parent, seg_lo, seg_hi = sweeps[k].split()
        box = box[take]
        cell_lo, cell_hi = cell_lo[parent], cell_hi[parent]
        cell_lo[:, k], cell_hi[:, k] = seg_lo, seg_hi
    start = np.searchsorted(group, np.arange(len(cell_lo) + 1))
    return Cells(cell_lo, cell_hi, start, box)


def _distinct(values: np.ndarray) -> np.ndarray:
    """The distinct ``values``, ascending (``np.unique`` of NumPy 2.4 hashes int64 and can
    take 100x longer than sorting)."""
    values = np.sort(values)
    return values[np.concatenate(([True], values[1:] != values[:-1]))]


class _Sweep:
    """One axis of ``shared_cells``: memberships ``(group, interval a:e)``, sorted by group,
    cut at every interval end inside its group; ``memberships`` is how many (interval,
    segment covered twice or more) pairs the cut leaves."""

    def __init__(self, group: np.ndarray, a: np.ndarray, e: np.ndarray):
        self.coords = _distinct(np.concatenate((a, e)))
        self.width = len(self.coords) + 1
        ka = group * self.width + np.searchsorted(self.coords, a)
        ke = group * self.width + np.searchsorted(self.coords, e)
        self.keys = _distinct(np.concatenate((ka, ke)))
        ia = np.searchsorted(self.keys, ka)
        ie = np.searchsorted(self.keys, ke)
        nkeys = len(self.keys)
        cover = np.cumsum(np.bincount(ia, minlength=nkeys) - np.bincount(ie, minlength=nkeys))
        self.shared = np.flatnonzero(cover >= 2)
        before = np.zeros(nkeys + 1, np.int64)
        np.cumsum(cover >= 2, out=before[1:])
        self.first = before[ia]
        self.count = before[ie] - self.first
        self.memberships = int(self.count.sum())

    def split(self) -> tuple[np.ndarray, ...]:
        """``(group, take, parent, seg_lo, seg_hi)``: the new memberships (group ids sorted,
        ``take`` indexes the old memberships) and, per new group, its old group and its
        segment of the axis."""
        take = np.repeat(np.arange(len(self.count)), self.count)
        group = concat_ranges(self.first, self.count)
        order = np.argsort(group, kind="stable")
        left, right = self.keys[self.shared], self.keys[self.shared + 1]
        return (group[order], take[order], left // self.width,
                self.coords[left % self.width], self.coords[right % self.width])
