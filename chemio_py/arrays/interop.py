"""Moving DiskArrays to and from Dask and HDF5 (h5py).

``to_dask`` gives a lazy dask array whose chunks are whole multiples of the disk chunks
(each dask task reads contiguous runs of chunks). ``from_dask`` stores a dask array's blocks
in parallel (split over the ranks under MPI). ``to_hdf5`` / ``from_hdf5`` copy between a
DiskArray and an HDF5 dataset (PySCF-style files) slab by slab, reading the next slab from
the DiskArray while the current one goes through h5py. ``progress=`` (``True``: a
``tqdm`` bar, a callable ``(done_bytes, total_bytes)``, ``False``) reports the bytes moved
(see ``chemio_py.runtime.progress``).
h5py is used from one thread only (its global lock serialises it anyway).

This module sits above ``diskarray`` and imports it; ``DiskArray``'s own ``to_dask``,
``from_hdf5``... import this module when first called. dask and h5py are imported inside
these functions, never at ``import chemio_py``.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import uuid as _uuid
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from chemio_py.arrays import meta as _meta
from chemio_py.arrays.chunks import default_chunks
from chemio_py.arrays.diskarray import DiskArray, block_section
from chemio_py.backends import grid
from chemio_py.errors import ArgumentError
from chemio_py.runtime.comm import resolve as _resolve_comm
from chemio_py.runtime.progress import Progress, check as _check_progress

if TYPE_CHECKING:
    import dask.array
    import xarray

SLAB_BYTES = 64 << 20          # HDF5 copies move slabs of about this size
DASK_CHUNK_BYTES = 64 << 20    # default dask chunk: disk chunks grown to about this size
H5_CHUNK_MAX = (1 << 32) - 1   # HDF5's limit on a chunk's bytes


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

MAX_DASK_BLOCKS = 10_000_000           # tasks of one default to_dask graph, at most


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


def to_dask(d: DiskArray, chunks: Any = None) -> dask.array.Array:
    """A lazy dask array over DiskArray ``d``; ``chunks`` default: whole disk chunks
    grown to about 64 MiB. Tasks read through ``d`` (keep it open while computing), with
    chemio's own read path and its bounds: a hostile object of a ``zarr`` array is the
    ``MetadataError`` that ``d[...]`` raises, never a decompression bomb inflated by
    zarr-python. A graph sent to other processes (the workers of a ``dask.distributed``
    cluster) carries ``d`` pickled: each worker process reopens the array by its path, in
    ``d``'s mode, once while its tasks hold it (``chemio_py.arrays.pickling``; ``shm``
    arrays only on their node)."""
    import dask.array as da
    if chunks is None:
        chunks = dask_chunks(d.chunks, d.shape, d.dtype.itemsize)
        if 0 in d.shape:                    # no element: one block, however long the axes
            chunks = tuple(max(n, 1) for n in d.shape)
        blocks = math.prod(-(-n // c) for n, c in zip(d.shape, chunks))
        if blocks > MAX_DASK_BLOCKS:
            raise ArgumentError(
                f"to_dask of DiskArray {d.name!r} (shape {d.shape}) with chunks {chunks} "
                f"would make {blocks} dask tasks, more than {MAX_DASK_BLOCKS} that dask's "
                f"scheduler can hold; pass larger chunks=")
    # Read through chemio even where others could read the store without it (``zarr``):
    # zarr-python's decoders are not bounded. Sent to other processes (a dask cluster), the
    # graph carries ``d`` pickled: the way to reopen it (``chemio_py.arrays.pickling``).
    name = f"diskarray-{d.name}-{_uuid.uuid4().hex[:12]}"
    return da.from_array(d, chunks=chunks, name=name, lock=False, fancy=False,
                         meta=np.empty((0,) * d.ndim, dtype=d.dtype))


def to_xarray(d: DiskArray, dims: Any = None, coords: Any = None, *, name: str | None = None,
              attrs: dict | None = None, chunks: Any = None) -> xarray.DataArray:
    """A lazily loaded ``xarray.DataArray`` over ``to_dask(d)``: nothing is read until it
    is computed. ``dims`` names the axes (default ``dim_0``, ``dim_1``, ...); ``coords`` and
    ``attrs`` are passed to ``xarray.DataArray``; ``name`` defaults to the array's name.
    Needs xarray (``pip install xarray``)."""
    try:
        import xarray as xr
    except ImportError:
        raise ImportError("DiskArray.to_xarray needs xarray: pip install xarray") from None
    if dims is None:
        dims = tuple(f"dim_{k}" for k in range(d.ndim))
    elif isinstance(dims, str) or len(dims) != d.ndim:
        raise ArgumentError(f"dims {dims!r} must name each of the {d.ndim} axes of "
                            f"DiskArray {d.name!r} (shape {d.shape}), e.g. "
                            f"{tuple(f'dim_{k}' for k in range(d.ndim))}")
    info = {"chemio_backend": d.backend, "chemio_path": d.path, **(attrs or {})}
    return xr.DataArray(to_dask(d, chunks=chunks), dims=tuple(dims), coords=coords,
                        name=d.name if name is None else name, attrs=info)


def _block_regions(chunks: tuple[tuple[int, ...], ...]) -> list[tuple[slice, ...]]:
    bounds = [np.concatenate(([0], np.cumsum(c))).tolist() for c in chunks]
    import itertools
    return [tuple(slice(b[i], b[i + 1]) for b, i in zip(bounds, idx))
            for idx in itertools.product(*(range(len(c)) for c in chunks))]


class _Counted:
    """A ``da.store`` target writing into DiskArray ``d`` and counting the bytes stored.

    Pickled (for a distributed scheduler's worker processes) it is ``d`` itself, which
    pickles as the way to reopen it writable (``chemio_py.arrays.pickling``): the bar then
    moves only when the store returns."""

    def __init__(self, d: DiskArray, bar: Progress):
        self.d, self.bar = d, bar
        self.token = _uuid.uuid4().hex

    def __setitem__(self, key: Any, value: Any) -> None:
        self.d[key] = value
        self.bar.update(getattr(value, "nbytes", 0))

    def __reduce__(self) -> Any:
        return (_identity, (self.d,))

    def __dask_tokenize__(self) -> str:
        return self.token


def _identity(x: Any) -> Any:
    return x


def from_dask(x: Any, name: str, *, chunks: Any = None, request_shape: Any = None,
              comm: Any = None, progress: Any = False, **create_kw: Any) -> DiskArray:
    """Store dask array ``x`` in a new DiskArray ``name`` (collective).

    The disk chunks are ``x``'s block shape when its blocks form a regular grid (so every
    block is one contiguous write), unless ``chunks`` or ``request_shape`` say otherwise.
    Blocks are computed and written in parallel by dask's scheduler; under MPI each rank
    stores every ``size``-th block. ``progress`` (see ``chemio_py.runtime.progress``) reports the
    bytes this rank stores. Other keywords go to ``DiskArray.create``.
    """
    import dask.array as da
    _check_progress(progress)
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
                    mine = sum(grid.region_nbytes(r, d.dtype.itemsize) for r in regions)
                    with Progress(progress, mine, f"from_dask {name}") as bar:
                        target: Any = _Counted(d, bar) if bar.active else d
                        da.store([x[r] for r in regions], [target] * len(regions),
                                 regions=regions, lock=False)
                        if bar.done < mine:
                            bar.update(mine - bar.done)
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
    return default_chunks(shape, itemsize)


def _is_group(x: Any) -> bool:
    """An open HDF5-shaped group: h5py's File/Group, chemio's H5TmpFile/Group."""
    return all(hasattr(x, a) for a in ("create_dataset", "keys", "__getitem__"))


def _is_dataset(x: Any) -> bool:
    """An open HDF5-shaped dataset: h5py's Dataset, chemio's (H5TmpFile) Dataset."""
    return not _is_group(x) and all(hasattr(x, a) for a in ("read_direct", "shape", "dtype"))


def _label(h5file: Any) -> str:
    if isinstance(h5file, (str, os.PathLike)):
        return repr(str(h5file))
    name = getattr(getattr(h5file, "file", None), "filename", None) or getattr(h5file, "name", "")
    return f"<{type(h5file).__name__} {name}>"


@contextlib.contextmanager
def _h5_group(h5file: Any, mode: str) -> Iterator[Any]:
    """``h5file`` as an open group: a path is opened with h5py (and closed after); an open
    h5py File/Group or chemio H5TmpFile/Group is used as it is and left open."""
    if isinstance(h5file, (str, os.PathLike)):
        import h5py
        with h5py.File(h5file, mode) as f:
            yield f
        return
    if not _is_group(h5file):
        raise ArgumentError(f"expected an HDF5 file path, an open h5py.File/Group or a "
                            f"chemio H5TmpFile/Group, got {type(h5file).__name__}")
    if mode != "r" and getattr(getattr(h5file, "file", h5file), "mode", "r+") == "r":
        raise ArgumentError(f"{_label(h5file)} is open read-only; open it with 'r+' or 'a' "
                            f"to write a dataset into it")
    yield h5file


@contextlib.contextmanager
def _h5_dataset(h5file: Any, dataset: str | None) -> Iterator[Any]:
    """The dataset to read: ``h5file[dataset]`` of a path or an open group, or ``h5file``
    itself when it is an open dataset (then ``dataset`` is None)."""
    if _is_dataset(h5file):
        if dataset not in (None, ""):
            raise ArgumentError(f"{_label(h5file)} is a dataset already; leave dataset= out "
                                f"(got {dataset!r})")
        yield h5file
        return
    if not isinstance(dataset, str) or not dataset.strip("/"):
        raise ArgumentError(f"dataset must name a dataset of {_label(h5file)}, like 'eri' or "
                            f"'scf/mo_coeff', got {dataset!r}")
    with _h5_group(h5file, "r") as f:
        ds = f[dataset] if dataset in f else None
        if ds is None or not _is_dataset(ds):
            raise ArgumentError(f"HDF5 file {_label(h5file)} has no dataset {dataset!r}; "
                                f"its top-level names: {sorted(f.keys())[:20]}")
        yield ds


def to_hdf5(d: DiskArray, path: Any, dataset: str, *, overwrite: bool = False,
            compression: Any = None, progress: Any = False, mode: str = "a",
            slab_bytes: int = SLAB_BYTES) -> None:
    """Copy DiskArray ``d`` into dataset ``dataset`` of HDF5 file ``path`` — a path, an
    open h5py File/Group, or a chemio ``H5TmpFile``/``Group`` (left open) — (collective:
    rank 0 writes, the others wait). The dataset is chunked like ``d``; ``compression``
    goes to h5py. An existing dataset is replaced only with ``overwrite=True``. The next
    slab is read from disk while the current one is written to HDF5. ``progress``: see
    ``chemio_py.runtime.progress`` (bytes copied)."""
    _check_progress(progress)
    c = d.comm
    with c.agree(f"DiskArray {d.name!r} to_hdf5({_label(path)}, {dataset!r})"):
        if c.rank == 0:
            _to_hdf5(d, path, dataset, overwrite, compression, progress, mode, slab_bytes)


def _to_hdf5(d: DiskArray, path: Any, dataset: str, overwrite: bool, compression: Any,
             progress: Any, mode: str, slab_bytes: int) -> None:
    import h5py
    if not isinstance(dataset, str) or not dataset.strip("/"):
        raise ArgumentError(f"dataset must be a non-empty name like 'eri' or 'scf/mo_coeff', "
                            f"got {dataset!r}")
    chemio_target = not isinstance(path, (str, os.PathLike)) and \
        not type(path).__module__.startswith("h5py")
    if not chemio_target:
        try:                            # before the file is touched
            h5py.h5t.py_create(d.dtype, logical=True)
        except TypeError:
            raise ArgumentError(
                f"HDF5 has no type for dtype {d.dtype} of DiskArray {d.name!r} (h5py stores "
                f"numbers, S/V bytes and structured records, not U text or "
                f"datetime64/timedelta64): convert it first (U to S bytes, times to int64); "
                f"nothing was written") from None
    with _h5_group(path, mode) as f:
        if dataset in f:
            if not overwrite:
                raise ArgumentError(f"HDF5 file {_label(path)} already has {dataset!r}; pass "
                                    f"overwrite=True to replace it or choose another name")
            del f[dataset]
        ds = f.create_dataset(dataset, shape=d.shape, dtype=d.dtype,
                              chunks=_h5_chunks(d.chunks, d.shape, d.dtype.itemsize),
                              compression=compression)
        ds.attrs["chemio_py.chunks"] = list(d.chunks)
        with Progress(progress, d.nbytes, f"to_hdf5 {dataset}") as bar:
            if d.size == 0:
                bar.update(0)
                return
            _copy_to_h5(d, ds, bar, slab_bytes)


def _copy_to_h5(d: DiskArray, ds: Any, bar: Progress, slab_bytes: int) -> None:
    slabs = _slabs(d.shape, 0, d.shape[0], d.chunks[0], d.dtype.itemsize, slab_bytes)
    bufs = [np.empty(grid.region_shape(slabs[0]), d.dtype) for _ in range(2)]

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


def from_hdf5(h5file: Any, dataset: str | None = None, name: str | None = None, *,
              chunks: Any = None,
              request_shape: Any = None, progress: Any = False, comm: Any = None,
              slab_bytes: int = SLAB_BYTES, **create_kw: Any) -> DiskArray:
    """A new DiskArray holding dataset ``dataset`` of HDF5 file ``h5file`` (collective).

    ``h5file`` is a path, an open h5py File/Group or chemio ``H5TmpFile``/``Group`` (left
    open; each rank passes its own handle), or an open dataset itself (h5py's, or one of an
    ``H5TmpFile``; then ``dataset`` is left out).

    ``name`` defaults to the dataset's name with unusual characters replaced. Each rank
    copies its block of rows (``block_section``); h5py reads of the next slab and the
    DiskArray writes of the previous one overlap. Other keywords go to ``DiskArray.create``
    (``path=``, ``persistent=``, ``backend=``...). ``progress`` (see ``chemio_py.runtime.progress``)
    reports rank 0's share of the bytes.
    """
    _check_progress(progress)
    c = _resolve_comm(comm)
    what = f"DiskArray.from_hdf5({_label(h5file)}, {dataset!r})"
    info: Any = None
    with c.agree(what):
        if c.rank == 0:
            with _h5_dataset(h5file, dataset) as ds:
                label = dataset or str(getattr(ds, "name", "") or "dataset")
                dt = _meta.check_dtype(ds.dtype, f"HDF5 dataset {label!r} dtype")
                info = (tuple(ds.shape), dt, label)
    if c.size > 1:
        info = c.bcast(info)
    shape, dstr, label = info
    if len(shape) == 0:
        raise ArgumentError(f"HDF5 dataset {label!r} is a scalar; DiskArrays have >= 1 axis")
    d = DiskArray.create(name or _default_name(label), shape, dstr, chunks=chunks,
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


def _from_hdf5(d: DiskArray, h5file: Any, dataset: str | None, mine: tuple, progress: Any,
               slab_bytes: int) -> None:
    lo, hi = mine[0].start, mine[0].stop
    if hi <= lo:
        return
    slabs = _slabs(d.shape, lo, hi, d.chunks[0], d.dtype.itemsize, slab_bytes)
    bufs = [np.empty(grid.region_shape(slabs[0]), d.dtype) for _ in range(2)]
    total = sum(grid.region_nbytes(s, d.dtype.itemsize) for s in slabs)
    req, prev = None, 0
    with Progress(progress, total, f"from_hdf5 {dataset or 'dataset'}") as bar, \
            _h5_dataset(h5file, dataset) as ds:
        for i, s in enumerate(slabs):
            buf = bufs[i % 2][: s[0].stop - s[0].start]
            ds.read_direct(buf, source_sel=s)
            if req is not None:
                req.wait()          # the previous slab is on disk: its buffer is next
                bar.update(prev)
            req = d.awrite(s, buf)
            prev = buf.nbytes
        if req is not None:
            req.wait()
            bar.update(prev)

