"""The RAM budget of the shm backend: how many more bytes segments may take.

The budget is the least of the free space of the shm file system, ``MemAvailable``, the room
left under the cgroup memory limit (v1 or v2, this process's cgroup and its ancestors) and
``CHEMIO_SHM_LIMIT`` minus what chemio's segments already hold (``ram_budget``,
``RamBudget``). A store takes bytes from it before it allocates pages (``check_budget``,
which reuses a measurement for ``BUDGET_TTL`` seconds) and names it when the system
refuses them (``no_room``), so a shortage is an ``OutOfSpaceError`` that says which limit
binds, raised before anything is written. ``shm_dir`` is the configured shm directory the
budget is measured for; ``meminfo`` and ``cgroup_memory`` read the system's terms.
"""
from __future__ import annotations

import errno
import os
import threading
import time
from dataclasses import dataclass, field

from chemio_py.errors import OutOfSpaceError, fmt_bytes
from chemio_py.runtime import config
from chemio_py.scratch import fs, jobs

NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM)      # errnos of refused pages
_UNLIMITED = 1 << 60            # cgroup v1 writes "no limit" as ~2**63
BUDGET_TTL = 0.05               # seconds a measured budget is reused (minus our allocations)


def _read(path: str) -> str | None:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return None


def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """``/proc/meminfo`` in bytes (``{"MemAvailable": ..., ...}``); empty when unreadable."""
    out = {}
    for line in (_read(path) or "").splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return out


@dataclass(frozen=True)
class CgroupMemory:
    """The tightest memory limit of this process's cgroup and its ancestors."""
    version: str                # "v1" or "v2"
    path: str                   # the cgroup directory whose limit binds
    limit: int                  # bytes
    usage: int                  # bytes charged, minus reclaimable (inactive) file cache

    @property
    def free(self) -> int:
        return max(0, self.limit - self.usage)


def _int_file(path: str) -> int | None:
    s = _read(path)
    if s is None:
        return None
    s = s.strip()
    if s == "max":
        return None
    try:
        return int(s)
    except ValueError:
        return None


def _stat_value(path: str, key: str) -> int:
    for line in (_read(path) or "").splitlines():
        k, _, v = line.partition(" ")
        if k == key:
            try:
                return int(v)
            except ValueError:
                return 0
    return 0


def cgroup_memory(proc_cgroup: str = "/proc/self/cgroup",
                  mount: str = "/sys/fs/cgroup") -> CgroupMemory | None:
    """The binding cgroup memory limit (v1 ``memory`` or v2 unified), or None if unlimited.

    Walks from this process's cgroup up to the root of the mounted hierarchy and returns
    the level with the least room (limit minus usage, counting inactive file cache as
    reclaimable). Inside a cgroup namespace the mounted root is this process's own cgroup,
    which is also looked at.
    """
    text = _read(proc_cgroup)
    if text is None:
        return None
    cands: list[tuple[str, str, str, str, str]] = []     # (ver, base, rel, limit, usage)
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, ctrls, rel = parts
        if ctrls == "":
            cands.append(("v2", mount, rel, "memory.max", "memory.current"))
        elif "memory" in ctrls.split(","):
            cands.append(("v1", os.path.join(mount, "memory"), rel,
                          "memory.limit_in_bytes", "memory.usage_in_bytes"))
    best: CgroupMemory | None = None
    for ver, base, rel, lim_name, use_name in cands:
        stat_key = "inactive_file" if ver == "v2" else "total_inactive_file"
        rel = rel.strip().strip("/")
        levels = []
        p = rel
        while True:
            levels.append(os.path.join(base, p) if p else base)
            if not p:
                break
            p = os.path.dirname(p)
        for d in levels:
            lim = _int_file(os.path.join(d, lim_name))
            if lim is None or lim >= _UNLIMITED:
                continue
            use = _int_file(os.path.join(d, use_name)) or 0
            use = max(0, use - _stat_value(os.path.join(d, "memory.stat"), stat_key))
            cg = CgroupMemory(ver, d, lim, use)
            if best is None or cg.free < best.free:
                best = cg
    return best


def chemio_usage(shm_dir: str) -> int:
    """Bytes held by the files of chemio job directories (``chemio-*``) in ``shm_dir``,
    including the retired segments of re-created arrays that readers still map."""
    total = 0
    try:
        entries = list(os.scandir(shm_dir))
    except OSError:
        return 0
    for e in entries:
        if not e.name.startswith(jobs.JOB_PREFIX):
            continue
        try:
            if not e.is_dir(follow_symlinks=False):
                continue
        except OSError:
            continue
        for dirpath, _dirs, files in os.walk(e.path):
            for f in files:
                if f.startswith(jobs.LEASE_PREFIX) or f == jobs.MARKER_NAME:
                    continue
                try:
                    total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
                except OSError:
                    pass
    return total


