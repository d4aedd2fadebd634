"""convo: keep LLM conversations inside a hard memory budget.

The names a user needs are importable from ``convo`` (``__all__``); everything else lives in
its module (``convo.errors``, ``convo.plan``, ``convo.engines``, ``convo.planner``,
``convo.fast``, ``convo.admission``, ``convo.testing``...). ``import convo`` loads no
torch, transformers, FAISS, sentence-transformers, httpx or FastAPI: heavy names are
imported on first use.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from convo.budget import Budget, OversizePolicy
from convo.errors import BudgetError, ConvoError
from convo.messages import Message, Role, ToolCall, assistant, system, tool, user
from convo.models import FinishReason, Sampling
from convo.plan import PromptPlan, fit, plan_prompt
from convo.session import Reply, Session
from convo.stores import InMemoryStore, RedisStore, SQLiteStore
from convo.tokens import HFTokenCounter, TiktokenCounter, TokenCounter

if TYPE_CHECKING:
    from convo.admission import AdmissionController
    from convo.engines.local.engine import TransformersEngine
    from convo.engines.openai import OpenAIEngine
    from convo.retrieval import DocumentCollection, RetrievalMemory

__version__ = "0.1.0"

__all__ = [
    "AdmissionController",
    "Budget",
    "BudgetError",
    "ConvoError",
    "DocumentCollection",
    "FinishReason",
    "HFTokenCounter",
    "InMemoryStore",
    "Message",
    "OpenAIEngine",
    "OversizePolicy",
    "PromptPlan",
    "RedisStore",
    "Reply",
    "RetrievalMemory",
    "Role",
    "SQLiteStore",
    "Sampling",
    "Session",
    "TiktokenCounter",
    "TokenCounter",
    "ToolCall",
    "TransformersEngine",
    "assistant",
    "fit",
    "plan_prompt",
    "system",
    "tool",
    "user",
]

# Public names served lazily, with the module that defines them.
_LAZY = {
    "AdmissionController": "convo.admission",
    "DocumentCollection": "convo.retrieval",
    "OpenAIEngine": "convo.engines.openai",
    "RetrievalMemory": "convo.retrieval",
    "TransformersEngine": "convo.engines.local.engine",
}

# Names ``convo`` exported before 0.2, with their home now: still served, with a
# DeprecationWarning, for one release.
_MOVED = {
    **dict.fromkeys(
        [
            "AdmissionError",
            "ConfigError",
            "DeviceOutOfMemory",
            "GenerationTimeout",
            "MessageError",
            "MissingDependency",
            "ModelLoadError",
            "QueueFullError",
            "QueueTimeoutError",
            "RemoteEngineError",
            "SessionBusy",
            "SessionNotFound",
            "StoreError",
        ],
        "convo.errors",
    ),
    **dict.fromkeys(["AdmissionLimits", "Batcher", "Ledger", "MemoryLedger", "Request"], "convo.admission"),
    **dict.fromkeys(
        ["BM25Index", "Chunk", "RetrievalConfig", "VectorIndex", "chunk_text"], "convo.retrieval"
    ),
    **dict.fromkeys(["Generation", "GenerationStats", "Quant"], "convo.models"),
    **dict.fromkeys(["Passage", "Turn"], "convo.plan"),
    **dict.fromkeys(["SessionState", "Store"], "convo.stores"),
    **dict.fromkeys(["ModelSummarizer", "Summarizer"], "convo.summarize"),
    **dict.fromkeys(["KVSlotPool", "StaticDecoder"], "convo.fast"),
    "RetryPolicy": "convo.engines.openai",
    "TurnStats": "convo.session",
    "CharCounter": "convo.tokens",
    "Embedder": "convo.embeddings",
    "ServingMetrics": "convo.metrics",
    "parse_size": "convo.models",
}
_RENAMED = {
    "Memory": ("RetrievalMemory", "convo.retrieval"),
    "MemoryStore": ("InMemoryStore", "convo.stores"),
    "MemoryModel": ("VRAMModel", "convo.planner"),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    if name in _MOVED:
        module = _MOVED[name]
        warnings.warn(
            f"convo.{name} is deprecated; import it from {module}", DeprecationWarning, stacklevel=2
        )
        return getattr(importlib.import_module(module), name)
    if name in _RENAMED:
        new, module = _RENAMED[name]
        home = "convo" if new in __all__ else module
        warnings.warn(f"convo.{name} is deprecated; use {home}.{new}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(module), new)
    if name == "memory":  # the planner module's old name (``import convo.memory`` warns too)
        return importlib.import_module("convo.memory")
    raise AttributeError(f"module 'convo' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
