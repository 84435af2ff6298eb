"""Per-rank cost of the collective write plans at P = 1k, 4k, 16k ranks, on one core (issue 21).

Every ``DiskArray.write_all`` checks that the ranks' sections are disjoint
(``diskarray._check_disjoint``), and the ``zarr`` backend's ``write_all`` plans which rank
writes each storage object (``zarr_exchange.contested_objects``, then ``exchange`` with its
``schedule``). Both run on every rank with the boxes of all ranks, so their per-rank time and
memory decide whether a write scales to 10k ranks. This benchmark runs the real functions as
rank 0 and as the middle rank of P ranks through ``FakeComm``: a ``chemio_py.runtime.comm.Comm``
whose ``allgather`` returns what the other ranks would send (unpickled one by one, as
mpi4py does), whose ``allreduce`` combines with the value the other ranks would bring, and
whose ``mpi.Alltoallv`` moves nothing (the exchange then stores nothing: ``store_object`` is
a no-op, so only the plan's own bookkeeping is measured, not data movement).

Patterns (boxes of all P ranks, 2-d arrays):

* ``block-1d``: 64 rows each along axis 0 (``block_section``), chunks ``(64, 256)``: aligned,
  no object contested;
* ``grid-2d``: a near-square process grid of 48x48 blocks, chunks ``(48, 48)``: aligned;
* ``contested-1d``: 10 rows each, chunks ``(16, 256)``: every object is shared by 2-3
  neighbours;
* ``contested-2d``: process grid of 40x40 blocks, chunks ``(32, 32)``: the objects on the
  block edges are shared by 2-4 ranks.

Rows: CPU seconds per call (median; best and wall time in the note) and peak extra memory
per call (tracemalloc, a separate run), new against the old all-pairs algorithms (kept here
verbatim as the baseline, run up to P = 4k: at 16k the old check needs ~1 GiB per rank and
the old plan minutes). ``allgather floor`` is what unpickling the P gathered boxes costs
alone (paid by any algorithm with this payload). The growth rows compare the best CPU time
at the largest P with the smallest (best over the calls of both ranks: both do the same
work, and on a shared machine the best is the least disturbed) against
(P1/P0)·log(P1)/log(P0), 22.4 from 1k to 16k: target at most that, i.e. no worse than
P log P.

Run alone: ``python benchmarks/bench_collective.py [--full]``.
"""
from __future__ import annotations

import itertools
import math
import os
import pickle
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import peak_mib, row  # noqa: E402

from chemio_py.arrays import diskarray  # noqa: E402
from chemio_py.backends.zarr import exchange as X  # noqa: E402
from chemio_py.runtime.comm import Comm  # noqa: E402
from chemio_py.errors import SectionError  # noqa: E402

FULL = {"procs": (1024, 4096, 16384), "old_up_to": 4096, "repeat": 5}
QUICK = {"procs": (256, 1024), "old_up_to": 256, "repeat": 3}
PATTERNS = ("block-1d", "grid-2d", "contested-1d", "contested-2d")
NO_PAIR = None      # what FakeComm's others_reduce returns when the other ranks add nothing


# ------------------------------------------------------------------ the fake communicator

class _NoTransfer:
    """``Alltoallv`` that moves no byte: the exchange's plan runs, its data does not."""

    def Alltoallv(self, send: Any, recv: Any) -> None:
        pass


class FakeComm(Comm):
    """Rank ``rank`` of ``size`` ranks that exist only as the values they would send:
    ``others_payload(k)`` is what rank ``k`` passes to ``allgather``; ``others_reduce(op)``
    is the combination of the other ranks' ``allreduce`` values (None: they add nothing)."""

    def __init__(self, rank: int, size: int, others_payload: Callable[[int], Any],
                 others_reduce: Callable[[str], Any] = lambda op: NO_PAIR):
        self.rank, self.size = rank, size
        self._blobs = [pickle.dumps(others_payload(k), 5) for k in range(size)]
        self._others_reduce = others_reduce
        self.mpi = _NoTransfer()

    def allgather(self, obj: Any) -> list:
        self._blobs[self.rank] = pickle.dumps(obj, 5)
        return [pickle.loads(b) for b in self._blobs]

    def allreduce(self, value: Any, op: str = "sum") -> Any:
        other = self._others_reduce(op)
        if other is None:
            return value
        return {"min": min, "max": max, "sum": lambda a, b: a + b}[op](value, other)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        pass


# ------------------------------------------------------------------ the patterns

def _grid(p: int) -> tuple[int, int]:
    q0 = int(math.isqrt(p))
    while p % q0:
        q0 -= 1
    return q0, p // q0


