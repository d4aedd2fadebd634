"""The OpenAI-compatible HTTP server (``convo serve``, or :func:`create_app` for an app of
your own). FastAPI and uvicorn are imported on first use: ``pip install 'convo[server]'``.

* :mod:`convo.server.app` — the app (:mod:`~convo.server.routes` holds its routes,
  :mod:`~convo.server.turns` one request's turn, :mod:`~convo.server.streaming` a streamed
  one, :mod:`~convo.server.completions` the response's JSON);
* :mod:`convo.server.requests` — request bodies: pydantic models, served as ``/openapi.json``;
* :mod:`convo.server.errors` — one table from exception to HTTP status;
* :mod:`convo.server.limits` — :class:`ServerLimits`;
* :mod:`convo.server.auth` — API keys and session owners;
* :mod:`convo.server.security` — Host/Origin checks and CORS;
* :mod:`convo.server.access_log` — one log line per request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from convo._deprecated import lazy

if TYPE_CHECKING:
    from convo.server.app import create_app
    from convo.server.limits import ServerLimits

__all__ = ["ServerLimits", "create_app"]

_LAZY = {"create_app": "convo.server.app", "ServerLimits": "convo.server.limits"}

__getattr__ = lazy("convo.server", _LAZY)
