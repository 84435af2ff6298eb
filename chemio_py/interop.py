"""Moving DiskArrays to and from Dask and HDF5 (h5py).

``to_dask`` gives a lazy dask array whose chunks are whole multiples of the disk chunks
(each dask task reads contiguous runs of chunks). ``from_dask`` stores a dask array's blocks
in parallel (split over the ranks under MPI). ``to_hdf5`` / ``from_hdf5`` copy between a
DiskArray and an HDF5 dataset (PySCF-style files) slab by slab, reading the next slab from
the DiskArray while the current one goes through h5py, with an optional progress bar.
h5py is used from one thread only (its global lock serialises it anyway).

This module sits above ``diskarray`` and imports it; ``DiskArray``'s own ``to_dask``,
``from_hdf5``... import this module when first called. dask and h5py are imported inside
these functions, never at ``import chemio_py``.
"""
from __future__ import annotations

import math
import re
import sys
import time
import uuid as _uuid
from typing import Any

import numpy as np

from . import layout as _layout, meta as _meta
from .comm import resolve as _resolve_comm
from .diskarray import DiskArray, block_section
from .errors import ArgumentError

SLAB_BYTES = 64 << 20          # HDF5 copies move slabs of about this size
DASK_CHUNK_BYTES = 64 << 20    # default dask chunk: disk chunks grown to about this size
H5_CHUNK_MAX = (1 << 32) - 1   # HDF5's limit on a chunk's bytes


# ---------------------------------------------------------------- progress

