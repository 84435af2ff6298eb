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
that started the ranks of a node (hydra_pmi_proxy, prterun/prted, slurmstepd: the nearest
ancestor not started with the rank's launcher variables, so that wrappers which do not
``exec``, ``sh -c 'python ...'`` or a run.sh, are passed over), else this process. The batch
job id (Slurm, PBS, LSF, SGE, Cobalt, Flux) is part of the name for people to see, never what
makes it unique: two independent scripts of one allocation get two directories. Deriving it
locally means that a non-collective call, such as opening a private file on one rank, never
waits for other ranks; shared objects take rank 0's directory in their collective creation.

On SIGTERM (a job's walltime) a handler installed with the first scratch removes this
process's scratch by path, then chains to the handler that was there before, or ends the
process as SIGTERM would have (``CHEMIO_SIGTERM_CLEANUP=0`` turns this off).
"""
from __future__ import annotations

import atexit
import errno
import fnmatch
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import stat as _stat
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from chemio_py.errors import InvalidNameError, StorageError
from chemio_py.runtime import config, finalizers
from chemio_py.runtime.ownfiles import write_all

_log = logging.getLogger(__name__)

BATCH_JOB_VARS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "JOB_ID", "COBALT_JOBID",
                  "FLUX_JOB_ID")
JOB_PREFIX = "chemio-"
LEASE_PREFIX = ".lease."
MARKER_NAME = ".chemio-job.json"
MARKER_MAGIC = "chemio_py job directory"
MARKER_FORMAT = 1
RECORD_LIMIT = 4096             # leases and markers are far smaller; anything bigger is not ours
NO_LEASE_GRACE = 3600           # seconds a marked directory without any lease is left alone
ALIVE, DEAD, UNKNOWN = "alive", "dead", "unknown"    # verdicts on a writer or a job
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


_owner: str | None = None               # _job_owner(), found once per process


def _after_fork_in_child() -> None:
    # The scratch, the open objects and their I/O threads are the parent's: the child starts
    # with empty registries (and its own job directory if it makes files).
    global _lock, _job_dirs, _by_root, _owned, _open_objects, _forked, _owner
    _lock = threading.RLock()
    _job_dirs = {}
    _by_root = {}
    _owned = {}
    _open_objects = weakref.WeakKeyDictionary()
    _forked = True
    _owner = None


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


def safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]", "_", text)[:64]


# Variables an MPI launcher gives each rank. A wrapper that does not exec (``sh -c``, a
# run.sh) was started with the rank's own values of them; the launcher process that started
# the rank (hydra_pmi_proxy, prterun/prted, slurmstepd) was not.
_RANK_VARS = ("PMI_RANK", "PMI_SIZE", "PMI_FD", "PMIX_RANK", "PMIX_NAMESPACE",
              "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK",
              "ALPS_APP_PE", "MPI_LOCALRANKID", "SLURM_PROCID", "SLURM_STEP_ID")
_MAX_WRAPPERS = 16                      # ancestors looked at before giving up
_ENVIRON_LIMIT = 1 << 24                # bytes of /proc/<pid>/environ read at most


def _parent_of(pid: int) -> int:
    """The parent pid of ``pid`` from /proc (0: none visible); raises ``OSError``."""
    data = _read_proc(f"/proc/{pid}/stat")
    try:
        return int(data.rsplit(b")", 1)[1].split()[1])
    except (IndexError, ValueError):
        raise OSError(errno.EIO, f"cannot parse /proc/{pid}/stat") from None


def _started_with(pid: int, names: set[bytes]) -> dict[bytes, bytes]:
    """The variables ``names`` in the environment ``pid`` was started with; raises
    ``OSError``."""
    data = _read_proc(f"/proc/{pid}/environ", _ENVIRON_LIMIT)
    pairs = (item.partition(b"=")[::2] for item in data.split(b"\0") if item)
    return {k: v for k, v in pairs if k in names}


def _launcher_pid() -> int | None:
    """The launcher process that started this MPI rank on this node; None when /proc cannot
    tell (not mounted, another pid namespace, an ancestor outside it).

    It is the nearest ancestor not started with this rank's launcher variables: the ranks of
    one launch on a node share it, wrappers that do not exec are passed over, and two
    launches (two ``mpiexec`` in one allocation) never share it while both run. An ancestor
    whose environment may not be read (another user's, e.g. root's slurmstepd) is no
    wrapper of ours: it is the launcher."""
    from chemio_py.runtime.comm import LAUNCHER_VARS
    names = {v.encode() for v in (*_RANK_VARS, *LAUNCHER_VARS)}
    try:
        if os.readlink("/proc/self") != str(os.getpid()):
            return None
        mine = _started_with(os.getpid(), names)    # as started, like the ancestors'
        if not mine:
            return None
        pid = os.getppid()
        for _ in range(_MAX_WRAPPERS):
            if pid <= 1:
                return None
            try:
                if _started_with(pid, names) != mine:
                    return pid
            except PermissionError:
                return pid
            pid = _parent_of(pid)
    except OSError:
        return None
    return None


def _launch_id() -> str | None:
    """The launch this rank belongs to as its launcher names it in the environment (PMIx
    namespace, Open MPI job id, Slurm step, Cray PALS/ALPS application id); None when the
    launcher names none (MPICH's hydra does not)."""
    env = os.environ
    for v in ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "PALS_APID", "ALPS_APP_ID"):
        if env.get(v):
            return f"{v}={env[v]}"
    if env.get("SLURM_JOB_ID") and env.get("SLURM_STEP_ID"):
        return f"slurm={env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}"
    return None


def _job_owner() -> str:
    """What names this process's job directory on its host: the pid of the MPI launcher of
    this node's ranks (see ``_launcher_pid``) under an MPI launcher, else this process's pid.
    A fork() child owns its own, even under MPI (its parent is a rank, not a launcher). A
    rank whose launcher /proc cannot show takes the launch id its launcher set
    (``launch-<hash>``), else its own pid: never the directory of another launch."""
    global _owner
    if _owner is None:
        owner: str | int = os.getpid()
        if not _forked:
            from chemio_py.runtime.comm import launched_by_mpi
            if launched_by_mpi():
                launcher, launch = _launcher_pid(), _launch_id()
                if launcher is not None:
                    owner = launcher
                elif launch is not None:
                    owner = "launch-" + hashlib.sha1(launch.encode()).hexdigest()[:12]
        _owner = str(owner)
    return _owner


def job_id() -> str:
    """``[<batchid>-]<host>-<owner>[-ns<hex>]``: unique per owning process group on a host
    (see ``_job_owner``) and, outside the host's pid namespace, per pid namespace (see
    ``namespace_tag``)."""
    owner = f"{safe_name(socket.gethostname())}-{_job_owner()}"
    tag = namespace_tag()
    if tag:
        owner = f"{owner}-{tag}"
    for v in BATCH_JOB_VARS:
        val = os.environ.get(v)
        if val:
            return f"{safe_name(val)}-{owner}"
    return owner


def _read_proc(path: str, limit: int = 4096) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(limit)


def read_boot_id() -> str:
    try:
        return _read_proc("/proc/sys/kernel/random/boot_id", 256).decode().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


INIT_PID_NAMESPACE = "pid:[4026531836]"     # the host's (PROC_PID_INIT_INO, 0xEFFFFFFC)
_ns_tag: str | None = None              # namespace_tag(), found once per process


def namespace_tag() -> str:
    """``""`` in the host's pid namespace (or when /proc cannot tell), else ``ns<12 hex>``
    naming this pid namespace on this boot of this machine.

    Pids are unique only within a pid namespace: two containers (``--pid``, ``unshare
    --pid``) sharing a scratch root and host name both run as pid 1. What chemio names after
    a pid (job directory, lease, temp file) carries this tag, so they never share one."""
    global _ns_tag
    if _ns_tag is None:
        ns = pid_namespace()
        if ns is None or ns == INIT_PID_NAMESPACE:
            _ns_tag = ""
        else:
            _ns_tag = "ns" + hashlib.sha1(f"{read_boot_id()}:{ns}".encode()).hexdigest()[:12]
    return _ns_tag


def _lease_host() -> str:
    """The host part of this process's lease names: the host name, then ``.<namespace
    tag>`` outside the host's pid namespace."""
    tag = namespace_tag()
    return f"{socket.gethostname()}.{tag}" if tag else socket.gethostname()


def process_start_time(pid: int) -> str | None:
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
    """``.lease.<host>[.ns<hex>].<pid>``: one per process of a job directory (see
    ``namespace_tag``)."""
    return f"{LEASE_PREFIX}{_lease_host()}.{os.getpid() if pid is None else pid}"


TEMP_AGE = 600          # seconds after which a chemio temp file is stale, whoever wrote it
_NAME_MAX = 255
_TEMP_TAIL = re.compile(r"(\d+)(?:\.([0-9a-f]{8})\.(\d+)\.([0-9a-f]{8}))?")


def _writer_tag() -> str:
    """8 hex naming this machine (host name and boot) and pid namespace: where the pid in a
    temp file's name means this process."""
    where = f"{socket.gethostname()}:{read_boot_id()}:{pid_namespace()}"
    return hashlib.sha1(where.encode()).hexdigest()[:8]


def _temp_stem(path: str) -> str:
    """``<dir>/.<name>.tmp`` for ``path``, its name shortened so a temp name fits a
    directory entry."""
    d, base = os.path.split(os.path.abspath(path))
    return os.path.join(d, f".{base[:_NAME_MAX - 48]}.tmp")


def temp_path(path: str) -> str:
    """A fresh name beside ``path`` for a temp file to replace it atomically:
    ``.<name>.tmp<pid>.<where>.<thread>.<random>``, distinct for every process (pid
    namespace and machine included), thread and call. Create it with ``O_EXCL``."""
    return (f"{_temp_stem(path)}{os.getpid()}.{_writer_tag()}.{threading.get_native_id()}."
            f"{os.urandom(4).hex()}")


_TEMP_NAME = re.compile(r"\.(.+)\.tmp(" + _TEMP_TAIL.pattern + ")", re.S)
_REUSE_MARGIN = 60      # seconds a process may seem to start after its temp file's mtime


def _boot_time() -> float | None:
    """The wall-clock time of this boot (``btime`` of /proc/stat); None when unknown."""
    try:
        for line in _read_proc("/proc/stat", 1 << 20).splitlines():
            if line.startswith(b"btime "):
                return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _temp_verdict(tail: str, st: os.stat_result) -> tuple[str, str] | None:
    """Whether the writer of a temp file (``tail``: what follows ``.tmp`` in its name,
    ``st``: its lstat) still runs: ``(alive|dead|unknown, why)``; None when it is not a
    temp file of chemio's that this user owns (left alone, not reported).

    Dead only when provable: the name's writer tag is this machine's, boot's and pid
    namespace's, /proc shows this namespace, and the pid is gone, a zombie, a process
    that started after the file was last written (the pid was reused), or the writing
    thread (its native id is in the name) has ended. A live thread's temp is never dead."""
    m = _TEMP_TAIL.fullmatch(tail)
    if m is None or not _stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        return None
    pid = int(m.group(1))
    if m.group(2) is None:
        return UNKNOWN, (f"written by pid {pid} of a chemio version that did not name "
                          f"its machine and thread: cannot tell")
    if m.group(2) != _writer_tag():
        return UNKNOWN, (f"written by pid {pid} on another machine, boot or pid "
                          f"namespace: cannot check it from here")
    try:
        if os.readlink("/proc/self") != str(os.getpid()):
            raise OSError
    except OSError:
        return UNKNOWN, (f"/proc is not readable here or shows another pid namespace: "
                          f"cannot check pid {pid}")
    tid = int(m.group(3))
    if pid != os.getpid():
        try:
            state = _read_proc(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()
            start = int(state[19])
        except (FileNotFoundError, ProcessLookupError):
            return DEAD, f"its writer, pid {pid}, is gone"
        except (OSError, IndexError, ValueError) as e:
            return UNKNOWN, f"cannot read /proc/{pid}: {getattr(e, 'strerror', None) or e}"
        if state[0] in (b"Z", b"X"):
            return DEAD, f"its writer, pid {pid}, has exited"
        boot = _boot_time()
        if boot is not None:
            started = boot + start / os.sysconf("SC_CLK_TCK")
            if started > st.st_mtime + _REUSE_MARGIN:
                return DEAD, (f"pid {pid} now belongs to another process (started "
                               f"{started - st.st_mtime:.0f} s after the file was written)")
    if not os.path.exists(f"/proc/{pid}/task/{tid}"):
        if os.path.exists(f"/proc/{pid}"):
            return DEAD, f"thread {tid} of pid {pid}, its writer, has ended"
        return DEAD, f"its writer, pid {pid}, is gone"
    return ALIVE, f"its writer, thread {tid} of pid {pid}, is running"


def _temp_is_stale(name: str, tail: str, st: os.stat_result, now: float) -> bool:
    """Whether the temp file ``name`` (``tail``: what follows ``.tmp``) is a dead writer's:
    its writer (of this machine, boot and pid namespace) is provably gone
    (``_temp_verdict``), or cannot be checked and the file is older than ``TEMP_AGE``.
    Only regular files of this user qualify; a live writer's file never does."""
    verdict = _temp_verdict(tail, st)
    if verdict is None or verdict[0] == ALIVE:
        return False
    return verdict[0] == DEAD or now - st.st_mtime > TEMP_AGE


def remove_stale_temps(path: str) -> list[str]:
    """Remove the temp files of ``path`` (``.<name>.tmp…`` beside it) left by writers that
    are gone (``_temp_is_stale``); return their names. Never raises: what cannot be
    examined or removed stays."""
    stem = _temp_stem(path)
    d, prefix = os.path.split(stem)
    removed: list[str] = []
    now = time.time()
    try:
        with os.scandir(d) as entries:
            names = [e.name for e in entries if e.name.startswith(prefix)]
    except OSError:
        return removed
    for name in names:
        try:
            st = os.lstat(os.path.join(d, name))
            if _temp_is_stale(name, name[len(prefix):], st, now):
                os.unlink(os.path.join(d, name))
                removed.append(name)
        except OSError:
            continue
    return removed


@dataclass
class TempSweep:
    """What ``sweep_temps`` did in one directory: ``(name, why)`` of each temp file
    ``removed`` (or, in a dry run, that would be), ``kept`` or whose removal ``failed``."""
    path: str
    removed: list[tuple[str, str]]
    kept: list[tuple[str, str]]
    failed: list[tuple[str, str]]


def sweep_temps(d: str, dry_run: bool = False, aged: bool = False) -> TempSweep:
    """Remove the temp files of atomic writes (``.<name>.tmp<pid>…``, ``temp_path``) in
    directory ``d`` whose writers are provably gone (``_temp_verdict``): a create killed
    before its rename leaves one, which nothing else removes while its job directory is
    in use. ``aged``: also those whose writer cannot be checked and that are older than
    ``TEMP_AGE`` (the library's rule; ``chemio clean`` keeps them). Files of live writers,
    of other users and anything else stay. Never raises."""
    out = TempSweep(d, [], [], [])
    try:
        with os.scandir(d) as entries:
            names = sorted(e.name for e in entries if e.name.startswith("."))
    except OSError:
        return out
    now = time.time()
    for name in names:
        m = _TEMP_NAME.fullmatch(name)
        if m is None:
            continue
        p = os.path.join(d, name)
        try:
            st = os.lstat(p)
        except OSError:
            continue
        verdict = _temp_verdict(m.group(2), st)
        if verdict is None:
            continue
        state, why = verdict
        if state == UNKNOWN and aged and now - st.st_mtime > TEMP_AGE:
            state, why = DEAD, f"{why}; older than {TEMP_AGE} s"
        if state != DEAD:
            out.kept.append((name, why))
            continue
        if not dry_run:
            try:
                os.unlink(p)
            except FileNotFoundError:
                continue                # its writer's cleanup, or another sweep, was first
            except OSError as e:
                out.failed.append((name, f"{why}; cannot remove it: {e.strerror or e}"))
                continue
        out.removed.append((name, why))
    return out


_WRITE_NEW = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def _write_lease(job_dir: str) -> None:
    pid = os.getpid()
    try:
        start = process_start_time(pid)
    except OSError:
        start = None
    lease = {"format": 1, "host": socket.gethostname(), "boot_id": read_boot_id(),
             "pidns": pid_namespace(), "pid": pid, "start_time": start,
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
              "pid": os.getpid(), "pidns": pid_namespace(), "boot_id": read_boot_id(),
              "token": os.urandom(8).hex(), "uid": os.geteuid(), "created": time.time()}
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
    """Create a 0700 directory (True), or accept an existing real directory of ours (False),
    tightened to 0700 when others could enter it (a pre-created 0777 one)."""
    try:
        os.mkdir(path, 0o700)
        return True
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        raise OSError(errno.ENOTDIR, f"{path!r} exists and is not a directory (a symlink?); "
                                     f"remove it or choose another CHEMIO_SCRATCH", path) from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise PermissionError(errno.EACCES, f"scratch directory {path!r} belongs to uid "
                                                f"{st.st_uid}, not to you; choose another "
                                                f"CHEMIO_SCRATCH", path)
        if _stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)        # the very directory checked above, not a swapped one
    finally:
        os.close(fd)
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
    """This job's directory under ``root``, created with this process's lease if needed
    (again when the lease went away, e.g. removed on SIGTERM by a process that goes on)."""
    root = os.path.abspath(root)
    arm_sigterm_cleanup()
    with _lock:
        if jobid is None:
            d = _by_root.get(root)
            if d is not None and os.path.lexists(os.path.join(d, _lease_name())):
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
        sweep_temps(j.path, aged=True)  # temp files of writers killed mid-write
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
    its parent's scratch. Closes of dropped files that finalizers handed to the closer
    thread finish first (``finalizers.settle``)."""
    finalizers.settle(finalizers.EXIT_WAIT)
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
            _log.debug("cleanup removed %s", path)
        except Exception as e:  # noqa: BLE001 - reported below
            failed.append(f"{path}: {type(e).__name__}: {e}")
    if owned:
        _log.info("cleanup: removed %d scratch object(s) of pid %d", len(owned) - len(failed),
                  pid)
    for j in dirs:
        _leave_job_dir(j)
    if failed:
        import warnings
        warnings.warn(f"chemio cleanup could not remove {len(failed)} scratch object(s) "
                      f"({'; '.join(failed[:5])}); `chemio clean` removes them once this "
                      f"job is gone", RuntimeWarning, stacklevel=2)


atexit.register(cleanup)


# ---------------------------------------------------------------- SIGTERM

SIBLING_WAIT = 3.0          # seconds a process that ends on SIGTERM waits for the others of
                            # its job directories to remove their scratch first
_HANDLER_SETTINGS = ("sigterm_cleanup", "keep")
_HANDLER_VARS = tuple(config.SPECS[n].env for n in _HANDLER_SETTINGS)
_handler_settings: dict[str, Any] = {"sigterm_cleanup": True, "keep": False}
_handler_env: tuple = ()                # their environment variables when last read
_in_sigterm_cleanup = False


def _read_handler_settings(changes: Any = None, reset: bool = False) -> None:
    """Read the settings the SIGTERM handler needs, outside the handler: it may not read
    them itself (the code it interrupts may hold the settings lock). Runs when scratch is
    created and after ``configure()`` changes them; an invalid value leaves the last one."""
    global _handler_env
    _handler_env = tuple(map(os.environ.get, _HANDLER_VARS))
    for name in _HANDLER_SETTINGS:
        try:
            _handler_settings[name] = config.get(name)
        except config.ConfigError:
            pass


config.on_change(_HANDLER_SETTINGS, _read_handler_settings)


def _running(pid: int) -> bool:
    """True when ``pid`` is a live process (a zombie, or no such pid, is not)."""
    try:
        state = _read_proc(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def _others_running(path: str, host: str, me: int) -> bool:
    """True while a lease in job directory ``path`` names another live process of ``host``."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    for n in names:
        if n.startswith(LEASE_PREFIX):
            lease_host, _, pid = n[len(LEASE_PREFIX):].rpartition(".")
            if lease_host == host and pid.isdigit() and int(pid) != me and _running(int(pid)):
                return True
    return False


def _wait_for_others(left: list[_JobDir], limit: float) -> None:
    """Wait, ``limit`` seconds at most, until no other live process of this host holds a
    lease in the job directories ``left``, then remove those that are empty but for the
    marker. The ranks of a job get SIGTERM together, and a launcher such as hydra kills the
    remaining ranks the moment one ends: the first to finish its cleanup would cut the
    others' short, or the last one's removal of the directory after its lease."""
    host, me = _lease_host(), os.getpid()
    deadline = time.monotonic() + limit
    waiting = [j.path for j in left]
    while waiting and time.monotonic() < deadline:
        waiting = [d for d in waiting if _others_running(d, host, me)]
        if waiting:
            time.sleep(0.01)
    for j in left:
        if j.path not in waiting:
            _leave_job_dir(j)           # our lease is gone already: the last one's steps


def remove_scratch_now() -> list[_JobDir]:
    """Remove this process's scratch from a signal handler (unless ``CHEMIO_KEEP`` as of the
    last scratch creation or ``configure()``); return the job directories it left.

    Unlike ``cleanup()`` it takes no lock (the interrupted code may hold one), closes
    nothing, waits for no request and calls no backend code: it removes what this process
    owns by path (unlinking a file that is open, or being written by an I/O thread, is
    safe), then drops its leases. Persistent files are never touched."""
    if _handler_settings["keep"]:
        return []
    pid = os.getpid()
    owned = [p for p, (who, _) in _owned.copy().items() if who == pid]
    dirs = [j for j in _job_dirs.copy().values() if j.pid == pid]
    for path in owned:
        try:
            remove_path(path)
        except Exception:           # noqa: BLE001 - one failure never stops the rest
            pass
    for j in dirs:
        _leave_job_dir(j)
    return dirs


class SigtermCleanup:
    """chemio's SIGTERM handler: ``remove_scratch_now()``, then the handler it replaced.

    That handler (``previous``) is called next, and when it returns so does this one: the
    process goes on. When it was the default action, the process waits briefly for the
    other processes of its job directories (``SIBLING_WAIT``), restores the default and
    sends itself SIGTERM, so that it ends as "killed by SIGTERM" as it would have without
    chemio."""

    def __init__(self, previous: Any):
        self.previous = previous

    def __repr__(self) -> str:
        return f"<chemio_py scratch cleanup on SIGTERM, then {self.previous!r}>"

    def __call__(self, signum: int, frame: Any) -> Any:
        global _in_sigterm_cleanup
        if _in_sigterm_cleanup:         # another SIGTERM (launchers may send two): the
            return None                 # first one goes on
        _in_sigterm_cleanup = True
        left: list[_JobDir] = []
        try:
            if _handler_settings["sigterm_cleanup"]:
                left = remove_scratch_now()
        except Exception:               # noqa: BLE001 - the process still ends (or goes on)
            pass
        if callable(self.previous):
            _in_sigterm_cleanup = False
            return self.previous(signum, frame)
        _wait_for_others(left, SIBLING_WAIT)
        signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)          # not reached: the signal ended the process


def arm_sigterm_cleanup() -> None:
    """Install ``SigtermCleanup`` for SIGTERM, from the main thread, when the
    ``sigterm_cleanup`` setting is on and SIGTERM has the default action or a handler set
    from Python (which it then chains to). An ignored SIGTERM, or a handler set outside
    Python, is left alone. Called whenever scratch is about to be created, never at import:
    a handler set after chemio's is wrapped at the next creation."""
    current = signal.getsignal(signal.SIGTERM)
    if isinstance(current, SigtermCleanup):
        if _handler_env != tuple(map(os.environ.get, _HANDLER_VARS)):
            _read_handler_settings()
        return
    if current is None or current == signal.SIG_IGN \
            or threading.current_thread() is not threading.main_thread():
        return
    if not config.get("sigterm_cleanup"):
        return
    _read_handler_settings()
    try:
        signal.signal(signal.SIGTERM, SigtermCleanup(current))
    except ValueError:                  # not the main interpreter: no handlers here
        pass
