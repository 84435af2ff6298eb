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

Settings steer where chemio writes and what it keeps, so a config file is trusted only when
it is a regular file of at most 1 MiB, owned by this user or root and writable by no one
else (``mode & 0o022 == 0``); the checks are made on the opened descriptor. Anything else
is refused with a ``ConfigError`` at the first lookup that needs the file. A symbolic link
named ``./chemio.toml`` is refused (the working directory may be shared: name the target in
``CHEMIO_CONFIG`` instead); ``CHEMIO_CONFIG`` and the user config file may be links of this
user's (or root's), and the file they reach passes the same checks. ``CHEMIO_CONFIG=/dev/null``
means no config file at all. Every value, from any source, is checked: a number must be
finite and in range (``io_threads`` 1 to 1024, sizes up to ``2**63-1`` bytes), a flag a
boolean, a path a string.

Settings are checked all at once, not one by one when first used. The first lookup of any
setting (``get``, ``settings``, ``backend_for``, ...), every ``configure()`` call and
``chemio config --check`` (``survey()``) examine every setting of every source: explicit
values, ``CHEMIO_*`` variables, the config file and its ``[files."pattern"]`` rules. Any
problem raises one ``ConfigError`` naming each bad setting with its source (``configure()``,
the variable, the file), and nothing is used until they are fixed; ``configure()`` with a
problem changes nothing. Later lookups check again only when an input changed: a
``CHEMIO_*`` variable, the config file, ``configure()``, the known values (``set_choices``).
``import chemio_py`` reads no setting that can fail it, so a bad environment breaks no
import, and ``chemio config --check`` can always run to list what is wrong.