def pattern(name: str, p: int) -> tuple[tuple, tuple, list]:
    """``(shape, chunks, boxes)``: the array, its storage objects and every rank's box
    ``((lo...), (hi...))``."""
    if name in ("block-1d", "contested-1d"):
        rows, chunks = (64, (64, 256)) if name == "block-1d" else (10, (16, 256))
        shape = (rows * p, 256)
        boxes = [((r * rows, 0), ((r + 1) * rows, 256)) for r in range(p)]
        return shape, chunks, boxes
    side, chunks = (48, (48, 48)) if name == "grid-2d" else (40, (32, 32))
    q0, q1 = _grid(p)
    shape = (q0 * side, q1 * side)
    boxes = []
    for r in range(p):
        i, j = divmod(r, q1)
        boxes.append(((i * side, j * side), ((i + 1) * side, (j + 1) * side)))
    return shape, chunks, boxes


def _region(box: tuple) -> tuple:
    return tuple(slice(lo, hi) for lo, hi in zip(*box))


# ------------------------------------------------------------------ the old algorithms

def old_first_pair(boxes: np.ndarray) -> tuple[int, int] | None:
    """The first overlapping pair of ``boxes`` (P x ndim x (lo, hi)) as the check before
    issue 21 found it: a P x P x ndim broadcast; None when they are disjoint."""
    lo, hi = boxes[:, :, 0], boxes[:, :, 1]
    full = np.asarray((hi > lo).all(axis=1))     # (asarray: numpy's stubs say bool or array)
    meet = ((lo[:, None, :] < hi[None, :, :]) & (lo[None, :, :] < hi[:, None, :])).all(axis=2)
    meet &= full[:, None] & full[None, :]
    np.fill_diagonal(meet, False)
    if not meet.any():
        return None
    i, j = (int(k) for k in np.argwhere(meet)[0])
    return i, j


def old_check_disjoint(c: Comm, region: tuple, what: str) -> None:
    """``diskarray._check_disjoint`` before issue 21: a P x P x ndim broadcast per rank."""
    boxes = np.array(c.allgather([(s.start, s.stop) for s in region]), dtype=np.int64)
    pair = old_first_pair(boxes)
    if pair is not None:
        i, j = pair

        def show(k: int) -> str:
            return "[" + ", ".join(f"{a}:{b}" for a, b in boxes[k]) + "]"
        raise SectionError(f"{what}: the sections of rank {i} {show(i)} and rank {j} {show(j)} "
                           f"overlap; a collective write needs disjoint sections (decide which "
                           f"rank writes the shared part); nothing was written")


