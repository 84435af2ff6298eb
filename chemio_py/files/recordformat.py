"""The RecordFile format: header, commit slots, pages, indexes and records, and the bounded
readers of each (``read_index``, ``decode_page``, ``iter_records``), shared by
``RecordFile`` and ``chemio check``.

**File layout (format 2).** A 4096-byte header: the magic ``CIORECv2`` at 0 and two commit
slots at 512 and 1024 (magic ``CIORECSL``, generation, position of the index trailer,
flags (1 = durable), CRC-32 of the slot). Then pages and indexes, in allocation order. An
index is a JSON header and an int64 table of ``offset, stored bytes, raw bytes,
compressed?, checksum of the raw page`` per page, followed by a 32-byte trailer (magic
``CIOREC01``, index offset, index length, CRC-32 of the index, JSON length). The JSON
header names the page checksum (``"checksum"``: ``"crc32c"``, the Castagnoli CRC, computed
by the ``crc32c`` wheel (it releases the GIL) or else ``google-crc32c``, about 8x faster
than ``zlib.crc32``; or ``"crc32"``, zlib's, which
files written before the key existed use); an index naming another algorithm is refused
(``MetadataError``) rather than read unchecked. The reader
takes the newest valid slot; when its index is damaged it falls back to the other slot
(with a warning) unless the newest commit was durable (then the damage is an error).
Format 1 files (no header, page ``i`` at ``i * page_size``, the trailer at the end of the
file, no page checksums) are still replayed; append to them by copying into a new file.

In the stream a record is a 16-byte prefix (magic, number of arrays, header length,
payload length), one descriptor per array (dtype string, shape), then each array's bytes;
every part is padded to 8 bytes so that replayed arrays are aligned views into the page
buffers. Every size read from a file is checked against the file (or the stream its index
describes) before anything is allocated; a page is checked against its CRC before its
records are parsed.
"""
from __future__ import annotations

import math
import operator
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Iterator

import numpy as np

from chemio_py.errors import ArgumentError, CompressorUnavailableError, MetadataError
from chemio_py.runtime import safejson

MiB = 1 << 20
MIN_PAGE = MiB
MAX_PAGE = 1 << 30
DEFAULT_PAGE = 4 * MiB
PAGE_ALIGN = 4096

HEADER = 4096                          # format 2: header before the first page
HMAGIC = b"CIORECv2"
SLOT = struct.Struct("<8sQQQI")        # magic, generation, trailer position, flags, CRC-32
SMAGIC = b"CIORECSL"
SLOT_OFFSETS = (512, 1024)
DURABLE = 1
TRAILER = struct.Struct("<8sQQII")
MAGIC = b"CIOREC01"
_PREFIX = struct.Struct("<HHIQ")
_REC_MAGIC = 0xC10E
FORMAT = "chemio.records"
VERSION = 2
COLUMNS = {1: 4, 2: 5}                 # int64 columns of the page table, per format
_KINDS = "biufcmMSU"
_CODECS = ("zstd", "blosc", "lz4", "zlib", "gzip", "bz2", "lzma")
MAX_INDEX_BYTES = 1 << 30
MAX_HEAD_BYTES = 1 << 16          # the JSON header of an index is a few hundred bytes
ZPAD = memoryview(bytes(8))
_MAX_INTP = int(np.iinfo(np.intp).max)  # NumPy refuses shapes whose nonzero axes pass it


CHECKSUMS = ("crc32c", "crc32")   # page checksum algorithms an index may name
_CRC_STEP = 1 << 20                # google-crc32c holds the GIL on arrays: bound each hold
_CRC32C_CHECK = (b"123456789", 0xE3069283)    # the Castagnoli check value (RFC 3720)


def _icrar_crc32c() -> Callable[[Any], int] | None:
    """The ``crc32c`` wheel's function when it is installed and computes the Castagnoli CRC
    (same values as google-crc32c); it releases the GIL on buffers of 32 KiB and more, so a
    page is checked on the I/O pool while the consumer runs. None otherwise."""
    try:
        import crc32c as icrar
        fn = icrar.crc32c
        if fn(_CRC32C_CHECK[0]) != _CRC32C_CHECK[1]:
            return None
    except Exception:               # absent, or another package of that name
        return None

    def crc32c(data: Any) -> int:
        if isinstance(data, np.ndarray) and not data.flags.c_contiguous:
            data = np.ascontiguousarray(data)
        return int(fn(data))
    return crc32c


