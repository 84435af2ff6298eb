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
"""
from __future__ import annotations

import os as _os
from typing import TYPE_CHECKING as _TYPE_CHECKING, Any as _Any

if _TYPE_CHECKING:
    import numpy as _np

# In a source checkout the device layer lives in ../backends and is installed as
# chemio_py.backends; let the package find it there too (as the installed layout does).
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "backends", "__init__.py")) \
        and _os.path.isfile(_os.path.join(_checkout, "pyproject.toml")):
    __path__.append(_checkout)

from . import errors  # noqa: E402
from .comm import comm  # noqa: E402
from .config import configure, settings  # noqa: E402
from .errors import (  # noqa: E402
    BackendUnavailableError, ChecksumError, ChemIOError, EndOfFileError, LimitExceededError,
    MetadataError, ModeError, OutOfSpaceError, SectionError, SupersededError, UnobservedIOError,
)
from .diskarray import DiskArray, block_section  # noqa: E402
from .exclusive import ExclusiveFile  # noqa: E402
from .prefetch import WriteBehind, prefetch  # noqa: E402
from .records import RecordFile  # noqa: E402
from .shared import SharedFile  # noqa: E402
from . import sync  # noqa: E402
from .requests import Request, completed, waitall, waitany  # noqa: E402
from .scratch import FsInfo, cleanup, stat  # noqa: E402
from .stats import report  # noqa: E402
from .listing import ls  # noqa: E402

__version__ = "0.1.0"


def aligned_empty(shape: int | tuple[int, ...], dtype: _Any = "uint8",
                  align: int = 4096) -> _np.ndarray:
    """An uninitialised array aligned for O_DIRECT (``align``-byte boundary)."""
    from .backends.posix import aligned_empty as _ae
    return _ae(shape, dtype, align)


__all__ = [
    "DiskArray", "block_section",
    "prefetch", "WriteBehind", "RecordFile",
    "SharedFile", "sync",
    "ExclusiveFile", "Request", "completed", "waitall", "waitany", "configure", "settings",
    "comm", "stat", "FsInfo", "cleanup", "report", "ls", "aligned_empty", "errors",
    "ChemIOError", "OutOfSpaceError", "EndOfFileError", "SectionError", "ModeError",
    "LimitExceededError", "MetadataError", "ChecksumError", "BackendUnavailableError",
    "SupersededError",
    "UnobservedIOError", "__version__",
]
