"""I/O accounting: per-file counters, the report, and a Chrome/Perfetto trace.

Counters per file: operations and bytes each way, seconds spent inside I/O calls
(``io_seconds``, summed over threads) and seconds the caller was blocked waiting for I/O
(``wait_seconds``). With ``CHEMIO_TRACE=path.json`` every I/O call becomes a trace event;
the file is written at exit (one file per rank under MPI) or by ``write_trace()``.

Pipelines (``prefetch``, ``iter_blocks``, ``WriteBehind``, ``RecordFile``) add their own
counters (``for_pipeline``/``pipelines()``): time in I/O, time the consumer waited and the
overlap efficiency ``1 - wait/io``, shown by ``report()``; their I/O, wait and compute spans
go to the trace on separate tracks, and ``plot_timeline()`` draws them (matplotlib).
"""
from __future__ import annotations

import collections
import html
import os
import sys
import threading
from typing import Any

from chemio_py.errors import fmt_bytes
from chemio_py.runtime import reprs
from chemio_py.runtime.trace import collector

_MOVED_TO_TRACE = frozenset({"span", "trace_events", "write_trace", "refresh_trace"})


def __getattr__(name: str) -> object:
    """The trace's names, found here as before the trace had a module of its own."""
    if name in _MOVED_TO_TRACE:
        from chemio_py._imports import moved_name
        return moved_name(__name__, name, "chemio_py.runtime.trace")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_lock = threading.Lock()
_files: dict[str, "FileStats"] = {}


class FileStats:
    """Counters of one file (kept after the file closes, until ``reset()``).

    Blocking calls of the byte files, the hot path of small records, append one tuple to
    ``log`` (a ``deque.append``: atomic, no lock, no Python frame) instead of calling
    ``record``; the counters fold the log in when they are read, and the writer folds it
    every ``FOLD_AT`` entries so it stays small."""

    __slots__ = ("name", "backend", "_reads", "_writes", "_bytes_read", "_bytes_written",
                 "_io_seconds", "_wait_seconds", "_lock", "_log", "log")

    FOLD_AT = 4096

    def __init__(self, name: str, backend: str):
        self.name = name
        self.backend = backend
        self._reads = self._writes = 0
        self._bytes_read = self._bytes_written = 0
        self._io_seconds = 0.0
        self._wait_seconds = 0.0
        self._lock = threading.Lock()
        self._log: collections.deque[tuple[bool, int, float]] = collections.deque()
        self.log = self._log.append
        """``log((is_read, nbytes, seconds))``: one blocking call (its time is also wait
        time). Call ``fold()`` when ``len(log_entries) > FOLD_AT``."""

    @property
    def log_entries(self) -> collections.deque[tuple[bool, int, float]]:
        return self._log

    def fold(self) -> None:
        """Add the logged blocking calls to the counters."""
        q = self._log
        with self._lock:
            while True:
                try:
                    is_read, n, dt = q.popleft()
                except IndexError:
                    return
                if is_read:
                    self._reads += 1
                    self._bytes_read += n
                else:
                    self._writes += 1
                    self._bytes_written += n
                self._io_seconds += dt
                self._wait_seconds += dt

    def _folded(self, value: str) -> Any:
        if self._log:
            self.fold()
        return getattr(self, value)

    reads = property(lambda self: self._folded("_reads"), doc="Read calls.")
    writes = property(lambda self: self._folded("_writes"), doc="Write calls.")
    bytes_read = property(lambda self: self._folded("_bytes_read"), doc="Bytes read.")
    bytes_written = property(lambda self: self._folded("_bytes_written"),
                             doc="Bytes written.")
    io_seconds = property(lambda self: self._folded("_io_seconds"),
                          doc="Seconds the I/O calls took.")
    wait_seconds = property(lambda self: self._folded("_wait_seconds"),
                            doc="Seconds callers waited for this file's I/O.")

    def record(self, op: str, nbytes: int, t0: float, t1: float, offset: int | None = None,
               blocking: bool = False, count: int = 1) -> None:
        """Count ``count`` I/O calls of ``nbytes`` in all that ran from ``t0`` to ``t1``.

        ``blocking``: the caller waited for all of it (its I/O time is also wait time).
        """
        with self._lock:
            if op == "read":
                self._reads += count
                self._bytes_read += nbytes
            else:
                self._writes += count
                self._bytes_written += nbytes
            self._io_seconds += t1 - t0
            if blocking:
                self._wait_seconds += t1 - t0
        if collector.on:
            collector.event(op, "io", t0, t1,
                            {"file": self.name, "offset": offset, "bytes": nbytes})

    def waited(self, seconds: float) -> None:
        """Count time the caller spent blocked on this file's I/O."""
        with self._lock:
            self._wait_seconds += seconds

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
    return {"files": files, "total": total, "pipelines": pipelines()}


