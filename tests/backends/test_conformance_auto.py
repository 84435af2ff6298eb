"""The conformance suite of chemio_py.testing on the built-in ``auto`` backend:
byte files and DiskArrays."""
from chemio_py.testing import BackendTests


class TestAuto(BackendTests):
    backend = "auto"
