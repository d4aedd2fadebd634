"""Embedding ahead: after a reply the session has its new turn embedded in the background,
so the next turn's indexing only looks its vectors up (issue 24)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pytest
from conftest import RecordingEncoder

from convo import Budget, RetrievalMemory, Session
from convo.messages import Message, Role
from convo.plan import PreparesTurns, Turn
from convo.retrieval.config import RetrievalConfig
from convo.retrieval.scopes import ScopedMemory
from convo.session.ahead import AheadPool, ahead_stats, drain_ahead
from convo.testing import ScriptedEngine


def _turns(pairs: Sequence[tuple[str, str]], start: int = 0) -> list[Turn]:
    return [
        Turn(
            index=start + i,
            messages=(Message(role=Role.USER, content=u), Message(role=Role.ASSISTANT, content=a)),
        )
        for i, (u, a) in enumerate(pairs)
    ]


PAIRS = [
    ("I moved to Lisbon in March with my sister.", "How do you like the city?"),
    ("The tram up the hill is my favourite part.", "Yes, tram 28 is famous."),
    ("My sister found a job at the aquarium.", "That sounds like a lovely place to work."),
]


@pytest.mark.parametrize("config", [RetrievalConfig(), RetrievalConfig(embed_alone=False, neighbours=False)])
def test_embedding_texts_cover_what_indexing_embeds(config: RetrievalConfig) -> None:
    for earlier in (0, 1):  # with and without an indexed turn before (its last line is context)
        enc = RecordingEncoder()
        memory = RetrievalMemory(enc, config=config)
        turns = _turns(PAIRS)
        memory.remember_turns("s", turns[:earlier])
        ahead = set(memory.embedding_texts("s", turns[earlier:]))
        enc.seen.clear()
        memory.remember_turns("s", turns[earlier:])
        assert enc.seen and set(enc.seen) <= ahead
        assert memory.embedding_texts("s", turns[earlier:])  # indexing nothing changed that


def test_scoped_memory_prepares_only_turns_not_indexed() -> None:
    enc = RecordingEncoder()
    scoped = ScopedMemory(enc, scope="s", date_turns=False)
    turns = _turns(PAIRS)
    scoped.index_turns("s", turns[:2])
    enc.seen.clear()
    assert scoped.prepare_turns("s", turns) > 0
    prepared = set(enc.seen)
    assert not any("Lisbon" in t for t in prepared)  # turn 0 is indexed already
    assert any("aquarium" in t for t in prepared)
    enc.seen.clear()
    scoped.index_turns("s", turns)
    assert set(enc.seen) <= prepared
    assert scoped.prepare_turns("s", turns) == 0  # nothing left to embed


def test_pool_runs_jobs_counts_them_and_drops_past_its_backlog() -> None:
    gate = threading.Event()
    pool = AheadPool(workers=1, max_backlog=2)
    assert pool.submit(lambda: (gate.wait(10), 3)[1])
    assert pool.submit(lambda: 2)
    # The first job may still be queued or already running: fill the queue up.
    results = [pool.submit(lambda: 1) for _ in range(2)]
    assert results.count(False) >= 1
    gate.set()
    assert pool.drain(10)
    s = pool.stats()
    assert s.dropped == results.count(False) and s.done == s.submitted - s.dropped
    assert s.texts == 3 + 2 + results.count(True) and s.backlog == 0

    def boom() -> int:
        raise RuntimeError("fails")

    assert pool.submit(boom) and pool.drain(10)
    assert pool.stats().failed == 1


def test_session_embeds_its_turn_ahead_and_the_next_turn_finds_it() -> None:
    from convo.embeddings import Embedder

    embedder = Embedder(precision="float32", word_cache=False)
    memory = RetrievalMemory(embedder)
    assert isinstance(memory, PreparesTurns)
    # One turn in the window: the first turn leaves it when the second one starts.
    budget = Budget(context_tokens=4096, window_turns=1, summarize_batch_turns=1)
    session = Session(ScriptedEngine(), retriever=memory, budget=budget)
    before = ahead_stats()
    session.send("I moved to Lisbon in March with my sister, who works at the aquarium.")
    assert drain_ahead(30)
    after = ahead_stats()
    assert after.done == before.done + 1 and after.texts > before.texts
    computed: list[str] = []  # on the turn's path (not in the embed-ahead threads)
    compute = embedder._compute

    def counting(todo: Sequence[str]) -> dict[str, np.ndarray]:
        if threading.current_thread().name != "convo-ahead":
            computed.extend(todo)
        return compute(todo)

    embedder._compute = counting  # type: ignore[method-assign]
    question = "Where does my sister work?"
    session.send(question)
    # The first turn was indexed at the start of this one (it left the window) from
    # vectors computed ahead: only the question (and its words, for expansion) was embedded
    # on the turn's path, and the turn's passage came from the first turn.
    assert computed and set(computed) <= {question, *question.lower().rstrip("?").split()}
    assert session.evicted_turns >= 1
    assert memory.retrieve("aquarium job", session_id=session.id, top_k=1)


def test_turns_in_the_window_wait_for_indexing_and_cost_no_query_embedding() -> None:
    # While every turn is in the window (its passages would be dropped), a retriever that
    # embeds ahead is handed nothing and asked nothing: no embedding on the turn's path.
    enc = RecordingEncoder()
    memory = RetrievalMemory(enc)
    session = Session(ScriptedEngine(), retriever=memory, budget=Budget(context_tokens=4096))
    session.send("I moved to Lisbon in March.")
    assert drain_ahead(30)
    prepared = len(enc.seen)
    assert prepared > 0  # embedded ahead, in the background
    session.send("Where did I move?")
    reply = session.send("And when?")
    assert drain_ahead(30)
    assert reply.stats.passages_used == 0 and session.evicted_turns == 0
    assert memory.retrieve("Lisbon", session_id=session.id, top_k=1) == []  # not indexed yet
