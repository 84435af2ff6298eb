"""The conformance suite of chemio_py.testing on the built-in ``local`` backend:
byte files and DiskArrays."""
from chemio_py.testing import BackendTests


class TestLocal(BackendTests):
    backend = "local"
    mpi_ranks = 2
