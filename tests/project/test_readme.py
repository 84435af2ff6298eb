"""The README stays true: its Python blocks run, its commands are the ones CI runs."""
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

ROOT = REPO
README = open(os.path.join(ROOT, "README.md")).read()


def _block_after(marker):
    m = re.search(rf"<!-- {marker} -->\s*```bash\n(.*?)\n```", README, re.S)
    assert m, f"README has no {marker} block"
    return m.group(1).strip()


def test_ci_runs_the_readme_test_command():
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert _block_after("test-command") in ci
    assert "chemio demo" in _block_after("main-command")


@pytest.mark.parametrize("index", range(len(re.findall(r"```python\n", README))))
def test_readme_python_block_runs(index, tmp_path):
    code = re.findall(r"```python\n(.*?)```", README, re.S)[index]
    env = {**os.environ}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, f"README block {index} failed:\n{code}\n{r.stderr}"


def test_cli_demo_info_config():
    def run(*a):
        return subprocess.run([sys.executable, "-m", "chemio_py.cli", *a], capture_output=True,
                              text=True, timeout=300)
    demo = run("demo", "--eaf", "--records", "8")
    assert demo.returncode == 0, demo.stderr
    assert "OK" in demo.stdout and "I/O report" in demo.stdout
    info = run("info")
    assert info.returncode == 0 and "local" in info.stdout and "settings:" in info.stdout
    cfg = run("config", "integrals.aoints")
    assert cfg.returncode == 0 and "integrals.aoints" in cfg.stdout
    bad = run("frobnicate")
    assert bad.returncode == 2


def test_readme_shared_file_block_under_mpi(mpirun):
    code = next(b for b in re.findall(r"```python\n(.*?)```", README, re.S) if "SharedFile(" in b)
    mpirun(3, code, timeout=240)


def test_chemio_demo_is_the_ri_mp2_main_job(tmp_path):
    import json
    r = subprocess.run([sys.executable, "-m", "chemio_py.cli", "demo"], capture_output=True,
                       text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["example"] == "ri_mp2" and result["abs_error"] < 1e-9
    assert result["passes"] > 1                     # out of core: B read in several passes
    assert "overlap" in r.stdout and "PySCF" in r.stdout
