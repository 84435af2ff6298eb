"""The device layer (ChemIO's ELIO): storage backends, their protocol and registry.

A backend owns bytes, never user semantics. It is an object registered by name that opens

* a **ByteStore** (for ExclusiveFile, SharedFile, RecordFile)::

      pread(offset, out) -> int      # fills a writable buffer; short count only at end of file
      pwrite(offset, data) -> int    # loops until all is written or raises
      size(); truncate(n); reserve(n); flush(); close()

  Thread-safe for disjoint ranges. Every failed call raises a ``chemio_py`` error carrying
  errno, path, offset and size (``OutOfSpaceError`` for ENOSPC/EDQUOT).

* an **ArrayStore** (for DiskArray): ``read(region, out)``, ``write(region, data)`` and the
  collective ``read_all`` / ``write_all``.

and answers ``stat(path)`` (an ``FsInfo``) and ``remove(path)`` (a backend whose objects
are many files may add the collective ``remove_all(path, comm)``: ``CollectiveRemove``).
Backends are found by name in the built-in table below, then in the entry-point group
``chemio_py.backends`` (a third party registers ``name = "package.module:BackendClass"``),
and can be added at run time with ``register(name, factory)``.
"""
from __future__ import annotations

import functools
import importlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Tuple, runtime_checkable

from chemio_py.runtime import config
from chemio_py.errors import BackendUnavailableError

ENTRY_POINT_GROUP = "chemio_py.backends"

# name -> "module:attribute" of the backend class, imported on first use.
BUILTIN: dict[str, str] = {
    "local": "chemio_py.backends.local.backend:LocalBackend",
    "shm": "chemio_py.backends.shm.backend:ShmBackend",
    "auto": "chemio_py.backends.auto:AutoBackend",
    "mpiio": "chemio_py.backends.mpiio.backend:MpiioBackend",
    "zarr": "chemio_py.backends.zarr.backend:ZarrBackend",
}

