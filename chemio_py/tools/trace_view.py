"""``chemio trace FILE``: a recorded I/O trace as a timeline picture and a short summary.

A trace is what ``CHEMIO_TRACE=path.json`` writes (``trace.write_trace``): Chrome/Perfetto
JSON, ``{"traceEvents": [...]}`` of complete events (``"ph": "X"``, ``ts``/``dur`` in
microseconds). I/O calls are ``cat == "io"`` with ``args.file`` and ``args.bytes``;
pipeline requests are ``cat == "io"`` with ``args.pipeline``; the consumer's waits
``cat == "wait"``; its work ``cat == "compute"``. Under MPI each rank writes its own file:
pass them all.

The summary: the busiest files by bytes and by time in I/O calls; per pipeline its I/O
time, wait and overlap efficiency ``1 - wait/io`` (as ``report()``); and on the wall clock,
the time some I/O was in flight, the time a consumer waited, and the I/O time overlapped
with work (in flight while nobody waited). The picture is ``stats.plot_timeline`` of the
events (matplotlib), PNG or SVG by the output's suffix.

A trace file is untrusted input, and may be huge. Each file is read without following a link
or blocking on a FIFO, at most ``MAX_TRACE_BYTES``, parsed by ``safejson`` (no nesting
deeper than 32 levels); at most ``max_events`` complete events are kept (the rest are counted
and reported). An event whose ``ts``, ``dur`` or ``args.bytes`` is not a finite number in range
(NaN, Infinity, 10**400, negative durations...) is a bad event: skipped, counted, reported.
The picture draws the ``MAX_TRACKS`` busiest tracks one row each and sums the others into
"N other tracks" rows (one per kind: io, wait, compute); spans of a row closer than a pixel
are drawn as one bar. Memory and time are bounded by these limits, not by the trace.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from chemio_py.errors import ArgumentError, ChemIOError, fmt_bytes
from chemio_py.runtime import safejson
from chemio_py.runtime.ownfiles import NotARegularFile, open_regular, read_bounded

FORMATS = {".png": "png", ".svg": "svg"}
MAX_TRACE_BYTES = 128 << 20     # one trace file (about a million events)
MAX_EVENTS = 250_000            # complete events kept over all files; the rest are counted
MAX_TRACKS = 64                 # rows of the picture; the other tracks are summed
MAX_TIME_US = 1e18              # |ts| and dur beyond 31,000 years are not times
_MAX_DEPTH = 32                 # a trace nests 4 levels (document, list, event, args)
_LABEL = 512                    # characters of a name, track or file name kept


# ---------------------------------------------------------------- reading

def _key(ev: dict) -> tuple:
    """What makes two events the same (every value of a read event is hashable)."""
    return (ev.get("pid"), str(ev.get("tid")), ev.get("name"), ev.get("cat"), ev["ts"],
            ev["dur"], tuple(sorted(ev.get("args", {}).items())))


@dataclass
class Trace:
    """What ``read`` found: the good complete events in time order (exact duplicates once),
    and what it left out."""
    events: list[dict]
    bad: int = 0                    # events with a bad ts, dur or bytes: skipped
    bad_examples: list[str] = field(default_factory=list)
    unread: int = 0                 # complete events past ``max_events``: not read


def _time(v: Any, low: float) -> float | None:
    """``v`` as a float of microseconds when it is one (finite, in range), else None."""
    if type(v) not in (int, float):             # (a bool is not a time)
        return None
    x = float(v) if type(v) is float or abs(v) <= MAX_TIME_US else math.inf
    return x if math.isfinite(x) and low <= x <= MAX_TIME_US else None


def _label(v: Any, strings: dict) -> str | int | None:
    """A name, track or file as the trace has it (None and ints as they are, anything else
    as text), cut to ``_LABEL`` characters and shared between events (a trace repeats a
    few names many times)."""
    if type(v) is not str:
        if v is None or type(v) is int:
            return v
        v = str(v)[:_LABEL] if isinstance(v, (bool, float)) else \
            json.dumps(v, default=str)[:_LABEL]
    elif len(v) > _LABEL:
        v = v[:_LABEL]
    return strings.setdefault(v, v) if len(strings) < 65536 else v


class _Reader:
    """Collects the complete events of trace files as ``safejson.iter_items`` parses them
    one by one: checked, slimmed to what the summary reads, at most ``limit``."""

    def __init__(self, limit: int):
        self.limit = limit
        self.trace = Trace([])
        self.strings: dict[str, str] = {}
        self.where = ""

    def take(self, obj: Any) -> None:
        if not isinstance(obj, dict) or obj.get("ph") != "X":
            return
        t = self.trace
        if len(t.events) >= self.limit:
            t.unread += 1
            return
        ts, dur = _time(obj.get("ts"), -MAX_TIME_US), _time(obj.get("dur"), 0.0)
        args = obj.get("args")
        if not isinstance(args, dict):
            args = {}
        nbytes = args.get("bytes", 0)
        ok_bytes = type(nbytes) is int and 0 <= nbytes < 1 << 63
        if ts is None or dur is None or not ok_bytes:
            t.bad += 1
            if len(t.bad_examples) < 3:
                shown = {k: obj.get(k) for k in ("ts", "dur")}
                if not ok_bytes:
                    shown["bytes"] = nbytes
                t.bad_examples.append(f"{self.where}: " + ", ".join(
                    f"{k}={v!r:.40}" for k, v in shown.items()))
            return
        s = self.strings
        ev: dict[str, Any] = {"ph": "X", "ts": ts, "dur": dur}
        for k in ("name", "cat", "pid", "tid"):
            ev[k] = _label(obj.get(k), s)
        kept = {k: _label(args[k], s) for k in ("file", "pipeline") if k in args}
        if "bytes" in args:
            kept["bytes"] = nbytes
        if type(args.get("offset")) is int:
            kept["offset"] = args["offset"]
        if kept:
            ev["args"] = kept
        t.events.append(ev)


def _read_one(p: str, reader: _Reader) -> None:
    """Add the events of trace file ``p`` to ``reader``; ``ArgumentError`` when it is not
    a trace chemio can read."""
    try:
        fd = open_regular(p)
    except FileNotFoundError:
        raise ArgumentError(f"trace file {p!r} does not exist; record one with "
                            f"CHEMIO_TRACE=path.json (one file per rank under MPI: "
                            f"path.rank<N>.json)") from None
    except NotARegularFile as e:
        raise ArgumentError(f"{p!r} {e.strerror}; a trace is a regular file written by "
                            f"CHEMIO_TRACE") from None
    except OSError as e:
        raise ArgumentError(f"cannot read trace file {p!r}: {e.strerror or e}") from None
    try:
        if os.fstat(fd).st_size > MAX_TRACE_BYTES:
            raise ValueError("too large")
        raw = read_bounded(fd, MAX_TRACE_BYTES, repr(p))
    except ValueError:
        raise ArgumentError(f"{p!r} holds more than {MAX_TRACE_BYTES >> 20} MiB, more than "
                            f"chemio trace reads; record a shorter run, or one trace per "
                            f"phase of the job") from None
    except OSError as e:
        raise ArgumentError(f"cannot read trace file {p!r}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    reader.where = os.path.basename(p)
    for item in safejson.iter_items(
            raw, what=f"trace file {p!r}", key="traceEvents", error=ArgumentError,
            hint="it is not a chemio trace (a Chrome/Perfetto JSON trace as CHEMIO_TRACE "
                 "writes)", max_bytes=MAX_TRACE_BYTES, max_depth=_MAX_DEPTH,
            max_items=MAX_TRACE_BYTES // 8, lenient_numbers=True):
        reader.take(item)


def read(paths: str | os.PathLike | Iterable[str | os.PathLike],
         max_events: int = MAX_EVENTS) -> Trace:
    """The complete (``"ph": "X"``) events of one or more trace files, in time order, and
    what was left out (see ``Trace``): at most ``max_events`` are read, bad ones skipped.

    Exact duplicates (same process, track, name, time and arguments) count once: a
    pipeline run and its named totals both record each of its spans."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    reader = _Reader(max(0, max_events))
    for p in paths:
        _read_one(os.fspath(p), reader)
    t = reader.trace
    unique = {_key(ev): ev for ev in t.events}
    t.events = sorted(unique.values(), key=lambda e: e["ts"])
    return t


