"""SIGTERM (a job's walltime) removes the scratch of the process it ends (issue 21 item 11).

Real signals to real child processes: the child is in the middle of writing an
ExclusiveFile, a scratch DiskArray and a persistent DiskArray when SIGTERM arrives; its
scratch must be gone, the persistent array intact up to what it had flushed, and the exit
status "killed by SIGTERM" (or whatever the user's own handler decided).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import chemio_py as cio
from conftest import mpiexec_path

WRITER = """
import os, signal, sys, numpy as np, chemio_py as cio
persist = sys.argv[1]
{before}
f = cio.ExclusiveFile("eaf", "w+")
s = cio.DiskArray.create("scr", (64, 256), "f8")
p = cio.DiskArray.create("keep", (100000, 256), "f8", path=persist, persistent=True,
                         backend="local")
{after}
print("scratch", os.path.dirname(f.path), flush=True)
i = 0
while not stop:
    row = np.full((1, 256), float(i))
    f.awrite(2048 * (i % 64), row)
    s.awrite(np.s_[i % 64:i % 64 + 1, :], row)
    p[i:i + 1, :] = row
    if i % 10 == 9:
        p.flush()
        print("flushed", i + 1, flush=True)
    i += 1
{on_stop}
"""


@pytest.fixture
def start(tmp_path):
    """``start(before, after, on_stop, env)`` runs WRITER in a child until it says where its
    scratch is: (child, scratch root, persistent dir, job dir, lines printed before). A child
    a failed test left running is killed."""
    children = []

    def run(*args, **kw):
        out = _start(tmp_path, *args, **kw)
        children.append(out[0])
        return out
    yield run
    for child in children:
        if child.poll() is None:
            child.kill()
            child.communicate()


def _start(tmp_path, before="stop = False", after="", on_stop="", env=None):
    root = tmp_path / "scratch"
    persist = tmp_path / "persist"
    persist.mkdir(exist_ok=True)
    (tmp_path / "shm").mkdir(exist_ok=True)
    code = WRITER.format(before=textwrap.dedent(before), after=textwrap.dedent(after),
                         on_stop=textwrap.dedent(on_stop))
    child = subprocess.Popen([sys.executable, "-c", code, str(persist)], text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**os.environ, "CHEMIO_SCRATCH": str(root),
                                  "CHEMIO_SHM_DIR": str(tmp_path / "shm"), **(env or {})})
    said = []
    while not said or not said[-1].startswith("scratch "):
        line = child.stdout.readline()
        assert line, child.stderr.read()
        said.append(line)
    return child, root, persist, said[-1].split()[-1], said[:-1]


def _terminate_while_writing(child, rows: int = 100):
    """Send SIGTERM once ``rows`` rows were flushed; return (flushed rows, rest of stdout)."""
    flushed = 0
    while flushed < rows:
        line = child.stdout.readline()
        assert line, child.stderr.read()
        flushed = int(line.split()[1])
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=60)
    return flushed, out, err


def _check_persistent(persist, flushed: int):
    with cio.DiskArray.open(str(persist / "keep.dra")) as d:
        rows = d[0:flushed, :]
    assert (rows == np.arange(flushed, dtype="f8")[:, None]).all()


def _leftovers(root) -> list[str]:
    return [os.path.join(dp, n) for dp, dns, fns in os.walk(root) for n in dns + fns]


@pytest.mark.parametrize("backend", ["local", "shm", "auto"])
def test_sigterm_removes_scratch_keeps_persistent_data_and_ends_as_killed(start, tmp_path,
                                                                         backend):
    child, root, persist, job, said = start(env={"CHEMIO_BACKEND": backend})
    assert os.path.isdir(job)
    flushed, _, err = _terminate_while_writing(child)
    assert child.returncode == -signal.SIGTERM, err
    assert not os.path.exists(job)
    assert _leftovers(root) == [] and _leftovers(tmp_path / "shm") == []
    _check_persistent(persist, flushed)


USER_EXITS = """
def on_term(signum, frame):
    print("user handler, scratch gone:", not os.path.exists(os.path.dirname(f.path)),
          flush=True)
    sys.exit(3)
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_users_handler_runs_after_the_cleanup(start, when):
    """A handler set before chemio's first scratch is chained at once; one set after it is
    wrapped at the next scratch creation."""
    if when == "before":
        before = "stop = False\n" + USER_EXITS + "signal.signal(signal.SIGTERM, on_term)"
        after = ""
    else:
        before = "stop = False\n" + USER_EXITS
        after = ("signal.signal(signal.SIGTERM, on_term)\n"
                 "g = cio.ExclusiveFile('later', 'w+')\n")
    child, root, persist, job, said = start(before, after)
    flushed, out, err = _terminate_while_writing(child)
    assert "user handler, scratch gone: True" in out, err
    assert child.returncode == 3, err                   # the user's decision, not SIGTERM's
    assert _leftovers(root) == []
    _check_persistent(persist, flushed)


