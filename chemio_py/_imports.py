"""Import-system glue, the one place that knows where modules used to be.

* Module paths from before the package was grouped by concept (``chemio_py.diskarray``,
  ``chemio_py.backends.zarr_v3``, ...) still import: they name the same module object as
  the new path (not a copy). ``chemio_py.comm`` is not among them: that name is the
  ``comm()`` function of the package face.
* In a source checkout used without an install, ``chemio_py.backends`` is found in the
  checkout's ``backends/`` folder, as the installed layout places it.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType

MOVED = {
    "chemio_py.config": "chemio_py.runtime.config",
    "chemio_py.rankguard": "chemio_py.runtime.rankguard",
    "chemio_py.handles": "chemio_py.runtime.handles",
    "chemio_py.ownfiles": "chemio_py.runtime.ownfiles",
    "chemio_py.progress": "chemio_py.runtime.progress",
    "chemio_py.reprs": "chemio_py.runtime.reprs",
    "chemio_py.requests": "chemio_py.runtime.requests",
    "chemio_py.stats": "chemio_py.runtime.stats",
    "chemio_py.safejson": "chemio_py.runtime.safejson",
    "chemio_py.bytefile": "chemio_py.files.bytefile",
    "chemio_py.exclusive": "chemio_py.files.exclusive",
    "chemio_py.shared": "chemio_py.files.shared",
    "chemio_py.records": "chemio_py.files.records",
    "chemio_py.diskarray": "chemio_py.arrays.diskarray",
    "chemio_py.sections": "chemio_py.arrays.sections",
    "chemio_py.meta": "chemio_py.arrays.meta",
    "chemio_py.interop": "chemio_py.arrays.interop",
    "chemio_py.check": "chemio_py.tools.check",
    "chemio_py.listing": "chemio_py.tools.listing",
    "chemio_py.trace_view": "chemio_py.tools.trace_view",
    "chemio_py.layout": "chemio_py.backends.grid",
    "chemio_py.boxes": "chemio_py.backends.boxes",
    "chemio_py.backends.linux_aio": "chemio_py.backends.local.linux_aio",
    "chemio_py.backends.shm_lock": "chemio_py.backends.shm.lock",
    "chemio_py.backends.shm_map": "chemio_py.backends.shm.mapping",
    "chemio_py.backends.ram_budget": "chemio_py.backends.shm.budget",
    "chemio_py.backends.mpi_types": "chemio_py.backends.mpiio.types",
    "chemio_py.backends.zarr_v3": "chemio_py.backends.zarr.backend",
    "chemio_py.backends.zarr_format": "chemio_py.backends.zarr.format",
    "chemio_py.backends.zarr_exchange": "chemio_py.backends.zarr.exchange",
}

_HERE = os.path.dirname(os.path.abspath(__file__))
_CHECKOUT_BACKENDS = os.path.join(os.path.dirname(_HERE), "backends")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old module paths, and the checkout's backends when nothing else does."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        if fullname == "chemio_py.backends" \
                and not os.path.isdir(os.path.join(_HERE, "backends")) \
                and os.path.isfile(os.path.join(_CHECKOUT_BACKENDS, "__init__.py")):
            return importlib.util.spec_from_file_location(
                fullname, os.path.join(_CHECKOUT_BACKENDS, "__init__.py"),
                submodule_search_locations=[_CHECKOUT_BACKENDS])
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """The module was run under its own name already."""


def moved_module(name: str) -> ModuleType:
    """``chemio_py.<name>`` for a module that moved (``cio.stats``, ``cio.requests``, ...):
    the package face's ``__getattr__``, so attribute access finds them as before."""
    if f"chemio_py.{name}" in MOVED:
        return importlib.import_module(f"chemio_py.{name}")
    raise AttributeError(f"module 'chemio_py' has no attribute {name!r}")


def moved_name(module: str, name: str, target: str) -> object:
    """``name`` of ``module`` that now lives in ``target`` (the module's ``__getattr__``)."""
    mod = importlib.import_module(target)
    if name.startswith("__") or not hasattr(mod, name):
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    return getattr(mod, name)


def install() -> None:
    """Put the finder last on ``sys.meta_path`` (once): every real location wins."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
