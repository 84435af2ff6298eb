"""Run-time backend selection: an unchanged script moves its files to RAM by
``CHEMIO_BACKEND``, by a TOML rule per name pattern, or not at all; ``backend=`` wins.

Each mechanism runs the same job script in a real child process, which reports where
every file's bytes are while they exist (path, file-system type, allocated bytes).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

import chemio_py as cio
from chemio_py.runtime import config
from chemio_py.scratch import fs, jobs
from chemio_py.errors import ConfigError
from chemio_py.backends.shm import budget as budget_mod

MiB = 1 << 20

# The "unchanged script": no backend anywhere in it.
JOB = r"""
import json, os, sys, numpy as np
import chemio_py as cio
from chemio_py.scratch import fs, jobs

def where(name, obj, nbytes):
    store = obj.store
    path = store.path
    st = os.stat(path)
    return {"name": name, "path": path, "fstype": fs.fstype(path),
            "allocated": st.st_blocks * 512, "nbytes": nbytes, "backend": obj.backend}

out = []
ints = cio.ExclusiveFile("eri.aoints", "w+")
ints.write(0, np.arange(2 * 2**17, dtype=np.float64))               # 2 MiB
out.append(where("eri.aoints", ints, 2 * 2**20))
fock = cio.ExclusiveFile("fock.dat", "w+")
fock.write(0, np.ones(2**17))                                       # 1 MiB
out.append(where("fock.dat", fock, 2**20))
sf = cio.SharedFile("ci.vectors")
sf.write(0, np.full(2**17, 3.0))
out.append(where("ci.vectors", sf, 2**20))
d = cio.DiskArray.create("t2.amps", (256, 512), "f8")
d[...] = 2.0
out.append(where("t2.amps", d, 256 * 512 * 8))
disk = [os.path.join(dp, f) for root in {jobs.private_root(0), jobs.shared_root()}
        for dp, _, fs in os.walk(root) for f in fs if not f.startswith(".lease")]
print("WHERE " + json.dumps({"files": out, "disk": disk}), flush=True)
assert ints.read(0, np.empty(2 * 2**17))[-1] == 2 * 2**17 - 1
assert d[255, 511] == 2.0 and sf.read(8, np.empty(1))[0] == 3.0
for f in (ints, fock):
    f.delete()
