"""Shared Files: one scratch file that every process of the job reads and writes.

Creation, ``close()``, ``sync()`` and ``destroy()`` are collective; ``read``/``write``/
``aread``/``awrite``/``size``/``flush`` are not. Mutual exclusion is the application's (see
``chemio_py.sync``)::

    sf = cio.SharedFile("ci.vectors", soft_limit=n * 8 * nproc)     # every rank
    sf.write(rank * n * 8, block); sf.flush(); cio.comm().barrier()
    sf.read(other * n * 8, out)
    sf.destroy()                                                    # every rank

The file is ``<name>.sf`` (``<name>.g<R>.sf`` for a sub-communicator whose rank 0 is world
rank R) in rank 0's job directory under the backend's shared root: for
``local`` the shared scratch (``CHEMIO_SHARED_SCRATCH``, default the first ``CHEMIO_SCRATCH``
entry), for ``shm`` the shm directory (all ranks on one node). Rank 0 creates it
(replacing a stale file of that name) and writes a random token into a side file beside
it; every other rank opens the same path and checks the token, so a node-local directory
fails at creation with a clear error instead of giving each node its own file. A failure
on any rank during creation raises on every rank (``CollectiveError`` carrying that rank's
reason on the others), and every rank undoes what it made (the one creation protocol,
``chemio_py.runtime.collective``).
Rank 0 owns the file: ``destroy()`` or the end of rank 0's process removes it.
"""
from __future__ import annotations

import os
import socket
import threading
from typing import Any

import chemio_py.backends as _backends
from chemio_py.errors import ArgumentError, LimitExceededError, NotSharedError, OutOfSpaceError
from chemio_py.files import pickling
from chemio_py.files.bytefile import ByteFile, check_offset
from chemio_py.runtime import config, reprs, requests
from chemio_py.runtime.collective import Creation
from chemio_py.runtime.comm import Comm, SerialComm, resolve as _resolve_comm
from chemio_py.scratch import fs, jobs
from chemio_py.scratch.reopen import check_state

SUFFIX = ".sf"
GROW_STEP = 8 << 20          # reservation grows ahead of the writes by at least this much
_TOKEN_BYTES = 16
_TOKEN_SUFFIX = ".token"      # side file proving that every rank sees rank 0's directory



def _opt_size(value: Any, what: str, minimum: int = 0) -> int | None:
    if value is None:
        return None
    v = check_offset(value, what)
    if v < minimum:
        raise ArgumentError(f"{what} must be >= {minimum} bytes, got {v}")
    return v


