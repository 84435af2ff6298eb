"""Pickling byte files: a file travels as the way to reopen it.

An ``ExclusiveFile``, ``SharedFile`` or ``RecordFile`` pickles as its path, backend, name
and where it was pickled (``chemio_py.scratch.reopen``), never its descriptors, mappings
or locks. ``pickle.loads`` gives, in the process that pickled it and while it is open, the
very same object; anywhere else a *copy*: the file opened again by this process alone,
which never owns it (closing or collecting a copy removes nothing; ``delete()`` of a copy
is refused; the file still goes when its owner removes it or ends). A file that is gone
raises ``StorageError`` (ENOENT) saying so.

* **ExclusiveFile** — private to the process that made it: its copy is **read-only**
  (mode ``r``; the one writer stays that process) and only on the same node (its scratch
  is node-local); elsewhere ``NotSharedError``. It reads the bytes on disk when it reads.
* **RecordFile** — the same as its ExclusiveFile: a read-only copy that replays the
  records of the last commit (``flush()`` before pickling what others must see).
* **SharedFile** — made for every process of the job: its copy is **read/write** (mode
  ``r+``), not collective (a serial communicator: ``close()`` and ``destroy()`` close the
  copy only; the file stays until the creating ranks destroy it), with the same
  ``hard_limit``; mutual exclusion is the application's, as between ranks. On ``shm`` (and
  ``auto``, which starts in RAM) only on the same node; on ``mpiio`` read-only through
  ``local`` (the same bytes; MPI-IO's data sieving could undo another process's write).
"""
from __future__ import annotations

import errno
from typing import Any

import chemio_py.backends as _backends
from chemio_py.errors import NotSharedError, StorageError
from chemio_py.scratch import reopen

READ_THROUGH = {"mpiio": "local"}       # backends a copy reads through another, read-only
NODE_LOCAL = ("shm", "auto")            # backends whose files start in one node's RAM


def state_of(f: Any, kind: str, **extra: Any) -> dict:
    """The pickled state of byte file ``f`` (a ``kind``): path, backend, name, origin,
    token, and ``extra``."""
    return {"kind": kind, "format": reopen.FORMAT, "path": f.path, "backend": f.backend,
            "name": f.name, "origin": reopen.origin(), "token": reopen.token(f), **extra}


def live(state: dict) -> Any:
    """The pickled object itself when this is the process that pickled it and it is open."""
    f = reopen.live(state["origin"], state["token"])
    return f if f is not None and not f.closed else None


def open_copy(state: dict, mode: str, private: bool) -> tuple[Any, str, str, Any]:
    """Open the store of a copy of the pickled file ``state`` in ``mode``: (backend object,
    backend name, mode, store). ``private`` files (ExclusiveFile) are reached on their node
    only; ``mpiio`` files are read through ``local``, read-only."""
    o, kind, name = state["origin"], state["kind"], state["name"]
    if (private or state["backend"] in NODE_LOCAL) and not reopen.same_node(o):
        why = ("is private to the process that made it, in its node's scratch"
               if private else f"lives in the memory of host {o.get('host')!r} "
                               f"(backend {state['backend']!r})")
        here = reopen.origin()["host"]
        raise NotSharedError(
            f"{kind} {name!r} ({state['path']!r}) pickled by {reopen.describe(o)} {why}; this "
            f"process on host {here!r}{' (rebooted since)' if here == o.get('host') else ''} "
            f"cannot reach it. Unpickle it on that node"
            + ("" if private else ", or use backend 'local' on a directory every node mounts"))
    be_name = READ_THROUGH.get(state["backend"], state["backend"])
    if be_name != state["backend"]:
        mode = "r"
    be = _backends.require(_backends.resolve(be_name), be_name, _backends.ByteBackend)
    try:
        store = be.open_bytes(state["path"], mode)
    except OSError as e:
        if e.errno != errno.ENOENT:
            raise
        raise StorageError(
            errno.ENOENT, state["path"], None, None, f"reopen a pickled {kind}",
            f"{kind} {name!r} pickled by {reopen.describe(o)} is not there any more: its "
            f"owner removed it (delete()/destroy(), or the end of its process removed its "
            f"scratch); keep it while other processes use it") from None
    return be, be_name, mode, store
