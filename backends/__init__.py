"""The device layer (ChemIO's ELIO): the registry of storage backends.

A backend is found by name in the built-in table below, then in the entry-point group
``chemio_py.backends`` (a third party registers ``name = "package.module:BackendClass"``),
and can be added at run time with ``register(name, factory)``; ``resolve(name)`` gives its
one instance of the process. What a backend and its stores must and may provide (the
Protocols, ``Region``, ``Capabilities``, ``capabilities()``) is ``backends/contract.py``;
its names are re-exported here (``chemio_py.backends.ByteStore``, ...).
"""
from __future__ import annotations

import functools
import importlib
import threading
from typing import Any, Callable

from chemio_py.runtime import config
from chemio_py.errors import BackendUnavailableError
from chemio_py.backends.contract import (
    NO_CAPABILITIES, ArrayBackend, ArrayFormats, ArrayOptions, ArrayStore, Availability,
    Backend, BackendCapabilities, ByteAddressable, ByteBackend, ByteStore, CachedRead,
    Capabilities, CollectiveCheck, CollectiveIO, CollectiveOpen, CollectiveRemove,
    CollectiveSync, Compressed, DaskSource, Described, Evict, LocalClose, NativeAsync,
    NativeAsyncMany, NativeRegionRead, NonBlockingRead, OnceIO, PartRead, ReadStreams, Region,
    SelfDescribing, WriteCheck, WriteStreams, array_formats, backend_capabilities,
    capabilities, close_local, description, is_collective, removes_together, require)

__all__ = [
    "ENTRY_POINT_GROUP", "BUILTIN", "register", "unregister", "names", "resolve",
    "availability", "serving",
    # the contract (backends/contract.py)
    "NO_CAPABILITIES", "ArrayBackend", "ArrayFormats", "ArrayOptions", "ArrayStore",
    "Availability", "Backend", "BackendCapabilities", "ByteAddressable", "ByteBackend",
    "ByteStore", "CachedRead", "Capabilities", "CollectiveCheck", "CollectiveIO",
    "CollectiveOpen", "CollectiveRemove", "CollectiveSync", "Compressed", "DaskSource",
    "Described", "Evict", "LocalClose", "NativeAsync", "NativeAsyncMany", "NativeRegionRead",
    "NonBlockingRead", "OnceIO", "PartRead", "ReadStreams", "Region", "SelfDescribing",
    "WriteCheck", "WriteStreams", "array_formats", "backend_capabilities", "capabilities",
    "close_local", "description", "is_collective", "removes_together", "require",
]

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


def serving(kind: type, layout: str | None = None) -> list[str]:
    """Names of the backends usable here that serve ``kind`` (``ByteBackend`` or
    ``ArrayBackend``) and, given ``layout``, read that array format."""
    out = []
    for n in names():
        try:
            be = resolve(n)
        except Exception:
            continue
        if (layout is None or layout in array_formats(be)) and isinstance(be, kind):
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
    check = backend_capabilities(inst).check_available
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
            out[n] = (True, description(b))
        except BackendUnavailableError as e:
            out[n] = (False, str(e))
        except Exception as e:  # a broken third-party backend must not break `chemio info`
            out[n] = (False, f"{type(e).__name__}: {e}")
    return out
