"""Progress reports for long operations, from a ``progress=`` argument.

``progress`` may be:

* ``True`` — a ``tqdm.auto`` bar (a widget in notebooks, a bar on stderr in terminals);
* ``"auto"`` — the same bar, but only when stderr is a terminal or in a notebook, and only
  once the operation has run for half a second (what commands and scripts use by default);
* a callable — called as ``progress(done, total)`` after each step;
* ``False`` or ``None`` — nothing.

``Progress(progress, total, desc)`` counts steps (``update(n)``); ``track(iterable, ...)``
wraps a loop. tqdm is imported on the first bar only, so ``import chemio_py`` stays light.
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Iterable, Iterator, TypeVar

from chemio_py.errors import ArgumentError

T = TypeVar("T")
AUTO = "auto"
AUTO_DELAY = 0.5            # seconds before an "auto" bar appears (short operations show none)


def _is_auto(how: Any) -> bool:
    return isinstance(how, str) and how == AUTO


def check(how: Any) -> Any:
    """``how`` when it is a valid ``progress=`` value, else ``ArgumentError``."""
    if how is None or how is False or how is True or _is_auto(how) or callable(how):
        return how
    raise ArgumentError(f"progress must be True, False, 'auto' or a callable(done, total), "
                        f"got {how!r}")


class Progress:
    """One progress report of ``total`` units (``unit="B"``: bytes, shown scaled).

    ``update(n)`` adds ``n`` done units (thread-safe); ``close()`` ends the bar (also at
    the end of a ``with`` block). ``file`` is where a bar goes (default ``sys.stderr``).
    """

    def __init__(self, how: Any, total: int | None, desc: str, *, unit: str = "B",
                 file: Any = None):
        self.how = check(how)
        self.total = None if total is None else max(int(total), 0)
        self.desc = desc
        self.done = 0
        self._lock = threading.Lock()
        self._bar: Any = None
        self._callback: Callable[[int, int | None], Any] | None = None
        auto = _is_auto(how)
        if how is True or auto:
            from tqdm.auto import tqdm
            scaled = unit == "B"
            self._bar = tqdm(total=self.total, desc=desc, unit=unit, unit_scale=scaled,
                             unit_divisor=1024 if scaled else 1000, dynamic_ncols=True,
                             file=file if file is not None else sys.stderr,
                             disable=None if auto else False,
                             delay=AUTO_DELAY if auto else 0.0)
        elif how:
            self._callback = how

    @property
    def active(self) -> bool:
        """Whether anything is reported at all (a bar or a callback)."""
        return self._callback is not None or (self._bar is not None and not self._bar.disable)

    def update(self, n: int = 1) -> None:
        with self._lock:
            self.done += int(n)
            done = self.done
            if self._bar is not None:
                self._bar.update(int(n))
        if self._callback is not None:
            self._callback(done, self.total)

    def set_postfix(self, text: str) -> None:
        """A short status shown after the bar (bars only)."""
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def track(iterable: Iterable[T], how: Any, desc: str, *, total: int | None = None,
          unit: str = "it", file: Any = None) -> Iterator[T]:
    """Yield from ``iterable``, reporting one unit per item (``total`` defaults to its len)."""
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    with Progress(how, total, desc, unit=unit, file=file) as bar:
        for item in iterable:
            yield item
            bar.update(1)


def write(msg: str, file: Any = None) -> None:
    """Print a line without tearing the bars on screen (``tqdm.write`` once tqdm is in use)."""
    f = file if file is not None else sys.stderr
    tq = sys.modules.get("tqdm")
    if tq is not None:
        tq.tqdm.write(msg, file=f)
        f.flush()
    else:
        print(msg, file=f, flush=True)
