"""Session stores: where the full history, the summary and the settings live.

The store keeps *everything*: every message ever sent, even those the prompt no longer
shows; a session's state is small and append-only, so each turn is one transaction.

- :class:`SQLiteStore` (:mod:`convo.stores.sqlite`) is the embedded default: one file
  shared by threads and processes.
- :class:`RedisStore` (:mod:`convo.stores.redis`) is shared by server replicas.
- :class:`MemoryStore` (:mod:`convo.stores.memory`) keeps sessions in a dict (tests,
  throw-away sessions).

Every store implements :class:`Store` (:mod:`convo.stores.base`), including its turn lock.
"""

from __future__ import annotations

from convo.stores.base import EXPORT_FORMAT, SessionState, Store, redact_url
from convo.stores.memory import MemoryStore
from convo.stores.redis import RedisStore
from convo.stores.sqlite import SQLiteStore

__all__ = [
    "EXPORT_FORMAT",
    "MemoryStore",
    "RedisStore",
    "SQLiteStore",
    "SessionState",
    "Store",
    "redact_url",
]
