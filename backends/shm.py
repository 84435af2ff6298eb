"""The ``shm`` backend: files in memory.

A store is a plain file in the shm directory (``CHEMIO_SHM_DIR``, default ``/dev/shm``,
a tmpfs) mapped into the process with ``mmap``. Reads and writes are memory copies between
the mapping and the caller's buffer (NumPy copies that release the GIL), so the I/O thread
pool overlaps them like any other request. Processes on one node that open the same file
map the same pages: a SharedFile or DiskArray on ``shm`` is node-shared memory.

Never a SIGBUS. A store never touches a page that is not backed:

* Before a file grows (a write past the end, ``truncate`` up, ``reserve``) the RAM budget
  is checked (:func:`ram_budget`: free space of the shm file system, ``MemAvailable``, the
  cgroup memory limit and ``CHEMIO_SHM_LIMIT``) and the pages are allocated with
  ``fallocate``; a shortage is an ``OutOfSpaceError`` naming the budget, raised before
  anything is written.
* Every access holds a shared ``flock`` on the file and checks the size seen under it;
  shrinking (``truncate`` down, re-creating with ``w+``) takes the exclusive lock, so no
  process can be inside a page that is being cut off. (The shared lock is kept across a
  burst of accesses and let go when the store idles, so small requests cost no system
  call; a shrinking process waits milliseconds.)
* A tmpfs file never has holes here (a read fault on a hole allocates a page too): growth
  allocates every byte up to the new end, and a writable open backs a sparse file first.

Ownership: files are created ``O_EXCL`` (or reused after an exclusive-locked truncation for
``w+``), mode 0600, in the job directory under the shm directory, so leases cover them and
``chemio clean`` removes the segments of dead jobs. The user layer decides who removes them.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import stat as _stat
import struct
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from chemio_py import config, scratch
from chemio_py.errors import (ChemIOError, NodeSpanError, OutOfSpaceError,  # noqa: F401
                              StorageError, _fmt_bytes)

from .local import _byte_span, _bytes_view, _fallocate_keep_size

PAGE = mmap.PAGESIZE
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM)
_UNLIMITED = 1 << 60            # cgroup v1 writes "no limit" as ~2**63
MIN_MAP = 16 << 30              # virtual size mapped up front: growth rarely needs a remap
BUDGET_TTL = 0.05               # seconds a measured budget is reused (minus our allocations)
LOCK_WAIT = 600.0               # seconds to wait for another process's exclusive lock

_MODES = {
    "r": os.O_RDONLY,
    "r+": os.O_RDWR,
    "w+": os.O_RDWR | os.O_CREAT,
    "x+": os.O_RDWR | os.O_CREAT | os.O_EXCL,
}


def _round_up(n: int, q: int = PAGE) -> int:
    return -(-n // q) * q


# ---------------------------------------------------------------- mmap through libc
# Python's mmap refuses to map past the end of a file and cannot be unmapped while a
# buffer of it is exported; libc's mmap can do both, so a store maps a large virtual
# window once and the file grows inside it without remapping (and without losing the
# pages already faulted in).

_libc_fns: list[Any] = []


def _libc() -> Any:
    if not _libc_fns:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_int64]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.restype = ctypes.c_int
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc_fns.append(libc)
    return _libc_fns[0]


_MAP_FAILED = ctypes.c_void_p(-1).value


class _Window:
    """``length`` bytes of a file mapped shared at its offset 0, with a NumPy byte view."""

    __slots__ = ("addr", "length", "view")

    def __init__(self, fd: int, length: int, writable: bool):
        libc = _libc()
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        addr = libc.mmap(None, length, prot, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == _MAP_FAILED:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        self.addr = addr
        self.length = length

        class _Iface:
            __array_interface__ = {"shape": (length,), "typestr": "|u1", "version": 3,
                                   "data": (addr, not writable)}
        self.view = np.asarray(_Iface())

    def close(self) -> None:
        if self.addr:
            self.view = None
            _libc().munmap(self.addr, self.length)
            self.addr = 0


def _map(fd: int, needed: int, writable: bool) -> _Window:
    """Map at least ``needed`` bytes (more when the address space allows)."""
    want = _round_up(max(MIN_MAP, 2 * needed, PAGE))
    floor = _round_up(max(needed, PAGE))
    while True:
        try:
            return _Window(fd, want, writable)
        except OSError as e:
            if e.errno != errno.ENOMEM or want <= floor:
                raise
            want = max(floor, _round_up(want // 4))      # e.g. under ulimit -v


# ---------------------------------------------------------------- locking

class _Gate:
    """Readers/exclusive gate of one store.

    Any number of threads may be inside (``enter``/``leave``). While a thread is inside,
    the store's descriptor holds a shared ``flock``, which keeps other processes from
    shrinking the file (shrinking takes the exclusive lock), so a size seen under it stays
    a valid lower bound: ``size`` caches it and accesses below it need no system call.
    The lock is kept across a burst of accesses and dropped by the janitor thread once the
    store has been idle ``IDLE_RELEASE`` seconds, or after ``MAX_HOLD`` seconds (new
    accesses then wait until the current ones finish and the lock has been let go), so a
    shrinking process waits a few milliseconds at most. ``enter_excl`` waits until no
    thread is inside and drops the lock (for remapping, shrinking, closing).
    With ``fd=None`` it is a plain readers/writer lock.
    """

    __slots__ = ("_fd", "_cv", "_inside", "_excl", "_waiting", "_held", "_drain", "_drained",
                 "_since", "_last", "size", "__weakref__")

    def __init__(self, fd: int | None):
        self._fd = fd
        self._cv = threading.Condition(threading.Lock())
        self._inside = 0
        self._excl = False
        self._waiting = 0
        self._held = False          # the shared flock is held
        self._drain = False         # the janitor asked for the lock to be let go
        self._drained = False       # ... and it was: wait DRAIN_GAP before taking it again
        self._since = 0.0
        self._last = 0.0
        self.size = -1              # file size seen under the held lock (-1: unknown)

    def enter(self) -> None:
        with self._cv:
            while True:
                while self._excl or self._waiting or self._drain:
                    self._cv.wait()
                if self._held or self._fd is None:
                    break
                pause = self._last + DRAIN_GAP - time.monotonic() if self._drained else 0.0
                if pause > 0:                   # let a waiting shrinker in after a drain
                    self._cv.wait(pause)
                    continue
                self._drained = False
                _flock(self._fd, fcntl.LOCK_SH)
                self._held = True
                self._since = time.monotonic()
                self.size = -1
                _janitor.watch(self)
                break
            self._inside += 1

    def leave(self) -> None:
        with self._cv:
            self._inside -= 1
            if self._inside == 0:
                self._last = time.monotonic()
                if self._drain:
                    self._unlock()
                    self._drain = False
                    self._drained = True
                    self._cv.notify_all()
                elif self._waiting:
                    self._cv.notify_all()

    def _unlock(self) -> None:
        if self._held:
            self._held = False
            self.size = -1
            try:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            except OSError:
                pass

    def tick(self, now: float) -> bool:
        """Janitor: let an idle or long-held lock go; True while it is still held."""
        with self._cv:
            if not self._held:
                return False
            if self._inside == 0 and (now - self._last > IDLE_RELEASE
                                      or now - self._since > MAX_HOLD):
                self._unlock()
                return False
            if now - self._since > MAX_HOLD:
                self._drain = True
            return True

    def enter_excl(self) -> None:
        with self._cv:
            self._waiting += 1
            try:
                while self._excl or self._inside:
                    self._cv.wait()
            finally:
                self._waiting -= 1
            self._excl = True
            self._unlock()

    def leave_excl(self) -> None:
        with self._cv:
            self._excl = False
            self._cv.notify_all()


IDLE_RELEASE = 0.002            # seconds an unused shared lock is kept
MAX_HOLD = 0.05                 # seconds a shared lock is kept however busy the store is
DRAIN_GAP = 0.002               # seconds without it after such a forced release


class _Janitor:
    """One daemon thread that lets go of the shared locks of idle stores."""

    def __init__(self):
        self._cv = threading.Condition(threading.Lock())
        self._gates: "weakref.WeakSet[_Gate]" = weakref.WeakSet()
        self._thread: threading.Thread | None = None

    def watch(self, gate: _Gate) -> None:
        with self._cv:
            self._gates.add(gate)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="chemio-shm-locks",
                                                daemon=True)
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._gates:
                    self._cv.wait()
            time.sleep(IDLE_RELEASE)
            now = time.monotonic()
            with self._cv:
                gates = list(self._gates)
            for g in gates:
                if not g.tick(now):
                    with self._cv:
                        self._gates.discard(g)

    def after_fork(self) -> None:
        # The child shares the parent's open file descriptions (and so their flocks):
        # it must not unlock them; it starts with no janitor and re-locks on next use.
        for g in list(self._gates):
            g._held = False
            g._drain = False
            g.size = -1
        self._gates = weakref.WeakSet()
        self._thread = None
        self._cv = threading.Condition(threading.Lock())


_janitor = _Janitor()
os.register_at_fork(after_in_child=_janitor.after_fork)


def _flock(fd: int, op: int, timeout: float = LOCK_WAIT) -> None:
    """``flock`` that gives up with a clear error instead of waiting forever."""
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    deadline = time.monotonic() + timeout
    delay, cap = 1e-4, (DRAIN_GAP / 4 if op == fcntl.LOCK_EX else 0.01)
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise ChemIOError(
                    f"another process has held an exclusive lock on a shm segment for more "
                    f"than {timeout:.0f} s (descriptor {fd}); it may be stuck: check the job's "
                    f"other processes") from None
            time.sleep(delay)
            delay = min(delay * 2, cap)


_FLOCK_FMT = "hhxxxxqqi4x"         # struct flock on LP64 Linux


def _ofd_lock(fd: int, kind: int, wait: bool) -> bool:
    """Open-file-description lock on byte 0 (F_RDLCK / F_WRLCK / F_UNLCK); False if busy."""
    cmd = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
    try:
        fcntl.fcntl(fd, cmd, struct.pack(_FLOCK_FMT, kind, os.SEEK_SET, 0, 1, 0))
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


# ---------------------------------------------------------------- the RAM budget

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
    """Bytes held by the files of chemio job directories (``chemio-*``) in ``shm_dir``."""
    total = 0
    try:
        entries = list(os.scandir(shm_dir))
    except OSError:
        return 0
    for e in entries:
        if not e.name.startswith(scratch.JOB_PREFIX):
            continue
        try:
            if not e.is_dir(follow_symlinks=False):
                continue
        except OSError:
            continue
        for dirpath, _dirs, files in os.walk(e.path):
            for f in files:
                if f.startswith(scratch.LEASE_PREFIX) or f == scratch.MARKER_NAME:
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
        return min(self.terms, key=self.terms.get) if self.terms else "none"

    def describe(self) -> str:
        others = [f"{k}: {_fmt_bytes(v)}" for k, v in self.terms.items() if k != self.binding]
        return (f"RAM budget of the shm backend: {_fmt_bytes(self.headroom)} left, set by "
                f"{self.binding}" + (f" (other limits: {'; '.join(others)})" if others else ""))


def ram_budget(directory: str | None = None) -> RamBudget:
    """Measure the RAM budget for segments in ``directory`` (default: the shm directory)."""
    root = shm_dir()
    d = os.path.abspath(directory) if directory else root
    try:
        st = os.statvfs(scratch._existing_ancestor(d))
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
        terms[f"free space in {d} ({scratch.fstype(d)})"] = fs_free
    if mem is not None:
        terms["MemAvailable"] = mem
    if cg is not None:
        terms[f"cgroup {cg.version} memory limit {_fmt_bytes(cg.limit)} ({cg.path})"] = cg.free
    terms[f"CHEMIO_SHM_LIMIT={setting.value!r} ({where}) = {_fmt_bytes(limit)} minus "
          f"{_fmt_bytes(used)} held by chemio segments in {root}"] = limit - used
    return RamBudget(root, scratch.fstype(d), fs_free, mem, cg, used, limit, str(setting.value),
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


def _forget_budget() -> None:
    with _budget_lock:
        _budget_cache.clear()


def _no_room(e: OSError, path: str, needed: int, what: str) -> OutOfSpaceError:
    _forget_budget()
    b = ram_budget(os.path.dirname(os.path.abspath(path)))
    return OutOfSpaceError(
        path, needed, b.headroom, what=f"{what} in RAM",
        hint=(f"the system refused the pages ({errno.errorcode.get(e.errno, e.errno)}); "
              f"{b.describe()}. Free memory, lower CHEMIO_SHM_LIMIT, or use backend='auto' "
              f"or 'local'"))


# ---------------------------------------------------------------- the byte store

class ShmByteStore:
    """A byte-addressable file in RAM (see ``chemio_py.backends`` for the protocol)."""

    def __init__(self, path: str, fd: int, writable: bool):
        self.path = path
        self.writable = writable
        self._fd = fd
        self._gate = _Gate(fd)
        self._grow_lock = threading.Lock()
        st = os.fstat(fd)
        self._win: _Window | None = _map(fd, st.st_size, writable)
        # A read fault on a hole of a tmpfs file allocates a page (and can SIGBUS when RAM
        # is short). Writable stores never have holes; a read-only store of a sparse file
        # made by someone else reads with preadv, which returns zeros for holes.
        self._holes = not writable and st.st_blocks * 512 < _round_up(st.st_size)

    # ------------------------------------------------------------ helpers
    @property
    def fd(self) -> int:
        return self._fd

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def _window(self) -> _Window:
        w = self._win
        if w is None:
            raise ChemIOError(f"I/O on a closed shm segment {self.path!r}")
        return w

    def _remap(self, needed: int) -> None:
        self._gate.enter_excl()
        try:
            w = self._window()
            if needed > w.length:
                w.close()
                self._win = None
                self._win = _map(self._fd, needed, self.writable)
        finally:
            self._gate.leave_excl()

    def _seen_size(self) -> int:
        """The file's size now (inside the gate): the cached lower bound is raised to it."""
        size = os.fstat(self._fd).st_size
        if size > self._gate.size:
            self._gate.size = size
        return size

    def _extend(self, end: int, what: str) -> None:
        """Allocate and extend the file to ``end`` bytes (called inside the gate)."""
        with self._grow_lock:
            st = os.fstat(self._fd)
            size = st.st_size
            if end <= size:
                if size > self._gate.size:
                    self._gate.size = size
                return
            need = _round_up(end) - st.st_blocks * 512
            check_budget(self.path, need, what)
            try:
                os.posix_fallocate(self._fd, size, end - size)     # never shrinks: race-free
            except OSError as e:
                if e.errno in _NO_ROOM:
                    raise _no_room(e, self.path, max(need, 0), what) from e
                raise StorageError(e.errno, self.path, size, end - size, "extend") from e
            if self._gate._held and end > self._gate.size:
                self._gate.size = end

    def _fill_holes(self) -> None:
        """Back every page of the current size (a writable open of a sparse file)."""
        st = os.fstat(self._fd)
        if st.st_blocks * 512 >= _round_up(st.st_size):
            return
        need = _round_up(st.st_size) - st.st_blocks * 512
        check_budget(self.path, need, "back the holes of an existing file")
        try:
            os.posix_fallocate(self._fd, 0, st.st_size)
        except OSError as e:
            if e.errno in _NO_ROOM:
                raise _no_room(e, self.path, need, "back the holes of an existing file") from e
            raise StorageError(e.errno, self.path, 0, st.st_size, "allocate") from e

    # ------------------------------------------------------------ the protocol
    def pread(self, offset: int, out: Any) -> int:
        """Fill ``out`` from ``offset``; returns the bytes read (fewer only at end of file)."""
        mv = _bytes_view(out, writable=True)
        n = len(mv)
        if n == 0:
            return 0
        if self._holes:
            return self._pread_syscall(offset, mv)
        dst = np.frombuffer(mv, dtype=np.uint8)
        while True:
            self._gate.enter()
            try:
                w = self._window()
                size = self._gate.size
                if offset + n > size:
                    size = self._seen_size()
                k = max(0, min(n, size - offset))
                if k == 0:
                    return 0
                if offset + k <= w.length:
                    np.copyto(dst[:k], w.view[offset:offset + k])
                    return k
            finally:
                self._gate.leave()
            self._remap(offset + k)          # another process grew the file past our window

    def _pread_syscall(self, offset: int, mv: memoryview) -> int:
        done, n = 0, len(mv)
        self._gate.enter()
        try:
            while done < n:
                k = os.preadv(self._fd, [mv[done:]], offset + done)
                if k == 0:
                    break
                done += k
        except OSError as e:
            raise StorageError(e.errno, self.path, offset, n, "read") from e
        finally:
            self._gate.leave()
        return done

    def copy_to(self, dst: Any, chunk: int = 64 << 20) -> int:
        """Write this segment's bytes into the ByteStore ``dst`` (straight from the mapping);
        returns the number of bytes copied."""
        self._gate.enter()
        try:
            w = self._window()
            size = os.fstat(self._fd).st_size
            if size > w.length:
                raise ChemIOError(f"shm segment {self.path!r} grew past its mapping during a copy")
            for off in range(0, size, chunk):
                dst.pwrite(off, w.view[off:min(size, off + chunk)])
            return size
        finally:
            self._gate.leave()

    def pwrite(self, offset: int, data: Any) -> int:
        """Write all of ``data`` at ``offset`` (extending the file); returns its length."""
        if not self.writable:
            raise StorageError(errno.EBADF, self.path, offset, None, "write",
                               hint="the segment is open read-only")
        mv = _bytes_view(data, writable=False)
        n = len(mv)
        if n == 0:
            return 0
        src = np.frombuffer(mv, dtype=np.uint8)
        end = offset + n
        while True:
            self._gate.enter()
            try:
                w = self._window()
                if end > self._gate.size and end > self._seen_size():
                    self._extend(end, f"write of {n} bytes at offset {offset}")  # budget first
                if end <= w.length:
                    np.copyto(w.view[offset:end], src)
                    return n
            finally:
                self._gate.leave()
            self._remap(end)

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def allocated(self) -> int:
        """Bytes of RAM the segment holds (including preallocated pages past the end)."""
        return os.fstat(self._fd).st_blocks * 512

    def truncate(self, n: int) -> None:
        """Set the size to ``n``. Growing allocates (budget checked); shrinking waits until
        no other process is inside the segment."""
        if not self.writable:
            raise StorageError(errno.EBADF, self.path, None, n, "truncate",
                               hint="the segment is open read-only")
        self._gate.enter_excl()
        try:
            self._window()
            _flock(self._fd, fcntl.LOCK_EX)
            try:
                size = os.fstat(self._fd).st_size
                if n < size:
                    os.ftruncate(self._fd, n)
                    _forget_budget()
                elif n > size:
                    self._extend(n, f"truncate to {n} bytes")
            except OSError as e:
                if isinstance(e, ChemIOError):
                    raise
                raise StorageError(e.errno, self.path, None, n, "truncate") from e
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            if n > self._win.length:
                self._win.close()
                self._win = None
                self._win = _map(self._fd, n, self.writable)
        finally:
            self._gate.leave_excl()

    def reserve(self, n: int) -> None:
        """Allocate the first ``n`` bytes without changing the size (budget checked)."""
        if not self.writable:
            return
        with self._grow_lock:
            have = os.fstat(self._fd).st_blocks * 512
            need = _round_up(n) - have
            if need <= 0:
                return
            check_budget(self.path, need, f"reserve {n} bytes")
            err = _fallocate_keep_size(self._fd, n)
            if err in _NO_ROOM:
                raise _no_room(OSError(err, os.strerror(err)), self.path, need,
                               f"reserve {n} bytes")
            if err not in (0, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise StorageError(err, self.path, 0, n, "reserve")

    def advise(self, offset: int, length: int, advice: str) -> None:
        """Access hints mean nothing for RAM; accepted for protocol compatibility."""

    def flush(self) -> None:
        """Nothing to do: the bytes are in (shared) memory as soon as a write returns."""

    def lock_sole(self) -> bool:
        """Become the only open of this segment: False when another open (in any process)
        exists. While held, new opens wait; ``unlock_sole`` (or ``close``) ends it."""
        return _ofd_lock(self._fd, fcntl.F_WRLCK, wait=False)

    def unlock_sole(self) -> None:
        _ofd_lock(self._fd, fcntl.F_RDLCK, wait=True)      # back to a plain presence lock

    def close(self) -> None:
        if self._fd < 0:
            return
        self._gate.enter_excl()
        try:
            if self._win is not None:
                self._win.close()
                self._win = None
            fd, self._fd = self._fd, -1
            os.close(fd)                    # drops the presence lock and any flock
        finally:
            self._gate.leave_excl()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"<ShmByteStore {self.path!r}{' closed' if self.closed else ''}>"


# ---------------------------------------------------------------- the array store

class ShmArrayStore:
    """A DiskArray's data in RAM, in the raw grid format of ``chemio_py.layout``.

    Each chunk is a C-ordered block of the mapping, so a region moves with one NumPy copy
    per chunk it meets, straight between the mapping and the caller's (possibly strided)
    array. The whole array is allocated when it is created (budget checked), so no access
    can fault. A write touches only the region's bytes (``byte_addressable``); thread-safe
    for disjoint regions. ``read_all`` / ``write_all`` are the independent calls.
    """

    byte_addressable = True

    def __init__(self, seg: ShmByteStore, layout: Any, dtype: np.dtype):
        self._seg = seg
        self.path = seg.path
        self.writable = seg.writable
        self.layout = layout
        self.shape = layout.shape
        self.chunks = layout.chunks
        self.dtype = dtype

    @property
    def fd(self) -> int:
        return self._seg.fd

    @property
    def closed(self) -> bool:
        return self._seg.closed

    def _move(self, write: bool, region: Any, arr: np.ndarray) -> None:
        want = tuple(s.stop - s.start for s in region)
        if tuple(arr.shape) != want:
            raise ValueError(f"buffer shape {arr.shape} does not match region {want}")
        if arr.size == 0:
            return
        lay, isz, seg = self.layout, self.dtype.itemsize, self._seg
        if seg._holes and not write:
            self._read_sparse(region, arr)
            return
        seg._gate.enter()
        try:
            w = seg._window()
            size = seg._gate.size
            if size < lay.nbytes:
                size = seg._seen_size()
            if size < lay.nbytes or w.length < lay.nbytes:
                raise StorageError(errno.EIO, self.path, 0, lay.nbytes, "write" if write else "read",
                                   hint=f"the segment has {size} bytes, the array needs "
                                        f"{lay.nbytes}: it was truncated behind chemio's back")
            for p in lay.pieces(region):
                n = 1
                for e in p.extent:
                    n *= e
                chunk = w.view[p.offset:p.offset + n * isz].view(self.dtype).reshape(p.extent)
                inner = tuple(slice(a - i * c, a - i * c + k) for a, i, c, k
                              in zip(p.start, p.index, lay.chunks, p.shape))
                mine = tuple(slice(a - r.start, a - r.start + k) for a, r, k
                             in zip(p.start, region, p.shape))
                if write:
                    chunk[inner] = arr[mine]
                else:
                    arr[mine] = chunk[inner]
        finally:
            seg._gate.leave()

    def _read_sparse(self, region: Any, arr: np.ndarray) -> None:
        """Read a read-only store of a sparse segment with ``preadv``: a read fault on a
        hole would allocate a page and, with the tmpfs full, kill us with SIGBUS."""
        flat = _byte_span(arr, writable=True)
        if flat is None:
            tmp = np.empty(arr.shape, arr.dtype)
            self._read_sparse(region, tmp)
            arr[...] = tmp
            return
        offs, moffs, lens = self.layout.segments(region, arr.strides)
        for off, mo, n in zip(offs.tolist(), moffs.tolist(), lens.tolist()):
            if self._seg._pread_syscall(off, flat[mo:mo + n]) != n:
                raise StorageError(errno.EIO, self.path, off, n, "read",
                                   hint="the segment is shorter than the array: it was "
                                        "truncated behind chemio's back")

    def read(self, region: Any, out: np.ndarray) -> np.ndarray:
        """Fill ``out`` (the region's shape, this array's dtype) from RAM; returns it."""
        self._move(False, region, out)
        return out

    def write(self, region: Any, data: np.ndarray) -> None:
        """Copy ``data`` (the region's shape, this array's dtype) into the region."""
        if not self.writable:
            raise StorageError(errno.EBADF, self.path, None, None, "write",
                               "the array store is open read-only")
        self._move(True, region, data)

    def read_all(self, region: Any, out: np.ndarray, comm: Any = None) -> np.ndarray:
        return self.read(region, out)

    def write_all(self, region: Any, data: np.ndarray, comm: Any = None) -> None:
        self.write(region, data)

    def size(self) -> int:
        return self._seg.size()

    def allocated(self) -> int:
        return self._seg.allocated()

    def flush(self) -> None:
        """Nothing to do: a write is in shared memory when it returns."""

    def close(self) -> None:
        self._seg.close()

    def __repr__(self) -> str:
        return f"<ShmArrayStore {self.path!r} shape={self.shape} chunks={self.chunks}>"


# ---------------------------------------------------------------- opening

def open_segment(path: str, mode: str, perms: int = 0o600) -> tuple[int, bool]:
    """Open (creating per ``mode``) a segment file; returns (fd, created). The fd holds a
    presence lock; ``w+`` on an existing file empties it once no process is inside."""
    if mode not in _MODES:
        raise ValueError(f"mode {mode!r} is not one of {sorted(_MODES)}")
    flags = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK     # a FIFO there must not hang us
    created = False
    if mode == "w+":
        try:
            fd = os.open(path, _MODES["x+"] | flags, perms)
            created = True
        except FileExistsError:
            fd = os.open(path, os.O_RDWR | flags)
    else:
        fd = os.open(path, _MODES[mode] | flags, perms)
        created = mode == "x+"
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode):
            raise StorageError(errno.EINVAL, path, None, None, "open",
                               "it is not a regular file (a FIFO, device or directory?); "
                               "chemio segments are regular files")
        os.set_blocking(fd, True)
        _ofd_lock(fd, fcntl.F_RDLCK, wait=True)
        if mode == "w+" and not created:
            _flock(fd, fcntl.LOCK_EX)
            try:
                os.ftruncate(fd, 0)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            _forget_budget()
    except BaseException:
        os.close(fd)
        if created:
            try:
                os.unlink(path)
            except OSError:
                pass
        raise
    return fd, created