def reset() -> None:
    """Forget all counters and the trace events collected so far."""
    with _lock:
        _files.clear()
        _pipelines.clear()
    with collector.lock:
        collector.events.clear()


class Report(str):
    """The text of ``cio.report()``; a notebook shows it as an HTML table."""

    html: str = ""

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        return self.html


def _in_notebook() -> bool:
    """True inside a Jupyter kernel, where the returned Report displays itself."""
    ip = sys.modules.get("IPython")
    try:
        shell = ip.get_ipython() if ip is not None else None
    except Exception:
        return False
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def report(print_it: bool | None = None) -> Report:
    """A table of I/O per file (ops, MiB, seconds in I/O, seconds waited). Printed unless
    ``print_it=False`` (or, by default, in a notebook, where the returned ``Report``
    renders as an HTML table)."""
    snap = snapshot()
    rows = [("file", "backend", "reads", "MiB read", "writes", "MiB written", "io s", "waited s")]
    for f in snap["files"]:
        rows.append((os.path.basename(f["file"]), f["backend"], str(f["reads"]),
                     fmt_bytes(f["bytes_read"], "MiB", bare=True), str(f["writes"]),
                     fmt_bytes(f["bytes_written"], "MiB", bare=True),
                     f"{f['io_seconds']:.3f}", f"{f['wait_seconds']:.3f}"))
    t = snap["total"]
    rows.append(("total", "", str(t["reads"]), fmt_bytes(t["bytes_read"], "MiB", bare=True),
                 str(t["writes"]), fmt_bytes(t["bytes_written"], "MiB", bare=True),
                 f"{t['io_seconds']:.3f}", f"{t['wait_seconds']:.3f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    text = "\n".join(lines)
    pipes = _pipeline_report()
    if pipes:
        text += "\n\n" + pipes
    if print_it is None:
        print_it = not _in_notebook()
    if print_it:
        print(text)
    out = Report(text)
    out.html = reprs.grid(rows[0], rows[1:], "chemio I/O per file") + (
        f"<pre>{html.escape(pipes)}</pre>" if pipes else "")
    return out


# ---------------------------------------------------------------- pipelines
#
# A pipeline (read-ahead or write-behind) counts, per request, the time from issue to
# completion (``io_seconds``) and the time the consumer was blocked on it
# (``wait_seconds``). The consumer's wait for a request lies inside that request's span,
# so ``wait_seconds <= io_seconds`` and the overlap efficiency ``1 - wait/io`` is in [0, 1]:
# 1 means every byte moved while the consumer computed, 0 that it waited for all of them.

MAX_SPANS = 20000          # spans kept per pipeline for plot_timeline (the rest are counted)
_pipelines: dict[str, "PipelineStats"] = {}


class PipelineStats:
    """Counters of one pipeline run, or (``for_pipeline``) of all runs of one name.

    ``ops`` and ``bytes`` count completed requests; ``io_seconds`` sums their issue-to-
    completion times; ``wait_seconds`` is the time the consumer was blocked on them;
    ``compute_seconds`` the time it spent between steps. ``spans`` keeps
    ``(track, t0, t1)`` tuples (``perf_counter`` seconds) for ``plot_timeline``;
    ``read_path`` says how a read-ahead reads (``iter_blocks``: O_DIRECT or the page
    cache, and why), or None.
    """

    __slots__ = ("name", "kind", "ops", "bytes", "io_seconds", "wait_seconds",
                 "compute_seconds", "t_first", "t_last", "spans", "dropped_spans",
                 "read_path", "_parent", "_lock")

    def __init__(self, name: str, kind: str, parent: "PipelineStats | None" = None):
        self.name = name
        self.kind = kind
        self.ops = 0
        self.bytes = 0
        self.io_seconds = 0.0
        self.wait_seconds = 0.0
        self.compute_seconds = 0.0
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.spans: list[tuple[str, float, float]] = []
        self.dropped_spans = 0
        self.read_path: str | None = None
        self._parent = parent
        self._lock = threading.Lock()

    @property
    def efficiency(self) -> float | None:
        """Overlap efficiency ``1 - wait/io`` in [0, 1]; None before any I/O completed."""
        if self.io_seconds <= 0.0:
            return None
        return min(1.0, max(0.0, 1.0 - self.wait_seconds / self.io_seconds))

    @property
    def wall_seconds(self) -> float:
        """From the first issue to the last completion or step."""
        if self.t_first is None or self.t_last is None:
            return 0.0
        return self.t_last - self.t_first

    def _span(self, track: str, t0: float, t1: float) -> None:
        if len(self.spans) < MAX_SPANS:
            self.spans.append((track, t0, t1))
        else:
            self.dropped_spans += 1

    def _stamp(self, t0: float, t1: float) -> None:
        if self.t_first is None or t0 < self.t_first:
            self.t_first = t0
        if self.t_last is None or t1 > self.t_last:
            self.t_last = t1

    def op_done(self, nbytes: int, t_issue: float, t_done: float, wait: float,
                wait_t0: float | None = None, slot: int = 0) -> None:
        """Count one completed request (``wait`` seconds of it blocked the consumer)."""
        if collector.on:                   # once, by the pipeline that ran it (not its totals)
            collector.event(f"{self.kind} #{slot}", "io", t_issue, t_done,
                         {"pipeline": self.name, "bytes": nbytes}, track=f"{self.name} io.{slot}")
            if wait > 0.0 and wait_t0 is not None:
                collector.event("wait", "wait", wait_t0, wait_t0 + wait, {"pipeline": self.name},
                             track=f"{self.name} wait")
        self._add_op(nbytes, t_issue, t_done, wait, wait_t0, slot)

    def _add_op(self, nbytes: int, t_issue: float, t_done: float, wait: float,
                wait_t0: float | None, slot: int) -> None:
        with self._lock:
            self.ops += 1
            self.bytes += nbytes
            self.io_seconds += t_done - t_issue
            self.wait_seconds += wait
            self._stamp(t_issue, t_done)
            self._span(f"io.{slot}", t_issue, t_done)
            if wait > 0.0 and wait_t0 is not None:
                self._span("wait", wait_t0, wait_t0 + wait)
        if self._parent is not None:
            self._parent._add_op(nbytes, t_issue, t_done, wait, wait_t0, slot)

    def set_read_path(self, text: str) -> None:
        """Record how this run reads (the totals of its name show the latest run's)."""
        self.read_path = text
        if self._parent is not None:
            self._parent.read_path = text

    def computed(self, t0: float, t1: float) -> None:
        """Count consumer work between two steps of the pipeline."""
        if collector.on:
            collector.event("compute", "compute", t0, t1, {"pipeline": self.name},
                         track=f"{self.name} compute")
        self._add_compute(t0, t1)

    def _add_compute(self, t0: float, t1: float) -> None:
        with self._lock:
            self.compute_seconds += t1 - t0
            self._stamp(t0, t1)
            self._span("compute", t0, t1)
        if self._parent is not None:
            self._parent._add_compute(t0, t1)

    def as_dict(self) -> dict:
        return {"pipeline": self.name, "kind": self.kind, "ops": self.ops, "bytes": self.bytes,
                "io_seconds": self.io_seconds, "wait_seconds": self.wait_seconds,
                "compute_seconds": self.compute_seconds, "wall_seconds": self.wall_seconds,
                "efficiency": self.efficiency, "read_path": self.read_path}

    def __repr__(self) -> str:
        eff = self.efficiency
        return (f"<PipelineStats {self.name!r} {self.kind}: {self.ops} ops, {self.bytes} B, "
                f"io {self.io_seconds:.4f} s, waited {self.wait_seconds:.4f} s, "
                f"efficiency {'-' if eff is None else f'{eff:.2f}'}>")


def for_pipeline(name: str, kind: str) -> PipelineStats:
    """The running totals of every pipeline called ``name`` (what ``report()`` shows)."""
    with _lock:
        st = _pipelines.get(name)
        if st is None:
            st = _pipelines[name] = PipelineStats(name, kind)
        return st


def new_pipeline(name: str, kind: str) -> PipelineStats:
    """Counters of one pipeline run; they also add to ``for_pipeline(name, kind)``."""
    return PipelineStats(name, kind, parent=for_pipeline(name, kind))


def pipelines() -> list[dict]:
    """The pipeline totals, as plain data."""
    with _lock:
        return [p.as_dict() for p in _pipelines.values()]


def _pipeline_report() -> str:
    pipes = pipelines()
    if not pipes:
        return ""
    rows = [("pipeline", "kind", "ops", "MiB", "io s", "waited s", "compute s", "overlap")]
    for p in pipes:
        eff = p["efficiency"]
        rows.append((p["pipeline"], p["kind"], str(p["ops"]),
                     fmt_bytes(p["bytes"], "MiB", bare=True),
                     f"{p['io_seconds']:.3f}", f"{p['wait_seconds']:.3f}",
                     f"{p['compute_seconds']:.3f}", "-" if eff is None else f"{eff:.0%}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    text = "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))) for r in rows)
    paths = [f"  {p['pipeline']}: {p['read_path']}" for p in pipes if p.get("read_path")]
    return text + ("\nread paths:\n" + "\n".join(paths) if paths else "")


