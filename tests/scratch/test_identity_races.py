"""One identity for a job and a handle (issue 27 items 1, 2 and two minor items).

* Two processes in separate PID namespaces (both pid 1) sharing a scratch root get separate
  job directories: each reads back its own ExclusiveFile and scratch DiskArray.
* Two threads creating one scratch DiskArray name at once never both hold a live handle:
  the loser is superseded, its close() leaves the winner's file alone, and no temp-name
  collision (FileExistsError) surfaces.
* A metadata temp file of a writer killed half-way is removed by the next create of that
  name; one's own pre-created 0777 job directory is tightened to 0700.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import chemio_py as cio
from chemio_py.arrays import meta
from chemio_py.scratch import jobs
from chemio_py.errors import SupersededError

TIMEOUT = 120


# ---------------------------------------------------------------- PID namespaces

NAMESPACE_JOB = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import chemio_py as cio
    sync, tag = sys.argv[1], sys.argv[2]
    other = "b" if tag == "a" else "a"

    def meet(step):
        open(os.path.join(sync, f"{step}.{tag}"), "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(sync, f"{step}.{other}")):
            if time.monotonic() > deadline:
                sys.exit(f"the other process never reached {step}")
            time.sleep(0.01)

    value = 1.0 if tag == "a" else 2.0
    payload = (tag * 64).encode()
    meet("start")
    f = cio.ExclusiveFile("x", "w+")
    f.write(0, payload)
    d = cio.DiskArray.create("a", (128,), "f8")
    d[:] = np.full(128, value)
    meet("written")
    ok = f.read_bytes(0, len(payload)) == payload and bool((d[:] == value).all())
    print(os.getpid(), os.path.dirname(f.path), os.path.dirname(d.path), ok, flush=True)
    meet("read")
    f.close()
    d.close()
""")


def _unshare_available() -> str | None:
    if not shutil.which("unshare"):
        return "no unshare command"
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                           capture_output=True, timeout=TIMEOUT)
    if probe.returncode != 0:
        return f"cannot make a pid namespace here: {probe.stderr!r}"
    return None


def test_two_pid_namespaces_never_share_a_job_directory(tmp_path):
    why = _unshare_available()
    if why:
        pytest.skip(why)
    root, sync = tmp_path / "scratch", tmp_path / "sync"
    root.mkdir()
    sync.mkdir()
    script = tmp_path / "job.py"
    script.write_text(NAMESPACE_JOB)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("PMI", "OMPI_"))},
           "CHEMIO_SCRATCH": str(root)}
    procs = [subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
                               sys.executable, str(script), str(sync), tag],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, start_new_session=True) for tag in "ab"]
    try:
        outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(TIMEOUT)
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    rows = [out.split() for out, _ in outs]
    assert [r[0] for r in rows] == ["1", "1"]          # both are pid 1 in their namespace
    assert [r[3] for r in rows] == ["True", "True"], rows   # each read its own data
    assert rows[0][1] != rows[1][1], rows               # separate job directories
    assert rows[0][2] != rows[1][2], rows
    assert os.listdir(root) == []                       # each removed its own scratch


# ---------------------------------------------------------------- threads

RACES = 300


