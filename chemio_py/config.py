"""Settings: explicit (``configure``) > environment (``CHEMIO_*``) > TOML file > defaults.

Every effective value carries its source, so ``chemio config`` can say why a value is what
it is. Values are resolved on each lookup: a change of ``CHEMIO_SCRATCH`` at run time is
seen by the next file that is created.

The TOML file (``CHEMIO_CONFIG``, else ``./chemio.toml``, else
``$XDG_CONFIG_HOME/chemio/config.toml``) holds settings as top-level keys and per-name
rules in the "files in memory" style::

    backend = "local"
    io_threads = 8
    [files."*.aoints"]
    backend = "shm"

A per-name rule is more specific than the global ``backend`` setting and wins over it; an
explicit ``backend=`` argument wins over both.
"""
from __future__ import annotations

import fnmatch
import os
import tempfile
import threading
import tomllib
from dataclasses import dataclass
from typing import Any, Callable

from .errors import ChemIOError


class ConfigError(ChemIOError, ValueError):
    """A setting has a value that cannot be used."""


def _parse_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected one of 1/0, true/false, yes/no, on/off")


def _parse_pos_int(v: Any) -> int:
    if isinstance(v, bool):
        raise ValueError("expected a positive integer")
    i = int(v)
    if i < 1:
        raise ValueError("expected a positive integer")
    return i


def _parse_opt_str(v: Any) -> str | None:
    if v is None:
        return None
    s = str(v).strip()
    return s or None


def _parse_limit(v: Any) -> str:
    """A byte count (``2000000``, ``512M``, ``4G``) or a share of memory (``50%``)."""
    s = str(v).strip()
    parse_limit(s, 1)  # validate now, resolve against the budget later
    return s


def parse_limit(text: str, whole: int) -> int:
    """Turn ``'50%'``, ``'512M'``, ``'4GiB'`` or ``'1000'`` into bytes (``%`` of ``whole``)."""
    s = str(text).strip().upper().replace(" ", "")
    if not s:
        raise ValueError("empty size")
    if s.endswith("%"):
        pct = float(s[:-1])
        if not (0 < pct <= 100):
            raise ValueError("a percentage must be in (0, 100]")
        return int(whole * pct / 100)
    for suffix in ("IB", "B"):
        if s.endswith(suffix) and len(s) > len(suffix) and s[-len(suffix) - 1] in "KMGT":
            s = s[: -len(suffix)]
            break
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(s[-1], 1)
    if mult != 1:
        s = s[:-1]
    value = float(s)
    if not (value >= 0) or value != value:
        raise ValueError("a size must be a non-negative number")
    return int(value * mult)


@dataclass(frozen=True)
class Spec:
    name: str
    env: str
    default: Callable[[], Any]
    parse: Callable[[Any], Any]
    doc: str


SPECS: dict[str, Spec] = {s.name: s for s in [
    Spec("backend", "CHEMIO_BACKEND", lambda: "local", lambda v: str(v).strip(),
         "storage backend for files without an explicit one"),
    Spec("scratch", "CHEMIO_SCRATCH", tempfile.gettempdir, lambda v: str(v).strip(),
         "scratch dirs for per-rank files: 'dir', 'host:dir' or 'RANK:dir', comma separated"),
    Spec("shared_scratch", "CHEMIO_SHARED_SCRATCH", lambda: None, _parse_opt_str,
         "dir for shared files and arrays (default: first CHEMIO_SCRATCH entry)"),
    Spec("io_threads", "CHEMIO_IO_THREADS", lambda: 16, _parse_pos_int,
         "threads in the background I/O pool"),
    Spec("shm_dir", "CHEMIO_SHM_DIR", lambda: "/dev/shm", lambda v: str(v).strip(),
         "directory of RAM-resident files for the shm backend"),
    Spec("shm_limit", "CHEMIO_SHM_LIMIT", lambda: "50%", _parse_limit,
         "RAM budget of the shm backend: bytes (512M, 4G) or a share of available memory"),
    Spec("sync", "CHEMIO_SYNC", lambda: False, _parse_bool,
         "complete every async call before it returns (debugging)"),
    Spec("trace", "CHEMIO_TRACE", lambda: None, _parse_opt_str,
         "write a Chrome/Perfetto trace of I/O events to this path at exit"),
    Spec("keep", "CHEMIO_KEEP", lambda: False, _parse_bool,
         "keep scratch files at exit for inspection"),
    Spec("direct", "CHEMIO_DIRECT", lambda: False, _parse_bool,
         "use O_DIRECT for aligned requests on the local backend"),
]}

_lock = threading.Lock()
_explicit: dict[str, Any] = {}
_explicit_comm: list[Any] = []          # [comm] when configure(comm=...) was called
_toml_cache: dict[str, tuple[float, dict]] = {}


@dataclass(frozen=True)
class Setting:
    """One effective setting: its value and where it came from."""
    name: str
    value: Any
    source: str

    def __repr__(self) -> str:
        return f"{self.name}={self.value!r} ({self.source})"