def shm_dir() -> str:
    """The configured shm directory (absolute)."""
    return os.path.abspath(os.path.expanduser(config.get("shm_dir")))


@dataclass(frozen=True)
class RamBudget:
    """How many more bytes shm segments may take, and which limit says so.

    ``limit`` is ``CHEMIO_SHM_LIMIT`` in bytes (a percentage is a share of the memory
    chemio could use: the smaller of ``MemAvailable`` and the cgroup's room, plus what its
    segments already hold). ``headroom`` is the least of: free space in the shm file
    system, ``MemAvailable``, the cgroup's room and ``limit - used``; ``binding`` names it.
    """
    shm_dir: str
    fstype: str
    fs_free: int | None
    mem_available: int | None
    cgroup: CgroupMemory | None
    used: int
    limit: int
    limit_text: str
    limit_source: str
    terms: dict = field(default_factory=dict)

    @property
    def headroom(self) -> int:
        return max(0, min(self.terms.values())) if self.terms else 0

    @property
    def binding(self) -> str:
        return min(self.terms, key=self.terms.__getitem__) if self.terms else "none"

    def describe(self) -> str:
        others = [f"{k}: {fmt_bytes(v)}" for k, v in self.terms.items() if k != self.binding]
        return (f"RAM budget of the shm backend: {fmt_bytes(self.headroom)} left, set by "
                f"{self.binding}" + (f" (other limits: {'; '.join(others)})" if others else ""))


def ram_budget(directory: str | None = None) -> RamBudget:
    """Measure the RAM budget for segments in ``directory`` (default: the shm directory)."""
    root = shm_dir()
    d = os.path.abspath(directory) if directory else root
    try:
        st = os.statvfs(fs.existing_ancestor(d))
        fs_free: int | None = st.f_bavail * st.f_frsize
    except OSError:
        fs_free = None
    mem = meminfo().get("MemAvailable")
    cg = cgroup_memory()
    used = chemio_usage(root)
    setting = config.get_setting("shm_limit")
    room = [x for x in (mem, cg.free if cg else None) if x is not None]
    whole = (min(room) if room else 1 << 62) + used
    limit = config.parse_limit(setting.value, whole)
    where = setting.source if setting.source != "default" else "default"
    terms: dict[str, int] = {}
    if fs_free is not None:
        terms[f"free space in {d} ({fs.fstype(d)})"] = fs_free
    if mem is not None:
        terms["MemAvailable"] = mem
    if cg is not None:
        terms[f"cgroup {cg.version} memory limit {fmt_bytes(cg.limit)} ({cg.path})"] = cg.free
    terms[f"CHEMIO_SHM_LIMIT={setting.value!r} ({where}) = {fmt_bytes(limit)} minus "
          f"{fmt_bytes(used)} held by chemio segments in {root}"] = limit - used
    return RamBudget(root, fs.fstype(d), fs_free, mem, cg, used, limit, str(setting.value),
                     where, terms)


_budget_lock = threading.Lock()
_budget_cache: dict[tuple, list] = {}        # key -> [time, headroom left, RamBudget]


def _budget_key(directory: str) -> tuple:
    s = config.get_setting("shm_limit")
    return (os.path.dirname(os.path.abspath(directory)), shm_dir(), s.value)


def check_budget(path: str, needed: int, what: str) -> None:
    """Take ``needed`` bytes from the RAM budget or raise ``OutOfSpaceError`` naming it.

    A measurement is reused for ``BUDGET_TTL`` seconds, less what was taken since, so
    frequent small growths do not re-read /proc and /sys each time.
    """
    if needed <= 0:
        return
    key = _budget_key(path)
    with _budget_lock:
        now = time.monotonic()
        ent = _budget_cache.get(key)
        if ent is None or now - ent[0] > BUDGET_TTL or ent[1] < needed:
            b = ram_budget(os.path.dirname(os.path.abspath(path)))
            ent = _budget_cache[key] = [now, b.headroom, b]
        if needed > ent[1]:
            b = ent[2]
            raise OutOfSpaceError(
                path, needed, ent[1], what=f"{what} in RAM",
                hint=(f"{b.describe()}. Raise CHEMIO_SHM_LIMIT, free memory, or use "
                      f"backend='auto' (spills to disk) or backend='local'"))
        ent[1] -= needed


def forget_budget() -> None:
    with _budget_lock:
        _budget_cache.clear()


def no_room(e: OSError, path: str, needed: int, what: str) -> OutOfSpaceError:
    forget_budget()
    b = ram_budget(os.path.dirname(os.path.abspath(path)))
    return OutOfSpaceError(
        path, needed, b.headroom, what=f"{what} in RAM",
        hint=(f"the system refused the pages ({errno.errorcode.get(e.errno or 0, e.errno)}); "
              f"{b.describe()}. Free memory, lower CHEMIO_SHM_LIMIT, or use backend='auto' "
              f"or 'local'"))
