"""The version of chemio_py: the one place it is written (pyproject.toml reads it)."""
__version__ = "0.1.0"
