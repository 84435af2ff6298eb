"""The backend contract: what a storage backend and its stores must and may provide.

A backend owns bytes, never user semantics. It opens

* a **ByteStore** (for ExclusiveFile, SharedFile, RecordFile)::

      pread(offset, out) -> int      # fills a writable buffer; short count only at end of file
      pwrite(offset, data) -> int    # loops until all is written or raises
      size(); truncate(n); reserve(n); flush(); close()

  Thread-safe for disjoint ranges. Every failed call raises a ``chemio_py`` error carrying
  errno, path, offset and size (``OutOfSpaceError`` for ENOSPC/EDQUOT).

* an **ArrayStore** (for DiskArray): ``read(region, out)``, ``write(region, data)`` and the
  collective ``read_all`` / ``write_all``.

and answers ``stat(path)`` (an ``FsInfo``) and ``remove(path)``. Everything beyond that is an
optional capability, a runtime-checkable protocol below. ``capabilities(store)`` (when a
store opens) and ``backend_capabilities(backend)`` find them in one place, as the fields of
``Capabilities`` and ``BackendCapabilities``; the user layer reads those records and never
probes a store or a backend itself. The registry is ``chemio_py.backends``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Tuple, TypeGuard, runtime_checkable

from chemio_py.errors import BackendUnavailableError

Region = Tuple[slice, ...]
"""A section of an array as one ``slice(start, stop)`` (step 1) per axis, inside its shape."""


@runtime_checkable
class ByteStore(Protocol):
    """One open byte-addressable file (ExclusiveFile, SharedFile, RecordFile).

    Safe to call from several threads at once for disjoint byte ranges. Every failing call
    raises a ``chemio_py.errors`` error carrying errno, path, offset and size
    (``OutOfSpaceError`` for ENOSPC/EDQUOT). The user layer checks modes, offsets and
    limits before it calls; the store moves bytes.
    """

    path: str
    """Where the bytes live now (may change, e.g. ``auto`` spilling from RAM to disk)."""

    def pread(self, offset: int, out: Any) -> int:
        """Fill the writable buffer ``out`` from ``offset``; return the bytes read, fewer
        than ``len(out)`` only at the end of the file (the user layer decides what that
        means). Short reads of the OS are looped inside."""
    def pwrite(self, offset: int, data: Any) -> int:
        """Write all of buffer ``data`` at ``offset`` (extending the file; holes read as
        zero) and return its length, or raise."""
    def size(self) -> int:
        """The file's size in bytes now."""
    def truncate(self, n: int) -> None:
        """Set the size to ``n`` bytes (shrink or extend with zeros)."""
    def reserve(self, n: int) -> None:
        """Make sure the first ``n`` bytes can be written without running out of space
        (allocate them), without changing the size; ``OutOfSpaceError`` now if not."""
    def flush(self) -> None:
        """Make written data durable (fdatasync or the equivalent)."""
    def close(self) -> None:
        """Release the store; idempotent. Never a collective call, except for a store a
        ``CollectiveOpen`` backend opened with ``comm`` (then see ``close_local``)."""


@runtime_checkable
class ArrayStore(Protocol):
    """The data of one DiskArray, opened by ``ArrayBackend.open_array``.

    ``out``/``data`` are NumPy arrays of the region's shape and the array's dtype, possibly
    strided views whose last axis is contiguous. The user layer checks bounds, dtypes and
    modes, splits sections into tasks (one thread each) and synchronises ranks.
    """

    path: str
    shape: tuple
    chunks: tuple
    byte_addressable: bool
    """True when a write touches only the region's bytes (no read-modify-write of whole
    chunks), so writers of disjoint regions never disturb each other in one chunk."""

    def read(self, region: Region, out: Any) -> Any:
        """Fill ``out`` from ``region``; return it. Unwritten elements read as zero."""
    def write(self, region: Region, data: Any) -> None:
        """Write ``data`` into ``region``; the rest of the array is unchanged."""
    def read_all(self, region: Region, out: Any, comm: Any = None) -> Any:
        """Collective read over ``comm`` (every rank calls it; an empty region is fine).
        Stores without collective I/O read independently."""
    def write_all(self, region: Region, data: Any, comm: Any = None) -> None:
        """Collective write over ``comm``; see ``read_all``."""
    def flush(self) -> None:
        """Make written data durable."""
    def close(self) -> None:
        """Release this rank's handle; idempotent; never a collective call, except for a
        store a ``CollectiveOpen`` backend opened with ``comm`` (then see ``close_local``)."""


