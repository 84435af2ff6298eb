"""A rank that leaves the collective sequence never hangs the others (issue 21).

Every case runs under a real ``mpiexec`` with plain ``python script.py`` (not ``-m mpi4py``,
which aborts by itself) and must end well inside its time bound, on every backend where
the collective touches storage; the suite's scratch check then demands that nothing is
left behind, aborted jobs included.
"""
from __future__ import annotations

import time

import pytest

from chemio_py.runtime.rankguard import EXIT_CALL, mismatch_message, ranks_text

BACKENDS = ["local", "shm", "mpiio", "zarr"]
BOUND = 60          # seconds; a hang shows as subprocess.TimeoutExpired

PRELUDE = """
import os, sys, time, numpy as np, chemio_py as cio
c = cio.comm()
def say(*words):                    # one file per rank: mpiexec interleaves stdout lines
    with open(f"said.{c.rank}", "a") as f:
        f.write(" ".join(str(w) for w in words) + "\\n")
"""


def _run(mpirun, n, body, **kw):
    t0 = time.monotonic()
    proc = mpirun(n, PRELUDE + body, plain=True, check=False, timeout=BOUND, **kw)
    return proc, time.monotonic() - t0


def _said(tmp_path) -> list[str]:
    """Every line the ranks said, rank by rank."""
    return [ln for p in sorted(tmp_path.glob("said.*")) for ln in p.read_text().splitlines()]


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_uncaught_error_on_one_rank_ends_the_job(mpirun, backend):
    proc, took = _run(mpirun, 3, f"""
d = cio.DiskArray.create("x", (6, 4), "f8", backend={backend!r})
if c.rank == 1:
    raise RuntimeError("rank 1 fails alone")
d.write_all(np.s_[2 * c.rank:2 * c.rank + 2], np.ones((2, 4)))
d.close()
print("finished", flush=True)
""")
    assert proc.returncode != 0
    assert "finished" not in proc.stdout
    assert "RuntimeError: rank 1 fails alone" in proc.stderr
    assert "aborting the MPI job" in proc.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["local", "mpiio"])
@pytest.mark.parametrize("how", ["sys.exit(1)", "raise SystemExit(3)", "pass"])
def test_rank_that_exits_makes_the_others_raise(mpirun, backend, how):
    """sys.exit, SystemExit and a plain early end of the script: the rank's exit meets the
    others' write_all, and every rank says who left."""
    proc, took = _run(mpirun, 3, f"""
d = cio.DiskArray.create("x", (6, 4), "f8", backend={backend!r})
if c.rank == 1:
    {how}
else:
    d.write_all(np.s_[2 * c.rank:2 * c.rank + 2], np.ones((2, 4)))
    d.close()
    print("finished", flush=True)
""")
    assert proc.returncode != 0
    assert "finished" not in proc.stdout
    assert "rank 1 has left (its interpreter is exiting) while ranks 0, 2 are in " \
           "DiskArray 'x' write_all()" in proc.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_rank_that_skips_a_collective_gets_a_clear_error_everywhere(mpirun, tmp_path, backend):
    """A rank that catches its own error and goes on to close(): every rank raises the same
    CollectiveMismatchError naming who is where, later calls refuse at once, close()
    releases locally, and the job ends normally."""
    proc, took = _run(mpirun, 3, f"""
from chemio_py.errors import CollectiveMismatchError
d = cio.DiskArray.create("x", (6, 4), "f8", backend={backend!r})
try:
    if c.rank == 1:
        try:
            raise ValueError("my own bad data")
        except ValueError:
            pass                                    # ... and skips write_all
    else:
        d.write_all(np.s_[2 * c.rank:2 * c.rank + 2], np.ones((2, 4)))
    d.close()
except CollectiveMismatchError as e:
    say("mismatch", c.rank, e)
    d.close()                                       # local release, no hang
    try:
        d2 = cio.DiskArray.create("y", (2,), "f8", backend={backend!r})
    except CollectiveMismatchError as e2:
        assert "not attempted" in str(e2)
        say("refused", c.rank)
""")
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in _said(tmp_path) if ln.startswith("mismatch")]
    assert sorted(ln.split()[1] for ln in lines) == ["0", "1", "2"]
    for ln in lines:
        assert "rank 1 is in DiskArray 'x' close() (collective call #2) while ranks 0, 2 are " \
               "in DiskArray 'x' write_all() (collective call #2)" in ln
    assert sum(ln.startswith("refused") for ln in _said(tmp_path)) == 3


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["local", "shm", "mpiio"])
def test_shared_file_rank_skipping_sync_is_named(mpirun, tmp_path, backend):
    proc, took = _run(mpirun, 2, f"""
from chemio_py.errors import CollectiveMismatchError
sf = cio.SharedFile("s", backend={backend!r})
try:
    if c.rank == 0:
        sf.sync()
    sf.destroy()
except CollectiveMismatchError as e:
    say("mismatch", c.rank, e)
    sf.destroy()
""")
    assert proc.returncode == 0, proc.stderr
    said = "\n".join(_said(tmp_path))
    assert said.count("rank 0 is in SharedFile('s').sync() (collective call #2) while "
                      "rank 1 is in SharedFile('s').destroy() (collective call #2)") == 2


