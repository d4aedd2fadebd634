"""Deprecated: ``convo.store`` became the package :mod:`convo.stores` (``base``, ``memory``,
``sqlite``, ``redis``); this alias forwards every name it had and goes away in the next
release. Its ``MemoryStore`` is :class:`convo.stores.InMemoryStore` now.

A user's ``from convo.store import X`` warns (a :class:`DeprecationWarning`). convo's own
modules that still import this path until they move to :mod:`convo.stores` do not: they
must not make ``import convo`` warn, or fail under ``-W error``.
"""

from __future__ import annotations

import sys
import warnings
from types import FrameType
from typing import Any

from convo import stores as _stores
from convo._deprecated import moved

#: Where the names of the old module live now, searched in order.
_HOMES = [
    "convo.stores",
    "convo.stores.base",
    "convo.stores.memory",
    "convo.stores.sqlite",
    "convo.stores.redis",
]


def _called_from_convo(frame: FrameType | None) -> bool:
    """Whether ``frame`` (import machinery skipped) runs code of the convo package."""
    while frame is not None:
        name = str(frame.f_globals.get("__name__", ""))
        if not (frame.f_code.co_filename.startswith("<frozen importlib") or name.startswith("importlib")):
            return name == "convo" or name.startswith("convo.")
        frame = frame.f_back
    return False


if _called_from_convo(sys._getframe(1)):
    # Imported by convo itself: no warning now; a user's later import warns per name.
    _warned_on_import = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        _forward = moved("convo.store", "convo.stores", _HOMES)
else:
    _warned_on_import = True
    _forward = moved("convo.store", "convo.stores", _HOMES)


def __getattr__(name: str) -> Any:
    if name.startswith("__"):  # e.g. __path__: this module is no package, whatever it forwards to
        raise AttributeError(f"module 'convo.store' has no attribute {name!r}")
    new = _stores._RENAMED.get(name)  # MemoryStore: InMemoryStore now
    if new is not None:
        if not _called_from_convo(sys._getframe(1)):
            warnings.warn(
                f"convo.store.{name} is deprecated; use convo.stores.{new}",
                DeprecationWarning,
                stacklevel=2,
            )
        return getattr(_stores, new)
    value = _forward(name)
    if not _called_from_convo(sys._getframe(1)):  # a user names it: say where it lives now
        warnings.warn(
            f"convo.store is deprecated; import {name} from convo.stores instead",
            DeprecationWarning,
            stacklevel=2,
        )
    return value
