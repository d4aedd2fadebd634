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
from convo.plan import PromptPlan, Turn
from convo.tokens import TokenCounter


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


def evicted_after(budget: Budget, *, turn_count: int, evicted: int, lookahead: int = 0) -> int:
    """Turns out of the window once it holds ``turn_count + lookahead`` turns: unchanged
    until it would pass :func:`max_window_turns`, then down to ``window_turns``."""
    turns = turn_count + lookahead
    if turns - evicted > max_window_turns(budget):
        return turns - budget.window_turns
    return evicted


def turn_tokens(turn: Turn, counter: TokenCounter) -> int:
    return sum(counter.message_tokens(m) for m in turn.messages)


def next_turn_overflows(
    plan: PromptPlan, recent: Sequence[Turn], budget: Budget, counter: TokenCounter
) -> bool:
    """Whether a next turn the average size of the ``recent`` ones would not fit beside
    ``plan``'s prompt.

    Making room now (after the reply) instead of letting the planner cut a turn on the
    next one means the window and the summary move together, once per batch.
    """
    if not recent:
        return False
    per_turn = sum(turn_tokens(t, counter) for t in recent) / len(recent)
    return plan.prompt_tokens + per_turn > budget.available_prompt_tokens


def turns_to_push_out(window: Sequence[Turn], budget: Budget, counter: TokenCounter) -> int:
    """How many of the window's oldest turns to push out when the token budget, not the
    turn count, pushed turns out.

    Dropping just enough turns every turn would change the prompt's start every turn and
    defeat KV reuse. Instead, free room for about ``summarize_batch_turns - 1`` more turns
    of the recent size, keeping at least one turn and ``recent_min_tokens`` of recent
    history, so the next turns extend the prompt until the next cut.
    """
    batch = budget.summarize_batch_turns
    if batch <= 1 or len(window) <= 1:
        return 0
    costs = [turn_tokens(t, counter) for t in window]
    per_turn = sum(costs[-batch:]) / len(costs[-batch:])
    target = (batch - 1) * per_turn
    kept, freed, drop = sum(costs), 0.0, 0
    while drop < len(window) - 1 and freed < target and kept - costs[drop] >= budget.recent_min:
        freed += costs[drop]
        kept -= costs[drop]
        drop += 1
    return drop
