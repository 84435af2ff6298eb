"""Issue 11, items 1, 3, 10 (leases and markers), 12, 13, 14 and names with control
characters: job directories are private to the process group that owns them, a forked child
never cleans its parent's scratch, and `chemio clean` removes only what chemio provably made
and provably abandoned -- without hanging, reading without bound or aborting half way."""
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

import chemio_py as cio
from chemio_py.scratch import janitor, jobs
from chemio_py.errors import InvalidNameError

MARKER = ".chemio-job.json"
TIMEOUT = 60


def env_for(root, **extra):
    env = dict(os.environ, CHEMIO_SCRATCH=str(root))
    for k in ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "JOB_ID", "COBALT_JOBID", "FLUX_JOB_ID"):
        env.pop(k, None)
    env.update(extra)
    return env


def run_py(code, env, timeout=TIMEOUT, **kw):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=timeout, **kw)


def clean(root, *args, timeout=TIMEOUT, prefix=()):
    """`chemio clean --root root`; a hang becomes a TimeoutExpired (a test failure)."""
    return subprocess.run([*prefix, sys.executable, "-m", "chemio_py.cli", "clean", "--root",
                           str(root), *args], capture_output=True, text=True,
                          env=env_for(root), timeout=timeout)


def line_for(out, path):
    lines = [ln for ln in out.splitlines() if f" {path}  (" in ln or ln.endswith(f" {path}")]
    assert lines, f"no line for {path} in:\n{out}"
    return lines[0]


def assert_kept(proc, path, *words):
    assert os.path.isdir(path), f"{path} was removed:\n{proc.stdout}\n{proc.stderr}"
    ln = line_for(proc.stdout, str(path))
    assert not ln.startswith(("removing", "would remove")), ln
    for w in words:
        assert w.lower() in ln.lower(), f"{w!r} not in {ln!r}"
    return ln


DEAD = """
import os, chemio_py as cio
f = cio.ExclusiveFile('orphan', 'w+')
f.write(0, b'x' * 4096)
print(os.path.dirname(f.path), flush=True)
os._exit(0)          # no cleanup: a job that died
"""


def dead_job(root, **extra):
    """The job directory of a real process that died without cleaning up. Without ``extra``,
    a copy of the one such directory a real process left for this module (its bytes, its
    dead pid): a Python process less per call (about 40 calls a run)."""
    if extra:
        return _really_dead_job(root, **extra)
    if not _DEAD_TEMPLATE:
        base = tempfile.mkdtemp(prefix="cio-adv-dead-")
        _DEAD_TEMPLATE.append(_really_dead_job(base))
    d = os.path.join(str(root), f"chemio-dead-{next(_DEAD_COPIES)}")
    shutil.copytree(_DEAD_TEMPLATE[0], d, symlinks=True)
    return d


def _really_dead_job(root, **extra):
    p = run_py(DEAD, env_for(root, **extra))
    assert p.returncode == 0, p.stderr
    d = p.stdout.strip()
    assert os.path.isdir(d) and os.path.dirname(d) == str(root)
    return d


_DEAD_TEMPLATE: list[str] = []          # the real dead job's directory, made on first use
_DEAD_COPIES = itertools.count()


@pytest.fixture(scope="module", autouse=True)
def _remove_dead_template():
    yield
    if _DEAD_TEMPLATE:
        shutil.rmtree(os.path.dirname(_DEAD_TEMPLATE.pop()), ignore_errors=True)


def lease_of(d):
    names = [n for n in os.listdir(d) if n.startswith(".lease.")]
    assert len(names) == 1, names
    return os.path.join(d, names[0])


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "root"
    r.mkdir()
    yield r
    for dp, _dns, fns in os.walk(r):             # undo chattr +i, if a test left it
        for n in fns:
            subprocess.run(["chattr", "-i", os.path.join(dp, n)], capture_output=True)
    shutil.rmtree(r, ignore_errors=True)


# ---------------------------------------------------------------- item 1

