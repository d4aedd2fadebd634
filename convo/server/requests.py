"""Parsing and validating ``/v1/chat/completions`` bodies."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from convo.engines.base import GREEDY, Sampling
from convo.errors import (
    ConfigError,
    MessageError,
)
from convo.messages import Message, check_text
from convo.server.errors import ApiError
from convo.server.limits import ServerLimits

_SESSION_ID = re.compile(r"[A-Za-z0-9._:@-]{1,128}")

#: Most stop sequences a request may give (OpenAI's limit).
MAX_STOP_SEQUENCES = 4
#: Largest ``seed`` accepted (torch seeds are 64-bit); larger gets 400.
MAX_SEED = 2**63 - 1
#: Largest ``temperature`` accepted (OpenAI's range is 0..2).
MAX_TEMPERATURE = 2.0
#: A positive ``temperature`` below this decodes greedily (dividing logits by ~0 overflows).
MIN_SAMPLING_TEMPERATURE = 1e-3

# OpenAI parameters this server does not implement: refused with 400 instead of being
# silently ignored, as strict servers do. (name, is it harmless at this value?)
_UNSUPPORTED = {
    "n": lambda v: v in (None, 1),
    "tools": lambda v: v in (None, []),
    "functions": lambda v: v in (None, []),
    "tool_choice": lambda v: v in (None, "none", "auto"),
    "function_call": lambda v: v in (None, "none", "auto"),
    "logprobs": lambda v: v in (None, False),
    "top_logprobs": lambda v: v in (None, 0),
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "audio": lambda v: v is None,
    "modalities": lambda v: v in (None, ["text"]),
}


@dataclass(frozen=True, kw_only=True)
class ChatRequest:
    """A parsed, validated ``/v1/chat/completions`` body."""

    messages: tuple[Message, ...]
    max_tokens: int | None = None
    stream: bool = False
    include_usage: bool = False
    session_id: str | None = None
    sampling: Sampling = GREEDY
    stop: tuple[str, ...] = ()


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise ApiError(
                    400, f"messages[{index}].content: only text parts are supported", code="invalid_content"
                )
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(
        400, f"messages[{index}].content must be a string or a list of text parts", code="invalid_content"
    )


def _number(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise ApiError(
            400, f"{name} must be a{'n integer' if kind is int else ' number'}", code="invalid_value"
        )
    if kind is float and not math.isfinite(value):
        raise ApiError(400, f"{name} must be a finite number", code="invalid_value")
    return kind(value)


def _flag(body: dict[str, Any], name: str) -> bool:
    """A boolean field: JSON ``true``/``false`` (or absent/null); ``"false"`` is refused."""
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be a boolean (true or false)", code="invalid_value")
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP_SEQUENCES
        or not all(isinstance(x, str) and x for x in stops)
    ):
        raise ApiError(
            400,
            f"stop must be a non-empty string or a list of at most {MAX_STOP_SEQUENCES} non-empty strings",
            code="invalid_value",
        )
    try:
        return tuple(check_text(x, "stop") for x in stops)
    except MessageError as exc:
        raise ApiError(400, str(exc), code="invalid_value") from None


def parse_chat_request(
    body: Any,
    *,
    header_session_id: str | None,
    limits: ServerLimits,
    max_tokens_cap: int,
    session_from_user: bool = False,
) -> ChatRequest:
    """Validate a chat completions body (raises :class:`ApiError` 400).

    Args:
        body: the decoded JSON.
        header_session_id: the ``X-Session-Id`` header, if any (wins over the body's).
        limits: the server's limits.
        max_tokens_cap: the largest ``max_tokens`` allowed.
        session_from_user: read the ``user`` field as a session id (after the header and
            ``metadata.session_id``). Off by default: OpenAI's ``user`` names an end user,
            who may have many conversations.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    for name, harmless in _UNSUPPORTED.items():
        if not harmless(body.get(name)):
            raise ApiError(400, f"{name} is not supported by this server", code="unsupported_parameter")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "messages must be a non-empty list", code="invalid_messages")
    if len(raw) > limits.max_messages:
        raise ApiError(
            400,
            f"{len(raw)} messages, over the limit of {limits.max_messages} per request",
            code="too_many_messages",
        )
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object", code="invalid_messages")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise ApiError(
                400,
                f"messages[{i}].role {role!r} is not supported (system, user, assistant, tool)",
                code="invalid_role",
            )
        fields = {k: m[k] for k in ("tool_calls", "tool_call_id", "name") if m.get(k) is not None}
        try:
            messages.append(
                Message.from_openai({**fields, "role": role, "content": _content_text(m.get("content"), i)})
            )
        except MessageError as exc:
            raise ApiError(400, f"messages[{i}]: {exc}", code="invalid_messages") from None
    cap = max_tokens_cap
    max_tokens = _number(body, "max_completion_tokens", int, None)
    max_tokens = _number(body, "max_tokens", int, max_tokens)
    if max_tokens is not None and not 1 <= max_tokens <= cap:
        raise ApiError(400, f"max_tokens must be between 1 and {cap}", code="invalid_max_tokens")
    options = body.get("stream_options") or {}
    metadata = body.get("metadata") or {}
    if not isinstance(options, dict) or not isinstance(metadata, dict):
        raise ApiError(400, "stream_options and metadata must be objects", code="invalid_value")
    session_id = (
        header_session_id or metadata.get("session_id") or (body.get("user") if session_from_user else None)
    )
    if session_id is not None and (not isinstance(session_id, str) or not _SESSION_ID.fullmatch(session_id)):
        raise ApiError(
            400, "a session id is 1-128 characters of A-Z a-z 0-9 . _ : @ -", code="invalid_session_id"
        )
    temperature = _number(body, "temperature", float, 0.0)
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise ApiError(400, f"temperature must be between 0 and {MAX_TEMPERATURE:g}", code="invalid_value")
    if temperature < MIN_SAMPLING_TEMPERATURE:
        temperature = 0.0  # greedy: what a temperature this close to 0 means
    seed = _number(body, "seed", int, None)
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise ApiError(400, f"seed must be between 0 and {MAX_SEED}", code="invalid_value")
    try:
        sampling = Sampling(temperature=temperature, top_p=_number(body, "top_p", float, 1.0), seed=seed)
    except ConfigError as exc:
        raise ApiError(400, str(exc), code="invalid_value") from None
    return ChatRequest(
        messages=tuple(messages),
        max_tokens=max_tokens,
        stream=_flag(body, "stream"),
        include_usage=_flag(options, "include_usage"),
        session_id=session_id,
        sampling=sampling,
        stop=_stop(body),
    )
