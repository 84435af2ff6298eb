"""Disk Resident Arrays: N-d arrays on disk, moved to and from memory in sections.

    >>> import numpy as np, chemio_py as cio
    >>> d = cio.DiskArray.create("demo", (6, 4), "f8")       # collective; scratch array
    >>> d[1:3, :] = np.ones((2, 4))                            # blocking write of a section
    >>> float(d[0:4, 1].sum())                                 # unwritten elements read 0
    2.0
    >>> d.close()                                              # a scratch array vanishes

A section is a tuple of step-1 slices (or ints, which drop their axis) inside the shape.
Sections become chunk pieces and each piece byte runs (``chemio_py.backends.grid``); the pieces go
to the I/O pool in parallel and the bytes land straight in the caller's array.
``create``/``open``/``close``/``delete``/``read_all``/``write_all`` are collective over the
communicator (``cio.comm()`` unless ``comm=``): a failure on one rank raises on every rank.
Everything else is independent. See DESIGN §3 for the contract.
"""
from __future__ import annotations

import functools
import logging
import math
import operator
import os
import socket
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

import chemio_py.backends as _backends
from chemio_py.arrays import indexing as _indexing, meta as _meta, sections as _sections
from chemio_py.arrays import views as _views
from chemio_py.arrays.chunks import clip_chunks, default_chunks, hinted_chunks
from chemio_py.arrays.checksums import (
    Checksums,
    check_checksum,
    checksum_meta,
    crc_path,
    verify_then_copy,
)
from chemio_py.backends import grid
from chemio_py.errors import (
    ArgumentError,
    ChemIOError,
    MetadataError,
    ModeError,
    NotSharedError,
    SectionError,
)
from chemio_py.runtime import config, pool, reprs, requests, stats
from chemio_py.runtime.collective import Collective, Creation
from chemio_py.runtime.lifecycle import StoreHandle
from chemio_py.runtime.comm import Comm, resolve as _resolve_comm
from chemio_py.scratch import jobs

_log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import dask.array
    import xarray

    from chemio_py.prefetch import Pipeline

SUFFIX = ".dra"
META_SUFFIX = ".json"
TASK_MIN = 4 << 20            # a task of the I/O pool moves at least this much (if there is)
TASK_MAX = 16 << 20           # ... and at most about this much
# An aread this small that the page cache holds is copied inline: the hand-off to an I/O
# thread and the wait measured ~500 us for a hot 785 KB block, the copy here ~130 us.
HOT_INLINE = 2 << 20
LONG_STRETCH = 32 << 20       # a cold read's stretches this long are read as streams...
LONG_STREAMS = 2              # ... this many at once (see DiskArray._long_stretches)


# ---------------------------------------------------------------- sections

def block_section(shape: Sequence[int], comm: Any = None, axis: int = 0, *,
                  chunks: Sequence[int] | None = None) -> tuple[slice, ...]:
    """This rank's share of an array of ``shape``: a block of ``shape[axis]``, GA style.

    Shares are contiguous, in rank order, and differ by at most one row (one chunk when
    ``chunks`` is given: then shares start on chunk boundaries, so no two ranks write the
    same chunk). A rank may get an empty share when there are more ranks than rows.
    """
    c = _resolve_comm(comm)
    shape = _meta.check_shape(shape)
    try:
        ax = operator.index(axis)
    except TypeError:
        raise ArgumentError(f"axis must be an int, got {axis!r}") from None
    if not -len(shape) <= ax < len(shape):
        raise ArgumentError(f"axis {axis} is out of range for shape {shape}")
    ax %= len(shape)
    unit = 1
    if chunks is not None:
        unit = _meta.check_shape(chunks, "chunks")[ax] or 1
    lo, hi = grid.block_bounds(shape[ax], c.size, c.rank, unit)
    return tuple(slice(lo, hi) if k == ax else slice(0, n) for k, n in enumerate(shape))


# ---------------------------------------------------------------- helpers

def _direct(a: np.ndarray) -> bool:
    """True when the store can move bytes straight into/out of ``a`` (rows contiguous)."""
    if a.flags.c_contiguous:
        return True                     # the usual case, without looking at the strides
    isz = a.itemsize
    if any(s < 0 or s % isz for n, s in zip(a.shape, a.strides) if n > 1):
        return False
    for n, s in zip(reversed(a.shape), reversed(a.strides)):
        if n > 1:
            return s == isz
    return True


def _as_values(value: Any, dtype: np.dtype) -> np.ndarray:
    """Python scalars and sequences as an array, by NumPy's rule for Python values: a
    number that does not fit ``dtype`` (300 for int8) is an error, not a wrapped value;
    tuples, strings and dates become records, bytes, text and times of ``dtype``."""
    if dtype.kind in "VSUmM" and not isinstance(value, np.ndarray):
        try:
            return np.asarray(value, dtype=dtype)
        except (TypeError, ValueError) as e:
            raise ArgumentError(f"value {value!r:.80} is not of dtype {dtype} ({e}); nothing "
                                f"was written") from None
    arr = np.asarray(value)
    if arr.dtype.kind in "biufc" and np.can_cast(arr.dtype, dtype, "same_kind"):
        try:
            return np.asarray(value, dtype=dtype)
        except OverflowError as e:
            raise ArgumentError(f"value {value!r} does not fit dtype {dtype} ({e}); nothing "
                                f"was written") from None
    return arr


class _Releaser:
    """What ``cio.cleanup()`` closes at exit: the local handle only, never a collective."""

    __slots__ = ("owner", "__weakref__")

    def __init__(self, owner: "DiskArray"):
        self.owner = owner

    def _release(self) -> BaseException | None:
        return self.owner._release()


def _new_paths(be: Any, name: str, path: Any, keep: bool, inside: bool) -> tuple[str, str]:
    """(data path, metadata path) of a new array; the two are one for a backend that keeps
    its metadata inside its objects (``SelfDescribing``)."""
    suffix = be.suffix if inside else SUFFIX
    if not keep:
        data = os.path.join(jobs.job_dir(be.root("shared")), name + suffix)
        return data, (data if inside else data + META_SUFFIX)
    p = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if os.path.isdir(p) and not (inside and be.recognizes(p)):
        p = os.path.join(p, name + suffix)
    elif p.endswith(META_SUFFIX) and not inside:
        raise ArgumentError(f"path={path!r} ends with {META_SUFFIX!r}, which names the metadata; "
                            f"give the data file path (the metadata goes to <path>{META_SUFFIX})")
    parent = os.path.dirname(p)
    if not os.path.isdir(parent):
        raise ArgumentError(f"path={path!r}: directory {parent!r} does not exist; create it first")
    return p, (p if inside else p + META_SUFFIX)


def _check_options(be: _backends.Backend, be_name: str, options: dict) -> dict:
    """The backend options of a create/open call, if backend ``be`` takes them all."""
    known = _backends.backend_capabilities(be).array_options
    bad = sorted(set(options) - known)
    if bad:
        takes = f"it takes {sorted(known)}" if known else "it takes none"
        raise ArgumentError(f"backend {be_name!r} has no option {', '.join(bad)} ({takes}); "
                            f"remove it or choose a backend that has it")
    return dict(options)



def _attributes(inside: bool, m: _meta.Meta) -> dict:
    """What ``open_array`` gets on creation: the metadata document, for a backend that
    keeps it inside the object."""
    return {"attributes": m.to_doc()} if inside else {}


def _grow_kw(maxshape: tuple | None) -> dict:
    """The ``open_array`` keyword of a resizable array (none for a fixed one)."""
    return {} if maxshape is None else {"maxshape": maxshape}


