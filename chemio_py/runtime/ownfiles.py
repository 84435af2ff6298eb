"""Chemio's own small files (leases, markers, metadata, objects) in hostile places.

A scratch directory is shared ground: a neighbour may leave a FIFO, a device or a symbolic
link where chemio expects one of its own files. ``read_small`` opens without following links
and without blocking, insists on a regular file, and reads at most ``limit`` bytes, so such a
file becomes an error that says what was found instead of a hang or an unbounded read.
"""
from __future__ import annotations

import errno
import os
import stat as _stat
from typing import Any

from chemio_py.errors import NotARegularFile  # noqa: F401 - raised here, imported from here too

_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)


def kind(mode: int) -> str:
    """What a non-regular file is, in words ("a FIFO", "a directory"...)."""
    for test, name in ((_stat.S_ISFIFO, "a FIFO"), (_stat.S_ISCHR, "a character device"),
                       (_stat.S_ISBLK, "a block device"), (_stat.S_ISSOCK, "a socket"),
                       (_stat.S_ISDIR, "a directory"), (_stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str, flags: int = os.O_RDONLY) -> int:
    """Open ``path`` as a regular file without following a final symlink or blocking.

    ``flags`` are the access flags (``os.O_RDONLY``, ``os.O_RDWR``...); the descriptor is
    returned in blocking mode. Raises ``NotARegularFile`` (an ``OSError``) for anything
    that is not a regular file, and the usual ``OSError`` when it cannot be opened.
    """
    try:
        fd = os.open(path, flags | (_FLAGS & ~os.O_RDONLY))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotARegularFile(errno.ELOOP, "is a symbolic link, not a regular file",
                                  path) from None
        if e.errno == errno.ENXIO:         # a FIFO with no writer opened for writing
            raise NotARegularFile(errno.ENXIO, "is a FIFO, not a regular file", path) from None
        raise
    try:
        st = os.fstat(fd)
        if not _stat.S_ISREG(st.st_mode):
            raise NotARegularFile(errno.EINVAL, f"is {kind(st.st_mode)}, not a regular file",
                                  path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bounded(fd: int, limit: int, what: str = "the file") -> bytes:
    """Read ``fd`` to its end; ``ValueError`` when it holds more than ``limit`` bytes."""
    chunks, left = [], limit + 1
    while left > 0:
        b = os.read(fd, min(left, 1 << 20))
        if not b:
            break
        chunks.append(b)
        left -= len(b)
    data = b"".join(chunks)
    if len(data) > limit:
        raise ValueError(f"{what} holds more than {limit} bytes; it is not a file chemio "
                         f"wrote")
    return data


def read_small(path: str, limit: int) -> bytes:
    """The whole content of regular file ``path``, which must hold at most ``limit`` bytes.

    Raises ``NotARegularFile`` for a FIFO, device, link..., ``ValueError`` when the file is
    larger than ``limit``, and ``OSError`` when it cannot be read.
    """
    fd = open_regular(path)
    try:
        return read_bounded(fd, limit, repr(path))
    finally:
        os.close(fd)


def write_all(fd: int, data: Any) -> None:
    """Write every byte of buffer ``data`` to ``fd`` (looping over short writes)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view):]