def test_two_threads_creating_one_name_never_both_hold_a_live_handle():
    """Two threads create the same scratch DiskArray at the same moment, RACES times."""
    start = threading.Barrier(3, timeout=TIMEOUT)
    created = threading.Barrier(3, timeout=TIMEOUT)
    results: list = [None, None]

    def racer(slot: int) -> None:
        for _ in range(RACES):
            start.wait()
            try:
                results[slot] = cio.DiskArray.create("race", (256,), "f8")
            except BaseException as e:     # noqa: BLE001 - the test reports it
                results[slot] = e
            created.wait()

    threads = [threading.Thread(target=racer, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for race in range(RACES):
        start.wait()
        created.wait()
        handles = list(results)
        failed = [h for h in handles if isinstance(h, BaseException)]
        assert not failed, f"race {race}: a create raised {failed[0]!r}"
        live = []
        for value, d in enumerate(handles, start=1):
            try:
                d[:] = np.full(256, float(value))
                live.append((value, d))
            except SupersededError:
                pass
        assert len(live) == 1, f"race {race}: {len(live)} live handles to one name"
        value, winner = live[0]
        for d in handles:
            if d is not winner:
                with pytest.raises(SupersededError):
                    d[0:1]
                d.close()                  # the loser's close leaves the winner's file alone
        assert os.path.exists(winner.path), f"race {race}: the loser removed the file"
        again = cio.DiskArray.open(winner.path)
        try:
            assert (again[:] == value).all(), f"race {race}: the named file lost the data"
        finally:
            again.close()
        assert (winner[:] == value).all()
        winner.close()
        assert not os.path.exists(winner.path)
    for t in threads:
        t.join(TIMEOUT)


def test_metadata_temp_names_are_per_thread(tmp_path):
    """Two threads writing one metadata file atomically never collide on the temp name."""
    target = str(tmp_path / "x.dra.json")
    errors: list = []
    go = threading.Barrier(2, timeout=TIMEOUT)

    def writer(tag: bytes) -> None:
        for _ in range(200):
            go.wait()
            try:
                meta.write_atomic(target, tag)
            except BaseException as e:     # noqa: BLE001 - the test reports it
                errors.append(e)

    threads = [threading.Thread(target=writer, args=(t,)) for t in (b"a", b"b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not errors, errors[:3]
    assert sorted(os.listdir(tmp_path)) == ["x.dra.json"]


# ---------------------------------------------------------------- stale temp files

KILLED_CREATE = textwrap.dedent("""
    import os, signal, sys
    import chemio_py as cio
    def killed(*args, **kw):               # the process dies right before the rename
        os.kill(os.getpid(), signal.SIGKILL)
    os.replace = killed
    cio.DiskArray.create("a", (8,), "f8", path=sys.argv[1], persistent=True)
""")


def test_a_killed_writers_temp_file_is_removed_by_the_next_create(tmp_path):
    keep = tmp_path / "keep"
    keep.mkdir()
    p = subprocess.run([sys.executable, "-c", KILLED_CREATE, str(keep)], timeout=TIMEOUT,
                       capture_output=True, text=True)
    assert p.returncode == -signal.SIGKILL, p.stderr
    left = [n for n in os.listdir(keep) if ".tmp" in n]
    assert left, os.listdir(keep)                      # the killed create left its temp file
    aged = keep / ".a.dra.json.tmp4242"                # an old-style one, an hour old
    aged.write_bytes(b"{")
    old = time.time() - 3600
    os.utime(aged, (old, old))
    fresh = keep / f".a.dra.json.tmp{os.getpid()}"     # a live writer's: never touched
    fresh.write_bytes(b"{")
    other = keep / ".b.dra.json.tmp4242"               # another name's: not this create's
    other.write_bytes(b"{")
    os.utime(other, (old, old))
    d = cio.DiskArray.create("a", (8,), "f8", path=str(keep), persistent=True, overwrite=True)
    d.close()
    names = set(os.listdir(keep))
    assert not any(n in names for n in left), names
    assert aged.name not in names
    assert {fresh.name, other.name} <= names


def test_a_pre_created_0777_job_directory_is_tightened(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    d = root / f"{jobs.JOB_PREFIX}{jobs.job_id()}"
    d.mkdir()
    os.chmod(d, 0o777)
    try:
        assert jobs.job_dir(str(root)) == str(d)
        assert os.stat(d).st_mode & 0o777 == 0o700
    finally:
        jobs.cleanup()


def test_listing_reads_the_owner_of_a_namespaced_job_directory():
    from chemio_py.tools import listing
    tagged = "chemio-4242-vm-17-ns0123456789ab"
    assert listing._owner_from_name(tagged, "vm") == ("vm", 17, "4242")
    assert listing._owner_from_name("chemio-vm-17", "vm") == ("vm", 17, None)
