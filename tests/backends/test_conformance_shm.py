"""The conformance suite of chemio_py.testing on the built-in ``shm`` backend:
byte files and DiskArrays."""
from chemio_py.testing import BackendTests


class TestShm(BackendTests):
    backend = "shm"
    mpi_ranks = 2
