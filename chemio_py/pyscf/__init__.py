"""chemio under PySCF: ``patch``/``enable``/``disable`` put PySCF's own out-of-core scratch
(``lib.H5TmpFile``, ``lib.call_in_background``, the Davidson ``_Xlist``) on chemio
(``chemio_py.pyscf.plugin``); ``semi_direct(mf)`` makes an SCF object semi-direct
(``chemio_py.pyscf.semidirect``). Importing this package does not import PySCF; ``enable``
does.
"""
from chemio_py.pyscf.plugin import disable, enable, enabled, patch, scratch_dir, usage
from chemio_py.pyscf.semidirect import semi_direct

__all__ = ["patch", "enable", "disable", "enabled", "usage", "scratch_dir", "semi_direct"]
