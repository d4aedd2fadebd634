"""Tool calls read out of a model's reply text, for the three families open models use.

An open model calls a tool by writing it in its reply, in the format its chat template
taught it. convo reads the three formats vLLM (``--tool-call-parser``) and llama.cpp
serve most::

    hermes       Qwen2.5, Qwen3, Hermes 2 Pro / 3 (the text before the first call is content)
                 I'll look it up.
                 <tool_call>
                 {"name": "get_weather", "arguments": {"city": "Paris"}}
                 </tool_call>
    llama3_json  Llama 3.1 / 3.2 / 3.3 with JSON tools (the calls are the whole reply;
                 several are separated by ";")
                 <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}
    mistral      Mistral 7B Instruct v0.3, Mixtral 8x22B, Mistral Nemo (v3 tokenizer)
                 [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

Each parser returns a :class:`~convo.tools.reply.ParsedReply`: the content text, the calls
(ids ``call_`` + 24 letters and digits, arguments as canonical compact JSON strings, as
OpenAI passes them), ``finish_reason`` and, for a reply that tried to call a tool and
failed, why. The grammar of each family and the exact policy for replies that are not
well-formed calls are in :mod:`convo.tools.stream`; in short: **arguments that are not valid
JSON (or any other broken call) make the whole reply plain text with finish_reason
"stop"; no call of that reply is passed on, and** ``ParsedReply.invalid`` **says why.**

Special tokens: ``<|python_tag|>`` (Llama) and ``[TOOL_CALLS]`` (Mistral v3) are special
tokens; decode the reply with ``skip_special_tokens=False`` (and strip the end-of-turn
token) or the parser never sees them. Qwen's ``<tool_call>`` survives either way.

Pick a parser by name (:func:`get_parser`, for a ``--tool-parser`` flag) or from the
model's chat template (:func:`detect_parser`).

Not read: Llama's built-in tools (``<|python_tag|>brave_search.call(...)``), Llama 3.2's
pythonic calls (``[f(x=1)]``), Mistral's v11 tokenizer format (``[TOOL_CALLS]name{...}``);
such replies come back as text, marked invalid when they open with a marker.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping
from typing import ClassVar, Protocol, runtime_checkable

from convo.errors import ConfigError
from convo.tools.reply import ParsedReply
from convo.tools.stream import CallSyntax, ToolCallStream

__all__ = [
    "TOOL_PARSERS",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "ParsedReply",
    "ToolParser",
    "detect_parser",
    "get_parser",
]


@runtime_checkable
class ToolParser(Protocol):
    """Reads tool calls out of one model family's replies.

    ``parse`` reads a whole reply; ``stream`` returns a :class:`ToolCallStream` to feed
    the reply piece by piece, whose ``finish()`` gives what ``parse`` gives for the whole
    text (with the same ``rng`` seed, the same ids).
    """

    #: the name of the family, as ``--tool-parser`` takes it
    name: ClassVar[str]

    def parse(
        self, text: str, *, rng: random.Random | None = None, allowed_names: Collection[str] | None = None
    ) -> ParsedReply: ...

    def stream(
        self,
        *,
        rng: random.Random | None = None,
        allowed_names: Collection[str] | None = None,
        hold_calls: bool = False,
    ) -> ToolCallStream: ...


class _SyntaxParser:
    """A parser defined by its family's :class:`CallSyntax`."""

    name: ClassVar[str]
    syntax: ClassVar[CallSyntax]

    def parse(
        self, text: str, *, rng: random.Random | None = None, allowed_names: Collection[str] | None = None
    ) -> ParsedReply:
        """Split a whole reply into content and tool calls.

        Args:
            text: the reply as decoded (special tokens kept, see the module docstring).
            rng: the randomness of call ids; ``None`` for the system's secure source.
            allowed_names: the offered function names; a call to another one makes the
                reply invalid. ``None`` accepts any name.
        """
        stream = self.stream(rng=rng, allowed_names=allowed_names)
        stream.feed(text)
        stream.close()
        return stream.finish()

    def stream(
        self,
        *,
        rng: random.Random | None = None,
        allowed_names: Collection[str] | None = None,
        hold_calls: bool = False,
    ) -> ToolCallStream:
        """A stream to feed the reply piece by piece (see :class:`ToolCallStream`)."""
        return ToolCallStream(self.syntax, rng=rng, allowed_names=allowed_names, hold_calls=hold_calls)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class HermesParser(_SyntaxParser):
    """Qwen2.5 / Qwen3 / Hermes: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

    Example:
        >>> reply = HermesParser().parse('<tool_call>\\n{"name": "now", "arguments": {}}\\n</tool_call>')
        >>> reply.finish_reason, reply.tool_calls[0].name, reply.tool_calls[0].arguments
        ('tool_calls', 'now', '{}')
    """

    name = "hermes"
    syntax = CallSyntax(marker="<tool_call>", end_marker="</tool_call>")


