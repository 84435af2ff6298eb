"""How chemio objects show themselves in notebooks: small HTML tables in the spirit of
dask's array table, and the sizes in them (``_repr_html_`` of DiskArray, the byte files
and ``cio.report()``). Nothing here raises: a value that cannot be found shows as "?"."""
from __future__ import annotations

import html
import os
from typing import Any, Iterable, Sequence

from chemio_py.errors import fmt_bytes

_STYLE = ("border-collapse:collapse;font-family:monospace;font-size:90%",
          "text-align:left;padding:1px 8px;border-bottom:1px solid #ddd")


def size_text(n: int | None) -> str:
    """``n`` bytes for a reader: ``"1.5 GiB (1610612736 B)"``; ``"?"`` when unknown."""
    if n is None:
        return "?"
    return fmt_bytes(n) if n < 1024 else f"{fmt_bytes(n)} ({n} B)"


def disk_usage(path: str) -> int | None:
    """Bytes allocated on disk for the file or directory tree at ``path`` (never through
    a link); None when it cannot be read."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    total = st.st_blocks * 512
    if os.path.isdir(path) and not os.path.islink(path):
        for d, dirs, files in os.walk(path):
            for n in dirs + files:
                try:
                    total += os.lstat(os.path.join(d, n)).st_blocks * 512
                except OSError:
                    pass
    return total


def table(title: str, rows: Iterable[tuple[str, Any]]) -> str:
    """A two-column HTML table: ``title`` on top, then one ``(label, value)`` per row."""
    t, cell = _STYLE
    body = "".join(f'<tr><th style="{cell}">{html.escape(str(k))}</th>'
                   f'<td style="{cell}">{html.escape(str(v))}</td></tr>' for k, v in rows)
    return (f'<table style="{t}"><caption style="text-align:left;font-weight:bold">'
            f'{html.escape(title)}</caption>{body}</table>')


def grid(header: Sequence[str], rows: Iterable[Sequence[Any]], title: str = "") -> str:
    """An HTML table with a header row (``cio.report()`` in a notebook)."""
    t, cell = _STYLE
    head = "".join(f'<th style="{cell}">{html.escape(str(h))}</th>' for h in header)
    body = "".join("<tr>" + "".join(f'<td style="{cell}">{html.escape(str(v))}</td>'
                                    for v in r) + "</tr>" for r in rows)
    cap = (f'<caption style="text-align:left;font-weight:bold">{html.escape(title)}</caption>'
           if title else "")
    return f'<table style="{t}">{cap}<tr>{head}</tr>{body}</table>'