def _record(be: _backends.Backend, m: _meta.Meta, data: str, mpath: str, keep: bool,
            inside: bool) -> None:
    """After creation on rank 0: write the metadata beside the data (unless the object
    holds it) and hand scratch objects to the job's cleanup."""
    if not keep:
        jobs.own(data, be.remove)
    if not inside:
        crc = crc_path(data)                # the checksums first: never metadata without
        if m.checksum:
            Checksums.make(data, grid.Layout(m.shape, m.chunks, m.dtype.itemsize),
                            0o666 if keep else 0o600)
            if not keep:
                jobs.own(crc)
        elif os.path.lexists(crc):          # those of an array this one replaces
            jobs.disown(crc)
            jobs.remove_path(crc)
        _meta.write_atomic(mpath, _meta.dumps(m), 0o666 if keep else 0o600, durable=keep)
        if not keep:
            jobs.own(mpath)


def _described(be: Any, be_name: str, path: str) -> _meta.Meta:
    """The metadata an array of a ``SelfDescribing`` backend keeps inside its object."""
    return _meta.from_description(be.describe(path), path, be_name,
                                  _backends.array_formats(be)[0])


def _load_meta(be: _backends.Backend, be_name: str, data: str, mpath: str) -> _meta.Meta:
    """The metadata of an array: from inside its object, or from the file beside it."""
    if mpath == data and isinstance(be, _backends.SelfDescribing):
        return _described(be, be_name, data)
    return _meta.load(mpath)


def _check_disjoint(c: Comm, region: tuple, what: str) -> None:
    """Collective: raise the same ``SectionError`` on every rank when the regions of two
    ranks overlap (a collective write has no defined last writer), naming the lowest such
    pair. Per rank O(P·ndim) time and memory: each rank checks its own region against all
    (``boxes.first_meeting``) and one ``allreduce`` shares the lowest pair."""
    from chemio_py.backends import boxes as _boxes
    boxes = _boxes.unpack(c.allgather(_boxes.pack(region)))
    pair = _boxes.pair_of(c.allreduce(_boxes.first_meeting(boxes, c.rank), op="min"), c.size)
    if pair is not None:
        i, j = pair

        def show(k: int) -> str:
            return "[" + ", ".join(f"{a}:{b}" for a, b in boxes[k]) + "]"
        raise SectionError(f"{what}: the sections of rank {i} {show(i)} and rank {j} {show(j)} "
                           f"overlap; a collective write needs disjoint sections (decide which "
                           f"rank writes the shared part); nothing was written")


def _exists_message(data: str, mpath: str) -> str:
    if not os.path.lexists(mpath):
        return (f"a data file without metadata is at {data!r} (left by an interrupted "
                f"DiskArray.create?); pass overwrite=True to replace it, remove it "
                f"(os.remove({data!r})), or choose another path")
    return (f"an array (or file) already exists at {data!r}; pass overwrite=True to replace "
            f"it, delete it with DiskArray.open({data!r}, 'r+').delete(), or choose another "
            f"path")


def _find(path: Any, backend: str | None) -> tuple[str, str, _meta.Meta]:
    """(metadata path, data path, metadata) of the array at ``path`` (rank 0 of an open).

    ``path`` is the data path or its ``.json``; without chemio metadata beside it, a
    self-describing backend (``backend`` if given, else any that recognises it) reads the
    metadata from inside the object."""
    p = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if p.endswith(META_SUFFIX) and not os.path.isdir(p):
        m = _meta.load(p)
        guess = p[:-len(META_SUFFIX)]
        data = guess if os.path.exists(guess) else os.path.join(os.path.dirname(p), m.data)
        return p, data, m
    mpath = p + META_SUFFIX
    if not os.path.lexists(mpath):
        damage: MetadataError | None = None
        for name in ([backend] if backend else
                     _backends.serving(_backends.ArrayBackend)):
            try:
                be = _backends.resolve(name)
            except ChemIOError:
                continue
            if not isinstance(be, _backends.SelfDescribing):
                continue
            if be.recognizes(p):
                return p, p, _described(be, name, p)
            if damage is None and os.path.isdir(p):
                try:                        # its own words on what is wrong inside
                    return p, p, _described(be, name, p)
                except MetadataError as e:
                    damage = e
                except OSError:
                    pass
        if damage is not None:
            raise damage
        if os.path.lexists(p):
            raise MetadataError(
                f"{p!r} has no metadata ({mpath!r} is missing) and no backend that reads "
                f"arrays without it recognises it. An interrupted DiskArray.create leaves "
                f"such a file, but it may also be someone's data: look at it before you "
                f"decide what to do with it")
    return mpath, p, _meta.load(mpath)


def _find_to_open(path: Any, mode: str, backend: str | None, rank: int) -> Any:
    """The first step of ``DiskArray.open``: check ``mode``; on rank 0 find the array."""
    if mode not in ("r", "r+"):
        raise ModeError(f"DiskArray.open mode {mode!r} is not 'r' (read) or 'r+' "
                        f"(read/write); create new arrays with DiskArray.create")
    return _find(path, backend) if rank == 0 else None


def _unmake(be: Any, data: str, mpath: str) -> None:
    """Undo a creation on rank 0: remove the object, its metadata and its checksums."""
    be.remove(data)
    if mpath != data:
        jobs.remove_path(mpath)                 # the user layer wrote the metadata
        jobs.remove_path(crc_path(data))
    for p in {data, mpath, crc_path(data)}:
        jobs.disown(p)


