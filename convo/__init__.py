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
    RemoteEngineError,
    SessionBusy,
    SessionNotFound,
    StoreError,
)
from convo.messages import Message, Role, ToolCall, assistant, system, tool, user
from convo.plan import Passage, PromptPlan, Turn, plan_prompt
from convo.session import Reply, Session, TurnStats
from convo.store import MemoryStore, RedisStore, SessionState, SQLiteStore, Store
from convo.summarize import ModelSummarizer, Summarizer
from convo.tokens import CharCounter, HFTokenCounter, TiktokenCounter, TokenCounter

if TYPE_CHECKING:
    from convo.admission import AdmissionController, AdmissionLimits, Batcher, MemoryLedger, Request
    from convo.decode import KVSlotPool, StaticDecoder
    from convo.embeddings import Embedder
    from convo.engine import FinishReason, Generation, GenerationStats, Quant, Sampling, TransformersEngine
    from convo.memory import MemoryModel, parse_size
    from convo.metrics import ServingMetrics
    from convo.remote import OpenAIEngine, RetryPolicy
    from convo.retrieval import (
        BM25Index,
        Chunk,
        DocumentCollection,
        Memory,
        RetrievalConfig,
        VectorIndex,
        chunk_text,
    )

# Names served lazily, with the module that defines them: `import convo` stays light
# (no torch, transformers, FAISS or sentence-transformers until they are used).
_LAZY = {
    "FinishReason": "convo.engine",
    "Generation": "convo.engine",
    "GenerationStats": "convo.engine",
    "Quant": "convo.engine",
    "Sampling": "convo.engine",
    "TransformersEngine": "convo.engine",
    "AdmissionController": "convo.admission",
    "AdmissionLimits": "convo.admission",
    "Batcher": "convo.admission",
    "MemoryLedger": "convo.admission",
    "Request": "convo.admission",
    "MemoryModel": "convo.memory",
    "parse_size": "convo.memory",
    "ServingMetrics": "convo.metrics",
    "Memory": "convo.retrieval",
    "DocumentCollection": "convo.retrieval",
    "RetrievalConfig": "convo.retrieval",
    "VectorIndex": "convo.retrieval",
    "BM25Index": "convo.retrieval",
    "Chunk": "convo.retrieval",
    "chunk_text": "convo.retrieval",
    "Embedder": "convo.embeddings",
    "KVSlotPool": "convo.decode",
    "StaticDecoder": "convo.decode",
    "OpenAIEngine": "convo.remote",
    "RetryPolicy": "convo.remote",
}

__version__ = "0.1.0"

__all__ = [
    "AdmissionController",
    "AdmissionError",
    "AdmissionLimits",
    "BM25Index",
    "Batcher",
    "Budget",
    "BudgetError",
    "CharCounter",
    "Chunk",
    "ConfigError",
    "ConvoError",
    "DeviceOutOfMemory",
    "DocumentCollection",
    "Embedder",
    "FinishReason",
    "Generation",
    "GenerationStats",
    "GenerationTimeout",
    "HFTokenCounter",
    "KVSlotPool",
    "Memory",
    "MemoryLedger",
    "MemoryModel",
    "MemoryStore",
    "Message",
    "MessageError",
    "MissingDependency",
    "ModelLoadError",
    "ModelSummarizer",
    "OpenAIEngine",
    "OversizePolicy",
    "Passage",
    "PromptPlan",
    "Quant",
    "QueueFullError",
    "QueueTimeoutError",
    "RedisStore",
    "RemoteEngineError",
    "Reply",
    "Request",
    "RetrievalConfig",
    "RetryPolicy",
    "Role",
    "SQLiteStore",
    "Sampling",
    "ServingMetrics",
    "Session",
    "SessionBusy",
    "SessionNotFound",
    "SessionState",
    "StaticDecoder",
    "Store",
    "StoreError",
    "Summarizer",
    "TiktokenCounter",
    "TokenCounter",
    "ToolCall",
    "TransformersEngine",
    "Turn",
    "TurnStats",
    "VectorIndex",
    "assistant",
    "chunk_text",
    "parse_size",
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
