"""The ``mpiio`` backend: MPI-IO through mpi4py, for parallel file systems.

Byte files are one ``MPI.File`` (on ``COMM_SELF`` for a private file, on the communicator
of a SharedFile); arrays keep the raw chunk-grid format of ``local`` (``chemio_py.backends.grid``),
so a ``.dra`` written by one backend opens with the other, byte for byte.

What MPI-IO does not do well, the backend does with POSIX on the side (an ``os``
descriptor of the file beside the MPI handles: every rank's for a byte file; for an array
rank 0's, which checked the file for all, and the others' opened by their first
``flush``): files are created by rank 0 with ``O_CREAT|O_EXCL|O_NOFOLLOW`` and mode 0600
(MPI's ``file_perm`` hint is ignored and its modes have no no-follow or truncate) and
MPI-opened without ``MODE_CREATE``; space is reserved with ``fallocate``
(``File.Preallocate`` in ROMIO rewrites the whole range); ``flush`` is a rank-local
``fdatasync``; ``size`` a rank-local ``fstat``.

Semantics (a ``SharedFile`` on ``mpiio``): every rank reads and writes independently with
explicit offsets; what a rank wrote is visible to another rank after the writer's
``flush()`` and a barrier (ROMIO's ``ufs``/``nfs`` drivers cache nothing in the client; on
NFS, or for MPI's own consistency rules, ``sync_all()`` = ``File.Sync``, barrier,
``File.Sync`` on every rank is the portable form).

Facts of the pip ``mpich`` wheel (MPICH 5.0.2, mpi4py 4.1.2) this module works around:
``Iwrite_at``/``Iread_at`` of more than 2,147,479,552 bytes move only that many and report
success (requests are cut into pieces of at most ``PIECE`` bytes and every count is
checked, remainders reissued); MPICH serialises MPI-IO calls of several threads
(``write_streams = 1``; overlap comes from nonblocking and collective calls); after
``Write_all`` the individual file pointer has moved (only explicit offsets are used).
"""
from __future__ import annotations

import errno
import importlib.util
import os
import sys
import threading
import time
import warnings
from typing import Any

import numpy as np

from chemio_py.backends.mpiio import types as mpi_types
from chemio_py.backends.posix import (
    SPACE_ERRNOS,
    ScratchPlaces,
    byte_span,
    bytes_view,
    datasync,
    fallocate_keep_size,
    free_bytes,
    open_checked,
    unlink_regular,
)
from chemio_py.errors import BackendUnavailableError, MetadataError, OutOfSpaceError, StorageError
from chemio_py.runtime import config, finalizers, requests
from chemio_py.scratch import fs

PIECE = 1 << 30                 # largest single MPI-IO transfer issued
# Collective reads of chemio arrays move whole chunk rows (pieces of KiBs at least):
# read data sieving only reads the holes between them too, and read aggregation funnels
# every byte through one aggregator per node. Measured on one node (8192^2 f8, P=2/4,
# cold): column blocks 1.0-1.7 GiB/s with both off vs 0.14-1.05 with ROMIO's automatic
# defaults. Sites with many nodes may turn romio_cb_read back on through mpiio_hints.
DEFAULT_HINTS = {"romio_cb_write": "enable", "romio_ds_write": "disable",
                 "romio_cb_read": "disable", "romio_ds_read": "disable"}
ROMIO_DRIVERS = ("ufs", "nfs", "lustre", "gpfs", "pvfs2", "daos", "xfs", "panfs", "ime",
                 "quobytefs")
_MODES = ("r", "r+", "w+", "x+")
_POLL_MIN, _POLL_MAX = 20e-6, 1e-3          # completion-thread back-off between tests
_warned: list[bool] = []
_MPI: list[Any] = []


def _mpi() -> Any:
    """The mpi4py ``MPI`` module, imported (and MPI initialised) on first use."""
    if not _MPI:
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise BackendUnavailableError("mpiio", f"mpi4py cannot be imported ({e})",
                                          "pip install 'chemio-py[mpi]' (mpi4py + mpich)") from e
        _MPI.append(MPI)
    return _MPI[0]


def _mpi_alive() -> bool:
    MPI = _MPI[0] if _MPI else sys.modules.get("mpi4py.MPI")
    return bool(MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized())


# ---------------------------------------------------------------- hints and drivers

def hints() -> dict[str, str]:
    """The hints every open passes: the defaults, then the ``mpiio_hints`` setting."""
    out = dict(DEFAULT_HINTS)
    out.update({str(k): str(v) for k, v in (config.get("mpiio_hints") or {}).items()})
    return out


def _hint_off(key: str) -> bool:
    """Whether the hint ``key`` is 'disable' in the hints every open passes."""
    return hints().get(key) == "disable"


def _info() -> Any:
    MPI = _mpi()
    info = MPI.Info.Create()
    for k, v in hints().items():
        info.Set(k, v)
    return info


def romio_drivers() -> list[str]:
    """The ROMIO file-system drivers of the installed MPI (``ufs:``, ``lustre:`` prefixes...).

    Found by opening an existing file read-only through each known prefix: a driver that
    is not compiled in fails with another error class than a missing file.
    """
    MPI = _mpi()
    probe = os.path.realpath(sys.executable)
    found = []
    for d in ROMIO_DRIVERS:
        try:
            fh = MPI.File.Open(MPI.COMM_SELF, f"{d}:{probe}", MPI.MODE_RDONLY)
        except MPI.Exception:
            continue
        fh.Close()
        found.append(d)
    return found


