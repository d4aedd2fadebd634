"""Who may call: the API key as a route dependency, and the cross-site rules (``Host``,
``Origin`` and CORS) as a pure ASGI middleware that runs before any route.

Without an API key the server serves only requests whose ``Host`` names the address it is
bound to (loopback), so DNS rebinding cannot reach it, and it refuses any request with a
foreign ``Origin`` unless ``allowed_origins`` lists it; POST bodies must be
``application/json`` (a plain HTML form cannot send that cross-site).

An origin is its scheme, host and port (``http://127.0.0.1:9999`` is not
``http://127.0.0.1:8000``). A browser page of an allowed origin gets CORS: its preflight
``OPTIONS`` is answered (no API key needed: browsers send none there), and every response
to it names it in ``Access-Control-Allow-Origin`` and exposes ``X-Session-Id`` and
``Retry-After``::

    request ── keyless and foreign Host? 403
       ├─ Origin not allowed (not listed, not "*", not the server's own)? 403
       ├─ preflight (OPTIONS + Access-Control-Request-Method)? 204 with the CORS headers
       └─ the route; an allowed Origin's response carries the CORS headers
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from convo.errors import ConfigError
from convo.server.errors import ApiError, error_response
from convo.server.state import ServerState

#: Host names a keyless server answers to besides the address it is bound to.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")

#: Seconds a browser may cache a preflight's answer (``Access-Control-Max-Age``).
PREFLIGHT_MAX_AGE_S = 600
#: Methods an allowed origin may use (the server's routes use no others).
CORS_METHODS = "GET, POST, DELETE, OPTIONS"
#: Request headers a preflight allows when the browser names none (it names them).
CORS_HEADERS = "Authorization, Content-Type, X-Session-Id"
#: Response headers an allowed origin's script may read.
CORS_EXPOSE = "X-Session-Id, Retry-After"
_DEFAULT_PORTS = {"http": 80, "https": 443}


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


def origin_key(origin: str) -> tuple[str, str, int] | None:
    """An origin as (scheme, host, port), the port filled in for the scheme
    (``https://App.example`` -> ``("https", "app.example", 443)``); ``None`` when it is not
    an http(s) origin (``null``, a path, junk)."""
    try:
        parts = urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname or parts.path not in ("", "/"):
        return None
    if parts.query or parts.fragment or parts.username is not None:
        return None
    return scheme, parts.hostname.lower(), port if port is not None else _DEFAULT_PORTS[scheme]


def normalize_origin(origin: str) -> str:
    """An allowed origin as :class:`ServerState` keeps it (``scheme://host:port``), or ``"*"``.
    Raises ConfigError for what is not an origin (``app.example`` without a scheme...)."""
    if origin.strip() == "*":
        return "*"
    key = origin_key(origin)
    if key is None:
        raise ConfigError(f"not a browser origin (scheme://host[:port]): {origin!r}")
    scheme, host, port = key
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}:{port}"


def origin_allowed(state: ServerState, origin: str, *, scheme: str = "http", host: str = "") -> bool:
    """Whether a browser ``Origin`` may call: listed, ``*``, or (keyless) the server's own:
    the scheme, host and port the request was sent to (``host``: its ``Host`` header)."""
    if "*" in state.origins:
        return True
    try:
        if normalize_origin(origin) in state.origins:
            return True
    except ConfigError:
        return False
    if state.keys or not host:
        return False
    # Same origin as the server itself: a page it served (it serves none) or a tool.
    own = origin_key(f"{scheme}://{host.strip()}")
    return own is not None and own[1].strip("[]") in state.hosts and origin_key(origin) == own


class CrossSiteGuard:
    """Pure ASGI middleware: refuse cross-site requests (foreign ``Host`` without a key,
    foreign ``Origin``) with 403 before any route runs; answer an allowed origin's
    preflight and add the CORS headers to its responses.

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
        headers = Headers(scope=scope)
        refused = self.refusal(headers, scope.get("scheme", "http"))
        if refused is not None:
            await error_response(refused)(scope, receive, send)
            return
        origin = headers.get("origin")
        if origin is None:
            await self.app(scope, receive, send)
            return
        cors = [
            (b"access-control-allow-origin", origin.encode("latin-1")),
            (b"access-control-expose-headers", CORS_EXPOSE.encode()),
            (b"vary", b"Origin"),
        ]
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            asked = headers.get("access-control-request-headers")
            allow = {
                "Access-Control-Allow-Origin": origin,
                "Access-Control-Allow-Methods": CORS_METHODS,
                "Access-Control-Allow-Headers": asked or CORS_HEADERS,
                "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
                "Vary": "Origin",
            }
            await Response(status_code=204, headers=allow)(scope, receive, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *cors]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def refusal(self, headers: Headers, scheme: str) -> ApiError | None:
        """The 403 for a cross-site request, or ``None``."""
        state = self.state
        host = headers.get("host", "")
        if not state.keys and host_name(host) not in state.hosts:
            return ApiError(403, "this Host is not served here", code="forbidden_host")
        origin = headers.get("origin")
        if origin is not None and not origin_allowed(state, origin, scheme=scheme, host=host):
            return ApiError(
                403,
                "cross-origin requests are refused (convo serve --allow-origin ORIGIN)",
                code="forbidden_origin",
            )
        return None


def install_cross_site_checks(app: FastAPI, state: ServerState) -> None:
    """Refuse cross-site requests (foreign ``Host`` without a key, foreign ``Origin``) with
    403 before any route runs, and serve CORS to the allowed origins (:class:`CrossSiteGuard`)."""
    app.add_middleware(CrossSiteGuard, state=state)