def _discard(store: Any, fd: int, path: str, created: bool) -> None:
    """Undo a half-made open: close (and unmap), and remove a file we created."""
    try:
        if store is not None:
            store.close()
        else:
            os.close(fd)
    except OSError:
        pass
    if created:
        try:
            os.unlink(path)
        except OSError:
            pass


def node_groups(hosts: list[str], node_ids: list[int]) -> dict[str, list[int]] | None:
    """Ranks per node when the ranks span several nodes, else None.

    ``node_ids[r]`` is the same for ranks that share memory with rank ``r`` (from an MPI
    shared-memory split); ``hosts[r]`` is its host name, used to label the nodes.
    """
    if len(set(node_ids)) <= 1:
        return None
    by_node: dict[int, list[int]] = {}
    for r, nid in enumerate(node_ids):
        by_node.setdefault(nid, []).append(r)
    names = [hosts[ranks[0]] for ranks in by_node.values()]
    groups = {}
    for (nid, ranks), name in zip(by_node.items(), names):
        label = name if names.count(name) == 1 else f"{name} (node of rank {ranks[0]})"
        groups[label] = ranks
    return groups


class ShmBackend:
    """RAM-resident files in the shm directory, mapped with mmap and shared within a node."""

    name = "shm"
    node_local = True

    @property
    def description(self) -> str:
        d = shm_dir()
        base = scratch._existing_ancestor(d)
        ok = os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK)
        if not ok:
            return (f"files in memory: mmap'ed files in {d} -- not a writable directory: "
                    f"set CHEMIO_SHM_DIR")
        try:
            b = ram_budget()
            budget = (f"; RAM budget {_fmt_bytes(b.headroom)} left of "
                      f"CHEMIO_SHM_LIMIT={b.limit_text!r} = {_fmt_bytes(b.limit)}")
        except Exception as e:  # noqa: BLE001 - a description must not fail
            budget = f"; RAM budget unknown ({e})"
        return f"files in memory: mmap'ed files in {d} ({scratch.fstype(d)}){budget}"

    def check_available(self) -> None:
        """Platform support only; a bad shm directory is an OSError when a file is made."""
        from chemio_py.errors import BackendUnavailableError
        if not hasattr(fcntl, "F_OFD_SETLK") or not hasattr(os, "posix_fallocate"):
            raise BackendUnavailableError("shm", "it needs Linux (OFD locks, fallocate)",
                                          "use backend='local'")
        try:
            _libc()
        except (OSError, AttributeError) as e:
            raise BackendUnavailableError("shm", f"libc mmap is not reachable ({e})",
                                          "use backend='local'") from e

    def root(self, scope: str, rank: int = 0) -> str:
        """The shm directory, for private and shared files alike (it is node-local)."""
        return shm_dir()

    def open_bytes(self, path: str, mode: str, *, direct: bool | None = None,
                   **_ignored: Any) -> ShmByteStore:
        fd, created = open_segment(path, mode)
        store = None
        try:
            store = ShmByteStore(path, fd, mode != "r")
            if mode == "r+":
                store._fill_holes()
        except BaseException:
            _discard(store, fd, path, created)
            raise
        return store

    def open_array(self, path: str, mode: str, *, shape: Any, dtype: Any, chunks: Any,
                   reserve: bool = True, perms: int = 0o600) -> ShmArrayStore:
        """Open the RAM segment of an array in the raw grid format (``chemio_py.layout``).

        ``w+``/``x+`` create it at its full size, every byte allocated after a RAM-budget
        check (``OutOfSpaceError`` now, not a SIGBUS later); ``r``/``r+`` require exactly
        the array's size. ``reserve`` is accepted for compatibility (RAM is always reserved).
        """
        from chemio_py.errors import MetadataError
        from chemio_py.layout import Layout
        dt = np.dtype(dtype)
        layout = Layout(shape, chunks, dt.itemsize)
        fd, created = open_segment(path, mode, perms)
        seg = None
        try:
            seg = ShmByteStore(path, fd, mode != "r")
            if mode in ("w+", "x+"):
                if layout.nbytes:
                    seg._extend(layout.nbytes, f"array of {layout.nbytes} bytes")
                if layout.nbytes > seg._win.length:
                    seg._remap(layout.nbytes)
            else:
                size = os.fstat(fd).st_size
                if size != layout.nbytes:
                    raise MetadataError(
                        f"segment {path!r} has {size} bytes but the array's metadata (shape "
                        f"{layout.shape}, {dt}) needs {layout.nbytes}; it was truncated or "
                        f"belongs to another array: recreate the array")
                if mode == "r+":
                    seg._fill_holes()
        except BaseException:
            _discard(seg, fd, path, created)
            raise
        return ShmArrayStore(seg, layout, dt)

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def stat(self, path: str) -> scratch.FsInfo:
        """Free = the RAM budget's headroom, total = its limit, for ``path``'s directory."""
        b = ram_budget(os.path.dirname(os.path.abspath(path)))
        return scratch.FsInfo(os.path.abspath(path), b.headroom, b.limit, b.fstype)

    def remove(self, path: str) -> bool:
        """Delete the segment (or directory tree) at ``path``; False when it did not exist."""
        if not scratch.remove_path(path):
            return False
        _forget_budget()
        return True

    def budget(self) -> RamBudget:
        return ram_budget()

    def check_collective(self, comm: Any, what: str) -> None:
        """Collective: raise ``NodeSpanError`` on every rank when ``comm`` spans nodes.

        Shm segments are visible on one node only; the ranks are grouped with an MPI
        shared-memory split (``COMM_TYPE_SHARED``) and the error names the nodes.
        """
        if comm is None or getattr(comm, "size", 1) <= 1 or getattr(comm, "mpi", None) is None:
            return
        import socket
        from mpi4py import MPI
        node = comm.mpi.Split_type(MPI.COMM_TYPE_SHARED, comm.rank)
        try:
            leader = node.bcast(comm.rank, root=0)
        finally:
            node.Free()
        info = comm.allgather((socket.gethostname(), leader))
        groups = node_groups([h for h, _ in info], [n for _, n in info])
        if groups:
            listing = "; ".join(f"{h}: ranks {rs}" for h, rs in groups.items())
            raise NodeSpanError(
                f"{what} on backend 'shm' spans {len(groups)} nodes ({listing}), but shm "
                f"segments live in one node's memory; use backend='local' with a shared "
                f"file system (CHEMIO_SHARED_SCRATCH), or a communicator of one node "
                f"(comm.Split_type(MPI.COMM_TYPE_SHARED))")
