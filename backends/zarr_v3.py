"""The ``zarr`` backend: DiskArrays as standard Zarr v3 arrays, safe with many writers.

An array is a directory that plain ``zarr.open_array``, ``dask.array.from_zarr`` and
``xarray.open_zarr`` read (format in ``zarr_format``). The DiskArray ``chunks`` are the
storage objects (the zarr chunk grid); an object larger than 2 MiB is a shard of inner
chunks of about 256 KiB–1 MiB (``inner_chunks=`` sets them, ``False`` turns sharding off).
Compression: ``compressor=`` (``"zstd[:level]"``, ``"blosc[:cname[:level[:shuffle]]]"``,
``"none"``) or the ``compressor`` setting (``configure``, ``CHEMIO_COMPRESSOR``, TOML
``[files]`` rule).

The I/O path is chemio's own: numcodecs encodes and decodes; every object is written whole
to a temporary name in its directory and ``os.replace``-d, so a reader sees the old object
or the new one, never a torn one; shards are read through their index, decoding only the
inner chunks a region needs. Objects holding only zeros are not stored (read as zeros).

Many writers: ``write_all`` is collective two-phase I/O (``zarr_exchange``): each object
gets one owner rank, which alone rewrites it, so writers of disjoint regions never lose
each other's updates. An independent ``write`` that covers only part of an object while
several ranks hold the array writable would be a lost-update race: it is refused (use
``write_all``), unless the array was opened with ``lock=True``: then every object write
holds an ``fcntl`` lock on a byte of ``<array>/.chemio-lock``. On Lustre that needs the
``flock`` mount option (``localflock`` locks only within one node).
"""
from __future__ import annotations

import errno
import fcntl
import math
import os
import stat as _stat
import threading
from contextlib import contextmanager
from itertools import product
from typing import Any

import numpy as np

from chemio_py import config, scratch
from chemio_py.errors import (ArgumentError, BackendUnavailableError, ChemIOError,
                              CollectiveError, MetadataError, OutOfSpaceError, StorageError)
from chemio_py.layout import Layout, region_nbytes

from . import zarr_exchange as _xchg
from . import zarr_format as zf
from .posix import ScratchPlaces

SHARD_ABOVE = 2 << 20            # objects larger than this are sharded by default
INNER_TARGET = 1 << 20           # default inner chunk: at most this ...
INNER_MIN = 256 << 10            # ... and not less than this when the shape allows
LOCK_NAME = ".chemio-lock"
TASK_BYTES = 4 << 20             # read_all/write_all fan out in tasks of about this
_SPACE = (errno.ENOSPC, errno.EDQUOT)
_STRIPES = 64
_DIRTY_MAX = 1 << 16             # objects remembered for flush; beyond: flush syncs all
_MODES = ("r", "r+", "w+", "x+")
_AHEAD = 64                       # objects a read opens and queues before reading them


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


