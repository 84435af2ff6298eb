"""GAMESS-like I/O mixes on a per-process EAF file, async API vs fio (libaio, iodepth 32).

After the distributed-file-system study of GAMESS: as its scratch files grow, the
read/write mix moves through 0/100, 5/95, 65/35 and 85/15 (percent reads/writes). Each mix
runs on one per-process ``cio.ExclusiveFile`` (1 GiB; 64 MiB in quick mode, filled with
random bytes first, opened with ``direct=True`` so that both sides bypass the page cache)
with random, size-aligned requests of 4 KiB and of 8 MiB, 32 requests in flight, issued two
ways through the async API: grouped, ``GROUP`` requests per ``aread_many``/``awrite_many``
call (the library's way to issue many requests; the targets apply to it), and one request
per ``aread``/``awrite`` call in a ring of 32, the oldest waited for before its slot is
reused (reported for information). fio runs
the same file, mix, request size and queue depth in the same run (``ioengine=libaio``,
``iodepth=32``, ``direct=1``, time based). Targets: >= 0.8x fio's IOPS at 4 KiB and >= 0.9x
its bandwidth at 8 MiB. Without fio the fio column is left out (rows without a baseline).
"""
from __future__ import annotations

import collections
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (GiB, KiB, MiB, fio_available, mib_s, payload, raw_write_seq,  # noqa: E402
                    row, run_fio)

MIXES = ((0, 100), (5, 95), (65, 35), (85, 15))       # percent reads / writes
SIZES = ((4 * KiB, "4 KiB", 0.8, "IOPS"), (8 * MiB, "8 MiB", 0.9, "MiB/s"))
IN_FLIGHT = 32
GROUP = 8               # requests per aread_many/awrite_many call in the grouped variant
NAME = "gamess"


def _rates(nread: int, nwrite: int, size: int, dt: float) -> dict:
    ops = nread + nwrite
    return {"iops": ops / dt, "mib_s": mib_s(ops * size, dt), "read_iops": nread / dt,
            "write_iops": nwrite / dt, "seconds": dt}


