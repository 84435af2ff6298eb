"""The ``mpiio`` backend: one MPI-IO file per array or shared file (``backend``), sections
as MPI datatypes (``types``)."""
from chemio_py.backends.mpiio.backend import MpiioArrayStore, MpiioBackend, MpiioByteStore

__all__ = ["MpiioBackend", "MpiioByteStore", "MpiioArrayStore"]
