"""One corpus of hostile inputs for every reader of untrusted files (issue 27).

Each ``Hostile`` is something a damaged disk, a careless colleague or an attacker can leave
where chemio expects one of its own small files: JSON (``.dra.json`` metadata, the job
marker, leases, traces, the header of a RecordFile index) or TOML (``chemio.toml``).
Deep nesting, huge files, numbers that overflow, NaN, wrong types, binary garbage,
UTF-16, an empty file, a FIFO (a reader that opens it blindly blocks forever), a symbolic
link to ``/dev/zero`` (a reader that follows it reads forever) and a directory.

``tests/tools/test_hostile_inputs.py`` runs the whole corpus against every reader; a reader must
end each one with its chemio error (or a reported skip), never a traceback, and within a
bounded peak RSS.
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Hostile:
    """One hostile input: ``content`` written as a file, or a ``special`` file."""
    name: str
    content: bytes = b""
    special: str | None = None          # "fifo", "symlink" (to /dev/zero), "directory"
    valid_syntax: bool = False          # parses fine; only the reader's checks refuse it

    def make(self, path: str) -> None:
        """Create the hostile input at ``path`` (which must not exist), private to you."""
        if self.special == "fifo":
            os.mkfifo(path, 0o600)
        elif self.special == "symlink":
            os.symlink("/dev/zero", path)
        elif self.special == "directory":
            os.mkdir(path, 0o700)
        else:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                view = memoryview(self.content)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)


SPECIAL = [Hostile("fifo", special="fifo"), Hostile("symlink to /dev/zero", special="symlink"),
           Hostile("directory", special="directory")]


def json_corpus() -> list[Hostile]:
    """Hostile JSON documents (and special files) for every JSON reader."""
    return [
        Hostile("empty", b""),
        Hostile("binary", bytes(range(256)) * 4),
        Hostile("utf16", json.dumps({"format": 1, "magic": "chemio"}).encode("utf-16")),
        Hostile("nul byte", b'{"format": 1}\x00'),
        Hostile("deep array 2000", b"[" * 2000 + b"]" * 2000),          # fits 4 KiB limits
        Hostile("deep array 100k", b"[" * 100_000 + b"]" * 100_000),
        Hostile("deep object 100k", b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
        Hostile("unterminated string", b'["' + b'\\"' * 1500),
        Hostile("int 4000 digits", b'{"pid": ' + b"9" * 4000 + b"}"),
        Hostile("int 5000 digits", b'{"pid": ' + b"9" * 5000 + b"}"),   # past int()'s limit
        Hostile("10**400", b'{"ts": 1' + b"0" * 400 + b"}"),
        Hostile("float overflow", b'{"ts": 1e400, "dur": 1}'),
        Hostile("NaN", b'{"format": 1, "shape": [NaN]}'),
        Hostile("Infinity", b'{"ts": -Infinity}'),
        Hostile("a string", b'"just a string"', valid_syntax=True),
        Hostile("a list", b"[1, 2, 3]", valid_syntax=True),
        Hostile("null", b"null", valid_syntax=True),
        Hostile("wrong types", b'{"format": "1", "shape": "big", "pid": true, "host": [1], '
                               b'"magic": 7, "traceEvents": {"ph": "X"}}', valid_syntax=True),
        Hostile("huge 2 MiB", b'{"pad": "' + b"x" * (2 << 20) + b'"}'),
        Hostile("400k items", b"[" + b"0," * 400_000 + b"0]"),
    ] + SPECIAL


def toml_corpus() -> list[Hostile]:
    """Hostile ``chemio.toml`` files (and special files) for the configuration reader."""
    return [
        Hostile("deep array 100k", b"x = " + b"[" * 100_000 + b"]" * 100_000),
        Hostile("deep inline table 50k", b"x = " + b"{a=" * 50_000 + b"1" + b"}" * 50_000),
        Hostile("dotted key 100k", b"a" + b".a" * 100_000 + b" = 1\n"),
        Hostile("table header 100k", b"[" + b"a." * 100_000 + b"a]\n"),
        Hostile("int 5000 digits", b"io_threads = " + b"9" * 5000 + b"\n"),
        Hostile("float overflow", b"io_threads = 1e400\n", valid_syntax=True),
        Hostile("nan", b"io_threads = nan\n", valid_syntax=True),
        Hostile("wrong type: list", b"io_threads = [[1]]\n", valid_syntax=True),
        Hostile("wrong type: files", b"files = 5\n", valid_syntax=True),
        Hostile("binary", bytes(range(256)) * 4),
        Hostile("utf16", "io_threads = 4\n".encode("utf-16")),
        Hostile("not TOML", b"io_threads = = 4\n[[[\n"),
        Hostile("huge 2 MiB", b"# " + b"x" * (2 << 20) + b"\n"),
    ] + SPECIAL


# ---------------------------------------------------------------- RecordFile index headers

_SLOT = struct.Struct("<8sQQQI")
_TRAILER = struct.Struct("<8sQQII")


def _committed(data: bytes) -> tuple[int, int]:
    """(offset of the newest valid commit slot, trailer position) of a format 2 file."""
    best = None
    for so in (512, 1024):
        magic, gen, tpos, flags, crc = _SLOT.unpack_from(data, so)
        if magic == b"CIORECSL" and zlib.crc32(data[so:so + _SLOT.size - 4]) == crc:
            if best is None or gen > best[0]:
                best = (gen, so, tpos)
    assert best is not None, "no valid commit slot"
    return best[1], best[2]


def set_record_index_header(path: str, header: bytes) -> None:
    """Give the RecordFile at ``path`` a new, self-consistent index whose JSON header is
    ``header`` (the page table kept): a new index and trailer at the end of the file, the
    committed slot pointed at it, the other slot emptied, every CRC right. Only the
    header's content is hostile."""
    data = bytearray(open(path, "rb").read())
    so, tpos = _committed(bytes(data))
    magic, ioff, ilen, crc, jlen = _TRAILER.unpack_from(data, tpos)
    table = bytes(data[ioff + jlen:ioff + ilen])
    blob = header + table
    new_ioff = len(data)
    new_tpos = new_ioff + len(blob)
    data += blob + _TRAILER.pack(b"CIOREC01", new_ioff, len(blob), zlib.crc32(blob),
                                 len(header))
    m, gen, _, flags, _ = _SLOT.unpack_from(data, so)
    head = _SLOT.pack(m, gen, new_tpos, flags, 0)[:-4]
    data[so:so + _SLOT.size] = head + struct.pack("<I", zlib.crc32(head))
    other = 1024 if so == 512 else 512
    data[other:other + _SLOT.size] = bytes(_SLOT.size)     # no older commit to fall back to
    with open(path, "wb") as fh:
        fh.write(bytes(data))


