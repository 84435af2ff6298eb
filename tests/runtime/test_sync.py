"""cio.sync.Counter and cio.sync.Mutex: serially with threads, and under a real mpiexec
for both MPI implementations (mpi4py.util.sync and raw RMA windows)."""
import sys
import threading

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.errors import ArgumentError
from chemio_py.runtime.comm import SerialComm
from chemio_py.sync import SyncError


@pytest.fixture(autouse=True)
def _serial_here():
    """The serial tests run on a serial communicator even where an earlier test of this
    process initialised MPI (comm() is then a one-rank MPI world, and Counter picks an MPI
    implementation); the tests under mpiexec run in processes of their own."""
    cio.configure(comm=SerialComm())
    yield
    cio.configure(comm=None)

# ------------------------------------------------------------------ serial


def test_light_import_does_not_load_mpi4py():
    import subprocess
    code = "import sys, chemio_py as cio; cio.sync.Counter; print('mpi4py' in sys.modules)"
    env = {k: v for k, v in __import__("os").environ.items()
           if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, check=True).stdout
    assert out.strip() == "False"


def test_counter_serial_fetch_and_add():
    with cio.sync.Counter(5) as c:
        assert c.impl == "serial"
        assert [c.next(), c.next(), c.next()] == [5, 6, 7]
        assert c.fetch_and_add(10) == 8
        assert c.next() == 18
        assert c.fetch_and_add(0) == 19
        assert c.fetch_and_add(-4) == 19
        assert c.next() == 15
    with pytest.raises(SyncError, match="freed"):
        c.next()
    c.free()                                          # idempotent


def test_counter_hands_out_each_task_once_across_threads():
    counter = cio.sync.Counter()
    got = [[] for _ in range(4)]

    def worker(k):
        t = counter.next()
        while t < 1000:
            got[k].append(t)
            t = counter.next()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    flat = sorted(x for g in got for x in g)
    assert flat == list(range(1000))
    assert counter.fetch_and_add(0) == 1000 + 4       # each worker overshot once
    counter.close()


@pytest.mark.parametrize("kwargs, match", [
    ({"start": 1.5}, "start must be an integer"),
    ({"start": 1 << 63}, "does not fit in a signed 64-bit"),
    ({"impl": "bogus"}, "not one of"),
    ({"impl": "mpi4py"}, "needs an MPI communicator"),
    ({"impl": "rma"}, "needs an MPI communicator"),
])
def test_counter_bad_arguments(kwargs, match):
    with pytest.raises(ArgumentError, match=match):
        cio.sync.Counter(**kwargs)


def test_counter_bad_increment_changes_nothing():
    c = cio.sync.Counter(3)
    with pytest.raises(ArgumentError):
        c.fetch_and_add("1")
    assert c.next() == 3
    c.free()


def test_mutex_serial_usage_errors():
    m = cio.sync.Mutex()
    assert m.impl == "serial" and not m.locked()
    with m:
        assert m.locked()
        with pytest.raises(SyncError, match="not recursive"):
            m.acquire()
        seen = []
        t = threading.Thread(target=lambda: seen.append(m.acquire(blocking=False)))
        t.start()
        t.join()
        assert seen == [False]                        # another thread cannot take it
        t = threading.Thread(target=lambda: seen.append(pytest.raises(SyncError, m.release)))
        t.start()
        t.join()
        assert m.locked()                             # a non-holder's release changed nothing
    assert not m.locked()
    with pytest.raises(SyncError, match="does not hold"):
        m.release()
    assert m.acquire(blocking=False)
    m.free()                                          # releases it first
    assert not m.locked()
    with pytest.raises(SyncError, match="freed"):
        m.acquire()


def test_mutex_guards_read_modify_write_of_a_shared_file_across_threads(store):
    m = cio.sync.Mutex()
    seg = 32
    with cio.SharedFile("rmw", backend=store) as sf:
        sf.write(0, np.zeros(seg))

        def worker(k):
            buf = np.empty(seg)
            for _ in range(100):
                with m:
                    sf.read(0, buf)
                    buf += k + 1
                    sf.awrite(0, buf).wait()          # complete before the release

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        np.testing.assert_array_equal(sf.read(0, np.empty(seg)), 100 * (1 + 2 + 3 + 4))
    m.free()


# ------------------------------------------------------------------ MPI

