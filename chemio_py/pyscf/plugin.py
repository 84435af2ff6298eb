"""One switch that puts PySCF's out-of-core scratch on chemio.

    >>> import chemio_py.pyscf
    >>> with chemio_py.pyscf.patch(backend="shm", max_memory=200):
    ...     e_cc = pyscf.cc.CCSD(mf).run().e_tot            # PySCF's own code, unchanged

While enabled (``enable(...)`` ... ``disable()``, or inside ``with patch(...)``):

* ``pyscf.lib.H5TmpFile()`` (and ``pyscf.lib.misc.H5TmpFile``, and the name in every loaded
  module that imported it) makes a scratch ``chemio_py.H5TmpFile`` of ``backend``: PySCF's
  datasets become DiskArrays (``local``, ``shm``, ``auto``, ``mpiio``...). A call with a
  file name (``lib.H5TmpFile(name, 'w')``) still makes PySCF's own h5py file: a named
  file is a contract with code that reopens it by name (``h5py.File(name)``). h5py
  ``File`` keywords (``libver=``...) are ignored. The chemio groups count as
  ``h5py.Group`` for ``isinstance`` (registered once as a virtual subclass; that stays
  after ``disable``, and concerns chemio's groups only).
* ``pyscf.lib.call_in_background`` runs the functions on chemio's I/O pool with PySCF's
  semantics: each returned function first waits for its previous call (an error there is
  raised as ``lib.ThreadRuntimeError``), the ``with`` block's end waits for all of them,
  ``sync=True`` (or PySCF's ``ASYNC_IO = False``) calls them in the caller. A call that
  would take the pool's last free thread runs in the caller instead (a background function
  that does chemio I/O needs pool threads for its own reads).
* ``pyscf.lib.linalg_helper._Xlist`` (the Davidson subspace kept on disk when memory is
  short) keeps its vectors in a chemio ``H5TmpFile``.
* ``max_memory`` (MB, PySCF's unit) sets ``lib.param.MAX_MEMORY``, the default
  ``max_memory`` of PySCF objects made while enabled.

Scratch goes to ``dir`` when given, else to ``PYSCF_TMPDIR``/``lib.param.TMPDIR`` when set
(to anything but PySCF's default, the system temp dir), else to chemio's scratch
(``CHEMIO_SCRATCH``); ``shm`` and ``auto`` keep their data in RAM either way. Under MPI
each rank's files are its own (``COMM_SELF``), as PySCF's are.

**Messages.** While enabled, what chemio logs (``logging.getLogger("chemio_py")`` and below:
spills of ``auto`` to disk, recoveries, backend choices, cleanup) is also written by PySCF's
``lib.logger`` to ``sys.stdout``, as PySCF's own messages are: WARNING and above as
``lib.logger.warn`` (ERROR as ``error``), INFO as ``info``, DEBUG as ``debug``, each shown
when ``verbose`` (``enable``/``patch`` argument; None: PySCF's default, what a new ``Mole``
gets: ``pyscf.__config__.VERBOSE``, else ``logger.NOTE`` = 3) reaches that level
(``logger.WARN`` = 2, ``INFO`` = 4, ``DEBUG`` = 5), so ``verbose=0`` prints nothing. One
handler serves nested ``enable`` calls (the innermost ``verbose`` applies; no message is
printed twice) and goes at the last ``disable``; for ``verbose`` >= 4 the ``chemio_py``
logger's level is lowered to let INFO (>= 5: DEBUG) records through while enabled.
``semi_direct`` writes its own messages to ``lib.logger`` at the SCF object's ``verbose``;
they are not repeated.

``enable`` calls nest: each ``disable`` (or the end of a ``with patch``) puts back exactly
what the matching ``enable`` found. ``usage()`` counts what went through chemio.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

from chemio_py.arrays.container import Group, H5TmpFile
from chemio_py.errors import ArgumentError
from chemio_py.runtime import config, pool

_lock = threading.RLock()
_levels: list["_Level"] = []
_registered: list[bool] = []
_counts = {"h5tmpfiles": 0, "background_calls": 0, "background_inline": 0,
           "prefetch_maps": 0, "xlists": 0}
_busy = [0]                     # background functions running on the pool now


@dataclass
class _Level:
    """What one ``enable`` changed: (object, attribute, value before or _ABSENT)."""
    saved: list = field(default_factory=list)
    original_tmp: Any = None            # PySCF's own H5TmpFile class
    verbose: int = 0                    # lib.logger verbosity of chemio's messages
    log_level: int | None = None        # the chemio_py logger's level before (None: kept)


_ABSENT = object()


def usage() -> dict:
    """How much went through chemio since import: H5TmpFiles made, background calls (and
    those run in the caller), Davidson subspaces."""
    with _lock:
        return dict(_counts)


def enabled() -> bool:
    """True while at least one ``enable`` is in effect."""
    return bool(_levels)


def scratch_dir(dir: Any = None) -> str | None:
    """Where the plug-in's scratch goes: ``dir``, else ``PYSCF_TMPDIR``, else
    ``lib.param.TMPDIR`` when it is not PySCF's default, else None (chemio's scratch)."""
    if dir is not None:
        return os.fspath(dir)
    env = os.environ.get("PYSCF_TMPDIR")
    if env:
        return env
    from pyscf.lib import param
    tmp = getattr(param, "TMPDIR", None)
    if tmp and os.path.abspath(tmp) != os.path.abspath(tempfile.gettempdir()):
        return str(tmp)
    return None


# ---------------------------------------------------------------- what gets installed

def _tmpfile_class(original: Any, backend: str | None, where: str | None,
                   settings: dict) -> type:
    """A stand-in for ``lib.H5TmpFile`` with PySCF's signature."""

    class PySCFH5TmpFile(H5TmpFile):
        """``lib.H5TmpFile`` on chemio (``chemio_py.pyscf.patch``): scratch calls make a
        chemio file, named ones PySCF's h5py file."""

        # PySCF's class calls this through its module's global name
        _gen_unique_name = staticmethod(original._gen_unique_name)

        def __new__(cls, filename: Any = None, mode: str = "a", prefix: str = "",
                    suffix: str = "", dir: Any = None, *args: Any, **kwargs: Any) -> Any:
            if filename is not None:
                return original(filename, mode, prefix, suffix, dir, *args, **kwargs)
            return super().__new__(cls)

        def __init__(self, filename: Any = None, mode: str = "a", prefix: str = "",
                     suffix: str = "", dir: Any = None, *args: Any, **kwargs: Any):
            super().__init__(None, backend=backend, dir=where if dir is None else dir,
                             prefix=prefix, suffix=suffix, **settings)
            with _lock:
                _counts["h5tmpfiles"] += 1

    return PySCFH5TmpFile


