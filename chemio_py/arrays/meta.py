"""Disk Resident Array metadata: the JSON document beside the data, its checks and its writing.

One document per array (``<data file>.json``)::

    {"format": 1, "kind": "chemio_py.DiskArray", "name": "t2", "shape": [800, 800],
     "dtype": "<f8", "chunks": [400, 800], "order": "C", "layout": "grid",
     "byte_order": "little", "nbytes": 5120000, "backend": "local", "data": "t2.dra",
     "persistent": true, "uuid": "…", "created": {"time": …, "host": …, "ranks": 4, …}}

An array created with ``checksum=True`` has ``"format": 2`` and ``"checksum": "crc32"``
(per-chunk CRCs in the sidecar ``<data file>.crc``, see ``chemio_py.arrays.diskarray``): a
chemio_py that predates checksums refuses it ("written by a newer chemio_py") instead of
writing to it without updating the CRCs. Arrays without checksums keep format 1, so the
documents of old and new chemio_py are the same and both read each other's.

A metadata file is untrusted input (it may be corrupt, truncated, or written by someone
hostile): ``load`` reads at most ``MAX_BYTES``, parses with ``safejson`` (no document nested
deeper than 64 levels, no integer of more than 30 digits), rejects NaN/Infinity, non-integer or
negative sizes, sizes whose product passes ``MAX_NBYTES``, dtypes outside the whitelist,
and data file names that are not plain names. Every failure is a ``MetadataError`` that
names the file, the key and what was found. ``write_atomic`` writes a temp file, fsyncs it,
renames it over the target and fsyncs the directory, so a reader sees the old document or
the new one, never half of one.
"""
from __future__ import annotations

import json
import math
import operator
import os
import re
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from chemio_py.errors import ArgumentError, MetadataError
from chemio_py.runtime import ownfiles, safejson
from chemio_py.scratch import jobs

FORMAT = 1                     # arrays without checksums (every array before issue 27)
FORMAT_CHECKSUM = 2            # arrays with per-chunk checksums: older readers refuse them
FORMATS = (FORMAT, FORMAT_CHECKSUM)
CHECKSUMS = ("crc32",)         # the algorithms a "checksum" key may name
KIND = "chemio_py.DiskArray"
MAX_BYTES = 1 << 20            # a metadata document is a few hundred bytes
MAX_NDIM = 32
MAX_NBYTES = 1 << 60           # 1 EiB: far above any file system, far below int64 overflow
_PLAIN = re.compile(r"^[A-Za-z0-9._+-]{1,255}$")
_BACKEND = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

# The supported element types (native byte order is what we write; the other order is
# recognised so that the error can say what it is).
DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float32", "float64", "complex64", "complex128")
_ALLOWED: dict[str, np.dtype] = {}
for _n in DTYPES:
    _d = np.dtype(_n)
    for _v in (_d.newbyteorder("<"), _d.newbyteorder(">")):
        _ALLOWED[_v.str] = _v
    _ALLOWED[_n] = _d


def check_dtype(dtype: Any, where: str = "dtype") -> np.dtype:
    """``dtype`` as a native NumPy dtype if it is supported, else ``ArgumentError``."""
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError) as e:
        raise ArgumentError(f"{where} {dtype!r} is not a NumPy dtype ({e}); use one of "
                            f"{', '.join(DTYPES)}") from None
    if dt.name not in DTYPES or dt.fields is not None or dt.subdtype is not None:
        raise ArgumentError(f"{where} {dt!r} is not supported by DiskArray; use one of "
                            f"{', '.join(DTYPES)}")
    return dt.newbyteorder("=") if dt.byteorder not in ("=", "|") else dt