@runtime_checkable
class Backend(Protocol):
    """A storage backend: where files live and how their stores open and go away."""

    def root(self, scope: str, rank: int = 0) -> str:
        """The directory under which job scratch goes: ``scope`` is ``"private"`` (this
        rank's files) or ``"shared"`` (files every rank opens)."""
    def stat(self, path: str) -> Any:
        """An ``FsInfo(path, free, total, fstype)`` for where ``path`` would live."""
    def exists(self, path: str) -> bool:
        """True when an object (file or directory) of this backend is at ``path``."""
    def remove(self, path: str) -> bool:
        """Delete the on-disk object at ``path`` (file or directory); False if absent."""


@runtime_checkable
class ByteBackend(Backend, Protocol):
    """A backend that holds byte files (ExclusiveFile, SharedFile, RecordFile)."""

    def open_bytes(self, path: str, mode: str, **options: Any) -> ByteStore:
        """Open (``r``, ``r+``) or create (``w+`` replaces, ``x+`` must not exist) a file;
        never follows a final symbolic link, never blocks on a FIFO."""


@runtime_checkable
class ArrayBackend(Backend, Protocol):
    """A backend that holds DiskArrays.

    Optional attributes: ``array_formats`` (``ArrayFormats``; default ``("grid",)``) and
    ``array_options`` (``ArrayOptions``; default none).
    """

    def open_array(self, path: str, mode: str, *, shape: Any, dtype: Any, chunks: Any,
                   **options: Any) -> ArrayStore:
        """Open or create (``w+``/``x+``: every element zero, space reserved) an array."""


# ---------------------------------------------------------------- optional capabilities
# Looked up once when a store opens (``capabilities``), never per call; the ones of a
# backend by ``backend_capabilities``.

@runtime_checkable
class CollectiveCheck(Protocol):
    def check_collective(self, comm: Any, what: str) -> None:
        """Raise on every rank when this backend cannot serve ``comm``'s ranks together
        (e.g. ``shm``: all ranks must share one node)."""


@runtime_checkable
class NativeAsync(Protocol):
    def native_read(self, offset: int, out: Any, then: Callable, stats: Any = None) -> Any:
        """Start a read the store completes itself (e.g. Linux AIO): return a
        ``chemio_py.runtime.requests.Request`` completed (``set_result``/``set_exception``) with
        ``then(count, t0, t1)``, or None when this call is not eligible (the pool runs it)."""
    def native_write(self, offset: int, data: Any, then: Callable, stats: Any = None) -> Any:
        """As ``native_read``, for a write."""


@runtime_checkable
class NativeAsyncMany(Protocol):
    def native_read_many(self, many: Any, then: Callable, stats: Any = None) -> Any:
        """Start many reads as one request (``many`` has ``offsets``, ``addresses``,
        ``sizes``, ``bits`` and ``views``); None when not eligible."""
    def native_write_many(self, many: Any, then: Callable, stats: Any = None) -> Any:
        """As ``native_read_many``, for writes."""


@runtime_checkable
class NonBlockingRead(Protocol):
    def read_nowait(self, offset: int, out: Any) -> int:
        """Read only what needs no device I/O (page cache); return the bytes read."""


@runtime_checkable
class CachedRead(Protocol):
    def read_cached(self, region: Region, out: Any) -> bool:
        """Fill ``out`` only when that needs no device I/O; say whether it did."""


