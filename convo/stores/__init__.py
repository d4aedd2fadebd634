"""Session stores: where the full history, the summary and the settings live.

The store keeps *everything*: every message ever sent, even those the prompt no longer
shows; a session's state is small and append-only, so each turn is one transaction.

- :class:`SQLiteStore` (:mod:`convo.stores.sqlite`) is the embedded default: one file
  shared by threads and processes.
- :class:`RedisStore` (:mod:`convo.stores.redis`) is shared by server replicas.
- :class:`InMemoryStore` (:mod:`convo.stores.memory`) keeps sessions in a dict (tests,
  throw-away sessions). Its old name ``MemoryStore`` still works for one release, with a
  :class:`DeprecationWarning`.

Every store implements :class:`Store` (:mod:`convo.stores.base`), including its turn lock.
"""

from __future__ import annotations

import warnings
from typing import Any

from convo.stores.base import EXPORT_FORMAT, MemoryLog, SessionState, Store, StoredTail, redact_url
from convo.stores.memory import InMemoryStore
from convo.stores.redis import RedisStore
from convo.stores.sqlite import SQLiteStore

__all__ = [
    "EXPORT_FORMAT",
    "InMemoryStore",
    "MemoryLog",
    "RedisStore",
    "SQLiteStore",
    "SessionState",
    "Store",
    "StoredTail",
    "redact_url",
]

#: Old names of the stores, with their name now; served with a DeprecationWarning.
_RENAMED = {"MemoryStore": "InMemoryStore"}


def __getattr__(name: str) -> Any:
    new = _RENAMED.get(name)
    if new is None:
        raise AttributeError(f"module 'convo.stores' has no attribute {name!r}")
    warnings.warn(
        f"convo.stores.{name} is deprecated; use convo.stores.{new}", DeprecationWarning, stacklevel=2
    )
    return globals()[new]
