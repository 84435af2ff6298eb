"""NumPy's indexing for DiskArray: what ``d[key]`` and ``d.oindex[key]`` select, and how to
move it.

``parse`` turns a key into a ``Selection``: one *pick* per array axis, in request order — an
``int`` (the axis is dropped), a ``range`` (a slice: any step, clipped as NumPy clips) or an
int64 array (a list, an integer array or a boolean mask of that axis) — plus where ``None``
(newaxis) puts length-1 axes. Two flavours:

* ``d[key]`` (NumPy/h5py): slices, ints, ``...``, ``None``, and at most one integer list or
  boolean mask. With one array, orthogonal and NumPy's fancy indexing agree, including
  NumPy's rule that the array's axis goes first when ints and the array are not adjacent.
  Two or more arrays mean NumPy's broadcast (point) indexing: refused, with ``d.oindex``
  named as the way.
* ``d.oindex[key]`` (zarr's orthogonal indexing): any number of per-axis arrays/masks, each
  selecting along its own axis.

``plan`` cuts a selection into step-1 boxes to move, so a stepped or listed read moves only
the chunks it needs, in coalesced runs, and never the whole array: for writes each box is
exactly the selected elements (runs of consecutive indices; nothing else is touched), for
reads a box may read through small gaps (a byte-addressable store) or whole chunks (a
chunked store) and the selected elements are picked from it in memory.
"""
from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass
from typing import Any, Iterator, Union

import numpy as np

from chemio_py.errors import SectionError

Pick = Union[int, range, np.ndarray]

GAP_BYTES = 256 << 10     # a byte-addressable read reads through gaps up to this size (about
#                           what copying costs against moving one more box)
BOX_BYTES = 16 << 20      # temporary memory of one batch of boxes of a read


class IndexOutOfBounds(SectionError, IndexError):
    """An integer index outside the axis (an ``IndexError`` as in NumPy, and a
    ``SectionError``)."""


@dataclass(frozen=True)
class Selection:
    """What a key selects: ``picks`` per array axis, and how the result is shaped.

    The *core* of a selection has one axis per array axis (length 1 for an int pick), in
    pick order; the result is the core reshaped to ``shape`` (int axes dropped, newaxis
    put in), with axis ``front`` moved to the front when NumPy's mixed-index rule says so.
    """
    picks: tuple[Pick, ...]
    shape: tuple[int, ...]
    front: int | None = None

    @property
    def core_shape(self) -> tuple[int, ...]:
        return tuple(1 if isinstance(p, int) else len(p) for p in self.picks)

    @property
    def scalar(self) -> bool:
        """Every axis an int and no newaxis: NumPy returns a scalar."""
        return not self.shape and all(isinstance(p, int) for p in self.picks)

    def region(self) -> tuple[slice, ...] | None:
        """The step-1 region when every pick is an int or a step-1 range, else None."""
        out = []
        for p in self.picks:
            if isinstance(p, int):
                out.append(slice(p, p + 1))
            elif isinstance(p, range) and (p.step == 1 or len(p) <= 1):
                lo = p.start if len(p) else 0
                out.append(slice(lo, lo + len(p)))
            else:
                return None
        return tuple(out)

    def shape_result(self, core: np.ndarray) -> Any:
        """The core (in pick order) as NumPy would return it."""
        out = core.reshape(self.pre_move_shape())
        if self.front is not None:
            out = np.moveaxis(out, self.front, 0)
        if self.scalar:
            return out[()]
        return out

    def pre_move_shape(self) -> tuple[int, ...]:
        if self.front is None:
            return self.shape
        s = list(self.shape)
        s.insert(self.front, s.pop(0))
        return tuple(s)

    def core_value(self, value: np.ndarray) -> np.ndarray:
        """A value already broadcast to ``shape`` as an array of ``core_shape``."""
        if self.front is not None:
            value = np.moveaxis(value, 0, self.front)
        return value.reshape(self.core_shape)


# ---------------------------------------------------------------- parsing

def _bad(key: Any, text: str) -> SectionError:
    return SectionError(f"index {key!r}: {text}")


def _slice_pick(k: slice, n: int, axis: int, key: Any) -> range:
    for v, what in ((k.start, "start"), (k.stop, "stop"), (k.step, "step")):
        if v is not None and (isinstance(v, bool) or not hasattr(v, "__index__")):
            raise _bad(key, f"axis {axis} slice {what} {v!r} is not an int")
    if k.step is not None and operator.index(k.step) == 0:
        raise _bad(key, f"axis {axis} has slice step 0")
    return range(*k.indices(n))


