"""Chunk-shape policy of DiskArrays: the default chunks (1–4 MiB, close to square) and
chunks grown from the ``request_shape`` hint so that a typical request touches few chunks.
The grid those chunks make is ``backends.grid``'s.
"""
from __future__ import annotations

import math
from typing import Sequence

from chemio_py.backends.grid import MIB, ceil_div

CHUNK_MIN = 1 * MIB           # a default or hint-grown chunk is at least this ...
CHUNK_MAX = 4 * MIB           # ... and a default chunk at most this (when the array allows)


# ---------------------------------------------------------------- chunk shapes

def clip_chunks(chunks: Sequence[int], shape: Sequence[int]) -> tuple[int, ...]:
    """``chunks`` limited to the shape (each at least 1)."""
    return tuple(max(1, min(int(c), max(int(n), 1))) for c, n in zip(chunks, shape))


def default_chunks(shape: Sequence[int], itemsize: int,
                   max_bytes: int = CHUNK_MAX) -> tuple[int, ...]:
    """Chunks of at most ``max_bytes`` (2–4 MiB by default) and close to square.

    Starts from the whole array and halves its longest chunk dimension (the first one on a
    tie, which keeps the trailing axes whole) until the chunk fits.
    """
    ch = [max(1, int(n)) for n in shape]
    while math.prod(ch) * itemsize > max_bytes:
        k = max(range(len(ch)), key=lambda i: (ch[i], -i))
        if ch[k] == 1:
            break
        ch[k] = ceil_div(ch[k], 2)
    return tuple(ch)


def hinted_chunks(shape: Sequence[int], itemsize: int, request_shape: Sequence[int | None],
                  min_bytes: int = CHUNK_MIN) -> tuple[int, ...]:
    """Chunks that make a request of shape ``request_shape`` one contiguous byte range.

    The request (each entry clipped to the array; ``None`` means the whole dimension) is
    the chunk; a chunk smaller than ``min_bytes`` is grown by whole requests along the first
    axis, so requests aligned to the request grid stay contiguous bands of a chunk.
    """
    ch = [max(1, min(int(n if r is None else r), max(int(n), 1)))
          for r, n in zip(request_shape, shape)]
    size = math.prod(ch) * itemsize
    if size < min_bytes and shape[0] > ch[0]:
        k = min(ceil_div(min_bytes, size), ceil_div(int(shape[0]), ch[0]))
        ch[0] = min(ch[0] * k, int(shape[0]))
    return tuple(ch)
