"""What is in scratch: ``cio.ls()`` and ``chemio ls [--root DIR] [--all] [--json]``.

Every ``chemio-*`` job directory under the scratch roots (private, shared, shm), with its
owner process and whether the job still runs (the verdict of ``chemio clean``:
``janitor.scan_job_dirs``), and each object inside: its kind (DiskArray ``.dra`` + ``.json``,
zarr ``.zarr`` directory, SharedFile ``.sf``, RecordFile, EAF), a backend guessed from its
metadata or from where it lives, its size on disk (allocated blocks) against its logical
size, and its age.

Read only, always. A directory of another user or one chemio did not mark is **foreign**:
it is listed only with ``all=True`` and only by names and ``lstat`` (no file in it is ever
opened); in your own marked directories only chemio's small metadata (``.json``, the
RecordFile header) is read, with a bound, without following links or blocking.
"""
from __future__ import annotations

import fnmatch
import json
import os
import re
import socket
import stat as _stat
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from chemio_py.errors import MetadataError, fmt_bytes
from chemio_py.runtime import config, safejson
from chemio_py.runtime.ownfiles import NotARegularFile, open_regular, read_small
from chemio_py.scratch import fs, janitor, jobs

if TYPE_CHECKING:
    import argparse

MAX_WALK = 100_000          # entries counted inside one directory object (a .zarr tree)
MAX_TREE_DEPTH = 64         # levels measured inside one directory object (zarr keys: 33)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_META_LIMIT = 1 << 20
_RANK_SUFFIX = re.compile(r"\.(\d+)$")


@dataclass
class ScratchObject:
    """One object in a job directory (a DiskArray's data and metadata count as one)."""
    name: str
    path: str
    kind: str               # DiskArray, DiskArray (zarr), SharedFile, RecordFile, EAF, ...
    backend: str            # from the metadata, else guessed from the name and the place
    disk_bytes: int         # allocated on disk (st_blocks * 512), every part included
    logical_bytes: int      # the array's nbytes, or the files' apparent sizes
    age_seconds: float      # since the last change of any part
    rank: int | None = None     # for private files ``<name>.<rank>``
    parts: list[str] = field(default_factory=list)
    note: str | None = None     # what could not be read or measured, and why


@dataclass
class JobListing:
    """One ``chemio-*`` directory: who owns it, whether its job runs, what it holds.

    ``alive``: True (a process of the job runs), False (every process is provably gone:
    ``chemio clean`` would remove it) or None (cannot tell, or foreign). ``foreign``: not
    yours or not made by chemio; such a directory is never opened or changed.
    """
    path: str
    root: str
    place: str              # private, shared, shm (or several, when roots coincide)
    name: str
    host: str | None
    owner_pid: int | None
    batch_id: str | None
    status: str             # in use, stale, keep, vanished, skipped (scan_job_dirs)
    alive: bool | None
    foreign: bool
    reason: str
    uid: int | None
    age_seconds: float | None
    processes: list[dict] = field(default_factory=list)   # per lease: pid, host, alive, why
    objects: list[ScratchObject] = field(default_factory=list)
    disk_bytes: int = 0
    logical_bytes: int = 0
    note: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- places and backends

def _places(roots: Iterable[str] | None) -> dict[str, str]:
    """``{root: place}`` of the roots to scan (default: every root chemio uses here)."""
    labels: dict[str, list[str]] = {}

    def add(path: str, label: str) -> None:
        labels.setdefault(os.path.abspath(path), [])
        if label not in labels[os.path.abspath(path)]:
            labels[os.path.abspath(path)].append(label)

    try:
        for e in jobs.parse_scratch(config.get("scratch")):
            if e.host is None or fnmatch.fnmatchcase(socket.gethostname(), e.host):
                add(e.path, "private")
        add(jobs.shared_root(), "shared")
        add(config.get("shm_dir"), "shm")
    except Exception:           # a bad setting: still list the roots given
        pass
    wanted = [os.path.abspath(r) for r in roots] if roots else list(labels)
    return {r: "+".join(labels.get(r, ["given"])) for r in dict.fromkeys(wanted)}