@runtime_checkable
class CollectiveOpen(Protocol):
    """A backend whose stores are opened and closed by all ranks together (MPI-IO, or a
    store that must know its writers, like ``zarr``).

    The user layer calls ``open_bytes(path, mode, comm=comm)`` / ``open_array(path, mode,
    ..., comm=comm)`` on **every rank** of ``comm`` (a ``chemio_py.runtime.comm.Comm``; ``comm.mpi``
    is its mpi4py communicator, None when serial) at the same time with the same arguments.
    ``w+``/``x+`` create: the backend makes the object once (say on rank 0) and every rank
    opens it. The call returns on every rank or raises on every rank (run rank-local steps
    inside ``comm.agree``). ``comm=None`` means a private store of this process only (an
    ExclusiveFile). The store's ``close()`` is then collective over ``comm``;
    ``close_local()`` never is: it releases this process's resources without waiting for
    any other rank (``__del__``, interpreter exit, error paths) and may warn.
    """

    collective_open: bool


@runtime_checkable
class CollectiveRemove(Protocol):
    """A backend whose objects are many files (``zarr``: a directory tree of storage
    objects) that the ranks of a communicator remove together, each a share, instead of
    one rank removing every file while the others wait.
    """

    def remove_all(self, path: str, comm: Any) -> bool:
        """The collective form of ``Backend.remove``: every rank of ``comm`` (a
        ``chemio_py.runtime.comm.Comm``; None: this process alone, as ``remove``) calls it at the
        same time with the same ``path``. Each rank removes its share of the object's
        files, the ranks meet once, then rank 0 removes what is left (directories,
        metadata, and whatever another rank could not remove). Nothing outside ``path`` is
        removed and no link is followed; a file that cannot be removed does not stop the
        rest. Returns whether the object existed, on every rank, or raises on every rank
        (rank 0 a ``StorageError`` naming the first path that could not be removed, with
        its errno; the others ``CollectiveError``)."""


@runtime_checkable
class SelfDescribing(Protocol):
    """An array backend whose on-disk object carries its own metadata (``zarr``): the user
    layer writes no ``<data>.json`` beside it, passes its metadata document to
    ``open_array(..., attributes=doc)`` on creation and reads it back with ``describe``."""

    suffix: str
    """The name ending of objects it creates (``".zarr"``); ``DiskArray`` data uses ``.dra``."""

    def describe(self, path: str) -> dict:
        """The array at ``path`` as ``{"shape", "dtype", "chunks", "attributes"}`` (the
        ``attributes`` a creation passed, ``{}`` for arrays written by others), after
        checking the backend's own metadata as untrusted input (``MetadataError``)."""
    def recognizes(self, path: str) -> bool:
        """True when ``path`` holds an array of this backend's format (cheap; no errors)."""


@runtime_checkable
class OnceIO(Protocol):
    """The hot path of small blocking calls: functions that make exactly one system call."""

    def pread_once(self) -> Callable[[Any, int], int] | None:
        """A function ``(buffers, offset) -> count``, the call of ``os.preadv`` without
        the descriptor (so that ``functools.partial(os.preadv, fd)`` serves and the call
        costs no Python frame): reads once into ``buffers``, a 1-tuple of a buffer. A short
        count is for the caller to complete with ``pread``; ``OSError`` for the caller to
        retry through ``pread``, which maps it; ``TypeError``/``ValueError``/``BufferError``
        (a read-only or non-contiguous buffer) for the caller to pass to ``pread``, which
        says what is wrong. None when the store has no such call."""
    def pwrite_once(self) -> Callable[[Any, int], int] | None:
        """As ``pread_once``, writing once (``os.pwritev`` without the descriptor)."""


@runtime_checkable
class WriteCheck(Protocol):
    def check_write(self, region: Region) -> None:
        """Raise, changing nothing, if an independent write of the whole ``region`` would
        be unsafe (e.g. ``zarr``: it cuts a storage object other ranks may be rewriting).
        Called once per section before it is split into tasks."""