def check_shape(shape: Any, where: str = "shape") -> tuple[int, ...]:
    """``shape`` as a tuple of Python ints >= 0 (1..32 of them), else ``ArgumentError``."""
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        items = list(shape)
    except TypeError:
        raise ArgumentError(f"{where} must be a tuple of ints, got {type(shape).__name__} "
                            f"{shape!r}") from None
    if not 1 <= len(items) <= MAX_NDIM:
        raise ArgumentError(f"{where} must have 1 to {MAX_NDIM} dimensions, got {len(items)}")
    out = []
    for n in items:
        if isinstance(n, bool):
            raise ArgumentError(f"{where} {tuple(items)!r} holds a bool; sizes are ints")
        try:
            n = operator.index(n)
        except TypeError:
            raise ArgumentError(f"{where} {tuple(items)!r} holds {n!r}, which is not an "
                                f"int") from None
        if n < 0:
            raise ArgumentError(f"{where} {tuple(items)!r} holds a negative size {n}")
        out.append(int(n))
    return tuple(out)


@dataclass(frozen=True)
class Meta:
    """The validated content of a metadata document."""
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: tuple[int, ...]
    backend: str
    data: str
    persistent: bool
    uuid: str
    created: dict = field(default_factory=dict)
    format: int = FORMAT
    layout: str = "grid"        # the store's on-disk format (raw chunk grid, zarr3, ...)
    checksum: str | None = None  # "crc32": per-chunk CRCs in the sidecar (format 2)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def to_doc(self) -> dict:
        return {
            "format": self.format, "kind": KIND, "name": self.name,
            "shape": list(self.shape), "dtype": self.dtype.str, "chunks": list(self.chunks),
            "order": "C", "layout": self.layout, "byte_order": sys.byteorder,
            "nbytes": self.nbytes, "backend": self.backend, "data": self.data,
            "persistent": self.persistent, "uuid": self.uuid, "created": dict(self.created),
        } | ({"checksum": self.checksum} if self.checksum else {})


def creation_info(ranks: int) -> dict:
    """Who made an array and when (informational; never trusted)."""
    from chemio_py._version import __version__
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": socket.gethostname(),
            "pid": os.getpid(), "ranks": ranks, "by": f"chemio_py {__version__}",
            "python": sys.version.split()[0], "numpy": np.__version__}


# ---------------------------------------------------------------- validation

def _bad(src: str, what: str, hint: str = "") -> MetadataError:
    msg = f"metadata {src}: {what}"
    if hint:
        msg += f"; {hint}"
    return MetadataError(msg)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_list(doc: dict, key: str, src: str, lo: int) -> tuple[int, ...]:
    v = doc.get(key)
    if not isinstance(v, list):
        raise _bad(src, f"{key!r} must be a list of ints, found {type(v).__name__} {v!r:.80}")
    if not 1 <= len(v) <= MAX_NDIM:
        raise _bad(src, f"{key!r} must have 1 to {MAX_NDIM} entries, found {len(v)}")
    for n in v:
        if not _int(n):
            raise _bad(src, f"{key!r} holds {n!r:.40}, which is not an int")
        if n < lo or n > MAX_NBYTES:
            raise _bad(src, f"{key!r} holds {n}, outside [{lo}, {MAX_NBYTES}]")
    return tuple(v)


