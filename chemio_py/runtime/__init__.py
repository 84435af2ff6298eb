"""What every process of a job has, below any file: settings (``config``), the communicator
and its call-sequence guard (``comm``, ``rankguard``), the I/O pool and requests
(``requests``), accounting and traces (``stats``), handle registries (``handles``,
``ownfiles``), bounded readers of untrusted text (``safejson``), progress bars and reprs.

Nothing here knows a file format or a backend.
"""