def config_path() -> str | None:
    """The TOML file in use, or None."""
    p = os.environ.get("CHEMIO_CONFIG")
    if p:
        return p
    if os.path.isfile("chemio.toml"):
        return os.path.abspath("chemio.toml")
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    p = os.path.join(base, "chemio", "config.toml")
    return p if os.path.isfile(p) else None


def _toml() -> tuple[str | None, dict]:
    path = config_path()
    if not path:
        return None, {}
    try:
        mtime = os.stat(path).st_mtime
    except FileNotFoundError:
        raise ConfigError(f"CHEMIO_CONFIG names {path!r}, which does not exist; "
                          f"create it or unset CHEMIO_CONFIG") from None
    cached = _toml_cache.get(path)
    if cached and cached[0] == mtime:
        return path, cached[1]
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path!r} is not valid TOML: {e}") from None
    unknown = set(data) - set(SPECS) - {"files"}
    if unknown:
        raise ConfigError(f"config file {path!r} has unknown keys {sorted(unknown)}; "
                          f"known: {sorted(SPECS)} and [files.\"pattern\"] tables")
    _toml_cache[path] = (mtime, data)
    return path, data


def _parse(spec: Spec, raw: Any, source: str) -> Any:
    try:
        return spec.parse(raw)
    except (TypeError, ValueError) as e:
        where = spec.env if source.startswith("env") else source
        raise ConfigError(f"setting {spec.name!r} = {raw!r} (from {where}) is invalid: {e}") from None


def get_setting(name: str) -> Setting:
    """The effective value of one setting, with its source."""
    spec = SPECS.get(name)
    if spec is None:
        raise ConfigError(f"unknown setting {name!r}; known: {sorted(SPECS)}")
    with _lock:
        if name in _explicit:
            return Setting(name, _explicit[name], "explicit")
    raw = os.environ.get(spec.env)
    if raw is not None and raw != "":
        return Setting(name, _parse(spec, raw, f"env:{spec.env}"), f"env:{spec.env}")
    path, data = _toml()
    if name in data:
        return Setting(name, _parse(spec, data[name], f"file:{path}"), f"file:{path}")
    return Setting(name, spec.default(), "default")


def get(name: str) -> Any:
    return get_setting(name).value


def configure(**settings: Any) -> None:
    """Set settings explicitly (highest precedence). ``name=None`` drops an explicit value.

    ``comm=`` takes an mpi4py communicator (or a ``chemio_py.comm.Comm``) to use for
    collective calls, e.g. a sub-communicator for a task group.
    """
    unknown = set(settings) - set(SPECS) - {"comm"}
    if unknown:
        raise ConfigError(f"configure() got unknown settings {sorted(unknown)}; "
                          f"known: {sorted(SPECS) + ['comm']}")
    parsed = {}
    for k, v in settings.items():
        if k != "comm" and v is not None:
            parsed[k] = _parse(SPECS[k], v, "configure()")
    with _lock:
        for k, v in settings.items():
            if k == "comm":
                _explicit_comm.clear()
                if v is not None:
                    _explicit_comm.append(v)
            elif v is None:
                _explicit.pop(k, None)
            else:
                _explicit[k] = parsed[k]
    if "io_threads" in settings or "sync" in settings:
        from . import requests
        requests.reset_pool()
    if "trace" in settings:
        from . import stats
        stats.refresh_trace()


def explicit_comm() -> Any | None:
    with _lock:
        return _explicit_comm[0] if _explicit_comm else None


def settings() -> dict[str, Setting]:
    """All effective settings, each with its source."""
    return {name: get_setting(name) for name in SPECS}


def file_rules() -> list[tuple[str, dict, str]]:
    """The per-name rules of the TOML file: (pattern, values, source)."""
    path, data = _toml()
    files = data.get("files", {})
    if not isinstance(files, dict):
        raise ConfigError(f"[files] in {path!r} must be a table of pattern tables")
    out = []
    for pattern, values in files.items():
        if not isinstance(values, dict):
            raise ConfigError(f"[files.{pattern!r}] in {path!r} must be a table")
        bad = set(values) - {"backend"}
        if bad:
            raise ConfigError(f"[files.{pattern!r}] in {path!r} has unknown keys {sorted(bad)}; "
                              f"known: ['backend']")
        out.append((pattern, values, f"file:{path} [files.\"{pattern}\"]"))
    return out


def backend_for(name: str | None, explicit: str | None = None) -> Setting:
    """Which backend a file of this name uses, and which rule decided it."""
    if explicit is not None:
        return Setting("backend", explicit, "argument")
    if name is not None:
        for pattern, values, source in file_rules():
            if "backend" in values and fnmatch.fnmatchcase(name, pattern):
                return Setting("backend", str(values["backend"]), source)
    return get_setting("backend")


def reset() -> None:
    """Drop all explicit settings (tests use this)."""
    with _lock:
        _explicit.clear()
        _explicit_comm.clear()
        _toml_cache.clear()
    from . import requests, stats
    requests.forget_settings()
    stats.refresh_trace()
