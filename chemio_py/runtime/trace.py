"""The Chrome/Perfetto trace: with ``CHEMIO_TRACE=path.json`` (or
``configure(trace=)``) every I/O call and pipeline span becomes an event; the file is
written at exit (one per rank under MPI, never over a file that is not a trace) or by
``write_trace()``. ``chemio trace`` reads it back (``tools/trace_view``).
"""
from __future__ import annotations

import atexit
import errno
import json
import os
import stat as _stat
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from chemio_py.runtime import config, ownfiles


class _Trace:
    """Collects trace events while ``CHEMIO_TRACE`` (or ``configure(trace=)``) is set."""

    def __init__(self) -> None:
        self.on = False
        self.path: str | None = None
        self.events: list[dict] = []
        self.lock = threading.Lock()
        self.t0 = time.perf_counter()
        self.epoch_us = time.time() * 1e6
        self.refresh()

    def refresh(self) -> None:
        try:
            self.path = config.get("trace")
        except Exception:          # a refused setting or config file: no trace
            self.path = None
        self.on = self.path is not None
        self.pid = os.getpid()     # the process that writes the trace at exit

    def event(self, name: str, cat: str, t0: float, t1: float, args: dict | None = None,
              track: str | None = None) -> None:
        ev = {"name": name, "cat": cat, "ph": "X", "pid": os.getpid(),
              "tid": track or threading.current_thread().name,
              "ts": self.epoch_us + (t0 - self.t0) * 1e6, "dur": (t1 - t0) * 1e6}
        if args:
            ev["args"] = args
        with self.lock:
            self.events.append(ev)


collector = _Trace()
trace_state = collector
"""``trace_state.on`` is True while trace events are collected (the byte files' fast path
checks it before logging a call without its event)."""


def refresh_trace() -> None:
    """Re-read the trace setting (after ``configure(trace=...)`` and ``config.reset()``)."""
    collector.refresh()


config.on_change(("trace",), lambda changes, reset: refresh_trace())


@contextmanager
def span(name: str, cat: str = "compute", track: str = "compute") -> Iterator[None]:
    """Mark a stretch of caller work (e.g. compute) in the trace on its own track."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if collector.on:
            collector.event(name, cat, t0, time.perf_counter(), track=track)


def trace_events() -> list[dict]:
    with collector.lock:
        return list(collector.events)


def _trace_target(path: str) -> str:
    """The file this rank writes: under MPI, ``<root>.rank<N><ext>`` (one file per rank)."""
    from chemio_py.runtime.comm import comm
    try:
        c = comm()
        if c.size > 1:
            root, ext = os.path.splitext(path)
            return f"{root}.rank{c.rank}{ext or '.json'}"
    except Exception:
        pass
    return path


class Refused(Exception):
    """The trace target turned out not to be replaceable (the message says why)."""


def replaceable_target(target: str) -> str | None:
    """Why chemio must not replace ``target`` (None: it may). Only a missing file or a
    regular file of this user is replaced; never a link, a device, a directory..."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"it cannot be examined ({e.strerror})"
    if _stat.S_ISLNK(st.st_mode):
        try:
            to = f" (to {os.readlink(target)!r})"
        except OSError:
            to = ""
        return f"it is a symbolic link{to}, and chemio does not write through links"
    if not _stat.S_ISREG(st.st_mode):
        return f"it is {ownfiles.kind(st.st_mode)}, not a regular file"
    if st.st_uid != os.geteuid():
        return (f"it is an existing file owned by uid {st.st_uid}, not by you "
                f"(uid {os.geteuid()}), and chemio does not replace other users' files")
    return None


def write_new(target: str, payload: bytes) -> None:
    """Write ``payload`` to a fresh 0600 temp file beside ``target`` (``O_EXCL|O_NOFOLLOW``,
    unguessable name), then rename it onto ``target`` (a rename replaces, never writes
    through, whatever name is there)."""
    directory, base = os.path.split(os.path.abspath(target))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        tmp = os.path.join(directory, f".{base}.{os.urandom(8).hex()}.tmp")
        try:
            fd = os.open(tmp, flags, 0o600)
            break
        except FileExistsError:
            continue
    else:                                              # pragma: no cover
        raise FileExistsError(errno.EEXIST, "no free temporary name", directory)
    try:
        try:
            ownfiles.write_all(fd, payload)
        finally:
            os.close(fd)
        why = replaceable_target(target)                     # again: the target may have changed
        if why is not None:
            raise Refused(why)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_trace(path: str | None = None) -> str | None:
    """Write the collected events as Chrome/Perfetto JSON; returns the path written.

    ``path`` (else the ``trace`` setting) gets a new file, mode 0600, or replaces a regular
    file of this user; a symbolic link, a FIFO, a directory or another user's file there is
    refused (``ArgumentError`` for ``path``, ``ConfigError`` for the setting) and left alone.
    Under MPI each rank writes ``<root>.rank<N><ext>``.
    """
    explicit = path is not None
    path = path or collector.path
    if not path:
        return None
    target = _trace_target(path)
    with collector.lock:
        data = {"traceEvents": list(collector.events), "displayTimeUnit": "ms"}
    payload = json.dumps(data).encode()
    why = replaceable_target(target)
    try:
        if why is None:
            write_new(target, payload)
    except Refused as e:
        why = str(e)
    if why is not None:
        if explicit:
            from chemio_py.errors import ArgumentError
            raise ArgumentError(f"write_trace({path!r}) will not write {target!r}: {why}; "
                                f"remove it or choose another path")
        try:
            source = config.get_setting("trace").source
        except Exception:
            source = "settings"
        raise config.ConfigError(f"the I/O trace (setting 'trace' from {source}) will not be "
                                 f"written to {target!r}: {why}; remove it or set CHEMIO_TRACE "
                                 f"to another path")
    return target


@atexit.register
def _write_trace_at_exit() -> None:
    """Write the trace at exit; a refusal or an I/O error is one warning line, not a traceback.

    Only the process that set the trace up writes it: a forked child that exits normally
    would otherwise replace its parent's trace with its own copy of the events.
    """
    if not (collector.on and collector.events) or collector.pid != os.getpid():
        return
    try:
        write_trace()
    except Exception as e:
        msg = str(e) if isinstance(e, config.ConfigError) else (
            f"the I/O trace was not written to {collector.path!r}: "
            f"{getattr(e, 'strerror', None) or e}")
        try:
            sys.stderr.write("chemio: warning: " + " ".join(msg.split()) + "\n")
            sys.stderr.flush()
        except Exception:
            pass
