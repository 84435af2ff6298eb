"""Pickling DiskArrays: an array travels as the way to reopen it.

``pickle.dumps(d)`` holds the array's data path, metadata path, backend, mode, name,
shape, dtype and chunks, the uuid of its metadata and where it was pickled
(``chemio_py.scratch.reopen``), never its store, mappings, descriptors or locks. A view
(``d.view[...]``) pickles as its array and its key, so the same rules hold for the array
inside it. ``pickle.loads`` gives:

* **in the process that pickled it, while that handle is open:** the very same handle;
* **anywhere else** (a ``dask.distributed`` worker process, a ``multiprocessing`` child,
  another job, or this process after the handle was closed): a ``Reopened`` DiskArray. It
  opens nothing until it is used (a dask scheduler that only passes the graph on never
  touches the file; shape, dtype, chunks, name, path and mode come from the pickle), then
  opens the array by its path, in this process alone (a serial communicator: never a
  collective call, even in a process that an MPI launcher started), in the pickled
  handle's mode, after checking that it is the array that was pickled (the uuid of its
  metadata). The copies of one array in one process share one handle while any of them
  is in use; each copy checks at its first use, with one ``stat``, that the metadata was
  not replaced or removed since. ``close()`` of a copy lets go of that handle (it closes
  when no copy uses it); it never removes anything.

Modes. A handle opened ``r`` gives read-only copies. A handle opened ``r+`` gives
writable copies: whoever pickles a writable handle hands out the right to write, as
``DiskArray.from_dask`` does to the workers that store the blocks. Independent writers in
several processes are as safe as chemio's independent writes: disjoint sections on
``local``, ``shm`` and ``auto`` (byte-exact writes), on ``zarr`` (a write that covers part
of a storage object locks that object against every other process, ``lock=None``), and
with ``checksum=True`` (each CRC entry is locked the same way). Writers of the same
elements at the same time leave one of the values. ``mpiio`` arrays are read in another
process through ``local`` (the same raw grid format, no MPI in the worker) and
**read-only**: an MPI-IO handle belongs to the ranks that opened it together, and MPI-IO's
data sieving rewrites whole file ranges, which could undo a worker's write.

Scratch arrays (``persistent=False``) live in the job's shared scratch directory as long
as their creator's handle: a copy is never their owner (closing or collecting it removes
nothing; the creator's ``close()`` and cleanup still do), and a copy used after they are
gone raises a ``StorageError`` (ENOENT) that says so. ``shm`` arrays (and ``auto`` scratch
arrays, which start in RAM) live in one node's memory: used on another host (or after a
reboot) a copy raises ``NotSharedError``. A path that holds another array now (the name
was created again) raises ``MetadataError``.
"""
from __future__ import annotations

import errno
import math
import os
import threading
import weakref
from typing import Any

import numpy as np

from chemio_py.arrays.diskarray import DiskArray
from chemio_py.errors import ChemIOError, MetadataError, ModeError, NotSharedError, StorageError
from chemio_py.runtime.comm import SerialComm
from chemio_py.scratch import reopen

KIND = "DiskArray"
READ_THROUGH = {"mpiio": "local"}       # backends read in another process through another
NODE_LOCAL = ("shm",)                   # backends whose arrays live in one node's RAM

_lock = threading.RLock()              # reentrant: a finalizer may run inside it
_copies: "weakref.WeakValueDictionary[tuple, DiskArray]" = weakref.WeakValueDictionary()
_stamps: dict[tuple, tuple] = {}            # key -> (metadata stamp, id of its handle)


def reduce_array(d: DiskArray, uuid: str) -> tuple:
    """``DiskArray.__reduce__``: (``reopen_array``, (state,)); ``uuid`` is the uuid of
    ``d``'s metadata ('' for a foreign array that has none)."""
    state = {"kind": KIND, "format": reopen.FORMAT, "path": d.path,
             "meta_path": d.meta_path, "backend": d.backend, "mode": d.mode, "name": d.name,
             "shape": tuple(d.shape), "dtype": d.dtype.str, "chunks": tuple(d.chunks),
             "uuid": uuid, "persistent": d.persistent, "origin": reopen.origin(),
             "token": reopen.token(d)}
    return (reopen_array, (state,))


def reopen_array(state: dict) -> DiskArray:
    """Unpickle a DiskArray (see the module docstring for what comes back)."""
    state = reopen.check_state(state, KIND)
    d = reopen.live(state["origin"], state["token"])
    if d is not None and not d.closed:
        return d                                    # the pickling process: its own handle
    return Reopened(state)