def load(paths: str | os.PathLike | Iterable[str | os.PathLike],
         max_events: int = MAX_EVENTS) -> list[dict]:
    """The good events of ``read(paths, max_events)``."""
    return read(paths, max_events).events


# ---------------------------------------------------------------- summary

def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _intersection(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """Total length of the overlap of two sorted, disjoint span lists."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if hi > lo:
            total += hi - lo
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(events: list[dict]) -> dict:
    """Plain-data summary of ``events`` (seconds and bytes); see the module docstring."""
    files: dict[str, dict] = {}
    pipes: dict[str, dict] = {}
    io_spans: list[tuple[float, float]] = []
    wait_spans: list[tuple[float, float]] = []
    compute_s = 0.0
    t0 = t1 = None

    def pipe(name: Any) -> dict:
        return pipes.setdefault(str(name), {"pipeline": str(name), "ops": 0, "bytes": 0,
                                            "io_seconds": 0.0, "wait_seconds": 0.0,
                                            "compute_seconds": 0.0})
    base = min((ev["ts"] for ev in events), default=0.0)   # keeps microsecond precision
    for ev in events:
        a = (ev["ts"] - base) / 1e6
        b = a + ev["dur"] / 1e6
        t0 = a if t0 is None else min(t0, a)
        t1 = b if t1 is None else max(t1, b)
        args: dict[str, Any] = ev["args"] if isinstance(ev.get("args"), dict) else {}
        cat = ev.get("cat")
        nbytes = args.get("bytes") if isinstance(args.get("bytes"), int) else 0
        if cat == "io":
            io_spans.append((a, b))
            if "file" in args:
                f = files.setdefault(str(args["file"]), {
                    "file": str(args["file"]), "reads": 0, "writes": 0, "bytes_read": 0,
                    "bytes_written": 0, "io_seconds": 0.0})
                write = ev.get("name") == "write"
                f["writes" if write else "reads"] += 1
                f["bytes_written" if write else "bytes_read"] += nbytes
                f["io_seconds"] += b - a
            elif "pipeline" in args:
                p = pipe(args["pipeline"])
                p["ops"] += 1
                p["bytes"] += nbytes
                p["io_seconds"] += b - a
        elif cat == "wait":
            wait_spans.append((a, b))
            if "pipeline" in args:
                pipe(args["pipeline"])["wait_seconds"] += b - a
        elif cat == "compute":
            compute_s += b - a
            if "pipeline" in args:
                pipe(args["pipeline"])["compute_seconds"] += b - a
    for f in files.values():
        f["bytes"] = f["bytes_read"] + f["bytes_written"]
    for p in pipes.values():
        io_s = p["io_seconds"]
        p["efficiency"] = None if io_s <= 0 else min(1.0, max(0.0, 1 - p["wait_seconds"] / io_s))
    io_u, wait_u = _union(io_spans), _union(wait_spans)
    io_busy = _length(io_u)
    waited_on_io = _intersection(io_u, wait_u)
    return {
        "events": len(events),
        "seconds": 0.0 if t0 is None else t1 - t0,
        "io_events": len(io_spans),
        "io_busy_seconds": io_busy,                # wall time with some I/O in flight
        "wait_seconds": _length(wait_u),           # wall time a consumer was blocked
        "overlapped_io_seconds": io_busy - waited_on_io,   # I/O in flight, nobody waiting
        "compute_seconds": compute_s,
        "bytes": sum(f["bytes"] for f in files.values()),
        "files": sorted(files.values(), key=lambda f: (-f["bytes"], -f["io_seconds"])),
        "pipelines": sorted(pipes.values(), key=lambda p: -p["io_seconds"]),
    }


def text(s: dict, top: int = 5) -> str:
    """The summary as ``chemio trace`` prints it."""
    lines = [f"{s['events']} events over {s['seconds']:.3f} s; {s['io_events']} I/O, "
             f"{fmt_bytes(s['bytes'], 'MiB')} through files"]
    busy = s["io_busy_seconds"]
    share = f" ({s['overlapped_io_seconds'] / busy:.0%} of it)" if busy > 0 else ""
    lines.append(f"I/O in flight {busy:.3f} s; waited {s['wait_seconds']:.3f} s; "
                 f"I/O overlapped with work {s['overlapped_io_seconds']:.3f} s{share}")
    from chemio_py.scratch.fs import printable
    if s["files"]:
        lines.append(f"busiest files by bytes (top {min(top, len(s['files']))} of "
                     f"{len(s['files'])}):")
        for f in s["files"][:top]:
            lines.append(f"  {printable(os.path.basename(f['file'])):40s} "
                         f"{fmt_bytes(f['bytes'], 'MiB'):>12s}  {f['io_seconds']:8.3f} s in I/O  "
                         f"({f['reads']} reads, {f['writes']} writes)")
        by_time = sorted(s["files"], key=lambda f: -f["io_seconds"])[:top]
        if [f["file"] for f in by_time] != [f["file"] for f in s["files"][:top]]:
            lines.append("busiest files by time in I/O:")
            for f in by_time:
                lines.append(f"  {printable(os.path.basename(f['file'])):40s} "
                             f"{f['io_seconds']:8.3f} s  {fmt_bytes(f['bytes'], 'MiB'):>12s}")
    if s["pipelines"]:
        shown = max(top, 20)
        lines.append("pipelines:" if len(s["pipelines"]) <= shown else
                     f"pipelines (the {shown} with most I/O time of {len(s['pipelines'])}):")
        for p in s["pipelines"][:shown]:
            eff = "-" if p["efficiency"] is None else f"{p['efficiency']:.0%}"
            lines.append(f"  {printable(p['pipeline']):40s} {p['ops']:6d} ops "
                         f"{fmt_bytes(p['bytes'], 'MiB'):>12s}  io {p['io_seconds']:.3f} s  waited "
                         f"{p['wait_seconds']:.3f} s  overlap {eff}")
    if s.get("bad_events"):
        lines.append(f"{s['bad_events']} bad event{'s' if s['bad_events'] != 1 else ''} "
                     f"skipped (ts, dur or bytes not a finite number in range), e.g. "
                     f"{'; '.join(printable(x) for x in s.get('bad_examples', []))}")
    if s.get("events_not_read"):
        lines.append(f"{s['events_not_read']} events past the first {s['max_events']} not read: "
                     f"the figures above cover the first {s['max_events']} only (raise the "
                     f"limit with --max-events, at about 1 KiB of memory per event)")
    return "\n".join(lines)


# ---------------------------------------------------------------- picture

def _tracks(events: list[dict]) -> list[dict]:
    """Events with the rank (pid) in the track name when several processes are in it."""
    if len({ev.get("pid") for ev in events}) <= 1:
        return events
    return [{**ev, "tid": f"pid {ev.get('pid')} {ev.get('tid')}"} for ev in events]


def _kind(track: str) -> str:
    return "compute" if track.endswith("compute") else "wait" if track.endswith("wait") else "io"


def track_count(events: list[dict]) -> int:
    """How many tracks (rows of the picture, one per thread or pipeline slot) ``events`` use."""
    return len({str(ev.get("tid")) for ev in _tracks(events)})


def picture_rows(events: list[dict], max_tracks: int = MAX_TRACKS,
                 bars: int = 2000) -> list[dict]:
    """The events the picture draws: the ``max_tracks`` busiest tracks (by time in their
    events) as they are, every other track's events in one "N other tracks" row per kind
    (io, wait, compute); in each row, spans closer than 1/``bars`` of the trace's length
    are merged into one bar. At most ``(max_tracks + 3) * (bars + 1)`` events."""
    events = _tracks(events)
    busy: dict[str, float] = {}
    for ev in events:
        t = str(ev.get("tid"))
        busy[t] = busy.get(t, 0.0) + ev["dur"]
    keep = sorted(busy, key=lambda t: -busy[t])[:max_tracks]
    others = len(busy) - len(keep)
    row_of = {t: f"({others} other tracks) {_kind(t)}" for t in busy}
    row_of.update((t, printable_label(t)) for t in keep)
    rows: dict[str, list[tuple[float, float]]] = {}
    for ev in events:
        ts = ev["ts"]
        rows.setdefault(row_of[str(ev.get("tid"))], []).append((ts, ts + ev["dur"]))
    lo = min((ev["ts"] for ev in events), default=0.0)
    hi = max((ev["ts"] + ev["dur"] for ev in events), default=0.0)
    gap = (hi - lo) / max(1, bars)
    out: list[dict] = []
    for row, spans in rows.items():
        merged: list[list[float]] = []
        for a, b in sorted(spans):
            if merged and a <= merged[-1][1] + gap:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        out.extend({"ph": "X", "tid": row, "ts": a, "dur": b - a} for a, b in merged)
    return out


def printable_label(track: str) -> str:
    """A track's name as a row label: printable, at most 60 characters."""
    from chemio_py.scratch.fs import printable
    shown = printable(track)
    return shown if len(shown) <= 60 else shown[:28] + "..." + shown[-29:]


def draw(events: list[dict], out: str | os.PathLike, max_tracks: int = MAX_TRACKS) -> str:
    """Draw the timeline to ``out`` (``.png`` or ``.svg``); returns the path written.

    At most ``max_tracks`` rows of tracks and three rows summing the others
    (``picture_rows``), so the picture's size and the time to draw it are bounded. Needs
    matplotlib (``ChemIOError`` saying how to install it otherwise). Only a new file or a
    regular file of yours is replaced, never a link or anything else.
    """
    from chemio_py.runtime import stats, trace
    out = os.fspath(out)
    fmt = FORMATS.get(os.path.splitext(out)[1].lower())
    if fmt is None:
        raise ArgumentError(f"chemio trace draws PNG or SVG, chosen by the output's suffix; "
                            f"{out!r} ends with neither (use e.g. trace.png or trace.svg)")
    if not events:
        raise ArgumentError("the trace holds no events to draw (was any I/O done while "
                            "CHEMIO_TRACE was set?)")
    why = trace.replaceable_target(out)
    if why is not None:
        raise ArgumentError(f"chemio trace will not write {out!r}: {why}; choose another path")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ChemIOError("drawing the timeline needs matplotlib, which is not installed: "
                          "pip install matplotlib (the text summary works without it)") from None
    fig = stats.plot_timeline(picture_rows(events, max_tracks))
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, bbox_inches="tight")
    try:
        trace.write_new(out, buf.getvalue())
    except trace.Refused as e:
        raise ArgumentError(f"chemio trace will not write {out!r}: {e}; choose another "
                            f"path") from None
    return out


