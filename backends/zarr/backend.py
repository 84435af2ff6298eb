"""The ``zarr`` backend: DiskArrays as standard Zarr v3 arrays, safe with many writers.

An array is a directory that plain ``zarr.open_array``, ``dask.array.from_zarr`` and
``xarray.open_zarr`` read (format in ``zarr_format``). The DiskArray ``chunks`` are the
storage objects (the zarr chunk grid); an object larger than 2 MiB is a shard of inner
chunks of about 256 KiB–1 MiB (``inner_chunks=`` sets them, ``False`` turns sharding off).
Compression: ``compressor=`` (``"zstd[:level]"``, ``"blosc[:cname[:level[:shuffle]]]"``,
``"none"``) or the ``compressor`` setting (``configure``, ``CHEMIO_COMPRESSOR``, TOML
``[files]`` rule).

The I/O path is chemio's own: numcodecs encodes and decodes; every object is written whole
to a temporary name in its directory and put in place atomically, so a reader sees the old
object or the new one, never a torn one: an existing object is exchanged with the new file
(``renameat2(RENAME_EXCHANGE)``; ``os.replace`` where the kernel or file system cannot) and
the old file, now under the temporary name, is unlinked by a thread of its own (freeing its
blocks is most of a replacing rename's cost), before the write returns (in a persistent
array the new file's write-back is started before it replaces an object, as ext4 does for a
rename over a file, so that a crash leaves the old object or the new one); shards are read
through their index, decoding only the inner chunks a region needs. Objects holding only
zeros are not stored (read as zeros), nor are a raw shard's all-zero inner chunks.
An object is written with ``pwritev`` straight from its parts (the encoded inner chunks and
the index of a shard) into a temporary file preallocated with ``fallocate`` when it is 1 MiB
or more (skipped where the file system refuses); a shard of raw inner chunks (zero fill) is
written chunk by chunk at its place in the file from the caller's array, a block that is
not contiguous there through a per-thread tile that stays in the CPU cache (no staging copy
of the shard). Inner chunks stored raw are read straight into the caller's array where their
place in it is contiguous (runs of neighbours in one ``preadv``), the others into a reused
per-thread buffer (never a zero-filled one per object); the threads' buffers are dropped
when the last open store of the process closes (``held_bytes`` says what they hold). The
inner chunks of a large shard (4 MiB or more) are encoded and written, or read and decoded,
over chemio's I/O pool, the calling thread working too.

Durability: a persistent array (any array chemio did not create as scratch) is made durable
by ``flush()`` and by ``close()``: one pass starts the write-back of every object written
since the last flush (``sync_file_range``), the next fsyncs them, then each key directory
whose entries changed is fsynced once (writes leave the write-back to the kernel until
then: starting it per object made the writer wait for the device). A scratch array
(``"persistent": false`` in chemio's entry of the attributes) is removed when it closes, so
it is never synced (a crash loses it anyway). No write fsyncs by itself. Objects are never
rewritten in place, not even those this process created: another process reading a
half-rewritten compressed object would decode garbage, and a crash would leave a torn
object in a persistent array; an object's cost is one create, one write and one rename
(an exchange, the old file unlinked off the writer's thread).

Many writers: ``write_all`` is collective two-phase I/O (``zarr_exchange``): each object
gets one owner rank, which alone rewrites it, so writers of disjoint regions never lose
each other's updates. A write that covers only part of an object reads, merges and
rewrites it; writers the library cannot see (processes without MPI, dask workers, other
scripts) would lose each other's updates there, so by default (``lock=None``) every such
read-merge-rewrite holds an exclusive ``fcntl`` lock on one byte of the array's
``zarr.json`` (the object's index; the file is opened for writing but never written, so
the array stays what zarr-python writes; ``.chemio-lock`` when ``zarr.json`` is not
writable or the kernel lacks open-file-description locks): two system calls on a path
that already reads, decodes, encodes and renames. Writes of whole objects take no lock:
a disjoint writer never shares such an object. ``lock=True`` locks every object write,
``lock=False`` none (the caller promises one writer per object). Under MPI, an
independent partial ``write`` while other ranks hold the array writable is refused (use
``write_all``) unless ``lock=True``. On Lustre the locks need the ``flock`` mount option
(``localflock`` locks only within one node); a file system without locks makes such a
write a ``StorageError`` that says so.

Paths are resolved on every access, not remembered: the store holds a descriptor of the
array directory from the open and reaches every key directory and object from it, one
component at a time with ``O_NOFOLLOW`` (``openat``); the key directories it opened stay
open (a bounded cache), so a name swapped for a link later redirects nothing.
"""
from __future__ import annotations

import atexit
import collections
import errno
import fcntl
import importlib.util
import itertools
import math
import os
import stat as _stat
import sys
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from itertools import product
from typing import Any

import numpy as np

from chemio_py.backends.grid import Layout, region_nbytes
from chemio_py.backends.posix import (
    DIR_FLAGS,
    SPACE_ERRNOS,
    ScratchPlaces,
    clear_dir,
    removal_error,
    remove_dir_at,
    remove_entry_at,
    FLOCK,
    ofd_lock,
    wait_until,
)
from chemio_py.backends.zarr import exchange as _xchg, format as zf
from chemio_py.errors import (
    ArgumentError,
    BackendUnavailableError,
    ChemIOError,
    CollectiveError,
    MetadataError,
    ModeError,
    OutOfSpaceError,
    StorageError,
)
from chemio_py.runtime import config, finalizers
from chemio_py.runtime.blas import cpu_share
from chemio_py.scratch import fs, jobs

SHARD_ABOVE = 2 << 20            # objects larger than this are sharded by default
INNER_TARGET = 1 << 20           # default inner chunk: at most this ...
INNER_MIN = 256 << 10            # ... and not less than this when the shape allows
LOCK_NAME = ".chemio-lock"
TASK_BYTES = 4 << 20             # read_all/write_all fan out in tasks of about this
_STRIPES = 64
_DIRTY_MAX = 1 << 16             # objects remembered for flush; beyond: flush syncs all
_MODES = ("r", "r+", "w+", "x+")
_AHEAD = 64                       # objects a read opens and queues before reading them
_DIR_CACHE = 64                   # key directories a store holds open (least recent closed)
_OBJ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)
SETTLE_SECONDS = 2.0              # an open waits this long for a re-create under way
# Encoding and decoding are CPU work: more tasks at once than two per core only contend.
CODEC_TASKS = 2 * (os.cpu_count() or 1)
FAN_BYTES = 4 << 20               # inner chunks of a shard this large in all: over the pool
_SYNC_BATCH = 256                 # objects whose write-back a flush starts together


def _spf(n: int) -> int:
    """The smallest prime factor of ``n`` > 1."""
    p = 2
    while p * p <= n:
        if n % p == 0:
            return p
        p += 1
    return n


def default_inner(chunks: tuple, itemsize: int) -> tuple | None:
    """Inner chunks for an object of ``chunks`` (None: no sharding): divisors of the
    object shape of at most ``INNER_TARGET`` bytes, cutting the longest axis first."""
    if math.prod(chunks) * itemsize <= SHARD_ABOVE:
        return None
    inner = list(chunks)
    size = math.prod(inner) * itemsize
    while size > INNER_TARGET:
        steps = [(k, _spf(inner[k])) for k in range(len(inner)) if inner[k] > 1]
        good = [(k, p) for k, p in steps if size // p >= INNER_MIN]
        if good:
            k, p = max(good, key=lambda t: (inner[t[0]], -t[0]))
        else:
            k, p = min(steps, key=lambda t: (t[1], t[0]))
        inner[k] //= p
        size //= p
    return tuple(inner) if size >= INNER_MIN // 8 else None


def _in_process_locks() -> list:
    return [threading.Lock() for _ in range(_STRIPES)]


_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", None) \
    if sys.platform.startswith("linux") and FLOCK.size == 32 else None
_OFD_PROBED = False


def _ofd_works(fd: int) -> bool:
    """Whether open-file-description locks work on ``fd`` (this kernel has them; probed
    once per process)."""
    global _OFD_SETLKW, _OFD_PROBED
    if _OFD_SETLKW is not None and not _OFD_PROBED:
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_GETLK, FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0))
        except OSError as e:
            if e.errno == errno.EINVAL:
                _OFD_SETLKW = None
        _OFD_PROBED = True
    return _OFD_SETLKW is not None


LOCK_WAIT = 600.0          # seconds a writer waits for another process's object lock


def _try_byte_lock(fd: int, at: int) -> bool:
    """Take the exclusive lock of byte ``at`` of ``fd`` if nobody holds it (no wait)."""
    global _OFD_SETLKW
    if _OFD_SETLKW is not None:
        try:
            return ofd_lock(fd, fcntl.F_WRLCK, at=at)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            _OFD_SETLKW = None                  # a kernel before 3.15
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, at)
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def byte_lock(fd: int, at: int, take: bool, timeout: float | None = None) -> None:
    """Take (``take``) or release the exclusive lock of byte ``at`` of ``fd``: an
    open-file-description lock where the kernel has them (it also excludes the other
    handles of this process, and closing another descriptor never drops it), else
    ``lockf``. Taking waits at most ``timeout`` seconds (None: ``LOCK_WAIT``) for another
    holder (a dead one lets go at once; a stopped one would hold it for ever), then raises
    ``TimeoutError`` with nothing taken."""
    if not take:
        if _OFD_SETLKW is not None:
            ofd_lock(fd, fcntl.F_UNLCK, at=at)
        else:
            fcntl.lockf(fd, fcntl.LOCK_UN, 1, at)
        return
    wait = LOCK_WAIT if timeout is None else timeout
    if not wait_until(lambda: _try_byte_lock(fd, at), wait):
        raise TimeoutError(errno.ETIMEDOUT, f"byte {at} of the lock file stayed locked by "
                           f"another writer for {wait:g} s")