def _ours(cio: Any, workdir: str, size: int, fsize: int, read_pct: int, seconds: float,
          bufs: list, seed: int) -> dict:
    """Random ``size``-byte requests, ``read_pct`` % reads, 32 in flight for ``seconds``."""
    rng = np.random.default_rng(seed)
    nslots = fsize // size
    batch = max(1, min(256, (32 * MiB) // size))     # ops between two looks at the clock
    with cio.ExclusiveFile(NAME, "r+", dir=workdir, backend="local", direct=True) as f:
        aread, awrite = f.aread, f.awrite
        ring: collections.deque = collections.deque()
        nread = nwrite = 0
        t0 = time.perf_counter()
        deadline = t0 + seconds
        slot = 0
        while time.perf_counter() < deadline:
            offs = (rng.integers(0, nslots, batch) * size).tolist()
            reads = (rng.integers(0, 100, batch) < read_pct).tolist()
            for off, is_read in zip(offs, reads):
                if len(ring) >= IN_FLIGHT:
                    ring.popleft().wait()
                buf = bufs[slot]
                slot = (slot + 1) % IN_FLIGHT
                if is_read:
                    ring.append(aread(off, buf))
                    nread += 1
                else:
                    ring.append(awrite(off, buf))
                    nwrite += 1
        while ring:
            ring.popleft().wait()
        dt = time.perf_counter() - t0
    return _rates(nread, nwrite, size, dt)


def _ours_grouped(cio: Any, workdir: str, size: int, fsize: int, read_pct: int,
                  seconds: float, bufs: np.ndarray, seed: int) -> dict:
    """The same random mix, issued ``GROUP`` at a time with ``aread_many``/``awrite_many``.

    Each group of ``GROUP`` random requests becomes one read call and one write call (the
    mix decides the split); groups are waited for oldest first, so that exactly
    ``IN_FLIGHT`` requests are in flight whenever a new group is issued.
    """
    rng = np.random.default_rng(seed)
    nslots = fsize // size
    groups = IN_FLIGHT // GROUP
    batch = max(1, min(64, (32 * MiB) // (size * GROUP)))
    with cio.ExclusiveFile(NAME, "r+", dir=workdir, backend="local", direct=True) as f:
        aread_many, awrite_many = f.aread_many, f.awrite_many
        ring: collections.deque = collections.deque()
        nread = nwrite = 0
        t0 = time.perf_counter()
        deadline = t0 + seconds
        g = 0
        while time.perf_counter() < deadline:
            offs = rng.integers(0, nslots, (batch, GROUP)) * size
            nreads = (rng.integers(0, 100, (batch, GROUP)) < read_pct).sum(axis=1).tolist()
            for k in range(batch):
                if len(ring) >= groups:
                    for r in ring.popleft():
                        r.wait()
                rows = bufs[(g % groups) * GROUP:(g % groups + 1) * GROUP]
                g += 1
                nr = nreads[k]
                reqs = []
                if nr:
                    reqs.append(aread_many(offs[k, :nr], rows[:nr]))
                if nr < GROUP:
                    reqs.append(awrite_many(offs[k, nr:], rows[nr:]))
                ring.append(reqs)
                nread += nr
                nwrite += GROUP - nr
        while ring:
            for r in ring.popleft():
                r.wait()
        dt = time.perf_counter() - t0
    return _rates(nread, nwrite, size, dt)


def _fio(path: str, size: int, fsize: int, read_pct: int, seconds: float) -> dict | None:
    rw = "randwrite" if read_pct == 0 else "randread" if read_pct == 100 else "randrw"
    res = run_fio(name=f"gamess{read_pct}", filename=path, rw=rw,
                  rwmixread=read_pct if rw == "randrw" else None, bs=size, size=fsize,
                  ioengine="libaio", iodepth=IN_FLIGHT, direct=1, runtime=max(1, round(seconds)),
                  time_based=True, randrepeat=0, norandommap=True)
    if res is None:
        return None
    iops = res["read_iops"] + res["write_iops"]
    return {"iops": iops, "mib_s": res["read_mib_s"] + res["write_mib_s"],
            "read_iops": res["read_iops"], "write_iops": res["write_iops"]}


def run(quick: bool, workdir: str) -> list[dict]:
    """Quick: a 64 MiB file, 1 s per case; full: 1 GiB, 5 s per case."""
    import chemio_py as cio
    from chemio_py import config

    fsize = 64 * MiB if quick else 1 * GiB
    seconds = 1.0 if quick else 5.0
    path = os.path.join(workdir, f"{NAME}.0")
    raw_write_seq(path, fsize, chunk=8 * MiB, buf=payload(8 * MiB, seed=9))
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        direct_note = "O_DIRECT both sides"
    except OSError:
        direct_note = "no O_DIRECT on this file system: page cache for chemio_py"
    have_fio = fio_available()
    s = config.get_setting("io_threads")
    changed = s.value < IN_FLIGHT
    restore = s.value if s.source == "explicit" else None
    if changed:
        config.configure(io_threads=IN_FLIGHT)      # 32 blocking preadv in flight = QD 32
    rows = []
    try:
        for size, label, target, metric in SIZES:
            bufs = [cio.aligned_empty(size) for _ in range(IN_FLIGHT)]
            for b in bufs:
                b[:] = 7                              # touched: no page faults while timing
            grouped = cio.aligned_empty((IN_FLIGHT, size))
            grouped[...] = 7
            for i, (rd, wr) in enumerate(MIXES):
                ours = _ours(cio, workdir, size, fsize, rd, seconds, bufs, seed=100 + i)
                mine = _ours_grouped(cio, workdir, size, fsize, rd, seconds, grouped,
                                     seed=200 + i)
                theirs = _fio(path, size, fsize, rd, seconds) if have_fio else None
                key = "iops" if metric == "IOPS" else "mib_s"
                for variant, res, on in ((f"x{IN_FLIGHT}", ours, False),
                                         (f"{GROUP} per call x{IN_FLIGHT}", mine, True)):
                    note = (f"{rd}/{wr} reads/writes, random {label} over {fsize // MiB} MiB, "
                            f"{IN_FLIGHT} in flight, {seconds:g} s; {direct_note}; chemio "
                            f"{res['read_iops']:.0f} r + {res['write_iops']:.0f} w ops/s")
                    if theirs is not None:
                        note += (f"; fio {theirs['read_iops']:.0f} r + "
                                 f"{theirs['write_iops']:.0f} w ops/s")
                    if not on:
                        note += "; one request per call, informational (target: grouped)"
                    rows.append(row(f"gamess {rd}/{wr} {label}: EAF async {variant}", metric,
                                    res[key], "fio libaio QD32" if theirs else None,
                                    theirs[key] if theirs else None,
                                    target if theirs and on else None, note))
    finally:
        if changed:
            config.configure(io_threads=restore)
        os.unlink(path)
    return rows


if __name__ == "__main__":
    import json
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        for r in run(quick="--full" not in sys.argv, workdir=d):
            print(json.dumps(r))