def _int_pick(k: Any, n: int, axis: int, key: Any) -> int:
    i = operator.index(k)
    if not -n <= i < n:
        raise IndexOutOfBounds(f"index {key!r}: index {i} is out of bounds for axis {axis} "
                               f"with size {n}")
    return i % n


def _array_pick(k: Any, n: int, axis: int, key: Any) -> np.ndarray:
    a = np.asarray(k)
    if a.dtype == bool:
        if a.shape != (n,):
            raise _bad(key, f"axis {axis}: a boolean mask must have the axis' length {n}, "
                            f"got shape {a.shape} (a mask of several axes is not taken: read "
                            f"the section and mask it in memory)")
        return np.flatnonzero(a)
    if a.size == 0 and a.dtype.kind not in "iu":
        a = a.astype(np.int64)
    if a.dtype.kind not in "iu" or a.ndim != 1:
        raise _bad(key, f"axis {axis}: an index array must be 1-d integers or a boolean "
                        f"mask, got dtype {a.dtype} and shape {a.shape}")
    a = a.astype(np.int64)
    if a.size and (a.min() < -n or a.max() >= n):
        bad = a[(a < -n) | (a >= n)][0]
        raise IndexOutOfBounds(f"index {key!r}: index {int(bad)} is out of bounds for axis "
                               f"{axis} with size {n}")
    return np.where(a < 0, a + n, a)


def _is_array(k: Any) -> bool:
    return isinstance(k, (list, np.ndarray)) and not (isinstance(k, np.ndarray) and k.ndim == 0
                                                      and k.dtype != bool)


def _plain(key: Any, shape: tuple[int, ...]) -> Selection | None:
    """The common key — plain ints and slices of ints, no more than the axes — parsed
    quickly; None for anything else (``parse`` then checks it in full)."""
    items = key if type(key) is tuple else (key,)
    if len(items) > len(shape):
        return None
    picks: list[Pick] = []
    out: list[int] = []
    for k, n in zip(items, shape):
        t = type(k)
        if t is slice:
            if k.step == 0 or not all(v is None or type(v) is int
                                      for v in (k.start, k.stop, k.step)):
                return None
            r = range(*k.indices(n))
            picks.append(r)
            out.append(len(r))
        elif t is int and -n <= k < n:
            picks.append(k % n)
        else:
            return None
    for n in shape[len(items):]:
        picks.append(range(n))
        out.append(n)
    return Selection(tuple(picks), tuple(out))


def parse(key: Any, shape: tuple[int, ...], *, orthogonal: bool = False) -> Selection:
    """``key`` against ``shape`` as a ``Selection`` (``SectionError`` if it is not an index)."""
    fast = _plain(key, shape)
    if fast is not None:
        return fast
    items = key if isinstance(key, tuple) else (key,)
    if any(isinstance(k, (bool, np.bool_)) or (isinstance(k, np.ndarray) and k.ndim == 0
                                               and k.dtype == bool) for k in items):
        raise _bad(key, "a bare True/False is not taken (NumPy would add an axis and mask "
                        "it); index with slices, ints, lists or per-axis masks")
    n_ell = sum(1 for k in items if k is Ellipsis)
    if n_ell > 1:
        raise _bad(key, "more than one '...'")
    n_axes = sum(1 for k in items if k is not None and k is not Ellipsis)
    if n_axes > len(shape):
        raise _bad(key, f"too many indices ({n_axes}) for a {len(shape)}-d array of shape "
                        f"{shape}")
    fill = (slice(None),) * (len(shape) - n_axes)
    if n_ell:
        i = next(j for j, k in enumerate(items) if k is Ellipsis)
        items = items[:i] + fill + items[i + 1:]
    else:
        items = tuple(items) + fill
    picks: list[Pick] = []
    out: list[int] = []
    kinds: list[str] = []                     # per entry: "new", "int", "slice", "array"
    axis = 0
    for k in items:
        if k is None:
            out.append(1)
            kinds.append("new")
            continue
        n = shape[axis]
        p: Pick
        if isinstance(k, slice):
            r = _slice_pick(k, n, axis, key)
            out.append(len(r))
            p = r
            kinds.append("slice")
        elif _is_array(k):
            arr = _array_pick(k, n, axis, key)
            out.append(len(arr))
            p = arr
            kinds.append("array")
        elif hasattr(k, "__index__"):
            p = _int_pick(k, n, axis, key)
            kinds.append("int")
        else:
            raise _bad(key, f"axis {axis} entry {k!r} ({type(k).__name__}) is not a slice, "
                            f"int, list, integer array or boolean mask")
        picks.append(p)
        axis += 1
    front = None
    arrays = [j for j, kd in enumerate(kinds) if kd == "array"]
    if arrays and not orthogonal:
        if len(arrays) > 1:
            raise _bad(key, "two or more index arrays mean NumPy's broadcast (point) "
                            "indexing, which DiskArray does not do; for one selection per "
                            "axis (h5py's and zarr's orthogonal meaning) use d.oindex[...]")
        adv = [j for j, kd in enumerate(kinds) if kd in ("array", "int")]
        if adv != list(range(adv[0], adv[-1] + 1)):        # NumPy: the array axis first
            front = sum(1 for kd in kinds[:arrays[0]] if kd != "int")
            if front == 0:
                front = None
    sel = Selection(tuple(picks), tuple(out), None)
    if front is not None:
        s = list(sel.shape)
        s.insert(0, s.pop(front))
        sel = Selection(sel.picks, tuple(s), front)
    return sel