class _Ran:
    """A call run in the caller, with a Request's ``wait``: its error comes from ``wait``
    (where PySCF's background calls raise theirs), not at the call."""

    def __init__(self, fn: Any, args: tuple, kwargs: dict):
        self._error: BaseException | None = None
        self._value = None
        try:
            self._value = fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - delivered by wait(), as a thread's would be
            self._error = e

    def wait(self, timeout: float | None = None) -> Any:
        if self._error is not None:
            raise self._error
        return self._value

    def done(self) -> bool:
        return True


def _start(fn: Any, args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)`` on the I/O pool as a Request; in the caller when that would
    take the pool's last free thread (or in sync mode)."""
    with _lock:
        _counts["background_calls"] += 1
        inline = pool.sync_mode() or _busy[0] + 1 >= config.get("io_threads")
        if not inline:
            _busy[0] += 1
        else:
            _counts["background_inline"] += 1
    if inline:
        return _Ran(fn, args, kwargs)

    def run() -> Any:
        try:
            return fn(*args, **kwargs)
        finally:
            with _lock:
                _busy[0] -= 1
    try:
        return pool.submit(run)
    except BaseException:
        with _lock:
            _busy[0] -= 1
        raise


def _background_class(misc: Any) -> type:
    """A stand-in for ``lib.call_in_background`` on chemio's I/O pool."""
    ThreadRuntimeError = misc.ThreadRuntimeError

    class call_in_background:
        """PySCF's ``lib.call_in_background`` (same signature and semantics) running the
        functions on chemio's I/O pool (``chemio_py.pyscf.patch``)."""

        def __init__(self, *fns: Any, **kwargs: Any):
            self.fns = fns
            self.handlers: list[Any] = [None] * len(fns)
            self.sync = kwargs.get("sync", not getattr(misc, "ASYNC_IO", True))

        def _wait(self, i: int) -> None:
            h, self.handlers[i] = self.handlers[i], None
            if h is not None:
                try:
                    h.wait()
                except Exception as e:
                    raise ThreadRuntimeError(f"Error on thread {self}:\n{e}") from e

        def __enter__(self) -> Any:
            if self.sync:
                return self.fns[0] if len(self.fns) == 1 else list(self.fns)

            def async_fn(i: int) -> Any:
                def call(*args: Any, **kwargs: Any) -> Any:
                    self._wait(i)
                    self.handlers[i] = _start(self.fns[i], args, kwargs)
                    return self.handlers[i]
                return call
            fns = [async_fn(i) for i in range(len(self.fns))]
            return fns[0] if len(fns) == 1 else fns

        def __exit__(self, *exc: Any) -> None:
            first: BaseException | None = None
            for i in range(len(self.handlers)):
                try:
                    self._wait(i)
                except BaseException as e:  # noqa: BLE001 - wait for all, raise the first
                    first = first or e
            if first is not None and exc[0] is None:
                raise first

    return call_in_background


