"""The shm backend ("files in memory") and the auto backend (RAM, spilling to disk).

Checked against bytearray / NumPy models, in real child processes where the point is that
a process survives (no SIGBUS) or shares memory with another, and under a real mpiexec.
"""
import os
import re
import signal
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest

import chemio_py as cio
import chemio_py.backends as backends
from chemio_py.runtime import config
from chemio_py.scratch import janitor, jobs
from chemio_py.runtime import stats
from chemio_py.backends import auto as auto_mod
from chemio_py.backends.shm import backend as shm_mod, budget as budget_mod, mapping as shm_map
from chemio_py.errors import OutOfSpaceError

MiB = 1 << 20
KiB = 1 << 10


def shm_root() -> str:
    return budget_mod.shm_dir()


def private_shm_dir() -> str:
    """A fresh directory in the shm root (its name avoids the leak check's "chemio")."""
    return tempfile.mkdtemp(prefix="cio-shm-", dir=shm_root())


def markers(out: str, tag: str) -> list[str]:
    return [ln[len(tag):].strip() for ln in out.splitlines() if ln.startswith(tag)]


def _can_mount_tmpfs() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        p = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True,
                           timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return p.returncode == 0


# ------------------------------------------------------------------ basics

def test_segment_is_a_private_ram_file_in_the_job_dir():
    data = np.arange(100_000, dtype=np.float64)
    with cio.ExclusiveFile("seg.aoints", "w+", backend="shm") as f:
        f.write(0, data)
        path = f.path
        st = os.stat(path)
        assert os.path.dirname(os.path.dirname(path)) == shm_root()
        assert os.path.basename(os.path.dirname(path)).startswith(jobs.JOB_PREFIX)
        assert st.st_mode & 0o777 == 0o600
        assert os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
        assert st.st_size == data.nbytes and st.st_blocks * 512 >= data.nbytes   # no holes
        with open(path, "rb") as fh:                      # plain file, plain bytes
            assert fh.read() == data.tobytes()
        with pytest.raises(FileExistsError):
            backends.resolve("shm").open_bytes(path, "x+")
        f.delete()
    assert not os.path.exists(path)


def test_symlink_in_place_of_a_segment_is_refused(tmp_path):
    be = backends.resolve("shm")
    job = jobs.job_dir(shm_root())
    target = tmp_path / "elsewhere"
    target.write_bytes(b"secret")
    link = os.path.join(job, "link.0")
    os.symlink(target, link)
    try:
        for mode in ("r", "r+", "w+"):
            with pytest.raises(OSError):
                be.open_bytes(link, mode)
        assert target.read_bytes() == b"secret"
    finally:
        os.unlink(link)


