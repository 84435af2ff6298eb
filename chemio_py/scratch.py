"""Job scratch directories: where files go, who owns them, and how they are cleaned up.

Each job gets ``<root>/chemio-<jobid>/`` (directory 0700) holding one lease file per process
(host, boot id, pid, process start time). Files a process creates there are removed when it
calls ``cio.cleanup()`` or exits (unless ``CHEMIO_KEEP=1``); ``chemio clean`` removes job
directories whose every lease belongs to a process that is gone.

The job id comes from the batch system (Slurm, PBS, LSF, SGE, Cobalt, Flux) when present.
Otherwise it is derived without communication: under an MPI launcher from the launcher
process that started the ranks of a node (their common parent), else from this process.
Deriving it locally means that a non-collective call, such as opening a private file on one
rank, never waits for other ranks; shared objects take rank 0's directory in their
collective creation.
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
from .errors import InvalidNameError, OutOfSpaceError, StorageError

BATCH_JOB_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "JOB_ID", "COBALT_JOBID",
                  "FLUX_JOB_ID")
JOB_PREFIX = "chemio-"
LEASE_PREFIX = ".lease."
_NAME_RE = re.compile(r"^[A-Za-z0-9._+-]{1,200}$")

_lock = threading.RLock()
_job_dirs: dict[str, str] = {}          # root -> job dir created by this process
_owned: set[str] = set()                # files this process created and must remove
_open_objects: "weakref.WeakSet[Any]" = weakref.WeakSet()


def validate_name(name: Any) -> str:
    """Return ``name`` if it is a plain file name (letters, digits, ``._-+``), else raise."""
    if not isinstance(name, str):
        raise InvalidNameError(f"a scratch name must be a str, got {type(name).__name__} {name!r}")
    if not _NAME_RE.match(name) or name in (".", "..") or ".." in name:
        raise InvalidNameError(
            f"invalid scratch name {name!r}: use 1-200 letters, digits and '._-+' with no "
            f"path separators and no '..' (e.g. 'fock.aoints'); pass dir= to choose the directory")
    return name


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
    s = config.get("shared_scratch")
    if s:
        return os.path.expanduser(s)
    for e in parse_scratch(config.get("scratch")):
        if e.host is None and e.rank is None:
            return e.path
    return parse_scratch(config.get("scratch"))[0].path


def job_id() -> str:
    for v in BATCH_JOB_VARS:
        val = os.environ.get(v)
        if val:
            return re.sub(r"[^A-Za-z0-9._+-]", "_", val)
    from .comm import launched_by_mpi
    host = re.sub(r"[^A-Za-z0-9._+-]", "_", socket.gethostname())
    pid = os.getppid() if launched_by_mpi() else os.getpid()
    return f"{host}-{pid}"


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> str | None:
    """The start time of a process in clock ticks since boot (None if there is no such pid)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            data = fh.read()
    except OSError:
        return None
    return data.rsplit(")", 1)[1].split()[19]


def _lease_name() -> str:
    return f"{LEASE_PREFIX}{socket.gethostname()}.{os.getpid()}"


def _write_lease(job_dir: str) -> None:
    lease = {"host": socket.gethostname(), "boot_id": _boot_id(), "pid": os.getpid(),
             "start_time": _start_time(os.getpid()), "created": time.time(),
             "uid": os.getuid()}
    path = os.path.join(job_dir, _lease_name())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(lease, fh)


def _make_private_dir(path: str) -> None:
    """Create a 0700 directory, or accept an existing real directory of ours."""
    try:
        os.mkdir(path, 0o700)
        return
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not _stat.S_ISDIR(st.st_mode):
        raise OSError(errno.ENOTDIR, f"{path!r} exists and is not a directory (a symlink?); "
                                     f"remove it or choose another CHEMIO_SCRATCH", path)
    if st.st_uid != os.getuid():
        raise PermissionError(errno.EACCES, f"scratch directory {path!r} belongs to uid "
                                            f"{st.st_uid}, not to you; choose another CHEMIO_SCRATCH", path)


def job_dir(root: str, jobid: str | None = None) -> str:
    """This job's directory under ``root``, created with this process's lease if needed."""
    root = os.path.abspath(root)
    with _lock:
        d = _job_dirs.get(root)
        if d is not None and jobid is None and os.path.isdir(d):
            return d
        d = os.path.join(root, JOB_PREFIX + (jobid or job_id()))
        try:
            if not os.path.isdir(root):
                os.makedirs(root, mode=0o700, exist_ok=True)
            _make_private_dir(d)
        except OSError as e:
            raise StorageError(e.errno or errno.EIO, d, None, None, "create the job scratch directory",
                               f"{e.strerror or e}; point CHEMIO_SCRATCH (or "
                               f"CHEMIO_SHARED_SCRATCH) at a directory you can write") from e
        _write_lease(d)
        _job_dirs[root] = d
        return d


