"""The collective write plans against the all-pairs algorithms they replaced (issue 21).

* ``boxes.first_meeting`` (each rank against all, then a minimum over ranks) names the same
  overlapping pair as the old P x P broadcast of ``diskarray._check_disjoint``;
* ``diskarray._check_disjoint`` run by P threads that really exchange their values raises
  the same ``SectionError`` on every rank, or none;
* ``boxes.shared_cells`` against counting, point by point, the boxes that cover each point;
* ``zarr_exchange.contested_objects`` and ``schedule`` give byte for byte the plan of the
  old pairwise ``contested_objects`` (kept below as the reference model);
* at P = 16k ranks (a communicator that answers for the other ranks) the check and the plan
  stay within a few MiB, where the old check needed about 1 GiB.
"""
from __future__ import annotations

import functools
import os
import sys
import itertools
import operator
import pickle
import threading

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from chemio_py.backends import boxes as B
from chemio_py.backends.zarr import exchange as X
from chemio_py.runtime.comm import Comm
from chemio_py.arrays.diskarray import _check_disjoint
from chemio_py.errors import SectionError
from conftest import REPO

sys.path.insert(0, os.path.join(REPO,
                                "benchmarks"))
from bench_collective import old_contested_objects, old_first_pair  # noqa: E402 - the models
from common import peak_mib  # noqa: E402

PROPERTY = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---------------------------------------------------------------- inputs

@st.composite
def arrays(draw: st.DrawFn) -> tuple[tuple, tuple]:
    """``(shape, chunks)``: 1-d to 4-d, edge chunks, chunks larger than the array."""
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.integers(1, 13)) for _ in range(ndim))
    chunks = tuple(draw(st.integers(1, n + 2)) for n in shape)
    return shape, chunks


@st.composite
def any_boxes(draw: st.DrawFn, shape: tuple, nranks: int) -> list:
    """Boxes inside ``shape`` that may overlap; some empty (``lo == hi`` on an axis)."""
    out = []
    for _ in range(nranks):
        lo, hi = [], []
        for n in shape:
            a = draw(st.integers(0, n))
            lo.append(a)
            hi.append(draw(st.integers(a, n)))
        out.append((tuple(lo), tuple(hi)))
    return out


@st.composite
def disjoint_boxes(draw: st.DrawFn, shape: tuple, nranks: int) -> list:
    """Every rank's box (``None``: empty region) from guillotine cuts of ``shape``; pieces
    left over are holes nobody writes."""
    pieces = [(tuple(0 for _ in shape), tuple(shape))]
    for _ in range(draw(st.integers(0, 2 * nranks))):
        k = draw(st.integers(0, len(pieces) - 1))
        lo, hi = pieces[k]
        axis = draw(st.integers(0, len(shape) - 1))
        if hi[axis] - lo[axis] < 2:
            continue
        cut = draw(st.integers(lo[axis] + 1, hi[axis] - 1))
        pieces[k:k + 1] = [(lo, hi[:axis] + (cut,) + hi[axis + 1:]),
                           (lo[:axis] + (cut,) + lo[axis + 1:], hi)]
    order = draw(st.permutations(range(len(pieces))))
    out: list = [pieces[k] for k in order[:nranks]]
    out += [None] * (nranks - len(out))
    for r in range(nranks):
        if draw(st.integers(0, 5)) == 0:
            out[r] = None
    return draw(st.permutations(out))


def packed(boxes: list) -> np.ndarray:
    return np.array([np.stack([lo, hi], axis=-1) for lo, hi in boxes], np.int64)


# ---------------------------------------------------------------- disjointness

@PROPERTY
@given(st.data())
def test_first_meeting_names_the_pair_the_old_check_named(data):
    shape, _ = data.draw(arrays())
    nranks = data.draw(st.integers(1, 12))
    boxes = packed(data.draw(any_boxes(shape, nranks)))
    n = len(boxes)
    codes = [B.first_meeting(boxes, me) for me in range(n)]
    assert B.pair_of(min(codes), n) == old_first_pair(boxes)
    for me, code in enumerate(codes):          # each rank's answer: its own lowest pair
        pair = B.pair_of(code, n)
        others = [(min(me, j), max(me, j)) for j in range(n) if j != me
                  and old_first_pair(boxes[[min(me, j), max(me, j)]]) is not None]
        assert pair == (min(others) if others else None)


