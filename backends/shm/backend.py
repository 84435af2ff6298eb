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

Ownership: files are created ``O_EXCL`` (a byte file opened ``w+`` is reused after an
exclusive-locked truncation, as ``O_TRUNC`` does on disk), mode 0600, in the job directory
under the shm directory, so leases cover them and ``chemio clean`` removes the segments of
dead jobs. The user layer decides who removes them.

Re-creating an array (``open_array`` with ``w+``) makes a new segment: the old one is
renamed out of the way (:func:`retire`), so processes that still map it read the old array,
never the new bytes under the old shape. While a reader keeps it, the retired segment stays
in the job directory, where the RAM budget counts it; the last reader's ``close`` removes it
(:func:`reap_retired`), or else the next re-create of the name or its creator's cleanup.

The parts live in modules of their own: the mmap window in ``shm_map``, the locks in
``shm_lock``, the RAM budget in ``ram_budget``; this module holds the stores (byte and
array) and the backend.
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading
from contextlib import nullcontext
from typing import Any

import numpy as np

from chemio_py.backends.contract import ArrayStore, ByteStore
from chemio_py.backends.posix import byte_span, bytes_view, fallocate_keep_size, require_regular
from chemio_py.backends.shm.budget import (
    NO_ROOM,
    RamBudget,
    check_budget,
    forget_budget,
    no_room,
    ram_budget,
    shm_dir,
)
from chemio_py.backends.shm.lock import Gate, flock_fd, ofd_lock, ofd_lock_wait
from chemio_py.backends.shm.mapping import Window, libc_calls, map_window, round_up
from chemio_py.errors import ChemIOError, NodeSpanError, StorageError, fmt_bytes
from chemio_py.runtime import finalizers
from chemio_py.scratch import fs, jobs

_MODES = {
    "r": os.O_RDONLY,
    "r+": os.O_RDWR,
    "w+": os.O_RDWR | os.O_CREAT,
    "x+": os.O_RDWR | os.O_CREAT | os.O_EXCL,
}


# ---------------------------------------------------------------- the byte store

