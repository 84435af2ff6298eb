"""Runnable chemistry examples (semi-direct SCF, RI-MP2, MRCI-style Davidson, checkpoint).

Each is a script: ``python examples/ri_mp2.py --help``. The directory is also installed as
``chemio_py.examples`` so that ``chemio demo`` can run the RI-MP2 example after a plain
``pip install``.
"""
