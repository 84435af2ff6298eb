"""Overlap of I/O and compute through ``cio.prefetch``: how much of the shorter phase hides.

A file (1 GiB; 128 MiB in quick mode) is streamed in 8 MiB blocks through a read-ahead
pipeline (depth 2) while the consumer runs a compute step per block sized to the I/O time
of that block (repeated single-threaded NumPy ufunc passes over a cache-sized array,
which release the GIL, plus a touch of the block). Three things are timed per mode:

* ``T_io``: the pipeline with no compute (the stream alone);
* ``T_compute``: the compute steps with no I/O;
* ``wall``: the pipeline with the compute step in the loop body.

Perfect overlap gives ``wall = max(T_io, T_compute)``, none gives ``T_io + T_compute``. The
figure of merit is the hidden share of the shorter phase,
``(T_io + T_compute - wall) / min(T_io, T_compute)`` (target >= 0.9 in cold mode). Modes:
``cold O_DIRECT`` (every block from the device, no kernel copy), ``cold evicted`` (page
cache, file evicted before each run: the kernel's copy competes with compute for the two
cores) and ``hot`` (file in the page cache). A ``depth=0`` run (synchronous) is the
no-overlap reference. The pipeline's own accounting (``1 - wait/io``) is reported too.

``BLAS on all cores``: chemistry codes run BLAS on every core. A DiskArray (1 GiB; 256 MiB
quick) is streamed with ``iter_blocks`` in 8 MiB blocks, cold, while each step runs a NumPy
matmul sized to take as long as a block read the ordinary way, with ``threadpoolctl``
giving BLAS ``os.cpu_count()`` threads. Two paths, interleaved in each repetition: the
ordinary one (``direct=False``, the default: page cache, I/O threads; the kernel's copy
and the threads compete with BLAS for the cores) and ``direct=True`` (O_DIRECT + Linux AIO
straight into the ring buffers, no CPU copy). Same figure of merit, ranges over the
repetitions.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import GiB, MiB, evict, mib_s, payload, raw_write_seq, row  # noqa: E402

BLOCK = 8 * MiB
DEPTH = 2
DEEP = 4                # also measured in O_DIRECT mode: more blocks in flight absorb jitter
NAME = "overlap"


def _direct_ok(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False


class _Compute:
    """A compute step of tunable length: ``reps`` passes of a NumPy ufunc over a cache-sized
    array. Single-threaded and GIL-free, so one core stays for I/O (a multi-threaded BLAS
    kernel would spin on both cores of a 2-core machine and starve the I/O thread)."""

    def __init__(self, n: int = 1 << 15):
        self.x = np.random.default_rng(0).random(n)
        self.y = np.empty(n)
        self.reps = 1

    def _unit(self) -> None:
        np.sqrt(self.x, out=self.y)
        np.multiply(self.y, 1.0000001, out=self.y)

    def unit_seconds(self) -> float:
        for _ in range(20):
            self._unit()
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(50):
                self._unit()
            samples.append((time.perf_counter() - t0) / 50)
        return statistics.median(samples)

    def calibrate(self, seconds_per_block: float) -> None:
        self.reps = max(1, round(seconds_per_block / self.unit_seconds()))

    def __call__(self, block: np.ndarray) -> float:
        s = float(block[::4096].sum())           # use the data (one cache line per page)
        for _ in range(self.reps):
            self._unit()
        return s


def _stream(cio: Any, workdir: str, direct: bool, nbytes: int, depth: int,
            compute: _Compute | None, name: str) -> tuple[float, Any]:
    """Seconds to stream the file through prefetch (optionally computing); the run's stats."""
    with cio.ExclusiveFile(NAME, "r", dir=workdir, backend="local", direct=direct) as f:
        def read_into(k: int, buf: np.ndarray):
            return f.aread(k, buf)

        t0 = time.perf_counter()
        pipe = cio.prefetch(read_into, range(0, nbytes, BLOCK),
                            lambda: cio.aligned_empty(BLOCK // 8, np.float64), depth=depth,
                            name=name)
        for _, block in pipe:
            if compute is not None:
                compute(block)
        return time.perf_counter() - t0, pipe.stats


def _compute_only(compute: _Compute, nblocks: int) -> float:
    block = np.zeros(BLOCK // 8)
    t0 = time.perf_counter()
    for _ in range(nblocks):
        compute(block)
    return time.perf_counter() - t0


class _Matmul:
    """A compute step that uses every core: one BLAS matmul of ``n x n`` (plus a touch of
    the block), ``n`` sized so that a step takes ``seconds``."""

    def __init__(self) -> None:
        self.n = 256
        self._set(self.n)

    def _set(self, n: int) -> None:
        rng = np.random.default_rng(1)
        self.n, self.a, self.c = n, rng.random((n, n)), np.empty((n, n))

    def _time(self) -> float:
        np.matmul(self.a, self.a, out=self.c)
        samples = []
        for _ in range(7):                  # the least disturbed of a few (a shared machine)
            t0 = time.perf_counter()
            np.matmul(self.a, self.a, out=self.c)
            samples.append(time.perf_counter() - t0)
        return min(samples)

    def calibrate(self, seconds: float) -> None:
        for _ in range(3):                  # matmul time grows as n**3
            self._set(max(32, min(8192, round(self.n * (seconds / self._time()) ** (1 / 3)))))

    def __call__(self, block: np.ndarray) -> float:
        s = float(block.reshape(-1)[::512].sum())      # use the data (one word per page)
        np.matmul(self.a, self.a, out=self.c)
        return s


def _blas_stream(d: Any, direct: bool, compute: Any) -> tuple[float, Any]:
    """Seconds to stream ``d`` cold through iter_blocks (computing per block or not)."""
    from chemio_py.prefetch import iter_blocks
    d.evict()
    rows = BLOCK // (d.dtype.itemsize * d.shape[1])
    t0 = time.perf_counter()
    with iter_blocks(d, size=rows, depth=DEPTH, direct=direct,
                     name=f"overlap BLAS direct={direct}") as pipe:
        for _, block in pipe:
            if compute is not None:
                compute(block)
    return time.perf_counter() - t0, pipe.stats


def _run_blas(cio: Any, quick: bool, workdir: str) -> list[dict]:
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        print("bench_overlap: threadpoolctl missing (pip install -e '.[dev]'): BLAS case "
              "skipped", file=sys.stderr)
        return []
    nbytes = 256 * MiB if quick else 1 * GiB
    reps = 3 if quick else 5
    cols = 1024
    rows = nbytes // (8 * cols)
    nblocks = nbytes // BLOCK
    d = cio.DiskArray.create("overlap-blas", (rows, cols), np.float64, path=workdir)
    try:
        step = BLOCK // (8 * cols)
        for i in range(0, rows, step):
            d[i:i + step] = np.random.default_rng(i).random((min(step, rows - i), cols))
        d.flush()
        threads = os.cpu_count() or 1
        paths = (("direct=False (page cache, I/O threads)", False),
                 ("direct=True (O_DIRECT + AIO)", True))
        with threadpool_limits(limits=threads, user_api="blas"):
            compute = _Matmul()
            t_cal = statistics.median(_blas_stream(d, False, None)[0] for _ in range(2))
            compute.calibrate(t_cal / nblocks)
            got: dict = {p: {"hid": [], "io": [], "c": [], "wall": [], "eff": []} for _, p in paths}
            for _ in range(reps):
                for _, path in paths:
                    r = got[path]
                    t_io = _blas_stream(d, path, None)[0]
                    block = np.zeros((step, cols))
                    t0 = time.perf_counter()
                    for _ in range(nblocks):
                        compute(block)
                    t_c = time.perf_counter() - t0
                    wall, st = _blas_stream(d, path, compute)
                    r["io"].append(t_io)
                    r["c"].append(t_c)
                    r["wall"].append(wall)
                    r["eff"].append(st.efficiency or 0.0)
                    r["hid"].append((t_io + t_c - wall) / min(t_io, t_c))
    finally:
        d.delete()
    out = []
    for label, path in paths:
        r = got[path]
        hid = r["hid"]
        note = (f"{nbytes // MiB} MiB DiskArray in {BLOCK // MiB} MiB blocks, depth {DEPTH}, "
                f"cold; BLAS on {threads} threads, {compute.n}x{compute.n} matmul per block; "
                f"T_io {statistics.median(r['io']):.3f} s "
                f"({mib_s(nbytes, statistics.median(r['io'])):.0f} MiB/s), T_compute "
                f"{statistics.median(r['c']):.3f} s, wall {statistics.median(r['wall']):.3f} s; "
                f"hidden over {reps} interleaved repetitions: {min(hid):.2f} to {max(hid):.2f}; "
                f"pipeline efficiency {statistics.median(r['eff']):.2f}")
        out.append(row(f"overlap BLAS on all cores, {label}: shorter phase hidden",
                       "fraction", statistics.median(hid), "whole shorter phase", 1.0,
                       0.9 if path else None, note))
    return out


def run(quick: bool, workdir: str) -> list[dict]:
    """Quick: a 128 MiB file; full: 1 GiB; medians of 3 repetitions either way."""
    import chemio_py as cio

    nbytes = 128 * MiB if quick else 1 * GiB
    reps = 3
    nblocks = nbytes // BLOCK
    path = os.path.join(workdir, f"{NAME}.0")
    raw_write_seq(path, nbytes, chunk=BLOCK, buf=payload(BLOCK, seed=5))
    compute = _Compute()
    modes = ([("cold O_DIRECT", True, True)] if _direct_ok(path) else []) + \
        [("cold evicted", False, True), ("hot", False, False)]
    rows = []
    try:
        for mode, direct, cold in modes:
            def prep() -> None:
                if cold:  # noqa: B023 - prep() is called in this iteration only
                    evict(path)

            if not cold:
                _stream(cio, workdir, False, nbytes, DEPTH, None, "warm-up")
            prep()
            t_cal = _stream(cio, workdir, direct, nbytes, DEPTH, None, "calibration")[0]
            compute.calibrate(t_cal / nblocks)
            # the phases of one repetition run back to back, so that drift of a shared
            # machine hits them alike; the hidden share is taken per repetition
            t_io, t_c, walls, effs, hid, hid_deep = [], [], [], [], [], []
            for _ in range(reps):
                prep()
                t_io.append(_stream(cio, workdir, direct, nbytes, DEPTH, None,
                                    f"overlap {mode} io")[0])
                t_c.append(_compute_only(compute, nblocks))
                prep()
                w, st = _stream(cio, workdir, direct, nbytes, DEPTH, compute,
                                f"overlap {mode} depth {DEPTH}")
                walls.append(w)
                effs.append(st.efficiency or 0.0)
                hid.append((t_io[-1] + t_c[-1] - w) / min(t_io[-1], t_c[-1]))
                if direct:
                    prep()
                    w = _stream(cio, workdir, direct, nbytes, DEEP, compute,
                                f"overlap {mode} depth {DEEP}")[0]
                    hid_deep.append((t_io[-1] + t_c[-1] - w) / min(t_io[-1], t_c[-1]))
            tio, tc, wall = (statistics.median(x) for x in (t_io, t_c, walls))
            prep()
            w0, st0 = _stream(cio, workdir, direct, nbytes, 0, compute, f"overlap {mode} depth 0")
            ideal, serial = max(tio, tc), tio + tc
            hidden = statistics.median(hid)
            hidden0 = (serial - w0) / min(tio, tc)
            note = (f"{nbytes // MiB} MiB in {BLOCK // MiB} MiB blocks, depth {DEPTH}; T_io "
                    f"{tio:.3f} s ({mib_s(nbytes, tio):.0f} MiB/s), T_compute {tc:.3f} s "
                    f"({compute.reps} ufunc passes per block), T_io+T_compute {serial:.3f} s; "
                    f"median of {reps}")
            rows.append(row(f"overlap {mode}: wall vs max(T_io, T_compute)", "s", wall,
                            "max(T_io, T_compute)", ideal, None,
                            note + f"; vs T_io+T_compute: {wall / serial:.2f}",
                            lower_is_better=True))
            rows.append(row(f"overlap {mode}: shorter phase hidden", "fraction", hidden,
                            "whole shorter phase", 1.0, 0.9 if cold else None,
                            note + "; (T_io+T_compute-wall)/min(T_io,T_compute)"))
            if hid_deep:
                rows.append(row(f"overlap {mode}: shorter phase hidden, depth {DEEP}",
                                "fraction", statistics.median(hid_deep), "whole shorter phase",
                                1.0, None, f"as above with {DEEP} blocks in flight "
                                f"(informational; the target is for the default depth)"))
            rows.append(row(f"overlap {mode}: pipeline efficiency 1-wait/io", "fraction",
                            statistics.median(effs), None, None, None,
                            "from the pipeline's own counters (cio.report())"))
            rows.append(row(f"overlap {mode}: depth 0 (no read-ahead) wall", "s", w0,
                            "T_io+T_compute", serial, None,
                            f"synchronous reference: hidden {hidden0:.2f}, efficiency "
                            f"{(st0.efficiency or 0.0):.2f}", lower_is_better=True))
    finally:
        os.unlink(path)
    return rows + _run_blas(cio, quick, workdir)


if __name__ == "__main__":
    import json
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        for r in run(quick="--full" not in sys.argv, workdir=d):
            print(json.dumps(r))
