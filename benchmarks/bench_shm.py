"""Files in memory: the ``shm`` backend beside ``local``, and against memcpy.

Three cases, all in one run:

* **memcpy** — large requests (1, 4, 16, 64 MiB; quick: 1 and 16 MiB) through
  ``cio.ExclusiveFile`` on ``shm``, a whole pass over a 256 MiB segment (quick: 64 MiB)
  that was written once before (pages allocated and mapped), against ``np.copyto`` of the
  same bytes between two warm buffers in the same request sizes. Target: >= 0.7x memcpy
  for requests >= 1 MiB, both directions. (A first write into fresh pages is not timed:
  on this VM first-touch of any new page, anonymous memory included, runs at ~0.4 GiB/s.)
* **EAF paper case** — the ChemIO EAF pattern of ``bench_eaf`` (random permutation of
  1.6 kB .. 1.6 MB records over an 80 MB file, quick: 8 MB; read back in another random
  order) on ``shm`` and on ``local``. Local writes end with a data sync; local reads are
  reported cold (evicted) and hot (page cache); ``shm`` has neither a device nor a sync.
* **DRA section case** — the ``bench_dra`` case (8000^2 float64 array, 4000^2 section;
  quick: 2000^2 / 1000^2), aligned and at (250, 750), on ``shm`` and ``local``.

The ratios against ``local`` are informational (no target in the issue).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import MiB, evict, mib_s, payload, row  # noqa: E402

try:                                   # the patterns of the EAF and DRA benchmarks
    from bench_eaf import CHUNKS as EAF_CHUNKS, FULL_SIZE as EAF_FULL, QUICK_SIZE as EAF_QUICK
    from bench_eaf import Pattern, _label
except ImportError:                    # pragma: no cover - keep working on our own
    EAF_CHUNKS, EAF_FULL, EAF_QUICK = (1_600, 16_000, 160_000, 1_600_000), 80_000_000, 8_000_000
    Pattern = None

    def _label(chunk: int) -> str:
        return f"{chunk} B"
try:
    from bench_dra import FULL as DRA_FULL, OFFSET as DRA_OFFSET, QUICK as DRA_QUICK
except ImportError:                    # pragma: no cover
    DRA_FULL, DRA_QUICK, DRA_OFFSET = dict(n=8000, s=4000, reps=3), dict(n=2000, s=1000, reps=3), \
        (250, 750)

TARGET = 0.7


def _median(ts: list[float]) -> float:
    return statistics.median(ts)


# ------------------------------------------------------------------ memcpy

def _memcpy_case(quick: bool) -> list[dict]:
    import chemio_py as cio
    total = 64 * MiB if quick else 256 * MiB
    sizes = (1 * MiB, 16 * MiB) if quick else (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)
    reps = 15 if quick else 21
    src = payload(total, 7)
    dst = np.empty_like(src)
    np.copyto(dst, src)                           # both buffers warm
    rows = []
    f = cio.ExclusiveFile("bench-memcpy", "w+", backend="shm")
    try:
        f.write(0, src)                           # allocate and map every page once
        write, read = f.write, f.read
        seg = f.store._win.view[:total]          # the mapping itself: the physical limit
        for req in sizes:
            views = [(o, src[o:o + req], dst[o:o + req]) for o in range(0, total, req)]
            tw, tr, tc, tmw, tmr = [], [], [], [], []
            for _ in range(reps):
                t0 = time.perf_counter()
                for o, s, _d in views:
                    np.copyto(seg[o:o + req], s)
                tmw.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for o, _s, d in views:
                    np.copyto(d, seg[o:o + req])
                tmr.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for o, s, _d in views:
                    write(o, s)
                tw.append(time.perf_counter() - t0)
                dst[:] = 0
                t0 = time.perf_counter()
                for o, _s, d in views:
                    read(o, d)
                tr.append(time.perf_counter() - t0)
                if not np.array_equal(dst, src):
                    raise AssertionError("shm read back other data")
                t0 = time.perf_counter()
                for _o, s, d in views:
                    np.copyto(d, s)
                tc.append(time.perf_counter() - t0)
            # best of the interleaved repetitions: on a shared 2-core machine the median
            # measures the neighbours; the best pass is what the memory system allows
            copy = mib_s(total, min(tc))
            label = f"{req // MiB} MiB requests"
            rows.append(row(f"shm write, {label}", "MiB/s", mib_s(total, min(tw)),
                            "np.copyto", copy, TARGET,
                            f"ExclusiveFile.write over a {total // MiB} MiB segment, best of "
                            f"{reps}; median of paired ratios "
                            f"{_median([c / w for c, w in zip(tc, tw)]):.2f}"))
            rows.append(row(f"shm read, {label}", "MiB/s", mib_s(total, min(tr)),
                            "np.copyto", copy, TARGET,
                            f"ExclusiveFile.read into a warm buffer, best of {reps}; median "
                            f"of paired ratios {_median([c / r for c, r in zip(tc, tr)]):.2f}"))
            rows.append(row(f"np.copyto into the tmpfs mapping, {label}", "MiB/s",
                            mib_s(total, min(tmw)), "np.copyto", copy, None,
                            "no chemio: the limit of 4 KiB-page shared memory vs anonymous "
                            "(transparent huge page) memory on this machine"))
            rows.append(row(f"np.copyto out of the tmpfs mapping, {label}", "MiB/s",
                            mib_s(total, min(tmr)), "np.copyto", copy, None,
                            "no chemio: the mapping's limit for reads"))
    finally:
        f.delete()
    return rows


# ------------------------------------------------------------------ EAF paper case

class _Pat:
    """Offsets and views of the EAF pattern (``bench_eaf.Pattern`` when available)."""

    def __init__(self, src: np.ndarray, dst: np.ndarray, size: int, chunk: int, seed: int):
        if Pattern is not None:
            p = Pattern(src, dst, size, chunk, seed)
            self.w, self.r, self.nbytes = p.w, p.r, p.nbytes
            return
        rng = np.random.default_rng(seed)
        n = size // chunk
        smv, dmv = memoryview(src), memoryview(dst)
        self.w = [(s * chunk, smv[s * chunk:(s + 1) * chunk]) for s in rng.permutation(n)]
        self.r = [(s * chunk, dmv[s * chunk:(s + 1) * chunk]) for s in rng.permutation(n)]
        self.nbytes = n * chunk


def _eaf_once(backend: str, workdir: str, pat: _Pat) -> tuple[float, float, float | None]:
    """(write s, read s, hot read s) for one pass; local: write + flush, cold then hot read."""
    import chemio_py as cio
    d = workdir if backend == "local" else None
    f = cio.ExclusiveFile("bench-eaf", "w+", backend=backend, dir=d)
    try:
        write, read = f.write, f.read
        t0 = time.perf_counter()
        for off, buf in pat.w:
            write(off, buf)
        f.flush()
        tw = time.perf_counter() - t0
        if backend == "local":
            evict(f.path)
        t0 = time.perf_counter()
        for off, buf in pat.r:
            read(off, buf)
        tr = time.perf_counter() - t0
        th = None
        if backend == "local":
            t0 = time.perf_counter()
            for off, buf in pat.r:
                read(off, buf)
            th = time.perf_counter() - t0
    finally:
        f.delete()
    return tw, tr, th


def _eaf_case(quick: bool, workdir: str) -> list[dict]:
    size = EAF_QUICK if quick else EAF_FULL
    chunks = EAF_CHUNKS[1:] if quick else EAF_CHUNKS
    reps = 2 if quick else 3
    src = payload(size, 11)
    dst = np.empty_like(src)
    rows = []
    for chunk in chunks:
        pat = _Pat(src, dst, size, chunk, 5)
        t: dict[str, list] = {}
        for rep in range(reps):
            for be in (("shm", "local") if rep % 2 == 0 else ("local", "shm")):
                dst[:] = 0
                tw, tr, th = _eaf_once(be, workdir, pat)
                if rep == 0 and not np.array_equal(dst[:pat.nbytes], src[:pat.nbytes]):
                    raise AssertionError(f"EAF on {be} read back other data")
                t.setdefault((be, "w"), []).append(tw)
                t.setdefault((be, "r"), []).append(tr)
                if th is not None:
                    t.setdefault((be, "h"), []).append(th)
        mb = pat.nbytes
        sw, sr = mib_s(mb, _median(t["shm", "w"])), mib_s(mb, _median(t["shm", "r"]))
        lw, lr = mib_s(mb, _median(t["local", "w"])), mib_s(mb, _median(t["local", "r"]))
        lh = mib_s(mb, _median(t["local", "h"]))
        lab = f"EAF {_label(chunk)} records, {size // 1_000_000} MB"
        rows.append(row(f"{lab}: shm write", "MiB/s", sw, "local write+sync", lw, None,
                        "random record order; shm needs no sync"))
        rows.append(row(f"{lab}: shm read", "MiB/s", sr, "local cold read", lr, None,
                        "another random order; local evicted first"))
        rows.append(row(f"{lab}: shm read vs page cache", "MiB/s", sr, "local hot read", lh,
                        None, "local pages cached"))
    return rows


# ------------------------------------------------------------------ DRA section case

def _dra_case(quick: bool, workdir: str) -> list[dict]:
    import chemio_py as cio
    cfg = DRA_QUICK if quick else DRA_FULL
    n, s, reps = cfg["n"], cfg["s"], 2 if quick else cfg["reps"]
    x = np.random.default_rng(0).standard_normal((s, s))
    out = np.zeros((s, s))
    secs = {"aligned": (slice(0, s), slice(0, s)),
            "non-aligned": (slice(DRA_OFFSET[0], DRA_OFFSET[0] + s),
                            slice(DRA_OFFSET[1], DRA_OFFSET[1] + s))}
    arrays = {be: cio.DiskArray.create(f"bench-dra-{be}", (n, n), "f8", backend=be)
              for be in ("shm", "local")}
    t: dict[tuple, list] = {}
    try:
        for rep in range(reps):
            order = ("shm", "local") if rep % 2 == 0 else ("local", "shm")
            for case, sec in secs.items():
                for be in order:
                    d = arrays[be]
                    t0 = time.perf_counter()
                    d.write(sec, x)
                    d.flush()
                    t.setdefault((be, "write", case), []).append(time.perf_counter() - t0)
                    if be == "local":
                        evict(d.path)
                    out[...] = 0.0
                    t0 = time.perf_counter()
                    d.read(sec, out)
                    t.setdefault((be, "read", case), []).append(time.perf_counter() - t0)
                    if rep == 0 and not np.array_equal(out, x):
                        raise AssertionError(f"DRA on {be} read back other data")
                    t0 = time.perf_counter()
                    d.read(sec, out)
                    t.setdefault((be, "hot", case), []).append(time.perf_counter() - t0)
    finally:
        for d in arrays.values():
            d.delete()
    rows = []
    nb = s * s * 8
    for case in secs:
        def m(be, what):                # called in this iteration only
            return mib_s(nb, _median(t[be, what, case]))  # noqa: B023
        lab = f"DRA {s}x{s} section of {n}x{n} f8, {case}"
        rows.append(row(f"{lab}: shm write", "MiB/s", m("shm", "write"), "local write+sync",
                        m("local", "write"), None, "default chunks"))
        rows.append(row(f"{lab}: shm read", "MiB/s", m("shm", "read"), "local cold read",
                        m("local", "read"), None, "local evicted first"))
        rows.append(row(f"{lab}: shm read vs page cache", "MiB/s", m("shm", "hot"),
                        "local hot read", m("local", "hot"), None, "second read of each"))
    return rows


def run(quick: bool, workdir: str) -> list[dict]:
    import chemio_py as cio
    ok, why = __import__("chemio_py.backends", fromlist=["x"]).availability().get(
        "shm", (False, "not registered"))
    if not ok:
        return [row("shm backend", "available", 0.0, note=f"skipped: {why}")]
    rows = _memcpy_case(quick)
    rows += _eaf_case(quick, workdir)
    rows += _dra_case(quick, workdir)
    cio.cleanup()
    return rows


if __name__ == "__main__":
    import tempfile
    quick = "--full" not in sys.argv
    with tempfile.TemporaryDirectory(prefix="bench-shm-") as wd:
        for r in run(quick, wd):
            ratio = "" if r["ratio"] is None else f"  {r['ratio']:.2f}x {r['baseline_name']}"
            print(f"{r['case']:60s} {r['value']:10.1f} {r['metric']}{ratio}")