def test_a_users_handler_that_returns_keeps_the_process_running(start):
    """The user's handler returns: the process goes on. Its open scratch still works (the
    files were unlinked, not closed), new scratch gets a job directory again, and the exit
    cleans up as usual."""
    before = """
    stop = False
    def on_term(signum, frame):
        global stop
        stop = True
    signal.signal(signal.SIGTERM, on_term)
    """
    on_stop = """
    print("went on; job dir gone:", not os.path.exists(os.path.dirname(f.path)), flush=True)
    f.write(0, b"still writable")
    assert f.read_bytes(0, 14) == b"still writable"
    g = cio.ExclusiveFile("after", "w+")
    g.write(0, b"x")
    print("new scratch in", os.path.dirname(g.path), flush=True)
    """
    child, root, persist, job, said = start(before, on_stop=on_stop)
    flushed, out, err = _terminate_while_writing(child)
    assert child.returncode == 0, err
    assert "went on; job dir gone: True" in out
    assert f"new scratch in {job}" in out
    assert _leftovers(root) == []
    _check_persistent(persist, flushed)


@pytest.mark.parametrize("env", [{"CHEMIO_SIGTERM_CLEANUP": "0"}, {"CHEMIO_KEEP": "1"}])
def test_opting_out_leaves_the_scratch_to_chemio_clean(start, env):
    after = "print('handler', repr(signal.getsignal(signal.SIGTERM)), flush=True)"
    child, root, persist, job, said = start(after=after, env=env)
    installed = "chemio_py" in said[0]
    assert installed == ("CHEMIO_KEEP" in env)          # KEEP: installed, keeps the scratch
    flushed, out, err = _terminate_while_writing(child)
    assert child.returncode == -signal.SIGTERM, err
    assert os.path.exists(job)
    clean = subprocess.run([sys.executable, "-m", "chemio_py.cli", "clean", "--root",
                            str(root)], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "CHEMIO_SCRATCH": str(root)})
    assert clean.returncode == 0 and _leftovers(root) == [], clean.stdout + clean.stderr
    _check_persistent(persist, flushed)


def test_handler_is_installed_only_by_scratch_in_the_main_thread(tmp_path):
    code = """
    import signal, threading, chemio_py as cio
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL       # not at import
    t = threading.Thread(target=lambda: cio.ExclusiveFile("t", "w+").close())
    t.start(); t.join()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL       # not from a thread
    cio.DiskArray.create("p", (4,), "f8", path={path!r}, persistent=True).close()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL       # no scratch, no handler
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    cio.ExclusiveFile("i", "w+").close()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN       # ignored stays ignored
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    cio.ExclusiveFile("m", "w+").close()
    h = signal.getsignal(signal.SIGTERM)
    assert "chemio_py" in repr(h) and h.previous == signal.SIG_DFL, h
    print("ok")
    """.format(path=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=120,
                       env={**os.environ, "CHEMIO_SCRATCH": str(tmp_path / "scratch")})
    assert p.stdout.strip() == "ok", p.stderr
    assert _leftovers(tmp_path / "scratch") == []


MPI_WRITER = """
import os, numpy as np, chemio_py as cio
c = cio.comm()
f = cio.ExclusiveFile("eaf", "w+")
sf = cio.SharedFile("sf")
d = cio.DiskArray.create("scr", (64, 256), "f8")
a = np.random.default_rng(c.rank).random((400, 400))
c.barrier()
with open(os.path.join(os.path.dirname(__file__), f"ready.{c.rank}.tmp"), "w") as out:
    out.write(f"{os.path.dirname(f.path)} {os.getpid()}")
os.rename(out.name, out.name[:-4])
i = 0
while True:
    f.write(8 * (i % 1000), np.array([i], "f8"))
    sf.write(8 * c.rank, np.array([i], "f8"))
    d[c.rank:c.rank + 1, :] = float(i)
    if c.rank == 1:
        np.linalg.svd(a)        # rank 1 is often inside a C call when SIGTERM comes
    i += 1
"""


def test_sigterm_to_mpiexec_removes_every_ranks_scratch(tmp_path):
    """hydra forwards SIGTERM to every rank and kills the rest as soon as one has ended:
    each rank waits (briefly) for the others of its job directory before it ends.

    (Not under a wrapper that does not exec: hydra signals its own children, the shell dies
    at once and hydra kills the ranks, which may never see SIGTERM.)"""
    script = tmp_path / "writer.py"
    script.write_text(MPI_WRITER)
    root = tmp_path / "scratch"
    cmd = [sys.executable, str(script)]
    p = subprocess.Popen([mpiexec_path(), "-n", "2", *cmd], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "CHEMIO_SCRATCH": str(root),
                              "OPENBLAS_NUM_THREADS": "1"})
    segments: set[str] = set()
    try:
        ready = [_wait_for(tmp_path / f"ready.{r}", p).split() for r in (0, 1)]
        assert ready[0][0] == ready[1][0]               # one job directory for both ranks
        segments = _mpich_segments(int(r[1]) for r in ready)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
        for seg in segments:            # MPICH's own, left by any rank killed by a signal
            if os.path.exists(seg):
                os.unlink(seg)
    assert p.returncode != 0
    assert _leftovers(root) == [], (_leftovers(root), err)


def _wait_for(path, proc: subprocess.Popen) -> str:
    """The text a rank wrote to ``path`` (once it is there)."""
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        assert proc.poll() is None and time.monotonic() < deadline, f"no {path}"
        time.sleep(0.05)
    return open(path).read()


def _mpich_segments(pids) -> set[str]:
    """The /dev/shm files of MPICH that the processes ``pids`` have mapped."""
    found = set()
    for pid in pids:
        with open(f"/proc/{pid}/maps") as fh:
            for line in fh:
                fields = line.split(None, 5)
                path = fields[5].strip() if len(fields) == 6 else ""
                if path.startswith("/dev/shm/mpich_shm_") and not path.endswith("(deleted)"):
                    found.add(path)
    return found
