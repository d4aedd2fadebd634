"""Lazy and moved names: a package serves heavy names on first use, and old module names
are kept for one release (they warn once on import and forward names)."""

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


def lazy(package: str, names: dict[str, str]) -> Callable[[str], Any]:
    """A package ``__getattr__`` that imports ``names[name]`` (a module) on first use, so the
    package itself stays light (no torch, httpx or FastAPI until a name needs them)."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