class Llama3JsonParser(_SyntaxParser):
    """Llama 3.x JSON tools: ``{"name": ..., "parameters": {...}}``, optionally after
    ``<|python_tag|>``, several separated by ``;``; the calls are the whole reply.

    Example:
        >>> Llama3JsonParser().parse('{"name": "now", "parameters": {}}').tool_calls[0].name
        'now'
    """

    name = "llama3_json"
    syntax = CallSyntax(
        marker="<|python_tag|>",
        separator=";",
        whole_reply=True,
        argument_keys=("parameters", "arguments"),
        arguments_required=True,
    )


class MistralParser(_SyntaxParser):
    """Mistral (v3 tokenizer): ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``.

    Mistral's own template refuses to render a history whose call ids are not 9 letters
    or digits; the engine maps convo's ids when it renders the history for this family.

    Example:
        >>> MistralParser().parse('[TOOL_CALLS] [{"name": "now", "arguments": {}}]').finish_reason
        'tool_calls'
    """

    name = "mistral"
    syntax = CallSyntax(marker="[TOOL_CALLS]", array=True)


#: The parsers by the name a ``--tool-parser`` flag takes (the names vLLM uses).
TOOL_PARSERS: Mapping[str, type[_SyntaxParser]] = {
    cls.name: cls for cls in (HermesParser, Llama3JsonParser, MistralParser)
}


def get_parser(name: str) -> ToolParser:
    """The parser called ``name`` (``"hermes"``, ``"llama3_json"``, ``"mistral"``).

    Raises:
        ConfigError: an unknown name; the message lists the known ones.
    """
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise ConfigError(f"unknown tool parser {name!r}; choose one of: {known}") from None


def detect_parser(chat_template: str | None) -> ToolParser | None:
    """The parser for the tool format a chat template teaches, or ``None`` if it teaches none.

    Reads the template text, not the model name, so fine-tunes that keep their base's
    template are recognized:

    - ``<tool_call>`` (Qwen2.5, Qwen3, Hermes): hermes
    - ``[TOOL_CALLS]`` (Mistral v3 tokenizer): mistral; ``None`` when the template also
      writes ``[ARGS]`` (the newer ``[TOOL_CALLS]name[ARGS]{...}`` format, not read here)
    - ``<|python_tag|>``, or an ``ipython`` environment with ``"parameters"`` (Llama 3.x):
      llama3_json

    Example:
        >>> detect_parser("{{- '<tool_call>\\\\n{\\"name\\": ...' }}").name
        'hermes'
        >>> detect_parser("{{ '<|im_start|>' + message['content'] }}") is None
        True
    """
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return HermesParser()
    if "[TOOL_CALLS]" in chat_template:
        # Newer Mistral tokenizers write "[TOOL_CALLS]name[ARGS]{...}", a format this
        # module does not read: better no parser than one that refuses every call.
        return None if "[ARGS]" in chat_template else MistralParser()
    if "<|python_tag|>" in chat_template or ("ipython" in chat_template and '"parameters"' in chat_template):
        return Llama3JsonParser()
    return None
