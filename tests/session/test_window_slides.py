"""How often the window slides under long turns, with and without memory (issues 22, 24).

Every slide prefills again all that follows the summary, so a session should slide a batch
at a time: push out enough that ``summarize_batch_turns - 1`` more turns fit (keeping the
newest), and, with memory on, keep the window's turns in place while retrieval takes what
they leave (down to ``Budget.retrieval_min``) instead of cutting a turn every turn.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest

from convo import Budget, Session
from convo.errors import ConfigError
from convo.messages import Message, Role
from convo.plan import Passage, Retriever, Turn
from convo.session import window
from convo.session.config import SummaryConfig
from convo.summarize import Summarizer
from convo.testing import ScriptedEngine
from convo.tokens import CharCounter

BIG = "x" * 1500  # ~375 tokens of CharCounter: four such turns fill a 2,048-token window
BUDGET = Budget(context_tokens=2048, max_new_tokens=64)


class Instant(Summarizer):
    """A summarizer that writes a fixed-size summary at once (no model)."""

    def summarize(self, *, previous: str, messages: Sequence[Message], max_tokens: int) -> str:
        return "s" * (max_tokens * 4 - 8)


class Plenty(Retriever):
    """Offers more passages than the room holds, every turn (as memory does once turns
    have left the window)."""

    def retrieve(self, query: str, *, session_id: str, top_k: int) -> list[Passage]:
        return [Passage(text=f"m{i} " + "m" * 236, source=f"p{i}", score=1.0 - i / 100) for i in range(top_k)]


class Evicted(Retriever):
    """Offers passages only of turns that have left the window, as a real memory does:
    nothing before the first slide, then more than the room holds."""

    def __init__(self) -> None:
        self.session: Session | None = None

    def retrieve(self, query: str, *, session_id: str, top_k: int) -> list[Passage]:
        if self.session is None or not self.session.evicted_turns:
            return []
        return Plenty().retrieve(query, session_id=session_id, top_k=top_k)


def turns_of(sizes: Sequence[int]) -> list[Turn]:
    return [
        Turn(index=i, messages=(Message(role=Role.USER, content="u" * (4 * n)),)) for i, n in enumerate(sizes)
    ]


def test_push_out_frees_room_for_a_batch_and_keeps_the_newest() -> None:
    counter = CharCounter()
    budget = Budget(context_tokens=2048, max_new_tokens=64)
    four = turns_of([386] * 4)  # window full: the next turn would not fit
    # Room for 1,673 tokens of turns: four of ~390 in, three more must fit: three leave.
    assert window.turns_to_push_out(four, budget, counter, room=1673) == 3
    # Room enough already for three more: nothing leaves.
    assert window.turns_to_push_out(four, budget, counter, room=4000) == 0
    # Never the newest turn, however little room.
    assert window.turns_to_push_out(four, budget, counter, room=0) == 3
    # Small turns, plenty of room (an out-of-memory retry cut the plan, not the budget).
    assert window.turns_to_push_out(turns_of([10] * 3), budget, counter, room=1673) == 0


def test_retrieval_min_is_named_defaulted_and_checked() -> None:
    assert BUDGET.retrieval_min == (BUDGET.available_prompt_tokens - BUDGET.pinned_cap) // 4 == 372
    assert Budget(retrieval_min_tokens=100).retrieval_min == 100
    assert Budget.from_dict(Budget(retrieval_min_tokens=50).to_dict()).retrieval_min_tokens == 50
    with pytest.raises(ConfigError, match="retrieval_min_tokens"):
        Budget(retrieval_min_tokens=-1)


def first_shown(
    memory: bool,
    turns: int = 14,
    retriever: Retriever | None = None,
    message: str = BIG,
    budget: Budget = BUDGET,
) -> list[int]:
    engine = ScriptedEngine(CharCounter(), context_window=2048)
    engine.reply_fn = lambda _m: "r" * 128
    session = Session(
        engine,
        budget=budget,
        retriever=retriever or (Plenty() if memory else None),
        summarizing=SummaryConfig(summarizer=Instant(), wait_s=None),
    )
    if isinstance(retriever, Evicted):
        retriever.session = session
    shown = []
    for i in range(turns):
        reply = session.send(f"u{i} {message}")
        assert reply.stats.prompt_tokens + budget.max_new_tokens <= budget.context_tokens
        if retriever is None:
            assert (reply.plan.parts["retrieved"] > 0) == memory
        session.wait_summary(10)
        shown.append(reply.plan.first_shown_turn)
    return shown


@pytest.mark.parametrize("memory", [False, True])
def test_the_window_slides_a_batch_at_a_time(memory: bool) -> None:
    """Without memory four turns fit: it slides every third turn, keeping one. With memory
    (which always has passages to fill the room) the window still holds its turns until
    they no longer fit beside retrieval's share: every second turn, never every turn."""
    shown = first_shown(memory)
    moves = [i for i in range(1, len(shown)) if shown[i] != shown[i - 1]]
    assert len(moves) >= 3, shown
    gaps = {b - a for a, b in itertools.pairwise(moves)}
    assert gaps == ({3} if not memory else {2}), shown


def test_the_first_slide_with_memory_leaves_room_for_what_retrieval_will_bring() -> None:
    """A real memory has no passages before the first slide (every turn is still in the
    window). The first slide still keeps retrieval's share free, so the window does not
    slide again soon after, when the passages come. With ~300-token turns (gpu-chat's)
    reckoned without it, the first slide left three turns out, the next came two turns
    later; now four leave and every slide is three turns apart."""
    shown = first_shown(True, retriever=Evicted(), message="x" * 1200)
    moves = [i for i in range(1, len(shown)) if shown[i] != shown[i - 1]]
    assert len(moves) >= 3 and {b - a for a, b in itertools.pairwise(moves)} == {3}, shown


def test_memory_its_budget_never_lets_retrieve_holds_no_share() -> None:
    """A retriever whose budget retrieves nothing (``retrieval_tokens=0``) slides the window
    as a session without memory does: no room is kept for passages that cannot come."""
    none = Budget(context_tokens=2048, max_new_tokens=64, retrieval_tokens=0)
    off = first_shown(False, message="x" * 1200, budget=none)
    assert first_shown(True, retriever=Evicted(), message="x" * 1200, budget=none) == off
