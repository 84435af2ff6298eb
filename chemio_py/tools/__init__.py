"""What the ``chemio`` command shows and checks: ``listing`` (``chemio ls``), ``check``
(``chemio check``) and ``trace_view`` (``chemio trace``)."""
