"""The ``auto`` backend: start in RAM, spill to disk when the RAM budget runs out.

Scratch files of ``auto`` start as shm segments, in the job directory under the shm
directory (``path`` is there). When a write, ``truncate`` or ``reserve`` would pass the
RAM budget of the ``shm`` backend, the store spills: it waits for the requests in flight,
copies the segment to the same job directory and file name under the disk scratch root
(:func:`disk_path`), switches to the disk file, completes the request that did not fit
and removes the segment; the store's ``path`` then names the disk file (a user object
keeps the name it was opened with, and removing that removes the file wherever it is).
The spill is recorded in the
I/O statistics (a row ``<path> (spilled to disk)`` in ``cio.report()``), in
:func:`spills` and as a :class:`SpillWarning`. Files outside a job directory (an explicit
``dir=``) are the caller's to keep and go straight to disk.

A segment opened by several processes (a SharedFile on several ranks) cannot be moved
without them: growing it past the budget raises ``OutOfSpaceError`` saying so. Give such
files a size hint (``soft_limit``) so the decision is taken at creation, or use ``local``.
"""
from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
import warnings
from typing import Any

from chemio_py.backends.local.backend import LocalBackend
from chemio_py.backends.shm.backend import ShmBackend
from chemio_py.backends.shm.budget import RamBudget, ram_budget, shm_dir
from chemio_py.backends.shm.lock import Gate
from chemio_py.errors import ChemIOError, OutOfSpaceError, SpillWarning, fmt_bytes
from chemio_py.runtime import stats
from chemio_py.scratch import fs, jobs

_log = logging.getLogger(__name__)
_spills_lock = threading.Lock()
_spills: list[dict] = []


def spills() -> list[dict]:
    """The spills of this process: path, bytes, seconds, reason (oldest first)."""
    with _spills_lock:
        return [dict(s) for s in _spills]


def _record_spill(path: str, nbytes: int, t0: float, t1: float, reason: str) -> None:
    with _spills_lock:
        _spills.append({"path": path, "bytes": nbytes, "seconds": t1 - t0, "reason": reason,
                        "time": time.time()})
    stats.for_file(f"{path} (spilled to disk)", "auto").record("write", nbytes, t0, t1, 0)
    _log.warning("%s moved from RAM to disk (%d bytes in %.3f s): %s", path, nbytes,
                 t1 - t0, reason)
    warnings.warn(f"chemio: {path} moved from RAM to disk ({nbytes} bytes in "
                  f"{t1 - t0:.3f} s): {reason}", SpillWarning, stacklevel=2)


_PRIVATE_NAME = re.compile(r".+\.(\d+)")


def _in_shm_job_dir(path: str) -> bool:
    d = os.path.dirname(os.path.abspath(path))
    return (os.path.dirname(d) == shm_dir()
            and os.path.basename(d).startswith(jobs.JOB_PREFIX))


def disk_path(path: str) -> str:
    """Where the RAM file ``path`` (in a job directory under the shm directory) goes when it
    spills: the same job directory name and file name under the disk scratch root, which is
    rank N's private root for a per-rank name ``<name>.N``, else the shared root."""
    d, base = os.path.split(os.path.abspath(path))
    m = _PRIVATE_NAME.fullmatch(base)
    root = jobs.private_root(int(m.group(1))) if m else jobs.shared_root()
    return os.path.join(os.path.abspath(root), os.path.basename(d), base)


def ram_path(path: str) -> str | None:
    """The RAM path of the disk path ``path`` of a spilled file, or None (not a job file)."""
    d, base = os.path.split(os.path.abspath(path))
    if not os.path.basename(d).startswith(jobs.JOB_PREFIX):
        return None
    return os.path.join(shm_dir(), os.path.basename(d), base)