@runtime_checkable
class PartRead(Protocol):
    def read_part(self, region: Region, out: Any, section: Region) -> Any:
        """As ``ArrayStore.read``, for ``region``, one task the user layer cut from the
        section ``section`` of the caller's request: a store may plan for the whole
        section (``local``: which stretches of the file are short enough to read without
        read-ahead). Returns ``out``."""


@runtime_checkable
class NativeRegionRead(Protocol):
    def native_read_region(self, region: Region, out: Any, then: Callable, stats: Any = None,
                           cached: bool = False) -> Any:
        """Start reading ``region`` straight from the device into ``out`` (a contiguous,
        aligned array): a ``Request`` the store completes with ``then(nbytes, t0, t1)``,
        or None when not eligible (``cached=False``: pages in the page cache make it so)."""


@runtime_checkable
class Evict(Protocol):
    def evict(self) -> None:
        """Drop the object's cached pages and read mappings."""


@runtime_checkable
class WriteStreams(Protocol):
    write_streams: int
    """Concurrent writers of one section worth having (more only contend)."""


@runtime_checkable
class ReadStreams(Protocol):
    read_streams: int
    """Concurrent readers of one section worth having."""


@runtime_checkable
class CollectiveIO(Protocol):
    collective: bool
    """True when ``read_all``/``write_all`` are true collective I/O: the user layer hands
    them the whole region and ``comm`` instead of splitting it into tasks."""


@runtime_checkable
class ByteAddressable(Protocol):
    byte_addressable: bool
    """See ``ArrayStore.byte_addressable``."""


@runtime_checkable
class Compressed(Protocol):
    compression: str | None
    """The codec of the stored data for people to read (``"zstd level 3"``), None: none."""


@runtime_checkable
class CollectiveSync(Protocol):
    def sync_all(self) -> None:
        """Collective over the ranks that opened the store: make every rank's writes
        before it durable and visible to every rank after it (MPI-IO sync-barrier-sync)."""


@runtime_checkable
class DaskSource(Protocol):
    def as_dask(self, chunks: Any = None) -> Any:
        """A dask array of the object that others could read without chemio (its path
        is enough: ``dask.array.from_zarr``)."""


@runtime_checkable
class Resizable(Protocol):
    """A store whose shape can change (``DiskArray.resize``/``append``): opened with
    ``maxshape=`` (see ``ResizableArrays``)."""

    maxshape: tuple
    """The most each axis may grow to, None for an axis without limit."""

    def resize(self, shape: tuple, comm: Any = None) -> None:
        """Change the array's shape to ``shape`` (within ``maxshape``; the user layer has
        checked it). With ``comm`` every rank that opened the object calls it together with
        the same shape, with no I/O of this array in flight; the object changes once and
        every rank's store has the new shape when it returns (all return or all raise).
        Elements inside both shapes keep their values and no stored chunk moves; elements
        of the new shape outside the old one read as zero (stale bytes of a shrink are
        zeroed or dropped). Nothing changes when it raises before the object changed
        (``OutOfSpaceError`` for a growth that does not fit)."""


@runtime_checkable
class LocalClose(Protocol):
    def close_local(self) -> None:
        """Release this process's resources without any collective call (see
        ``CollectiveOpen``); may warn when it leaves a collective handle behind."""


# ---------------------------------------------------------------- optional, of a backend

@runtime_checkable
class ArrayFormats(Protocol):
    array_formats: tuple[str, ...]
    """The on-disk array formats it reads and writes, the one it creates first."""


@runtime_checkable
class ArrayOptions(Protocol):
    array_options: frozenset[str]
    """The extra keywords its ``open_array`` takes, which ``DiskArray.create/open(**options)``
    pass on."""


