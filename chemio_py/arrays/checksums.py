"""Per-chunk checksums of DiskArrays (``checksum=True``).

``DiskArray.create(..., checksum=True)`` (backends local, shm, auto: the raw grid format
read and written by this process) keeps one CRC-32 (``zlib.crc32``: C speed, no new
dependency) per chunk in a sidecar beside the metadata, ``<data file>.crc``: a flat
array of little-endian uint32, one per chunk in C order of the chunk grid, nothing else
(its size is exactly 4 bytes per chunk). A chunk's CRC is that of its elements in C order
of its own extent: its bytes in the grid file. An entry holds ``crc ^ crc(zeros)`` (the
CRC of as many zero bytes), so a new sidecar, all zeros (a sparse file), says every chunk
is zeros, as a new array is: a chunk never written needs no entry and no sentinel.

Writes: after a write completes, every chunk it touched gets its entry recomputed, a
chunk written whole from the data in memory, a chunk written in part from the whole
chunk read back. The read-back and the entry's write hold the entry's lock (a thread lock
and an exclusive ``fcntl`` lock on the entry's first byte, open-file-description where the
kernel has them, as the zarr backend's partial writes): so independent writers of
disjoint parts of one chunk, in any processes, leave the CRC of the chunk's final bytes
(the last to take the lock read after every write that came before). Writers of the same
elements at the same time leave undefined data, and the CRC may then not match it.

``write_all``: every rank recomputes the chunks it touched after the end of the write's
agreement (an allgather: every rank's writes are complete), so a chunk shared by several
ranks is recomputed by each of them from the same final bytes, to the same value:
idempotent, no communication. A write that fails leaves the chunks it touched unverified:
reading them raises ``ChecksumError`` until they are written again (their data is
undefined). Reads: every chunk a read meets is checked, a chunk read in part by reading
all of it (its bytes then come from that read: what is returned is what was checked).
"""
from __future__ import annotations

import math
import os
import stat
import threading
import zlib
from typing import Any, Callable, Sequence

import numpy as np

import chemio_py.backends as _backends
from chemio_py.arrays import meta as _meta
from chemio_py.backends import grid
from chemio_py.errors import ArgumentError, ChecksumError, MetadataError
from chemio_py.runtime import config, pool
from chemio_py.scratch import jobs

CRC_SUFFIX = ".crc"
CHECKSUM_BACKENDS = ("local", "shm", "auto")
CHECKSUM_ALGORITHM = "crc32"
_CRC_ENTRY = 4
_ZERO_CRCS: dict[int, int] = {}
_CRC_STRIPES = [threading.Lock() for _ in range(64)]
_TASK_BYTES = (1 << 20, 32 << 20)    # the bytes of one pool task of a hook, clamped
_POOL_THREAD = "chemio-io_"     # the name prefix of the I/O pool's threads (runtime.pool)


def crc_path(data: str) -> str:
    """The checksum sidecar of the array whose data is at ``data``."""
    return data + CRC_SUFFIX


def zero_crc(nbytes: int) -> int:
    """CRC-32 of ``nbytes`` zero bytes (cached: few chunk sizes per array)."""
    crc = _ZERO_CRCS.get(nbytes)
    if crc is None:
        block = bytes(min(nbytes, 1 << 20))
        crc, left = 0, nbytes
        while left:
            k = min(left, len(block))
            crc = zlib.crc32(memoryview(block)[:k], crc)
            left -= k
        if len(_ZERO_CRCS) < 4096:
            _ZERO_CRCS[nbytes] = crc
    return crc


def _crc_of(a: np.ndarray, scratch: np.ndarray) -> int:
    """CRC-32 of ``a``'s elements in C order, through a copy in ``scratch`` (bytes, at least
    ``a.nbytes``) unless ``a`` is contiguous: one ``zlib.crc32`` call, which releases the
    GIL (a call per row would take it back once per row, and threads contend for it)."""
    if not a.flags.c_contiguous:
        tmp = scratch[:a.nbytes].view(a.dtype).reshape(a.shape)
        np.copyto(tmp, a)
        a = tmp
    return zlib.crc32(a)  # type: ignore[arg-type]


def _cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _on_pool_thread() -> bool:
    """Whether this thread is one of the I/O pool's (a hook run as a request's finish): it
    must not wait for pool tasks, which could be queued behind it."""
    return threading.current_thread().name.startswith(_POOL_THREAD)


def _entry_lock(fd: int, at: int, take: bool) -> None:
    from chemio_py.backends.zarr.backend import byte_lock  # the zarr backend's partial-write lock
    byte_lock(fd, at, take)


