"""Other jobs' directories: their leases and markers read with bounds, a verdict per
directory (in use, stale, someone else's, damaged) and their removal for ``chemio clean``
and ``chemio ls``. Nothing here removes a directory whose job may still run.
"""
from __future__ import annotations

import errno
import fnmatch
import os
import socket
import stat as _stat
import time
from dataclasses import dataclass
from typing import Iterable

from chemio_py.errors import MetadataError, RefusedRemoval, StorageError
from chemio_py.runtime import config, safejson
from chemio_py.runtime.ownfiles import NotARegularFile, open_regular, read_bounded
from chemio_py.scratch.fs import DIR_FLAGS, clear_dir_at, printable, remove_entry_at
from chemio_py.scratch.jobs import (
    ALIVE,
    DEAD,
    UNKNOWN,
    JOB_PREFIX,
    LEASE_PREFIX,
    MARKER_FORMAT,
    MARKER_MAGIC,
    MARKER_NAME,
    NO_LEASE_GRACE,
    RECORD_LIMIT,
    parse_scratch,
    pid_namespace,
    process_start_time,
    read_boot_id,
    shared_root,
)

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


def this_process() -> _Here:
    try:
        proc_ok = os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        proc_ok = False
    return _Here(socket.gethostname(), read_boot_id(), pid_namespace(), proc_ok, os.geteuid())


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
    """The checked content of a lease; ``ValueError`` (``MetadataError`` for what is not
    JSON chemio reads: ``safejson``) saying what is wrong."""
    lease = safejson.load(data, what="the lease", max_bytes=RECORD_LIMIT)
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


def lease_verdict(lease: dict, here: _Here) -> tuple[str, str]:
    """Whether the lease's process runs: alive, dead (provably gone) or unknown."""
    pid, host = lease["pid"], lease["host"]
    if lease["uid"] != here.uid:
        return UNKNOWN, f"pid {pid} ran as uid {lease['uid']}, not as you (uid {here.uid})"
    if host != here.host:
        return UNKNOWN, f"pid {pid} runs on host {host!r}: cannot check it from here"
    if not here.proc_ok:
        return UNKNOWN, (f"/proc is not readable here or shows another pid namespace: "
                          f"cannot check pid {pid}")
    if not here.boot_id or lease["boot_id"] != here.boot_id:
        return UNKNOWN, (f"pid {pid} was started during another boot of {printable(host)} "
                          f"(or on another machine of that name): cannot tell")
    if not lease.get("pidns") or lease["pidns"] != here.pidns:
        return UNKNOWN, (f"pid {pid} lives in another pid namespace "
                          f"({printable(str(lease.get('pidns')))}, here {here.pidns}): "
                          f"cannot see it from here")
    try:
        start = process_start_time(pid)
    except OSError as e:
        return UNKNOWN, f"cannot read /proc/{pid}: {e.strerror or e}"
    if start is None:
        return DEAD, f"pid {pid} is gone"
    if lease.get("start_time") is None:
        return ALIVE, f"pid {pid} is running (its start time was not recorded)"
    if start != lease["start_time"]:
        return DEAD, f"pid {pid} now belongs to another process"
    return ALIVE, f"pid {pid} is running"


def marker_problem(d: str, here: _Here) -> str | None:
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
        m = safejson.load(data, what=f"its marker {MARKER_NAME}", max_bytes=RECORD_LIMIT)
    except MetadataError as e:
        return f"{e}: it is not chemio's"
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
        problem = marker_problem(d, here)
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
            verdicts.append((UNKNOWN, f"{what} {e.strerror}"))
            continue
        except ValueError as e:
            verdicts.append((UNKNOWN, f"{what} {e}"))
            continue
        except OSError as e:
            verdicts.append((UNKNOWN, f"{what} cannot be read: {e.strerror or e}"))
            continue
        if lst.st_uid != here.uid:
            verdicts.append((UNKNOWN, f"{what} belongs to uid {lst.st_uid}, not to you "
                                       f"(uid {here.uid})"))
            continue
        try:
            lease = _parse_lease(data)
        except ValueError as e:
            verdicts.append((UNKNOWN, f"{what} cannot be parsed ({e})"))
            continue
        leases.append(lease)
        verdicts.append(lease_verdict(lease, here))
    alive = [r for v, r in verdicts if v == ALIVE]
    unknown = [r for v, r in verdicts if v == UNKNOWN]
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
    here = this_process()
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

    However deep its tree (``clear_dir_at``). Entries vanishing meanwhile are fine. When
    something cannot be removed, the leases and the marker stay (a later ``chemio clean``
    tries again) and ``StorageError`` says what.
    """
    failures: list[tuple[str, BaseException]] = []
    try:
        dfd = os.open(path, DIR_FLAGS)
    except FileNotFoundError:
        return
    try:
        clear_dir_at(dfd, path, failures, keep=lambda n: _removal_phase(n) > 0)
        for phase in (1, 2):
            if failures:
                break
            for n in os.listdir(dfd):
                if _removal_phase(n) == phase:
                    remove_entry_at(dfd, n, os.path.join(path, n), failures)
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
        shown = printable(p if len(p) <= 400 else f"{p[:150]}/.../{p[-200:]}")
        raise StorageError(code, path, None, None, "remove the stale job directory",
                           f"{shown}: {getattr(err, 'strerror', None) or err}{more}; fix "
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
        info = _examine(path, this_process())
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
