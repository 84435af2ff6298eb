"""The Zarr v3 on-disk format, as the ``zarr`` backend reads and writes it.

* ``zarr.json``: read with bounded size, nesting and numbers (``loads_bounded``, through
  ``chemio_py.runtime.safejson``), parsed and checked as untrusted input (``parse``), written
  atomically (``write_meta``). Created
  arrays use the regular chunk grid, the default chunk-key encoding (``c/i/j``), fill value 0
  and the codecs ``bytes`` (little endian) + optional ``zstd``/``blosc``, or
  ``sharding_indexed`` holding inner chunks with those codecs and an index coded ``bytes`` +
  ``crc32c``.
* Codec pipelines with numcodecs (``Pipeline``): one chunk from its padded array to its
  stored bytes and back. Every decoder is bounded before it allocates: a stage never
  produces more than its input can legitimately have held (``grown``), the last exactly
  the chunk's size, so a hostile object cannot inflate (zstd frames are walked block by
  block, gzip is inflated with a length cap, a blosc header must state the right size).
* Shard indexes (``encode_shard``/``parse_index``): little-endian uint64 (offset, nbytes)
  per inner chunk in C order, empty = (2^64-1, 2^64-1), then the crc32c of those bytes.

Anything this module does not understand raises ``MetadataError`` naming it.
"""
from __future__ import annotations

import errno
import json
import math
import os
import stat as _stat
import struct
import sys
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from chemio_py.runtime import safejson
from chemio_py.errors import MetadataError, StorageError

from chemio_py.backends.posix import DIR_FLAGS

META_NAME = "zarr.json"
MAX_META_BYTES = 1 << 20            # a zarr.json larger than this is refused unread
MAX_META_DEPTH = 64                 # nesting of objects and lists in a zarr.json
MAX_NDIM = 32
MAX_NBYTES = 1 << 60                # the array (as chemio_py.arrays.meta)
MAX_OBJECT_BYTES = 1 << 32          # one stored object, decoded (it is held in memory)
MAX_INNER = 1 << 20                 # inner chunks per shard
EMPTY = (1 << 64) - 1               # a shard index entry of an absent inner chunk