def _guess_backend(kind: str, place: str) -> str:
    if kind.endswith("(zarr)"):
        return "zarr"
    if "shm" in place.split("+"):
        return "shm"
    if kind == "SharedFile" and "shared" in place.split("+"):
        return "local or mpiio"
    return "local"


# ---------------------------------------------------------------- sizes

def _tree_sizes(path: str) -> tuple[int, int, float, int, str | None]:
    """(disk bytes, apparent bytes, newest mtime, entries, what was left out or None) of a
    directory tree: by ``lstat`` relative to directory descriptors (never following a
    link), without recursion, at most ``MAX_WALK`` entries and ``MAX_TREE_DEPTH`` levels."""
    disk = size = n = 0
    newest = 0.0
    deep = unreadable = 0

    def scan(fd: int) -> list[str]:
        """Count the entries of directory ``fd``; its subdirectories' names."""
        nonlocal disk, size, n, newest, unreadable
        subdirs = []
        with os.scandir(fd) as it:
            for e in it:
                n += 1
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    unreadable += 1
                    continue
                disk += st.st_blocks * 512
                newest = max(newest, st.st_mtime)
                if _stat.S_ISDIR(st.st_mode):
                    subdirs.append(e.name)
                elif _stat.S_ISREG(st.st_mode):
                    size += st.st_size
                if n >= MAX_WALK:
                    break
        return subdirs

    try:
        fd = os.open(path, _DIR_FLAGS)
        stack = [(fd, scan(fd))]
    except OSError as e:
        return 0, 0, 0.0, 0, f"cannot be measured: {e.strerror or e}"
    try:
        while stack and n < MAX_WALK:
            fd, subdirs = stack[-1]
            if not subdirs:
                os.close(stack.pop()[0])
                continue
            name = subdirs.pop()
            if len(stack) >= MAX_TREE_DEPTH:
                deep += 1
                continue
            try:
                cfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError:
                unreadable += 1
                continue
            try:
                stack.append((cfd, scan(cfd)))
            except OSError:
                os.close(cfd)
                unreadable += 1
    finally:
        for fd, _ in stack:
            os.close(fd)
    left = []
    if n >= MAX_WALK:
        left.append(f"counted its first {MAX_WALK} entries only")
    if deep:
        left.append(f"{deep} director{'y' if deep == 1 else 'ies'} deeper than "
                    f"{MAX_TREE_DEPTH} levels not measured")
    if unreadable:
        left.append(f"{unreadable} entr{'y' if unreadable == 1 else 'ies'} could not be read")
    return disk, size, newest, n, "; ".join(left) or None


def _array_nbytes(meta: dict) -> int | None:
    """``shape x itemsize`` from chemio's or zarr's metadata, when it says so plainly."""
    import numpy as np
    shape = meta.get("shape")
    dt = meta.get("dtype", meta.get("data_type"))
    if not isinstance(shape, list) or len(shape) > 64 \
            or not all(type(n) is int and 0 <= n < 1 << 63 for n in shape):
        return None
    try:
        itemsize = np.dtype(dt).itemsize
    except Exception:
        return None
    n = itemsize
    for k in shape:
        n *= k
    return n


def _read_json(path: str) -> tuple[dict | None, str | None]:
    """(the JSON object in chemio's small file ``path``, None) or (None, why it cannot be
    read): bounded, without following a link or blocking, parsed by ``safejson``."""
    name = os.path.basename(path)
    try:
        m = safejson.load(read_small(path, _META_LIMIT), what=name, max_bytes=_META_LIMIT)
    except FileNotFoundError:
        return None, None
    except NotARegularFile as e:
        return None, f"{name} {e.strerror}"
    except MetadataError as e:
        return None, str(e)
    except ValueError:
        return None, f"{name} holds more than {_META_LIMIT} bytes"
    except OSError as e:
        return None, f"{name} cannot be read: {e.strerror or e}"
    if not isinstance(m, dict):
        return None, f"{name} holds a JSON {type(m).__name__}, not an object"
    return m, None