class Progress:
    """A progress report: ``True`` draws a text bar on stderr, a callable gets
    ``(done_bytes, total_bytes)``, ``False``/``None`` does nothing."""

    def __init__(self, how: Any, total: int, label: str):
        self.how = how
        self.total = max(int(total), 0)
        self.label = label
        self.done = 0
        self.t0 = time.perf_counter()
        self._last = -1.0
        if how and not callable(how) and how is not True:
            raise ArgumentError(f"progress must be True, False or a callable(done, total), "
                                f"got {how!r}")

    def update(self, n: int) -> None:
        self.done += int(n)
        if not self.how:
            return
        if callable(self.how) and self.how is not True:
            self.how(self.done, self.total)
            return
        now = time.perf_counter()
        if now - self._last < 0.2 and self.done < self.total:
            return
        self._last = now
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(30 * frac)
        rate = self.done / max(now - self.t0, 1e-9) / 2**20
        sys.stderr.write(f"\r{self.label} [{bar:<30}] {100 * frac:5.1f}% "
                         f"{self.done / 2**20:.1f}/{self.total / 2**20:.1f} MiB "
                         f"{rate:.0f} MiB/s")
        if self.done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _slabs(shape: tuple, lo: int, hi: int, row_unit: int, itemsize: int,
           slab_bytes: int = SLAB_BYTES) -> list[tuple[slice, ...]]:
    """Sections of rows [lo, hi) of about ``slab_bytes``, in multiples of ``row_unit`` rows."""
    row = math.prod(shape[1:]) * itemsize
    rows = max(1, slab_bytes // max(row, 1))
    if row_unit > 1 and rows >= row_unit:
        rows -= rows % row_unit
    rest = tuple(slice(0, n) for n in shape[1:])
    return [(slice(a, min(a + rows, hi)),) + rest for a in range(lo, hi, rows)]


# ---------------------------------------------------------------- dask

def dask_chunks(chunks: tuple, shape: tuple, itemsize: int,
                target: int = DASK_CHUNK_BYTES) -> tuple[int, ...]:
    """Disk chunks grown by whole multiples, last axis first, to about ``target`` bytes."""
    ch = list(chunks)
    for k in reversed(range(len(ch))):
        other = math.prod(ch[:k] + ch[k + 1:]) * itemsize
        mult = max(1, target // max(other * chunks[k], 1))
        ch[k] = min(chunks[k] * mult, max(shape[k], 1))
        if ch[k] < max(shape[k], 1):
            break
    return tuple(ch)


def to_dask(d: DiskArray, chunks: Any = None) -> Any:
    """A lazy dask array over DiskArray ``d``; ``chunks`` default: whole disk chunks
    grown to about 64 MiB. Tasks read through ``d`` (keep it open while computing), unless
    its store reads without chemio (``as_dask``, e.g. ``zarr``: ``da.from_zarr`` of its
    path, which a dask cluster whose workers only see the path can compute)."""
    import dask.array as da
    if chunks is None:
        chunks = dask_chunks(d.chunks, d.shape, d.dtype.itemsize)
    as_dask = getattr(getattr(d, "_store", None), "as_dask", None)
    if as_dask is not None:
        return as_dask(chunks)
    name = f"diskarray-{d.name}-{_uuid.uuid4().hex[:12]}"
    return da.from_array(d, chunks=chunks, name=name, lock=False, fancy=False,
                         meta=np.empty((0,) * d.ndim, dtype=d.dtype))


def _block_regions(chunks: tuple[tuple[int, ...], ...]) -> list[tuple[slice, ...]]:
    bounds = [np.concatenate(([0], np.cumsum(c))).tolist() for c in chunks]
    import itertools
    return [tuple(slice(b[i], b[i + 1]) for b, i in zip(bounds, idx))
            for idx in itertools.product(*(range(len(c)) for c in chunks))]


def from_dask(x: Any, name: str, *, chunks: Any = None, request_shape: Any = None,
              comm: Any = None, **create_kw: Any) -> DiskArray:
    """Store dask array ``x`` in a new DiskArray ``name`` (collective).

    The disk chunks are ``x``'s block shape when its blocks form a regular grid (so every
    block is one contiguous write), unless ``chunks`` or ``request_shape`` say otherwise.
    Blocks are computed and written in parallel by dask's scheduler; under MPI each rank
    stores every ``size``-th block. Other keywords go to ``DiskArray.create``.
    """
    import dask.array as da
    if not isinstance(x, da.Array):
        x = da.asarray(x)
    if chunks is None and request_shape is None and x.ndim and x.size:
        first = tuple(c[0] for c in x.chunks)
        regular = all(all(n == f for n in c[:-1]) and c[-1] <= f
                      for c, f in zip(x.chunks, first))
        if regular and min(first) > 0:
            chunks = first
    d = DiskArray.create(name, x.shape, x.dtype, chunks=chunks, request_shape=request_shape,
                         comm=comm, **create_kw)
    c = d.comm
    try:
        with c.agree(f"DiskArray.from_dask({name!r})"):
            if x.size:
                regions = _block_regions(x.chunks)[c.rank::c.size]
                if regions:
                    da.store([x[r] for r in regions], [d] * len(regions), regions=regions,
                             lock=False)
    except BaseException:
        d.delete()
        raise
    return d


# ---------------------------------------------------------------- HDF5

def _h5_chunks(chunks: tuple, shape: tuple, itemsize: int) -> tuple | None:
    if 0 in shape:
        return None
    if math.prod(chunks) * itemsize <= H5_CHUNK_MAX:
        return tuple(chunks)
    return _layout.default_chunks(shape, itemsize)


def to_hdf5(d: DiskArray, path: Any, dataset: str, *, overwrite: bool = False,
            compression: Any = None, progress: Any = False, mode: str = "a",
            slab_bytes: int = SLAB_BYTES) -> None:
    """Copy DiskArray ``d`` into dataset ``dataset`` of HDF5 file ``path`` (collective:
    rank 0 writes, the others wait). The dataset is chunked like ``d``; ``compression``
    goes to h5py. An existing dataset is replaced only with ``overwrite=True``. The next
    slab is read from disk while the current one is written to HDF5."""
    c = d.comm
    with c.agree(f"DiskArray {d.name!r} to_hdf5({str(path)!r}, {dataset!r})"):
        if c.rank == 0:
            _to_hdf5(d, path, dataset, overwrite, compression, progress, mode, slab_bytes)


def _to_hdf5(d: DiskArray, path: Any, dataset: str, overwrite: bool, compression: Any,
             progress: Any, mode: str, slab_bytes: int) -> None:
    import h5py
    if not isinstance(dataset, str) or not dataset.strip("/"):
        raise ArgumentError(f"dataset must be a non-empty name like 'eri' or 'scf/mo_coeff', "
                            f"got {dataset!r}")
    with h5py.File(path, mode) as f:
        if dataset in f:
            if not overwrite:
                raise ArgumentError(f"HDF5 file {str(path)!r} already has {dataset!r}; pass "
                                    f"overwrite=True to replace it or choose another name")
            del f[dataset]
        ds = f.create_dataset(dataset, shape=d.shape, dtype=d.dtype,
                              chunks=_h5_chunks(d.chunks, d.shape, d.dtype.itemsize),
                              compression=compression)
        ds.attrs["chemio_py.chunks"] = list(d.chunks)
        bar = Progress(progress, d.nbytes, f"to_hdf5 {dataset}")
        if d.size == 0:
            bar.update(0)
            return
        slabs = _slabs(d.shape, 0, d.shape[0], d.chunks[0], d.dtype.itemsize, slab_bytes)
        bufs = [np.empty(_layout.region_shape(slabs[0]), d.dtype) for _ in range(2)]

        def start(i: int) -> Any:
            s = slabs[i]
            return d.aread(s, bufs[i % 2][: s[0].stop - s[0].start])

        req = start(0)
        for i, s in enumerate(slabs):
            block = req.wait()
            req = start(i + 1) if i + 1 < len(slabs) else None
            ds.write_direct(np.ascontiguousarray(block), dest_sel=s)
            bar.update(block.nbytes)


def _default_name(dataset: str) -> str:
    n = re.sub(r"[^A-Za-z0-9._+-]", "_", dataset.strip("/")).strip(".") or "h5array"
    return re.sub(r"\.\.+", ".", n)[:200]


def from_hdf5(h5file: Any, dataset: str, name: str | None = None, *, chunks: Any = None,
              request_shape: Any = None, progress: Any = False, comm: Any = None,
              slab_bytes: int = SLAB_BYTES, **create_kw: Any) -> DiskArray:
    """A new DiskArray holding dataset ``dataset`` of HDF5 file ``h5file`` (collective).

    ``name`` defaults to the dataset's name with unusual characters replaced. Each rank
    copies its block of rows (``block_section``); h5py reads of the next slab and the
    DiskArray writes of the previous one overlap. Other keywords go to ``DiskArray.create``
    (``path=``, ``persistent=``, ``backend=``...).
    """
    c = _resolve_comm(comm)
    what = f"DiskArray.from_hdf5({str(h5file)!r}, {dataset!r})"
    info = None
    with c.agree(what):
        if c.rank == 0:
            import h5py
            with h5py.File(h5file, "r") as f:
                if dataset not in f or not isinstance(f[dataset], h5py.Dataset):
                    raise ArgumentError(f"HDF5 file {str(h5file)!r} has no dataset {dataset!r}; "
                                        f"its top-level names: {sorted(f.keys())[:20]}")
                ds = f[dataset]
                dt = _meta.check_dtype(ds.dtype, f"HDF5 dataset {dataset!r} dtype")
                info = (tuple(ds.shape), dt.str)
    if c.size > 1:
        info = c.bcast(info)
    shape, dstr = info
    if len(shape) == 0:
        raise ArgumentError(f"HDF5 dataset {dataset!r} is a scalar; DiskArrays have >= 1 axis")
    d = DiskArray.create(name or _default_name(dataset), shape, dstr, chunks=chunks,
                         request_shape=request_shape, comm=c, **create_kw)
    try:
        with c.agree(what):
            if d.size:
                _from_hdf5(d, h5file, dataset, block_section(d.shape, c, 0, chunks=d.chunks),
                           progress if c.rank == 0 else False, slab_bytes)
    except BaseException:
        d.delete()
        raise
    return d


def _from_hdf5(d: DiskArray, h5file: Any, dataset: str, mine: tuple, progress: Any,
               slab_bytes: int) -> None:
    import h5py
    lo, hi = mine[0].start, mine[0].stop
    if hi <= lo:
        return
    slabs = _slabs(d.shape, lo, hi, d.chunks[0], d.dtype.itemsize, slab_bytes)
    bufs = [np.empty(_layout.region_shape(slabs[0]), d.dtype) for _ in range(2)]
    bar = Progress(progress, sum(_layout.region_nbytes(s, d.dtype.itemsize) for s in slabs),
                   f"from_hdf5 {dataset}")
    req = None
    with h5py.File(h5file, "r") as f:
        ds = f[dataset]
        for i, s in enumerate(slabs):
            buf = bufs[i % 2][: s[0].stop - s[0].start]
            ds.read_direct(buf, source_sel=s)
            if req is not None:
                req.wait()          # the previous slab is on disk: its buffer is next
            req = d.awrite(s, buf)
            bar.update(buf.nbytes)
    if req is not None:
        req.wait()

