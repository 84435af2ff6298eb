"""The ``mpiio`` backend (issue 13): collective array I/O and native asynchronous I/O.

P = 1, 2, 4 ranks (real ``mpiexec -n P``) share a block-distributed 8192 x 8192 f8 array
(512 MiB; quick: 1024 x 1024) in the raw grid format with the default chunks: each rank a
block of rows (contiguous in the file), then a block of columns (non-contiguous). Each
method writes the array (timed from a barrier to the barrier after every rank's
``fdatasync``), the file is evicted from the page cache (untimed), then read back cold:

* ``mpiio`` store ``write_all`` / ``read_all`` (a file view of chunk pieces, collective);
* raw mpi4py ``Write_at_all`` / ``Read_at_all`` of the same bytes as one contiguous range
  per rank (the MPI-IO ceiling; target mpiio >= 0.7x);
* the ``local`` backend's ``write_all`` / ``read_all`` (independent ``pwritev``/``preadv``);
* fio ``numjobs=P`` sequential 1 MiB blocks over the same size, when fio is installed.

On one node with one aggregator (ROMIO's default ``cb_nodes=1`` here), collective
buffering only adds a copy through the aggregator: the figures say what MPI-IO costs on a
workstation, not what it gains on a parallel file system. Methods run interleaved; values
are medians of the repetitions with the range in the note.

Asynchronous: an ``ExclusiveFile`` writes then reads back cold 256 MiB (quick 32 MiB) in
requests of 1 MiB and 16 MiB with 16 in flight, on ``mpiio`` (``Iwrite_at``/``Iread_at``
completed by the store's thread) and on ``local`` (the I/O pool, or Linux AIO).
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
from common import MiB, evict, fio_available, mib_s, row, run_fio  # noqa: E402

TARGET = 0.7
FULL = {"n": 8192, "procs": (1, 2, 4), "repeat": 3, "async_bytes": 256 * MiB,
        "async_sizes": (1 * MiB, 16 * MiB), "async_repeat": 3}
QUICK = {"n": 1024, "procs": (1, 2, 4), "repeat": 1, "async_bytes": 32 * MiB,
         "async_sizes": (1 * MiB, 16 * MiB), "async_repeat": 1}


# ------------------------------------------------------------------ the MPI worker

def _quiet_barrier(mpi) -> None:
    """A barrier that sleeps instead of spinning (P=4 ranks on 2 cores)."""
    req = mpi.Ibarrier()
    while not req.Test():
        time.sleep(0.0002)


def _timed(mpi, fn) -> float:
    _quiet_barrier(mpi)
    t0 = time.perf_counter()
    fn()
    _quiet_barrier(mpi)
    return mpi.allreduce(time.perf_counter() - t0, op=_max())


def _max():
    from mpi4py import MPI
    return MPI.MAX


def _array_worker(n: int, workdir: str, case: str) -> None:
    """One round of the three methods on every rank; rank 0 prints ``RESULT {json}``."""
    import chemio_py as cio
    import chemio_py.backends as backends
    from chemio_py.backends.grid import block_bounds
    from chemio_py.arrays.chunks import default_chunks
    from mpi4py import MPI
    c = cio.comm()
    mpi = c.mpi if c.mpi is not None else MPI.COMM_WORLD
    me, P = mpi.Get_rank(), mpi.Get_size()
    shape = (n, n)
    chunks = default_chunks(shape, 8)
    axis = 0 if case == "rows" else 1
    lo, hi = block_bounds(n, P, me)
    region = (slice(lo, hi), slice(0, n)) if axis == 0 else (slice(0, n), slice(lo, hi))
    part = np.empty((hi - lo, n) if axis == 0 else (n, hi - lo))
    part[...] = me + 1.0
    total = n * n * 8
    out: dict = {}

    def evict_all(path):
        _quiet_barrier(mpi)
        if me == 0:
            evict(path)
        _quiet_barrier(mpi)

    # mpiio: collective through a file view
    path = os.path.join(workdir, f"mpiio-{case}.dra")
    be = backends.resolve("mpiio")
    st = be.open_array(path, "w+", shape=shape, dtype="f8", chunks=chunks, comm=c)
    out["mpiio_w"] = _timed(mpi, lambda: (st.write_all(region, part, c), st.flush()))
    evict_all(path)
    back = np.zeros_like(part)
    out["mpiio_r"] = _timed(mpi, lambda: st.read_all(region, back, c))
    bad = int(not (back == part).all())
    st.close()

    # raw mpi4py: the same bytes, one contiguous range per rank
    raw = os.path.join(workdir, f"raw-{case}.bin")
    if me == 0:
        os.close(os.open(raw, os.O_CREAT | os.O_TRUNC | os.O_RDWR, 0o600))
    _quiet_barrier(mpi)
    fh = MPI.File.Open(mpi, raw, MPI.MODE_RDWR)
    fd = os.open(raw, os.O_RDWR)
    flat = part.reshape(-1)
    rlo, _ = block_bounds(total, P, me, unit=8)

    def raw_write():
        fh.Write_at_all(rlo, [flat, MPI.BYTE])
        os.fdatasync(fd)
    out["raw_w"] = _timed(mpi, raw_write)
    evict_all(raw)
    out["raw_r"] = _timed(mpi, lambda: fh.Read_at_all(rlo, [flat, MPI.BYTE]))
    fh.Close()
    os.close(fd)

    # local: independent preadv/pwritev of the same region
    lpath = os.path.join(workdir, f"local-{case}.dra")
    loc = backends.resolve("local")
    if me == 0:
        loc.open_array(lpath, "w+", shape=shape, dtype="f8", chunks=chunks).close()
    _quiet_barrier(mpi)
    ls = loc.open_array(lpath, "r+", shape=shape, dtype="f8", chunks=chunks)
    out["local_w"] = _timed(mpi, lambda: (ls.write_all(region, part), ls.flush()))
    evict_all(lpath)
    out["local_r"] = _timed(mpi, lambda: ls.read_all(region, back))
    ls.close()
    bad += int(not (back == part).all())
    bad = mpi.allreduce(bad)
    _quiet_barrier(mpi)
    if me == 0:
        for p in (path, raw, lpath):
            os.unlink(p)
        out.update(bytes=total, bad=bad)
        print("RESULT " + json.dumps(out), flush=True)


def _async_worker(nbytes: int, req: int, workdir: str) -> None:
    """ExclusiveFile write then cold read, ``req``-byte requests, 16 in flight."""
    import chemio_py as cio
    cio.configure(scratch=workdir)
    out = {}
    buf = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    back = np.zeros_like(buf)
    k = nbytes // req
    for be in ("mpiio", "local"):
        with cio.ExclusiveFile(f"async-{be}", "w+", backend=be) as f:
            def run(write: bool):
                inflight = []
                for i in range(k):
                    if len(inflight) == 16:
                        inflight.pop(0).wait()
                    view = (buf if write else back)[i * req:(i + 1) * req]
                    inflight.append(f.awrite(i * req, view) if write else f.aread(i * req, view))
                for r in inflight:
                    r.wait()
                if write:
                    f.flush()
            t0 = time.perf_counter()
            run(True)
            out[f"{be}_w"] = time.perf_counter() - t0
            evict(f.path)
            t0 = time.perf_counter()
            run(False)
            out[f"{be}_r"] = time.perf_counter() - t0
            if not np.array_equal(back, buf):
                out["bad"] = be
            back[:] = 0
            f.delete()
    print("RESULT " + json.dumps(out), flush=True)


# ------------------------------------------------------------------ driver

def _mpiexec() -> str:
    cand = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return cand if os.path.exists(cand) else (shutil.which("mpiexec") or "mpiexec")


def _launch(p: int, args: list[str], workdir: str) -> dict:
    env = dict(os.environ, CHEMIO_SCRATCH=workdir, CHEMIO_SHARED_SCRATCH=workdir)
    for var in ("CHEMIO_SYNC", "CHEMIO_TRACE", "CHEMIO_DIRECT", "CHEMIO_BACKEND"):
        env.pop(var, None)
    cmd = [_mpiexec(), "-n", str(p), sys.executable, "-m", "mpi4py",
           os.path.abspath(__file__)] + args
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"mpiio worker failed (exit {proc.returncode}) for P={p} {args}:\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    res = json.loads(lines[-1][len("RESULT "):])
    if res.get("bad"):
        raise RuntimeError(f"mpiio benchmark read wrong data (P={p} {args}): {res['bad']}")
    return res


def _fio(p: int, total: int, workdir: str) -> tuple[float, float] | None:
    if not fio_available():
        return None
    path = os.path.join(workdir, "fio.mpiio")
    common = dict(filename=path, bs=MiB, numjobs=p, offset_increment=total // p,
                  ioengine="psync", direct=0, group_reporting=True, size=total // p)
    try:
        w = run_fio(name="w", rw="write", end_fsync=1, **common)
        evict(path)
        r = run_fio(name="r", rw="read", **common)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return w["write_mib_s"], r["read_mib_s"]


def _med(xs: list[float]) -> str:
    return f"median of {len(xs)}, range {min(xs):.0f}-{max(xs):.0f} MiB/s"


def run(quick: bool, workdir: str) -> list[dict]:
    cfg = QUICK if quick else FULL
    n = cfg["n"]
    total = n * n * 8
    rows = []
    cb = ("one node, one aggregator: collective buffering only adds a copy here, "
          "so this is MPI-IO's cost on a workstation, not its gain on a parallel FS")
    for p in cfg["procs"]:
        for case in ("rows", "cols"):
            bw: dict[str, list[float]] = {}
            fio_w, fio_r = [], []
            for _ in range(cfg["repeat"]):
                res = _launch(p, ["--array", str(n), workdir, case], workdir)
                for k in ("mpiio_w", "mpiio_r", "raw_w", "raw_r", "local_w", "local_r"):
                    bw.setdefault(k, []).append(mib_s(total, res[k]))
                f = _fio(p, total, workdir)
                if f is not None:
                    fio_w.append(f[0])
                    fio_r.append(f[1])
            label = f"P={p} {n}x{n} f8 {'row' if case == 'rows' else 'column'} blocks"
            for op, name in (("w", "write_all+fdatasync"), ("r", "cold read_all")):
                m = statistics.median(bw[f"mpiio_{op}"])
                note = f"mpiio {_med(bw[f'mpiio_{op}'])}"
                rows.append(row(f"mpiio {name} {label}", "MiB/s", m,
                                "raw mpi4py *_at_all, contiguous per-rank ranges",
                                statistics.median(bw[f"raw_{op}"]), TARGET,
                                f"{note}; raw {_med(bw[f'raw_{op}'])}; {cb}"))
                rows.append(row(f"mpiio {name} vs local {label}", "MiB/s", m,
                                "local write_all/read_all", statistics.median(bw[f"local_{op}"]),
                                None, f"{note}; local {_med(bw[f'local_{op}'])}"))
                fx = fio_w if op == "w" else fio_r
                if fx:
                    rows.append(row(f"mpiio {name} vs fio {label}", "MiB/s", m,
                                    "fio numjobs=P psync 1 MiB", statistics.median(fx), None,
                                    f"{note}; fio {_med(fx)}"))
    for req in cfg["async_sizes"]:
        bw = {}
        for _ in range(cfg["async_repeat"]):
            res = _launch(1, ["--async", str(cfg["async_bytes"]), str(req), workdir], workdir)
            for k in ("mpiio_w", "mpiio_r", "local_w", "local_r"):
                bw.setdefault(k, []).append(mib_s(cfg["async_bytes"], res[k]))
        for op, name in (("w", "awrite+flush"), ("r", "cold aread")):
            rows.append(row(f"mpiio {name} {req // MiB} MiB x16 in flight", "MiB/s",
                            statistics.median(bw[f"mpiio_{op}"]), "local (pool / AIO)",
                            statistics.median(bw[f"local_{op}"]), None,
                            f"{cfg['async_bytes'] // MiB} MiB; mpiio {_med(bw[f'mpiio_{op}'])}; "
                            f"local {_med(bw[f'local_{op}'])}"))
    return rows


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--array":
        _array_worker(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    elif len(sys.argv) == 5 and sys.argv[1] == "--async":
        _async_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        import tempfile
        quick = "--full" not in sys.argv
        with tempfile.TemporaryDirectory(prefix="bench-mpiio-") as d:
            for r in run(quick, d):
                print(json.dumps(r))
