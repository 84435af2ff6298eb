"""The life of a handle on one backend store, shared by ByteFile and DiskArray.

A handle is open while it holds its store. ``_open_store()`` returns the store or raises:
``SupersededError`` naming what replaced it (the same path was created again in this
process, ``handles``), else ``ChemIOError`` saying it is closed. Closing waits for the
handle's requests, then, in one piece that an interrupt cannot cut, forgets the store,
drops what depends on it (``_forget_store``), closes it and gives up the handle's place as
the creator of its path (``handles.release``); the errors of requests nobody waited for
come back to the caller. Only a close that every rank of the store's communicator makes
together may close the store collectively; every other close (``cio.cleanup``, garbage
collection, a superseded handle) releases it alone (``close_alone``).

Subclasses set ``close_alone`` and call ``_hold`` from their ``__init__``; they may
override the messages (``_label``, ``_closed_text``, ``_read_only_label``) and ``close``.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

from chemio_py.errors import ChemIOError, ModeError, SupersededError
from chemio_py.runtime import finalizers, handles, requests

_H = TypeVar("_H", bound="StoreHandle")


class StoreHandle:
    """Open, close, supersede and release a handle on one store (module docstring)."""

    _store: Any = None
    _superseded: str | None = None      # why a later creation closed this handle
    _path: str
    _mode: str
    _pending: requests.Pending
    close_alone: Callable[[Any], None]  # releases a store without any collective call

    def _hold(self, store: Any, path: str, mode: str) -> None:
        """Start holding ``store`` of ``path`` (the key of ``handles``) in ``mode``."""
        self._store = store
        self._path = path
        self._mode = mode
        self._pending = requests.Pending()

    @property
    def store(self) -> Any:
        """The backend store object (None once closed), like h5py's ``.id`` or zarr's
        ``.store``: for diagnostics, tests and benchmarks; its methods are the backend
        contract, not the chemio API."""
        return self._store

    @property
    def closed(self) -> bool:
        return self._store is None

    @property
    def path(self) -> str:
        return self._path

    # ------------------------------------------------------------ messages
    def _label(self) -> str:
        return f"{type(self).__name__} {self._path!r}"

    def _closed_text(self) -> str:
        return f"I/O on a closed {type(self).__name__}; open it again"

    def _read_only_label(self) -> str:
        return repr(self.path)

    # ------------------------------------------------------------ state
    def _open_store(self) -> Any:
        if self._store is None:
            if self._superseded is not None:
                raise SupersededError(f"{self._label()} is closed: {self._superseded}")
            raise ChemIOError(self._closed_text())
        return self._store

    def _writable_store(self) -> Any:
        st = self._open_store()
        if self._mode == "r":
            raise ModeError(f"{self._read_only_label()} is open read-only (mode 'r'); open it "
                            f"with mode 'r+' to write")
        return st

    def _forget_store(self) -> None:
        """Drop what depends on the open store (capabilities, fast paths); it is closing."""

    def _supersede(self, reason: str) -> list[BaseException]:
        """Close locally because the same path was created again (``handles``)."""
        self._superseded = reason
        return self._close_local()

    def _close_local(self, together: bool = False) -> list[BaseException]:
        """Wait for outstanding requests, close the store; the errors nobody has seen.
        Only with ``together`` (every rank of the store's communicator is closing now) may
        the store's close be a collective call."""
        if self._store is None:
            return []
        errors = self._pending.drain()          # an interrupt here leaves the handle open
        # from here on, whole: an interrupt between forgetting the store and closing it
        # would leave it open with nothing to close it again (handlers still run; what
        # one raises comes after the close)
        with requests.shield():
            store, self._store = self._store, None
            try:
                self._forget_store()
                if together:
                    store.close()
                else:
                    self.close_alone(store)
            finally:
                handles.release(self._path, self)
        return errors

    def _release(self, together: bool = False) -> BaseException | None:
        """Close this process's handle (waiting for its requests) without a collective
        call unless ``together``; the error of requests nobody waited for."""
        return requests.failure(self.path, self._close_local(together))

    def close(self) -> None:
        """Wait for outstanding requests, then close. Idempotent.

        A request that failed and was never waited for makes this raise
        ``UnobservedIOError`` (once, the original error chained).
        """
        err = self._release(together=True)
        if err is not None:
            raise err

    def __enter__(self: _H) -> _H:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if self._store is not None:
            finalizers.close_later(self._close_dropped)

    def _close_dropped(self) -> None:
        """The finalizer's close: quietly, and without the registries' locks."""
        store = self._store
        if store is not None:
            self._pending.drain()
            self._store = None
            self._forget_store()
            self.close_alone(store)
