"""Shared Files under a real ``mpiexec``: the ChemIO/GA test, sizes, collective failures and
node-local scratch."""
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import mpiexec_path

pytestmark = pytest.mark.mpi


def logs(tmp_path, n):
    """The lines each rank logged, in rank order (rank r's file is rank{r}.log)."""
    out = []
    for r in range(n):
        f = tmp_path / f"rank{r}.log"
        out += f.read_text().splitlines() if f.exists() else []
    return out


def lines(out, prefix):
    return [ln for ln in out if ln.startswith(prefix)]

HEADER = """
import os, numpy as np, chemio_py as cio
from chemio_py.errors import CollectiveError, EndOfFileError, LimitExceededError
c = cio.comm(); me, P = c.rank, c.size
BE = os.environ["CIO_TEST_BACKEND"]
def say(line):                           # one log per rank: mpiexec interleaves stdout
    with open(f"rank{me}.log", "a") as fh:
        fh.write(line + "\\n")
def ok(tag): say(f"OK {tag} {me}")
"""

GA_TEST = HEADER + """
PIECE, NPIECE, MAXREQ = 8192, 5, 5
N = NPIECE * PIECE                       # doubles per rank; 5*8192*P in all
sf = cio.SharedFile("gatest", backend=BE, request_size=PIECE * 8, soft_limit=N * P * 8)
assert sf.size == 0
c.barrier()                              # (before any rank writes)
reqs, bufs = [], []
for k in range(NPIECE):                  # my contiguous slice, 8192 doubles per request
    if len(reqs) == MAXREQ:
        cio.waitall(reqs); reqs.clear(); bufs.clear()
    first = me * N + k * PIECE
    buf = np.arange(first + 1, first + PIECE + 1, dtype=np.float64)   # global 1-based index
    reqs.append(sf.awrite(first * 8, buf)); bufs.append(buf)
cio.waitall(reqs)
sf.flush()
c.barrier()
sizes = c.allgather(sf.size)
assert sizes == [N * P * 8] * P, sizes
other = P - 1 - me                       # read the slice another rank wrote
reqs, outs, firsts = [], [], []
def check():
    cio.waitall(reqs)
    for f, o in zip(firsts, outs):
        np.testing.assert_array_equal(o, np.arange(f + 1, f + PIECE + 1, dtype=np.float64))
    reqs.clear(); outs.clear(); firsts.clear()
for k in range(NPIECE):
    if len(reqs) == MAXREQ:
        check()
    first = other * N + k * PIECE
    out = np.empty(PIECE)
    reqs.append(sf.aread(first * 8, out)); outs.append(out); firsts.append(first)
check()
try:
    sf.read(N * P * 8 - 8, np.empty(2))
    raise AssertionError("read past the end did not raise")
except EndOfFileError:
    pass
path = sf.path
assert c.allgather(path) == [path] * P
sf.destroy()
assert not os.path.exists(path)          # gone for every rank when destroy() returns
c.barrier()                              # (before rank 0 makes it again below)
ok("ga")

# re-created: empty; a write past the end by the last rank is seen by all, holes are zero
sf = cio.SharedFile("gatest", backend=BE, hard_limit=8192)
assert sf.size == 0
c.barrier()
if me == P - 1:
    sf.write(4096, np.float64(7.0))
    try:
        sf.write(8190, b"xyz")           # passes the hard limit: raises, writes nothing
        raise AssertionError("hard limit did not hold")
    except LimitExceededError:
        pass
c.barrier()
assert c.allgather(sf.size) == [4104] * P
assert sf.read_bytes(0, 4096) == bytes(4096)
assert sf.read(4096, np.empty(1))[0] == 7.0
sf.destroy()
ok("again")

# task groups (sub-communicators) creating the same name get files of their own
color = me % 2
sub = c.mpi.Split(color, me)
sf = cio.SharedFile("group", backend=BE, comm=sub)
assert sf.comm.size == sub.Get_size()
sf.write(8 * sub.Get_rank(), np.float64(100 * color + sub.Get_rank()))
sub.Barrier()
np.testing.assert_array_equal(sf.read(0, np.empty(sub.Get_size())),
                              100 * color + np.arange(sub.Get_size()))
assert len(set(c.allgather(sf.path))) == min(P, 2)
sf.destroy()
sub.Free()
ok("groups")
"""


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ga_shared_file_test(mpirun, store, n, tmp_path):
    mpirun(n, GA_TEST, env={"CIO_TEST_BACKEND": store}, timeout=120)
    out = logs(tmp_path, n)
    for tag in ("ga", "again", "groups"):
        assert lines(out, f"OK {tag} ") == [f"OK {tag} {r}" for r in range(n)], out


