"""RecordFile: variable-size records appended to large pages and replayed with read-ahead.

The semi-direct SCF integral cache: the first iteration appends batches of integrals
(e.g. an index array and a value array), later iterations replay them in order.

    >>> import numpy as np, chemio_py as cio
    >>> with cio.RecordFile("ints.demo", "w+") as log:
    ...     log.append(np.array([1, 2], np.int32), np.array([0.5, 0.25]))
    ...     log.append(np.arange(3, dtype=np.int32), np.zeros(3))
    ...     [(idx.tolist(), val.tolist()) for idx, val in log.replay()]
    [([1, 2], [0.5, 0.25]), ([0, 1, 2], [0.0, 0.0, 0.0])]

Records are concatenated into a byte stream cut into pages of ``page_size`` bytes
(>= 1 MiB); a full page is written behind (``depth`` writes in flight) while the caller
keeps appending, optionally compressed by a numcodecs codec (``"zstd"``, ``"blosc"``).
``flush()`` / ``close()`` commit: they write the page index and then point the file header
at it, so the file can be reopened (``mode="r"`` or ``"r+"``) and replayed by another run.
A record larger than a page spans several pages. The file is an ``ExclusiveFile`` of this
rank: same naming, modes, scratch lifecycle and backends.

**Commits.** Nothing a commit refers to is overwritten before the next commit is complete:
pages and indexes are only ever placed in free space after it (a partly filled page that
grows is rewritten in place with the same leading bytes), and the header holds two commit
slots written alternately, each with its own checksum. A crash (SIGKILL, power loss after
a durable flush) or a later failure (ENOSPC, an exception) therefore leaves the last
complete commit readable: the reopened file holds exactly the records of that commit. Each
commit leaves the previous index behind as dead space (about 40 bytes per page).

The bytes on disk are ``recordformat``'s.
"""
from __future__ import annotations

import errno
import json
import mmap
import operator
import os
import threading
import time
import warnings
import weakref
import zlib
from typing import Any

import numpy as np

from chemio_py.errors import (ArgumentError, ChemIOError, LimitExceededError, MetadataError,
                              ModeError, StorageError)
from chemio_py.files.exclusive import ExclusiveFile, reopen as reopen_exclusive
from chemio_py.files.pickling import live
from chemio_py.files.recordformat import (
    COLUMNS,
    DEFAULT_PAGE,
    DURABLE,
    FORMAT,
    HEADER,
    HMAGIC,
    MAGIC,
    PAGE_ALIGN,
    SLOT_OFFSETS,
    TRAILER,
    VERSION,
    ZPAD,
    RecoveredWarning,
    make_codec,
    check_page_size,
    checksum_function,
    decode_page,
    default_checksum,
    describe,
    iter_records,
    pad8,
    read_index,
    slot_bytes,
)
from chemio_py.prefetch import Pipeline, WriteBehind, check_depth, quiet_wait
from chemio_py.runtime import finalizers, pool, reprs, requests, stats
from chemio_py.scratch.reopen import check_state, token


