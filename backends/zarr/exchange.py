"""Two-phase collective writes for stores that write whole objects (``zarr``).

Every rank brings a box (its region, possibly empty). Objects (chunks of the grid) that
one rank alone touches are that rank's to write. An object touched by several ranks is
*contested*: its owner is the rank holding most of its elements (the lowest rank on a tie),
and the other ranks send it their pieces with ``Alltoallv``. The transfer runs in rounds:
per owner, objects go into rounds of at most ``round_bytes`` received bytes, an object
larger than that is split over consecutive rounds, so memory stays bounded and every count
stays far below 2 GiB. Every rank derives the same plan from the gathered boxes, so no
counts are exchanged; a round in which nobody sends anything is skipped, and a write whose
boxes cut no object apart needs one ``allgather`` only.

The owner then writes each object whole (``store_object(index, pieces)``), reading what
is already stored only where the pieces leave holes.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from chemio_py.backends.boxes import Cells, concat_ranges, shared_cells

ROUND_BYTES = 256 << 20          # received bytes per owner and round (at most)
_COUNT_LIMIT = (1 << 31) - 1


Box = tuple  # (lo tuple, hi tuple); None stands for an empty box


def box_of(region: tuple) -> Box | None:
    if any(s.stop <= s.start for s in region):
        return None
    return tuple(s.start for s in region), tuple(s.stop for s in region)


def _overlap(a: Box, b: Box) -> Box | None:
    lo = tuple(max(x, y) for x, y in zip(a[0], b[0]))
    hi = tuple(min(x, y) for x, y in zip(a[1], b[1]))
    return None if any(h <= l for l, h in zip(lo, hi)) else (lo, hi)


def _count(b: Box | None) -> int:
    return 0 if b is None else math.prod(h - l for l, h in zip(*b))


@dataclass
class Contested:
    index: tuple
    owner: int
    senders: list                   # ranks other than the owner, ascending
    nbytes: dict                    # rank -> bytes of its piece
    parts: int = 1
    touchers: list = field(default_factory=list)


def object_box(index: tuple, chunks: tuple, shape: tuple) -> Box:
    lo = tuple(i * c for i, c in zip(index, chunks))
    return lo, tuple(min(l + c, n) for l, c, n in zip(lo, chunks, shape))


def contested_objects(boxes: list, chunks: tuple, shape: tuple, itemsize: int,
                      round_bytes: int = ROUND_BYTES) -> list[Contested]:
    """The objects touched by more than one rank, in C order of their index, with owners.

    The ranks' ranges of objects go through ``boxes.shared_cells`` (sort and sweep),
    so the work is O(P log P) when no object is contested and grows with the number of
    (rank, contested object) pairs otherwise; no step compares all pairs of ranks."""
    ranks = np.array([r for r, b in enumerate(boxes) if b is not None], np.int64)
    if len(ranks) < 2:
        return []
    chain = itertools.chain.from_iterable
    given = np.fromiter(chain(chain(b) for b in boxes if b is not None), np.int64,
                        count=2 * len(chunks) * len(ranks)).reshape(len(ranks), 2, len(chunks))
    lo, hi = given[:, 0], given[:, 1]
    grid = np.array(chunks, np.int64)
    index, obj, member = _incidences(shared_cells(lo // grid, -(-hi // grid)))
    first = index[obj] * grid
    last = np.minimum(first + grid, np.array(shape, np.int64))
    inside = np.minimum(hi[member], last) - np.maximum(lo[member], first)
    count = np.clip(inside, 0, None).prod(axis=1)
    keep = count > 0
    keep &= np.bincount(obj[keep], minlength=len(index))[obj] >= 2
    obj, rank, count = obj[keep], ranks[member[keep]], count[keep]
    if len(obj) == 0:
        return []
    starts = np.flatnonzero(np.diff(obj, prepend=-1))
    nbytes = count * itemsize
    at_owner = np.lexsort((rank, -count, obj))[starts]
    sent = np.add.reduceat(nbytes, starts) - nbytes[at_owner]
    parts = np.maximum(1, -(-sent // _cap(round_bytes, len(boxes))))
    bounds = starts.tolist() + [len(obj)]
    indices, objs, ranks_l, nbytes_l = index.tolist(), obj.tolist(), rank.tolist(), nbytes.tolist()
    out = []
    for a, b, owner, k in zip(bounds, bounds[1:], rank[at_owner].tolist(), parts.tolist()):
        touchers = ranks_l[a:b]
        out.append(Contested(tuple(indices[objs[a]]), owner, [r for r in touchers if r != owner],
                             dict(zip(touchers, nbytes_l[a:b])), k, touchers))
    return out


def _incidences(cells: Cells) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(index, obj, member)``: the objects of ``cells``, ``(N, ndim)`` in C order, and per
    (object, covering box) pair the object's row in ``index`` and the box, grouped by object,
    boxes ascending."""
    extent = cells.hi - cells.lo
    size = extent.prod(axis=1)
    cell = np.repeat(np.arange(len(size)), size)
    rest = concat_ranges(np.zeros_like(size), size)
    index = np.empty((len(cell), extent.shape[1]), np.int64)
    for k in reversed(range(extent.shape[1])):
        along = extent[cell, k]
        index[:, k] = cells.lo[cell, k] + rest % along
        rest //= along
    if extent.shape[1]:
        order = np.lexsort(index.T[::-1])
        index, cell = index[order], cell[order]
    many = cells.start[cell + 1] - cells.start[cell]
    obj = np.repeat(np.arange(len(cell)), many)
    return index, obj, cells.members[concat_ranges(cells.start[cell], many)]


