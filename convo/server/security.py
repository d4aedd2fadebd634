"""Who may call: the API key as a route dependency, and the cross-site rules (``Host`` and
``Origin``) as a pure ASGI middleware that runs before any route.

Without an API key the server serves only requests whose ``Host`` names the address it is
bound to (loopback), so DNS rebinding cannot reach it, and it refuses any request with a
foreign ``Origin`` unless ``allowed_origins`` lists it; POST bodies must be
``application/json`` (a plain HTML form cannot send that cross-site).
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from fastapi import Depends, FastAPI, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from convo.server.errors import ApiError, error_response
from convo.server.state import ServerState

#: Host names a keyless server answers to besides the address it is bound to.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def state_of(request: Request) -> ServerState:
    """The app's :class:`ServerState` (a route dependency)."""
    state: ServerState = request.app.state.convo
    return state


#: ``Authorization: Bearer KEY``, as ``/openapi.json`` documents it (no error of its own:
#: :func:`caller` answers 401).
bearer = HTTPBearer(
    auto_error=False,
    description="one of the server's API keys (convo serve --api-key); none on a keyless loopback server",
)


async def caller(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> str:
    """The caller's owner hash (a route dependency); 401 unless the key is one of ours."""
    return state_of(request).owner_of(credentials.credentials.strip() if credentials else "")


def host_name(value: str) -> str:
    """The host part of a ``Host`` header, lower-cased (``[::1]:8000`` -> ``::1``)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def origin_allowed(state: ServerState, origin: str) -> bool:
    """Whether a browser ``Origin`` may call: listed, ``*``, or (keyless) the server's own."""
    if "*" in state.origins or origin.rstrip("/").lower() in state.origins:
        return True
    try:
        parts = urlsplit(origin)
    except ValueError:
        return False
    # Same origin as the server itself: a page it served (it serves none) or a tool.
    return parts.scheme in ("http", "https") and (parts.hostname or "") in state.hosts and not state.keys


class CrossSiteGuard:
    """Pure ASGI middleware: refuse cross-site requests (foreign ``Host`` without a key,
    foreign ``Origin``) with 403 before any route runs.

    Pure ASGI, not Starlette's ``BaseHTTPMiddleware``: that one runs the response in a task
    of its own and, when the client goes away mid-stream, leaves the streaming response
    suspended, holding its admission slot until the garbage collector finds it.
    """

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = self.refusal(Headers(scope=scope))
        if refused is not None:
            await error_response(refused)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def refusal(self, headers: Headers) -> ApiError | None:
        """The 403 for a cross-site request, or ``None``."""
        state = self.state
        if not state.keys and host_name(headers.get("host", "")) not in state.hosts:
            return ApiError(403, "this Host is not served here", code="forbidden_host")
        origin = headers.get("origin")
        if origin is not None and not origin_allowed(state, origin):
            return ApiError(
                403,
                "cross-origin requests are refused (convo serve --allow-origin ORIGIN)",
                code="forbidden_origin",
            )
        return None


def install_cross_site_checks(app: FastAPI, state: ServerState) -> None:
    """Refuse cross-site requests (foreign ``Host`` without a key, foreign ``Origin``) with
    403 before any route runs (:class:`CrossSiteGuard`)."""
    app.add_middleware(CrossSiteGuard, state=state)
