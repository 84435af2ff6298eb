"""Scratch lifecycle: job dirs, leases, cleanup, `chemio clean`, fs info."""
import json
import os
import signal
import subprocess
import sys

import pytest

import chemio_py as cio
from chemio_py.scratch import fs, janitor, jobs


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "chemio_py.cli", *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=120)


def test_job_dir_lease_and_cleanup(scratch_root):
    with cio.ExclusiveFile("lease", "w+") as fh:
        d = os.path.dirname(fh.path)
        assert os.path.basename(d).startswith("chemio-")
        leases = [n for n in os.listdir(d) if n.startswith(".lease.")]
        assert len(leases) == 1
        lease = json.load(open(os.path.join(d, leases[0])))
        assert lease["pid"] == os.getpid() and lease["host"] and lease["boot_id"]
        assert lease["start_time"] is not None
    cio.cleanup()
    assert os.listdir(scratch_root) == []


def test_keep_setting_keeps_scratch(scratch_root):
    cio.configure(keep=True)
    fh = cio.ExclusiveFile("kept", "w+")
    path = fh.path
    fh.close()
    cio.cleanup()
    assert os.path.exists(path)
    cio.configure(keep=None)
    cio.cleanup()
    assert not os.path.exists(path)


def test_scratch_entries_by_rank_and_host():
    e = jobs.parse_scratch("/a, 1:/r1, myhost:/h, /b")
    assert [x.path for x in e] == ["/a", "/r1", "/h", "/b"]
    cio.configure(scratch="/a,1:/r1,node*:/h,/b")
    assert jobs.private_root(1, "other") == "/r1"
    assert jobs.private_root(0, "node7") == "/h"
    assert jobs.private_root(0, "other") == "/a"
    assert jobs.private_root(3, "other") == "/b"
    assert jobs.shared_root() == "/a"


def test_fs_info():
    info = cio.stat("/tmp/does/not/exist/yet")
    assert info.free > 0 and info.total >= info.free and info.fstype not in ("", None)
    assert fs.fstype("/dev/shm") == "tmpfs"
    assert fs.fstype("/proc/self") == "proc"


def test_clean_removes_job_of_killed_process_and_nothing_else(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "precious").write_text("not chemio's")
    (root / "chemio-not-a-dir").write_text("a file named like a job dir")
    env = {**os.environ, "CHEMIO_SCRATCH": str(root)}
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import chemio_py as cio, sys, time\n"
         "f = cio.ExclusiveFile('orphan', 'w+', size_hint=1 << 20)\n"
         "f.write(0, b'x' * 4096)\n"
         "print(f.path, flush=True)\n"
         "time.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True, env=env)
    path = child.stdout.readline().strip()
    assert os.path.exists(path)
    jobdir = os.path.dirname(path)

    live = run_cli("clean", "--root", str(root), env=env)
    assert "in use" in live.stdout and os.path.exists(path)

    child.send_signal(signal.SIGKILL)
    child.wait()
    dry = run_cli("clean", "--dry-run", "--root", str(root), env=env)
    assert "would remove" in dry.stdout and os.path.exists(path)
    wet = run_cli("clean", "--root", str(root), env=env)
    assert wet.returncode == 0, wet.stderr
    assert not os.path.exists(jobdir)
    assert (root / "precious").read_text() == "not chemio's"
    assert (root / "chemio-not-a-dir").exists()


def test_remove_job_dir_refuses_outside_paths(tmp_path):
    victim = tmp_path / "chemio-x"
    victim.mkdir()
    with pytest.raises(ValueError, match="refusing"):
        janitor.remove_job_dir(str(victim), [str(tmp_path / "elsewhere")])
    link = tmp_path / "chemio-link"
    link.symlink_to(victim)
    with pytest.raises(ValueError, match="symbolic link"):
        janitor.remove_job_dir(str(link), [str(tmp_path)])
    assert victim.exists()


def test_scratch_dir_symlink_is_refused(tmp_path):
    root = tmp_path / "r"
    root.mkdir()
    target = tmp_path / "target"
    target.mkdir()
    (root / f"chemio-{jobs.job_id()}").symlink_to(target)
    cio.configure(scratch=str(root))
    with pytest.raises(OSError, match="not a directory"):
        cio.ExclusiveFile("x", "w+")
    assert os.listdir(target) == []


KILLED_CREATE = """
import os, signal, sys
import chemio_py as cio
def killed(*args, **kw):                   # the process dies right before the rename
    os.kill(os.getpid(), signal.SIGKILL)
os.replace = killed
cio.DiskArray.create("a", (8,), "f8", path=sys.argv[1], persistent=True)
"""