def _cap(round_bytes: int, nranks: int) -> int:
    """Bytes per owner and round: ``round_bytes``, less when a sender's whole round (to
    every owner) could pass the 2 GiB an MPI count or displacement may hold."""
    return max(1, min(int(round_bytes), _COUNT_LIMIT // max(2, nranks)))


def schedule(objs: list[Contested], nranks: int, round_bytes: int = ROUND_BYTES) -> list[list]:
    """Rounds of ``(object, part)`` items: per owner, items in order, packed greedily up to
    ``round_bytes`` received bytes per round."""
    cap = _cap(round_bytes, nranks)
    per_owner: dict[int, list] = {}
    for o in objs:
        per_owner.setdefault(o.owner, []).append(o)
    rounds: list[list] = []
    for owner in sorted(per_owner):
        r, load = 0, 0
        for o in per_owner[owner]:
            total = sum(o.nbytes[s] for s in o.senders)
            for k in range(o.parts):
                size = total // o.parts + 1
                if load and load + size > cap:
                    r, load = r + 1, 0
                while len(rounds) <= r:
                    rounds.append([])
                rounds[r].append((o, k))
                load += size
    return rounds


def _part(n: int, k: int, parts: int) -> tuple[int, int]:
    return n * k // parts, n * (k + 1) // parts


def exchange(comm: Any, region: tuple, data: np.ndarray, chunks: tuple, shape: tuple,
             boxes: list, store_object: Callable[[tuple, list, bool], None],
             submit: Callable[..., Any], wait_batch: Callable[[list], None],
             round_bytes: int = ROUND_BYTES, objs: list | None = None) -> set:
    """Move the pieces of contested objects to their owners and store them there.

    ``store_object(index, pieces, covered)`` runs (through ``submit``) for each contested
    object this rank owns, with ``pieces`` = [(object-local slices, array)]; ``wait_batch``
    waits for what ``submit`` returned and must not raise (it keeps the errors: a rank that
    left the rounds early would leave the others waiting in ``Alltoallv``). Returns the
    indices of all contested objects (the caller writes the others itself). Every rank
    calls this with the same ``boxes``.
    """
    me = comm.rank
    itemsize = data.dtype.itemsize
    if objs is None:
        objs = contested_objects(boxes, chunks, shape, itemsize, round_bytes)
    if not objs:
        return set()
    from mpi4py import MPI
    mybox = boxes[me]
    rounds = schedule(objs, comm.size, round_bytes)
    nranks = comm.size
    packed: dict[tuple, np.ndarray] = {}
    assembly: dict[tuple, dict] = {}
    inflight: list[list] = []

    def my_piece(o: Contested) -> np.ndarray:
        ov = _overlap(object_box(o.index, chunks, shape), mybox)
        assert ov is not None                   # a toucher's piece is never empty
        rel = tuple(slice(l - s.start, h - s.start) for l, h, s in zip(*ov, region))
        return data[rel]

    for items in rounds:
        send: list[list[Any]] = [[] for _ in range(nranks)]  # per destination: byte views
        recv: list[list[Any]] = [[] for _ in range(nranks)]  # per source: (object, lo, hi)
        for o, k in items:
            if me in o.senders:
                if o.index not in packed:
                    packed[o.index] = np.ascontiguousarray(my_piece(o)).reshape(-1).view(np.uint8)
                lo, hi = _part(o.nbytes[me], k, o.parts)
                send[o.owner].append(packed[o.index][lo:hi])
                if k == o.parts - 1:
                    del packed[o.index]
            if o.owner == me:
                for s in o.senders:
                    lo, hi = _part(o.nbytes[s], k, o.parts)
                    recv[s].append((o, lo, hi))
        scounts = [sum(v.nbytes for v in send[d]) for d in range(nranks)]
        rcounts = [sum(hi - lo for _, lo, hi in recv[s]) for s in range(nranks)]
        sbuf = (np.concatenate(list(itertools.chain.from_iterable(send))) if any(scounts)
                else np.zeros(1, np.uint8))
        rbuf = np.empty(max(1, sum(rcounts)), np.uint8)
        sd = np.concatenate(([0], np.cumsum(scounts)[:-1])).astype(np.int64)
        rd = np.concatenate(([0], np.cumsum(rcounts)[:-1])).astype(np.int64)
        comm.mpi.Alltoallv([sbuf, (scounts, sd.tolist()), MPI.BYTE],
                           [rbuf, (rcounts, rd.tolist()), MPI.BYTE])
        done = []
        for s in range(nranks):
            pos = int(rd[s])
            for o, lo, hi in recv[s]:
                bufs = assembly.setdefault(o.index, {})
                if s not in bufs:
                    bufs[s] = np.empty(o.nbytes[s], np.uint8)
                bufs[s][lo:hi] = rbuf[pos:pos + hi - lo]
                pos += hi - lo
        for o, k in items:
            if o.owner == me and k == o.parts - 1:
                done.append(o)
        batch = []
        for o in done:
            ob = object_box(o.index, chunks, shape)
            pieces = []
            bufs = assembly.pop(o.index, {})
            for s in o.touchers:
                ov = _overlap(ob, boxes[s])
                assert ov is not None           # a toucher's piece is never empty
                local = tuple(slice(l - b, h - b) for l, h, b in zip(*ov, ob[0]))
                if s == me:
                    arr = my_piece(o)
                else:
                    arr = bufs[s].view(data.dtype).reshape(tuple(h - l for l, h in zip(*ov)))
                pieces.append((local, arr))
            covered = sum(_count(_overlap(ob, boxes[s])) for s in o.touchers) == _count(ob)
            batch.append(submit(store_object, o.index, pieces, covered))
        inflight.append(batch)
        if len(inflight) > 2:                       # bound memory: two rounds in flight
            wait_batch(inflight.pop(0))
    for batch in inflight:
        wait_batch(batch)
    return {o.index for o in objs}
