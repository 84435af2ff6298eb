"""Scratch lifecycle: job dirs, leases, cleanup, `chemio clean`, fs info."""
import json
import os
import signal
import subprocess
import sys

import pytest

import chemio_py as cio
from chemio_py import scratch


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
    e = scratch.parse_scratch("/a, 1:/r1, myhost:/h, /b")
    assert [x.path for x in e] == ["/a", "/r1", "/h", "/b"]
    cio.configure(scratch="/a,1:/r1,node*:/h,/b")
    assert scratch.private_root(1, "other") == "/r1"
    assert scratch.private_root(0, "node7") == "/h"
    assert scratch.private_root(0, "other") == "/a"
    assert scratch.private_root(3, "other") == "/b"
    assert scratch.shared_root() == "/a"


def test_fs_info():
    info = cio.stat("/tmp/does/not/exist/yet")
    assert info.free > 0 and info.total >= info.free and info.fstype not in ("", None)
    assert scratch.fstype("/dev/shm") == "tmpfs"
    assert scratch.fstype("/proc/self") == "proc"


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
        scratch.remove_job_dir(str(victim), [str(tmp_path / "elsewhere")])
    link = tmp_path / "chemio-link"
    link.symlink_to(victim)
    with pytest.raises(ValueError, match="symbolic link"):
        scratch.remove_job_dir(str(link), [str(tmp_path)])
    assert victim.exists()


def test_scratch_dir_symlink_is_refused(tmp_path):
    root = tmp_path / "r"
    root.mkdir()
    target = tmp_path / "target"
    target.mkdir()
    (root / f"chemio-{scratch.job_id()}").symlink_to(target)
    cio.configure(scratch=str(root))
    with pytest.raises(OSError, match="not a directory"):
        cio.ExclusiveFile("x", "w+")
    assert os.listdir(target) == []
