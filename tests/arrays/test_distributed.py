"""DiskArrays on a real ``dask.distributed`` cluster of worker *processes*.

One ``LocalCluster(n_workers=2, processes=True, threads_per_worker=1)`` serves the module
(two worker processes, as many as CI's cores: each costs a nanny and an interpreter).
The graphs carry the arrays pickled (``chemio_py.arrays.pickling``): every worker process
reopens them by path. ``to_dask`` reductions and blockwise maps, and ``from_dask`` writing
a dask computation into a DiskArray from the workers, are checked against NumPy on
``local``, ``shm`` and ``zarr``; ``mpiio`` arrays are read-only in a worker, with an error
that says why. The workers make no scratch of their own (the conftest checks the scratch
root after every test) and are gone when the module ends.
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

import chemio_py as cio
from conftest import library_bytecode, usable_backends
import chemio_py.backends as backends

pytestmark = pytest.mark.slow

distributed = pytest.importorskip("distributed")
da = pytest.importorskip("dask.array")

BACKENDS = [b for b in ("local", "shm", "zarr") if b in usable_backends(backends.ArrayBackend)]


@pytest.fixture(scope="module")
def client():
    psutil = pytest.importorskip("psutil")
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    with library_bytecode():
        cluster = distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1,
                                           dashboard_address=None, silence_logs=40)
    c = distributed.Client(cluster)
    try:
        pids = list(c.run(os.getpid).values())
        assert len(set(pids)) == 2 and os.getpid() not in pids
        yield c
    finally:
        c.close()
        cluster.close()
    # no stray process: the workers and their nannies are gone
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = [p for p in me.children(recursive=True) if p.pid not in before
                and p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                and not _tracker(p)]
        if not left:
            break
        time.sleep(0.1)
    assert not left, f"processes left running: {left}"


def _tracker(p) -> bool:
    """multiprocessing's resource tracker: one per parent process, for its lifetime."""
    try:
        return "resource_tracker" in " ".join(p.cmdline())
    except Exception:       # noqa: BLE001 - it ended meanwhile
        return True


def _model(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape)


def _pid_block(b):
    return np.full(b.shape, os.getpid(), dtype=np.int64)


@pytest.mark.parametrize("be", BACKENDS)
def test_to_dask_reductions_and_maps_run_in_worker_processes(client, be):
    model = _model((96, 40), 1)
    with cio.DiskArray.create("rd", model.shape, "f8", chunks=(8, 40), backend=be) as d:
        d[...] = model
        x = d.to_dask(chunks=(16, 40))
        assert np.isclose(x.sum().compute(), model.sum())
        np.testing.assert_allclose(x.mean(axis=0).compute(), model.mean(axis=0))
        np.testing.assert_array_equal(x.map_blocks(lambda b: 2 * b + 1).compute(),
                                      2 * model + 1)
        pids = set(np.unique(x.map_blocks(_pid_block, dtype=np.int64).compute()).tolist())
        assert pids and os.getpid() not in pids        # read in the workers, not here
        # a view of the array, sent the same way
        v = d.view[10:70, ::3] if hasattr(d, "view") else None
        if v is not None and hasattr(v, "to_dask"):
            np.testing.assert_array_equal(v.to_dask().compute(), model[10:70, ::3])


@pytest.mark.parametrize("be", BACKENDS)
def test_from_dask_stores_a_computation_from_the_workers(client, be):
    a = _model((90, 30), 2)
    x = da.from_array(a, chunks=(15, 30))
    y = (x * 2 + da.sin(x)).T                       # a computation, blocks of 30 x 15
    want = (a * 2 + np.sin(a)).T
    e = cio.DiskArray.from_dask(y, "fd", backend=be)
    try:
        assert e.shape == want.shape and e.chunks == (30, 15)
        np.testing.assert_array_equal(e[...], want)
    finally:
        e.close()
    # disk chunks that cut the dask blocks: writers of parts of one chunk in several
    # processes (zarr locks each object it rewrites in part)
    seen = []
    f = cio.DiskArray.from_dask(y, "fd2", backend=be, chunks=(8, 11),
                                progress=lambda done, total: seen.append((done, total)))
    try:
        np.testing.assert_array_equal(f[...], want)
        assert seen and seen[-1] == (want.nbytes, want.nbytes)
    finally:
        f.close()


def test_a_closed_scratch_array_fails_clearly_in_a_worker(client):
    with cio.DiskArray.create("gone", (20, 4), "f8") as d:
        x = d.to_dask(chunks=(5, 4))
    with pytest.raises(OSError, match="scratch array lives as long as its creator"):
        x.sum().compute()


def test_mpiio_arrays_are_read_only_in_workers(client, tmp_path):
    if "mpiio" not in usable_backends(backends.ArrayBackend):
        pytest.skip("mpiio is not usable here")
    model = _model((32, 8), 3)
    with cio.DiskArray.create("mp", model.shape, "f8", chunks=(8, 8), backend="mpiio",
                              path=tmp_path) as d:
        d.write_all((), model)
        d.flush()
        assert np.isclose(d.to_dask(chunks=(8, 8)).sum().compute(), model.sum())
        d.delete()
    with pytest.raises(cio.errors.ModeError, match="backend 'mpiio' is read-only in a process"):
        cio.DiskArray.from_dask(da.from_array(model, chunks=(8, 8)), "mpw", backend="mpiio",
                                path=tmp_path)
    assert not os.path.exists(tmp_path / "mpw.dra")       # from_dask removed what it made