def validate(doc: Any, src: str = "<document>") -> Meta:
    """Check an untrusted metadata document; return it as ``Meta`` or raise ``MetadataError``."""
    if not isinstance(doc, dict):
        raise _bad(src, f"expected a JSON object, found {type(doc).__name__}")
    fmt: Any = doc.get("format")
    if not _int(fmt):
        raise _bad(src, f"'format' must be an int version, found {fmt!r:.40}",
                   "is this a chemio_py DiskArray?")
    if fmt not in FORMATS:
        hint = ("written by a newer chemio_py; upgrade chemio_py to read it"
                if fmt > max(FORMATS) else "not a format this chemio_py knows")
        raise _bad(src, f"format version {fmt} (this chemio_py reads "
                        f"{' and '.join(map(str, FORMATS))})", hint)
    checksum = doc.get("checksum")
    if fmt == FORMAT_CHECKSUM:
        if checksum not in CHECKSUMS:
            raise _bad(src, f"format {fmt} needs 'checksum' to be one of {list(CHECKSUMS)}, "
                            f"found {checksum!r:.40}", "written by a newer chemio_py (upgrade "
                            "chemio_py to read it) or damaged")
    elif "checksum" in doc:
        raise _bad(src, f"'checksum' {checksum!r:.40} in a format {fmt} document (checksummed "
                        f"arrays are format {FORMAT_CHECKSUM})")
    if doc.get("kind", KIND) != KIND:
        raise _bad(src, f"'kind' is {doc.get('kind')!r:.60}, expected {KIND!r}")
    if doc.get("order", "C") != "C":
        raise _bad(src, f"'order' is {doc.get('order')!r:.40}; only 'C' is supported")
    layout = doc.get("layout", "grid")          # which store format: its store checks it
    if not isinstance(layout, str) or not _BACKEND.match(layout):
        raise _bad(src, f"'layout' {layout!r:.60} is not a format name")
    shape = _int_list(doc, "shape", src, 0)
    chunks = _int_list(doc, "chunks", src, 1)
    if len(chunks) != len(shape):
        raise _bad(src, f"'chunks' {list(chunks)} has {len(chunks)} entries but 'shape' "
                        f"{list(shape)} has {len(shape)}")
    for n, c in zip(shape, chunks):
        if c > max(n, 1):
            raise _bad(src, f"chunk size {c} exceeds its dimension {n} "
                            f"(chunks {list(chunks)}, shape {list(shape)})")
    dstr = doc.get("dtype")
    if not isinstance(dstr, str) or dstr not in _ALLOWED:
        raise _bad(src, f"'dtype' {dstr!r:.60} is not one of the supported types",
                   f"supported: {', '.join(DTYPES)}")
    dtype = _ALLOWED[dstr]
    order = doc.get("byte_order", sys.byteorder)
    if order not in ("little", "big"):
        raise _bad(src, f"'byte_order' is {order!r:.40}, expected 'little' or 'big'")
    if dtype.byteorder in "<>" and {"<": "little", ">": "big"}[dtype.byteorder] != order:
        raise _bad(src, f"'dtype' {dstr!r} contradicts 'byte_order' {order!r}")
    if dtype.itemsize > 1 and order != sys.byteorder:
        raise _bad(src, f"the data is {order}-endian but this machine is {sys.byteorder}-endian",
                   "convert it on a machine of its byte order (to_hdf5) first")
    dtype = dtype.newbyteorder("=") if dtype.byteorder in "<>" else dtype
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > MAX_NBYTES:
        raise _bad(src, f"shape {list(shape)} of {dtype} makes {nbytes} bytes, more than the "
                        f"limit {MAX_NBYTES}")
    if "nbytes" in doc and doc["nbytes"] != nbytes:
        raise _bad(src, f"'nbytes' is {doc['nbytes']!r:.40} but shape and dtype give {nbytes}")
    name = doc.get("name")
    if not isinstance(name, str) or not _PLAIN.match(name) or ".." in name:
        raise _bad(src, f"'name' {name!r:.60} is not a plain name")
    data = doc.get("data")
    if not isinstance(data, str) or not _PLAIN.match(data) or ".." in data:
        raise _bad(src, f"'data' {data!r:.60} is not a plain file name",
                   "the data file must sit beside the metadata")
    backend = doc.get("backend")
    if not isinstance(backend, str) or not _BACKEND.match(backend):
        raise _bad(src, f"'backend' {backend!r:.60} is not a backend name")
    persistent = doc.get("persistent", True)
    if not isinstance(persistent, bool):
        raise _bad(src, f"'persistent' must be true or false, found {persistent!r:.40}")
    uuid = doc.get("uuid", "")
    if not isinstance(uuid, str) or len(uuid) > 64:
        raise _bad(src, f"'uuid' {uuid!r:.60} is not a short string")
    created = doc.get("created", {})
    if not isinstance(created, dict):
        created = {}
    return Meta(name=name, shape=shape, dtype=dtype, chunks=chunks, backend=backend,
                data=data, persistent=persistent, uuid=uuid, created=created, format=fmt,
                layout=layout, checksum=checksum)


