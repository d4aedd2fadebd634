"""Errors: one table from exception to HTTP status and OpenAI-style body
(``{"error": {"message", "type", "param", "code"}}``), and one mapping from a request that
fails its pydantic model to that body (:func:`validation_error`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, get_args

from pydantic import BaseModel, Field
from pydantic_core.core_schema import ErrorType

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
    RemoteEngineError,
    SessionBusy,
    SessionNotFound,
    StoreError,
    ToolsNotSupported,
)
from convo.tools.spec import ToolSpecError

logger = logging.getLogger(__name__)


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body
    ``{"error": {"message", "type", "param", "code"}}``; ``type`` follows from the status
    unless given (:func:`error_type`), ``param`` names the request field at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or error_type(status)
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorBody(error=detail).model_dump()


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, rate_limit_error...")
    param: str | None = Field(None, description="the request field at fault (messages[0].content)")
    code: str | None = Field(None, description="what failed: unsupported_parameter, queue_full...")


class ErrorBody(BaseModel):
    """Every error response: OpenAI's shape."""

    error: ErrorDetail


_PYDANTIC_ERRORS = frozenset(get_args(ErrorType))

#: The error responses every route documents in ``/openapi.json``.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorBody, "description": "refused: the error says which field and why"},
    "5XX": {"model": ErrorBody, "description": "failed: a timeout, out of memory, the store"},
}


_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    409: "conflict_error",
    429: "rate_limit_error",
}


def error_type(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status."""
    return "server_error" if status >= 500 else _TYPES.get(status, "invalid_request_error")


# Most specific first: the first isinstance match wins.
_STATUS: tuple[tuple[type[BaseException], int, str], ...] = (
    (QueueFullError, 429, "queue_full"),
    (QueueTimeoutError, 503, "queue_timeout"),
    (AdmissionError, 400, "request_too_large"),
    (BudgetError, 400, "context_length_exceeded"),
    (ToolSpecError, 400, "invalid_value"),
    (MessageError, 400, "invalid_message"),
    (ToolsNotSupported, 400, "unsupported_parameter"),
    (ConfigError, 400, "invalid_value"),
    (SessionNotFound, 404, "session_not_found"),
    (SessionBusy, 409, "session_busy"),
    (StoreError, 500, "store_error"),
    (GenerationTimeout, 504, "generation_timeout"),
    (RemoteEngineError, 502, "upstream_error"),
    (DeviceOutOfMemory, 503, "out_of_memory"),
    (ConvoError, 500, "internal_error"),
)


# 5xx errors whose message is convo's own and safe to show; every other 5xx body says only
# what failed, in words fixed here, and the details (which may name a store URL, a path or
# a key) go to the server log.
_SHOWN_5XX = (QueueTimeoutError, GenerationTimeout, DeviceOutOfMemory)
_HIDDEN = {
    "store_error": "the session store failed; the server log has the details",
    "upstream_error": "the model server behind this one failed; the server log has the details",
    "internal_error": "internal server error; the server log has the details",
}


def error_param(exc: BaseException) -> str | None:
    """The request field an exception is about, for the error's ``param``: ``tools`` for
    tools on an engine that cannot use them, the field a :class:`ToolSpecError` names."""
    if isinstance(exc, ToolSpecError):
        return exc.field
    if isinstance(exc, ToolsNotSupported):
        return "tools"
    return None


def error_status(exc: BaseException) -> ApiError:
    """The HTTP error for an exception (the single ConvoError -> HTTP mapping).

    A body never carries a store URL, a path, a key or a stack trace: 5xx errors other
    than convo's own timeouts and out-of-memory get a fixed message (logged in full).
    """
    if isinstance(exc, ApiError):
        return exc
    for kind, status, code in _STATUS:
        if isinstance(exc, kind):
            headers = {}
            if isinstance(exc, QueueFullError):
                headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
            elif isinstance(exc, RemoteEngineError) and exc.retry_after_s is not None:
                headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
            message = str(exc)
            if status >= 500 and not isinstance(exc, _SHOWN_5XX):
                logger.error("%s: %s", code, exc, exc_info=exc)
                message = _HIDDEN.get(code, _HIDDEN["internal_error"])
            return ApiError(status, message, code=code, param=error_param(exc), headers=headers)
    logger.error("unexpected error", exc_info=exc)
    return ApiError(500, _HIDDEN["internal_error"], code="internal_error")


def validation_error(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """The 400 for a request that fails its pydantic model: the first error, ``param``
    naming its field (``messages[0].content``). convo's own checks (a custom error type such
    as ``unsupported_parameter``) give the ``code``; pydantic's built-in ones give
    ``invalid_value``. The refused input is never echoed."""
    first = errors[0] if errors else {}
    loc = list(first.get("loc", ()))
    if loc and loc[0] in ("body", "header", "query", "path"):
        loc = loc[1:]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
    kind = str(first.get("type", ""))
    code = "invalid_value" if kind in _PYDANTIC_ERRORS else kind
    return ApiError(
        400, f"{param or 'the request body'}: {first.get('msg', 'invalid')}", code=code, param=param
    )


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
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Any:
        return error_response(error_status(exc))
