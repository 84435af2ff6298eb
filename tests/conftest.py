"""Test scaffolding shared by every test module.

* The suite runs with its own scratch root (``CHEMIO_SCRATCH``), made fresh per session.
* ``store`` is parametrised over every backend usable here: a store test written once runs
  on each of them.
* ``mpirun(n, body)`` runs ``body`` (Python source) under a real ``mpiexec -n n`` through
  ``python -m mpi4py`` (an exception on one rank aborts the job instead of hanging it).
* After every test the process's scratch is cleaned as at exit and the scratch root must be
  empty; at the end no new chemio segment may remain in the shm directory.
* Every run has its own shm directory (a fresh directory inside ``CHEMIO_SHM_DIR``, default
  /dev/shm), so another job's segments are never taken for leaks. Under pytest-xdist
  (``-n N``) each worker has its own scratch root and shm directory (inside the controller's);
  a worker checks those for leftovers at its end and the controller, once every worker has
  ended, reports them with its own check of /dev/shm (MPICH segments). Tests marked
  ``alone`` (listed in ``ALONE`` below: they look at machine-wide state) run while no other
  worker runs a test.
  A plain serial run behaves as without xdist.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import threading
import sys
import tempfile
import textwrap
import time
from typing import Any
import uuid

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))    # tests/: shared helpers live here
REPO = os.path.dirname(TESTS)                        # the checkout: tests are grouped below
WORKER = os.environ.get("PYTEST_XDIST_WORKER")       # "gw0", ... in an xdist worker, else None
# A process a test starts may import this module without pytest (a spawned worker
# unpickling a function of a test module): it keeps the test's scratch root and shm
# directory instead of making new ones that nobody would remove.
# CIO_TESTS_OWNER ("<pid> <xdist worker or ->") names the pytest process that made the
# root; an xdist worker is a child of the controller but has its own worker name.
_INHERITED = os.environ.get("CHEMIO_SCRATCH", "")
_owner_pid, _, _owner_worker = os.environ.get("CIO_TESTS_OWNER", "").partition(" ")
_HELPER_PROCESS = (_owner_pid not in ("", str(os.getpid())) and _owner_worker == (WORKER or "-")
                   and os.path.isdir(_INHERITED))
SCRATCH_ROOT = _INHERITED if _HELPER_PROCESS else tempfile.mkdtemp(prefix="cio-tests-")
os.environ["CHEMIO_SCRATCH"] = SCRATCH_ROOT
if not _HELPER_PROCESS:
    os.environ["CIO_TESTS_OWNER"] = f"{os.getpid()} {WORKER or '-'}"
# The run's own shm directory (a worker's inside the controller's): its segments, budget and
# leak check are not another worker's, nor another job's on the same machine.
_OWN_SHM = None
if not _HELPER_PROCESS:
    try:
        _OWN_SHM = tempfile.mkdtemp(prefix=f"cio-tests-{WORKER or 'run'}-",
                                    dir=os.environ.get("CHEMIO_SHM_DIR") or "/dev/shm")
        os.environ["CHEMIO_SHM_DIR"] = _OWN_SHM
    except OSError:                                 # no writable shm dir: tests will say so
        pass
# Bytecode for the processes tests start (python -c, mpiexec ranks, CLIs): with
# PYTHONDONTWRITEBYTECODE set, each of them compiled chemio_py's source again (0.35 s of CPU a
# process, hundreds of processes a run). They share one cache directory of the run instead
# (PYTHONPYCACHEPREFIX), so the checkout gets no __pycache__; the controller (or the serial
# run) makes it and removes it at the end. The pytest processes themselves keep reading the
# usual caches (with the prefix they would compile every library again): an xdist worker
# hands the directory (CIO_TESTS_PYCACHE, from the controller) to its children only.
_PYCACHE = None


def _children_share_bytecode() -> None:
    if _PYCACHE and os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
        os.environ["PYTHONPYCACHEPREFIX"] = _PYCACHE


@contextlib.contextmanager
def library_bytecode():
    """Processes started inside read the installed libraries' own caches, as outside the
    tests: for children that import much more than chemio_py (each process of a dask cluster
    started at once would first compile all of distributed into the run's cache: 4 s of CPU)."""
    saved = {k: os.environ.get(k) for k in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    if _PYCACHE and saved["PYTHONPYCACHEPREFIX"] == _PYCACHE:
        os.environ.pop("PYTHONPYCACHEPREFIX")
        os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_SEEDER: list = []                  # the controller's thread filling the cache (below)
_SEEDER_STOP = threading.Event()


def _seed_library_bytecode(prefix: str) -> None:
    """Link the standard library's and the installed libraries' own bytecode into the run's
    cache, where the children look for it: otherwise the first children of a run compiled
    numpy, dask, zarr, h5py, PySCF... again (9 s of CPU for one process, more when ranks
    start together). A stale one is replaced in the cache by the child, never written
    through the link; one a child compiled first stays."""
    import sysconfig
    tag = f".{sys.implementation.cache_tag}.pyc"
    paths = sysconfig.get_paths()
    for root in {paths["stdlib"], paths["purelib"], paths["platlib"]}:
        for dirpath, _dirs, files in os.walk(root):
            if _SEEDER_STOP.is_set():
                return
            if os.path.basename(dirpath) != "__pycache__":
                continue
            mirror = prefix + os.path.dirname(dirpath)
            names = [f for f in files if f.endswith(tag)]     # not the .opt-N ones
            if names:
                os.makedirs(mirror, exist_ok=True)
                for f in names:
                    with contextlib.suppress(OSError):
                        os.symlink(os.path.join(dirpath, f), os.path.join(mirror, f))


def _remove_bytecode_cache() -> None:
    if _SEEDER:
        _SEEDER_STOP.set()
        _SEEDER[0].join(30)
    shutil.rmtree(_PYCACHE, ignore_errors=True)


if not _HELPER_PROCESS and os.environ.get("PYTHONDONTWRITEBYTECODE"):
    if WORKER:
        _PYCACHE = os.environ.get("CIO_TESTS_PYCACHE")
        _children_share_bytecode()
    else:
        _PYCACHE = tempfile.mkdtemp(prefix="cio-tests-pycache-")
        os.environ["CIO_TESTS_PYCACHE"] = _PYCACHE
        _SEEDER.append(threading.Thread(target=_seed_library_bytecode, args=(_PYCACHE,),
                                        name="cio-tests-seed-bytecode", daemon=True))
        _SEEDER[0].start()          # 3-7 s: the workers start and collect meanwhile


def _remove_own_dirs_at_exit() -> None:
    """A session that ends before ``pytest_sessionfinish`` (a usage error, an interrupt
    while collecting) still leaves no directory of its own behind; a non-empty scratch or
    shm directory stays (what a test left there is a leak to look at)."""
    for d in (SCRATCH_ROOT, _OWN_SHM):
        with contextlib.suppress(OSError, TypeError):
            os.rmdir(d)
    if _PYCACHE and not WORKER:                     # the bytecode cache made here
        _remove_bytecode_cache()


if not _HELPER_PROCESS:
    atexit.register(_remove_own_dirs_at_exit)
for var in ("CHEMIO_SHARED_SCRATCH", "CHEMIO_BACKEND", "CHEMIO_CONFIG", "CHEMIO_SYNC",
            "CHEMIO_KEEP", "CHEMIO_TRACE", "CHEMIO_IO_THREADS", "CHEMIO_DIRECT"):
    os.environ.pop(var, None)

from chemio_py.runtime import config, stats  # noqa: E402
from chemio_py.scratch import jobs  # noqa: E402
import chemio_py.backends as backends  # noqa: E402

SHM_DIR = os.environ.get("CHEMIO_SHM_DIR", "/dev/shm")


def _shm_entries() -> set[str]:
    """chemio segments in the shm dir, and MPICH's in /dev/shm (left by killed MPI jobs).
    The segment of this very process (MPI initialised in-process by the mpiio tests) is
    removed by MPI_Finalize after the session ends, so it does not count."""
    found = set()
    mine = f"mpich_shm_{os.getpid():x}_"
    for d, match in ((SHM_DIR, lambda n: "chemio" in n),
                     ("/dev/shm", lambda n: n.startswith("mpich_shm_")
                      and not n.startswith(mine))):
        try:
            found |= {os.path.join(d, n) for n in os.listdir(d) if match(n)}
        except OSError:
            pass
    return found


_SHM_BEFORE = _shm_entries()


def usable_backends(kind: type) -> list[str]:
    """Backends usable on this machine that serve ``kind`` (ByteBackend or ArrayBackend)."""
    return [n for n, (ok, _) in backends.availability().items()
            if ok and isinstance(backends.resolve(n), kind)]


def store_backends() -> list[str]:
    """Backends that can hold byte stores on this machine."""
    return usable_backends(backends.ByteBackend)


@pytest.fixture(params=store_backends())
def store(request) -> str:
    """The name of a byte backend; every test using it runs once per backend."""
    return request.param


@pytest.fixture
def warm_store(store) -> str:
    """``store``, used once before the test: what a backend starts at first use and keeps
    for the process (the I/O pool, shm's lock janitor thread, MPI's descriptors) is there
    before a test counts threads or descriptors, whichever test happens to run first."""
    import chemio_py as cio
    with cio.ExclusiveFile("warm-up", "w+", backend=store) as f:
        f.write(0, b"warm")
        f.delete()
    return store


def process_threads() -> set[int]:
    """Threads that are not the process's own: the I/O pool's and mpiio's completion thread
    (``chemio-io*``), shm's lock janitor (``chemio-shm-locks``) and the finalizers' closer
    (``chemio-closer``) live on once started; the suite's own (``cio-tests-``) is not one."""
    return {t.ident for t in threading.enumerate()
            if not t.name.startswith(("chemio-io", "chemio-shm-locks", "chemio-closer",
                                      "cio-tests-"))}


@pytest.fixture(params=usable_backends(backends.ArrayBackend))
def arr_store(request) -> str:
    """The name of an array backend; every test using it runs once per backend."""
    return request.param


@pytest.fixture
def scratch_root() -> str:
    return SCRATCH_ROOT


def _leftovers(root: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        out += [os.path.join(dirpath, n) for n in filenames + dirnames]
    return out


@pytest.fixture(autouse=True)
def _clean_scratch_after_test():
    """Reset settings; after the test, clean up as at exit and demand an empty root."""
    config.reset()
    stats.reset()
    yield
    config.reset()
    jobs.cleanup()
    left = _leftovers(SCRATCH_ROOT)
    if left:
        for name in os.listdir(SCRATCH_ROOT):
            p = os.path.join(SCRATCH_ROOT, name)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
        pytest.fail(f"test left files in the scratch root: {left[:10]}")


@pytest.fixture
def make_tmpfs(tmp_path):
    """``make_tmpfs(size)`` mounts a real tmpfs of ``size`` (e.g. ``"1m"``) under the test's
    directory and returns its path, or None where this machine does not let us (not root);
    every mount is undone after the test."""
    mounted = []

    def mount(size: str) -> str | None:
        mnt = tmp_path / f"tmpfs-{size}-{uuid.uuid4().hex[:6]}"
        mnt.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                            str(mnt)], capture_output=True)
        if r.returncode != 0:
            return None
        mounted.append(mnt)
        return str(mnt)
    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def small_fs(make_tmpfs):
    """A real 1 MiB tmpfs when this machine lets us mount one (root), else None."""
    return make_tmpfs("1m")


# Tests that look at machine-wide state (every MPICH segment in /dev/shm, RAM) and so must
# not overlap another xdist worker's test; node id prefixes. A serial run ignores this.
ALONE = (
    "tests/adversarial/test_adv_stress_smoke.py::",     # no new MPICH segment in /dev/shm
    "tests/project/test_examples.py::test_checkpoint_sigkill_mpi_then_resume_serial",  # unlinks
    # 10,000 collective calls of 2 spinning ranks: 9 s alone, 31 s beside another worker
    "tests/backends/test_mpiio.py::test_no_datatype_leak_in_10000_collective_calls",
    "tests/runtime/test_many_ranks.py::",              # 8 ranks on 2 cores: one at a time
)
# Tests that hold 6-9 GB of RAM each: never two of them at once, but beside ordinary tests
# (as alone tests, the other worker idled through their 30 s).
BIG_MEMORY = (
    "tests/backends/test_mpiio.py::test_iwrite_iread_past_2gib",
    "tests/backends/test_mpiio.py::test_collective_write_past_2gib",
)
_WORKER_LEAKS: list[str] = []           # the controller: what the workers reported
_WORKER_PIDS: set[int] = set()


def pytest_configure(config):
    if not WORKER and getattr(config.option, "dist", "no") != "no" \
            and getattr(config.option, "numprocesses", None):
        # the controller of an xdist run: the lock files its workers share (see below)
        os.environ["CIO_TESTS_LOCKS"] = tempfile.mkdtemp(prefix="cio-tests-locks-")
    elif not WORKER:
        _children_share_bytecode()              # a serial run: its own children


def pytest_itemcollected(item):
    """Mark the ``ALONE`` tests (the lock in pytest_runtest_protocol keeps them alone; an
    ``xdist_group`` would not: pytest-xdist 3.8's loadgroup spread one group over workers)."""
    if item.nodeid.startswith(ALONE):
        item.add_marker(pytest.mark.alone)
    if item.nodeid.startswith(BIG_MEMORY):
        item.add_marker(pytest.mark.big_memory)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist, hold the workers' shared lock around a test (setup to teardown): shared
    for most, exclusive for ``alone`` tests; ``big_memory`` tests also hold their own
    exclusive lock, taken after the shared one."""
    locks = os.environ.get("CIO_TESTS_LOCKS") if WORKER else None
    if not locks:
        yield
        return
    import fcntl
    alone = item.get_closest_marker("alone") is not None
    big = item.get_closest_marker("big_memory") is not None
    # A turnstile before the readers' lock: a waiting exclusive test lets no new test start.
    turn = os.open(os.path.join(locks, "turnstile"), os.O_RDWR | os.O_CREAT, 0o600)
    main = os.open(os.path.join(locks, "tests"), os.O_RDWR | os.O_CREAT, 0o600)
    memory = os.open(os.path.join(locks, "big_memory"), os.O_RDWR | os.O_CREAT, 0o600) \
        if big else None
    try:
        fcntl.flock(turn, fcntl.LOCK_EX)
        fcntl.flock(main, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(turn, fcntl.LOCK_UN)
        if big:
            fcntl.flock(memory, fcntl.LOCK_EX)
        yield
    finally:
        if memory is not None:
            os.close(memory)
        os.close(main)
        os.close(turn)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller collects what each xdist worker found left behind."""
    out = getattr(node, "workeroutput", {}) or {}
    _WORKER_LEAKS.extend(out.get("cio_leaks", []))
    if out.get("cio_pid"):
        _WORKER_PIDS.add(out["cio_pid"])


def pytest_sessionfinish(session, exitstatus):
    jobs.cleanup()
    left = _leftovers(SCRATCH_ROOT)
    shutil.rmtree(SCRATCH_ROOT, ignore_errors=True)
    workerinput = getattr(session.config, "workerinput", None)
    if workerinput is not None:
        # An xdist worker: its own scratch root and shm dir; /dev/shm is the controller's.
        shm_left = []
        if _OWN_SHM:
            shm_left = sorted(os.path.join(_OWN_SHM, n) for n in os.listdir(_OWN_SHM)
                              if "chemio" in n)
            shutil.rmtree(_OWN_SHM, ignore_errors=True)
        session.config.workeroutput["cio_pid"] = os.getpid()
        session.config.workeroutput["cio_leaks"] = (
            [f"{WORKER}: scratch root {left[:10]}"] if left else []) + (
            [f"{WORKER}: shm {shm_left[:10]}"] if shm_left else [])
        return
    # The serial run, or the controller after every worker ended: their in-process MPI
    # segments go at their MPI_Finalize, as this process's does.
    shm_left = sorted(p for p in _shm_entries() - _SHM_BEFORE
                      if not any(os.path.basename(p).startswith(f"mpich_shm_{pid:x}_")
                                 for pid in _WORKER_PIDS))
    if _OWN_SHM:
        shutil.rmtree(_OWN_SHM, ignore_errors=True)
    locks = os.environ.pop("CIO_TESTS_LOCKS", None)
    if locks:
        shutil.rmtree(locks, ignore_errors=True)
    if _PYCACHE:
        _remove_bytecode_cache()
    if left or shm_left or _WORKER_LEAKS:
        print(f"\nLEAK: scratch root {left[:10]}, shm {shm_left[:10]}"
              + "".join(f"\nLEAK: {w}" for w in _WORKER_LEAKS), file=sys.stderr)
        session.exitstatus = 1


def mpiexec_path() -> str:
    cand = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return cand if os.path.exists(cand) else (shutil.which("mpiexec") or "mpiexec")


def run_mpi(n: int, body: str, *, tmp_path, timeout: float = 180, env: dict | None = None,
            check: bool = True, args: list[str] | None = None,
            plain: bool = False) -> subprocess.CompletedProcess:
    """Run ``body`` on ``n`` ranks under ``python -m mpi4py`` (or plain ``python`` with
    ``plain``, as most users launch: then only chemio_py keeps a failing rank from hanging
    the others)."""
    script = tmp_path / f"mpi_body_{n}.py"
    # a rank still running shortly before the timeout prints every thread's stack and
    # exits, so a hang fails with where it hung instead of a bare kill at the timeout
    watchdog = ("import faulthandler as _fh\n"
                f"_fh.dump_traceback_later({max(5.0, timeout - 10)}, exit=True)\n")
    script.write_text(watchdog + textwrap.dedent(body))
    full_env = dict(os.environ)
    full_env.update(env or {})
    runner = [sys.executable] if plain else [sys.executable, "-m", "mpi4py"]
    cmd = [mpiexec_path(), "-n", str(n), *runner, str(script)] + (args or [])
    segments_before = _mpich_segments()
    ended = False
    try:
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=full_env, cwd=str(tmp_path), start_new_session=True) as job:
            try:
                out, err = job.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                # still running: where every process of the job is, also outside Python
                # (MPI_Init, MPI_Finalize, hydra), where the watchdog cannot see; then the
                # whole job goes (its own session), not mpiexec alone
                stacks = job_stacks(job.pid)
                _kill_session(job)
                out, err = job.communicate()
                pytest.fail(f"mpiexec -n {n} still running after {timeout} s: killed\n"
                            f"--- stdout\n{out}\n--- stderr\n{err}\n--- native stacks\n"
                            f"{stacks}")
        proc = subprocess.CompletedProcess(cmd, job.returncode, out, err)
        ended = proc.returncode == 0
    finally:
        if not ended:                   # an aborted job's ranks were SIGKILLed by hydra
            reap_orphan_mpich_segments(segments_before)
    if check and proc.returncode != 0:
        pytest.fail(f"mpiexec -n {n} failed ({proc.returncode})\n--- stdout\n{proc.stdout}"
                    f"\n--- stderr\n{proc.stderr}")
    return proc


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc), parents first."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(sorted(children.get(p, [])))
    return out