def test_first_meeting_edges():
    empty_meets_nothing = packed([((0, 0), (4, 4)), ((2, 2), (2, 9)), ((1, 1), (3, 3))])
    assert B.pair_of(B.first_meeting(empty_meets_nothing, 1), 3) is None
    assert B.pair_of(B.first_meeting(empty_meets_nothing, 2), 3) == (0, 2)
    touching = packed([((0,), (5,)), ((5,), (9,))])           # half-open: 5 is not shared
    assert B.first_meeting(touching, 0) == B.first_meeting(touching, 1) == 4
    assert B.first_meeting(packed([((0,), (5,))]), 0) == 1
    region = (slice(3, 7), slice(0, 2))
    assert B.unpack([B.pack(region)] * 2).tolist() == [[[3, 7], [0, 2]]] * 2


class _Threads:
    """The shared slots and barrier of a group of ``_ThreadComm`` ranks."""

    def __init__(self, size: int):
        self.slots: list = [None] * size
        self.barrier = threading.Barrier(size, timeout=60)


class _ThreadComm(Comm):
    """Rank ``rank`` of threads of this process: real collectives over shared slots."""

    def __init__(self, group: _Threads, rank: int):
        self.group, self.rank, self.size = group, rank, len(group.slots)

    def allgather(self, obj):
        g = self.group
        g.barrier.wait()
        g.slots[self.rank] = pickle.loads(pickle.dumps(obj))
        g.barrier.wait()
        return list(g.slots)

    def allreduce(self, value, op="sum"):
        combine = {"min": min, "max": max, "sum": operator.add}[op]
        return functools.reduce(combine, self.allgather(value))

    def bcast(self, obj, root=0):
        return self.allgather(obj)[root]

    def barrier(self):
        self.group.barrier.wait()


