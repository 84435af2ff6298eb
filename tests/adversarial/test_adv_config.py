"""Settings from untrusted places, non-finite settings values, and the trace output path.

Issue 11, item 15 and "non-finite settings values". Everything here uses real files: the
"other user" is uid 65534 set with ``os.chown`` (the suite runs as root, which bypasses
permissions, so the checks under test are on ``st_uid``/``st_mode``, not on ``access()``),
"writable by others" is a real ``chmod``, and FIFOs, devices and links are real. The exit-time
trace writer is exercised in real subprocesses with a timeout.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest

import chemio_py as cio
from chemio_py.runtime import config, trace
from chemio_py.runtime.config import ConfigError
from chemio_py.errors import ArgumentError

OTHER = 65534                                  # "nobody": a uid that is not ours and not root
VICTIM_TEXT = b"precious data of somebody else\n"
TIMEOUT = 60


@pytest.fixture
def no_config(monkeypatch, tmp_path):
    """No config file from the environment, the home directory or the test's cwd."""
    monkeypatch.delenv("CHEMIO_CONFIG", raising=False)
    xdg = tmp_path / "xdg"
    xdg.mkdir()
    monkeypatch.setenv("XDG_CONFIG_HOME", str(xdg))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    for var in [s.env for s in config.SPECS.values() if s.name != "scratch"]:
        monkeypatch.delenv(var, raising=False)
    return {"xdg": xdg, "cwd": cwd}


def _place(where: str, env: dict, monkeypatch) -> str:
    """Where a config file found via ``where`` lives (and make chemio look there)."""
    if where == "cwd":
        return str(env["cwd"] / "chemio.toml")
    if where == "xdg":
        d = env["xdg"] / "chemio"
        d.mkdir(exist_ok=True)
        return str(d / "config.toml")
    p = str(env["cwd"].parent / "explicit.toml")
    monkeypatch.setenv("CHEMIO_CONFIG", p)
    return p


def _digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _run(code: str, *, cwd, env: dict | None = None, timeout: float = TIMEOUT):
    full = dict(os.environ)
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=str(cwd), env=full,
                          capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------- who may configure us

@pytest.mark.parametrize("where", ["cwd", "env", "xdg"])
def test_config_file_of_another_user_is_refused(where, no_config, monkeypatch):
    path = _place(where, no_config, monkeypatch)
    with open(path, "w") as fh:
        fh.write("io_threads = 3\nkeep = true\n")
    os.chmod(path, 0o644)
    os.chown(path, OTHER, OTHER)
    with pytest.raises(ConfigError) as ei:
        cio.settings()
    msg = str(ei.value)
    assert path in msg and f"uid {OTHER}" in msg and "CHEMIO_CONFIG" in msg, msg
    with pytest.raises(ConfigError):             # every lookup that consults the file
        config.get("keep")
    # the user's own file, same content, is honoured
    os.chown(path, os.geteuid(), os.getegid())
    assert config.get_setting("io_threads").value == 3
    assert config.get_setting("io_threads").source == f"file:{path}"


@pytest.mark.parametrize("where", ["cwd", "env", "xdg"])
@pytest.mark.parametrize("mode,who", [(0o666, "group and others"), (0o664, "group"),
                                      (0o646, "others"), (0o622, "group and others")])
def test_config_file_writable_by_others_is_refused(where, mode, who, no_config, monkeypatch):
    path = _place(where, no_config, monkeypatch)
    with open(path, "w") as fh:
        fh.write("io_threads = 3\n")
    os.chmod(path, mode)
    with pytest.raises(ConfigError) as ei:
        config.get("io_threads")
    msg = str(ei.value)
    assert path in msg and f"writable by {who}" in msg and oct(mode) in msg, msg
    assert "chmod go-w" in msg
    os.chmod(path, mode & ~0o022)
    assert config.get("io_threads") == 3