def test_concurrent_growing_writes_from_threads_match_model():
    block, nthreads, per = 48 * KiB + 8, 8, 12
    model = bytearray(block * nthreads * per)
    rng = np.random.default_rng(1)
    payload = rng.integers(0, 256, size=(nthreads, per, block), dtype=np.uint8)
    with cio.ExclusiveFile("threads", "w+", backend="shm") as f:
        store = f.store
        errors = []

        def work(t):
            try:
                for k in range(per):
                    off = (k * nthreads + t) * block          # interleaved: every write grows
                    store.pwrite(off, payload[t, k])
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        ths = [threading.Thread(target=work, args=(t,)) for t in range(nthreads)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        assert not errors
        for t in range(nthreads):
            for k in range(per):
                off = (k * nthreads + t) * block
                model[off:off + block] = payload[t, k].tobytes()
        assert f.size == len(model)
        assert f.read_bytes(0, len(model)) == bytes(model)
        f.delete()


def test_second_store_remaps_when_another_grows_past_its_window(tmp_path):
    """A store maps a window; when another opener grows the file past it, reads remap."""
    be = backends.resolve("shm")
    path = os.path.join(jobs.job_dir(shm_root()), "window.0")
    a = be.open_bytes(path, "w+")
    jobs.own(path)
    old = shm_map.MIN_MAP
    shm_map.MIN_MAP = 64 * KiB
    try:
        b = be.open_bytes(path, "r")
        assert b._win.length < 4 * MiB
    finally:
        shm_map.MIN_MAP = old
    try:
        blob = np.random.default_rng(2).integers(0, 256, 4 * MiB, dtype=np.uint8)
        a.pwrite(0, blob)
        out = np.empty(MiB, np.uint8)
        assert b.pread(3 * MiB, out) == MiB
        assert np.array_equal(out, blob[3 * MiB:])
        assert b._win.length >= 4 * MiB
        assert b.pread(4 * MiB - 10, out) == 10               # short only at the end
    finally:
        b.close()
        a.close()
        be.remove(path)


def test_read_only_open_of_a_sparse_file_allocates_nothing_and_r_plus_fills_it():
    """A read fault on a tmpfs hole allocates a page: read-only stores of sparse files read
    with preadv instead; writable opens back every page first (budget checked)."""
    be = backends.resolve("shm")
    path = os.path.join(jobs.job_dir(shm_root()), "sparse.0")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    jobs.own(path)
    os.pwrite(fd, b"head", 0)
    os.ftruncate(fd, 8 * MiB)                              # made by someone else, sparse
    os.close(fd)
    before = os.stat(path).st_blocks
    r = be.open_bytes(path, "r")
    out = bytearray(8 * MiB)
    assert r.pread(0, out) == 8 * MiB
    assert out[:4] == b"head" and not any(out[4:])
    assert os.stat(path).st_blocks == before               # nothing allocated by the read
    r.close()
    w = be.open_bytes(path, "r+")
    assert os.stat(path).st_blocks * 512 >= 8 * MiB        # no holes left to fault on
    w.close()
    be.remove(path)


def test_shrink_waits_for_no_one_and_other_openers_see_the_end(tmp_path):
    """Shrinking while another process has the segment open: it reads a short count (the
    new end), never a SIGBUS; re-creating with w+ likewise."""
    be = backends.resolve("shm")
    path = os.path.join(jobs.job_dir(shm_root()), "shrink.0")
    a = be.open_bytes(path, "x+")
    jobs.own(path)
    a.pwrite(0, np.full(2 * MiB, 7, np.uint8))
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, numpy as np
            import chemio_py.backends as b
            s = b.resolve("shm").open_bytes({path!r}, "r+")
            buf = np.empty(2 * 2**20, np.uint8)
            print("A", s.pread(0, buf), int(buf.sum()), flush=True)
            sys.stdin.readline()                       # the parent shrinks the file now
            print("B", s.pread(0, buf), flush=True)
            s.pwrite(3 * 2**20, b"tail")               # grows again from 1 KiB
            print("C", s.size(), flush=True)
            sys.stdin.readline()
            s.close()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().split() == ["A", str(2 * MiB), str(7 * 2 * MiB)]
        a.truncate(KiB)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().split() == ["B", str(KiB)]
        assert child.stdout.readline().split() == ["C", str(3 * MiB + 4)]
        out = bytearray(3 * MiB + 4)
        assert a.pread(0, out) == len(out)
        assert out[:KiB] == b"\x07" * KiB and not any(out[KiB:3 * MiB]) and out[-4:] == b"tail"
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(60) == 0, child.stderr.read()
    finally:
        if child.poll() is None:
            child.kill()
        a.close()
        be.remove(path)


def test_shrink_gets_in_while_another_process_reads_nonstop(tmp_path):
    """A reader that never pauses still lets a shrinking process in (its shared lock is
    dropped now and then); afterwards it sees the new end: short reads, no SIGBUS."""
    be = backends.resolve("shm")
    path = os.path.join(jobs.job_dir(shm_root()), "busy.0")
    a = be.open_bytes(path, "x+")
    jobs.own(path)
    a.pwrite(0, np.full(MiB, 3, np.uint8))
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import time, numpy as np
            import chemio_py.backends as b
            s = b.resolve("shm").open_bytes({path!r}, "r")
            buf = np.empty(2**20, np.uint8)
            assert s.pread(0, buf) == buf.size        # reading before the parent shrinks
            print("START", flush=True)
            t0, n = time.monotonic(), 1
            while time.monotonic() - t0 < 60:
                k = s.pread(0, buf)
                n += 1
                if k < buf.size:
                    print("SHORT", k, int(buf[:k].sum()), n > 1, flush=True)
                    break
                assert int(buf.sum()) == 3 * 2**20
            s.close()
        """)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "START"
        a.truncate(KiB)
        assert a.size() == KiB
        assert child.stdout.readline().split() == ["SHORT", str(KiB), str(3 * KiB), "True"]
        assert child.wait(60) == 0, child.stderr.read()
    finally:
        if child.poll() is None:
            child.kill()
        a.close()
        be.remove(path)


# ------------------------------------------------------------------ the RAM budget

def test_budget_names_its_terms_and_counts_segments():
    config.configure(shm_limit="256M")
    b0 = budget_mod.ram_budget()
    assert b0.limit == 256 * MiB
    mem = budget_mod.meminfo()["MemAvailable"]
    with open("/proc/meminfo") as fh:                  # independent reading
        kb = next(int(ln.split()[1]) for ln in fh if ln.startswith("MemAvailable:"))
    assert abs(mem - kb * 1024) < 256 * MiB
    assert any("CHEMIO_SHM_LIMIT='256M' (explicit)" in k for k in b0.terms)
    assert b0.headroom <= min(b0.terms.values()) + 1 and b0.headroom <= 256 * MiB - b0.used
    with cio.ExclusiveFile("budget", "w+", backend="shm") as f:
        f.write(0, np.zeros(3 * MiB, np.uint8))
        b1 = budget_mod.ram_budget()
        assert b1.used - b0.used >= 3 * MiB
        f.delete()
    config.configure(shm_limit="10%")
    b2 = budget_mod.ram_budget()
    room = [x for x in (b2.mem_available, b2.cgroup.free if b2.cgroup else None) if x]
    assert b2.limit == int((min(room) + b2.used) * 0.10)
    config.configure(shm_limit="100M")             # stat(): free = headroom, total = limit
    fs = backends.resolve("shm").stat(os.path.join(shm_root(), "x"))
    assert fs.total == 100 * MiB and fs.free <= 100 * MiB and fs.fstype == "tmpfs"


def test_far_offsets_hit_the_budget_before_any_mapping():
    with cio.ExclusiveFile("far", "w+", backend="shm") as f:
        f.write(0, b"abc")
        with pytest.raises(OutOfSpaceError, match="RAM budget") as ei:
            f.write(1 << 45, b"x")                          # 32 TiB: nothing happens
        assert ei.value.needed >= 1 << 45 and ei.value.free < 1 << 45
        with pytest.raises(cio.EndOfFileError):
            f.read(1 << 45, bytearray(1))
        assert f.size == 3 and f.read_bytes(0, 3) == b"abc"
        assert f.store.allocated() <= 4096
        f.delete()


def _write_tree(root, files: dict) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_cgroup_v1_and_v2_limits_are_found_up_the_tree(tmp_path):
    # v1: the parent of our cgroup has the tighter room; inactive file cache counts as free
    v1 = tmp_path / "v1"
    _write_tree(v1, {
        "proc": "12:cpu,cpuacct:/job/step\n4:memory:/job/step\n0::/\n",
        "sys/memory/memory.limit_in_bytes": "9223372036854771712\n",
        "sys/memory/job/memory.limit_in_bytes": str(8 << 30),
        "sys/memory/job/memory.usage_in_bytes": str(7 << 30),
        "sys/memory/job/memory.stat": f"cache 5\ntotal_inactive_file {1 << 30}\n",
        "sys/memory/job/step/memory.limit_in_bytes": str(16 << 30),
        "sys/memory/job/step/memory.usage_in_bytes": str(1 << 30),
    })
    cg = budget_mod.cgroup_memory(str(v1 / "proc"), str(v1 / "sys"))
    assert cg.version == "v1" and cg.path.endswith("memory/job")
    assert cg.limit == 8 << 30 and cg.free == 2 << 30
    # v2: memory.max "max" at the leaf, a limit above it
    v2 = tmp_path / "v2"
    _write_tree(v2, {
        "proc": "0::/user.slice/job.scope\n",
        "sys/user.slice/memory.max": str(4 << 30),
        "sys/user.slice/memory.current": str(1 << 30),
        "sys/user.slice/memory.stat": "anon 1\ninactive_file 0\n",
        "sys/user.slice/job.scope/memory.max": "max\n",
        "sys/user.slice/job.scope/memory.current": str(1 << 29),
    })
    cg = budget_mod.cgroup_memory(str(v2 / "proc"), str(v2 / "sys"))
    assert cg.version == "v2" and cg.path.endswith("user.slice")
    assert cg.free == 3 << 30
    # inside a cgroup namespace the listed path does not exist: the mounted root is ours
    ns = tmp_path / "ns"
    _write_tree(ns, {"proc": "0::/../../elsewhere\n", "sys/memory.max": str(1 << 30),
                     "sys/memory.current": str(1 << 28)})
    cg = budget_mod.cgroup_memory(str(ns / "proc"), str(ns / "sys"))
    assert cg.limit == 1 << 30 and cg.free == (1 << 30) - (1 << 28)
    # no limit anywhere
    nolim = tmp_path / "nolim"
    _write_tree(nolim, {"proc": "0::/a\n", "sys/a/memory.max": "max\n",
                        "sys/memory.max": "max\n"})
    assert budget_mod.cgroup_memory(str(nolim / "proc"), str(nolim / "sys")) is None


BUDGET_JOB = """
import os, sys, numpy as np, warnings
import chemio_py as cio
from chemio_py.errors import OutOfSpaceError
be = sys.argv[1] if len(sys.argv) > 1 else "shm"
model = bytearray()
blk = np.arange(256 * 1024, dtype=np.uint8) % 251
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    f = cio.ExclusiveFile("job.aoints", "w+", backend=be)
    try:
        for k in range(16):                     # 4 MiB in 256 KiB records
            f.write(k * blk.nbytes, blk + k)
            model += (blk + k).tobytes()
        print("DONE", f.size, f.read_bytes(0, f.size) == bytes(model), f.store.path,
              flush=True)                       # the store knows where the bytes are now
    except OutOfSpaceError as e:
        print("OOS", f.size, f.read_bytes(0, f.size) == bytes(model), e.needed, e.free,
              flush=True)
        print("MSG", str(e).replace(chr(10), " "), flush=True)
    try:
        f.truncate(64 << 20)
        print("TRUNC-OK", f.size)
    except OutOfSpaceError:
        print("TRUNC-OOS", f.size)
    f.close()
    try:
        cio.ExclusiveFile("hint", "w+", backend=be, size_hint=64 << 20).delete()
        print("HINT-OK")
    except OutOfSpaceError:
        print("HINT-OOS", os.listdir(os.path.dirname(f.path)))
    try:
        d = cio.DiskArray.create("arr", (1024, 1024), "f8", backend=be)
        d[...] = 1.5
        print("ARRAY-OK", float(d[3:5, 7:9].sum()))
        d.delete()
    except OutOfSpaceError as e:
        print("ARRAY-OOS")
print("SPILLS", sum(1 for w in caught if "moved from RAM to disk" in str(w.message)))
"""


@pytest.mark.parametrize("be", ["shm", "auto"])
def test_shm_limit_in_a_real_process(be, tmp_path):
    """CHEMIO_SHM_LIMIT=1M: shm raises OutOfSpaceError (the process lives on and exits 0);
    auto finishes the same job on disk with the data intact."""
    own = private_shm_dir()             # the budget counts every chemio segment there
    try:
        p = subprocess.run([sys.executable, "-c", BUDGET_JOB, be], capture_output=True,
                           text=True, timeout=120, cwd=str(tmp_path),
                           env=dict(os.environ, CHEMIO_SHM_LIMIT="1M", CHEMIO_SHM_DIR=own))
        assert os.listdir(own) == []
    finally:
        shutil.rmtree(own, ignore_errors=True)
    assert p.returncode == 0, p.stderr                  # no SIGBUS, no crash
    out = p.stdout
    if be == "shm":
        oos = markers(out, "OOS")[0].split()
        assert oos[0] == str(1 * MiB) and oos[1] == "True"   # 4 records fit, nothing else
        assert int(oos[2]) == 256 * KiB and int(oos[3]) < 256 * KiB
        msg = markers(out, "MSG")[0]
        assert "RAM budget" in msg and "CHEMIO_SHM_LIMIT='1M'" in msg and "auto" in msg
        assert markers(out, "TRUNC-OOS") == [str(MiB)]
        left = markers(out, "HINT-OOS")[0]
        assert "job.aoints.0" in left and "hint.0" not in left    # nothing half-made
        assert markers(out, "ARRAY-OOS") == [""]
        assert markers(out, "SPILLS") == ["0"]
    else:
        done = markers(out, "DONE")[0].split()
        assert done[0] == str(4 * MiB) and done[1] == "True"
        assert not done[2].startswith(shm_root())          # it moved to disk
        assert markers(out, "TRUNC-OK") == [str(64 * MiB)]
        assert markers(out, "HINT-OK") == [""]
        assert markers(out, "ARRAY-OK") == [str(1.5 * 4)]
        assert int(markers(out, "SPILLS")[0]) >= 3


RAW_SIGBUS = """
import mmap, os, sys
p = os.path.join(sys.argv[1], "raw")
fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 8 << 20)                   # reserves nothing on tmpfs
m = mmap.mmap(fd, 8 << 20)
m[:] = b"x" * (8 << 20)                     # first touch past the 1 MiB tmpfs: SIGBUS
print("survived")
"""

TINY_JOB = """
import os, sys, numpy as np
import chemio_py as cio
from chemio_py.errors import OutOfSpaceError
be = sys.argv[1]
blk = np.arange(256 * 1024, dtype=np.uint8) % 253
with cio.ExclusiveFile("tiny", "w+", backend=be) as f:
    try:
        for k in range(16):
            f.write(k * blk.nbytes, blk ^ k)
        ok = all(np.array_equal(f.read(k * blk.nbytes, np.empty_like(blk)), blk ^ k)
                 for k in range(16))
        print("DONE", f.size, ok, f.store.path)
    except OutOfSpaceError as e:
        print("OOS", f.size, str(e).replace(chr(10), " "))
    f.delete()
