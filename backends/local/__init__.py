"""The ``local`` backend: POSIX files in a scratch directory (``backend``), with Linux AIO
for O_DIRECT reads and writes (``linux_aio``)."""
from chemio_py.backends.local.backend import LocalArrayStore, LocalBackend, LocalByteStore

__all__ = ["LocalBackend", "LocalByteStore", "LocalArrayStore"]
