"""Errors: one table from exception to HTTP status and OpenAI-style body."""

from __future__ import annotations

import logging
import math
from typing import Any

from convo.errors import (
    AdmissionError,
    BudgetError,
    ConfigError,
    ConvoError,
    DeviceOutOfMemory,
    GenerationTimeout,
    MessageError,
    QueueFullError,
    QueueTimeoutError,
    SessionBusy,
    SessionNotFound,
    StoreError,
)

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body ``{"error": {"message", "type", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": None, "code": self.code}}


# Most specific first: the first isinstance match wins.
_STATUS: tuple[tuple[type[BaseException], int, str, str], ...] = (
    (QueueFullError, 429, "rate_limit_error", "queue_full"),
    (QueueTimeoutError, 503, "server_error", "queue_timeout"),
    (AdmissionError, 400, "invalid_request_error", "request_too_large"),
    (BudgetError, 400, "invalid_request_error", "context_length_exceeded"),
    (MessageError, 400, "invalid_request_error", "invalid_message"),
    (ConfigError, 400, "invalid_request_error", "invalid_value"),
    (SessionNotFound, 404, "invalid_request_error", "session_not_found"),
    (SessionBusy, 409, "conflict_error", "session_busy"),
    (StoreError, 500, "server_error", "store_error"),
    (GenerationTimeout, 504, "server_error", "generation_timeout"),
    (DeviceOutOfMemory, 503, "server_error", "out_of_memory"),
    (ConvoError, 500, "server_error", "internal_error"),
)


# 5xx errors whose message is convo's own and safe to show; every other 5xx body says only
# what failed, in words fixed here, and the details (which may name a store URL, a path or
# a key) go to the server log.
_SHOWN_5XX = (QueueTimeoutError, GenerationTimeout, DeviceOutOfMemory)
_HIDDEN = {
    "store_error": "the session store failed; the server log has the details",
    "internal_error": "internal server error; the server log has the details",
}


def error_status(exc: BaseException) -> ApiError:
    """The HTTP error for an exception (the single ConvoError -> HTTP mapping).

    A body never carries a store URL, a path, a key or a stack trace: 5xx errors other
    than convo's own timeouts and out-of-memory get a fixed message (logged in full).
    """
    if isinstance(exc, ApiError):
        return exc
    for kind, status, type_, code in _STATUS:
        if isinstance(exc, kind):
            headers = {}
            if isinstance(exc, QueueFullError):
                headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
            message = str(exc)
            if status >= 500 and not isinstance(exc, _SHOWN_5XX):
                logger.error("%s: %s", code, exc, exc_info=exc)
                message = _HIDDEN.get(code, _HIDDEN["internal_error"])
            return ApiError(status, message, type=type_, code=code, headers=headers)
    logger.error("unexpected error", exc_info=exc)
    return ApiError(500, _HIDDEN["internal_error"], type="server_error", code="internal_error")


def error_response(err: ApiError) -> Any:
    """The ``JSONResponse`` of an :class:`ApiError`."""
    from fastapi.responses import JSONResponse

    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def install_error_handlers(app: Any) -> None:
    """Answer every error, expected or not, with an OpenAI-style JSON body: ApiError as it is,
    ConvoError through :func:`error_status`, framework errors as 4xx, anything else as a 500
    with a fixed message (the details go to the log, never to the client)."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Any:
        return error_response(exc)

    @app.exception_handler(ConvoError)
    async def _convo_error(request: Request, exc: ConvoError) -> Any:
        return error_response(error_status(exc))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> Any:
        return error_response(ApiError(exc.status_code, str(exc.detail), code=f"http_{exc.status_code}"))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Any:
        return error_response(ApiError(400, "the request is malformed", code="invalid_request"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Any:
        return error_response(error_status(exc))