"""


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs unshare -m and tmpfs mounts (root)")
def test_full_tmpfs_is_an_error_not_a_sigbus(store, tmp_path):
    """On a real 1 MiB tmpfs a plain mmap write dies of SIGBUS; a chemio store raises
    OutOfSpaceError (local, shm) or moves to disk (auto), and the process exits normally."""
    ram = tmp_path / "ram"
    disk = tmp_path / "disk"
    ram.mkdir()
    disk.mkdir()
    (tmp_path / "raw.py").write_text(RAW_SIGBUS)
    (tmp_path / "job.py").write_text(TINY_JOB)
    scratch_dir = ram if store in ("local", "mpiio") else disk     # files in CHEMIO_SCRATCH
    env = dict(os.environ, CHEMIO_SHM_DIR=str(ram), CHEMIO_SCRATCH=str(scratch_dir),
               CHEMIO_SHM_LIMIT="100%")
    env.pop("CHEMIO_SHARED_SCRATCH", None)

    def in_ns(*cmd):
        return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                               'mount -t tmpfs -o size=1m tmpfs "$0" && exec "$@"', str(ram),
                               *cmd], capture_output=True, text=True, timeout=120, env=env,
                              cwd=str(tmp_path))

    raw = in_ns(sys.executable, str(tmp_path / "raw.py"), str(ram))
    assert raw.returncode == -signal.SIGBUS, (raw.returncode, raw.stdout, raw.stderr)
    p = in_ns(sys.executable, str(tmp_path / "job.py"), store)
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr)
    if store == "auto":
        done = markers(p.stdout, "DONE")[0].split()
        assert done[:2] == [str(4 * MiB), "True"] and done[2].startswith(str(disk))
    else:
        oos = markers(p.stdout, "OOS")[0]
        assert int(oos.split()[0]) < MiB and "out of space" in oos
        if store == "shm":
            assert "RAM budget" in oos and "free space in" in oos
    assert os.listdir(ram) == []                       # the namespace's tmpfs is gone
    assert [n for n in os.listdir(disk) if not n.startswith(".")] == []


# ------------------------------------------------------------------ auto

def test_auto_spills_with_requests_in_flight_and_records_it():
    config.configure(shm_limit="2M")
    n, blk = 48, 128 * KiB
    data = [np.full(blk // 8, float(i)) for i in range(n)]
    with pytest.warns(auto_mod.SpillWarning, match="moved from RAM to disk"):
        with cio.ExclusiveFile("spill.amps", "w+", backend="auto") as f:
            ram_path = f.path
            assert ram_path.startswith(shm_root())
            reqs = [f.awrite(i * blk, data[i]) for i in range(n)]     # 6 MiB > 2 MiB
            assert cio.waitall(reqs) == [blk] * n
            store = f.store
            disk = auto_mod.disk_path(ram_path)
            assert store.spilled and store.path == disk and f.path == disk   # where bytes live
            assert not os.path.exists(ram_path) and os.path.exists(disk)
            outs = [np.empty(blk // 8) for _ in range(n)]
            cio.waitall([f.aread(i * blk, outs[i]) for i in range(n)])
            for i in range(n):
                np.testing.assert_array_equal(outs[i], data[i])
            f.delete()
    assert not os.path.exists(disk)
    sp = [s for s in auto_mod.spills() if s["path"] == disk]
    assert sp and sp[-1]["bytes"] <= 2 * MiB and "RAM budget" in sp[-1]["reason"]
    assert f"{disk} (spilled to disk)" in [r["file"] for r in stats.snapshot()["files"]]


def test_auto_small_files_stay_in_ram_and_arrays_choose_at_creation():
    config.configure(shm_limit="4M")
    with cio.ExclusiveFile("small", "w+", backend="auto") as f:
        f.write(0, np.arange(1000.0))
        assert f.store.path.startswith(shm_root()) and not f.store.spilled
        f.delete()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        small = cio.DiskArray.create("fits", (64, 64), "f8", backend="auto")
        big = cio.DiskArray.create("big", (1024, 1024), "f8", backend="auto")   # 8 MiB
    assert len([w for w in caught if issubclass(w.category, auto_mod.SpillWarning)]) == 1
    model = np.arange(1024 * 1024, dtype=np.float64).reshape(1024, 1024)
    big[...] = model
    small[...] = model[:64, :64]
    np.testing.assert_array_equal(big[100:300, 7:900], model[100:300, 7:900])
    np.testing.assert_array_equal(small[...], model[:64, :64])
    assert small.path.startswith(shm_root()) or small.store.path.startswith(shm_root())
    big.delete()
    small.delete()


def test_auto_file_outside_the_job_dir_goes_to_disk_and_stays(tmp_path):
    with cio.ExclusiveFile("mine", "w+", backend="auto", dir=str(tmp_path)) as f:
        f.write(0, b"kept")
        assert f.path == str(tmp_path / "mine.0")
    assert (tmp_path / "mine.0").read_bytes() == b"kept"


# ------------------------------------------------------------------ processes

SHARE_MPI = """
import os, numpy as np
import chemio_py as cio
from chemio_py.scratch import fs, janitor, jobs
import chemio_py.backends as backends
c = cio.comm()
me, P = c.rank, c.size
backends.resolve("shm").check_collective(c, "test")      # one node: no error
n = 1 << 16
sf = cio.SharedFile("share", backend="shm")
st = os.stat(sf.path)
ids = c.allgather((st.st_dev, st.st_ino, sf.path))
assert len(set(ids)) == 1, ids
assert sf.path.startswith(os.environ["CHEMIO_SHM_DIR"]) and fs.fstype(sf.path) == "tmpfs"
mine = np.arange(n, dtype=np.float64) * (me + 1)
sf.write(me * n * 8, mine)
c.barrier()
other = (me + 1) % P
got = sf.read(other * n * 8, np.empty(n))
assert np.array_equal(got, np.arange(n, dtype=np.float64) * (other + 1))
c.barrier()
if me == 1:                                  # later writes of one are seen by the other
    sf.write(3 * n * 8, np.full(n, 42.0))
