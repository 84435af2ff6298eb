"""``chemio trace FILE``: a recorded I/O trace as a timeline picture and a short summary.

A trace is what ``CHEMIO_TRACE=path.json`` writes (``stats.write_trace``): Chrome/Perfetto
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
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
from typing import Any, Iterable, Sequence

from .errors import ArgumentError, ChemIOError

FORMATS = {".png": "png", ".svg": "svg"}


# ---------------------------------------------------------------- reading

def _key(ev: dict) -> tuple:
    return (ev.get("pid"), str(ev.get("tid")), ev.get("name"), ev.get("cat"), ev["ts"],
            ev["dur"], json.dumps(ev.get("args"), sort_keys=True, default=str))


def load(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[dict]:
    """The complete (``"ph": "X"``) events of one or more trace files, in time order.

    Exact duplicates (same process, track, name, time and arguments) count once: a
    pipeline run and its named totals both record each of its spans."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    events: list[dict] = []
    for p in paths:
        p = os.fspath(p)
        try:
            with open(p, "rb") as fh:
                data = json.load(fh)
        except FileNotFoundError:
            raise ArgumentError(f"trace file {p!r} does not exist; record one with "
                                f"CHEMIO_TRACE=path.json (one file per rank under MPI: "
                                f"path.rank<N>.json)") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise ArgumentError(f"{p!r} is not a chemio trace: not JSON ({e})") from None
        except IsADirectoryError:
            raise ArgumentError(f"{p!r} is a directory, not a trace file") from None
        evs = data.get("traceEvents") if isinstance(data, dict) else data
        if not isinstance(evs, list):
            raise ArgumentError(f"{p!r} is not a chemio trace: no 'traceEvents' list (a "
                                f"Chrome/Perfetto JSON trace as CHEMIO_TRACE writes)")
        for k, ev in enumerate(evs):
            if not isinstance(ev, dict) or ev.get("ph") != "X":
                continue
            ts, dur = ev.get("ts"), ev.get("dur")
            if not isinstance(ts, (int, float)) or not isinstance(dur, (int, float)) \
                    or dur < 0:
                raise ArgumentError(f"{p!r}: event {k} has no valid 'ts'/'dur' "
                                    f"(got ts={ts!r}, dur={dur!r})")
            events.append(ev)
    unique = {_key(ev): ev for ev in events}
    return sorted(unique.values(), key=lambda e: e["ts"])


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


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def text(s: dict, top: int = 5) -> str:
    """The summary as ``chemio trace`` prints it."""
    lines = [f"{s['events']} events over {s['seconds']:.3f} s; {s['io_events']} I/O, "
             f"{_mib(s['bytes'])} through files"]
    busy = s["io_busy_seconds"]
    share = f" ({s['overlapped_io_seconds'] / busy:.0%} of it)" if busy > 0 else ""
    lines.append(f"I/O in flight {busy:.3f} s; waited {s['wait_seconds']:.3f} s; "
                 f"I/O overlapped with work {s['overlapped_io_seconds']:.3f} s{share}")
    from .scratch import printable
    if s["files"]:
        lines.append(f"busiest files by bytes (top {min(top, len(s['files']))} of "
                     f"{len(s['files'])}):")
        for f in s["files"][:top]:
            lines.append(f"  {printable(os.path.basename(f['file'])):40s} "
                         f"{_mib(f['bytes']):>12s}  {f['io_seconds']:8.3f} s in I/O  "
                         f"({f['reads']} reads, {f['writes']} writes)")
        by_time = sorted(s["files"], key=lambda f: -f["io_seconds"])[:top]
        if [f["file"] for f in by_time] != [f["file"] for f in s["files"][:top]]:
            lines.append("busiest files by time in I/O:")
            for f in by_time:
                lines.append(f"  {printable(os.path.basename(f['file'])):40s} "
                             f"{f['io_seconds']:8.3f} s  {_mib(f['bytes']):>12s}")
    if s["pipelines"]:
        lines.append("pipelines:")
        for p in s["pipelines"]:
            eff = "-" if p["efficiency"] is None else f"{p['efficiency']:.0%}"
            lines.append(f"  {printable(p['pipeline']):40s} {p['ops']:6d} ops "
                         f"{_mib(p['bytes']):>12s}  io {p['io_seconds']:.3f} s  waited "
                         f"{p['wait_seconds']:.3f} s  overlap {eff}")
    return "\n".join(lines)


# ---------------------------------------------------------------- picture

def _tracks(events: list[dict]) -> list[dict]:
    """Events with the rank (pid) in the track name when several processes are in it."""
    if len({ev.get("pid") for ev in events}) <= 1:
        return events
    return [{**ev, "tid": f"pid {ev.get('pid')} {ev.get('tid')}"} for ev in events]


def draw(events: list[dict], out: str | os.PathLike) -> str:
    """Draw the timeline to ``out`` (``.png`` or ``.svg``); returns the path written.

    Needs matplotlib (``ChemIOError`` saying how to install it otherwise). Only a new file
    or a regular file of yours is replaced, never a link or anything else.
    """
    from . import stats
    out = os.fspath(out)
    fmt = FORMATS.get(os.path.splitext(out)[1].lower())
    if fmt is None:
        raise ArgumentError(f"chemio trace draws PNG or SVG, chosen by the output's suffix; "
                            f"{out!r} ends with neither (use e.g. trace.png or trace.svg)")
    if not events:
        raise ArgumentError("the trace holds no events to draw (was any I/O done while "
                            "CHEMIO_TRACE was set?)")
    why = stats._replaceable(out)
    if why is not None:
        raise ArgumentError(f"chemio trace will not write {out!r}: {why}; choose another path")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ChemIOError("drawing the timeline needs matplotlib, which is not installed: "
                          "pip install matplotlib (the text summary works without it)") from None
    fig = stats.plot_timeline(_tracks(events))
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, bbox_inches="tight")
    try:
        stats._write_new(out, buf.getvalue())
    except stats._Refused as e:
        raise ArgumentError(f"chemio trace will not write {out!r}: {e}; choose another "
                            f"path") from None
    return out


# ---------------------------------------------------------------- command line

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="trace file(s) written by CHEMIO_TRACE (all ranks' files together)")
    p.add_argument("-o", "--output", metavar="OUT",
                   help="the timeline picture, PNG or SVG by its suffix (needs matplotlib); "
                        "default: none, only the summary")
    p.add_argument("--top", type=int, default=5, help="files shown in the summary")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def cmd_trace(args: argparse.Namespace) -> int:
    """``chemio trace``: print the summary, draw the picture when ``-o`` is given."""
    events = load(args.files)
    summary = summarize(events)
    out = draw(events, args.output) if args.output else None
    if args.json:
        print(json.dumps({**summary, "picture": out}))
    else:
        print(text(summary, max(1, args.top)))
        if out:
            print(f"timeline: {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="chemio trace", description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return cmd_trace(args)
    except ChemIOError as e:
        print(f"chemio trace: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
