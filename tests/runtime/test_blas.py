"""``chemio_py.runtime.blas``: free cores from /proc/stat, BLAS threads beside I/O threads.

The thread limit is checked on the live pools (threadpoolctl's report) and against a GEMM
computed with the library's own threads; the core count against a child process spinning
on one of our cores.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.errors import ArgumentError
from chemio_py.runtime import blas

threadpoolctl = pytest.importorskip("threadpoolctl")


def _blas_threads() -> list[int]:
    return [d["num_threads"] for d in threadpoolctl.threadpool_info()
            if d["user_api"] == "blas"]


def test_free_cores_is_within_the_cpu_set():
    for _ in range(3):
        f = blas.free_cores(0.02)
        assert 0.0 <= f <= blas.cpu_set()
    assert 1 <= blas.cpu_set() <= (os.cpu_count() or 1)


def test_free_cores_since_a_sample_does_not_sleep():
    s = blas.CpuSample()
    time.sleep(0.06)
    t = time.perf_counter()
    f = blas.free_cores(0.05, since=s)
    assert time.perf_counter() - t < 0.04        # the interval had passed: no sleep
    assert 0.0 <= f <= blas.cpu_set()


@pytest.mark.skipif(not os.path.exists("/proc/stat") or not hasattr(os, "sched_getaffinity"),
                    reason="needs /proc/stat and CPU affinity")
def test_a_spinning_process_on_our_cores_is_seen_as_busy():
    cpus = sorted(os.sched_getaffinity(0))
    code = ("import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\n"
            "while True:\n    pass\n")
    child = subprocess.Popen([sys.executable, "-c", code, str(cpus[-1])])
    try:
        time.sleep(0.2)                          # started and spinning
        seen = min(blas.free_cores(0.2) for _ in range(2))
    finally:
        child.kill()
        child.wait()
    # the child holds (at least) one core of our set, whatever else runs
    assert seen <= blas.cpu_set() - 0.6


def test_own_threads_are_not_counted_as_busy():
    # this process's CPU time is subtracted: a sample over our own GEMMs finds no more
    # load than the other processes make (bounded by what the machine has)
    a = np.random.default_rng(0).standard_normal((600, 600))
    s = blas.CpuSample()
    t = time.perf_counter()
    while time.perf_counter() - t < 0.15:
        a @ a
    own = time.process_time() - s.own
    f = blas.free_cores(since=s)
    assert own > 0.05
    assert 0.0 <= f <= blas.cpu_set()


@pytest.mark.parametrize("io, free, want", [(1, 2.0, 1), (0.25, 2.0, 2), (0.25, 1.0, 1),
                                            (0, 0.0, 1), (0.5, 8.0, 8), (1, 1.3, 1),
                                            (0.25, 1.4, 1), (0.25, 1.9, 2), (2, 16, 14)])
def test_blas_threads_is_free_less_io_at_least_one(io, free, want):
    assert blas.blas_threads(io, free) == want


def test_blas_threads_measures_when_free_is_not_given():
    n = blas.blas_threads(0.0)
    assert 1 <= n <= math.ceil(blas.cpu_set())


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), True, "1", None])
def test_bad_core_counts_are_refused(bad):
    before = _blas_threads()
    with pytest.raises(ArgumentError, match="number of cores"):
        blas.blas_threads(bad, 2.0)
    if bad is not None:                          # free=None: measured
        with pytest.raises(ArgumentError, match="number of cores"):
            blas.blas_threads(1, bad)
    with pytest.raises(ArgumentError, match="io_threads"):
        with cio.blas_threads_beside_io(bad):
            pass                                  # pragma: no cover
    assert _blas_threads() == before             # nothing changed


@pytest.mark.parametrize("kw", [{"threads": 0}, {"threads": 1.5}, {"threads": True},
                                {"apis": "blas"}, {"apis": ("mkl",)}])
def test_bad_arguments_change_nothing(kw):
    before = _blas_threads()
    with pytest.raises(ArgumentError, match="nothing was|no thread count"):
        with cio.blas_threads_beside_io(**kw):
            pass                                  # pragma: no cover
    assert _blas_threads() == before


@pytest.mark.parametrize("interval", [0, -1, float("nan"), "0.1"])
def test_bad_interval_is_refused(interval):
    with pytest.raises(ArgumentError, match="interval"):
        blas.free_cores(interval)


def test_the_limit_holds_inside_and_is_restored_after():
    before = _blas_threads()
    assert before                                 # numpy's BLAS is loaded
    with cio.blas_threads_beside_io(threads=1) as n:
        assert n == 1
        assert set(_blas_threads()) == {1}
    assert _blas_threads() == before
    with pytest.raises(KeyError):
        with cio.blas_threads_beside_io(threads=1):
            assert set(_blas_threads()) == {1}
            raise KeyError("inside")
    assert _blas_threads() == before              # restored on an exception too


def test_measured_limit_is_applied_and_the_gemm_is_unchanged():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((300, 200)), rng.standard_normal((200, 250))
    want = a @ b
    with cio.blas_threads_beside_io(io_threads=0.25) as n:
        assert 1 <= n <= math.ceil(blas.cpu_set())
        # every BLAS is limited to n; one built for fewer threads (PySCF's bundled
        # OpenBLAS 0.3.3 reports 1) stays below it
        assert max(_blas_threads()) == n and all(t <= n for t in _blas_threads())
        got = a @ b
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_beside_a_read_ahead_pipeline():
    # the documented use: a read-ahead loop of GEMMs under the limit gives the model's sum
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, 40))
    d = cio.DiskArray.create("blas.pipe", x.shape, "f8", chunks=(16, 40))
    try:
        d[...] = x
        acc = np.zeros((40, 40))
        with cio.blas_threads_beside_io(io_threads=0.5):
            for _sec, blk in d.iter_blocks(axis=0, size=16):
                acc += blk.T @ blk
        np.testing.assert_allclose(acc, x.T @ x, rtol=1e-12, atol=1e-12)
    finally:
        d.close()