MAX_ITEMSIZE = 1 << 20             # one element (as chemio_py.arrays.meta)
_NUMBERS = frozenset(("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                      "uint64", "float16", "float32", "float64", "complex64", "complex128"))
DTYPES = ("bool", "(u)int8-64", "float16/32/64", "complex64/128", "null_terminated_bytes (S<n>)",
          "fixed_length_utf32 (U<n>)", "raw_bytes (V<n>)", "numpy.datetime64",
          "numpy.timedelta64", "structured")
_BLOSC_SHUFFLE = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}
_BLOSC_CNAMES = ("blosclz", "lz4", "lz4hc", "zlib", "zstd", "snappy")
_TOP_KEYS = {"zarr_format", "node_type", "shape", "data_type", "chunk_grid",
             "chunk_key_encoding", "fill_value", "codecs", "attributes",
             "storage_transformers", "dimension_names"}
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def _crc32c_impl():
    try:
        import google_crc32c
        return lambda b: google_crc32c.value(bytes(b) if not isinstance(b, bytes) else b)
    except ImportError:
        pass
    from numcodecs.checksum32 import crc32c_checksum
    if crc32c_checksum is None:
        raise ImportError("no crc32c implementation (pip install google-crc32c)")
    return lambda b: crc32c_checksum(b, 0)


_crc = None


def crc32c(data: Any) -> int:
    """The CRC-32C (Castagnoli) of ``data``."""
    global _crc
    if _crc is None:
        _crc = _crc32c_impl()
    return _crc(data)


# ---------------------------------------------------------------- codecs

def grown(n: int) -> int:
    """The most bytes any supported codec (zstd, blosc, gzip, crc32c) turns ``n`` bytes
    into: a decoder stage may yield at most this from what was once ``n`` bytes."""
    return n + n // 64 + 1024


class _Codec:
    """A bytes-to-bytes codec of a pipeline (compression, checksum)."""

    name = ""
    config: dict

    def encode(self, buf: Any) -> Any:
        raise NotImplementedError

    def decode(self, buf: Any, size: int, exact: bool, out: Any = None) -> Any:
        """Decode ``buf`` into at most ``size`` bytes (exactly ``size`` when ``exact``; then
        ``out``, a writable byte array of ``size`` bytes, is filled when given), refusing
        with ``ValueError`` before allocating more than ``size`` bytes."""
        raise NotImplementedError

    def doc(self) -> dict:
        return {"name": self.name, "configuration": dict(self.config)} if self.config \
            else {"name": self.name}


def _expect(got_lo: int, got_hi: int, size: int, exact: bool) -> None:
    """Refuse a decoded size range [got_lo, got_hi] that cannot meet ``size``."""
    if got_lo > size or (exact and got_hi < size):
        have = f"{got_lo}" if got_lo == got_hi else f"{got_lo} to {got_hi}"
        want = f"{size}" if exact else f"at most {size}"
        raise ValueError(f"its header says it decodes to {have} bytes, expected {want}")


def _target(size: int, out: Any) -> Any:
    return out if out is not None else np.empty(size, np.uint8)


# ---- zstd: frames walked block by block (RFC 8878), so sizes are known before decoding

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_ZSTD_BLOCK_MAX = 1 << 17


def _zstd_frames(mv: memoryview, size: int) -> list:
    """``(start, end, stated size or None, least, most)`` of each zstd frame in ``mv``
    (skippable frames left out): the bytes it decodes to lie in [least, most]. Raises
    ``ValueError`` on a malformed frame or on more blocks than ``size`` bytes justify."""
    frames: list = []
    pos, n = 0, len(mv)
    blocks_left = size // 256 + 256
    while pos < n:
        if n - pos < 8:
            raise ValueError(f"a zstd frame header at byte {pos} is cut short")
        magic = bytes(mv[pos:pos + 4])
        if magic[1:] == b"\x2a\x4d\x18" and magic[0] & 0xF0 == 0x50:     # skippable
            skip = int.from_bytes(mv[pos + 4:pos + 8], "little")
            if pos + 8 + skip > n:
                raise ValueError(f"a skippable zstd frame at byte {pos} runs past the end")
            pos += 8 + skip
            continue
        if magic != _ZSTD_MAGIC:
            raise ValueError(f"no zstd frame at byte {pos} (magic {magic.hex()})")
        start = pos
        fhd = mv[pos + 4]
        fcs_flag, single, checksum, dict_flag = fhd >> 6, (fhd >> 5) & 1, (fhd >> 2) & 1, fhd & 3
        if fhd & 0x08:
            raise ValueError(f"the zstd frame at byte {pos} sets a reserved bit")
        pos += 5
        window = 0
        if not single:
            wd = mv[pos]
            log = 10 + (wd >> 3)
            window = (1 << log) + ((1 << log) >> 3) * (wd & 7)
            pos += 1
        pos += (0, 1, 2, 4)[dict_flag]
        fcs_bytes = (1 if single else 0, 2, 4, 8)[fcs_flag]
        if pos + fcs_bytes > n:
            raise ValueError(f"the zstd frame header at byte {start} is cut short")
        stated = None
        if fcs_bytes:
            stated = int.from_bytes(mv[pos:pos + fcs_bytes], "little") + \
                (256 if fcs_bytes == 2 else 0)
            window = stated
        pos += fcs_bytes
        block_max = min(window, _ZSTD_BLOCK_MAX)
        least = most = 0
        while True:
            if pos + 3 > n:
                raise ValueError(f"the zstd frame at byte {start} ends inside a block header")
            blocks_left -= 1
            if blocks_left < 0:
                raise ValueError(f"more zstd blocks than {size} bytes need")
            head = int.from_bytes(mv[pos:pos + 3], "little")
            last, kind, bsize = head & 1, (head >> 1) & 3, head >> 3
            pos += 3
            if kind == 0:                       # raw
                pos += bsize
                least += bsize
                most += bsize
            elif kind == 1:                     # one byte repeated bsize times
                pos += 1
                least += bsize
                most += bsize
            elif kind == 2:                     # compressed: at most one block
                pos += bsize
                most += block_max
            else:
                raise ValueError(f"the zstd frame at byte {start} has a reserved block type")
            if pos > n:
                raise ValueError(f"the zstd frame at byte {start} is cut short")
            if last:
                break
        pos += 4 if checksum else 0
        if pos > n:
            raise ValueError(f"the zstd frame at byte {start} is cut short")
        if stated is not None:
            if not least <= stated <= most:
                raise ValueError(f"the zstd frame at byte {start} states {stated} bytes but "
                                 f"its blocks hold {least} to {most}")
            least = most = stated
        frames.append((start, pos, stated, least, most))
    return frames


class _Compressor(_Codec):
    """A numcodecs compressor: encodes through it; each subclass bounds its own decoding."""

    def __init__(self, config: dict, codec: Any):
        self.config, self._c = config, codec

    def encode(self, buf: Any) -> Any:
        return self._c.encode(buf)


class _Zstd(_Compressor):
    name = "zstd"

    def decode(self, buf: Any, size: int, exact: bool, out: Any = None) -> Any:
        mv = memoryview(buf).cast("B")
        frames = _zstd_frames(mv, size)
        least = sum(f[3] for f in frames)
        most = sum(f[4] for f in frames)
        _expect(least, most, size, exact)
        if not exact:
            if least != most:
                raise ValueError("a zstd frame without a stated size inside a codec chain")
            size, out = least, None
        dest = _target(size, out)
        at = 0
        for k, (start, end, _stated, lo, hi) in enumerate(frames):
            if lo == hi:
                n = lo
            elif k == len(frames) - 1:
                n = size - at
            else:
                raise ValueError("a zstd frame without a stated size is followed by another")
            if not lo <= n <= hi or at + n > size:
                raise ValueError(f"the zstd frames hold more than {size} bytes")
            if n:   # into exactly n bytes: numcodecs refuses more and (unstated) fewer
                self._c.decode(mv[start:end], out=dest[at:at + n])
            at += n
        if at != size:
            raise ValueError(f"decoded to {at} bytes, expected {size}")
        return dest


class _Blosc(_Compressor):
    name = "blosc"

    def decode(self, buf: Any, size: int, exact: bool, out: Any = None) -> Any:
        mv = memoryview(buf).cast("B")
        if len(mv) < 16:
            raise ValueError(f"{len(mv)} bytes are too few for a blosc header")
        nbytes, blocksize, cbytes = struct.unpack("<III", mv[4:16])
        _expect(nbytes, nbytes, size, exact)
        if cbytes != len(mv):
            raise ValueError(f"its blosc header says {cbytes} stored bytes, the object holds "
                             f"{len(mv)}")
        if blocksize > max(nbytes, 1):
            raise ValueError(f"its blosc header has blocks of {blocksize} bytes for "
                             f"{nbytes} bytes")
        dest = _target(nbytes, out if exact else None)
        if nbytes:
            self._c.decode(mv, out=dest)
        return dest


class _Gzip(_Compressor):
    name = "gzip"

    def decode(self, buf: Any, size: int, exact: bool, out: Any = None) -> Any:
        rest: Any = memoryview(buf).cast("B")
        parts: list = []
        total = 0
        while True:                     # members one after another, as gzip.GzipFile reads
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
            try:
                part = d.decompress(rest, size - total + 1)
            except zlib.error as e:
                raise ValueError(f"gzip: {e}") from None
            total += len(part)
            if total > size:
                raise ValueError(f"it inflates to more than the {size} bytes expected")
            parts.append(part)
            if not d.eof:
                raise ValueError("the gzip stream is cut short")
            rest = d.unused_data
            if not rest.strip(b"\0"):  # zero padding after the last member is allowed
                break
        if exact and total != size:
            raise ValueError(f"decoded to {total} bytes, expected {size}")
        dest = _target(total, out if exact else None)
        at = 0
        for part in parts:
            dest[at:at + len(part)] = np.frombuffer(part, np.uint8)
            at += len(part)
        return dest


class _Crc32c(_Codec):
    name = "crc32c"

    def __init__(self):
        self.config = {}

    def encode(self, buf: Any) -> bytes:
        b = bytes(memoryview(buf).cast("B"))
        return b + struct.pack("<I", crc32c(b))

    def decode(self, buf: Any, size: int, exact: bool, out: Any = None) -> Any:
        mv = memoryview(buf).cast("B")
        if len(mv) < 4:
            raise ValueError("shorter than its crc32c checksum")
        body = mv[:-4]
        _expect(len(body), len(body), size, exact)
        want = struct.unpack("<I", mv[-4:])[0]
        got = crc32c(body)
        if got != want:
            raise ValueError(f"crc32c checksum mismatch (stored {want:#010x}, "
                             f"computed {got:#010x})")
        return body


class Unsupported(MetadataError):
    """A valid Zarr v3 array whose codecs chemio's own pipeline does not implement (it is
    read through zarr-python instead, read-only)."""


def _int(v: Any, lo: int, hi: int, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise MetadataError(f"{what} must be an integer from {lo} to {hi}, got {v!r}")
    return v


def make_codec(doc: Any, itemsize: int, where: str) -> _Codec:
    """A bytes-to-bytes codec from its ``zarr.json`` entry (``MetadataError`` if unknown)."""
    name, conf = _codec_parts(doc, where)
    import numcodecs
    if name == "zstd":
        _only(conf, {"level", "checksum"}, name, where)
        level = _int(conf.get("level", 0), -131072, 22, f"{where}: zstd level")
        checksum = conf.get("checksum", False)
        if not isinstance(checksum, bool):
            raise MetadataError(f"{where}: zstd checksum must be true or false, got {checksum!r}")
        return _Zstd({"level": level, "checksum": checksum},
                     numcodecs.Zstd(level=level, checksum=checksum))
    if name == "blosc":
        _only(conf, {"typesize", "cname", "clevel", "shuffle", "blocksize"}, name, where)
        cname = conf.get("cname", "zstd")
        if cname not in _BLOSC_CNAMES:
            raise MetadataError(f"{where}: blosc cname {cname!r} is not one of {_BLOSC_CNAMES}")
        clevel = _int(conf.get("clevel", 5), 0, 9, f"{where}: blosc clevel")
        shuffle = conf.get("shuffle", "noshuffle")
        if shuffle not in _BLOSC_SHUFFLE:
            raise MetadataError(f"{where}: blosc shuffle {shuffle!r} is not one of "
                                f"{list(_BLOSC_SHUFFLE)}")
        typesize = _int(conf.get("typesize", itemsize), 1, 255, f"{where}: blosc typesize")
        blocksize = _int(conf.get("blocksize", 0), 0, 1 << 31, f"{where}: blosc blocksize")
        c = numcodecs.Blosc(cname=cname, clevel=clevel, shuffle=_BLOSC_SHUFFLE[shuffle],
                            blocksize=blocksize, typesize=typesize)
        return _Blosc({"typesize": typesize, "cname": cname, "clevel": clevel,
                       "shuffle": shuffle, "blocksize": blocksize}, c)
    if name == "gzip":
        _only(conf, {"level"}, name, where)
        level = _int(conf.get("level", 6), 0, 9, f"{where}: gzip level")
        return _Gzip({"level": level}, numcodecs.GZip(level=level))
    if name == "crc32c":
        _only(conf, set(), name, where)
        return _Crc32c()
    raise Unsupported(f"{where}: codec {name!r} is not supported by chemio's zarr backend "
                        f"(it reads bytes, zstd, blosc, gzip, crc32c and sharding_indexed); "
                        f"read this array with zarr-python, or rewrite it with supported codecs")


def _codec_parts(doc: Any, where: str) -> tuple[str, dict]:
    if isinstance(doc, str):
        return doc, {}
    if not isinstance(doc, dict) or not isinstance(doc.get("name"), str):
        raise MetadataError(f"{where}: a codec must be an object with a 'name', got {doc!r:.200}")
    conf = doc.get("configuration", {})
    if not isinstance(conf, dict) or set(doc) - {"name", "configuration", "must_understand"}:
        raise MetadataError(f"{where}: codec {doc['name']!r} has a malformed entry {doc!r:.200}")
    return doc["name"], conf


def _only(conf: dict, keys: set, name: str, where: str) -> None:
    extra = set(conf) - keys
    if extra:
        raise MetadataError(f"{where}: codec {name!r} has unknown settings {sorted(extra)}")


@dataclass
class Pipeline:
    """Array -> bytes (``bytes`` codec with ``endian``) -> bytes-to-bytes ``codecs``. The
    array's dtype has the byte order ``endian`` names (``ZarrMeta.dtype``), so its memory
    is the stored bytes: nothing is ever swapped."""
    endian: str | None = "little"
    codecs: list = field(default_factory=list)

    @property
    def plain(self) -> bool:
        """True when stored bytes are the raw elements (no bytes-to-bytes codec)."""
        return not self.codecs

    def encode(self, arr: np.ndarray) -> Any:
        """Stored bytes of the C-contiguous chunk ``arr``."""
        raw = arr.reshape(-1).view(np.uint8)    # bytes of any dtype (datetime64 has no
        buf: Any = raw                          # buffer format of its own)
        for c in self.codecs:
            buf = c.encode(buf)
        # numpy's stubs make ndarray a Buffer for Python 3.12+ only
        return buf if self.codecs else memoryview(raw)  # type: ignore[arg-type]

    def decode(self, buf: Any, out: np.ndarray) -> np.ndarray:
        """Decode stored bytes ``buf`` into the C-contiguous chunk ``out``; ValueError if
        they do not decode to exactly ``out.nbytes`` bytes. No stage allocates more than
        its output may legitimately hold (``bound``)."""
        n = out.nbytes
        flat = out.reshape(-1).view(np.uint8)
        if not self.codecs:
            mv = memoryview(buf).cast("B")
            if len(mv) != n:
                raise ValueError(f"holds {len(mv)} bytes, expected {n}")
            flat[...] = np.frombuffer(mv, np.uint8)
        else:
            for k in range(len(self.codecs) - 1, -1, -1):
                last = k == 0
                buf = self.codecs[k].decode(buf, self.bound(n, k), last, flat if last else None)
            if buf is not flat:
                got = np.frombuffer(memoryview(buf).cast("B"), np.uint8)
                if got.size != n:
                    raise ValueError(f"decoded to {got.size} bytes, expected {n}")
                flat[...] = got
        return out

    def bound(self, n: int, stages: int | None = None) -> int:
        """The most bytes a chunk of ``n`` bytes can have after the first ``stages`` codecs
        (all of them when None): what is stored, or what a decoding stage may yield."""
        k = len(self.codecs) if stages is None else stages
        for _ in range(k):
            n = grown(n)
        return n

    def docs(self) -> list:
        return [_bytes_doc(self.endian)] + [c.doc() for c in self.codecs]


def _parse_pipeline(docs: Any, itemsize: int, where: str) -> tuple[Pipeline, Any]:
    """(pipeline, the sharding_indexed entry or None) from a ``codecs`` list."""
    if not isinstance(docs, list) or not docs or len(docs) > 16:
        raise MetadataError(f"{where}: codecs must be a non-empty list, got {docs!r:.200}")
    first, conf = _codec_parts(docs[0], where)
    if first == "transpose":
        raise Unsupported(f"{where}: codec 'transpose' is not supported by chemio's zarr "
                          f"backend's own pipeline")
    shard = None
    if first == "sharding_indexed":
        shard = conf
        endian: str | None = "little"
    elif first == "bytes":
        _only(conf, {"endian"}, first, where)
        endian = conf.get("endian")
        if endian not in ("little", "big", None):
            raise MetadataError(f"{where}: bytes endian must be 'little' or 'big', got {endian!r}")
    else:
        if first in ("zstd", "blosc", "gzip", "crc32c"):
            raise MetadataError(f"{where}: the codec list must start with an array-to-bytes "
                                f"codec ('bytes' or 'sharding_indexed'), not {first!r}")
        make_codec(docs[0], itemsize, where)         # raises, naming the codec
    rest = [make_codec(d, itemsize, where) for d in docs[1:]]
    if shard is not None and rest:
        raise Unsupported(f"{where}: codecs after 'sharding_indexed' are not supported")
    return Pipeline(endian, rest), shard


# ---------------------------------------------------------------- metadata

@dataclass
class Shard:
    """How a storage object (shard) holds its inner chunks."""
    inner: tuple
    pipeline: Pipeline
    index_crc: bool = True
    index_at_end: bool = True
    per_axis: tuple = ()             # inner chunks per shard along each axis
    inner_bound: int = 0             # the most bytes one stored inner chunk can have

    @property
    def count(self) -> int:
        return math.prod(self.per_axis)

    @property
    def index_nbytes(self) -> int:
        return 16 * self.count + (4 if self.index_crc else 0)


@dataclass
class ZarrMeta:
    shape: tuple
    dtype: np.dtype
    chunks: tuple                    # the storage object (the zarr chunk grid; the shard)
    pipeline: Pipeline               # of a whole object when unsharded
    shard: Shard | None
    fill: np.ndarray                 # 0-d, dtype
    separator: str = "/"
    v2_keys: bool = False
    attributes: dict = field(default_factory=dict)
    foreign: str | None = None       # why chemio's pipeline cannot: read via zarr-python
    foreign_codecs: str = ""         # the codec names of such an array, for messages

    @property
    def grid(self) -> tuple:
        return tuple(-(-n // c) for n, c in zip(self.shape, self.chunks))

    @property
    def fill_is_zero(self) -> bool:
        return not self.fill.reshape(1).view(np.uint8).any()

    def key(self, index: tuple) -> str:
        """The object's path relative to the array directory."""
        if self.v2_keys:
            return self.separator.join(map(str, index)) if index else "0"
        return self.separator.join(("c",) + tuple(map(str, index)))

    @property
    def stored_bound(self) -> int:
        """The most bytes one stored object of this array can hold (larger is damage):
        its chunk encoded by the worst case of its codecs, or a shard's index plus every
        inner chunk at its worst case, with room for gaps other writers may leave."""
        sh = self.shard
        if sh is None:
            return self.pipeline.bound(math.prod(self.chunks) * self.dtype.itemsize)
        tight = sh.index_nbytes + sh.count * sh.inner_bound
        return tight + tight // 4 + (1 << 20)


def _shape(v: Any, lo: int, what: str) -> tuple:
    if not isinstance(v, list) or len(v) > MAX_NDIM:
        raise MetadataError(f"{what} must be a list of at most {MAX_NDIM} integers, got {v!r:.200}")
    return tuple(_int(x, lo, 1 << 62, f"{what} entry") for x in v)


_SPECIAL = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def _fill_value(v: Any, dt: np.dtype, where: str) -> np.ndarray:
    """The ``fill_value`` as a 0-d array of ``dt`` (``MetadataError`` when it does not fit:
    out of range, a bad ``"0x…"`` bit pattern, the wrong type)."""
    def bad(why: str) -> MetadataError:
        return MetadataError(f"{where}: fill_value {v!r:.80} {why}")

    def real(x: Any, t: np.dtype) -> Any:
        if isinstance(x, str) and x in _SPECIAL and t.kind == "f":
            return _SPECIAL[x]
        if isinstance(x, str) and x.startswith("0x") and t.kind == "f":
            digits = x[2:]
            if len(digits) != 2 * t.itemsize or \
                    any(c not in "0123456789abcdefABCDEF" for c in digits):
                raise bad(f"is not a bit pattern of {t} (\"0x\" and {2 * t.itemsize} hex "
                          f"digits)")
            return np.frombuffer(bytes.fromhex(digits)[::-1], t)[0]
        if t.kind == "b":
            if not isinstance(x, bool):
                raise bad("of a bool array must be true or false")
            return x
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise bad(f"does not fit data type {t}")
        if t.kind in "iu" and (not isinstance(x, int) or not np.iinfo(t).min <= x
                               <= np.iinfo(t).max):
            raise bad(f"does not fit data type {t}")
        if t.kind == "f":
            info = np.finfo(t)
            if not math.isfinite(x) or not -float(info.max) <= float(x) <= float(info.max):
                raise bad(f"is outside the range of {t}")
        return x
    try:
        if dt.kind == "c":
            if not isinstance(v, list) or len(v) != 2:
                raise bad("of a complex array must be [re, im]")
            part = np.dtype(f"f{dt.itemsize // 2}")
            val = complex(real(v[0], part), real(v[1], part))
        else:
            val = real(v, dt)
        return np.array(val, dtype=dt)
    except (OverflowError, ValueError, TypeError) as e:
        if isinstance(e, MetadataError):
            raise
        raise bad(f"does not fit data type {dt} ({e})") from None


def parse(doc: Any, where: str) -> ZarrMeta:
    """A ``zarr.json`` document, checked as untrusted input (``MetadataError``)."""
    if not isinstance(doc, dict):
        raise MetadataError(f"{where} is not a JSON object")
    if doc.get("zarr_format") != 3:
        raise MetadataError(f"{where}: zarr_format is {doc.get('zarr_format')!r}, not 3 "
                            f"(chemio's zarr backend reads Zarr v3 arrays)")
    if doc.get("node_type") != "array":
        raise MetadataError(f"{where}: node_type is {doc.get('node_type')!r}, not 'array' "
                            f"(open an array inside the group)")
    for k in set(doc) - _TOP_KEYS:
        v = doc[k]
        if not (isinstance(v, dict) and v.get("must_understand") is False):
            raise MetadataError(f"{where}: unknown key {k!r} that must be understood")
    if doc.get("storage_transformers", []) != []:
        raise MetadataError(f"{where}: storage transformers are not supported")
    shape = _shape(doc.get("shape"), 0, f"{where}: shape")
    grid = doc.get("chunk_grid")
    if not (isinstance(grid, dict) and grid.get("name") == "regular"
            and isinstance(grid.get("configuration"), dict)):
        raise MetadataError(f"{where}: chunk_grid must be 'regular', got {grid!r:.200}")
    chunks = _shape(grid["configuration"].get("chunk_shape"), 1, f"{where}: chunk_shape")
    if len(chunks) != len(shape):
        raise MetadataError(f"{where}: chunk_shape {chunks} does not match shape {shape}")
    name = doc.get("data_type")
    zmeta: Any = None
    if isinstance(name, str) and name in _NUMBERS:
        # numbers, chemio's common case: checked by chemio alone (strict fill values,
        # bounded codecs below), without importing zarr-python
        dt = np.dtype(name)
        if dt.byteorder != "|":
            dt = dt.newbyteorder(">" if _array_endian(doc.get("codecs")) == "big" else "<")
    else:
        zmeta = _zarr_python_meta(doc, where)   # the spec's checks, by zarr-python
        dt = _dtype_of(zmeta, doc.get("codecs"), where)
    nbytes = math.prod(shape) * dt.itemsize
    if nbytes > MAX_NBYTES:
        raise MetadataError(f"{where}: shape {shape} of {dt} makes {nbytes} bytes, more than "
                            f"the limit {MAX_NBYTES}")
    obj = math.prod(chunks) * dt.itemsize
    if obj > MAX_OBJECT_BYTES:
        raise MetadataError(f"{where}: a chunk of {chunks} holds {obj} bytes, more than the "
                            f"{MAX_OBJECT_BYTES} a storage object may hold here")
    enc = doc.get("chunk_key_encoding", {"name": "default"})
    if not isinstance(enc, dict) or enc.get("name") not in ("default", "v2"):
        raise MetadataError(f"{where}: chunk_key_encoding {enc!r:.200} is not supported")
    econf = enc.get("configuration", {}) or {}
    sep = econf.get("separator", "/" if enc["name"] == "default" else ".") \
        if isinstance(econf, dict) else None
    if sep not in ("/", "."):
        raise MetadataError(f"{where}: chunk key separator {sep!r:.80} is not '/' or '.'")
    fill = _fill_of(doc.get("fill_value"), None if zmeta is None else zmeta.fill_value, dt,
                    where)
    foreign = None
    try:
        pipeline, sconf = _parse_pipeline(doc.get("codecs"), dt.itemsize, f"{where}: codecs")
        shard = None if sconf is None else _parse_shard(sconf, chunks, dt.itemsize, where)
    except Unsupported as e:                    # zarr-python's codec pipeline reads it
        if zmeta is None:
            zmeta = _zarr_python_meta(doc, where)
        _foreign_limits(zmeta.codecs, chunks, where)
        foreign, pipeline, shard = str(e), Pipeline(), None
        codecs = json.dumps(_codec_names(doc.get("codecs")))[:200]
    attrs = doc.get("attributes", {})
    if not isinstance(attrs, dict):
        raise MetadataError(f"{where}: attributes must be an object")
    dims = doc.get("dimension_names")
    if dims is not None and not (isinstance(dims, list) and len(dims) == len(shape)):
        raise MetadataError(f"{where}: dimension_names must list one name per axis")
    return ZarrMeta(shape, dt, chunks, pipeline, shard, fill, sep, enc["name"] == "v2", attrs,
                    foreign, codecs if foreign else "")


def _zarr_python_meta(doc: dict, where: str) -> Any:
    """``doc`` checked by zarr-python's own ``ArrayV3Metadata`` (data type, fill value,
    codecs and their settings, chunk grid and key encoding), any refusal a
    ``MetadataError`` naming ``where``. ``doc`` is already bounded (``loads_bounded``)."""
    import warnings
    from zarr.core.metadata.v3 import ArrayV3Metadata
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # zarr's "no stable spec" notes for S/U/V/M
            return ArrayV3Metadata.from_dict(dict(doc))
    except Exception as e:                      # zarr-python raises many kinds
        raise MetadataError(f"{where}: not a Zarr v3 array zarr-python accepts "
                            f"({type(e).__name__}: {str(e)[:300]}); its data_type is "
                            f"{doc.get('data_type')!r:.100}, its codecs "
                            f"{_codec_names(doc.get('codecs'))}") from None


def _codec_names(codecs: Any, depth: int = 0) -> list:
    """The codec names of a ``codecs`` list (those inside sharding in brackets), for
    messages."""
    out: list = []
    for c in codecs[:16] if isinstance(codecs, list) else ():
        name = c.get("name") if isinstance(c, dict) else c
        out.append(str(name)[:40])
        conf = c.get("configuration") if isinstance(c, dict) else None
        if name == "sharding_indexed" and isinstance(conf, dict) and depth < 4:
            out.append(_codec_names(conf.get("codecs"), depth + 1))
    return out


def _array_endian(codecs: Any) -> str | None:
    """The ``endian`` of the array-to-bytes ``bytes`` codec (inside sharding too), if set."""
    for c in codecs if isinstance(codecs, list) else ():
        if not isinstance(c, dict):
            continue
        conf = c.get("configuration")
        conf = conf if isinstance(conf, dict) else {}
        if c.get("name") == "bytes":
            e = conf.get("endian")
            return e if e in ("little", "big") else None
        if c.get("name") == "sharding_indexed":
            return _array_endian(conf.get("codecs"))
    return None


def _dtype_of(zmeta: Any, codecs: Any, where: str) -> np.dtype:
    """The NumPy dtype of the array, in the byte order its ``bytes`` codec stores (so its
    memory is the stored bytes); fixed-size, at most ``MAX_ITEMSIZE`` bytes."""
    try:
        dt = np.dtype(zmeta.data_type.to_native_dtype())
    except Exception as e:
        raise MetadataError(f"{where}: data_type has no NumPy form ({e})") from None
    if dt.hasobject or dt.kind in "OT" or dt.itemsize == 0:
        raise MetadataError(f"{where}: data_type {dt} has elements of variable size; chemio's "
                            f"zarr backend reads fixed-size data types ({', '.join(DTYPES)})")
    if dt.itemsize > MAX_ITEMSIZE:
        raise MetadataError(f"{where}: data_type {dt} has elements of {dt.itemsize} bytes, "
                            f"more than {MAX_ITEMSIZE}")
    if dt.names is None and dt.byteorder != "|":
        dt = dt.newbyteorder(">" if _array_endian(codecs) == "big" else "<")
    return dt


def _fill_of(v: Any, parsed: Any, dt: np.dtype, where: str) -> np.ndarray:
    """The fill value as a 0-d array of ``dt``: numbers through chemio's own strict check
    (``_fill_value``: range, bit patterns), other types as zarr-python parsed them."""
    if dt.names is None and dt.kind in "biufc":
        native = dt.newbyteorder("=") if dt.byteorder != "|" else dt
        return _fill_value(v, native, where).astype(dt)
    try:
        return np.array(parsed, dtype=dt)
    except (TypeError, ValueError, OverflowError) as e:
        raise MetadataError(f"{where}: fill_value {v!r:.80} does not fit data type {dt} "
                            f"({e})") from None


def _foreign_limits(codecs: Any, chunks: tuple, where: str) -> None:
    """chemio's limits on an array read through zarr-python: at most ``MAX_INNER`` inner
    chunks per shard at every level of sharding."""
    for c in codecs:
        inner = getattr(c, "chunk_shape", None)
        sub = getattr(c, "codecs", None)
        if inner is None or sub is None:
            continue
        inner = tuple(int(i) for i in inner)
        if len(inner) != len(chunks) or any(i < 1 for i in inner):
            raise MetadataError(f"{where}: sharding chunk_shape {inner} does not fit {chunks}")
        n = math.prod(-(-c_ // i) for c_, i in zip(chunks, inner))
        if n > MAX_INNER:
            raise MetadataError(f"{where}: sharding_indexed: {n} inner chunks per shard, more "
                                f"than {MAX_INNER}")
        _foreign_limits(sub, inner, where)


def _parse_shard(conf: dict, chunks: tuple, itemsize: int, where: str) -> Shard:
    w = f"{where}: sharding_indexed"
    _only(conf, {"chunk_shape", "codecs", "index_codecs", "index_location"},
          "sharding_indexed", where)
    inner = _shape(conf.get("chunk_shape"), 1, f"{w} chunk_shape")
    if len(inner) != len(chunks) or any(c % i for c, i in zip(chunks, inner)):
        raise MetadataError(f"{w}: inner chunk_shape {inner} does not divide the shard "
                            f"shape {chunks}")
    per = tuple(c // i for c, i in zip(chunks, inner))
    if math.prod(per) > MAX_INNER:
        raise MetadataError(f"{w}: {math.prod(per)} inner chunks per shard, more than "
                            f"{MAX_INNER}")
    pipe, nested = _parse_pipeline(conf.get("codecs"), itemsize, f"{w} codecs")
    if nested is not None:
        raise Unsupported(f"{w}: nested sharding is not supported")
    idx = conf.get("index_codecs", [{"name": "bytes", "configuration": {"endian": "little"}},
                                    {"name": "crc32c"}])
    names = [_codec_parts(d, f"{w} index_codecs") for d in idx] if isinstance(idx, list) else None
    ok = names is not None and names[:1] == [("bytes", names[0][1])] and \
        names[0][1].get("endian", "little") == "little" and \
        [n for n, _ in names[1:]] in ([], ["crc32c"])
    if not ok:
        raise Unsupported(f"{w}: index_codecs {idx!r:.200} are not supported (bytes little "
                          f"endian, optionally crc32c)")
    loc = conf.get("index_location", "end")
    if loc not in ("end", "start"):
        raise MetadataError(f"{w}: index_location {loc!r} is not 'start' or 'end'")
    assert names is not None                # ok above implies it
    return Shard(inner, pipe, len(names) == 2, loc == "end", per,
                 pipe.bound(math.prod(inner) * itemsize))


def build_doc(shape: tuple, dtype: np.dtype, chunks: tuple, compressor: dict | None,
              inner: tuple | None, attributes: dict | None) -> dict:
    """The ``zarr.json`` of an array chemio creates (``data_type_doc``: the data type, the
    byte order of its ``bytes`` codec and its zero fill value)."""
    dt = np.dtype(dtype)
    data_type, endian, fill = data_type_doc(dt)
    codecs = [_bytes_doc(endian)]
    if compressor is not None:
        codecs.append(compressor_doc(compressor, dt.itemsize))
    if inner is not None:
        codecs = [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": list(inner), "codecs": codecs,
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                             {"name": "crc32c"}],
            "index_location": "end"}}]
    return {"zarr_format": 3, "node_type": "array", "shape": list(shape),
            "data_type": data_type,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": fill, "codecs": codecs,
            "attributes": {} if attributes is None else {"chemio": attributes},
            # xarray needs axis names to open a Zarr v3 array; NumPy-style defaults
            "dimension_names": [f"dim_{k}" for k in range(len(shape))],
            "storage_transformers": []}


def dtype_json(dt: np.dtype) -> Any:
    """``dt`` as JSON: ``dt.str``, or for a structured dtype ``dt.descr`` as lists (the
    form of chemio's metadata, ``chemio_py.arrays.meta.dtype_doc``)."""
    def lists(descr: list) -> list:
        return [[e[0], lists(e[1]) if isinstance(e[1], list) else e[1]]
                + ([list(e[2])] if len(e) > 2 else []) for e in descr]
    return dt.str if dt.names is None else lists(dt.descr)


def _bytes_doc(endian: str | None) -> dict:
    return {"name": "bytes", "configuration": {"endian": endian}} if endian else \
        {"name": "bytes"}


def _zarr_structured(dt: np.dtype) -> bool:
    """True when zarr-python's ``structured`` data type holds ``dt`` exactly: packed
    fields (no padding, no subarrays), every number little-endian, nested alike."""
    if dt.names is None:
        return dt.byteorder in "<|" or (dt.byteorder == "=" and sys.byteorder == "little")
    at = 0
    fields: Any = dt.fields
    for name in dt.names:
        f, off = fields[name][:2]
        if off != at or f.subdtype is not None or not _zarr_structured(f):
            return False
        at += f.itemsize
    return at == dt.itemsize


def data_type_doc(dt: np.dtype) -> tuple[Any, str | None, Any]:
    """(``data_type``, ``bytes`` codec endian or None, ``fill_value``) of a chemio array of
    ``dt``, through zarr-python's data types: numbers, ``S<n>``, ``U<n>``, ``V<n>``,
    datetime64/timedelta64 keep their type and store in ``dt``'s byte order; a structured
    dtype zarr-python's ``structured`` type cannot hold exactly (padding, subarray or
    big-endian fields) is stored as ``raw_bytes`` of its itemsize, its exact dtype kept in
    the chemio attributes (chemio reads it back; zarr-python reads raw records)."""
    if dt.names is None and dt.kind in "biufc":         # numbers: no zarr-python import
        endian = None if dt.byteorder == "|" else \
            {"<": "little", ">": "big", "=": sys.byteorder}[dt.byteorder]
        fill: Any = False if dt.kind == "b" else 0 if dt.kind in "iu" else \
            [0.0, 0.0] if dt.kind == "c" else 0.0
        return dt.newbyteorder("=").name, endian, fill
    import warnings
    from zarr.core.dtype import get_data_type_from_native_dtype
    if dt.hasobject or dt.itemsize == 0 or dt.itemsize > MAX_ITEMSIZE:
        raise MetadataError(f"dtype {dt} cannot be stored in a Zarr v3 array here (fixed-size "
                            f"types of 1 to {MAX_ITEMSIZE} bytes: {', '.join(DTYPES)})")
    endian = None if dt.byteorder == "|" else \
        {"<": "little", ">": "big", "=": sys.byteorder}[dt.byteorder]
    if dt.names is not None and not _zarr_structured(dt):
        zt = np.dtype(f"V{dt.itemsize}")
    else:
        zt = dt.newbyteorder("<") if endian else dt
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            z = get_data_type_from_native_dtype(zt)
            fill = z.to_json_scalar(np.zeros((), zt)[()], zarr_format=3)
            return z.to_json(zarr_format=3), endian, \
                list(fill) if isinstance(fill, tuple) else fill
    except Exception as e:
        raise MetadataError(f"dtype {dt} cannot be stored in a Zarr v3 array here ({e}); "
                            f"supported: {', '.join(DTYPES)}") from None


def compressor_doc(comp: dict, itemsize: int) -> dict:
    """The codec entry of a normalised compressor (``chemio_py.runtime.config``)."""
    if comp["id"] == "zstd":
        return {"name": "zstd", "configuration": {"level": comp["level"], "checksum": False}}
    if comp["id"] == "blosc":
        return {"name": "blosc", "configuration": {
            "typesize": itemsize, "cname": comp["cname"], "clevel": comp["level"],
            "shuffle": comp["shuffle"], "blocksize": 0}}
    raise MetadataError(f"compressor {comp['id']!r} is not supported by the zarr backend")


def compressor_of(meta: ZarrMeta) -> dict | None:
    """The normalised compressor of an array (as ``chemio_py.runtime.config`` spells it), or None;
    ``{"id": name}`` for other codec lists."""
    if meta.foreign is not None:
        return {"id": f"read by zarr-python: {meta.foreign_codecs}"}
    pipe = meta.shard.pipeline if meta.shard else meta.pipeline
    if not pipe.codecs:
        return None
    c = pipe.codecs[0]
    if len(pipe.codecs) == 1 and c.name == "zstd":
        return {"id": "zstd", "level": c.config["level"]}
    if len(pipe.codecs) == 1 and c.name == "blosc":
        return {"id": "blosc", "cname": c.config["cname"], "level": c.config["clevel"],
                "shuffle": c.config["shuffle"]}
    return {"id": "+".join(x.name for x in pipe.codecs)}


# ---------------------------------------------------------------- files

def read_meta(path: str) -> ZarrMeta:
    """Parse ``<path>/zarr.json`` (a regular file, never through a link, at most 1 MiB)."""
    return parse(load_doc(path), os.path.join(path, META_NAME))


def read_meta_at(dir_fd: int, path: str) -> ZarrMeta:
    """``read_meta`` of the array directory open as ``dir_fd`` (``path`` names it)."""
    return parse(load_doc_at(dir_fd, path), os.path.join(path, META_NAME))


def open_dir(path: str) -> int:
    """A descriptor of the array directory ``path`` (the last component never a link);
    ``MetadataError`` when it is missing or not a directory."""
    try:
        return os.open(path, DIR_FLAGS)
    except FileNotFoundError:
        raise MetadataError(f"{os.path.join(path, META_NAME)!r} is missing: {path!r} does "
                            f"not exist, so it is not a Zarr v3 array") from None
    except OSError as e:
        if e.errno in (errno.ENOTDIR, errno.ELOOP):
            try:
                what = "a symbolic link" if _stat.S_ISLNK(os.lstat(path).st_mode) else \
                    "not a directory"
            except OSError:
                what = "not a directory"
            raise MetadataError(f"{path!r} is {what}, so not a Zarr array") from None
        raise StorageError(e.errno, path, None, None, "open the array directory") from e


def load_doc(path: str) -> Any:
    """The JSON document of ``<path>/zarr.json`` (``loads_bounded``), unchecked."""
    fd = open_dir(path)
    try:
        return load_doc_at(fd, path)
    finally:
        os.close(fd)


def load_doc_at(dir_fd: int, path: str) -> Any:
    """``load_doc`` of the array directory open as ``dir_fd`` (``path`` names it)."""
    mpath = os.path.join(path, META_NAME)
    try:
        fd = os.open(META_NAME, _OPEN_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise MetadataError(f"{mpath!r} is missing: {path!r} is not a Zarr v3 array") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise MetadataError(f"{mpath!r} is a symbolic link; refused") from None
        raise StorageError(e.errno, mpath, None, None, "open") from e
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode):
            raise MetadataError(f"Zarr metadata {mpath!r} is {_kind(st.st_mode)}, not a "
                                f"regular file")
        if st.st_size > MAX_META_BYTES:
            raise MetadataError(f"Zarr metadata {mpath!r} has {st.st_size} bytes, more than "
                                f"the {MAX_META_BYTES} a zarr.json may have here")
        raw = os.read(fd, MAX_META_BYTES + 1)
    except OSError as e:
        raise StorageError(e.errno, mpath, None, None, "read") from e
    finally:
        os.close(fd)
    return loads_bounded(raw, mpath)


def _kind(mode: int) -> str:
    for test, what in ((_stat.S_ISDIR, "a directory"), (_stat.S_ISFIFO, "a FIFO"),
                       (_stat.S_ISSOCK, "a socket"), (_stat.S_ISCHR, "a character device"),
                       (_stat.S_ISBLK, "a block device"), (_stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return what
    return "not a regular file"


def loads_bounded(raw: bytes, where: str) -> Any:
    """The JSON document in ``raw``, parsed by ``chemio_py.runtime.safejson`` within its limits
    (size ``MAX_META_BYTES``, nesting ``MAX_META_DEPTH``, bounded integers, finite floats,
    no NaN/Infinity); anything else is a ``MetadataError`` that names ``where`` and what
    is wrong (never advice to overwrite or remove it: it may hold someone's array)."""
    if len(raw) > MAX_META_BYTES:
        raise MetadataError(f"Zarr metadata {where!r} has more than {MAX_META_BYTES} bytes")
    if not raw.strip():
        raise MetadataError(f"Zarr metadata {where!r} is empty")
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff") or (len(raw) > 1 and b"\0" in raw[:4]):
        raise MetadataError(f"Zarr metadata {where!r} is not UTF-8 text (UTF-16?)")
    return safejson.load(raw, what=f"Zarr metadata {where!r}", max_bytes=MAX_META_BYTES,
                         max_depth=MAX_META_DEPTH, error=MetadataError)


def write_meta(path: str, doc: dict, perms: int) -> None:
    """Write ``<path>/zarr.json`` atomically (temporary name, then rename)."""
    data = json.dumps(doc, indent=2, allow_nan=False).encode()
    write_atomic(path, META_NAME, data, perms)


def write_atomic(dirpath: str, name: str, data: Any, perms: int) -> None:
    """Replace ``dirpath/name`` with ``data`` (temporary file in the same directory,
    ``os.replace``): a reader sees the old bytes or the new, never a mix."""
    fd = open_dir(dirpath)
    try:
        write_atomic_at(fd, name, data, perms)
    finally:
        os.close(fd)


def write_atomic_at(dir_fd: int, name: str, data: Any, perms: int,
                    keep_old: bool = False, ordered: bool = True) -> str | None:
    """``write_atomic`` into the directory open as ``dir_fd``: the temporary file is
    created there with ``O_EXCL | O_NOFOLLOW`` and renamed within it, so nothing outside
    that directory is ever written whatever its path now resolves to. ``data`` is one
    buffer or a list of buffers written in order (``pwritev``, no joined copy); a file
    of ``PREALLOCATE_ABOVE`` bytes or more is preallocated first (``fallocate``; skipped
    where the file system refuses, ``ENOSPC`` raised before anything is written).

    ``keep_old``: where ``name`` exists and the kernel can, the new file takes its place by
    an atomic exchange (``renameat2(RENAME_EXCHANGE)``) and the name of the temporary file,
    which now holds the replaced file, is returned: the caller removes it (freeing the old
    file's blocks is most of a replacing rename's cost, and need not delay the writer).
    None when the new file was renamed over ``name`` (absent, or no exchange here).
    ``ordered`` (with ``keep_old``): the new file's write-back is started before it
    replaces an existing ``name`` (``order_before_replace``), as ext4 does by itself for a
    rename over a file, so that a crash leaves the old object or the new one, not an empty
    one (a scratch array, lost in a crash anyway, passes False)."""
    parts = data if isinstance(data, list) else [data]
    views = [memoryview(p).cast("B") for p in parts]
    return write_filled_at(dir_fd, name, perms, sum(len(v) for v in views),
                           lambda fd: pwrite_parts(fd, views, 0), keep_old, ordered)


def write_filled_at(dir_fd: int, name: str, perms: int, nbytes: int, fill: Any,
                    keep_old: bool = False, ordered: bool = True) -> str | None:
    """``write_atomic_at`` of an object of ``nbytes`` that ``fill(fd)`` writes into the
    temporary file (at any offsets, from any threads, before it returns)."""
    fd, tmp = temp_at(dir_fd, name, perms)
    try:
        try:
            if nbytes >= PREALLOCATE_ABOVE:
                preallocate(fd, nbytes)
            fill(fd)
            if keep_old and ordered and not order_before_replace(fd, dir_fd, name):
                keep_old = False                # absent: a plain rename, no exchange tried
        finally:
            os.close(fd)
        return install_at(dir_fd, tmp, name, keep_old)
    except BaseException:
        discard_at(dir_fd, tmp)
        raise


def temp_at(dir_fd: int, name: str, perms: int) -> tuple[int, str]:
    """A new temporary file for object ``name`` in the directory open as ``dir_fd``
    (``O_EXCL | O_NOFOLLOW``): (write descriptor, its name). Put in place with
    ``install_at`` or removed with ``discard_at``."""
    tmp = f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 perms, dir_fd=dir_fd)
    return fd, tmp


def order_before_replace(fd: int, dir_fd: int, name: str) -> bool:
    """Start the write-back of ``fd`` (``start_writeback``) when ``name`` exists in the
    directory open as ``dir_fd``: its blocks are then allocated in the journal transaction
    before the one that exchanges the names (ext4's ``auto_da_alloc`` does this for a
    rename over a file, not for an exchange). Whether ``name`` exists."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    start_writeback(fd)
    return True


def install_at(dir_fd: int, tmp: str, name: str, keep_old: bool) -> str | None:
    """Put the written temporary file ``tmp`` in place of ``name`` atomically (see
    ``write_atomic_at`` for ``keep_old`` and the result)."""
    if keep_old and exchange_at(dir_fd, tmp, name):
        return tmp
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    return None


def discard_at(dir_fd: int, tmp: str) -> None:
    """Remove the temporary file ``tmp`` of a write that failed (quietly)."""
    try:
        os.unlink(tmp, dir_fd=dir_fd)
    except OSError:
        pass


_RENAME_EXCHANGE = 2
_exchange_fn: list = []


def exchange_at(dir_fd: int, a: str, b: str) -> bool:
    """Swap the entries ``a`` and ``b`` of the directory open as ``dir_fd`` atomically
    (Linux ``renameat2(RENAME_EXCHANGE)``): True when done; False when ``b`` is absent or
    this kernel or file system cannot (nothing changed); other failures raise ``OSError``."""
    if not _exchange_fn:
        fn = None
        if sys.platform.startswith("linux"):
            try:
                import ctypes
                fn = ctypes.CDLL(None, use_errno=True).renameat2
                fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                               ctypes.c_uint]
                fn.restype = ctypes.c_int
                _exchange_fn.append((fn, ctypes))
            except (OSError, AttributeError):
                fn = None
        if fn is None:
            _exchange_fn.append((None, None))
    fn, ctypes = _exchange_fn[0]
    if fn is None:
        return False
    if fn(dir_fd, os.fsencode(a), dir_fd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        try:
            mode = os.stat(a, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except OSError:
            return True
        if not _stat.S_ISDIR(mode):
            return True                 # b was a file (or a link): a rename's result
        # b was a directory, which a rename would not replace: swap back, let it refuse
        fn(dir_fd, os.fsencode(a), dir_fd, os.fsencode(b), _RENAME_EXCHANGE)
        return False
    err = ctypes.get_errno()
    if err in (errno.ENOENT, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), a, None, b)


PREALLOCATE_ABOVE = 1 << 20         # objects this large are preallocated before writing
IOV_MAX = 1024                      # buffers one pwritev/preadv takes (Linux UIO_MAXIOV)
_NO_FALLOCATE = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENOTSUP)
_fallocate_fn: list = []


def preallocate(fd: int, n: int) -> bool:
    """Reserve ``n`` bytes for ``fd`` with ``fallocate(2)`` (mode 0: the size becomes
    ``n``): buffered writes into reserved blocks run several times faster than into an
    extending file. False when this file system cannot (nothing changed; never glibc's
    write-a-byte-per-block emulation); ``OSError`` (``ENOSPC``, ``EDQUOT``) when the space
    is not there."""
    if not _fallocate_fn:
        fn = None
        try:
            import ctypes
            fn = ctypes.CDLL(None, use_errno=True).fallocate
            fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            fn.restype = ctypes.c_int
            _fallocate_fn.append((fn, ctypes))
        except (OSError, AttributeError):
            _fallocate_fn.append((None, None))
    fn, ctypes = _fallocate_fn[0]
    if fn is None:
        return False
    if fn(fd, 0, 0, n) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_FALLOCATE:
        return False
    raise OSError(err, os.strerror(err))


_SYNC_FILE_RANGE_WRITE = 2
_sfr_fn: list = []


def start_writeback(fd: int) -> None:
    """Start writing ``fd``'s dirty pages to the device without waiting for them
    (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, Linux); a no-op where unavailable. It
    makes nothing durable by itself: ``fsync`` still does."""
    if not _sfr_fn:
        fn = None
        try:
            import ctypes
            fn = ctypes.CDLL(None, use_errno=True).sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            fn = None
        _sfr_fn.append(fn if sys.platform.startswith("linux") else None)
    fn = _sfr_fn[0]
    if fn is not None:
        fn(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def pwrite_parts(fd: int, views: list, offset: int) -> int:
    """Write the byte views ``views`` in order at ``offset`` of ``fd`` with ``pwritev``
    (at most ``IOV_MAX`` per call, short writes continued); returns the bytes written."""
    pos = offset
    i = 0
    views = [v for v in views if len(v)]
    while i < len(views):
        batch = views[i:i + IOV_MAX]
        want = sum(len(v) for v in batch)
        k = os.pwritev(fd, batch, pos)
        pos += k
        if k == want:
            i += len(batch)
            continue
        if k == 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        for j, v in enumerate(batch):       # a short write: resume inside the batch
            if k < len(v):
                views[i + j] = v[k:]
                i += j
                break
            k -= len(v)
    return pos - offset


# ---------------------------------------------------------------- shard index

def encode_shard(parts: list, shard: Shard) -> bytes | None:
    """A shard's bytes from its encoded inner chunks in C order (None = absent), or None
    when every inner chunk is absent (the shard is not stored)."""
    bufs = shard_buffers(parts, shard)
    return None if bufs is None else b"".join(bufs)


def shard_plan(sizes: list, shard: Shard) -> tuple[list, bytes, int, int] | None:
    """Where the inner chunks of a shard go, given their stored sizes in bytes (C order,
    None = absent), laid out as ``shard_buffers`` does: (file offset of each, None when
    absent; the index bytes; the index's offset; the file size). None when every inner
    chunk is absent (the shard is not stored)."""
    index = np.full((len(sizes), 2), EMPTY, dtype="<u8")
    pos = 0 if shard.index_at_end else shard.index_nbytes
    offsets: list = []
    for k, ln in enumerate(sizes):
        if ln is None:
            offsets.append(None)
            continue
        index[k] = (pos, ln)
        offsets.append(pos)
        pos += ln
    if all(o is None for o in offsets):
        return None
    ib = index.tobytes()
    if shard.index_crc:
        ib += struct.pack("<I", crc32c(ib))
    at = pos if shard.index_at_end else 0
    return offsets, ib, at, pos + len(ib) if shard.index_at_end else pos


def shard_buffers(parts: list, shard: Shard) -> list | None:
    """The buffers of a shard in file order (its encoded inner chunks ``parts`` in C order,
    None = absent, and its index), for ``pwritev`` without a joined copy; None when every
    inner chunk is absent (the shard is not stored)."""
    n = len(parts)
    index = np.full((n, 2), EMPTY, dtype="<u8")
    pos = 0 if shard.index_at_end else shard.index_nbytes
    body = []
    for k, p in enumerate(parts):
        if p is None:
            continue
        mv = memoryview(p).cast("B")
        ln = len(mv)
        index[k] = (pos, ln)
        body.append(mv)
        pos += ln
    if not body:
        return None
    ib = index.tobytes()
    if shard.index_crc:
        ib += struct.pack("<I", crc32c(ib))
    return body + [ib] if shard.index_at_end else [ib] + body


def parse_index(raw: Any, shard: Shard, size: int, where: str) -> np.ndarray:
    """The (offset, nbytes) rows of a shard index read from a file of ``size`` bytes,
    checked: crc32c, entries inside the file and outside the index, both or neither empty."""
    mv = memoryview(raw).cast("B")
    n = shard.count
    if len(mv) != shard.index_nbytes:
        raise MetadataError(f"{where}: the shard has {size} bytes, too few for its index of "
                            f"{shard.index_nbytes} bytes; it was truncated: restore it or "
                            f"rewrite this part of the array")
    if shard.index_crc:
        want = struct.unpack("<I", mv[-4:])[0]
        got = crc32c(mv[:-4])
        if want != got:
            raise MetadataError(f"{where}: the shard index checksum does not match (stored "
                                f"{want:#010x}, computed {got:#010x}): the shard is corrupt; "
                                f"restore it or rewrite this part of the array")
    idx = np.frombuffer(mv[:16 * n], dtype="<u8").reshape(n, 2)
    off, ln = idx[:, 0], idx[:, 1]
    e_off, e_len = off == EMPTY, ln == EMPTY
    if (e_off != e_len).any():
        raise MetadataError(f"{where}: the shard index has half-empty entries; it is corrupt")
    full = ~e_off
    lo, hi = (0, size - shard.index_nbytes) if shard.index_at_end else \
        (shard.index_nbytes, size)
    o, l_ = off[full], ln[full]
    if o.size and ((o < lo) | (o > hi) | (l_ > hi - o)).any():
        k = int(np.flatnonzero(full)[np.flatnonzero((o < lo) | (o > hi) | (l_ > hi - o))[0]])
        raise MetadataError(f"{where}: the shard index entry {k} points to bytes "
                            f"[{int(off[k])}, {int(off[k]) + int(ln[k])}) outside the shard's "
                            f"data [{lo}, {hi}); the shard is corrupt")
    if shard.inner_bound and l_.size and (l_ > shard.inner_bound).any():
        k = int(np.flatnonzero(full)[np.flatnonzero(l_ > shard.inner_bound)[0]])
        raise MetadataError(f"{where}: the shard index entry {k} gives inner chunk {k} "
                            f"{int(ln[k])} bytes, more than any inner chunk of this array "
                            f"can have ({shard.inner_bound}); the shard is corrupt")
    return idx
