"""One creating handle per file in a process: creating a name again replaces the old handle.

``d1 = DiskArray.create("tmp", ...)`` followed by ``d2 = DiskArray.create("tmp", ...)`` (a
notebook cell run twice) must not leave two objects writing one file. The second creation
*supersedes* the first: the old handle waits for its requests, closes, and from then on
every use raises ``SupersededError`` naming what replaced it. Opening an existing file for
reading (or ``r+``) does not supersede anything: those handles see the same bytes.

Creations of one path are serialised between threads: ``supersede`` takes the path's
creation lock and ``claim`` (or ``abandon``, when the creation failed) gives it back, so the
file on disk is always the one of the handle claimed last, and two threads never both hold a
live creating handle: the one that came first is superseded by the other.
"""
from __future__ import annotations

import os
import threading
import warnings
import weakref
from typing import Any, Protocol



class Supersedable(Protocol):
    def _supersede(self, reason: str) -> list[BaseException]:
        """Wait for outstanding I/O, close locally, refuse further use with ``reason``;
        return errors of failed requests nobody had seen."""


_lock = threading.Lock()
_creators: dict[str, "weakref.ref[Any]"] = {}


class _Creation:
    """The right to create one path, held by one thread from ``supersede`` until ``claim``
    or ``abandon``; ``users`` counts the threads holding or waiting for it."""
    __slots__ = ("lock", "holder", "users")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holder: int | None = None
        self.users = 0


_creations: dict[str, _Creation] = {}


def _key(path: str) -> str:
    return os.path.abspath(path)


def _begin_creation(key: str) -> None:
    """Wait until no other thread is creating ``key``, then hold it. A thread that holds it
    already (an attempt that failed before ``abandon``) keeps it."""
    me = threading.get_ident()
    with _lock:
        creation = _creations.get(key)
        if creation is None:
            creation = _creations[key] = _Creation()
        elif creation.holder == me:
            return
        creation.users += 1
    creation.lock.acquire()
    with _lock:
        creation.holder = me


def _end_creation(key: str) -> None:
    """Give back this thread's hold on creating ``key``; nothing when it holds none."""
    with _lock:
        creation = _creations.get(key)
        if creation is None or creation.holder != threading.get_ident():
            return
        creation.holder = None
        creation.users -= 1
        if not creation.users:
            del _creations[key]
        creation.lock.release()


def supersede(path: str, what: str) -> None:
    """Before ``path`` is created again: wait while another thread creates it, then close
    this process's live creator of it, if any. The caller then holds the creation of
    ``path`` until it calls ``claim`` (created) or ``abandon`` (failed): it must call one.

    ``what`` names the new creation (``"DiskArray.create('tmp')"``) for the old handle's
    error message. Failed requests of the old handle nobody had seen become a warning.
    """
    key = _key(path)
    _begin_creation(key)
    try:
        with _lock:
            ref = _creators.pop(key, None)
        old = ref() if ref is not None else None
        if old is None:
            return
        errors = old._supersede(f"{what} in this process replaced it (same file {key!r}); "
                                f"use the new object")
    except BaseException:
        _end_creation(key)
        raise
    if errors:
        warnings.warn(f"{len(errors)} asynchronous request(s) of the replaced handle of {key!r} "
                      f"had failed and were never waited for; the first: "
                      f"{type(errors[0]).__name__}: {errors[0]}", RuntimeWarning, stacklevel=3)


def claim(path: str, obj: Supersedable) -> None:
    """Record ``obj`` as this process's creator of ``path`` and end this thread's creation
    of it (``supersede``)."""
    key = _key(path)
    with _lock:
        _creators[key] = weakref.ref(obj)
    _end_creation(key)


def abandon(path: str | None) -> None:
    """End this thread's creation of ``path`` that failed before ``claim``; nothing when
    ``path`` is None or this thread is not creating it."""
    if path is not None:
        _end_creation(_key(path))


def release(path: str, obj: Any) -> None:
    """Forget ``obj`` as the creator of ``path`` (it closed)."""
    key = _key(path)
    with _lock:
        ref = _creators.get(key)
        if ref is not None and ref() is obj:
            del _creators[key]


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()            # its holder, another thread, is not in the child
    _creators.clear()
    _creations.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