def private_path(name: str, rank: int, dir: str | None = None, root: str | None = None) -> str:
    """Where this rank's private file ``name`` lives: ``<name>.<rank>`` in its job dir or ``dir``."""
    fname = f"{validate_name(name)}.{rank}"
    if dir is not None:
        return os.path.join(os.path.abspath(os.path.expanduser(dir)), fname)
    return os.path.join(job_dir(root or private_root(rank)), fname)


def in_job_dir(path: str) -> bool:
    """True when ``path`` lies directly inside a job dir this process created."""
    parent = os.path.dirname(os.path.abspath(path))
    with _lock:
        return parent in _job_dirs.values()


# ---------------------------------------------------------------- ownership and cleanup

def own(path: str) -> None:
    """Record that this process created ``path`` in its scratch and removes it at cleanup."""
    if in_job_dir(path):
        with _lock:
            _owned.add(os.path.abspath(path))


def disown(path: str) -> None:
    with _lock:
        _owned.discard(os.path.abspath(path))


def register_open(obj: Any) -> None:
    """Track an open file-like object; cleanup() closes it (``obj.close()``)."""
    _open_objects.add(obj)


def _remove_owned(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def cleanup() -> None:
    """Close this process's open chemio files and remove its scratch (unless CHEMIO_KEEP=1)."""
    for obj in list(_open_objects):
        try:
            obj.close()
        except Exception:
            pass
    try:
        keep = config.get("keep")
    except Exception:
        keep = False
    with _lock:
        owned = list(_owned)
        dirs = list(_job_dirs.values())
        if not keep:
            _owned.clear()
            _job_dirs.clear()
    if keep:
        return
    for path in owned:
        _remove_owned(path)
    for d in dirs:
        try:
            os.unlink(os.path.join(d, _lease_name()))
        except FileNotFoundError:
            pass
        try:
            os.rmdir(d)        # only when empty: other processes of the job may still use it
        except OSError:
            pass


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
    path: str
    leases: list[dict]
    alive: bool
    reason: str


def _lease_alive(lease: dict) -> tuple[bool | None, str]:
    """True/False when we can tell whether the lease's process lives; None for another host."""
    if lease.get("host") != socket.gethostname():
        return None, f"process on host {lease.get('host')!r} (cannot check from here)"
    if lease.get("boot_id") and lease.get("boot_id") != _boot_id():
        return False, f"pid {lease.get('pid')} from an earlier boot"
    pid = lease.get("pid")
    if not isinstance(pid, int):
        return False, "lease without a pid"
    st = _start_time(pid)
    if st is None:
        return False, f"pid {pid} is gone"
    if lease.get("start_time") is not None and st != lease.get("start_time"):
        return False, f"pid {pid} now belongs to another process"
    return True, f"pid {pid} is running"


def scan_job_dirs(roots: Iterable[str]) -> list[JobDirInfo]:
    """Job directories under ``roots`` with whether any of their processes still runs."""
    out = []
    for root in dict.fromkeys(os.path.abspath(r) for r in roots):
        try:
            names = os.listdir(root)
        except OSError:
            continue
        for n in sorted(names):
            d = os.path.join(root, n)
            if not n.startswith(JOB_PREFIX) or not _stat.S_ISDIR(os.lstat(d).st_mode):
                continue
            leases = []
            try:
                for ln in os.listdir(d):
                    if ln.startswith(LEASE_PREFIX):
                        try:
                            with open(os.path.join(d, ln)) as fh:
                                leases.append(json.load(fh))
                        except (OSError, ValueError):
                            pass
            except OSError:
                continue
            verdicts = [_lease_alive(lease) for lease in leases]
            if any(v is True for v, _ in verdicts):
                alive, why = True, "; ".join(r for v, r in verdicts if v)
            elif any(v is None for v, _ in verdicts):
                alive, why = True, "; ".join(r for v, r in verdicts if v is None)
            elif not leases:
                age = time.time() - os.lstat(d).st_mtime
                alive, why = age < 3600, f"no lease, last changed {age:.0f} s ago"
            else:
                alive, why = False, "; ".join(r for _, r in verdicts)
            out.append(JobDirInfo(d, leases, alive, why))
    return out


def all_roots() -> list[str]:
    """Every scratch root chemio may use on this host: private, shared and shm."""
    roots = [e.path for e in parse_scratch(config.get("scratch"))
             if e.host is None or fnmatch.fnmatchcase(socket.gethostname(), e.host)]
    roots.append(shared_root())
    roots.append(config.get("shm_dir"))
    return list(dict.fromkeys(os.path.abspath(r) for r in roots))


def remove_job_dir(path: str, roots: Iterable[str]) -> None:
    """Remove a stale job directory; refuses anything that is not ``<root>/chemio-*``."""
    path = os.path.abspath(path)
    parent, base = os.path.split(path)
    if parent not in {os.path.abspath(r) for r in roots} or not base.startswith(JOB_PREFIX):
        raise ValueError(f"refusing to remove {path!r}: not a chemio job directory in a scratch root")
    if os.path.islink(path):
        raise ValueError(f"refusing to remove {path!r}: it is a symbolic link")
    shutil.rmtree(path)   # fd-based on Linux: does not follow symlinks inside
