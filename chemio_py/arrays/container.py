"""An h5py-shaped container of DiskArrays: ``cio.H5TmpFile`` and its ``cio.Group``s.

    >>> import numpy as np, chemio_py as cio
    >>> with cio.H5TmpFile(backend="shm") as ftmp:        # scratch: gone on close
    ...     ftmp.create_dataset("eri/ovov", (10, 10), "f8", chunks=(5, 10))
    ...     ftmp["x"] = np.arange(4.0)                    # creates a dataset, as h5py
    ...     ftmp["eri"]["ovov"][2:4] = 1.0                # datasets are DiskArrays
    ...     ftmp.attrs["basis"] = "sto-3g"

What code written for h5py does to an ``h5py.File`` works here: ``create_dataset(name,
shape, dtype, data=, chunks=, **h5py_kw)``, ``require_dataset``, ``create_group`` and
``require_group`` (paths such as ``"a/b/c"`` make the groups between), ``f[name]``,
``f[name] = array``, ``del f[name]``, ``in``, iteration, ``keys/values/items/get``,
``.attrs``, ``.name`` (``"/"``, ``"/a/b"``), ``.filename``, ``.file``, ``.parent``,
``flush``, ``close`` and ``with``. A dataset is a :class:`Dataset`, a DiskArray (any
backend, read-ahead, ``stats``, NumPy's indexing, which takes every h5py selection) with
h5py's ``read_direct``/``write_direct``, ``.name`` as h5py, ``fillvalue``, ``resize`` and
``.attrs``.

Keywords h5py takes that chemio has no use for are accepted with this meaning:

* ``maxshape`` -> the DiskArray's ``maxshape`` (resizable; on the raw-grid backends only
  axis 0 may be unlimited); ``chunks=True``/``None`` -> chemio's default chunks, a tuple
  -> those chunks (clipped to the shape, at least 1);
* ``fletcher32=True`` -> ``checksum=True`` (a CRC-32 per chunk) on ``local``, ``shm`` and
  ``auto`` for a fixed-shape dataset; elsewhere ignored;
* ``fillvalue`` -> written into the dataset at creation and into what ``resize`` adds
  (a DiskArray reads zero where nothing was written: fill 0 costs nothing);
* ``compression``, ``compression_opts``, ``shuffle``, ``scaleoffset`` -> ignored: data is
  stored raw (compression is the backend's: ``zarr`` with ``compressor=``);
* ``track_times``, ``track_order``, ``dcpl``, ``dapl``, ``external``, ``efile_prefix``,
  ``virtual_prefix``, ``allow_unknown_filter``, ``rdcc_*`` -> ignored;
* h5py ``File`` keywords (``libver``, ``driver``, ``userblock_size``, ``swmr``,
  ``locking``, ``rdcc_*``, ``fs_*``, ``page_buf_size``, ``alignment_*``, ...) -> ignored.

Any other keyword is an ``ArgumentError`` and nothing is created. h5py's default dtype
(``"f4"`` without ``data``) is kept.

**Where the data lives.** ``H5TmpFile()`` is scratch: each dataset is a scratch DiskArray of
the chosen backend (``shm`` and ``auto`` in RAM, ``local``/``mpiio``/``zarr`` in the job's
scratch directory, or in a job directory under ``dir=`` when given), removed when the file
closes, when the file object is garbage-collected (as PySCF's ``lib.H5TmpFile`` deletes its
file) and at exit; groups and attributes live in memory. ``H5TmpFile(filename)`` is
persistent: a directory ``filename`` (modes as h5py: ``r``, ``r+``, ``w``, ``w-``/``x``,
``a``) holding a directory per group, a persistent DiskArray per dataset (``<name>.dra`` +
``.dra.json``, ``<name>.zarr`` on ``zarr``) and a JSON document ``.group.json`` per group
with its attributes (written atomically; read as untrusted input; at most
``meta.MAX_ATTRS`` bytes); it reopens later. Names are any text without ``/``; on disk,
characters other than letters, digits, ``_`` and ``-`` are written ``+hh`` (UTF-8 hex).

**Attributes** are JSON values (as ``DiskArray.attrs``): NumPy numbers and arrays are
stored as numbers and lists and read back as such (h5py gives NumPy values back).

**MPI.** A ``H5TmpFile`` is private to the process that makes it (``COMM_SELF``), as
PySCF's are (one process per rank, each with its own temporary file): its calls are
never collective, even under ``mpiexec``. Pass ``comm=`` (a communicator) to share a
persistent file among ranks: then creation, ``resize`` and attribute changes are
collective over it, as DiskArray's are.
"""
from __future__ import annotations

import math
import os
import secrets
import weakref
from collections.abc import MutableMapping
from typing import Any, Iterator, cast