def _record_kind(path: str, size: int) -> str:
    """RecordFile or EAF, from the first (format 2) or last (format 1) bytes."""
    from chemio_py.files import recordformat
    try:
        fd = open_regular(path)
    except (OSError, NotARegularFile):
        return "EAF"
    try:
        if os.pread(fd, 8, 0) == recordformat.HMAGIC:
            return "RecordFile"
        tail = recordformat.TRAILER.size
        if size >= tail and os.pread(fd, 8, size - tail) == recordformat.MAGIC:
            return "RecordFile"
    except OSError:
        pass
    finally:
        os.close(fd)
    return "EAF"


# ---------------------------------------------------------------- one directory

def _objects(d: str, place: str, trusted: bool,
             now: float) -> tuple[list[ScratchObject], str | None]:
    """The objects in job directory ``d``; ``trusted``: ours and marked, so chemio's
    metadata may be read (else names and lstat only)."""
    try:
        names = sorted(os.listdir(d))
    except OSError as e:
        return [], f"cannot list it: {e.strerror or e}"
    stats: dict[str, os.stat_result] = {}
    for n in names:
        if n == jobs.MARKER_NAME or n.startswith(jobs.LEASE_PREFIX):
            continue
        try:
            stats[n] = os.lstat(os.path.join(d, n))
        except OSError:
            continue
    used: set[str] = set()
    out: list[ScratchObject] = []

    def obj(name: str, kind: str, parts: list[str], logical: int | None = None,
            backend: str | None = None, rank: int | None = None,
            tree: tuple[int, int, float, int, str | None] | None = None,
            note: str | None = None) -> None:
        used.update(parts)
        sts = [stats[p] for p in parts]
        disk = sum(s.st_blocks * 512 for s in sts)
        size = sum(s.st_size for s in sts if _stat.S_ISREG(s.st_mode))
        newest = max(s.st_mtime for s in sts)
        if tree is not None:
            disk, size, newest = disk + tree[0], tree[1], max(newest, tree[2])
            note = "; ".join(x for x in (note, tree[4]) if x) or None
        out.append(ScratchObject(name, os.path.join(d, name), kind,
                                 backend or _guess_backend(kind, place), disk,
                                 size if logical is None else logical,
                                 max(0.0, now - newest), rank, parts, note))

    def backend_of(meta: dict | None) -> str | None:
        b = None if meta is None else meta.get("backend")
        return b[:64] if isinstance(b, str) and b else None

    for n, st in stats.items():
        if n in used:
            continue
        p = os.path.join(d, n)
        if n.endswith(".dra") and _stat.S_ISREG(st.st_mode):
            parts = [n] + ([n + ".json"] if n + ".json" in stats else [])
            meta, bad = _read_json(p + ".json") if trusted and len(parts) > 1 else (None, None)
            obj(n, "DiskArray", parts, None if meta is None else _array_nbytes(meta),
                backend_of(meta), note=bad and f"metadata not read: {bad}")
        elif n.endswith(".zarr") and _stat.S_ISDIR(st.st_mode):
            meta, bad = (_read_json(os.path.join(p, "zarr.json")) if trusted
                         else (None, None))
            obj(n, "DiskArray (zarr)", [n], None if meta is None else _array_nbytes(meta),
                tree=_tree_sizes(p), note=bad and f"metadata not read: {bad}")
        elif n.endswith(".sf") and _stat.S_ISREG(st.st_mode):
            parts = [n] + ([n + ".token"] if n + ".token" in stats else [])
            obj(n, "SharedFile", parts)
    for n, st in stats.items():
        if n in used:
            continue
        p = os.path.join(d, n)
        m = _RANK_SUFFIX.search(n)
        if n.endswith(".dra.json") and _stat.S_ISREG(st.st_mode):
            obj(n, "DiskArray metadata (no data)", [n])
        elif m and _stat.S_ISREG(st.st_mode):
            kind = _record_kind(p, st.st_size) if trusted else "EAF or RecordFile"
            obj(n, kind, [n], rank=int(m.group(1)))
        elif _stat.S_ISDIR(st.st_mode):
            obj(n, "directory", [n], tree=_tree_sizes(p))
        elif _stat.S_ISREG(st.st_mode):
            obj(n, "file", [n])
        else:
            from chemio_py.runtime.ownfiles import kind as _kind
            obj(n, _kind(st.st_mode), [n])
    out.sort(key=lambda o: o.name)
    return out, None


