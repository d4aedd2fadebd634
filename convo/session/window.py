"""How a session's window of recent turns slides: pure functions of the budget, the turns
and a token counter (no store, no model).

The window holds between ``window_turns`` and ``window_turns + summarize_batch_turns - 1``
turns (:func:`max_window_turns`). When a new turn would make it larger, the oldest turns
leave together, down to ``window_turns`` (:func:`evicted_after`). Between those moments
every prompt extends the previous one, so the engine reuses its KV cache and prefills only
the new turn; the summary changes on the same turn as the window. The token budget may push
turns out earlier: then a batch leaves at once (:func:`turns_to_push_out`), not one turn
per turn, for the same reason. After a reply the session looks one turn ahead
(:func:`next_turn_overflows`, ``lookahead=1``), so the window moves and the summary is
rewritten before the next turn, together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from convo.budget import Budget
from convo.messages import Message
from convo.plan import PromptPlan, Turn, summary_message
from convo.tokens import TokenCounter, Tool


def max_window_turns(budget: Budget) -> int:
    """The most turns the window holds: ``window_turns + summarize_batch_turns - 1``."""
    return budget.window_turns + budget.summarize_batch_turns - 1


def planning_budget(budget: Budget, *, candidates: int, late: bool) -> Budget:
    """The budget the planner gets: it may show every turn still inside the window
    (:func:`max_window_turns`) and, while the summary is ``late``, every one of the
    ``candidates`` turns it does not cover yet."""
    if budget.summarize_batch_turns > 1:
        budget = replace(budget, window_turns=max_window_turns(budget))
    if late and budget.window_turns < candidates:
        budget = replace(budget, window_turns=candidates)
    return budget


def hold_window(
    budget: Budget,
    turns: Sequence[Turn],
    pinned: Sequence[Message],
    summary: str,
    tools: Sequence[Tool] | None,
    counter: TokenCounter,
) -> Budget:
    """The budget a session with memory plans with: the ``turns`` inside the window (the
    new message included) are guaranteed their place beside the pinned part, the tools and
    the ``summary`` (:func:`fixed_tokens`), while retrieval keeps at least
    :attr:`~convo.budget.Budget.retrieval_min`; retrieval takes what they leave.

    The planner otherwise guarantees the recent turns only ``recent_min_tokens`` and gives
    the rest to retrieval, which always has passages to fill it: every turn then cut the
    oldest turn shown, the window slid every turn, and each prompt prefilled again all
    that follows the summary. Held, the window grows turn by turn and slides a batch at a
    time (:func:`turns_to_push_out`) once it no longer fits beside retrieval's share."""
    fixed = fixed_tokens(pinned, summary, tools, counter)
    room = budget.available_prompt_tokens - fixed - budget.retrieval_min
    need = sum(turn_tokens(t, counter) for t in turns)
    keep = min(need, room, budget.available_prompt_tokens - budget.pinned_cap)
    if keep <= budget.recent_min:
        return budget
    return replace(budget, recent_min_tokens=keep)


def evicted_after(budget: Budget, *, turn_count: int, evicted: int, lookahead: int = 0) -> int:
    """Turns out of the window once it holds ``turn_count + lookahead`` turns: unchanged
    until it would pass :func:`max_window_turns`, then down to ``window_turns``."""
    turns = turn_count + lookahead
    if turns - evicted > max_window_turns(budget):
        return turns - budget.window_turns
    return evicted


def turn_tokens(turn: Turn, counter: TokenCounter) -> int:
    return sum(counter.message_tokens(m) for m in turn.messages)


def fixed_tokens(
    pinned: Sequence[Message], summary: str, tools: Sequence[Tool] | None, counter: TokenCounter
) -> int:
    """What a prompt holds besides its turns and passages: the pinned messages, the tool
    schemas, the summary message and the chat template's overhead."""
    cost = sum(counter.message_tokens(m) for m in pinned)
    cost += counter.count_tools(tools) if tools else 0
    cost += counter.message_tokens(summary_message(summary)) if summary else 0
    return cost + max(counter.overhead_tokens(True), counter.overhead_tokens(False))


