"""``chemio trace``: a trace recorded by a real workload (``CHEMIO_TRACE`` in a subprocess)
drawn as PNG and SVG, and its summary checked against the trace's own events."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import chemio_py as cio

WORKLOAD = """
import time, numpy as np, chemio_py as cio
d = cio.DiskArray.create("big", (256, 1024), "f8")
d[...] = 1.0
e = cio.ExclusiveFile("small", "w+")
e.write(0, np.ones(1000))
read = lambda k, buf: d.aread((slice(k * 32, (k + 1) * 32), slice(0, 1024)), buf)
total = 0.0
for k, blk in cio.prefetch(read, range(8), lambda: np.empty((32, 1024)), depth=2,
                           name="tour"):
    time.sleep(0.01)                       # "compute": the next reads overlap with it
    total += float(blk.sum())
assert total == 256 * 1024
d.delete()
e.delete()
"""


def _chemio(*args, env=None, check=True):
    r = subprocess.run([sys.executable, "-m", "chemio_py.cli", *args], capture_output=True,
                       text=True, timeout=120, env=env)
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trace")
    path = tmp / "io.json"
    scratch = tmp / "scratch"
    scratch.mkdir()
    env = dict(os.environ, CHEMIO_TRACE=str(path), CHEMIO_SCRATCH=str(scratch))
    subprocess.run([sys.executable, "-c", WORKLOAD], env=env, check=True, timeout=120)
    assert path.is_file() and os.listdir(scratch) == []
    return path


def _union_length(spans):
    """Length covered by the spans, by a sweep over their sorted end points."""
    points = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans],
                    key=lambda p: (p[0], -p[1]))
    depth, start, total = 0, 0.0, 0.0
    for t, step in points:
        if depth == 0 and step == 1:
            start = t
        depth += step
        if depth == 0:
            total += t - start
    return total


def test_summary_matches_the_trace_events(trace):
    raw = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    # identical events count once (stats.py records a pipeline's spans for the run and
    # again for its named totals)
    events = list({json.dumps(e, sort_keys=True): e for e in raw}.values())
    s = json.loads(_chemio("trace", str(trace), "--json").stdout)
    assert s["events"] == len(events) and s["picture"] is None

    per_file: dict[str, int] = {}
    for e in events:
        if e["cat"] == "io" and "file" in e.get("args", {}):
            per_file[e["args"]["file"]] = per_file.get(e["args"]["file"], 0) + e["args"]["bytes"]
    assert {f["file"]: f["bytes"] for f in s["files"]} == per_file
    busiest = s["files"][0]
    assert os.path.basename(busiest["file"]).startswith("big")
    assert busiest["bytes"] == 2 * 256 * 1024 * 8          # written once, read once
    assert busiest["bytes_written"] == busiest["bytes_read"]
    assert s["bytes"] == sum(per_file.values())

    t0 = min(e["ts"] for e in events)
    sec = lambda e: ((e["ts"] - t0) / 1e6, (e["ts"] - t0 + e["dur"]) / 1e6)  # noqa: E731
    io = [sec(e) for e in events if e["cat"] == "io"]
    waits = [sec(e) for e in events if e["cat"] == "wait"]
    assert s["io_busy_seconds"] == pytest.approx(_union_length(io), rel=1e-9, abs=1e-9)
    assert s["wait_seconds"] == pytest.approx(_union_length(waits), rel=1e-9, abs=1e-9)
    waited_on_io = (_union_length(io) + _union_length(waits)
                    - _union_length(io + waits))            # |IO ∩ WAIT|
    assert s["overlapped_io_seconds"] == pytest.approx(_union_length(io) - waited_on_io,
                                                       rel=1e-6, abs=1e-9)
    assert 0 < s["overlapped_io_seconds"] <= s["io_busy_seconds"]

    tour = {p["pipeline"]: p for p in s["pipelines"]}["tour"]
    pipe_io = [e for e in events if e["cat"] == "io" and e.get("args", {}).get("pipeline")
               == "tour"]
    assert tour["ops"] == len(pipe_io) == 8
    assert tour["bytes"] == 256 * 1024 * 8
    assert tour["io_seconds"] == pytest.approx(sum(e["dur"] for e in pipe_io) / 1e6)
    assert 0.0 <= tour["efficiency"] <= 1.0

    text = _chemio("trace", str(trace), "--top", "1").stdout
    assert "busiest files by bytes (top 1 of 2)" in text
    assert os.path.basename(busiest["file"]) in text and "tour" in text
    assert "overlapped with work" in text


@pytest.mark.parametrize("suffix,head", [(".png", b"\x89PNG\r\n\x1a\n"), (".svg", b"<?xml")])
def test_timeline_picture(trace, tmp_path, suffix, head):
    pytest.importorskip("matplotlib")
    out = tmp_path / f"timeline{suffix}"
    r = _chemio("trace", str(trace), "-o", str(out))
    assert f"timeline: {out}" in r.stdout
    data = out.read_bytes()
    assert data.startswith(head) and len(data) > 5000
    if suffix == ".svg":
        assert b"<svg" in data and b"tour io.0" in data        # a pipeline track's label
    assert oct(os.stat(out).st_mode & 0o777) == "0o600"


def test_bad_outputs_change_nothing(trace, tmp_path):
    target = tmp_path / "precious.png"
    target.write_bytes(b"keep me")
    link = tmp_path / "link.png"
    link.symlink_to(target)
    r = _chemio("trace", str(trace), "-o", str(link), check=False)
    assert r.returncode == 1 and "symbolic link" in r.stderr
    assert target.read_bytes() == b"keep me" and link.is_symlink()
    r = _chemio("trace", str(trace), "-o", str(tmp_path / "t.jpg"), check=False)
    assert r.returncode == 1 and "PNG or SVG" in r.stderr
    assert not (tmp_path / "t.jpg").exists()
    r = _chemio("trace", str(tmp_path / "missing.json"), check=False)
    assert r.returncode == 1 and "CHEMIO_TRACE" in r.stderr
    (tmp_path / "junk.json").write_text("{not json")
    r = _chemio("trace", str(tmp_path / "junk.json"), check=False)
    assert r.returncode == 1 and "not a chemio trace" in r.stderr


def test_without_matplotlib_a_clear_error_and_the_summary_still_works(trace, tmp_path):
    out = tmp_path / "t.png"
    code = ("import sys; sys.modules['matplotlib'] = None; from chemio_py.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "trace", str(trace), "-o", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "pip install matplotlib" in r.stderr
    assert not out.exists()
    r = subprocess.run([sys.executable, "-c", code, "trace", str(trace)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "busiest files" in r.stdout


def test_each_pipeline_event_is_traced_once(tmp_path):
    """A pipeline run counts into its totals too, but its trace events are written once
    (they used to be written again by the totals, doubling every span)."""
    from chemio_py.runtime import trace
    cio.configure(trace=str(tmp_path / "t.json"))
    try:
        d = cio.DiskArray.create("once", (64, 512), "f8", chunks=(8, 512))
        d[...] = 1.0
        steps = sum(1 for _ in d.iter_blocks(axis=0, size=8, depth=2))
        io = [e for e in trace.trace_events() if e.get("cat") == "io"
              and "pipeline" in e.get("args", {})]
        assert steps == 8 and len(io) == 8, [e["name"] for e in io]
        d.close()
    finally:
        cio.configure(trace=None)
