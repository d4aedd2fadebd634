"""What a tool parser returns: the parsed reply, and the deltas a stream sends.

The two delta types mirror the two things OpenAI's ``choices[0].delta`` carries::

    ContentDelta("Let me check.")                     {"content": "Let me check."}
    ToolCallDelta(0, "call_8fK...", "get_weather", "") {"tool_calls": [{"index": 0, "id": "call_8fK...",
                                                          "type": "function",
                                                          "function": {"name": "get_weather",
                                                                       "arguments": ""}}]}
    ToolCallDelta(0, None, None, '{"city":')           {"tool_calls": [{"index": 0,
                                                          "function": {"arguments": "{\\"city\\":"}}]}
"""

from __future__ import annotations

import random
import secrets
import string
from dataclasses import dataclass
from typing import Any, Literal

from convo.messages import ToolCall

__all__ = [
    "CALL_ID_LENGTH",
    "CALL_ID_PREFIX",
    "ContentDelta",
    "ParsedReply",
    "StreamDelta",
    "ToolCallDelta",
    "ToolFinishReason",
    "new_call_id",
]

#: The finish reasons a parsed reply can have; the engine's own ``"length"`` (the reply hit
#: ``max_new_tokens``) is the engine's to report.
ToolFinishReason = Literal["tool_calls", "stop"]

#: Call ids look like OpenAI's: ``call_`` and 24 letters or digits.
CALL_ID_PREFIX = "call_"
CALL_ID_LENGTH = 24
_ALNUM = string.ascii_letters + string.digits


def new_call_id(rng: random.Random | None = None) -> str:
    """A fresh call id, ``call_`` + 24 random letters and digits.

    Args:
        rng: where the randomness comes from; ``None`` for the system's secure source.
            Tests pass ``random.Random(seed)`` to get the same ids every run.
    """
    source = rng if rng is not None else secrets.SystemRandom()
    return CALL_ID_PREFIX + "".join(source.choice(_ALNUM) for _ in range(CALL_ID_LENGTH))


@dataclass(frozen=True, kw_only=True)
class ParsedReply:
    """A model's reply text, split into what it says and the tools it calls.

    Args:
        content: the text for the user. With tool calls: the text outside the calls, less
            the whitespace touching a call. Without: the reply, unchanged.
        tool_calls: the calls, in the order the model wrote them; arguments are canonical
            compact JSON strings (see :mod:`convo.tools.canonical_json`).
        finish_reason: ``"tool_calls"`` when there are calls, else ``"stop"``.
        invalid: why the reply looked like a tool call but could not be read as one
            (then ``content`` is the whole reply and there are no calls); ``None`` otherwise.
    """

    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: ToolFinishReason = "stop"
    invalid: str | None = None


@dataclass(frozen=True)
class ContentDelta:
    """Text for the user, as OpenAI's ``delta.content``."""

    text: str

    def to_openai(self) -> dict[str, Any]:
        return {"content": self.text}


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of one tool call, as an item of OpenAI's ``delta.tool_calls``.

    The first delta of a call carries its ``id`` and ``name`` and empty arguments; the
    next ones carry only ``arguments_fragment``. Joining the fragments of one ``index``
    gives the call's ``arguments``.
    """

    index: int
    id: str | None
    name: str | None
    arguments_fragment: str

    def to_openai(self) -> dict[str, Any]:
        item: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {"arguments": self.arguments_fragment}
        if self.id is not None:
            item["id"] = self.id
            item["type"] = "function"
        if self.name is not None:
            function = {"name": self.name, **function}
        item["function"] = function
        return {"tool_calls": [item]}


StreamDelta = ContentDelta | ToolCallDelta