class ZarrArrayStore:
    """One open Zarr v3 array (see the module docstring). Thread-safe for disjoint
    regions; objects are rewritten whole, so ``byte_addressable`` is False and
    ``collective`` is True (``write_all`` is two-phase collective I/O)."""

    byte_addressable = False
    collective = True
    # Encoding and decoding are CPU work: more tasks than two per core only contend.
    read_streams = write_streams = 2 * (os.cpu_count() or 1)

    def __init__(self, path: str, meta: zf.ZarrMeta, writable: bool, perms: int,
                 comm: Any = None, lock: bool = False):
        self.path = path
        self.meta = meta
        self.shape = meta.shape
        self.chunks = meta.chunks
        self.dtype = meta.dtype
        self.writable = writable
        self._perms = perms & 0o666
        self._dperms = (perms & 0o666) | ((perms & 0o444) >> 2)
        self._comm = comm
        self._layout = Layout(meta.shape, meta.chunks, meta.dtype.itemsize)
        self._stripes = _in_process_locks()
        self._dirs: set = set()
        self._dirty: set = set()
        self._dirty_all = False
        self._dirty_lock = threading.Lock()
        self._shared_writers = writable and comm is not None and comm.size > 1
        self._lockfd = -1
        self._closed = False
        if lock and writable:
            self._lockfd = _open_lock_file(path, self._perms)
        self.lock = self._lockfd >= 0
        self._object_limit = zf.MAX_OBJECT_BYTES + (1 << 20) + \
            (meta.shard.index_nbytes if meta.shard else 0)

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

    def _verified_dir(self, rel: str, create: bool) -> bool:
        """True when directory ``rel`` (relative to the array) exists as a real directory
        (created when ``create``); a link or a non-directory on the way raises."""
        if rel in self._dirs or not rel:
            return True
        parent = os.path.dirname(rel)
        if not self._verified_dir(parent, create):
            return False
        full = os.path.join(self.path, rel)
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            if not create:
                return False
            try:
                os.mkdir(full, self._dperms | 0o700)
            except FileExistsError:
                pass
            except OSError as e:
                raise self._error(e, full, "mkdir") from e
            st = os.lstat(full)
        if not _stat.S_ISDIR(st.st_mode):
            what = "a symbolic link" if _stat.S_ISLNK(st.st_mode) else "not a directory"
            raise MetadataError(f"{full!r} inside the Zarr array {self.path!r} is {what}"
                                f"; refused (objects must stay inside the array's directory)")
        self._dirs.add(rel)
        return True

    def _error(self, e: OSError, path: str, what: str, n: int | None = None) -> Exception:
        if e.errno in _SPACE:
            try:
                free = scratch.stat(path).free
            except OSError:
                free = None
            return OutOfSpaceError(path, n, free, what=what)
        return StorageError(e.errno or errno.EIO, path, None, n, what)

    def _open_object(self, index: tuple) -> int:
        """A read descriptor of the object at ``index``, or -1 when it is absent."""
        key = self.meta.key(index)
        if not self._verified_dir(os.path.dirname(key), False):
            return -1
        full = os.path.join(self.path, key)
        try:
            fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return -1
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise MetadataError(f"{full!r} is a symbolic link; refused (objects must be "
                                    f"regular files inside the array)") from None
            raise StorageError(e.errno, full, None, None, "open") from e
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise MetadataError(f"{full!r} is not a regular file; refused")
        return fd

    def _pread(self, fd: int, offset: int, n: int, where: str) -> memoryview:
        buf = bytearray(n)
        mv = memoryview(buf)
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
                                f"array can have ({self._object_limit}); it is corrupt")
        return size

    def _decode(self, pipe: zf.Pipeline, buf: Any, out: np.ndarray, where: str) -> None:
        try:
            pipe.decode(buf, out)
        except (ValueError, RuntimeError, TypeError) as e:
            raise MetadataError(f"{where}: the stored object does not decode ({e}); it is "
                                f"corrupt: restore it or rewrite this part of the array") from None

    @contextmanager
    def _locked(self, index: tuple):
        """Serialise writers of object ``index``: threads of this process (striped locks)
        and, with ``lock=True``, processes (``fcntl`` byte lock in the side file)."""
        stripe = self._stripes[hash(index) % _STRIPES]
        with stripe:
            if self._lockfd < 0:
                yield
                return
            at = int(np.ravel_multi_index(index, self.meta.grid)) if index else 0
            fcntl.lockf(self._lockfd, fcntl.LOCK_EX, 1, at)
            try:
                yield
            finally:
                fcntl.lockf(self._lockfd, fcntl.LOCK_UN, 1, at)

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
            if whole and out.flags.c_contiguous:
                if pipe.plain:
                    nb = out.nbytes
                    if size != nb:
                        raise MetadataError(f"{where} has {size} bytes, expected {nb}; it is "
                                            f"corrupt: restore it or rewrite this part")
                    self._readinto(fd, out, where)
                    return
                self._decode(pipe, self._pread(fd, 0, size, where), out, where)
                return
            tmp = np.empty(chunks, self.dtype)
            self._decode(pipe, self._pread(fd, 0, size, where), tmp, where)
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
        sh = self.meta.shard
        assert sh is not None                   # only called for sharded arrays
        size = self._size(fd, where)
        idx = self._index(fd, size, where)
        boxes = list(self._inner_boxes(local))
        want = [k for k, _, _ in boxes if idx[k, 0] != zf.EMPTY]
        whole_buf = None
        if want and int(idx[want, 1].sum()) * 2 > size:      # most of it: one read
            whole_buf = self._pread(fd, 0, size, where)
        base = [s.start for s in local]
        for k, ins, obs in boxes:
            dst = out[tuple(slice(s.start - b, s.stop - b) for s, b in zip(obs, base))]
            off, ln = int(idx[k, 0]), int(idx[k, 1])
            if off == zf.EMPTY:
                dst[...] = self.meta.fill
                continue
            buf = whole_buf[off:off + ln] if whole_buf is not None else \
                self._pread(fd, off, ln, where)
            w = f"{where} (inner chunk {k})"
            full = tuple(s.stop - s.start for s in ins) == sh.inner
            if full and dst.flags.c_contiguous:
                self._decode(sh.pipeline, buf, dst, w)
            else:
                tmp = np.empty(sh.inner, self.dtype)
                self._decode(sh.pipeline, buf, tmp, w)
                dst[...] = tmp[ins]

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
        """Replace object ``index`` with ``data`` (None: remove it) atomically."""
        key = self.meta.key(index)
        d, name = os.path.split(key)
        full = os.path.join(self.path, key)
        if data is None:
            if self._verified_dir(d, False):
                try:
                    os.unlink(full)
                except FileNotFoundError:
                    return
                except OSError as e:
                    raise self._error(e, full, "remove") from e
                self._mark(os.path.dirname(full))
            return
        self._verified_dir(d, True)
        try:
            zf.write_atomic(os.path.dirname(full), name, data, self._perms)
        except OSError as e:
            raise self._error(e, full, "write", memoryview(data).nbytes) from e
        self._mark(full)

    def _mark(self, path: str) -> None:
        with self._dirty_lock:
            if len(self._dirty) < _DIRTY_MAX:
                self._dirty.add(path)
            else:
                self._dirty_all = True

    def _encode_whole(self, arr: np.ndarray) -> Any:
        """Stored bytes of one unsharded object (C-contiguous ``arr`` of the chunk shape)."""
        return self.meta.pipeline.encode(arr)

    def store_object(self, index: tuple, pieces: list, covered: bool) -> None:
        """Write the disjoint ``pieces`` [(object-local slices, array)] into object
        ``index``; ``covered``: they cover all of its elements inside the array, so
        nothing stored needs reading. Holds the object's lock."""
        if self._lockfd < 0:                    # threads of this process only
            with self._stripes[hash(index) % _STRIPES]:
                self._store(index, pieces, covered)
            return
        with self._locked(index):
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
        sh = self.meta.shard
        assert sh is not None                   # only called for sharded arrays
        where = self._where(index)
        extent = self._layout.chunk_extent(index)
        boxes = [tuple((s.start, s.stop) for s in sl) for sl, _ in pieces]
        fd, idx, old = -1, None, None
        parts: list = []
        try:
            everything = tuple(slice(0, c) for c in self.chunks)
            for k, _ins, obs in self._inner_boxes(everything):
                lo = [s.start for s in obs]
                hi = [min(s.stop, e) for s, e in zip(obs, extent)]
                if any(h <= l for l, h in zip(lo, hi)):
                    parts.append(None)                  # wholly outside the array
                    continue
                need = math.prod(h - l for l, h in zip(lo, hi))
                hits = []
                got = 0
                for (bx, (_sl, arr)) in zip(boxes, pieces):
                    a = [max(l, b[0]) for l, b in zip(lo, bx)]
                    b = [min(h, b[1]) for h, b in zip(hi, bx)]
                    if all(x < y for x, y in zip(a, b)):
                        hits.append((a, b, bx, arr))
                        got += math.prod(y - x for x, y in zip(a, b))
                if not hits or got < need:
                    if fd < 0 and idx is None and not covered:
                        fd = self._open_object(index)
                        if fd >= 0:
                            size = self._size(fd, where)
                            idx = self._index(fd, size, where)
                            if int(idx[idx[:, 0] != zf.EMPTY, 1].sum()) * 2 > size:
                                old = self._pread(fd, 0, size, where)
                    stored = None
                    if idx is not None and idx[k, 0] != zf.EMPTY:
                        off, ln = int(idx[k, 0]), int(idx[k, 1])
                        stored = old[off:off + ln] if old is not None else \
                            self._pread(fd, off, ln, where)
                    if not hits:
                        parts.append(None if stored is None else bytes(stored))
                        continue
                tile = np.empty(sh.inner, self.dtype)
                if got < need and stored is not None:
                    self._decode(sh.pipeline, stored, tile, f"{where} (inner chunk {k})")
                else:
                    tile[...] = self.meta.fill
                for a, b, bx, arr in hits:
                    dst = tuple(slice(x - l, y - l) for x, y, l in zip(a, b, lo))
                    src = tuple(slice(x - b0[0], y - b0[0]) for x, y, b0 in zip(a, b, bx))
                    tile[dst] = arr[src]
                parts.append(None if self._all_fill(tile) else bytes(sh.pipeline.encode(tile)))
        finally:
            if fd >= 0:
                os.close(fd)
        self._put(index, zf.encode_shard(parts, sh))

    # ------------------------------------------------------------ the ArrayStore API
    def read(self, region: tuple, out: np.ndarray) -> np.ndarray:
        """Fill ``out`` from ``region``; absent objects read as the fill value (zero)."""
        self._check(region, out)
        pieces = list(self._layout.pieces(region))
        ahead = self.meta.shard is None and len(pieces) > 1
        for at in range(0, len(pieces), _AHEAD):
            batch = pieces[at:at + _AHEAD]
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
        if not self._shared_writers or self.lock:
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
        for p, local, arr in self._pieces(region, data):
            self.store_object(p.index, [(local, arr)], p.shape == p.extent)

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
        from chemio_py import requests
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
            for p, local, a in self._pieces(sub, view):
                if p.index not in skip:
                    self.store_object(p.index, [(local, a)], p.shape == p.extent)
        if len(subs) == 1:
            req = requests.Request()
            try:
                run(subs[0])
                req.set_result(None)
            except Exception as e:
                req.set_exception(e)
            return [req]
        return [requests.submit(run, s) for s in subs]

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
        from chemio_py import requests
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
                           self.store_object, requests.submit,
                           lambda batch: _wait(batch, errors), _xchg.ROUND_BYTES, plan)
        except Exception as e:             # pragma: no cover - an MPI failure
            errors.append(e)
        _wait(local, errors)
        err = mine or (errors[0] if errors else None)
        reasons = comm.allgather(None if err is None else f"{type(err).__name__}: {err}")
        if err is not None:
            raise err
        bad = {r: m for r, m in enumerate(reasons) if m is not None}
        if bad:
            raise CollectiveError(f"write_all of Zarr array {self.path!r}", bad)

    def flush(self) -> None:
        """Make the objects this process wrote durable (fsync them and their directories)."""
        with self._dirty_lock:
            paths, self._dirty = self._dirty, set()
            everything, self._dirty_all = self._dirty_all, False
        if everything:                    # too many to remember: every object there is
            for d, _, files in os.walk(self.path):
                paths.add(d)
                paths.update(os.path.join(d, f) for f in files)
        dirs = set()
        for p in sorted(paths):
            dirs.add(p if os.path.isdir(p) else os.path.dirname(p))
            if os.path.isdir(p):
                continue
            try:
                fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            except OSError as e:
                raise self._error(e, p, "flush") from e
            finally:
                os.close(fd)
        for d in sorted(dirs):
            try:
                fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                os.fsync(fd)
            except OSError:
                pass
            finally:
                os.close(fd)

    def as_dask(self, chunks: Any = None) -> Any:
        """A dask array reading this array with zarr-python (no chemio needed on workers);
        ``chunks`` default: the storage objects."""
        import dask.array as da
        return da.from_zarr(self.path, chunks=chunks if chunks is not None else self.chunks)

    def close(self) -> None:
        """Release this process's resources (no collective call is needed); idempotent."""
        self._closed = True
        fd, self._lockfd = self._lockfd, -1
        if fd >= 0:
            os.close(fd)

    close_local = close

    def __del__(self):
        try:
            self.close()
        except Exception:
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


