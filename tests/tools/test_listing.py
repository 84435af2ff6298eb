"""``cio.ls()`` and ``chemio ls``: live, dead and foreign job directories in a scratch root.

Real processes make the scratch: one keeps running with a DiskArray, an EAF, a RecordFile,
a SharedFile and an shm array open; one exits with ``CHEMIO_KEEP=1`` (its directory stays,
its lease dead). Foreign directories (no chemio marker; another user's when the suite runs
as root) must be listed as foreign and never touched: names, bytes, modification and
access times are compared before and after.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import chemio_py as cio

LIVE = """
import sys, numpy as np, chemio_py as cio
d = cio.DiskArray.create("fock", (64, 128), "f8"); d[...] = 1.0; d.flush()
e = cio.ExclusiveFile("cache", "w+"); e.write(0, np.ones(1000)); e.flush()
r = cio.RecordFile("recs", "w+"); r.append(np.arange(10.0)); r.flush()
s = cio.SharedFile("sf1"); s.write(0, np.ones(100)); s.flush()
m = cio.DiskArray.create("inram", (16, 16), "f8", backend="shm"); m[...] = 2.0
print("ready", flush=True)
sys.stdin.readline()
"""

DEAD = """
import chemio_py as cio
d = cio.DiskArray.create("old", (1024, 1024), "f8"); d[0] = 1.0; d.flush()
"""


def _env(root, shm, **extra):
    env = dict(os.environ, CHEMIO_SCRATCH=str(root), CHEMIO_SHM_DIR=str(shm), **extra)
    env.pop("CHEMIO_SHARED_SCRATCH", None)
    return env


def _snapshot(d) -> dict:
    """What a touch would change, by lstat only (reading would move the atimes): names,
    sizes, modes, owners, modification times, and the access times of the files (a
    directory's atime moves when it is listed, which is all ``ls`` does to it)."""
    out = {}
    for p in [d, *sorted(d.rglob("*"))]:
        st = os.lstat(p)
        out[str(p)] = (st.st_mtime_ns, None if p.is_dir() else st.st_atime_ns, st.st_mode,
                       st.st_uid, st.st_size)
    return out


def _contents(foreign) -> dict:
    return {str(p): p.read_bytes() for d in foreign for p in d.rglob("*") if p.is_file()}


@pytest.fixture
def scratch_tree(tmp_path):
    root, shm = tmp_path / "root", tmp_path / "shm"
    root.mkdir()
    shm.mkdir()
    subprocess.run([sys.executable, "-c", DEAD], env=_env(root, shm, CHEMIO_KEEP="1"),
                   check=True, timeout=60)
    live = subprocess.Popen([sys.executable, "-c", LIVE], env=_env(root, shm),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert live.stdout.readline().strip() == "ready"
    # foreign 1: a chemio-* directory chemio did not make (no marker)
    plain = root / "chemio-notours-4242"
    plain.mkdir()
    (plain / "data.bin").write_bytes(b"precious" * 100)
    foreign = [plain]
    if os.geteuid() == 0:           # foreign 2: another user's job directory
        alien = root / "chemio-elsewhere-77"
        alien.mkdir(mode=0o700)
        (alien / "x.dra").write_bytes(b"\0" * 4096)
        for p in (alien / "x.dra", alien):
            os.chown(p, 54321, 54321)
        foreign.append(alien)
    for d in foreign:               # atime older than mtime: any read would move it
        for p in [*d.rglob("*"), d]:
            st = os.lstat(p)
            os.utime(p, ns=(st.st_mtime_ns - 10**10, st.st_mtime_ns), follow_symlinks=False)
    try:
        yield root, shm, live, foreign
    finally:
        if live.poll() is None:
            live.stdin.write("\n")
            live.stdin.flush()
            live.wait(timeout=60)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def CONTENTS(foreign) -> dict:
    """What the fixture wrote into the foreign directories."""
    out = {str(foreign[0] / "data.bin"): b"precious" * 100}
    if len(foreign) > 1:
        out[str(foreign[1] / "x.dra")] = b"\0" * 4096
    return out


def _by_name(objs):
    return {o["name"] if isinstance(o, dict) else o.name: o for o in objs}


def _blocks(*paths) -> int:
    return sum(os.lstat(p).st_blocks * 512 for p in paths)


def test_ls_live_dead_and_foreign(scratch_tree):
    root, shm, live, foreign = scratch_tree
    before = {str(d): _snapshot(d) for d in foreign}

    jobs = cio.ls([str(root), str(shm)])
    assert all(not j.foreign for j in jobs)
    by_state = {j.alive: j for j in jobs if j.root == str(root)}
    assert set(by_state) == {True, False}

    run = by_state[True]
    assert run.owner_pid == live.pid and run.status == "in use"
    assert run.processes == [{"pid": live.pid, "host": run.host, "alive": True,
                              "why": f"pid {live.pid} is running"}]
    objs = _by_name(run.objects)
    assert {n: o.kind for n, o in objs.items()} == {
        "fock.dra": "DiskArray", "cache.0": "EAF", "recs.0": "RecordFile",
        "sf1.sf": "SharedFile"}
    fock = objs["fock.dra"]
    assert fock.logical_bytes == 64 * 128 * 8 and fock.backend == "local"
    assert fock.disk_bytes == _blocks(fock.path, fock.path + ".json")
    assert objs["cache.0"].rank == 0 and objs["cache.0"].logical_bytes == 8000
    assert all(0 <= o.age_seconds < 600 for o in run.objects)
    assert run.disk_bytes == sum(o.disk_bytes for o in run.objects)

    dead = by_state[False]
    assert dead.status == "stale" and dead.owner_pid != live.pid
    assert [p["alive"] for p in dead.processes] == [False]
    old = _by_name(dead.objects)["old.dra"]
    assert old.logical_bytes == 1024 * 1024 * 8
    assert old.disk_bytes == _blocks(old.path, old.path + ".json")

    in_shm = [j for j in jobs if j.root == str(shm)]
    assert len(in_shm) == 1 and in_shm[0].alive is True
    assert _by_name(in_shm[0].objects)["inram.dra"].logical_bytes == 16 * 16 * 8

    everything = cio.ls(str(root), all=True)
    strangers = {j.path: j for j in everything if j.foreign}
    assert set(strangers) == {str(d) for d in foreign}
    for j in strangers.values():
        assert j.alive is None and j.status == "keep"
    plain = strangers[str(foreign[0])]
    assert "no chemio marker" in plain.reason
    assert _by_name(plain.objects)["data.bin"].logical_bytes == 800
    if len(foreign) > 1:
        assert "uid 54321" in strangers[str(foreign[1])].reason
        assert strangers[str(foreign[1])].uid == 54321

    assert {str(d): _snapshot(d) for d in foreign} == before
    assert _contents(foreign) == CONTENTS(foreign)


def test_chemio_ls_command_text_and_json(scratch_tree):
    root, shm, live, foreign = scratch_tree
    before = {str(d): _snapshot(d) for d in foreign}
    env = _env(root, shm)

    def chemio(*args):
        r = subprocess.run([sys.executable, "-m", "chemio_py.cli", "ls", *args], env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout

    text = chemio()                           # default roots: the env's scratch and shm
    assert f"pid {live.pid}" in text and "running" in text and "dead" in text
    assert "fock.dra" in text and "on disk" in text and "FOREIGN" not in text
    assert f"{len(foreign)} foreign director" in text and "--all" in text
    assert str(foreign[0]) not in text

    data = json.loads(chemio("--json"))
    assert data["foreign_hidden"] == len(foreign)
    places = {j["root"]: j["place"] for j in data["jobs"]}
    assert places == {str(root): "private+shared", str(shm): "shm"}
    shm_obj = _by_name([o for j in data["jobs"] if j["root"] == str(shm)
                        for o in j["objects"]])["inram.dra"]
    assert shm_obj["backend"] == "shm" and shm_obj["kind"] == "DiskArray"

    data = json.loads(chemio("--all", "--json", "--root", str(root)))
    assert data["roots"] == [str(root)] and data["foreign_hidden"] == 0
    foreign_paths = sorted(j["path"] for j in data["jobs"] if j["foreign"])
    assert foreign_paths == sorted(str(d) for d in foreign)
    text = chemio("--all", "--root", str(root))
    assert text.count("FOREIGN") == len(foreign) and "data.bin" in text

    assert {str(d): _snapshot(d) for d in foreign} == before
    assert _contents(foreign) == CONTENTS(foreign)