def compose(base: tuple[Pick, ...], sel: Selection) -> Selection:
    """``sel`` (a selection over the non-int axes of picks ``base``) as a selection over
    the array ``base`` was taken from (views of views)."""
    it = iter(sel.picks)
    picks: list[Pick] = []
    for b in base:
        if isinstance(b, int):
            picks.append(b)
            continue
        p = next(it)
        if isinstance(p, int):
            picks.append(int(b[p]))
        elif isinstance(b, range) and isinstance(p, range):
            picks.append(_range_of_range(b, p))
        else:
            seq = np.arange(b.start, b.stop, b.step, dtype=np.int64) \
                if isinstance(b, range) else b
            idx = np.arange(p.start, p.stop, p.step, dtype=np.int64) \
                if isinstance(p, range) else p
            picks.append(seq[idx])
    return Selection(tuple(picks), sel.shape, sel.front)


def _range_of_range(b: range, p: range) -> range:
    if not len(p):
        return range(0)
    step = b.step * p.step
    last = b[p[-1]]
    return range(b[p[0]], last + (1 if step > 0 else -1), step)


def full_picks(shape: tuple[int, ...]) -> tuple[Pick, ...]:
    return tuple(range(n) for n in shape)


# ---------------------------------------------------------------- planning

@dataclass(frozen=True)
class Axis:
    """One axis of a selection, sorted: ``u`` the distinct indices in increasing order,
    ``order`` how the request's order is made from them (None: the same; "flip":
    reversed; an array: positions in ``u``, for unsorted lists and repeats)."""
    u: Any                    # range (step > 0) or sorted int64 array
    order: Any


def sort_pick(p: Pick) -> Axis:
    if isinstance(p, int):
        return Axis(range(p, p + 1), None)
    if isinstance(p, range):
        if len(p) <= 1:
            return Axis(range(p[0], p[0] + 1) if len(p) else range(0), None)
        if p.step > 0:
            return Axis(p, None)
        return Axis(p[::-1], "flip")
    if p.size == 0 or np.all(p[1:] > p[:-1]):
        return Axis(p, None)
    u, inv = np.unique(p, return_inverse=True)
    return Axis(u, inv)


def repeats(p: Pick) -> bool:
    return isinstance(p, np.ndarray) and p.size > 1 and np.unique(p).size != p.size


def order_core(core: np.ndarray, axes: list[Axis]) -> np.ndarray:
    """The sorted core (axes of ``u``) in request order."""
    for a, ax in enumerate(axes):
        if ax.order is None:
            continue
        if isinstance(ax.order, str):
            core = np.flip(core, a)
        else:
            core = np.take(core, ax.order, axis=a)
    return core


def sort_value(value: np.ndarray, picks: tuple[Pick, ...], axes: list[Axis]) -> np.ndarray:
    """A value in request order (``core_shape``) in sorted order (no repeats)."""
    for a, (p, ax) in enumerate(zip(picks, axes)):
        if ax.order is None:
            continue
        if isinstance(ax.order, str):
            value = np.flip(value, a)
        else:
            value = np.take(value, np.argsort(p, kind="stable"), axis=a)
    return value


