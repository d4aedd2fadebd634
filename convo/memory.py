"""Deprecated: ``convo.memory`` moved to :mod:`convo.planner`. This alias warns and goes away in the
next release."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

warnings.warn(
    "convo.memory is deprecated; import from convo.planner instead",
    DeprecationWarning,
    stacklevel=2,
)

_MODULES = ('convo.planner.model', 'convo.planner.calibration', 'convo.planner.measure')


def __getattr__(name: str) -> Any:
    for module in _MODULES:
        mod = importlib.import_module(module)
        if hasattr(mod, name):
            return getattr(mod, name)
    raise AttributeError(f"module 'convo.memory' has no attribute {name!r}")
