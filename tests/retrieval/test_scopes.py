"""ScopedMemory: a person's memory shared by several Sessions, one ranking, dated passages,
the newest fact preferred, forgetting, and records that rebuild the same index."""

from __future__ import annotations

from datetime import date

from conftest import HashEncoder

from convo import Budget, Session
from convo.messages import Message, Role
from convo.plan import Turn
from convo.retrieval.config import RetrievalConfig
from convo.retrieval.scopes import MemoryRecord, ScopedMemory
from convo.testing import EchoEngine

BUDGET = Budget(
    context_tokens=2048, max_new_tokens=64, window_turns=2, summarize_batch_turns=1, summary_tokens=0
)


def day(d: str):  # a clock for a Session: every turn on that day
    return lambda: date.fromisoformat(d)


def chat(memory: ScopedMemory, sid: str, on: str, lines: list[str]) -> Session:
    session = Session(EchoEngine(), budget=BUDGET, retriever=memory, session_id=sid, clock=day(on))
    for line in lines:
        session.send(line)
    return session


FILLER = [f"small talk number {i} about buses and rain" for i in range(3)]


def test_a_new_session_retrieves_earlier_sessions_and_its_own_in_one_ranking() -> None:
    alice = ScopedMemory(HashEncoder(), scope="alice")
    chat(alice, "mon", "2026-11-02", ["My cat is called Miso.", *FILLER])
    today = chat(alice, "tue", "2026-11-03", ["My dog is called Pepper.", *FILLER])
    plan = today.plan("What are my cat and dog called?")
    used = {(p.meta["session_id"], p.meta["turn"]) for p in plan.passages_used}
    assert ("mon", 0) in used and ("tue", 0) in used
    mine = next(p for p in plan.passages_used if p.meta["session_id"] == "tue")
    other = next(p for p in plan.passages_used if p.meta["session_id"] == "mon")
    assert mine.key.startswith("turn:0") and other.key.startswith("session:mon:turn:0")
    assert other.meta["date"] == "2026-11-02" and other.source == "session mon turn 0"
    # Each passage shows its date in the prompt.
    prompt = "\n".join(m.content for m in plan.messages)
    assert "2026-11-02" in prompt and "2026-11-03" in prompt


def test_where_a_fact_changed_the_newest_is_preferred() -> None:
    """The older statement matches the question better word for word; the person's scope
    ranks the later day first (without the recency weight the older one wins)."""
    winners = []
    for config in (None, RetrievalConfig(recency_weight=0.0)):
        bob = ScopedMemory(HashEncoder(), scope="bob", config=config)
        chat(bob, "a", "2026-10-01", ["I live in Paris.", *FILLER])
        chat(bob, "b", "2026-11-20", ["I moved last month: now I live in Berlin, near the park.", *FILLER])
        found = bob.retrieve("Where do I live?", session_id="c", top_k=4, today="2026-12-01")
        winners.append(next(p.meta["session_id"] for p in found if "live in" in p.text))
    assert winners == ["b", "a"]


def test_forgetting_a_person_or_a_session() -> None:
    carol = ScopedMemory(HashEncoder(), scope="carol")
    chat(carol, "x", "2026-11-01", ["My locker code is 4711.", *FILLER])
    chat(carol, "y", "2026-11-02", ["My bike is blue.", *FILLER])
    assert carol.forget_session("x") > 0
    assert all(p.meta["session_id"] == "y" for p in carol.retrieve("locker code", session_id="z", top_k=4))
    carol.forget()
    assert carol.retrieve("bike", session_id="z", top_k=4) == [] and carol.session_ids() == []


def test_records_rebuild_the_same_ranking_without_the_embedder() -> None:
    live = ScopedMemory(HashEncoder(), scope="dave")
    records: list[MemoryRecord] = []
    for sid, start in (("s1", 0), ("s2", 0)):
        turns = [
            Turn(
                index=start + i,
                messages=(
                    Message(role=Role.USER, content=f"{sid} fact {i}: the code word is word{i}{sid}"),
                    Message(role=Role.ASSISTANT, content=f"ok {i}"),
                ),
            )
            for i in range(5)
        ]
        records += live.index_turns(sid, turns[:3], dates={0: "2026-11-01"})
        records += live.index_turns(sid, turns, dates={0: "2026-11-01"})  # the first 3: skipped
    assert len(records) == 10
    encoder = HashEncoder()
    rebuilt = ScopedMemory(encoder, scope="dave")
    rebuilt.apply(MemoryRecord.from_dict(r.to_dict()) for r in records)
    assert encoder.calls == 0
    for q in ("code word word3s2", "fact 1 of s1"):
        a = live.retrieve(q, session_id="s2", top_k=4)
        b = rebuilt.retrieve(q, session_id="s2", top_k=4)
        assert [(p.key, round(p.score, 5)) for p in a] == [(p.key, round(p.score, 5)) for p in b]


class OtherModel(HashEncoder):
    """Another embedding model (a different name) of the same vector length."""

    model_id = "other-model/256"


def _records(live: ScopedMemory) -> list[MemoryRecord]:
    turns = [
        Turn(index=i, messages=(Message(role=Role.USER, content=f"fact {i}: the code word is word{i}"),))
        for i in range(4)
    ]
    return live.index_turns("s1", turns, dates={0: "2026-11-01"})


def test_records_name_their_encoder_and_another_model_embeds_them_again() -> None:
    live = ScopedMemory(HashEncoder(), scope="erin")
    records = [MemoryRecord.from_dict(r.to_dict()) for r in _records(live)]
    assert records[0].encoder == "HashEncoder/256" and records[0].vectors
    same = HashEncoder()
    ScopedMemory(same, scope="erin").apply(records)
    assert same.calls == 0  # its own vectors: replayed, not computed
    other = OtherModel()
    rebuilt = ScopedMemory(other, scope="erin")
    rebuilt.apply(records)
    assert other.calls > 0  # another model's vectors are never mixed in: embedded again
    assert [p.key for p in rebuilt.retrieve("code word word2", session_id="s1", top_k=1)] == [
        p.key for p in live.retrieve("code word word2", session_id="s1", top_k=1)
    ]


def test_older_records_without_an_encoder_are_replayed_when_their_length_fits() -> None:
    live = ScopedMemory(HashEncoder(), scope="erin")
    older = []
    for r in _records(live):
        data = r.to_dict()
        data.pop("encoder", None)  # (written before records named their encoder)
        older.append(MemoryRecord.from_dict(data))
    assert older[0].encoder == ""
    fits = HashEncoder()
    ScopedMemory(fits, scope="erin").apply(older)
    assert fits.calls == 0
    wider = HashEncoder(dim=128)
    ScopedMemory(wider, scope="erin").apply(older)  # vectors of another length: embedded again
    assert wider.calls > 0