def next_turn_overflows(
    plan: PromptPlan, recent: Sequence[Turn], budget: Budget, counter: TokenCounter
) -> bool:
    """Whether a next turn the average size of the ``recent`` ones would not fit beside
    ``plan``'s prompt.

    Making room now (after the reply) instead of letting the planner cut a turn on the
    next one means the window and the summary move together, once per batch. Retrieved
    passages count only up to retrieval's share beside a held window
    (:func:`hold_window`): they take whatever room is left, so the rest is not a reason
    to slide.
    """
    if not recent:
        return False
    per_turn = sum(turn_tokens(t, counter) for t in recent) / len(recent)
    retrieved = plan.parts.get("retrieved", 0)
    held = plan.prompt_tokens - retrieved + min(retrieved, budget.retrieval_min)
    return held + per_turn > budget.available_prompt_tokens


def turns_to_push_out(window: Sequence[Turn], budget: Budget, counter: TokenCounter, *, room: int) -> int:
    """How many of the window's oldest turns to push out when the token budget, not the
    turn count, pushed turns out; ``room``: the tokens the window's turns may hold (the
    prompt room less the pinned part, the summary's cap and, beside memory, retrieval's
    share: :func:`window_room`).

    Dropping just enough turns every turn would change the prompt's start every turn and
    defeat KV reuse: every slide prefills again all that follows the summary. Instead, push
    out enough that about ``summarize_batch_turns - 1`` more turns of the recent size fit
    in ``room`` (none when they fit already), keeping at least the newest turn, so the next
    turns extend the prompt until the next cut.

    The floor is one turn, not the recent turns' guaranteed share (``recent_min_tokens``,
    which the planner still gives them when there is enough to show): with ~390-token turns
    at a 2,048 budget the window holds four, and keeping that share (two) made it slide
    every second turn, each slide prefilling ~1,470 tokens; keeping one, it slides every
    third turn and prefills ~1,090 (issue 22, ``benchmarks/serve_load.py --preset think-16``).
    """
    batch = budget.summarize_batch_turns
    if batch <= 1 or len(window) <= 1:
        return 0
    costs = [turn_tokens(t, counter) for t in window]
    per_turn = sum(costs[-batch:]) / len(costs[-batch:])
    target = sum(costs) + (batch - 1) * per_turn - room
    freed, drop = 0.0, 0
    while drop < len(window) - 1 and freed + per_turn / 2 < target:  # about: within half a turn
        freed += costs[drop]
        drop += 1
    return drop


def window_room(
    plan: PromptPlan, budget: Budget, summary_cap: int, counter: TokenCounter, *, memory: bool = False
) -> int:
    """The tokens the window's turns may hold in prompts like ``plan``: the prompt room less
    its pinned part, tools and template, the summary at its cap (``summary_cap``; it grows
    to it once written) and, where ``plan`` retrieved passages or the session has
    ``memory`` that its budget lets retrieve (``retrieval_tokens`` and top-k above 0),
    retrieval's share (:attr:`~convo.budget.Budget.retrieval_min`).

    With memory, the share is kept even when ``plan`` retrieved nothing: before the first
    slide every remembered turn is still in the window (no passages), but once turns leave
    it, retrieval has passages to fill its share. Reckoned without it, the first slide
    pushed out too few turns and the window slid again on the next turn, each slide
    prefilling all that follows the summary (``serve_load.py --preset gpu-chat --memory``:
    1,341 then 424-1,636 tokens prefilled on the two turns, against 581 then 312 without
    memory)."""
    parts = plan.parts
    summary = parts.get("summary", 0)
    if summary_cap > 0:
        summary = max(summary, summary_cap + counter.message_tokens(summary_message("")))
    fixed = parts.get("system", 0) + parts.get("tools", 0) + parts.get("template", 0) + summary
    retrieves = memory and budget.retrieval_cap > 0 and budget.retrieval_top_k > 0
    retrieval = budget.retrieval_min if retrieves or parts.get("retrieved", 0) > 0 else 0
    return budget.available_prompt_tokens - fixed - retrieval