def test_cached_config_is_rechecked_after_chmod_or_chown(no_config, monkeypatch):
    path = _place("cwd", no_config, monkeypatch)
    with open(path, "w") as fh:
        fh.write("io_threads = 3\n")
    os.chmod(path, 0o600)
    assert config.get("io_threads") == 3          # now cached
    os.chmod(path, 0o666)
    with pytest.raises(ConfigError, match="writable by"):
        config.get("io_threads")
    os.chmod(path, 0o600)
    os.chown(path, OTHER, OTHER)
    with pytest.raises(ConfigError, match="owned by"):
        config.get("io_threads")


def test_symlinked_cwd_config_is_refused(no_config, monkeypatch, tmp_path):
    own = tmp_path / "mine.toml"
    own.write_text("io_threads = 3\n")
    os.chmod(own, 0o600)
    os.symlink(own, no_config["cwd"] / "chemio.toml")
    with pytest.raises(ConfigError) as ei:
        config.get("io_threads")
    msg = str(ei.value)
    assert "symbolic link" in msg and "CHEMIO_CONFIG" in msg and str(own) in msg, msg
    # the documented way out: name the file explicitly
    monkeypatch.setenv("CHEMIO_CONFIG", str(own))
    assert config.get("io_threads") == 3


def test_symlinked_explicit_config(no_config, monkeypatch, tmp_path):
    """CHEMIO_CONFIG / the user config dir may be a link of the user's (dotfiles): the link
    must be the user's (or root's) and the file it reaches passes the same checks."""
    own = tmp_path / "dotfiles.toml"
    own.write_text("io_threads = 5\n")
    os.chmod(own, 0o600)
    link = tmp_path / "link.toml"
    os.symlink(own, link)
    monkeypatch.setenv("CHEMIO_CONFIG", str(link))
    assert config.get("io_threads") == 5
    os.chown(own, OTHER, OTHER)                        # the target is somebody else's
    with pytest.raises(ConfigError, match=f"uid {OTHER}"):
        config.get("io_threads")
    os.chown(own, os.geteuid(), os.getegid())
    os.lchown(link, OTHER, OTHER)                      # the link is somebody else's
    with pytest.raises(ConfigError, match="symbolic link"):
        config.get("io_threads")
    os.unlink(link)
    os.symlink(tmp_path / "missing.toml", link)        # a dangling link
    with pytest.raises(ConfigError, match="does not exist"):
        config.get("io_threads")