import numpy as np

import chemio_py.backends as _backends
from chemio_py.arrays import attrs as _attrs, meta as _meta
from chemio_py.arrays.diskarray import META_SUFFIX, SUFFIX, DiskArray
from chemio_py.errors import ArgumentError, ChemIOError, MetadataError, ModeError, NotFoundError
from chemio_py.runtime import comm as _comm, config, finalizers, safejson
from chemio_py.scratch import jobs

GROUP_DOC = ".group.json"           # a persistent group's marker and attributes
FORMAT = "chemio-h5"                # its "format" entry
FILL_BLOCK = 16 << 20               # bytes of fill written per call

# h5py keywords of create_dataset chemio accepts, and what becomes of them (module doc)
DATASET_KW = frozenset({
    "compression", "compression_opts", "shuffle", "fletcher32", "fillvalue", "track_times",
    "track_order", "maxshape", "scaleoffset", "dcpl", "dapl", "external", "efile_prefix",
    "virtual_prefix", "allow_unknown_filter", "rdcc_nbytes", "rdcc_w0", "rdcc_nslots",
})
# h5py.File keywords (all ignored)
FILE_KW = frozenset({
    "libver", "driver", "userblock_size", "swmr", "rdcc_nbytes", "rdcc_w0", "rdcc_nslots",
    "track_order", "fs_strategy", "fs_persist", "fs_threshold", "fs_page_size",
    "page_buf_size", "min_meta_keep", "min_raw_keep", "locking", "alignment_threshold",
    "alignment_interval", "meta_block_size", "backing_store", "block_size",
})
CHECKSUM_BACKENDS = ("local", "shm", "auto")
RAM_BACKENDS = ("shm", "auto")      # their scratch is in RAM whatever ``dir`` says
_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


# ---------------------------------------------------------------- names

def escape(name: str) -> str:
    """``name`` as a file name: letters, digits, ``_``, ``-`` kept, other bytes ``+hh``."""
    return "".join(c if c in _SAFE else "".join(f"+{b:02x}" for b in c.encode())
                   for c in name)


def unescape(text: str) -> str | None:
    """The name ``escape`` made ``text`` of; None when ``text`` is not such a name."""
    out = bytearray()
    i = 0
    try:
        while i < len(text):
            c = text[i]
            if c == "+":
                out.append(int(text[i + 1:i + 3], 16))
                i += 3
            elif c in _SAFE:
                out += c.encode()
                i += 1
            else:
                return None
        name = out.decode()
    except (ValueError, UnicodeDecodeError):
        return None
    return name if name and escape(name) == text else None


def _parts(name: Any, where: str) -> tuple[bool, list[str]]:
    """(absolute, components) of an h5py path; ``.`` components dropped."""
    if isinstance(name, bytes):
        name = name.decode()
    if not isinstance(name, str):
        raise ArgumentError(f"{where}: a name is a str (an h5py path such as 'a/b'), got "
                            f"{type(name).__name__} {name!r:.60}; nothing changed")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ArgumentError(f"{where}: path {name!r} climbs with '..', which chemio's groups "
                            f"do not follow; give the path from the file ('/a/b'); "
                            f"nothing changed")
    return name.startswith("/"), parts


# ---------------------------------------------------------------- attributes of groups