def _runs(u: Any, join: Any) -> list[tuple[int, int]]:
    """Positions [p0, p1) of ``u`` grouped where ``join(prev, next)`` holds between
    neighbours."""
    if isinstance(u, range):
        if not len(u):
            return []
        if u.step == 1:
            return [(0, len(u))]
        u = np.arange(u.start, u.stop, u.step, dtype=np.int64)
    if not u.size:
        return []
    cut = np.flatnonzero(~join(u[:-1], u[1:])) + 1
    edges = np.concatenate(([0], cut, [u.size]))
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


@dataclass(frozen=True)
class Span:
    """Positions [p0, p1) of an axis' ``u``, moved as elements [lo, hi) of the array."""
    p0: int
    p1: int
    lo: int
    hi: int


def _spans(u: Any, runs: list[tuple[int, int]]) -> list[Span]:
    return [Span(p0, p1, int(u[p0]), int(u[p1 - 1]) + 1) for p0, p1 in runs]


def axis_spans(u: Any, chunk: int, inner_bytes: int, write: bool,
               byte_addressable: bool) -> list[Span]:
    """How one axis is moved: exact runs for writes; for reads, runs that read through
    small gaps (byte-addressable) or whole chunks between untouched ones (chunked)."""
    if write:
        join = lambda a, b: b - a == 1                       # noqa: E731
    elif byte_addressable:
        gap = max(1, GAP_BYTES // max(1, inner_bytes))
        join = lambda a, b: b - a <= gap                     # noqa: E731
    else:
        join = lambda a, b: b // chunk - a // chunk <= 1     # noqa: E731
    return _spans(u, _runs(u, join))


def _extent(u: Any) -> int:
    return int(u[-1]) - int(u[0]) + 1 if len(u) else 0


def _split(spans: list[Span], u: Any, limit: int) -> list[Span]:
    """Spans cut so that none reaches over more than ``limit`` elements."""
    out = []
    for s in spans:
        if s.hi - s.lo <= limit:
            out.append(s)
            continue
        p = s.p0
        while p < s.p1:
            lo = int(u[p])
            if isinstance(u, range):
                q = min(s.p1, p + max(1, (limit - 1) // u.step + 1))
            else:
                q = p + int(np.searchsorted(u[p:s.p1], lo + limit, "left"))
                q = max(q, p + 1)
            out.append(Span(p, q, lo, int(u[q - 1]) + 1))
            p = q
    return out


def plan(axes: list[Axis], chunks: tuple[int, ...], itemsize: int, write: bool,
         byte_addressable: bool) -> list[list[Span]]:
    """The spans per axis; every combination (one span per axis) is a box to move."""
    ext = [_extent(ax.u) for ax in axes]
    out = []
    budget_axis = None
    for a, ax in enumerate(axes):
        inner = itemsize * math.prod(ext[a + 1:])
        spans = axis_spans(ax.u, chunks[a], inner, write, byte_addressable)
        if budget_axis is None and not write and inner <= BOX_BYTES:
            budget_axis = a
            spans = _split(spans, ax.u, max(1, BOX_BYTES // max(1, inner)))
        elif budget_axis is None and not write:
            spans = _split(spans, ax.u, 1)                 # one index per box here
        out.append(spans)
    return out


def boxes(spans: list[list[Span]]) -> Iterator[tuple[Span, ...]]:
    """Every box of a plan, the last axis fastest."""
    if any(not s for s in spans):
        return iter(())
    return itertools.product(*spans)


def local_index(u: Any, span: Span) -> Any:
    """Where the selected elements of ``span`` lie inside ``[lo, hi)``: a slice when they
    are evenly spaced, else an int64 array."""
    if isinstance(u, range):
        return slice(u[span.p0] - span.lo, u[span.p1 - 1] - span.lo + 1, u.step)
    sel = u[span.p0:span.p1] - span.lo
    if sel.size == 1:
        return slice(int(sel[0]), int(sel[0]) + 1)
    d = np.diff(sel)
    if np.all(d == d[0]) and d[0] > 0:
        return slice(int(sel[0]), int(sel[-1]) + 1, int(d[0]))
    return sel
