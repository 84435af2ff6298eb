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
documents of old and new chemio_py are the same and both read each other's. A resizable
array (``create(..., maxshape=)``) records ``"maxshape"`` (null for an axis without
limit); in the raw grid its chunks are laid out for it (``grid.capacity``), so it is
``"format": 3``, which older chemio_py refuse. User attributes (``d.attrs``) are the
``"attributes"`` object (JSON, at most ``MAX_ATTRS`` bytes); older readers ignore it.

A metadata file is untrusted input (it may be corrupt, truncated, or written by someone
hostile): ``load`` reads at most ``MAX_BYTES``, parses with ``safejson`` (no document nested
deeper than 64 levels, no integer of more than 30 digits), rejects NaN/Infinity, non-integer or
negative sizes, sizes whose product passes ``MAX_NBYTES``, dtypes outside the whitelist
(structured dtypes are rebuilt field by field within ``MAX_FIELDS``, ``MAX_DTYPE_DEPTH``
and ``MAX_ITEMSIZE``), and data file names that are not plain names. Every failure is a
``MetadataError`` that names the file, the key and what was found. ``write_atomic`` writes
a temp file, fsyncs it, renames it over the target and fsyncs the directory, so a reader
sees the old document or the new one, never half of one.
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
from typing import Any, Literal

import numpy as np

from chemio_py.errors import ArgumentError, MetadataError
from chemio_py.runtime import ownfiles, safejson
from chemio_py.scratch import jobs

FORMAT = 1                     # arrays without checksums (every array before issue 27)
FORMAT_CHECKSUM = 2            # arrays with per-chunk checksums: older readers refuse them
FORMAT_GROWABLE = 3            # resizable raw-grid arrays: the grid is laid out for maxshape
FORMATS = (FORMAT, FORMAT_CHECKSUM, FORMAT_GROWABLE)
CHECKSUMS = ("crc32",)         # the algorithms a "checksum" key may name
KIND = "chemio_py.DiskArray"
MAX_BYTES = 1 << 20            # a metadata document is a few hundred bytes
MAX_NDIM = 32
MAX_ATTRS = 64 << 10           # the user attributes, serialized (JSON)
MAX_NBYTES = 1 << 60           # 1 EiB: far above any file system, far below int64 overflow
_PLAIN = re.compile(r"^[A-Za-z0-9._+-]{1,255}$")
_BACKEND = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

# The supported element types: every fixed-size NumPy dtype that reads the same everywhere.
# Byte order is part of the dtype and is kept (a ">f8" array stays big-endian on disk and in
# what it reads). The document spells a plain dtype as ``dtype.str`` ("<f8", "|S10", "<U5",
# "<M8[s]", "|V8") and a structured one as ``dtype.descr`` in JSON lists (as ``.npy`` files
# do); both are rebuilt here piece by piece from checked parts, never handed to NumPy whole.
DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "complex64", "complex128",
          "S<n> (bytes)", "U<n> (unicode)", "V<n> (raw)", "datetime64[unit]",
          "timedelta64[unit]", "structured (of these; nested and subarray fields)")
MAX_ITEMSIZE = 1 << 20         # one element (a structured record) of at most 1 MiB
MAX_FIELDS = 1024              # fields of a structured dtype, counted through nesting
MAX_DTYPE_DEPTH = 8            # nesting of structured fields
_SUPPORTED = ("supported: bool, (u)int8-64, float16/32/64, complex64/128, S<n>, U<n>, V<n>, "
              "datetime64/timedelta64 with a unit, and structured dtypes of these")
_NAMES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
          "float16", "float32", "float64", "complex64", "complex128")
_SIMPLE = re.compile(r"^[<>|=]?(?:b1|[iu][1248]|f[248]|c(?:8|16)|[SUV][1-9][0-9]{0,6}"
                     r"|[mM]8\[[1-9]?[0-9]{0,5}(?:Y|M|W|D|h|m|s|ms|us|ns|ps|fs|as)\])$")
