"""``/v1/chat/completions`` bodies: the pydantic model FastAPI validates them against (so
``/openapi.json`` documents them) and the :class:`ChatRequest` a turn runs.

The model is strict where OpenAI's API is loose in practice and a loose server is unsafe:
JSON types are not coerced (``"1"`` is not a number, ``0`` is not ``false``), numbers are
finite, and the OpenAI parameters this server does not implement get 400
``unsupported_parameter`` unless they ask for what it does anyway (``n: 1``,
``functions: []``...). ``tools``, ``tool_choice`` and ``parallel_tool_calls`` are
validated by :func:`convo.tools.parse_tool_request` (400 whose ``param`` names the field,
``tools[0].function.name``). Other unknown fields are ignored, as OpenAI-compatible servers do. A
failure is one 400 in OpenAI's error JSON whose ``param`` names the field
(:func:`convo.server.errors.validation_error`). What depends on the server's configuration
(``max_tokens`` against the budget, the message count and the length of each ``stop``
string against :class:`~convo.server.limits.ServerLimits`) is checked by
:meth:`ChatCompletionBody.to_request`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from convo.engines.base import GREEDY, Sampling
from convo.errors import ConfigError, MessageError
from convo.messages import Message, check_text
from convo.server.errors import ApiError
from convo.server.limits import ServerLimits
from convo.server.memory import check_user_id
from convo.tools.spec import ToolSpecError, parse_tool_request

#: Most stop sequences a request may give (OpenAI's limit).
MAX_STOP_SEQUENCES = 4
#: Largest ``seed`` accepted (torch seeds are 64-bit); larger gets 400.
MAX_SEED = 2**63 - 1
#: Largest ``temperature`` accepted (OpenAI's range is 0..2).
MAX_TEMPERATURE = 2.0
#: A positive ``temperature`` below this decodes greedily (dividing logits by ~0 overflows).
MIN_SAMPLING_TEMPERATURE = 1e-3

_SESSION_ID = r"[A-Za-z0-9._:@-]{1,128}"
_SESSION_ID_RULE = "a session id is 1-128 characters of A-Z a-z 0-9 . _ : @ -"


def _refuse(code: str, message: str) -> WrapValidator:
    """Report any failure of the annotated type as one error: ``code`` (the error JSON's
    ``code``) with ``message``, instead of one error per member of a union."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError(code, message) from None

    return WrapValidator(validate)


def _invalid(code: str, exc: Exception) -> PydanticCustomError:
    """A validation error carrying a convo error's message (passed as context: the message
    may hold braces)."""
    return PydanticCustomError(code, "{reason}", {"reason": str(exc)})


#: OpenAI parameters this server does not implement: only their harmless values pass; any
#: other gets 400 ``unsupported_parameter`` instead of being silently ignored.
_Unsupported = _refuse("unsupported_parameter", "not supported by this server")
_NoList = Annotated[list[Any], Field(max_length=0)]
_NoTool = Literal["none", "auto"]
_MaxTokens = Annotated[
    Annotated[int, Field(ge=1)] | None, _refuse("invalid_max_tokens", "must be an integer >= 1")
]
#: A session id (``X-Session-Id``, ``metadata.session_id``).
SessionId = Annotated[str, Field(pattern=f"^{_SESSION_ID}$"), _refuse("invalid_session_id", _SESSION_ID_RULE)]


class _Body(BaseModel):
    """JSON types as sent (no coercion), finite numbers, unknown fields ignored."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class TextPart(_Body):
    """One part of a message's ``content`` list; only text is supported."""

    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = Field("{}", description="JSON text (an object is serialized)")