def _open_lock_file(path: str, perms: int) -> int:
    p = os.path.join(path, LOCK_NAME)
    try:
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, perms)
    except OSError as e:
        raise StorageError(e.errno, p, None, None, "open the lock file") from e
    if not _stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise MetadataError(f"{p!r} is not a regular file; refused")
    return fd


# ---------------------------------------------------------------- the backend

class ZarrBackend(ScratchPlaces):
    """Zarr v3 arrays (directories) on a local or parallel file system; DiskArrays only."""

    name = "zarr"
    description = "Zarr v3 arrays: numcodecs codecs, sharding, two-phase collective writes"
    collective_open = True
    array_formats = ("zarr-v3",)
    suffix = ".zarr"
    array_options = frozenset({"compressor", "inner_chunks", "lock"})

    def check_available(self) -> None:
        try:
            import numcodecs  # noqa: F401
            import zarr  # noqa: F401
            zf.crc32c(b"")
        except ImportError as e:
            raise BackendUnavailableError("zarr", f"importing its dependencies failed ({e})",
                                          "pip install zarr numcodecs google-crc32c") from e

    def recognizes(self, path: str) -> bool:
        """True when ``path`` is a directory holding a Zarr v3 array's ``zarr.json``."""
        try:
            doc = zf.load_doc(path)
        except Exception:
            return False
        return isinstance(doc, dict) and doc.get("zarr_format") == 3 and \
            doc.get("node_type") == "array"

    def describe(self, path: str) -> dict:
        """``{"shape", "dtype", "chunks", "attributes"}`` of the array at ``path``
        (``attributes``: what chemio stored at creation, ``{}`` for foreign arrays)."""
        m = zf.read_meta(path)
        doc = m.attributes.get("chemio")
        return {"shape": m.shape, "dtype": m.dtype.str, "chunks": m.chunks,
                "attributes": dict(doc) if isinstance(doc, dict) else {}}

    def open_array(self, path: str, mode: str, *, shape: Any, dtype: Any, chunks: Any,
                   comm: Any = None, perms: int = 0o600, attributes: dict | None = None,
                   compressor: Any = None, inner_chunks: Any = None, lock: bool = False,
                   reserve: bool = True) -> ZarrArrayStore:
        """Open (``r``, ``r+``) or create (``w+`` replaces, ``x+`` must not exist) the
        Zarr v3 array at directory ``path``; with ``comm`` every rank calls this together
        (rank 0 creates, then all open) and all return or all raise."""
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
            if lock not in (True, False):
                raise ArgumentError(f"lock must be True or False, got {lock!r}")
            if spec is not None and (comm is None or comm.rank == 0):   # spec: create
                self._create(path, mode, spec, perms)
        store = None
        with _agree(comm, what):
            m = zf.read_meta(path)
            if (m.shape, m.dtype, m.chunks) != (shape_t, dt.newbyteorder("="), chunks_t):
                raise MetadataError(
                    f"the Zarr array at {path!r} has shape {m.shape}, {m.dtype}, chunks "
                    f"{m.chunks}, not the shape {shape_t}, {dt}, chunks {chunks_t} asked for")
            if not create:
                self._same_options(path, m, compressor, inner_chunks, attributes)
            store = ZarrArrayStore(path, m, mode != "r", perms, comm, lock)
        return store

    def _creation(self, shape: tuple, dt: np.dtype, chunks: tuple, compressor: Any,
                  inner_chunks: Any, attributes: dict | None) -> dict:
        if dt.name not in zf.DTYPES:
            raise ArgumentError(f"dtype {dt} cannot be stored in a Zarr v3 array here; use "
                                f"one of {', '.join(zf.DTYPES)}")
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
        doc = zf.build_doc(shape, dt, chunks, comp, inner, attributes)
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
        dperms = (perms & 0o666) | ((perms & 0o444) >> 2) | 0o700
        if mode == "w+" and os.path.lexists(path):
            st = os.lstat(path)
            if _stat.S_ISDIR(st.st_mode) and not self.recognizes(path) and os.listdir(path):
                raise ArgumentError(f"{path!r} is a directory that is not a Zarr array; "
                                    f"refusing to replace it (remove it or choose another path)")
            scratch.remove_path(path)
        try:
            os.mkdir(path, dperms)
        except FileExistsError:
            raise FileExistsError(errno.EEXIST, f"{path!r} already exists (mode 'x+')",
                                  path) from None
        except OSError as e:
            raise StorageError(e.errno, path, None, None, "create the array directory") from e
        try:
            zf.write_meta(path, doc, perms & 0o666)
        except BaseException:
            scratch.remove_path(path)
            raise

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


class _NoAgreement:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _agree(comm: Any, what: str):
    return _NoAgreement() if comm is None else comm.agree(what)