TWIN = """
import os, sys, time, numpy as np, chemio_py as cio
me, other, sync = sys.argv[1], sys.argv[2], sys.argv[3]
f = cio.ExclusiveFile('fock', 'w+')
f.write(0, np.full(1000, float(me)))
open(os.path.join(sync, me), 'w').close()
deadline = time.time() + 30
while not os.path.exists(os.path.join(sync, other)):    # both files exist at once
    assert time.time() < deadline, 'the other script never came'
    time.sleep(0.01)
got = f.read(0, np.empty(1000))
assert (got == float(me)).all(), f'script {me} reads {got[0]}: another script\\'s data'
print(os.path.dirname(f.path), flush=True)
open(os.path.join(sync, me + '.done'), 'w').close()
while not os.path.exists(os.path.join(sync, other + '.done')):
    assert time.time() < deadline, 'the other script never finished'
    time.sleep(0.01)
f.close()
"""


@pytest.mark.parametrize("var", ["SLURM_JOB_ID", "PBS_JOBID"])
def test_two_scripts_of_one_batch_job_never_share_private_files(root, tmp_path, var):
    sync = tmp_path / "sync"
    sync.mkdir()
    env = env_for(root, **{var: "4242"})
    procs = [subprocess.Popen([sys.executable, "-c", TWIN, a, b, str(sync)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for a, b in (("1", "2"), ("2", "1"))]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT)
            assert p.returncode == 0, err
            outs.append(out.strip())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert outs[0] != outs[1], "two independent scripts got one job directory"
    for d in outs:
        assert os.path.basename(d).startswith("chemio-4242"), d    # the batch id stays visible
    assert os.listdir(root) == []                                # each cleaned its own


@pytest.mark.parametrize("value", ["../../etc", "a/b\nc", "x" * 500, "4242.srv$(id)"])
def test_any_batch_id_makes_one_directory_directly_in_the_root(root, value):
    p = run_py("""
        import os, chemio_py as cio
        f = cio.ExclusiveFile('b', 'w+')
        print(os.path.dirname(f.path), flush=True)
        f.close()
    """, env_for(root, SLURM_JOB_ID=value))
    assert p.returncode == 0, p.stderr
    d = p.stdout.strip()
    assert os.path.dirname(d) == str(root) and os.path.basename(d).startswith("chemio-")
    assert os.listdir(root) == []


def test_ranks_of_one_mpi_job_share_one_job_dir_under_a_batch_id(mpirun):
    p = mpirun(2, """
        import os, chemio_py as cio
        c = cio.comm()
        f = cio.ExclusiveFile("x", "w+")
        dirs = c.allgather(os.path.dirname(f.path))
        assert dirs[0] == dirs[1] and "chemio-77" in dirs[0], dirs
        f.close()
        c.barrier()
        print("ok", flush=True)
    """, env={"SLURM_JOB_ID": "77"})
    assert p.stdout.count("ok") == 2


# ---------------------------------------------------------------- item 3

FORK = """
import os, sys, numpy as np, chemio_py as cio
f = cio.ExclusiveFile('parent', 'w+')
f.awrite(0, np.full(1 << 16, 7.0)).wait()        # the I/O pool has threads now
d = cio.DiskArray.create('parr', (64, 64), 'f8')
d[...] = 3.0
slow = f.awrite(1 << 20, np.ones(1 << 18))       # maybe still in flight at the fork
pid = os.fork()
if pid == 0:
    if sys.argv[1] == 'own':
        g = cio.ExclusiveFile('child', 'w+')
        g.write(0, b'c' * 100)
        print('CHILD ' + g.path, flush=True)
    sys.exit(0)                                   # normal exit: atexit runs in the child
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0
slow.wait()
assert os.path.exists(f.path) and os.path.exists(d.path), 'the child removed our scratch'
assert (f.read(0, np.empty(1 << 16)) == 7.0).all()
assert (d[...] == 3.0).all()
print('PARENT ' + f.path, flush=True)
"""


@pytest.mark.parametrize("child", ["idle", "own"])
def test_forked_child_never_removes_its_parents_scratch(root, child):
    p = subprocess.run([sys.executable, "-c", FORK, child], capture_output=True, text=True,
                       env=env_for(root), timeout=TIMEOUT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "PARENT" in p.stdout
    if child == "own":
        cpath = next(ln.split(" ", 1)[1] for ln in p.stdout.splitlines() if ln.startswith("CHILD"))
        ppath = next(ln.split(" ", 1)[1] for ln in p.stdout.splitlines() if ln.startswith("PARENT"))
        assert os.path.dirname(cpath) != os.path.dirname(ppath)   # the child is its own owner
    assert os.listdir(root) == []          # child cleaned its own files, parent its own


RAWFORK = """
import ctypes, os, sys, chemio_py as cio
from chemio_py.scratch import janitor, jobs
f = cio.ExclusiveFile('parent', 'w+')
f.write(0, b'p' * 100)
pid = ctypes.CDLL(None).fork()                    # a fork that runs no Python fork hooks
if pid == 0:
    jobs.cleanup()                             # what exit would do in the child
    os._exit(0)
os.waitpid(pid, 0)
assert os.path.exists(f.path), 'the child removed the file its parent created'
assert f.read_bytes(0, 100) == b'p' * 100
print('ok', flush=True)
"""


def test_cleanup_removes_only_what_this_pid_created(root):
    p = run_py(RAWFORK, env_for(root))
    assert p.returncode == 0 and "ok" in p.stdout, p.stdout + p.stderr
    assert os.listdir(root) == []


# ---------------------------------------------------------------- items 10 and 13: leases

def _fifo(d):
    os.mkfifo(os.path.join(d, ".lease.evil.1"), 0o600)


def _zero(d):
    os.symlink("/dev/zero", os.path.join(d, ".lease.evil.2"))


def _huge(d):
    with open(os.path.join(d, ".lease.evil.3"), "wb") as fh:
        fh.truncate(1 << 30)                       # sparse: 1 GiB of zeros


def _dir(d):
    os.mkdir(os.path.join(d, ".lease.evil.4"))


def _garbage(d):
    with open(lease_of(d), "w") as fh:
        fh.write("{not json")


def _edit(**changes):
    def f(d):
        path = lease_of(d)
        with open(path) as fh:
            lease = json.load(fh)
        for k, v in changes.items():
            if v is None:
                lease.pop(k, None)
            else:
                lease[k] = v
        with open(path, "w") as fh:
            json.dump(lease, fh)
    return f


def _other_uid(d):
    os.chown(lease_of(d), 65534, 65534)


def _not_a_dict(d):
    with open(lease_of(d), "w") as fh:
        fh.write("[1, 2]")


def _bool_pid(d):
    _edit(pid=True)(d)


HOSTILE = {
    "fifo": (_fifo, ["FIFO"]),
    "symlink to /dev/zero": (_zero, ["symbolic link"]),
    "1 GiB lease": (_huge, ["bytes"]),
    "directory": (_dir, ["directory"]),
    "garbage": (_garbage, ["parse"]),
    "not a dict": (_not_a_dict, ["parse"]),
    "bool pid": (_bool_pid, ["parse"]),
    "other pid namespace": (_edit(pidns="pid:[1]"), ["namespace"]),
    "no pid namespace (old lease)": (_edit(pidns=None), ["namespace"]),
    "other boot": (_edit(boot_id="00000000-0000-0000-0000-000000000000"), ["boot"]),
    "other host": (_edit(host="elsewhere"), ["elsewhere"]),
    "other uid in lease": (_edit(uid=65534), ["uid 65534"]),
    "lease file of other uid": (_other_uid, ["uid 65534"]),
}


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_clean_keeps_a_job_it_cannot_prove_dead_and_never_hangs(root, kind):
    make, words = HOSTILE[kind]
    d = dead_job(root)
    control = dead_job(root)                   # the same but provably dead: must still go
    make(d)
    for args in (("--dry-run",), ()):
        p = clean(root, *args)
        assert p.returncode == 0, p.stdout + p.stderr
        assert_kept(p, d, *words)
    assert not os.path.exists(control), p.stdout
    assert os.path.exists(os.path.join(d, "orphan.0"))


def test_clean_keeps_a_live_job_in_another_pid_namespace(root):
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                           capture_output=True, timeout=TIMEOUT)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a pid namespace here: {probe.stderr!r}")
    code = ("import os, time, chemio_py as cio\n"
            "f = cio.ExclusiveFile('ns', 'w+'); f.write(0, b'alive')\n"
            "print(f.path, os.getpid(), flush=True)\n"
            "time.sleep(120)\n")
    child = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
                              sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env=env_for(root), start_new_session=True)
    try:
        path, inner_pid = child.stdout.readline().split()
        assert int(inner_pid) < 10            # its pid as seen inside its namespace
        p = clean(root)
        assert p.returncode == 0, p.stderr
        assert_kept(p, os.path.dirname(path), "namespace")
        assert open(path, "rb").read() == b"alive"
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(TIMEOUT)


