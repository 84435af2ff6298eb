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

and answers ``stat(path)`` (an ``FsInfo``) and ``remove(path)``. Backends are found by name
in the built-in table below, then in the entry-point group ``chemio_py.backends`` (a third
party registers ``name = "package.module:BackendClass"``), and can be added at run time
with ``register(name, factory)``.
"""
from __future__ import annotations

import importlib
import threading
from typing import Any, Callable, Protocol, runtime_checkable

from chemio_py.errors import BackendUnavailableError

ENTRY_POINT_GROUP = "chemio_py.backends"

# name -> "module:attribute" of the backend class, imported on first use.
BUILTIN: dict[str, str] = {
    "local": "chemio_py.backends.local:LocalBackend",
    "shm": "chemio_py.backends.shm:ShmBackend",
    "auto": "chemio_py.backends.auto:AutoBackend",
}

_lock = threading.Lock()
_factories: dict[str, Callable[[], Any]] = {}
_instances: dict[str, Any] = {}


@runtime_checkable
class ByteStore(Protocol):
    path: str

    def pread(self, offset: int, out: Any) -> int: ...
    def pwrite(self, offset: int, data: Any) -> int: ...
    def size(self) -> int: ...
    def truncate(self, n: int) -> None: ...
    def reserve(self, n: int) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


@runtime_checkable
class ArrayStore(Protocol):
    """The data of one DiskArray, opened by ``backend.open_array(path, mode, shape=, dtype=,
    chunks=)``. ``region`` is a tuple of ``slice(start, stop)`` inside ``shape``; ``out`` /
    ``data`` are NumPy arrays of the region's shape and the array's dtype (possibly strided
    views, last axis contiguous). The user layer checks bounds, dtypes and modes, splits
    sections into tasks and synchronises ranks; ``read_all``/``write_all`` may do true
    collective I/O over ``comm`` (default: the independent calls). ``byte_addressable``
    says a write touches only the region's bytes (no read-modify-write of whole chunks).
    Optional: ``read_cached(region, out) -> bool`` fills ``out`` only when that needs no
    device I/O (e.g. every page cached) and says whether it did."""
    path: str
    shape: tuple
    chunks: tuple
    byte_addressable: bool

    def read(self, region: tuple, out: Any) -> Any: ...
    def write(self, region: tuple, data: Any) -> None: ...
    def read_all(self, region: tuple, out: Any, comm: Any = None) -> Any: ...
    def write_all(self, region: tuple, data: Any, comm: Any = None) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


@runtime_checkable
class Backend(Protocol):
    name: str

    def open_bytes(self, path: str, mode: str, **options: Any) -> ByteStore: ...
    def stat(self, path: str) -> Any: ...
    def remove(self, path: str) -> bool: ...
    def root(self, scope: str, rank: int = 0) -> str: ...


def register(name: str, factory: Callable[[], Any], replace: bool = False) -> None:
    """Make ``factory()`` the backend called ``name``."""
    with _lock:
        if not replace and (name in _factories or name in BUILTIN):
            raise ValueError(f"backend {name!r} is already registered; pass replace=True")
        _factories[name] = factory
        _instances.pop(name, None)


def _load(target: str) -> Any:
    mod, _, attr = target.partition(":")
    return getattr(importlib.import_module(mod), attr)


def _entry_points() -> dict[str, Any]:
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