# ---------------------------------------------------------------- opening a copy

def _stamp(path: str) -> tuple | None:
    """What changes when the metadata at ``path`` is replaced or removed (None: gone)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


def _node_local(state: dict) -> bool:
    return state["backend"] in NODE_LOCAL or (state["backend"] == "auto"
                                               and not state["persistent"])


def _gone(state: dict, why: str) -> StorageError:
    kind = "persistent" if state["persistent"] else "scratch"
    hint = (f"the {kind} DiskArray {state['name']!r} pickled by "
            f"{reopen.describe(state['origin'])} is not there any more ({why})")
    if state["persistent"]:
        hint += "; it was deleted or moved: pickle a handle of it where it is now"
    else:
        hint += ("; a scratch array lives as long as its creator's handle (close() and the "
                 "end of the creating process remove it): keep it open while other "
                 "processes use it, or create it with path= (persistent). On another node "
                 "set CHEMIO_SHARED_SCRATCH to a directory that every node mounts")
    return StorageError(errno.ENOENT, state["path"], None, None, "reopen a pickled DiskArray",
                        hint)


def _how(state: dict) -> tuple[str, str]:
    """(backend, mode) a copy opens with."""
    backend = READ_THROUGH.get(state["backend"], state["backend"])
    return backend, ("r" if backend != state["backend"] else state["mode"])


def _shared_copy(state: dict) -> DiskArray:
    """This process's open handle of the pickled array ``state``: the one its copies share
    while it is alive and its metadata unchanged, else a new one (checked)."""
    o = state["origin"]
    if _node_local(state) and not reopen.same_node(o):
        here = reopen.origin()["host"]
        raise NotSharedError(
            f"DiskArray {state['name']!r} on backend {state['backend']!r} lives in the memory "
            f"of host {o.get('host')!r} (pickled by {reopen.describe(o)}); this process on "
            f"host {here!r}{' (rebooted since)' if o.get('host') == here else ''} cannot "
            f"reach it. Run the workers on that node, or create the array on backend "
            f"'local' (a shared scratch directory) or 'zarr' for workers on other nodes")
    backend, mode = _how(state)
    key = (state["path"], backend, mode, state["uuid"])
    stamp = _stamp(state["meta_path"])
    if stamp is None:
        raise _gone(state, f"no metadata at {state['meta_path']!r}")
    with _lock:
        d = _copies.get(key)
        if d is not None and not d.closed and _stamps.get(key) == (stamp, id(d)):
            return d
        d = _open(state, backend, mode)
        _copies[key] = d
        _stamps[key] = (stamp, id(d))
        weakref.finalize(d, _forget, key, id(d))
    return d


def _forget(key: tuple, ident: int) -> None:
    """The handle ``ident`` of ``key`` was collected: forget its stamp (not a newer one's)."""
    with _lock:
        if _stamps.get(key, (None, None))[1] == ident:
            del _stamps[key]


class ReadThrough(DiskArray):
    """A copy of an array of a backend that another process reads through another one
    (``mpiio`` through ``local``): read-only, and its writes say why."""

    pickled_from = "mpiio"

    def _writable_store(self) -> Any:
        self._open_store()                          # closed: that error first
        raise ModeError(
            f"DiskArray {self.name!r} ({self.path!r}) of backend {self.pickled_from!r} is "
            f"read-only in a process that unpickled it: an MPI-IO handle belongs to the ranks "
            f"that opened the array together, and MPI-IO's data sieving rewrites whole file "
            f"ranges, which could undo this process's write. Write it from those ranks "
            f"(write/write_all), or give worker processes an array of backend 'local' (the "
            f"same format); nothing was written")


def _open(state: dict, backend: str, mode: str) -> DiskArray:
    path = state["path"]
    cls = DiskArray if backend == state["backend"] else ReadThrough
    try:
        d = cls.open(path, mode, backend=backend, comm=SerialComm())
    except (MetadataError, FileNotFoundError, StorageError) as e:
        if not os.path.lexists(path) or not os.path.lexists(state["meta_path"]):
            raise _gone(state, f"{type(e).__name__}: {e}") from None
        raise
    if state["uuid"] and d.uuid != state["uuid"]:
        d.close()
        raise MetadataError(
            f"{path!r} holds another array than the DiskArray {state['name']!r} pickled by "
            f"{reopen.describe(state['origin'])} (its metadata has another uuid: the name "
            f"was created again since); pickle a handle of the array that is there now")
    return d


def _after_fork_in_child() -> None:
    global _lock, _copies
    _lock = threading.RLock()
    _copies = weakref.WeakValueDictionary()     # the parent's handles: reopened here
    _stamps.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


# ---------------------------------------------------------------- the copy

class _Link:
    """The state of a ``Reopened``: the pickle, the shared handle once used, closed?"""

    __slots__ = ("state", "target", "closed")

    def __init__(self, state: dict):
        self.state = state
        self.target: DiskArray | None = None
        self.closed = False

    def open(self) -> DiskArray:
        t = self.target
        if t is not None and not t.closed:
            return t
        if self.closed:
            s = self.state
            raise ChemIOError(f"DiskArray {s['name']!r} is closed (a copy unpickled in this "
                              f"process); unpickle it again, or open it with "
                              f"DiskArray.open({s['path']!r})")
        self.target = t = _shared_copy(self.state)
        return t

    def described(self, name: str) -> Any:
        """Attribute ``name`` from the pickle, before the array is opened."""
        s = self.state
        backend, mode = _how(s)
        shape = tuple(s["shape"])
        dt = np.dtype(s["dtype"])
        return {"shape": shape, "dtype": dt, "ndim": len(shape), "chunks": tuple(s["chunks"]),
                "name": s["name"], "path": s["path"], "meta_path": s["meta_path"],
                "mode": mode, "backend": backend, "persistent": s["persistent"],
                "uuid": s["uuid"], "size": math.prod(shape),
                "nbytes": math.prod(shape) * dt.itemsize}[name]


_DESCRIBED = frozenset({"shape", "dtype", "ndim", "chunks", "name", "path", "meta_path", "mode",
                        "backend", "persistent", "uuid", "size", "nbytes"})
_OWN = frozenset({"_link", "close", "closed", "__reduce__", "__reduce_ex__", "__class__",
                  "__del__", "__dict__", "__getstate__", "__setstate__", "__repr__"})


class Reopened(DiskArray):
    """A DiskArray unpickled in another process than the one that pickled it (see the
    module docstring): it opens the array at its first use and then stands for that
    process's handle of it, shared by every copy of the array there. Before that, shape,
    dtype, chunks, name, path, meta_path, mode, backend, persistent, uuid, size and nbytes
    come from the pickle."""

    def __init__(self, state: dict):                # nothing is opened here
        object.__setattr__(self, "_link", _Link(state))

    def __getattribute__(self, name: str) -> Any:
        if name in _OWN:
            return object.__getattribute__(self, name)
        link = object.__getattribute__(self, "_link")
        if link.target is None and name in _DESCRIBED and not link.closed:
            return link.described(name)
        return getattr(link.open(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_link").open(), name, value)

    @property
    def closed(self) -> bool:
        link = object.__getattribute__(self, "_link")
        return link.closed or (link.target is not None and link.target.closed)

    def close(self) -> None:
        """Let go of this process's handle (it closes when no copy uses it any more);
        removes nothing. Idempotent."""
        link = object.__getattribute__(self, "_link")
        link.closed, link.target = True, None

    # the calls dask and NumPy make on the copy itself go straight to the handle
    def __getitem__(self, key: Any) -> Any:
        return self._link.open()[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._link.open()[key] = value

    def __array__(self, *args: Any, **kw: Any) -> np.ndarray:
        return self._link.open().__array__(*args, **kw)

    def __len__(self) -> int:
        return len(self._link.open())

    def __repr__(self) -> str:
        link = self._link
        if link.target is None and not link.closed:
            s = link.state
            return (f"<DiskArray {s['name']!r} shape={tuple(s['shape'])} dtype="
                    f"{np.dtype(s['dtype'])} unpickled, not opened yet path={s['path']!r} "
                    f"backend={_how(s)[0]}>")
        return repr(link.target) if link.target is not None else (
            f"<DiskArray {link.state['name']!r} closed copy path={link.state['path']!r}>")

    def __reduce__(self) -> tuple:
        return (reopen_array, (object.__getattribute__(self, "_link").state,))

    def __reduce_ex__(self, protocol: Any) -> tuple:
        return self.__reduce__()

    def __del__(self) -> None:
        pass                                        # the shared handle closes itself