@pytest.mark.parametrize("kind", ["fifo", "dir", "devzero", "devnull_link"])
@pytest.mark.parametrize("where", ["cwd", "env"])
def test_config_that_is_not_a_regular_file(kind, where, tmp_path):
    """A FIFO, a directory or a device as the config file: a clear error, never a hang."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    target = str(cwd / "chemio.toml") if where == "cwd" else str(tmp_path / "cfg.toml")
    if kind == "fifo":
        os.mkfifo(target, 0o600)
    elif kind == "dir":
        os.mkdir(target, 0o700)
    elif kind == "devzero" and where == "env":
        target = "/dev/zero"
    elif kind == "devzero":
        os.symlink("/dev/zero", target)
    else:
        os.symlink(os.devnull, target)
    env = {"XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    if where == "env":
        env["CHEMIO_CONFIG"] = target
    p = _run("""
        import chemio_py as cio
        from chemio_py.runtime.config import ConfigError
        try:
            cio.settings()
        except ConfigError as e:
            print("REFUSED", e)
        else:
            print("ACCEPTED")
        """, cwd=cwd, env={**env, "CHEMIO_CONFIG": env.get("CHEMIO_CONFIG", "")})
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("REFUSED"), p.stdout + p.stderr
    assert "config file" in p.stdout


def test_oversized_and_undecodable_config(no_config, monkeypatch):
    path = _place("env", no_config, monkeypatch)
    with open(path, "w") as fh:
        fh.write("io_threads = 3\n")
        fh.write("# " + "x" * (2 << 20) + "\n")
    os.chmod(path, 0o600)
    with pytest.raises(ConfigError) as ei:
        config.get("io_threads")
    assert path in str(ei.value) and "MiB" in str(ei.value), str(ei.value)
    with open(path, "wb") as fh:
        fh.write(b"backend = \"\xff\xfe\"\n")
    with pytest.raises(ConfigError, match="UTF-8"):
        config.get("backend")


def test_dev_null_means_no_config_file(no_config, monkeypatch):
    """The way out when a foreign chemio.toml sits in a directory you cannot clean."""
    path = _place("cwd", no_config, monkeypatch)
    with open(path, "w") as fh:
        fh.write("io_threads = 3\n")
    os.chown(path, OTHER, OTHER)
    monkeypatch.setenv("CHEMIO_CONFIG", os.devnull)
    assert config.config_path() is None
    assert config.get_setting("io_threads").source == "default"
    assert config.file_rules() == []


def test_foreign_cwd_config_cannot_redirect_trace_or_keep_scratch(tmp_path):
    """Issue 11 item 15: a foreign chemio.toml with ``trace=`` aimed at a victim file and
    ``keep=true``. The victim stays untouched, the scratch goes, the user sees the error."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(VICTIM_TEXT)
    before = _digest(victim)
    toml = shared / "chemio.toml"
    toml.write_text(f'trace = "{victim}"\nkeep = true\n')
    os.chmod(toml, 0o644)
    os.chown(toml, OTHER, OTHER)
    scratch_root = tmp_path / "scratch"
    scratch_root.mkdir()
    env = {"CHEMIO_SCRATCH": str(scratch_root), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    # 1. the first file operation needs a setting from the file: the user sees the error
    p = _run("""
        import numpy as np, chemio_py as cio
        from chemio_py.runtime.config import ConfigError
        try:
            f = cio.ExclusiveFile("work", "w+")
            f.write(0, np.arange(1000.0))
        except ConfigError as e:
            print("REFUSED", e)
        """, cwd=shared, env=env)
    # 2. every setting a file operation needs is given elsewhere: settings are checked all
    #    at once (issue 21), so the refused file still stops the first lookup, and the
    #    file's keep=true and trace= do nothing
    q = _run("""
        import numpy as np, chemio_py as cio
        from chemio_py.runtime.config import ConfigError
        try:
            with cio.ExclusiveFile("work", "w+", backend="local") as f:
                f.write(0, np.arange(1000.0))
        except ConfigError as e:
            print("REFUSED", e)
        """, cwd=shared, env={**env, "CHEMIO_DIRECT": "0", "CHEMIO_IO_THREADS": "2",
                                  "CHEMIO_SYNC": "0"})
    for r in (p, q):
        assert r.returncode == 0, r.stderr
        assert "REFUSED" in r.stdout and str(toml) in r.stdout, r.stdout
        assert f"uid {OTHER}" in r.stdout, r.stdout
        assert "Traceback" not in r.stderr, r.stderr
    assert _digest(victim) == before
    left = [os.path.join(d, n) for d, ds, fs in os.walk(scratch_root) for n in ds + fs]
    assert left == [], f"scratch kept on the word of a foreign config file: {left}"
    assert sorted(os.listdir(shared)) == ["chemio.toml"]


def test_foreign_config_error_on_first_lookup(tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    toml = cwd / "chemio.toml"
    toml.write_text("io_threads = 2\n")
    os.chmod(toml, 0o666)
    p = _run("""
        import chemio_py as cio
        try:
            cio.configure(sync=True)        # explicit settings never need the file
            print(cio.settings()["io_threads"])
        except cio.ChemIOError as e:
            print("REFUSED", type(e).__name__, e)
        """, cwd=cwd, env={"XDG_CONFIG_HOME": str(tmp_path / "xdg"), "CHEMIO_CONFIG": ""})
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("REFUSED ConfigError") and "chmod go-w" in p.stdout, p.stdout


# ---------------------------------------------------------------- values

BIG = 10 ** 5000          # str(BIG) raises ValueError in Python 3.11: the message must cope

IO_THREADS_BAD_TEXT = ["nan", "NaN", "inf", "-inf", "Infinity", "1e400", "1e3", "-1", "0",
                       "1025", "99999999999999999999999999999", "9" * 5000, "1.5", "8.0",
                       "true", "0x10", "1_0", "٣"]
IO_THREADS_BAD_OBJ = [float("nan"), float("inf"), float("-inf"), 1e400, -1, 0, 1025, 10 ** 30,
                      BIG, True, False, 1.5, 8.0, "nan", [4], "1e3", b"8"]
LIMIT_BAD_TEXT = ["nan", "inf", "-inf", "+inf", "Infinity", "1e400", "1e999G", "1e19T",
                  "9" * 400, "9" * 5000, "nan%", "inf%", "-inf%", "1e400%", "0%", "-5%",
                  "150%", "-5", "-0.5G", "lots", "", "G", "%", "1_000", "0x10", "5P", "true"]
LIMIT_BAD_OBJ = [float("nan"), float("inf"), -1, 2 ** 63, 10 ** 30, BIG, True, False,
                 [1], -0.5, 1e400]


def _id(v) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 200:
        return f"int_{v.bit_length()}_bits"
    r = repr(v)
    return r if len(r) <= 24 else r[:20] + f"...{len(r)}"


def _check_message(msg: str, name: str, where: str, accepted: str):
    assert repr(name) in msg, msg
    assert where in msg, msg
    assert accepted in msg, msg
    assert len(msg) < 800, msg


@pytest.mark.parametrize("text", IO_THREADS_BAD_TEXT, ids=_id)
def test_io_threads_bad_in_env(text, no_config, monkeypatch):
    monkeypatch.setenv("CHEMIO_IO_THREADS", text)
    with pytest.raises(ConfigError) as ei:
        config.get("io_threads")
    _check_message(str(ei.value), "io_threads", "CHEMIO_IO_THREADS", "1024")
    assert text[:20] in str(ei.value)


@pytest.mark.parametrize("literal", ["nan", "inf", "-inf", "+inf", "1e400", "-1", "0", "1025",
                                     "99999999999999999999999999999", "1.5", "8.0", "true",
                                     '"nan"', '"1e3"', "[4]", "{a = 1}", "1979-05-27"])
def test_io_threads_bad_in_toml(literal, no_config, monkeypatch):
    path = _place("env", no_config, monkeypatch)
    with open(path, "w") as fh:
        fh.write(f"io_threads = {literal}\n")
    os.chmod(path, 0o600)
    with pytest.raises(ConfigError) as ei:
        config.get("io_threads")
    _check_message(str(ei.value), "io_threads", path, "1024")


@pytest.mark.parametrize("value", IO_THREADS_BAD_OBJ, ids=_id)
def test_io_threads_bad_in_configure(value, no_config):
    cio.configure(io_threads=4)
    with pytest.raises(ConfigError) as ei:
        cio.configure(io_threads=value)
    _check_message(str(ei.value), "io_threads", "configure()", "1024")
    assert config.get_setting("io_threads").value == 4         # bad input changes nothing


def test_io_threads_good_values(no_config, monkeypatch):
    for text, want in (("1", 1), (" 8 ", 8), ("1024", 1024), ("+16", 16)):
        monkeypatch.setenv("CHEMIO_IO_THREADS", text)
        assert config.get("io_threads") == want
    monkeypatch.delenv("CHEMIO_IO_THREADS")
    cio.configure(io_threads=1024)
    assert config.get("io_threads") == 1024
    import numpy as np
    cio.configure(io_threads=np.int32(4), shm_limit=np.int64(1 << 30))
    assert config.get("io_threads") == 4 and config.get("shm_limit") == str(1 << 30)
    assert "1024" in config.SPECS["io_threads"].doc


@pytest.mark.parametrize("text", LIMIT_BAD_TEXT, ids=_id)
def test_shm_limit_bad_in_env(text, no_config, monkeypatch):
    if text == "":
        pytest.skip("an empty variable means unset")
    monkeypatch.setenv("CHEMIO_SHM_LIMIT", text)
    with pytest.raises(ConfigError) as ei:
        config.get("shm_limit")
    _check_message(str(ei.value), "shm_limit", "CHEMIO_SHM_LIMIT", "50%")


@pytest.mark.parametrize("literal", ["nan", "inf", "-inf", "1e400", "-1", "1e30",
                                     "99999999999999999999999999999", "true", '"nan%"',
                                     '"1e999G"', '"inf"', '"150%"', "[1]", '""'])
def test_shm_limit_bad_in_toml(literal, no_config, monkeypatch):
    path = _place("env", no_config, monkeypatch)
    with open(path, "w") as fh:
        fh.write(f"shm_limit = {literal}\n")
    os.chmod(path, 0o600)
    with pytest.raises(ConfigError) as ei:
        config.get("shm_limit")
    _check_message(str(ei.value), "shm_limit", path, "50%")


@pytest.mark.parametrize("value", LIMIT_BAD_OBJ + LIMIT_BAD_TEXT, ids=_id)
def test_shm_limit_bad_in_configure(value, no_config):
    cio.configure(shm_limit="1G")
    with pytest.raises(ConfigError) as ei:
        cio.configure(shm_limit=value, io_threads=3)
    _check_message(str(ei.value), "shm_limit", "configure()", "50%")
    assert config.get("shm_limit") == "1G" and config.get_setting("io_threads").source == "default"


@pytest.mark.parametrize("text", LIMIT_BAD_TEXT, ids=_id)
def test_parse_limit_refuses_non_finite_and_huge(text):
    with pytest.raises(ValueError) as ei:          # never OverflowError, never a silent value
        config.parse_limit(text, 1 << 40)
    assert type(ei.value) is not OverflowError
    assert "size" in str(ei.value) or "percentage" in str(ei.value), str(ei.value)


def test_parse_limit_good_values():
    assert config.parse_limit("512M", 0) == 512 << 20
    assert config.parse_limit("4GiB", 0) == 4 << 30
    assert config.parse_limit("4 GB", 0) == 4 << 30
    assert config.parse_limit("1.5G", 0) == 3 << 29
    assert config.parse_limit("1e3", 0) == 1000
    assert config.parse_limit("0", 0) == 0
    assert config.parse_limit("50%", 1000) == 500
    assert config.parse_limit("12.5%", 1000) == 125
    assert config.parse_limit("100%", 1000) == 1000
    assert config.parse_limit(str(2 ** 63 - 1), 0) == 2 ** 63 - 1
    cio.configure(shm_limit=2 ** 30)
    assert config.parse_limit(config.get("shm_limit"), 0) == 2 ** 30


@pytest.mark.parametrize("name", ["keep", "sync", "direct"])
@pytest.mark.parametrize("value", ["nan", "inf", "2", "-1", "maybe", 2, 1.0, float("nan"), BIG,
                                   [True]], ids=_id)
def test_bool_settings_bad(name, value, no_config):
    with pytest.raises(ConfigError) as ei:
        cio.configure(**{name: value})
    _check_message(str(ei.value), name, "configure()", "true")


@pytest.mark.parametrize("name,value", [("backend", 5), ("backend", True), ("backend", ""),
                                        ("scratch", 5), ("scratch", ["/tmp"]),
                                        ("shm_dir", 1.5), ("trace", True), ("trace", 3),
                                        ("trace", "io\0.json"), ("shared_scratch", b"/tmp"),
                                        ("scratch", "/tmp/a\0b")], ids=_id)
def test_string_settings_bad(name, value, no_config):
    with pytest.raises(ConfigError) as ei:
        cio.configure(**{name: value})
    assert repr(name) in str(ei.value) and "configure()" in str(ei.value), str(ei.value)


def test_string_settings_from_toml_bad(no_config, monkeypatch):
    path = _place("env", no_config, monkeypatch)
    for line in ("trace = true", "shared_scratch = 5", "backend = 1.5", "shm_dir = [1]"):
        with open(path, "w") as fh:
            fh.write(line + "\n")
        os.chmod(path, 0o600)
        key = line.split()[0]
        with pytest.raises(ConfigError) as ei:
            config.get(key)
        assert repr(key) in str(ei.value) and path in str(ei.value), str(ei.value)


def test_file_rule_backend_must_be_a_string(no_config, monkeypatch):
    path = _place("env", no_config, monkeypatch)
    with open(path, "w") as fh:
        fh.write('[files."*.x"]\nbackend = 3\n')
    os.chmod(path, 0o600)
    with pytest.raises(ConfigError, match="backend"):
        config.backend_for("a.x")


# ---------------------------------------------------------------- the trace output path

def _events():
    with cio.ExclusiveFile("traced", "w+") as f:
        f.write(0, b"x" * 100)
        f.read(0, bytearray(100))
        f.delete()


@pytest.fixture
def victim(tmp_path):
    v = tmp_path / "victim.txt"
    v.write_bytes(VICTIM_TEXT)
    os.chmod(v, 0o644)
    return v


def _hostile(kind: str, target, victim) -> None:
    if kind == "symlink":
        os.symlink(victim, target)
    elif kind == "foreign":
        with open(target, "wb") as fh:
            fh.write(VICTIM_TEXT)
        os.chown(target, OTHER, OTHER)
    elif kind == "fifo":
        os.mkfifo(target, 0o600)
    elif kind == "dir":
        os.mkdir(target)
    elif kind == "dangling":
        os.symlink(str(victim) + ".new", target)


def _unchanged(kind, target, victim) -> None:
    assert victim.read_bytes() == VICTIM_TEXT
    if kind in ("symlink", "dangling"):
        assert os.path.islink(target)
        assert not os.path.exists(str(victim) + ".new")
    elif kind == "foreign":
        st = os.lstat(target)
        assert st.st_uid == OTHER and open(target, "rb").read() == VICTIM_TEXT
    elif kind == "fifo":
        assert stat.S_ISFIFO(os.lstat(target).st_mode)
    elif kind == "dir":
        assert os.path.isdir(target) and not os.path.islink(target)


def _no_temp_left(directory) -> None:
    left = [n for n in os.listdir(directory) if "tmp" in n]
    assert left == [], left


@pytest.mark.parametrize("kind", ["symlink", "foreign", "fifo", "dir", "dangling"])
def test_trace_setting_refuses_hostile_target(kind, tmp_path, victim):
    target = tmp_path / "io.json"
    _hostile(kind, target, victim)
    cio.configure(trace=str(target))
    try:
        _events()
        with pytest.raises(ConfigError) as ei:
            trace.write_trace()
        msg = str(ei.value)
        assert str(target) in msg and "trace" in msg, msg
        _unchanged(kind, target, victim)
        _no_temp_left(tmp_path)
        with pytest.raises(ArgumentError):               # an explicit path: same rule
            trace.write_trace(str(target))
        _unchanged(kind, target, victim)
    finally:
        cio.configure(trace=None)


def test_trace_temp_name_cannot_be_planted(tmp_path, victim):
    """The temporary file is created O_EXCL|O_NOFOLLOW under an unguessable name: a link
    planted where a predictable temp name would be does not redirect the write."""
    target = tmp_path / "io.json"
    for name in (f"io.json.tmp{os.getpid()}", f".io.json.tmp{os.getpid()}"):
        os.symlink(victim, tmp_path / name)
    cio.configure(trace=str(target))
    try:
        _events()
        assert trace.write_trace() == str(target)
    finally:
        cio.configure(trace=None)
    assert victim.read_bytes() == VICTIM_TEXT
    assert json.loads(target.read_text())["traceEvents"]
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600


def test_trace_replaces_own_previous_trace(tmp_path):
    target = tmp_path / "io.json"
    target.write_text("old trace")
    os.chmod(target, 0o644)
    cio.configure(trace=str(target))
    try:
        _events()
        assert trace.write_trace() == str(target)
    finally:
        cio.configure(trace=None)
    data = json.loads(target.read_text())
    assert {e["name"] for e in data["traceEvents"]} >= {"read", "write"}
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    assert sorted(os.listdir(tmp_path)) == ["io.json"]


def test_trace_into_missing_directory_is_an_error(tmp_path):
    target = tmp_path / "no" / "such" / "io.json"
    cio.configure(trace=str(target))
    try:
        _events()
        with pytest.raises(OSError):
            trace.write_trace()
    finally:
        cio.configure(trace=None)
    assert not (tmp_path / "no").exists()


EXIT_SCRIPT = """
    import chemio_py as cio
    with cio.ExclusiveFile("traced", "w+") as f:
        f.write(0, b"x" * 100); f.awrite(100, b"y" * 100).wait(); f.read(0, bytearray(200))
        f.delete()
    print("DONE", flush=True)
    """


@pytest.mark.parametrize("kind", ["symlink", "foreign", "fifo", "dir", "dangling", "missing_dir"])
def test_trace_at_exit_warns_once_and_writes_nothing(kind, tmp_path, victim):
    target = tmp_path / "io.json"
    if kind == "missing_dir":
        target = tmp_path / "nowhere" / "io.json"
    else:
        _hostile(kind, target, victim)
    p = _run(EXIT_SCRIPT, cwd=tmp_path, env={"CHEMIO_TRACE": str(target)})
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "DONE"
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("chemio: warning:") and str(target) in lines[0], lines
    assert "Traceback" not in p.stderr
    if kind != "missing_dir":
        _unchanged(kind, target, victim)
    assert victim.read_bytes() == VICTIM_TEXT
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["victim.txt"] + ([] if kind == "missing_dir" else ["io.json"]))


def test_trace_at_exit_good_path_writes(tmp_path):
    target = tmp_path / "io.json"
    p = _run(EXIT_SCRIPT, cwd=tmp_path, env={"CHEMIO_TRACE": str(target)})
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert {e["name"] for e in json.loads(target.read_text())["traceEvents"]} >= {"read", "write"}
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600


def test_forked_child_does_not_write_parent_trace(tmp_path):
    """A child forked after I/O exits normally: the trace file is the parent's to write."""
    target = tmp_path / "io.json"
    p = _run("""
        import os, sys, chemio_py as cio
        with cio.ExclusiveFile("traced", "w+") as f:
            f.write(0, b"x" * 100); f.delete()
        pid = os.fork()
        if pid == 0:
            sys.exit(0)                          # normal exit: atexit handlers run
        os.waitpid(pid, 0)
        print("AFTER CHILD", os.path.exists(%r))
        """ % str(target), cwd=tmp_path, env={"CHEMIO_TRACE": str(target)})
    assert p.returncode == 0, p.stderr
    assert "AFTER CHILD False" in p.stdout, p.stdout
    assert json.loads(target.read_text())["traceEvents"]


@pytest.mark.mpi
def test_mpi_per_rank_trace_names_and_refusal(mpirun, tmp_path, victim):
    os.symlink(victim, tmp_path / "io.rank1.json")
    p = mpirun(2, """
        import chemio_py as cio
        with cio.ExclusiveFile("traced", "w+") as f:
            f.write(0, b"x" * 100); f.delete()
        cio.comm().barrier()     # no rank's exit cleanup may race another's job-dir set-up
        print("DONE", cio.comm().rank, flush=True)
    """, env={"CHEMIO_TRACE": str(tmp_path / "io.json")})
    assert p.stdout.count("DONE") == 2
    assert json.loads((tmp_path / "io.rank0.json").read_text())["traceEvents"]
    assert os.path.islink(tmp_path / "io.rank1.json")
    assert victim.read_bytes() == VICTIM_TEXT
    warn = [ln for ln in p.stderr.splitlines() if ln.startswith("chemio: warning:")]
    assert len(warn) == 1 and "io.rank1.json" in warn[0], p.stderr
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "io.json").exists()