FAILURES = HEADER + """
import glob, resource
from chemio_py.files.shared import NotSharedError
from chemio_py.errors import ArgumentError
job = None
def leftovers():
    import chemio_py.backends as backends
    from chemio_py.scratch import jobs
    job = jobs.job_dir(backends.resolve(BE).root("shared"))     # this job's directory
    return sorted(glob.glob(os.path.join(job, "*.sf*")))

# 1. rank 0's shared scratch cannot be created (a regular file stands in the way)
if me == 0:
    # settings are checked when given, so the directory turns into a file after that
    bad = os.environ["CIO_NOT_A_DIR"] + ".dir"
    os.mkdir(bad)
    cio.configure(shared_scratch=bad, shm_dir=bad)
    os.rmdir(bad)
    open(bad, "w").close()
try:
    cio.SharedFile("f1", backend=BE)
    say(f"NOERROR 1 {me}")
except CollectiveError as e:
    assert me != 0 and list(e.failures) == [0], e.failures
    say(f"COLL1 {me} {e}")
except OSError as e:
    assert me == 0
    say(f"OWN1 {me} {type(e).__name__}")
cio.configure(shared_scratch=None, shm_dir=None)

# 2. rank P-1 has no file descriptor left when it opens rank 0's file
if me == P - 1:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    fds = []
    try:
        while True:
            fds.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
try:
    cio.SharedFile("f2", backend=BE)
    msg = f"NOERROR 2 {me}"
except CollectiveError as e:
    assert me != P - 1 and list(e.failures) == [P - 1], e.failures
    msg = f"COLL2 {me} {e}"
except OSError as e:
    assert me == P - 1
    msg = f"OWN2 {me} {e.errno}"
if me == P - 1:
    for fd in fds:
        os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
say(msg)
if me == 0:                                # rank 0 removed the half-made file
    assert leftovers() == [], leftovers()
c.barrier()

# 3. rank 1 passes another hard limit than the others
try:
    cio.SharedFile("f3", backend=BE, hard_limit=4096 if me == 1 else 8192)
    say(f"NOERROR 3 {me}")
except CollectiveError as e:
    assert me != 1 and list(e.failures) == [1], e.failures
    say(f"COLL3 {me} {e}")
except ArgumentError as e:
    assert me == 1
    say(f"OWN3 {me} {e}")
if me == 0:
    assert leftovers() == [], leftovers()
c.barrier()

# afterwards the ranks still work together
with cio.SharedFile("f4", backend=BE) as sf:
    sf.write(me * 8, np.float64(me))
    c.barrier()
    assert list(sf.read(0, np.empty(P))) == list(range(P))
ok("after")
"""


def test_failure_on_one_rank_raises_on_every_rank(mpirun, store, tmp_path):
    blocker = tmp_path / "regular-file"
    blocker.write_text("not a directory")
    mpirun(3, FAILURES, env={"CIO_TEST_BACKEND": store, "CIO_NOT_A_DIR": str(blocker)},
           timeout=120)
    out = logs(tmp_path, 3)
    assert lines(out, "NOERROR") == [], out
    # 1: rank 0 gets its own OS error; the others learn rank 0's reason
    assert lines(out, "OWN1 ") in (["OWN1 0 NotADirectoryError"], ["OWN1 0 FileExistsError"],
                                   ["OWN1 0 StorageError"]), out
    coll1 = lines(out, "COLL1 ")
    assert [ln.split()[1] for ln in coll1] == ["1", "2"], out
    for ln in coll1:
        assert "SharedFile('f1') creation failed on 1 rank(s): rank 0:" in ln
        assert str(blocker) in ln
    # 2: rank 2 ran out of file descriptors
    assert lines(out, "OWN2 ") == ["OWN2 2 24"], out                # EMFILE
    coll2 = lines(out, "COLL2 ")
    assert [ln.split()[1] for ln in coll2] == ["0", "1"], out
    assert all("rank 2:" in ln and "Too many open files" in ln for ln in coll2), out
    # 3: mismatched arguments: rank 1's error names both versions
    own3 = lines(out, "OWN3 ")
    assert len(own3) == 1 and own3[0].startswith("OWN3 1 "), out
    assert "hard_limit=4096" in own3[0] and "hard_limit=8192" in own3[0]
    assert [ln.split()[1] for ln in lines(out, "COLL3 ")] == ["0", "2"], out
    assert lines(out, "OK after") == [f"OK after {r}" for r in range(3)], out


