"""chemio_py: out-of-core arrays and scratch files for computational chemistry.

The three I/O models of ChemIO over pluggable backends:

* ``DiskArray`` — N-d arrays on disk moved in sections, with ``block_section`` (DRA);
* ``ExclusiveFile`` — one private byte-addressable scratch file per process (EAF);
* ``SharedFile`` — one scratch file shared by all processes (SF), with ``sync.Counter``
  and ``sync.Mutex`` for dynamic load balancing and mutual exclusion;

with asynchronous requests (``Request``, ``waitall``, ``waitany``), read-ahead and
write-behind pipelines (``prefetch``, ``WriteBehind``, ``RecordFile`` for variable-size
records replayed with read-ahead), run-time settings
(``configure``, ``settings``) and I/O accounting (``report``). See README.md for a tour.

This module only hands names on. The house behind it, by concept: ``runtime/`` (settings,
communicator, requests, stats), ``scratch/`` (where files go, who removes them),
``files/`` (ExclusiveFile, SharedFile, RecordFile), ``arrays/`` (DiskArray), ``tools/``
(what ``chemio ls|check|trace`` show) and ``backends/`` (the bytes).
"""
from typing import TYPE_CHECKING

import logging

from chemio_py import _imports

_imports.install()
logging.getLogger("chemio_py").addHandler(logging.NullHandler())

from chemio_py import errors, sync  # noqa: E402
from chemio_py._version import __version__  # noqa: E402
from chemio_py.arrays.diskarray import DiskArray, block_section  # noqa: E402
from chemio_py.arrays.container import Group, H5TmpFile  # noqa: E402
from chemio_py.backends.posix import aligned_empty  # noqa: E402
from chemio_py.errors import (  # noqa: E402
    BackendUnavailableError, ChecksumError, ChemIOError, EndOfFileError, LimitExceededError,
    MetadataError, ModeError, OutOfSpaceError, SectionError, SupersededError, UnobservedIOError,
)
from chemio_py.files.exclusive import ExclusiveFile  # noqa: E402
from chemio_py.files.records import RecordFile  # noqa: E402
from chemio_py.files.shared import SharedFile  # noqa: E402
if TYPE_CHECKING:      # type checkers see the function, the documented call
    from chemio_py.prefetch import prefetch
else:                  # the module, which calling calls prefetch()
    from chemio_py import prefetch  # noqa: E402
from chemio_py.prefetch import WriteBehind  # noqa: E402
from chemio_py.runtime.blas import blas_threads_beside_io  # noqa: E402
from chemio_py.runtime.comm import comm  # noqa: E402
from chemio_py.runtime.config import configure, settings  # noqa: E402
from chemio_py.runtime.requests import Request, completed, waitall, waitany  # noqa: E402
from chemio_py.runtime.stats import report  # noqa: E402
from chemio_py.scratch.fs import FsInfo, stat  # noqa: E402
from chemio_py.scratch.jobs import cleanup  # noqa: E402
from chemio_py.tools.listing import ls  # noqa: E402


def __getattr__(name: str) -> object:
    """Modules that moved into folders stay reachable as attributes (``cio.stats``)."""
    return _imports.moved_module(name)


__all__ = [
    "DiskArray", "block_section", "H5TmpFile", "Group",
    "prefetch", "WriteBehind", "RecordFile",
    "SharedFile", "sync",
    "ExclusiveFile", "Request", "completed", "waitall", "waitany", "configure", "settings",
    "comm", "blas_threads_beside_io", "stat", "FsInfo", "cleanup", "report", "ls",
    "aligned_empty", "errors",
    "ChemIOError", "OutOfSpaceError", "EndOfFileError", "SectionError", "ModeError",
    "LimitExceededError", "MetadataError", "BackendUnavailableError", "SupersededError",
    "UnobservedIOError", "ChecksumError", "__version__",
]
