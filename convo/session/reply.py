"""What a turn returns: the :class:`Reply` and its :class:`TurnStats`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from convo.engines.base import FinishReason, GenerationStats
from convo.messages import Message, Role, ToolCall
from convo.plan import PromptPlan
from convo.summarize import SummaryState


@dataclass(frozen=True, kw_only=True)
class TurnStats:
    """What a turn cost and what its prompt held.

    Attributes:
        turn: 1-based number of the turn in the session (continues across resumes).
        parts: tokens per prompt part (see :class:`~convo.plan.PromptPlan`).
        prompt_tokens: the exact token count of the rendered prompt.
        context_tokens / max_new_tokens: the budget.
        summary_tokens: tokens of the rolling summary this turn's prompt was planned with.
        evicted_turns: turns that have left the window so far (total).
        summarized_turns: turns folded into the stored summary when the reply returned
            (the summary of the turns that left the window on this turn is written after it).
        hidden_turns: turns that were neither in the summary nor shown whole in this prompt:
            the summary had not caught up with them (the turn went on without it, see
            ``summary_wait_s``, or the budget cut them on this turn). The prompt showed
            excerpts of them in a provisional summary (``provisional_summary``); they stay
            stored and are folded in later.
        provisional_summary: the prompt showed a provisional summary
            (:func:`~convo.summarize.provisional_summary`) in the summary's place.
        passages_used / passages_dropped: retrieval outcome.
        truncated_messages: messages the TRUNCATE policy shortened in this prompt.
        plan_s / generate_s / latency_s: seconds.
        summarize_s: seconds this turn waited for a background summary (the summary itself
            runs after the reply; 0 when the turn did not wait).
        summary: the session's summary state when the reply returned (see
            :class:`~convo.summarize.SummaryState`).
        oom_retries: 1 when the turn ran out of device memory and was re-run smaller.
        recovery: what the OOM retry changed (empty when none).
        generation: the engine's report (tokens, KV bytes, memory, timings).
    """

    turn: int
    parts: Mapping[str, int]
    prompt_tokens: int
    context_tokens: int
    max_new_tokens: int
    summary_tokens: int
    evicted_turns: int
    summarized_turns: int
    passages_used: int
    passages_dropped: int
    truncated_messages: int
    plan_s: float
    generate_s: float
    summarize_s: float
    latency_s: float
    oom_retries: int = 0
    recovery: str = ""
    generation: GenerationStats | None = None
    hidden_turns: int = 0
    summary: SummaryState | None = None
    provisional_summary: bool = False


@dataclass(frozen=True, kw_only=True)
class Reply:
    """The assistant's answer to one turn.

    ``tool_calls`` holds the function calls the reply asks for (``finish_reason`` is then
    :attr:`FinishReason.TOOL_CALLS`); they are stored on the assistant message, and the
    ``tool`` results answering them go in the next turn (``send([tool(...), ...])``).
    """

    text: str
    finish_reason: FinishReason
    stats: TurnStats
    plan: PromptPlan = field(repr=False)
    tool_calls: tuple[ToolCall, ...] = ()

    @property
    def message(self) -> Message:
        """The reply as an assistant :class:`~convo.messages.Message` (``.to_openai()``
        gives the dict an agent loop appends to its history), its tool calls included."""
        return Message(role=Role.ASSISTANT, content=self.text, tool_calls=self.tool_calls)

    @property
    def timed_out(self) -> bool:
        """Generation hit its wall-clock limit (``text`` holds what was produced)."""
        return self.finish_reason is FinishReason.TIMEOUT
