"""I/O accounting: per-file counters, the report, and a Chrome/Perfetto trace.

Counters per file: operations and bytes each way, seconds spent inside I/O calls
(``io_seconds``, summed over threads) and seconds the caller was blocked waiting for I/O
(``wait_seconds``). With ``CHEMIO_TRACE=path.json`` every I/O call becomes a trace event;
the file is written at exit (one file per rank under MPI) or by ``write_trace()``.
"""
from __future__ import annotations

import atexit
import json
import os
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from . import config

_lock = threading.Lock()
_files: dict[str, "FileStats"] = {}


class FileStats:
    """Counters of one file (kept after the file closes, until ``reset()``)."""

    __slots__ = ("name", "backend", "reads", "writes", "bytes_read", "bytes_written",
                 "io_seconds", "wait_seconds", "_lock")

    def __init__(self, name: str, backend: str):
        self.name = name
        self.backend = backend
        self.reads = self.writes = 0
        self.bytes_read = self.bytes_written = 0
        self.io_seconds = 0.0
        self.wait_seconds = 0.0
        self._lock = threading.Lock()

    def record(self, op: str, nbytes: int, t0: float, t1: float, offset: int | None = None) -> None:
        """Count one I/O call of ``nbytes`` that ran from ``t0`` to ``t1`` (perf_counter)."""
        with self._lock:
            if op == "read":
                self.reads += 1
                self.bytes_read += nbytes
            else:
                self.writes += 1
                self.bytes_written += nbytes
            self.io_seconds += t1 - t0
        if _trace.on:
            _trace.event(op, "io", t0, t1, {"file": self.name, "offset": offset, "bytes": nbytes})

    def waited(self, seconds: float) -> None:
        """Count time the caller spent blocked on this file's I/O."""
        with self._lock:
            self.wait_seconds += seconds

    def as_dict(self) -> dict:
        return {"file": self.name, "backend": self.backend, "reads": self.reads,
                "writes": self.writes, "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written, "io_seconds": self.io_seconds,
                "wait_seconds": self.wait_seconds}


def for_file(name: str, backend: str) -> FileStats:
    """The counters of a file, created on first use (reopening a file keeps counting)."""
    with _lock:
        st = _files.get(name)
        if st is None:
            st = _files[name] = FileStats(name, backend)
        return st


def snapshot() -> dict:
    """Per-file counters and their totals, as plain data."""
    with _lock:
        files = [s.as_dict() for s in _files.values()]
    keys = ("reads", "writes", "bytes_read", "bytes_written", "io_seconds", "wait_seconds")
    total = {k: sum(f[k] for f in files) for k in keys}
    return {"files": files, "total": total}


def reset() -> None:
    """Forget all counters."""
    with _lock:
        _files.clear()


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def report(print_it: bool = True) -> str:
    """A table of I/O per file (ops, MiB, seconds in I/O, seconds waited); printed by default."""
    snap = snapshot()
    rows = [("file", "backend", "reads", "MiB read", "writes", "MiB written", "io s", "waited s")]
    for f in snap["files"]:
        rows.append((os.path.basename(f["file"]), f["backend"], str(f["reads"]),
                     _mib(f["bytes_read"]), str(f["writes"]), _mib(f["bytes_written"]),
                     f"{f['io_seconds']:.3f}", f"{f['wait_seconds']:.3f}"))
    t = snap["total"]
    rows.append(("total", "", str(t["reads"]), _mib(t["bytes_read"]), str(t["writes"]),
                 _mib(t["bytes_written"]), f"{t['io_seconds']:.3f}", f"{t['wait_seconds']:.3f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    text = "\n".join(lines)
    if print_it:
        print(text)
    return text


class _Trace:
    """Collects trace events while ``CHEMIO_TRACE`` (or ``configure(trace=)``) is set."""

    def __init__(self):
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
        except Exception:
            self.path = None
        self.on = self.path is not None

    def event(self, name: str, cat: str, t0: float, t1: float, args: dict | None = None,
              track: str | None = None) -> None:
        ev = {"name": name, "cat": cat, "ph": "X", "pid": os.getpid(),
              "tid": track or threading.current_thread().name,
              "ts": self.epoch_us + (t0 - self.t0) * 1e6, "dur": (t1 - t0) * 1e6}
        if args:
            ev["args"] = args
        with self.lock:
            self.events.append(ev)


_trace = _Trace()


def refresh_trace() -> None:
    """Re-read the trace setting (``configure(trace=...)`` calls this)."""
    _trace.refresh()


@contextmanager
def span(name: str, cat: str = "compute", track: str = "compute") -> Iterator[None]:
    """Mark a stretch of caller work (e.g. compute) in the trace on its own track."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if _trace.on:
            _trace.event(name, cat, t0, time.perf_counter(), track=track)


def trace_events() -> list[dict]:
    with _trace.lock:
        return list(_trace.events)


def write_trace(path: str | None = None) -> str | None:
    """Write the collected events as Chrome/Perfetto JSON; returns the path written."""
    path = path or _trace.path
    if not path:
        return None
    from .comm import comm
    try:
        c = comm()
        if c.size > 1:
            root, ext = os.path.splitext(path)
            path = f"{root}.rank{c.rank}{ext or '.json'}"
    except Exception:
        pass
    with _trace.lock:
        data = {"traceEvents": list(_trace.events), "displayTimeUnit": "ms"}
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)
    return path


@atexit.register
def _write_trace_at_exit() -> None:
    if _trace.on and _trace.events:
        try:
            write_trace()
        except OSError:
            pass