@runtime_checkable
class ResizableArrays(Protocol):
    resizable_arrays: bool
    """True when ``open_array`` takes ``maxshape=`` (a tuple, None entries for axes without
    limit; passed only for resizable arrays) and its stores are ``Resizable``."""


@runtime_checkable
class AttributeWriter(Protocol):
    def write_attributes(self, path: str, attributes: dict) -> None:
        """Replace the user attributes kept in the object's own metadata (``zarr``: the
        ``attributes`` of ``zarr.json``, beside chemio's entry, which stays) in one atomic
        write. Not collective: the user layer calls it on one rank."""


@runtime_checkable
class Availability(Protocol):
    def check_available(self) -> None:
        """Raise ``BackendUnavailableError`` with a hint when it cannot work here."""


@runtime_checkable
class Described(Protocol):
    description: str
    """One line for ``chemio info`` (not in ``BackendCapabilities``: it may change)."""


@dataclass(frozen=True)
class Capabilities:
    """What a store offers beyond the contract, found once when it opens
    (``capabilities``): the methods bound, None (or False) when it does not."""
    native_read: Callable | None = None         # NativeAsync
    native_write: Callable | None = None
    native_read_many: Callable | None = None    # NativeAsyncMany
    native_write_many: Callable | None = None
    native_read_region: Callable | None = None  # NativeRegionRead
    read_nowait: Callable | None = None         # NonBlockingRead
    read_cached: Callable | None = None         # CachedRead
    read_part: Callable | None = None           # PartRead
    check_write: Callable | None = None         # WriteCheck
    evict: Callable | None = None               # Evict
    pread_once: Callable | None = None          # OnceIO
    pwrite_once: Callable | None = None
    sync_all: Callable | None = None            # CollectiveSync
    as_dask: Callable | None = None             # DaskSource
    close_local: Callable | None = None         # LocalClose
    resize: Callable | None = None              # Resizable
    write_streams: int | None = None            # WriteStreams (None: any number)
    read_streams: int | None = None             # ReadStreams (None: any number)
    collective: bool = False                    # CollectiveIO
    byte_addressable: bool = False              # ByteAddressable
    compression: str | None = None              # Compressed


NO_CAPABILITIES = Capabilities()
"""What a closed store offers: nothing (its methods are no longer reachable)."""