class Checksums:
    """The open checksum sidecar of one DiskArray handle (see the comment above)."""

    def __init__(self, path: str, fd: int, lay: grid.Layout, dtype: np.dtype,
                 data_path: str, writable: bool):
        self.path = path
        self.fd = fd
        self.layout = lay
        self.dtype = dtype
        self.data_path = data_path
        self.writable = writable
        self._buffers = threading.local()   # one chunk buffer per thread, reused

    @staticmethod
    def make(data: str, lay: grid.Layout, perms: int) -> str:
        """Create the sidecar of a new array (all entries zero: every chunk zeros), as a
        new file renamed into place (a handle of an array it replaces keeps the old one)."""
        path = crc_path(data)
        tmp = jobs.temp_path(path)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     perms)
        try:
            try:
                os.ftruncate(fd, math.prod(lay.grid) * _CRC_ENTRY)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            jobs.remove_path(tmp)
            raise
        return path

    @classmethod
    def open(cls, data: str, lay: grid.Layout, dtype: np.dtype,
             writable: bool) -> "Checksums":
        path = crc_path(data)
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC | \
            os.O_NONBLOCK
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            raise MetadataError(
                f"the DiskArray {data!r} was created with checksum=True but its checksum "
                f"file {path!r} is missing; restore it from where the array came from (the "
                f"array is its data file, its .json and its .crc)") from None
        except OSError as e:
            raise MetadataError(f"the checksum file {path!r} of DiskArray {data!r} cannot be "
                                f"opened: {e}") from None
        try:
            st = os.fstat(fd)
            want = math.prod(lay.grid) * _CRC_ENTRY
            if not stat.S_ISREG(st.st_mode) or st.st_size != want:
                what = "is not a regular file" if not stat.S_ISREG(st.st_mode) else \
                    f"has {st.st_size} bytes"
                raise MetadataError(
                    f"the checksum file {path!r} of DiskArray {data!r} {what}; it must be a "
                    f"regular file of exactly {want} bytes (4 per chunk of the grid "
                    f"{list(lay.grid)}): it is damaged or not this array's")
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, lay, dtype, data, writable)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def flush(self) -> None:
        if self.writable and self.fd >= 0:
            os.fsync(self.fd)

    # ------------------------------------------------------------ entries
    def _number(self, index: Sequence[int]) -> int:
        n = 0
        for i, g in zip(index, self.layout.grid):
            n = n * g + i
        return n

    def _expected(self, n: int, nbytes: int) -> int:
        raw = os.pread(self.fd, _CRC_ENTRY, n * _CRC_ENTRY)
        if len(raw) != _CRC_ENTRY:
            raise MetadataError(f"the checksum file {self.path!r} is shorter than its array "
                                f"needs (entry {n} is missing): it was truncated")
        return int.from_bytes(raw, "little") ^ zero_crc(nbytes)

    def _put(self, n: int, crc: int, nbytes: int) -> None:
        entry = (crc ^ zero_crc(nbytes)).to_bytes(_CRC_ENTRY, "little")
        if os.pwrite(self.fd, entry, n * _CRC_ENTRY) != _CRC_ENTRY:
            raise OSError(f"short write of a checksum to {self.path!r}")

    @staticmethod
    def _rel(region: tuple, piece: Any) -> tuple[slice, ...]:
        return tuple(slice(s - r.start, s - r.start + k)
                     for s, k, r in zip(piece.start, piece.shape, region))

    def _scratch(self) -> np.ndarray:
        """This thread's chunk-sized byte buffer (made once, reused: no page faults)."""
        raw = getattr(self._buffers, "chunk", None)
        if raw is None:
            raw = self._buffers.chunk = np.empty(self.layout.chunk_nbytes, np.uint8)
        return raw

    def _chunk(self, store: Any, piece: Any) -> np.ndarray:
        """The whole chunk of ``piece``, read from the store into this thread's buffer."""
        lay = self.layout
        buf = self._scratch()[:math.prod(piece.extent) * self.dtype.itemsize] \
            .view(self.dtype).reshape(piece.extent)
        store.read(tuple(slice(i * c, i * c + e) for i, c, e in
                         zip(piece.index, lay.chunks, piece.extent)), buf)
        return buf

    def _mismatch(self, piece: Any, n: int, nbytes: int, expected: int,
                  found: int) -> ChecksumError:
        return ChecksumError(self.data_path, piece.index, n, piece.offset, nbytes, expected,
                             found, self.path)

    # ------------------------------------------------------------ the hooks
    def _each_part(self, region: tuple,
                   fn: Callable[[tuple], ChecksumError | None]) -> None:
        """Run ``fn(part)`` over parts of ``region`` cut at chunk boundaries (each chunk
        in one part), on as many I/O pool threads as there are CPUs (CRC-32 runs at 1-2
        GB/s a core, releasing the GIL); in this thread when it is a pool thread. Each
        ``fn`` returns None or the error of its first bad chunk; the one first in the file
        over all parts is raised, as a serial pass would."""
        lay = self.layout
        threads = max(1, min(int(config.get("io_threads")), _cpus()))   # CPU-bound work
        size = grid.region_nbytes(region, lay.itemsize) // (4 * threads)
        parts = lay.split(region, min(max(size, _TASK_BYTES[0], lay.chunk_nbytes),
                                      _TASK_BYTES[1]), within_chunks=False)
        found: list = []
        if len(parts) <= 1 or threads == 1 or _on_pool_thread():
            found = [fn(part) for part in parts]
        else:
            pool.TaskRun(lambda part: found.append(fn(part)), parts).run(
                min(threads, len(parts)))
        bad = [e for e in found if e is not None]
        if bad:
            raise min(bad, key=lambda e: e.offset)

    def updated(self, store: Any, region: tuple, src: np.ndarray) -> None:
        """After a write of ``src`` to ``region`` completed: recompute the entries of the
        chunks it touched (whole chunks from ``src``, others read back under the lock)."""
        isz = self.dtype.itemsize

        def part(sub: tuple) -> None:
            scratch = self._scratch()
            for piece in self.layout.pieces(sub):
                n = self._number(piece.index)
                nbytes = math.prod(piece.extent) * isz
                if piece.shape == piece.extent:
                    self._put(n, _crc_of(src[self._rel(region, piece)], scratch), nbytes)
                    continue
                at = n * _CRC_ENTRY
                with _CRC_STRIPES[n % len(_CRC_STRIPES)]:
                    _entry_lock(self.fd, at, True)
                    try:
                        self._put(n, zlib.crc32(self._chunk(store, piece)),  # type: ignore[arg-type]
                                  nbytes)
                    finally:
                        _entry_lock(self.fd, at, False)
        self._each_part(region, part)

    def verify(self, store: Any, region: tuple, target: np.ndarray) -> None:
        """After a read of ``region`` into ``target``: check every chunk it met (a chunk
        read in part: all of it is read and checked, and the part copied from it)."""
        isz = self.dtype.itemsize
        chunks = self.layout.chunks

        def part(sub: tuple) -> ChecksumError | None:
            scratch = self._scratch()
            for piece in self.layout.pieces(sub):
                n = self._number(piece.index)
                nbytes = math.prod(piece.extent) * isz
                rel = self._rel(region, piece)
                if piece.shape == piece.extent:
                    chunk = None
                    found = _crc_of(target[rel], scratch)
                else:
                    chunk = self._chunk(store, piece)
                    found = zlib.crc32(chunk)  # type: ignore[arg-type]
                expected = self._expected(n, nbytes)
                if found != expected:
                    return self._mismatch(piece, n, nbytes, expected, found)
                if chunk is not None:
                    target[rel] = chunk[tuple(slice(s - i * c, s - i * c + k) for s, k, i, c
                                              in zip(piece.start, piece.shape, piece.index,
                                                     chunks))]
            return None
        self._each_part(region, part)


