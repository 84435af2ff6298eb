"""Settings checked at once (issue 21, item 12), and the ``chemio`` command in real use.

Every setting of every source is checked at the first lookup, at each ``configure()`` and
by ``chemio config --check``: one ``ConfigError`` names each bad one with its source.
Scratch directories must exist (or be one ``mkdir`` away), URLs are refused, backend names
are checked against the registry. The command runs in real subprocesses: ``--version``, a
reader that closes the pipe early, and ``chemio bench --help`` from an installed package
(the package files copied as ``pyproject.toml`` installs them, without the checkout).
"""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tomllib

import pytest

import chemio_py as cio
import chemio_py.backends as backends
from chemio_py.runtime import config
from chemio_py.runtime.config import ConfigError
from conftest import REPO

ROOT = REPO
URL_ADVICE = "chemio_py works on local/parallel file systems"


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No CHEMIO_* variable but the suite's scratch, no config file found by accident."""
    for spec in config.SPECS.values():
        if spec.name != "scratch":
            monkeypatch.delenv(spec.env, raising=False)
    monkeypatch.delenv("CHEMIO_CONFIG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return tmp_path


def _toml(tmp_path, text: str, monkeypatch) -> str:
    path = tmp_path / "chemio.toml"
    path.write_text(text)
    os.chmod(path, 0o600)
    monkeypatch.setenv("CHEMIO_CONFIG", str(path))
    return str(path)


@pytest.fixture
def registry_checks_backends():
    """Backend names checked against the registry, as the registry registers them."""
    before = config.set_choices("backend", backends.names)
    yield
    config.set_choices("backend", before)


# ---------------------------------------------------------------- all at once

def test_first_lookup_names_every_bad_setting_with_its_source(clean_env, monkeypatch):
    missing = clean_env / "scrath" / "x"
    monkeypatch.setenv("CHEMIO_IO_THREADS", "many")
    monkeypatch.setenv("CHEMIO_SCRATCH", str(missing))
    path = _toml(clean_env, 'shm_limit = "lots"\nscrach = "/tmp"\n[files."*.x"]\n'
                 'compressor = "lzma"\n', monkeypatch)
    with pytest.raises(ConfigError) as ei:
        config.get("keep")                             # any lookup: everything is checked
    msg = str(ei.value)
    assert msg.startswith("5 problems with the chemio settings"), msg
    assert "'io_threads' = 'many' (from environment variable CHEMIO_IO_THREADS)" in msg
    assert f"'shm_limit' = 'lots' (from config file {path})" in msg
    assert "unknown keys ['scrach'] (did you mean 'scratch'?)" in msg
    assert f'(from config file {path} [files."*.x"]) is invalid: unknown compressor' in msg
    assert (f"(from environment variable CHEMIO_SCRATCH): entry {str(missing)!r}: no such "
            f"directory ({str(clean_env / 'scrath')!r} does not exist); create it "
            f"(mkdir -p {missing}) or fix the path") in msg
    assert not (clean_env / "scrath").exists()
    found = config.survey()                            # the same, without raising
    assert len(found.problems) == 5 and found.invalid == {"io_threads", "scratch", "shm_limit"}
    assert found.settings["io_threads"].value == "many"


def test_configure_checks_every_source_and_changes_nothing(clean_env, monkeypatch):
    cio.configure(io_threads=3)
    monkeypatch.setenv("CHEMIO_SYNC", "maybe")
    with pytest.raises(ConfigError) as ei:
        cio.configure(io_threads=5, keep=2)
    msg = str(ei.value)          # the arguments are named together, before anything else
    assert "'keep' = 2 (from configure())" in msg and "2 problems" not in msg
    with pytest.raises(ConfigError, match="'sync' = 'maybe' .*CHEMIO_SYNC"):
        cio.configure(io_threads=5)
    monkeypatch.delenv("CHEMIO_SYNC")
    assert config.get_setting("io_threads") == config.Setting("io_threads", 3, "explicit")


def test_a_variable_changed_at_run_time_is_checked_before_use(clean_env, monkeypatch, tmp_path):
    assert config.get("io_threads") == 16
    typo = tmp_path / "scartch" / "run1"
    monkeypatch.setenv("CHEMIO_SCRATCH", str(typo))
    with pytest.raises(ConfigError, match="CHEMIO_SCRATCH.*no such directory"):
        cio.ExclusiveFile("x", "w+")
    assert not typo.parent.exists()                    # no tree made on a typo's word
    monkeypatch.setenv("CHEMIO_SCRATCH", str(tmp_path / "run1"))    # one level: made
    with cio.ExclusiveFile("x", "w+") as f:
        f.write(0, b"data")
        assert f.path.startswith(str(tmp_path / "run1") + os.sep)
        f.delete()
    assert stat.S_IMODE(os.stat(tmp_path / "run1").st_mode) == 0o700
    cio.cleanup()


def test_scratch_entries_are_named_one_by_one(clean_env, tmp_path):
    ok = tmp_path / "ok"
    ok.mkdir()
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(ConfigError) as ei:
        cio.configure(scratch=f"{ok}, n1:, :/x, s3://bucket/x, 3:gs://b")
    msg = str(ei.value)
    for said in ("entry 'n1:' names no directory after 'n1:'",
                 "entry ':/x' has no host or rank before ':'",
                 f"entry 's3://bucket/x' is a URL: {URL_ADVICE}",
                 "entry '3:gs://b': 'gs://b' is a URL"):
        assert said in msg, msg
    with pytest.raises(ConfigError) as ei:
        cio.configure(scratch=f"{ok},{afile},{afile}/sub,0:{tmp_path}/no/such")
    msg = str(ei.value)
    assert msg.startswith("3 problems"), msg
    assert f"entry {str(afile)!r}: not a directory" in msg
    assert f"entry '{afile}/sub': cannot be made: {str(afile)!r} is not a directory" in msg
    assert f"entry '0:{tmp_path}/no/such': no such directory" in msg
    # another host's directory is checked on that host; a pattern of this host is checked here
    cio.configure(scratch=f"{ok},not-this-host-*:/no/such/dir")
    import socket
    with pytest.raises(ConfigError, match="no such directory"):
        cio.configure(scratch=f"{ok},{socket.gethostname()}:/no/such/dir")
    cio.configure(scratch=None)


@pytest.mark.parametrize("name", ["scratch", "shared_scratch", "shm_dir", "trace"])
@pytest.mark.parametrize("url", ["s3://bucket/run", "gs://b/x", "https://h/x", "http://h/x",
                                 "abfs://c@acct/x", "file:///tmp/x"])
def test_urls_are_refused_with_what_to_do(name, url, clean_env, monkeypatch):
    with pytest.raises(ConfigError) as ei:
        cio.configure(**{name: url})
    msg = str(ei.value)
    assert URL_ADVICE in msg and "zarr backend with a mounted path" in msg, msg
    if url.startswith("file://"):
        assert "give the path itself, '/tmp/x'" in msg, msg
    monkeypatch.setenv(config.SPECS[name].env, url)   # changed at run time: checked at use
    with pytest.raises(ConfigError, match=config.SPECS[name].env):
        config.get(name)


def test_config_file_named_by_url(clean_env, monkeypatch):
    monkeypatch.setenv("CHEMIO_CONFIG", "s3://bucket/chemio.toml")
    with pytest.raises(ConfigError, match="is a URL: chemio reads its settings from a local"):
        cio.settings()


def test_directories_of_shared_scratch_and_shm(clean_env, tmp_path, monkeypatch):
    monkeypatch.setenv("CHEMIO_SHARED_SCRATCH", str(tmp_path / "a" / "b"))
    monkeypatch.setenv("CHEMIO_SHM_DIR", str(tmp_path / "ram" / "x"))
    found = config.survey()
    assert [p.split(" (from ")[0] for p in found.problems] == [
        f"setting 'shared_scratch' = {str(tmp_path / 'a' / 'b')!r}",
        f"setting 'shm_dir' = {str(tmp_path / 'ram' / 'x')!r}"]
    (tmp_path / "a").mkdir()
    (tmp_path / "ram").mkdir()
    assert config.survey().problems == []              # the last level is made at first use


def test_default_scratch_is_tmpdir_and_needs_nothing(tmp_path):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHEMIO_")}
    env.update(TMPDIR=str(tmpdir), XDG_CONFIG_HOME=str(tmp_path / "xdg"), CHEMIO_SHM_DIR="")
    code = ("import chemio_py as cio\n"
            "s = cio.settings()['scratch']; print(s.value, s.source)\n"
            "with cio.ExclusiveFile('t', 'w+') as f:\n"
            "    f.write(0, b'x'); print(f.path); f.delete()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    first, path = r.stdout.splitlines()
    assert first == f"{tmpdir} default" and path.startswith(str(tmpdir) + os.sep)
    assert os.listdir(tmpdir) == []                    # cleaned at exit


def test_a_bad_environment_never_breaks_the_import(tmp_path):
    env = dict(os.environ, CHEMIO_IO_THREADS="many", CHEMIO_SCRATCH="/scrath/x",
               XDG_CONFIG_HOME=str(tmp_path))
    code = ("import chemio_py as cio\n"
            "try:\n    cio.settings()\nexcept cio.errors.ConfigError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.startswith("2 problems") and "/scrath" in r.stdout, r.stdout


def test_backend_names_are_checked_against_the_registry(clean_env, monkeypatch,
                                                        registry_checks_backends):
    with pytest.raises(ConfigError, match=r"'shmm' .* no backend of that name is known here "
                                          r"\(did you mean 'shm'\?\)"):
        cio.configure(backend="shmm")
    path = _toml(clean_env, 'backend = "local"\n[files."*.aoints"]\nbackend = "nvme"\n',
                 monkeypatch)
    with pytest.raises(ConfigError) as ei:
        config.backend_for("eri.aoints")
    assert f'(from config file {path} [files."*.aoints"]) is invalid' in str(ei.value)
    backends.register("nvme", lambda: backends.resolve("local"))
    try:
        assert config.backend_for("eri.aoints").value == "nvme"    # known once registered
    finally:
        backends.unregister("nvme")
        config.reset()


# ---------------------------------------------------------------- the command

def _chemio(*args, env=None, cwd=None, **kw):
    return subprocess.run([sys.executable, "-m", "chemio_py.cli", *args], capture_output=True,
                          text=True, timeout=120, env=env, cwd=cwd, **kw)


@pytest.fixture
def cli_env(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("CHEMIO_") and k != "PYTHONUNBUFFERED"}
    env.update(CHEMIO_SCRATCH=os.environ["CHEMIO_SCRATCH"],
               XDG_CONFIG_HOME=str(tmp_path / "xdg"))
    return env


def test_config_check_exit_status_and_every_problem(tmp_path, cli_env):
    r = _chemio("config", "--check", env=cli_env, cwd=tmp_path)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.startswith("chemio config: all ") and "settings valid" in r.stdout
    toml = tmp_path / "chemio.toml"
    toml.write_text('io_threads = 0\n[files."*.t2"]\nbackend = "zar"\n')
    os.chmod(toml, 0o600)
    bad = dict(cli_env, CHEMIO_SCRATCH=str(tmp_path / "scrath" / "x"), CHEMIO_SYNC="maybe")
    r = _chemio("config", "--check", env=bad, cwd=tmp_path)
    assert r.returncode == 1 and r.stdout == "", r.stdout
    lines = r.stderr.splitlines()
    assert lines[0].startswith("chemio config: 4 problems"), r.stderr
    text = r.stderr
    assert f"'io_threads' = 0 (from config file {toml})" in text
    assert "'zar'" in text and "did you mean 'zarr'" in text and '[files."*.t2"]' in text
    assert "CHEMIO_SYNC" in text and "CHEMIO_SCRATCH" in text and "mkdir -p" in text
    assert "Traceback" not in text
    r = _chemio("config", "eri.t2", env=bad, cwd=tmp_path)    # still shows what it can
    assert r.returncode == 1
    assert "INVALID" in r.stdout and "io_threads" in r.stdout and "(env:CHEMIO_SYNC)" in r.stdout
    toml.write_text("[oops\n")
    r = _chemio("config", "--check", env=cli_env, cwd=tmp_path)
    assert r.returncode == 1 and "is not valid TOML" in r.stderr


def test_version(cli_env):
    r = _chemio("--version", env=cli_env)
    assert (r.returncode, r.stdout, r.stderr) == (0, f"chemio_py {cio.__version__}\n", "")
    script = os.path.join(os.path.dirname(sys.executable), "chemio")
    if os.path.exists(script):                         # the installed entry point too
        r = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60)
        assert r.stdout == f"chemio_py {cio.__version__}\n"


COMMANDS = [["info"], ["config"], ["config", "--check"], ["config", "x.aoints"], ["--version"],
            ["--help"], ["info", "--help"], ["clean", "--dry-run", "--root", "{tmp}"],
            ["ls", "--root", "{tmp}"], ["check", "--help"], ["trace", "--help"],
            ["demo", "--eaf", "--records", "2"], ["bench", "--help"],
            ["bench", "--list", "--dir", "{bench}"]]
BENCH_DIR = os.path.join(REPO,
                         "benchmarks")      # named: an installed package does not ship it


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_reader_gone_before_any_output_is_quiet(argv, tmp_path, cli_env):
    """``chemio ... | head -0``: the reader closed the pipe before the first byte."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        argv = [a.replace("{tmp}", str(tmp_path)).replace("{bench}", BENCH_DIR) for a in argv]
        r = subprocess.run([sys.executable, "-m", "chemio_py.cli", *argv], stdout=write_end,
                           stderr=subprocess.PIPE, text=True, timeout=120, env=cli_env,
                           cwd=tmp_path)
    finally:
        os.close(write_end)
    assert (r.returncode, r.stderr) == (141, ""), r.stderr


def test_reader_gone_after_the_first_line_is_quiet(tmp_path, cli_env):
    """``chemio config NAME... | head -1`` with more output than a pipe holds."""
    names = [f"integrals-{i:05d}.aoints" for i in range(4000)]        # > 64 KiB of output
    p = subprocess.Popen([sys.executable, "-m", "chemio_py.cli", "config", *names],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env,
                         cwd=tmp_path)
    first = p.stdout.readline()
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=120) == 141, err
    assert first.startswith(b"config file:") and err == b"", err


def test_errors_still_go_to_stderr_with_status_1(tmp_path, cli_env):
    r = _chemio("info", env=dict(cli_env, CHEMIO_IO_THREADS="0"), cwd=tmp_path)
    assert r.returncode == 1 and "chemio info: ConfigError:" in r.stderr, r.stderr


# ---------------------------------------------------------------- an installed package

@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The package as pip installs it (``[tool.setuptools] packages`` and ``package-dir``
    of pyproject.toml, Python files and package data), in a site directory of its own."""
    site = tmp_path_factory.mktemp("site")
    meta = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["tool"]["setuptools"]
    dirs = meta["package-dir"]
    for package in meta["packages"]:
        parent = max((p for p in dirs if package == p or package.startswith(p + ".")), key=len)
        src = os.path.join(ROOT, dirs[parent], *package[len(parent):].split(".")[1:])
        dst = site.joinpath(*package.split("."))
        dst.mkdir(parents=True, exist_ok=True)
        data = meta.get("package-data", {}).get(package, [])
        for name in os.listdir(src):
            if name.endswith(".py") or name in data:
                shutil.copy2(os.path.join(src, name), dst / name)
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHEMIO_")}
    env.update(PYTHONPATH=str(site), CHEMIO_SCRATCH=os.environ["CHEMIO_SCRATCH"],
               XDG_CONFIG_HOME=str(elsewhere))
    where = subprocess.run([sys.executable, "-c", "import chemio_py; print(chemio_py.__file__)"],
                           capture_output=True, text=True, env=env, cwd=elsewhere, timeout=60)
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr
    return env, elsewhere


def test_bench_help_from_an_installed_package(installed):
    env, cwd = installed
    r = _chemio("bench", "--help", env=env, cwd=cwd)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.startswith("usage: chemio bench [--dir DIR]"), r.stdout
    assert "benchmarks/ folder of the chemio_py source checkout" in r.stdout
    r = _chemio("bench", "--only", "eaf", env=env, cwd=cwd)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("chemio bench: the benchmark suite is not part of the installed "
                               "package"), r.stderr
    r = _chemio("bench", "--dir", str(cwd), "--list", env=env, cwd=cwd)
    assert r.returncode == 2 and "holds no runner.py" in r.stderr


def test_bench_help_in_the_checkout_is_the_runners(cli_env, tmp_path):
    r = _chemio("bench", "--help", env=cli_env, cwd=tmp_path)
    assert r.returncode == 0 and "--quick" in r.stdout and "--only" in r.stdout, r.stderr