class ToolCall(_Body):
    """A tool call of an assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    """One message of the conversation (``developer`` is read as ``system``)."""

    role: Annotated[
        Literal["system", "developer", "user", "assistant", "tool"],
        _refuse("invalid_role", "is not supported (system, developer, user, assistant, tool)"),
    ]
    content: Annotated[
        str | list[TextPart] | None,
        _refuse("invalid_content", "must be a string, null or a list of text parts"),
    ] = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    _message: Message = PrivateAttr()

    @model_validator(mode="after")
    def _read(self) -> Self:
        """Build the :class:`Message` (which refuses lone surrogates, misplaced tool fields)."""
        try:
            self._message = Message.from_openai(self.model_dump(exclude_none=True))
        except MessageError as exc:
            raise _invalid("invalid_messages", exc) from None
        return self

    @property
    def message(self) -> Message:
        return self._message


def _stops(stop: str | list[str] | None) -> list[str]:
    return [] if stop is None else [stop] if isinstance(stop, str) else stop


def _stop_text(stop: Any) -> Any:
    """Refuse stop sequences UTF-8 cannot encode (a lone surrogate), before their type is
    checked (pydantic's own message for them says less)."""
    try:
        for text in [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else ():
            if isinstance(text, str):
                check_text(text, "the text")
    except MessageError as exc:
        raise _invalid("invalid_value", exc) from None
    return stop


class StreamOptions(_Body):
    include_usage: bool | None = Field(None, description="end the stream with a usage chunk")


class Metadata(_Body):
    """Free-form; ``session_id`` names the conversation the server keeps."""

    model_config = ConfigDict(extra="allow")

    session_id: SessionId | None = None
    #: The person whose memory the session retrieves from (their earlier sessions), see
    #: :mod:`convo.server.memory`; the request's ``user`` does the same.
    user_id: str | None = None
    #: Vector stores whose chunks the reply may use (``vs_...`` ids: a list, or one string
    #: of ids separated by commas, as OpenAI's metadata values are strings).
    vector_store_ids: list[str] | str | None = None


class TextFormat(_Body):
    type: Literal["text"]


class ChatCompletionBody(_Body):
    """The body of ``POST /v1/chat/completions`` (OpenAI's Chat Completions request).

    ``tools`` (function tools), ``tool_choice`` and ``parallel_tool_calls`` are OpenAI's,
    checked by :func:`~convo.tools.parse_tool_request` in :meth:`to_request`. ``n``, the
    legacy ``functions`` and ``function_call``, ``logprobs``, ``top_logprobs``,
    ``response_format``, ``audio`` and ``modalities`` are not supported: only values that
    ask for what the server does anyway pass (``n: 1``, ``functions: []``,
    ``response_format: {"type": "text"}``...); any other gets 400 ``unsupported_parameter``.
    Other fields OpenAI defines (``frequency_penalty``...) are ignored.
    """

    model: str | None = Field(None, description="ignored: the server runs one model")
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: _MaxTokens = Field(
        None, description="reply cap, at most the server's (default: the budget's max_new_tokens)"
    )
    max_completion_tokens: _MaxTokens = Field(
        None, description="as max_tokens, which wins when both are given"
    )
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = Field(
        None, description="0 or absent: greedy decoding"
    )
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    stop: Annotated[
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP_SEQUENCES)]
        | None,
        _refuse(
            "invalid_value",
            f"must be a non-empty string or a list of at most {MAX_STOP_SEQUENCES} non-empty strings",
        ),
        BeforeValidator(_stop_text),
    ] = None
    metadata: Metadata | None = None
    user: str | None = Field(None, description="an end user; the session id only with --session-from-user")
    n: Annotated[Literal[1] | None, _Unsupported] = None
    tools: Any = Field(
        None, description="OpenAI function tools: [{type: function, function: {name, parameters...}}]"
    )
    functions: Annotated[_NoList | None, _Unsupported] = None
    tool_choice: Any = Field(None, description="auto, none, required or {type: function, function: {name}}")
    parallel_tool_calls: Any = Field(None, description="whether the model may ask for several calls at once")
    function_call: Annotated[_NoTool | None, _Unsupported] = None
    logprobs: Annotated[Literal[False] | None, _Unsupported] = None
    top_logprobs: Annotated[Literal[0] | None, _Unsupported] = None
    response_format: Annotated[TextFormat | None, _Unsupported] = None
    audio: Annotated[None, _Unsupported] = None
    modalities: Annotated[
        Annotated[list[Literal["text"]], Field(min_length=1, max_length=1)] | None, _Unsupported
    ] = None

    def to_request(
        self,
        *,
        header_session_id: str | None,
        limits: ServerLimits,
        max_tokens_cap: int,
        session_from_user: bool = False,
    ) -> ChatRequest:
        """The turn to run; what depends on the server's limits is checked here (400).

        Args:
            header_session_id: the ``X-Session-Id`` header, if any (wins over the body's).
            limits: the server's limits.
            max_tokens_cap: the largest ``max_tokens`` allowed.
            session_from_user: read the ``user`` field as a session id (after the header and
                ``metadata.session_id``). Off by default: OpenAI's ``user`` names an end user,
                who may have many conversations.
        """
        if len(self.messages) > limits.max_messages:
            raise ApiError(
                400,
                f"messages: {len(self.messages)}, over the limit of {limits.max_messages} per request",
                code="too_many_messages",
                param="messages",
            )
        param = "max_tokens" if self.max_tokens is not None else "max_completion_tokens"
        max_tokens = self.max_tokens if self.max_tokens is not None else self.max_completion_tokens
        if max_tokens is not None and max_tokens > max_tokens_cap:
            raise ApiError(
                400,
                f"{param}: at most {max_tokens_cap} (this server's reply cap)",
                code="invalid_max_tokens",
                param=param,
            )
        stops = _stops(self.stop)
        for i, text in enumerate(stops):
            if len(text) > limits.max_stop_chars:
                where = "stop" if isinstance(self.stop, str) else f"stop[{i}]"
                raise ApiError(
                    400,
                    f"stop: {where} has {len(text)} characters, over this server's limit of "
                    f"{limits.max_stop_chars} per stop string",
                    code="invalid_value",
                    param="stop",
                )
        session_id = header_session_id or (self.metadata.session_id if self.metadata else None)
        if session_id is None and session_from_user and self.user is not None:
            if not re.fullmatch(_SESSION_ID, self.user):
                raise ApiError(400, f"user: {_SESSION_ID_RULE}", code="invalid_session_id", param="user")
            session_id = self.user
        user_id = self.metadata.user_id if self.metadata else None
        if user_id is None and not session_from_user:
            user_id = self.user  # OpenAI's end user: a person's memory across sessions
        if user_id is not None:
            try:
                check_user_id(user_id)
            except ConfigError as exc:
                where = "metadata.user_id" if self.metadata and self.metadata.user_id is not None else "user"
                raise ApiError(400, f"{where}: {exc}", code="invalid_value", param=where) from None
        stores = self.metadata.vector_store_ids if self.metadata else None
        if isinstance(stores, str):
            stores = [s.strip() for s in stores.split(",") if s.strip()]
        temperature = self.temperature or 0.0
        if temperature < MIN_SAMPLING_TEMPERATURE:
            temperature = 0.0  # greedy: what a temperature this close to 0 means
        sampling = Sampling(temperature=temperature, top_p=self.top_p or 1.0, seed=self.seed)
        try:
            offered = parse_tool_request(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ToolSpecError as exc:
            raise ApiError(400, str(exc), code="invalid_value", param=exc.field) from None
        tools = tuple(t.to_openai() for t in offered.tools)
        return ChatRequest(
            messages=tuple(m.message for m in self.messages),
            max_tokens=max_tokens,
            stream=bool(self.stream),
            include_usage=bool(self.stream_options and self.stream_options.include_usage),
            session_id=session_id,
            user_id=user_id,
            vector_store_ids=tuple(stores or ()),
            sampling=sampling,
            stop=tuple(stops),
            tools=tools,
            # Only what the client chose (else the engine's defaults), and only with tools:
            # "tool_choice": "none" or "auto" without tools asks for nothing.
            tool_choice=offered.choice.to_openai() if tools and self.tool_choice is not None else None,
            parallel_tool_calls=offered.parallel_tool_calls
            if tools and self.parallel_tool_calls is not None
            else None,
        )


@dataclass(frozen=True, kw_only=True)
class ChatRequest:
    """A validated ``/v1/chat/completions`` request, as a turn runs it."""

    messages: tuple[Message, ...]
    max_tokens: int | None = None
    stream: bool = False
    include_usage: bool = False
    session_id: str | None = None
    #: The person (``user`` / ``metadata.user_id``) whose memory a session retrieves from.
    user_id: str | None = None
    #: The vector stores (``metadata.vector_store_ids``) the reply may use.
    vector_store_ids: tuple[str, ...] = ()
    sampling: Sampling = GREEDY
    stop: tuple[str, ...] = ()
    #: OpenAI function tools offered to the model (validated, in OpenAI's shape).
    tools: tuple[dict[str, Any], ...] = ()
    #: The client's ``tool_choice`` (``None``: the engine's default).
    tool_choice: str | dict[str, Any] | None = None
    #: The client's ``parallel_tool_calls`` (``None``: the engine's default).
    parallel_tool_calls: bool | None = None

    def tool_options(self) -> dict[str, Any]:
        """The turn's tool keywords (:class:`~convo.session.TurnOptions`); empty without tools."""
        if not self.tools:
            return {}
        options: dict[str, Any] = {"tools": list(self.tools)}
        if self.tool_choice is not None:
            options["tool_choice"] = self.tool_choice
        if self.parallel_tool_calls is not None:
            options["parallel_tool_calls"] = self.parallel_tool_calls
        return options