def _round_up(n: int, q: int) -> int:
    return -(-n // q) * q


class _Making(Creation):
    """The creation of one SharedFile, in the steps of ``runtime.collective``: rank 0 makes
    the file (replacing a stale one of the same name), reserves the soft limit before
    anyone else opens it and writes a random token into a side file of the same directory;
    every other rank proves it reads that token, then opens the file."""

    def __init__(self, c: Comm, name: str, hard_limit: Any, soft_limit: Any,
                 request_size: Any, backend: str | None):
        super().__init__(c, f"SharedFile({name!r})", f"SharedFile({name!r}) creation")
        self.name = name
        self.args = (hard_limit, soft_limit, request_size, backend)
        self.store: Any = None
        self.tokened = False            # rank 0 wrote the token file (it removes it)

    def check(self) -> tuple:
        hard_limit, soft_limit, request_size, backend = self.args
        jobs.validate_name(self.name)
        self.hard = hard = _opt_size(hard_limit, "hard_limit")
        self.soft = soft = _opt_size(soft_limit, "soft_limit")
        self.req = req = _opt_size(request_size, "request_size", minimum=1)
        if soft is not None and hard is not None and soft > hard:
            raise ArgumentError(f"soft_limit ({soft} bytes) is larger than hard_limit "
                                f"({hard} bytes); the soft limit is the expected size "
                                f"and must not pass the hard limit")
        self.be_name = config.backend_for(self.name, backend).value
        self.be = _backends.require(_backends.resolve(self.be_name), self.be_name,
                                    _backends.ByteBackend)
        self.vet = _backends.backend_capabilities(self.be).check_collective  # shm: one node
        self.together = _backends.is_collective(self.be)
        reserve = 0 if soft is None else _round_up(soft, req or 1)
        self.reserve = reserve if hard is None else min(reserve, hard)
        return (self.name, hard, soft, req, self.be_name)

    def explain(self, mine: tuple, first: tuple) -> str:
        return (f"rank {self.comm.rank} asked for SharedFile{_fmt_spec(mine)} but rank 0 for "
                f"SharedFile{_fmt_spec(first)}; every rank must pass the same name, limits, "
                f"request_size and backend")

    def make(self) -> tuple[str, bytes]:
        be, name = self.be, self.name
        path = os.path.join(jobs.job_dir(be.root("shared")), name + _group_tag(self.comm) + SUFFIX)
        if self.reserve:
            fs.check_space(path, self.reserve, what=f"soft_limit of shared file {name!r}")
        self.supersede(path, f"SharedFile({name!r})")
        be.remove(path)
        if not self.together:
            self._opened(be.open_bytes(path, "x+"), path, created=True)
            self.adopt((path, b""))
        token = b""
        if self.comm.size > 1:
            token = os.urandom(_TOKEN_BYTES)
            self.tokened = True
            self.on_failure(lambda: self._remove_token(path))
            _write_token(be, path + _TOKEN_SUFFIX, token)
        return path, token

    def join(self, made: tuple[str, bytes]) -> None:
        path, token = made
        self.supersede(path, f"SharedFile({self.name!r})")
        _see_token(self.be, path, token, self.comm, self.host0)
        if not self.together:
            self._opened(self.be.open_bytes(path, "r+"), path, created=False)

    def open_together(self, made: tuple[str, bytes]) -> None:
        store = self.be.open_bytes(made[0], "x+", comm=self.comm)
        self._opened(store, made[0], created=self.comm.rank == 0)

    def adopt(self, made: tuple[str, bytes]) -> None:
        jobs.own(made[0], self.be.remove)
        if self.reserve:
            self.store.reserve(self.reserve)

    def finishing(self, made: tuple[str, bytes]) -> bool:
        return self.comm.size > 1

    def finish(self, made: tuple[str, bytes]) -> None:
        if self.comm.rank == 0:
            self._remove_token(made[0])

    def _opened(self, store: Any, path: str, created: bool) -> None:
        """Keep ``store``; on failure close it and, where this rank ``created`` the file,
        remove it."""
        self.store = store
        if created:
            self.on_failure(lambda: self._unmake(path))
        self.on_failure(lambda: _backends.close_local(store))

    def _unmake(self, path: str) -> None:
        self.be.remove(path)
        jobs.disown(path)

    def _remove_token(self, path: str) -> None:
        if self.tokened:
            self.tokened = False
            _drop_token(self.be, path + _TOKEN_SUFFIX)


class SharedFile(ByteFile):
    """One byte-addressable scratch file shared by all ranks of ``comm``.

    Collective to create. A new file is empty; unwritten bytes read as zero; reading past
    the current end raises ``EndOfFileError``; a write that would end past ``hard_limit``
    raises ``LimitExceededError`` and writes nothing. The size grows as any rank writes past
    it; ``size`` is the file's current size as every rank sees it.

    Hints change speed, never results:

    * ``soft_limit`` — the expected final size. After a free-space check
      (``OutOfSpaceError`` up front, nothing created) that many bytes are preallocated
      without changing the size, so writes land in reserved blocks.
    * ``request_size`` — the typical request in bytes. The preallocation is rounded up to a
      whole number of requests, and when writes pass the preallocated region the
      reservation grows ahead of them in whole requests (at least 8 MiB at a time, never
      past ``hard_limit``) so that extending writes do not allocate block by block.

    With neither hint the file is a plain sparse file. ``with SharedFile(...) as sf:``
    destroys the file (collectively) at the end of the block.

    Pickled, it is the way to reopen it: another process gets a read/write copy that is
    not collective and never removes the file (``chemio_py.files.pickling``).
    """

    def __init__(self, name: str, *, hard_limit: int | None = None,
                 soft_limit: int | None = None, request_size: int | None = None,
                 backend: str | None = None, comm: Any = None):
        mk = _Making(_resolve_comm(comm), name, hard_limit, soft_limit, request_size, backend)
        path, _ = mk.run()
        self.name = name
        self.hard_limit = mk.hard
        self.soft_limit = mk.soft
        self.request_size = req = mk.req
        self.comm: Comm = mk.comm
        self._backend_obj = mk.be
        self._reserved = mk.reserve
        self._grow = mk.soft is not None or req is not None
        self._grow_step = _round_up(max(GROW_STEP, req or 1), req or 1)
        self._grow_lock = threading.Lock()
        self._replaced = False
        self._destroyed = False
        self._sf_path: str = path

        def build() -> SharedFile:
            ByteFile.__init__(self, mk.store, mk.be_name, "r+")
            return self
        mk.claim(path, build)

    def __reduce__(self) -> tuple:
        """Pickle as the way to reopen the file: in another process a read/write copy, not
        collective, that never removes it (``chemio_py.files.pickling``); in this one the
        file itself."""
        return (reopen, (pickling.state_of(self, "SharedFile", hard_limit=self.hard_limit,
                                           soft_limit=self.soft_limit,
                                           request_size=self.request_size),))

    def _supersede(self, reason: str) -> list[BaseException]:
        self._replaced = True           # its destroy() must not remove the new file
        return super()._supersede(reason)

    # ------------------------------------------------------------ limits and layout
    _limited = True

    def _before_write(self, offset: int, nbytes: int) -> None:
        end = offset + nbytes
        if self.hard_limit is not None and end > self.hard_limit:
            raise LimitExceededError(
                f"write of {nbytes} bytes at offset {offset} would end at byte {end}, past the "
                f"hard limit of {self.hard_limit} bytes of shared file {self.path!r}; nothing "
                f"was written. Create the file with a larger hard_limit")
        if self._grow and end > self._reserved:
            self._grow_to(end)

    def _grow_to(self, end: int) -> None:
        with self._grow_lock:
            if end <= self._reserved:
                return
            target = _round_up(end, self._grow_step)
            if self.hard_limit is not None:
                target = min(target, self.hard_limit)
            try:
                self._open_store().reserve(target)
            except OutOfSpaceError:
                pass            # only a hint: the write itself reports a real lack of space
            self._reserved = target

    @property
    def reserved(self) -> int:
        """Bytes preallocated so far, as far as this rank knows (0 without hints)."""
        return self._reserved

    def truncate(self, n: int) -> None:
        """Set the size to ``n`` bytes (not collective; ``hard_limit`` holds)."""
        n = check_offset(n, "size")
        if self.hard_limit is not None and n > self.hard_limit:
            raise LimitExceededError(
                f"truncate to {n} bytes passes the hard limit of {self.hard_limit} bytes of "
                f"shared file {self.path!r}; nothing was changed")
        super().truncate(n)

    # ------------------------------------------------------------ lifetime
    def sync(self) -> None:
        """Collective: wait for this rank's requests and make every rank's writes done
        before the call durable and visible to every rank after it (MPI-IO's
        sync-barrier-sync; ``flush`` and a barrier on the other backends)."""
        c = self.comm
        c.begin(f"SharedFile({self.name!r}).sync()")
        with c.agree(f"SharedFile({self.name!r}).sync()"):
            store = self._open_store()
            err = requests.failure(self.path, self._pending.drain())
            if err is not None:
                raise err
        sync_all = self._caps.sync_all
        if sync_all is not None:
            sync_all()                  # collective inside the store (MPI File.Sync)
        else:
            with c.agree(f"SharedFile({self.name!r}).sync()"):
                store.flush()

    def destroy(self) -> None:
        """Collective: every rank closes the file (waiting for its requests), then rank 0
        removes it; when it returns the file is gone for every rank. An error of an
        outstanding request on any rank raises on every rank, and the file is removed all
        the same. Calling it again does nothing."""
        if self._destroyed:
            return
        self._destroyed = True
        c = self.comm
        path = self.path
        if c.broken is not None:            # out of step: no collective can complete
            self._release()
            return
        c.begin(f"SharedFile({self.name!r}).destroy()")   # every rank is here before removal
        try:
            self.close()
        finally:
            with c.agree(f"SharedFile({self.name!r}).destroy()"):
                if c.rank == 0 and not self._replaced:
                    jobs.disown(path)
                    self._backend_obj.remove(path)

    def close(self) -> None:
        """Collective: every rank waits for its requests and closes its handle; the file
        stays until ``destroy()``. An error of an outstanding request on any rank raises
        on every rank. Idempotent (a handle closed already takes no part)."""
        if self._store is None:
            return
        if self.comm.broken is not None:
            self._release()
            return
        self.comm.begin(f"SharedFile({self.name!r}).close()")
        with self.comm.agree(f"SharedFile({self.name!r}).close()"):
            super().close()

    @property
    def path(self) -> str:
        return self._sf_path

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def __repr__(self) -> str:
        state = "destroyed" if self._destroyed else ("closed" if self.closed else "open")
        size = self._size_or_none()
        shown = "" if size is None else f" size={size}"
        return (f"<SharedFile {self.name!r} {state}{shown} path={self.path!r} "
                f"ranks={self.comm.size} backend={self.backend}>")

    def _html_rows(self) -> list[tuple[str, object]]:
        rows = super()._html_rows()
        if self._destroyed:
            rows[3] = ("state", "destroyed")
        return rows + [("ranks", self.comm.size),
                       ("hard limit", reprs.size_text(self.hard_limit)
                        if self.hard_limit is not None else "none"),
                       ("soft limit", reprs.size_text(self.soft_limit)
                        if self.soft_limit is not None else "none"),
                       ("reserved", reprs.size_text(self._reserved))]


def reopen(state: dict) -> SharedFile:
    """Unpickle a SharedFile: the file itself in the process that pickled it while it is
    open, else a copy opened by this process alone (``chemio_py.files.pickling``): mode
    ``r+`` (``r`` for ``mpiio``), the same limits, ``close()``/``destroy()`` close the copy
    only."""
    state = check_state(state, "SharedFile")
    alive: SharedFile | None = pickling.live(state)
    if alive is not None:
        return alive
    be, be_name, mode, store = pickling.open_copy(state, "r+", private=False)
    f = SharedFile.__new__(SharedFile)
    f.name = state["name"]
    f.hard_limit = state["hard_limit"]
    f.soft_limit = state["soft_limit"]
    f.request_size = state["request_size"]
    f.comm = SerialComm()
    f._backend_obj = be
    f._reserved = 0
    f._grow = False                     # the creating ranks reserve; a copy only writes
    f._grow_step = GROW_STEP
    f._grow_lock = threading.Lock()
    f._replaced = True                  # not the owner: destroy() never removes the file
    f._destroyed = False
    f._sf_path = state["path"]
    ByteFile.__init__(f, store, be_name, mode)
    return f


def _group_tag(c: Comm) -> str:
    """``""`` for the whole job; ``.g<world rank of rank 0>`` for a sub-communicator, so
    that task groups creating the same name at once get files of their own."""
    if c.mpi is None:
        return ""
    from mpi4py import MPI
    if MPI.Comm.Compare(c.mpi, MPI.COMM_WORLD) in (MPI.IDENT, MPI.CONGRUENT):
        return ""
    return f".g{MPI.COMM_WORLD.Get_rank()}"


def _write_token(be: Any, tpath: str, token: bytes) -> None:
    be.remove(tpath)
    ts = be.open_bytes(tpath, "x+")
    jobs.own(tpath)
    try:
        ts.pwrite(0, token)
        ts.flush()                     # visible to other clients (NFS close-to-open)
    finally:
        ts.close()


def _drop_token(be: Any, tpath: str) -> None:
    jobs.disown(tpath)
    be.remove(tpath)


def _see_token(be: Any, path: str, token: bytes, c: Comm, host0: str) -> None:
    """On a rank other than 0: ``NotSharedError`` unless rank 0's token is readable beside
    ``path`` here, i.e. this rank sees the same directory."""
    here = f"rank {c.rank} on host {socket.gethostname()!r}"
    fix = ("set CHEMIO_SHARED_SCRATCH to a directory on a file system that every rank "
           "mounts (NFS, Lustre, GPFS, BeeGFS...)")
    try:
        ts = be.open_bytes(path + _TOKEN_SUFFIX, "r")
    except FileNotFoundError:
        raise NotSharedError(
            f"{here} cannot see the shared file {path!r} that rank 0 created on host "
            f"{host0!r}: the shared scratch directory is not shared by all ranks "
            f"(node-local?); {fix}") from None
    try:
        got = bytearray(len(token) + 1)
        n = ts.pread(0, got)
    finally:
        ts.close()
    if bytes(got[:n]) != token:
        raise NotSharedError(
            f"{here} opened {path!r} but found a different file than the one rank 0 "
            f"created on host {host0!r}: the shared scratch directory is node-local; "
            f"{fix}")


def _fmt_spec(spec: tuple) -> str:
    name, hard, soft, req, be = spec
    return (f"({name!r}, hard_limit={hard}, soft_limit={soft}, request_size={req}, "
            f"backend={be!r})")