c.barrier()
if me == 0:
    assert sf.size == 4 * n * 8
    assert np.all(sf.read(3 * n * 8, np.empty(n)) == 42.0)
    assert not any(sf.read_bytes(2 * n * 8, n * 8))          # the gap reads as zeros
path = sf.path
sf.destroy()
assert not os.path.exists(path)
d = cio.DiskArray.create("shared_arr", (400, 300), "f8", backend="shm", chunks=(64, 64))
sec = cio.block_section(d.shape)
d.write_all(sec, np.full((sec[0].stop - sec[0].start, 300), float(me)))
full = d.read_all((slice(0, 400), slice(0, 300)), np.empty((400, 300)))
expect = np.concatenate([np.full((200, 300), float(r)) for r in range(P)])
assert np.array_equal(full, expect)
d.delete()
print(f"RANK-OK-{me}", flush=True)
"""


def test_two_mpi_ranks_share_one_segment(mpirun):
    p = mpirun(2, SHARE_MPI, env={"CHEMIO_SHM_DIR": shm_root()}, timeout=120)
    assert sorted(re.findall(r"RANK-OK-(\d)", p.stdout)) == ["0", "1"], p.stdout


AUTO_SHARED = """
import os, numpy as np
import chemio_py as cio
from chemio_py.errors import OutOfSpaceError
c = cio.comm()
sf = cio.SharedFile("grows", backend="auto")
sf.write(c.rank * 65536, np.full(8192, float(c.rank)))        # small: stays in RAM
c.barrier()
assert sf.store.path.startswith(os.environ["CHEMIO_SHM_DIR"]) and not sf.store.spilled
if c.rank == 1:
    try:
        sf.write(0, np.zeros(1 << 20))                           # 8 MiB > 2M budget
        print("NO-ERROR", flush=True)
    except OutOfSpaceError as e:
        print(f"REFUSED {'open in other processes' in str(e)}", flush=True)