class RecordFile:
    """Variable-size records (tuples of NumPy arrays) appended and replayed in order.

    ``RecordFile(name, mode="w+", *, page_size=4 MiB, compressor=None, depth=2,
    backend=None, dir=None, size_hint=None, max_bytes=None, checksum=None)``

    * ``append(*arrays)`` adds one record; pages of ``page_size`` bytes are written behind
      with ``depth`` writes in flight. ``max_bytes`` bounds the (uncompressed) stream:
      an append past it raises ``LimitExceededError`` and stores nothing.
    * ``replay(depth=2)`` yields each record as a tuple of read-only arrays, reading
      ``depth`` pages ahead; the arrays are valid until the next step (copy to keep).
    * ``flush()`` commits every record appended so far: once it returns, reopening the
      file (in another process, or after this one is killed) shows them, and no later
      failure of this handle (ENOSPC, an exception, a kill) takes them away. It does not
      wait for the device: an OS crash or power loss may undo it.
      ``flush(durable=True)`` also syncs pages, index and header to the device before it
      returns: the records survive an OS crash or power loss too.
    * ``close()`` is ``flush()`` (not durable) and closes; an open replay is closed first.
      Records appended after the last commit are lost if the process dies before it.
      Reopen with ``mode="r"`` to replay or ``"r+"`` to append more; ``page_size`` and
      ``compressor`` are fixed at creation.
    * Every page carries a checksum, checked when it is read back (on the I/O pool, beside
      the read-ahead). ``checksum`` picks its algorithm for a new file: ``"crc32c"``
      (the ``crc32c`` wheel, which releases the GIL so the check overlaps the consumer, or
      google-crc32c's C code: about memory speed), ``"crc32"`` (zlib's, about 8x slower),
      or None: ``"crc32c"`` when either C implementation is importable, else
      ``"crc32"``. The file names its algorithm, so a reader uses the right one; files
      from before the choice existed are ``"crc32"``. ``checksum`` (property): the name.
    * ``nbytes``: bytes the file holds once flushed (compare with ``cio.stat(path).free``);
      ``raw_nbytes``: the uncompressed stream; ``len(log)``: the number of records;
      ``RecordFile.record_nbytes(*arrays)``: stream bytes one record takes;
      ``recovered``: None, or why the file was opened at its previous commit.

    * Pickled, it is the way to reopen it: another process on this node gets a read-only
      copy replaying the records of the last commit (``chemio_py.files.pickling``).

    An error of a write behind surfaces at the next ``append``/``flush``/``close`` and
    leaves the file failed (every later call raises it; the last commit stays readable).
    Not for concurrent use by several threads; do not append while a replay is open.
    """

    def __init__(self, name: str, mode: str = "w+", *, page_size: int | None = None,
                 compressor: Any = None, depth: int = 2, backend: str | None = None,
                 dir: str | None = None, size_hint: int | None = None,
                 max_bytes: int | None = None, checksum: str | None = None):
        if mode not in ("r", "r+", "w+", "x+"):
            raise ModeError(f"mode {mode!r} is not one of r, r+, w+, x+ (r: replay an existing "
                            f"file, r+: append to it, w+: create or truncate, x+: create new)")
        self._depth = check_depth(depth)
        new = mode in ("w+", "x+")
        if new:
            self._page_size = check_page_size(DEFAULT_PAGE if page_size is None else page_size)
            self._codec = None if compressor is None else make_codec(compressor)
            self._checksum = default_checksum() if checksum is None else checksum
            self._crc = checksum_function(self._checksum)
        elif compressor is not None:
            raise ArgumentError("the compressor of a RecordFile is fixed when it is created; "
                                "pass compressor=None to reopen it")
        elif checksum is not None:
            checksum_function(checksum)         # an unknown name is an error here too
        if max_bytes is not None:
            try:
                max_bytes = operator.index(max_bytes)
            except TypeError:
                raise ArgumentError(f"max_bytes must be an integer number of bytes, got "
                                    f"{type(max_bytes).__name__}") from None
            if max_bytes < 0:
                raise ArgumentError(f"max_bytes must be >= 0, got {max_bytes}")
        self._max_bytes = max_bytes
        self.name = name
        self._mode = mode
        self._lock = threading.Lock()
        # per page: offset, stored, raw, compressed?, CRC-32 of the raw bytes (-1: unknown)
        self._pages: list[Any] = []     # [off, stored, raw, flag, crc]; None while placed
        self._n = 0                  # records
        self._stream = 0             # stream bytes appended
        self._alloc = HEADER        # first free byte: nothing committed lies at or after it
        self._slot: int | None = None   # where the page being filled is (partly) written
        self._unplaced = 0           # pages handed to the pool to compress, not yet placed
        self._page_no = 0            # index of the page being filled
        self._pos = 0                # bytes in the page being filled
        self._bufs: list[np.ndarray] = []
        self._mvs: list[memoryview] = []
        self._buf_req: list[requests.Request | None] = []
        self._cur = 0
        self._dirty = new
        self._gen = 0                # generation of the last commit (0: none yet)
        self._commit_slot: int | None = None
        self._tpos: int | None = None    # trailer of the last commit
        self._durable = False        # the last commit is known to be on the device
        self._flushed_size: int | None = None
        self._error: BaseException | None = None
        self.recovered: str | None = None
        self._replays: "weakref.WeakSet[_Replay]" = weakref.WeakSet()
        self._map: _PageMap | None = None     # read-only mapping for replays of hot pages
        self._wb = None
        self._f = self._open_file(name, mode, backend, dir, size_hint)
        try:
            if new:
                self._f.write(0, HMAGIC + bytes(HEADER - len(HMAGIC)))
            else:
                self._load_index(page_size, checksum)
            self._wb = WriteBehind(self._depth, name=f"records:{name}") if mode != "r" else None
            if mode == "r+" and self._pages:
                self._resume()
        except BaseException:
            self._f.close()
            raise

    def _open_file(self, name: str, mode: str, backend: str | None, dir: str | None,
                   size_hint: int | None) -> ExclusiveFile:
        """The ExclusiveFile under the records (``_Copy`` opens a pickled one)."""
        return ExclusiveFile(name, mode, backend=backend, dir=dir, size_hint=size_hint)

    def __reduce__(self) -> tuple:
        """Pickle as the way to reopen the file: in another process on this node a
        read-only copy replaying the records of the last commit (``flush()`` first), in
        this one the file itself (``chemio_py.files.pickling``)."""
        file_state = self._f.__reduce__()[1][0]
        return (reopen, ({**file_state, "kind": "RecordFile", "token": token(self),
                          "file": file_state},))

    # ------------------------------------------------------------ properties
    @property
    def path(self) -> str:
        return self._f.path

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def closed(self) -> bool:
        return self._f.closed

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def compressor(self) -> str | None:
        """The codec id (``"zstd"``, ``"blosc"``...) or None."""
        return None if self._codec is None else self._codec.codec_id

    @property
    def checksum(self) -> str:
        """The page checksum algorithm: ``"crc32c"`` or ``"crc32"``."""
        return self._checksum

    @property
    def pages(self) -> int:
        """Pages in the stream (the last one may be partly filled)."""
        return self._page_no + (1 if self._pos else 0)

    def __len__(self) -> int:
        return self._n

    @property
    def raw_nbytes(self) -> int:
        """Bytes of the uncompressed record stream."""
        return self._stream

    @property
    def nbytes(self) -> int:
        """Bytes the file holds once closed: header, pages, indexes (the last one included).

        Exact after ``flush()``/``close()`` and for an unmodified reopened file; with
        compression and unflushed records it is an upper bound.
        """
        if not self._dirty and self._flushed_size is not None:
            return self._flushed_size
        ps = self._page_size
        with self._lock:
            end = self._alloc + self._unplaced * (ps + PAGE_ALIGN)
            if self._pos:
                if self._slot is None:
                    end = _align(end) + self._pos
                elif self._slot + ps == end:        # close() trims the slot of the last page
                    end = self._slot + self._pos
        n = self.pages
        return end + len(self._index_head(n)) + 8 * COLUMNS[VERSION] * n + TRAILER.size

    @staticmethod
    def record_nbytes(*arrays: Any) -> int:
        """Bytes one record of these arrays takes in the (uncompressed) stream."""
        _, head, payload = describe(arrays)
        return len(head) + payload

    # ------------------------------------------------------------ checks
    def _check_open(self) -> None:
        if self._f.closed:
            raise ChemIOError(f"RecordFile {self.name!r} is closed; open it again")
        if self._error is not None:
            raise self._error

    def _check_writable(self) -> None:
        self._check_open()
        if self._mode == "r":
            raise ModeError(f"RecordFile {self.name!r} is open read-only (mode 'r'); open it "
                            f"with mode 'r+' to append")
        if len(self._replays):
            raise ChemIOError(f"append to RecordFile {self.name!r} while a replay of it is "
                              f"open; finish or close() the replay first")

    # ------------------------------------------------------------ writing
    def append(self, *arrays: Any) -> None:
        """Append one record: a tuple of arrays of any dtypes and shapes."""
        self._check_writable()
        arrs, head, payload = describe(arrays)
        total = len(head) + payload
        if self._max_bytes is not None and self._stream + total > self._max_bytes:
            raise LimitExceededError(
                f"appending a record of {total} bytes to {self.name!r} would make its stream "
                f"{self._stream + total} bytes, over max_bytes={self._max_bytes}; nothing was "
                f"appended (compute this batch directly, or raise max_bytes)")
        if self._map is not None:
            self._drop_map()
        if not self._bufs:
            self._alloc_buffers()
        try:
            self._put(memoryview(head))
            for a in arrs:
                if a.nbytes:
                    # numpy's stubs make ndarray a Buffer for Python 3.12+ only
                    self._put(memoryview(a).cast("B"))  # type: ignore[arg-type]
                    pad = pad8(a.nbytes) - a.nbytes
                    if pad:
                        self._put(ZPAD[:pad])
        except BaseException as e:
            self._error = e
            raise
        self._n += 1
        self._stream += total
        self._dirty = True

    def _alloc_buffers(self) -> None:
        from chemio_py.backends.posix import aligned_empty
        self._bufs = [aligned_empty((self._page_size,), np.uint8) for _ in range(self._depth + 1)]
        # numpy's stubs make ndarray a Buffer for Python 3.12+ only
        self._mvs = [memoryview(b) for b in self._bufs]  # type: ignore[arg-type]
        self._buf_req = [None] * len(self._bufs)
        self._cur = 0

    def _put(self, mv: memoryview) -> None:
        ps = self._page_size
        n = len(mv)
        i = 0
        while i < n:
            pos = self._pos
            k = min(ps - pos, n - i)
            self._mvs[self._cur][pos:pos + k] = mv[i:i + k] if k != n else mv
            self._pos = pos + k
            i += k
            if self._pos == ps:
                self._write_page()
                self._next_buffer()

    def _take(self, n: int, align: bool) -> int:
        """Allocate ``n`` bytes of free space (hold ``self._lock``); returns the offset."""
        off = _align(self._alloc) if align else self._alloc
        self._alloc = off + n
        return off

    def _write_page(self) -> None:
        """Queue the full page being filled for writing behind (compressed on the pool)."""
        assert self._wb is not None             # open for writing
        i, raw = self._page_no, self._pos
        view = self._bufs[self._cur][:raw]
        if i == len(self._pages):
            self._pages.append(None)
        slot = self._slot
        with self._lock:
            if self._codec is None:
                off = slot if slot is not None else self._take(self._page_size, True)
                self._pages[i] = [off, raw, raw, 0, -1]
            else:
                self._unplaced += 1
        if self._codec is None:
            req = self._wb.submit(pool.submit, self._plain_write, i, off, view, nbytes=raw)
        else:
            req = self._wb.submit(pool.submit, self._compress_write, i, view, slot,
                                  nbytes=raw)
        self._buf_req[self._cur] = req

    def _next_buffer(self) -> None:
        self._page_no += 1
        self._pos = 0
        self._slot = None
        self._cur = (self._cur + 1) % len(self._bufs)
        prev = self._buf_req[self._cur]
        if prev is not None and not prev.done():
            quiet_wait(prev)       # its error, if any, surfaces through the WriteBehind

    def _plain_write(self, i: int, off: int, view: np.ndarray) -> int:
        """On the I/O pool: checksum page ``i`` and write it to its place."""
        crc = self._crc(view)
        self._f.write(off, view)
        self._pages[i][4] = crc
        return len(view)

    def _compress_write(self, i: int, view: np.ndarray, slot: int | None) -> int:
        """On the I/O pool: compress page ``i``, place it in free space, write it.

        A page that does not shrink is stored raw, in the slot it already has if any.
        """
        raw = len(view)
        assert self._codec is not None          # called for compressed files only
        crc = self._crc(view)
        try:
            enc = self._codec.encode(view.view(np.uint64) if raw % 8 == 0 else view)
            data, flag = ((memoryview(enc), 1) if len(enc) < raw
                          else (memoryview(view), 0))  # type: ignore[arg-type]
            with self._lock:
                if flag:
                    off = self._take(len(data), False)
                else:
                    off = slot if slot is not None else self._take(self._page_size, True)
        finally:
            with self._lock:
                self._unplaced -= 1
        self._f.write(off, data)
        with self._lock:
            self._pages[i] = [off, len(data), raw, flag, crc]
        return len(data)

    def _write_partial(self, final: bool) -> None:
        """Write the partly filled page (and wait), into its slot; with ``final`` (close)
        compress it and trim its slot when nothing follows it. Every full page is placed."""
        assert self._wb is not None             # open for writing
        i, raw, ps = self._page_no, self._pos, self._page_size
        view = self._bufs[self._cur][:raw]
        if i == len(self._pages):
            self._pages.append(None)
        crc = self._crc(view)
        data, flag = memoryview(view), 0  # type: ignore[arg-type]
        if final and self._codec is not None:
            enc = self._codec.encode(view.view(np.uint64) if raw % 8 == 0 else view)
            if len(enc) < raw:
                data, flag = memoryview(enc), 1
        with self._lock:
            if flag:
                off = self._take(len(data), False)
            else:
                if self._slot is None:
                    self._slot = self._take(ps, True)
                off = self._slot
                if final and off + ps == self._alloc:
                    self._alloc = off + raw
        self._wb.submit(self._f.awrite, off, data, nbytes=raw)
        self._wb.flush()
        self._pages[i] = [off, len(data), raw, flag, crc]

    def flush(self, durable: bool = False) -> None:
        """Commit every appended record (see the class docstring for what that promises);
        ``durable`` also syncs it to the device before returning."""
        self._flush(durable, False)

    def _flush(self, durable: bool, final: bool) -> None:
        self._check_open()
        if self._mode == "r":
            return
        assert self._wb is not None          # open for writing
        try:
            self._wb.flush()                 # full pages: placed and written
            if self._dirty:
                if self._pos:
                    self._write_partial(final)
                self._commit(durable)
                self._dirty = False
            elif durable and not self._durable and self._tpos is not None:
                self._f.flush()
                self._publish(self._tpos, True)
        except BaseException as e:
            if self._error is None:
                self._error = e
            raise

    def _index_head(self, n_pages: int) -> bytes:
        return json.dumps({"format": FORMAT, "version": VERSION, "page_size": self._page_size,
                           "compressor": None if self._codec is None else self._codec.get_config(),
                           "checksum": self._checksum,
                           "records": self._n, "stream_bytes": self._stream,
                           "pages": n_pages, "columns": COLUMNS[VERSION]},
                          sort_keys=True).encode()

    def _commit(self, durable: bool) -> None:
        """Write the index in free space, then point a header slot at it."""
        self._drop_map()
        n = self.pages
        table = np.array(self._pages[:n], dtype="<i8").reshape(n, COLUMNS[VERSION])
        head = self._index_head(n)
        blob = head + table.tobytes()
        with self._lock:
            ioff = self._take(len(blob) + TRAILER.size, False)
        tpos = ioff + len(blob)
        self._f.write(ioff, blob + TRAILER.pack(MAGIC, ioff, len(blob), zlib.crc32(blob),
                                                 len(head)))
        if durable:
            self._f.flush()                  # pages and index on the device before the slot
        self._publish(tpos, durable)
        end = tpos + TRAILER.size
        if self._f.size > end:               # uncommitted bytes of an earlier run or slot
            self._f.truncate(end)
        self._flushed_size = end

    def _publish(self, tpos: int, durable: bool) -> None:
        """Write the next commit into the slot the current commit does not use."""
        j = 0 if self._commit_slot is None else 1 - self._commit_slot
        gen = self._gen + 1
        self._f.write(SLOT_OFFSETS[j], slot_bytes(gen, tpos, DURABLE if durable else 0))
        if durable:
            self._f.flush()
        self._gen, self._commit_slot, self._tpos, self._durable = gen, j, tpos, durable

    # ------------------------------------------------------------ reopening
    def _load_index(self, page_size: Any, checksum: str | None) -> None:
        f = self._f
        size = f.size
        where = f"record file {f.path!r}"

        def read_at(off: int, n: int) -> bytes:
            return f.read_bytes(off, n)

        idx = read_index(read_at, size, where)
        if page_size is not None and page_size != idx.page_size:
            raise ArgumentError(f"{where} has page_size {idx.page_size}, not {page_size}; the "
                                f"page size is fixed when the file is created (pass "
                                f"page_size=None)")
        if checksum is not None and idx.version == VERSION and checksum != idx.checksum:
            raise ArgumentError(f"{where} checksums its pages with {idx.checksum}, not "
                                f"{checksum}; the algorithm is fixed when the file is created "
                                f"(pass checksum=None)")
        if idx.version != VERSION and self._mode != "r":
            raise ModeError(f"{where} is in record format {idx.version}, written by an earlier "
                            f"chemio_py; it can be replayed (mode 'r') but not appended to: "
                            f"copy its records into a new RecordFile")
        if idx.recovered:
            self.recovered = idx.recovered
            warnings.warn(idx.recovered, RecoveredWarning, stacklevel=3)
        self._page_size, self._codec = idx.page_size, idx.codec
        self._checksum = idx.checksum
        self._crc = checksum_function(idx.checksum)
        self._pages, self._n, self._stream = idx.pages, idx.records, idx.stream
        self._alloc = idx.end
        self._page_no, self._pos = len(idx.pages), 0
        self._gen, self._commit_slot = idx.max_generation, idx.slot
        self._tpos, self._durable = idx.end - TRAILER.size, idx.durable
        self._flushed_size = size

    def _resume(self) -> None:
        """Mode r+: continue filling a partly filled last page (rewritten elsewhere: its
        committed copy stays until the next commit)."""
        last = self._pages[-1]
        if last[2] == self._page_size:
            return
        self._alloc_buffers()
        self._page_no = len(self._pages) - 1
        self._pos = last[2]
        self._slot = None
        self._read_page(self._page_no, (np.empty(last[1], np.uint8), self._bufs[0]))

    # ------------------------------------------------------------ replay
    def _read_page(self, i: int, slot: tuple, entry: list | None = None) -> np.ndarray:
        """Blocking (on the I/O pool in a replay): page ``i`` into ``slot``; returns its bytes."""
        entry = self._pages[i] if entry is None else entry
        off, stored, raw, flag, _ = entry
        comp, page = slot
        if flag:
            self._f.read(off, comp[:stored])
        else:
            self._f.read(off, page[:raw])
        return decode_page(self._codec, entry, comp, page, f"record file {self.path!r}", i,
                           self._checksum)

    def _fetch_page(self, i: int, slot: tuple, entry: list, pm: "_PageMap | None") -> np.ndarray:
        """On the I/O pool in a replay: page ``i``, a read-only view of the mapping when it is
        uncompressed and in the page cache (checked against its checksum there), else read
        into ``slot`` (``_read_page``)."""
        if pm is not None and not entry[3]:
            t0 = time.perf_counter()
            page = pm.page(entry[0], entry[2])
            if page is not None:
                decode_page(None, entry, None, page, f"record file {self.path!r}", i,
                            self._checksum)
                if not pm.guard.poisoned:
                    # the records were delivered from the file: counted as read, as a
                    # DiskArray's hot read from its mapping is
                    self._f.stats.record("read", entry[2], t0, time.perf_counter(), entry[0])
                    return page
                self._drop_map(pm)           # the file shrank: the read below reports it
        return self._read_page(i, slot, entry)

    def _page_map(self) -> "_PageMap | None":
        """The file's read-only mapping for replays (made now if the file qualifies: a
        regular file of the ``local`` or ``shm`` backend, mincore and the SIGBUS guard
        available, within the ``map_cap`` setting); None otherwise."""
        pm = self._map
        if pm is not None and pm.view is not None:
            return pm
        if not MAP_REPLAY or self._f.backend not in ("local", "shm"):
            return None
        pm = _PageMap.create(self, self.path, self._f.size)
        self._map = pm
        return pm

    def _drop_map(self, pm: "_PageMap | None" = None) -> None:
        """Forget the replay mapping (``pm``: only if it is still that one); views handed
        out keep it mapped until they are gone."""
        from chemio_py.backends.local import mappings
        with mappings.maps_lock:
            cur = self._map
            if cur is None or (pm is not None and cur is not pm):
                return
            self._map = None
            live: Any = mappings.live_maps.get(id(cur))
            if live is cur:
                mappings.drop_map(id(cur))
            else:
                cur.release()

    def replay(self, depth: int = 2) -> "_Replay":
        """Iterate over the records in order, ``depth`` pages read ahead (flushes first).

        Yields tuples of read-only arrays, valid until the next step. Use it in a ``for``
        loop or a ``with`` block; ``close()`` ends it early. Every page is checked against
        its CRC before its records are handed out. Uncompressed pages of a ``local`` or
        ``shm`` file that are in the page cache are not copied: the arrays are views of a
        read-only mapping of the file (kept while any of them lives; dropped with the file's
        other read mappings by ``drop_mappings()``, at the next append and at close). If
        another process shrinks the file under a replay, the replay raises
        ``StorageError`` at its next step (no SIGBUS).
        """
        self._check_open()
        depth = check_depth(depth)
        if self._mode != "r" and self._dirty:
            self.flush()
        n_pages = self.pages
        pages = [list(p) for p in self._pages[:n_pages]]
        maxraw = max((p[2] for p in pages), default=0)
        maxstored = max((p[1] for p in pages if p[3]), default=0)
        name = f"replay:{self.name}"
        from chemio_py.backends.posix import aligned_empty

        def make() -> tuple:
            return (np.empty(maxstored, np.uint8) if maxstored else None,
                    aligned_empty((maxraw,), np.uint8))

        pm = self._page_map() if any(not p[3] for p in pages) else None

        def start(i: int, slot: tuple) -> tuple:
            req = pool.submit(self._fetch_page, i, slot, pages[i], pm)
            return req, req, None, pages[i][2]

        pipe = Pipeline(start, range(n_pages), make, depth, name=name)
        rep = _Replay(pipe, self._n, self._stream, self.path, self._replays,
                      None if pm is None else pm.guard, None if pm is None else pm.view)
        self._replays.add(rep)
        return rep

    # ------------------------------------------------------------ ending
    def close(self) -> None:
        """Commit (as ``flush()``) and close (an open replay is closed first). Idempotent.

        After a failure the file is closed without a commit: it keeps its last one.
        """
        if self._f.closed:
            return
        self._end_replays()
        try:
            if self._mode != "r" and self._error is None:
                self._flush(False, True)
        finally:
            self._drop_map()
            if self._wb is not None:
                self._wb._drain()
                self._wb._closed = True
                if self._error is not None:         # already raised to the caller
                    for r in self._wb._failed:
                        r.observed()
            self._bufs, self._mvs = [], []
            self._f.close()

    def delete(self) -> None:
        """Remove the file (in-flight writes are waited for, nothing more is written)."""
        self._end_replays()
        self._drop_map()
        if self._wb is not None:
            self._wb._drain()
            self._wb._closed = True
        self._bufs, self._mvs = [], []
        self._f.delete()

    def _end_replays(self) -> None:
        for rep in list(self._replays):
            rep.close()

    @staticmethod
    def remove(name: str, *, backend: str | None = None, dir: str | None = None) -> bool:
        """Delete this rank's record file ``name`` without opening it; True if removed."""
        return ExclusiveFile.remove(name, backend=backend, dir=dir)

    def __enter__(self) -> "RecordFile":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            try:
                self.close()
            except Exception:
                pass

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"mode {self._mode!r}"
        return (f"<RecordFile {self.name!r} {state}: {self._n} records, {self.pages} pages of "
                f"{self._page_size} B, compressor={self.compressor}, "
                f"backend={self._f.backend}, path={self._f.path!r}>")

    def _repr_html_(self) -> str:
        """The notebook view: records, pages, compression, the file underneath."""
        rows = [("records", self._n), ("pages", f"{self.pages} of {self._page_size} B"),
                ("compressor", self.compressor or "none"),
                ("state", "closed" if self.closed else f"open, mode {self._mode!r}")]
        return reprs.table(f"RecordFile {self.name!r}", rows + self._f._html_rows())