def verify_then_copy(sums: Checksums, store: Any, region: tuple, target: np.ndarray,
                      back: np.ndarray | None) -> None:
    sums.verify(store, region, target)
    if back is not None:
        back[...] = target


def check_checksum(be: Any, be_name: str, checksum: Any, why: str = "") -> None:
    """Refuse a ``checksum=`` that is not a bool, or checksums on a backend that cannot
    keep them: chemio keeps them for stores it reads and writes chunk by chunk itself, in
    the raw grid format, opened by each process alone (not ``zarr``, not ``mpiio``)."""
    if not isinstance(checksum, bool):
        raise ArgumentError(f"checksum must be True (a CRC-32 per chunk, checked on every "
                            f"read) or False, got {checksum!r}")
    if not checksum:
        return
    if isinstance(be, _backends.SelfDescribing):
        raise ArgumentError(
            f"backend {be_name!r} does not take checksum=True{why}: chemio keeps per-chunk "
            f"checksums for the raw grid backends {list(CHECKSUM_BACKENDS)}; on {be_name!r} "
            f"(Zarr v3) per-chunk crc32c codecs are not offered yet (sharded arrays already "
            f"checksum their shard indexes). Use backend='local' (or 'shm', 'auto') with "
            f"checksum=True, or {be_name!r} without it")
    if _backends.is_collective(be) or "grid" not in _backends.array_formats(be):
        raise ArgumentError(
            f"backend {be_name!r} does not take checksum=True{why}: chemio keeps per-chunk "
            f"checksums only where it reads back what every process wrote through its own "
            f"handle ({list(CHECKSUM_BACKENDS)}); {be_name!r} opens arrays collectively. "
            f"'local' writes the same raw grid format byte for byte: use backend='local' "
            f"with checksum=True (write_all works there too), or {be_name!r} without it")


def checksum_meta(checksum: bool) -> dict:
    """The metadata fields of ``checksum=``: format 2 and the algorithm when True."""
    if not checksum:
        return {}
    return {"checksum": CHECKSUM_ALGORITHM, "format": _meta.FORMAT_CHECKSUM}
