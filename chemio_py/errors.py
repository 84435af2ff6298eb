"""The chemio_py exception hierarchy.

Every error names what was asked, what was found and, where there is one, what to do.
Errors that stand for an operating-system failure are also ``OSError`` (with ``errno``),
errors about bad arguments are also ``ValueError``, so callers can catch them either way.
"""
from __future__ import annotations

import concurrent.futures as _futures
import errno as _errno


UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def fmt_bytes(n: float | None, unit: str | None = None, *, bare: bool = False) -> str:
    """``n`` bytes for a reader, the one formatter of the package: ``"512 B"``, ``"1.5 MiB"``
    (the largest unit that keeps the figure at least 1); in ``unit`` (one of ``UNITS``) when
    given, ``fmt_bytes(n, "MiB")`` -> ``"0.5 MiB"``, and without the unit when ``bare`` (a
    column whose heading names it); ``"unknown"`` for None."""
    if n is None:
        return "unknown"
    if unit is None:
        k = 0
        while k < len(UNITS) - 1 and abs(n) >= 1024 ** (k + 1):
            k += 1
    elif unit in UNITS:
        k = UNITS.index(unit)
    else:
        raise ValueError(f"fmt_bytes() got unit {unit!r}; use one of {UNITS}")
    text = f"{n}" if k == 0 else f"{n / 1024 ** k:.1f}"
    return text if bare else f"{text} {UNITS[k]}"


class ChemIOError(Exception):
    """Base class of every error raised by chemio_py."""


class StorageError(ChemIOError, OSError):
    """An I/O call failed in a backend: carries errno, path, offset and size."""

    def __init__(self, err: int | None, path: str, offset: int | None = None,
                 size: int | None = None, op: str = "I/O", hint: str = "") -> None:
        self.offset = offset
        self.size = size
        self.op = op
        where = f" at offset {offset}" if offset is not None else ""
        what = f" of {size} bytes" if size is not None else ""
        code = _errno.errorcode.get(err or 0, err)        # (None: raised without an errno)
        msg = f"{op}{what}{where} failed: {code} ({_os_strerror(err)})"
        if hint:
            msg += f". {hint}"
        OSError.__init__(self, err, msg, path)

    def __str__(self) -> str:
        return f"{self.strerror}: {self.filename!r}"


def _os_strerror(err: int | None) -> str:
    import os
    if err is None:  # an OSError raised without an errno
        return "unknown error"
    try:
        return os.strerror(err)
    except ValueError:  # pragma: no cover
        return "unknown error"


class OutOfSpaceError(StorageError):
    """Not enough room on the device (or in the RAM budget) for what was asked."""

    def __init__(self, path: str, needed: int | None, free: int | None,
                 what: str = "write", hint: str | None = None):
        self.needed = needed
        self.free = free
        self.what = what
        if hint is None:
            hint = ("free space there, point CHEMIO_SCRATCH at a larger file system, "
                    "or lower the size hint")
        ChemIOError.__init__(self)
        OSError.__init__(self, _errno.ENOSPC,
                         f"out of space: {what} needs {fmt_bytes(needed)} "
                         f"({needed} bytes) but {fmt_bytes(free)} ({free} bytes) "
                         f"is free; {hint}", path)
        self.offset = None
        self.size = needed
        self.op = what


class UnobservedIOError(StorageError):
    """Asynchronous I/O of a file failed and nobody waited for it; raised (once) by the
    file's ``flush()`` or ``close()``. ``errors`` holds every such failure, the first is
    also the ``__cause__`` (its errno is kept; EIO when it has none)."""

    def __init__(self, path: str, errors: list[BaseException]):
        self.errors = list(errors)
        first = self.errors[0]
        err = getattr(first, "errno", None) or _errno.EIO
        size = getattr(first, "nbytes", None) if isinstance(first, EOFError) else \
            getattr(first, "size", None)
        n = len(self.errors)
        StorageError.__init__(
            self, err, path, getattr(first, "offset", None), size,
            f"{n} asynchronous request{'s' if n > 1 else ''} that nobody waited for (first: "
            f"{type(first).__name__}: {first})",
            "a failed write's data is not in the file and a failed read's buffer was not "
            "filled; wait() on each request to handle its error where it happens")


class SupersededError(ChemIOError):
    """The handle was closed because the same file was created again in this process
    (``DiskArray.create`` or ``ExclusiveFile(..., "w+")`` of a name still open)."""


class EndOfFileError(ChemIOError, EOFError):
    """A read reached past the end of a file."""

    def __init__(self, path: str, offset: int, nbytes: int, size: int):
        self.path = path
        self.offset = offset
        self.nbytes = nbytes
        self.size = size
        super().__init__(
            f"read of {nbytes} bytes at offset {offset} passes the end of {path!r} "
            f"(size {size} bytes); read at most {max(0, size - offset)} bytes there "
            f"or write the range first")


class ArgumentError(ChemIOError, ValueError):
    """An argument (offset, size, mode, name...) is not acceptable."""


class ConfigError(ChemIOError, ValueError):
    """A setting has a value that cannot be used."""


class CancelledError(ChemIOError, _futures.CancelledError):
    """The request was cancelled before it ran (``Request.cancel()``); raised by its
    ``wait()``. Also a ``concurrent.futures.CancelledError``."""