COUNTER_BODY = """
import os, numpy as np, chemio_py as cio
c = cio.comm(); me, P = c.rank, c.size
BE = os.environ["CIO_TEST_BACKEND"]
NTASK = 1000
for impl in ("mpi4py", "rma"):
    # dynamic load balancing: each task writes its index into its slot of a shared file
    sf = cio.SharedFile("tasks", backend=BE, hard_limit=NTASK * 8)
    counter = cio.sync.Counter(comm=None, impl=impl)
    assert counter.impl == impl
    mine = []
    t = counter.next()
    while t < NTASK:
        mine.append(t)
        sf.write(t * 8, np.float64(t))
        t = counter.next()
    every = c.allgather(mine)
    flat = sorted(x for m in every for x in m)
    assert flat == list(range(NTASK)), (impl, len(flat))
    assert counter.fetch_and_add(0) == NTASK + P            # each rank overshot once
    sf.flush(); c.barrier()
    np.testing.assert_array_equal(sf.read(0, np.empty(NTASK)), np.arange(NTASK))
    counter.free()
    sf.destroy()
    # chunks of 7 with fetch_and_add, starting at 100
    with cio.sync.Counter(100, impl=impl) as chunks:
        got = []
        lo = chunks.fetch_and_add(7)
        while lo < 100 + NTASK:
            got += range(lo, min(lo + 7, 100 + NTASK))
            lo = chunks.fetch_and_add(7)
        flat = sorted(x for g in c.allgather(got) for x in g)
        assert flat == list(range(100, 100 + NTASK)), impl
    with open(f"rank{me}.log", "a") as fh:
        fh.write(f"OK counter {impl} {me} {len(mine)}\\n")
"""


def test_counter_hands_out_1000_tasks_once_each_mpi(mpirun, store, tmp_path):
    mpirun(4, COUNTER_BODY, env={"CIO_TEST_BACKEND": store}, timeout=120)
    for impl in ("mpi4py", "rma"):
        done = [ln for r in range(4) for ln in (tmp_path / f"rank{r}.log").read_text().split("\n")
                if ln.startswith(f"OK counter {impl} ")]
        assert [int(ln.split()[3]) for ln in done] == [0, 1, 2, 3]
        assert sum(int(ln.split()[4]) for ln in done) == 1000


MUTEX_BODY = """
import os, numpy as np, chemio_py as cio
c = cio.comm(); me, P = c.rank, c.size
BE = os.environ["CIO_TEST_BACKEND"]
SEG, REPS = 64, 200
for impl in ("mpi4py", "rma"):
    sf = cio.SharedFile("acc", backend=BE)
    mutex = cio.sync.Mutex(impl=impl)
    if me == 0:
        sf.write(0, np.zeros(SEG))
    c.barrier()
    buf = np.empty(SEG)
    mine = (me + 1) * np.arange(1, SEG + 1, dtype=np.float64)
    for _ in range(REPS):
        with mutex:
            assert mutex.locked()
            sf.read(0, buf)
            buf += mine
            sf.awrite(0, buf).wait()        # the write completes before the release
    assert not mutex.locked()
    c.barrier()
    expect = REPS * sum(range(1, P + 1)) * np.arange(1, SEG + 1, dtype=np.float64)
    np.testing.assert_array_equal(sf.read(0, np.empty(SEG)), expect)
    # non-blocking acquire fails while another rank holds it
    if me == 0:
        assert mutex.acquire()
    c.barrier()
    if me != 0:
        assert mutex.acquire(blocking=False) is False
    c.barrier()
    if me == 0:
        mutex.release()
    mutex.free()
    sf.destroy()
    with open(f"rank{me}.log", "a") as fh:
        fh.write(f"OK mutex {impl} {me}\\n")
"""


def test_mutex_read_modify_write_exact_sum_mpi(mpirun, store, tmp_path):
    mpirun(3, MUTEX_BODY, env={"CIO_TEST_BACKEND": store}, timeout=120)
    done = sorted(ln for r in range(3) for ln in (tmp_path / f"rank{r}.log").read_text().split("\n")
                  if ln.startswith("OK mutex "))
    assert done == sorted(f"OK mutex {impl} {r}" for impl in ("mpi4py", "rma") for r in range(3))


