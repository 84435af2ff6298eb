"""A backend that opens and closes collectively (``backends.CollectiveOpen``), for testing
the user layer's side of that contract without MPI-IO: the example backend's files, with a
store ``close()`` that is a real barrier over the store's communicator (so a close that not
every rank makes hangs, as ``MPI.File.Close`` would) and a ``close_local()`` that is not.
Each rank appends what it was asked to do to ``<path>.calls.<rank>`` beside the object."""
from __future__ import annotations

import os
from typing import Any

from example_backend import PlainBackend


def _log(path: str, rank: int, what: str) -> None:
    with open(f"{path}.calls.{rank}", "a") as f:
        f.write(what + "\n")


class _Together:
    """Wraps a plain store; ``close()`` waits for every rank of ``comm``."""

    def __init__(self, inner: Any, comm: Any):
        self._inner, self._comm = inner, comm
        self._closed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _log(self._inner.path, self._comm.rank, "close")
        self._comm.barrier()                  # collective, like MPI.File.Close
        self._inner.close()

    def close_local(self) -> None:
        if self._closed:
            return
        self._closed = True
        _log(self._inner.path, self._comm.rank, "close_local")
        self._inner.close()


class CollectiveBackend(PlainBackend):
    name = "together"
    collective_open = True

    def _open(self, opener: Any, path: str, mode: str, comm: Any, **kw: Any) -> Any:
        if comm is None:
            return opener(path, mode, **kw)
        inner = None
        with comm.agree(f"{self.name} open {path!r}"):
            _log(path, comm.rank, f"open {mode}")
            if comm.rank == 0:
                inner = opener(path, mode, **kw)
        with comm.agree(f"{self.name} open {path!r}"):
            if comm.rank != 0:
                inner = opener(path, "r+" if mode in ("w+", "x+") else mode, **kw)
        return _Together(inner, comm)

    def open_bytes(self, path: str, mode: str, *, comm: Any = None, **options: Any) -> Any:
        return self._open(super().open_bytes, path, mode, comm, **options)

    def open_array(self, path: str, mode: str, *, comm: Any = None, **kw: Any) -> Any:
        return self._open(super().open_array, path, mode, comm, **kw)

    def remove(self, path: str) -> bool:
        for name in os.listdir(os.path.dirname(path) or "."):
            if name.startswith(os.path.basename(path) + ".calls."):
                os.unlink(os.path.join(os.path.dirname(path), name))
        return super().remove(path)