class ShmByteStore:
    """A byte-addressable file in RAM (see ``chemio_py.backends`` for the protocol)."""

    def __init__(self, path: str, fd: int, writable: bool):
        self.path = path
        self.writable = writable
        self._fd = fd
        self._gate = Gate(fd)
        self._grow_lock = threading.Lock()
        st = os.fstat(fd)
        self._ino = st.st_ino               # names the segment once retired (re-created)
        self._win: Window | None = map_window(fd, st.st_size, writable)
        # A read fault on a hole of a tmpfs file allocates a page (and can SIGBUS when RAM
        # is short). Writable stores never have holes; a read-only store of a sparse file
        # made by someone else reads with preadv, which returns zeros for holes.
        self._holes = not writable and st.st_blocks * 512 < round_up(st.st_size)

    # ------------------------------------------------------------ helpers
    @property
    def fd(self) -> int:
        return self._fd

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def _window(self) -> Window:
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
                self._win = map_window(self._fd, needed, self.writable)
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
            need = round_up(end) - st.st_blocks * 512
            check_budget(self.path, need, what)
            try:
                os.posix_fallocate(self._fd, size, end - size)     # never shrinks: race-free
            except OSError as e:
                if e.errno in NO_ROOM:
                    raise no_room(e, self.path, max(need, 0), what) from e
                raise StorageError(e.errno, self.path, size, end - size, "extend") from e
            if self._gate._held and end > self._gate.size:
                self._gate.size = end

    def _fill_holes(self) -> None:
        """Back every page of the current size (a writable open of a sparse file)."""
        st = os.fstat(self._fd)
        if st.st_blocks * 512 >= round_up(st.st_size):
            return
        need = round_up(st.st_size) - st.st_blocks * 512
        check_budget(self.path, need, "back the holes of an existing file")
        try:
            os.posix_fallocate(self._fd, 0, st.st_size)
        except OSError as e:
            if e.errno in NO_ROOM:
                raise no_room(e, self.path, need, "back the holes of an existing file") from e
            raise StorageError(e.errno, self.path, 0, st.st_size, "allocate") from e

    # ------------------------------------------------------------ the protocol
    def pread(self, offset: int, out: Any) -> int:
        """Fill ``out`` from ``offset``; returns the bytes read (fewer only at end of file)."""
        mv = bytes_view(out, writable=True)
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
        mv = bytes_view(data, writable=False)
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
            flock_fd(self._fd, fcntl.LOCK_EX)
            try:
                size = os.fstat(self._fd).st_size
                if n < size:
                    os.ftruncate(self._fd, n)
                    forget_budget()
                elif n > size:
                    self._extend(n, f"truncate to {n} bytes")
            except OSError as e:
                if isinstance(e, ChemIOError):
                    raise
                raise StorageError(e.errno, self.path, None, n, "truncate") from e
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            assert self._win is not None        # self._window() mapped it
            if n > self._win.length:
                self._win.close()
                self._win = None
                self._win = map_window(self._fd, n, self.writable)
        finally:
            self._gate.leave_excl()

    def reserve(self, n: int) -> None:
        """Allocate the first ``n`` bytes without changing the size (budget checked)."""
        if not self.writable:
            return
        with self._grow_lock:
            have = os.fstat(self._fd).st_blocks * 512
            need = round_up(n) - have
            if need <= 0:
                return
            check_budget(self.path, need, f"reserve {n} bytes")
            err = fallocate_keep_size(self._fd, n)
            if err in NO_ROOM:
                raise no_room(OSError(err, os.strerror(err)), self.path, need,
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
        return ofd_lock(self._fd, fcntl.F_WRLCK, wait=False)

    def unlock_sole(self) -> None:
        ofd_lock(self._fd, fcntl.F_RDLCK, wait=True)      # back to a plain presence lock

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
        try:                                # the last reader of a re-created array's old
            reap_retired(retired_path(self.path, self._ino), self._ino)   # segment frees it
        except OSError:
            pass

    def __del__(self):
        finalizers.close_later(self.close)

    def __repr__(self) -> str:
        return f"<ShmByteStore {self.path!r}{' closed' if self.closed else ''}>"


# ---------------------------------------------------------------- the array store

class ShmArrayStore:
    """A DiskArray's data in RAM, in the raw grid format of ``chemio_py.backends.grid``.

    Each chunk is a C-ordered block of the mapping, so a region moves with one NumPy copy
    per block of like chunk pieces (``Layout.copy_blocks``: at most 3**ndim, whatever the
    number of chunks), straight between the mapping and the caller's (possibly strided)
    array. The whole array is allocated when it is created (budget checked), so no access
    can fault. A write touches only the region's bytes (``byte_addressable``); thread-safe
    for disjoint regions. ``read_all`` / ``write_all`` are the independent calls.
    """

    byte_addressable = True

    def __init__(self, seg: ShmByteStore, layout: Any, dtype: np.dtype, shape: Any = None,
                 maxshape: Any = None):
        self._seg = seg
        self.path = seg.path
        self.writable = seg.writable
        self.layout = layout                       # of the capacity (a resizable array)
        self.shape = layout.shape if shape is None else tuple(int(n) for n in shape)
        self.maxshape = self.shape if maxshape is None else tuple(maxshape)
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
        lay, seg = self.layout, self._seg
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
                raise StorageError(errno.EIO, self.path, 0, lay.nbytes,
                                   "write" if write else "read",
                                   hint=f"the segment has {size} bytes, the array needs "
                                        f"{lay.nbytes}: it was truncated behind chemio's back")
            lay.copy_blocks(region, w.view, self.dtype, arr, write)
        finally:
            seg._gate.leave()

    def _read_sparse(self, region: Any, arr: np.ndarray) -> None:
        """Read a read-only store of a sparse segment with ``preadv``: a read fault on a
        hole would allocate a page and, with the tmpfs full, kill us with SIGBUS."""
        flat = byte_span(arr, writable=True)
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

    def resize(self, shape: Any, comm: Any = None) -> None:
        """``Resizable.resize``: rank 0 zeroes what a shrink leaves in the segment outside
        the new shape and sets the segment to the new capacity (a growth allocates every
        byte after a RAM-budget check: ``OutOfSpaceError`` changes nothing); every rank
        then maps the new size and takes the new shape."""
        from chemio_py.backends.grid import Layout, capacity, stale_regions, zero_regions
        new = tuple(int(n) for n in shape)
        lay = Layout(capacity(new, self.chunks, self.maxshape), self.chunks,
                     self.layout.itemsize)
        what = f"resize array {self.path}"
        with (nullcontext() if comm is None else comm.agree(what)):
            if comm is None or comm.rank == 0:
                if not self.writable:
                    raise StorageError(errno.EBADF, self.path, None, None, "resize",
                                       "the array store is open read-only")
                if lay.nbytes > self.layout.nbytes:
                    self._seg.truncate(lay.nbytes)      # budget first: nothing lost on failure
                kept = (min(lay.shape[0], self.layout.shape[0]), *self.layout.shape[1:])
                zero_regions(self.write, stale_regions(self.shape, new, kept),
                             self.chunks, self.dtype)
                if lay.nbytes < self.layout.nbytes:
                    self._seg.truncate(lay.nbytes)
        with (nullcontext() if comm is None else comm.agree(what)):
            w = self._seg._window()
            if lay.nbytes > w.length:
                self._seg._remap(lay.nbytes)
        self.layout, self.shape = lay, new

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

RETIRED_TAG = ".retired-"


def retired_path(path: str, ino: int) -> str:
    """The name under which the old segment (inode ``ino``) of a re-created array at
    ``path`` waits for its last reader: hidden, in the same directory."""
    d, base = os.path.split(path)
    return os.path.join(d, f".{base}{RETIRED_TAG}{ino}")


def reap_retired(retired: str, ino: int | None = None) -> bool:
    """Remove the retired segment ``retired`` (of inode ``ino``, if given) when no open
    holds it; True when it is gone. Every open holds a presence lock, so a failed attempt
    means a reader is still there, and its ``close`` attempts again."""
    try:
        fd = os.open(retired, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (ino is not None and st.st_ino != ino):
            return False
        if not ofd_lock(fd, fcntl.F_WRLCK, wait=False):
            return False
        try:
            if os.lstat(retired).st_ino == st.st_ino:
                os.unlink(retired)
        except FileNotFoundError:
            pass
    finally:
        os.close(fd)
    forget_budget()
    return True


def _remove_retired(retired: str) -> bool:
    """Cleanup of a retired segment by its creator: readers still mapping it keep it."""
    gone = jobs.remove_path(retired)
    forget_budget()
    return gone


def retire(path: str) -> None:
    """Move the segment at ``path`` out of the way of a new array there (``w+``).

    Processes that map the old segment keep reading it. In a job directory of this process
    it is renamed to :func:`retired_path` (the RAM budget counts it while readers keep it)
    and removed now if no one has it open, else by its last reader's ``close``, the next
    re-create of ``path`` or this process's cleanup; elsewhere it is unlinked (the kernel
    frees it with its last mapping). A symbolic link is removed; anything else in the way
    is a ``StorageError``."""
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and jobs.in_job_dir(path):
            retired = retired_path(path, st.st_ino)
            os.rename(path, retired)
            ino = os.lstat(retired).st_ino
            if ino != st.st_ino:            # replaced between lstat and rename: name it right
                os.rename(retired, retired_path(path, ino))
            d, base = os.path.split(path)
            prefix = f".{base}{RETIRED_TAG}"
            for name in os.listdir(d):      # this one, and any whose reader was killed
                if name.startswith(prefix) and not reap_retired(os.path.join(d, name)):
                    jobs.own(os.path.join(d, name), _remove_retired)
        elif stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
            os.unlink(path)
        else:
            raise StorageError(errno.EEXIST, path, None, None, "create the array",
                               "something that is not a regular file is in the way; remove "
                               "it or choose another name")
    except FileNotFoundError:
        return                              # nothing there (any more)
    except OSError as e:
        if isinstance(e, StorageError):
            raise
        raise StorageError(e.errno, path, None, None, "move the old array out of the way") \
            from e
    finally:
        forget_budget()


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
        require_regular(fd, path)
        ofd_lock_wait(fd, fcntl.F_RDLCK, path)     # bounded: a stuck holder is an error
        if mode == "w+" and not created:
            flock_fd(fd, fcntl.LOCK_EX)
            try:
                os.ftruncate(fd, 0)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            forget_budget()
    except BaseException:
        os.close(fd)
        if created:
            try:
                os.unlink(path)
            except OSError:
                pass
        raise
    return fd, created


def _discard(store: ByteStore | ArrayStore | None, fd: int, path: str,
             created: bool) -> None:
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
    for (_nid, ranks), name in zip(by_node.items(), names):
        label = name if names.count(name) == 1 else f"{name} (node of rank {ranks[0]})"
        groups[label] = ranks
    return groups


class ShmBackend:
    """RAM-resident files in the shm directory, mapped with mmap and shared within a node."""

    name = "shm"
    node_local = True
    resizable_arrays = True

    @property
    def description(self) -> str:
        d = shm_dir()
        base = fs.existing_ancestor(d)
        ok = os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK)
        if not ok:
            return (f"files in memory: mmap'ed files in {d} -- not a writable directory: "
                    f"set CHEMIO_SHM_DIR")
        try:
            b = ram_budget()
            budget = (f"; RAM budget {fmt_bytes(b.headroom)} left of "
                      f"CHEMIO_SHM_LIMIT={b.limit_text!r} = {fmt_bytes(b.limit)}")
        except Exception as e:  # noqa: BLE001 - a description must not fail
            budget = f"; RAM budget unknown ({e})"
        return f"files in memory: mmap'ed files in {d} ({fs.fstype(d)}){budget}"

    def check_available(self) -> None:
        """Platform support only; a bad shm directory is an OSError when a file is made."""
        from chemio_py.errors import BackendUnavailableError
        if not hasattr(fcntl, "F_OFD_SETLK") or not hasattr(os, "posix_fallocate"):
            raise BackendUnavailableError("shm", "it needs Linux (OFD locks, fallocate)",
                                          "use backend='local'")
        try:
            libc_calls()
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
                   reserve: bool = True, perms: int = 0o600,
                   maxshape: Any = None) -> ShmArrayStore:
        """Open the RAM segment of an array in the raw grid format (``chemio_py.backends.grid``).

        ``w+``/``x+`` create it at its full size, every byte allocated after a RAM-budget
        check (``OutOfSpaceError`` now, not a SIGBUS later); ``w+`` makes a new segment,
        retiring an old one (:func:`retire`) whose readers keep its data. ``r``/``r+``
        require exactly the array's size. ``reserve`` is accepted for compatibility (RAM is
        always reserved).
        """
        from chemio_py.backends.grid import Layout, capacity
        from chemio_py.errors import MetadataError
        if mode not in _MODES:
            raise ValueError(f"mode {mode!r} is not one of {sorted(_MODES)}")
        dt = np.dtype(dtype)
        layout = Layout(capacity(shape, chunks, maxshape), chunks, dt.itemsize)
        if mode == "w+":
            retire(path)
        fd, created = open_segment(path, "x+" if mode == "w+" else mode, perms)
        seg = None
        try:
            seg = ShmByteStore(path, fd, mode != "r")
            if mode in ("w+", "x+"):
                if layout.nbytes:
                    seg._extend(layout.nbytes, f"array of {layout.nbytes} bytes")
                assert seg._win is not None     # a new store is mapped
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
        return ShmArrayStore(seg, layout, dt, shape, maxshape)

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def stat(self, path: str) -> fs.FsInfo:
        """Free = the RAM budget's headroom, total = its limit, for ``path``'s directory."""
        b = ram_budget(os.path.dirname(os.path.abspath(path)))
        return fs.FsInfo(os.path.abspath(path), b.headroom, b.limit, b.fstype)

    def remove(self, path: str) -> bool:
        """Delete the segment (or directory tree) at ``path``; False when it did not exist."""
        if not jobs.remove_path(path):
            return False
        forget_budget()
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
