"""The request log: one line per request on the ``convo.server.access`` logger (stdlib
``logging``, level INFO)::

    POST /v1/chat/completions 200 812.4 ms
    GET /v1/sessions/abc 404 1.2 ms

Method, path as sent (never the query string), status and the time until the response ended (a
stream's whole length). Bodies, headers and API keys are never logged. ``convo serve
--log-level`` sets what is shown; an app of your own configures ``logging`` as it likes.
"""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: The request log's logger.
ACCESS_LOGGER = "convo.server.access"

logger = logging.getLogger(ACCESS_LOGGER)


#: Longest path written to the log, in characters (the rest is cut).
MAX_LOGGED_PATH_CHARS = 200


def _path(scope: Scope) -> str:
    """The path as sent (still percent-encoded: a ``%0A`` cannot forge a log line), cut at
    :data:`MAX_LOGGED_PATH_CHARS`."""
    raw = scope.get("raw_path")
    if isinstance(raw, bytes):
        path = raw.decode("latin-1")
    else:
        path = scope["path"].encode("unicode_escape").decode()
    path = path.split("?", 1)[0]
    return path if len(path) <= MAX_LOGGED_PATH_CHARS else path[:MAX_LOGGED_PATH_CHARS] + "..."


class RequestLog:
    """Pure ASGI middleware that logs each HTTP request once it has been answered."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not logger.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # an error that escaped before any response was sent

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            logger.info(
                "%s %s %d %.1f ms",
                scope["method"],
                _path(scope),
                status,
                (time.perf_counter() - started) * 1000,
            )