class SectionError(ChemIOError, ValueError):
    """A section (tuple of slices) or data shape does not fit the array."""


class ModeError(ArgumentError):
    """The operation is not allowed in the mode the object was opened with."""


class InvalidNameError(ArgumentError):
    """A scratch name is not a plain file name."""


class NotFoundError(ChemIOError, KeyError):
    """A name is not in a container (``H5TmpFile`` group, attributes); also a ``KeyError``."""

    def __str__(self) -> str:           # KeyError would show the message quoted
        return str(self.args[0]) if self.args else ""


class LimitExceededError(ChemIOError):
    """A write would pass a hard size limit; nothing was written."""


class MetadataError(ChemIOError, ValueError):
    """Array metadata is missing, corrupt or hostile."""


class ChecksumError(ChemIOError):
    """A chunk of a DiskArray created with ``checksum=True`` does not match its stored
    CRC: the data (or the checksum sidecar) was damaged on disk. Carries ``path`` (the
    data file), ``chunk`` (its grid index), ``number`` (its place in C order), ``offset``
    (its first byte in the file), ``expected`` and ``found`` (CRC32 values)."""

    def __init__(self, path: str, chunk: tuple, number: int, offset: int, nbytes: int,
                 expected: int, found: int, sidecar: str = ""):
        self.path = path
        self.chunk = tuple(chunk)
        self.number = number
        self.offset = offset
        self.nbytes = nbytes
        self.expected = expected
        self.found = found
        self.sidecar = sidecar
        where = f" (checksums in {sidecar!r})" if sidecar else ""
        super().__init__(
            f"checksum mismatch in {path!r}: chunk {list(self.chunk)} (number {number}, "
            f"{nbytes} bytes at offset {offset}) has CRC32 {found:#010x}, expected "
            f"{expected:#010x}{where}; the data on disk is damaged: restore the array from a "
            f"copy, or rewrite that chunk (run 'chemio check --read' to list every damaged "
            f"chunk)")


class BackendUnavailableError(ChemIOError, ImportError):
    """A storage backend cannot be used here; the message says how to install it."""

    def __init__(self, name: str, reason: str, hint: str = ""):
        self.backend = name
        self.reason = reason
        self.hint = hint
        msg = f"backend {name!r} is unavailable: {reason}"
        if hint:
            msg += f"; {hint}"
        super().__init__(msg)


class NotSharedError(ChemIOError):
    """The shared scratch directory is not the same directory on every rank."""


class SyncError(ChemIOError, RuntimeError):
    """A counter or mutex was used wrongly (freed, not held, acquired twice)."""


class SpillWarning(UserWarning):
    """A file of the ``auto`` backend moved from RAM to disk (its data intact)."""


class CollectiveError(ChemIOError):
    """Another rank failed in a collective call; ``failures`` maps rank -> its reason."""

    def __init__(self, what: str, failures: dict[int, str]):
        self.what = what
        self.failures = dict(failures)
        lines = "; ".join(f"rank {r}: {m}" for r, m in sorted(self.failures.items()))
        super().__init__(f"{what} failed on {len(self.failures)} rank(s): {lines}")


class CollectiveMismatchError(CollectiveError):
    """The ranks of a communicator are not in the same collective call: one skipped a call,
    called another, or left (its interpreter is exiting). ``where`` maps each call (its
    name and sequence number on the communicator) to the ranks in it. Raised on every rank;
    the communicator takes no further chemio collective call afterwards."""

    def __init__(self, message: str, where: dict[tuple[int, str], list[int]]):
        self.where = dict(where)
        self.what = message
        self.failures = {}
        ChemIOError.__init__(self, message)


class CollectiveTimeoutError(CollectiveError):
    """Ranks did not arrive at a collective call within ``collective_timeout`` seconds;
    ``missing`` lists them when rank 0's roll call could tell (else None)."""

    def __init__(self, message: str, missing: list[int] | None):
        self.missing = None if missing is None else list(missing)
        self.what = message
        self.failures = {}
        ChemIOError.__init__(self, message)


class PointerBufferError(ArgumentError):
    """A buffer whose items are pointers (NumPy object arrays) was given for file I/O."""


class NotARegularFile(OSError):
    """The path exists but is a FIFO, device, socket, directory or symbolic link."""


class CompressorUnavailableError(ChemIOError, ImportError):
    """The compressor asked for needs numcodecs, which is not installed."""


class RefusedRemoval(ArgumentError):
    """``remove_job_dir`` was asked to remove something that is not provably stale scratch."""


class NodeSpanError(ChemIOError):
    """A shared object on a node-local backend was asked for by ranks on several nodes."""


__all__ = [
    "ChemIOError", "ArgumentError", "ConfigError", "CancelledError", "StorageError",
    "OutOfSpaceError", "UnobservedIOError", "SupersededError",
    "EndOfFileError", "SectionError",
    "ModeError", "InvalidNameError", "NotFoundError", "LimitExceededError", "MetadataError",
    "ChecksumError",
    "BackendUnavailableError", "CollectiveError", "CollectiveMismatchError",
    "CollectiveTimeoutError", "NotSharedError", "SyncError",
    "SpillWarning",
]
