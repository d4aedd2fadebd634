"""Chat messages and the atomic groups that eviction moves as a whole.

A conversation is a list of :class:`Message`. For eviction it is cut into *blocks*: a
block is never split, so an assistant message that calls tools always leaves (or stays)
together with every tool result answering it. *Turns* group blocks: a turn starts at a
user message and runs until the next one, so "the recent N turns" means the last N user
messages and everything that answered them.

Text policy: every string a message carries (content, name, tool ids and arguments) must
be encodable as UTF-8. Text that is not (a lone surrogate such as ``"\\ud800"``, which
a JSON body can carry as an escape) is refused with :class:`~convo.errors.MessageError`
when the :class:`Message` is built, so it never reaches a store, a tokenizer or a model.
Nothing is replaced silently.
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from convo.errors import MessageError


def check_text(value: object, what: str) -> str:
    """Return ``value`` if it is a string that can be encoded as UTF-8.

    Raises:
        MessageError: not a string, or it holds a lone surrogate (see the text policy above).
    """
    if not isinstance(value, str):
        raise MessageError(f"{what} must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise MessageError(
            f"{what} is not valid Unicode text: {exc.reason} U+{ord(value[exc.start]):04X} at "
            f"index {exc.start}; send UTF-8 text (lone surrogates are refused)"
        ) from None
    return value


class Role(enum.StrEnum):
    """Who wrote a message. Strings become a ``Role`` at the edge (``Role("user")``)."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