# ---------------------------------------------------------------- command line

def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``chemio trace``."""
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="trace file(s) written by CHEMIO_TRACE (all ranks' files together)")
    p.add_argument("-o", "--output", metavar="OUT",
                   help="the timeline picture, PNG or SVG by its suffix (needs matplotlib); "
                        "default: none, only the summary")
    p.add_argument("--top", type=int, default=5, help="files shown in the summary")
    p.add_argument("--max-events", type=int, default=MAX_EVENTS, metavar="N",
                   help=f"complete events read at most, over all files (default {MAX_EVENTS}; "
                        f"about 1 KiB of memory each); the rest are counted and reported")
    p.add_argument("--max-tracks", type=int, default=MAX_TRACKS, metavar="N",
                   help=f"tracks drawn one row each (default {MAX_TRACKS}); the others are "
                        f"summed into 'N other tracks' rows")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def run(args: argparse.Namespace) -> int:
    """``chemio trace``: print the summary, draw the picture when ``-o`` is given."""
    max_events, max_tracks = max(1, args.max_events), max(1, args.max_tracks)
    trace = read(args.files, max_events)
    summary = summarize(trace.events)
    tracks = track_count(trace.events)
    summary.update(bad_events=trace.bad, bad_examples=trace.bad_examples,
                   events_not_read=trace.unread, max_events=max_events, tracks=tracks,
                   tracks_drawn=min(tracks, max_tracks))
    out = draw(trace.events, args.output, max_tracks) if args.output else None
    if args.json:
        print(json.dumps({**summary, "picture": out}))
    else:
        print(text(summary, max(1, args.top)))
        if out:
            print(f"timeline: {out}")
            if tracks > max_tracks:
                print(f"  (the {max_tracks} busiest of {tracks} tracks drawn one row each; "
                      f"the other {tracks - max_tracks} summed into '({tracks - max_tracks} "
                      f"other tracks)' rows, one per kind: io, wait, compute)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="chemio trace", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except ChemIOError as e:
        print(f"chemio trace: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
