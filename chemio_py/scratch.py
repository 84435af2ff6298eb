"""Job scratch directories: where files go, who owns them, and how they are cleaned up.

Each job gets ``<root>/chemio-[<batchid>-]<host>-<pid>/`` (directory 0700) holding chemio's
marker ``.chemio-job.json`` and one lease file per process (host, boot id, pid namespace,
pid, process start time, uid). Files a process creates there are removed by that process
(the pid that created them, never a forked child) when it calls ``cio.cleanup()`` or exits
(unless ``CHEMIO_KEEP=1``). ``chemio clean`` removes a job directory only when it carries a
valid marker and every lease in it belongs to a process that is provably gone; whenever
that cannot be proven (another host, boot, pid namespace or uid, an unreadable or hostile
lease, /proc not usable) the directory is kept and the listing says why.

The job directory belongs to one process group: under an MPI launcher the launcher process
that started the ranks of a node (their common parent), else this process. The batch job id
(Slurm, PBS, LSF, SGE, Cobalt, Flux) is part of the name for people to see, never what makes
it unique: two independent scripts of one allocation get two directories. Deriving it
locally means that a non-collective call, such as opening a private file on one rank, never
waits for other ranks; shared objects take rank 0's directory in their collective creation.
"""
from __future__ import annotations

import atexit
import errno
import fnmatch
import json
import os
import re
import shutil
import socket
import stat as _stat
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

from . import config
from .errors import (InvalidNameError, OutOfSpaceError, RefusedRemoval,  # noqa: F401
                     StorageError)
from .ownfiles import NotARegularFile, open_regular, read_bounded, write_all

BATCH_JOB_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "JOB_ID", "COBALT_JOBID",
                  "FLUX_JOB_ID")
JOB_PREFIX = "chemio-"
LEASE_PREFIX = ".lease."
MARKER_NAME = ".chemio-job.json"
MARKER_MAGIC = "chemio_py job directory"
MARKER_FORMAT = 1
RECORD_LIMIT = 4096             # leases and markers are far smaller; anything bigger is not ours
NO_LEASE_GRACE = 3600           # seconds a marked directory without any lease is left alone
_NAME_CHARS = re.compile(r"[A-Za-z0-9._+-]+")
_MAX_NAME = 200
_ATTEMPTS = 20


@dataclass
class _JobDir:
    path: str
    pid: int            # the process that created (or joined) it and removes its lease
    marked: bool        # carries chemio's marker: the last process out removes it


_lock = threading.RLock()
_job_dirs: dict[str, _JobDir] = {}      # job dir path -> entry, for dirs this process uses
_by_root: dict[str, str] = {}           # root -> this process's default job dir there
_owned: dict[str, tuple[int, Any]] = {}  # objects this process created -> (pid, remover)
_open_objects: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()  # -> pid
_forked = False                         # this process is a fork() child of a chemio process


def _after_fork_in_child() -> None:
    # The scratch, the open objects and their I/O threads are the parent's: the child starts
    # with empty registries (and its own job directory if it makes files).
    global _lock, _job_dirs, _by_root, _owned, _open_objects, _forked
    _lock = threading.RLock()
    _job_dirs = {}
    _by_root = {}
    _owned = {}
    _open_objects = weakref.WeakKeyDictionary()
    _forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def _char(c: str) -> str:
    return f"U+{ord(c):04X}"


def validate_name(name: Any) -> str:
    """Return ``name`` if it is a plain file name (letters, digits, ``._-+``), else raise."""
    if not isinstance(name, str):
        raise InvalidNameError(f"a scratch name must be a str, got {type(name).__name__} {name!r}")
    if _NAME_CHARS.fullmatch(name) and len(name) <= _MAX_NAME and ".." not in name \
            and name != ".":
        return name
    found = None
    for i, c in enumerate(name):
        if ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F:
            found = f"contains the control character {_char(c)} ({c!r}) at position {i}"
            break
    if found is None:
        if not name:
            found = "is empty"
        elif "/" in name:
            found = f"contains the path separator '/' at position {name.index('/')}"
        elif ".." in name:
            found = "contains '..'"
        elif len(name) > _MAX_NAME:
            found = f"is {len(name)} characters long (at most {_MAX_NAME})"
        elif name == ".":
            found = "is '.'"
        else:
            i, c = next((i, c) for i, c in enumerate(name) if not _NAME_CHARS.fullmatch(c))
            found = f"contains the character {c!r} ({_char(c)}) at position {i}"
    raise InvalidNameError(
        f"invalid scratch name {name!r}: it {found}; use 1-{_MAX_NAME} letters, digits and "
        f"'._-+' with no path separators and no '..' (e.g. 'fock.aoints'); pass dir= to choose "
        f"the directory")