def set_first_record_shape(path: str, shape: tuple[int, ...]) -> None:
    """Rewrite the shape of the first array of the first record of the (uncompressed,
    format 2) RecordFile at ``path`` -- same number of axes -- and fix the page's CRC in
    the index and the index's CRC: a hostile but self-consistent file."""
    data = bytearray(open(path, "rb").read())
    _, tpos = _committed(bytes(data))
    magic, ioff, ilen, icrc, jlen = _TRAILER.unpack_from(data, tpos)
    head = json.loads(bytes(data[ioff:ioff + jlen]))
    cols = (ilen - jlen) // 8 // head["pages"]
    off, stored, raw, flag, crc = struct.unpack_from("<5q", data, ioff + jlen)
    assert cols == 5 and flag == 0, "an uncompressed format 2 file"
    q = off + 16                                    # the first descriptor, after the prefix
    dl, nd = data[q], data[q + 1]
    assert nd == len(shape), f"the first array has {nd} axes"
    struct.pack_into(f"<{nd}q", data, q + 2 + dl, *shape)
    from chemio_py.files.recordformat import checksum_function    # the algorithm it names
    page_crc = checksum_function(head.get("checksum", "crc32"))(bytes(data[off:off + raw]))
    struct.pack_into("<q", data, ioff + jlen + 32, page_crc)
    blob = bytes(data[ioff:ioff + ilen])
    struct.pack_into("<8sQQII", data, tpos, magic, ioff, ilen, zlib.crc32(blob), jlen)
    with open(path, "wb") as fh:
        fh.write(bytes(data))
