"""Shared Files benchmark after the ChemIO paper (SF on the SP-2, its Figure 8).

P = 1, 2, 4 processes (real ``mpiexec -n P``) share one file of about 1 GiB cut into slots of
the request size R (32 KiB and 64 KiB). Slot ``i`` is written by process ``i % P``
(round-robin from the start of the file) with blocking ``SharedFile.write``; barrier; the
file is evicted from the page cache (fsync + POSIX_FADV_DONTNEED, untimed); then process
``k`` reads, cold, the slots written by process ``(k + 1) % P`` (``k + 1 + j*P``), so no
process reads what it wrote. The file is created with ``soft_limit`` = its size and
``request_size`` = R, as the paper's ``sf_create`` hints. Every read slot is checked.

Aggregate bandwidth = bytes moved by all processes / wall time from the barrier before the
phase to the barrier after it. The baseline is fio on the same pattern in the same run:
``numjobs=P``, ``ioengine=psync`` (one blocking request per process, like the SF loop),
buffered, ``rw=write:<(P-1)R>`` with ``offset_increment=R`` (job k writes slots k, k+P, ...),
then after eviction ``rw=read:<(P-1)R>`` from offset R (job k reads slots k+1, k+1+P, ...).
Target: SF >= 0.8x fio. Without fio the rows carry no baseline. chemio and fio runs are
interleaved and the median of the repetitions is reported.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (GiB, KiB, MiB, evict, fio_available, mib_s, payload,  # noqa: E402
                    resident_fraction, row, run_fio)

TARGET = 0.8
FULL = {"size": 1 * GiB, "procs": (1, 2, 4), "reqs": (32 * KiB, 64 * KiB), "repeat": 3}
QUICK = {"size": 32 * MiB, "procs": (1, 2, 4), "reqs": (32 * KiB, 64 * KiB), "repeat": 1}


# ------------------------------------------------------------------ the MPI worker

def _quiet_barrier(c) -> None:
    """A barrier that sleeps instead of spinning: with more ranks than cores (P=4 on 2
    here), ranks spinning in MPI_Barrier would take the CPU from ranks still doing I/O,
    which fio's jobs, sleeping in wait(), do not."""
    if c.mpi is None:
        return
    req = c.mpi.Ibarrier()
    while not req.Test():
        time.sleep(0.0002)


def _worker(size: int, req: int) -> None:
    """One SF run on every rank of COMM_WORLD; rank 0 prints ``RESULT {json}``."""
    import chemio_py as cio
    c = cio.comm()
    me, P = c.rank, c.size
    nslot = size // req
    mine = payload(req, seed=1000 + me)
    stamp = mine[:8].view(np.int64)
    sf = cio.SharedFile("bench_sf", soft_limit=size, request_size=req)

    c.barrier()
    t0 = time.perf_counter()
    for i in range(me, nslot, P):
        stamp[0] = i                      # the slot number, to check the layout on reading
        sf.write(i * req, mine)
    _quiet_barrier(c)
    t_write = time.perf_counter() - t0

    if me == 0:
        evict(sf.path)
        resident = resident_fraction(sf.path)
    c.barrier()

    writer = (me + 1) % P
    expect = payload(req, seed=1000 + writer)
    out = np.empty(req, np.uint8)
    slots = range(me + 1, nslot, P)[: nslot // P - 1]
    bad = 0
    c.barrier()
    t0 = time.perf_counter()
    for i in slots:
        sf.read(i * req, out)
        bad += out[:8].view(np.int64)[0] != i
    _quiet_barrier(c)
    t_read = time.perf_counter() - t0
    bad += not np.array_equal(out[8:], expect[8:])
    bad = c.allreduce(int(bad))
    nread = c.allreduce(len(slots))
    sf.destroy()
    if me == 0:
        print("RESULT " + json.dumps({"write_s": t_write, "read_s": t_read,
                                      "read_bytes": nread * req, "bad": bad,
                                      "resident": resident}), flush=True)


def _mpiexec() -> str:
    cand = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return cand if os.path.exists(cand) else (shutil.which("mpiexec") or "mpiexec")


def _chemio_run(p: int, size: int, req: int, workdir: str) -> dict:
    scr = os.path.join(workdir, "scratch")
    os.makedirs(scr, exist_ok=True)
    env = dict(os.environ, CHEMIO_SCRATCH=scr, CHEMIO_SHARED_SCRATCH=scr)
    for var in ("CHEMIO_SYNC", "CHEMIO_TRACE", "CHEMIO_DIRECT", "CHEMIO_BACKEND"):
        env.pop(var, None)
    cmd = [_mpiexec(), "-n", str(p), sys.executable, "-m", "mpi4py", os.path.abspath(__file__),
           "--worker", str(size), str(req)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"SF worker failed (exit {proc.returncode}) for P={p} R={req}:\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    res = json.loads(lines[-1][len("RESULT "):])
    if res["bad"]:
        raise RuntimeError(f"SF benchmark read wrong data (P={p} R={req}): {res['bad']} bad")
    return res


def _fio_run(p: int, size: int, req: int, workdir: str) -> tuple[float, float]:
    """(write MiB/s, cold read MiB/s) of fio on the SF pattern."""
    path = os.path.join(workdir, "fio.sf")
    common = dict(filename=path, bs=req, numjobs=p, offset_increment=req, ioengine="psync",
                  direct=0, group_reporting=True)
    skip = f":{(p - 1) * req}" if p > 1 else ""
    try:
        w = run_fio(name="sfw", rw="write" + skip, size=size - (p - 1) * req,
                    io_size=size // p, **common)
        evict(path)
        r = run_fio(name="sfr", rw="read" + skip, offset=req, size=size - p * req,
                    io_size=size // p - req, **common)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return w["write_mib_s"], r["read_mib_s"]


def run(quick: bool, workdir: str) -> list[dict]:
    cfg = QUICK if quick else FULL
    size = cfg["size"]
    have_fio = fio_available()
    rows = []
    for p in cfg["procs"]:
        for req in cfg["reqs"]:
            sw, sr, fw, fr, res_frac = [], [], [], [], []
            for _ in range(cfg["repeat"]):
                res = _chemio_run(p, size, req, workdir)
                sw.append(mib_s(size, res["write_s"]))
                sr.append(mib_s(res["read_bytes"], res["read_s"]))
                if res["resident"] is not None:
                    res_frac.append(res["resident"])
                if have_fio:
                    w, r = _fio_run(p, size, req, workdir)
                    fw.append(w)
                    fr.append(r)
            label = f"P={p} R={req // KiB} KiB"
            note = (f"{size / MiB:.0f} MiB file, round-robin, blocking requests, "
                    f"median of {cfg['repeat']}")
            if res_frac:
                note += f"; {max(res_frac):.0%} of the file cached before the read"
            base = "fio numjobs=P psync" if have_fio else None
            rows.append(row(f"SF write {label}", "MiB/s", statistics.median(sw), base,
                            statistics.median(fw) if have_fio else None,
                            TARGET if have_fio else None, note + " (page cache, no fsync)"))
            rows.append(row(f"SF cold read of another's data {label}", "MiB/s",
                            statistics.median(sr), base,
                            statistics.median(fr) if have_fio else None,
                            TARGET if have_fio else None, note))
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _worker(int(sys.argv[2]), int(sys.argv[3]))
    else:
        import tempfile
        quick = "--full" not in sys.argv
        with tempfile.TemporaryDirectory(prefix="bench-sf-") as d:
            for r in run(quick, d):
                print(json.dumps(r))