# ---------------------------------------------------------------- where files go

@dataclass(frozen=True)
class ScratchEntry:
    path: str
    host: str | None = None     # only for this host (fnmatch pattern)
    rank: int | None = None     # only for this rank


def parse_scratch(text: str) -> list[ScratchEntry]:
    """Parse ``CHEMIO_SCRATCH``: comma-separated ``dir``, ``host:dir`` or ``RANK:dir``."""
    out = []
    for tok in (t.strip() for t in text.split(",")):
        if not tok:
            continue
        if ":" in tok and not tok.startswith("/"):
            key, path = tok.split(":", 1)
            if key.isdigit():
                out.append(ScratchEntry(os.path.expanduser(path), rank=int(key)))
            else:
                out.append(ScratchEntry(os.path.expanduser(path), host=key))
        else:
            out.append(ScratchEntry(os.path.expanduser(tok)))
    if not out:
        raise config.ConfigError(f"CHEMIO_SCRATCH={text!r} names no directory")
    return out


def private_root(rank: int = 0, host: str | None = None) -> str:
    """The scratch root for this rank's private files.

    A ``RANK:dir`` entry for this rank wins, then ``host:dir`` entries matching this host,
    then plain entries; with several candidates ranks are spread over them round-robin.
    """
    entries = parse_scratch(config.get("scratch"))
    host = host or socket.gethostname()
    for e in entries:
        if e.rank == rank:
            return e.path
    cands = [e for e in entries if e.host is not None and fnmatch.fnmatchcase(host, e.host)]
    if not cands:
        cands = [e for e in entries if e.host is None and e.rank is None]
    if not cands:
        raise config.ConfigError(
            f"CHEMIO_SCRATCH={config.get('scratch')!r} has no entry for rank {rank} on host "
            f"{host!r}; add a plain directory entry")
    return cands[rank % len(cands)].path


def shared_root() -> str:
    """The root for shared files and arrays (``CHEMIO_SHARED_SCRATCH`` or first plain entry)."""
    s: str | None = config.get("shared_scratch")
    if s:
        return os.path.expanduser(s)
    for e in parse_scratch(config.get("scratch")):
        if e.host is None and e.rank is None:
            return e.path
    return parse_scratch(config.get("scratch"))[0].path


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]", "_", text)[:64]


def _owner_pid() -> int:
    """The process that owns this process's job directory: the MPI launcher of this node's
    ranks (their common parent) under an MPI launcher, else this process. A fork() child
    owns its own, even under MPI (its parent is a rank, not a launcher)."""
    if not _forked:
        from .comm import launched_by_mpi
        if launched_by_mpi():
            return os.getppid()
    return os.getpid()


def job_id() -> str:
    """``[<batchid>-]<host>-<owner pid>``: unique per owning process group on a host."""
    owner = f"{_safe(socket.gethostname())}-{_owner_pid()}"
    for v in BATCH_JOB_VARS:
        val = os.environ.get(v)
        if val:
            return f"{_safe(val)}-{owner}"
    return owner


def _read_proc(path: str, limit: int = 4096) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(limit)


def _boot_id() -> str:
    try:
        return _read_proc("/proc/sys/kernel/random/boot_id", 256).decode().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _start_time(pid: int) -> str | None:
    """The start time of a process in clock ticks since boot; None if there is no such pid.

    Raises ``OSError`` when /proc cannot tell (not readable, not parseable)."""
    try:
        data = _read_proc(f"/proc/{pid}/stat")
    except (FileNotFoundError, ProcessLookupError):
        return None
    try:
        return data.rsplit(b")", 1)[1].split()[19].decode()
    except (IndexError, UnicodeDecodeError):
        raise OSError(errno.EIO, f"cannot parse /proc/{pid}/stat") from None


def _lease_name(pid: int | None = None) -> str:
    return f"{LEASE_PREFIX}{socket.gethostname()}.{os.getpid() if pid is None else pid}"