_lock = threading.Lock()
_factories: dict[str, Callable[[], Any]] = {}
_instances: dict[str, Any] = {}


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

    Optional attributes: ``array_formats`` (the on-disk formats it reads, the one it
    creates first; default ``("grid",)``) and ``array_options`` (the names of the extra
    keywords its ``open_array`` takes, which ``DiskArray.create/open(**options)`` pass on;
    default none).
    """

    def open_array(self, path: str, mode: str, *, shape: Any, dtype: Any, chunks: Any,
                   **options: Any) -> ArrayStore:
        """Open or create (``w+``/``x+``: every element zero, space reserved) an array."""


def array_formats(backend: Any) -> tuple[str, ...]:
    """The on-disk array formats an ``ArrayBackend`` reads and writes, the one it creates
    first: its ``array_formats`` attribute, else the raw chunk grid (``"grid"``)."""
    formats = getattr(backend, "array_formats", None)
    return tuple(formats) if formats else ("grid",)


# ---------------------------------------------------------------- optional capabilities
# Looked up once when a store opens (``capabilities``), never per call.

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


def removes_together(backend: Any, comm: Any) -> bool:
    """Whether the ranks of ``comm`` remove ``backend``'s objects together
    (``CollectiveRemove.remove_all``) rather than rank 0 alone (``remove``)."""
    return comm is not None and comm.size > 1 and isinstance(backend, CollectiveRemove)


def is_collective(backend: Any) -> bool:
    """Whether ``backend`` opens and closes its stores collectively (``CollectiveOpen``)."""
    return getattr(backend, "collective_open", False) is True


def close_local(store: Any) -> None:
    """Release ``store`` without any collective call: ``close_local()`` when it has one,
    else ``close()`` (which the contract says is never collective for the stores of a
    backend that is not ``CollectiveOpen``)."""
    local = getattr(store, "close_local", None)
    local() if local is not None else store.close()


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


@dataclass(frozen=True)
class Capabilities:
    """What a store offers beyond the contract, found once when it opens."""
    native_read: Callable | None = None
    native_write: Callable | None = None
    native_read_many: Callable | None = None
    native_write_many: Callable | None = None
    read_nowait: Callable | None = None
    read_cached: Callable | None = None
    check_write: Callable | None = None
    evict: Callable | None = None          # drop the object's cached pages and mappings
    pread_once: Callable | None = None
    pwrite_once: Callable | None = None
    write_streams: int | None = None       # concurrent writers worth having (None: any)
    read_streams: int | None = None        # concurrent readers worth having (None: any)
    collective: bool = False               # read_all/write_all are true collective I/O
    byte_addressable: bool = False


NO_CAPABILITIES = Capabilities()
"""What a closed store offers: nothing (its methods are no longer reachable)."""


def capabilities(store: Any) -> Capabilities:
    """The optional capabilities of an open store (see the protocols above)."""
    nat = isinstance(store, NativeAsync)
    many = isinstance(store, NativeAsyncMany)
    streams = getattr(store, "write_streams", None)
    readers = getattr(store, "read_streams", None)
    return Capabilities(
        native_read=store.native_read if nat else None,
        native_write=store.native_write if nat else None,
        native_read_many=store.native_read_many if many else None,
        native_write_many=store.native_write_many if many else None,
        read_nowait=store.read_nowait if isinstance(store, NonBlockingRead) else None,
        read_cached=store.read_cached if isinstance(store, CachedRead) else None,
        check_write=store.check_write if isinstance(store, WriteCheck) else None,
        evict=getattr(store, "evict", None),
        pread_once=store.pread_once() if isinstance(store, OnceIO) else None,
        pwrite_once=store.pwrite_once() if isinstance(store, OnceIO) else None,
        write_streams=streams if isinstance(streams, int) and streams > 0 else None,
        read_streams=readers if isinstance(readers, int) and readers > 0 else None,
        collective=getattr(store, "collective", False) is True,
        byte_addressable=getattr(store, "byte_addressable", False) is True)


def require(backend: Any, name: str, kind: type) -> Any:
    """``backend`` if it serves ``kind`` (``ByteBackend``/``ArrayBackend``), else
    ``BackendUnavailableError`` naming the backends that do."""
    if isinstance(backend, kind):
        return backend
    what = "byte files (ExclusiveFile, SharedFile, RecordFile)" if kind is ByteBackend \
        else "DiskArrays"
    able = [n for n in serving(kind) if n != name]
    raise BackendUnavailableError(name, f"it cannot hold {what}",
                                  f"choose one that can: {able}")


def serving(kind: type, layout: str | None = None) -> list[str]:
    """Names of the backends usable here that serve ``kind`` (``ByteBackend`` or
    ``ArrayBackend``) and, given ``layout``, read that array format."""
    out = []
    for n in names():
        try:
            be = resolve(n)
        except Exception:
            continue
        if isinstance(be, kind) and (layout is None or layout in array_formats(be)):
            out.append(n)
    return out


def register(name: str, factory: Callable[[], Any], replace: bool = False) -> None:
    """Make ``factory()`` the backend called ``name``."""
    with _lock:
        if not replace and (name in _factories or name in BUILTIN):
            raise ValueError(f"backend {name!r} is already registered; pass replace=True")
        _factories[name] = factory
        _instances.pop(name, None)
    config.set_choices("backend", names)        # settings naming it are valid from now on


def unregister(name: str) -> None:
    """Forget a backend added with ``register`` (built-in ones stay)."""
    with _lock:
        _factories.pop(name, None)
        _instances.pop(name, None)
    config.set_choices("backend", names)


def _load(target: str) -> Any:
    mod, _, attr = target.partition(":")
    return getattr(importlib.import_module(mod), attr)


@functools.lru_cache(maxsize=1)
def _entry_points() -> dict[str, Any]:
    """Installed plug-in backends, read once per process (a scan of every installed
    distribution costs tens of milliseconds; ``register()`` adds backends at run time)."""
    from importlib.metadata import entry_points
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def names() -> list[str]:
    """Every backend name known here (registered, built in or from entry points)."""
    found = set(BUILTIN) | set(_factories)
    try:
        found |= set(_entry_points())
    except Exception:
        pass
    return sorted(found)


config.set_choices("backend", names)            # backend settings must name one of these


def resolve(name: str) -> Any:
    """The backend called ``name`` (one instance per process)."""
    with _lock:
        inst = _instances.get(name)
        if inst is not None:
            return inst
        factory = _factories.get(name)
    try:
        if factory is None and name in BUILTIN:
            factory = _load(BUILTIN[name])
        if factory is None:
            ep = _entry_points().get(name)
            if ep is not None:
                factory = ep.load()
    except BackendUnavailableError:
        raise
    except ImportError as e:
        raise BackendUnavailableError(name, f"importing it failed ({e})",
                                      "install its dependencies (chemio info shows them)") from e
    if factory is None:
        raise BackendUnavailableError(
            name, "no backend of that name is registered",
            f"choose one of {names()} (CHEMIO_BACKEND, backend=, or a [files] rule)")
    inst = factory()
    check = getattr(inst, "check_available", None)
    if check is not None:
        check()
    with _lock:
        return _instances.setdefault(name, inst)


def availability() -> dict[str, tuple[bool, str]]:
    """For each known backend: (usable here, why not / what it is)."""
    out = {}
    for n in names():
        try:
            b = resolve(n)
            out[n] = (True, getattr(b, "description", ""))
        except BackendUnavailableError as e:
            out[n] = (False, str(e))
        except Exception as e:  # a broken third-party backend must not break `chemio info`
            out[n] = (False, f"{type(e).__name__}: {e}")
    return out
