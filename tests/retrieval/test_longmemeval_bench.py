"""benchmarks/longmemeval.py on a tiny synthetic haystack in LongMemEval's format (no
LongMemEval data needed): the counting fails when evidence is missing and passes when
every ``has_answer`` message is in the prompt."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from conftest import HashEncoder

from benchmarks import longmemeval as lme
from benchmarks.locomo import CachedEmbeddings
from convo.retrieval import RetrievalConfig, RetrievalMemory
from convo.tokens import TiktokenCounter

FILLER = "Tell me about the weather in general and some other unrelated things please. " * 4


def tiny_record(qid: str = "q1") -> dict[str, Any]:
    sessions, dates, ids = [], [], []
    for s in range(12):
        msgs = [
            {"role": "user", "content": f"{FILLER} (session {s})"},
            {"role": "assistant", "content": f"Sure. {FILLER} (answer {s})"},
        ]
        if s == 3:
            msgs.insert(0, {"role": "assistant", "content": "Welcome back!"})  # opens with the assistant
            msgs.append({"role": "user", "content": "My dog Biscuit is a beagle.", "has_answer": True})
        if s == 7:
            msgs.append({"role": "user", "content": "Biscuit turned three in June.", "has_answer": True})
        sessions.append(msgs)
        dates.append(f"2023/05/{s + 1:02d} (Mon) 10:00")
        ids.append(f"s{s}")
    return {
        "question_id": qid,
        "question_type": "multi-session",
        "question": "What breed is my dog Biscuit and how old did Biscuit turn?",
        "answer": "beagle, three",
        "question_date": "2023/06/30 (Fri) 09:00",
        "haystack_dates": dates,
        "haystack_session_ids": ids,
        "haystack_sessions": sessions,
        "answer_session_ids": ["s3", "s7"],
    }


def test_items_split_sessions_and_find_the_evidence(tmp_path: Path) -> None:
    path = tmp_path / "tiny.json.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump([tiny_record(), {**tiny_record("q2_abs"), "question_type": "temporal-reasoning"}], f)
    items = lme.load(path)
    item = items[0]
    # Session 3 opens with the assistant: a turn of its own, dated with its session.
    opener = [t for t in item.turns if t.messages[0].content == "Welcome back!"]
    assert len(opener) == 1 and item.dates[opener[0].index].startswith("2023/05/04")
    assert [text for *_, text in item.evidence] == [
        "My dog Biscuit is a beagle.",
        "Biscuit turned three in June.",
    ]
    assert items[1].abstention
    # Counting: nothing found, one of two (fails), both (passes).
    assert lme.evidence_in(item, ["nothing here"])[:2] == (0, 2)
    found, known, srec = lme.evidence_in(item, ["user: My dog Biscuit is a beagle."])
    assert (found, known, srec) == (1, 2, 0.5)
    assert lme.evidence_in(item, ["My dog Biscuit is a beagle.\nBiscuit turned three in June."]) == (
        2,
        2,
        1.0,
    )

    def factory(name: str, it: lme.Item) -> Any:
        if name == "window":
            return None
        if name == "bm25":
            return lme.BM25Messages(it)
        mem = RetrievalMemory(HashEncoder(), config=RetrievalConfig(min_score=0.0))
        mem.remember_turns(it.qid, it.turns, dates=it.dates)
        return mem

    results = lme.evaluate(
        items,
        strategies=["window", "bm25", "retrieval"],
        budgets=[600],
        counter=TiktokenCounter("cl100k_base"),
        factory=factory,
    )
    window, bm25 = results["window"]["600"], results["bm25"]["600"]
    assert window["questions"] == 1 and window["recall_all"] == 0.0  # the evidence left the window
    assert bm25["recall_all"] == 1.0 and bm25["session_recall"] == 1.0
    assert bm25["abstention_questions"] == 1 and bm25["abstention_mean_tokens"] > 0
    assert bm25["per_type"]["multi-session"]["recall_all"] == 1.0
    assert bm25["newest_recall"] == 1.0 and window["newest_recall"] == 0.0
    assert results["retrieval"]["600"]["recall_all"] == 1.0
    cv = lme.cross_validate(results, items, 600)
    assert cv["candidates"] == ["retrieval"] and len(cv["folds"]) == 2


def test_precompute_embeds_every_text_a_run_needs(tmp_path: Path) -> None:
    path = tmp_path / "tiny.json.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump([tiny_record()], f)
    items = lme.load(path)
    inner = HashEncoder()
    cache = CachedEmbeddings(inner, tmp_path / "vectors.npz")

    def build(name: str, it: lme.Item, encoder: Any) -> Any:
        if name == "dense":
            return lme.DenseMessages(it, encoder, RetrievalConfig().embed_chars)
        mem = RetrievalMemory(encoder, config=RetrievalConfig(min_score=0.0))
        mem.remember_turns(it.qid, it.turns, dates=it.dates)
        return mem

    assert lme.precompute(items, build, ["dense", "retrieval"], cache, progress=lambda _: None) > 0
    assert (tmp_path / "vectors.npz").exists()
    # A run from the saved cache embeds nothing more (queries and vocabulary included).
    again = CachedEmbeddings(inner, tmp_path / "vectors.npz")
    calls = inner.calls
    for name in ("dense", "retrieval"):
        got = build(name, items[0], again)
        got.retrieve(
            items[0].question, session_id=items[0].qid, top_k=lme.TOP_K, today=items[0].question_date
        )
    assert inner.calls == calls
    assert lme.precompute(items, build, ["dense", "retrieval"], again, progress=lambda _: None) == 0


def test_the_embedding_cache_grows_with_its_texts_not_rows_times_the_longest(tmp_path: Path) -> None:
    # One long text among many short ones: a numpy string array would make every row as
    # wide as the longest (a LongMemEval cache reached 19 GB that way).
    import numpy as np

    texts = [f"short text {i}" for i in range(2000)] + ["long " * 20000]
    cache = CachedEmbeddings(HashEncoder(), tmp_path / "v.npz")
    cache.encode(texts)
    cache.save()
    assert (tmp_path / "v.npz").stat().st_size < 4 * 1024 * 1024
    again = CachedEmbeddings(HashEncoder(), tmp_path / "v.npz")
    assert all(again.has(t) for t in texts)
    assert np.allclose(again.encode(texts[:3]), cache.encode(texts[:3]))
    # A cache written the older way (a string array) still reads.
    np.savez(tmp_path / "old.npz", texts=np.asarray(texts[:5]), vectors=cache.encode(texts[:5]))
    old = CachedEmbeddings(HashEncoder(), tmp_path / "old.npz")
    assert all(old.has(t) for t in texts[:5]) and not old.has(texts[6])