NODE_LOCAL = HEADER + """
from chemio_py.scratch import jobs
from chemio_py.files.shared import NotSharedError
# rank 1 runs in a private mount namespace: its shared scratch root is another tmpfs,
# like a node-local /scratch on another node.
job = c.bcast(jobs.job_dir(jobs.shared_root()) if me == 0 else None)
try:
    cio.SharedFile("nl1", backend=BE)
    say(f"NOERROR 1 {me}")
except NotSharedError as e:
    say(f"OWN1 {me} {e}")
except CollectiveError as e:
    say(f"COLL1 {me} {e}")
if me == 1:                              # a file of the same name exists there, but another one
    os.makedirs(job, mode=0o700)
    for stale in ("nl2.sf", "nl2.sf.token"):
        with open(os.path.join(job, stale), "wb") as fh:
            fh.write(os.urandom(16))
try:
    cio.SharedFile("nl2", backend=BE)
    say(f"NOERROR 2 {me}")
except NotSharedError as e:
    say(f"OWN2 {me} {e}")
except CollectiveError as e:
    say(f"COLL2 {me} {e}")
c.barrier()
if me == 0:
    assert [n for n in os.listdir(job) if ".sf" in n] == []
ok("nl")
"""


def _can_unshare() -> bool:
    if not shutil.which("unshare") or not sys.platform.startswith("linux"):
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="needs unshare -m and tmpfs mounts (root)")
def test_node_local_shared_scratch_fails_clearly(store, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    script = tmp_path / "node_local.py"
    script.write_text(textwrap.dedent(NODE_LOCAL))
    env = dict(os.environ, CIO_TEST_BACKEND=store, CHEMIO_SHARED_SCRATCH=str(shared),
               CHEMIO_SHM_DIR=str(shared))       # the shared root of local and of shm
    py = [sys.executable, "-m", "mpi4py", str(script)]
    other = ["unshare", "-m", "--propagation", "private", "sh", "-c",
             'mount -t tmpfs tmpfs "$0" && exec "$@"', str(shared)] + py
    p = subprocess.run([mpiexec_path(), "-n", "1"] + py + [":", "-n", "1"] + other,
                       capture_output=True, text=True, timeout=120, env=env, cwd=str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    out = logs(tmp_path, 2)
    assert lines(out, "NOERROR") == [], out
    own1, coll1 = lines(out, "OWN1 "), lines(out, "COLL1 ")
    assert len(own1) == 1 and own1[0].startswith("OWN1 1 "), out
    assert "cannot see the shared file" in own1[0] and "CHEMIO_SHARED_SCRATCH" in own1[0]
    assert len(coll1) == 1 and coll1[0].startswith("COLL1 0 ") \
        and "rank 1: NotSharedError" in coll1[0], out
    own2, coll2 = lines(out, "OWN2 "), lines(out, "COLL2 ")
    assert len(own2) == 1 and own2[0].startswith("OWN2 1 "), out
    assert "found a different file" in own2[0] and "node-local" in own2[0]
    assert len(coll2) == 1 and coll2[0].startswith("COLL2 0 ") \
        and "rank 1: NotSharedError" in coll2[0], out
    assert lines(out, "OK nl") == ["OK nl 0", "OK nl 1"], out
    assert not any(".sf" in n for _, _, files in os.walk(shared) for n in files)
