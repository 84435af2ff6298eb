"""One creating handle per file in a process: creating a name again replaces the old handle.

``d1 = DiskArray.create("tmp", ...)`` followed by ``d2 = DiskArray.create("tmp", ...)`` (a
notebook cell run twice) must not leave two objects writing one file. The second creation
*supersedes* the first: the old handle waits for its requests, closes, and from then on
every use raises ``SupersededError`` naming what replaced it. Opening an existing file for
reading (or ``r+``) does not supersede anything: those handles see the same bytes.
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


def _key(path: str) -> str:
    return os.path.abspath(path)


def supersede(path: str, what: str) -> None:
    """Before ``path`` is created again: close this process's live creator of it, if any.

    ``what`` names the new creation (``"DiskArray.create('tmp')"``) for the old handle's
    error message. Failed requests of the old handle nobody had seen become a warning.
    """
    key = _key(path)
    with _lock:
        ref = _creators.pop(key, None)
    old = ref() if ref is not None else None
    if old is None:
        return
    errors = old._supersede(f"{what} in this process replaced it (same file {key!r}); use "
                            f"the new object")
    if errors:
        warnings.warn(f"{len(errors)} asynchronous request(s) of the replaced handle of {key!r} "
                      f"had failed and were never waited for; the first: "
                      f"{type(errors[0]).__name__}: {errors[0]}", RuntimeWarning, stacklevel=3)


def claim(path: str, obj: Supersedable) -> None:
    """Record ``obj`` as this process's creator of ``path``."""
    with _lock:
        _creators[_key(path)] = weakref.ref(obj)


def release(path: str, obj: Any) -> None:
    """Forget ``obj`` as the creator of ``path`` (it closed)."""
    key = _key(path)
    with _lock:
        ref = _creators.get(key)
        if ref is not None and ref() is obj:
            del _creators[key]


def _after_fork_in_child() -> None:
    _creators.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