def _count(n: object) -> int | None:
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def capabilities(store: ByteStore | ArrayStore) -> Capabilities:
    """The optional capabilities of an open store (see the protocols above)."""
    compression = store.compression if isinstance(store, Compressed) else None
    return Capabilities(
        native_read=store.native_read if isinstance(store, NativeAsync) else None,
        native_write=store.native_write if isinstance(store, NativeAsync) else None,
        native_read_many=store.native_read_many if isinstance(store, NativeAsyncMany) else None,
        native_write_many=store.native_write_many
        if isinstance(store, NativeAsyncMany) else None,
        native_read_region=store.native_read_region
        if isinstance(store, NativeRegionRead) else None,
        read_nowait=store.read_nowait if isinstance(store, NonBlockingRead) else None,
        read_cached=store.read_cached if isinstance(store, CachedRead) else None,
        read_part=store.read_part if isinstance(store, PartRead) else None,
        check_write=store.check_write if isinstance(store, WriteCheck) else None,
        evict=store.evict if isinstance(store, Evict) else None,
        pread_once=store.pread_once() if isinstance(store, OnceIO) else None,
        pwrite_once=store.pwrite_once() if isinstance(store, OnceIO) else None,
        sync_all=store.sync_all if isinstance(store, CollectiveSync) else None,
        as_dask=store.as_dask if isinstance(store, DaskSource) else None,
        close_local=store.close_local if isinstance(store, LocalClose) else None,
        resize=store.resize if isinstance(store, Resizable) else None,
        write_streams=_count(store.write_streams) if isinstance(store, WriteStreams) else None,
        read_streams=_count(store.read_streams) if isinstance(store, ReadStreams) else None,
        collective=isinstance(store, CollectiveIO) and store.collective is True,
        byte_addressable=isinstance(store, ByteAddressable) and store.byte_addressable is True,
        compression=compression if isinstance(compression, str) and compression else None)


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend offers beyond the contract (``backend_capabilities``)."""
    array_formats: tuple[str, ...] = ("grid",)  # ArrayFormats (default: the raw chunk grid)
    array_options: frozenset[str] = frozenset()  # ArrayOptions
    collective_open: bool = False               # CollectiveOpen
    remove_all: Callable | None = None          # CollectiveRemove
    check_collective: Callable | None = None    # CollectiveCheck
    check_available: Callable | None = None     # Availability
    self_describing: bool = False               # SelfDescribing
    resizable_arrays: bool = False              # ResizableArrays
    write_attributes: Callable | None = None    # AttributeWriter


def backend_capabilities(backend: Backend) -> BackendCapabilities:
    """The optional capabilities of ``backend`` (see the protocols above)."""
    formats = tuple(backend.array_formats) if isinstance(backend, ArrayFormats) else ()
    options = backend.array_options if isinstance(backend, ArrayOptions) else None
    return BackendCapabilities(
        array_formats=formats or ("grid",),
        array_options=frozenset(options or ()),
        collective_open=isinstance(backend, CollectiveOpen) and backend.collective_open is True,
        remove_all=backend.remove_all if isinstance(backend, CollectiveRemove) else None,
        check_collective=backend.check_collective
        if isinstance(backend, CollectiveCheck) else None,
        check_available=backend.check_available if isinstance(backend, Availability) else None,
        self_describing=isinstance(backend, SelfDescribing),
        resizable_arrays=isinstance(backend, ResizableArrays)
        and backend.resizable_arrays is True,
        write_attributes=backend.write_attributes
        if isinstance(backend, AttributeWriter) else None)


def description(backend: Backend) -> str:
    """The line ``chemio info`` prints for ``backend`` (``Described``; may be computed
    each time, e.g. ``shm``'s RAM budget left), else ``""``."""
    text = backend.description if isinstance(backend, Described) else ""
    return text if isinstance(text, str) else ""


def array_formats(backend: Backend) -> tuple[str, ...]:
    """The on-disk array formats an ``ArrayBackend`` reads and writes, the one it creates
    first: its ``array_formats`` attribute, else the raw chunk grid (``"grid"``)."""
    return backend_capabilities(backend).array_formats


def removes_together(backend: Backend, comm: Any) -> TypeGuard[CollectiveRemove]:
    """Whether the ranks of ``comm`` remove ``backend``'s objects together
    (``CollectiveRemove.remove_all``) rather than rank 0 alone (``remove``)."""
    return comm is not None and comm.size > 1 and isinstance(backend, CollectiveRemove)


def is_collective(backend: Backend) -> bool:
    """Whether ``backend`` opens and closes its stores collectively (``CollectiveOpen``)."""
    return isinstance(backend, CollectiveOpen) and backend.collective_open is True


def close_local(store: ByteStore | ArrayStore) -> None:
    """Release ``store`` without any collective call: ``close_local()`` when it has one
    (``LocalClose``), else ``close()`` (which the contract says is never collective for
    the stores of a backend that is not ``CollectiveOpen``)."""
    if isinstance(store, LocalClose):
        store.close_local()
    else:
        store.close()


def require(backend: Backend, name: str, kind: type) -> Any:
    """``backend`` if it serves ``kind`` (``ByteBackend``/``ArrayBackend``), else
    ``BackendUnavailableError`` naming the backends that do."""
    if isinstance(backend, kind):
        return backend
    from chemio_py.backends import serving          # the registry, which imports this module
    what = "byte files (ExclusiveFile, SharedFile, RecordFile)" if kind is ByteBackend \
        else "DiskArrays"
    able = [n for n in serving(kind) if n != name]
    raise BackendUnavailableError(name, f"it cannot hold {what}",
                                  f"choose one that can: {able}")
