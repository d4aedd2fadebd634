"""Old module names kept for one release: each warns once on import and forwards names."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any


def moved(old: str, new: str, modules: Sequence[str]) -> Callable[[str], Any]:
    """Warn that module ``old`` moved to ``new`` and return a module ``__getattr__`` that
    looks names up in ``modules``, in order."""
    warnings.warn(f"{old} is deprecated; import from {new} instead", DeprecationWarning, stacklevel=3)

    def __getattr__(name: str) -> Any:
        for module in modules:
            mod = importlib.import_module(module)
            if hasattr(mod, name):
                return getattr(mod, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    return __getattr__