_UNITS = ("Y", "M", "W", "D", "h", "m", "s", "ms", "us", "ns", "ps", "fs", "as")


def _dtype_error(what: str) -> str:
    return f"{what}; DiskArray stores fixed-size NumPy dtypes only ({_SUPPORTED})"


def _plain_dtype(dt: np.dtype) -> str | None:
    """Why ``dt`` (not structured) is not supported, or None."""
    k = dt.kind
    if k in "OT" or dt.hasobject:
        return f"dtype {dt} holds Python objects or strings of variable size"
    if k in "fc" and dt.str[1:] not in ("f2", "f4", "f8", "c8", "c16"):
        return f"dtype {dt} (long double) has a size and layout that differ between machines"
    if k in "mM":
        unit = np.datetime_data(dt)[0]
        if unit not in _UNITS:
            return f"dtype {dt} has no unit; give one, e.g. {k}8[s]"
    if k in "SUV" and dt.itemsize == 0:
        return f"dtype {dt} has no length; give one, e.g. {dt.char}8"
    if dt.str[1:] == "O" or not _SIMPLE.match(dt.str):
        return f"dtype {dt} is not a fixed-size NumPy dtype DiskArray knows"
    return None


def dtype_doc(dt: np.dtype) -> Any:
    """The JSON form of a supported dtype: ``dt.str``, or ``dt.descr`` as lists."""
    if dt.names is None:
        return dt.str
    return _descr_json(dt.descr)


def _descr_json(descr: list) -> list:
    out = []
    for entry in descr:
        name, t = entry[0], entry[1]
        item: list = [name, _descr_json(t) if isinstance(t, list) else t]
        if len(entry) > 2:
            item.append(list(entry[2]))
        out.append(item)
    return out


def dtype_from_doc(v: Any, where: str = "'dtype'") -> np.dtype:
    """The dtype a document spells (``dtype_doc``), checked as untrusted input: plain
    strings from the whitelist, structured lists of at most ``MAX_FIELDS`` fields nested at
    most ``MAX_DTYPE_DEPTH`` deep, elements of at most ``MAX_ITEMSIZE`` bytes, no objects.
    Raises ``ValueError`` saying what is wrong."""
    count = [0]
    dt = _dtype_part(v, 0, count, where)
    if dt.itemsize > MAX_ITEMSIZE:
        raise ValueError(f"{where} makes elements of {dt.itemsize} bytes, more than "
                         f"{MAX_ITEMSIZE}")
    return dt


