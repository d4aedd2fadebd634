"""Deprecated: ``convo.engine`` moved to :mod:`convo.engines`. This alias warns and goes away in the
next release."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

warnings.warn(
    "convo.engine is deprecated; import from convo.engines instead",
    DeprecationWarning,
    stacklevel=2,
)

_MODULES = ('convo.engines.base', 'convo.engines.transformers', 'convo.engines.models', 'convo.paths')


def __getattr__(name: str) -> Any:
    for module in _MODULES:
        mod = importlib.import_module(module)
        if hasattr(mod, name):
            return getattr(mod, name)
    raise AttributeError(f"module 'convo.engine' has no attribute {name!r}")