def plot_timeline(source: Any = None, path: str | None = None, ax: Any = None) -> Any:
    """Draw I/O, wait and compute spans as a timeline (one row per track); needs matplotlib.

    ``source``: a ``PipelineStats`` (e.g. ``pipe.stats``), a list of them, a list of trace
    events (``trace_events()``), or None for every pipeline's totals. Draws on ``ax`` when
    given, else on a new figure; saves to ``path`` when given; returns the figure.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("plot_timeline needs matplotlib: pip install matplotlib") from e
    tracks: dict[str, list[tuple[float, float]]] = {}
    if source is None:
        with _lock:
            source = list(_pipelines.values())
    if isinstance(source, PipelineStats):
        source = [source]
    t_origin = None
    for item in source:
        if isinstance(item, PipelineStats):
            with item._lock:
                spans = list(item.spans)
            for track, t0, t1 in spans:
                tracks.setdefault(f"{item.name} {track}", []).append((t0, t1 - t0))
        elif isinstance(item, dict) and item.get("ph") == "X":
            t0 = item["ts"] / 1e6
            tracks.setdefault(str(item.get("tid")), []).append((t0, item["dur"] / 1e6))
        else:
            raise TypeError(f"plot_timeline cannot draw {type(item).__name__}; pass "
                            f"PipelineStats or trace events")
    for track_spans in tracks.values():
        for t0, _ in track_spans:
            t_origin = t0 if t_origin is None else min(t_origin, t0)
    fig = None
    if ax is None:
        fig = Figure(figsize=(10, 0.6 + 0.35 * max(1, len(tracks))))
        ax = fig.add_subplot(111)
    else:
        fig = ax.figure

    def order(name: str) -> tuple:
        kind = 0 if name.endswith("compute") else 1 if name.endswith("wait") else 2
        return (name.rsplit(" ", 1)[0], kind, name)

    names = sorted(tracks, key=order)
    colours = {0: "tab:green", 1: "tab:red", 2: "tab:blue"}
    for row, name in enumerate(names):
        bars = [(t0 - (t_origin or 0.0), d) for t0, d in tracks[name]]
        ax.broken_barh(bars, (row - 0.4, 0.8), color=colours[order(name)[1]])
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names)
    ax.set_xlabel("seconds")
    ax.set_title("I/O (blue), waits (red) and compute (green)")
    if path is not None:
        fig.savefig(path, bbox_inches="tight")
    return fig