class ZarrArrayStore:
    """One open Zarr v3 array (see the module docstring). Thread-safe for disjoint
    regions; objects are rewritten whole, so ``byte_addressable`` is False and
    ``collective`` is True (``write_all`` is two-phase collective I/O). It owns ``root``,
    a descriptor of the array directory, from which every object is reached."""

    byte_addressable = False
    collective = True
    write_streams = CODEC_TASKS
    # Sections read in at most one task per core of the rank's share: each task already
    # queues the reads of its next objects at once (_AHEAD), and more tasks only hand the
    # GIL around. Cold reads of 64 KB objects, median of 7 interleaved rounds against
    # TensorStore in the same process: 0.64-0.76x with 4 tasks on 2 cores, 0.87-0.99x with
    # 2 (and half the CPU time); 2 MB and sharded objects measured the same either way.
    read_streams = max(1, int(cpu_share()))

    def __init__(self, path: str, meta: zf.ZarrMeta, writable: bool, perms: int,
                 comm: Any = None, lock: bool | None = None, root: int | None = None):
        self._dir_lock = threading.Lock()
        self._dirfds: OrderedDict = OrderedDict()   # key dir -> [fd, users, dropped]
        self._closed = False
        self._counted = False                   # in _OPEN (the thread buffers' users)
        self._lockfd = -1
        self._root = zf.open_dir(path) if root is None else root
        self.path = path
        self.meta = meta
        self.shape = meta.shape
        self.chunks = meta.chunks
        self.maxshape = meta.shape              # a resizable array's: set by open_array
        self.dtype = meta.dtype
        self.writable = writable
        self._perms = perms & 0o666
        self._dperms = (perms & 0o666) | ((perms & 0o444) >> 2)
        self._comm = comm
        self._layout = Layout(meta.shape, meta.chunks, meta.dtype.itemsize)
        self._stripes = _in_process_locks()
        self._dirty: set = set()                # (key dir, object name or None)
        self._dirty_all = False
        self._dirty_lock = threading.Lock()
        self._shared_writers = writable and comm is not None and comm.size > 1
        self._lock_mode = lock
        self._lockfd_guard = threading.Lock()
        self._lock_path = os.path.join(path, zf.META_NAME)
        self.lock = bool(lock is True and writable)
        self._object_limit = meta.stored_bound
        self._durable = durable_array(meta)
        self._zarr_python: Any = None           # zarr.Array of a foreign array, once read
        _store_opened(1)
        self._counted = True
        if self.lock:
            try:
                self._lockfd = self._open_lock_file()
            except BaseException:
                self.close()
                raise

    def __repr__(self) -> str:
        return f"<ZarrArrayStore {self.path!r} shape={self.shape} chunks={self.chunks}>"

    @property
    def compression(self) -> str | None:
        """The codec for a reader (``"zstd level 3"``, ``"blosc lz4 level 5 shuffle"``,
        sharding's inner chunks too), None when the objects are not compressed."""
        c = zf.compressor_of(self.meta)
        shard = self.meta.shard
        inner = f", shards of inner chunks {tuple(shard.inner)}" if shard else ""
        if c is None:
            return f"none{inner}" if inner else None
        if c["id"] == "zstd":
            text = f"zstd level {c['level']}"
        elif c["id"] == "blosc":
            text = f"blosc {c['cname']} level {c['level']} {c['shuffle']}"
        else:
            text = c["id"]
        return text + inner

    # ------------------------------------------------------------ helpers
    def _where(self, index: tuple) -> str:
        return f"{os.path.join(self.path, self.meta.key(index))}"

    def _check(self, region: tuple, arr: np.ndarray) -> None:
        if self._closed:
            raise ChemIOError(f"the zarr array store {self.path!r} is closed")
        want = tuple(s.stop - s.start for s in region)
        if tuple(arr.shape) != want:
            raise ValueError(f"buffer shape {arr.shape} does not match region {want}")

    # ------------------------------------------------------------ directories, by descriptor
    def _dir_get(self, rel: str, create: bool) -> list | None:
        """The open key directory ``rel`` (``"c/1"``) as ``[fd, users, dropped]`` with one
        more user (hand it back with ``_dir_put``), or None when it is absent. Opened from
        the array's descriptor one component at a time without following links (made when
        ``create``); a link or a file on the way raises ``MetadataError``."""
        with self._dir_lock:
            if self._closed:
                raise ChemIOError(f"the zarr array store {self.path!r} is closed")
            e = self._dirfds.get(rel)
            if e is not None:
                e[1] += 1
                self._dirfds.move_to_end(rel)
                return e
        parent, _, name = rel.rpartition("/")
        pe = self._dir_get(parent, create) if parent else None
        if parent and pe is None:
            return None
        try:
            fd = self._open_dir_at(self._root if pe is None else pe[0], name, rel, create)
        finally:
            if pe is not None:
                self._dir_put(pe)
        if fd < 0:
            return None
        with self._dir_lock:
            e = self._dirfds.get(rel)
            if e is not None or self._closed:   # another thread was quicker, or closed
                os.close(fd)
                if e is None:
                    raise ChemIOError(f"the zarr array store {self.path!r} is closed")
                e[1] += 1
                return e
            e = [fd, 1, False]
            self._dirfds[rel] = e
            if len(self._dirfds) > _DIR_CACHE:
                for old in list(self._dirfds):
                    if len(self._dirfds) <= _DIR_CACHE:
                        break
                    o = self._dirfds[old]
                    if o[1] == 0:
                        del self._dirfds[old]
                        os.close(o[0])
            return e

    def _dir_put(self, e: list) -> None:
        with self._dir_lock:
            e[1] -= 1
            if e[2] and e[1] == 0:
                os.close(e[0])

    def _dir_forget(self, rel: str, e: list) -> None:
        """Drop ``e`` (key directory ``rel``, removed meanwhile) from the cache: the next
        use opens the name again; the descriptor closes with its last user."""
        with self._dir_lock:
            if self._dirfds.get(rel) is e:
                del self._dirfds[rel]
            e[2] = True

    def _open_dir_at(self, parent: int, name: str, rel: str, create: bool) -> int:
        """A descriptor of directory ``name`` in ``parent`` (``rel`` inside the array),
        made when absent and ``create``; -1 when absent."""
        try:
            return os.open(name, DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                return -1
        except OSError as e:
            raise self._not_a_dir(parent, name, rel, e) from None
        try:
            os.mkdir(name, self._dperms | 0o700, dir_fd=parent)
            self._mark(rel.rpartition("/")[0], None)
        except FileExistsError:
            pass
        except OSError as e:
            raise self._error(e, os.path.join(self.path, rel), "mkdir") from e
        try:
            return os.open(name, DIR_FLAGS, dir_fd=parent)
        except OSError as e:
            raise self._not_a_dir(parent, name, rel, e) from None

    def _not_a_dir(self, parent: int, name: str, rel: str, e: OSError) -> Exception:
        full = os.path.join(self.path, rel)
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            return self._error(e, full, "open")
        try:
            link = _stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
        except OSError:
            link = e.errno == errno.ELOOP
        what = "a symbolic link" if link else "not a directory"
        return MetadataError(f"{full!r} inside the Zarr array {self.path!r} is {what}; refused "
                             f"(objects must stay inside the array's directory)")

    def _gone(self, fd: int) -> bool:
        """Whether the directory open as ``fd`` has been removed."""
        try:
            return os.fstat(fd).st_nlink == 0
        except OSError:
            return False

    def _check_present(self, op: str = "read") -> None:
        """Raise ``StorageError`` when the array this store opened is no longer there
        (removed, or replaced by a re-create: its ``zarr.json`` is gone), so that an
        absent object is never taken for the fill value of a vanished array."""
        try:
            os.stat(zf.META_NAME, dir_fd=self._root, follow_symlinks=False)
        except FileNotFoundError:
            raise self._removed(op) from None
        except OSError:
            pass

    def _removed(self, op: str) -> StorageError:
        return StorageError(errno.ENOENT, self.path, None, None, op,
                            "the Zarr array was removed, or re-created by another process, "
                            "after this handle opened it (its zarr.json is gone); open it "
                            "again to use the array that is there now")

    def _error(self, e: OSError, path: str, what: str, n: int | None = None) -> Exception:
        if e.errno in SPACE_ERRNOS:
            try:
                free = fs.stat(path).free
            except OSError:
                free = None
            return OutOfSpaceError(path, n, free, what=what)
        if e.errno == errno.ENOENT and self._root >= 0 and \
                (self._gone(self._root) or not self._meta_there()):
            return self._removed(what)
        return StorageError(e.errno or errno.EIO, path, None, n, what)

    def _meta_there(self) -> bool:
        try:
            os.stat(zf.META_NAME, dir_fd=self._root, follow_symlinks=False)
            return True
        except OSError:
            return False

    def _key_parts(self, index: tuple) -> tuple[str, str]:
        """(key directory inside the array, object name) of object ``index``."""
        rel, _, name = self.meta.key(index).rpartition("/")
        return rel, name

    def _open_object(self, index: tuple) -> int:
        """A read descriptor of the object at ``index``, or -1 when it is absent (and the
        array still there: ``_check_present``)."""
        rel, name = self._key_parts(index)
        fd = -1
        for attempt in (0, 1):
            e = self._dir_get(rel, False) if rel else None
            if rel and e is None:
                self._check_present()
                return -1
            dfd = self._root if e is None else e[0]
            try:
                fd = os.open(name, _OBJ_FLAGS, dir_fd=dfd)
            except FileNotFoundError:
                if e is not None and attempt == 0 and self._gone(dfd):
                    self._dir_forget(rel, e)    # removed meanwhile: open its name again
                    continue
                self._check_present()
                return -1
            except OSError as err:
                full = self._where(index)
                if err.errno == errno.ELOOP:
                    raise MetadataError(f"{full!r} is a symbolic link; refused (objects must "
                                        f"be regular files inside the array)") from None
                raise StorageError(err.errno, full, None, None, "open") from err
            finally:
                if e is not None:
                    self._dir_put(e)
            break
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise MetadataError(f"{self._where(index)!r} is not a regular file; refused")
        return fd

    def _pread(self, fd: int, offset: int, n: int, where: str,
               reuse: bool = False) -> memoryview:
        """``n`` bytes at ``offset`` of ``fd``, in a new buffer that is not zero-filled, or
        (``reuse``) in this thread's reusable buffer: valid until this thread's next
        ``reuse`` read, so its caller decodes or copies it before reading again."""
        mv = _thread_buffer(n) if reuse else np.empty(n, np.uint8).data
        done = 0
        try:
            while done < n:
                k = os.preadv(fd, [mv[done:]], offset + done)
                if k == 0:
                    break
                done += k
        except OSError as e:
            raise StorageError(e.errno, where, offset, n, "read") from e
        if done != n:
            raise MetadataError(f"{where}: expected {n} bytes at offset {offset}, the file "
                                f"ended after {done} (truncated while being read?)")
        return mv

    def _size(self, fd: int, where: str) -> int:
        size = os.fstat(fd).st_size
        if size > self._object_limit:
            raise MetadataError(f"{where} has {size} bytes, more than any object of this "
                                f"array can have ({self._object_limit} with its codecs); it "
                                f"is corrupt: restore it or rewrite this part of the array")
        return size

    def _decode(self, pipe: zf.Pipeline, buf: Any, out: np.ndarray, where: str) -> None:
        try:
            pipe.decode(buf, out)
        except (ValueError, RuntimeError, TypeError) as e:
            raise MetadataError(f"{where}: the stored object does not decode ({e}); it is "
                                f"corrupt: restore it or rewrite this part of the array") from None

    @contextmanager
    def _process_lock(self, index: tuple):
        """Hold object ``index``'s lock against other processes (and other handles of this
        one): an exclusive ``fcntl`` lock on byte ``index`` (C order) of the lock file
        (``_open_lock_file``)."""
        fd = self._lock_file()
        at = 0
        for i, g in zip(index, self.meta.grid):
            at = at * g + i
        try:
            byte_lock(fd, at, True)
        except TimeoutError:
            raise StorageError(
                errno.ETIMEDOUT, self._lock_path, None, None, "lock a storage object",
                f"another writer (a process or another handle of this array) has held the "
                f"lock of object {index} for more than {LOCK_WAIT:g} s: it may be stopped or "
                f"stuck; this object was not written. Check the job's other processes; "
                f"writes of whole storage objects (chunks {self.chunks}) and write_all under "
                f"MPI take no lock") from None
        except OSError as e:
            raise self._lock_error(e) from e
        try:
            yield
        finally:
            byte_lock(fd, at, False)

    def _lock_file(self) -> int:
        if self._lockfd < 0:
            with self._lockfd_guard:
                if self._lockfd < 0:
                    self._lockfd = self._open_lock_file()
        return self._lockfd

    def _open_lock_file(self) -> int:
        """The file whose bytes lock the objects: the array's own ``zarr.json``, opened for
        writing (byte locks need it) but never written, which every process opening the
        array finds; ``.chemio-lock`` beside it (made when absent) when ``zarr.json`` is
        not writable."""
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        p = os.path.join(self.path, zf.META_NAME)
        fd = -1
        if _OFD_SETLKW is not None:
            try:
                fd = os.open(zf.META_NAME, flags, dir_fd=self._root)
            except OSError as e:
                if e.errno not in (errno.EACCES, errno.EPERM):
                    raise StorageError(e.errno, p, None, None, "open the lock file") from e
            if fd >= 0 and not _ofd_works(fd):  # lockf locks would drop whenever any
                os.close(fd)                    # descriptor of zarr.json closes
                fd = -1
        if fd < 0:
            p = os.path.join(self.path, LOCK_NAME)
            try:
                fd = os.open(LOCK_NAME, flags | os.O_CREAT, self._perms, dir_fd=self._root)
            except OSError as e2:
                raise StorageError(e2.errno, p, None, None, "open the lock file") from e2
        if not _stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise MetadataError(f"{p!r} is not a regular file; refused")
        self._lock_path = p
        return fd

    def _lock_error(self, e: OSError) -> StorageError:
        p = self._lock_path
        if e.errno not in _NO_LOCKS:
            return StorageError(e.errno, p, None, None, "lock a storage object")
        return StorageError(
            e.errno, p, None, None, "lock a storage object",
            "this file system does not support fcntl locks (on Lustre mount with -o flock). "
            "A write that covers only part of a storage object takes one so that writers "
            "in other processes lose nothing, and this object was not written: write whole "
            f"storage objects (chunks {self.chunks}), use write_all under MPI, or open the "
            "array with lock=False if this process is its only writer")

    # ------------------------------------------------------------ reading objects
    def _read_object(self, index: tuple, local: tuple, out: np.ndarray,
                     fd: int | None = None) -> None:
        """Fill ``out`` with the object-local box ``local`` of object ``index`` (``fd``: its
        descriptor already open, -1 when absent; this call closes it)."""
        if fd is None:
            fd = self._open_object(index)
        if fd < 0:
            out[...] = self.meta.fill
            return
        where = self._where(index)
        try:
            if self.meta.shard is not None:
                self._read_shard(fd, where, local, out)
                return
            size = self._size(fd, where)
            chunks = self.chunks
            whole = tuple(s.stop - s.start for s in local) == chunks
            pipe = self.meta.pipeline
            if pipe.plain:
                nb = math.prod(chunks) * self.dtype.itemsize
                if size != nb:
                    raise MetadataError(f"{where} has {size} bytes, expected {nb}; it is "
                                        f"corrupt: restore it or rewrite this part")
                if whole and out.flags.c_contiguous:
                    self._readinto(fd, out, where)
                else:                   # the stored elements, seen in place: one copy
                    raw = self._pread(fd, 0, size, where, True)
                    out[...] = np.frombuffer(raw, self.dtype).reshape(chunks)[local]
                return
            if whole and out.flags.c_contiguous:
                self._decode(pipe, self._pread(fd, 0, size, where, True), out, where)
                return
            small = math.prod(chunks) * self.dtype.itemsize <= _BUF_KEEP
            tmp = _thread_tile(chunks, self.dtype) if small else np.empty(chunks, self.dtype)
            self._decode(pipe, self._pread(fd, 0, size, where, True), tmp, where)
            out[...] = tmp[local]
        finally:
            os.close(fd)

    def _readinto(self, fd: int, out: np.ndarray, where: str) -> None:
        # numpy's stubs make ndarray a Buffer for Python 3.12+ only
        mv = memoryview(out.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
        done, n = 0, len(mv)
        try:
            while done < n:
                k = os.preadv(fd, [mv[done:]], done)
                if k == 0:
                    raise MetadataError(f"{where} ended after {done} of {n} bytes")
                done += k
        except OSError as e:
            raise StorageError(e.errno, where, done, n, "read") from e

    def _index(self, fd: int, size: int, where: str) -> np.ndarray:
        sh = self.meta.shard
        assert sh is not None                   # only called for sharded arrays
        n = sh.index_nbytes
        if size < n:
            raise MetadataError(f"{where}: the shard has {size} bytes, too few for its index "
                                f"of {n} bytes; it was truncated: restore it or rewrite this "
                                f"part of the array")
        raw = self._pread(fd, size - n if sh.index_at_end else 0, n, where)
        return zf.parse_index(raw, sh, size, where)

    def _inner_boxes(self, local: tuple):
        """(inner index k, inner-local slices, object-local slices) of inner chunks meeting
        the object-local box ``local``."""
        sh = self.meta.shard
        assert sh is not None                   # only called for sharded arrays
        inner = sh.inner
        ranges = [range(s.start // c, -(-s.stop // c)) for s, c in zip(local, inner)]
        for pos in product(*ranges):
            k = 0
            for p, n in zip(pos, sh.per_axis):
                k = k * n + p
            lo = [p * c for p, c in zip(pos, inner)]
            a = [max(s.start, l) for s, l in zip(local, lo)]
            b = [min(s.stop, l + c) for s, l, c in zip(local, lo, inner)]
            yield (k, tuple(slice(x - l, y - l) for x, y, l in zip(a, b, lo)),
                   tuple(slice(x, y) for x, y in zip(a, b)))

    def _read_shard(self, fd: int, where: str, local: tuple, out: np.ndarray) -> None:
        """Fill ``out`` with the object-local box ``local`` of the shard open as ``fd``.
        Inner chunks stored raw whose destination in ``out`` is contiguous are read
        straight into it (``preadv``, runs of neighbours in one call); the others are
        read and decoded, over the I/O pool when there is enough of them (``_fan``)."""
        sh = self.meta.shard
        assert sh is not None                   # only called for sharded arrays
        size = self._size(fd, where)
        idx = self._index(fd, size, where)
        plain = sh.pipeline.plain
        base = [s.start for s in local]
        direct: list = []
        jobs: list = []
        for k, ins, obs in self._inner_boxes(local):
            dst = out[tuple(slice(s.start - b, s.stop - b) for s, b in zip(obs, base))]
            off, ln = int(idx[k, 0]), int(idx[k, 1])
            if off == zf.EMPTY:
                dst[...] = self.meta.fill
                continue
            full = tuple(s.stop - s.start for s in ins) == sh.inner
            if plain and full and dst.flags.c_contiguous and ln == dst.nbytes:
                direct.append((off, dst))
            else:
                jobs.append((k, off, ln, ins, dst, full))
        if direct:
            self._read_direct(fd, direct, where)
        if not jobs:
            return
        total = sum(j[2] for j in jobs)
        if len(jobs) > 1 and total >= FAN_BYTES:
            def one(job: tuple) -> None:
                k, off, ln, ins, dst, full = job
                self._decode_inner(self._pread(fd, off, ln, where, True), k, ins, dst,
                                   full, where)
            _fan(one, jobs, CODEC_TASKS)
            return
        whole = self._pread(fd, 0, size, where, True) if total * 2 > size else None
        for k, off, ln, ins, dst, full in jobs:
            buf = whole[off:off + ln] if whole is not None else \
                self._pread(fd, off, ln, where)
            self._decode_inner(buf, k, ins, dst, full, where)

    def _decode_inner(self, buf: Any, k: int, ins: tuple, dst: np.ndarray, full: bool,
                      where: str) -> None:
        """Decode inner chunk ``k`` (stored bytes ``buf``) and put its part ``ins`` in
        ``dst``."""
        sh = self.meta.shard
        assert sh is not None
        w = f"{where} (inner chunk {k})"
        if full and dst.flags.c_contiguous:
            self._decode(sh.pipeline, buf, dst, w)
        elif sh.pipeline.plain and len(buf) == math.prod(sh.inner) * self.dtype.itemsize:
            dst[...] = np.frombuffer(buf, self.dtype).reshape(sh.inner)[ins]   # one copy
        else:
            tmp = _thread_tile(sh.inner, self.dtype)
            self._decode(sh.pipeline, buf, tmp, w)
            dst[...] = tmp[ins]

    def _read_direct(self, fd: int, direct: list, where: str) -> None:
        """Read the raw inner chunks ``direct`` [(file offset, contiguous destination)]
        straight into their destinations, neighbours in the file in one ``preadv``."""
        direct.sort(key=lambda t: t[0])
        run: list = []
        start = end = -1
        for off, dst in direct:
            mv = dst.reshape(-1).view(np.uint8).data
            if run and off == end and len(run) < zf.IOV_MAX:
                run.append(mv)
                end += len(mv)
                continue
            if run:
                self._preadv_all(fd, run, start, where)
            run, start, end = [mv], off, off + len(mv)
        if run:
            self._preadv_all(fd, run, start, where)

    def _preadv_all(self, fd: int, views: list, offset: int, where: str) -> None:
        """Fill the byte views ``views`` in order from ``offset`` of ``fd``, short reads
        continued; a file that ends first is a ``MetadataError``."""
        n = sum(len(v) for v in views)
        pos, i = offset, 0
        try:
            while i < len(views):
                k = os.preadv(fd, views[i:], pos)
                if k == 0:
                    raise MetadataError(f"{where}: expected {n} bytes at offset {offset}, "
                                        f"the file ended after {pos - offset} (truncated "
                                        f"while being read?)")
                pos += k
                while i < len(views) and k >= len(views[i]):
                    k -= len(views[i])
                    i += 1
                if k:
                    views[i] = views[i][k:]
        except OSError as e:
            raise StorageError(e.errno, where, offset, n, "read") from e

    # ------------------------------------------------------------ writing objects
    def _all_fill(self, arr: np.ndarray) -> bool:
        if self.meta.fill_is_zero:
            a = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
            flat = a.reshape(-1).view(np.uint8)
            if flat.size % 8 == 0:
                flat = flat.view(np.uint64)
            if flat.size and (flat[0] or flat[-1]):     # most data: no scan needed
                return False
            return not flat.any()
        f = np.ascontiguousarray(np.broadcast_to(self.meta.fill, arr.shape))
        return np.ascontiguousarray(arr).tobytes() == f.tobytes()

    def _put(self, index: tuple, data: Any) -> None:
        """Replace object ``index`` with ``data`` (None: remove it) atomically, inside the
        key directory this store holds open (opened again once if it was removed).
        ``data``: a buffer, a list of buffers written in order, or ``(nbytes, fill)``
        where ``fill(fd)`` writes the ``nbytes`` of the new object into ``fd``."""
        rel, name = self._key_parts(index)
        full = self._where(index)
        streamed = isinstance(data, tuple)
        n = None if data is None else data[0] if streamed else \
            sum(memoryview(p).nbytes for p in (data if isinstance(data, list) else [data]))
        for attempt in (0, 1):
            e = self._dir_get(rel, data is not None) if rel else None
            if rel and e is None:
                return                          # removing from an absent directory
            dfd = self._root if e is None else e[0]
            try:
                if data is None:
                    os.unlink(name, dir_fd=dfd)
                else:
                    old = zf.write_filled_at(dfd, name, self._perms, data[0], data[1], True,
                                             self._durable) if streamed else \
                        zf.write_atomic_at(dfd, name, data, self._perms, True, self._durable)
                    if old is not None:             # the replaced object, now named old:
                        _REAPER.add(self, dfd, old, e)   # removed off this thread
                        e = None                    # (the reaper hands the directory back)
            except FileNotFoundError as err:
                if data is None:
                    return                      # already absent
                if e is not None and attempt == 0 and self._gone(dfd):
                    self._dir_forget(rel, e)    # removed meanwhile: open its name again
                    continue
                raise self._error(err, full, "write", n) from err
            except OSError as err:
                raise self._error(err, full, "remove" if data is None else "write", n) from err
            finally:
                if e is not None:
                    self._dir_put(e)
            self._mark(rel, None if data is None else name)
            return

    def _mark(self, rel: str, name: str | None) -> None:
        """Remember for ``flush``: object ``name`` in key directory ``rel`` (None: only
        the directory's entries changed); nothing for a scratch array."""
        if not self._durable:
            return
        with self._dirty_lock:
            if len(self._dirty) < _DIRTY_MAX:
                self._dirty.add((rel, name))
            else:
                self._dirty_all = True

    def _encode_whole(self, arr: np.ndarray) -> Any:
        """Stored bytes of one unsharded object (C-contiguous ``arr`` of the chunk shape)."""
        return self.meta.pipeline.encode(arr)

    def store_object(self, index: tuple, pieces: list, covered: bool) -> None:
        """Write the disjoint ``pieces`` [(object-local slices, array)] into object
        ``index``; ``covered``: they cover all of its elements inside the array, so
        nothing stored needs reading. Holds the object's lock: against the threads of
        this process always; against other processes too when it reads what is stored
        (not ``covered``), unless ``lock=False``, and always with ``lock=True``."""
        with self._stripes[hash(index) % _STRIPES]:
            if self._lock_mode is True or (self._lock_mode is None and not covered):
                with self._process_lock(index):
                    self._store(index, pieces, covered)
            else:
                self._store(index, pieces, covered)

    def _store(self, index: tuple, pieces: list, covered: bool) -> None:
        """``store_object`` under the object's lock."""
        if self.meta.shard is not None:
            self._store_shard(index, pieces, covered)
            return
        chunks = self.chunks
        if covered and len(pieces) == 1 and pieces[0][1].shape == chunks:
            buf = np.ascontiguousarray(pieces[0][1])
        else:
            buf = np.empty(chunks, self.dtype)
            if covered:
                buf[...] = self.meta.fill
            else:
                everything = tuple(slice(0, c) for c in chunks)
                self._read_object(index, everything, buf)
            for sl, arr in pieces:
                buf[sl] = arr
        self._put(index, None if self._all_fill(buf) else self._encode_whole(buf))

    def _store_shard(self, index: tuple, pieces: list, covered: bool) -> None:
        """``_store`` of a shard: every inner chunk the pieces touch is gathered (an inner
        chunk that is one contiguous block of a piece is taken as it is when stored raw)
        and encoded, over the I/O pool when there is enough of them (``_fan``); the
        others keep their stored bytes; the shard is then written from its parts
        (``pwritev``, no joined copy)."""
        sh = self.meta.shard
        assert sh is not None                   # only called for sharded arrays
        where = self._where(index)
        extent = self._layout.chunk_extent(index)
        boxes = [tuple((s.start, s.stop) for s in sl) for sl, _ in pieces]
        fd, idx, old = -1, None, None
        parts: list = [None] * sh.count
        jobs: list = []
        inner = sh.inner
        pipe = sh.pipeline
        try:
            everything = tuple(slice(0, c) for c in self.chunks)
            for k, _ins, obs in self._inner_boxes(everything):
                lo = [s.start for s in obs]
                hi = [min(s.stop, e) for s, e in zip(obs, extent)]
                if any(h <= l for l, h in zip(lo, hi)):
                    continue                            # wholly outside the array
                need = math.prod(h - l for l, h in zip(lo, hi))
                hits = []
                got = 0
                for (bx, (_sl, arr)) in zip(boxes, pieces):
                    a = [max(l, b[0]) for l, b in zip(lo, bx)]
                    b = [min(h, b[1]) for h, b in zip(hi, bx)]
                    if all(x < y for x, y in zip(a, b)):
                        hits.append((a, b, bx, arr))
                        got += math.prod(y - x for x, y in zip(a, b))
                stored = None
                if not hits or got < need:
                    if fd < 0 and idx is None and not covered:
                        fd = self._open_object(index)
                        if fd >= 0:
                            size = self._size(fd, where)
                            idx = self._index(fd, size, where)
                            if int(idx[idx[:, 0] != zf.EMPTY, 1].sum()) * 2 > size:
                                old = self._pread(fd, 0, size, where)
                    if idx is not None and idx[k, 0] != zf.EMPTY:
                        off, ln = int(idx[k, 0]), int(idx[k, 1])
                        stored = old[off:off + ln] if old is not None else \
                            self._pread(fd, off, ln, where)
                    if not hits:
                        parts[k] = stored
                        continue
                jobs.append((k, lo, hi, hits, stored if got < need else None,
                             got == need == math.prod(inner)))
        finally:
            if fd >= 0:
                os.close(fd)

        if pipe.plain and self.meta.fill_is_zero:
            self._write_raw_shard(index, where, jobs, parts)
            return
        # raw inner chunks are gathered into this thread's staging buffer (their slots
        # stay valid until the shard is written); encoded ones into a reused tile
        tile_n = math.prod(inner)
        stage = _thread_stage(len(jobs) * tile_n * self.dtype.itemsize, self.dtype) \
            if pipe.plain else None
        slot = {job[0]: i for i, job in enumerate(jobs)}

        def encode(job: tuple) -> None:
            k, lo, hi, hits, stored, whole = job
            if stage is not None:
                i = slot[k]
                tile = stage[i * tile_n:(i + 1) * tile_n].reshape(inner)
            else:
                tile = _thread_tile(inner, self.dtype)
            if whole and len(hits) == 1:
                a, b, bx, arr = hits[0]
                src = arr[tuple(slice(x - b0[0], y - b0[0]) for x, y, b0 in zip(a, b, bx))]
                if pipe.plain and src.flags.c_contiguous:
                    tile = src                          # raw and contiguous: no copy
                else:
                    tile[...] = src
            else:
                if stored is not None:
                    self._decode(pipe, stored, tile, f"{where} (inner chunk {k})")
                else:
                    tile[...] = self.meta.fill
                for a, b, bx, arr in hits:
                    dst = tuple(slice(x - l, y - l) for x, y, l in zip(a, b, lo))
                    src = tuple(slice(x - b0[0], y - b0[0]) for x, y, b0 in zip(a, b, bx))
                    tile[dst] = arr[src]
            parts[k] = None if self._all_fill(tile) else pipe.encode(tile)
        nbytes = len(jobs) * math.prod(inner) * self.dtype.itemsize
        _fan(encode, jobs, self.write_streams if nbytes >= FAN_BYTES else 1)
        self._put(index, zf.shard_buffers(parts, sh))

    def _write_raw_shard(self, index: tuple, where: str, jobs: list, parts: list) -> None:
        """The end of ``_store_shard`` for raw inner chunks and a zero fill value: each
        inner chunk that is one whole block of a piece is written from it (``pwrite`` at
        its place in the new shard; a strided block through this thread's tile, which
        stays in the CPU cache), over the I/O pool for large shards: no staging copy of
        the shard. Merged inner chunks are assembled first; all-zero ones not stored."""
        sh = self.meta.shard
        assert sh is not None
        inner = sh.inner
        src: list = list(parts)                 # kept stored bytes, or what to write
        for k, lo, _hi, hits, stored, whole in jobs:
            if whole and len(hits) == 1:
                a, b, bx, arr = hits[0]
                view = arr[tuple(slice(x - b0[0], y - b0[0]) for x, y, b0 in zip(a, b, bx))]
                src[k] = None if _zero_view(view) else view
                continue
            tile = np.empty(inner, self.dtype)
            if stored is not None:
                self._decode(sh.pipeline, stored, tile, f"{where} (inner chunk {k})")
            else:
                tile[...] = self.meta.fill
            for a, b, bx, arr in hits:
                dst = tuple(slice(x - l, y - l) for x, y, l in zip(a, b, lo))
                tile[dst] = arr[tuple(slice(x - b0[0], y - b0[0])
                                      for x, y, b0 in zip(a, b, bx))]
            src[k] = None if self._all_fill(tile) else tile
        plan = zf.shard_plan([None if p is None else
                              p.nbytes if isinstance(p, np.ndarray) else memoryview(p).nbytes
                              for p in src], sh)
        if plan is None:
            self._put(index, None)
            return
        offsets, ib, at, total = plan
        items = [(offsets[k], p) for k, p in enumerate(src) if p is not None]

        def put(item: tuple, fd: int = -1) -> None:
            off, p = item
            if isinstance(p, np.ndarray):
                if not p.flags.c_contiguous:
                    t = _thread_tile(inner, self.dtype)
                    t[...] = p
                    p = t
                p = p.reshape(-1).view(np.uint8)
            zf.pwrite_parts(fd, [memoryview(p).cast("B")], off)

        def fill(fd: int) -> None:
            width = self.write_streams if total >= FAN_BYTES else 1
            _fan(lambda item: put(item, fd), items, width)
            zf.pwrite_parts(fd, [memoryview(ib)], at)
        self._put(index, (total, fill))

    # ------------------------------------------------------------ the ArrayStore API
    def read(self, region: tuple, out: np.ndarray) -> np.ndarray:
        """Fill ``out`` from ``region``; absent objects read as the fill value (zero). An
        array whose codecs chemio does not implement (``meta.foreign``) is read through
        zarr-python's own codec pipeline."""
        self._check(region, out)
        if self.meta.foreign is not None:
            return self._read_foreign(region, out)
        pieces = self._layout.pieces(region)       # a batch at a time: bounded memory
        ahead: bool | None = None
        while True:
            batch = list(itertools.islice(pieces, _AHEAD))
            if not batch:
                break
            if ahead is None:                      # more than one piece in all
                ahead = self.meta.shard is None and len(batch) > 1
            fds: list = []
            try:
                if ahead:       # all reads of the batch queued at once: a deeper device queue
                    for p in batch:
                        fd = self._open_object(p.index)
                        fds.append(fd)
                        if fd >= 0:
                            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                for k, p in enumerate(batch):
                    local = tuple(slice(a - i * c, a - i * c + n)
                                  for a, i, c, n in zip(p.start, p.index, self.chunks, p.shape))
                    rel = tuple(slice(a - s.start, a - s.start + n)
                                for a, s, n in zip(p.start, region, p.shape))
                    given: int | None = fds[k] if fds else None
                    if fds:
                        fds[k] = -1                     # _read_object closes it
                    self._read_object(p.index, local, out[rel], given)
            finally:
                for fd in fds:
                    if fd >= 0:
                        os.close(fd)
        return out

    def _read_foreign(self, region: tuple, out: np.ndarray) -> np.ndarray:
        za = self._zarr_python
        if za is None:
            import zarr
            from zarr.storage import LocalStore
            za = zarr.open_array(LocalStore(self.path, read_only=True), mode="r")
            if tuple(za.shape) != self.shape:
                raise StorageError(errno.ESTALE, self.path, None, None, "read",
                                   f"the array was re-created (shape {tuple(za.shape)}, not "
                                   f"{self.shape}): open it again")
            self._zarr_python = za
        try:
            out[...] = za[region]
        except Exception as e:
            raise MetadataError(f"Zarr array {self.path!r}: zarr-python cannot read region "
                                f"{tuple((s.start, s.stop) for s in region)}: "
                                f"{type(e).__name__}: {str(e)[:300]}") from None
        return out

    def _pieces(self, region: tuple, data: np.ndarray):
        for p in self._layout.pieces(region):
            local = tuple(slice(a - i * c, a - i * c + n)
                          for a, i, c, n in zip(p.start, p.index, self.chunks, p.shape))
            rel = tuple(slice(a - s.start, a - s.start + n)
                        for a, s, n in zip(p.start, region, p.shape))
            yield p, local, data[rel]

    def check_write(self, region: tuple) -> None:
        """Raise (changing nothing) if an independent write of ``region`` would rewrite
        objects that other ranks may be writing at the same time (see the module doc)."""
        if not self.writable:
            raise StorageError(errno.EBADF, self.path, None, None, "write",
                               "the array store is open read-only")
        if not self._shared_writers or self._lock_mode is True:
            return
        for p in self._layout.pieces(region):
            if p.shape != p.extent:
                raise ArgumentError(
                    f"an independent write of region "
                    f"{tuple((s.start, s.stop) for s in region)} covers only part of storage "
                    f"object {self.meta.key(p.index)!r} (chunks {self.chunks}) of Zarr array "
                    f"{self.path!r} while {self._comm.size} ranks hold it writable: rewriting "
                    f"the object could lose another rank's update. Use write_all "
                    f"(collective), write whole storage objects, or open the array with "
                    f"lock=True; nothing was written")

    def write(self, region: tuple, data: np.ndarray) -> None:
        """Write ``data`` into ``region`` (objects it cuts are read, merged and replaced)."""
        self._check(region, data)
        self.check_write(region)
        try:
            for p, local, arr in self._pieces(region, data):
                self.store_object(p.index, [(local, arr)], p.shape == p.extent)
        finally:
            _REAPER.settle(self)            # the replaced objects' files are gone

    def read_all(self, region: tuple, out: np.ndarray, comm: Any = None) -> np.ndarray:
        """Read ``region`` (every rank independently; collective only in name)."""
        self._check(region, out)
        self._fan_out(False, region, out)
        return out

    def _fan_out(self, write: bool, region: tuple, arr: np.ndarray) -> None:
        """Move ``region`` in tasks on the I/O pool and wait for them."""
        _wait(self._submit(write, region, arr), None)

    def _submit(self, write: bool, region: tuple, arr: np.ndarray,
                skip: set | frozenset = frozenset()) -> list:
        """Start the objects of ``region`` (minus ``skip``) on the I/O pool in tasks of
        about ``TASK_BYTES``; returns the requests (one task runs here, at once)."""
        from chemio_py.runtime import pool, requests
        nb = region_nbytes(region, self.dtype.itemsize)
        if nb == 0:
            return []
        threads = max(1, int(config.get("io_threads")))
        task = max(TASK_BYTES, nb // (2 * threads))
        subs = self._layout.split(region, task, False)
        rstart = [s.start for s in region]

        def run(sub: tuple) -> None:
            view = arr[tuple(slice(s.start - r, s.stop - r) for s, r in zip(sub, rstart))]
            if not write:
                self.read(sub, view)
                return
            try:
                for p, local, a in self._pieces(sub, view):
                    if p.index not in skip:
                        self.store_object(p.index, [(local, a)], p.shape == p.extent)
            finally:
                _REAPER.settle(self)
        if len(subs) == 1:
            req = requests.NativeRequest()          # completed here, in the caller
            try:
                run(subs[0])
                req.set_result(None)
            except Exception as e:
                req.set_exception(e)
            return [req]
        return [pool.submit(run, s) for s in subs]

    def write_all(self, region: tuple, data: np.ndarray, comm: Any = None) -> None:
        """Collective two-phase write (``zarr_exchange``): every rank calls it with its own
        region (disjoint; an empty one is fine); each object is written by one owner.
        Returns on every rank or raises on every rank."""
        self._check(region, data)
        if comm is None or comm.size == 1:
            if not self.writable:
                self.check_write(region)
            self._fan_out(True, region, data)
            return
        from chemio_py.runtime import pool
        errors: list = []
        mine = None
        try:
            if not self.writable:
                self.check_write(region)
        except Exception as e:
            mine = e
        boxes = comm.allgather(None if mine else _xchg.box_of(region))
        local: list = []
        plan = None
        if mine is None:
            plan = _xchg.contested_objects(boxes, self.chunks, self.shape,
                                           self.dtype.itemsize, _xchg.ROUND_BYTES)
            # this rank's own objects go to the pool first; the exchange overlaps them
            local = self._submit(True, region, data, {o.index for o in plan})
        try:
            _xchg.exchange(comm, region, data, self.chunks, self.shape, boxes,
                           self.store_object, pool.submit,
                           lambda batch: _wait(batch, errors), _xchg.ROUND_BYTES, plan)
        except Exception as e:             # pragma: no cover - an MPI failure
            errors.append(e)
        _wait(local, errors)
        _REAPER.settle(self)
        err = mine or (errors[0] if errors else None)
        reasons = comm.allgather(None if err is None else f"{type(err).__name__}: {err}")
        if err is not None:
            raise err
        bad = {r: m for r, m in enumerate(reasons) if m is not None}
        if bad:
            raise CollectiveError(f"write_all of Zarr array {self.path!r}", bad)

    def flush(self) -> None:
        """Make the objects this process wrote since the last flush durable (see the
        module docstring): one pass that starts the write-back of all of them, one that
        fsyncs them, then the directories whose entries changed, all reached from the
        array's descriptor, never through a link. A scratch array (chemio's metadata says
        ``persistent: false``) is removed when it closes, so nothing is synced."""
        _REAPER.settle(self)
        with self._dirty_lock:
            dirty, self._dirty = self._dirty, set()
            everything, self._dirty_all = self._dirty_all, False
        if not self._durable:
            return
        if everything:                    # too many to remember: every object there is
            for _, _, files, dfd in os.fwalk(".", dir_fd=self._root):
                self._sync_names(dfd, "", sorted(files))
                _fsync_quietly(dfd)
            return
        by_dir: dict = {}
        for rel, name in dirty:
            names = by_dir.setdefault(rel, set())
            if name is not None:
                names.add(name)
        held: list = []
        try:
            for rel in sorted(by_dir):    # the objects, directory by directory ...
                try:
                    e = self._dir_get(rel, False) if rel else None
                except MetadataError:     # a link in its place now: nothing of ours there
                    continue
                if rel and e is None:
                    continue
                held.append((rel, e))
                self._sync_names(self._root if e is None else e[0], rel, sorted(by_dir[rel]))
            for _rel, e in held:          # ... then the directories
                _fsync_quietly(self._root if e is None else e[0])
        finally:
            for _rel, e in held:
                if e is not None:
                    self._dir_put(e)

    def _sync_names(self, dfd: int, rel: str, names: list) -> None:
        """fsync the regular files ``names`` of the directory open as ``dfd`` (``rel`` in
        the array), ``_SYNC_BATCH`` at a time: the write-back of a batch is started for
        all of them first (``sync_file_range``), so the device sees them together."""
        for i in range(0, len(names), _SYNC_BATCH):
            fds: list = []
            try:
                for name in names[i:i + _SYNC_BATCH]:
                    try:
                        fd = os.open(name, _OBJ_FLAGS, dir_fd=dfd)
                    except OSError:       # gone, or a link: nothing of ours to sync
                        continue
                    fds.append((fd, name))
                    if _stat.S_ISREG(os.fstat(fd).st_mode):
                        zf.start_writeback(fd)
                for fd, name in fds:
                    if _stat.S_ISREG(os.fstat(fd).st_mode):
                        try:
                            os.fsync(fd)
                        except OSError as e:
                            raise self._error(e, os.path.join(self.path, rel, name),
                                              "flush") from e
            finally:
                for fd, _ in fds:
                    os.close(fd)

    def resize(self, shape: Any, comm: Any = None) -> None:
        """``Resizable.resize`` (every axis may grow: objects are named by their grid
        index, none moves). Rank 0 zeroes the parts of the objects it keeps that lie
        outside the new shape, rewrites ``zarr.json`` with the new shape (chemio's entry of
        its attributes too) in one atomic write, then removes the objects wholly outside
        (a missing one is fine); every rank then takes the new shape."""
        from dataclasses import replace

        from chemio_py.backends.grid import ceil_div, stale_regions, zero_regions
        new = tuple(int(n) for n in shape)
        old, ch = self.shape, self.chunks
        with _agree(comm, f"resize Zarr array {self.path}"):
            if comm is None or comm.rank == 0:
                if not self.writable:
                    raise StorageError(errno.EBADF, self.path, None, None, "resize",
                                       "the array store is open read-only")
                kept = tuple(ceil_div(n, c) * c for n, c in zip(new, ch))
                zero_regions(self.write, stale_regions(old, new, kept), ch, self.dtype)
                doc = zf.load_doc_at(self._root, self.path)
                doc["shape"] = list(new)
                mine = doc.get("attributes", {}).get("chemio")
                if isinstance(mine, dict) and "shape" in mine:
                    mine["shape"] = list(new)
                    mine.pop("nbytes", None)
                zf.parse(doc, "the resized zarr.json")      # what we write, we can read
                zf.write_meta(self.path, doc, self._perms)
                self._drop_objects(old, new)
        self.meta = replace(self.meta, shape=new)
        self.shape = new
        self._layout = Layout(new, ch, self.dtype.itemsize)

    def _drop_objects(self, old: tuple, new: tuple) -> None:
        """Remove the objects of shape ``old``'s grid outside shape ``new``'s grid."""
        from chemio_py.backends.grid import ceil_div
        og = [ceil_div(n, c) for n, c in zip(old, self.chunks)]
        ng = [ceil_div(n, c) for n, c in zip(new, self.chunks)]
        for k in range(len(og)):
            if ng[k] >= og[k]:
                continue
            ranges = [range(min(ng[j], og[j])) if j < k else range(ng[k], og[k]) if j == k
                      else range(og[j]) for j in range(len(og))]
            for index in product(*ranges):
                where = self._where(index)
                try:
                    os.unlink(where)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    raise self._error(e, where, "remove an object outside the new shape") \
                        from e

    def as_dask(self, chunks: Any = None) -> Any:
        """A dask array reading this array with zarr-python (no chemio needed on workers);
        ``chunks`` default: the storage objects."""
        import dask.array as da
        return da.from_zarr(self.path, chunks=chunks if chunks is not None else self.chunks)

    @property
    def closed(self) -> bool:
        return getattr(self, "_closed", True)

    def close(self) -> None:
        """Make a persistent array's writes durable (``flush``), then release this
        process's resources (no collective call is needed; the threads' reusable buffers
        when this was the last open zarr store); idempotent. A flush error is raised after
        the resources are released."""
        err: Exception | None = None
        if getattr(self, "_durable", False) and not self._closed and \
                (self._dirty or self._dirty_all):
            try:
                self.flush()
            except Exception as failure:    # released all the same, then raised
                err = failure
        _REAPER.settle(self)
        with self._dir_lock:
            self._closed = True
            counted, self._counted = getattr(self, "_counted", False), False
            for e in self._dirfds.values():
                if e[1] == 0:
                    os.close(e[0])
                else:
                    e[2] = True           # its last user closes it
            self._dirfds.clear()
            root, self._root = getattr(self, "_root", -1), -1
        fd, self._lockfd = self._lockfd, -1
        if fd >= 0:
            os.close(fd)
        if root >= 0:
            os.close(root)
        if counted:
            _store_opened(-1)               # the last one: the thread buffers released
        if err is not None:
            raise err

    close_local = close

    def __del__(self):
        finalizers.close_later(self.close)

    # ------------------------------------------------------------ checking (chemio check)
    def verify_object(self, index: tuple) -> int:
        """Check object ``index`` whole, as a reader would: a regular file reached without
        links, no larger than any object of this array can be, its shard index (CRC32C,
        entries inside the shard) and every stored inner chunk, or the object itself,
        decoding to exactly its size (checksum codecs checked). Returns its size in bytes
        (0: absent); ``MetadataError`` or ``StorageError`` name what is damaged."""
        fd = self._open_object(index)
        if fd < 0:
            return 0
        where = self._where(index)
        try:
            size = self._size(fd, where)
            if self.meta.foreign is not None:   # decoded as its reader does: zarr-python
                box = tuple(slice(i * c, min((i + 1) * c, n))
                            for i, c, n in zip(index, self.chunks, self.shape))
                self._read_foreign(box, np.empty(tuple(b.stop - b.start for b in box),
                                                 self.dtype))
                return size
            sh = self.meta.shard
            if sh is None:
                tmp = np.empty(self.chunks, self.dtype)
                if self.meta.pipeline.plain and size != tmp.nbytes:
                    raise MetadataError(f"{where} has {size} bytes, expected {tmp.nbytes}; it "
                                        f"is corrupt: restore it or rewrite this part")
                self._decode(self.meta.pipeline, self._pread(fd, 0, size, where), tmp, where)
                return size
            idx = self._index(fd, size, where)
            tile = np.empty(sh.inner, self.dtype)
            for k in np.flatnonzero(idx[:, 0] != zf.EMPTY):
                off, ln = int(idx[k, 0]), int(idx[k, 1])
                self._decode(sh.pipeline, self._pread(fd, off, ln, where), tile,
                             f"{where} (inner chunk {k})")
            return size
        finally:
            os.close(fd)

    def stored_objects(self, strays: list, limit: int = 100):
        """Yield the index of every object stored in the array directory (in directory
        order), found by walking it from the array's descriptor without following links.
        Entries that are no object of the array go to ``strays`` as ``(path, what,
        serious)`` (serious: where a reader expects a key directory), at most ``limit`` of
        them, then one ``("", "N more entries ...", False)``."""
        m = self.meta
        grid = m.grid
        nd = len(grid)
        extra = [0]

        def stray(rel: str, what: str, serious: bool = False) -> None:
            if len(strays) < limit:
                strays.append((os.path.join(self.path, rel), what, serious))
            else:
                extra[0] += 1
        known = {zf.META_NAME, LOCK_NAME}
        tree = m.separator == "/" and nd > 0
        prefix = () if m.v2_keys else ("c",)
        top = "c" if tree and not m.v2_keys else ""
        if tree and not m.v2_keys:
            known.add("c")
        # the array directory itself: metadata, lock, and (flat keys) the objects
        for name, kind in _entries(self._root):
            if name in known or (tree and m.v2_keys):
                continue
            if not tree:
                index = _parse_key(name, m.separator, prefix, grid)
                if index is not None:
                    yield index
                    continue
            stray(name, _stray_kind(name, kind))
        if tree:
            yield from self._walk_tree(top, grid, stray)
        if extra[0]:
            strays.append(("", f"{extra[0]} more entries that are no object of the array",
                           False))

    def _walk_tree(self, top: str, grid: tuple, stray: Any):
        """``stored_objects`` of the ``/`` key layouts: directories ``<top>/i0/.../``."""
        if top:
            e = self._dir_get(top, False)
            if e is None:
                return
            start = os.dup(e[0])
            self._dir_put(e)
        else:
            start = os.dup(self._root)
        leaf = len(grid) - 1
        stack: list[tuple[int, str, tuple]] = [(start, top, ())]
        try:
            while stack:
                dfd, rel, index = stack.pop()
                try:
                    level = len(index)
                    for name, kind in _entries(dfd):
                        relname = f"{rel}/{name}" if rel else name
                        if not rel and name in (zf.META_NAME, LOCK_NAME):
                            continue
                        i = _index_name(name, grid[level])
                        if i is None:
                            stray(relname, _stray_kind(name, kind))
                        elif level == leaf:
                            yield index + (i,)
                        else:
                            try:
                                sub = os.open(name, DIR_FLAGS, dir_fd=dfd)
                            except OSError:
                                stray(relname, _stray_kind(name, kind) + " where a key "
                                      "directory belongs; readers refuse it", True)
                                continue
                            stack.append((sub, relname, index + (i,)))
                finally:
                    os.close(dfd)
        finally:
            for dfd, _, _ in stack:
                os.close(dfd)


def _entries(fd: int):
    """(name, kind) of the entries of the directory open as ``fd`` (kind: ``"dir"``,
    ``"file"``, ``"link"``, ``"other"``), never following links."""
    with os.scandir(fd) as it:
        for entry in it:
            if entry.is_symlink():
                kind = "link"
            elif entry.is_dir(follow_symlinks=False):
                kind = "dir"
            elif entry.is_file(follow_symlinks=False):
                kind = "file"
            else:
                kind = "other"
            yield entry.name, kind


def _index_name(name: str, n: int) -> int | None:
    """The chunk index ``name`` spells (``"0"``, ``"17"``), if below ``n``."""
    if not (name.isascii() and name.isdigit()) or len(name) > 20 or \
            (len(name) > 1 and name[0] == "0"):
        return None
    i = int(name)
    return i if i < n else None


def _parse_key(name: str, sep: str, prefix: tuple, grid: tuple) -> tuple | None:
    """The chunk index of a flat key (``c.1.2``, ``1.2``), None if ``name`` is none."""
    parts = name.split(sep) if grid else [name]
    if tuple(parts[:len(prefix)]) != prefix:
        return None
    parts = parts[len(prefix):]
    if not grid:
        return () if not parts or parts == ["0"] else None
    if len(parts) != len(grid):
        return None
    index = tuple(_index_name(p, g) for p, g in zip(parts, grid))
    return None if any(i is None for i in index) else index


def _stray_kind(name: str, kind: str) -> str:
    if kind == "file" and name.startswith(".") and name.endswith(".tmp"):
        return "a temporary file of an interrupted write (or of a write under way)"
    what = {"dir": "a directory", "file": "a file", "link": "a symbolic link",
            "other": "a special file"}[kind]
    return f"{what} that is no object of the array"


def durable_array(meta: zf.ZarrMeta) -> bool:
    """Whether writes to the array of ``meta`` are made durable at ``flush``/``close``:
    all but chemio's scratch arrays (``"persistent": false`` in chemio's entry of the
    attributes), which vanish when they close."""
    mine = meta.attributes.get("chemio") if isinstance(meta.attributes, dict) else None
    return not (isinstance(mine, dict) and mine.get("persistent") is False)


_local = threading.local()
_BUF_KEEP = 16 << 20             # a thread keeps a reusable read buffer up to this size
_STAGE_KEEP = 64 << 20           # ... and a reusable write staging buffer up to this size


class _Held:
    """One thread's reusable buffers (None: none yet), registered in ``_HELD`` so that
    ``release_buffers`` can drop every thread's."""
    __slots__ = ("buf", "stage", "tile", "__weakref__")

    def __init__(self) -> None:
        self.buf: np.ndarray | None = None
        self.stage: np.ndarray | None = None
        self.tile: np.ndarray | None = None


_HELD: weakref.WeakSet = weakref.WeakSet()      # every live thread's _Held
_OPEN = [0]                                     # zarr array stores open in this process
_HELD_LOCK = threading.Lock()


def _held() -> _Held:
    h = getattr(_local, "held", None)
    if h is None:
        h = _local.held = _Held()
        with _HELD_LOCK:
            _HELD.add(h)
    return h


def held_bytes() -> int:
    """Bytes of the reusable buffers all threads of this process hold for zarr I/O."""
    with _HELD_LOCK:
        return sum(b.nbytes for h in _HELD for b in (h.buf, h.stage, h.tile) if b is not None)


def release_buffers() -> None:
    """Drop every thread's reusable buffers (a buffer in use stays alive until its user
    is done with it): done when the last open zarr array store of the process closes."""
    with _HELD_LOCK:
        for h in _HELD:
            h.buf = h.stage = h.tile = None


def _store_opened(delta: int) -> None:
    with _HELD_LOCK:
        _OPEN[0] += delta
        last = _OPEN[0] <= 0
    if last:
        release_buffers()


def _thread_buffer(n: int) -> memoryview:
    """``n`` bytes of this thread's reusable buffer (grown as needed, never zero-filled;
    one larger than ``_BUF_KEEP`` is not kept; all released when the last store
    closes)."""
    h = _held()
    buf = h.buf
    if buf is None or buf.size < n:
        buf = np.empty(max(n, 1 << 16), np.uint8)
        if n <= _BUF_KEEP:
            h.buf = buf
    return buf[:n].data


def _thread_stage(n: int, dtype: np.dtype) -> np.ndarray:
    """A flat array of ``dtype`` over ``n`` bytes of this thread's reusable staging
    buffer (gathered raw inner chunks of one shard, until it is written); one larger
    than ``_STAGE_KEEP`` is not kept."""
    h = _held()
    buf = h.stage
    if buf is None or buf.size < n:
        buf = np.empty(n, np.uint8)
        if n <= _STAGE_KEEP:
            h.stage = buf
    return buf[:n].view(dtype)


def _thread_tile(shape: tuple, dtype: np.dtype) -> np.ndarray:
    """This thread's reusable array of ``shape`` and ``dtype`` (decoded inner chunks
    that are copied out at once)."""
    h = _held()
    tile = h.tile
    if tile is None or tile.shape != shape or tile.dtype != dtype:
        tile = np.empty(shape, dtype)
        h.tile = tile
    return tile


def _fan(fn: Any, items: list, width: int) -> None:
    """``fn(item)`` for every item, this thread and up to ``width - 1`` I/O pool threads
    taking items from one queue; returns when every started call has finished (the
    first error is raised, the items not started are dropped). The caller works too and
    waits only for calls already running, so this is safe inside a pool task."""
    from chemio_py.runtime import pool
    if len(items) <= 1 or width <= 1 or pool.sync_mode():
        for it in items:
            fn(it)
        return
    todo = collections.deque(items)
    cond = threading.Condition()
    active = [0]
    errors: list[BaseException] = []

    def drain() -> None:
        while True:
            with cond:
                if errors or not todo:
                    return
                it = todo.popleft()
                active[0] += 1
            try:
                fn(it)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                with cond:
                    errors.append(e)
            finally:
                with cond:
                    active[0] -= 1
                    cond.notify_all()
    for _ in range(min(width, len(items)) - 1):
        pool.submit(drain)
    drain()
    with cond:
        while active[0]:
            cond.wait()
    if errors:
        raise errors[0]


_REAP_MAX = 256                   # replaced objects a store leaves to the reaper at most
_REAP_IDLE = 2.0                  # seconds the reaper thread waits for work before ending


class _Reaper:
    """Removes the files that replaced objects leave (``write_atomic_at(keep_old=True)``)
    on a thread of its own, so that a writer does not wait while the file system frees an
    old object's blocks (most of a replacing rename's cost on ext4). A store has at most
    ``_REAP_MAX`` such files waiting (then its writers wait); ``settle(store)`` returns
    when none of its files is left, which every write, ``flush`` and ``close`` does before
    returning. A file that cannot be removed stays as a temporary file, as an
    interrupted write leaves one (``chemio check`` reports it). In ``CHEMIO_SYNC`` mode
    the writer removes the file itself."""

    def __init__(self) -> None:
        self._reset()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._todo: collections.deque = collections.deque()
        self._pending: dict = {}        # id(store): its files queued or being removed
        self._thread: threading.Thread | None = None

    def add(self, store: ZarrArrayStore, dfd: int, name: str, e: list | None) -> None:
        """Remove ``name`` from the directory open as ``dfd`` (store's key directory entry
        ``e``, handed back with ``_dir_put`` after; None: the array's own directory)."""
        from chemio_py.runtime import pool
        if pool.sync_mode():
            self._remove(store, dfd, name, e)
            return
        key = id(store)
        made = None
        with self._cond:
            while self._pending.get(key, 0) >= _REAP_MAX:
                self._cond.wait()
            self._pending[key] = self._pending.get(key, 0) + 1
            self._todo.append((key, store, dfd, name, e))
            if self._thread is None:
                self._thread = made = threading.Thread(target=self._run, daemon=True,
                                                       name="chemio-zarr-reaper")
            self._cond.notify_all()
        if made is not None:
            made.start()        # outside the lock: see ``_Pool.start`` in runtime.pool

    @staticmethod
    def _remove(store: ZarrArrayStore, dfd: int, name: str, e: list | None) -> None:
        try:
            os.unlink(name, dir_fd=dfd)
        except OSError:
            pass                        # gone already, or a stray temporary file now
        finally:
            if e is not None:
                store._dir_put(e)

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._todo:
                    self._cond.wait(_REAP_IDLE)
                    if not self._todo:
                        self._thread = None
                        return
                key, store, dfd, name, e = self._todo.popleft()
            try:
                self._remove(store, dfd, name, e)
            finally:
                with self._cond:
                    left = self._pending[key] - 1
                    if left:
                        self._pending[key] = left
                    else:
                        del self._pending[key]
                    self._cond.notify_all()
            store = e = None                # no store kept alive by this thread

    def settle(self, store: ZarrArrayStore | None = None) -> None:
        """Wait until no file of ``store`` (None: of any store) waits for removal."""
        with self._cond:
            while self._pending if store is None else self._pending.get(id(store)):
                self._cond.wait()


_REAPER = _Reaper()
atexit.register(_REAPER.settle)


def _zero_view(a: np.ndarray) -> bool:
    """Whether every byte of ``a`` (any strides) is zero, without a contiguous copy
    (looked at whole only when its first and last elements are zero)."""
    n = a.dtype.itemsize
    if n not in (1, 2, 4, 8):
        return not np.ascontiguousarray(a).reshape(-1).view(np.uint8).any()
    u = a.view(np.dtype(f"u{n}"))
    if u.size and (u.flat[0] or u[(-1,) * u.ndim]):
        return False
    return not u.any()


def _fsync_quietly(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError:
        pass


def _wait(reqs: list, errors: list | None) -> None:
    """Wait for every request; keep errors in ``errors`` (raise the first if None)."""
    first = None
    for r in reqs:
        try:
            r.wait()
        except Exception as e:
            if errors is not None:
                errors.append(e)
            elif first is None:
                first = e
    if first is not None:
        raise first


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


# ---------------------------------------------------------------- removal
#
# An array is a tree ``<array>/c/<i0>/<i1>/.../<i_last>`` of storage objects plus
# ``zarr.json`` (and ``.chemio-lock``). Removed by several ranks together, each takes a
# contiguous share of the tree (``removal_share``) and removes it relative to open
# directory descriptors; after one barrier rank 0 removes what is left: the directories
# above the shares, the metadata, temporary files and anything another rank could not
# remove. Nothing outside the array's directory is touched and no link is followed.

DEAL_MAX = 1 << 20      # names of one directory a rank computes itself; beyond: it lists it


def removal_share(grid: tuple, rank: int, size: int) -> tuple[int, int, int]:
    """``(level, first, end)``: what rank ``rank`` of ``size`` removes of an array with
    chunk grid ``grid`` (at least one axis): the units ``first <= u < end`` (C order) at
    depth ``level`` of its key tree, which are the directories ``c/<i0>/.../<i_level>``
    with all they hold when ``level < len(grid) - 1``, else the objects. ``level`` is the
    shallowest with at least ``size`` units, so shares are whole directories when there
    are enough; the ranks' shares are contiguous, disjoint and together every unit."""
    n, level = 1, len(grid) - 1
    for depth, g in enumerate(grid):
        n *= g
        if n >= size:
            level = depth
            break
    return level, rank * n // size, (rank + 1) * n // size


def _key_grid(doc: Any) -> tuple | None:
    """The chunk grid of a ``zarr.json`` document whose objects are at ``c/<i0>/<i1>/...``
    (the default chunk-key encoding with ``/``, which chemio creates), else None."""
    try:
        shape = doc["shape"]
        chunks = doc["chunk_grid"]["configuration"]["chunk_shape"]
        enc = doc.get("chunk_key_encoding", {"name": "default"})
        conf = enc.get("configuration") or {}
        ok = enc.get("name") == "default" and conf.get("separator", "/") == "/"
    except (KeyError, TypeError, AttributeError):
        return None

    def ints(v: Any, lo: int) -> bool:
        return isinstance(v, list) and all(
            isinstance(x, int) and not isinstance(x, bool) and x >= lo for x in v)
    if not (ok and ints(shape, 0) and ints(chunks, 1) and
            1 <= len(shape) == len(chunks) <= zf.MAX_NDIM):
        return None
    return tuple(-(-n // c) for n, c in zip(shape, chunks))


def _removal_plan(path: str) -> Any:
    """Rank 0's look before a removal: ``"absent"``, the chunk grid when the ranks can
    share the work, or None (rank 0 removes it all: a file, a link, another key layout)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "absent"
    except OSError:
        return None
    if not _stat.S_ISDIR(st.st_mode):
        return None
    try:
        return _key_grid(zf.load_doc(path))
    except Exception:                   # unreadable or hostile metadata: rank 0 alone
        return None


def _outside(lo: int, hi: int) -> Any:
    """A test of entry names: True unless the name is an index ``lo <= i < hi``."""
    return lambda name: not (name.isascii() and name.isdigit() and lo <= int(name) < hi)


def _open_chain(top: int, names: tuple, chain: list, where: str, failures: list) -> int:
    """A descriptor of directory ``top/names[0]/names[1]/...`` (-1: absent, or not a real
    directory), opening component by component without following links and keeping the
    open ones in ``chain`` (``(name, fd)``) for the next call."""
    common = 0
    while common < min(len(chain), len(names)) and chain[common][0] == names[common]:
        common += 1
    for _, fd in chain[common:]:
        if fd >= 0:
            os.close(fd)
    del chain[common:]
    for name in names[common:]:
        parent = chain[-1][1] if chain else top
        fd = -1
        if parent >= 0:
            try:
                fd = os.open(name, DIR_FLAGS, dir_fd=parent)
            except FileNotFoundError:
                pass
            except OSError as e:        # a link or a file there: rank 0 removes the entry
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    failures.append((os.path.join(where, *[n for n, _ in chain], name), e))
        chain.append((name, fd))
    return chain[-1][1] if chain else top


def _remove_share(path: str, grid: tuple, rank: int, size: int, failures: list) -> None:
    """Remove rank ``rank``'s share (``removal_share``) of the array at ``path``."""
    level, first, end = removal_share(grid, rank, size)
    if first >= end:
        return
    try:
        top = os.open(path, DIR_FLAGS)
    except FileNotFoundError:
        return
    except OSError as e:
        failures.append((path, e))
        return
    chain: list = []
    try:
        g = grid[level]
        for parent in range(first // g, (end - 1) // g + 1):
            lo, hi = max(first - parent * g, 0), min(end - parent * g, g)
            index: list = []
            q = parent
            for n in reversed(grid[:level]):
                q, i = divmod(q, n)
                index.append(str(i))
            names = ("c",) + tuple(reversed(index))
            fd = _open_chain(top, names, chain, path, failures)
            if fd < 0:
                continue
            where = os.path.join(path, *names)
            if lo == 0 and hi == g:     # the whole directory is ours: list it once
                clear_dir(fd, where, failures)
            elif hi - lo <= DEAL_MAX:   # our names in it, one unlinkat (or tree) each
                for k in range(lo, hi):
                    if level == len(grid) - 1:
                        remove_entry_at(fd, str(k), where, failures)
                    else:
                        remove_dir_at(fd, str(k), where, failures)
            else:                       # too many names to try blindly: list it
                clear_dir(fd, where, failures, keep=_outside(lo, hi))
    finally:
        for _, fd in chain:
            if fd >= 0:
                os.close(fd)
        os.close(top)


# ---------------------------------------------------------------- the backend

class ZarrBackend(ScratchPlaces):
    """Zarr v3 arrays (directories) on a local or parallel file system; DiskArrays only."""

    name = "zarr"
    description = "Zarr v3 arrays: numcodecs codecs, sharding, two-phase collective writes"
    collective_open = True
    array_formats = ("zarr-v3",)
    suffix = ".zarr"
    array_options = frozenset({"compressor", "inner_chunks", "lock"})
    resizable_arrays = True

    def check_available(self) -> None:
        """Raise ``BackendUnavailableError`` unless zarr, numcodecs and a crc32c are
        installed: found without importing them (``importlib.util.find_spec``; zarr-python
        alone costs ~170 modules and ~0.5 s per rank). They are imported where used:
        numcodecs for a codec, zarr-python only by ``as_dask``."""
        missing = [m for m in ("zarr", "numcodecs") if not _installed(m)]
        if not missing and not _installed("google_crc32c"):
            try:                    # numcodecs' own crc32c (it may be built without one)
                zf.crc32c(b"")
            except ImportError:
                missing.append("google_crc32c")
        if missing:
            raise BackendUnavailableError("zarr", f"{', '.join(missing)} not installed",
                                          "pip install zarr numcodecs google-crc32c")

    def remove(self, path: str) -> bool:
        """Delete the array (directory tree) or file at ``path``, never following a link;
        False when absent. Every part is tried; ``StorageError`` names the first that
        could not be removed."""
        return self.remove_all(path, None)

    def remove_all(self, path: str, comm: Any) -> bool:
        """Collective ``remove`` (``backends.CollectiveRemove``): every rank of ``comm``
        (None: this process alone) removes its share of the objects (``removal_share``),
        then after one barrier rank 0 removes the rest. Returns whether the array existed
        on every rank, or raises on every rank (rank 0 the ``StorageError``)."""
        rank, size = (0, 1) if comm is None else (comm.rank, comm.size)
        plan = _removal_plan(path) if rank == 0 else None
        if size > 1:
            plan = comm.bcast(plan)
        if plan == "absent":
            return False
        failures: list = []
        if plan is not None:
            try:
                _remove_share(path, plan, rank, size, failures)
            except Exception as e:  # noqa: BLE001 - rank 0 retries what is left
                failures.append((path, e))
        if size > 1:
            comm.barrier()
        error = None
        if rank == 0:
            failures = []           # what others could not remove, rank 0 tries again
            remove_dir_at(None, path, "", failures)
            if failures:
                error = removal_error(path, failures, "remove the Zarr array")
        if size > 1:
            reason = comm.bcast(None if error is None else f"{type(error).__name__}: {error}")
            if reason is not None and error is None:
                raise CollectiveError(f"removal of Zarr array {path!r}", {0: reason})
        if error is not None:
            raise error
        return True

    def recognizes(self, path: str) -> bool:
        """True when ``path`` is a directory holding a Zarr v3 array's ``zarr.json``. While
        another process re-creates the array there it waits up to ``SETTLE_SECONDS`` for
        it (``_settled``), then says True (``describe`` reports what it found)."""
        try:
            doc = _settled(path, zf.load_doc_at)
        except MetadataError as e:
            return isinstance(e, _Unsettled)
        except Exception:
            return False
        return isinstance(doc, dict) and doc.get("zarr_format") == 3 and \
            doc.get("node_type") == "array"

    def describe(self, path: str) -> dict:
        """``{"shape", "dtype", "chunks", "attributes"}`` of the array at ``path``
        (``attributes``: what chemio stored at creation, ``{}`` for foreign arrays)."""
        m = _settled(path, zf.read_meta_at)
        doc = m.attributes.get("chemio")
        return {"shape": m.shape, "dtype": zf.dtype_json(m.dtype), "chunks": m.chunks,
                "attributes": dict(doc) if isinstance(doc, dict) else {},
                "user_attributes": {k: v for k, v in m.attributes.items() if k != "chemio"}}

    def write_attributes(self, path: str, attributes: dict) -> None:
        """``AttributeWriter``: the ``attributes`` of ``<path>/zarr.json`` become
        ``attributes`` plus chemio's own entry (``"chemio"``, kept), in one atomic write."""
        doc = zf.load_doc(path)
        zf.parse(doc, os.path.join(path, zf.META_NAME))
        have = doc.get("attributes")
        mine = have.get("chemio") if isinstance(have, dict) else None
        doc["attributes"] = dict(attributes) | ({"chemio": mine} if mine is not None else {})
        perms = _stat.S_IMODE(os.stat(os.path.join(path, zf.META_NAME)).st_mode)
        zf.write_meta(path, doc, perms)

    def open_array(self, path: str, mode: str, *, shape: Any, dtype: Any, chunks: Any,
                   comm: Any = None, perms: int = 0o600, attributes: dict | None = None,
                   compressor: Any = None, inner_chunks: Any = None,
                   lock: bool | None = None, reserve: bool = True,
                   maxshape: Any = None) -> ZarrArrayStore:
        """Open (``r``, ``r+``) or create (``w+`` replaces, ``x+`` must not exist) the
        Zarr v3 array at directory ``path``; with ``comm`` every rank calls this together
        (rank 0 creates, then all open) and all return or all raise. ``lock``: None locks
        the writes that cover part of a storage object against other processes, True
        every object write, False none (see the module docstring)."""
        if mode not in _MODES:
            raise ValueError(f"mode {mode!r} is not one of {list(_MODES)}")
        shape_t = tuple(int(n) for n in shape)
        chunks_t = tuple(int(c) for c in chunks)
        dt = np.dtype(dtype)
        what = f"open Zarr array {path!r}"
        create = mode in ("w+", "x+")
        spec = None
        with _agree(comm, what):
            if create:
                spec = self._creation(shape_t, dt, chunks_t, compressor, inner_chunks,
                                      attributes)
            if lock is not None and not isinstance(lock, bool):
                raise ArgumentError(f"lock must be None (lock writes that cover part of a "
                                    f"storage object), True (every write) or False (none), "
                                    f"got {lock!r}")
            if spec is not None and (comm is None or comm.rank == 0):   # spec: create
                self._create(path, mode, spec, perms)
        store = None
        with _agree(comm, what):
            root, m = _settled(path, zf.read_meta_at, keep_open=True)
            try:
                m = _as_dtype(m, dt)
                if m.foreign is not None and mode != "r":
                    raise ModeError(
                        f"the Zarr array at {path!r} opens read-only (mode 'r'), not {mode!r}: "
                        f"{m.foreign}, so chemio reads it through zarr-python's own codec "
                        f"pipeline and cannot write it; nothing was changed")
                if (m.shape, m.dtype, m.chunks) != (shape_t, dt, chunks_t):
                    raise MetadataError(
                        f"the Zarr array at {path!r} has shape {m.shape}, {m.dtype}, chunks "
                        f"{m.chunks}, not the shape {shape_t}, {dt}, chunks {chunks_t} asked "
                        f"for (if it was just examined, another process has re-created it "
                        f"since: open it again)")
                if not create:
                    self._same_options(path, m, compressor, inner_chunks, attributes)
            except BaseException:
                os.close(root)
                raise
            store = ZarrArrayStore(path, m, mode != "r", perms, comm, lock, root)
            store.maxshape = m.shape if maxshape is None else tuple(maxshape)
        return store

    def _creation(self, shape: tuple, dt: np.dtype, chunks: tuple, compressor: Any,
                  inner_chunks: Any, attributes: dict | None) -> dict:
        if len(chunks) != len(shape) or min(chunks, default=1) < 1:
            raise ArgumentError(f"chunks {chunks} must have one int >= 1 per axis of {shape}")
        obj = math.prod(chunks) * dt.itemsize
        if obj > zf.MAX_OBJECT_BYTES:
            raise ArgumentError(f"chunks {chunks} make storage objects of {obj} bytes; the "
                                f"zarr backend holds objects of at most {zf.MAX_OBJECT_BYTES}")
        name = attributes.get("name") if isinstance(attributes, dict) else None
        comp = config.setting_for("compressor", name if isinstance(name, str) else None,
                                  compressor).value
        inner = self._inner(chunks, dt, inner_chunks)
        try:
            doc = zf.build_doc(shape, dt, chunks, comp, inner, attributes)
        except MetadataError as e:
            raise ArgumentError(str(e)) from None
        zf.parse(doc, "the new zarr.json")          # what we write, we can read
        return doc

    @staticmethod
    def _inner(chunks: tuple, dt: np.dtype, inner_chunks: Any) -> tuple | None:
        if inner_chunks is None:
            return default_inner(chunks, dt.itemsize)
        if inner_chunks is False:
            return None
        try:
            inner = tuple(int(i) for i in inner_chunks)
            ok = all(not isinstance(i, bool) for i in inner_chunks)
        except (TypeError, ValueError):
            ok, inner = False, ()
        if not ok or len(inner) != len(chunks) or min(inner, default=1) < 1 or \
                any(c % i for c, i in zip(chunks, inner)):
            raise ArgumentError(f"inner_chunks={inner_chunks!r} must give one int >= 1 per axis "
                                f"that divides the storage object shape (chunks {chunks}), or "
                                f"False for no sharding")
        if math.prod(c // i for c, i in zip(chunks, inner)) > zf.MAX_INNER:
            raise ArgumentError(f"inner_chunks={inner} make more than {zf.MAX_INNER} inner "
                                f"chunks per storage object {chunks}; choose larger ones")
        return inner

    def _create(self, path: str, mode: str, doc: dict, perms: int) -> None:
        """Make the array at ``path`` whole before anyone can see it: a new directory with
        its ``zarr.json`` under a temporary name beside ``path``, then one rename into
        place, where it replaces an array (``w+``) by an atomic exchange when the file
        system can, so a racing open finds the old array or the new one, never a missing
        or half-made one. The old array is then removed, its ``zarr.json`` first, so that
        handles still open on it fail instead of reading the fill value."""
        dperms = (perms & 0o666) | ((perms & 0o444) >> 2) | 0o700
        if os.path.lexists(path):
            if mode == "x+":
                raise FileExistsError(errno.EEXIST, f"{path!r} already exists (mode 'x+')",
                                      path)
            self._check_replaceable(path)
        parent, base = os.path.split(path)
        new = os.path.join(parent, f".{base}.new-{os.getpid()}-{os.urandom(4).hex()}")
        try:
            os.mkdir(new, dperms)
        except OSError as e:
            raise StorageError(e.errno, new, None, None, "create the array directory") from e
        try:
            zf.write_meta(new, doc, perms & 0o666)
            old = _move_into_place(new, path, mode)
        except BaseException:
            jobs.remove_path(new)
            raise
        if old is not None:
            try:
                os.unlink(os.path.join(old, zf.META_NAME))
            except OSError:
                pass
            try:
                self.remove(old)
            except Exception as e:                      # the new array is in place
                warnings.warn(f"the Zarr array replaced at {path!r} was moved to {old!r} and "
                              f"could not be removed there ({e}); remove it by hand",
                              RuntimeWarning, stacklevel=3)

    def _check_replaceable(self, path: str) -> None:
        """Refuse (``ArgumentError``) to replace a directory at ``path`` that holds data but
        no Zarr array, nor a damaged one (a ``zarr.json`` that does not parse)."""
        st = os.lstat(path)
        if not _stat.S_ISDIR(st.st_mode) or self.recognizes(path) or not os.listdir(path):
            return
        try:
            zf.load_doc(path)
        except MetadataError:
            if os.path.lexists(os.path.join(path, zf.META_NAME)):
                return                                  # a damaged array: replaced
        raise ArgumentError(f"{path!r} is a directory that is not a Zarr array; refusing to "
                            f"replace it (choose another path)")

    @staticmethod
    def _same_options(path: str, m: zf.ZarrMeta, compressor: Any, inner_chunks: Any,
                      attributes: Any) -> None:
        if compressor is not None:
            want = config.setting_for("compressor", None, compressor).value
            have = zf.compressor_of(m)
            if want != have:
                raise ArgumentError(f"the Zarr array at {path!r} is stored with compressor "
                                    f"{have}, not {want}; compression is chosen at creation")
        if inner_chunks is not None:
            have_inner = m.shard.inner if m.shard else False
            want_inner = False if inner_chunks is False else tuple(inner_chunks)
            if have_inner != want_inner:
                raise ArgumentError(f"the Zarr array at {path!r} has inner chunks "
                                    f"{have_inner}, not {want_inner}; they are chosen at "
                                    f"creation")


def _as_dtype(m: zf.ZarrMeta, dt: np.dtype) -> zf.ZarrMeta:
    """``m`` holding ``dt`` when the array stores ``dt``'s records as ``raw_bytes`` of the
    same size (a structured dtype zarr-python's ``structured`` cannot hold exactly:
    ``zf.data_type_doc``); otherwise ``m`` unchanged."""
    from dataclasses import replace
    if dt.names is None or m.dtype.names is not None or m.dtype.kind != "V" or \
            m.dtype.itemsize != dt.itemsize:
        return m
    return replace(m, dtype=dt, fill=m.fill.view(dt).reshape(()))


class _NoAgreement:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _agree(comm: Any, what: str):
    return _NoAgreement() if comm is None else comm.agree(what)


# ---------------------------------------------------------------- re-creating in place

_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_renameat2_fn: Any = False              # not looked up yet


def _renameat2(src: str, dst: str, flags: int) -> bool:
    """Linux ``renameat2(src, dst, flags)``: True when done, False when this system or
    file system cannot (the caller falls back); other failures raise ``OSError``."""
    global _renameat2_fn
    import ctypes
    if _renameat2_fn is False:
        try:
            fn = ctypes.CDLL(None, use_errno=True).renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                           ctypes.c_uint]
            fn.restype = ctypes.c_int
            _renameat2_fn = fn if sys.platform.startswith("linux") else None
        except (OSError, AttributeError):
            _renameat2_fn = None
    if _renameat2_fn is None:
        return False
    at_cwd = -100
    if _renameat2_fn(at_cwd, os.fsencode(src), at_cwd, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), src, None, dst)


def _move_into_place(new: str, path: str, mode: str) -> str | None:
    """Rename the finished array directory ``new`` to ``path``; returns where the array
    it replaced now lies (None: nothing was replaced)."""
    try:
        if _renameat2(new, path, _RENAME_NOREPLACE):
            return None
        if not os.path.lexists(path):
            os.rename(new, path)                # (would replace an empty directory)
            return None
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            raise
    if mode == "x+":
        raise FileExistsError(errno.EEXIST, f"{path!r} already exists (mode 'x+')", path)
    if not _stat.S_ISDIR(os.lstat(path).st_mode):     # a file or a link in the way
        jobs.remove_path(path)
        os.rename(new, path)
        return None
    if _renameat2(new, path, _RENAME_EXCHANGE):
        return new                              # the old array now lies at ``new``
    parent, base = os.path.split(new)
    old = os.path.join(parent, base.replace(".new-", ".old-", 1))
    os.rename(path, old)
    os.rename(new, path)
    return old


def _being_replaced(path: str) -> bool:
    """Whether a re-create of the array at ``path`` is under way (its temporary
    directories ``.<name>.new-*``/``.<name>.old-*`` are beside it)."""
    parent, base = os.path.split(os.path.abspath(path))
    marks = (f".{base}.new-", f".{base}.old-")
    try:
        with os.scandir(parent) as it:
            return any(e.name.startswith(marks) for e in it)
    except OSError:
        return False


class _Unsettled(MetadataError):
    """The array at a path stayed in the middle of a re-create for ``SETTLE_SECONDS``."""


def _replaced(root: int, path: str) -> bool:
    """Whether the directory open as ``root`` is no longer the one at ``path``."""
    try:
        st, now = os.fstat(root), os.lstat(path)
    except OSError:
        return True
    return st.st_nlink == 0 or (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino)


def _settled(path: str, read: Any, keep_open: bool = False) -> Any:
    """``read(dir_fd, path)`` of the array directory at ``path`` (``zf.load_doc_at`` or
    ``zf.read_meta_at``); with ``keep_open`` ``(dir_fd, result)``, the descriptor the
    caller's to close. While another process re-creates the array there (the directory
    was replaced under the descriptor, or the re-create's temporary directories are
    beside it) it tries again for up to ``SETTLE_SECONDS``, then raises ``_Unsettled``."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        root = -1
        try:
            root = zf.open_dir(path)
            got = read(root, path)
            if keep_open:
                root, fd = -1, root
                return fd, got
            return got
        except (MetadataError, StorageError) as e:
            moving = (root >= 0 and _replaced(root, path)) or _being_replaced(path)
            if not moving:
                raise
            if time.monotonic() > deadline:
                raise _Unsettled(
                    f"{path!r} is being re-created by another process ({e}; its temporary "
                    f"directories .{os.path.basename(path)}.new-*/.old-* are beside it): open "
                    f"it again once that is done (temporary directories left by a re-create "
                    f"that was killed stay until removed)") from None
        finally:
            if root >= 0:
                os.close(root)
        time.sleep(0.005)