class _Copy(RecordFile):
    """A read-only RecordFile over the ExclusiveFile of a pickled one."""

    def __init__(self, state: dict):
        self._pickled = state
        super().__init__(state["name"], "r")

    def _open_file(self, name: str, mode: str, backend: str | None, dir: str | None,
                   size_hint: int | None) -> ExclusiveFile:
        return reopen_exclusive(self._pickled["file"])


def reopen(state: dict) -> RecordFile:
    """Unpickle a RecordFile: the file itself in the process that pickled it while it is
    open, else a read-only copy replaying the last commit (``chemio_py.files.pickling``)."""
    state = check_state(state, "RecordFile")
    log = live(state)
    return log if log is not None else _Copy(state)


def _align(n: int) -> int:
    return -(-n // PAGE_ALIGN) * PAGE_ALIGN


class _Replay:
    """The iterator ``RecordFile.replay()`` returns: records in order; a context manager."""

    def __init__(self, pipe: Pipeline, n_records: int, stream: int, path: str, registry: Any,
                 guard: Any = None, whole: np.ndarray | None = None):
        self._pipe = pipe
        self._gen = iter_records(pipe, n_records, stream, f"record file {path!r}", whole)
        self._registry = registry
        self._guard = guard              # the mapping's SIGBUS guard (None: not mapped)
        self._path = path

    @property
    def stats(self) -> stats.PipelineStats:
        return self._pipe.stats

    @property
    def in_flight(self) -> int:
        return self._pipe.in_flight

    def __iter__(self) -> "_Replay":
        return self

    def __next__(self) -> tuple:
        try:
            rec = next(self._gen)
        except StopIteration:
            self.close()
            self._check_guard()
            raise
        except MetadataError as e:          # zeros where the file shrank read as damage
            self.close()
            try:
                self._check_guard()
            except StorageError as s:
                raise s from e
            raise
        except BaseException:
            self.close()
            raise
        if self._guard is not None and self._guard.poisoned:
            self.close()
            self._check_guard()
        return rec

    def _check_guard(self) -> None:
        """Raise if the mapped file shrank under this replay (its views read zeros there)."""
        if self._guard is not None and self._guard.poisoned:
            raise StorageError(errno.EIO, self._path, op="replay of mapped pages",
                               hint="the file shrank under the replay (truncated by another "
                                    "process?): records handed out since may hold zeros; "
                                    "nothing was changed, rebuild the cache")

    def close(self) -> None:
        """End the replay early: in-flight page reads are cancelled or waited for."""
        self._gen.close()
        self._pipe.close()
        self._registry.discard(self)

    def __enter__(self) -> "_Replay":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        finalizers.close_later(self.close)


MAP_REPLAY = True           # replays hand out views of a mapping for hot uncompressed pages


class _Mapped:
    """A read-only mapping made with ``posix.map_file`` (no descriptor kept open), seen by
    NumPy through ``__array_interface__``: every view of it keeps it alive, and the last one
    to go unmaps it (its SIGBUS guard is unregistered first)."""

    def __init__(self, addr: int, nbytes: int, guard: Any, posix: Any):
        self.addr, self.nbytes, self.guard, self._posix = addr, nbytes, guard, posix
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                    "data": (addr, True), "version": 3}

    def __del__(self) -> None:
        self._posix.guard_unregister(self.guard)
        self._posix.unmap(self.addr, self.nbytes)