def from_description(desc: Any, path: str, backend: str, layout: str) -> Meta:
    """The ``Meta`` of an array whose backend keeps its metadata inside the object
    (``backends.SelfDescribing.describe``): the store's shape, dtype and chunks, with the
    chemio document it was created with (its ``attributes``) when there is one. A document
    that contradicts the store, or an array outside what DiskArray supports, is a
    ``MetadataError``."""
    src = repr(path)
    if not isinstance(desc, dict):
        raise _bad(src, f"the backend described it as {type(desc).__name__}, not a mapping")
    attrs = desc.get("attributes")
    doc = dict(attrs) if isinstance(attrs, dict) and attrs.get("kind") == KIND else {}
    base = os.path.basename(path.rstrip(os.sep)) or "array"
    stem = re.sub(r"[^A-Za-z0-9._+-]", "_", base.rsplit(".", 1)[0] or base)[:200] or "array"
    dtype = desc.get("dtype")
    try:
        dtype = np.dtype(dtype).str if dtype is not None else dtype
    except TypeError:
        pass
    found = {"shape": _listed(desc.get("shape")), "chunks": _listed(desc.get("chunks")),
             "dtype": dtype}
    for key, value in found.items():
        if key in doc and doc[key] != value:
            raise _bad(src, f"its chemio attributes say {key} {doc[key]!r:.60} but the array "
                            f"has {value!r:.60}", "the object was rewritten by another tool; "
                            "its own description wins: remove the stale 'chemio' attributes")
    doc.update(found)
    doc.setdefault("format", FORMAT)
    doc.setdefault("name", stem.replace("..", "_"))
    doc.setdefault("persistent", True)
    doc.pop("nbytes", None)
    doc.update(backend=backend, layout=layout, data=_plain_name(base))
    return validate(doc, src)


def _listed(v: Any) -> Any:
    return list(v) if isinstance(v, (tuple, list)) else v


def _plain_name(base: str) -> str:
    """A name the ``data`` key accepts (the object's own name is the path; this is a label)."""
    if _PLAIN.match(base) and ".." not in base:
        return base
    return re.sub(r"[^A-Za-z0-9._+-]", "_", base).replace("..", "_")[:255] or "array"


def loads(text: bytes | str, src: str = "<document>") -> Meta:
    """Parse (``safejson``: size, nesting and number limits) and validate a metadata
    document; every failure is a ``MetadataError`` naming ``src``."""
    doc = safejson.load(text, what=f"metadata {src}", max_bytes=MAX_BYTES,
                        hint="the metadata file is damaged; restore it from a copy")
    return validate(doc, src)


def load(path: str) -> Meta:
    """Read and validate the metadata file at ``path``."""
    try:
        text = ownfiles.read_small(path, MAX_BYTES)
    except FileNotFoundError:
        raise MetadataError(f"no DiskArray metadata at {path!r}: the file does not exist; "
                            f"check the path (a DiskArray is opened by its data file or by "
                            f"its .json metadata file)") from None
    except ownfiles.NotARegularFile as e:
        raise MetadataError(f"DiskArray metadata {path!r} {e.strerror}; chemio writes its "
                            f"metadata as a regular file: remove what is there or open "
                            f"the array by its real path") from None
    except ValueError:
        raise MetadataError(f"{path!r} is too large (over {MAX_BYTES} bytes) for DiskArray "
                            f"metadata; it is not a file chemio wrote") from None
    except OSError as e:
        raise MetadataError(f"cannot read DiskArray metadata {path!r}: {e}") from None
    return loads(text, repr(path))


def dumps(meta: Meta) -> bytes:
    return (json.dumps(meta.to_doc(), indent=1, allow_nan=False) + "\n").encode()


def write_atomic(path: str, payload: bytes, mode: int = 0o600) -> None:
    """Write ``payload`` to ``path`` all-or-nothing: temp file, fsync, rename, fsync dir.

    The temp file's name is this call's own (``jobs.temp_path``: pid, namespace, thread,
    random); temp files of ``path`` whose writers are gone are removed first."""
    d = os.path.dirname(os.path.abspath(path))
    jobs.remove_stale_temps(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for attempt in range(8):
        tmp = jobs.temp_path(path)
        try:
            fd = os.open(tmp, flags, mode)
            break
        except FileExistsError:         # 32 random bits met another's: draw again
            if attempt == 7:
                raise
    try:
        ownfiles.write_all(fd, payload)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)