def test_clean_removes_dead_writers_temp_files_in_a_live_job_dir(tmp_path):
    """A create killed before its rename leaves ``.<name>.dra.json.tmp<pid>...`` in a job
    directory that is still in use: ``chemio clean`` removes it (and any temp file whose
    writer is provably gone), keeps those of live writers and those it cannot check, and
    says which; the job's own cleanup at exit sweeps them too, and removes the directory."""
    import time
    root = tmp_path / "root"
    root.mkdir()
    env = {**os.environ, "CHEMIO_SCRATCH": str(root)}
    job = subprocess.Popen(
        [sys.executable, "-c",
         "import chemio_py as cio, sys\n"
         "f = cio.ExclusiveFile('live', 'w+')\n"
         "print(f.path, flush=True)\n"
         "sys.stdin.readline()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        jobdir = os.path.dirname(job.stdout.readline().strip())
        before = set(os.listdir(jobdir))
        k = subprocess.run([sys.executable, "-c", KILLED_CREATE, jobdir], env=env,
                           capture_output=True, text=True, timeout=120)
        assert k.returncode == -signal.SIGKILL, k.stderr
        killed = [n for n in set(os.listdir(jobdir)) - before if ".tmp" in n]
        assert len(killed) == 1 and killed[0].startswith(".a.dra.json.tmp"), killed
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True).stdout.strip()
        tag, p = jobs._writer_tag(), job.pid
        names = {
            "live": f".b.dra.json.tmp{p}.{tag}.{p}.0000abcd",         # job's main thread
            "reused": f".c.dra.json.tmp{p}.{tag}.{p}.0000beef",       # older than the job
            "dead": f".d.dra.json.tmp{dead}.{tag}.{dead}.12345678",
            "old_style": f".e.dra.json.tmp{dead}",                    # where: unknown
            "foreign": f".f.dra.json.tmp{dead}.00000000.{dead}.12345678",
        }
        for n in names.values():
            with open(os.path.join(jobdir, n), "w") as fh:
                fh.write("{")
        old = time.time() - 3600
        os.utime(os.path.join(jobdir, names["reused"]), (old, old))

        dry = run_cli("clean", "--dry-run", "--root", str(root), env=env)
        assert dry.returncode == 0, dry.stderr
        assert "in use" in dry.stdout and "would remove" in dry.stdout, dry.stdout
        assert set(names.values()) | set(killed) <= set(os.listdir(jobdir))

        wet = run_cli("clean", "--root", str(root), env=env)
        assert wet.returncode == 0, wet.stderr
        left = set(os.listdir(jobdir))
        gone = {killed[0], names["reused"], names["dead"]}
        assert not gone & left, (wet.stdout, left)
        assert {names["live"], names["old_style"], names["foreign"]} <= left, wet.stdout
        out = wet.stdout
        assert f"removed      temp file {killed[0]}" in out and "is gone" in out, out
        assert "now belongs to another process" in out, out
        assert f"keeping      temp file {names['live']}" in out and "is running" in out, out
        assert "3 temp files of dead writers removed" in out and "3 kept" in out, out
        assert os.path.exists(os.path.join(jobdir, "live.0"))

        # the job's own cleanup at exit sweeps dead writers' temp files too
        for n in (names["live"], names["old_style"], names["foreign"]):
            os.unlink(os.path.join(jobdir, n))
        for n in set(os.listdir(jobdir)) - before:   # the killed create's data file
            os.unlink(os.path.join(jobdir, n))
        with open(os.path.join(jobdir, names["dead"]), "w") as fh:
            fh.write("{")
        job.stdin.write("\n")
        job.stdin.flush()
        assert job.wait(timeout=120) == 0
        assert not os.path.exists(jobdir), os.listdir(jobdir)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


def test_temp_verdicts(tmp_path):
    tag = jobs._writer_tag()
    me, tid = os.getpid(), __import__("threading").get_native_id()
    f = tmp_path / "x"
    f.write_text("{")
    st = os.lstat(f)
    assert jobs._temp_verdict(f"{me}.{tag}.{tid}.00000000", st)[0] == "alive"
    assert jobs._temp_verdict(f"{me}.{tag}.{2 ** 22 + 7}.00000000", st)[0] == "dead"
    assert jobs._temp_verdict(f"{me}", st)[0] == "unknown"
    assert jobs._temp_verdict("not-a-pid", st) is None
    # a live writer's temp file stays whatever its age; the library removes only the
    # aged ones it cannot check
    old = os.stat(f).st_mtime - 3600
    os.utime(f, (old, old))
    st = os.lstat(f)
    assert not jobs._temp_is_stale("", f"{me}.{tag}.{tid}.00000000", st, old + 3600)
    assert jobs._temp_is_stale("", f"{me}", st, old + 3600)
