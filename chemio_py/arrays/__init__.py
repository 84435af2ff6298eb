"""N-d arrays on disk: ``DiskArray`` (Disk Resident Arrays), its metadata (``meta``), section
parsing (``sections``) and exchange with NumPy, dask, xarray and HDF5 (``interop``)."""