def job_stacks(pid: int, per_process: float = 20.0) -> str:
    """What every process of the job under ``pid`` is doing: command, state, kernel wait
    channel, and (with gdb) every thread's native stack. For a hang report."""
    gdb = shutil.which("gdb")
    parts = []
    for p in _descendants(pid):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as fh:
                argv = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{p}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{p}/wchan") as fh:
                wchan = fh.read().strip()
        except OSError:
            continue
        parts.append(f"pid {p} [{state}, wchan {wchan or '-'}] {argv[:200]}")
        if gdb and "python" in argv:
            try:
                bt = subprocess.run([gdb, "-p", str(p), "-batch", "-nx",
                                     "-ex", "thread apply all bt 30"], capture_output=True,
                                    text=True, timeout=per_process).stdout
            except subprocess.TimeoutExpired:
                bt = "(gdb timed out)"
            parts.append("\n".join(ln for ln in bt.splitlines()
                                   if ln.startswith(("#", "Thread"))))
    return "\n".join(parts) or "(no process left)"


def _kill_session(job: subprocess.Popen) -> None:
    """SIGKILL every process of ``job``'s session (mpiexec, its proxies and the ranks)."""
    import signal
    try:
        os.killpg(job.pid, signal.SIGKILL)
    except OSError:
        job.kill()


