"""The conformance suite of chemio_py.testing on the built-in ``zarr`` backend:
DiskArrays only (it holds no byte files)."""
import pytest

from chemio_py.testing import ArrayStoreTests

pytest.importorskip("zarr", reason="the zarr backend needs zarr")


class TestZarr(ArrayStoreTests):
    backend = "zarr"
    mpi_ranks = 2