def _crc32c_fn() -> Callable[[Any], int] | None:
    """The fastest crc32c here: the ``crc32c`` wheel's (releases the GIL), else
    google-crc32c's (C when built, else its Python), else numcodecs' own; None when none
    is installed."""
    fast = _icrar_crc32c()
    if fast is not None:
        return fast
    try:
        import google_crc32c
    except ImportError:
        try:
            from numcodecs.checksum32 import crc32c_checksum
        except ImportError:
            return None
        return crc32c_checksum
    extend = google_crc32c.extend

    def crc32c(data: Any) -> int:
        # its C code takes bytes and NumPy arrays, not memoryviews (they may be released)
        if isinstance(data, bytes):
            return int(extend(0, data))
        a = np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) \
            else data.reshape(-1).view(np.uint8)
        n = len(a)
        if n <= _CRC_STEP:
            return int(extend(0, a))
        crc = 0
        for o in range(0, n, _CRC_STEP):
            crc = extend(crc, a[o:o + _CRC_STEP])
        return int(crc)
    return crc32c


_crc_fns: dict[str, Callable[[Any], int]] = {"crc32": zlib.crc32}


def default_checksum() -> str:
    """The checksum new record files use: ``"crc32c"`` when the ``crc32c`` wheel or
    google-crc32c's C extension is importable, else ``"crc32"`` (zlib's: C speed
    everywhere, about 8x slower)."""
    if _icrar_crc32c() is not None:
        return "crc32c"
    try:
        import google_crc32c
    except ImportError:
        return "crc32"
    return "crc32c" if google_crc32c.implementation == "c" else "crc32"


def checksum_function(name: str) -> Callable[[Any], int]:
    """``f(buffer) -> int`` computing the page checksum ``name`` (one of ``CHECKSUMS``)."""
    fn = _crc_fns.get(name)
    if fn is None:
        if name not in CHECKSUMS:
            raise ArgumentError(f"checksum {name!r} is not known; use one of {CHECKSUMS} or "
                                f"None (the fastest available)")
        fn = _crc32c_fn()
        if fn is None:
            raise CompressorUnavailableError(
                "record pages checksummed with crc32c need google-crc32c: pip install "
                "google-crc32c (nothing was read or written)")
        _crc_fns[name] = fn
    return fn


class RecoveredWarning(UserWarning):
    """A record file was opened at its previous commit: the newest one is incomplete."""


def pad8(n: int) -> int:
    return (n + 7) & ~7


def make_codec(spec: Any) -> Any:
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


def check_page_size(page_size: Any) -> int:
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


def describe(arrays: tuple) -> tuple[list[np.ndarray], bytes, int]:
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


def _parse(ro: memoryview, base: int, n: int, hl: int, pl: int, where: str = "a record file",
           k: int | None = None) -> tuple:
    """The arrays of the record whose prefix starts at ``base`` of the read-only ``ro``
    (record ``k`` of ``where``, for messages)."""
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
                raise MetadataError(f"{where}: record {k} has array shape {shape}, which is "
                                    f"negative; the file is damaged")
            if math.prod(x for x in shape if x) * dt.itemsize > _MAX_INTP:
                raise MetadataError(f"{where}: record {k} has array shape {shape} of {dt}, "
                                    f"larger than any array can be (more than 2**63 bytes "
                                    f"without its zero axes); the file is damaged or hostile")
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


# ---------------------------------------------------------------- reading an index

@dataclass
class Index:
    """A validated commit of a record file (what ``read_index`` found)."""
    version: int
    page_size: int
    codec: Any
    records: int
    stream: int
    pages: list                     # per page: [offset, stored, raw, compressed, crc (-1: none)]
    ioff: int                       # where the index starts
    end: int                        # where its trailer ends
    generation: int = 0             # format 2: the commit's generation and slot
    slot: int | None = None
    durable: bool = False
    checksum: str = "crc32"         # the page checksum algorithm (format 2)
    max_generation: int = 0         # the highest valid generation seen in the header
    recovered: str | None = None    # set when an older commit had to be used
    notes: list = field(default_factory=list)


def slot_bytes(gen: int, tpos: int, flags: int) -> bytes:
    head = SLOT.pack(SMAGIC, gen, tpos, flags, 0)[:-4]
    return head + struct.pack("<I", zlib.crc32(head))