@dataclass(frozen=True, kw_only=True)
class ToolCall:
    """One function call requested by the assistant (OpenAI shape).

    Args:
        id: the call id that the matching tool result names in ``tool_call_id``.
        name: the function name.
        arguments: the arguments as a JSON string, exactly as the model produced them.
    """

    id: str
    name: str
    arguments: str = "{}"

    def __post_init__(self) -> None:
        for attr in ("id", "name", "arguments"):
            check_text(getattr(self, attr), f"ToolCall.{attr}")
        if not self.id:
            raise MessageError("ToolCall.id must not be empty")

    @property
    def parsed_arguments(self) -> dict[str, Any] | None:
        """The arguments as a dict, or ``None`` when they are not a JSON object (a model
        may produce broken JSON; ``arguments`` keeps its text as it came).

        Example:
            >>> ToolCall(id="c1", name="f", arguments='{"x": 1}').parsed_arguments
            {'x': 1}
            >>> ToolCall(id="c1", name="f", arguments='{"x": ').parsed_arguments is None
            True
        """
        try:
            value = json.loads(self.arguments)
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True, kw_only=True)
class Message:
    """One chat message.

    Args:
        role: ``"system"``, ``"user"``, ``"assistant"`` or ``"tool"`` (or a :class:`Role`).
        content: the text. Must be a string (may be empty for a pure tool call).
        tool_calls: tool calls requested by an assistant message.
        tool_call_id: for a tool message, the id of the call it answers.
        name: optional author name (tool name for tool results).
        pinned: a pinned message is never evicted: it is always shown in the prompt's
            system part. System messages are pinned implicitly.
        created_at: UNIX time, seconds.
        opens_turn: the message opens a new turn although its role alone would not (an
            assistant message added with a new day's date, :meth:`Session.add
            <convo.session.Session.add>`). Stored with it, so a session read back cuts its
            turns the same way; not part of what a model is shown, nor of equality.

    Example:
        >>> Message(role="user", content="hi").role
        <Role.USER: 'user'>
    """

    role: Role
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    pinned: bool = False
    created_at: float = field(default_factory=time.time, compare=False)
    opens_turn: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        try:
            role = self.role if type(self.role) is Role else Role(self.role)
        except ValueError:
            valid = ", ".join(r.value for r in Role)
            raise MessageError(f"invalid role {self.role!r}; expected one of: {valid}") from None
        object.__setattr__(self, "role", role)
        check_text(self.content, "message content")
        for attr in ("tool_call_id", "name"):
            if getattr(self, attr) is not None:
                check_text(getattr(self, attr), f"message {attr}")
        calls = tuple(self.tool_calls)
        for call in calls:
            if not isinstance(call, ToolCall):
                raise MessageError("tool_calls must hold ToolCall objects")
        object.__setattr__(self, "tool_calls", calls)
        if calls and role is not Role.ASSISTANT:
            raise MessageError("only assistant messages can carry tool_calls")
        if role is Role.TOOL and not self.tool_call_id:
            raise MessageError("a tool message needs the tool_call_id it answers")
        if role is not Role.TOOL and self.tool_call_id is not None:
            raise MessageError("tool_call_id is only valid on tool messages")
        if role is Role.SYSTEM:
            object.__setattr__(self, "pinned", True)

    @property
    def key(self) -> tuple[Any, ...]:
        """A hashable identity of the rendered content (used by token-count caches)."""
        return (self.role, self.content, self.tool_calls, self.tool_call_id, self.name)

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI / Hugging Face chat-template dict for this message."""
        out: dict[str, Any] = {"role": self.role.value, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    def to_record(self) -> dict[str, Any]:
        """A JSON-safe dict that :meth:`from_record` reads back (used by stores, export)."""
        out = self.to_dict()
        out["pinned"] = self.pinned
        out["created_at"] = self.created_at
        if self.opens_turn:
            out["opens_turn"] = True
        return out

    def to_openai(self) -> dict[str, Any]:
        """The message as an OpenAI Chat Completions dict.

        An assistant message that only calls tools gets ``"content": None``, as the API
        returns it. :meth:`from_openai` reads the result back to an equal message.

        Example:
            >>> Message(role="user", content="hi").to_openai()
            {'role': 'user', 'content': 'hi'}
        """
        out = self.to_dict()
        if self.tool_calls and not self.content:
            out["content"] = None
        return out

    @classmethod
    def from_openai(cls, message: Mapping[str, Any] | Message) -> Message:
        """Read an OpenAI Chat Completions message dict.

        Accepts what the ``openai`` SDK sends and returns: ``content`` as a string,
        ``None`` (an assistant message that only calls tools) or a list of text parts
        (``[{"type": "text", "text": ...}]``); assistant ``tool_calls`` (``arguments`` as a
        JSON string, or an object that is serialized); ``tool`` results with their
        ``tool_call_id``; the ``developer`` role, read as ``system``; an assistant
        ``refusal`` (a string, or ``{"type": "refusal"}`` content parts), read as text of the
        content, since a model is shown it. A :class:`Message` is returned unchanged.

        Every field a model is shown is read, so that what :func:`convo.fit` counts is what
        it sends: fields it cannot count are refused, never passed through uncounted
        (:data:`UNCOUNTABLE_FIELDS`). Other keys (your own metadata) are ignored.

        Raises:
            MessageError: not a mapping, an unknown role, non-text content parts, a tool
                call without an id or of a type other than ``function``, or a field of
                :data:`UNCOUNTABLE_FIELDS` that is set.

        Example:
            >>> Message.from_openai({"role": "tool", "tool_call_id": "c1", "content": "42"}).role
            <Role.TOOL: 'tool'>
        """
        if isinstance(message, Message):
            return message
        if not isinstance(message, Mapping):
            raise MessageError(f"a message must be a mapping, got {type(message).__name__}")
        if "role" not in message:
            raise MessageError("a message needs a 'role'")
        role = message["role"]
        if role == "developer":
            role = Role.SYSTEM
        for key, why in UNCOUNTABLE_FIELDS.items():
            if message.get(key) is not None:
                raise MessageError(f"message field {key!r} cannot be counted: {why}")
        calls = []
        raw_calls = message.get("tool_calls") or ()
        if not isinstance(raw_calls, (list, tuple)):
            raise MessageError("tool_calls must be a list")
        for raw in raw_calls:
            if not isinstance(raw, Mapping):
                raise MessageError("each tool call must be a mapping")
            if raw.get("type", "function") != "function":
                raise MessageError(
                    f"a tool call of type {raw.get('type')!r} cannot be counted; only 'function' "
                    "calls are supported"
                )
            fn = raw.get("function") or {}
            if not isinstance(fn, Mapping):
                raise MessageError("a tool call's 'function' must be a mapping")
            args = fn.get("arguments", "{}")
            if not isinstance(args, str):
                args = json.dumps(args)
            calls.append(ToolCall(id=raw.get("id") or "", name=fn.get("name", ""), arguments=args))
        kwargs: dict[str, Any] = {}
        if "created_at" in message:
            try:
                kwargs["created_at"] = float(message["created_at"])
            except (TypeError, ValueError):
                raise MessageError(f"created_at must be a number, got {message['created_at']!r}") from None
        content = content_text(message.get("content"))
        refusal = message.get("refusal")
        if refusal is not None and check_text(refusal, "message refusal"):
            content = f"{content}\n{refusal}" if content else refusal  # a model is shown it
        return cls(
            role=role,
            content=content,
            tool_calls=tuple(calls),
            tool_call_id=message.get("tool_call_id"),
            name=message.get("name"),
            pinned=bool(message.get("pinned", False)),
            **kwargs,
        )

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Message:
        """Build a message from a stored record (or any OpenAI-style dict)."""
        message = cls.from_openai(record)
        return replace(message, opens_turn=True) if record.get("opens_turn") is True else message


#: Fields of an OpenAI message dict that a model is shown but convo cannot count:
#: :meth:`Message.from_openai` refuses a message that sets one (with the reason), so
#: :func:`convo.fit` never returns content its ``prompt_tokens`` left out.
UNCOUNTABLE_FIELDS: dict[str, str] = {
    "function_call": "the legacy function-calling field; send the call as 'tool_calls' "
    "([{'id': ..., 'type': 'function', 'function': {'name': ..., 'arguments': ...}}]) and its "
    "result as a 'tool' message",
    "audio": "an assistant audio reference; send its transcript as 'content'",
}


#: What APIs that take messages accept: a :class:`Message` or an OpenAI message dict.
MessageLike = Message | Mapping[str, Any]


def content_text(content: Any) -> str:
    """The text of an OpenAI ``content`` field: a string, ``None`` (empty) or a list of
    text (or ``refusal``) parts, joined.

    Raises:
        MessageError: a part that is not text (images, audio, files are not supported).
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
                continue
            if isinstance(part, Mapping) and part.get("type") == "refusal":
                parts.append(check_text(part.get("refusal"), "a refusal content part"))
                continue
            if (
                not isinstance(part, Mapping)
                or part.get("type") not in ("text", "input_text", "output_text")
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise MessageError(f"only text content parts are supported, got {kind!r}")
            parts.append(part["text"])
        return "".join(parts)
    raise MessageError(
        f"message content must be a string or a list of text parts, got {type(content).__name__}"
    )


def as_message(message: MessageLike) -> Message:
    """A :class:`Message` from a message or an OpenAI dict (see :meth:`Message.from_openai`)."""
    return Message.from_openai(message)


def system(content: str) -> Message:
    """A system message (always pinned)."""
    return Message(role=Role.SYSTEM, content=content)


def user(content: str) -> Message:
    """A user message."""
    return Message(role=Role.USER, content=content)


def assistant(content: str, *, tool_calls: Sequence[ToolCall] = ()) -> Message:
    """An assistant message, optionally calling tools."""
    return Message(role=Role.ASSISTANT, content=content, tool_calls=tuple(tool_calls))


def tool(content: str, *, tool_call_id: str, name: str | None = None) -> Message:
    """A tool result answering the call ``tool_call_id``."""
    return Message(role=Role.TOOL, content=content, tool_call_id=tool_call_id, name=name)


def group_blocks(messages: Sequence[Message]) -> list[tuple[int, int]]:
    """Cut unpinned messages into atomic blocks, as ``(start, end)`` index ranges.

    An assistant message with tool calls and the tool messages that follow it form one
    block; every other message is a block of its own.

    Raises:
        MessageError: a tool message does not follow a tool call it answers.
    """
    blocks: list[tuple[int, int]] = []
    i, n = 0, len(messages)
    while i < n:
        msg = messages[i]
        if msg.role is Role.TOOL:
            raise MessageError(
                f"tool message {msg.tool_call_id!r} does not follow the assistant tool call it answers"
            )
        j = i + 1
        if msg.tool_calls:
            ids = {c.id for c in msg.tool_calls}
            while j < n and messages[j].role is Role.TOOL:
                if messages[j].tool_call_id not in ids:
                    raise MessageError(f"tool result {messages[j].tool_call_id!r} answers no pending call")
                j += 1
        blocks.append((i, j))
        i = j
    return blocks


def validate_sequence(messages: Iterable[Message]) -> None:
    """Check tool-call structure of a full history (raises :class:`MessageError`)."""
    group_blocks([m for m in messages if not m.pinned])
