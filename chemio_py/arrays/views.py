"""Windows onto a DiskArray without a copy: ``d.view[key]``, ``d.oindex[key]``, iteration.

An ``ArrayView`` is a DiskArray-like object (shape, dtype, indexing, read/write, asynchronous
requests, ``iter_blocks``, ``to_dask``) over the same storage as the array it was taken
from: reading it reads the array, writing it writes the array, and nothing is copied until
then. A view of a view is a view of the array. A view keeps the array's handle; closing the
array ends its views (they raise as the closed array does).

A *window* (every axis a step-1 range or an int) moves sections straight through the
array's section calls (``aread`` into the caller's buffer, ``aread_direct``); a view with
steps or index lists reads through the array's NumPy indexing (the chunks it needs).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from chemio_py.arrays import indexing as _indexing, sections as _sections
from chemio_py.errors import ArgumentError, SectionError
from chemio_py.runtime import pool, requests

if TYPE_CHECKING:
    import dask.array

    from chemio_py.arrays.diskarray import DiskArray
    from chemio_py.prefetch import Pipeline

ITER_BYTES = 8 << 20          # iteration and ``in`` read blocks of about this size


def _blocks(a: Any) -> Iterator[Any]:
    """``a`` read in blocks of ~``ITER_BYTES`` along its first axis."""
    n = a.shape[0]
    row = a.dtype.itemsize * math.prod(a.shape[1:])
    step = max(1, ITER_BYTES // max(1, row))
    for lo in range(0, n, step):
        yield a[lo:min(n, lo + step)]


def iterate(a: Any) -> Iterator[Any]:
    """The sub-arrays of ``a`` along its first axis, read in blocks of ~``ITER_BYTES``."""
    for block in _blocks(a):
        yield from block


def contains(a: Any, value: Any) -> bool:
    """NumPy's ``value in a``: any element equals ``value``, read in blocks."""
    if a.ndim == 0:
        return False
    return any(np.any(block == value) for block in _blocks(a))


class OIndex:
    """``x.oindex[key]``: one index (slice, int, list, integer array, boolean mask) per
    axis, each selecting along its own axis (zarr's orthogonal indexing); reads and
    writes."""

    def __init__(self, target: Any):
        self._t = target

    def __getitem__(self, key: Any) -> Any:
        return self._t._read_selection(_indexing.parse(key, self._t.shape, orthogonal=True))

    def __setitem__(self, key: Any, value: Any) -> None:
        self._t._write_selection(_indexing.parse(key, self._t.shape, orthogonal=True),
                                 value, key)


class Views:
    """``x.view[key]``: an ``ArrayView`` of what ``x.oindex[key]`` selects (no ``None``)."""

    def __init__(self, target: Any):
        self._t = target

    def __getitem__(self, key: Any) -> "ArrayView":
        t = self._t
        sel = _indexing.parse(key, t.shape, orthogonal=True)
        if len(sel.shape) != sum(1 for p in sel.picks if not isinstance(p, int)):
            raise SectionError(f"view {key!r}: None (newaxis) does not make a view (a view "
                               f"keeps the array's axes); index the view with None instead")
        composed = _indexing.compose(t._picks(), sel)
        return ArrayView(t._root(), composed.picks)