def _mpich_segments() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("mpich_shm_")}
    except OSError:
        return set()


def reap_orphan_mpich_segments(before: set[str]) -> None:
    """Remove MPICH shared-memory segments that appeared since ``before`` and that no live
    process has mapped for ``ORPHAN_AFTER`` seconds: a job ended by MPI_Abort is SIGKILLed
    by hydra, which leaves them. A segment seen unmapped once may be one that another
    job's MPI_Init (the other xdist worker's) has just created and not mapped yet: removing
    it would leave that job's ranks waiting in MPI_Init."""
    deadline = time.monotonic() + 5             # killed ranks may still be exiting
    unmapped_since: dict[str, float] = {}
    while True:
        new = _mpich_segments() - before
        if not new:
            return
        mapped = set()
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    with open(f"/proc/{pid}/maps") as fh:
                        mapped.update(n for n in new if n in fh.read())
                except OSError:
                    pass
        now = time.monotonic()
        for name in mapped:
            unmapped_since.pop(name, None)
        for name in new - mapped:
            if now - unmapped_since.setdefault(name, now) >= ORPHAN_AFTER:
                try:
                    os.unlink(os.path.join("/dev/shm", name))
                except OSError:
                    pass
        if now > deadline:
            return
        time.sleep(0.1)


ORPHAN_AFTER = 0.5


