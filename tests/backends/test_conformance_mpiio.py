"""The conformance suite of chemio_py.testing on the built-in ``mpiio`` backend:
byte files and DiskArrays."""
import pytest

from chemio_py.testing import BackendTests

pytest.importorskip("mpi4py", reason="the mpiio backend needs mpi4py")


class TestMpiio(BackendTests):
    backend = "mpiio"
    mpi_ranks = 2
