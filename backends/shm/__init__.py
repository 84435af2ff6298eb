"""The ``shm`` backend: files in memory (``/dev/shm`` segments) mapped once (``mapping``),
with cross-process locks (``lock``) and the node's RAM budget (``budget``)."""
from chemio_py.backends.shm.backend import ShmArrayStore, ShmBackend, ShmByteStore

__all__ = ["ShmBackend", "ShmByteStore", "ShmArrayStore"]