def _dtype_part(v: Any, depth: int, count: list, where: str) -> np.dtype:
    if isinstance(v, str):
        if v in _NAMES:
            return np.dtype(v)
        if len(v) > 40 or not _SIMPLE.match(v):
            raise ValueError(f"{where} {v!r:.60} is not one of the supported types")
        dt = np.dtype(v)
        why = _plain_dtype(dt)
        if why:
            raise ValueError(f"{where}: {why}")
        if dt.itemsize > MAX_ITEMSIZE:
            raise ValueError(f"{where} {v!r} makes elements of {dt.itemsize} bytes, more "
                             f"than {MAX_ITEMSIZE}")
        return dt
    if not isinstance(v, list) or not v:
        raise ValueError(f"{where} {v!r:.60} is neither a dtype string nor a non-empty list "
                         f"of structured fields")
    if depth >= MAX_DTYPE_DEPTH:
        raise ValueError(f"{where} nests structured fields more than {MAX_DTYPE_DEPTH} deep")
    names: list = []
    formats: list = []
    offsets: list = []
    at = 0
    for entry in v:
        count[0] += 1
        if count[0] > MAX_FIELDS:
            raise ValueError(f"{where} has more than {MAX_FIELDS} structured fields")
        if not isinstance(entry, list) or len(entry) not in (2, 3) or \
                not isinstance(entry[0], str) or len(entry[0]) > 255:
            raise ValueError(f"{where}: field {entry!r:.80} is not [name, type] or "
                             f"[name, type, shape] with a name of at most 255 characters")
        t = _dtype_part(entry[1], depth + 1, count, where)
        if len(entry) == 3:
            shp = entry[2]
            if not isinstance(shp, list) or not 1 <= len(shp) <= MAX_NDIM or \
                    not all(_int(n) and 0 <= n <= MAX_ITEMSIZE for n in shp):
                raise ValueError(f"{where}: field {entry[0]!r:.60} has subarray shape "
                                 f"{shp!r:.60}, not a list of 1 to {MAX_NDIM} sizes")
            n = math.prod(shp)
            if n * t.itemsize > MAX_ITEMSIZE:
                raise ValueError(f"{where}: field {entry[0]!r:.60} makes {n * t.itemsize} "
                                 f"bytes, more than {MAX_ITEMSIZE}")
            t = np.dtype((t, tuple(shp)))
        if entry[0] == "":                      # padding (an aligned struct)
            if t.kind != "V" or t.names is not None or len(entry) == 3:
                raise ValueError(f"{where}: an unnamed field must be raw padding '|V<n>', "
                                 f"found {entry[1]!r:.60}")
        else:
            if entry[0] in names:
                raise ValueError(f"{where}: field name {entry[0]!r:.60} appears twice")
            names.append(entry[0])
            formats.append(t)
            offsets.append(at)
        at += t.itemsize
        if at > MAX_ITEMSIZE:
            raise ValueError(f"{where} makes elements of more than {MAX_ITEMSIZE} bytes")
    if not names:
        raise ValueError(f"{where} has no named field")
    spec: Any = {"names": names, "formats": formats, "offsets": offsets, "itemsize": at}
    return np.dtype(spec)


def _without_metadata(dt: np.dtype) -> np.dtype:
    if dt.subdtype is not None:
        return np.dtype((_without_metadata(dt.subdtype[0]), dt.subdtype[1]))
    if dt.names is None:
        return np.dtype(dt.str)
    fields: Any = dt.fields
    spec: Any = {"names": list(dt.names), "itemsize": dt.itemsize,
                 "formats": [_without_metadata(fields[n][0]) for n in dt.names],
                 "offsets": [fields[n][1] for n in dt.names]}
    return np.dtype(spec)


def check_dtype(dtype: Any, where: str = "dtype") -> np.dtype:
    """``dtype`` as a NumPy dtype if DiskArray supports it (every fixed-size dtype: bool,
    ints, float16/32/64, complex64/128, ``S<n>``, ``U<n>``, ``V<n>``, datetime64 and
    timedelta64 with a unit, structured dtypes of these without titles or overlapping
    fields), byte order kept; else ``ArgumentError`` naming the dtype and what is
    supported."""
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError) as e:
        raise ArgumentError(_dtype_error(f"{where} {dtype!r} is not a NumPy dtype ({e})")) \
            from None
    if dt.subdtype is not None:
        raise ArgumentError(_dtype_error(f"{where} {dt} is a subarray dtype: add its axes "
                                         f"{dt.shape} to the array's shape instead"))
    if dt.names is None:
        why = _plain_dtype(dt)
        if why:
            raise ArgumentError(_dtype_error(f"{where}: {why}"))
        if dt.itemsize > MAX_ITEMSIZE:
            raise ArgumentError(f"{where} {dt} has elements of {dt.itemsize} bytes, more than "
                                f"the {MAX_ITEMSIZE} DiskArray supports")
        return dt
    if dt.hasobject:
        raise ArgumentError(_dtype_error(f"{where} {dt} has Python-object fields"))
    try:
        doc = dtype_doc(_without_metadata(dt))  # h5py tags its strings with metadata
    except ValueError as e:                     # overlapping or out-of-order fields
        raise ArgumentError(_dtype_error(f"{where} {dt}: {e}")) from None
    try:
        back = dtype_from_doc(json.loads(json.dumps(doc)), where)
    except ValueError as e:
        raise ArgumentError(_dtype_error(str(e))) from None
    if back != dt or back.itemsize != dt.itemsize:
        raise ArgumentError(_dtype_error(f"{where} {dt} cannot be recorded exactly (titles, "
                                         f"overlapping or reordered fields)"))
    return back