@pytest.mark.mpi
def test_watchdog_names_the_rank_that_never_arrived(mpirun, tmp_path):
    proc, took = _run(mpirun, 3, """
from chemio_py.errors import CollectiveTimeoutError
d = cio.DiskArray.create("x", (6, 4), "f8")
if c.rank == 2:
    time.sleep(8)                                   # far past the timeout
try:
    d.write_all(np.s_[2 * c.rank:2 * c.rank + 2], np.ones((2, 4)))
except CollectiveTimeoutError as e:
    say("timeout", c.rank, e.missing, e)
""", env={"CHEMIO_COLLECTIVE_TIMEOUT": "1"})
    assert proc.returncode != 0                      # the job ends: an abandoned wait
    assert took < BOUND
    lines = [ln for ln in _said(tmp_path) if ln.startswith("timeout")]
    assert {ln.split()[1] for ln in lines} == {"0", "1"}
    for ln in lines:
        assert "[2]" in ln and "rank 2 never arrived" in ln


@pytest.mark.mpi
def test_abort_on_error_can_be_turned_off(mpirun):
    """Opted out: no MPI_Abort, but the others still learn that the rank left."""
    proc, took = _run(mpirun, 3, """
d = cio.DiskArray.create("x", (6, 4), "f8")
if c.rank == 1:
    raise RuntimeError("rank 1 fails alone")
d.write_all(np.s_[2 * c.rank:2 * c.rank + 2], np.ones((2, 4)))
""", env={"CHEMIO_ABORT_ON_ERROR": "0"})
    assert proc.returncode != 0
    assert "aborting the MPI job" not in proc.stderr
    assert "rank 1 has left" in proc.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["local", "shm", "mpiio"])
def test_destroy_is_collective_before_removal_in_every_order(mpirun, tmp_path, backend):
    """The race of tests/scratch/test_lifecycle.py (rank 0 removed the file while rank 1 still
    looked at it), repeated in every order of close and destroy."""
    proc, took = _run(mpirun, 2, f"""
for i in range(15):
    for order in ("close-destroy", "destroy", "close-close-destroy"):
        sf = cio.SharedFile("race", backend={backend!r})
        sf.write(8 * c.rank, np.array([c.rank + 1.0]))
        sf.sync()
        for step in order.split("-"):
            if step == "close":
                sf.close()
                assert os.path.exists(sf.path), (i, order)
            else:
                sf.destroy()
                assert not os.path.exists(sf.path), (i, order)
d = cio.DiskArray.create("p", (4,), "f8", backend="local", path=os.getcwd() + "/p.dra")
for i in range(10):
    d.close()
    assert os.path.exists(d.path)
    d = cio.DiskArray.open(d.path, "r+")
d.close()
d.delete()
assert not os.path.exists(d.path)
say("ok")
""")
    assert proc.returncode == 0, proc.stderr
    assert _said(tmp_path) == ["ok", "ok"]


def test_mismatch_message_groups_ranks():
    where = [(7, "A()")] * 3 + [(7, "B()")] + [(6, EXIT_CALL)] + [(7, "A()")] * 2
    msg, groups = mismatch_message(where)
    assert groups[(7, "A()")] == [0, 1, 2, 5, 6]
    assert msg.startswith("ranks are out of step: rank 3 is in B() (collective call #7) "
                          "while rank 4 has left (its interpreter is exiting); ranks 0–2, "
                          "5–6 are in A() (collective call #7)")
    assert ranks_text(list(range(0, 100, 2))).endswith("... (50 ranks in all)")