What is checked beyond type and range: unknown keys (with the nearest known name); values
with a fixed set of choices, registered by the module that knows them (``set_choices``: the
backend registry for ``backend``, globally and in every ``[files]`` rule); paths are local,
so a URL (``s3://``, ``gs://``, ``http(s)://``, ``file://``, any ``scheme://``) is refused:
chemio works on local and parallel file systems, object stores are reached through the
``zarr`` backend on a mounted path (for ``file://`` give the path itself). The directories
that ``scratch`` (each entry this host may use: plain and ``RANK:dir`` entries, ``host:dir``
entries matching this host), ``shared_scratch`` and ``shm_dir`` name must be directories
this user can write, or be missing with an existing parent: chemio then makes the last
level (0700) at first use, as ``mkdir`` would, so ``/scratch/$USER/$JOB_ID`` works while a
typo higher up is an error naming the entry, what is missing and the source, never a
silently made tree. File-system checks apply to the value in effect, not to defaults (the
default ``scratch`` is ``tempfile.gettempdir()``: ``$TMPDIR``, else ``/tmp``), and not to
``trace``: a trace that cannot be written is a warning at exit, never a failed job.

This is the lowest layer of the package: it imports no chemio module but ``errors``,
``ownfiles`` and ``safejson`` (the TOML is parsed with its limits). Modules above it that
keep state derived from a setting (the I/O pool, the trace, the communicator) follow changes
through ``on_change`` hooks.
"""
from __future__ import annotations

import difflib
import fnmatch
import math
import operator
import os
import re
import shlex
import socket
import stat as _stat
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from chemio_py.errors import ConfigError
from chemio_py.runtime import ownfiles, safejson

MAX_IO_THREADS = 1024
MAX_CONFIG_BYTES = 1 << 20          # a config file larger than this is not one of ours
MAX_BYTES = (1 << 63) - 1           # the largest byte count a setting may name (off_t)

_BOOL_ACCEPTED = "expected true or false (also 1/0, yes/no, on/off)"
_LIMIT_ACCEPTED = ("expected a byte count (2000000, 512M, 4GiB; at most 2**63-1 bytes) or a "
                   "share of available memory (50%; more than 0, at most 100)")
_SIZE_RE = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)(?:E[+-]?\d+)?", re.ASCII)
_INT_RE = re.compile(r"\+?\d{1,30}", re.ASCII)


def _show(v: Any) -> str:
    """``repr(v)`` for a message: bounded, and safe for integers too long to print."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 256:
        return f"<{'negative ' if v < 0 else ''}integer of {v.bit_length()} bits>"
    try:
        r = repr(v)
    except Exception:                                  # pragma: no cover
        r = f"<{type(v).__name__}>"
    return r if len(r) <= 80 else r[:60] + f"... ({len(r)} characters)"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if type(v).__name__ == "bool_":                    # numpy.bool_
        return bool(v)
    if _is_int(v):
        if v in (0, 1):
            return bool(v)
        raise ValueError(_BOOL_ACCEPTED)
    if not isinstance(v, str):
        raise ValueError(f"{_BOOL_ACCEPTED}, not a {type(v).__name__}")
    s = v.strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(_BOOL_ACCEPTED)


_DIRECT_ACCEPTED = "expected auto, true or false (also 1/0, yes/no, on/off)"


def _parse_direct(v: Any) -> bool | str:
    """The ``direct`` setting: ``"auto"`` (the default: read-ahead chooses), True or False."""
    if isinstance(v, str) and v.strip().lower() == "auto":
        return "auto"
    try:
        return _parse_bool(v)
    except ValueError:
        raise ValueError(_DIRECT_ACCEPTED if isinstance(v, (str, bool, int))
                         else f"{_DIRECT_ACCEPTED}, not a {type(v).__name__}") from None


def _parse_io_threads(v: Any) -> int:
    """A whole number of threads from 1 to ``MAX_IO_THREADS``: no bools, floats, NaN or inf."""
    accepted = f"expected a positive whole number of threads, at most {MAX_IO_THREADS}"
    if isinstance(v, str):
        s = v.strip()
        if not _INT_RE.fullmatch(s):
            raise ValueError(accepted)
        i = int(s)
    elif isinstance(v, bool) or type(v).__name__ == "bool_" or isinstance(v, float):
        raise ValueError(f"{accepted}, not a {type(v).__name__}")
    else:
        try:
            i = operator.index(v)                      # int, numpy integers
        except TypeError:
            raise ValueError(f"{accepted}, not a {type(v).__name__}") from None
    if not 1 <= i <= MAX_IO_THREADS:
        raise ValueError(accepted)
    return i


_AIO_ENGINES = ("auto", "io_uring", "aio", "threads")


def _parse_aio_engine(v: Any) -> str:
    accepted = f"expected one of {', '.join(_AIO_ENGINES)}"
    if not isinstance(v, str):
        raise ValueError(f"{accepted}, not a {type(v).__name__}")
    s = v.strip().lower()
    if s not in _AIO_ENGINES:
        raise ValueError(accepted)
    return s


def _parse_name(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"expected a backend name (a string such as 'local'), "
                         f"not a {type(v).__name__}")
    s = v.strip()
    if not s or any(ord(c) < 32 or c == "\x7f" for c in s):
        raise ValueError("expected a backend name such as 'local' or 'shm'")
    return s


def _path_text(v: Any) -> str:
    if isinstance(v, os.PathLike):
        v = os.fspath(v)
    if not isinstance(v, str):
        raise ValueError(f"expected a path (a string), not a {type(v).__name__}")
    if "\0" in v:
        raise ValueError("expected a path; it contains a NUL character")
    return v.strip()


_URL_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def _local(text: str) -> str:
    """``text`` itself when it is a path, not a URL (``s3://``, ``file://``, ...)."""
    m = _URL_RE.match(text)
    if m is None:
        return text
    hint = ""
    if m.group().lower() == "file://":
        rest = text[len("file://"):]
        rest = rest[len("localhost"):] if rest.lower().startswith("localhost/") else rest
        hint = f" (for a local directory give the path itself, {rest!r})"
    raise ValueError(f"{_show(text)} is a URL: chemio_py works on local/parallel file systems; "
                     f"for object stores use the zarr backend with a mounted path{hint}")


def _parse_path(v: Any) -> str:
    text = _path_text(v)
    if not text:
        raise ValueError("expected a path, got an empty string")
    return _local(text)


def _parse_opt_path(v: Any) -> str | None:
    if v is None:
        return None
    return _local(_path_text(v)) or None


_SCRATCH_ACCEPTED = "expected directories separated by commas, each 'dir', 'host:dir' or 'RANK:dir'"


def _scratch_tokens(text: str) -> list[tuple[str, str | None, str]]:
    """``(entry, key, dir)`` for each entry of a ``scratch`` value, read as
    ``scratch.parse_scratch`` reads it: ``key`` is None for a plain ``dir``, the digits of a
    ``RANK:dir`` entry or the host pattern of a ``host:dir`` entry."""
    out: list[tuple[str, str | None, str]] = []
    for tok in (t.strip() for t in text.split(",")):
        if tok and ":" in tok and not tok.startswith("/") and not _URL_RE.match(tok):
            key, path = tok.split(":", 1)
            out.append((tok, key, path))
        elif tok:
            out.append((tok, None, tok))
    return out


def _parse_scratch(v: Any) -> str:
    """``scratch``: comma-separated ``dir``, ``host:dir`` or ``RANK:dir`` entries, each
    naming a local directory; every bad entry is named in one error."""
    text = _path_text(v)
    entries = _scratch_tokens(text)
    if not entries:
        raise ValueError(f"names no directory; {_SCRATCH_ACCEPTED}")
    bad = []
    for tok, key, path in entries:
        if key == "":
            bad.append(f"entry {tok!r} has no host or rank before ':'")
        elif key is not None and not path.strip():
            bad.append(f"entry {tok!r} names no directory after '{key}:'")
        else:
            try:
                _local(path.strip())
            except ValueError as e:
                bad.append(f"entry {e}" if path == tok else f"entry {tok!r}: {e}")
    if bad:
        raise ValueError("; ".join(bad))
    return text


def _dir_problem(path: str) -> str | None:
    """Why chemio cannot keep files in directory ``path``, or None. It must be a directory
    this user may write in, or be missing with an existing parent (made at first use, 0700,
    as ``mkdir`` makes it)."""
    full = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(full):
        if os.access(full, os.W_OK | os.X_OK):
            return None
        return "not writable by you; choose another directory or fix its permissions"
    if os.path.lexists(full):
        return "not a directory; name a directory"
    missing = full
    while not os.path.lexists(os.path.dirname(missing)):
        missing = os.path.dirname(missing)
    if missing == full:
        parent = os.path.dirname(full)
        if os.path.isdir(parent):
            return None                     # made at first use, as mkdir makes it
        return f"cannot be made: {parent!r} is not a directory; fix the path"
    above = os.path.dirname(missing)
    if not os.path.isdir(above):
        return f"cannot be made: {above!r} is not a directory; fix the path"
    return (f"no such directory ({missing!r} does not exist); create it "
            f"(mkdir -p {shlex.quote(full)}) or fix the path")


def _check_dir(value: str | None) -> list[str]:
    why = None if value is None else _dir_problem(value)
    return [] if why is None else [why]


def _check_scratch_dirs(value: str) -> list[str]:
    """The problems of the entries of a ``scratch`` value that this host may use (plain and
    ``RANK:dir`` entries, ``host:dir`` ones whose pattern matches this host)."""
    host = socket.gethostname()
    out = []
    for tok, key, path in _scratch_tokens(value):
        if key is not None and not key.isdigit() and not fnmatch.fnmatchcase(host, key):
            continue                            # another host's directory: checked there
        why = _dir_problem(path.strip())
        if why is not None:
            out.append(f"entry {tok!r}: {why}")
    return out


def _parse_limit(v: Any) -> str:
    """A byte count (``2000000``, ``512M``, ``4G``) or a share of memory (``50%``)."""
    if isinstance(v, bool) or type(v).__name__ == "bool_":
        raise ValueError(f"{_LIMIT_ACCEPTED}, not a boolean")
    if not isinstance(v, (str, float)):
        try:
            i = operator.index(v)                      # int, numpy integers
        except TypeError:
            raise ValueError(f"{_LIMIT_ACCEPTED}, not a {type(v).__name__}") from None
        if not 0 <= i <= MAX_BYTES:
            raise ValueError(_LIMIT_ACCEPTED)
        return str(i)
    s = str(v).strip()
    parse_limit(s, 1)  # validate now, resolve against the budget later
    return s


def parse_limit(text: str, whole: int) -> int:
    """Turn ``'50%'``, ``'512M'``, ``'4GiB'`` or ``'1000'`` into bytes (``%`` of ``whole``).

    Raises ``ValueError`` (saying what is accepted) for anything else: signs, NaN, infinities,
    an exponent that overflows, more than ``2**63-1`` bytes, a percentage outside (0, 100].
    """
    s = str(text).strip().upper().replace(" ", "")
    if not s:
        raise ValueError(f"empty size; {_LIMIT_ACCEPTED}")
    if s.endswith("%"):
        num = s[:-1]
        pct = float(num) if _SIZE_RE.fullmatch(num) else math.nan
        if not (math.isfinite(pct) and 0 < pct <= 100):
            raise ValueError(f"a percentage must be a number in (0, 100]; {_LIMIT_ACCEPTED}")
        return int(whole * pct / 100)
    for suffix in ("IB", "B"):
        if s.endswith(suffix) and len(s) > len(suffix) and s[-len(suffix) - 1] in "KMGT":
            s = s[: -len(suffix)]
            break
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(s[-1], 1)
    if mult != 1:
        s = s[:-1]
    if not _SIZE_RE.fullmatch(s):
        raise ValueError(f"not a size; {_LIMIT_ACCEPTED}")
    if mult == 1 and "." not in s and "E" not in s:
        value = int(s) if len(s) <= 20 else MAX_BYTES + 1      # exact for byte counts
    else:
        f = float(s) * mult
        value = int(f) if math.isfinite(f) and f <= MAX_BYTES else MAX_BYTES + 1
    if value > MAX_BYTES:
        raise ValueError(f"a size of more than 2**63-1 bytes; {_LIMIT_ACCEPTED}")
    return value


_HINTS_ACCEPTED = ("expected MPI-IO hints as 'key=value,key=value' (or a TOML table of strings); "
                   "keys and values are plain words such as romio_cb_write=enable")
_HINT_WORD = re.compile(r"^[A-Za-z0-9_.:/+-]{1,255}$", re.ASCII)


def _parse_hints(v: Any) -> dict[str, str]:
    """MPI-IO hints: ``"key=value,key=value"`` or a mapping of strings (TOML table)."""
    if v is None:
        return {}
    if isinstance(v, str):
        pairs = []
        for item in v.split(","):
            item = item.strip()
            if not item:
                continue
            key, eq, value = item.partition("=")
            if not eq:
                raise ValueError(f"{_HINTS_ACCEPTED}; {item!r} has no '='")
            pairs.append((key.strip(), value.strip()))
    elif isinstance(v, dict):
        pairs = list(v.items())
    else:
        raise ValueError(f"{_HINTS_ACCEPTED}, not a {type(v).__name__}")
    out = {}
    for key, value in pairs:
        if isinstance(value, bool):
            value = "true" if value else "false"
        elif _is_int(value):
            value = str(value)
        if not (isinstance(key, str) and isinstance(value, str)
                and _HINT_WORD.fullmatch(key) and _HINT_WORD.fullmatch(value)):
            raise ValueError(f"{_HINTS_ACCEPTED}; got {_show(key)}={_show(value)}")
        out[key] = value
    return out


_TIMEOUT_ACCEPTED = ("expected a number of seconds greater than 0 (60, 0.5), or 0/off/none "
                     "for no timeout")


def _parse_timeout(v: Any) -> float | None:
    """Seconds (finite, > 0), or None for "no timeout" (``0``, ``off``, ``none``, empty)."""
    if v is None:
        return None
    if isinstance(v, bool) or type(v).__name__ == "bool_":
        raise ValueError(f"{_TIMEOUT_ACCEPTED}, not a boolean")
    if isinstance(v, str):
        s = v.strip().lower()
        if s in ("", "0", "off", "none", "no"):
            return None
        if not _SIZE_RE.fullmatch(s.upper()):
            raise ValueError(_TIMEOUT_ACCEPTED)
        f = float(s)
    else:
        try:
            f = float(v)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"{_TIMEOUT_ACCEPTED}, not a {type(v).__name__}") from None
    if f == 0:
        return None
    if not (math.isfinite(f) and 0 < f <= 1e9):
        raise ValueError(_TIMEOUT_ACCEPTED)
    return f


COMPRESSORS = ("zstd", "blosc")
_COMPRESSOR_ACCEPTED = ("expected 'none', 'zstd[:level]' or 'blosc[:cname[:level[:shuffle]]]' "
                        "(shuffle: noshuffle, shuffle, bitshuffle), or a TOML table such as "
                        "{id = 'zstd', level = 5}")
_BLOSC_NAMES = ("blosclz", "lz4", "lz4hc", "zlib", "zstd")
_SHUFFLES = ("noshuffle", "shuffle", "bitshuffle")


def _parse_compressor(v: Any) -> dict | None:
    """A compressor for array backends that compress (``zarr``), as a normalised dict
    (``{"id": "zstd", "level": 3}``, ``{"id": "blosc", "cname": "lz4", "level": 5,
    "shuffle": "shuffle"}``) or None for no compression."""
    if v is None:
        return None
    if isinstance(v, str):
        parts = [p.strip().lower() for p in v.split(":")]
        if parts == ["none"] or parts == [""]:
            return None
        d: dict[str, Any] = {"id": parts[0]}
        keys = {"zstd": ("level",), "blosc": ("cname", "level", "shuffle")}.get(parts[0], ())
        if len(parts) - 1 > len(keys):
            raise ValueError(_COMPRESSOR_ACCEPTED)
        d.update(zip(keys, parts[1:]))
    elif isinstance(v, dict):
        d = {str(k): (x.lower() if isinstance(x, str) else x) for k, x in v.items()}
    else:
        raise ValueError(f"{_COMPRESSOR_ACCEPTED}, not a {type(v).__name__}")
    cid = d.get("id")
    if cid not in COMPRESSORS:
        raise ValueError(f"unknown compressor {_show(cid)}; {_COMPRESSOR_ACCEPTED}")
    allowed = {"zstd": {"id", "level"}, "blosc": {"id", "cname", "level", "shuffle"}}[cid]
    if set(d) - allowed:
        raise ValueError(f"{cid} takes {sorted(allowed - {'id'})}, not "
                         f"{sorted(set(d) - allowed)}")
    level = d.get("level", 3 if cid == "zstd" else 5)
    try:
        level = int(level) if not isinstance(level, bool) else None
    except (TypeError, ValueError):
        level = None
    lo, hi = (-7, 22) if cid == "zstd" else (0, 9)
    if level is None or not lo <= level <= hi:
        raise ValueError(f"{cid} level must be a whole number from {lo} to {hi}, "
                         f"got {_show(d.get('level'))}")
    out: dict[str, Any] = {"id": cid, "level": level}
    if cid == "blosc":
        cname = d.get("cname", "zstd")
        shuffle = d.get("shuffle", "shuffle")
        if cname not in _BLOSC_NAMES:
            raise ValueError(f"blosc cname must be one of {list(_BLOSC_NAMES)}, "
                             f"got {_show(cname)}")
        if shuffle not in _SHUFFLES:
            raise ValueError(f"blosc shuffle must be one of {list(_SHUFFLES)}, "
                             f"got {_show(shuffle)}")
        out.update(cname=cname, shuffle=shuffle)
    return out


@dataclass(frozen=True)
class Spec:
    """One setting: its name, variable, default, parser (raises ``ValueError`` saying what
    it accepts) and meaning; ``check_dirs`` lists the problems of the directories a value
    names (run on the value in effect when it is not the default)."""
    name: str
    env: str
    default: Callable[[], Any]
    parse: Callable[[Any], Any]
    doc: str
    check_dirs: Callable[[Any], list[str]] | None = None


SPECS: dict[str, Spec] = {s.name: s for s in [
    Spec("backend", "CHEMIO_BACKEND", lambda: "local", _parse_name,
         "storage backend for files without an explicit one"),
    Spec("scratch", "CHEMIO_SCRATCH", tempfile.gettempdir, _parse_scratch,
         "scratch dirs for per-rank files: 'dir', 'host:dir' or 'RANK:dir', comma separated",
         _check_scratch_dirs),
    Spec("shared_scratch", "CHEMIO_SHARED_SCRATCH", lambda: None, _parse_opt_path,
         "dir for shared files and arrays (default: first CHEMIO_SCRATCH entry)", _check_dir),
    Spec("io_threads", "CHEMIO_IO_THREADS", lambda: 16, _parse_io_threads,
         f"threads in the background I/O pool (1 to {MAX_IO_THREADS})"),
    Spec("shm_dir", "CHEMIO_SHM_DIR", lambda: "/dev/shm", _parse_path,
         "directory of RAM-resident files for the shm backend", _check_dir),
    Spec("shm_limit", "CHEMIO_SHM_LIMIT", lambda: "50%", _parse_limit,
         "RAM budget of the shm backend: bytes (512M, 4G) or a share of available memory"),
    Spec("sync", "CHEMIO_SYNC", lambda: False, _parse_bool,
         "complete every async call before it returns (debugging)"),
    Spec("trace", "CHEMIO_TRACE", lambda: None, _parse_opt_path,
         "write a Chrome/Perfetto trace of I/O events to this path at exit (a new file, or "
         "one of yours it replaces; never through a link)"),
    Spec("keep", "CHEMIO_KEEP", lambda: False, _parse_bool,
         "keep scratch files at exit for inspection"),
    Spec("sigterm_cleanup", "CHEMIO_SIGTERM_CLEANUP", lambda: True, _parse_bool,
         "on SIGTERM (e.g. a job's walltime), remove this process's scratch, then run the "
         "handler that was there before or end as SIGTERM would"),
    Spec("aio_engine", "CHEMIO_AIO_ENGINE", lambda: "auto", _parse_aio_engine,
         "kernel interface of the local backend's aligned O_DIRECT requests: 'auto' "
         "(Linux AIO, else io_uring, else the I/O threads), 'io_uring', 'aio' or 'threads'"),
    Spec("direct", "CHEMIO_DIRECT", lambda: "auto", _parse_direct,
         "O_DIRECT on the local backend: 'auto' (read-ahead picks it for cold aligned "
         "big blocks), true (aligned requests always), false (never)"),
    Spec("map_cap", "CHEMIO_MAP_CAP", lambda: "8G", _parse_limit,
         "bytes of array files the local backend keeps mapped for reads from the page "
         "cache (least recently used first out): bytes (512M, 8G) or a share of memory"),
    Spec("mpiio_hints", "CHEMIO_MPIIO_HINTS", dict, _parse_hints,
         "extra MPI-IO hints for the mpiio backend: 'key=value,key=value'"),
    Spec("compressor", "CHEMIO_COMPRESSOR", lambda: None, _parse_compressor,
         "compression of arrays on backends that compress (zarr): 'none', 'zstd[:level]', "
         "'blosc[:cname[:level[:shuffle]]]'"),
    Spec("abort_on_error", "CHEMIO_ABORT_ON_ERROR", lambda: True, _parse_bool,
         "under MPI, an uncaught exception on one rank aborts the whole job (as "
         "python -m mpi4py does) instead of leaving the other ranks waiting"),
    Spec("collective_timeout", "CHEMIO_COLLECTIVE_TIMEOUT", lambda: None, _parse_timeout,
         "seconds a rank waits for the others to arrive at a collective call before it "
         "raises, naming the ranks that never came (off by default)"),
]}

# Settings that a [files."pattern"] rule of the TOML file may set per file name.
PER_FILE = ("backend", "compressor")

# What configure() takes besides the settings: config passes these values on to the hooks
# that subscribed to them and keeps nothing (the communicator lives in chemio_py.runtime.comm).
PASSED_ON = ("comm",)

Hook = Callable[[dict[str, Any], bool], None]

_lock = threading.Lock()
_explicit: dict[str, Any] = {}
_files: dict[str, tuple[tuple, dict]] = {}   # config path -> (identity, TOML data) as read
_hooks: list[tuple[frozenset[str], Hook]] = []
_choices: dict[str, Callable[[], Iterable[str]]] = {}   # see set_choices


@dataclass(frozen=True)
class Setting:
    """One effective setting: its value and where it came from."""
    name: str
    value: Any
    source: str

    def __repr__(self) -> str:
        return f"{self.name}={self.value!r} ({self.source})"


_HOW_ENV = "named by CHEMIO_CONFIG"
_HOW_CWD = "chemio.toml in the working directory"
_HOW_USER = "the user config file"


def _find_config() -> tuple[str, str] | None:
    """The config file to use and how it was found, or None (``CHEMIO_CONFIG=/dev/null``)."""
    p = os.environ.get("CHEMIO_CONFIG")
    if p:
        return None if p == os.devnull else (p, _HOW_ENV)
    if os.path.lexists("chemio.toml"):                 # a link, FIFO... too: refused below
        return os.path.abspath("chemio.toml"), _HOW_CWD
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    p = os.path.join(base, "chemio", "config.toml")
    return (p, _HOW_USER) if os.path.lexists(p) else None


def config_path() -> str | None:
    """The TOML file in use, or None."""
    found = _find_config()
    return found[0] if found else None


def _user(uid: int) -> str:
    try:
        import pwd
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def _way_out(path: str, how: str) -> str:
    if how == _HOW_ENV:
        return "point CHEMIO_CONFIG at a file of your own, or unset it"
    return (f"remove it{' or run from another directory' if how == _HOW_CWD else ''}, or set "
            f"CHEMIO_CONFIG to a file of your own (CHEMIO_CONFIG=/dev/null for no config file)")


def _refuse(path: str, how: str, what: str, todo: str | None = None) -> ConfigError:
    return ConfigError(f"config file {path!r} ({how}) {what}; {todo or _way_out(path, how)}")


def _check_trust(path: str, how: str, st: os.stat_result, what: str = "is") -> None:
    """Only a file of this user (or root) that no one else may write holds our settings."""
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        you = "you (root)" if me == 0 else f"you ({_user(me)}) or root"
        raise _refuse(path, how, f"{what} owned by {_user(st.st_uid)}, not by {you}: chemio "
                      f"takes no settings from a file another user controls")
    if st.st_mode & 0o022 and not _stat.S_ISLNK(st.st_mode):
        who = {0o020: "group", 0o002: "others"}.get(st.st_mode & 0o022, "group and others")
        raise _refuse(path, how, f"is writable by {who} (mode {oct(_stat.S_IMODE(st.st_mode))}), "
                      f"so someone else could change your settings",
                      f"run `chmod go-w {shlex.quote(path)}` if it is yours; otherwise "
                      f"{_way_out(path, how)}")


def _resolve(path: str, how: str) -> tuple[str, os.stat_result]:
    """The file to open for ``path`` and its ``lstat``; a final link is followed only for
    CHEMIO_CONFIG and the user config file, and only when the link is ours (or root's)."""
    if _URL_RE.match(path):
        raise _refuse(path, how, "is a URL: chemio reads its settings from a local file",
                      "point CHEMIO_CONFIG at a local file, or unset it")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise _refuse(path, how, "does not exist",
                      "create it or unset CHEMIO_CONFIG" if how == _HOW_ENV else None) from None
    except OSError as e:
        raise _refuse(path, how, f"cannot be examined: {e.strerror}") from None
    if not _stat.S_ISLNK(st.st_mode):
        return path, st
    real = os.path.realpath(path)
    if how == _HOW_CWD:
        raise _refuse(path, how, f"is a symbolic link (to {real!r}); chemio does not follow a "
                      f"link named chemio.toml in the working directory, where others may "
                      f"have placed it",
                      f"set CHEMIO_CONFIG={real} to use the file it points to, or remove the link")
    _check_trust(path, how, st, "is a symbolic link")
    try:
        return real, os.lstat(real)
    except FileNotFoundError:
        raise _refuse(path, how, f"is a symbolic link to {real!r}, which does not exist",
                      "create the file or " + ("unset CHEMIO_CONFIG" if how == _HOW_ENV
                                               else "remove the link")) from None
    except OSError as e:
        raise _refuse(path, how, f"is a symbolic link to {real!r}, which cannot be "
                      f"examined: {e.strerror}") from None


def _cache_key(target: str, st: os.stat_result) -> tuple:
    return (target, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
            st.st_mode, st.st_uid)


def _load(path: str, how: str, target: str) -> tuple[tuple, dict]:
    """Open, check (on the open descriptor) and parse the config file."""
    try:
        fd = ownfiles.open_regular(target)
    except ownfiles.NotARegularFile as e:
        raise _refuse(path, how, f"{e.strerror}" + (f" ({target!r})" if target != path else "")
                      ) from None
    except FileNotFoundError:
        raise _refuse(path, how, "vanished while being opened") from None
    except OSError as e:
        raise _refuse(path, how, f"cannot be opened: {e.strerror}") from None
    too_big = _refuse(path, how, f"is larger than {MAX_CONFIG_BYTES >> 20} MiB: not a chemio "
                      f"config file", "remove it or point CHEMIO_CONFIG elsewhere")
    try:
        st = os.fstat(fd)
        _check_trust(path, how, st)
        if st.st_size > MAX_CONFIG_BYTES:
            raise too_big
        try:
            raw = ownfiles.read_bounded(fd, MAX_CONFIG_BYTES)
        except ValueError:
            raise too_big from None
    except OSError as e:
        raise _refuse(path, how, f"cannot be read: {e.strerror}") from None
    finally:
        os.close(fd)
    try:
        data = safejson.load_toml(raw.decode("utf-8"), what=f"config file {path!r}",
                                  max_bytes=MAX_CONFIG_BYTES, error=ConfigError)
    except UnicodeDecodeError as e:
        raise _refuse(path, how, f"is not UTF-8 text (byte {e.start})",
                      "fix or remove it") from None
    return _cache_key(target, st), data


def _read_file(path: str, how: str) -> tuple[tuple, dict]:
    """(identity, TOML data) of the config file; read again only when it changed."""
    target, st = _resolve(path, how)
    cached = _files.get(path)
    if cached and cached[0] == _cache_key(target, st):
        return cached                                  # the very file checked when it was read
    cached = _load(path, how, target)
    _files[path] = cached
    return cached


def _file_identity() -> tuple | None:
    """(path, identity) of the config file in use, None without one, ``_UNREADABLE`` when
    it cannot be used (the full check then says why)."""
    found = _find_config()
    if found is None:
        return None
    try:
        target, st = _resolve(*found)
    except ConfigError:
        return _UNREADABLE
    return found[0], _cache_key(target, st)


_UNREADABLE = ("unreadable",)


def _where(source: str) -> str:
    if source.startswith("env:"):
        return f"environment variable {source[4:]}"
    if source.startswith("file:"):
        return f"config file {source[5:]}"
    if source == "explicit":
        return "configure()"
    return source


def _parse(spec: Spec, raw: Any, source: str) -> Any:
    try:
        return spec.parse(raw)
    except (TypeError, ValueError, ArithmeticError) as e:
        raise ConfigError(f"setting {spec.name!r} = {_show(raw)} (from {_where(source)}) is "
                          f"invalid: {e}") from None


def _nearest(word: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _value(spec: Spec, raw: Any, source: str, choices: dict[str, frozenset[str]]) -> Any:
    """``raw`` parsed, and one of the known choices where the setting has them."""
    value = _parse(spec, raw, source)
    known = choices.get(spec.name)
    if known is not None and value not in known:
        raise ConfigError(f"setting {spec.name!r} = {_show(raw)} (from {_where(source)}) is "
                          f"invalid: no {spec.name} of that name is known here"
                          f"{_nearest(value, known)}; known: {sorted(known)}")
    return value


Provider = Callable[[], Iterable[str]]


def set_choices(name: str, provider: Provider | None) -> Provider | None:
    """Accept for setting ``name`` only the values ``provider()`` returns (None: any value
    its parser accepts); returns the provider it replaces. The module that knows the values
    registers them, so config stays a leaf: the backend registry gives
    ``set_choices("backend", names)``. The provider is called at each full check, never at a
    plain lookup; the next lookup checks everything again."""
    global _checked
    if name not in SPECS:
        raise ConfigError(f"set_choices() got unknown setting {name!r}; known: {sorted(SPECS)}")
    with _lock:
        before = _choices.pop(name, None)
        if provider is not None:
            _choices[name] = provider
        _checked = None
    return before


def _known_choices() -> dict[str, frozenset[str]]:
    with _lock:
        providers = dict(_choices)
    out = {}
    for name, provider in providers.items():
        try:
            out[name] = frozenset(provider())
        except Exception:  # noqa: BLE001 - a broken registry must not hide the other checks
            continue
    return out


@dataclass(frozen=True)
class Survey:
    """Every setting at once, as ``chemio config`` shows them and ``--check`` judges them."""
    config_file: str | None
    settings: dict[str, Setting]            # in effect; a bad one holds the value as found
    rules: list[tuple[str, dict, str]]      # the [files] rules: (pattern, values, source)
    problems: list[str]                     # one line per problem, naming setting and source
    invalid: frozenset[str]                 # settings whose value in effect is bad


@dataclass(frozen=True)
class _Checked:
    """What the last clean check saw; lookups use it until an input changes."""
    env: dict[str, tuple[str | None, Any]]  # name -> (CHEMIO_* text or None, parsed value)
    file: tuple | None                      # _file_identity() at the check
    values: dict[str, Any]                  # the config file's settings, parsed
    source: str                             # "file:<path>" of those settings
    rules: list[tuple[str, dict, str]]


_checked: _Checked | None = None
_BAD = object()


def _file_settings(path: str, data: dict, choices: dict[str, frozenset[str]],
                   problems: list[str]) -> tuple[dict[str, Any], list[tuple[str, dict, str]]]:
    """The settings and ``[files]`` rules of a config file, parsed; problems appended."""
    unknown = sorted(set(data) - set(SPECS) - {"files"})
    if unknown:
        hints = "".join(_nearest(k, SPECS) for k in unknown)
        problems.append(f"config file {path!r} has unknown keys {unknown}{hints}; known: "
                        f"{sorted(SPECS)} and [files.\"pattern\"] tables")
    values = {}
    for key in [k for k in data if k in SPECS]:
        try:
            values[key] = _value(SPECS[key], data[key], f"file:{path}", choices)
        except ConfigError as e:
            problems.append(str(e))
    rules: list[tuple[str, dict, str]] = []
    files = data.get("files", {})
    if not isinstance(files, dict):
        problems.append(f"[files] in {path!r} must be a table of pattern tables, such as "
                        f"[files.\"*.aoints\"]")
        return values, rules
    for pattern, table in files.items():
        if not isinstance(table, dict):
            problems.append(f"[files.{pattern!r}] in {path!r} must be a table")
            continue
        bad = sorted(set(table) - set(PER_FILE))
        if bad:
            problems.append(f"[files.{pattern!r}] in {path!r} has unknown keys {bad}"
                            f"{''.join(_nearest(k, PER_FILE) for k in bad)}; known: "
                            f"{list(PER_FILE)}")
        source = f"file:{path} [files.\"{pattern}\"]"
        parsed = {}
        for key in PER_FILE:
            if key in table:
                try:
                    parsed[key] = _value(SPECS[key], table[key], source, choices)
                except ConfigError as e:
                    problems.append(str(e))
        rules.append((pattern, parsed, source))
    return values, rules


def _examine(explicit: dict[str, Any],
             choices: dict[str, frozenset[str]]) -> tuple[Survey, _Checked]:
    """Check every setting of every source (``explicit`` values are parsed already)."""
    problems: list[str] = []
    found = _find_config()
    identity: tuple | None = None
    data: dict = {}
    values: dict[str, Any] = {}
    rules: list[tuple[str, dict, str]] = []
    if found is not None:
        try:
            key, data = _read_file(*found)
            identity = (found[0], key)
            values, rules = _file_settings(found[0], data, choices, problems)
        except ConfigError as e:
            problems.append(str(e))
            identity = _UNREADABLE
    env: dict[str, tuple[str | None, Any]] = {}
    for spec in SPECS.values():
        text = os.environ.get(spec.env) or None
        value: Any = None
        if text is not None:
            try:
                value = _value(spec, text, f"env:{spec.env}", choices)
            except ConfigError as e:
                problems.append(str(e))
                value = _BAD
        env[spec.name] = (text, value)
    shown: dict[str, Setting] = {}
    invalid = set()
    for spec in SPECS.values():
        name = spec.name
        if name in explicit:
            raw = value = explicit[name]
            source = "explicit"
        elif env[name][0] is not None:
            raw, value = env[name]
            source = f"env:{spec.env}"
        elif found is not None and name in data:
            raw, value = data[name], values.get(name, _BAD)
            source = f"file:{found[0]}"
        else:
            raw = value = spec.default()
            source = "default"
        if value is _BAD:
            invalid.add(name)
        elif spec.check_dirs is not None and source != "default":
            for why in spec.check_dirs(value):
                problems.append(f"setting {name!r} = {_show(raw)} (from {_where(source)}): "
                                f"{why}")
                invalid.add(name)
        shown[name] = Setting(name, raw if value is _BAD else value, source)
    path = found[0] if found else None
    survey = Survey(path, shown, rules, problems, frozenset(invalid))
    return survey, _Checked(env, identity, values, f"file:{path}", rules)


def _summary(problems: list[str]) -> str:
    if len(problems) == 1:
        return problems[0]
    return (f"{len(problems)} problems with the chemio settings (`chemio config --check` "
            f"lists them):\n" + "\n".join(f"  - {p}" for p in problems))


def survey() -> Survey:
    """Every setting with its source and every problem, without raising: what ``chemio
    config`` shows. It changes nothing: lookups still check on their own."""
    with _lock:
        explicit = dict(_explicit)
    return _examine(explicit, _known_choices())[0]


def _require_valid() -> _Checked:
    """Check everything; raise one ``ConfigError`` naming every problem."""
    global _checked
    with _lock:
        explicit = dict(_explicit)
    found, checked = _examine(explicit, _known_choices())
    if found.problems:
        raise ConfigError(_summary(found.problems))
    _checked = checked
    return checked


def _checked_file() -> _Checked:
    """The last clean check, made again when never made or when the config file changed."""
    checked = _checked
    if checked is None or checked.file != _file_identity():
        checked = _require_valid()
    return checked


def get_setting(name: str) -> Setting:
    """The effective value of one setting, with its source. Raises ``ConfigError`` naming
    every bad setting when any is bad (see the module's docstring for when it checks)."""
    spec = SPECS.get(name)
    if spec is None:
        raise ConfigError(f"unknown setting {name!r}{_nearest(name, SPECS)}; "
                          f"known: {sorted(SPECS)}")
    checked = _checked or _require_valid()
    with _lock:
        if name in _explicit:
            return Setting(name, _explicit[name], "explicit")
    text = os.environ.get(spec.env) or None
    if text != checked.env[name][0]:
        checked = _require_valid()                     # a variable changed: check them all
    seen, value = checked.env[name]
    if text is not None:
        if seen != text:                               # changed again meanwhile
            value = _value(spec, text, f"env:{spec.env}", _known_choices())
        return Setting(name, value, f"env:{spec.env}")
    checked = _checked_file()
    if name in checked.values:
        return Setting(name, checked.values[name], checked.source)
    return Setting(name, spec.default(), "default")


def get(name: str) -> Any:
    return get_setting(name).value


def on_change(names: Iterable[str], fn: Hook) -> Callable[[], None]:
    """Call ``fn(changes, reset)`` after ``configure()`` or ``reset()`` changed any of
    ``names`` (settings, or ``"comm"``); returns a function that removes the hook.

    ``changes`` maps each of ``names`` that changed to its new explicit value (parsed), or
    to None where the explicit value was dropped; a name counts as changed when a
    ``configure()`` call names it. ``reset`` is True for ``reset()``, which drops every
    explicit value and reports every name. Hooks run in the calling thread, in the order
    they subscribed, once the new values are in place; if one raises, the others still
    run and the first error is raised. A ``configure()`` that raises calls no hook.
    """
    wanted = frozenset([names] if isinstance(names, str) else names)
    unknown = wanted - set(SPECS) - set(PASSED_ON)
    if unknown or not wanted:
        got = f"unknown names {sorted(unknown)}" if unknown else "no names"
        raise ConfigError(f"on_change() got {got}; known: {sorted(SPECS) + list(PASSED_ON)}")
    entry = (wanted, fn)
    with _lock:
        _hooks.append(entry)

    def remove() -> None:
        with _lock:
            if entry in _hooks:
                _hooks.remove(entry)
    return remove


def _notify(changes: dict[str, Any], reset: bool) -> None:
    with _lock:
        hooks = list(_hooks)
    first: BaseException | None = None
    for names, fn in hooks:
        mine = {k: v for k, v in changes.items() if k in names}
        if not mine:
            continue
        try:
            fn(mine, reset)
        except BaseException as e:  # noqa: BLE001 - the other hooks still run; raised below
            if first is None:
                first = e
    if first is not None:
        raise first


def configure(**settings: Any) -> None:
    """Set settings explicitly (highest precedence). ``name=None`` drops an explicit value.

    ``comm=`` takes an mpi4py communicator (or a ``chemio_py.runtime.comm.Comm``) to use for
    collective calls, e.g. a sub-communicator for a task group; ``comm=None`` goes back
    to the default (``COMM_WORLD`` under an MPI launcher). Every setting is checked with
    the new values in place, from every source (the environment and the config file too):
    when anything is bad, one ``ConfigError`` names it all and nothing changes.
    """
    global _checked
    unknown = set(settings) - set(SPECS) - set(PASSED_ON)
    if unknown:
        hints = "".join(_nearest(k, [*SPECS, *PASSED_ON]) for k in sorted(unknown))
        raise ConfigError(f"configure() got unknown settings {sorted(unknown)}{hints}; "
                          f"known: {sorted(SPECS) + list(PASSED_ON)}")
    choices = _known_choices()
    parsed, problems = {}, []
    for k, v in settings.items():
        if k in SPECS and v is not None:
            try:
                parsed[k] = _value(SPECS[k], v, "explicit", choices)
            except ConfigError as e:
                problems.append(str(e))
    if problems:
        raise ConfigError(_summary(problems))
    changed = {k: parsed.get(k) for k in settings if k in SPECS}
    with _lock:
        candidate = {**_explicit, **changed}
    found, checked = _examine({k: v for k, v in candidate.items() if v is not None}, choices)
    if found.problems:
        raise ConfigError(_summary(found.problems))
    with _lock:
        for k, v in changed.items():
            if v is None:
                _explicit.pop(k, None)
            else:
                _explicit[k] = v
        _checked = checked
    _notify({k: parsed.get(k, v) for k, v in settings.items()}, reset=False)


def settings() -> dict[str, Setting]:
    """All effective settings, each with its source."""
    return {name: get_setting(name) for name in SPECS}


def file_rules() -> list[tuple[str, dict, str]]:
    """The per-name rules of the TOML file: (pattern, values, source)."""
    return list(_checked_file().rules)


def setting_for(key: str, name: str | None, explicit: Any = None) -> Setting:
    """The value of per-file setting ``key`` for a file called ``name``: ``explicit`` (an
    argument) if given, else the first matching ``[files]`` rule, else the setting."""
    if key not in PER_FILE:
        raise KeyError(f"{key!r} is not a per-file setting; those are {list(PER_FILE)}")
    if explicit is not None:
        return Setting(key, _parse(SPECS[key], explicit, "argument"), "argument")
    if name is not None:
        for pattern, values, source in file_rules():
            if key in values and fnmatch.fnmatchcase(name, pattern):
                return Setting(key, values[key], source)
    return get_setting(key)


def backend_for(name: str | None, explicit: str | None = None) -> Setting:
    """Which backend a file of this name uses, and which rule decided it."""
    if explicit is not None:
        return Setting("backend", explicit, "argument")
    return setting_for("backend", name)


def reset() -> None:
    """Drop all explicit settings and ``comm`` (tests use this)."""
    global _checked
    with _lock:
        _explicit.clear()
        _files.clear()
        _checked = None
    _notify(dict.fromkeys([*SPECS, *PASSED_ON]), reset=True)