# ---------------------------------------------------------------- errors

def _errno_of(MPI: Any) -> dict[int, int]:
    table: dict[int, int] = {}
    for name, err in (("ERR_ACCESS", errno.EACCES), ("ERR_READ_ONLY", errno.EROFS),
                      ("ERR_NO_SUCH_FILE", errno.ENOENT), ("ERR_FILE_EXISTS", errno.EEXIST),
                      ("ERR_IO", errno.EIO), ("ERR_BAD_FILE", errno.EINVAL),
                      ("ERR_FILE_IN_USE", errno.EBUSY), ("ERR_AMODE", errno.EINVAL),
                      ("ERR_UNSUPPORTED_OPERATION", errno.EOPNOTSUPP),
                      ("ERR_UNSUPPORTED_DATAREP", errno.EOPNOTSUPP),
                      ("ERR_NO_SPACE", errno.ENOSPC), ("ERR_QUOTA", errno.EDQUOT),
                      ("ERR_FILE", errno.EBADF)):
        cls = getattr(MPI, name, None)
        if cls is not None:
            table.setdefault(cls, err)
    return table


def mpi_error(e: Any, path: str, offset: int | None, size: int | None, op: str,
              free: int | None = None) -> StorageError:
    """The chemio error for the ``MPI.Exception`` ``e`` of ``op`` on ``path``:
    ``OutOfSpaceError`` for no space / quota, else ``StorageError`` with an errno."""
    MPI = _mpi()
    try:
        cls = e.Get_error_class()
        text = e.Get_error_string().split(",")[0].strip()
    except Exception:
        cls, text = None, str(e)
    err = _errno_of(MPI).get(cls, errno.EIO)
    if err == errno.EIO:
        err = _errno_in(str(e) if cls is None else e.Get_error_string())
    if err in SPACE_ERRNOS:
        if free is None:
            try:
                free = fs.stat(path).free
            except OSError:
                free = None
        return OutOfSpaceError(path, size, free, what=op)
    return StorageError(err, path, offset, size, op, f"MPI-IO: {text}")


def _errno_in(text: str) -> int:
    """The errno whose message ROMIO put in an "Other I/O error" (it reports ENOSPC so)."""
    for err in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS, errno.ENOENT,
                errno.EEXIST, errno.EFBIG, errno.EBADF, errno.EINVAL, errno.ESTALE):
        if os.strerror(err) in text:
            return err
    return errno.EIO


def _no_progress(path: str, fd: int, offset: int, left: int) -> StorageError:
    """The error of a write that moved nothing and reported nothing (ROMIO's ``Iwrite_at``
    on a full file system): out of space when the space is gone, else EIO."""
    free = free_bytes(fd)                # (None for a closed descriptor)
    if free is not None and free < left:
        return OutOfSpaceError(path, left, free, what="write")
    return StorageError(errno.EIO, path, offset, left, "write",
                        "MPI-IO wrote nothing and reported no error")


def _warn_collective_leak(path: str) -> None:
    if not _warned:
        _warned.append(True)
        warnings.warn(f"an mpiio file ({path!r}) opened by several ranks was released without "
                      f"its collective close (interpreter exit, garbage collection or an "
                      f"error path); its MPI handle is left open. Close SharedFiles and "
                      f"DiskArrays on every rank (close() or 'with') to avoid this",
                      RuntimeWarning, stacklevel=3)


# ---------------------------------------------------------------- opening

def _comms(comm: Any) -> tuple[Any, Any]:
    """(chemio Comm to agree on, mpi4py communicator of the file)."""
    MPI = _mpi()
    if comm is None:
        from chemio_py.runtime.comm import SerialComm
        return SerialComm(), MPI.COMM_SELF
    if not hasattr(comm, "agree"):
        from chemio_py.runtime.comm import wrap
        comm = wrap(comm)
    return comm, comm.mpi if comm.mpi is not None else MPI.COMM_SELF


def _create(path: str, mode: str, perms: int) -> int:
    """Create the file (``w+`` replaces a regular file or a link; ``x+`` needs it absent)
    with mode ``perms``, never through a link; returns its descriptor."""
    if mode == "w+":
        unlink_regular(path)
    return open_checked(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode, perms)


def _open_fd(path: str, mode: str) -> int:
    return open_checked(path, os.O_RDONLY if mode == "r" else os.O_RDWR,
                        "r" if mode == "r" else "r+")


def _mpi_open(comm: Any, mpi_comm: Any, path: str, writable: bool) -> Any:
    """``MPI.File.Open`` on ``mpi_comm`` without MODE_CREATE, every rank or none."""
    MPI = _mpi()
    info = _info()
    fh = None
    try:
        with comm.agree(f"MPI-IO open of {path}"):
            try:
                fh = MPI.File.Open(mpi_comm, path,
                                   MPI.MODE_RDWR if writable else MPI.MODE_RDONLY, info)
            except MPI.Exception as e:
                raise mpi_error(e, path, None, None, "MPI-IO open") from e
    except BaseException:
        if fh is not None and mpi_comm == MPI.COMM_SELF:
            fh.Close()
        raise                           # a shared handle of a failed open is left alone
    finally:
        info.Free()
    return fh