def _prefetch_function(misc: Any) -> Any:
    """A stand-in for ``lib.map_with_prefetch`` on chemio's I/O pool: ``func`` of the next
    task runs while the caller uses the result of this one (one call in flight, as
    PySCF's)."""

    def map_with_prefetch(func: Any, *iterables: Any) -> Iterator[Any]:
        with _lock:
            _counts["prefetch_maps"] += 1
        if not getattr(misc, "ASYNC_IO", True):
            for task in zip(*iterables):
                yield func(*task)
            return
        req = None
        try:
            for task in zip(*iterables):
                if req is None:
                    req = _start(func, task, {})
                else:
                    result = req.wait()
                    req = None
                    req = _start(func, task, {})
                    yield result
            if req is not None:
                result, req = req.wait(), None
                yield result
        finally:
            if req is not None:         # the consumer stopped early: let the call end
                try:
                    req.wait()
                except Exception:  # noqa: BLE001 - nobody asked for this result
                    pass
    return map_with_prefetch


def _xlist_class(backend: str | None, dir: str | None, settings: dict) -> type:
    """A stand-in for ``lib.linalg_helper._Xlist``: the vectors in a chemio H5TmpFile."""

    class Xlist(list):
        """PySCF's Davidson subspace on disk, in a chemio ``H5TmpFile``."""

        def __init__(self) -> None:
            self.scr_h5 = H5TmpFile(backend=backend, dir=dir, **settings)
            self.index: list[int] = []     # type: ignore[assignment]  # PySCF's name
            with _lock:
                _counts["xlists"] += 1

        def __getitem__(self, n: Any) -> Any:
            return self.scr_h5[str(self.index[n])]

        def __iter__(self) -> Iterator[Any]:
            return (self[i] for i in range(len(self)))

        def append(self, x: Any) -> None:
            length = len(self.index)
            key = length + 1
            index_set = set(self.index)
            if key in index_set:
                key = set(range(length)).difference(index_set).pop()
            self.index.append(key)
            self.scr_h5[str(key)] = x

        def extend(self, x: Any) -> None:
            for xi in x:
                self.append(xi)

        def __setitem__(self, n: Any, x: Any) -> None:
            self.scr_h5[str(self.index[n])][...] = x

        def __len__(self) -> int:
            return len(self.index)

        def pop(self, index: Any = -1) -> None:
            key = self.index.pop(index)
            del self.scr_h5[str(key)]

    return Xlist


# ---------------------------------------------------------------- messages

_LOGGER = "chemio_py"
FORWARDED = "pyscf_logged"      # a record with this attribute set was written to lib.logger


class _Out:
    """What ``lib.logger``'s functions take: ``verbose`` and ``stdout`` (looked up when a
    message is written, as PySCF's objects do)."""

    def __init__(self, verbose: int):
        self.verbose = verbose

    @property
    def stdout(self) -> Any:
        return sys.stdout


class _ToPySCFLogger(logging.Handler):
    """Writes ``chemio_py`` log records with PySCF's ``lib.logger`` at the innermost
    ``enable``'s ``verbose``."""

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, FORWARDED, False):
            return
        with _lock:
            if not _levels:
                return
            verbose = _levels[-1].verbose
        try:
            from pyscf.lib import logger
            if record.levelno >= logging.ERROR:
                fn = logger.error
            elif record.levelno >= logging.WARNING:
                fn = logger.warn
            elif record.levelno >= logging.INFO:
                fn = logger.info
            else:
                fn = logger.debug
            fn(_Out(verbose), "chemio: %s", record.getMessage())
        except Exception:  # noqa: BLE001 - logging never raises into the caller
            self.handleError(record)


_handler = _ToPySCFLogger()


def _verbosity(verbose: Any, lib: Any) -> int:
    if verbose is None:                 # what gto.Mole.verbose defaults to
        from pyscf import __config__
        return int(getattr(__config__, "VERBOSE", lib.logger.NOTE))
    if isinstance(verbose, bool) or not isinstance(verbose, int) or verbose < 0:
        raise ArgumentError(f"verbose={verbose!r}: give a PySCF verbosity, an integer >= 0 "
                            f"(lib.logger.WARN = 2, INFO = 4, DEBUG = 5) or None for "
                            f"PySCF's default; nothing changed")
    return verbose