def _make_job_dir_for(path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    jobs.job_dir(os.path.dirname(d), os.path.basename(d)[len(jobs.JOB_PREFIX):])


class AutoByteStore:
    """A ByteStore in RAM that moves itself to disk when the RAM budget is exhausted.

    ``path`` is where the bytes are now; ``spilled`` tells whether that is on disk.
    """

    def __init__(self, impl: Any, spilled: bool, writable: bool, disk: str | None = None):
        self.writable = writable
        self.spilled = spilled
        self.disk_path = disk or impl.path
        self._impl = impl
        self._last_path = impl.path
        self._gate = Gate(None)
        self._local = LocalBackend()

    @property
    def path(self) -> str:
        return self._last_path

    @property
    def closed(self) -> bool:
        return self._impl is None

    def _call(self, op: str, *args: Any) -> Any:
        self._gate.enter()
        try:
            impl = self._impl
            if impl is None:
                raise ChemIOError(f"I/O on a closed file {self._last_path!r}")
            return getattr(impl, op)(*args)
        finally:
            self._gate.leave()

    def _growing(self, op: str, *args: Any) -> Any:
        """Run an operation that may allocate; spill and run it again if RAM is short."""
        while True:
            self._gate.enter()
            try:
                impl, spilled = self._impl, self.spilled
                if impl is None:
                    raise ChemIOError(f"I/O on a closed file {self._last_path!r}")
                try:
                    return getattr(impl, op)(*args)
                except OutOfSpaceError as e:
                    if spilled:
                        raise
                    err = e
            finally:
                self._gate.leave()
            self._spill(err)

    def _spill(self, err: OutOfSpaceError) -> None:
        self._gate.enter_excl()
        try:
            if self.spilled or self._impl is None:
                return                      # another thread moved it meanwhile
            seg = self._impl
            if not seg.lock_sole():
                raise OutOfSpaceError(
                    seg.path, err.needed, err.free, what=f"{err.what} (backend 'auto')",
                    hint=(f"the segment is open in other processes too, so it cannot move "
                          f"to disk on its own; give the file a size hint (soft_limit) so it "
                          f"starts on disk, or use backend='local'. RAM: {err.strerror}")
                ) from err
            t0 = time.perf_counter()
            try:
                size = seg.size()
                _make_job_dir_for(self.disk_path)
                disk = self._local.open_bytes(self.disk_path, "w+")
                try:
                    disk.reserve(size)
                    seg.copy_to(disk)
                except BaseException:
                    disk.close()
                    self._local.remove(self.disk_path)
                    raise
            except BaseException:
                seg.unlock_sole()
                raise
            self._impl = disk
            self._last_path = disk.path
            self.spilled = True
            jobs.own(disk.path)
            os.unlink(seg.path)             # openers waiting on it see it gone and retry
            seg.close()
            t1 = time.perf_counter()
        finally:
            self._gate.leave_excl()
        _record_spill(self.disk_path, size, t0, t1,
                      f"{err.what} needed {fmt_bytes(err.needed)} but the RAM budget had "
                      f"{fmt_bytes(err.free)} left")

    # ------------------------------------------------------------ the protocol
    def pread(self, offset: int, out: Any) -> int:
        return self._call("pread", offset, out)

    def pwrite(self, offset: int, data: Any) -> int:
        return self._growing("pwrite", offset, data)

    def truncate(self, n: int) -> None:
        self._growing("truncate", n)

    def reserve(self, n: int) -> None:
        self._growing("reserve", n)

    def size(self) -> int:
        return self._call("size")

    def allocated(self) -> int:
        return self._call("allocated")

    def flush(self) -> None:
        self._call("flush")

    def advise(self, offset: int, length: int, advice: str) -> None:
        self._call("advise", offset, length, advice)

    @property
    def fd(self) -> int:
        return self._impl.fd

    def close(self) -> None:
        if self._impl is None:
            return
        self._gate.enter_excl()
        try:
            impl, self._impl = self._impl, None
            if impl is not None:
                impl.close()
        finally:
            self._gate.leave_excl()

    def __repr__(self) -> str:
        where = "closed" if self._impl is None else ("disk" if self.spilled else "RAM")
        return f"<AutoByteStore {self._last_path!r} ({where})>"


class AutoBackend:
    """Files that start in RAM (``shm``) and move to ``local`` disk when RAM runs short."""

    name = "auto"
    description = "starts in RAM (shm), spills to local disk when the RAM budget runs out"
    resizable_arrays = True

    def __init__(self):
        self._shm = ShmBackend()
        self._local = LocalBackend()

    def check_available(self) -> None:
        self._shm.check_available()

    def root(self, scope: str, rank: int = 0) -> str:
        """The shm directory: files start in RAM."""
        return self._shm.root(scope, rank)

    def _pair(self, path: str) -> tuple[str | None, str]:
        """(RAM path or None, disk path) for a path given in either place."""
        if _in_shm_job_dir(path):
            return os.path.abspath(path), disk_path(path)
        return ram_path(path), os.path.abspath(path)

    def open_bytes(self, path: str, mode: str, *, direct: bool | None = None,
                   **_ignored: Any) -> AutoByteStore:
        if mode not in ("r", "r+", "w+", "x+"):
            raise ValueError(f"mode {mode!r} is not one of ['r', 'r+', 'w+', 'x+']")
        writable = mode != "r"
        opts = {} if direct is None else {"direct": direct}
        if not _in_shm_job_dir(path):               # the caller's own directory: disk
            return AutoByteStore(self._local.open_bytes(path, mode, **opts), True, writable)
        ram, disk = os.path.abspath(path), disk_path(path)   # what _pair gives in a job dir
        if mode in ("r", "r+"):
            for _ in range(100):
                try:
                    seg = self._shm.open_bytes(ram, mode)
                except FileNotFoundError:
                    break
                if os.fstat(seg.fd).st_nlink:
                    return AutoByteStore(seg, False, writable, disk)
                seg.close()                          # it spilled while we waited: retry
            return AutoByteStore(self._local.open_bytes(disk, mode, **opts), True, writable)
        if mode == "x+" and os.path.lexists(disk):
            raise FileExistsError(errno.EEXIST, "file exists (spilled to disk)", disk)
        if mode == "w+":
            self._local.remove(disk)                 # a stale copy that had spilled
        return AutoByteStore(self._shm.open_bytes(ram, mode), False, writable, disk)

    def open_array(self, path: str, mode: str, *, shape: Any, dtype: Any, chunks: Any,
                   reserve: bool = True, perms: int = 0o600, maxshape: Any = None) -> Any:
        """An array store in RAM, or on disk when the array does not fit the RAM budget.

        An array has its full size from creation, so the choice is made then: a new array
        that would pass the budget is created on disk (recorded as a spill of 0 bytes).
        A resizable array (``maxshape``) stays where it was created: growing one in RAM
        past the budget raises ``OutOfSpaceError`` (create it with ``backend="local"``
        when it may outgrow RAM)."""
        kw = dict(shape=shape, dtype=dtype, chunks=chunks, reserve=reserve, perms=perms)
        if maxshape is not None:
            kw["maxshape"] = maxshape
        if not _in_shm_job_dir(path):
            return self._local.open_array(path, mode, **kw)
        ram, disk = os.path.abspath(path), disk_path(path)   # what _pair gives in a job dir
        if mode in ("r", "r+"):
            if os.path.lexists(ram):
                return self._shm.open_array(ram, mode, **kw)
            return self._local.open_array(disk, mode, **kw)
        if mode == "x+" and os.path.lexists(disk):
            raise FileExistsError(errno.EEXIST, "file exists (spilled to disk)", disk)
        self._local.remove(disk)
        t0 = time.perf_counter()
        try:
            return self._shm.open_array(ram, mode, **kw)
        except OutOfSpaceError as err:
            if mode == "x+" and os.path.lexists(ram):
                raise
            _make_job_dir_for(disk)
            store = self._local.open_array(disk, mode, **kw)
            jobs.own(disk)
            _record_spill(disk, 0, t0, time.perf_counter(),
                          f"a new array of {fmt_bytes(err.needed)} does not fit the RAM "
                          f"budget ({fmt_bytes(err.free)} left): created on disk")
            return store

    def exists(self, path: str) -> bool:
        ram, disk = self._pair(path)
        return os.path.lexists(disk) or (ram is not None and os.path.lexists(ram))

    def stat(self, path: str) -> fs.FsInfo:
        """The RAM budget while the file is (or would be) in RAM."""
        ram, disk = self._pair(path)
        return self._shm.stat(ram) if ram is not None else self._local.stat(disk)

    def remove(self, path: str) -> bool:
        """Remove the file wherever it is (RAM, disk after a spill, or both)."""
        ram, disk = self._pair(path)
        on_disk = self._local.remove(disk)
        jobs.disown(disk)
        in_ram = ram is not None and self._shm.remove(ram)
        return in_ram or on_disk

    def budget(self) -> RamBudget:
        return ram_budget()
