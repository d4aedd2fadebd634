"""Remote engines: any OpenAI-compatible server (vLLM, SGLang, llama.cpp, ``convo serve``).

:class:`OpenAIEngine` (see :mod:`.engine` for counting, margins and errors) runs on one
sans-I/O core driven by two transports::

    engine.py      OpenAIEngine: counts, plans the call, reports a Generation
      │
      ├─ protocol.py   bodies, replies, SSE decoding, HTTP status / httpx error -> convo error
      ├─ retry.py      RetryPolicy, decide_retry: what is retried and after how long
      ├─ config.py     Timeouts, ConnectionLimits (and the deprecated flat keywords)
      └─ transports.py SyncTransport (httpx.Client) / AsyncTransport (httpx.AsyncClient)

This package needs httpx (``pip install 'convo[server]'``); ``import convo`` does not load it.
"""

from __future__ import annotations

from convo.errors import MissingDependency

try:
    import httpx  # noqa: F401
except ImportError:  # pragma: no cover - httpx is a dependency of the server extra
    raise MissingDependency("the remote engine needs httpx; run: pip install httpx") from None

from convo.engines.openai.config import ConnectionLimits, Timeouts
from convo.engines.openai.engine import DEFAULT_TIKTOKEN_MARGIN, TEMPLATE_MARGIN_TOKENS, OpenAIEngine
from convo.engines.openai.retry import RETRY_STATUSES, RetryPolicy, parse_retry_after

__all__ = [
    "DEFAULT_TIKTOKEN_MARGIN",
    "RETRY_STATUSES",
    "TEMPLATE_MARGIN_TOKENS",
    "ConnectionLimits",
    "OpenAIEngine",
    "RetryPolicy",
    "Timeouts",
    "parse_retry_after",
]
