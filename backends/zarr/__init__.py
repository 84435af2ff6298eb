"""The ``zarr`` backend: DiskArrays as Zarr v3 arrays (``backend``), the on-disk format
(``format``) and the collective two-phase write plan (``exchange``)."""
from chemio_py.backends.zarr.backend import ZarrArrayStore, ZarrBackend

__all__ = ["ZarrBackend", "ZarrArrayStore"]
