"""The Zarr v3 on-disk format, as the ``zarr`` backend reads and writes it.

* ``zarr.json``: parsed and checked as untrusted input (``parse``), written atomically
  (``write_meta``). Created arrays use the regular chunk grid, the default chunk-key
  encoding (``c/i/j``), fill value 0 and the codecs ``bytes`` (little endian) + optional
  ``zstd``/``blosc``, or ``sharding_indexed`` holding inner chunks with those codecs and an
  index coded ``bytes`` + ``crc32c``.
* Codec pipelines with numcodecs (``Pipeline``): one chunk from its padded array to its
  stored bytes and back; the decoded size is checked, so a hostile chunk cannot inflate.
* Shard indexes (``encode_shard``/``read_index``): little-endian uint64 (offset, nbytes)
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
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from chemio_py.errors import MetadataError, StorageError
from chemio_py.ownfiles import write_all

META_NAME = "zarr.json"
MAX_META_BYTES = 1 << 20            # a zarr.json larger than this is refused unread
MAX_NDIM = 32
MAX_NBYTES = 1 << 60                # the array (as chemio_py.meta)
MAX_OBJECT_BYTES = 1 << 32          # one stored object, decoded (it is held in memory)
MAX_INNER = 1 << 20                 # inner chunks per shard
EMPTY = (1 << 64) - 1               # a shard index entry of an absent inner chunk

DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float32", "float64", "complex64", "complex128")
_BLOSC_SHUFFLE = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}
_BLOSC_CNAMES = ("blosclz", "lz4", "lz4hc", "zlib", "zstd", "snappy")
_TOP_KEYS = {"zarr_format", "node_type", "shape", "data_type", "chunk_grid",
             "chunk_key_encoding", "fill_value", "codecs", "attributes",
             "storage_transformers", "dimension_names"}


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

class _Codec:
    """A bytes-to-bytes codec of a pipeline (compression, checksum)."""

    name = ""
    config: dict

    def encode(self, buf: Any) -> Any:
        raise NotImplementedError

    def decode(self, buf: Any, nbytes: int | None, out: Any = None) -> Any:
        """Decode ``buf``; with ``nbytes`` the result must have that length (``out`` of that
        length is filled when the codec can check the size first)."""
        raise NotImplementedError

    def doc(self) -> dict:
        return {"name": self.name, "configuration": dict(self.config)} if self.config \
            else {"name": self.name}


def _zstd_content_size(buf: Any) -> int | None:
    """The decoded size a zstd frame header states, or None when it states none."""
    mv = memoryview(buf).cast("B")
    if len(mv) < 6 or bytes(mv[:4]) != b"\x28\xb5\x2f\xfd":
        return None
    fhd = mv[4]
    fcs_flag, single = fhd >> 6, (fhd >> 5) & 1
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3]
    size = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if size == 0 or len(mv) < pos + size:
        return None
    v = int.from_bytes(mv[pos:pos + size], "little")
    return v + 256 if size == 2 else v


def _blosc_content_size(buf: Any) -> int | None:
    """The decoded size a blosc header states (bytes 4-8, little endian)."""
    mv = memoryview(buf).cast("B")
    return int.from_bytes(mv[4:8], "little") if len(mv) >= 16 else None


class _Numcodec(_Codec):
    def __init__(self, name: str, config: dict, codec: Any, size_of: Any = None):
        self.name, self.config, self._c, self._size_of = name, config, codec, size_of

    def encode(self, buf: Any) -> Any:
        return self._c.encode(buf)

    def decode(self, buf: Any, nbytes: int | None, out: Any = None) -> Any:
        if nbytes is not None and out is not None and self._size_of is not None:
            try:
                stated = self._size_of(buf)
            except Exception:
                stated = None
            if stated == nbytes:
                self._c.decode(buf, out=out)
                return out
        got = self._c.decode(buf)
        if nbytes is not None and memoryview(got).nbytes != nbytes:
            raise ValueError(f"decoded to {memoryview(got).nbytes} bytes, expected {nbytes}")
        return got


class _Crc32c(_Codec):
    name = "crc32c"

    def __init__(self):
        self.config = {}

    def encode(self, buf: Any) -> bytes:
        b = bytes(memoryview(buf).cast("B"))
        return b + struct.pack("<I", crc32c(b))

    def decode(self, buf: Any, nbytes: int | None, out: Any = None) -> Any:
        mv = memoryview(buf).cast("B")
        if len(mv) < 4:
            raise ValueError("shorter than its crc32c checksum")
        body = mv[:-4]
        want = struct.unpack("<I", mv[-4:])[0]
        got = crc32c(body)
        if got != want:
            raise ValueError(f"crc32c checksum mismatch (stored {want:#010x}, "
                             f"computed {got:#010x})")
        if nbytes is not None and len(body) != nbytes:
            raise ValueError(f"holds {len(body)} bytes, expected {nbytes}")
        return body


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
        return _Numcodec(name, {"level": level, "checksum": checksum},
                         numcodecs.Zstd(level=level, checksum=checksum), _zstd_content_size)
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
        return _Numcodec(name, {"typesize": typesize, "cname": cname, "clevel": clevel,
                                "shuffle": shuffle, "blocksize": blocksize}, c,
                         _blosc_content_size)
    if name == "gzip":
        _only(conf, {"level"}, name, where)
        level = _int(conf.get("level", 6), 0, 9, f"{where}: gzip level")
        return _Numcodec(name, {"level": level}, numcodecs.GZip(level=level))
    if name == "crc32c":
        _only(conf, set(), name, where)
        return _Crc32c()
    raise MetadataError(f"{where}: codec {name!r} is not supported by chemio's zarr backend "
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
    """Array -> bytes (``bytes`` codec with ``endian``) -> bytes-to-bytes ``codecs``."""
    endian: str = "little"
    codecs: list = field(default_factory=list)

    @property
    def plain(self) -> bool:
        """True when stored bytes are the raw little-endian elements."""
        return not self.codecs and (self.endian == "little")

    def encode(self, arr: np.ndarray) -> Any:
        """Stored bytes of the C-contiguous chunk ``arr``."""
        if self.endian == "big" and arr.dtype.itemsize > 1:
            arr = arr.byteswap()
        buf: Any = arr
        for c in self.codecs:
            buf = c.encode(buf)
        # numpy's stubs make ndarray a Buffer for Python 3.12+ only
        return buf if self.codecs else memoryview(arr).cast("B")  # type: ignore[arg-type]

    def decode(self, buf: Any, out: np.ndarray) -> np.ndarray:
        """Decode stored bytes ``buf`` into the C-contiguous chunk ``out``; ValueError if
        they do not decode to exactly ``out.nbytes`` bytes."""
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
                buf = self.codecs[k].decode(buf, n if last else None, flat if last else None)
            if buf is not flat:
                got = np.frombuffer(memoryview(buf).cast("B"), np.uint8)
                if got.size != n:
                    raise ValueError(f"decoded to {got.size} bytes, expected {n}")
                flat[...] = got
        if self.endian == "big" and out.dtype.itemsize > 1:
            out.byteswap(inplace=True)
        return out

    def docs(self) -> list:
        return [{"name": "bytes", "configuration": {"endian": self.endian}}] + \
            [c.doc() for c in self.codecs]


def _parse_pipeline(docs: Any, itemsize: int, where: str) -> tuple[Pipeline, Any]:
    """(pipeline, the sharding_indexed entry or None) from a ``codecs`` list."""
    if not isinstance(docs, list) or not docs or len(docs) > 16:
        raise MetadataError(f"{where}: codecs must be a non-empty list, got {docs!r:.200}")
    first, conf = _codec_parts(docs[0], where)
    if first == "transpose":
        raise MetadataError(f"{where}: codec 'transpose' is not supported by chemio's zarr "
                            f"backend; read this array with zarr-python")
    shard = None
    if first == "sharding_indexed":
        shard = conf
        endian = "little"
    elif first == "bytes":
        _only(conf, {"endian"}, first, where)
        endian = conf.get("endian", "little")
        if endian not in ("little", "big"):
            raise MetadataError(f"{where}: bytes endian must be 'little' or 'big', got {endian!r}")
    else:
        if first in ("zstd", "blosc", "gzip", "crc32c"):
            raise MetadataError(f"{where}: the codec list must start with an array-to-bytes "
                                f"codec ('bytes' or 'sharding_indexed'), not {first!r}")
        make_codec(docs[0], itemsize, where)         # raises, naming the codec
    rest = [make_codec(d, itemsize, where) for d in docs[1:]]
    if shard is not None and rest:
        raise MetadataError(f"{where}: codecs after 'sharding_indexed' are not supported")
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


def _shape(v: Any, lo: int, what: str) -> tuple:
    if not isinstance(v, list) or len(v) > MAX_NDIM:
        raise MetadataError(f"{what} must be a list of at most {MAX_NDIM} integers, got {v!r:.200}")
    return tuple(_int(x, lo, 1 << 62, f"{what} entry") for x in v)


_SPECIAL = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def _fill_value(v: Any, dt: np.dtype, where: str) -> np.ndarray:
    def real(x: Any, t: np.dtype) -> Any:
        if isinstance(x, str) and x in _SPECIAL and t.kind == "f":
            return _SPECIAL[x]
        if isinstance(x, str) and x.startswith("0x") and t.kind == "f":
            raw = bytes.fromhex(x[2:])
            if len(raw) != t.itemsize:
                raise MetadataError(f"{where}: fill_value {x!r} has the wrong length for {t}")
            return np.frombuffer(raw[::-1], t)[0]
        if t.kind == "b":
            if not isinstance(x, bool):
                raise MetadataError(f"{where}: fill_value of a bool array must be true/false")
            return x
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise MetadataError(f"{where}: fill_value {x!r:.80} does not fit data type {t}")
        if t.kind in "iu" and (not isinstance(x, int) or not np.iinfo(t).min <= x
                               <= np.iinfo(t).max):
            raise MetadataError(f"{where}: fill_value {x!r} does not fit data type {t}")
        return x
    if dt.kind == "c":
        if not isinstance(v, list) or len(v) != 2:
            raise MetadataError(f"{where}: fill_value of a complex array must be [re, im]")
        part = np.dtype(f"f{dt.itemsize // 2}")
        val = complex(real(v[0], part), real(v[1], part))
    else:
        val = real(v, dt)
    return np.array(val, dtype=dt)


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
    name = doc.get("data_type")
    if name not in DTYPES:
        raise MetadataError(f"{where}: data_type {name!r:.80} is not supported (one of "
                            f"{', '.join(DTYPES)})")
    dt = np.dtype(name)
    shape = _shape(doc.get("shape"), 0, f"{where}: shape")
    nbytes = math.prod(shape) * dt.itemsize
    if nbytes > MAX_NBYTES:
        raise MetadataError(f"{where}: shape {shape} of {name} makes {nbytes} bytes, more than "
                            f"the limit {MAX_NBYTES}")
    grid = doc.get("chunk_grid")
    if not (isinstance(grid, dict) and grid.get("name") == "regular"
            and isinstance(grid.get("configuration"), dict)):
        raise MetadataError(f"{where}: chunk_grid must be 'regular', got {grid!r:.200}")
    chunks = _shape(grid["configuration"].get("chunk_shape"), 1, f"{where}: chunk_shape")
    if len(chunks) != len(shape):
        raise MetadataError(f"{where}: chunk_shape {chunks} does not match shape {shape}")
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
    fill = _fill_value(doc.get("fill_value"), dt, where)
    pipeline, sconf = _parse_pipeline(doc.get("codecs"), dt.itemsize, f"{where}: codecs")
    shard = None if sconf is None else _parse_shard(sconf, chunks, dt.itemsize, where)
    attrs = doc.get("attributes", {})
    if not isinstance(attrs, dict):
        raise MetadataError(f"{where}: attributes must be an object")
    dims = doc.get("dimension_names")
    if dims is not None and not (isinstance(dims, list) and len(dims) == len(shape)):
        raise MetadataError(f"{where}: dimension_names must list one name per axis")
    return ZarrMeta(shape, dt, chunks, pipeline, shard, fill, sep, enc["name"] == "v2", attrs)


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
        raise MetadataError(f"{w}: nested sharding is not supported")
    idx = conf.get("index_codecs", [{"name": "bytes", "configuration": {"endian": "little"}},
                                    {"name": "crc32c"}])
    names = [_codec_parts(d, f"{w} index_codecs") for d in idx] if isinstance(idx, list) else None
    ok = names is not None and names[:1] == [("bytes", names[0][1])] and \
        names[0][1].get("endian", "little") == "little" and \
        [n for n, _ in names[1:]] in ([], ["crc32c"])
    if not ok:
        raise MetadataError(f"{w}: index_codecs {idx!r:.200} are not supported (bytes little "
                            f"endian, optionally crc32c)")
    loc = conf.get("index_location", "end")
    if loc not in ("end", "start"):
        raise MetadataError(f"{w}: index_location {loc!r} is not 'start' or 'end'")
    assert names is not None                # ok above implies it
    return Shard(inner, pipe, len(names) == 2, loc == "end", per)


def build_doc(shape: tuple, dtype: np.dtype, chunks: tuple, compressor: dict | None,
              inner: tuple | None, attributes: dict | None) -> dict:
    """The ``zarr.json`` of an array chemio creates."""
    dt = np.dtype(dtype)
    if dt.name not in DTYPES:
        raise MetadataError(f"dtype {dt} cannot be stored as Zarr v3 here (one of {DTYPES})")
    codecs = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if compressor is not None:
        codecs.append(compressor_doc(compressor, dt.itemsize))
    if inner is not None:
        codecs = [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": list(inner), "codecs": codecs,
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                             {"name": "crc32c"}],
            "index_location": "end"}}]
    fill: Any = False if dt.kind == "b" else [0.0, 0.0] if dt.kind == "c" else \
        0.0 if dt.kind == "f" else 0
    return {"zarr_format": 3, "node_type": "array", "shape": list(shape),
            "data_type": dt.name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": fill, "codecs": codecs,
            "attributes": {} if attributes is None else {"chemio": attributes},
            # xarray needs axis names to open a Zarr v3 array; NumPy-style defaults
            "dimension_names": [f"dim_{k}" for k in range(len(shape))],
            "storage_transformers": []}


def compressor_doc(comp: dict, itemsize: int) -> dict:
    """The codec entry of a normalised compressor (``chemio_py.config``)."""
    if comp["id"] == "zstd":
        return {"name": "zstd", "configuration": {"level": comp["level"], "checksum": False}}
    if comp["id"] == "blosc":
        return {"name": "blosc", "configuration": {
            "typesize": itemsize, "cname": comp["cname"], "clevel": comp["level"],
            "shuffle": comp["shuffle"], "blocksize": 0}}
    raise MetadataError(f"compressor {comp['id']!r} is not supported by the zarr backend")


def compressor_of(meta: ZarrMeta) -> dict | None:
    """The normalised compressor of an array (as ``chemio_py.config`` spells it), or None;
    ``{"id": name}`` for other codec lists."""
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


def load_doc(path: str) -> Any:
    mpath = os.path.join(path, META_NAME)
    try:
        st = os.lstat(path)
        if not _stat.S_ISDIR(st.st_mode):
            raise MetadataError(f"{path!r} is not a directory, so not a Zarr array")
        fd = os.open(mpath, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise MetadataError(f"{mpath!r} is missing: {path!r} is not a Zarr v3 array") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise MetadataError(f"{mpath!r} is a symbolic link; refused") from None
        raise StorageError(e.errno, mpath, None, None, "open") from e
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode):
            raise MetadataError(f"{mpath!r} is not a regular file")
        if st.st_size > MAX_META_BYTES:
            raise MetadataError(f"{mpath!r} has {st.st_size} bytes, more than the "
                                f"{MAX_META_BYTES} a zarr.json may have here")
        raw = os.read(fd, MAX_META_BYTES + 1)
    finally:
        os.close(fd)
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise MetadataError(f"{mpath!r} is not valid JSON ({e}); restore it or recreate "
                            f"the array") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def write_meta(path: str, doc: dict, perms: int) -> None:
    """Write ``<path>/zarr.json`` atomically (temporary name, then rename)."""
    data = json.dumps(doc, indent=2).encode()
    write_atomic(path, META_NAME, data, perms)


def write_atomic(dirpath: str, name: str, data: Any, perms: int) -> None:
    """Replace ``dirpath/name`` with ``data`` (temporary file in the same directory,
    ``os.replace``): a reader sees the old bytes or the new, never a mix."""
    tmp = os.path.join(dirpath, f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    target = os.path.join(dirpath, name)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 perms)
    try:
        try:
            write_all(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# ---------------------------------------------------------------- shard index

def encode_shard(parts: list, shard: Shard) -> bytes | None:
    """A shard's bytes from its encoded inner chunks in C order (None = absent), or None
    when every inner chunk is absent (the shard is not stored)."""
    n = len(parts)
    index = np.full((n, 2), EMPTY, dtype="<u8")
    pos = 0 if shard.index_at_end else shard.index_nbytes
    body = []
    for k, p in enumerate(parts):
        if p is None:
            continue
        ln = memoryview(p).nbytes
        index[k] = (pos, ln)
        body.append(p)
        pos += ln
    if not body:
        return None
    ib = index.tobytes()
    if shard.index_crc:
        ib += struct.pack("<I", crc32c(ib))
    chunks = body + [ib] if shard.index_at_end else [ib] + body
    return b"".join(chunks)


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
    return idx