class _PageMap:
    """A read-only mapping of a record file for replays, in ``mappings.live_maps`` beside
    the arrays' ``ReadMap`` s and shaped like them (so ``drop_mappings()`` and the
    ``map_cap`` setting cover it). Dropping it only forgets it: the mapping itself goes
    when the last view of it does, and stays guarded against SIGBUS until then."""

    __slots__ = ("addr", "nbytes", "base", "guard", "pins", "dead", "owner", "view")

    def __init__(self, owner: RecordFile, view: np.ndarray, guard: Any):
        self.addr, self.nbytes = int(view.ctypes.data), len(view)
        self.base = None
        self.guard, self.pins, self.dead = guard, 0, False
        self.owner = weakref.ref(owner)
        self.view: np.ndarray | None = view

    @classmethod
    def create(cls, owner: RecordFile, path: str, size: int) -> "_PageMap | None":
        """Map the first ``size`` bytes of ``path`` read-only; None when it cannot be."""
        from chemio_py.backends import posix
        from chemio_py.backends.local import mappings
        if size <= 0 or not posix.mincore_ok() or not posix.sigbus_guard_ok():
            return None
        cap = mappings.map_cap()
        if size > cap:
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            addr = posix.map_file(fd, size)
        finally:
            os.close(fd)
        if addr is None:
            return None
        guard = posix.guard_register(addr, addr + size)
        view = np.asarray(_Mapped(addr, size, guard, posix))       # read-only; its base keeps it
        if not posix.sigbus_guard_arm():
            return None
        pm = cls(owner, view, guard)
        with mappings.maps_lock:
            mappings.make_room(size, cap)
            mappings.live_maps[id(pm)] = pm  # type: ignore[assignment]  # (a ReadMap look-alike)
        return pm

    def page(self, off: int, n: int) -> np.ndarray | None:
        """A read-only view of bytes ``[off, off + n)`` when they are all in the page cache
        and mapped; None otherwise (read them instead)."""
        from chemio_py.backends import posix
        view = self.view
        if view is None or self.guard.poisoned or off + n > self.nbytes or n <= 0:
            return None
        ps = mmap.PAGESIZE
        first, end = off // ps, -(-(off + n) // ps)
        if posix.resident(self.addr, [(first, end)], end - first) is not True:
            return None
        if not posix.sigbus_guard_arm():
            return None
        return view[off:off + n]

    def release(self) -> None:
        """Forget the mapping (``drop_map``); the views handed out keep it mapped."""
        self.view = None
        owner = self.owner()
        if owner is not None and owner._map is self:
            owner._map = None
