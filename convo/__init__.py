"""convo: keep LLM conversations inside a hard memory budget.

Everything a user needs is importable from ``convo``. Heavy parts (torch, transformers,
FAISS, sentence-transformers) are imported only when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from convo.budget import Budget, OversizePolicy
from convo.errors import (
    AdmissionError,
    BudgetError,
    ConfigError,
    ConvoError,
    DeviceOutOfMemory,
    GenerationTimeout,
    MessageError,
    MissingDependency,
    ModelLoadError,
    QueueFullError,
    QueueTimeoutError,
    SessionNotFound,
    StoreError,
)
from convo.messages import Message, Role, ToolCall, assistant, system, tool, user
from convo.plan import Passage, PromptPlan, Turn, plan_prompt
from convo.session import Reply, Session, TurnStats
from convo.store import MemoryStore, SessionState, SQLiteStore, Store
from convo.summarize import ModelSummarizer, Summarizer
from convo.tokens import CharCounter, HFTokenCounter, TiktokenCounter, TokenCounter

if TYPE_CHECKING:
    from convo.engine import (
        FinishReason,
        Generation,
        GenerationStats,
        Quant,
        Sampling,
        TransformersEngine,
    )

# Names served lazily: module that defines them. engine.py imports torch only inside
# functions, but keeping it lazy keeps `import convo` minimal.
_LAZY = {
    "FinishReason": "convo.engine",
    "Generation": "convo.engine",
    "GenerationStats": "convo.engine",
    "Quant": "convo.engine",
    "Sampling": "convo.engine",
    "TransformersEngine": "convo.engine",
}

__version__ = "0.1.0"

__all__ = [
    "AdmissionError",
    "Budget",
    "BudgetError",
    "CharCounter",
    "ConfigError",
    "ConvoError",
    "DeviceOutOfMemory",
    "FinishReason",
    "Generation",
    "GenerationStats",
    "GenerationTimeout",
    "HFTokenCounter",
    "MemoryStore",
    "Message",
    "MessageError",
    "MissingDependency",
    "ModelLoadError",
    "ModelSummarizer",
    "OversizePolicy",
    "Passage",
    "PromptPlan",
    "Quant",
    "QueueFullError",
    "QueueTimeoutError",
    "Reply",
    "Role",
    "SQLiteStore",
    "Sampling",
    "Session",
    "SessionNotFound",
    "SessionState",
    "Store",
    "StoreError",
    "Summarizer",
    "TiktokenCounter",
    "TokenCounter",
    "ToolCall",
    "TransformersEngine",
    "Turn",
    "TurnStats",
    "assistant",
    "plan_prompt",
    "system",
    "tool",
    "user",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'convo' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
