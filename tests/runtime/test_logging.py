"""chemio_py logs through the standard library: ``logging.getLogger("chemio_py")``.

Spills, recoveries, the backend and chunk hint in effect, and cleanup are logged; the
package adds only a ``NullHandler`` (a library never configures logging for its user).
"""
from __future__ import annotations

import logging
import warnings

import numpy as np

import chemio_py as cio
from chemio_py.scratch import jobs


def test_package_logger_has_only_a_null_handler():
    handlers = logging.getLogger("chemio_py").handlers
    assert handlers and all(isinstance(h, logging.NullHandler) for h in handlers)


def test_backend_and_hint_in_effect_are_logged(caplog):
    with caplog.at_level(logging.DEBUG, logger="chemio_py"):
        with cio.DiskArray.create("log.hint", (64, 32), "f8", request_shape=(8, None),
                                  backend="local"):
            pass
    msgs = [r.getMessage() for r in caplog.records if r.name.startswith("chemio_py")]
    assert any("log.hint" in m and "backend local" in m and "request_shape hint (8, None)" in m
               for m in msgs), msgs


def test_a_spill_is_logged_as_a_warning(caplog):
    cio.configure(shm_limit=64 << 10)
    with caplog.at_level(logging.WARNING, logger="chemio_py"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cio.ExclusiveFile("log.spill", "w+", backend="auto") as f:
            f.write(0, np.zeros(32 << 10))                  # 256 KiB > the 64 KiB budget
    spills = [r for r in caplog.records if "moved from RAM to disk" in r.getMessage()]
    assert spills and spills[0].levelno == logging.WARNING


def test_cleanup_is_logged(caplog):
    f = cio.ExclusiveFile("log.cleanup", "w+")
    f.write(0, b"x")
    with caplog.at_level(logging.INFO, logger="chemio_py"):
        jobs.cleanup()
    assert any("cleanup: removed" in r.getMessage() for r in caplog.records)
