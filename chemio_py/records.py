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
``flush()`` / ``close()`` write the page index at the end of the file, so the file can be
reopened (``mode="r"`` or ``"r+"``) and replayed by another run. A record larger than a
page spans several pages. The file is an ``ExclusiveFile`` of this rank: same naming, modes,
scratch lifecycle and backends.

File layout: pages, then the index (a JSON header and an int64 table of
``offset, stored bytes, raw bytes, compressed?`` per page), then a 32-byte trailer
(magic, index offset, index length, CRC-32 of the index, JSON length). In the stream a
record is a 16-byte prefix (magic, number of arrays, header length, payload length), one
descriptor per array (dtype string, shape), then each array's bytes; every part is padded
to 8 bytes so that replayed arrays are aligned views into the page buffers.
"""
from __future__ import annotations

import json
import math
import operator
import struct
import threading
import weakref
import zlib
from typing import Any, Iterator

import numpy as np

from . import requests
from .errors import ArgumentError, ChemIOError, LimitExceededError, MetadataError, ModeError
from .exclusive import ExclusiveFile
from .prefetch import Pipeline, WriteBehind, _quiet_wait, check_depth

MiB = 1 << 20
MIN_PAGE = MiB
MAX_PAGE = 1 << 30
DEFAULT_PAGE = 4 * MiB
PAGE_ALIGN = 4096

_TRAILER = struct.Struct("<8sQQII")
_MAGIC = b"CIOREC01"
_PREFIX = struct.Struct("<HHIQ")
_REC_MAGIC = 0xC10E
_FORMAT = "chemio.records"
_VERSION = 1
_KINDS = "biufcmMSU"
_CODECS = ("zstd", "blosc", "lz4", "zlib", "gzip", "bz2", "lzma")
MAX_INDEX_BYTES = 1 << 30
_ZPAD = memoryview(bytes(8))


class CompressorUnavailableError(ChemIOError, ImportError):
    """The compressor asked for needs numcodecs, which is not installed."""


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def _codec(spec: Any) -> Any:
    """A numcodecs codec for ``"zstd"``, ``"blosc"``, a codec config dict or a codec object."""
    try:
        import numcodecs
    except ImportError:
        raise CompressorUnavailableError(
            f"compressor {spec!r} needs numcodecs: pip install numcodecs, or pass "
            f"compressor=None") from None
    if isinstance(spec, str):
        if spec == "zstd":
            return numcodecs.Zstd(level=1)
        if spec == "blosc":
            return numcodecs.Blosc(cname="zstd", clevel=1, shuffle=numcodecs.Blosc.SHUFFLE)
        raise ArgumentError(f"compressor {spec!r} is not known; use 'zstd', 'blosc', a "
                            f"numcodecs codec object or None")
    if isinstance(spec, dict):
        if spec.get("id") not in _CODECS:
            raise MetadataError(f"compressor {spec.get('id')!r} in the record index is not one of "
                                f"{_CODECS}; the file is damaged or was not written by chemio_py")
        try:
            return numcodecs.get_codec(dict(spec))
        except Exception as e:
            raise MetadataError(f"compressor config {spec!r} in the record index is invalid "
                                f"({e})") from None
    cid = getattr(spec, "codec_id", None)
    if cid not in _CODECS or not hasattr(spec, "get_config"):
        raise ArgumentError(f"compressor {spec!r} is not supported; use one of {_CODECS} "
                            f"(a name or numcodecs codec object) or None")
    return spec


def _check_page_size(page_size: Any) -> int:
    try:
        ps = operator.index(page_size)
    except TypeError:
        raise ArgumentError(f"page_size must be an integer number of bytes, got "
                            f"{type(page_size).__name__}") from None
    if not MIN_PAGE <= ps <= MAX_PAGE or ps % PAGE_ALIGN:
        raise ArgumentError(f"page_size {ps} must be a multiple of {PAGE_ALIGN} between "
                            f"{MIN_PAGE} (1 MiB) and {MAX_PAGE} (1 GiB)")
    return ps


_SHAPES = [struct.Struct(f"<{n}q") for n in range(65)]
_desc_cache: dict[tuple, bytes] = {}


def _describe(arrays: tuple) -> tuple[list[np.ndarray], bytes, int]:
    """Validated contiguous arrays, the record head (prefix + descriptors) and its length."""
    if len(arrays) > 0xFFFF:
        raise ArgumentError(f"a record holds at most 65535 arrays, got {len(arrays)}")
    arrs, parts, payload = [], [], 0
    for i, a in enumerate(arrays):
        if type(a) is not np.ndarray:
            a = np.asarray(a)
        dt = a.dtype
        key = (dt, a.ndim)
        desc = _desc_cache.get(key)
        if desc is None:
            if dt.kind not in _KINDS or dt.itemsize == 0:
                raise ArgumentError(f"array {i} of the record has dtype {dt} ({dt.kind!r}); "
                                    f"records hold numeric, bool, datetime and string arrays only")
            ds = dt.str.encode("ascii")
            desc = struct.pack("<BB", len(ds), a.ndim) + ds
            if len(_desc_cache) < 4096:
                _desc_cache[key] = desc
        if not a.flags.c_contiguous:
            a = np.array(a, order="C")          # (ascontiguousarray would make 0-d 1-d)
        parts.append(desc)
        if a.ndim:
            parts.append(_SHAPES[a.ndim].pack(*a.shape))
        payload += (a.nbytes + 7) & ~7
        arrs.append(a)
    desc = b"".join(parts)
    hl = (len(desc) + 7) & ~7
    head = _PREFIX.pack(_REC_MAGIC, len(arrs), hl, payload) + desc + bytes(hl - len(desc))
    return arrs, head, payload


_dtype_cache: dict[bytes, np.dtype] = {}


def _dtype(code: bytes) -> np.dtype:
    dt = _dtype_cache.get(code)
    if dt is None:
        try:
            dt = np.dtype(code.decode("ascii"))
        except Exception:
            raise MetadataError(f"record dtype {code!r} is not a valid NumPy dtype; the record "
                                f"file is damaged") from None
        if dt.kind not in _KINDS or dt.hasobject or dt.itemsize == 0:
            raise MetadataError(f"record dtype {dt} is not allowed in a record file; the file "
                                f"is damaged or hostile")
        if len(_dtype_cache) < 4096:
            _dtype_cache[code] = dt
    return dt


def _parse(ro: memoryview, base: int, n: int, hl: int, pl: int) -> tuple:
    """The arrays of the record whose prefix starts at ``base`` of the read-only ``ro``."""
    p = base + _PREFIX.size
    head = bytes(ro[p:p + hl])
    d = p + hl
    end = d + pl
    q = 0
    out = []
    for _ in range(n):
        if q + 2 > hl:
            raise MetadataError("record descriptor runs past its header; the file is damaged")
        dl, nd = head[q], head[q + 1]
        r = q + 2 + dl
        if nd > 64 or r + 8 * nd > hl:
            raise MetadataError("record descriptor runs past its header; the file is damaged")
        dt = _dtype(head[q + 2:r])
        if nd:
            shape = _SHAPES[nd].unpack_from(head, r)
            if min(shape) < 0:
                raise MetadataError(f"record shape {shape} is negative; the file is damaged")
            count = math.prod(shape)
        else:
            shape, count = (), 1
        q = r + 8 * nd
        nb = count * dt.itemsize
        if d + nb > end:
            raise MetadataError(f"record array of shape {shape} {dt} needs {nb} bytes but the "
                                f"record holds {end - d}; the file is damaged")
        out.append(np.ndarray(shape, dt, ro, d))
        d += (nb + 7) & ~7
    if d != end:
        raise MetadataError(f"record payload is {pl} bytes but its arrays take "
                            f"{d - (end - pl)}; the file is damaged")
    return tuple(out)


class RecordFile:
    """Variable-size records (tuples of NumPy arrays) appended and replayed in order.

    ``RecordFile(name, mode="w+", *, page_size=4 MiB, compressor=None, depth=2,
    backend=None, dir=None, size_hint=None, max_bytes=None)``

    * ``append(*arrays)`` adds one record; pages of ``page_size`` bytes are written behind
      with ``depth`` writes in flight. ``max_bytes`` bounds the (uncompressed) stream:
      an append past it raises ``LimitExceededError`` and stores nothing.
    * ``replay(depth=2)`` yields each record as a tuple of read-only arrays, reading
      ``depth`` pages ahead; the arrays are valid until the next step (copy to keep).
    * ``flush()`` writes everything and the page index (``durable=True`` also syncs to
      the device); ``close()`` flushes and closes. Reopen with ``mode="r"`` to replay or
      ``"r+"`` to append more; ``page_size`` and ``compressor`` are fixed at creation.
    * ``nbytes``: bytes the file holds once flushed (compare with ``cio.stat(path).free``);
      ``raw_nbytes``: the uncompressed stream; ``len(log)``: the number of records;
      ``RecordFile.record_nbytes(*arrays)``: stream bytes one record takes.

    An error of a write behind surfaces at the next ``append``/``flush``/``close`` and
    leaves the file failed (every later call raises it). Not for concurrent use by
    several threads; do not append while a replay is open.
    """

    def __init__(self, name: str, mode: str = "w+", *, page_size: int | None = None,
                 compressor: Any = None, depth: int = 2, backend: str | None = None,
                 dir: str | None = None, size_hint: int | None = None,
                 max_bytes: int | None = None):
        if mode not in ("r", "r+", "w+", "x+"):
            raise ModeError(f"mode {mode!r} is not one of r, r+, w+, x+ (r: replay an existing "
                            f"file, r+: append to it, w+: create or truncate, x+: create new)")
        self._depth = check_depth(depth)
        new = mode in ("w+", "x+")
        if new:
            self._page_size = _check_page_size(DEFAULT_PAGE if page_size is None else page_size)
            self._codec = None if compressor is None else _codec(compressor)
        elif compressor is not None:
            raise ArgumentError("the compressor of a RecordFile is fixed when it is created; "
                                "pass compressor=None to reopen it")
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
        self._pages: list[list[int] | None] = []   # per page: offset, stored, raw, compressed?
        self._n = 0                  # records
        self._stream = 0             # stream bytes appended
        self._alloc = 0              # compressed mode: end of the page data
        self._page_no = 0            # index of the page being filled
        self._pos = 0                # bytes in the page being filled
        self._bufs: list[np.ndarray] = []
        self._mvs: list[memoryview] = []
        self._buf_req: list[requests.Request | None] = []
        self._cur = 0
        self._dirty = new
        self._flushed_size: int | None = None
        self._error: BaseException | None = None
        self._replays: "weakref.WeakSet[_Replay]" = weakref.WeakSet()
        self._f = ExclusiveFile(name, mode, backend=backend, dir=dir, size_hint=size_hint)
        try:
            if not new:
                self._load_index(page_size)
            self._wb = WriteBehind(self._depth, name=f"records:{name}") if mode != "r" else None
            if mode == "r+" and self._pages:
                self._resume()
        except BaseException:
            self._f.close()
            raise

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
        """Bytes the file holds once flushed: pages (the open one uncompressed) + index.

        Exact after ``flush()``/``close()`` and for an unmodified reopened file; with
        compression and unflushed records it is an upper bound.
        """
        if not self._dirty and self._flushed_size is not None:
            return self._flushed_size
        if self._codec is None:
            data = self._stream
        else:
            with self._lock:      # pages still being compressed count as uncompressed
                done = sum(self._page_size if p is None else p[1]
                           for p in self._pages[:self._page_no])
            data = done + self._pos
        n = self.pages
        return data + len(self._index_head(n)) + 32 * n + _TRAILER.size

    @staticmethod
    def record_nbytes(*arrays: Any) -> int:
        """Bytes one record of these arrays takes in the (uncompressed) stream."""
        _, head, payload = _describe(arrays)
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
        arrs, head, payload = _describe(arrays)
        total = len(head) + payload
        if self._max_bytes is not None and self._stream + total > self._max_bytes:
            raise LimitExceededError(
                f"appending a record of {total} bytes to {self.name!r} would make its stream "
                f"{self._stream + total} bytes, over max_bytes={self._max_bytes}; nothing was "
                f"appended (compute this batch directly, or raise max_bytes)")
        if not self._bufs:
            self._alloc_buffers()
        try:
            self._put(memoryview(head))
            for a in arrs:
                if a.nbytes:
                    self._put(memoryview(a).cast("B"))
                    pad = _pad8(a.nbytes) - a.nbytes
                    if pad:
                        self._put(_ZPAD[:pad])
        except BaseException as e:
            self._error = e
            raise
        self._n += 1
        self._stream += total
        self._dirty = True

    def _alloc_buffers(self) -> None:
        from . import aligned_empty
        self._bufs = [aligned_empty((self._page_size,), np.uint8) for _ in range(self._depth + 1)]
        self._mvs = [memoryview(b) for b in self._bufs]
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

    def _write_page(self) -> requests.Request:
        """Queue the page being filled (first ``_pos`` bytes) for writing behind."""
        i, raw = self._page_no, self._pos
        view = self._bufs[self._cur][:raw]
        if i == len(self._pages):
            self._pages.append(None)
        if self._codec is None:
            off = i * self._page_size
            self._pages[i] = [off, raw, raw, 0]
            req = self._wb.submit(self._f.awrite, off, view)
        else:
            req = self._wb.submit(requests.submit, self._compress_write, i, view, nbytes=raw)
        self._buf_req[self._cur] = req
        return req

    def _next_buffer(self) -> None:
        self._page_no += 1
        self._pos = 0
        self._cur = (self._cur + 1) % len(self._bufs)
        prev = self._buf_req[self._cur]
        if prev is not None and not prev.done():
            _quiet_wait(prev)       # its error, if any, surfaces through the WriteBehind

    def _compress_write(self, i: int, view: np.ndarray) -> int:
        """On the I/O pool: compress page ``i``, place it, write it."""
        raw = len(view)
        enc = self._codec.encode(view.view(np.uint64) if raw % 8 == 0 else view)
        data, flag = (memoryview(enc), 1) if len(enc) < raw else (memoryview(view), 0)
        with self._lock:
            old = self._pages[i]
            if old is not None and old[1] >= len(data):
                off = old[0]                  # a rewritten page that still fits: in place
            else:
                off = self._alloc
                self._alloc += len(data)
            self._pages[i] = [off, len(data), raw, flag]
        self._f.write(off, data)
        return len(data)

    def flush(self, durable: bool = False) -> None:
        """Write every appended record and the page index; ``durable`` also syncs the device."""
        self._check_open()
        if self._mode == "r":
            return
        try:
            if self._pos and self._dirty:
                self._write_page()          # the open page, partly filled (kept in memory)
            self._wb.flush()
            if self._dirty:
                self._write_index()
                self._dirty = False
            if durable:
                self._f.flush()
        except BaseException as e:
            if self._error is None:
                self._error = e
            raise

    def _data_end(self) -> int:
        if self._codec is None:
            return self._stream
        return self._alloc

    def _index_head(self, n_pages: int) -> bytes:
        return json.dumps({"format": _FORMAT, "version": _VERSION, "page_size": self._page_size,
                           "compressor": None if self._codec is None else self._codec.get_config(),
                           "records": self._n, "stream_bytes": self._stream,
                           "pages": n_pages}, sort_keys=True).encode()

    def _write_index(self) -> None:
        pages = self._pages[:self.pages]
        table = np.array(pages, dtype="<i8").reshape(len(pages), 4)
        head = self._index_head(len(pages))
        blob = head + table.tobytes()
        end = self._data_end()
        trailer = _TRAILER.pack(_MAGIC, end, len(blob), zlib.crc32(blob), len(head))
        self._f.write(end, blob + trailer)
        total = end + len(blob) + len(trailer)
        if self._f.size > total:
            self._f.truncate(total)
        self._flushed_size = total

    # ------------------------------------------------------------ reopening
    def _load_index(self, page_size: Any) -> None:
        f = self._f
        size = f.size
        where = f"record file {f.path!r}"
        fix = "it is damaged or was not closed; delete it and rebuild the cache"
        if size < _TRAILER.size:
            raise MetadataError(f"{where} is {size} bytes, too short for a record index; {fix}")
        magic, ioff, ilen, crc, jlen = _TRAILER.unpack(f.read_bytes(size - _TRAILER.size,
                                                                    _TRAILER.size))
        if magic != _MAGIC:
            raise MetadataError(f"{where} has no record index trailer (found {magic!r}); {fix}")
        if ioff + ilen + _TRAILER.size != size or ilen > MAX_INDEX_BYTES or jlen > ilen:
            raise MetadataError(f"{where}: index at {ioff} of {ilen} bytes does not fit the file "
                                f"size {size}; {fix}")
        blob = f.read_bytes(ioff, ilen)
        if zlib.crc32(blob) != crc:
            raise MetadataError(f"{where}: the record index fails its checksum; {fix}")
        try:
            head = json.loads(blob[:jlen].decode())
        except (UnicodeDecodeError, ValueError):
            raise MetadataError(f"{where}: the record index header is not JSON; {fix}") from None
        if not isinstance(head, dict):
            raise MetadataError(f"{where}: the record index header is {type(head).__name__}, "
                                f"not an object; {fix}")
        if head.get("format") != _FORMAT or head.get("version") != _VERSION:
            raise MetadataError(f"{where}: record index format {head.get('format')!r} version "
                                f"{head.get('version')!r} is not {_FORMAT} {_VERSION}; {fix}")
        ints = {}
        for k in ("page_size", "records", "stream_bytes", "pages"):
            v = head.get(k)
            if type(v) is not int or v < 0:
                raise MetadataError(f"{where}: index field {k!r} = {v!r} is not an integer "
                                    f">= 0; {fix}")
            ints[k] = v
        try:
            ps = _check_page_size(ints["page_size"])
        except ArgumentError as e:
            raise MetadataError(f"{where}: {e}; {fix}") from None
        if page_size is not None and page_size != ps:
            raise ArgumentError(f"{where} has page_size {ps}, not {page_size}; the page size is "
                                f"fixed when the file is created (pass page_size=None)")
        cfg = head.get("compressor")
        if cfg is not None and not isinstance(cfg, dict):
            raise MetadataError(f"{where}: compressor {cfg!r} is not a codec config; {fix}")
        codec = None if cfg is None else _codec(cfg)
        npages, stream = ints["pages"], ints["stream_bytes"]
        if (len(blob) - jlen) != 32 * npages:
            raise MetadataError(f"{where}: index table holds {(len(blob) - jlen)} bytes, "
                                f"not {npages} pages of 32; {fix}")
        table = np.frombuffer(blob, "<i8", 4 * npages, jlen).reshape(npages, 4)
        if stream % 8 or -(-stream // ps) != npages or ints["records"] * _PREFIX.size > stream:
            raise MetadataError(f"{where}: {ints['records']} records in {stream} stream bytes "
                                f"do not match {npages} pages of {ps}; {fix}")
        pages = []
        for i, (off, stored, raw, flag) in enumerate(table.tolist()):
            want = ps if i < npages - 1 else stream - ps * (npages - 1)
            ok = (raw == want and 0 <= off and off + stored <= ioff and flag in (0, 1)
                  and (stored == raw if flag == 0 else (0 < stored < raw and codec is not None))
                  and (codec is not None or off == i * ps))
            if not ok:
                raise MetadataError(f"{where}: page {i} entry (offset {off}, stored {stored}, "
                                    f"raw {raw}, compressed {flag}) is inconsistent; {fix}")
            pages.append([off, stored, raw, flag])
        self._page_size, self._codec = ps, codec
        self._pages, self._n, self._stream = pages, ints["records"], stream
        self._alloc = ioff
        self._page_no, self._pos = npages, 0
        self._flushed_size = size

    def _resume(self) -> None:
        """Mode r+: continue filling a partly filled last page."""
        last = self._pages[-1]
        if last[2] == self._page_size:
            return
        self._alloc_buffers()
        self._page_no = len(self._pages) - 1
        self._pos = last[2]
        self._read_page(self._page_no, (np.empty(self._page_size, np.uint8), self._bufs[0]))

    # ------------------------------------------------------------ replay
    def _read_page(self, i: int, slot: tuple, entry: list | None = None) -> np.ndarray:
        """Blocking (on the I/O pool in a replay): page ``i`` into ``slot``; returns its bytes."""
        off, stored, raw, flag = self._pages[i] if entry is None else entry
        comp, page = slot
        out = page[:raw]
        if not flag:
            self._f.read(off, out)
            return out
        self._f.read(off, comp[:stored])
        try:
            self._codec.decode(comp[:stored], out=out)
        except Exception as e:
            raise MetadataError(f"page {i} of record file {self.path!r} does not decompress "
                                f"({type(e).__name__}: {e}); the file is damaged") from None
        return out

    def replay(self, depth: int = 2) -> "_Replay":
        """Iterate over the records in order, ``depth`` pages read ahead (flushes first).

        Yields tuples of read-only arrays, valid until the next step. Use it in a ``for``
        loop or a ``with`` block; ``close()`` ends it early.
        """
        self._check_open()
        depth = check_depth(depth)
        if self._mode != "r" and self._dirty:
            self.flush()
        n_pages = self.pages
        pages = [list(p) for p in self._pages[:n_pages]]
        ps = self._page_size
        f = self._f
        name = f"replay:{self.name}"
        if self._codec is None:
            from . import aligned_empty

            def read_into(i: int, buf: np.ndarray) -> requests.Request:
                off, _, raw, _ = pages[i]
                return f.aread(off, buf[:raw])

            pipe = Pipeline(lambda i, b: _start_async(read_into, i, b, pages), range(n_pages),
                            lambda: aligned_empty((ps,), np.uint8), depth, name=name)
        else:
            maxstored = max((p[1] for p in pages), default=0)

            def make() -> tuple:
                return (np.empty(maxstored, np.uint8), np.empty(ps, np.uint8))

            def start(i: int, slot: tuple) -> tuple:
                req = requests.submit(self._read_page, i, slot, pages[i])
                return req, req, None, pages[i][1]

            pipe = Pipeline(start, range(n_pages), make, depth, name=name)
        rep = _Replay(pipe, self._n, self.path, self._replays)
        self._replays.add(rep)
        return rep

    # ------------------------------------------------------------ ending
    def close(self) -> None:
        """Flush (writing the index) and close (an open replay is closed first). Idempotent."""
        if self._f.closed:
            return
        self._end_replays()
        try:
            if self._mode != "r" and self._error is None:
                self.flush()
        finally:
            if self._wb is not None:
                self._wb._drain()
                self._wb._closed = True
            self._bufs, self._mvs = [], []
            self._f.close()

    def delete(self) -> None:
        """Remove the file (in-flight writes are waited for, nothing more is written)."""
        self._end_replays()
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
                f"{self._page_size} B, compressor={self.compressor}>")


def _start_async(read_into: Any, i: int, buf: np.ndarray, pages: list) -> tuple:
    return read_into(i, buf), None, None, pages[i][2]


class _Replay:
    """The iterator ``RecordFile.replay()`` returns: records in order; a context manager."""

    def __init__(self, pipe: Pipeline, n_records: int, path: str, registry: Any):
        self._pipe = pipe
        self._gen = self._records(pipe, n_records, path)
        self._registry = registry

    @property
    def stats(self):
        return self._pipe.stats

    @property
    def in_flight(self) -> int:
        return self._pipe.in_flight

    def __iter__(self) -> "_Replay":
        return self

    def __next__(self) -> tuple:
        try:
            return next(self._gen)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """End the replay early: in-flight page reads are cancelled or waited for."""
        self._gen.close()
        self._pipe.close()
        self._registry.discard(self)

    def __enter__(self) -> "_Replay":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    @staticmethod
    def _records(pipe: Pipeline, n_records: int, path: str) -> Iterator[tuple]:
        page: np.ndarray | None = None
        mv = memoryview(b"")
        pos = plen = 0

        def advance() -> None:
            nonlocal page, mv, pos, plen
            try:
                _, page = next(pipe)
            except StopIteration:
                raise MetadataError(f"record file {path!r} ends inside a record; the file is "
                                    f"damaged") from None
            mv = memoryview(page).toreadonly()      # replayed arrays are read-only views
            pos, plen = 0, len(page)

        def gather(n: int) -> bytearray:
            nonlocal pos
            out = bytearray(n)
            o = 0
            while o < n:
                if pos == plen:
                    advance()
                k = min(n - o, plen - pos)
                out[o:o + k] = mv[pos:pos + k]
                pos += k
                o += k
            return out

        def check(magic: int, hl: int, pl: int) -> int:
            if magic != _REC_MAGIC or hl % 8 or pl % 8:
                raise MetadataError(f"record file {path!r}: bad record prefix (magic {magic:#x}, "
                                    f"header {hl}, payload {pl}); the file is damaged")
            return _PREFIX.size + hl + pl

        try:
            for _ in range(n_records):
                if pos == plen:
                    advance()
                if plen - pos >= _PREFIX.size:
                    magic, na, hl, pl = _PREFIX.unpack_from(mv, pos)
                    total = check(magic, hl, pl)
                    if plen - pos >= total:
                        rec = _parse(mv, pos, na, hl, pl)
                        pos += total
                        yield rec
                        continue
                    buf = gather(total)
                else:
                    pre = gather(_PREFIX.size)
                    magic, na, hl, pl = _PREFIX.unpack_from(pre, 0)
                    total = check(magic, hl, pl)
                    buf = pre + gather(total - _PREFIX.size)
                yield _parse(memoryview(buf).toreadonly(), 0, na, hl, pl)
        finally:
            pipe.close()