def test_clean_keeps_everything_when_proc_cannot_be_read(root):
    d = dead_job(root)
    probe = subprocess.run(["unshare", "--mount", "sh", "-c", "mount -t tmpfs none /proc"],
                           capture_output=True, timeout=TIMEOUT)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace here: {probe.stderr!r}")
    p = subprocess.run(["unshare", "--mount", "sh", "-c",
                        f"mount -t tmpfs none /proc && exec {sys.executable} -m chemio_py.cli "
                        f"clean --root {root}"],
                       capture_output=True, text=True, env=env_for(root), timeout=TIMEOUT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert_kept(p, d, "/proc")


def test_scan_api_reports_unprovable_leases_as_alive(root):
    d = dead_job(root)
    _fifo(d)
    infos = {i.path: i for i in janitor.scan_job_dirs([str(root)])}
    assert infos[d].alive is True and "FIFO" in infos[d].reason
    with pytest.raises(ValueError, match="refusing"):
        janitor.remove_job_dir(d, [str(root)])
    assert os.path.isdir(d)


# ---------------------------------------------------------------- item 12: the marker

def test_new_job_dir_carries_a_private_marker(root):
    p = run_py("""
        import os, json, stat, chemio_py as cio
        f = cio.ExclusiveFile('m', 'w+')
        d = os.path.dirname(f.path)
        st = os.lstat(os.path.join(d, '.chemio-job.json'))
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
        m = json.load(open(os.path.join(d, '.chemio-job.json')))
        assert m['magic'] == 'chemio_py job directory' and m['format'] == 1, m
        print('ok', flush=True)
    """, env_for(root))
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr
    assert os.listdir(root) == []             # marker removed with the directory


def _old(path):
    t = time.time() - 3 * 86400
    for dp, dns, fns in os.walk(path):
        for n in dns + fns:
            os.utime(os.path.join(dp, n), (t, t), follow_symlinks=False)
    os.utime(path, (t, t))


def test_clean_never_removes_a_chemio_named_directory_it_did_not_make(root):
    mine = root / "chemio-py"                      # e.g. a checkout, CHEMIO_SCRATCH=$HOME
    (mine / "src").mkdir(parents=True)
    (mine / "src" / "main.py").write_text("print('precious')\n")
    _old(mine)
    p = clean(root)
    assert p.returncode == 0, p.stderr
    assert_kept(p, mine, "marker")
    assert (mine / "src" / "main.py").read_text() == "print('precious')\n"


def _no_marker(d):
    os.unlink(os.path.join(d, MARKER))


def _marker_fifo(d):
    _no_marker(d)
    os.mkfifo(os.path.join(d, MARKER), 0o600)


def _marker_link(d):
    real = os.path.join(os.path.dirname(d), "real-marker")
    os.rename(os.path.join(d, MARKER), real)
    os.symlink(real, os.path.join(d, MARKER))


def _marker_magic(d):
    with open(os.path.join(d, MARKER), "w") as fh:
        json.dump({"magic": "something else", "format": 1}, fh)


def _marker_format(d):
    with open(os.path.join(d, MARKER), "w") as fh:
        json.dump({"magic": "chemio_py job directory", "format": 99}, fh)


def _marker_big(d):
    with open(os.path.join(d, MARKER), "ab") as fh:
        fh.truncate(1 << 30)


def _marker_uid(d):
    os.chown(os.path.join(d, MARKER), 65534, 65534)


def _dir_uid(d):
    os.chown(d, 65534, 65534)


MARKERS = {"missing (older chemio)": (_no_marker, ["marker"]),
           "fifo": (_marker_fifo, ["FIFO"]),
           "symlink": (_marker_link, ["symbolic link"]),
           "wrong magic": (_marker_magic, ["marker"]),
           "unknown format": (_marker_format, ["format"]),
           "1 GiB": (_marker_big, ["bytes"]),
           "marker of other uid": (_marker_uid, ["uid 65534"]),
           "directory of other uid": (_dir_uid, ["uid 65534"])}


@pytest.mark.parametrize("kind", list(MARKERS))
def test_clean_removes_only_directories_with_a_valid_marker(root, kind):
    make, words = MARKERS[kind]
    d = dead_job(root)
    make(d)
    _old(d)
    for args in (("--dry-run",), ()):
        p = clean(root, *args)
        assert p.returncode == 0, p.stdout + p.stderr
        assert_kept(p, d, *words)
    assert os.path.exists(os.path.join(d, "orphan.0"))


# ---------------------------------------------------------------- item 14: vanishing and failing

def test_scan_and_remove_survive_directories_vanishing_under_them(root):
    template = dead_job(root)
    rng = random.Random(11)
    for rnd in range(6):
        dirs = []
        for k in range(150):
            d = str(root / f"chemio-copy{rnd}-{k}")
            shutil.copytree(template, d, symlinks=True)
            dirs.append(d)
        rng.shuffle(dirs)
        stop = threading.Event()

        def vanish():                   # runs in a thread joined in this same iteration
            for d in dirs:  # noqa: B023
                if stop.is_set():  # noqa: B023
                    return
                shutil.rmtree(d, ignore_errors=True)

        t = threading.Thread(target=vanish)
        t.start()
        try:
            for _ in range(3):
                for info in janitor.scan_job_dirs([str(root)]):
                    if not info.alive and info.path != template:
                        try:
                            janitor.remove_job_dir(info.path, [str(root)])
                        except ValueError as e:    # half removed by the other party: kept
                            assert "refusing" in str(e)
        finally:
            stop.set()
            t.join(TIMEOUT)
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    assert os.path.isdir(template)
    p = clean(root)
    assert p.returncode == 0 and not os.path.exists(template), p.stdout + p.stderr


def test_clean_cli_survives_directories_vanishing_under_it(root):
    """Directories appear and vanish all the time while `chemio clean` runs, repeatedly."""
    template = dead_job(root)
    stop = threading.Event()

    def churn():
        made, k = [], 0
        while not stop.is_set():
            d = str(root / f"chemio-churn-{k}")
            k += 1
            try:
                shutil.copytree(template, d, symlinks=True)
            except (OSError, shutil.Error):
                pass                          # the cleaner took it while it was being made
            made.append(d)
            if len(made) > 20:
                shutil.rmtree(made.pop(0), ignore_errors=True)
        for d in made:
            shutil.rmtree(d, ignore_errors=True)

    t = threading.Thread(target=churn)
    t.start()
    try:
        runs = [clean(root, *args) for args in ((), ("--dry-run",)) * 4]
    finally:
        stop.set()
        t.join(TIMEOUT)
    for p in runs:
        assert p.returncode == 0, p.stdout + p.stderr
        text = p.stdout + p.stderr
        for bad in ("Traceback", "FileNotFoundError", "No such file", "could not remove"):
            assert bad not in text, text
    p = clean(root)
    assert p.returncode == 0 and os.listdir(root) == [], p.stdout + p.stderr


def test_one_failing_removal_is_reported_and_the_rest_still_go(root):
    if shutil.which("chattr") is None:
        pytest.skip("needs chattr")
    stuck, a, b = dead_job(root), dead_job(root), dead_job(root)
    pinned = os.path.join(stuck, "orphan.0")
    if subprocess.run(["chattr", "+i", pinned], capture_output=True).returncode != 0:
        pytest.skip("this file system has no immutable attribute")
    try:
        p = clean(root)
        assert p.returncode != 0, p.stdout + p.stderr
        assert not os.path.exists(a) and not os.path.exists(b)
        assert os.path.exists(pinned)
        text = p.stdout + p.stderr
        assert stuck in text and "could not remove" in text.lower(), text
        assert os.path.exists(os.path.join(stuck, MARKER))     # a later clean can retry
        subprocess.run(["chattr", "-i", pinned], check=True)
        again = clean(root)
        assert again.returncode == 0 and not os.path.exists(stuck), again.stdout + again.stderr
    finally:
        subprocess.run(["chattr", "-i", pinned], capture_output=True)


# ---------------------------------------------------------------- names

@pytest.mark.parametrize("bad", ["fock\n", "fock\r", "a\tb", "nul\x00", "\x1b[31mred", "del\x7f",
                                 "\nfock", "fock\x85"])
def test_names_with_control_characters_are_refused(bad, scratch_root):
    with pytest.raises(InvalidNameError, match="control character") as ei:
        jobs.validate_name(bad)
    assert "U+" in str(ei.value)                    # says which character it found
    with pytest.raises(InvalidNameError):
        cio.ExclusiveFile(bad, "w+")
    with pytest.raises(InvalidNameError):
        cio.DiskArray.create(bad, (4,), "f8")
    with pytest.raises(InvalidNameError):
        cio.SharedFile(bad)
    with pytest.raises(InvalidNameError):
        cio.RecordFile(bad)
    assert os.listdir(scratch_root) == []


def test_other_bad_names_say_what_was_found():
    for bad, word in (("a/b", "'/'"), ("..", "'..'"), ("", "empty"), ("x" * 201, "201"),
                      ("fock é", "' '")):
        with pytest.raises(InvalidNameError, match=word):
            jobs.validate_name(bad)
    assert jobs.validate_name("fock.aoints+1_a-b") == "fock.aoints+1_a-b"



def test_a_rank_joining_while_the_marker_is_written_counts_the_dir_as_marked(tmp_path,
                                                                            monkeypatch):
    """The race, made deterministic: the maker writes the marker just after the joiner
    looked for it. The joiner took the dir for a foreign one (unmarked), and the last
    process out then left a lone marker behind (10 of 40 real 2-rank runs)."""
    d = tmp_path / "chemio-job"
    d.mkdir()
    (d / (jobs.LEASE_PREFIX + "vm.1")).write_text("{}")      # the maker's lease
    real = os.path.lexists

    def marker_appears_after_the_look(path):
        seen = real(path)
        if path.endswith(jobs.MARKER_NAME) and not seen:
            jobs._write_marker(str(d))                         # the maker, just after
        return seen
    monkeypatch.setattr(jobs.os.path, "lexists", marker_appears_after_the_look)
    assert jobs._join(str(d)) is True
    monkeypatch.undo()
    assert sorted(os.listdir(d)) == sorted([jobs.MARKER_NAME, jobs.LEASE_PREFIX + "vm.1"])


def test_ranks_joining_as_the_dir_is_made_leave_nothing_behind(tmp_path):
    """A rank that joined while another had made the dir but not yet marked it took the
    dir for a foreign one and the last process out left a lone marker (10 of 40 runs)."""
    import sys
    from conftest import mpiexec_path
    body = tmp_path / "body.py"
    body.write_text("import os, chemio_py as cio\n"
                    "c = cio.comm()\n"
                    "f = cio.ExclusiveFile('x', 'w+')\n"
                    "c.allgather(f.path)\n"
                    "f.close()\n"
                    "c.barrier()\n")
    root = tmp_path / "root"
    root.mkdir()
    env = dict(os.environ, CHEMIO_SCRATCH=str(root), SLURM_JOB_ID="78")
    for _ in range(8):
        p = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, "-m", "mpi4py",
                            str(body)], capture_output=True, text=True, timeout=60, env=env)
        assert p.returncode == 0, p.stderr[-2000:]
        assert os.listdir(root) == [], [os.listdir(root / d) for d in os.listdir(root)]