def casting(dtype: np.dtype) -> Literal["same_kind", "safe"]:
    """The NumPy casting rule for data written into an array of ``dtype``: ``same_kind``
    for numbers (float64 into float32 rounds), ``safe`` for records, bytes, text and times
    (``S12`` into ``S10`` would cut, ``M8[ms]`` into ``M8[s]`` would lose time)."""
    return "same_kind" if dtype.names is None and dtype.kind in "biufc" else "safe"


def check_cast(src: np.dtype, dtype: np.dtype, target: str) -> None:
    """``ArgumentError`` unless data of dtype ``src`` may be written into ``target`` of
    ``dtype`` (``casting``); says how to convert, and that nothing was written."""
    if src != dtype and not np.can_cast(src, dtype, casting(dtype)):
        raise ArgumentError(
            f"data of dtype {src} is not stored in {target} of dtype {dtype} (NumPy cannot "
            f"cast it without losing values); convert it first "
            f"(data.astype({str(dtype)!r})) if that is intended; nothing was written")


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
    maxshape: tuple | None = None  # resizable: the most each axis may grow to (None: no
    #                              limit); None: a fixed array (format 3 on the raw grid)
    attrs: dict = field(default_factory=dict)   # the user's attributes (``d.attrs``)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def to_doc(self) -> dict:
        return {
            "format": self.format, "kind": KIND, "name": self.name,
            "shape": list(self.shape), "dtype": dtype_doc(self.dtype),
            "chunks": list(self.chunks),
            "order": "C", "layout": self.layout, "byte_order": sys.byteorder,
            "nbytes": self.nbytes, "backend": self.backend, "data": self.data,
            "persistent": self.persistent, "uuid": self.uuid, "created": dict(self.created),
        } | ({"checksum": self.checksum} if self.checksum else {}) \
          | ({"maxshape": list(self.maxshape)} if self.maxshape is not None else {}) \
          | ({"attributes": dict(self.attrs)} if self.attrs else {})


def format_for(layout: str, checksum: str | None, maxshape: tuple | None) -> int:
    """The format version of a new document: 2 with checksums, 3 for a resizable array
    in the raw grid (its grid is laid out for ``maxshape``, which older chemio_py would
    misread, so they refuse it), else 1 (a resizable ``zarr`` array is plain Zarr)."""
    if checksum:
        return FORMAT_CHECKSUM
    if maxshape is not None and layout == "grid":
        return FORMAT_GROWABLE
    return FORMAT


def check_attrs(attrs: Any, src: str = "<document>") -> dict:
    """Untrusted ``attributes`` of a document: a JSON object of at most ``MAX_ATTRS``
    bytes serialized, else ``MetadataError``."""
    if not isinstance(attrs, dict):
        raise _bad(src, f"'attributes' must be a JSON object, found {type(attrs).__name__}")
    try:
        n = len(json.dumps(attrs, allow_nan=False, separators=(",", ":")))
    except (TypeError, ValueError) as e:
        raise _bad(src, f"'attributes' is not plain JSON ({e})") from None
    if n > MAX_ATTRS:
        raise _bad(src, f"'attributes' take {n} bytes, more than the limit of {MAX_ATTRS}")
    return attrs


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
    maxshape = _maxshape(doc, fmt, layout, shape, src)
    for k, (n, c) in enumerate(zip(shape, chunks)):
        if maxshape is not None:
            n = MAX_NBYTES if maxshape[k] is None else maxshape[k]
        if c > max(n, 1):
            raise _bad(src, f"chunk size {c} exceeds its dimension {n} "
                            f"(chunks {list(chunks)}, shape {list(shape)})")
    try:
        dtype = dtype_from_doc(doc.get("dtype"))
    except ValueError as e:
        raise _bad(src, f"{e}", _SUPPORTED) from None
    order = doc.get("byte_order", sys.byteorder)   # the writer's machine (informational:
    if order not in ("little", "big"):             # the dtype carries its byte order)
        raise _bad(src, f"'byte_order' is {order!r:.40}, expected 'little' or 'big'")
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
    attrs = check_attrs(doc.get("attributes", {}), src)
    return Meta(name=name, shape=shape, dtype=dtype, chunks=chunks, backend=backend,
                data=data, persistent=persistent, uuid=uuid, created=created, format=fmt,
                layout=layout, checksum=checksum, maxshape=maxshape, attrs=attrs)


