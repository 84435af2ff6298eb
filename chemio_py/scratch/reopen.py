"""Where a pickled chemio handle was made, and the live handles of this process by token.

A chemio handle (DiskArray, ExclusiveFile, SharedFile, RecordFile) pickles as the way to
reopen it — path, backend, mode — never as its mappings, descriptors or locks. With that it
carries its *origin* (``origin()``: host, boot id, pid namespace, pid and the process's
start time) and a *token* naming the handle in the process that pickled it:

* unpickled in that very process while the handle is open, the handle itself comes back
  (``live``): one handle per object, as ``copy.copy`` of a module gives the module;
* anywhere else the caller reopens the path, and ``same_node`` tells whether objects that
  live in one node's memory (``/dev/shm``) can be reached from here.

Nothing here opens a file or touches the scratch: a process that only unpickles handles
makes no job directory and owns nothing.
"""
from __future__ import annotations

import os
import socket
import threading
import weakref
from typing import Any

from chemio_py.errors import ArgumentError
from chemio_py.scratch.jobs import pid_namespace, process_start_time, read_boot_id

FORMAT = 1                      # of the pickled state of every chemio handle

_lock = threading.RLock()              # reentrant: a weakref callback may run inside it
_live: dict[str, "weakref.ref[Any]"] = {}       # token -> handle of this process
_tokens: dict[int, str] = {}                    # id(handle) -> token
_origin: dict | None = None                     # origin(), found once per process


def origin() -> dict:
    """This process as a pickled handle names it: ``host``, ``boot`` (boot id), ``pidns``,
    ``pid`` and ``start`` (start time in clock ticks; None where /proc cannot tell)."""
    global _origin
    o = _origin
    if o is None or o["pid"] != os.getpid():
        try:
            start = process_start_time(os.getpid())
        except OSError:
            start = None
        o = _origin = {"host": socket.gethostname(), "boot": read_boot_id(),
                       "pidns": pid_namespace(), "pid": os.getpid(), "start": start}
    return dict(o)


def same_node(o: dict) -> bool:
    """True when origin ``o`` is this machine, since its last boot (its RAM files are ours)."""
    here = origin()
    return o.get("host") == here["host"] and o.get("boot") == here["boot"]


def same_process(o: dict) -> bool:
    """True when origin ``o`` is this very process (pid, pid namespace and start time)."""
    here = origin()
    return (same_node(o) and o.get("pid") == here["pid"] and o.get("pidns") == here["pidns"]
            and o.get("start") == here["start"])


def describe(o: dict) -> str:
    """``process 123 on host 'n1'`` for origin ``o`` (for messages)."""
    return f"process {o.get('pid')} on host {o.get('host')!r}"


def check_state(state: Any, kind: str) -> dict:
    """``state`` if it is the pickled state of a ``kind`` handle in a format this version
    reads; else ``ArgumentError`` saying what was found."""
    if not isinstance(state, dict) or state.get("kind") != kind:
        raise ArgumentError(f"not a pickled {kind} handle: got {type(state).__name__}; "
                            f"unpickle only what chemio_py pickled")
    if state.get("format") != FORMAT:
        raise ArgumentError(f"a pickled {kind} handle in format {state.get('format')!r}, but "
                            f"this chemio_py reads format {FORMAT}; unpickle it with the "
                            f"chemio_py version that pickled it")
    return state


def token(obj: Any) -> str:
    """The token of handle ``obj`` in this process (made on first use; forgotten when
    ``obj`` is collected)."""
    key = id(obj)
    with _lock:
        tok = _tokens.get(key)
        if tok is not None:
            ref = _live.get(tok)
            if ref is not None and ref() is obj:
                return tok
        tok = os.urandom(12).hex()
        _tokens[key] = tok
        _live[tok] = weakref.ref(obj, _forgetter(tok, key))
        return tok


def _forgetter(tok: str, key: int) -> Any:
    """The weakref callback that forgets token ``tok`` of ``id`` ``key``."""
    def forget(_ref: Any) -> None:
        with _lock:
            _live.pop(tok, None)
            if _tokens.get(key) == tok:
                del _tokens[key]
    return forget


def live(o: dict, tok: Any) -> Any:
    """The handle of token ``tok`` when origin ``o`` is this process and it still exists
    (open or not: the caller decides), else None."""
    if not isinstance(tok, str) or not same_process(o):
        return None
    with _lock:
        ref = _live.get(tok)
    return None if ref is None else ref()


def _after_fork_in_child() -> None:
    global _lock, _origin
    _lock = threading.RLock()
    _live.clear()                       # the parent's handles: a child reopens by path
    _tokens.clear()
    _origin = None


os.register_at_fork(after_in_child=_after_fork_in_child)