def read_index(read_at: Callable[[int, int], bytes], size: int, where: str,
               fix: str = "it is damaged or was not closed; delete it and rebuild the cache"
               ) -> Index:
    """The last complete commit of a record file of ``size`` bytes; ``MetadataError`` if none.

    ``read_at(offset, n)`` returns ``n`` bytes of the file; it is only called for ranges
    inside the file. ``where`` names the file in messages.
    """
    if size < 8:
        raise MetadataError(f"{where} is {size} bytes, too short for a record file; {fix}")
    if read_at(0, 8) != HMAGIC:
        if size < TRAILER.size:
            raise MetadataError(f"{where} is {size} bytes, too short for a record index; {fix}")
        return _index_at(read_at, size, size - TRAILER.size, 1, where, fix)
    if size < HEADER:
        raise MetadataError(f"{where} is {size} bytes, shorter than its {HEADER}-byte header: "
                            f"it was never flushed; {fix}")
    slots, notes = [], []
    for j, so in enumerate(SLOT_OFFSETS):
        raw = read_at(so, SLOT.size)
        magic, gen, tpos, flags, crc = SLOT.unpack(raw)
        if magic == SMAGIC and zlib.crc32(raw[:-4]) == crc:
            slots.append((gen, tpos, flags, j))
        elif raw != bytes(SLOT.size):
            notes.append(f"commit slot {j} is not valid (torn or damaged)")
    if not slots:
        raise MetadataError(f"{where} holds no committed record index (no valid commit slot): "
                            f"it was never flushed, or its header is damaged; {fix}")
    slots.sort(reverse=True)
    top = slots[0][0]
    first_error: MetadataError | None = None
    for k, (gen, tpos, flags, j) in enumerate(slots):
        try:
            idx = _index_at(read_at, size, tpos, 2, where, fix)
        except MetadataError as e:
            if k == 0 and flags & DURABLE:
                raise MetadataError(f"{where}: the last durable commit (generation {gen}) is "
                                    f"damaged: {e}") from None
            first_error = first_error or e
            notes.append(f"commit {gen} (slot {j}) is unusable: {e}")
            continue
        idx.generation, idx.slot, idx.durable = gen, j, bool(flags & DURABLE)
        idx.max_generation, idx.notes = top, notes
        if k:
            idx.recovered = (f"{where}: the newest commit (generation {top}) is incomplete or "
                             f"damaged ({first_error}); opened at the previous commit "
                             f"(generation {gen}, {idx.records} records)")
        return idx
    assert first_error is not None          # slots is not empty
    raise first_error