def _run_check(boxes: list) -> list:
    """What ``_check_disjoint`` did on each of ``len(boxes)`` thread ranks: the message of
    its ``SectionError``, or None."""
    group = _Threads(len(boxes))
    out: list = [None] * len(boxes)

    def rank(r: int) -> None:
        region = tuple(slice(a, b) for a, b in zip(*boxes[r]))
        try:
            _check_disjoint(_ThreadComm(group, r), region, "write_all of 'x'")
            out[r] = None
        except SectionError as e:
            out[r] = str(e)
        except BaseException as e:     # noqa: BLE001 - reported by the test
            out[r] = e
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(boxes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_check_disjoint_raises_the_same_error_on_every_rank(data):
    shape, _ = data.draw(arrays())
    nranks = data.draw(st.integers(2, 8))
    boxes = data.draw(st.one_of(any_boxes(shape, nranks), disjoint_boxes(shape, nranks)))
    boxes = [b if b is not None else ((0,) * len(shape), (0,) * len(shape)) for b in boxes]
    got = _run_check(boxes)
    assert all(isinstance(m, (str, type(None))) for m in got), got
    assert len(set(got)) == 1, got
    pair = old_first_pair(packed(boxes))
    if pair is None:
        assert got[0] is None
    else:
        i, j = pair

        def show(k: int) -> str:
            return "[" + ", ".join(f"{a}:{b}" for a, b in zip(*boxes[k])) + "]"
        assert got[0] == (f"write_all of 'x': the sections of rank {i} {show(i)} and rank {j} "
                          f"{show(j)} overlap; a collective write needs disjoint sections "
                          f"(decide which rank writes the shared part); nothing was written")


# ---------------------------------------------------------------- shared cells

@PROPERTY
@given(st.data())
def test_shared_cells_are_the_points_covered_twice(data):
    shape, _ = data.draw(arrays())
    nranks = data.draw(st.integers(0, 9))
    boxes = data.draw(any_boxes(shape, nranks))
    lo = np.array([b[0] for b in boxes], np.int64).reshape(nranks, len(shape))
    hi = np.array([b[1] for b in boxes], np.int64).reshape(nranks, len(shape))
    cells = B.shared_cells(lo, hi)
    want = {}
    for point in itertools.product(*(range(n) for n in shape)):
        p = np.array(point)
        cover = np.flatnonzero(((lo <= p) & (p < hi)).all(axis=1)).tolist()
        if len(cover) >= 2:
            want[point] = cover
    got = {}
    for g in range(len(cells.lo)):
        members = cells.members[cells.start[g]:cells.start[g + 1]].tolist()
        assert len(members) >= 2 and members == sorted(members)
        for point in itertools.product(*(range(a, b) for a, b in zip(cells.lo[g], cells.hi[g]))):
            assert point not in got, "cells overlap"
            got[tuple(int(x) for x in point)] = members
    assert got == want


# ---------------------------------------------------------------- the zarr plan

def _same_plan(boxes: list, shape: tuple, chunks: tuple, itemsize: int, round_bytes: int):
    new = X.contested_objects(boxes, chunks, shape, itemsize, round_bytes)
    old = old_contested_objects(boxes, chunks, shape, itemsize, round_bytes)
    assert repr(new) == repr(old)
    assert new == old
    nranks = len(boxes)
    assert repr(X.schedule(new, nranks, round_bytes)) == repr(X.schedule(old, nranks,
                                                                         round_bytes))


@PROPERTY
@given(st.data())
def test_zarr_plan_is_the_old_plan_for_disjoint_regions(data):
    shape, chunks = data.draw(arrays())
    nranks = data.draw(st.integers(1, 10))
    boxes = data.draw(disjoint_boxes(shape, nranks))
    itemsize = data.draw(st.sampled_from([1, 8, 16]))
    round_bytes = data.draw(st.sampled_from([1, 40, 1000, X.ROUND_BYTES]))
    _same_plan(boxes, shape, chunks, itemsize, round_bytes)


@PROPERTY
@given(st.data())
def test_zarr_plan_is_the_old_plan_for_any_boxes(data):
    """Overlapping and empty boxes (``write_all`` refuses overlaps before planning, but the
    plan stays the old one)."""
    shape, chunks = data.draw(arrays())
    nranks = data.draw(st.integers(1, 8))
    boxes = data.draw(any_boxes(shape, nranks))
    boxes = [None if data.draw(st.integers(0, 4)) == 0 else b for b in boxes]
    _same_plan(boxes, shape, chunks, 8, data.draw(st.sampled_from([64, X.ROUND_BYTES])))


def test_zarr_plan_many_ranks_in_one_object():
    """200 ranks writing one row each of 8-row objects: 25 objects of 8 touchers each; the
    owner is the lowest rank (all hold the same count)."""
    shape, chunks = (200, 6), (8, 6)
    boxes = [((r, 0), (r + 1, 6)) for r in range(200)]
    plan = X.contested_objects(boxes, chunks, shape, 8)
    assert [o.index for o in plan] == [(k, 0) for k in range(25)]
    assert all(o.touchers == list(range(8 * k, 8 * k + 8)) and o.owner == 8 * k
               for k, o in enumerate(plan))
    _same_plan(boxes, shape, chunks, 8, X.ROUND_BYTES)


def test_zarr_plan_nothing_contested():
    boxes = [((16 * r, 0), (16 * (r + 1), 30)) for r in range(50)] + [None]
    assert X.contested_objects(boxes, (16, 7), (800, 30), 8) == []
    assert X.contested_objects([None, ((0, 0), (3, 3))], (2, 2), (3, 3), 8) == []


# ---------------------------------------------------------------- 16k ranks

class _OthersComm(Comm):
    """Rank ``rank`` of ``size`` ranks whose ``allgather`` contributions are ``gathered``
    and whose ``allreduce(min)`` contributions combine to ``others_min``."""

    def __init__(self, rank: int, gathered: list, others_min: int):
        self.rank, self.size = rank, len(gathered)
        self.gathered, self.others_min = gathered, others_min

    def allgather(self, obj):
        self.gathered[self.rank] = obj
        return self.gathered

    def allreduce(self, value, op="sum"):
        assert op == "min"
        return min(value, self.others_min)


def test_check_disjoint_at_16k_ranks_stays_small():
    """A 2-d process grid of 16,384 ranks: the old check allocated ~1 GiB per rank here."""
    P = 1 << 14
    regions = [(slice(40 * (r // 128), 40 * (r // 128 + 1)), slice(40 * (r % 128),
                                                                  40 * (r % 128 + 1)))
               for r in range(P)]
    gathered = [B.pack(reg) for reg in regions]
    for me in (0, P // 2, P - 1):
        check = functools.partial(_check_disjoint, _OthersComm(me, gathered, P * P),
                                  regions[me], "w")
        assert peak_mib(check) < 8
    # rank 9000 reaches into rank 5's block: every rank names (5, 9000)
    bad = list(regions)
    bad[9000] = (slice(0, 41), slice(200, 210))
    gathered = [B.pack(reg) for reg in bad]
    for me in (0, 5, 9000):
        comm = _OthersComm(me, gathered, 5 * P + 9000)
        try:
            _check_disjoint(comm, bad[me], "w")
        except SectionError as e:
            assert "rank 5 [0:40, 200:240] and rank 9000 [0:41, 200:210] overlap" in str(e)
        else:
            raise AssertionError("no SectionError")


def test_zarr_plan_at_16k_ranks_stays_small():
    P = 1 << 14
    aligned = [((64 * r, 0), (64 * (r + 1), 256)) for r in range(P)]
    assert peak_mib(lambda: X.contested_objects(aligned, (64, 256), (64 * P, 256), 8)) < 8
    plan: list = []
    contested = [((10 * r, 0), (10 * (r + 1), 256)) for r in range(P)]
    peak = peak_mib(lambda: plan.extend(
        X.contested_objects(contested, (16, 256), (10 * P, 256), 8)))
    assert len(plan) == 10 * P // 16        # a multiple of 10 cuts every 16-row object
    assert peak < 64
