"""Tool calling for engines that serve open models: the request's tools, and the calls read
out of the model's reply.

- :mod:`convo.tools.spec`: the OpenAI ``tools`` / ``tool_choice`` / ``parallel_tool_calls``
  fields, validated into a :class:`ToolRequest`.
- :mod:`convo.tools.parsers`: the three reply formats (hermes, llama3_json, mistral), by
  name or detected from a chat template; a whole reply becomes a :class:`ParsedReply`.
- :mod:`convo.tools.stream`: the same, fed piece by piece, answering OpenAI-shaped deltas.
- :mod:`convo.tools.history`: the conversation as the templates read it back (arguments as
  objects, Mistral's 9-character call ids).
- :mod:`convo.tools.canonical_json`: the incremental JSON rewriting the arguments go through.

Pure Python: no torch, transformers or web framework is imported here.
"""

from __future__ import annotations

from convo.tools.history import mistral_call_id, template_messages
from convo.tools.parsers import (
    TOOL_PARSERS,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ToolParser,
    detect_parser,
    get_parser,
)
from convo.tools.reply import ContentDelta, ParsedReply, StreamDelta, ToolCallDelta, new_call_id
from convo.tools.spec import (
    ToolChoice,
    ToolChoiceMode,
    ToolLimits,
    ToolRequest,
    ToolSpec,
    ToolSpecError,
    parse_tool_request,
)
from convo.tools.stream import CallSyntax, ToolCallStream

__all__ = [
    "TOOL_PARSERS",
    "CallSyntax",
    "ContentDelta",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "ParsedReply",
    "StreamDelta",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolChoice",
    "ToolChoiceMode",
    "ToolLimits",
    "ToolParser",
    "ToolRequest",
    "ToolSpec",
    "ToolSpecError",
    "detect_parser",
    "get_parser",
    "mistral_call_id",
    "new_call_id",
    "parse_tool_request",
    "template_messages",
]
