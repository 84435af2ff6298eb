"""Sections of a DiskArray: what ``d[key]`` may be, checked and normalised.

A section is a tuple of step-1 slices and ints (an int drops its axis), ``...`` once, or
fewer entries than axes (the rest whole). Anything else — steps, boolean or integer-array
(fancy) indexing, lists, out-of-range bounds — is a ``SectionError`` that says what was
asked and what to do. Kept apart from the array class, as NumPy-style libraries keep
indexing apart from storage.
"""
from __future__ import annotations

import operator
from typing import Any

import numpy as np

from chemio_py.errors import SectionError

Region = tuple[slice, ...]


def _norm_index(k: Any, n: int, axis: int, key: Any, shape: tuple) -> tuple[slice, bool]:
    """(slice, squeezed) for one entry of a section."""
    if isinstance(k, (np.ndarray, list, np.bool_)):
        kind = "boolean" if np.asarray(k).dtype == bool else "integer-array (fancy)"
        raise SectionError(
            f"section {key!r}: axis {axis} uses {kind} indexing, which DiskArray does not "
            f"do; a section is a tuple of step-1 slices and ints: read the enclosing section "
            f"(e.g. d[a:b]) and apply the index to it in memory")
    if isinstance(k, slice):
        if k.step not in (None, 1):
            raise SectionError(
                f"section {key!r}: axis {axis} has step {k.step!r}; DiskArray moves step-1 "
                f"sections only: read the step-1 section and slice it in memory")
        start, stop = k.start, k.stop
        for v, what in ((start, "start"), (stop, "stop")):
            if v is not None and (isinstance(v, bool) or not hasattr(v, "__index__")):
                raise SectionError(f"section {key!r}: axis {axis} {what} {v!r} is not an int")
        start = 0 if start is None else operator.index(start)
        stop = n if stop is None else operator.index(stop)
        if start < 0:
            start += n
        if stop < 0:
            stop += n
        if not 0 <= start <= stop <= n:
            raise SectionError(
                f"section {key!r}: axis {axis} asks for [{k.start}:{k.stop}] but the array "
                f"has {n} elements there (shape {shape}); use 0 <= start <= stop <= {n}")
        return slice(start, stop), False
    if isinstance(k, bool) or not hasattr(k, "__index__"):
        raise SectionError(
            f"section {key!r}: axis {axis} entry {k!r} ({type(k).__name__}) is not a slice or "
            f"int; a section is a tuple of step-1 slices and ints, e.g. np.s_[0:10, 5]")
    i = operator.index(k)
    if not -n <= i < n:
        raise SectionError(f"section {key!r}: index {i} is out of range for axis {axis} of "
                           f"length {n} (shape {shape})")
    i %= n
    return slice(i, i + 1), True


def parse_section(key: Any, shape: tuple[int, ...]) -> tuple[Region, tuple[bool, ...]]:
    """``key`` as (region of step-1 slices, which axes an int index drops)."""
    if type(key) is tuple and len(key) == len(shape):
        # the usual key of a section call: step-1 slices with bounds inside the shape
        region = []
        for k, n in zip(key, shape):
            if type(k) is not slice or k.step is not None:
                break
            a, b = k.start, k.stop
            a = 0 if a is None else a
            b = n if b is None else b
            if type(a) is not int or type(b) is not int or not 0 <= a <= b <= n:
                break
            region.append(slice(a, b))
        else:
            return tuple(region), (False,) * len(shape)
    items = key if isinstance(key, tuple) else (key,)
    if isinstance(key, list):
        raise SectionError(f"section {key!r} is a list (fancy indexing); use a tuple of "
                           f"step-1 slices and ints (np.s_[...])")
    n_ell = sum(1 for k in items if k is Ellipsis)
    if n_ell > 1:
        raise SectionError(f"section {key!r} has more than one '...'")
    if n_ell:
        i = next(j for j, k in enumerate(items) if k is Ellipsis)
        fill = len(shape) - (len(items) - 1)
        if fill < 0:
            raise SectionError(f"section {key!r} has {len(items) - 1} entries for a "
                               f"{len(shape)}-d array of shape {shape}")
        items = items[:i] + (slice(None),) * fill + items[i + 1:]
    if len(items) > len(shape):
        raise SectionError(f"section {key!r} has {len(items)} entries for a {len(shape)}-d "
                           f"array of shape {shape}")
    items = tuple(items) + (slice(None),) * (len(shape) - len(items))
    region, squeeze = [], []
    for axis, (k, n) in enumerate(zip(items, shape)):
        s, sq = _norm_index(k, n, axis, key, shape)
        region.append(s)
        squeeze.append(sq)
    return tuple(region), tuple(squeeze)


def expand(a: np.ndarray, squeeze: tuple[bool, ...]) -> np.ndarray:
    """View ``a`` (section shape without int-indexed axes) with those axes put back."""
    axes = tuple(i for i, s in enumerate(squeeze) if s)
    return np.expand_dims(a, axes) if axes else a
