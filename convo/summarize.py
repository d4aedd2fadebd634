"""Rolling summaries written by the chat model itself.

Turns that leave the window are folded into one summary, a batch at a time. The summary
prompt never overflows the model's context: the turns to fold are cut into chunks that
fit beside the instructions, the previous summary and the reply reserve, and folded one
chunk after another (a message too large for any chunk is shortened in the middle). The
result is cut to its hard cap, which the session's budget counts.

The prompt is :data:`DEFAULT_TEMPLATE`; pass ``template=`` to change it. It is rendered with
``str.format`` and these fields: ``{previous}`` (the summary so far, or "(none)"),
``{conversation}`` (the turns to fold, one ``role: text`` line each) and ``{max_words}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from convo.errors import ConfigError
from convo.messages import Message, Role

if TYPE_CHECKING:
    from convo.engines.base import Engine

DEFAULT_TEMPLATE = (
    "Earlier summary: {previous}\n\n"
    "Conversation:\n{conversation}\n\n"
    "Summarize the earlier summary and the conversation above in at most {max_words} words. "
    "Keep every name, number, date, place, preference and decision."
)


class Summarizer(Protocol):
    """Folds messages into a summary. The session injects one of these."""

    def summarize(self, *, previous: str, messages: Sequence[Message], max_tokens: int) -> str:
        """Return the new summary, at most ``max_tokens`` tokens long."""
        ...


def format_messages(messages: Sequence[Message]) -> str:
    """One ``speaker: text`` line per message (tool calls shown by name)."""
    lines = []
    for m in messages:
        who = m.name or m.role.value
        text = m.content.strip()
        if m.tool_calls:
            calls = ", ".join(f"{c.name}({c.arguments})" for c in m.tool_calls)
            text = f"{text} [calls {calls}]".strip()
        lines.append(f"{who}: {text}")
    return "\n".join(lines)


@dataclass(kw_only=True)
class ModelSummarizer:
    """Summarizes with an engine (the same model that chats, typically 4-bit).

    Args:
        engine: anything with ``counter``, ``context_window`` and ``generate(...)``.
        template: the summary prompt (see the module docstring for its fields).
        max_input_tokens: cap on one summary prompt; default: the engine's context window.
        timeout_s: wall-clock cap for one summary call. Default 120 s.

    Example:
        >>> summarizer = ModelSummarizer(engine=engine)        # doctest: +SKIP
    """

    engine: Engine
    template: str = DEFAULT_TEMPLATE
    max_input_tokens: int | None = None
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for field_name in ("previous", "conversation", "max_words"):
            if "{" + field_name + "}" not in self.template:
                raise ConfigError(f"summary template must contain {{{field_name}}}")

    def _prompt(self, previous: str, messages: Sequence[Message], max_tokens: int) -> list[Message]:
        text = self.template.format(
            previous=previous or "(none)",
            conversation=format_messages(messages),
            max_words=max(8, int(max_tokens * 0.7)),
        )
        return [Message(role=Role.USER, content=text)]

    def summarize(self, *, previous: str, messages: Sequence[Message], max_tokens: int) -> str:
        counter = self.engine.counter
        limit = min(self.max_input_tokens or self.engine.context_window, self.engine.context_window)
        room = limit - max_tokens  # prompt tokens a single summary call may use
        fixed = counter.count_prompt(self._prompt(previous, [], max_tokens)) + max_tokens  # previous <= cap
        if room - fixed <= 16:
            raise ConfigError(f"summary cap {max_tokens} leaves no room in the model's {limit}-token context")
        summary = counter.truncate_middle(previous, max_tokens) if previous else ""
        chunk: list[Message] = []
        for message in messages:
            # One line of the conversation costs about its text plus a name.
            if counter.count_text(message.content) > room - fixed - 8:
                message = Message(
                    role=message.role,
                    content=counter.truncate_middle(message.content, room - fixed - 16),
                    name=message.name,
                )
            candidate = [*chunk, message]
            if chunk and counter.count_prompt(self._prompt(summary, candidate, max_tokens)) > room:
                summary = self._fold(summary, chunk, max_tokens)
                chunk = [message]
            else:
                chunk = candidate
        if chunk:
            summary = self._fold(summary, chunk, max_tokens)
        return summary

    def _fold(self, previous: str, chunk: Sequence[Message], max_tokens: int) -> str:
        counter = self.engine.counter
        prompt = self._prompt(previous, chunk, max_tokens)
        result = self.engine.generate(prompt, max_new_tokens=max_tokens, timeout_s=self.timeout_s)
        text = result.text.strip() or previous
        return counter.truncate_middle(text, max_tokens)
