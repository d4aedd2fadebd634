"""Engines: what generates text for a :class:`~convo.session.Session`.

* :mod:`convo.engines.base` — the :class:`Engine` protocol and its typed values;
* :mod:`convo.engines.transformers` — :class:`TransformersEngine`, a local Hugging Face model
  behind a capped, measured ``generate`` (torch is imported on first use);
* :mod:`convo.engines.openai` — :class:`OpenAIEngine`, any OpenAI-compatible server (httpx);
* :mod:`convo.engines.models` — the embedded default model and model resolution.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from convo._deprecated import lazy
from convo.engines.base import (
    Engine,
    FinishReason,
    GenerateOptions,
    GenerateRequest,
    Generation,
    GenerationStats,
    Quant,
    Sampling,
)

if TYPE_CHECKING:
    from convo.engines.openai import OpenAIEngine
    from convo.engines.transformers import TransformersEngine

__all__ = [
    "Engine",
    "FinishReason",
    "GenerateOptions",
    "GenerateRequest",
    "Generation",
    "GenerationStats",
    "OpenAIEngine",
    "Quant",
    "Sampling",
    "TransformersEngine",
]

_LAZY = {"TransformersEngine": "convo.engines.transformers", "OpenAIEngine": "convo.engines.openai"}

__getattr__ = lazy("convo.engines", _LAZY)