sf.destroy()
d.delete()
"""


def run_job(tmp_path, env: dict) -> dict:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    disk = tmp_path / "scratch"
    disk.mkdir(exist_ok=True)
    full = dict(os.environ, CHEMIO_SCRATCH=str(disk))
    for k in ("CHEMIO_BACKEND", "CHEMIO_CONFIG", "CHEMIO_SHARED_SCRATCH"):
        full.pop(k, None)
    full.update(env)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=120, env=full, cwd=str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("WHERE "))
    rep = json.loads(line[len("WHERE "):])
    rep["by_name"] = {f["name"]: f for f in rep["files"]}
    rep["scratch"] = str(disk)
    leftovers = [os.path.join(dp, f) for dp, _, fs in os.walk(disk) for f in fs]
    assert leftovers == []                               # the job cleaned up after itself
    return rep


def in_ram(f: dict) -> bool:
    return (f["path"].startswith(budget_mod.shm_dir() + os.sep) and f["fstype"] == "tmpfs"
            and f["allocated"] >= f["nbytes"])


def on_disk(f: dict, scratch_dir: str) -> bool:
    return f["path"].startswith(scratch_dir + os.sep) and f["allocated"] >= f["nbytes"]


def test_default_is_disk(tmp_path):
    rep = run_job(tmp_path, {})
    for f in rep["files"]:
        assert on_disk(f, rep["scratch"]) and f["backend"] == "local", f
    assert len(rep["disk"]) >= 4


def test_chemio_backend_shm_moves_every_file_to_ram(tmp_path):
    rep = run_job(tmp_path, {"CHEMIO_BACKEND": "shm"})
    for f in rep["files"]:
        assert in_ram(f) and f["backend"] == "shm", f
    assert [p for p in rep["disk"] if not p.endswith(".json")] == []    # no data on disk


def test_toml_rule_moves_matching_names_only(tmp_path):
    toml = tmp_path / "chemio.toml"
    toml.write_text('[files."*.aoints"]\nbackend = "shm"\n[files."t2.*"]\nbackend = "shm"\n')
    rep = run_job(tmp_path, {"CHEMIO_CONFIG": str(toml)})
    by = rep["by_name"]
    assert in_ram(by["eri.aoints"]) and by["eri.aoints"]["backend"] == "shm"
    assert in_ram(by["t2.amps"]) and by["t2.amps"]["backend"] == "shm"
    assert on_disk(by["fock.dat"], rep["scratch"]) and by["fock.dat"]["backend"] == "local"
    assert on_disk(by["ci.vectors"], rep["scratch"])
    # a rule beats the global setting: CHEMIO_BACKEND=local does not undo it
    rep = run_job(tmp_path, {"CHEMIO_CONFIG": str(toml), "CHEMIO_BACKEND": "local"})
    assert in_ram(rep["by_name"]["eri.aoints"])
    assert on_disk(rep["by_name"]["fock.dat"], rep["scratch"])


def test_chemio_backend_auto_spills_only_what_does_not_fit(tmp_path):
    # the budget counts every chemio segment in the shm dir: give the job its own
    own = tempfile.mkdtemp(prefix="cio-shm-", dir=budget_mod.shm_dir())
    try:
        rep = run_job(tmp_path, {"CHEMIO_BACKEND": "auto", "CHEMIO_SHM_LIMIT": "3M",
                                 "CHEMIO_SHM_DIR": own})
        assert os.listdir(own) == []
    finally:
        shutil.rmtree(own, ignore_errors=True)
    by = rep["by_name"]
    assert all(f["backend"] == "auto" for f in rep["files"])
    assert in_ram(by["eri.aoints"])                        # 2 MiB: fits
    placed = [in_ram(by[n]) for n in ("fock.dat", "ci.vectors", "t2.amps")]
    assert placed.count(False) >= 1                        # the budget ran out on the way
    for n, ram in zip(("fock.dat", "ci.vectors", "t2.amps"), placed):
        assert ram or on_disk(by[n], rep["scratch"]), by[n]


def test_explicit_argument_wins_over_env_and_rules(tmp_path, monkeypatch):
    toml = tmp_path / "c.toml"
    toml.write_text('[files."*.aoints"]\nbackend = "shm"\n')
    monkeypatch.setenv("CHEMIO_CONFIG", str(toml))
    monkeypatch.setenv("CHEMIO_BACKEND", "shm")
    s = config.backend_for("x.aoints", "local")
    assert (s.value, s.source) == ("local", "argument")
    s = config.backend_for("x.aoints")
    assert s.value == "shm" and '[files."*.aoints"]' in s.source
    s = config.backend_for("x.dat")
    assert (s.value, s.source) == ("shm", "env:CHEMIO_BACKEND")
    with cio.ExclusiveFile("x.aoints", "w+", backend="local") as f:
        f.write(0, b"disk")
        assert f.backend == "local" and f.path.startswith(jobs.private_root(0))
        assert fs.fstype(f.path) == fs.fstype(jobs.private_root(0))
        f.delete()
    with cio.ExclusiveFile("y.dat", "w+") as f:                 # env decides
        assert f.backend == "shm" and f.path.startswith(budget_mod.shm_dir())
        f.delete()


def test_unknown_backend_name_in_a_rule_fails_clearly(tmp_path, monkeypatch):
    toml = tmp_path / "c.toml"
    toml.write_text('[files."*.aoints"]\nbackend = "ramdisk"\n')
    monkeypatch.setenv("CHEMIO_CONFIG", str(toml))
    # settings are checked all at once against the registry (issue 21): the rule is named
    with pytest.raises(ConfigError, match=r"'ramdisk'.*\[files.\"\*\.aoints\"\].*known.*shm"):
        cio.ExclusiveFile("z.aoints", "w+")


def test_chemio_config_shows_the_deciding_rule(tmp_path):
    toml = tmp_path / "chemio.toml"
    toml.write_text('[files."*.aoints"]\nbackend = "shm"\n')
    cli = os.path.join(os.path.dirname(sys.executable), "chemio")
    cmd = [cli] if os.path.exists(cli) else [sys.executable, "-m", "chemio_py.cli"]
    env = dict(os.environ, CHEMIO_CONFIG=str(toml), CHEMIO_BACKEND="auto")
    p = subprocess.run(cmd + ["config", "eri.aoints", "fock.dat"], capture_output=True,
                       text=True, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    lines = {ln.split()[0]: ln for ln in p.stdout.splitlines() if "->" in ln}
    assert "shm" in lines["eri.aoints"] and '[files."*.aoints"]' in lines["eri.aoints"]
    assert "auto" in lines["fock.dat"] and "env:CHEMIO_BACKEND" in lines["fock.dat"]