def old_contested_objects(boxes: list, chunks: tuple, shape: tuple, itemsize: int,
                          round_bytes: int = X.ROUND_BYTES) -> list:
    """``zarr_exchange.contested_objects`` before issue 21: every pair of ranks compared."""
    cbox = {}
    for r, b in enumerate(boxes):
        if b is not None:
            cbox[r] = (tuple(l // c for l, c in zip(b[0], chunks)),
                       tuple(-(-h // c) for h, c in zip(b[1], chunks)))
    touched: dict[tuple, set] = {}
    ranks = sorted(cbox)
    for i, r in enumerate(ranks):
        for s in ranks[i + 1:]:
            ov = X._overlap(cbox[r], cbox[s])
            if ov is None:
                continue
            for idx in itertools.product(*(range(l, h) for l, h in zip(*ov))):
                touched.setdefault(idx, set()).update((r, s))
    out = []
    cap = X._cap(round_bytes, len(boxes))
    for idx in sorted(touched):
        ob = X.object_box(idx, chunks, shape)
        counts = {r: X._count(X._overlap(ob, boxes[r])) for r in sorted(touched[idx])}
        counts = {r: n for r, n in counts.items() if n}
        if len(counts) < 2:
            continue
        owner = max(counts, key=lambda r: (counts[r], -r))
        senders = [r for r in counts if r != owner]
        nbytes = {r: counts[r] * itemsize for r in counts}
        total = sum(nbytes[r] for r in senders)
        out.append(X.Contested(idx, owner, senders, nbytes, max(1, -(-total // cap)),
                               sorted(counts)))
    return out


# ------------------------------------------------------------------ measuring

def _timed(fn: Callable[[], Any], repeat: int, budget: float = 1.0) -> tuple[float, ...]:
    """(median CPU, best CPU, median wall) seconds of ``fn()`` over ``repeat`` calls, more
    while they take less than ``budget`` seconds in all. CPU time (``process_time``; all of
    this runs on one thread) is what the call costs the rank; on a machine shared with other
    jobs it moves far less than wall time."""
    cpu: list[float] = []
    wall: list[float] = []
    while len(cpu) < repeat or (sum(wall) < budget and len(cpu) < 200):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(cpu), min(cpu), statistics.median(wall)


def _check_calls(p: int, rank: int, boxes: list) -> dict[str, Callable[[], Any]]:
    """The disjointness check as rank ``rank``: new, old, and the allgather alone."""
    from chemio_py.backends import boxes as B
    region = _region(boxes[rank])
    new = FakeComm(rank, p, lambda k: B.pack(_region(boxes[k])))
    old = FakeComm(rank, p, lambda k: [(lo, hi) for lo, hi in zip(*boxes[k])])
    return {"new": lambda: diskarray._check_disjoint(new, region, "bench"),
            "old": lambda: old_check_disjoint(old, region, "bench"),
            "floor": lambda: new.allgather(B.pack(region))}


def _zarr_calls(p: int, rank: int, shape: tuple, chunks: tuple,
                boxes: list) -> dict[str, Callable[[], Any]]:
    """The zarr write plan as rank ``rank``: ``contested_objects`` new and old, and
    ``exchange`` (schedule + per-round bookkeeping, fake Alltoallv, no store)."""
    region = _region(boxes[rank])
    data = np.zeros([s.stop - s.start for s in region], np.float64)
    comm = FakeComm(rank, p, lambda k: None)
    plan = X.contested_objects(boxes, chunks, shape, 8)

    def exchange() -> None:
        X.exchange(comm, region, data, chunks, shape, boxes, lambda *a: None,
                   lambda fn, *a: fn(*a), lambda batch: None, X.ROUND_BYTES, plan)
    return {"new": lambda: X.contested_objects(boxes, chunks, shape, 8),
            "old": lambda: old_contested_objects(boxes, chunks, shape, 8),
            "exchange": exchange}


def _growth_rows(label: str, best: dict[int, float], procs: tuple) -> list[dict]:
    lo, hi = procs[0], procs[-1]
    bound = hi / lo * math.log(hi) / math.log(lo)
    return [row(f"{label}: growth P={lo}->{hi}", "time ratio", best[hi] / best[lo],
                "P log P growth", bound, target=1.0, lower_is_better=True,
                note=f"best CPU time({hi})/best CPU time({lo}) over both ranks' calls, against "
                     f"{hi // lo}*log({hi})/log({lo})")]


def _time_rows(case: str, new: tuple, old: tuple | None, base: str, note: str) -> dict:
    return row(case, "CPU s per call (median)", new[0], base if old else None,
               old[0] if old else None, lower_is_better=True,
               note=f"best {new[1]:.3g} s, wall {new[2]:.3g} s"
               + (f" (old: best {old[1]:.3g} s, wall {old[2]:.3g} s)" if old else "")
               + f"; {note}")


def _mem_row(case: str, new: float, old: float | None, base: str, note: str = "") -> dict:
    return row(case, "peak MiB per call", new, base if old is not None else None, old,
               lower_is_better=True, note=note or "tracemalloc peak above the start")


def run(quick: bool, workdir: str) -> list[dict]:
    cfg = QUICK if quick else FULL
    procs, repeat = cfg["procs"], cfg["repeat"]
    rows: list[dict] = []
    for name in PATTERNS:
        check_best: dict[int, float] = {}
        plan_best: dict[int, float] = {}
        for p in procs:
            shape, chunks, boxes = pattern(name, p)
            contested = len(X.contested_objects(boxes, chunks, shape, 8))
            old_ok = p <= cfg["old_up_to"]
            old_mem_ok = p <= min(1024, cfg["old_up_to"])
            cnote = f"{contested} contested objects, chunks {chunks}, shape {shape}"
            for rank in (0, p // 2):
                who = f"{name} P={p} rank {rank}"
                c = _check_calls(p, rank, boxes)
                t_new = _timed(c["new"], repeat)
                t_old = _timed(c["old"], 1 if p > 1024 else repeat) if old_ok else None
                t_floor = _timed(c["floor"], repeat)
                check_best[p] = min(check_best.get(p, math.inf), t_new[1])
                case = f"write_all disjointness check, {who}"
                rows.append(_time_rows(case, t_new, t_old, "old P x P check",
                                       f"allgather floor (unpickling P boxes) "
                                       f"{t_floor[0] * 1e3:.2f} ms CPU, included"))
                rows.append(_mem_row(case, peak_mib(c["new"]),
                                     peak_mib(c["old"]) if old_ok else None,
                                     "old P x P check"))
                z = _zarr_calls(p, rank, shape, chunks, boxes)
                t_plan = _timed(z["new"], repeat)
                t_oplan = _timed(z["old"], 1) if old_ok else None
                plan_best[p] = min(plan_best.get(p, math.inf), t_plan[1])
                case = f"zarr contested_objects, {who}"
                rows.append(_time_rows(case, t_plan, t_oplan, "old all-pairs plan", cnote))
                rows.append(_mem_row(case, peak_mib(z["new"]),
                                     peak_mib(z["old"]) if old_mem_ok else None,
                                     "old all-pairs plan"))
                case = f"zarr exchange bookkeeping (no data moved), {who}"
                rows.append(_time_rows(case, _timed(z["exchange"], repeat), None, "", cnote))
                rows.append(_mem_row(case, peak_mib(z["exchange"]), None, ""))
        rows += _growth_rows(f"disjointness check {name}", check_best, procs)
        rows += _growth_rows(f"zarr contested_objects {name}", plan_best, procs)
    return rows


if __name__ == "__main__":
    import json
    for r in run("--full" not in sys.argv, ""):
        print(json.dumps(r))
