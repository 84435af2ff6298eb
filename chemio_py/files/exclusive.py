"""Exclusive Access Files: one private, byte-addressable scratch file per process.

``ExclusiveFile("fock", "w+")`` on rank 3 is the file ``fock.3`` in rank 3's scratch job
directory (or in ``dir=``). No other process touches it, so no call is collective.

    >>> import numpy as np, chemio_py as cio
    >>> with cio.ExclusiveFile("demo.eaf", "w+") as f:
    ...     _ = f.write(0, np.arange(4.0))
    ...     f.read(0, np.empty(4))
    array([0., 1., 2., 3.])
"""
from __future__ import annotations

from typing import Any

import chemio_py.backends as _backends
from chemio_py.errors import ModeError
from chemio_py.files import pickling
from chemio_py.files.bytefile import ByteFile, check_mode, check_offset, check_size_hint
from chemio_py.runtime import config, handles
from chemio_py.runtime.comm import comm
from chemio_py.scratch import fs, jobs
from chemio_py.scratch.reopen import check_state


def _locate(name: str, backend: str | None, dir: str | None) -> tuple[Any, str, str]:
    """(backend object, backend name, path) for this rank's file ``name``."""
    jobs.validate_name(name)
    be_name = config.backend_for(name, backend).value
    be = _backends.require(_backends.resolve(be_name), be_name, _backends.ByteBackend)
    rank = comm().rank
    root = None if dir is not None else be.root("private", rank)
    return be, be_name, jobs.private_path(name, rank, dir, root=root)


class ExclusiveFile(ByteFile):
    """One private byte-addressable file of this process.

    Modes: ``r`` read, ``r+`` read/write an existing file, ``w+`` create or truncate,
    ``x+`` create (must not exist). ``size_hint`` reserves that many bytes up front after a
    free-space check (``OutOfSpaceError`` before anything is created). Writing past the end
    extends the file and holes read as zeros; reading past the end raises
    ``EndOfFileError``. Files in the job scratch are removed at exit; files in an explicit
    ``dir`` are the caller's and stay.

    Pickled, it is the way to reopen it: another process on the same node gets a read-only
    copy that never owns the file (``chemio_py.files.pickling``).
    """

    _copy = False                       # a copy unpickled in another process

    def __init__(self, name: str, mode: str = "w+", *, backend: str | None = None,
                 dir: str | None = None, size_hint: int | None = None, direct: bool | None = None):
        check_mode(mode)
        if size_hint is not None:
            size_hint = check_offset(size_hint, "size_hint")
            if mode != "r":                 # (a reservation: not past `ulimit -f`)
                check_size_hint(size_hint, name)
        be, be_name, path = _locate(name, backend, dir)
        if size_hint:
            fs.check_space(path, size_hint, what=f"size_hint of {name!r}")
        options = {} if direct is None else {"direct": direct}
        if mode == "w+":
            handles.supersede(path, f"ExclusiveFile({name!r}, 'w+')")
        try:
            store = be.open_bytes(path, mode, **options)
            if mode in ("w+", "x+"):
                jobs.own(path, be.remove)
            try:
                if size_hint and mode != "r":
                    store.reserve(size_hint)
            except BaseException:
                store.close()
                if mode in ("w+", "x+"):
                    be.remove(path)
                    jobs.disown(path)
                raise
            self.name = name
            self._backend_obj = be
            super().__init__(store, be_name, mode)
        except BaseException:
            handles.abandon(path)           # another thread may create this name now
            raise
        if mode in ("w+", "x+"):
            handles.claim(path, self)

    def delete(self) -> None:
        """Close the file (waiting for its requests) and remove it."""
        path = self.path
        if self._copy:
            raise ModeError(f"ExclusiveFile {self.name!r} ({path!r}) is a read-only copy "
                            f"unpickled in another process than its owner, which alone "
                            f"removes it; close() the copy instead; nothing was removed")
        try:
            self.close()
        finally:
            self._backend_obj.remove(path)
            jobs.disown(path)

    def __reduce__(self) -> tuple:
        """Pickle as the way to reopen the file: in another process on this node a
        read-only copy (``chemio_py.files.pickling``), in this one the file itself."""
        return (reopen, (pickling.state_of(self, "ExclusiveFile"),))

    @staticmethod
    def remove(name: str, *, backend: str | None = None, dir: str | None = None) -> bool:
        """Delete this rank's file ``name`` without opening it; a missing file is fine.

        Returns True when a file was removed.
        """
        be, _, path = _locate(name, backend, dir)
        jobs.disown(path)
        removed: bool = be.remove(path)
        return removed


def reopen(state: dict) -> ExclusiveFile:
    """Unpickle an ExclusiveFile: the file itself in the process that pickled it while it
    is open, else a read-only copy that does not own it (``chemio_py.files.pickling``)."""
    state = check_state(state, "ExclusiveFile")
    alive: ExclusiveFile | None = pickling.live(state)
    if alive is not None:
        return alive
    be, be_name, mode, store = pickling.open_copy(state, "r", private=True)
    f = ExclusiveFile.__new__(ExclusiveFile)
    f.name = state["name"]
    f._backend_obj = be
    f._copy = True
    ByteFile.__init__(f, store, be_name, mode)
    return f