def _owner_from_name(name: str, host: str | None) -> tuple[str | None, int | None, str | None]:
    """(host, pid, batch id) read from ``chemio-[<batch>-]<host>-<pid>[-ns<hex>]`` (the pid
    namespace tag: ``jobs.namespace_tag``)."""
    rest = name[len(jobs.JOB_PREFIX):]
    m = re.fullmatch(r"(.*)-(\d+)(?:-ns[0-9a-f]{12})?", rest)
    if not m:
        return host, None, None
    front, pid = m.group(1), int(m.group(2))
    if not host:
        return front, pid, None         # "[<batch>-]<host>": cannot be split safely
    safe = jobs.safe_name(host)
    batch = front[:-len(safe) - 1] if front.endswith("-" + safe) else None
    return host, pid, batch


def _listing(info: janitor.JobDirInfo, root: str, place: str, here: Any,
             now: float, with_objects: bool) -> JobListing:
    d = info.path
    try:
        st = os.lstat(d)
    except OSError:
        st = None
    uid = None if st is None else st.st_uid
    foreign = info.status == "skipped" or uid != here.uid
    marker = None
    if not foreign:
        try:
            problem = janitor.marker_problem(d, here)
        except OSError:
            problem = "vanished"
        foreign = problem is not None
        if not foreign:
            marker = _read_json(os.path.join(d, jobs.MARKER_NAME))[0]
    host = (marker or {}).get("host") if marker else None
    if not isinstance(host, str):
        host = None
    if host is None and info.leases:
        host = info.leases[0].get("host")
    host, pid, batch = _owner_from_name(os.path.basename(d), host)
    processes = []
    for lease in info.leases:
        verdict, why = janitor.lease_verdict(lease, here)
        processes.append({"pid": lease["pid"], "host": lease["host"],
                          "alive": {"alive": True, "dead": False}.get(verdict), "why": why})
    alive = None if foreign else {"in use": True, "stale": False}.get(info.status)
    created = (marker or {}).get("created")
    age = (now - created if isinstance(created, (int, float))
           else None if st is None else now - st.st_mtime)
    job = JobListing(path=d, root=root, place=place, name=os.path.basename(d), host=host,
                     owner_pid=pid, batch_id=batch, status=info.status, alive=alive,
                     foreign=foreign, reason=info.reason, uid=uid,
                     age_seconds=None if age is None else max(0.0, age), processes=processes)
    if with_objects and info.status not in ("skipped", "vanished") and st is not None \
            and _stat.S_ISDIR(st.st_mode):
        job.objects, job.note = _objects(d, place, not foreign, now)
        job.disk_bytes = sum(o.disk_bytes for o in job.objects)
        job.logical_bytes = sum(o.logical_bytes for o in job.objects)
    return job


def ls(roots: Iterable[str] | str | None = None, all: bool = False) -> list[JobListing]:
    """The job directories under ``roots`` (default: every scratch root chemio uses here:
    private, shared, shm) with their objects; see ``JobListing`` and ``ScratchObject``.

    ``all=False`` lists your own chemio job directories; ``all=True`` adds the foreign ones
    (other users', or not made by chemio), listed by name and lstat only. Read only.
    """
    if isinstance(roots, (str, os.PathLike)):
        roots = [os.fspath(roots)]
    places = _places(roots)
    here = janitor.this_process()
    now = time.time()
    out = []
    for root, place in places.items():
        for info in janitor.scan_job_dirs([root]):
            try:
                job = _listing(info, root, place, here, now, with_objects=True)
            except Exception as e:      # one bad entry is reported, the listing goes on
                job = _unlisted(info, root, place, e)
            if job.foreign and not all:
                continue
            out.append(job)
    return out