COUNTER_EDGE = """
import chemio_py as cio
from chemio_py.errors import LimitExceededError
c = cio.comm()
for impl in (["serial"] if c.size == 1 else ["mpi4py", "rma"]):
    ctr = cio.sync.Counter(2**63 - 3, impl=impl)
    got = []
    for _ in range(3):
        try:
            got.append(ctr.next())
        except LimitExceededError as e:
            assert "signed 64-bit range" in str(e)
            got.append("refused")
    got = c.allgather(got)
    if c.rank == 0:
        print("EDGE", impl, sorted(v for vs in got for v in vs if v != "refused"),
              ctr.fetch_and_add(0), flush=True)
    ctr.free()
"""


def test_counter_refuses_to_pass_int64_serial(mpirun):
    """Issue 27: the serial counter went on to 2**63; values are signed 64-bit, so it
    hands out every value up to 2**63-2 once and refuses the rest, changing nothing."""
    proc = mpirun(1, COUNTER_EDGE)
    edges = [ln.split(None, 2) for ln in proc.stdout.splitlines() if ln.startswith("EDGE")]
    assert edges, proc.stdout
    for _, impl, rest in edges:
        assert rest == f"[{2**63 - 3}, {2**63 - 2}] {2**63 - 1}", (impl, rest)


COUNTER_LIMITS = """
import chemio_py as cio
from chemio_py.errors import LimitExceededError
c = cio.comm(); me, P = c.rank, c.size
MAX, MIN = 2**63 - 1, -2**63


def race(ctr, step, tries):
    \"\"\"Every rank adds ``step`` ``tries`` times at once; (values got, refusals).\"\"\"
    got, refused = [], 0
    c.barrier()
    for _ in range(tries):
        try:
            got.append(ctr.fetch_and_add(step))
        except LimitExceededError as e:
            assert "signed 64-bit range" in str(e) and "nothing was added" in str(e), e
            assert f"cannot add {step}" in str(e), e
            refused += 1
    every = c.allgather((got, refused))
    return sorted(v for g, _ in every for v in g), sum(r for _, r in every)


for impl in ("mpi4py", "rma"):
    # up to the top by one: exactly 10 of the 3*8 increments fit, the rest are refused
    with cio.sync.Counter(MAX - 10, impl=impl) as ctr:
        vals, refused = race(ctr, 1, 8)
        assert vals == list(range(MAX - 10, MAX)), (impl, vals)
        assert refused == 8 * P - 10, (impl, refused)
        assert ctr.fetch_and_add(0) == MAX, impl
    # steps of 7 from MAX-20: two fit (MAX-20, MAX-13), then MAX-6 stays, unchanged by
    # every refusal, and six steps of one still fit
    with cio.sync.Counter(MAX - 20, impl=impl) as ctr:
        vals, refused = race(ctr, 7, 4)
        assert vals == [MAX - 20, MAX - 13], (impl, vals)
        assert refused == 4 * P - 2
        assert ctr.fetch_and_add(0) == MAX - 6, impl
        vals, refused = race(ctr, 1, 4)
        assert vals == list(range(MAX - 6, MAX)) and refused == 4 * P - 6, (impl, vals)
        assert ctr.fetch_and_add(0) == MAX
    # down to the bottom by negative steps: no wrap to 2**63-1 either
    with cio.sync.Counter(MIN + 9, impl=impl) as ctr:
        vals, refused = race(ctr, -1, 6)
        assert vals == list(range(MIN + 1, MIN + 10)), (impl, vals)
        assert refused == 6 * P - 9
        assert ctr.fetch_and_add(0) == MIN, impl
        # the largest step refused at the bottom, and one that fits still works
        try:
            ctr.fetch_and_add(-1)
            raise AssertionError("went below -2**63")
        except LimitExceededError:
            pass
        c.barrier()
        if me == 0:
            assert ctr.fetch_and_add(MAX) == MIN
        c.barrier()
        assert ctr.fetch_and_add(0) == -1
    if me == 0:
        print("LIMITS OK", impl, flush=True)
"""


def test_counter_refuses_to_pass_int64_under_mpi(mpirun):
    """Issue 27: the MPI counters (Fetch_and_op) wrapped from 2**63-1 to -2**63. Racing
    ranks near either end: exactly the values that fit are handed out, once each, every
    other call raises LimitExceededError and the counter ends at the last valid value."""
    proc = mpirun(3, COUNTER_LIMITS, timeout=180)
    assert proc.stdout.count("LIMITS OK") == 2, proc.stdout
