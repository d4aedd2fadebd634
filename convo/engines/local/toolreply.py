"""A reply with tool calls, as the local engine (and the scripted test engine) reads it.

The model's reply text goes, piece by piece as it is decoded, through the model family's
:class:`~convo.tools.stream.ToolCallStream`: content reaches ``on_text``, the calls reach
``on_tool_call_delta`` as OpenAI-style deltas (index, id and name first, then argument
fragments), and :meth:`ToolReply.finish` gives the text, the calls and the finish reason
of the :class:`~convo.models.generation.Generation`.

The policy, in one place:

* **Invalid calls** (arguments that are not JSON, an unknown function, a call cut off...):
  the whole reply is returned as text, no call is passed on, ``finish_reason`` ``stop``
  (or ``length`` / ``timeout`` / ``cancelled`` when the reply was cut short), as
  :mod:`convo.tools.stream` defines it. Deltas already streamed cannot be taken back:
  :attr:`ToolReply.sent_tool_calls` tells a server to end its stream with an error.
* **A reply that breaks the request** (:meth:`~convo.tools.spec.ToolRequest.check`: two
  calls with ``parallel_tool_calls`` false...): the same, text and ``stop``.
* **tool_choice** ``"none"``: no tools are rendered and no call is parsed (plain text).
  ``"required"`` and a named function: the reply is *prefilled* with the opening of a
  call in the family's format (:func:`call_prefill`), so the model can only continue a
  call; the prefill is part of the prompt (and of its budget) and of the parsed reply.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from convo.engines.local.config import TOOL_PARSER_CHOICES
from convo.errors import ConfigError
from convo.messages import ToolCall
from convo.models.generation import FinishReason
from convo.models.generation import ToolCallDelta as GenerationToolCallDelta
from convo.tools import (
    ContentDelta,
    StreamDelta,
    ToolChoiceMode,
    ToolParser,
    ToolRequest,
    detect_parser,
    get_parser,
    parse_tool_request,
)

__all__ = ["TOOL_PARSER_CHOICES", "ToolReply", "call_prefill", "resolve_parser", "tool_request"]

logger = logging.getLogger(__name__)


#: Families whose call marker is a special token: their reply is decoded with special
#: tokens kept (less the end-of-turn tokens), or the marker would vanish.
SPECIAL_MARKER_FAMILIES = frozenset({"llama3_json", "mistral"})

#: The opening of a call each family writes, for ``required`` (any function: up to the
#: name's opening quote) and a named function (up to its arguments).
_PREFILL: Mapping[str, tuple[str, str, str]] = {
    # family: (required, named prefix, arguments key)
    "hermes": ('<tool_call>\n{"name": "', '<tool_call>\n{"name": ', "arguments"),
    "llama3_json": ('{"name": "', '{"name": ', "parameters"),
    "mistral": ('[TOOL_CALLS] [{"name": "', '[TOOL_CALLS] [{"name": ', "arguments"),
}


def resolve_parser(name: str | None, chat_template: str | None) -> ToolParser | None:
    """The parser for ``tool_parser=name``: ``"auto"``/``None`` detects it from the chat
    template (``None`` when the template teaches no known format), ``"none"`` is no parser.

    Raises:
        ConfigError: a name not in :data:`TOOL_PARSER_CHOICES`.
    """
    if name is None or name == "auto":
        return detect_parser(chat_template)
    if name == "none":
        return None
    if name not in TOOL_PARSER_CHOICES:
        raise ConfigError(f"tool_parser must be one of {', '.join(TOOL_PARSER_CHOICES)}, not {name!r}")
    return get_parser(name)


def tool_request(
    tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool | None
) -> ToolRequest | None:
    """The validated request, or ``None`` when no call is allowed (no tools, or
    ``tool_choice="none"``): then the engine renders and parses no tools at all."""
    request = parse_tool_request(list(tools) if tools else None, tool_choice, parallel_tool_calls)
    return request if request.calls_allowed else None


def call_prefill(parser: ToolParser, request: ToolRequest) -> str:
    """The text the reply is started with: ``""`` for ``auto``; for ``required`` the
    opening of a call up to the function name; for a named function the call up to its
    arguments (``<tool_call>\\n{"name": "get_weather", "arguments": `` for hermes)."""
    mode = request.choice.mode
    if mode is ToolChoiceMode.AUTO:
        return ""
    required, named, key = _PREFILL[parser.name]
    if mode is ToolChoiceMode.REQUIRED:
        return required
    return f"{named}{json.dumps(request.choice.name)}, {json.dumps(key)}: "


class ToolReply:
    """Reads one reply's text as it arrives; see the module docstring for the policy.

    Args:
        parser: the model family's parser.
        request: the call's tools and choice.
        on_text: gets the content pieces (never a call's text).
        on_tool_call_delta: gets each call's deltas.
        prefill: the text the reply was started with (:func:`call_prefill`); read first.
        rng: randomness of the call ids (tests pass a seeded one).
    """

    def __init__(
        self,
        parser: ToolParser,
        request: ToolRequest,
        *,
        on_text: Callable[[str], None] | None = None,
        on_tool_call_delta: Callable[[GenerationToolCallDelta], None] | None = None,
        prefill: str = "",
        rng: random.Random | None = None,
    ) -> None:
        self.request = request
        self._on_text = on_text
        self._on_delta = on_tool_call_delta
        self._stream = parser.stream(rng=rng, allowed_names=request.names)
        self._pieces: list[str] = []
        if prefill:
            self.feed(prefill)

    @property
    def text(self) -> str:
        """The reply as read so far, prefill included."""
        return "".join(self._pieces)

    @property
    def sent_tool_calls(self) -> bool:
        """Whether a tool-call delta went out (it cannot be taken back)."""
        return self._stream.sent_tool_calls

    def feed(self, piece: str) -> None:
        """The next piece of the reply text."""
        if piece:
            self._pieces.append(piece)
            self._send(self._stream.feed(piece))

    def _send(self, deltas: list[StreamDelta]) -> None:
        for delta in deltas:
            if isinstance(delta, ContentDelta):
                if self._on_text is not None and delta.text:
                    self._on_text(delta.text)
            elif self._on_delta is not None:
                self._on_delta(
                    GenerationToolCallDelta(
                        index=delta.index, id=delta.id, name=delta.name, arguments=delta.arguments_fragment
                    )
                )

    def finish(self, reason: FinishReason) -> tuple[str, tuple[ToolCall, ...], FinishReason]:
        """The reply's text, calls and finish reason; ``reason`` is why decoding ended."""
        self._send(self._stream.close())
        parsed = self._stream.finish()
        if parsed.invalid is not None:
            logger.warning("tool call not passed on: %s", parsed.invalid)
        if not parsed.tool_calls:
            return parsed.content, (), reason
        problem = self.request.check([c.name for c in parsed.tool_calls])
        if problem is not None:
            logger.warning("tool calls not passed on: %s", problem)
            return self.text, (), FinishReason.STOP
        return parsed.content, parsed.tool_calls, FinishReason.TOOL_CALLS
