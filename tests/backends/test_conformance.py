"""The conformance suite of chemio_py.testing on every built-in backend."""
from chemio_py.testing import BackendTests


class TestLocal(BackendTests):
    backend = "local"
    mpi_ranks = 2


class TestShm(BackendTests):
    backend = "shm"
    mpi_ranks = 2


class TestAuto(BackendTests):
    backend = "auto"