c.barrier()
other = 1 - c.rank
assert np.all(sf.read(other * 65536, np.empty(8192)) == float(other))   # data intact
sf.destroy()
print(f"RANK-OK-{c.rank}", flush=True)
"""


def test_auto_shared_segment_is_not_moved_behind_other_ranks(mpirun):
    own = private_shm_dir()
    try:
        p = mpirun(2, AUTO_SHARED, env={"CHEMIO_SHM_DIR": own, "CHEMIO_SHM_LIMIT": "2M"})
        assert os.listdir(own) == []
    finally:
        shutil.rmtree(own, ignore_errors=True)
    assert "REFUSED True" in p.stdout and "NO-ERROR" not in p.stdout, p.stdout
    assert sorted(re.findall(r"RANK-OK-(\d)", p.stdout)) == ["0", "1"], p.stdout


def test_node_groups_names_the_nodes():
    assert shm_mod.node_groups(["a", "a", "a"], [0, 0, 0]) is None
    g = shm_mod.node_groups(["n1", "n1", "n2", "n2"], [0, 0, 2, 2])
    assert g == {"n1": [0, 1], "n2": [2, 3]}
    g = shm_mod.node_groups(["x", "x"], [0, 1])                 # same name, two nodes
    assert list(g.values()) == [[0], [1]] and all("x" in k for k in g)


KILLED = """
import os, sys, time, numpy as np
import chemio_py as cio
f = cio.ExclusiveFile("orphan", "w+", backend="shm")
f.write(0, np.ones(1 << 18))
print(os.path.dirname(f.path), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("how", ["api", "cli"])
def test_clean_removes_the_segment_of_a_sigkilled_process(how, tmp_path):
    child = subprocess.Popen([sys.executable, "-c", KILLED], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=str(tmp_path))
    try:
        job = child.stdout.readline().strip()
        assert job.startswith(shm_root()) and os.path.isfile(os.path.join(job, "orphan.0"))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    assert child.returncode == -signal.SIGKILL
    assert os.path.getsize(os.path.join(job, "orphan.0")) == 8 << 18   # left behind
    infos = {i.path: i for i in janitor.scan_job_dirs([shm_root()])}
    assert infos[job].alive is False and "gone" in infos[job].reason
    mine = jobs.job_dir(shm_root())                  # a live job dir must survive
    if how == "api":
        janitor.remove_job_dir(job, [shm_root()])
    else:
        cli = os.path.join(os.path.dirname(sys.executable), "chemio")
        if not os.path.exists(cli):
            cli_cmd = [sys.executable, "-m", "chemio_py.cli"]
        else:
            cli_cmd = [cli]
        p = subprocess.run(cli_cmd + ["clean", "--root", shm_root()], capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        assert f"removing     {job}" in p.stdout
    assert not os.path.exists(job)
    assert os.path.isdir(mine)


def test_an_open_waits_for_a_sole_holder_with_a_deadline(monkeypatch):
    """An open of a segment that another open holds alone (``lock_sole``: auto moving it to
    disk) waits ``LOCK_WAIT`` at most, then fails clearly with nothing left open (it used to
    wait in the kernel for ever); once the holder lets go it opens."""
    import fcntl
    from chemio_py.backends.shm import lock as lock_mod
    monkeypatch.setattr(lock_mod, "LOCK_WAIT", 0.2)
    d = tempfile.mkdtemp(dir=budget_mod.shm_dir())
    try:
        _sole_holder_case(d, lock_mod, fcntl)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _sole_holder_case(d, lock_mod, fcntl):
    path = os.path.join(d, "held")
    holder = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert lock_mod.ofd_lock(holder, fcntl.F_WRLCK, wait=False)
        got: list = []

        def opener():
            try:
                got.append(shm_mod.open_segment(path, "r+"))
            except Exception as e:  # noqa: BLE001 - checked below
                got.append(e)
        fds = len(os.listdir("/proc/self/fd"))
        t = threading.Thread(target=opener, daemon=True)
        t.start()
        t.join(5)
        assert not t.is_alive() and isinstance(got[0], cio.ChemIOError), got
        assert "held alone" in str(got[0]) and "Nothing was opened" in str(got[0])
        assert len(os.listdir("/proc/self/fd")) == fds
    finally:
        os.close(holder)                # a waiter still in the kernel gets the lock now
    fd, created = shm_mod.open_segment(path, "r+")
    os.close(fd)
    assert not created


def test_a_gate_waiting_for_its_lock_holds_up_no_one_else(tmp_path):
    """A thread whose ``Gate.enter`` waits for the shared lock (another open holds it
    exclusively: a shrinker) waits outside the gate's own lock, so the janitor's ``tick``,
    which serves every store of the process, answers at once (it used to block for as long
    as the wait, up to ``LOCK_WAIT``); once the holder lets go the thread gets in."""
    import fcntl
    from chemio_py.backends.shm import lock as lock_mod
    path = str(tmp_path / "seg")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    holder = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        gate = lock_mod.Gate(fd)
        inside = threading.Event()

        def enter():
            gate.enter()
            inside.set()
        t = threading.Thread(target=enter, daemon=True)
        t.start()
        time.sleep(0.05)
        assert not inside.is_set()                  # still waiting for the shared lock
        ticked: list = []
        ticker = threading.Thread(target=lambda: ticked.append(gate.tick(time.monotonic())),
                                  daemon=True)
        ticker.start()
        ticker.join(2)
        waited = ticker.is_alive()
        fcntl.flock(holder, fcntl.LOCK_UN)          # (lets a blocked tick end, too)
        ticker.join(5)
        assert not waited and ticked == [False]     # not held yet, and no wait
        assert inside.wait(5)
        t.join(5)
        assert gate.tick(time.monotonic()) is True   # now held, with one thread inside
        gate.leave()
        gate.enter_excl()                           # nobody inside: exclusive, lock dropped
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        gate.leave_excl()
    finally:
        os.close(holder)
        os.close(fd)
