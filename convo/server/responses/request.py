"""``POST /v1/responses`` bodies: the pydantic model FastAPI validates them against and the
:class:`ResponsesRequest` a turn runs.

Stricter than ``/v1/chat/completions``: a field this server does not know gets 400 naming
it (OpenAI's Responses API is new, and a silently ignored field there usually asks for a
built-in feature). The fields it knows but does not implement (``background``,
``conversation``, ``reasoning``, ``prompt``, ``include``...) pass only with a value that
asks for nothing; any other gets 400 ``unsupported_parameter`` naming the field. Built-in
tools (``web_search``, ``file_search``, ``code_interpreter``...) get 400 naming
``tools[i].type``: only function tools are served.

``input`` is a string (one user message) or a list of items, read into convo messages:

==========================  =============================================================
item                        message
==========================  =============================================================
``message`` (``type`` may   its role (``developer`` as ``system``); ``content`` a string or
be left out)                ``input_text`` / ``output_text`` parts
``function_call``           a tool call of the assistant message before it (or a new one)
``function_call_output``    a ``tool`` message answering ``call_id``
anything else               400 naming ``input[i].type``
==========================  =============================================================
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from convo.engines.base import Sampling
from convo.errors import MessageError
from convo.messages import Message, Role, ToolCall, check_text
from convo.server.errors import ApiError
from convo.server.limits import ServerLimits
from convo.server.requests import (
    MAX_TEMPERATURE,
    MIN_SAMPLING_TEMPERATURE,
    ChatRequest,
    _Body,
    _MaxTokens,
    _Unsupported,
)
from convo.tools.spec import ToolSpecError, parse_tool_request

#: Most ``metadata`` keys a response may carry (OpenAI's limit), and their sizes.
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512

#: The input item types served (anything else: 400 naming ``input[i].type``).
INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output")

_Key = Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)]
_Value = Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)]


class TextFormat(_Body):
    type: Literal["text"]


class TextConfig(_Body):
    """``text``: only plain text output (no JSON schema, no verbosity)."""

    model_config = ConfigDict(extra="forbid")

    format: Annotated[TextFormat | None, _Unsupported] = None
    verbosity: Annotated[None, _Unsupported] = None


class ResponseStreamOptions(_Body):
    include_obfuscation: bool | None = Field(None, description="ignored: no obfuscation is added")


class ResponsesBody(_Body):
    """The body of ``POST /v1/responses`` (OpenAI's Responses request, function tools only).

    ``previous_response_id`` continues the conversation convo keeps for that response (an
    older response of it: the conversation branches there, see
    :mod:`convo.server.responses.records`). ``store: false`` keeps nothing (and cannot
    continue a kept conversation).
    """

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="ignored: the server runs one model")
    input: Any = Field(description="a string (one user message) or a list of input items")
    instructions: str | None = Field(None, description="the system prompt of a new conversation")
    previous_response_id: str | None = Field(None, description="continue that response's conversation")
    store: bool | None = Field(None, description="keep the response and its conversation (default true)")
    stream: bool | None = None
    stream_options: ResponseStreamOptions | None = None
    tools: Any = Field(None, description="function tools: [{type: function, name, parameters...}]")
    tool_choice: Any = Field(None, description="auto, none, required or {type: function, name}")
    parallel_tool_calls: Any = Field(None, description="whether the model may ask for several calls")
    max_output_tokens: _MaxTokens = Field(None, description="reply cap, at most the server's")
    metadata: Annotated[dict[_Key, _Value], Field(max_length=MAX_METADATA_KEYS)] | None = None
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = Field(
        None, description="0 or absent: greedy decoding"
    )
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    truncation: Literal["auto", "disabled"] | None = Field(
        None, description="either way the prompt is fitted into the budget (never over the context)"
    )
    text: TextConfig | None = None
    user: str | None = Field(None, description="ignored (an end user)")
    safety_identifier: str | None = Field(None, description="ignored")
    prompt_cache_key: str | None = Field(None, description="ignored")
    service_tier: Literal["auto", "default"] | None = Field(None, description="ignored")
    include: Annotated[Annotated[list[Any], Field(max_length=0)] | None, _Unsupported] = None
    background: Annotated[Literal[False] | None, _Unsupported] = None
    conversation: Annotated[None, _Unsupported] = None
    reasoning: Annotated[None, _Unsupported] = None
    prompt: Annotated[None, _Unsupported] = None
    max_tool_calls: Annotated[None, _Unsupported] = None
    top_logprobs: Annotated[Literal[0] | None, _Unsupported] = None
    prompt_cache_retention: Annotated[None, _Unsupported] = None
    prompt_cache_options: Annotated[None, _Unsupported] = None
    context_management: Annotated[None, _Unsupported] = None

    def to_request(self, *, limits: ServerLimits, max_tokens_cap: int) -> ResponsesRequest:
        """The turn to run (without its session, which the route picks); 400 naming the field
        for what the model alone cannot check."""
        if self.max_output_tokens is not None and self.max_output_tokens > max_tokens_cap:
            raise ApiError(
                400,
                f"max_output_tokens: at most {max_tokens_cap} (this server's reply cap)",
                code="invalid_max_tokens",
                param="max_output_tokens",
            )
        messages = read_input(self.input, limits)
        if self.instructions:
            try:
                check_text(self.instructions, "instructions")
            except MessageError as exc:
                raise ApiError(400, str(exc), code="invalid_value", param="instructions") from None
            messages.insert(0, Message(role=Role.SYSTEM, content=self.instructions))
        temperature = self.temperature or 0.0
        if temperature < MIN_SAMPLING_TEMPERATURE:
            temperature = 0.0  # greedy: what a temperature this close to 0 means
        tools, choice = chat_tools(self.tools), chat_tool_choice(self.tool_choice)
        try:
            offered = parse_tool_request(tools, choice, self.parallel_tool_calls)
        except ToolSpecError as exc:
            param = _responses_param(exc.field)
            raise ApiError(
                400, f"{param}: {_responses_param(str(exc))}", code="invalid_value", param=param
            ) from None
        specs = tuple(t.to_openai() for t in offered.tools)
        chat = ChatRequest(
            messages=tuple(messages),
            max_tokens=self.max_output_tokens,
            stream=bool(self.stream),
            sampling=Sampling(temperature=temperature, top_p=self.top_p or 1.0),
            tools=specs,
            tool_choice=offered.choice.to_openai() if specs and self.tool_choice is not None else None,
            parallel_tool_calls=offered.parallel_tool_calls
            if specs and self.parallel_tool_calls is not None
            else None,
        )
        return ResponsesRequest(
            chat=chat,
            instructions=self.instructions,
            previous_response_id=self.previous_response_id,
            store=self.store is not False,
            metadata=dict(self.metadata or {}),
            tools=[responses_tool(t) for t in specs],
            tool_choice=responses_tool_choice(offered.choice.to_openai()) if specs else "none",
            parallel_tool_calls=offered.parallel_tool_calls,
            temperature=self.temperature if self.temperature is not None else 0.0,
            top_p=self.top_p if self.top_p is not None else 1.0,
            truncation=self.truncation or "disabled",
        )


@dataclass(frozen=True, kw_only=True)
class ResponsesRequest:
    """A validated ``/v1/responses`` request: the chat turn it runs, and what the response
    object repeats back (in the Responses API's shapes)."""

    #: The turn as chat completions run it (its ``session_id`` is set by the route).
    chat: ChatRequest
    instructions: str | None = None
    previous_response_id: str | None = None
    #: ``store`` (default true): keep the response and its conversation.
    store: bool = True
    metadata: dict[str, str] = field(default_factory=dict)
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    temperature: float = 0.0
    top_p: float = 1.0
    truncation: str = "disabled"


# -- tools: the Responses shapes <-> the chat shapes the engines take -----------------------

#: A chat-shaped field name in a ToolSpecError (``tools[0].function.name``) as the
#: Responses API names it (``tools[0].name``).
_FUNCTION_LEVEL = re.compile(r"\.function(?=\.|\b)")


def _responses_param(text: str) -> str:
    return _FUNCTION_LEVEL.sub("", text)


def chat_tools(tools: Any) -> Any:
    """Responses function tools (``{type, name, description, parameters, strict}``) in the
    chat shape (``{type, function: {...}}``) that :func:`parse_tool_request` checks; a
    built-in tool gets 400 naming ``tools[i].type``. What is not a list is passed on for
    :func:`parse_tool_request` to refuse."""
    if not isinstance(tools, list):
        return tools
    out: list[Any] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            out.append(tool)
            continue
        kind = tool.get("type")
        if kind != "function":
            raise ApiError(
                400,
                f"tools[{i}].type: {kind!r} is not supported by this server (only 'function' tools; "
                "built-in tools such as web_search or file_search are not served)",
                code="unsupported_parameter",
                param=f"tools[{i}].type",
            )
        function = {k: v for k, v in tool.items() if k != "type"}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """A Responses ``tool_choice`` in the chat shape (``{type: function, name}`` becomes
    ``{type: function, function: {name}}``); hosted-tool choices get 400."""
    if not isinstance(choice, Mapping):
        return choice
    kind = choice.get("type")
    if kind != "function":
        raise ApiError(
            400,
            f"tool_choice.type: {kind!r} is not supported by this server (auto, none, required "
            "or {type: function, name})",
            code="unsupported_parameter",
            param="tool_choice.type",
        )
    return {"type": "function", "function": {"name": choice.get("name")}}


def responses_tool(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A validated chat-shaped tool in the Responses shape (what a response repeats)."""
    function = dict(spec["function"])
    return {
        "type": "function",
        "name": function["name"],
        "description": function.get("description"),
        "parameters": function.get("parameters"),
        "strict": function.get("strict"),
    }


def responses_tool_choice(choice: Any) -> Any:
    if isinstance(choice, Mapping):
        return {"type": "function", "name": choice["function"]["name"]}
    return choice


# -- input items ---------------------------------------------------------------------------


def _fail(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {message}", code=code, param=param)


def _text_of(content: Any, where: str, parts: tuple[str, ...]) -> str:
    """A message's text (``where`` names its field): a string, or text parts of the given
    types joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _fail(where, "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise _fail(f"{where}[{j}]", "must be an object")
        if part.get("type") not in parts:
            raise _fail(
                f"{where}[{j}].type",
                f"{part.get('type')!r} is not supported here ({', '.join(parts)})",
                "unsupported_parameter",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise _fail(f"{where}[{j}].text", "must be a string")
        texts.append(text)
    return "".join(texts)


def _string(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise _fail(f"{where}.{key}", "must be a non-empty string")
    return value


def _message(item: Mapping[str, Any], where: str) -> Message:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise _fail(f"{where}.role", "must be user, system, developer or assistant")
    parts = ("output_text", "refusal", "input_text") if role == "assistant" else ("input_text",)
    content = item.get("content")
    if role == "assistant" and isinstance(content, list):  # a refusal part's text is "refusal"
        content = [{**p, "text": p.get("refusal")} if p.get("type") == "refusal" else p for p in content]
    text = _text_of(content, f"{where}.content", parts)
    return Message.from_openai({"role": role, "content": text})


def _call(item: Mapping[str, Any], where: str) -> ToolCall:
    arguments = item.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise _fail(f"{where}.arguments", "must be a JSON string")
    return ToolCall(
        id=_string(item, "call_id", where), name=_string(item, "name", where), arguments=arguments
    )


def _output(item: Mapping[str, Any], where: str) -> Message:
    output = item.get("output")
    text = _text_of(output, f"{where}.output", ("input_text", "output_text"))
    return Message(role=Role.TOOL, content=text, tool_call_id=_string(item, "call_id", where))


def read_input(value: Any, limits: ServerLimits) -> list[Message]:
    """``input`` as convo messages (see the module docstring); 400 naming the item at fault.

    Function calls join the assistant message right before them, as chat completions
    carry them (a reply's text and its calls are one assistant message)."""
    if isinstance(value, str):
        items: list[Any] = [{"role": "user", "content": value}]
    elif isinstance(value, list) and value:
        items = value
    else:
        raise _fail("input", "must be a string or a non-empty list of input items")
    if len(items) > limits.max_messages:
        raise ApiError(
            400,
            f"input: {len(items)} items, over the limit of {limits.max_messages} per request",
            code="too_many_messages",
            param="input",
        )
    messages: list[Message] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise _fail(where, "must be an object")
        kind = item.get("type", "message")
        try:
            if kind == "message":
                messages.append(_message(item, where))
            elif kind == "function_call":
                call = _call(item, where)
                last = messages[-1] if messages else None
                if last is not None and last.role is Role.ASSISTANT:
                    messages[-1] = Message(
                        role=Role.ASSISTANT, content=last.content, tool_calls=(*last.tool_calls, call)
                    )
                else:
                    messages.append(Message(role=Role.ASSISTANT, content="", tool_calls=(call,)))
            elif kind == "function_call_output":
                messages.append(_output(item, where))
            else:
                raise _fail(
                    f"{where}.type",
                    f"{kind!r} items are not supported by this server ({', '.join(INPUT_ITEM_TYPES)})",
                    "unsupported_parameter",
                )
        except MessageError as exc:
            raise _fail(where, str(exc), "invalid_message") from None
    return messages