class ArrayView:
    """A lazy window onto a DiskArray (see the module's docstring). Made by
    ``d.view[key]``; pickles as (array, picks)."""

    def __init__(self, base: "DiskArray", picks: tuple):
        self._base = base
        self._p = tuple(picks)
        self._made_for = base.shape
        if len(self._p) != base.ndim:
            raise ArgumentError(f"a view of {base.ndim}-d array needs {base.ndim} picks, "
                                f"got {len(self._p)}")

    def __reduce__(self) -> Any:
        return (ArrayView, (self._base, self._p))

    # ------------------------------------------------------------ description
    @property
    def base(self) -> "DiskArray":
        """The DiskArray this view reads and writes."""
        return self._base

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(len(p) for p in self._p if not isinstance(p, int))

    @property
    def dtype(self) -> np.dtype:
        return self._base.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def chunks(self) -> tuple[int, ...]:
        """The array's chunk extents seen through the view (a step of k shows 1/k)."""
        out = []
        for p, c in zip(self._p, self._base.chunks):
            if isinstance(p, int):
                continue
            step = abs(p.step) if isinstance(p, range) else 1
            out.append(max(1, c // step))
        return tuple(out)

    @property
    def name(self) -> str:
        return f"{self._base.name}[view]"

    @property
    def closed(self) -> bool:
        return self._base.closed

    @property
    def window(self) -> bool:
        """True when every axis is an int or a step-1 range (sections map straight on)."""
        return all(isinstance(p, int) or (isinstance(p, range) and (p.step == 1 or len(p) <= 1))
                   for p in self._p)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d view")
        return self.shape[0]

    def __repr__(self) -> str:
        return (f"<ArrayView of {self._base.name!r} shape={self.shape} dtype={self.dtype} "
                f"{'window' if self.window else 'selection'}>")

    def _picks(self) -> tuple:
        return self._p

    def _root(self) -> "DiskArray":
        return self._base

    # ------------------------------------------------------------ indexing
    def _checked(self) -> tuple:
        """The picks, checked against the array's shape when it changed (``resize``)."""
        shape = self._base.shape
        if shape != self._made_for:
            for a, (p, n) in enumerate(zip(self._p, shape)):
                top = p if isinstance(p, int) else (max(p) if len(p) else -1)
                if top >= n:
                    raise SectionError(
                        f"this view of {self._base.name!r} was taken when the array had "
                        f"shape {self._made_for}; it is now {shape} and the view reaches "
                        f"index {top} of axis {a}: take the view again")
            self._made_for = shape
        return self._p

    def _read_selection(self, sel: _indexing.Selection) -> Any:
        return self._base._read_selection(_indexing.compose(self._checked(), sel))

    def _write_selection(self, sel: _indexing.Selection, value: Any, key: Any) -> None:
        self._base._write_selection(_indexing.compose(self._checked(), sel), value, key)

    def __getitem__(self, key: Any) -> Any:
        return self._read_selection(_indexing.parse(key, self.shape))

    def __setitem__(self, key: Any, value: Any) -> None:
        self._write_selection(_indexing.parse(key, self.shape), value, key)

    @property
    def oindex(self) -> OIndex:
        return OIndex(self)

    @property
    def view(self) -> Views:
        return Views(self)

    def __iter__(self) -> Iterator[Any]:
        return iterate(self)

    def __contains__(self, value: Any) -> bool:
        return contains(self, value)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if copy is False:
            raise ValueError("an ArrayView lives on disk; making a NumPy array of it always "
                             "copies (copy=False cannot be honoured): use np.asarray(v)")
        a = np.asarray(self[...])
        return a if dtype is None else a.astype(dtype, copy=False)

    # ------------------------------------------------------------ sections
    def _section(self, section: Any) -> tuple[tuple, _indexing.Selection]:
        """A strict section of the view as (the array's section when a window, else
        (), the selection on the array)."""
        region, squeeze = _sections.parse_section(section, self.shape)
        it = iter(zip(region, squeeze))
        base_key: list[Any] = []
        picks: list[Any] = []
        for p in self._checked():
            if isinstance(p, int):
                base_key.append(p)
                picks.append(p)
                continue
            s, sq = next(it)
            sub = p[s.start] if sq else p[s.start:s.stop]
            picks.append(int(sub) if sq else sub)
            if sq:
                base_key.append(int(sub))
            elif isinstance(sub, range) and (sub.step == 1 or len(sub) <= 1):
                lo = sub.start if len(sub) else 0
                base_key.append(slice(lo, lo + len(sub)))
            else:
                base_key.append(None)
        shape = tuple(s.stop - s.start for s, sq in zip(region, squeeze) if not sq)
        picks_t = tuple(picks)
        sel = _indexing.Selection(picks_t, shape)
        window = all(k is not None for k in base_key)
        return (tuple(base_key) if window else ()), sel

    def read(self, section: Any = (), out: np.ndarray | None = None) -> np.ndarray:
        """Read a section of the view (exact, as ``DiskArray.read``) into ``out``."""
        key, sel = self._section(section)
        if key:
            return self._base.read(key, out)
        res = np.asarray(self._base._read_selection(sel))
        if out is None:
            return res
        if not isinstance(out, np.ndarray) or out.shape != res.shape or \
                out.dtype != self.dtype or not out.flags.writeable:
            raise ArgumentError(f"out must be a writable array of shape {res.shape} and "
                                f"dtype {self.dtype}")
        out[...] = res
        return out

    def write(self, section: Any, data: Any) -> None:
        """Write ``data`` into a section of the view (as ``DiskArray.write``)."""
        key, sel = self._section(section)
        if key:
            self._base.write(key, data)
        else:
            self._base._write_selection(sel, data, section)

    def aread(self, section: Any, out: np.ndarray | None = None) -> requests.Request:
        """Start reading a section of the view; ``wait()`` returns the array."""
        key, _ = self._section(section)
        if key:
            return self._base.aread(key, out)
        return pool.submit(self.read, section, out)

    def awrite(self, section: Any, data: Any) -> requests.Request:
        """Start writing a section of the view; leave ``data`` alone until it completes."""
        key, _ = self._section(section)
        if key:
            return self._base.awrite(key, data)
        return pool.submit(self.write, section, data)

    def aread_direct(self, section: Any, out: np.ndarray,
                     cached: bool = False) -> requests.Request | None:
        """``DiskArray.aread_direct`` for a window; None (use ``aread``) otherwise."""
        key, _ = self._section(section)
        return self._base.aread_direct(key, out, cached) if key else None

    # ------------------------------------------------------------ pipelines and interop
    def iter_blocks(self, axis: int = 0, size: int | None = None, depth: int = 2,
                    out_dtype: Any = None, *, name: str | None = None,
                    direct: bool | None = None, start: int | None = None,
                    stop: int | None = None) -> "Pipeline":
        """Read the view in blocks along ``axis`` with read-ahead (``DiskArray.iter_blocks``)."""
        from chemio_py.prefetch import iter_blocks
        return iter_blocks(self, axis=axis, size=size, depth=depth, out_dtype=out_dtype,
                           name=name or f"iter_blocks:{self.name}", direct=direct,
                           start=start, stop=stop)

    def to_dask(self, chunks: Any = None) -> "dask.array.Array":
        """The array's ``to_dask()`` with this view's selection applied (lazy)."""
        x = self._base.to_dask(chunks)
        for a in reversed(range(len(self._p))):
            p = self._p[a]
            if isinstance(p, range):
                stop = p.stop if p.stop >= 0 else None
                k: Any = slice(p.start, stop, p.step) if len(p) else slice(0, 0)
            else:
                k = p
            x = x[(slice(None),) * a + (k,)]
        return x
