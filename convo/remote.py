"""Deprecated: ``convo.remote`` moved to :mod:`convo.engines.openai`. This alias warns and goes away in the
next release."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

warnings.warn(
    "convo.remote is deprecated; import from convo.engines.openai instead",
    DeprecationWarning,
    stacklevel=2,
)

_MODULES = ('convo.engines.openai',)


def __getattr__(name: str) -> Any:
    for module in _MODULES:
        mod = importlib.import_module(module)
        if hasattr(mod, name):
            return getattr(mod, name)
    raise AttributeError(f"module 'convo.remote' has no attribute {name!r}")