def _start_messages(level: _Level, lib: Any) -> None:
    """Route chemio's records to lib.logger for this level (hold ``_lock``)."""
    log = logging.getLogger(_LOGGER)
    need = (logging.DEBUG if level.verbose >= lib.logger.DEBUG else
            logging.INFO if level.verbose >= lib.logger.INFO else None)
    if need is not None and log.getEffectiveLevel() > need:
        level.log_level = log.level
        log.setLevel(need)
    if not _levels:
        log.addHandler(_handler)


def _stop_messages(level: _Level) -> None:
    """Undo ``_start_messages`` of ``level`` (hold ``_lock``; ``level`` already popped)."""
    log = logging.getLogger(_LOGGER)
    if level.log_level is not None:
        log.setLevel(level.log_level)
    if not _levels:
        log.removeHandler(_handler)


# ---------------------------------------------------------------- the switch

def _set(level: _Level, obj: Any, name: str, value: Any) -> None:
    level.saved.append((obj, name, obj.__dict__.get(name, _ABSENT)
                        if isinstance(getattr(obj, "__dict__", None), dict)
                        else getattr(obj, name, _ABSENT)))
    setattr(obj, name, value)


def enable(backend: str | None = None, max_memory: float | None = None, *,
           dir: Any = None, verbose: int | None = None, **settings: Any) -> None:
    """Route PySCF's scratch (``H5TmpFile``, ``call_in_background``, the Davidson
    ``_Xlist``) to chemio and chemio's log messages to ``lib.logger`` at ``verbose``
    (None: PySCF's default verbosity) (module docstring). ``settings`` go to every
    ``H5TmpFile`` (``checksum=True``, backend options). Undo with ``disable()``."""
    try:
        import h5py
        from pyscf import lib
        from pyscf.lib import linalg_helper, misc
    except ImportError as e:
        raise ArgumentError(f"chemio_py.pyscf needs PySCF ({e}); pip install "
                            f"'chemio-py[examples]' (pyscf); nothing changed") from e
    if max_memory is not None and (isinstance(max_memory, bool) or
                                   not isinstance(max_memory, (int, float)) or max_memory <= 0):
        raise ArgumentError(f"max_memory={max_memory!r}: give megabytes (a number > 0), as "
                            f"PySCF's max_memory; nothing changed")
    verbose = _verbosity(verbose, lib)
    if backend is not None:
        import chemio_py.backends as backends
        backends.resolve(backend)       # an unknown or unavailable backend fails here
    where = scratch_dir(dir)
    with _lock:
        if not _registered:
            h5py.Group.register(Group)
            _registered.append(True)
        level = _Level(verbose=verbose)
        level.original_tmp = _levels[0].original_tmp if _levels else misc.H5TmpFile
        original_tmp = level.original_tmp
        original_bg = misc.call_in_background
        original_map = misc.map_with_prefetch
        mapper = _prefetch_function(misc)
        tmp = _tmpfile_class(original_tmp, backend, where, settings)
        bg = _background_class(misc)
        current_tmp = misc.H5TmpFile
        for mod in [m for name, m in list(sys.modules.items())
                    if m is not None and (name == "pyscf" or name.startswith("pyscf."))]:
            d = getattr(mod, "__dict__", {})
            if d.get("H5TmpFile") is current_tmp:
                _set(level, mod, "H5TmpFile", tmp)
            if d.get("call_in_background") is original_bg:
                _set(level, mod, "call_in_background", bg)
            if d.get("map_with_prefetch") is original_map:
                _set(level, mod, "map_with_prefetch", mapper)
        _set(level, linalg_helper, "_Xlist", _xlist_class(backend, where, settings))
        if max_memory is not None:
            _set(level, lib.param, "MAX_MEMORY", max_memory)
        _start_messages(level, lib)
        _levels.append(level)


def disable() -> None:
    """Undo the latest ``enable``: every name it changed gets back the value it had (a
    name that was absent is removed). Does nothing when none is in effect."""
    with _lock:
        if not _levels:
            return
        level = _levels.pop()
        for obj, name, old in reversed(level.saved):
            if old is _ABSENT:
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass
            else:
                setattr(obj, name, old)
        _stop_messages(level)


@contextlib.contextmanager
def patch(backend: str | None = None, max_memory: float | None = None, *, dir: Any = None,
          verbose: int | None = None, **settings: Any) -> Iterator[None]:
    """``enable(...)`` for the ``with`` block, ``disable()`` at its end (errors too)."""
    enable(backend, max_memory, dir=dir, verbose=verbose, **settings)
    depth = len(_levels)
    try:
        yield
    finally:
        with _lock:
            while len(_levels) >= depth:      # levels a body left enabled go too
                disable()