def in_forked_child(check) -> None:
    """Run ``check()`` in a forked child (which never comes back into pytest: it ends with
    ``os._exit``) and assert that it returned True there."""
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1                                    # an exception in check()
        try:
            code = 0 if check() else 2
        finally:
            os.write(wr, bytes([code]))
            os._exit(code)
    os.close(wr)
    got = os.read(rd, 1)
    os.close(rd)
    _, status = os.waitpid(pid, 0)
    assert got == b"\x00" and os.waitstatus_to_exitcode(status) == 0, \
        f"the child reported {got!r} (1: an exception, 2: the check failed)"


def run_on_tty(argv: list[str], *, columns: int = 120, timeout: float = 120,
               **popen: Any) -> tuple[int, str, str]:
    """Run ``argv`` with stderr on a pseudo-terminal (so progress bars show) and stdout
    piped; returns (exit status, stdout, what reached the terminal)."""
    import fcntl
    import pty
    import struct
    import termios
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=slave, text=True, **popen)
    os.close(slave)
    out, _ = proc.communicate(timeout=timeout)
    chunks = []
    while True:
        try:
            b = os.read(master, 65536)
        except OSError:                 # EIO: the child side is closed
            break
        if not b:
            break
        chunks.append(b)
    os.close(master)
    return proc.returncode, out, b"".join(chunks).decode(errors="replace")


@pytest.fixture
def mpirun(tmp_path):
    """``mpirun(n, body, **kw)`` runs Python source ``body`` on ``n`` ranks; returns the process."""
    def _run(n: int, body: str, **kw):
        return run_mpi(n, body, tmp_path=tmp_path, **kw)
    return _run
