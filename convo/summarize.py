"""Rolling summaries written by the chat model itself.

Turns that leave the window are folded into one summary, a batch at a time. The summary
prompt never overflows the model's context: the turns to fold are cut into chunks that
fit beside the instructions, the previous summary and the reply reserve, and folded one
chunk after another (a message too large for any chunk is shortened in the middle). The
result is cut to its hard cap, which the session's budget counts.

The prompt is :data:`DEFAULT_TEMPLATE`; pass ``template=`` to change it. It is rendered with
``str.format`` and these fields: ``{previous}`` (the summary so far, or "(none)"),
``{conversation}`` (the turns to fold, one ``role: text`` line each) and ``{max_words}``.

Summaries are off the reply path: a session hands the turns that left its window to a
:class:`SummaryWorker` once the reply is stored, and the worker folds them in background
threads, after the replies in flight (its model calls are marked
``Priority.BACKGROUND``), and stores the result with a compare-and-set
(:meth:`~convo.stores.Store.save_summary`). The stored turns stay the source of truth: a
summary lost to a crash, a failure or a cancel is derived again from them.
:class:`SummaryState` is what a session reports (``Session.summary_state``, the reply's
stats, the server's ``convo`` stats).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from convo.errors import ConfigError
from convo.messages import Message, Role
from convo.models.generation import Priority

# The background worker lives beside this module; its names are this module's too.
from convo.summary_worker import (
    BACKLOG_FULL,
    DEFAULT_SUMMARY_BACKLOG,
    DEFAULT_SUMMARY_DEFER_S,
    DEFAULT_SUMMARY_THREADS,
    MAX_FINISHED_JOBS,
    SHUTDOWN_TIMEOUT_S,
    SUMMARY_LAG_BUCKETS,
    JobStatus,
    Summarizer,
    SummaryJob,
    SummaryState,
    SummaryStats,
    SummaryStatus,
    SummaryWorker,
)

if TYPE_CHECKING:
    from convo.engines.base import Engine
    from convo.tokens import TokenCounter

logger = logging.getLogger(__name__)

DEFAULT_TEMPLATE = (
    "Earlier summary: {previous}\n\n"
    "Conversation:\n{conversation}\n\n"
    "Summarize the earlier summary and the conversation above in at most {max_words} words. "
    "Keep every name, number, date, place, preference and decision."
)
#: The instruction a summary written from the session's own prompt ends with
#: (:attr:`ModelSummarizer.context_instruction`; field ``{max_words}``): the prompt is the
#: session's last prompt up to the turns to fold (its pinned part, the summary it showed and
#: the turns, as the chat template renders them), then this as a user message, so that a
#: KV-caching engine prefills this instruction alone.
DEFAULT_CONTEXT_INSTRUCTION = (
    "Summarize the conversation above, with the summary of earlier turns if there is one, in at "
    "most {max_words} words. Keep every name, number, date, place, preference and decision. "
    "Write only the summary."
)


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


#: Smallest summary cap worth writing, in tokens: a model context that leaves less (see
#: :meth:`ModelSummarizer.summary_cap`) cannot summarize, and a session refuses it.
MIN_SUMMARY_TOKENS = 32


@dataclass(kw_only=True)
class ModelSummarizer(Summarizer):
    """Summarizes with an engine (the same model that chats, typically 4-bit).

    The summary's cap follows the model's context (:meth:`summary_cap`): one summary call
    holds its instructions, then the previous summary, the conversation to fold and the new
    summary, which share what is left in three; so a summary asked for ``max_tokens`` gets
    at most ``(context - instructions) // 3`` tokens, and each call folds at least as much
    conversation. With a 512-token context (a local engine with KV slots of a 512-token
    budget) the default 256-token cap becomes about 150; a context that leaves less than
    :data:`MIN_SUMMARY_TOKENS` is refused.

    Where the session passes its last prompt up to the turns to fold (``context=``, see
    :class:`Summarizer`), and that prompt, the instruction and the summary fit the model's
    context, the summary is written as its continuation: ``context`` then
    :attr:`context_instruction`. A KV-caching engine then serves it from the session's cached
    prompt and prefills the instruction alone, instead of the turns again inside
    :attr:`template` (issue 22: the summaries were a fifth of the prompt tokens a chat
    server prefilled). Otherwise (no context, or it does not fit) the turns are folded with
    :attr:`template`, in chunks.

    Args:
        engine: anything with ``counter``, ``context_window`` and ``generate(...)``.
        template: the summary prompt (see the module docstring for its fields).
        max_input_tokens: cap on one summary prompt; default: the engine's context window.
        timeout_s: wall-clock cap for one summary call. Default 120 s.
        context_instruction: what follows the session's prompt in a summary written from
            it (:data:`DEFAULT_CONTEXT_INSTRUCTION`; field ``{max_words}``).
        reuse_prompt: write summaries from the session's prompt when it is given. ``None``
            (default): yes with the default ``template``, no with one of your own (your
            template is then used for every summary).

    Example:
        >>> summarizer = ModelSummarizer(engine=engine)        # doctest: +SKIP
    """

    engine: Engine
    template: str = DEFAULT_TEMPLATE
    max_input_tokens: int | None = None
    timeout_s: float = 120.0
    context_instruction: str = DEFAULT_CONTEXT_INSTRUCTION
    reuse_prompt: bool | None = None

    def __post_init__(self) -> None:
        for field_name in ("previous", "conversation", "max_words"):
            if "{" + field_name + "}" not in self.template:
                raise ConfigError(f"summary template must contain {{{field_name}}}")
        if "{max_words}" not in self.context_instruction:
            raise ConfigError("summary context_instruction must contain {max_words}")

    @property
    def supports_context(self) -> bool:
        """Whether :meth:`summarize` writes from the session's prompt (``reuse_prompt``)."""
        if self.reuse_prompt is None:
            return self.template == DEFAULT_TEMPLATE
        return self.reuse_prompt

    @property
    def context_tokens(self) -> int:
        """Tokens one summary call may hold (prompt + new summary): the engine's context
        window, or ``max_input_tokens`` when smaller."""
        window = self.engine.context_window
        return min(self.max_input_tokens or window, window)

    def summary_cap(self, max_tokens: int) -> int:
        """The cap a summary asked for ``max_tokens`` gets in this model's context (see the
        class docstring); 0 when it must be lowered below :data:`MIN_SUMMARY_TOKENS`."""
        instructions = self.engine.counter.count_prompt(self._prompt("", [], max_tokens))
        room = (self.context_tokens - instructions) // 3
        if max_tokens <= room:
            return max_tokens
        return room if room >= MIN_SUMMARY_TOKENS else 0

    def check_cap(self, max_tokens: int) -> int:
        """:meth:`summary_cap`, or :class:`~convo.errors.ConfigError` saying what to change
        when the model's context holds no summary."""
        cap = self.summary_cap(max_tokens)
        if cap == 0:
            limit = self.context_tokens
            instructions = self.engine.counter.count_prompt(self._prompt("", [], max_tokens))
            need = instructions + 3 * MIN_SUMMARY_TOKENS
            raise ConfigError(
                f"a summary does not fit the model's {limit}-token context (a summary call holds "
                f"{instructions} tokens of instructions, then the previous summary, the "
                f"conversation and the new summary, at least {MIN_SUMMARY_TOKENS} each); use "
                f"Budget(summary_tokens=0) to summarize nothing, or a model context of at least "
                f"{need} tokens"
            )
        return cap

    def _prompt(self, previous: str, messages: Sequence[Message], max_tokens: int) -> list[Message]:
        text = self.template.format(
            previous=previous or "(none)",
            conversation=format_messages(messages),
            max_words=_max_words(max_tokens),
        )
        return [Message(role=Role.USER, content=text)]

    def _context_prompt(self, context: Sequence[Message], max_tokens: int) -> list[Message]:
        instruction = self.context_instruction.format(max_words=_max_words(max_tokens))
        return [*context, Message(role=Role.USER, content=instruction)]

    supports_cancel = True
    supports_owner = True

    def summarize(  # type: ignore[override]  (adds the declared cancel= and owner=)
        self,
        *,
        previous: str,
        messages: Sequence[Message],
        max_tokens: int,
        cancel: threading.Event | None = None,
        owner: str | None = None,
        context: Sequence[Message] = (),
    ) -> str:
        """The new summary (see :class:`Summarizer`). ``cancel`` stops the model call in
        progress (the worker discards the result of a cancelled job); ``owner`` (the
        session's ``cache_key``) goes into each model call's options; ``context``: the
        session's prompt up to and including ``messages`` (see the class docstring)."""
        counter = self.engine.counter
        limit = self.context_tokens
        max_tokens = self.check_cap(max_tokens)  # the cap follows the model's context
        if context and self.supports_context:
            prompt = self._context_prompt(context, max_tokens)
            if counter.count_prompt(prompt) + max_tokens <= limit:
                return self._generate(prompt, previous, max_tokens, cancel, owner)
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
                summary = self._fold(summary, chunk, max_tokens, cancel, owner)
                chunk = [message]
            else:
                chunk = candidate
        if chunk:
            summary = self._fold(summary, chunk, max_tokens, cancel, owner)
        return summary

    def _fold(
        self,
        previous: str,
        chunk: Sequence[Message],
        max_tokens: int,
        cancel: threading.Event | None,
        owner: str | None,
    ) -> str:
        return self._generate(self._prompt(previous, chunk, max_tokens), previous, max_tokens, cancel, owner)

    def _generate(
        self,
        prompt: list[Message],
        previous: str,
        max_tokens: int,
        cancel: threading.Event | None,
        owner: str | None,
    ) -> str:
        counter = self.engine.counter
        result = self.engine.generate(
            prompt,
            max_new_tokens=max_tokens,
            timeout_s=self.timeout_s,
            cancel=cancel,
            # Background work: a batching engine's scheduler serves replies first, and a
            # KV-caching one serves it from the session's own KV (never another's slot).
            priority=Priority.BACKGROUND,
            owner=owner,
        )
        text = result.text.strip() or previous
        return counter.truncate_middle(text, max_tokens)