def _maxshape(doc: dict, fmt: int, layout: str, shape: tuple, src: str) -> tuple | None:
    """The checked ``maxshape`` of a document: required in format 3 (a resizable raw grid,
    whose only unlimited axis can be the first), allowed for other layouts in format 1."""
    v = doc.get("maxshape")
    if fmt == FORMAT_GROWABLE and layout != "grid":
        raise _bad(src, f"format {fmt} is for layout 'grid', found layout {layout!r:.40}")
    if v is None:
        if fmt == FORMAT_GROWABLE:
            raise _bad(src, f"format {fmt} (a resizable array) needs 'maxshape'",
                       "the metadata is damaged")
        return None
    if fmt == FORMAT_CHECKSUM or (fmt == FORMAT and layout == "grid"):
        raise _bad(src, f"'maxshape' in a format {fmt} document of layout {layout!r:.40} "
                        f"(resizable raw-grid arrays are format {FORMAT_GROWABLE})")
    if not isinstance(v, list) or len(v) != len(shape):
        raise _bad(src, f"'maxshape' must be a list of {len(shape)} ints or nulls, found "
                        f"{v!r:.80}")
    for k, (m, n) in enumerate(zip(v, shape)):
        if m is None:
            if layout == "grid" and k > 0:
                raise _bad(src, f"'maxshape' {v!r:.80} leaves axis {k} unlimited; only axis 0 "
                                f"of a raw grid can be")
            continue
        if not _int(m) or m < n or m > MAX_NBYTES:
            raise _bad(src, f"'maxshape' {v!r:.80} holds {m!r:.40}, not an int between the "
                            f"shape's {n} and {MAX_NBYTES}")
    return tuple(v)


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
    if not isinstance(dtype, list):             # a structured dtype comes as descr lists
        try:
            dtype = dtype_doc(np.dtype(dtype)) if dtype is not None else dtype
        except (TypeError, ValueError):
            pass
    kept = doc.get("dtype")
    if isinstance(kept, list) and isinstance(dtype, str) and re.match(r"^\|V[0-9]+$", dtype):
        try:                # records stored as raw bytes: the chemio dtype says what they are
            if dtype_from_doc(kept).itemsize == int(dtype[2:]):
                dtype = kept
        except ValueError:
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
    user = desc.get("user_attributes", {})          # the object's own, beside chemio's
    doc["attributes"] = user if isinstance(user, dict) else {}
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


def write_atomic(path: str, payload: bytes, mode: int = 0o600, *,
                 durable: bool = True) -> None:
    """Write ``payload`` to ``path`` all-or-nothing: temp file, fsync, rename, fsync dir.

    ``durable=False`` (scratch, which no crash has to survive) skips both fsyncs: readers
    still see the old or the new document whole. The temp file's name is this call's own
    (``jobs.temp_path``: pid, namespace, thread, random); temp files of ``path`` whose
    writers are gone are removed first."""
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
        if durable:
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
    if not durable:
        return
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
