"""Engines: what generates text for a :class:`~convo.session.Session`.

* :mod:`convo.engines.base` — the :class:`Engine` protocol and the options of a call;
* :mod:`convo.engines.local` — :class:`TransformersEngine`, a local Hugging Face model
  behind a capped, measured ``generate`` (torch is imported on first use), where its KV
  caches live and how models are found and loaded;
* :mod:`convo.engines.openai` — :class:`OpenAIEngine`, any OpenAI-compatible server (httpx).

The values a call returns (:class:`Generation`, :class:`GenerationStats`,
:class:`FinishReason`, :class:`Sampling`) are defined in :mod:`convo.models` and exported
here too; the weight format ``Quant`` lives in :mod:`convo.models` alone (its name here
still works for one release, with a ``DeprecationWarning``).
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from convo.engines.base import Engine, GenerateOptions, GenerateRequest
from convo.models.generation import FinishReason, Generation, GenerationStats, Sampling

if TYPE_CHECKING:
    from convo.engines.local.engine import TransformersEngine
    from convo.engines.openai import OpenAIEngine

__all__ = [
    "Engine",
    "FinishReason",
    "GenerateOptions",
    "GenerateRequest",
    "Generation",
    "GenerationStats",
    "OpenAIEngine",
    "Sampling",
    "TransformersEngine",
]

_LAZY = {"TransformersEngine": "convo.engines.local.engine", "OpenAIEngine": "convo.engines.openai"}
_MOVED = {"Quant": "convo.models.quant"}


def __getattr__(name: str) -> Any:
    """Heavy engines on first use (torch, httpx); moved names with a warning."""
    if name in _MOVED:
        warnings.warn(
            f"convo.engines.{name} is deprecated; import it from convo.models",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(_MOVED[name]), name)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'convo.engines' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
