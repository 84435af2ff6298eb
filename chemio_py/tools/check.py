"""``chemio check PATH``: verify a persistent DiskArray or a RecordFile without trusting it.

* A **DiskArray** is named by its data file (``x.dra``) or its metadata (``x.dra.json``):
  the metadata must be valid (``chemio_py.arrays.meta``), the data file present, a regular file,
  and exactly as large as the raw grid layout of its shape, dtype and chunks; an array
  created with ``checksum=True`` also needs its checksum file (``<data>.crc``, 4 bytes per
  chunk). ``--read`` also reads every byte and counts the chunks that are all zero (fine:
  unwritten elements read as zero), and with checksums checks the CRC-32 of every chunk
  (each mismatch is a problem naming the chunk, its offset, the expected and found CRC).
* A **RecordFile**: its commit slots, the index of the commit it opens at (trailer, CRC,
  page table inside the file), every page (readable, decompresses, CRC), every record
  (parses, the count matches the index).
* A **Zarr v3 array** (a directory holding ``zarr.json``: a DiskArray on the ``zarr``
  backend, or any Zarr v3 array): its metadata (parsed within bounds, as the backend
  reads it; a chemio document among its attributes must agree), then every stored object
  read and decoded as a reader would, bounded to its size: shard indexes and their CRC32C,
  every inner chunk decoding to exactly its size, ``crc32c`` codecs checked (always: only
  decoding finds damage in compressed objects, so ``--read`` adds nothing here). Entries
  in the array's directory that are no object of it are listed as notes (one where a key
  directory belongs is a problem: readers refuse it).

Nothing is trusted: files are opened without following links and without blocking (a
FIFO or a link to ``/dev/zero`` is reported, not read), and every size read from a file is
checked against the file before anything is allocated. Exit status: 0 when everything
checked is fine, 1 when something is wrong (each problem is named), 2 when ``PATH`` is
missing or is not a chemio file. ``--json`` prints one JSON object instead of text. While
it reads data (``--read``, a RecordFile's pages) a progress bar shows on a terminal.

Run as ``chemio check PATH`` (``add_arguments`` + ``run``, a row of ``cli.COMMANDS``) or
``python -m chemio_py.tools.check PATH``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import stat as _stat
import sys
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from chemio_py.arrays import meta as _meta
from chemio_py.errors import ChemIOError
from chemio_py.runtime.progress import AUTO, Progress
from chemio_py.runtime.ownfiles import NotARegularFile, kind, open_regular, read_small

MAX_PROBLEMS = 50                 # listed one by one; the rest are counted
MAX_ZERO_SCAN_CHUNKS = 1 << 20    # --read counts all-zero chunks up to this many chunks
BLOCK = 4 << 20
DESCRIPTION = ("verify a persistent DiskArray (data file or .json metadata), a Zarr v3 array "
               "(its directory) or a RecordFile without trusting it; exit status 0: fine, "
               "1: something is wrong (each problem named), 2: the path is missing or not "
               "a chemio file")
_EXPECTED = (ChemIOError, OSError, ValueError, MemoryError, OverflowError)


@dataclass
class Report:
    """What ``check`` looked at: ``checked`` (fine), ``problems`` (wrong), ``notes``."""
    path: str
    kind: str | None = None
    checked: list = field(default_factory=list)
    problems: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    facts: dict = field(default_factory=dict)
    usage_error: str | None = None
    _more: int = 0

    def ok(self, what: str) -> None:
        self.checked.append(what)

    def bad(self, what: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(what)
        else:
            self._more += 1

    @property
    def status(self) -> int:
        if self.usage_error is not None:
            return 2
        return 1 if self.problems or self._more else 0

    def to_dict(self) -> dict:
        probs = list(self.problems)
        if self._more:
            probs.append(f"... and {self._more} more problems")
        return {"path": self.path, "kind": self.kind, "status": self.status,
                "ok": self.status == 0, "checked": self.checked, "problems": probs,
                "notes": self.notes, "facts": self.facts, "usage_error": self.usage_error}

    def text(self) -> str:
        d = self.to_dict()
        lines = [f"chemio check {self.path}"]
        if self.usage_error is not None:
            lines.append(f"  error: {self.usage_error}")
            return "\n".join(lines)
        lines.append(f"  kind: {self.kind}")
        for k, v in self.facts.items():
            lines.append(f"  {k}: {v}")
        lines += [f"  ok       {c}" for c in self.checked]
        lines += [f"  note     {n}" for n in self.notes]
        lines += [f"  PROBLEM  {p}" for p in d["problems"]]
        n = len(self.problems) + self._more
        lines.append("result: OK" if n == 0 else
                     f"result: DAMAGED ({n} problem{'s' if n != 1 else ''})")
        return "\n".join(lines)


# ---------------------------------------------------------------- reading without trust

def _pread_exact(fd: int, off: int, n: int, path: str) -> bytes:
    """``n`` bytes at ``off`` (the caller has checked the range against the file size)."""
    out = bytearray()
    while len(out) < n:
        b = os.pread(fd, min(n - len(out), BLOCK), off + len(out))
        if not b:
            raise ChemIOError(f"{path!r}: short read at offset {off + len(out)} (the file "
                              f"shrank while being checked?)")
        out += b
    return bytes(out)


def _pread_into(fd: int, off: int, out: np.ndarray, path: str) -> None:
    # numpy's stubs make ndarray a Buffer for Python 3.12+ only
    mv = memoryview(out).cast("B")  # type: ignore[arg-type]
    done = 0
    while done < len(mv):
        n = os.preadv(fd, [mv[done:done + BLOCK]], off + done)
        if n <= 0:
            raise ChemIOError(f"{path!r}: short read at offset {off + done}")
        done += n


# ---------------------------------------------------------------- DiskArray

def check_diskarray(rep: Report, mpath: str, dpath: str | None, read_all: bool,
                    progress: Any = False) -> None:
    rep.kind = "DiskArray"
    try:
        text = read_small(mpath, _meta.MAX_BYTES)
    except FileNotFoundError:
        rep.bad(f"metadata {mpath!r} is missing: the array cannot be opened (an interrupted "
                f"create leaves data without metadata; delete the data file and recreate the "
                f"array)")
        return
    except NotARegularFile as e:
        rep.bad(f"metadata {mpath!r} {e.strerror}; it was not written by chemio")
        return
    except ValueError as e:
        rep.bad(f"metadata: {e}")
        return
    except OSError as e:
        rep.bad(f"metadata {mpath!r} cannot be read: {e}")
        return
    try:
        m = _meta.loads(text, repr(mpath))
    except _EXPECTED as e:
        rep.bad(str(e))
        return
    rep.ok(f"metadata {mpath!r}: valid (format {m.format}, shape {list(m.shape)}, dtype "
           f"{m.dtype}, chunks {list(m.chunks)}, backend {m.backend!r})")
    rep.facts.update({"shape": list(m.shape), "dtype": str(m.dtype), "chunks": list(m.chunks),
                      "backend": m.backend, "nbytes": m.nbytes})
    if dpath is None:
        guess = mpath[:-len(".json")]
        dpath = guess if os.path.lexists(guess) else os.path.join(os.path.dirname(mpath),
                                                                   m.data)
    elif os.path.basename(dpath) != m.data:
        rep.notes.append(f"the metadata names its data {m.data!r}, the file checked is "
                         f"{os.path.basename(dpath)!r} (renamed?)")
    rep.facts["data"] = dpath
    rep.facts["checksum"] = (f"{m.checksum} per chunk" if m.checksum else
                             "none (created without checksum=True)")
    if m.layout != "grid":
        rep.notes.append(f"format {m.layout!r} (backend {m.backend!r}) is its store's own: "
                         f"only the metadata was checked")
        return
    try:
        fd = open_regular(dpath)
    except FileNotFoundError:
        rep.bad(f"data file {dpath!r} is missing: restore it or delete the metadata")
        return
    except NotARegularFile as e:
        rep.bad(f"data file {dpath!r} {e.strerror}")
        return
    except OSError as e:
        rep.bad(f"data file {dpath!r} cannot be opened: {e}")
        return
    try:
        size = os.fstat(fd).st_size
        rep.facts["file_bytes"] = size
        if size != m.nbytes:
            how = "truncated" if size < m.nbytes else "longer than the array"
            rep.bad(f"data file {dpath!r} has {size} bytes but the layout of shape "
                    f"{list(m.shape)} {m.dtype} needs exactly {m.nbytes} ({how})")
            return
        rep.ok(f"data file {dpath!r}: a regular file of exactly {size} bytes (the raw grid "
               f"layout)")
        cfd = _open_checksums(rep, dpath, m) if m.checksum else None
        if m.checksum and cfd is None:
            return
        try:
            if read_all:
                if cfd is None:
                    rep.notes.append("the array has no checksums (created without "
                                     "checksum=True): the bytes were read, but damage inside "
                                     "a chunk cannot be detected")
                _read_chunks(rep, fd, dpath, m, progress, cfd)
        finally:
            if cfd is not None:
                os.close(cfd)
    finally:
        os.close(fd)


def _open_checksums(rep: Report, dpath: str, m: Any) -> int | None:
    """The descriptor of the checksum file of a checksummed array, if it is sound."""
    from chemio_py.arrays.checksums import crc_path
    from chemio_py.backends.grid import Layout
    cpath = crc_path(dpath)
    want = 4 * math.prod(Layout(m.shape, m.chunks, m.dtype.itemsize).grid)
    try:
        cfd = open_regular(cpath)
    except FileNotFoundError:
        rep.bad(f"checksum file {cpath!r} is missing (the metadata says the array has "
                f"{m.checksum} checksums): restore it, or the array cannot be opened")
        return None
    except (NotARegularFile, OSError) as e:
        rep.bad(f"checksum file {cpath!r} cannot be opened: {e}")
        return None
    size = os.fstat(cfd).st_size
    if size != want:
        os.close(cfd)
        rep.bad(f"checksum file {cpath!r} has {size} bytes but the array needs exactly "
                f"{want} (4 per chunk)")
        return None
    rep.ok(f"checksum file {cpath!r}: a regular file of exactly {want} bytes (one "
           f"{m.checksum} per chunk)")
    return cfd


def _chunk_runs(lay: Any) -> Any:
    """(grid index, offset, nbytes) of every chunk, in file order (= chunk number order)."""
    off = 0
    for index in np.ndindex(*lay.grid):
        n = math.prod(lay.chunk_extent(index)) * lay.itemsize
        yield index, off, n
        off += n


def _read_chunks(rep: Report, fd: int, path: str, m: Any, progress: Any = False,
                 cfd: int | None = None) -> None:
    from chemio_py.arrays.checksums import zero_crc
    from chemio_py.backends.grid import Layout
    lay = Layout(m.shape, m.chunks, m.dtype.itemsize)
    nchunks = math.prod(lay.grid)
    buf = np.empty(min(BLOCK, max(lay.nbytes, 1)), np.uint8)
    runs: Any
    if cfd is None and (nchunks == 0 or nchunks > MAX_ZERO_SCAN_CHUNKS):
        runs = [(None, 0, lay.nbytes)]      # one run: readable, zero chunks not counted
    else:
        runs = _chunk_runs(lay)
    zero = verified = mismatched = 0
    with Progress(progress, lay.nbytes, f"check {os.path.basename(path)}") as bar:
        for number, (index, off, n) in enumerate(runs):
            allzero = True
            crc = 0
            done = 0
            while done < n:
                k = min(n - done, len(buf))
                try:
                    _pread_into(fd, off + done, buf[:k], path)
                except _EXPECTED as e:
                    rep.bad(f"data file {path!r}: read of {k} bytes at offset {off + done} "
                            f"failed: {e}")
                    return
                if allzero and buf[:k].any():
                    allzero = False
                if cfd is not None:
                    crc = zlib.crc32(buf[:k], crc)  # type: ignore[arg-type]
                done += k
                bar.update(k)
            zero += allzero
            if cfd is not None:
                try:
                    raw = _pread_exact(cfd, 4 * number, 4, path + ".crc")
                except _EXPECTED as e:
                    rep.bad(f"checksum of chunk {list(index)} cannot be read: {e}")
                    return
                expected = int.from_bytes(raw, "little") ^ zero_crc(n)
                verified += 1
                if crc != expected:
                    mismatched += 1
                    rep.bad(f"checksum mismatch: chunk {list(index)} (number {number}, {n} "
                            f"bytes at offset {off}) has CRC32 {crc:#010x}, expected "
                            f"{expected:#010x}: its data (or its checksum) is damaged")
    rep.ok(f"data: all {lay.nbytes} bytes read")
    if cfd is not None:
        rep.facts["chunks_verified"] = verified
        rep.facts["checksum_mismatches"] = mismatched
        if not mismatched:
            rep.ok(f"checksums: all {verified} chunks match their {m.checksum}")
    if cfd is not None or nchunks <= MAX_ZERO_SCAN_CHUNKS and nchunks:
        rep.facts["chunks_all_zero"] = f"{zero} of {nchunks}"
        if zero:
            rep.notes.append(f"{zero} of {nchunks} chunks are all zero (never written, or "
                             f"written with zeros): fine, unwritten elements read as zero")


# ---------------------------------------------------------------- Zarr v3 arrays

ZARR_META = "zarr.json"


def _is_zarr_dir(path: str) -> bool:
    """Whether directory ``path`` is meant to be a Zarr v3 array: it holds a ``zarr.json``
    entry (whatever its state) or is named ``*.zarr``."""
    return path.endswith(".zarr") or os.path.lexists(os.path.join(path, ZARR_META))


def check_zarr(rep: Report, path: str, progress: Any = False) -> None:
    """Check the Zarr v3 array at directory ``path`` (see the module docstring)."""
    from chemio_py.backends.zarr.format import compressor_of, read_meta
    rep.kind = "Zarr v3 array"
    mpath = os.path.join(path, ZARR_META)
    try:
        be = _zarr_backend()
    except ChemIOError as e:
        rep.usage_error = f"{path!r} is a Zarr array, but it cannot be checked here: {e}"
        return
    try:
        m = read_meta(path)
    except _EXPECTED as e:
        rep.bad(f"metadata: {e}")
        return
    comp = compressor_of(m)
    rep.ok(f"metadata {mpath!r}: a valid Zarr v3 array (shape {list(m.shape)}, dtype "
           f"{m.dtype}, chunks {list(m.chunks)}"
           + (f", shards of inner chunks {list(m.shard.inner)}" if m.shard else "") + ")")
    rep.facts.update({"shape": list(m.shape), "dtype": str(m.dtype), "chunks": list(m.chunks),
                      "codecs": "none" if comp is None else comp["id"],
                      "nbytes": math.prod(m.shape) * m.dtype.itemsize})
    if m.shard is not None:
        rep.facts["inner_chunks"] = list(m.shard.inner)
    if isinstance(m.attributes.get("chemio"), dict):
        try:
            _meta.from_description(be.describe(path), path, "zarr", "zarr-v3")
        except _EXPECTED as e:
            rep.bad(f"chemio's metadata among the attributes of {mpath!r}: {e}")
        else:
            rep.ok("chemio's metadata among its attributes: valid and agrees with the array")
    try:
        store = be.open_array(path, "r", shape=m.shape, dtype=m.dtype, chunks=m.chunks)
    except _EXPECTED as e:
        rep.bad(f"the array cannot be opened: {e}")
        return
    _check_zarr_objects(rep, store, m, path, progress)


def _zarr_backend() -> Any:
    """The ``zarr`` backend (``BackendUnavailableError`` when it cannot run here)."""
    import chemio_py.backends as backends
    return backends.resolve("zarr")


def _check_zarr_objects(rep: Report, store: Any, m: Any, path: str, progress: Any) -> None:
    grid = m.grid
    total = math.prod(grid)
    strays: list = []
    stored = damaged = nbytes = 0
    try:
        with Progress(progress, None, f"check {os.path.basename(path)}") as bar:
            try:
                for index in store.stored_objects(strays):
                    try:
                        n = store.verify_object(index)
                    except _EXPECTED as e:
                        damaged += 1
                        rep.bad(str(e))
                        continue
                    stored += n > 0
                    nbytes += n
                    bar.update(n)
            except _EXPECTED as e:
                rep.bad(f"the array directory {path!r} could not be walked: {e}")
    finally:
        store.close()
    rep.facts["objects"] = f"{stored + damaged} stored of {total}"
    rep.facts["stored_bytes"] = nbytes
    what = "shard index and its CRC32C checked, every inner chunk" if m.shard is not None \
        else "each"
    if not damaged:
        rep.ok(f"objects: all {stored} stored read and decoded ({what} to exactly its size); "
               f"the {total - stored} not stored read as the fill value")
    for where, why, serious in strays:
        text = f"{where!r} is {why}" if where else why
        if serious:
            rep.bad(text)
        else:
            rep.notes.append(text)


# ---------------------------------------------------------------- RecordFile

def check_recordfile(rep: Report, path: str, fd: int, size: int,
                     progress: Any = False) -> None:
    from chemio_py.files import recordformat
    rep.kind = "RecordFile"
    where = f"record file {path!r}"
    rep.facts["file_bytes"] = size

    def read_at(off: int, n: int) -> bytes:
        if off < 0 or n < 0 or off + n > size:
            raise ChemIOError(f"{where}: asked to read {n} bytes at {off}, outside the file")
        return _pread_exact(fd, off, n, path)

    head = read_at(0, min(size, 8))
    if head == recordformat.HMAGIC and size >= recordformat.HEADER:
        rep.facts["format"] = 2
        slots = []
        for j, so in enumerate(recordformat.SLOT_OFFSETS):
            raw = read_at(so, recordformat.SLOT.size)
            magic, gen, tpos, flags, crc = recordformat.SLOT.unpack(raw)
            if magic == recordformat.SMAGIC and zlib.crc32(raw[:-4]) == crc:
                slots.append(f"slot {j}: generation {gen}{' durable' if flags & 1 else ''}, "
                             f"index trailer at {tpos}")
            elif raw == bytes(recordformat.SLOT.size):
                slots.append(f"slot {j}: empty")
            else:
                slots.append(f"slot {j}: INVALID (torn or damaged)")
        rep.facts["commit_slots"] = slots
    elif head != recordformat.HMAGIC:
        rep.facts["format"] = 1
        rep.notes.append("format 1 (written by an earlier chemio_py): pages carry no "
                         "checksums, so damage inside a page may go unnoticed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            idx = recordformat.read_index(read_at, size, where, fix="the file is damaged")
        except _EXPECTED as e:
            rep.bad(str(e))
            return
    for n in idx.notes:
        rep.notes.append(n)
    if idx.recovered:
        rep.bad(idx.recovered)
    rep.facts.update({"page_size": idx.page_size,
                      "compressor": None if idx.codec is None else idx.codec.codec_id,
                      "pages": len(idx.pages), "records": idx.records,
                      "stream_bytes": idx.stream})
    if idx.version == 2:
        rep.facts["generation"] = idx.generation
        rep.facts["durable"] = idx.durable
    rep.ok(f"index at {idx.ioff}: trailer, CRC, {len(idx.pages)} page entries inside the "
           f"file and not overlapping, {idx.records} records in {idx.stream} stream bytes")
    if size > idx.end:
        rep.notes.append(f"{size - idx.end} bytes follow the committed index (appended after "
                         f"the last commit and never committed: an interrupted run); they "
                         f"are ignored and reclaimed by the next commit")
    _check_pages_and_records(rep, idx, read_at, fd, path, where, progress)


def _check_pages_and_records(rep: Report, idx: Any, read_at: Any, fd: int, path: str,
                             where: str, progress: Any = False) -> None:
    from chemio_py.files import recordformat
    pages = idx.pages
    maxraw = max((p[2] for p in pages), default=0)
    maxstored = max((p[1] for p in pages if p[3]), default=0)
    comp = np.empty(maxstored, np.uint8) if maxstored else None
    page = np.empty(maxraw, np.uint8)
    bad_pages: list[int] = []
    state = {"next": 0}

    bar = Progress(progress, sum(p[1] if p[3] else p[2] for p in pages),
                   f"check {os.path.basename(path)}")

    def load(i: int) -> np.ndarray:
        off, stored, raw, flag, _ = pages[i]
        if flag:
            assert comp is not None             # a compressed page: maxstored > 0
            _pread_into(fd, off, comp[:stored], path)
        else:
            _pread_into(fd, off, page[:raw], path)
        bar.update(stored if flag else raw)
        return recordformat.decode_page(idx.codec, pages[i], comp, page, where, i,
                                        idx.checksum)

    def feed():
        for i in range(len(pages)):
            state["next"] = i + 1
            try:
                yield i, load(i)
            except _EXPECTED as e:
                bad_pages.append(i)
                rep.bad(f"page {i}: {e}")
                raise _PageFailed() from None

    n = 0
    records_ok = False
    try:
        for _ in recordformat.iter_records(feed(), idx.records, idx.stream, where):
            n += 1
        records_ok = True
    except _PageFailed:
        pass
    except _EXPECTED as e:
        rep.bad(f"records: {e} (after {n} good records)")
    for i in range(state["next"], len(pages)):       # the pages the records did not reach
        try:
            load(i)
        except _EXPECTED as e:
            bad_pages.append(i)
            rep.bad(f"page {i}: {e}")
    bar.close()
    if not bad_pages:
        what = "read, decompressed and" if idx.codec is not None else "read and"
        crc = " checked against their CRC" if idx.version == 2 else " (no checksums in format 1)"
        rep.ok(f"pages: all {len(pages)} {what}{crc}")
    if records_ok:
        rep.ok(f"records: all {n} parse, as many as the index says")
    elif bad_pages:
        rep.notes.append(f"records were parsed up to the first damaged page ({n} good)")


class _PageFailed(Exception):
    pass


# ---------------------------------------------------------------- dispatch

def check_path(path: str, read_all: bool = False, progress: Any = False) -> Report:
    """Check ``path`` (see the module docstring); returns the report. ``progress``
    (``chemio_py.runtime.progress``) reports the bytes read while data is read."""
    from chemio_py.files import recordformat
    rep = Report(path=path)
    ap = os.path.abspath(os.path.expanduser(path))
    try:
        st = os.lstat(ap)
    except FileNotFoundError:
        if os.path.lexists(ap + ".json"):
            check_diskarray(rep, ap + ".json", ap, read_all, progress)
        else:
            rep.usage_error = f"{path!r} does not exist"
        return rep
    except OSError as e:
        rep.usage_error = f"{path!r} cannot be examined: {e}"
        return rep
    if _stat.S_ISDIR(st.st_mode) and _is_zarr_dir(ap):
        check_zarr(rep, ap, progress)
        return rep
    if _stat.S_ISREG(st.st_mode) and os.path.basename(ap) == ZARR_META:
        check_zarr(rep, os.path.dirname(ap), progress)
        return rep
    if not _stat.S_ISREG(st.st_mode):
        what = kind(st.st_mode)
        hint = ""
        if _stat.S_ISLNK(st.st_mode):
            try:
                what += f" (to {os.readlink(ap)!r})"
            except OSError:
                pass
            hint = "; chemio check does not follow links: pass the file itself"
        rep.usage_error = f"{path!r} is {what}, not a chemio file{hint}"
        return rep
    if ap.endswith(".json"):
        check_diskarray(rep, ap, None, read_all, progress)
        return rep
    try:
        fd = open_regular(ap)
    except (NotARegularFile, OSError) as e:
        rep.usage_error = f"{path!r} cannot be opened: {e}"
        return rep
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        if head == recordformat.HMAGIC:
            check_recordfile(rep, ap, fd, size, progress)
        elif os.path.lexists(ap + ".json"):
            check_diskarray(rep, ap + ".json", ap, read_all, progress)
        elif _looks_like_records(fd, size):
            check_recordfile(rep, ap, fd, size, progress)
        elif ap.endswith(".dra"):
            check_diskarray(rep, ap + ".json", ap, read_all, progress)
        else:
            rep.usage_error = (f"{path!r} is not a chemio file (no RecordFile header or trailer, "
                               f"no DiskArray metadata {os.path.basename(ap) + '.json'!r} beside "
                               f"it)")
    finally:
        os.close(fd)
    return rep


def _looks_like_records(fd: int, size: int) -> bool:
    """A format 1 record file (trailer at the end), or a format 2 file whose header magic
    is damaged but whose commit slots are recognisable."""
    from chemio_py.files import recordformat
    tail = recordformat.TRAILER.size
    if size >= tail and os.pread(fd, 8, size - tail) == recordformat.MAGIC:
        return True
    if size >= recordformat.HEADER:
        return any(os.pread(fd, 8, so) == recordformat.SMAGIC for so in recordformat.SLOT_OFFSETS)
    return False


# ---------------------------------------------------------------- command line

def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``chemio check``."""
    p.add_argument("path", help="a DiskArray data file (.dra), its metadata (.dra.json), a "
                   "Zarr v3 array (its directory), or a RecordFile")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--read", action="store_true", help="DiskArray: also read every byte, "
                   "count the all-zero chunks and, for an array with checksums, check "
                   "every chunk's CRC")


def run(args: argparse.Namespace) -> int:
    """Run the check of ``args.path``; print the report; return the exit status."""
    as_json = getattr(args, "json", False)
    rep = check_path(args.path, read_all=getattr(args, "read", False),
                     progress=False if as_json else AUTO)
    if as_json:
        print(json.dumps(rep.to_dict(), default=str))
    else:
        out = sys.stderr if rep.usage_error is not None else sys.stdout
        print(rep.text(), file=out)
    return rep.status


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="chemio check", description=DESCRIPTION)
    add_arguments(p)
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