class _Creating(Creation):
    """The creation of one DiskArray, in the steps of ``runtime.collective``: rank 0 makes
    the object and records its metadata (with a fresh uuid) beside or inside it; every
    other rank proves it reads that uuid, then opens the object."""

    def __init__(self, c: Comm, name: str, a: SimpleNamespace):
        what = f"DiskArray.create({name!r})"
        super().__init__(c, what, what)
        self.name = name
        self.a = a                              # the arguments of create
        self.store: Any = None
        self.sums: Checksums | None = None

    def check(self) -> tuple:
        a = self.a
        jobs.validate_name(self.name)
        self.shape = shape = _meta.check_shape(a.shape)
        self.dt = dt = _meta.check_dtype(a.dtype)
        nbytes = math.prod(shape) * dt.itemsize
        if nbytes > _meta.MAX_NBYTES:
            raise ArgumentError(f"shape {shape} of {dt} makes {nbytes} bytes, more "
                                f"than the limit of {_meta.MAX_NBYTES}")
        self.ch = DiskArray._choose_chunks(shape, dt, a.chunks, a.request_shape)
        if a.persistent and a.path is None:
            raise ArgumentError(
                f"DiskArray {self.name!r}: persistent=True needs path= (a directory or file "
                f"where the array stays); scratch arrays need neither")
        self.keep = a.path is not None
        self.be_name = be_name = config.backend_for(self.name, a.backend).value
        self.be = be = _backends.require(_backends.resolve(be_name), be_name,
                                         _backends.ArrayBackend)
        self.vet = _backends.backend_capabilities(be).check_collective  # e.g. shm: one node
        self.opts = _check_options(be, be_name, a.options)
        _log.debug("DiskArray %r: backend %s, chunks %s (%s)", self.name, be_name, self.ch,
                   "given" if a.chunks is not None else
                   f"request_shape hint {tuple(a.request_shape)}"
                   if a.request_shape is not None else "default")
        check_checksum(be, be_name, a.checksum)
        self.together = _backends.is_collective(be)
        self.inside = isinstance(be, _backends.SelfDescribing)
        self.maxshape = self._growable(be, be_name, a, shape, dt)
        return (self.name, shape, dt.str, self.ch, be_name, self.keep,
                repr(sorted(self.opts.items())), a.checksum, self.maxshape)

    def _growable(self, be: Any, be_name: str, a: SimpleNamespace, shape: tuple,
                  dt: np.dtype) -> tuple | None:
        """The checked ``maxshape`` (None: a fixed array); for a resizable array the
        chunks are chosen for it (``growth.chunk_basis``)."""
        from chemio_py.arrays import growth
        grid_layout = _backends.array_formats(be)[0] == "grid"
        ms = growth.check_maxshape(a.maxshape, shape, grid_layout, be_name)
        if ms is None:
            return None
        if not _backends.backend_capabilities(be).resizable_arrays:
            raise ArgumentError(f"backend {be_name!r} cannot resize arrays, so maxshape= is "
                                f"refused; use local, shm, auto, mpiio or zarr")
        if a.checksum:
            raise ArgumentError("checksum=True and maxshape= do not go together: the CRCs "
                                "are kept per chunk of a fixed shape; choose one")
        nbytes = growth.capacity_nbytes(shape, ms, dt.itemsize)
        if nbytes > _meta.MAX_NBYTES:
            raise ArgumentError(f"maxshape {ms} of {dt} makes {nbytes} bytes, more than the "
                                f"limit of {_meta.MAX_NBYTES}")
        self.ch = DiskArray._choose_chunks(growth.chunk_basis(shape, ms, a.chunks), dt,
                                           a.chunks, a.request_shape)
        return ms

    def explain(self, mine: tuple, first: tuple) -> str:
        return (f"rank {self.comm.rank} asked for DiskArray.create{mine[:4]} on backend "
                f"{mine[4]!r} but rank 0 for {first[:4]} on {first[4]!r}; every rank must pass "
                f"the same name, shape, dtype, layout, backend and options")

    def make(self) -> tuple[str, str, _meta.Meta]:
        be, keep, inside = self.be, self.keep, self.inside
        data, mpath = _new_paths(be, self.name, self.a.path, keep, inside)
        if keep:
            if not self.a.overwrite and (be.exists(data) or os.path.lexists(mpath)):
                raise ArgumentError(_exists_message(data, mpath))
            if not inside and os.path.lexists(mpath):
                os.unlink(mpath)                # old metadata first: never half valid
        m = _meta.Meta(name=self.name, shape=self.shape, dtype=self.dt, chunks=self.ch,
                       backend=self.be_name, data=os.path.basename(data), persistent=keep,
                       uuid=os.urandom(16).hex(), created=_meta.creation_info(self.comm.size),
                       layout=_backends.array_formats(be)[0], maxshape=self.maxshape,
                       **(checksum_meta(self.a.checksum) or {"format": _meta.format_for(
                           _backends.array_formats(be)[0], None, self.maxshape)}))
        self.supersede(data, self.what)
        if not self.together:
            self._opened(be.open_array(data, "w+", **self._new(m)), data, mpath, True)
            self.adopt((data, mpath, m))
        return data, mpath, m

    def join(self, made: tuple[str, str, _meta.Meta]) -> None:
        data, mpath, m = made
        self.supersede(data, self.what)
        if not self.together:
            store = DiskArray._open_peer(self.be, self.be_name, data, mpath, m.uuid, self.shape,
                                         self.dt, self.ch, self.comm, self.host0,
                                         {**self.opts, **_grow_kw(m.maxshape)})
            self._opened(store, data, mpath, False)

    def open_together(self, made: tuple[str, str, _meta.Meta]) -> None:
        data, mpath, m = made
        store = self.be.open_array(data, "w+", comm=self.comm, **self._new(m))
        self._opened(store, data, mpath, self.comm.rank == 0)

    def adopt(self, made: tuple[str, str, _meta.Meta]) -> None:
        data, mpath, m = made
        _record(self.be, m, data, mpath, self.keep, self.inside)

    def finishing(self, made: tuple[str, str, _meta.Meta]) -> bool:
        return made[2].checksum is not None

    def finish(self, made: tuple[str, str, _meta.Meta]) -> None:
        layout = grid.Layout(self.shape, self.ch, self.dt.itemsize)
        self.sums = sums = Checksums.open(made[0], layout, self.dt, True)
        self.on_failure(sums.close)

    def _new(self, m: _meta.Meta) -> dict:
        """The keywords of ``open_array`` that make the object."""
        return dict(shape=self.shape, dtype=self.dt, chunks=self.ch,
                    perms=0o666 if self.keep else 0o600, **_attributes(self.inside, m),
                    **self.opts, **_grow_kw(m.maxshape))

    def _opened(self, store: Any, data: str, mpath: str, created: bool) -> None:
        """Keep ``store``; on failure close it and, where this rank ``created`` the object,
        remove it with its metadata."""
        self.store = store
        be = self.be
        if created:
            self.on_failure(lambda: _unmake(be, data, mpath))
        self.on_failure(lambda: _backends.close_local(store))


def _open_found(op: Collective, found: tuple, mode: str, backend: str | None,
                options: dict) -> tuple:
    """``DiskArray.open`` on every rank, agreed: the backend that reads the array found by
    rank 0, its checksums and (unless the backend opens collectively) its store."""
    mpath, data, m = found
    be_name = backend or m.backend
    be = _backends.require(_backends.resolve(be_name), be_name, _backends.ArrayBackend)
    opts = _check_options(be, be_name, options)
    if m.layout not in _backends.array_formats(be):
        able = [n for n in _backends.serving(_backends.ArrayBackend, m.layout) if n != be_name]
        raise MetadataError(
            f"the array at {mpath!r} is in format {m.layout!r}, which backend {be_name!r} "
            f"cannot read (it reads {list(_backends.array_formats(be))}); open it with "
            f"backend= one of {able}")
    if not be.exists(data):
        raise MetadataError(f"DiskArray metadata {mpath!r} is there but its data file "
                            f"{data!r} is missing; restore it or delete the metadata")
    sums = store = None
    if m.checksum:
        check_checksum(be, be_name, True, f" to open the array at {mpath!r}, which has "
                       f"checksums")
        sums = Checksums.open(data, grid.Layout(m.shape, m.chunks, m.dtype.itemsize),
                              m.dtype, mode != "r")
        op.on_failure(sums.close)
    if not _backends.is_collective(be):
        store = be.open_array(data, mode, shape=m.shape, dtype=m.dtype, chunks=m.chunks, **opts,
                              **_grow_kw(m.maxshape))
        op.on_failure(lambda: _backends.close_local(store))
    return be_name, be, opts, store, sums


# ---------------------------------------------------------------- the array

