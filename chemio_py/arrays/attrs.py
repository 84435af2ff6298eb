"""Persistent attributes of a DiskArray (``d.attrs``), as in h5py, zarr and xarray.

    >>> d.attrs["basis"] = "cc-pvdz"            # collective; written at once
    >>> d.attrs.update(charge=0, energies=np.array([-76.0, -75.9]))
    >>> dict(d.attrs)
    {'basis': 'cc-pvdz', 'charge': 0, 'energies': [-76.0, -75.9]}

A mutable mapping of str keys to JSON values, kept with the array: in the ``"attributes"``
object of its metadata document (raw-grid backends), or in the ``attributes`` of
``zarr.json`` (``zarr``: zarr-python and xarray see them; chemio's own entry ``"chemio"``
there is hidden and reserved). NumPy values become what JSON holds (``np.float64`` ->
``float``, arrays -> lists); anything else JSON cannot hold (bytes, complex, NaN, objects)
is an ``ArgumentError``. The whole mapping is at most ``meta.MAX_ATTRS`` bytes as JSON
(``LimitExceededError``). Each change is collective: every rank makes the same change
(``ArgumentError`` on every rank otherwise), rank 0 writes the document atomically and
every rank sees the result when the call returns. Read-only arrays refuse changes
(``ModeError``). A failed change changes nothing.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np

from chemio_py.arrays import meta as _meta
from chemio_py.errors import ArgumentError, LimitExceededError

if TYPE_CHECKING:
    from chemio_py.arrays.diskarray import DiskArray

RESERVED = "chemio"         # the key of chemio's own entry in zarr.json attributes


def jsonable(value: Any, where: str = "value") -> Any:
    """``value`` as plain JSON data (dict with str keys, list, str, int, float, bool,
    None), NumPy scalars and arrays converted; ``ArgumentError`` for what JSON cannot hold."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ArgumentError(f"attribute {where} is {value!r}, which JSON cannot hold; "
                                f"store a finite number or a string")
        return float(value)
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            raise ArgumentError(f"attribute {where} is an array of {value.dtype}, which JSON "
                                f"cannot hold; store numbers or strings")
        return jsonable(value.tolist(), where)
    if isinstance(value, np.generic):
        return jsonable(value.item(), where)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ArgumentError(f"attribute {where} has key {k!r}; keys are strings")
            out[k] = jsonable(v, f"{where}[{k!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ArgumentError(f"attribute {where} is a {type(value).__name__} ({value!r:.60}), "
                        f"which JSON cannot hold; store numbers, strings, bools, None, "
                        f"lists and dicts of them (or NumPy numbers and arrays)")


def checked(attrs: dict, name: str, reserved: bool) -> dict:
    """``attrs`` if it fits the size limit (``LimitExceededError``) and, for a zarr array
    (``reserved``), has no ``"chemio"`` key (``ArgumentError``)."""
    if reserved and RESERVED in attrs:
        raise ArgumentError(f"attribute key {RESERVED!r} of DiskArray {name!r} is reserved "
                            f"for chemio's own metadata in zarr.json; choose another key; "
                            f"nothing changed")
    n = len(json.dumps(attrs, allow_nan=False, separators=(",", ":")))
    if n > _meta.MAX_ATTRS:
        raise LimitExceededError(f"the attributes of DiskArray {name!r} would take {n} bytes "
                                 f"as JSON, more than the limit of {_meta.MAX_ATTRS}; keep "
                                 f"large data in an array of its own; nothing changed")
    return attrs


class Attributes(MutableMapping):
    """The attributes of one DiskArray (``d.attrs``): see the module docstring."""

    __slots__ = ("_d",)

    def __init__(self, d: "DiskArray"):
        self._d = d

    def _now(self) -> dict:
        self._d._open_store()                   # raises when closed
        return self._d._meta.attrs

    def __getitem__(self, key: str) -> Any:
        return copy.deepcopy(self._now()[key])

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._now()))

    def __len__(self) -> int:
        return len(self._now())

    def __contains__(self, key: object) -> bool:
        return key in self._now()

    def __setitem__(self, key: str, value: Any) -> None:
        if not isinstance(key, str):
            raise ArgumentError(f"attribute keys are strings, got {key!r}; nothing changed")
        v = jsonable(value, repr(key))
        self._change(lambda a: a.__setitem__(key, v), f"attrs[{key!r}] = ...")

    def __delitem__(self, key: str) -> None:
        def drop(a: dict) -> None:
            if key not in a:
                raise KeyError(key)
            del a[key]
        self._change(drop, f"del attrs[{key!r}]")

    def update(self, *args: Any, **kw: Any) -> None:
        """Set several attributes in one collective write."""
        new = dict(*args, **kw)
        for k in new:
            if not isinstance(k, str):
                raise ArgumentError(f"attribute keys are strings, got {k!r}; nothing changed")
        conv = {k: jsonable(v, repr(k)) for k, v in new.items()}
        self._change(lambda a: a.update(conv), "attrs.update(...)")

    def clear(self) -> None:
        """Remove every attribute in one collective write."""
        self._change(lambda a: a.clear(), "attrs.clear()")

    def __repr__(self) -> str:
        try:
            body = repr(self._now())
        except Exception:
            body = "(closed)"
        return f"<Attributes of DiskArray {self._d.name!r}: {body}>"

    def _change(self, fn: Callable[[dict], None], call: str) -> None:
        d = self._d
        c = d.comm
        what = f"DiskArray {d.name!r} {call}"
        c.begin(what)
        with c.agree(what):
            d._writable_store()
            new = copy.deepcopy(d._meta.attrs)
            fn(new)
            inside = d.meta_path == d.path
            checked(new, d.name, inside)
            text = json.dumps(new, sort_keys=True)
        c.same_everywhere(text, what, lambda mine, first: (
            f"rank {c.rank} would make the attributes of DiskArray {d.name!r} {mine:.200} but "
            f"rank 0 {first:.200}; every rank makes the same change; nothing changed"))
        m = dataclasses.replace(d._meta, attrs=new)
        with c.agree(what + " (write)"):
            if c.rank == 0:
                store(d, m, inside)
        d._reshaped(m)


def store(d: "DiskArray", m: _meta.Meta, inside: bool) -> None:
    """Rank 0: write metadata ``m`` of ``d`` where it lives."""
    if not inside:
        try:
            mode = os.stat(d.meta_path).st_mode & 0o777
        except OSError:
            mode = 0o600
        _meta.write_atomic(d.meta_path, _meta.dumps(m), mode, durable=m.persistent)
        return
    import chemio_py.backends as _backends
    write = _backends.backend_capabilities(d._be).write_attributes
    if write is None:
        raise ArgumentError(f"backend {d.backend!r} keeps no attributes of its own; "
                            f"nothing changed")
    write(d.path, dict(m.attrs))