_WRITE_NEW = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def _write_lease(job_dir: str) -> None:
    pid = os.getpid()
    try:
        start = _start_time(pid)
    except OSError:
        start = None
    lease = {"format": 1, "host": socket.gethostname(), "boot_id": _boot_id(),
             "pidns": _pid_namespace(), "pid": pid, "start_time": start,
             "created": time.time(), "uid": os.geteuid()}
    fd = os.open(os.path.join(job_dir, _lease_name()), _WRITE_NEW | os.O_TRUNC, 0o600)
    try:
        write_all(fd, json.dumps(lease).encode())
    finally:
        os.close(fd)


def _write_marker(job_dir: str) -> bool:
    """Create chemio's marker in ``job_dir``; False when one is already there."""
    marker = {"magic": MARKER_MAGIC, "format": MARKER_FORMAT,
              "job": os.path.basename(job_dir), "host": socket.gethostname(),
              "pid": os.getpid(), "uid": os.geteuid(), "created": time.time()}
    try:
        fd = os.open(os.path.join(job_dir, MARKER_NAME), _WRITE_NEW | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    try:
        write_all(fd, json.dumps(marker).encode())
    finally:
        os.close(fd)
    return True


def _make_private_dir(path: str) -> bool:
    """Create a 0700 directory (True), or accept an existing real directory of ours (False)."""
    try:
        os.mkdir(path, 0o700)
        return True
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not _stat.S_ISDIR(st.st_mode):
        raise OSError(errno.ENOTDIR, f"{path!r} exists and is not a directory (a symlink?); "
                                     f"remove it or choose another CHEMIO_SCRATCH", path)
    if st.st_uid != os.geteuid():
        raise PermissionError(errno.EACCES, f"scratch directory {path!r} belongs to uid "
                                            f"{st.st_uid}, not to you; choose another "
                                            f"CHEMIO_SCRATCH", path)
    return False


def _join(path: str) -> bool:
    """Join an existing job directory; True when it carries (or now gets) chemio's marker.

    A directory holding nothing but leases is one being made by another process of this
    job (it writes the marker right after mkdir): it gets the marker. A directory holding
    other things without a marker was not made by this chemio; it is used, never marked.
    """
    names = os.listdir(path)            # the maker may write the marker at any moment
    if MARKER_NAME in names:
        return True
    if all(n.startswith(LEASE_PREFIX) for n in names):
        _write_marker(path)
        return True
    return os.path.lexists(os.path.join(path, MARKER_NAME))


def job_dir(root: str, jobid: str | None = None) -> str:
    """This job's directory under ``root``, created with this process's lease if needed."""
    root = os.path.abspath(root)
    with _lock:
        if jobid is None:
            d = _by_root.get(root)
            if d is not None and os.path.isdir(d):
                return d
        d = os.path.join(root, JOB_PREFIX + (jobid or job_id()))
        for attempt in range(_ATTEMPTS):
            try:
                if not os.path.isdir(root):
                    os.makedirs(root, mode=0o700, exist_ok=True)
                if _make_private_dir(d):
                    _write_marker(d)
                    marked = True
                else:
                    marked = _join(d)
                _write_lease(d)
                break
            except FileNotFoundError as e:
                # the last process of the job removed it as we arrived: make it again
                if attempt + 1 < _ATTEMPTS:
                    continue
                err: OSError = e
            except OSError as e:
                err = e
            raise StorageError(err.errno or errno.EIO, d, None, None,
                               "create the job scratch directory",
                               f"{err.strerror or err}; point CHEMIO_SCRATCH (or "
                               f"CHEMIO_SHARED_SCRATCH) at a directory you can write") from err
        _job_dirs[d] = _JobDir(d, os.getpid(), marked)
        if jobid is None:
            _by_root[root] = d
        return d


def private_path(name: str, rank: int, dir: str | None = None, root: str | None = None) -> str:
    """Where this rank's private file ``name`` lives: ``<name>.<rank>`` in its job dir or
    ``dir``."""
    fname = f"{validate_name(name)}.{rank}"
    if dir is not None:
        return os.path.join(os.path.abspath(os.path.expanduser(dir)), fname)
    return os.path.join(job_dir(root or private_root(rank)), fname)


def in_job_dir(path: str) -> bool:
    """True when ``path`` lies directly inside a job dir this process created or joined."""
    parent = os.path.dirname(os.path.abspath(path))
    with _lock:
        j = _job_dirs.get(parent)
        return j is not None and j.pid == os.getpid()


# ---------------------------------------------------------------- ownership and cleanup

def own(path: str, remove: Any = None) -> None:
    """Record that this process created ``path`` in its scratch and removes it at cleanup,
    with ``remove(path)`` (the backend's, for the files or directories it makes) or, by
    default, as a plain file or directory."""
    if in_job_dir(path):
        with _lock:
            _owned[os.path.abspath(path)] = (os.getpid(), remove or remove_path)


def remove_path(path: str) -> bool:
    """Remove a file, or a directory tree (never following links); False when absent."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if _stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)             # fd-based on Linux: does not follow links inside
    else:
        _unlink_quiet(path)
    return True


def disown(path: str) -> None:
    with _lock:
        _owned.pop(os.path.abspath(path), None)


def register_open(obj: Any) -> None:
    """Track an open file-like object; cleanup() in this process closes it with
    ``obj._release()`` (which must never be a collective call), else ``obj.close()``."""
    with _lock:
        _open_objects[obj] = os.getpid()


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _leave_job_dir(j: _JobDir) -> None:
    """Drop our lease; the last process out removes the marker and the directory."""
    try:
        _unlink_quiet(os.path.join(j.path, _lease_name(j.pid)))
        if not j.marked or any(n != MARKER_NAME for n in os.listdir(j.path)):
            return
        _unlink_quiet(os.path.join(j.path, MARKER_NAME))
    except OSError:
        return
    try:
        os.rmdir(j.path)
    except FileNotFoundError:
        pass
    except OSError:
        try:                            # a process of the job arrived meanwhile: re-mark
            if any(n.startswith(LEASE_PREFIX) for n in os.listdir(j.path)):
                _write_marker(j.path)
            else:
                os.rmdir(j.path)
        except OSError:
            pass


def cleanup() -> None:
    """Close this process's open chemio files and remove its scratch (unless CHEMIO_KEEP=1).

    Only what this very process (pid) created is removed: a fork() child never touches
    its parent's scratch."""
    pid = os.getpid()
    with _lock:
        objs = [o for o, who in list(_open_objects.items()) if who == pid]
    for obj in objs:
        try:
            release = getattr(obj, "_release", None)
            release() if release is not None else obj.close()
        except Exception:
            pass
    try:
        keep = config.get("keep")
    except Exception:
        keep = False
    with _lock:
        owned = [(p, rm) for p, (who, rm) in _owned.items() if who == pid]
        dirs = [j for j in _job_dirs.values() if j.pid == pid]
        if not keep:
            _owned.clear()
            _job_dirs.clear()
            _by_root.clear()
    if keep:
        return
    failed = []
    for path, remove in owned:          # one failure never stops the rest
        try:
            remove(path)
        except Exception as e:  # noqa: BLE001 - reported below
            failed.append(f"{path}: {type(e).__name__}: {e}")
    for j in dirs:
        _leave_job_dir(j)
    if failed:
        import warnings
        warnings.warn(f"chemio cleanup could not remove {len(failed)} scratch object(s) "
                      f"({'; '.join(failed[:5])}); `chemio clean` removes them once this "
                      f"job is gone", RuntimeWarning, stacklevel=2)


atexit.register(cleanup)


# ---------------------------------------------------------------- space and file systems

@dataclass(frozen=True)
class FsInfo:
    """Free and total bytes of the file system holding ``path`` and its type."""
    path: str
    free: int
    total: int
    fstype: str


def _existing_ancestor(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def fstype(path: str) -> str:
    """The file-system type of ``path`` from the mount table (ext4, xfs, tmpfs, nfs, lustre…)."""
    p = os.path.realpath(_existing_ancestor(path))
    best, kind = "", "unknown"
    try:
        with open("/proc/self/mounts") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def stat(path: str) -> FsInfo:
    """``FsInfo(path, free, total, fstype)`` for the file system holding ``path``."""
    p = _existing_ancestor(path)
    st = os.statvfs(p)
    return FsInfo(os.path.abspath(path), st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize,
                  fstype(p))


def check_space(path: str, needed: int, what: str = "reserve", free: int | None = None) -> None:
    """Raise ``OutOfSpaceError`` up front when ``needed`` bytes do not fit where ``path`` lives."""
    if needed <= 0:
        return
    if free is None:
        free = stat(path).free
    if needed > free:
        raise OutOfSpaceError(path, needed, free, what=what)


# ---------------------------------------------------------------- stale jobs

@dataclass
class JobDirInfo:
    """One ``chemio-*`` directory found by ``scan_job_dirs``.

    ``status`` is ``"stale"`` (chemio's marker, every lease provably dead: removable),
    ``"in use"`` (a lease's process runs), ``"keep"`` (not chemio's, or liveness cannot be
    proven either way), ``"vanished"`` (disappeared during the scan) or ``"skipped"`` (a
    root that cannot be listed); ``reason`` says why.
    """
    path: str
    leases: list[dict]
    status: str
    reason: str

    @property
    def alive(self) -> bool:
        """False only when the directory is stale and may be removed."""
        return self.status != "stale"


@dataclass(frozen=True)
class _Here:
    """What a lease is compared with: where and as whom this process runs."""
    host: str
    boot_id: str
    pidns: str | None
    proc_ok: bool           # /proc shows this process's own pid namespace
    uid: int


def _here() -> _Here:
    try:
        proc_ok = os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        proc_ok = False
    return _Here(socket.gethostname(), _boot_id(), _pid_namespace(), proc_ok, os.geteuid())


def printable(text: str) -> str:
    """``text`` as is when printable, else its repr (names found on disk may hold anything)."""
    return text if text.isprintable() else repr(text)


def _read_record(path: str, limit: int = RECORD_LIMIT) -> tuple[bytes, os.stat_result]:
    """Content and status of one of chemio's small record files (lease, marker).

    Opened without following links or blocking (``ownfiles.open_regular``) and read with a
    bound; raises ``NotARegularFile``, ``ValueError`` (too big) or ``OSError``.
    """
    fd = open_regular(path)
    try:
        st = os.fstat(fd)
        if st.st_size > limit:
            raise ValueError(f"holds {st.st_size} bytes, more than the {limit} of a file "
                             f"chemio writes")
        return read_bounded(fd, limit, "it"), st
    finally:
        os.close(fd)


def _parse_lease(data: bytes) -> dict:
    lease = json.loads(data)
    if not isinstance(lease, dict):
        raise ValueError(f"a JSON {type(lease).__name__}, not an object")
    for key, types in (("host", str), ("pid", int), ("uid", int), ("boot_id", str)):
        v = lease.get(key)
        if not isinstance(v, types) or isinstance(v, bool):
            raise ValueError(f"{key!r} is {v!r}")
    if lease["pid"] <= 0:
        raise ValueError(f"'pid' is {lease['pid']}")
    for key in ("start_time", "pidns"):
        if not isinstance(lease.get(key), (str, type(None))):
            raise ValueError(f"{key!r} is {lease.get(key)!r}")
    return lease


_ALIVE, _DEAD, _UNKNOWN = "alive", "dead", "unknown"


def _lease_verdict(lease: dict, here: _Here) -> tuple[str, str]:
    """Whether the lease's process runs: alive, dead (provably gone) or unknown."""
    pid, host = lease["pid"], lease["host"]
    if lease["uid"] != here.uid:
        return _UNKNOWN, f"pid {pid} ran as uid {lease['uid']}, not as you (uid {here.uid})"
    if host != here.host:
        return _UNKNOWN, f"pid {pid} runs on host {host!r}: cannot check it from here"
    if not here.proc_ok:
        return _UNKNOWN, (f"/proc is not readable here or shows another pid namespace: "
                          f"cannot check pid {pid}")
    if not here.boot_id or lease["boot_id"] != here.boot_id:
        return _UNKNOWN, (f"pid {pid} was started during another boot of {printable(host)} "
                          f"(or on another machine of that name): cannot tell")
    if not lease.get("pidns") or lease["pidns"] != here.pidns:
        return _UNKNOWN, (f"pid {pid} lives in another pid namespace "
                          f"({printable(str(lease.get('pidns')))}, here {here.pidns}): "
                          f"cannot see it from here")
    try:
        start = _start_time(pid)
    except OSError as e:
        return _UNKNOWN, f"cannot read /proc/{pid}: {e.strerror or e}"
    if start is None:
        return _DEAD, f"pid {pid} is gone"
    if lease.get("start_time") is None:
        return _ALIVE, f"pid {pid} is running (its start time was not recorded)"
    if start != lease["start_time"]:
        return _DEAD, f"pid {pid} now belongs to another process"
    return _ALIVE, f"pid {pid} is running"


def _marker_problem(d: str, here: _Here) -> str | None:
    """None when ``d`` carries a valid chemio marker of ours, else what is wrong."""
    p = os.path.join(d, MARKER_NAME)
    try:
        data, st = _read_record(p)
    except FileNotFoundError:
        if not os.path.lexists(d):
            raise
        return (f"no chemio marker ({MARKER_NAME}): not made by chemio, or by a version "
                f"before markers")
    except NotARegularFile as e:
        return f"its marker {MARKER_NAME} {e.strerror}"
    except ValueError as e:
        return f"its marker {MARKER_NAME} {e}"
    except OSError as e:
        return f"its marker {MARKER_NAME} cannot be read: {e.strerror or e}"
    if st.st_uid != here.uid:
        return f"its marker belongs to uid {st.st_uid}, not to you (uid {here.uid})"
    try:
        m = json.loads(data)
    except ValueError:
        return f"its marker {MARKER_NAME} is not chemio's (not JSON)"
    if not isinstance(m, dict) or m.get("magic") != MARKER_MAGIC:
        return f"its marker {MARKER_NAME} is not chemio's (no chemio magic)"
    if m.get("format") != MARKER_FORMAT:
        return (f"its marker has format {m.get('format')!r}, which this chemio version "
                f"does not know")
    return None


def _examine(d: str, here: _Here) -> JobDirInfo | None:
    """The verdict on one ``<root>/chemio-*`` entry; None when it is not a directory."""
    def vanished() -> JobDirInfo:
        return JobDirInfo(d, [], "vanished", "disappeared during the scan")

    def keep(why: str, leases: list[dict] | None = None) -> JobDirInfo:
        return JobDirInfo(d, leases or [], "keep", why)

    try:
        st = os.lstat(d)
    except FileNotFoundError:
        return vanished()
    if not _stat.S_ISDIR(st.st_mode):
        return None
    if st.st_uid != here.uid:
        return keep(f"belongs to uid {st.st_uid}, not to you (uid {here.uid})")
    try:
        problem = _marker_problem(d, here)
    except FileNotFoundError:
        return vanished()
    if problem is not None:
        return keep(f"{problem}; chemio removes only directories it marked")
    try:
        names = sorted(os.listdir(d))
    except FileNotFoundError:
        return vanished()
    except OSError as e:
        return keep(f"cannot list it: {e.strerror or e}")
    leases: list[dict] = []
    verdicts: list[tuple[str, str]] = []
    for n in names:
        if not n.startswith(LEASE_PREFIX):
            continue
        what = f"lease {printable(n)}"
        try:
            data, lst = _read_record(os.path.join(d, n))
        except FileNotFoundError:
            continue                    # its process just left
        except NotARegularFile as e:
            verdicts.append((_UNKNOWN, f"{what} {e.strerror}"))
            continue
        except ValueError as e:
            verdicts.append((_UNKNOWN, f"{what} {e}"))
            continue
        except OSError as e:
            verdicts.append((_UNKNOWN, f"{what} cannot be read: {e.strerror or e}"))
            continue
        if lst.st_uid != here.uid:
            verdicts.append((_UNKNOWN, f"{what} belongs to uid {lst.st_uid}, not to you "
                                       f"(uid {here.uid})"))
            continue
        try:
            lease = _parse_lease(data)
        except ValueError as e:
            verdicts.append((_UNKNOWN, f"{what} cannot be parsed ({e})"))
            continue
        leases.append(lease)
        verdicts.append(_lease_verdict(lease, here))
    alive = [r for v, r in verdicts if v == _ALIVE]
    unknown = [r for v, r in verdicts if v == _UNKNOWN]
    if alive:
        return JobDirInfo(d, leases, "in use", "; ".join(alive))
    if unknown:
        return keep("cannot tell whether its job ended: " + "; ".join(unknown)
                    + "; remove it by hand once you know the job has ended", leases)
    if not verdicts:
        try:
            age = time.time() - os.lstat(d).st_mtime
        except FileNotFoundError:
            return vanished()
        if age < NO_LEASE_GRACE:
            return keep(f"no lease, last changed {age:.0f} s ago (a job may be starting; "
                        f"removed after {NO_LEASE_GRACE} s without a lease)")
        return JobDirInfo(d, leases, "stale", f"no lease, last changed {age:.0f} s ago")
    return JobDirInfo(d, leases, "stale", "; ".join(r for _, r in verdicts))


def scan_job_dirs(roots: Iterable[str]) -> list[JobDirInfo]:
    """Every ``chemio-*`` directory under ``roots`` with its verdict (see ``JobDirInfo``).

    Never raises for what it finds: hostile, unreadable or vanishing entries become
    verdicts with a reason, and nothing is ever read without a bound or blocking.
    """
    here = _here()
    out = []
    for root in dict.fromkeys(os.path.abspath(r) for r in roots):
        try:
            names = os.listdir(root)
        except FileNotFoundError:
            continue
        except OSError as e:
            out.append(JobDirInfo(root, [], "skipped",
                                  f"cannot list this scratch root: {e.strerror or e}"))
            continue
        for n in sorted(names):
            if not n.startswith(JOB_PREFIX):
                continue
            d = os.path.join(root, n)
            try:
                info = _examine(d, here)
            except FileNotFoundError:
                info = JobDirInfo(d, [], "vanished", "disappeared during the scan")
            except Exception as e:      # keep, never abort the scan
                info = JobDirInfo(d, [], "keep", f"cannot examine it: {type(e).__name__}: {e}")
            if info is not None:
                out.append(info)
    return out


def all_roots() -> list[str]:
    """Every scratch root chemio may use on this host: private, shared and shm."""
    roots = [e.path for e in parse_scratch(config.get("scratch"))
             if e.host is None or fnmatch.fnmatchcase(socket.gethostname(), e.host)]
    roots.append(shared_root())
    roots.append(config.get("shm_dir"))
    return list(dict.fromkeys(os.path.abspath(r) for r in roots))


def _removal_phase(name: str) -> int:
    return 2 if name == MARKER_NAME else 1 if name.startswith(LEASE_PREFIX) else 0


def _remove_tree(path: str) -> None:
    """Remove a job directory: data first, then leases, then the marker, then the directory.

    Entries vanishing meanwhile are fine. When something cannot be removed, the leases and
    the marker stay (a later ``chemio clean`` tries again) and ``StorageError`` says what.
    """
    failures: list[tuple[str, BaseException]] = []

    def onerror(func: Any, p: str, exc_info: Any) -> None:
        if not isinstance(exc_info[1], FileNotFoundError):
            failures.append((p, exc_info[1]))

    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        names = os.listdir(dfd)
        for phase in (0, 1, 2):
            if failures:
                break
            for n in (n for n in names if _removal_phase(n) == phase):
                try:
                    st = os.lstat(n, dir_fd=dfd)
                    if _stat.S_ISDIR(st.st_mode):
                        shutil.rmtree(n, dir_fd=dfd, onerror=onerror)
                    else:
                        os.unlink(n, dir_fd=dfd)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    failures.append((os.path.join(path, n), e))
    finally:
        os.close(dfd)
    if not failures:
        try:
            os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            failures.append((path, e))
    if failures:
        p, err = failures[0]
        code = getattr(err, "errno", None) or errno.EIO
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        raise StorageError(code, path, None, None, "remove the stale job directory",
                           f"{printable(p)}: {getattr(err, 'strerror', None) or err}{more}; fix "
                           f"that and run 'chemio clean' again") from err


def remove_job_dir(path: str, roots: Iterable[str]) -> bool:
    """Remove a stale job directory; True when removed, False when it was already gone.

    Raises ``RefusedRemoval`` (a ``ValueError``) for anything that is not
    ``<root>/chemio-*`` in one of ``roots``, is a link, has no valid chemio marker or has a
    lease whose process is not provably gone (checked again here), and ``StorageError``
    when part of it could not be removed.
    """
    path = os.path.abspath(path)
    parent, base = os.path.split(path)
    if parent not in {os.path.abspath(r) for r in roots} or not base.startswith(JOB_PREFIX):
        raise RefusedRemoval(f"refusing to remove {path!r}: not a chemio job directory in a "
                             f"scratch root")
    if os.path.islink(path):
        raise RefusedRemoval(f"refusing to remove {path!r}: it is a symbolic link")
    try:
        info = _examine(path, _here())
    except FileNotFoundError:
        return False
    if info is None:
        raise RefusedRemoval(f"refusing to remove {path!r}: it is not a directory")
    if info.status == "vanished":
        return False
    if info.status != "stale":
        raise RefusedRemoval(f"refusing to remove {path!r}: {info.status}: {info.reason}")
    _remove_tree(path)
    return True