class DiskArray(StoreHandle):
    """An N-d array on disk, read and written in sections (see the module docstring).

    Make one with ``DiskArray.create`` or ``DiskArray.open``; both are collective.
    """

    close_alone = staticmethod(_backends.close_local)
    _stretch_memo: tuple | None = None     # (key, answer) of _long_stretches' last call

    def __init__(self, *, store: _backends.ArrayStore, backend_obj: _backends.ArrayBackend,
                 backend_name: str, meta: _meta.Meta, data_path: str, meta_path: str,
                 mode: str, comm: Comm, owner: bool, checksums: Checksums | None = None):
        self._hold(store, data_path, mode)
        self._sums = checksums
        self._caps = _backends.capabilities(store)
        self._be = backend_obj
        self.backend = backend_name
        self._meta = meta
        self._meta_path = meta_path
        self._comm = comm
        self._owner = owner
        self._layout = grid.Layout(meta.shape, meta.chunks, meta.dtype.itemsize)
        self._stats = stats.for_file(data_path, backend_name)
        self._deleted = False
        self._releaser = _Releaser(self)
        jobs.register_open(self._releaser)

    # ------------------------------------------------------------ creation
    @classmethod
    def create(cls, name: str, shape: Any, dtype: Any, *, request_shape: Any = None,
               chunks: Any = None, backend: str | None = None, path: Any = None,
               persistent: bool = False, overwrite: bool = False,
               comm: Any = None, checksum: bool = False, maxshape: Any = None,
               **options: Any) -> "DiskArray":
        """Create an array of ``shape`` and ``dtype``, every element zero. Collective.

        Layout: ``chunks`` if given, else chunks shaped by ``request_shape`` (a typical
        request, ``None`` entries meaning a whole axis: such requests become contiguous on
        disk), else chunks of 2–4 MiB. Hints change speed, never results.

        Without ``path`` the array is scratch: it lives in the job's shared scratch
        directory and vanishes on ``close()`` and at exit. With ``path`` (a directory, where
        the data goes to ``<name>.dra`` — ``<name>.zarr`` on ``zarr`` — or a path of its
        own) it is persistent: its metadata is written beside it (``<data>.json``; inside
        the object for backends that describe themselves, like ``zarr``) and
        ``DiskArray.open`` reopens it with any number of ranks. An existing array there is
        replaced only with ``overwrite=True``. Other keywords are options of the backend
        (e.g. ``compressor=`` for ``zarr``); a backend refuses options it does not know.

        ``checksum=True`` (backends ``local``, ``shm``, ``auto``) keeps a CRC-32 per chunk
        in ``<data>.crc``: every write updates the CRCs of the chunks it touches, every
        read checks those of the chunks it meets (``ChecksumError`` on damage; a read of
        part of a chunk reads all of it), ``chemio check --read`` checks them all.

        ``maxshape`` (as in h5py: a tuple, ``None`` for an axis without limit) makes the
        array resizable (``resize``, ``append``; see ``chemio_py.arrays.growth``); without
        it the shape is fixed.
        """
        c = _resolve_comm(comm)
        mk = _Creating(c, name, SimpleNamespace(
            shape=shape, dtype=dtype, request_shape=request_shape, chunks=chunks,
            backend=backend, path=path, persistent=persistent, overwrite=overwrite,
            checksum=checksum, maxshape=maxshape, options=options))
        data, mpath, m = mk.run()
        sums = mk.sums
        return mk.claim(data, lambda: cls(
            store=mk.store, backend_obj=mk.be, backend_name=mk.be_name, meta=m, data_path=data,
            meta_path=mpath, mode="r+", comm=c, owner=not mk.keep, checksums=sums),
            None if sums is None else sums.close)

    @staticmethod
    def _choose_chunks(shape: tuple, dt: np.dtype, chunks: Any, request_shape: Any) -> tuple:
        if chunks is not None:
            ch = _meta.check_shape(chunks, "chunks")
            if len(ch) != len(shape) or min(ch) < 1:
                raise ArgumentError(f"chunks {ch} must have one int >= 1 per axis of shape {shape}")
            return clip_chunks(ch, shape)
        if request_shape is not None:
            try:
                rs = list(request_shape)
            except TypeError:
                raise ArgumentError(f"request_shape {request_shape!r} must be a tuple") from None
            if len(rs) != len(shape):
                raise ArgumentError(f"request_shape {tuple(rs)} must have {len(shape)} entries "
                                    f"(one per axis of shape {shape}; None means a whole axis)")
            for r in rs:
                if r is not None and (isinstance(r, bool) or not hasattr(r, "__index__")
                                      or operator.index(r) < 1):
                    raise ArgumentError(f"request_shape {tuple(rs)} holds {r!r}; use ints >= 1 "
                                        f"or None for a whole axis")
            return hinted_chunks(shape, dt.itemsize,
                                         [None if r is None else operator.index(r) for r in rs])
        return default_chunks(shape, dt.itemsize)

    @staticmethod
    def _open_peer(be: _backends.ArrayBackend, be_name: str, data: str, mpath: str,
                   uuid: str, shape: tuple, dt: np.dtype, ch: tuple, c: Comm, host0: str,
                   opts: dict) -> Any:
        here = f"rank {c.rank} on host {socket.gethostname()!r}"
        fix = ("set CHEMIO_SHARED_SCRATCH (or path=) to a directory on a file system that every "
               "rank mounts (NFS, Lustre, GPFS, BeeGFS...)")
        try:
            m = _load_meta(be, be_name, data, mpath)
        except MetadataError:
            if not os.path.exists(mpath):
                raise NotSharedError(
                    f"{here} cannot see the array {data!r} that rank 0 created on host "
                    f"{host0!r}: its directory is not shared by all ranks (node-local?); "
                    f"{fix}") from None
            raise
        if m.uuid != uuid:
            raise NotSharedError(f"{here} found a different array at {data!r} than the one rank 0 "
                                 f"created on host {host0!r}: the directory is node-local; {fix}")
        return be.open_array(data, "r+", shape=shape, dtype=dt, chunks=ch, **opts)

    @classmethod
    def open(cls, path: Any, mode: str = "r", *, backend: str | None = None,
             comm: Any = None, **options: Any) -> "DiskArray":
        """Open an existing array by its data path or its ``.json`` metadata. Collective.

        ``mode`` is ``r`` (read only) or ``r+`` (read and write). The metadata is checked
        as untrusted input (``MetadataError``); any number of ranks may open an array that
        any number of ranks wrote. A path without chemio metadata opens when a backend that
        describes its own arrays recognises it (a Zarr v3 array written by anyone opens on
        ``zarr``). Opening a scratch array does not make this handle its owner: only its
        creator's ``close()`` removes it. Other keywords are options of the backend.
        """
        c = _resolve_comm(comm)
        what = f"DiskArray.open({os.fspath(path)!r})"
        with Collective(c, what, what) as op:
            found = op.agreed(lambda: _find_to_open(path, mode, backend, c.rank))
            mpath, data, m = found = op.share(found)
            be_name, be, opts, store, sums = op.agreed(
                lambda: _open_found(op, found, mode, backend, options))
            if store is None:               # a collective backend: every rank together
                store = be.open_array(data, mode, shape=m.shape, dtype=m.dtype,
                                      chunks=m.chunks, comm=c, **opts, **_grow_kw(m.maxshape))
        return cls(store=store, backend_obj=be, backend_name=be_name, meta=m, data_path=data,
                   meta_path=mpath, mode=mode, comm=c, owner=False, checksums=sums)

    # ------------------------------------------------------------ properties
    @property
    def shape(self) -> tuple[int, ...]:
        """The array's shape."""
        return self._meta.shape

    @property
    def dtype(self) -> np.dtype:
        """The element type (native order)."""
        return self._meta.dtype

    @property
    def chunks(self) -> tuple[int, ...]:
        """The chunk shape on disk (the storage objects of ``zarr``)."""
        return self._meta.chunks

    @property
    def name(self) -> str:
        """The name given at creation."""
        return self._meta.name

    @property
    def path(self) -> str:
        """The data file (a directory for ``zarr``)."""
        return self._path

    @property
    def meta_path(self) -> str:
        """The metadata file (JSON); the data path itself when the object holds it."""
        return self._meta_path

    @property
    def mode(self) -> str:
        """'r' or 'r+'."""
        return self._mode

    @property
    def persistent(self) -> bool:
        """True when the array outlives close() (created with path=)."""
        return self._meta.persistent

    @property
    def checksum(self) -> bool:
        """True when the array keeps a CRC-32 per chunk (``create(..., checksum=True)``)."""
        return self._meta.checksum is not None

    @property
    def comm(self) -> Comm:
        """The communicator of collective calls."""
        return self._comm

    @property
    def stats(self) -> stats.FileStats:
        """This array's I/O counters."""
        return self._stats

    @property
    def ndim(self) -> int:
        return len(self._meta.shape)

    @property
    def size(self) -> int:
        return math.prod(self._meta.shape)

    @property
    def nbytes(self) -> int:
        return self._meta.nbytes

    @property
    def capabilities(self) -> _backends.Capabilities:
        """What its store offers beyond the backend contract; nothing once closed."""
        return self._caps

    def __len__(self) -> int:
        return self._meta.shape[0]

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"mode {self._mode!r}"
        kind = "persistent" if self.persistent else "scratch"
        return (f"<DiskArray {self.name!r} shape={self.shape} dtype={self.dtype} "
                f"chunks={self.chunks} {kind} {state} path={self.path!r} backend={self.backend}>")

    def _repr_html_(self) -> str:
        """The notebook view: shape, dtype, chunks, logical bytes and bytes on disk,
        backend and format, compression, state and open requests."""
        compression = self._caps.compression          # NO_CAPABILITIES once closed
        rows = [("shape", self.shape), ("dtype", self.dtype), ("chunks (on disk)", self.chunks),
                ("grid", tuple(-(-n // c) if n else 0 for n, c in zip(self.shape, self.chunks))),
                ("bytes", reprs.size_text(self.nbytes)),
                ("on disk", reprs.size_text(reprs.disk_usage(self.path))),
                ("backend", f"{self.backend} (format {self._meta.layout})"),
                ("compression", compression or "none"),
                ("kind", "persistent" if self.persistent else "scratch"),
                ("state", "closed" if self.closed else f"open, mode {self._mode!r}"),
                ("open requests", self.outstanding), ("path", self.path)]
        return reprs.table(f"DiskArray {self.name!r}", rows)

    # ------------------------------------------------------------ checks
    def _label(self) -> str:
        return f"DiskArray {self.name!r}"

    def _closed_text(self) -> str:
        return (f"DiskArray {self.name!r} is closed; open it again with "
                f"DiskArray.open({self.path!r})")

    def _read_only_label(self) -> str:
        return f"DiskArray {self.name!r} ({self.path!r})"

    def _supersede(self, reason: str) -> list[BaseException]:
        """Close this rank's handle because the array was created again (``handles``);
        the files now belong to the new array, so this one never removes them."""
        self._owner = False
        self._deleted = True
        return super()._supersede(reason)

    def _prep_read(self, section: Any, out: Any, transpose: bool) -> tuple:
        """Checks a read; returns (region, target view in region shape, result, copy-back)."""
        self._open_store()
        region, squeeze = _sections.parse_section(section, self.shape)
        full = grid.region_shape(region)
        shape = tuple(n for n, s in zip(full, squeeze) if not s)
        want = shape[::-1] if transpose else shape
        if out is None:
            out = np.empty(want, self.dtype)
        else:
            if not isinstance(out, np.ndarray):
                raise ArgumentError(f"out must be a NumPy array, got {type(out).__name__}")
            if out.dtype != self.dtype:
                raise ArgumentError(f"out has dtype {out.dtype} but DiskArray {self.name!r} holds "
                                    f"{self.dtype}; pass an array of dtype {self.dtype} (or "
                                    f"out=None and convert the result)")
            if not out.flags.writeable:
                raise ArgumentError("out is read-only; pass a writable array")
            if out.shape != want:
                if out.shape == (full[::-1] if transpose else full):
                    pass
                else:
                    raise SectionError(
                        f"out has shape {out.shape} but section {section!r} has shape {want}"
                        f"{' (transposed)' if transpose else ''}; pass an array of shape {want}")
        target = out.T if transpose else out
        if target.shape != full:
            target = _sections.expand(target, squeeze)
        if _direct(target):
            return region, target, out, None
        tmp = np.empty(full, self.dtype)
        return region, tmp, out, target

    def _prep_write(self, section: Any, data: Any, transpose: bool) -> tuple:
        """Checks a write; returns (region, source array in region shape)."""
        self._writable_store()
        region, squeeze = _sections.parse_section(section, self.shape)
        full = grid.region_shape(region)
        shape = tuple(n for n, s in zip(full, squeeze) if not s)
        want = shape[::-1] if transpose else shape
        arr = data if isinstance(data, np.ndarray) else _as_values(data, self.dtype)
        if arr.shape != want and arr.shape != (full[::-1] if transpose else full):
            raise SectionError(
                f"data has shape {arr.shape} but section {section!r} has shape {want}"
                f"{' (data transposed)' if transpose else ''}; nothing was written")
        _meta.check_cast(arr.dtype, self.dtype, f"DiskArray {self.name!r}")
        src = arr.T if transpose else arr
        if src.shape != full:
            src = _sections.expand(src, squeeze)
        if src.dtype != self.dtype or not _direct(src):
            src = np.ascontiguousarray(src, dtype=self.dtype)
        return region, src

    def _check_independent_write(self, region: tuple) -> None:
        """The store's veto of an independent write of the whole section, if it has one
        (before the section is split into tasks, so nothing is written when it says no)."""
        check = self._caps.check_write
        if check is not None:
            check(region)

    # ------------------------------------------------------------ the I/O engine
    def _tasks(self, store: _backends.ArrayStore, region: tuple, arr: np.ndarray,
               read: bool = False) -> list[tuple]:
        nb = grid.region_nbytes(region, self.dtype.itemsize)
        if nb == 0:
            return []
        threads = max(1, int(config.get("io_threads")))
        task = min(TASK_MAX, max(TASK_MIN, nb // (2 * threads)))
        stretches = self._long_stretches(region) if read else None
        if stretches is not None:
            task = max(task, nb // stretches)        # one task per stretch
        subs = self._layout.split(region, task, self._caps.byte_addressable)
        return [(sub, arr[grid.relative(region, sub)], region) for sub in subs]

    def _long_stretches(self, region: tuple) -> int | None:
        """How many stretches of the file a read of ``region`` that missed the page cache
        reads, when they are all at least ``LONG_STRETCH`` bytes long (None otherwise, or
        for a store without a page-cache copy, ``CachedRead``, which a read reaching the
        tasks has missed).

        Such a section is read one stretch per task in file order, at most
        ``LONG_STREAMS`` at once: a sequential stream with the kernel's read-ahead moves
        a long stretch at the device's sequential speed, where 4 MB tasks of it on every
        I/O thread turn it into scattered requests (a 128 MB contiguous section on a busy
        virtio disk, medians of interleaved rounds against a sequential ``preadv`` of the
        same bytes: 0.92-1.18x against 0.73-0.93x for rows of default chunks, 0.70-0.97x
        against 0.80-0.81x for one 128 MB chunk). Short stretches with gaps between them
        keep the parallel tasks, which measured faster there than one stream (0.58x
        against 0.43x: the device idles at each gap without a request queued). A
        resizable array's file is laid out for its capacity: this guess from the logical
        layout may then be off, which costs speed, never correctness."""
        if self._caps.read_cached is None or not self._caps.byte_addressable:
            return None
        key = (self._layout, LONG_STRETCH, tuple([(s.start, s.stop) for s in region]))
        memo = self._stretch_memo
        if memo is not None and memo[0] == key:
            answer: int | None = memo[1]
            return answer
        firsts, ends = self._layout.extents(region)
        lens = ends - firsts
        got = int(lens.size) if lens.size and int(lens.min()) >= LONG_STRETCH else None
        self._stretch_memo = (key, got)
        return got

    def _task(self, store: _backends.ArrayStore, write: bool, piece: tuple) -> None:
        region, arr, section = piece
        t0 = time.perf_counter()
        read_part = self._caps.read_part          # a store that plans for the whole section
        if write:
            store.write(region, arr)
        elif read_part is not None:
            read_part(region, arr, section)
        else:
            store.read(region, arr)
        self._stats.record("write" if write else "read", arr.nbytes, t0, time.perf_counter())

    def _streams(self, store: _backends.ArrayStore, write: bool, ntasks: int) -> int:
        """How many tasks of one section move at once: the I/O threads, at most the
        store's ``write_streams``/``read_streams`` (beyond them concurrent tasks only
        contend, e.g. for the CPU of a compressing store)."""
        n = max(1, int(config.get("io_threads")))
        cap = self._caps.write_streams if write else self._caps.read_streams
        return max(1, min(ntasks, n, cap or n))

    def _taskrun(self, store: _backends.ArrayStore, write: bool,
                 tasks: list) -> tuple[pool.TaskRun, int]:
        run = pool.TaskRun(functools.partial(self._task, store, write), tasks, self._stats)
        streams = self._streams(store, write, len(tasks))
        sections = {id(t[2]): t[2] for t in tasks}.values() if not write else ()
        if sections and all(self._long_stretches(r) is not None for r in sections):
            streams = min(streams, LONG_STREAMS)     # sequential streams of long stretches
        return run, streams

    def _start(self, store: _backends.ArrayStore, write: bool, region: tuple, arr: np.ndarray,
               value: Any, finish: Any = None) -> requests.Request:
        run, streams = self._taskrun(store, write,
                                     self._tasks(store, region, arr, not write))
        done = requests.gather([run.start(streams)], value, finish, self._stats)
        return self._pending.add(done)

    def _run(self, store: _backends.ArrayStore, write: bool, region: tuple,
             arr: np.ndarray) -> None:
        """Move a section and return when it is done (``_run_many`` of one)."""
        self._run_many(store, write, [(region, arr)])

    def _run_many(self, store: _backends.ArrayStore, write: bool,
                  pieces: list[tuple[tuple, np.ndarray]]) -> None:
        """Move ``(region, array)`` pieces and return when all are done. One task runs in
        this thread (a pool hand-off costs more than a small section); several run on the
        pool while this thread waits, so an interrupt stops the tasks not started and
        waits for the others instead of leaving them writing into the caller's buffer."""
        t0 = time.perf_counter()
        try:
            tasks: list[tuple] = []
            for region, arr in pieces:
                if not write and self._read_cached(region, arr, t0):
                    continue                             # all in the page cache: one copy
                tasks.extend(self._tasks(store, region, arr, not write))
            if len(tasks) <= 1:
                for piece in tasks:
                    self._task(store, write, piece)
                return
            run, streams = self._taskrun(store, write, tasks)
            run.run(streams)                             # stops its tasks before raising
        finally:
            self._stats.waited(time.perf_counter() - t0)

    def _read_pieces(self, pieces: list[tuple[tuple, np.ndarray]]) -> None:
        """Read step-1 regions into arrays of their shape, checksums checked."""
        self._run_many(self._store, False, pieces)
        if self._sums is not None:
            for region, arr in pieces:
                self._sums.verify(self._store, region, arr)

    def _write_pieces(self, pieces: list[tuple[tuple, np.ndarray]]) -> None:
        """Write arrays into step-1 regions of their shape (vetted by the store first,
        all of them, so a veto writes nothing), checksums updated."""
        for region, _ in pieces:
            self._check_independent_write(region)
        self._run_many(self._store, True, pieces)
        if self._sums is not None:
            for region, arr in pieces:
                self._sums.updated(self._store, region, arr)

    # ------------------------------------------------------------ blocking, independent
    def read(self, section: Any = (), out: np.ndarray | None = None, *,
             transpose: bool = False) -> np.ndarray:
        """Read ``section`` into ``out`` (new array if None) and return it.

        A section is exact (step-1 slices and ints inside the array; anything else is a
        ``SectionError``), as ChemIO's DRA calls are; ``d[key]`` takes NumPy's indexing.
        With ``transpose=True`` the result has the section's axes reversed.
        """
        region, target, out, back = self._prep_read(section, out, transpose)
        self._read_pieces([(region, target)])
        if back is not None:
            back[...] = target
        return out

    def write(self, section: Any, data: Any, *, transpose: bool = False) -> None:
        """Write ``data`` (the section's shape; reversed with ``transpose=True``) into it.

        Elements of the array outside the section, in the same chunks too, are unchanged.
        """
        region, src = self._prep_write(section, data, transpose)
        self._write_pieces([(region, src)])

    # ------------------------------------------------------------ NumPy's indexing
    def _read_selection(self, sel: _indexing.Selection) -> Any:
        """What ``sel`` selects, as NumPy returns it (the chunks it needs only)."""
        self._open_store()
        region = sel.region()
        if region is not None:
            core = np.empty(grid.region_shape(region), self.dtype)
            if core.size:
                self._read_pieces([(region, core)])
            return sel.shape_result(core)
        axes = [_indexing.sort_pick(p) for p in sel.picks]
        core = np.empty(tuple(len(ax.u) for ax in axes), self.dtype)
        if core.size:
            spans = _indexing.plan(axes, self.chunks, self.dtype.itemsize, False,
                                   self._caps.byte_addressable)
            scratch = np.empty(0, self.dtype)          # the batch's temporaries, reused
            batch: list[tuple] = []
            held = 0
            for box in _indexing.boxes(spans):
                region = tuple(slice(s.lo, s.hi) for s in box)
                shape = grid.region_shape(region)
                dst = core[tuple(slice(s.p0, s.p1) for s in box)]
                if dst.shape == shape and _direct(dst):    # every element selected: no temp
                    batch.append((None, region, dst))
                    continue
                n = math.prod(shape)
                if held + n > scratch.size:
                    self._scatter(batch, axes, core)
                    batch, held = [], 0
                    if n > scratch.size:
                        scratch = np.empty(max(n, _indexing.BOX_BYTES // self.dtype.itemsize),
                                           self.dtype)
                batch.append((box, region, scratch[held:held + n].reshape(shape)))
                held += n
            self._scatter(batch, axes, core)
        return sel.shape_result(_indexing.order_core(core, axes))

    def _scatter(self, batch: list[tuple], axes: list, core: np.ndarray) -> None:
        """Read a batch of boxes (into ``core`` itself, or temporaries whose selected
        elements are then put into ``core``)."""
        if not batch:
            return
        self._read_pieces([(region, tmp) for _, region, tmp in batch])
        for box, _, tmp in batch:
            if box is None:
                continue
            part = tmp
            fancy = []
            src = []
            for a, (ax, s) in enumerate(zip(axes, box)):
                li = _indexing.local_index(ax.u, s)
                if isinstance(li, slice):
                    src.append(li)
                else:
                    src.append(slice(None))
                    fancy.append((a, li))
            part = part[tuple(src)]
            for a, li in fancy:
                part = np.take(part, li, axis=a)
            core[tuple(slice(s.p0, s.p1) for s in box)] = part

    def _write_selection(self, sel: _indexing.Selection, value: Any, key: Any) -> None:
        """``d[key] = value`` for a parsed key: checked whole first (shape, dtype, repeated
        indices, the store's veto), then written; nothing is written when a check fails."""
        self._writable_store()
        arr = value if isinstance(value, np.ndarray) else _as_values(value, self.dtype)
        _meta.check_cast(arr.dtype, self.dtype, f"DiskArray {self.name!r}")
        try:
            arr = np.broadcast_to(arr, sel.shape)
        except ValueError:
            raise SectionError(f"value of shape {arr.shape} does not broadcast to index "
                               f"{key!r} of shape {sel.shape}; nothing was written") from None
        core = sel.core_value(arr)
        region = sel.region()
        if region is not None:
            if core.size:
                self._write_pieces([(region, np.ascontiguousarray(core, self.dtype))])
            return
        for a, p in enumerate(sel.picks):
            if _indexing.repeats(p):
                raise SectionError(f"index {key!r} repeats an index on axis {a}; a write "
                                   f"through it would store one of the values at random: "
                                   f"pass each index once; nothing was written")
        axes = [_indexing.sort_pick(p) for p in sel.picks]
        core = _indexing.sort_value(core, sel.picks, axes)
        if not core.size:
            return
        spans = _indexing.plan(axes, self.chunks, self.dtype.itemsize, True,
                               self._caps.byte_addressable)
        pieces = [(tuple(slice(s.lo, s.hi) for s in box),
                   np.ascontiguousarray(core[tuple(slice(s.p0, s.p1) for s in box)],
                                        self.dtype))
                  for box in _indexing.boxes(spans)]
        self._write_pieces(pieces)

    def __getitem__(self, key: Any) -> Any:
        """NumPy's indexing: slices with any step (out-of-range bounds clipped), ints
        (full integer indexing gives a NumPy scalar), ``...``, ``None``, and one integer
        list/array or boolean mask (h5py's lists, NumPy's fancy indexing of one axis);
        ``d.oindex`` takes one per axis. Reads only the chunks the selection needs."""
        return self._read_selection(_indexing.parse(key, self.shape))

    def __setitem__(self, key: Any, value: Any) -> None:
        """``d[key] = value``: the keys of ``d[key]`` (no repeated indices); ``value``
        broadcasts to the selection as in NumPy. Nothing is written when a check fails."""
        self._write_selection(_indexing.parse(key, self.shape), value, key)

    @property
    def oindex(self) -> "_views.OIndex":
        """Orthogonal indexing as zarr's ``oindex``: an integer array, list or boolean
        mask per axis selects along that axis alone (``d.oindex[[0, 2], [1, 3]]`` is a
        2×2 result); reads and writes."""
        return _views.OIndex(self)

    @property
    def view(self) -> "_views.Views":
        """Lazy windows: ``d.view[key]`` is an ``ArrayView`` over the same storage (no
        copy; keys as ``d.oindex``, no ``None``), itself indexable, writable, iterable in
        blocks (``iter_blocks``), convertible (``to_dask``)."""
        return _views.Views(self)

    def _picks(self) -> tuple:
        return _indexing.full_picks(self.shape)

    def _root(self) -> "DiskArray":
        return self

    def __iter__(self) -> Any:
        """The sub-arrays along the first axis, as NumPy iterates (read in blocks)."""
        return _views.iterate(self)

    def __contains__(self, value: Any) -> bool:
        """``value in d``: any element equals ``value`` (NumPy's meaning; read in blocks)."""
        return _views.contains(self, value)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """The whole array in memory: always a new array, so ``copy=False`` raises as
        NumPy 2 requires (``np.asarray(d)`` and ``np.array(d)`` are fine)."""
        if copy is False:
            raise ValueError(f"DiskArray {self.name!r} lives on disk; making a NumPy array "
                             f"of it always copies (np.array(d, copy=False) cannot be "
                             f"honoured): use np.asarray(d)")
        a = self.read(())
        return a if dtype is None else a.astype(dtype, copy=False)

    # ------------------------------------------------------------ asynchronous
    def aread(self, section: Any, out: np.ndarray | None = None, *,
              transpose: bool = False) -> requests.Request:
        """Start reading ``section`` into ``out``; ``wait()`` returns the filled array.

        A section of at most ``HOT_INLINE`` bytes that the page cache holds whole is copied
        before this returns (the request is then complete): handing it to an I/O thread
        costs more than the copy.
        """
        region, target, out, back = self._prep_read(section, out, transpose)
        if back is None and self._sums is None and target.nbytes <= HOT_INLINE and \
                self._read_cached(region, target, time.perf_counter()):
            return requests.completed(out)      # a hand-off would cost more than the copy
        finish = None if back is None else (lambda: back.__setitem__(Ellipsis, target))
        if self._sums is not None:          # check, then copy back: in the last task's thread
            finish = functools.partial(verify_then_copy, self._sums, self._store, region,
                                       target, back)
        return self._start(self._store, False, region, target, out, finish)

    def _read_cached(self, region: tuple, arr: np.ndarray, t0: float) -> bool:
        """Read ``region`` into ``arr`` in this thread when the store copies from the page
        cache (``read_cached``) and every page of it is there (True: done, recorded as a
        read from ``t0``)."""
        cached = self._caps.read_cached
        if cached is None or not arr.size or not cached(region, arr):
            return False
        self._stats.record("read", arr.nbytes, t0, time.perf_counter())
        return True

    def aread_direct(self, section: Any, out: np.ndarray,
                     cached: bool = False) -> requests.Request | None:
        """Start reading ``section`` into ``out`` straight from the device, when the store
        can (``local``: O_DIRECT + Linux AIO into ``out``, no CPU copy, no I/O thread; the
        section's byte runs 4 KiB-aligned, ``out`` contiguous and aligned, its pages not
        cached); else None, and nothing started (use ``aread``). ``iter_blocks(direct=True)``
        uses it for read-ahead beside compute that takes every core."""
        self._open_store()                              # raises when closed
        native = self._caps.native_read_region
        if native is None or pool.sync_mode() or self._sums is not None:
            return None
        region, target, out, back = self._prep_read(section, out, False)
        if back is not None:
            return None

        def then(nbytes: int, t0: float, t1: float) -> np.ndarray:
            self._stats.record("read", nbytes, t0, t1)
            return out
        req = native(region, target, then, self._stats, cached=cached)
        return None if req is None else self._pending.add(req)

    def awrite(self, section: Any, data: Any, *, transpose: bool = False) -> requests.Request:
        """Start writing ``data`` into ``section``; leave ``data`` alone until it completes."""
        region, src = self._prep_write(section, data, transpose)
        self._check_independent_write(region)
        sums, store = self._sums, self._store
        finish = None if sums is None else (lambda: sums.updated(store, region, src))
        return self._start(self._store, True, region, src, None, finish)

    @property
    def outstanding(self) -> int:
        """Asynchronous requests of this array not yet complete."""
        return len(self._pending)

    # ------------------------------------------------------------ collective
    def read_all(self, section: Any = (), out: np.ndarray | None = None, *,
                 transpose: bool = False) -> np.ndarray:
        """Collective read: every rank reads its own section (an empty one is fine)."""
        c = self._comm
        what = f"DiskArray {self.name!r} read_all"
        c.begin(what + "()")
        with c.agree(what):
            region, target, out, back = self._prep_read(section, out, transpose)
        with c.agree(what):
            self._collective(False, region, target)
            if self._sums is not None:
                self._sums.verify(self._store, region, target)
            if back is not None:
                back[...] = target
        return out

    def write_all(self, section: Any, data: Any, *, transpose: bool = False) -> None:
        """Collective write: every rank writes its own section; all writes are done (and
        visible to every rank) when it returns. Bad input on any rank writes nothing."""
        c = self._comm
        what = f"DiskArray {self.name!r} write_all"
        c.begin(what + "()")
        with c.agree(what):
            region, src = self._prep_write(section, data, transpose)
        if c.size > 1:
            _check_disjoint(c, region, what)
        with c.agree(what):
            self._collective(True, region, src)
        if self._sums is not None:
            # After the agreement every rank's writes are complete: each recomputes the
            # chunks it touched; one shared by ranks gets the same value from each (the
            # same final bytes), so no communication is needed.
            with c.agree(what + " checksums"):
                self._sums.updated(self._store, region, src)

    def _collective(self, write: bool, region: tuple, arr: np.ndarray) -> None:
        store = self._store
        if self._caps.collective:                      # true collective I/O (MPI-IO)
            t0 = time.perf_counter()
            if write:
                store.write_all(region, arr, self._comm)
            else:
                store.read_all(region, arr, self._comm)
            t1 = time.perf_counter()
            self._stats.record("write" if write else "read", arr.nbytes, t0, t1)
            self._stats.waited(t1 - t0)
        else:
            self._run(store, write, region, arr)

    # ------------------------------------------------------------ attributes and growth
    @property
    def attrs(self) -> Any:
        """The array's persistent attributes: a mapping of str keys to JSON values; each
        change is collective (``chemio_py.arrays.attrs``)."""
        from chemio_py.arrays.attrs import Attributes
        return Attributes(self)

    @property
    def maxshape(self) -> tuple:
        """The most each axis may grow to (None: no limit); the shape for a fixed array."""
        ms = self._meta.maxshape
        return self._meta.shape if ms is None else ms

    def resize(self, size: Any, axis: int | None = None) -> None:
        """Collective: change the shape to ``size`` (a tuple), or axis ``axis`` to the
        int ``size`` (h5py's ``resize(size, axis=)``), within ``maxshape``. Elements inside
        both shapes keep their values; new ones read as zero (``chemio_py.arrays.growth``)."""
        from chemio_py.arrays import growth
        growth.resize(self, size, axis)

    def append(self, data: Any, axis: int = 0) -> tuple:
        """Collective: grow ``axis`` by ``data``'s length along it and write ``data`` there
        (as zarr's ``append``; ``data`` with one axis fewer is one slice). Every rank passes
        the same data. Returns the new shape."""
        from chemio_py.arrays import growth
        return growth.append(self, data, axis)

    def _reshaped(self, meta: _meta.Meta) -> None:
        """Take the metadata ``meta`` (new shape or attributes) on this rank."""
        self._meta = meta
        self._layout = grid.Layout(meta.shape, meta.chunks, meta.dtype.itemsize)

    # ------------------------------------------------------------ lifetime
    def flush(self) -> None:
        """Wait for this rank's outstanding requests and make its writes durable."""
        store = self._open_store()
        err = requests.failure(self.path, self._pending.drain())
        if self._mode != "r":
            store.flush()
            if self._sums is not None:
                self._sums.flush()
        if err is not None:
            raise err

    def evict(self) -> None:
        """Wait for this rank's requests, make its writes durable, and drop the array's
        pages from memory: the page cache and any mapping the store keeps for reads from
        it (``local``), so the next read comes from the device (cold benchmarks, memory
        pressure). Not collective; does nothing more on stores that keep no cache."""
        self.flush()
        evict = self._caps.evict
        if evict is not None:
            evict()

    def _forget_store(self) -> None:
        self._caps = _backends.NO_CAPABILITIES
        sums, self._sums = self._sums, None
        if sums is not None:
            sums.close()

    def close(self) -> None:
        """Collective: wait for outstanding requests and close; a scratch array is removed
        (gone for every rank when this returns).

        An error of an outstanding request on any rank is raised on every rank (the array
        is closed, and a scratch array removed, all the same). Idempotent.
        """
        if self._store is None:
            return
        c = self._comm
        if c.broken is not None:            # out of step: no collective can complete
            self._release()
            return
        c.begin(f"DiskArray {self.name!r} close()")
        try:
            with c.agree(f"DiskArray {self.name!r} close"):
                err = self._release(together=True)
                if err is not None:
                    raise err
        finally:
            if self._owner and not self.persistent:
                with c.agree(f"DiskArray {self.name!r} removal"):
                    self._remove_files()

    def delete(self) -> None:
        """Collective: close the array and remove its data and metadata (persistent too)."""
        if self._deleted:
            return
        self._deleted = True
        c = self._comm
        if c.broken is not None:
            self._release()
            return
        c.begin(f"DiskArray {self.name!r} delete()")
        try:
            self.close()
        finally:
            with c.agree(f"DiskArray {self.name!r} delete"):
                self._remove_files()

    def _remove_files(self) -> None:
        """Collective (every rank calls it): remove the metadata (rank 0) and the data,
        by all ranks together where the backend can (``CollectiveRemove``), else by
        rank 0. Returns or raises on every rank only inside ``comm.agree``."""
        c = self._comm
        failed: list[BaseException] = []
        if c.rank == 0:
            for p in {self._meta_path, self._path}:
                jobs.disown(p)
            if self._meta_path != self._path:
                for p in (self._meta_path, crc_path(self._path)):
                    jobs.disown(p)
                    try:
                        jobs.remove_path(p)          # the user layer wrote these
                    except OSError as e:                # the data still goes
                        failed.append(e)
        if _backends.removes_together(self._be, c):
            self._be.remove_all(self._path, c)
        elif c.rank == 0:
            self._be.remove(self._path)
        if failed:
            raise failed[0]

    # ------------------------------------------------------------ pipelines and interop
    def iter_blocks(self, axis: int = 0, size: int | None = None, depth: int = 2,
                    out_dtype: Any = None, *, name: str | None = None,
                    direct: bool | str | None = None, start: int | None = None,
                    stop: int | None = None) -> Pipeline:
        """Read the array in blocks along ``axis`` with read-ahead: yields ``(section,
        block)`` (``chemio_py.prefetch.iter_blocks``, which says what each argument does;
        ``start``/``stop`` bound the range along ``axis``; ``direct``: ``"auto"`` (the
        default setting) reads cold, aligned blocks of 2 MiB or more through O_DIRECT and
        Linux AIO and the rest through the page cache, ``True``/``False`` force a path;
        the choice is in the pipeline's ``stats.read_path``)."""
        from chemio_py.prefetch import iter_blocks
        return iter_blocks(self, axis=axis, size=size, depth=depth, out_dtype=out_dtype,
                           name=name, direct=direct, start=start, stop=stop)

    def to_dask(self, chunks: Any = None) -> dask.array.Array:
        """A dask array reading this one; its chunks are whole multiples of the disk chunks."""
        from chemio_py.arrays.interop import to_dask
        return to_dask(self, chunks=chunks)

    def to_xarray(self, dims: Any = None, coords: Any = None, **kw: Any) -> xarray.DataArray:
        """A lazily loaded ``xarray.DataArray`` over ``to_dask()`` (needs xarray):
        ``dims`` names the axes, ``coords``/``attrs``/``name``/``chunks`` as in xarray."""
        from chemio_py.arrays.interop import to_xarray
        return to_xarray(self, dims, coords, **kw)

    @classmethod
    def from_dask(cls, x: Any, name: str, **create_kw: Any) -> "DiskArray":
        """Store dask array ``x`` in a new DiskArray (collective; blocks in parallel)."""
        from chemio_py.arrays.interop import from_dask
        return from_dask(x, name, **create_kw)

    def to_hdf5(self, path: Any, dataset: str, **kw: Any) -> None:
        """Copy this array into dataset ``dataset`` of HDF5 file ``path`` (a path, an open
        h5py File/Group or chemio H5TmpFile/Group; collective)."""
        from chemio_py.arrays.interop import to_hdf5
        to_hdf5(self, path, dataset, **kw)

    @classmethod
    def from_hdf5(cls, h5file: Any, dataset: str | None = None, name: str | None = None,
                  **kw: Any) -> "DiskArray":
        """A new DiskArray holding dataset ``dataset`` of HDF5 file ``h5file`` (a path, an
        open h5py File/Group or chemio H5TmpFile/Group), or of the open dataset ``h5file``
        (collective)."""
        from chemio_py.arrays.interop import from_hdf5
        return from_hdf5(h5file, dataset, name, **kw)

    # ------------------------------------------------------------ pickling
    @property
    def uuid(self) -> str:
        """The uuid of the array's metadata, new at every ``create`` ('' for an array
        chemio did not write): tells apart two arrays made at one path one after another."""
        return self._meta.uuid

    def __reduce__(self) -> tuple:
        """Pickle as the way to reopen the array (path, backend, mode, uuid), never its
        store, mappings or locks; what ``pickle.loads`` gives in this process and in others
        (modes, scratch and ``shm`` arrays, ``mpiio``) is in ``chemio_py.arrays.pickling``."""
        from chemio_py.arrays.pickling import reduce_array
        return reduce_array(self, self._meta.uuid)