# ---------------------------------------------------------------- native asynchrony

class _Op:
    """One native request: its pieces in flight, its count, its first error."""

    __slots__ = ("store", "req", "write", "then", "t0", "left", "count", "error")

    def __init__(self, store: MpiioByteStore, req: requests.NativeRequest, write: bool,
                 then: Any):
        self.store, self.req, self.write, self.then = store, req, write, then
        self.t0 = time.perf_counter()
        self.left = 0
        self.count = 0
        self.error: BaseException | None = None


class _Piece:
    __slots__ = ("op", "offset", "view", "mreq")
    mreq: Any                           # the MPI request while in flight, else None

    def __init__(self, op: _Op, offset: int, view: memoryview):
        self.op, self.offset, self.view, self.mreq = op, offset, view, None


class _Progress:
    """Issues ``Iread_at``/``Iwrite_at`` and completes them from one thread per process.

    The thread (``chemio-io-mpiio``, shared like the I/O pool) tests the MPI requests in
    flight (ROMIO's requests progress only when tested), backing off from 20 µs to 1 ms
    while none completes, and sleeps without touching MPI when none is in flight. A piece
    that moved fewer bytes than asked (the > 2 GiB silent short transfer, a full file
    system, the end of the file) is finished by the blocking calls, from that thread.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._wake = threading.Event()
        self._live: list[_Piece] = []
        self._thread: threading.Thread | None = None

    def submit(self, store: MpiioByteStore, write: bool, offset: int, mv: memoryview, then: Any,
               stats: Any) -> Any:
        req = requests.NativeRequest(stats)         # completed by the progress thread
        op = _Op(store, req, write, then)
        pieces = [_Piece(op, offset + a, mv[a:a + PIECE]) for a in range(0, len(mv), PIECE)]
        if not pieces:                               # zero bytes
            pieces = [_Piece(op, offset, mv)]
        op.left = len(pieces)
        made = None
        with self._lock:
            if self._thread is None:
                self._thread = made = threading.Thread(target=self._run, daemon=True,
                                                       name="chemio-io-mpiio")
            for p in pieces:
                self._issue(p)
                if p.mreq is not None:
                    self._live.append(p)
        if made is not None:
            made.start()        # outside the lock: see ``_Pool.start`` in runtime.pool
        for p in pieces:
            if p.mreq is None:
                self._piece_done(p, 0, op.error)
        self._wake.set()
        return req

    def _issue(self, p: _Piece) -> None:
        MPI = _mpi()
        st = p.op.store
        try:
            fn = st._fh.Iwrite_at if p.op.write else st._fh.Iread_at
            p.mreq = fn(p.offset, [p.view, MPI.BYTE])
        except MPI.Exception as e:
            p.mreq = None
            if p.op.error is None:
                p.op.error = st._error(e, p.offset, len(p.view),
                                       "write" if p.op.write else "read")

    def _run(self) -> None:
        MPI = _mpi()
        st = MPI.Status()
        pause = _POLL_MIN
        while True:
            self._wake.clear()
            with self._lock:
                live = list(self._live)
            if not live:
                self._wake.wait()
                pause = _POLL_MIN
                continue
            moved = False
            for p in live:
                err = None
                try:
                    if not p.mreq.Test(st):
                        continue
                    got = st.Get_count(MPI.BYTE)
                except MPI.Exception as e:
                    got, err = 0, p.op.store._error(e, p.offset, len(p.view),
                                                    "write" if p.op.write else "read")
                moved = True
                self._piece_done(p, got, err)
            if moved:
                pause = _POLL_MIN
            else:
                self._wake.wait(pause)
                pause = min(2 * pause, _POLL_MAX)

    def _piece_done(self, p: _Piece, got: int, err: BaseException | None) -> None:
        op = p.op
        if err is not None and op.error is None:
            op.error = err
        if err is None and got < len(p.view) and op.error is None:
            # Short: the silent > 2 GiB cut, a full file system (a further Iwrite_at
            # there never completes in ROMIO) or the end of the file. The rest goes
            # through the blocking calls, which report errors.
            rest = p.view[got:]
            try:
                if op.write:
                    got += op.store.pwrite(p.offset + got, rest)
                else:
                    got += op.store.pread(p.offset + got, rest)
            except BaseException as e:  # noqa: BLE001 - delivered at wait()
                op.error = e
        op.count += got
        with self._lock:
            if p in self._live:
                self._live.remove(p)
            op.left -= 1
            last = op.left == 0
            self._done.notify_all()
        if last:
            t1 = time.perf_counter()
            if op.error is not None:
                op.req.set_exception(op.error)
                return
            op.req.complete_with(op.then, op.count, op.t0, t1)

    def drain(self, store: MpiioByteStore) -> None:
        """Wait until no request of ``store`` is in flight."""
        if self._thread is threading.current_thread():
            return
        with self._lock:
            while any(p.op.store is store for p in self._live):
                self._done.wait()


_progress: list[_Progress] = []
_progress_lock = threading.Lock()


def _engine() -> _Progress:
    if not _progress:
        with _progress_lock:
            if not _progress:
                _progress.append(_Progress())
    return _progress[0]


os.register_at_fork(after_in_child=_progress.clear)   # the thread belongs to the parent


# ---------------------------------------------------------------- the byte store

class _MpiStore:
    """What both stores do with the ``os`` descriptor each rank keeps beside its MPI
    handles, and on garbage collection (never a collective call: ``close_local``)."""

    _fd: int

    def close_local(self) -> None:
        raise NotImplementedError

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        finalizers.close_later(self.close_local)


class MpiioByteStore(_MpiStore):
    """A byte file as one ``MPI.File`` (see ``chemio_py.backends`` for the protocol).

    Blocking ``Read_at``/``Write_at`` with explicit offsets (loops on the status count);
    ``native_read``/``native_write`` issue ``Iread_at``/``Iwrite_at`` completed by one
    thread per store. ``close()`` is collective over the file's communicator,
    ``close_local()`` never is.
    """

    write_streams = 1

    def __init__(self, path: str, fh: Any, fd: int, writable: bool, comm: Any, mpi_comm: Any):
        MPI = _mpi()
        self.path = path
        self._fh = fh
        self._fd = fd
        self.writable = writable
        self._comm = comm
        self._mpi_comm = mpi_comm
        self._private = mpi_comm == MPI.COMM_SELF
        self._async = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self._native = False            # a native request was ever issued

    @property
    def closed(self) -> bool:
        return self._fh is None

    def _error(self, e: Any, offset: int | None, size: int | None, op: str) -> StorageError:
        free = free_bytes(self._fd)
        return mpi_error(e, self.path, offset, size, op, free)

    def _refuse_write(self) -> None:
        raise StorageError(errno.EBADF, self.path, None, None, "write",
                           "the file is open read-only")

    def pread(self, offset: int, out: Any) -> int:
        """Fill ``out`` from ``offset``; returns the bytes read (fewer only at end of file)."""
        return self._move(False, offset, bytes_view(out, writable=True))

    def pwrite(self, offset: int, data: Any) -> int:
        """Write all of ``data`` at ``offset`` (extending the file); returns its length."""
        if not self.writable:
            self._refuse_write()
        return self._move(True, offset, bytes_view(data, writable=False))

    def _move(self, write: bool, offset: int, mv: memoryview) -> int:
        """Write ``mv`` at ``offset``, or fill it from there, in calls of at most ``PIECE``
        bytes; the bytes moved. A read ends early at end of file; a write that moves
        nothing raises."""
        MPI = _mpi()
        call = self._fh.Write_at if write else self._fh.Read_at
        n, done, st = len(mv), 0, MPI.Status()
        try:
            while done < n:
                k = min(n - done, PIECE)
                call(offset + done, [mv[done:done + k], MPI.BYTE], st)
                got = st.Get_count(MPI.BYTE)
                if got <= 0:
                    if write:
                        raise _no_progress(self.path, self._fd, offset + done, n - done)
                    break
                done += got
        except MPI.Exception as e:
            if write:
                raise self._error(e, offset + done, n - done, "write") from e
            raise self._error(e, offset, n, "read") from e
        return done

    # -------------------------------------------------------------- native asynchrony
    def _engine(self) -> _Progress | None:
        if not self._async or self._fh is None:
            return None
        self._native = True
        return _engine()

    def native_read(self, offset: int, out: Any, then: Any, stats: Any = None) -> Any:
        """Start an ``Iread_at``; the request's value is ``then(count, t0, t1)``. None when
        MPI runs without ``THREAD_MULTIPLE`` (the pool then runs a blocking read)."""
        eng = self._engine()
        if eng is None:
            return None
        return eng.submit(self, False, offset, bytes_view(out, writable=True), then,
                          stats)

    def native_write(self, offset: int, data: Any, then: Any, stats: Any = None) -> Any:
        """Start an ``Iwrite_at`` of all of ``data``; see ``native_read``."""
        if not self.writable:
            self._refuse_write()
        eng = self._engine()
        if eng is None:
            return None
        mv = bytes_view(data, writable=False)
        free = free_bytes(self._fd)
        if free is not None and free < len(mv):
            return None     # ROMIO's Iwrite_at on a full file system never completes
        return eng.submit(self, True, offset, mv, then, stats)

    # -------------------------------------------------------------- size and space
    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def truncate(self, n: int) -> None:
        """Set the size: ``File.Set_size`` for a private file; ``ftruncate`` of this rank's
        descriptor for a shared one (``Set_size`` is collective)."""
        if not self.writable:
            self._refuse_write()
        if self._private:
            MPI = _mpi()
            try:
                self._fh.Set_size(n)
            except MPI.Exception as e:
                raise self._error(e, None, n, "truncate") from e
            return
        try:
            os.ftruncate(self._fd, n)
        except OSError as e:
            raise StorageError(e.errno, self.path, None, n, "truncate") from e

    def reserve(self, n: int) -> None:
        """Allocate blocks for the first ``n`` bytes without changing the size (fallocate on
        this rank's descriptor, never ``File.Preallocate``); free space is checked first."""
        need = n - os.fstat(self._fd).st_blocks * 512
        if need <= 0:
            return
        fs.check_space(self.path, need, what=f"reserve {n} bytes",
                            free=free_bytes(self._fd))
        err = fallocate_keep_size(self._fd, n)
        if err in SPACE_ERRNOS:
            raise OutOfSpaceError(self.path, need, free_bytes(self._fd), what="reserve")
        if err not in (0, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS, errno.EBADF):
            raise StorageError(err, self.path, 0, n, "reserve")

    def flush(self) -> None:
        """Make this rank's writes durable (``fdatasync``; rank-local)."""
        if self.writable:
            datasync(self._fd, self.path)

    def sync_all(self) -> None:
        """Collective: ``File.Sync``, barrier, ``File.Sync``: afterwards every rank sees what
        any rank wrote before, by MPI's consistency rules on any file system."""
        MPI = _mpi()
        try:
            self._fh.Sync()
            self._mpi_comm.Barrier()
            self._fh.Sync()
        except MPI.Exception as e:
            raise self._error(e, None, None, "sync") from e

    # -------------------------------------------------------------- closing
    def _stop_progress(self) -> None:
        if self._native:
            _engine().drain(self)

    def close(self) -> None:
        """Collective over the file's communicator: every rank calls it; idempotent."""
        if self._fh is None:
            return
        self._stop_progress()
        fh, self._fh = self._fh, None
        err = None
        if _mpi_alive():
            MPI = _mpi()
            try:
                fh.Close()
            except MPI.Exception as e:
                err = self._error(e, None, None, "close")
        self._close_fd()
        if err is not None:
            raise err

    def close_local(self) -> None:
        """Release this rank's resources without waiting for other ranks: a private file
        is closed; a shared file's MPI handle is left open (and a warning given once)."""
        if self._fh is None:
            return
        self._stop_progress()
        fh, self._fh = self._fh, None
        if self._private and _mpi_alive():
            try:
                fh.Close()
            except Exception:
                pass
        elif not self._private and _mpi_alive():
            _warn_collective_leak(self.path)
        self._close_fd()


# ---------------------------------------------------------------- the array store

class MpiioArrayStore(_MpiStore):
    """A DiskArray's data in the raw grid format, through MPI-IO.

    ``read``/``write`` are independent: one ``Read_at``/``Write_at`` per region through a
    file view of its pieces and a memory type over the caller's (possibly strided) buffer,
    on a ``COMM_SELF`` handle (views are per handle: calls of several threads take turns,
    which MPICH imposes anyway), opened on this rank's first independent call: a rank
    that only reads and writes collectively never opens it. ``read_all``/``write_all`` are
    collective (``Read_at_all``/``Write_at_all`` at explicit offset 0 of a per-call view,
    on a handle opened on the array's communicator); a rank with an empty region takes
    part with a count of 0. Every derived datatype is freed after its call. The ``os``
    descriptor ``flush`` needs is opened on first use too (rank 0 keeps the one it
    checked the file with).
    """

    byte_addressable = True
    collective = True
    write_streams = 1

    def __init__(self, path: str, fd: int, fc: Any, writable: bool, layout: Any,
                 dtype: Any, comm: Any, mpi_comm: Any, shape: Any = None,
                 maxshape: Any = None):
        MPI = _mpi()
        self.path = path
        self._fd = fd                   # -1 until flush needs it (rank 0: from the open)
        self._fc = fc                   # collective I/O (the array's communicator)
        self._private = mpi_comm == MPI.COMM_SELF
        # independent I/O (COMM_SELF): the same handle for a private store, else opened
        # by this rank's first read/write
        self._fi: Any = fc if self._private else None
        self.writable = writable
        self.layout = layout                       # of the capacity (a resizable array)
        self.shape = layout.shape if shape is None else tuple(int(n) for n in shape)
        self.maxshape = self.shape if maxshape is None else tuple(maxshape)
        self.chunks = layout.chunks
        self.dtype = np.dtype(dtype)
        self._comm = comm
        self._lock = threading.Lock()
        self._sieving: list = []        # COMM_SELF handles with read sieving turned on

    @property
    def closed(self) -> bool:
        return self._fc is None

    @property
    def independent_open(self) -> bool:
        """Whether this rank opened a ``COMM_SELF`` handle of its own for independent I/O
        (a diagnostic: never, for a store used only collectively)."""
        return self._fi is not None and self._fi is not self._fc

    def _independent_handle(self, op: str) -> Any:
        """This rank's ``COMM_SELF`` handle, opened on first use (call with the lock held)."""
        if self._fc is None:
            raise StorageError(errno.EBADF, self.path, None, None, op, "the store is closed")
        if self._fi is None:
            MPI = _mpi()
            info = _info()
            try:
                self._fi = MPI.File.Open(MPI.COMM_SELF, self.path, MPI.MODE_RDWR
                                         if self.writable else MPI.MODE_RDONLY, info)
            except MPI.Exception as e:
                raise mpi_error(e, self.path, None, None, "MPI-IO open") from e
            finally:
                info.Free()
        return self._fi

    def _check(self, region: Any, arr: np.ndarray, write: bool) -> None:
        if write and not self.writable:
            raise StorageError(errno.EBADF, self.path, None, None, "write",
                               "the array store is open read-only")
        want = tuple(s.stop - s.start for s in region)
        if tuple(arr.shape) != want:
            raise ValueError(f"buffer shape {arr.shape} does not match region {want}")

    def _buffer(self, arr: np.ndarray, write: bool) -> tuple[Any, np.ndarray | None]:
        """(flat byte view from ``arr``'s first element, staging copy or None)."""
        base = byte_span(arr, writable=not write)
        if base is not None:
            return base, None
        tmp = np.ascontiguousarray(arr)             # negative or odd strides
        return byte_span(tmp, writable=not write), tmp

    def _short(self, write: bool, got: int, want: int, offset: int | None = None) -> None:
        if got != want:
            hint = "" if write else ("the data file is shorter than the array: it was "
                                     "truncated behind chemio's back")
            raise StorageError(errno.EIO, self.path, offset, want,
                               "write" if write else "read",
                               f"MPI-IO moved {got} of {want} bytes. {hint}".strip())

    def _independent(self, write: bool, region: Any, arr: np.ndarray) -> None:
        self._check(region, arr, write)
        if arr.size == 0:
            return
        MPI = _mpi()
        base, tmp = self._buffer(arr, write)
        strides = (tmp if tmp is not None else arr).strides
        types = mpi_types.region_types(MPI, self.layout, region, strides)
        assert types is not None                    # the region is not empty (arr.size)
        st = MPI.Status()
        try:
            with self._lock:
                fh = self._independent_handle("write" if write else "read")
                try:
                    if not write:
                        self._sieve_reads(fh, self._sieve(region, types))
                    fh.Set_view(0, MPI.BYTE, types.filetype)
                    if write:
                        fh.Write_at(0, [base, 1, types.memtype], st)
                    else:
                        fh.Read_at(0, [base, 1, types.memtype], st)
                except MPI.Exception as e:
                    raise mpi_error(e, self.path, None, types.nbytes,
                                    "write" if write else "read") from e
            self._short(write, st.Get_elements(MPI.BYTE), types.nbytes)
        finally:
            types.free()
        if tmp is not None and not write:
            arr[...] = tmp

    def read(self, region: Any, out: np.ndarray) -> np.ndarray:
        """Fill ``out`` (the region's shape, this array's dtype) from the file; returns it."""
        self._independent(False, region, out)
        return out

    def resize(self, shape: Any, comm: Any = None) -> None:
        """``Resizable.resize``, on every rank of the store's communicator: rank 0 zeroes
        what a shrink leaves in the file outside the new shape (independent writes, then
        synced), then sets the file to the new capacity with its own descriptor (a growth
        checked against the free space and allocated first); every rank then takes the new
        shape. The MPI handles stay open (the file keeps its name and inode)."""
        from chemio_py.backends.grid import Layout, capacity, stale_regions, zero_regions
        new = tuple(int(n) for n in shape)
        lay = Layout(capacity(new, self.chunks, self.maxshape), self.chunks,
                     self.layout.itemsize)
        c = self._comm
        with c.agree(f"resize array {self.path}"):
            if not self.writable:
                raise StorageError(errno.EBADF, self.path, None, None, "resize",
                                   "the array store is open read-only")
            if c.rank == 0:
                old_n, n = self.layout.nbytes, lay.nbytes
                kept = (min(lay.shape[0], self.layout.shape[0]), *self.layout.shape[1:])
                stale = stale_regions(self.shape, new, kept)
                if stale:
                    zero_regions(self.write, stale, self.chunks, self.dtype)
                    with self._lock:
                        if self._fi is not None:
                            self._fi.Sync()
                if self._fd < 0:
                    self._fd = _open_fd(self.path, "r+")
                have = os.fstat(self._fd).st_blocks * 512
                if n > old_n:
                    fs.check_space(self.path, n - have, what=f"grow the array to {n} bytes")
                    err = fallocate_keep_size(self._fd, n)
                    if err in SPACE_ERRNOS:
                        raise OutOfSpaceError(self.path, n - have, free_bytes(self._fd),
                                              what="grow the array")
                try:
                    os.ftruncate(self._fd, n)
                except OSError as e:
                    raise StorageError(e.errno, self.path, None, n, "resize") from e
        self.layout, self.shape = lay, new

    def write(self, region: Any, data: np.ndarray) -> None:
        """Write ``data`` (the region's shape, this array's dtype) into the region."""
        self._independent(True, region, data)

    def _collective(self, write: bool, region: Any, arr: np.ndarray, comm: Any) -> None:
        MPI = _mpi()
        c = self._comm if comm is None else comm
        if not hasattr(c, "agree"):
            from chemio_py.runtime.comm import wrap
            c = wrap(c)
        op = "write_all" if write else "read_all"
        types = tmp = base = None
        try:
            with c.agree(f"prepare {op} of {self.path}"):
                self._check(region, arr, write)
                if self._fc is None:
                    raise StorageError(errno.EBADF, self.path, None, None, op,
                                       "the store is closed")
                if arr.size:
                    base, tmp = self._buffer(arr, write)
                    strides = (tmp if tmp is not None else arr).strides
                    types = mpi_types.region_types(MPI, self.layout, region, strides)
            # Every rank is here: from now on each one makes the same collective calls,
            # whatever fails, and the outcome is agreed at the end.
            fh, err, got, st = self._fc, None, 0, MPI.Status()
            alone = 0               # bytes this rank read on its own (``_read_alone``)
            if types is not None and not write and self._sieve(region, types) \
                    and (self._private or _hint_off("romio_cb_read")):
                try:
                    alone = self._read_alone(region, base, types)
                except (MPI.Exception, StorageError) as e:
                    err, alone = e, -1
            try:
                fh.Set_view(0, MPI.BYTE, types.filetype if types and not alone else MPI.BYTE)
            except MPI.Exception as e:
                err = err or e
            buf = [base, 1, types.memtype] if types and err is None and not alone else \
                [_EMPTY, 0, MPI.BYTE]
            try:
                (fh.Write_at_all if write else fh.Read_at_all)(0, buf, st)
                got = st.Get_elements(MPI.BYTE) + max(alone, 0)
            except MPI.Exception as e:
                err = err or e
            want = types.nbytes if types else 0
            with c.agree(f"{op} of {self.path}"):
                if err is not None:
                    raise mpi_error(err, self.path, None, want, op)
                self._short(write, got, want)
        finally:
            if types is not None:
                types.free()
        if tmp is not None and not write:
            arr[...] = tmp

    # Reads whose pieces cover the file densely but land in memory in short blocks (a
    # chunk's rows in a C-ordered array: 8 KB each with the default chunks) go through
    # ROMIO's data sieving: a few large reads into its buffer (``ind_rd_buffer_size``) and
    # a copy out, instead of one system call per memory block (16,384 ``pread``s of 8 KB
    # for 128 MB). Measured, one rank, cold 128 MB: 0.08-0.13 s of CPU against 0.18-0.21 s;
    # wall time, 2 ranks beside a contiguous ``Read_at_all``: 0.58-1.28x against 0.46-2.06x
    # interleaved at load 5 (the same), 0.76-1.25x against 0.39-0.62x at load 8-9 (other
    # processes on the cores). Sparse regions keep it off: sieving reads their holes too.
    SIEVE_DENSITY = 1.25            # file span / bytes wanted at most this for sieving

    def _sieve(self, region: Any, types: Any) -> bool:
        """Whether a read of ``region`` (its ``types``) is dense in the file and scattered
        in memory, and the user left ``romio_ds_read`` to chemio."""
        if types.mem_contiguous or "romio_ds_read" in (config.get("mpiio_hints") or {}):
            return False
        first, end = self.layout.spans(region, 1, 1 << 62)
        return int(end[-1] - first[0]) <= self.SIEVE_DENSITY * types.nbytes

    def _sieve_reads(self, fh: Any, on: bool) -> None:
        """Turn ROMIO's read sieving of the ``COMM_SELF`` handle ``fh`` on or off (a local
        call on a handle of one process; only when it changes). Call with the lock held."""
        sieving = self._sieving
        if (fh in sieving) == on:
            return
        MPI = _mpi()
        info = MPI.Info.Create()
        try:
            info.Set("romio_ds_read", "enable" if on else "disable")
            fh.Set_info(info)
        finally:
            info.Free()
        if on:
            sieving.append(fh)
        else:
            sieving.remove(fh)

    def _read_alone(self, region: Any, base: Any, types: Any) -> int:
        """This rank's part of a collective read done on its ``COMM_SELF`` handle with
        sieving (read collectives move each rank's bytes independently anyway while
        ``romio_cb_read`` is disabled, the default); returns the bytes read."""
        MPI = _mpi()
        st = MPI.Status()
        with self._lock:
            fh = self._independent_handle("read_all")
            self._sieve_reads(fh, True)
            fh.Set_view(0, MPI.BYTE, types.filetype)
            fh.Read_at(0, [base, 1, types.memtype], st)
        return st.Get_elements(MPI.BYTE)

    def read_all(self, region: Any, out: np.ndarray, comm: Any = None) -> np.ndarray:
        """Collective read over the array's communicator (every rank calls it)."""
        self._collective(False, region, out, comm)
        return out

    def write_all(self, region: Any, data: np.ndarray, comm: Any = None) -> None:
        """Collective write over the array's communicator (every rank calls it)."""
        self._collective(True, region, data, comm)

    def flush(self) -> None:
        """Make this rank's writes durable (``fdatasync``; rank-local)."""
        if not self.writable or self._fc is None:
            return
        with self._lock:
            if self._fd < 0:
                self._fd = _open_fd(self.path, "r+")
            fd = self._fd
        try:
            os.fdatasync(fd)
        except OSError as e:
            raise StorageError(e.errno, self.path, None, None, "flush") from e

    def close(self) -> None:
        """Collective over the array's communicator; idempotent."""
        if self._fc is None:
            return
        with self._lock:
            fi, fc, self._fi, self._fc = self._fi, self._fc, None, None
            self._sieving.clear()
        err = None
        if _mpi_alive():
            MPI = _mpi()
            for fh in (fc, fi) if fi is not None and fi is not fc else (fc,):
                try:
                    fh.Close()
                except MPI.Exception as e:
                    err = err or mpi_error(e, self.path, None, None, "close")
        self._close_fd()
        if err is not None:
            raise err

    def close_local(self) -> None:
        """Release this rank's resources without any collective call (see the module)."""
        if self._fc is None:
            return
        with self._lock:
            fi, fc, self._fi, self._fc = self._fi, self._fc, None, None
            self._sieving.clear()
        if _mpi_alive():
            if fi is not None:
                try:
                    fi.Close()              # on COMM_SELF: a local call
                except Exception:
                    pass
            if fc is not fi:                # on the array's communicator: left open
                _warn_collective_leak(self.path)
        self._close_fd()


_EMPTY = bytearray(0)


# ---------------------------------------------------------------- the backend

class MpiioBackend(ScratchPlaces):
    """MPI-IO (mpi4py) on a local or parallel file system; collective open and close."""

    name = "mpiio"
    description = ("MPI-IO through mpi4py (explicit-offset and collective I/O, ROMIO hints "
                   "from the mpiio_hints setting)")
    collective_open = True
    array_formats = ("grid",)
    resizable_arrays = True

    def check_available(self) -> None:
        try:
            ok = importlib.util.find_spec("mpi4py") is not None and \
                importlib.util.find_spec("mpi4py.MPI") is not None
        except (ImportError, ValueError):
            ok = False
        if not ok:
            raise BackendUnavailableError("mpiio", "mpi4py is not installed",
                                          "pip install 'chemio-py[mpi]' (mpi4py + mpich)")

    def open_bytes(self, path: str, mode: str, *, comm: Any = None) -> MpiioByteStore:
        """Open (``r``, ``r+``) or create (``w+`` replaces, ``x+`` must not exist) a file on
        every rank of ``comm`` together (``None``: this process alone, ``COMM_SELF``)."""
        if mode not in _MODES:
            raise ValueError(f"mode {mode!r} is not one of {list(_MODES)}")
        c, mc = _comms(comm)
        with c.agree(f"create {path}"):
            if c.rank == 0 and mode in ("w+", "x+"):
                os.close(_create(path, mode, 0o600))
        fd = -1
        try:
            with c.agree(f"open {path}"):
                fd = _open_fd(path, mode)
            fh = _mpi_open(c, mc, path, mode != "r")
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        return MpiioByteStore(path, fh, fd, mode != "r", c, mc)

    def open_array(self, path: str, mode: str, *, shape: Any, dtype: Any, chunks: Any,
                   comm: Any = None, perms: int = 0o600, attributes: Any = None,
                   reserve: bool = True, maxshape: Any = None) -> MpiioArrayStore:
        """Open or create an array's data file in the raw grid format on every rank of
        ``comm`` together. ``w+``/``x+``: rank 0 creates it at its full size after a
        free-space check and (``reserve``) allocates its blocks; ``r``/``r+``: the file
        must have exactly the array's size (``MetadataError``)."""
        from chemio_py.backends.grid import Layout, capacity
        if mode not in _MODES:
            raise ValueError(f"mode {mode!r} is not one of {list(_MODES)}")
        dt = np.dtype(dtype)
        layout = Layout(capacity(shape, chunks, maxshape), chunks, dt.itemsize)
        c, mc = _comms(comm)
        create = mode in ("w+", "x+")
        fd = -1
        made = False
        try:
            with c.agree(f"create array {path}"):
                if c.rank == 0 and create:
                    fd = _create_array(path, mode, layout, perms, reserve)
                    made = True
            # Rank 0 alone checks the file for every rank (a regular file, no link, of
            # the array's size): one open per array, not one per rank.
            with c.agree(f"open array {path}"):
                if c.rank == 0 and fd < 0:
                    fd = _open_fd(path, mode)
                    size = os.fstat(fd).st_size
                    if size != layout.nbytes:
                        raise MetadataError(
                            f"data file {path!r} has {size} bytes but the array's metadata "
                            f"(shape {layout.shape}, {dt}) needs {layout.nbytes}; the file "
                            f"was truncated or belongs to another array: restore it or "
                            f"recreate the array")
            fc = _mpi_open(c, mc, path, mode != "r")
        except BaseException:
            if fd >= 0:
                os.close(fd)
            if made:
                try:
                    os.unlink(path)
                except OSError:
                    pass
            raise
        return MpiioArrayStore(path, fd, fc, mode != "r", layout, dt, c, mc, shape, maxshape)


def _create_array(path: str, mode: str, layout: Any, perms: int, reserve: bool) -> int:
    """Rank 0's part of creating an array: the file at its full size, space reserved;
    returns its descriptor (open read-write)."""
    have = 0
    try:
        have = os.stat(path, follow_symlinks=False).st_blocks * 512
    except OSError:
        pass
    fs.check_space(path, layout.nbytes - have, what=f"array of {layout.nbytes} bytes")
    fd = _create(path, mode, perms)
    try:
        try:
            os.ftruncate(fd, layout.nbytes)
        except OSError as e:
            raise StorageError(e.errno, path, None, layout.nbytes, "truncate") from e
        if reserve and layout.nbytes:
            err = fallocate_keep_size(fd, layout.nbytes)
            if err in SPACE_ERRNOS:
                raise OutOfSpaceError(path, layout.nbytes, free_bytes(fd),
                                      what="reserve the array")
    except BaseException:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        raise
    return fd