def _index_at(read_at: Callable[[int, int], bytes], size: int, tpos: int, version: int,
              where: str, fix: str) -> Index:
    """The index whose trailer sits at ``tpos``, checked against a file of ``size`` bytes."""
    low = HEADER if version == 2 else 0
    if not low <= tpos <= size - TRAILER.size:
        raise MetadataError(f"{where}: the index trailer at {tpos} lies outside the file of "
                            f"{size} bytes (truncated?); {fix}")
    magic, ioff, ilen, crc, jlen = TRAILER.unpack(read_at(tpos, TRAILER.size))
    if magic != MAGIC:
        raise MetadataError(f"{where} has no record index trailer at {tpos} (found "
                            f"{magic!r}); {fix}")
    if (ioff + ilen != tpos or ioff < low or ilen > MAX_INDEX_BYTES or jlen > ilen
            or jlen > MAX_HEAD_BYTES or (version == 1 and tpos + TRAILER.size != size)):
        raise MetadataError(f"{where}: index at {ioff} of {ilen} bytes does not fit the file "
                            f"size {size}; {fix}")
    blob = read_at(ioff, ilen)
    if zlib.crc32(blob) != crc:
        raise MetadataError(f"{where}: the record index fails its checksum; {fix}")
    head = safejson.load(blob[:jlen], what=f"{where}: the record index header",
                         max_bytes=MAX_HEAD_BYTES, max_depth=8, max_items=1000, hint=fix)
    if not isinstance(head, dict):
        raise MetadataError(f"{where}: the record index header is {type(head).__name__}, "
                            f"not an object; {fix}")
    if head.get("format") != FORMAT or head.get("version") != version:
        raise MetadataError(f"{where}: record index format {head.get('format')!r:.40} version "
                            f"{head.get('version')!r:.20} is not {FORMAT} {version}; {fix}")
    ints = {}
    for k in ("page_size", "records", "stream_bytes", "pages"):
        v = head.get(k)
        if type(v) is not int or v < 0:
            raise MetadataError(f"{where}: index field {k!r} = {v!r:.40} is not an integer "
                                f">= 0; {fix}")
        ints[k] = v
    try:
        ps = check_page_size(ints["page_size"])
    except ArgumentError as e:
        raise MetadataError(f"{where}: {e}; {fix}") from None
    cfg = head.get("compressor")
    if cfg is not None and not isinstance(cfg, dict):
        raise MetadataError(f"{where}: compressor {cfg!r:.80} is not a codec config; {fix}")
    npages, stream, nrec = ints["pages"], ints["stream_bytes"], ints["records"]
    cols = COLUMNS[version]
    if len(blob) - jlen != 8 * cols * npages:
        raise MetadataError(f"{where}: index table holds {len(blob) - jlen} bytes, not "
                            f"{npages} pages of {8 * cols}; {fix}")
    if stream % 8 or -(-stream // ps) != npages or nrec * _PREFIX.size > stream:
        raise MetadataError(f"{where}: {nrec} records in {stream} stream bytes do not match "
                            f"{npages} pages of {ps}; {fix}")
    checksum = head.get("checksum", "crc32")
    if version == 2 and checksum not in CHECKSUMS:
        raise MetadataError(f"{where}: the record index names page checksum {checksum!r:.40}, "
                            f"which this chemio_py does not know (it knows {CHECKSUMS}): the "
                            f"file was written by a newer chemio_py or is damaged; replay it "
                            f"with that version, or {fix}")
    codec = None if cfg is None else make_codec(cfg)
    table = np.frombuffer(blob, "<i8", cols * npages, jlen).reshape(npages, cols)
    pages = []
    for i, row in enumerate(table.tolist()):
        off, stored, raw, flag = row[:4]
        crc = row[4] if cols == 5 else -1
        want = ps if i < npages - 1 else stream - ps * (npages - 1)
        ok = (raw == want and low <= off and off + stored <= ioff and flag in (0, 1)
              and (stored == raw if flag == 0 else (0 < stored < raw and codec is not None))
              and (version == 2 or codec is not None or off == i * ps)
              and (-1 if version == 1 else 0) <= crc < (1 << 32))
        if not ok:
            raise MetadataError(f"{where}: page {i} entry (offset {off}, stored {stored}, "
                                f"raw {raw}, compressed {flag}) is inconsistent with the file "
                                f"({size} bytes, index at {ioff}); {fix}")
        pages.append([off, stored, raw, flag, crc])
    last = -1
    for off, stored, _, _, _ in sorted(pages):
        if off < last:
            raise MetadataError(f"{where}: pages overlap at offset {off}; {fix}")
        last = off + stored
    return Index(version=version, page_size=ps, codec=codec, records=nrec, stream=stream,
                 pages=pages, ioff=ioff, end=tpos + TRAILER.size, checksum=checksum)


def decode_page(codec: Any, entry: list, stored: np.ndarray | None, out: np.ndarray,
                where: str, i: int, checksum: str = "crc32") -> np.ndarray:
    """Page ``i`` (``entry`` of its index) from its stored bytes: decompressed into ``out``
    (when compressed; else ``out`` already holds it) and checked against its checksum
    (the algorithm ``checksum`` the index names, ``Index.checksum``)."""
    _, n_stored, raw, flag, crc = entry
    page = out[:raw]
    if flag:
        assert stored is not None               # a compressed page comes with its bytes
        try:
            codec.decode(stored[:n_stored], out=page)
        except Exception as e:
            raise MetadataError(f"page {i} of {where} does not decompress "
                                f"({type(e).__name__}: {e}); the file is damaged") from None
    if crc >= 0 and checksum_function(checksum)(page) != crc:
        raise MetadataError(f"page {i} of {where} fails its {checksum} checksum (the bytes on "
                            f"disk are not those written: torn or damaged); the file is "
                            f"damaged")
    return page


def iter_records(pages: Iterator, n_records: int, stream: int, where: str,
                 whole: np.ndarray | None = None) -> Generator[tuple, None, None]:
    """The records of a stream of ``stream`` bytes, from ``pages`` yielding ``(key, page)``.

    Records are tuples of read-only arrays, views into the pages (valid until the next
    step). A record that spans pages is gathered into one buffer, reused from record to
    record (grown when a larger one comes: no allocation and page faults per record) --
    unless ``whole`` is given (a read-only mapping of the file, of which pages may be
    views) and the pages it spans lie next to each other in it: then it is a view of
    ``whole`` too. Every prefix is checked against what is left of the stream before
    anything is allocated for a record that spans pages.
    """
    page: np.ndarray | None = None
    mv = memoryview(b"")
    pos = plen = 0
    paddr = 0                           # address of the current page
    left = stream
    spill = np.empty(0, np.uint8)       # where records spanning pages are gathered
    w_lo = w_hi = 0
    if whole is not None:
        w_lo = int(whole.ctypes.data)
        w_hi = w_lo + whole.nbytes

    def advance() -> None:
        nonlocal page, mv, pos, plen, paddr
        try:
            _, page = next(pages)
        except StopIteration:
            raise MetadataError(f"{where} ends inside a record; the file is damaged") from None
        # numpy's stubs make ndarray a Buffer for Python 3.12+ only
        mv = memoryview(page).toreadonly()  # type: ignore[arg-type]  # (read-only views)
        pos, plen = 0, len(page)
        if w_hi:
            paddr = int(page.ctypes.data)

    def span(n: int) -> memoryview:
        """The next ``n`` stream bytes: a view of ``whole`` when the pages holding them are
        next to each other in it, else gathered into the spill buffer."""
        nonlocal pos
        start = paddr + pos
        pieces = []
        o = 0
        adjacent = w_lo <= start and start + n <= w_hi
        while o < n:
            if pos == plen:
                advance()
                adjacent = adjacent and paddr == start + o
            k = min(n - o, plen - pos)
            pieces.append(mv[pos:pos + k])
            pos += k
            o += k
        if adjacent:
            # numpy's stubs make ndarray a Buffer for Python 3.12+ only
            return memoryview(whole)[start - w_lo:start - w_lo + n]  # type: ignore[arg-type]
        out = room(n)
        o = 0
        for piece in pieces:
            out[o:o + len(piece)] = piece
            o += len(piece)
        return out

    def room(n: int) -> memoryview:
        nonlocal spill
        if len(spill) < n:
            spill = np.empty(n, np.uint8)   # (the old one lives on in earlier records' views)
        # numpy's stubs make ndarray a Buffer for Python 3.12+ only
        return memoryview(spill)[:n]  # type: ignore[arg-type]

    def gather(out: memoryview, o: int = 0) -> memoryview:
        """Fill ``out[o:]`` from the stream."""
        nonlocal pos
        n = len(out)
        while o < n:
            if pos == plen:
                advance()
            k = min(n - o, plen - pos)
            out[o:o + k] = mv[pos:pos + k]
            pos += k
            o += k
        return out

    def check(k: int, magic: int, na: int, hl: int, pl: int) -> int:
        if magic != _REC_MAGIC or hl % 8 or pl % 8:
            raise MetadataError(f"{where}: bad prefix of record {k} (magic {magic:#x}, header "
                                f"{hl}, payload {pl}); the file is damaged")
        total = _PREFIX.size + hl + pl
        if total > left or 2 * na > hl:
            raise MetadataError(f"{where}: record {k} claims {total} bytes ({na} arrays, "
                                f"header {hl}, payload {pl}) but the stream holds {left} more; "
                                f"the file is damaged or hostile")
        return total

    try:
        for k in range(n_records):
            if pos == plen:
                advance()
            if plen - pos >= _PREFIX.size:
                magic, na, hl, pl = _PREFIX.unpack_from(mv, pos)
                total = check(k, magic, na, hl, pl)
                if plen - pos >= total:
                    rec = _parse(mv, pos, na, hl, pl, where, k)
                    pos += total
                    left -= total
                    yield rec
                    continue
                buf = span(total) if w_hi and w_lo <= paddr < w_hi else gather(room(total))
            else:
                pre = gather(memoryview(bytearray(_PREFIX.size)))
                magic, na, hl, pl = _PREFIX.unpack_from(pre, 0)
                total = check(k, magic, na, hl, pl)
                buf = room(total)
                buf[:_PREFIX.size] = pre
                gather(buf, _PREFIX.size)
            left -= total
            yield _parse(buf.toreadonly(), 0, na, hl, pl, where, k)
        if left:
            raise MetadataError(f"{where}: {left} stream bytes follow the last of its "
                                f"{n_records} records; the file is damaged")
    finally:
        close = getattr(pages, "close", None)
        if close is not None:
            close()