def _unlisted(info: janitor.JobDirInfo, root: str, place: str, e: Exception) -> JobListing:
    """The entry of a job directory that could not be listed, saying why."""
    return JobListing(path=info.path, root=root, place=place, name=os.path.basename(info.path),
                      host=None, owner_pid=None, batch_id=None, status=info.status,
                      alive=None, foreign=False, reason=info.reason, uid=None,
                      age_seconds=None, note=f"its objects could not be listed: "
                      f"{type(e).__name__}: {str(e)[:200]}")


def foreign_count(roots: Iterable[str] | None = None) -> int:
    """How many foreign ``chemio-*`` directories ``ls(roots)`` leaves out."""
    here = janitor.this_process()
    now = time.time()
    places = _places(roots)
    n = 0
    for r, p in places.items():
        for i in janitor.scan_job_dirs([r]):
            try:
                n += _listing(i, r, p, here, now, with_objects=False).foreign
            except Exception:           # ls() reports it as one of yours
                pass
    return n


# ---------------------------------------------------------------- command line

def _age(s: float | None) -> str:
    if s is None:
        return "?"
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.0f}{unit}"
    return f"{s:.0f}s"


def text(jobs: list[JobListing], hidden: int = 0) -> str:
    """The listing as ``chemio ls`` prints it."""
    show = fs.printable
    lines = []
    for j in jobs:
        if j.foreign:
            state = "FOREIGN"
        else:
            state = {True: "running", False: "dead", None: "unknown"}[j.alive]
        who = f"pid {j.owner_pid}" if j.owner_pid is not None else "owner ?"
        if j.host:
            who += f" on {show(j.host)}"
        if j.batch_id:
            who += f", batch job {show(j.batch_id)}"
        lines.append(f"{show(j.path)}  [{j.place}]  {state}  ({who}; age {_age(j.age_seconds)})")
        if j.foreign or j.alive is not True:
            lines.append(f"    {j.status}: {show(j.reason)}")
        for p in j.processes:
            st = {True: "alive", False: "gone", None: "unknown"}[p["alive"]]
            lines.append(f"    process {p['pid']} on {show(p['host'])}: {st}")
        for o in j.objects:
            lines.append(f"    {o.kind:18s} {o.backend:14s} {show(o.name):32s} "
                         f"{fmt_bytes(o.disk_bytes):>10s} on disk / "
                         f"{fmt_bytes(o.logical_bytes):>10s}  age {_age(o.age_seconds)}")
            if o.note:
                lines.append(f"      ({show(o.note)})")
        if j.note:
            lines.append(f"    ({j.note})")
        if j.objects:
            lines.append(f"    {len(j.objects)} object{'s' if len(j.objects) != 1 else ''}: "
                         f"{fmt_bytes(j.disk_bytes)} on disk, {fmt_bytes(j.logical_bytes)} logical")
    if not jobs:
        lines.append("no chemio job directories")
    if hidden:
        lines.append(f"{hidden} foreign director{'y' if hidden == 1 else 'ies'} (other users' "
                     f"or not made by chemio) not shown: 'chemio ls --all' lists "
                     f"{'it' if hidden == 1 else 'them'}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``chemio ls``."""
    p.add_argument("--root", action="append", help="scratch root to list (repeatable); "
                   "default: every root chemio uses here")
    p.add_argument("--all", action="store_true", help="also list foreign directories "
                   "(other users', or not made by chemio); they are never opened or changed")
    p.add_argument("--json", action="store_true", help="print one JSON object for scripts")


def run(args: argparse.Namespace) -> int:
    """``chemio ls``: print the listing (text or ``--json``); exit 0."""
    jobs = ls(args.root, all=args.all)
    hidden = 0 if args.all else foreign_count(args.root)
    if args.json:
        print(json.dumps({"roots": list(_places(args.root)), "jobs": [j.as_dict() for j in jobs],
                          "foreign_hidden": hidden}, default=str))
    else:
        print(text(jobs, hidden))
    return 0