class GroupAttrs(MutableMapping):
    """The attributes of a group or file: str keys, JSON values (see the module doc);
    kept in memory for a scratch file, in the group's ``.group.json`` for a persistent
    one (written at each change, atomically)."""

    __slots__ = ("_group",)

    def __init__(self, group: "Group"):
        self._group = group

    def _data(self) -> dict:
        return self._group._live().attrs

    def __getitem__(self, key: str) -> Any:
        try:
            return self._data()[key]
        except KeyError:
            raise NotFoundError(f"no attribute {key!r} in group {self._group.name!r}; "
                                f"it has {sorted(self._data())}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._data()))

    def __len__(self) -> int:
        return len(self._data())

    def __contains__(self, key: object) -> bool:
        return key in self._data()

    def __setitem__(self, key: str, value: Any) -> None:
        if not isinstance(key, str):
            raise ArgumentError(f"attribute keys are str, got {key!r}; nothing changed")
        self._change({key: _attrs.jsonable(value, repr(key))})

    def __delitem__(self, key: str) -> None:
        if key not in self._data():
            raise NotFoundError(f"no attribute {key!r} in group {self._group.name!r}")
        node = self._group._live()
        new = {k: v for k, v in node.attrs.items() if k != key}
        node.save_attrs(new, self._group.name)

    def update(self, *args: Any, **kw: Any) -> None:   # one write for all of them
        items = dict(*args, **kw)
        for k in items:
            if not isinstance(k, str):
                raise ArgumentError(f"attribute keys are str, got {k!r}; nothing changed")
        self._change({k: _attrs.jsonable(v, repr(k)) for k, v in items.items()})

    def _change(self, items: dict) -> None:
        node = self._group._live()
        node.save_attrs({**node.attrs, **items}, self._group.name)

    def __repr__(self) -> str:
        return f"<attributes of group {self._group.name!r}: {self._data()!r:.200}>"


# ---------------------------------------------------------------- the tree

class _State:
    """What one open file owns; the finalizer of the file object closes it (it never
    refers to the file object, so dropping the file releases it at once)."""

    def __init__(self, *, filename: str, persistent: bool, writable: bool, backend: str | None,
                 comm: Any, dir: str | None, options: dict):
        self.filename = filename
        self.persistent = persistent
        self.writable = writable
        self.backend = backend
        self.comm = comm
        self.dir = dir
        self.options = options
        self.token = secrets.token_hex(4)
        self.count = 0
        self.datasets: dict[int, DiskArray] = {}      # id -> open dataset
        self.closed = False
        self.file_ref: Any = None                     # weakref to the H5TmpFile

    def next_name(self, label: str) -> str:
        """A scratch DiskArray name: unique, with the h5py path's tail for reports."""
        self.count += 1
        return f"h5-{self.token}-{self.count}-{escape(label)[-40:]}"

    def release(self) -> None:
        """Close every dataset (a scratch one is removed); the first error is raised."""
        if self.closed:
            return
        self.closed = True
        first: BaseException | None = None
        for d in list(self.datasets.values()):
            try:
                d.close()
                if not self.persistent and d.persistent:      # scratch under dir=
                    d.delete()
            except BaseException as e:  # noqa: BLE001 - every dataset goes; first raised
                first = first or e
        self.datasets.clear()
        if first is not None:
            raise first


def _release_quietly(state: _State) -> None:
    """The finalizer: close what the file owned (``finalizers.close_later``); errors can go
    nowhere but a warning."""
    def release() -> None:
        try:
            state.release()
        except Exception as e:  # noqa: BLE001
            import warnings
            warnings.warn(f"closing {state.filename!r} when it was garbage-collected: {e}",
                          RuntimeWarning, stacklevel=1)
    finalizers.close_later(release)


class _Node:
    """A group's contents: children by name (a ``_Node``, an open ``Dataset``, or the path
    of a persistent dataset not opened yet) and attributes."""

    def __init__(self, state: _State, path: str, dirpath: str | None):
        self.state = state
        self.path = path                    # h5py name, "/" or "/a/b"
        self.dir = dirpath                  # its directory (persistent files)
        self.children: dict[str, Any] = {}
        self.attrs: dict = {}
        self.loaded = dirpath is None

    def child_path(self, name: str) -> str:
        return ("/" if self.path == "/" else self.path + "/") + name

    def load(self) -> None:
        """Read a persistent group's directory: its attributes and children."""
        if self.loaded:
            return
        assert self.dir is not None
        self.attrs = read_group_doc(self.dir)
        for entry in sorted(os.listdir(self.dir)):
            full = os.path.join(self.dir, entry)
            if entry.endswith(SUFFIX + META_SUFFIX):
                name = unescape(entry[:-len(SUFFIX + META_SUFFIX)])
                if name is not None:
                    self.children[name] = full
            elif entry.endswith(".zarr") and os.path.isdir(full):
                name = unescape(entry[:-5])
                if name is not None:
                    self.children[name] = full
            elif os.path.isdir(full) and not os.path.islink(full) \
                    and os.path.isfile(os.path.join(full, GROUP_DOC)):
                name = unescape(entry)
                if name is not None:
                    self.children[name] = _Node(self.state, self.child_path(name), full)
        self.loaded = True

    def save_attrs(self, new: dict, name: str) -> None:
        if not self.state.writable:
            raise ModeError(f"the attributes of group {name!r} cannot change: "
                            f"{self.state.filename!r} is open read-only; nothing changed")
        _attrs.checked(new, name, False)
        if self.dir is not None:
            write_group_doc(self.dir, new)
        self.attrs = new


def read_group_doc(dirpath: str) -> dict:
    """The attributes in a group's ``.group.json``, checked as untrusted input."""
    path = os.path.join(dirpath, GROUP_DOC)
    try:
        with open(path, "rb") as fh:
            raw = fh.read(_meta.MAX_ATTRS + 4096 + 1)
    except OSError as e:
        raise MetadataError(f"group document {path!r} cannot be read ({e}); is "
                            f"{os.path.dirname(path)!r} a chemio H5TmpFile group?") from None
    doc = safejson.load(raw, what=f"group document {path!r}",
                        max_bytes=_meta.MAX_ATTRS + 4096)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != 1:
        raise MetadataError(f"group document {path!r} is not a {FORMAT} version 1 document "
                            f"(found {str(doc)[:80]!r}); it was written by something else")
    return _meta.check_attrs(doc.get("attributes", {}), path)


def write_group_doc(dirpath: str, attrs: dict) -> None:
    import json
    doc = {"format": FORMAT, "version": 1, "attributes": attrs}
    _meta.write_atomic(os.path.join(dirpath, GROUP_DOC),
                       (json.dumps(doc, allow_nan=False) + "\n").encode(), 0o666)


# ---------------------------------------------------------------- datasets

class Dataset(DiskArray):
    """A dataset of an ``H5TmpFile``: a DiskArray with h5py's names on top."""

    _h5name: str | None = None
    _h5state: _State | None = None
    _fill: Any = None

    @property
    def name(self) -> str:
        """The h5py path (``"/a/x"``)."""
        return self._h5name or self._meta.name

    @property
    def file(self) -> "H5TmpFile | None":
        """The file it belongs to (None once that is gone)."""
        st = self._h5state
        return None if st is None or st.file_ref is None else st.file_ref()

    @property
    def parent(self) -> "Group":
        f = self.file
        if f is None:
            raise ChemIOError(f"dataset {self.name!r}: its file is closed")
        return f[self.name.rsplit("/", 1)[0] or "/"]

    @property
    def fillvalue(self) -> Any:
        """What unwritten elements read as (h5py's ``fillvalue``)."""
        return self.dtype.type(0) if self._fill is None else self._fill

    compression = None
    compression_opts = None
    shuffle = False
    fletcher32 = False
    scaleoffset = None

    def read_direct(self, dest: np.ndarray, source_sel: Any = None,
                    dest_sel: Any = None) -> None:
        """h5py's ``read_direct``: ``dest[dest_sel] = self[source_sel]`` (whole array and
        whole ``dest`` when None), reading straight into ``dest`` where it can."""
        if not isinstance(dest, np.ndarray):
            raise ArgumentError(f"read_direct needs a NumPy array to fill, got "
                                f"{type(dest).__name__}; nothing was read")
        view = dest if dest_sel is None else dest[dest_sel]
        src = () if source_sel is None else source_sel
        if view.dtype == self.dtype and (view is dest or np.shares_memory(view, dest)):
            try:                            # an exact section into a view: no copy
                self.read(src, out=view)
                return
            except ValueError:              # SectionError/ArgumentError: raised before I/O
                pass
        block = self[src]
        if np.shape(block) != view.shape:
            if np.size(block) != view.size:
                raise ArgumentError(f"read_direct: the source selection {source_sel!r} has "
                                    f"shape {np.shape(block)} but the destination selection "
                                    f"{dest_sel!r} has shape {view.shape}; nothing was read")
            block = np.reshape(block, view.shape)
        if dest_sel is None:
            dest[...] = block
        else:
            dest[dest_sel] = block

    def write_direct(self, source: Any, source_sel: Any = None, dest_sel: Any = None) -> None:
        """h5py's ``write_direct``: ``self[dest_sel] = source[source_sel]``."""
        src = np.asarray(source)
        data = src if source_sel is None else src[source_sel]
        self[() if dest_sel is None else dest_sel] = data

    def resize(self, size: Any, axis: int | None = None) -> None:
        """h5py's ``resize`` (``maxshape`` needed); what it adds reads as ``fillvalue``."""
        old = self.shape
        super().resize(size, axis)
        if self._fill is not None and self._fill != 0:
            new = self.shape
            for k in range(len(new)):
                if new[k] > old[k]:
                    region = tuple(slice(0, min(n, o)) if j < k else slice(0, n)
                                   for j, (n, o) in enumerate(zip(new, old)))
                    region = region[:k] + (slice(old[k], new[k]),) + region[k + 1:]
                    fill(self, region, self._fill)

    def __repr__(self) -> str:
        return (f"<chemio Dataset {self.name!r} shape={self.shape} dtype={self.dtype} "
                f"chunks={self.chunks} backend={self.backend} "
                f"{'closed' if self.closed else 'open'}>")


def fill(d: DiskArray, region: tuple, value: Any) -> None:
    """Write ``value`` into every element of ``region``, in blocks of ``FILL_BLOCK`` bytes."""
    shape = tuple(s.stop - s.start for s in region)
    if not shape:
        d[()] = value
        return
    if 0 in shape:
        return
    row = math.prod(shape[1:]) * d.dtype.itemsize
    step = max(1, FILL_BLOCK // max(1, row))
    for i in range(region[0].start, region[0].stop, step):
        sub = (slice(i, min(i + step, region[0].stop)),) + region[1:]
        d.write(sub, np.full(tuple(s.stop - s.start for s in sub), value, d.dtype))


# ---------------------------------------------------------------- groups

class Group(MutableMapping):
    """A group of an ``H5TmpFile``: datasets and groups by name (module docstring)."""

    def __init__(self, node: _Node):
        self._node = node

    # -- plumbing
    def _live(self) -> _Node:
        st = self._node.state
        if st.closed:
            raise ChemIOError(f"group {self._node.path!r} of {st.filename!r}: the file is "
                              f"closed; open it again (H5TmpFile(filename)) or make a new one")
        self._node.load()
        return self._node

    def _writable(self, what: str) -> _Node:
        node = self._live()
        if not node.state.writable:
            raise ModeError(f"{what} in {node.state.filename!r}: the file is open read-only "
                            f"(mode 'r'); open it with mode 'r+' or 'a'; nothing changed")
        return node

    def _walk(self, name: Any, where: str, create: bool = False) -> tuple[_Node, str | None]:
        """(parent node, last component) of ``name``; groups on the way made if ``create``."""
        absolute, parts = _parts(name, where)
        node = self._live()
        if absolute:
            f = self.file
            node = f._live() if f is not None else node
        if not parts:
            return node, None
        for p in parts[:-1]:
            child = node.children.get(p)
            if child is None:
                if not create:
                    raise NotFoundError(f"{where}: no group {p!r} in {node.path!r} (path "
                                        f"{name!r}); it has {sorted(node.children)}")
                child = self._new_group(node, p)
            if not isinstance(child, _Node):
                raise ArgumentError(f"{where}: {node.child_path(p)!r} is a dataset, not a "
                                    f"group (path {name!r}); nothing changed")
            child.load()
            node = child
        return node, parts[-1]

    def _new_group(self, parent: _Node, name: str) -> _Node:
        st = parent.state
        if not st.writable:
            raise ModeError(f"create group {parent.child_path(name)!r}: {st.filename!r} is "
                            f"open read-only; nothing changed")
        dirpath = None
        if parent.dir is not None:
            dirpath = os.path.join(parent.dir, escape(name))
            os.mkdir(dirpath, 0o777)
            write_group_doc(dirpath, {})
        node = _Node(st, parent.child_path(name), dirpath)
        parent.children[name] = node
        return node

    def _wrap(self, node: _Node, name: str, child: Any) -> Any:
        if isinstance(child, _Node):
            child.load()                            # a persistent group's document checked
            return Group(child)
        if isinstance(child, str):                  # a persistent dataset, not open yet
            st = node.state
            d = cast(Dataset, Dataset.open(child, "r+" if st.writable else "r", comm=st.comm))
            self._adopt(d, node.child_path(name), None)
            node.children[name] = d
            return d
        return child

    def _adopt(self, d: Dataset, path: str, fillvalue: Any) -> None:
        st = self._node.state
        d._h5name = path
        d._h5state = st
        d._fill = fillvalue
        st.datasets[id(d)] = d

    # -- h5py's names
    @property
    def name(self) -> str:
        """The h5py path: ``"/"`` for the file, ``"/a/b"`` for a group."""
        return self._node.path

    @property
    def file(self) -> "H5TmpFile | None":
        ref = self._node.state.file_ref
        return None if ref is None else ref()

    @property
    def filename(self) -> str:
        """The file's directory (persistent) or its scratch label."""
        return self._node.state.filename

    @property
    def parent(self) -> "Group":
        f = self.file
        if f is None:
            raise ChemIOError(f"group {self.name!r}: its file is closed")
        return f[self.name.rsplit("/", 1)[0] or "/"]

    @property
    def attrs(self) -> GroupAttrs:
        """The group's attributes (a mapping of str to JSON values)."""
        return GroupAttrs(self)

    # -- mapping
    def __getitem__(self, name: Any) -> Any:
        node, last = self._walk(name, f"group {self.name!r}[{name!r}]")
        if last is None:
            return Group(node)
        if last not in node.children:
            raise NotFoundError(f"no object {last!r} in group {node.path!r} (asked for "
                                f"{name!r}); it has {sorted(node.children)[:20]}")
        return self._wrap(node, last, node.children[last])

    def __setitem__(self, name: Any, obj: Any) -> None:
        """``g[name] = array`` makes a dataset holding it (h5py's meaning)."""
        if isinstance(obj, (Group, DiskArray)):
            raise ArgumentError(f"group {self.name!r}[{name!r}] = {type(obj).__name__}: chemio "
                                f"groups hold no links; copy the data instead "
                                f"(g.create_dataset(name, data=np.asarray(d))); nothing changed")
        self.create_dataset(name, data=obj)

    def __delitem__(self, name: Any) -> None:
        node, last = self._walk(name, f"del group {self.name!r}[{name!r}]")
        if last is None or last not in node.children:
            raise NotFoundError(f"cannot delete {name!r} from group {self.name!r}: no such "
                                f"object; nothing changed")
        if not node.state.writable:
            raise ModeError(f"del {name!r}: {node.state.filename!r} is open read-only; "
                            f"nothing changed")
        child = node.children[last]
        _remove(node.state, child)
        del node.children[last]

    def __contains__(self, name: object) -> bool:
        try:
            node, last = self._walk(name, "in")
        except (NotFoundError, ArgumentError):
            return False
        return last is None or last in node.children

    def __iter__(self) -> Iterator[str]:
        """The member names in h5py's default order (by name)."""
        return iter(sorted(self._live().children))

    def __len__(self) -> int:
        return len(self._live().children)

    def __bool__(self) -> bool:            # an empty group is still a group (h5py)
        return not self._node.state.closed

    def __repr__(self) -> str:
        st = self._node.state
        if st.closed:
            return f"<chemio Group {self._node.path!r} (closed)>"
        return f"<chemio Group {self._node.path!r} ({len(self)} members) in {st.filename!r}>"

    # -- creation
    def create_group(self, name: str, track_order: Any = None) -> "Group":
        """A new group (groups between made as needed); ``ArgumentError`` if it exists."""
        self._writable(f"create group {name!r}")
        node, last = self._walk(name, f"create_group({name!r})", create=True)
        if last is None or last in node.children:
            raise ArgumentError(f"create_group({name!r}): an object of that name already "
                                f"exists in {node.path!r}; nothing changed")
        return Group(self._new_group(node, last))

    def require_group(self, name: str) -> "Group":
        """The group ``name``, made if missing."""
        if name in self:
            g = self[name]
            if not isinstance(g, Group):
                raise ArgumentError(f"require_group({name!r}): {name!r} is a dataset, not a "
                                    f"group; nothing changed")
            return g
        return self.create_group(name)

    def create_dataset(self, name: Any, shape: Any = None, dtype: Any = None, data: Any = None,
                       chunks: Any = None, **h5py_kw: Any) -> Dataset:
        """A new dataset (a DiskArray): h5py's ``create_dataset`` (module docstring for
        what each h5py keyword means here); ``data`` is written into it."""
        bad = sorted(set(h5py_kw) - DATASET_KW)
        if bad:
            raise ArgumentError(f"create_dataset({name!r}) got keyword(s) {bad} that neither "
                                f"h5py's create_dataset nor chemio takes; it takes "
                                f"{sorted(DATASET_KW)} (see chemio_py.arrays.container); "
                                f"nothing created")
        self._writable(f"create dataset {name!r}")
        _, parts = _parts(name, f"create_dataset({name!r})")
        if not parts:
            raise ArgumentError(f"create_dataset({name!r}): give the dataset a name; "
                                f"nothing created")
        arr = None
        if data is not None:
            arr = data if isinstance(data, np.ndarray) else np.asarray(data)
        if dtype is None:
            dt = arr.dtype if arr is not None else np.dtype("f4")
        else:
            dt = np.dtype(dtype)
        if shape is None:
            if arr is None:
                raise ArgumentError(f"create_dataset({name!r}): give shape= or data=; "
                                    f"nothing created")
            shp: tuple = arr.shape
        else:
            shp = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
            shp = _meta.check_shape(shp, "shape")
            if arr is not None and arr.size != math.prod(shp):
                raise ArgumentError(f"create_dataset({name!r}): data of shape {arr.shape} "
                                    f"does not fit shape {shp}; nothing created")
            if arr is not None:
                arr = arr.reshape(shp)
        if arr is not None and arr.dtype != dt:
            arr = arr.astype(dt)
        if chunks is True or chunks is False:
            chunks = None
        if chunks is not None:
            ch = (chunks,) if isinstance(chunks, (int, np.integer)) else tuple(chunks)
            if len(ch) != len(shp):
                raise ArgumentError(f"create_dataset({name!r}): chunks {ch} must have one "
                                    f"entry per axis of shape {shp}; nothing created")
            chunks = tuple(max(1, min(int(c), max(1, n))) for c, n in zip(ch, shp))
        maxshape = h5py_kw.get("maxshape")
        if maxshape is not None:
            maxshape = (maxshape,) if isinstance(maxshape, (int, np.integer)) or \
                maxshape is None else tuple(maxshape)
        fillvalue = h5py_kw.get("fillvalue")
        st = self._node.state
        be = st.backend or config.backend_for(None).value
        checksum = bool(st.options.get("checksum", False))
        if h5py_kw.get("fletcher32") and be in CHECKSUM_BACKENDS and maxshape is None:
            checksum = True
        node, last = self._walk(name, f"create_dataset({name!r})", create=True)
        assert last is not None
        if last in node.children:
            raise ArgumentError(f"create_dataset({name!r}): an object of that name already "
                                f"exists in group {node.path!r} (h5py refuses this too); "
                                f"delete it first (del g[{name!r}]); nothing created")
        opts = {k: v for k, v in st.options.items() if k != "checksum"}
        kw: dict = dict(chunks=chunks, backend=st.backend, comm=st.comm, checksum=checksum,
                        **opts)
        if maxshape is not None:
            kw["maxshape"] = maxshape
        if node.dir is not None:
            d = cast(Dataset, Dataset.create(escape(last), shp, dt, path=node.dir, **kw))
        elif st.dir is not None and be not in RAM_BACKENDS:
            d = cast(Dataset, Dataset.create(st.next_name(last), shp, dt,
                                             path=jobs.job_dir(st.dir), **kw))
            jobs.own(d.path)
            if d.meta_path != d.path:
                jobs.own(d.meta_path)
        else:
            d = cast(Dataset, Dataset.create(st.next_name(last), shp, dt, **kw))
        try:
            if fillvalue is not None and np.asarray(fillvalue).any() and d.size:
                fill(d, tuple(slice(0, n) for n in shp), fillvalue)
            if arr is not None and arr.size:
                d.write(tuple(slice(0, n) for n in shp), arr)
            elif arr is not None and not shp:
                d[()] = arr
        except BaseException:
            d.delete()
            raise
        self._adopt(d, node.child_path(last), fillvalue)
        node.children[last] = d
        return d

    def require_dataset(self, name: Any, shape: Any, dtype: Any, exact: bool = False,
                        **kw: Any) -> Dataset:
        """The dataset ``name`` if it has ``shape`` and a ``dtype`` it casts to (equal
        with ``exact=True``), else a new one from ``create_dataset(name, shape, dtype,
        **kw)``; ``ArgumentError`` when one exists that does not fit."""
        if name not in self:
            return self.create_dataset(name, shape, dtype, **kw)
        d = self[name]
        if not isinstance(d, Dataset):
            raise ArgumentError(f"require_dataset({name!r}): {name!r} is a group; "
                                f"nothing changed")
        shp = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        if tuple(d.shape) != shp:
            raise ArgumentError(f"require_dataset({name!r}): it exists with shape {d.shape}, "
                                f"not {shp}; nothing changed")
        dt = np.dtype(dtype)
        if (exact and d.dtype != dt) or (not exact and not np.can_cast(d.dtype, dt)):
            raise ArgumentError(f"require_dataset({name!r}): it exists with dtype {d.dtype}, "
                                f"which is not {'' if exact else 'castable to '}{dt}; "
                                f"nothing changed")
        return d

    def get(self, name: Any, default: Any = None) -> Any:
        try:
            return self[name]
        except NotFoundError:
            return default

    def visit_datasets(self) -> Iterator[Dataset]:
        """Every dataset below this group (opening persistent ones)."""
        for k in list(self):
            v = self[k]
            if isinstance(v, Group):
                yield from v.visit_datasets()
            else:
                yield v


def _remove(st: _State, child: Any) -> None:
    """Remove a dataset or a group tree from storage."""
    if isinstance(child, _Node):
        child.load()
        for c in list(child.children.values()):
            _remove(st, c)
        child.children.clear()
        if child.dir is not None:
            jobs.remove_path(child.dir)
        return
    if isinstance(child, str):
        child = DiskArray.open(child, "r+", comm=st.comm)
    st.datasets.pop(id(child), None)
    child.delete()


# ---------------------------------------------------------------- the file

def private_comm() -> Any:
    """The communicator of a process-private file: MPI's ``COMM_SELF`` under MPI, else the
    serial one."""
    c = _comm.comm()
    if c.mpi is None:
        return _comm.SerialComm()
    from mpi4py import MPI
    return MPI.COMM_SELF


class H5TmpFile(Group):
    """An h5py-shaped container of DiskArrays (module docstring): scratch without
    ``filename`` (removed on close), a persistent directory with one.

    ``backend`` chooses the backend of its datasets (``None``: the configured one);
    ``dir`` puts a scratch file's datasets in a job directory under ``dir`` (file backends;
    ``shm``/``auto`` keep RAM); ``comm`` as the module docstring says under MPI;
    ``checksum=True`` gives every dataset CRC-32s; other ``settings`` are h5py ``File``
    keywords (ignored) or backend options given to each ``DiskArray.create``.
    ``prefix``/``suffix`` are taken as PySCF's ``lib.H5TmpFile`` takes them (they only
    label a scratch file).
    """

    def __init__(self, filename: Any = None, mode: str = "a", *, backend: str | None = None,
                 dir: Any = None, comm: Any = None, prefix: str = "", suffix: str = "",
                 **settings: Any):
        options = {k: v for k, v in settings.items() if k not in FILE_KW}
        if backend is not None:
            _backends.resolve(backend)          # an unknown backend fails here
            known = _backends.backend_capabilities(_backends.resolve(backend)).array_options
            bad = sorted(set(options) - set(known) - {"checksum"})
            if bad:
                raise ArgumentError(f"H5TmpFile got setting(s) {bad}: neither h5py.File "
                                    f"keywords nor options of backend {backend!r} (it takes "
                                    f"{sorted(known)} and checksum=); nothing created")
        if mode not in ("r", "r+", "w", "w-", "x", "a"):
            raise ArgumentError(f"H5TmpFile mode {mode!r} is not one of 'r', 'r+', 'w', "
                                f"'w-', 'x', 'a' (h5py's); nothing created")
        c = private_comm() if comm is None else comm
        if filename is None:
            st = _State(filename=f"<chemio scratch {prefix}h5tmp{suffix}>", persistent=False,
                        writable=True, backend=backend, comm=c,
                        dir=None if dir is None else os.fspath(dir), options=options)
            root = _Node(st, "/", None)
        else:
            path = os.path.abspath(os.path.expanduser(os.fspath(filename)))
            writable = _open_dir(path, mode)
            st = _State(filename=path, persistent=True, writable=writable, backend=backend,
                        comm=c, dir=None, options=options)
            root = _Node(st, "/", path)
        super().__init__(root)
        st.file_ref = weakref.ref(self)
        self._finalizer = weakref.finalize(self, _release_quietly, st)
        self._finalizer.atexit = False      # at exit chemio's cleanup removes the scratch
        if filename is not None:
            root.load()

    @property
    def mode(self) -> str:
        """'r+' when writable, else 'r' (h5py's)."""
        return "r+" if self._node.state.writable else "r"

    @property
    def persistent(self) -> bool:
        return self._node.state.persistent

    @property
    def closed(self) -> bool:
        return self._node.state.closed

    def flush(self) -> None:
        """Wait for the datasets' outstanding requests; a persistent file's writes are also
        made durable (a scratch file's need not be)."""
        st = self._live().state
        for d in list(st.datasets.values()):
            if d.closed:
                continue
            if st.persistent or d.outstanding:
                d.flush()

    def close(self) -> None:
        """Close every dataset; a scratch file's data is removed. Idempotent."""
        self._finalizer.detach()
        self._node.state.release()

    def __enter__(self) -> "H5TmpFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        st = self._node.state
        kind = "persistent" if st.persistent else "scratch"
        state = "closed" if st.closed else f"{len(self)} members"
        return f"<chemio H5TmpFile {st.filename!r} ({kind}, {state})>"


def _open_dir(path: str, mode: str) -> bool:
    """Prepare the directory of a persistent file for ``mode``; True when writable."""
    doc = os.path.join(path, GROUP_DOC)
    exists = os.path.isdir(path) and os.path.isfile(doc)
    if mode in ("r", "r+"):
        if not exists:
            raise NotFoundError(f"H5TmpFile({path!r}, {mode!r}): no chemio H5TmpFile there "
                                f"(a directory with {GROUP_DOC}); create it with mode 'a'")
        read_group_doc(path)
        return mode == "r+"
    if mode in ("w-", "x"):
        if os.path.lexists(path):
            raise ArgumentError(f"H5TmpFile({path!r}, {mode!r}): {path!r} exists; use mode "
                                f"'a' to open it or 'w' to replace it; nothing changed")
    if mode == "w" and os.path.lexists(path):
        if not exists:
            raise ArgumentError(f"H5TmpFile({path!r}, 'w'): {path!r} exists and is not a "
                                f"chemio H5TmpFile; chemio replaces only its own; nothing "
                                f"changed")
        read_group_doc(path)
        jobs.remove_path(path)
        exists = False
    if os.path.lexists(path) and not exists:
        raise ArgumentError(f"H5TmpFile({path!r}, {mode!r}): {path!r} exists and is not a "
                            f"chemio H5TmpFile (a directory with {GROUP_DOC}); choose another "
                            f"name; nothing changed")
    if not exists:
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            raise ArgumentError(f"H5TmpFile({path!r}): directory {parent!r} does not exist; "
                                f"create it first")
        os.mkdir(path, 0o777)
        write_group_doc(path, {})
    else:
        read_group_doc(path)
    return True