def _max_words(max_tokens: int) -> int:
    """The word count a summary of ``max_tokens`` tokens is asked for."""
    return max(8, int(max_tokens * 0.7))


#: How a provisional summary (:func:`provisional_summary`) introduces its excerpts.
PROVISIONAL_HEADER = "Latest turns, not summarized yet (excerpts):"
#: Fewest tokens of text a provisional summary shows per message; with less room per
#: message it shows the latest messages only. At 64 (24 before 2026-12-07) an excerpt's
#: head and tail are long enough to read, and to be runs a context shift moves from the
#: turns still cached (:data:`~convo.fast.kv_shift.SHIFT_EXTRA_MIN_TOKENS`): the slide
#: turn then prefills little more than an ordinary turn (300-token turns on the embedded
#: tokenizer: 331 tokens against 287, where 24-token excerpts of every message cost 543).
PROVISIONAL_MIN_TOKENS = 64


def provisional_summary(
    *, previous: str, messages: Sequence[Message], counter: TokenCounter, max_tokens: int
) -> str:
    """A model-free stand-in for the rolling summary while the model's is still written:
    the previous summary (at most half of ``max_tokens`` when there are messages), then
    :data:`PROVISIONAL_HEADER` and one ``speaker: text`` line per message it does not cover
    yet, each cut in the middle to an equal share of the rest (at least
    :data:`PROVISIONAL_MIN_TOKENS`; the latest messages win when not all fit). At most
    ``max_tokens`` tokens in all, and the same text for the same input, so two prompts
    that carry it share their KV prefix.

    A session shows it when a turn goes on without the summary of turns that left its
    window (``Session(summary_wait_s=...)``), so those turns are still seen, in part.
    """
    if not messages or max_tokens <= 0:
        return counter.truncate_middle(previous, max(max_tokens, 0)) if previous else ""
    prev = counter.truncate_middle(previous, max_tokens // 2) if previous else ""
    room = max_tokens - counter.count_text(f"{prev}\n{PROVISIONAL_HEADER}\n")
    # Each line costs its text plus the speaker's name and a newline (about 4 tokens).
    shown = list(messages)[-max(room // (PROVISIONAL_MIN_TOKENS + 4), 1) :]
    share = max(room // len(shown) - 4, 1)
    lines = [counter.truncate_middle(format_messages([m]), share + 4) for m in shown]
    text = "\n".join([*([prev] if prev else []), PROVISIONAL_HEADER, *lines])
    return counter.truncate_middle(text, max_tokens)


__all__ = [
    "BACKLOG_FULL",
    "DEFAULT_CONTEXT_INSTRUCTION",
    "DEFAULT_SUMMARY_BACKLOG",
    "DEFAULT_SUMMARY_DEFER_S",
    "DEFAULT_SUMMARY_THREADS",
    "DEFAULT_TEMPLATE",
    "MAX_FINISHED_JOBS",
    "MIN_SUMMARY_TOKENS",
    "PROVISIONAL_HEADER",
    "PROVISIONAL_MIN_TOKENS",
    "SHUTDOWN_TIMEOUT_S",
    "SUMMARY_LAG_BUCKETS",
    "JobStatus",
    "ModelSummarizer",
    "Summarizer",
    "SummaryJob",
    "SummaryState",
    "SummaryStats",
    "SummaryStatus",
    "SummaryWorker",
    "format_messages",
    "provisional_summary",
]
