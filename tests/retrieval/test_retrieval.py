"""Tests of convo.retrieval and convo.embeddings.

Most tests use a deterministic hashing encoder (bag of words), so they are fast and test
the index, fusion, isolation and persistence logic; a few load the real MiniLM model.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace
from datetime import date, datetime
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
from conftest import HashEncoder, RecordingEncoder

from convo.budget import Budget
from convo.errors import ConfigError, MissingDependency, StoreError
from convo.messages import Message, Role
from convo.plan import GROUP_LABEL, MEMORY_HEADER, Passage, Turn, passage_messages, plan_prompt, turn_key
from convo.retrieval import (
    BM25Index,
    DocumentCollection,
    Fusion,
    RetrievalConfig,
    RetrievalMemory,
    VectorIndex,
    chunk_text,
    day_label,
    terms,
)
from convo.retrieval.memory import query_text
from convo.tokens import TiktokenCounter

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cl100k() -> TiktokenCounter:
    return TiktokenCounter("cl100k_base")


def unit_vectors(n: int, dim: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def turns_of(pairs: Sequence[tuple[str, str]], start: int = 0) -> list[Turn]:
    return [
        Turn(
            index=start + i,
            messages=(
                Message(role=Role.USER, content=f"Ann: {u}", name="Ann"),
                Message(role=Role.ASSISTANT, content=b, name="Bob"),
            ),
        )
        for i, (u, b) in enumerate(pairs)
    ]


FILLER = [
    ("How was your weekend?", "Quiet, I read a book."),
    ("Any plans for dinner?", "Maybe pasta tonight."),
    ("Did you see the game?", "Yes, great match."),
    ("The weather is nice today.", "Perfect for a walk."),
    ("I started a new course.", "Good luck with it."),
]


# ---------------------------------------------------------------------------------------
# VectorIndex
# ---------------------------------------------------------------------------------------


def test_vector_index_exact_search_and_remove() -> None:
    vecs = unit_vectors(50, 16)
    index = VectorIndex(16)
    index.add(list(range(100, 150)), vecs)
    assert len(index) == 50 and index.kind == "flat"
    scores, ids = index.search(vecs[:5], 3)
    assert ids[:, 0].tolist() == [100, 101, 102, 103, 104]
    assert np.allclose(scores[:, 0], 1.0, atol=1e-5)
    assert index.remove([100, 101, 999]) == 2
    assert len(index) == 48
    _, ids = index.search(vecs[:2], 48)
    assert 100 not in ids and 101 not in ids


def test_vector_index_add_replaces_existing_id() -> None:
    vecs = unit_vectors(3, 8)
    index = VectorIndex(8)
    index.add([1, 2], vecs[:2])
    index.add([1], vecs[2:3])
    assert len(index) == 2
    _, ids = index.search(vecs[2:3], 1)
    assert ids[0, 0] == 1
    scores, _ = index.search(vecs[0:1], 2)
    assert scores[0, 0] < 0.999  # the old vector of id 1 is gone


def test_vector_index_switches_to_ivf_above_exact_max() -> None:
    vecs = unit_vectors(400, 32, seed=1)
    index = VectorIndex(32, exact_max=100, nprobe=64)
    index.add(list(range(100)), vecs[:100])
    assert index.kind == "flat"
    index.add(list(range(100, 400)), vecs[100:])
    assert index.kind == "ivf" and len(index) == 400
    _, ids = index.search(vecs, 1)
    assert (ids[:, 0] == np.arange(400)).mean() >= 0.95
    assert index.remove(range(0, 400, 2)) == 200
    _, ids = index.search(vecs[:10], 5)
    assert not ({0, 2, 4, 6, 8} & set(ids.ravel().tolist()))


@pytest.mark.parametrize("n", [30, 300])
def test_vector_index_save_load_round_trip(tmp_path: Path, n: int) -> None:
    vecs = unit_vectors(n, 24, seed=2)
    index = VectorIndex(24, exact_max=100)
    index.add(list(range(7, 7 + n)), vecs)
    index.remove([7, 8])
    path = tmp_path / "sub" / "v.faiss"
    index.save(path)
    loaded = VectorIndex.load(path)
    assert loaded.kind == index.kind and len(loaded) == len(index) == n - 2
    a = index.search(vecs[:20], 5)
    b = loaded.search(vecs[:20], 5)
    assert np.array_equal(a[1], b[1]) and np.allclose(a[0], b[0])
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_vector_index_load_detects_partial_save(tmp_path: Path) -> None:
    index = VectorIndex(8)
    index.add([1, 2, 3], unit_vectors(3, 8))
    index.save(tmp_path / "v.faiss")
    meta_path = tmp_path / "v.faiss.json"
    meta = json.loads(meta_path.read_text())
    meta["count"] = 4
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(StoreError):
        VectorIndex.load(tmp_path / "v.faiss")


def test_vector_index_rejects_nonsense() -> None:
    with pytest.raises(ConfigError):
        VectorIndex(0)
    with pytest.raises(ConfigError):
        VectorIndex(8, exact_max=0)
    index = VectorIndex(8)
    with pytest.raises(ConfigError):
        index.add([1], unit_vectors(1, 4))
    with pytest.raises(ConfigError):
        index.add([1, 1], unit_vectors(2, 8))


# ---------------------------------------------------------------------------------------
# BM25
# ---------------------------------------------------------------------------------------


def test_bm25_ranks_rare_terms_and_forgets() -> None:
    bm = BM25Index()
    bm.add(1, "I adopted a puppy named Rex last spring")
    bm.add(2, "We went hiking with the dogs")
    bm.add(3, "The weather was nice for hiking")
    assert bm.search("when did she adopt the puppy", 3)[0][0] == 1
    assert [i for i, _ in bm.search("hiking", 3)] == [2, 3] or [i for i, _ in bm.search("hiking", 3)] == [
        3,
        2,
    ]
    assert bm.remove(1) and not bm.remove(1)
    assert all(i != 1 for i, _ in bm.search("puppy adopted", 3))
    assert len(bm) == 2


def test_terms_stem_and_drop_stopwords() -> None:
    assert terms("She was painting the paints") == ["paint", "paint"]
    assert terms("the and of") == []


# ---------------------------------------------------------------------------------------
# Chunking and documents
# ---------------------------------------------------------------------------------------


def test_chunk_positions_and_overlap_are_exact(cl100k: TiktokenCounter) -> None:
    text = " ".join(f"word{i}" for i in range(700))
    ids = cl100k.encode(text)
    chunks = chunk_text(text, cl100k, source="doc.txt", chunk_tokens=100, overlap_tokens=25)
    assert chunks[0].start_token == 0 and chunks[-1].end_token == len(ids)
    for i, c in enumerate(chunks):
        assert c.start_token == i * 75
        assert c.text == cl100k.decode(ids[c.start_token : c.end_token])
        assert c.citation == f"doc.txt:{c.start_token}-{c.end_token}"
    for a, b in itertools.pairwise(chunks):
        assert a.end_token - b.start_token == 25
        assert a.end_token - a.start_token == 100


def test_chunk_keeps_markdown_heading(cl100k: TiktokenCounter) -> None:
    text = "# Intro\n" + "alpha " * 80 + "\n## Setup\n" + "beta " * 200
    chunks = chunk_text(text, cl100k, source="a.md", chunk_tokens=60, overlap_tokens=10)
    assert chunks[0].heading == "Intro"
    assert chunks[-1].heading == "Setup"


def test_chunk_rejects_nonsense(cl100k: TiktokenCounter) -> None:
    with pytest.raises(ConfigError):
        chunk_text("x", cl100k, chunk_tokens=10, overlap_tokens=10)
    with pytest.raises(ConfigError):
        chunk_text("x", cl100k, chunk_tokens=0)
    with pytest.raises(ConfigError):
        DocumentCollection("d", embedder=HashEncoder(), chunk_tokens=5, overlap_tokens=9)


def test_document_collection_add_file_search_and_replace(tmp_path: Path, cl100k: TiktokenCounter) -> None:
    path = tmp_path / "notes.md"
    body = "# Garden\n" + "Tomatoes need full sun and deep watering. " * 5
    body += "\n# Kitchen\n" + "The oven must be preheated to 220 degrees for bread. " * 5
    path.write_text(body)
    docs = DocumentCollection(
        "notes", embedder=HashEncoder(), counter=cl100k, chunk_tokens=40, overlap_tokens=8
    )
    chunks = docs.add_file(path)
    assert len(docs) == len(chunks) > 2
    hits = docs.search("preheated oven bread temperature", k=2)
    assert "oven" in hits[0].text and hits[0].meta["heading"] == "Kitchen"
    assert hits[0].key.startswith("doc:notes:") and hits[0].source.startswith(str(path))
    docs.add_text("only one line now", source=str(path))
    assert len(docs) == 1


# ---------------------------------------------------------------------------------------
# RetrievalMemory
# ---------------------------------------------------------------------------------------


def test_memory_recalls_planted_fact_and_keeps_sessions_apart() -> None:
    memory = RetrievalMemory(HashEncoder(), config=RetrievalConfig(min_score=0.0))
    planted = turns_of([("My locker combination is 4512, remember it.", "Noted.")])[0]
    memory.remember_turns("alice", [planted], dates={0: "3 May 2023"})
    memory.remember_turns("alice", turns_of(FILLER, start=1))
    memory.remember_turns("bob", turns_of(FILLER))
    hits = memory.retrieve("what is my locker combination", session_id="alice", top_k=2)
    assert hits[0].key == turn_key(0, 0)  # the message, not its whole turn (turn_lines="each")
    assert hits[0].text == "Ann: My locker combination is 4512, remember it."  # named once
    assert hits[0].meta["group"] == "3 May 2023"  # the planner puts the date in a header
    assert len(hits) > 2  # more candidates than top_k, for the planner to skip duplicates
    memory.config = RetrievalConfig(min_score=0.0, turn_lines="all")
    whole = memory.retrieve("what is my locker combination", session_id="alice", top_k=2)[0]
    assert whole.key == turn_key(0)
    assert "4512" in whole.text and "3 May 2023" in whole.text and "Bob: Noted." in whole.text
    assert whole.text.count("Ann:") == 1
    assert all("4512" not in p.text for p in memory.retrieve("locker combination", session_id="bob", top_k=5))
    assert memory.retrieve("locker", session_id="nobody", top_k=3) == []


def test_day_label_drops_the_time_of_day_only() -> None:
    assert day_label("1:56 pm on 8 May, 2023") == "8 May 2023"  # LoCoMo's session dates
    assert day_label("10:37 am on 27 June, 2023") == "27 June 2023"
    assert day_label("2023-05-08T13:56:00Z") == "2023-05-08"
    assert day_label("3 May 2023") == "3 May 2023"
    assert day_label("next Tuesday") == "next Tuesday"
    memory = RetrievalMemory(HashEncoder(), config=RetrievalConfig(min_score=0.0))
    first, second = turns_of([("I adopted a cat named Miso.", "Lovely."), ("Miso sleeps all day.", "Ha.")])
    memory.remember_turns("s", [first], dates={0: "9:00 am on 8 May, 2023"})
    memory.remember_turns("s", [second], dates={1: "6:30 pm on 8 May, 2023"})
    hits = memory.retrieve("Miso the cat", session_id="s", top_k=4)
    assert {p.meta["group"] for p in hits} == {"8 May 2023"}  # two sessions of one day: one group
    assert {p.meta["date"] for p in hits} == {"9:00 am on 8 May, 2023", "6:30 pm on 8 May, 2023"}


def test_time_aware_scoring_favours_the_days_the_question_names() -> None:
    # Two turns say the same thing; only their dates tell them apart.
    memory = RetrievalMemory(HashEncoder(), config=RetrievalConfig(min_score=0.0))
    pairs = [("We went hiking by the lake.", "Sounds fun."), ("We went hiking by the lake.", "Again!")]
    dated = {0: "10:00 am on 3 March, 2023", 1: "4:00 pm on 20 June, 2023"}
    memory.remember_turns("s", turns_of([*pairs, *FILLER]), dates={**dated, 2: "1 July 2023"})
    june = memory.retrieve("Where did Ann go hiking in June 2023?", session_id="s", top_k=3)
    march = memory.retrieve("Where did Ann go hiking in early March 2023?", session_id="s", top_k=3)
    assert june[0].key == turn_key(1, 0) and march[0].key == turn_key(0, 0)
    assert june[0].score > march[1].score  # the named day's message gained, not the other
    off = RetrievalMemory(HashEncoder(), config=RetrievalConfig(min_score=0.0, time_weight=0.0))
    off.remember_turns("s", turns_of([*pairs, *FILLER]), dates=dated)
    asked = ("Where did Ann go hiking in June 2023?", "Where did Ann go hiking in early March 2023?")
    tops = {off.retrieve(q, session_id="s", top_k=3)[0].key for q in asked}
    assert len(tops) == 1  # without it the dates change nothing


def test_time_aware_scoring_adds_a_named_days_messages_as_candidates() -> None:
    # No word of the question matches the message; its day does.
    memory = RetrievalMemory(HashEncoder(), config=RetrievalConfig(min_score=0.0))
    turns = turns_of([*FILLER, ("Surprise! I baked you a lemon cake.", "Thank you!")])
    dates = {i: f"{i + 1} May 2022" for i in range(len(FILLER))} | {len(FILLER): "9:00 am on 25 May, 2022"}
    memory.remember_turns("s", turns, dates=dates)
    cake = {turn_key(len(FILLER), 0), turn_key(len(FILLER), 1)}
    hits = memory.retrieve("What did Ann do for Bob on 25 May, 2022?", session_id="s", top_k=2)
    assert hits[0].key in cake
    undated = memory.retrieve("What did Ann do for Bob?", session_id="s", top_k=2)
    assert undated[0].key not in cake


def test_relative_time_counts_from_the_day_the_question_is_asked() -> None:
    # No context lines: the two turns' first lines stay alike (only their days differ).
    memory = RetrievalMemory(HashEncoder(), config=RetrievalConfig(min_score=0.0, neighbours=False))
    pairs = [("We went hiking by the lake.", "Sounds fun."), ("We went hiking by the lake.", "Again!")]
    memory.remember_turns(
        "s", turns_of([*pairs, *FILLER]), dates={0: "2026-11-02T10:00", 1: "2026-11-30T18:30"}
    )
    q = "Where did we go hiking yesterday?"
    assert memory.retrieve(q, session_id="s", top_k=3, today="2026-12-01")[0].key == turn_key(1, 0)
    assert memory.retrieve(q, session_id="s", top_k=3, today=date(2026, 11, 3))[0].key == turn_key(0, 0)
    last_week = memory.retrieve("hiking last week?", session_id="s", top_k=3, today=datetime(2026, 11, 10, 9))
    assert last_week[0].key == turn_key(0, 0)
    undated = memory.retrieve(q, session_id="s", top_k=3)  # no today: "yesterday" is just a word
    assert undated[0].score < memory.retrieve(q, session_id="s", top_k=3, today="2026-12-01")[0].score


def test_vocabulary_keeps_each_words_nearest_as_words_arrive() -> None:
    from convo.retrieval import NEAR_KEPT
    from convo.retrieval.expansion import Vocabulary

    words = [f"w{i}" for i in range(40)]
    vecs = unit_vectors(40, 16, seed=3)
    step = Vocabulary(16)
    for start in (0, 5, 6, 23):  # added in uneven batches
        end = {0: 5, 5: 6, 6: 23, 23: 40}[start]
        step.add(words[start:end], vecs[start:end])
    whole = Vocabulary(16)
    whole._CHUNK = 7  # chunked comparison gives the same lists
    whole.add(words, vecs)
    sims = vecs @ vecs.T
    np.fill_diagonal(sims, -2.0)
    for i, word in enumerate(words):
        expected = [words[j] for j in np.argsort(-sims[i], kind="stable")[:NEAR_KEPT]]
        assert [w for w, _ in step.nearest(word)] == expected
        assert [w for w, _ in whole.nearest(word)] == expected
        assert [c for _, c in step.nearest(word)] == pytest.approx(sorted(sims[i], reverse=True)[:NEAR_KEPT])


class WordEncoder(HashEncoder):
    """HashEncoder, but a single word of a family has the family's vector: a stand-in for
    an embedding model that puts "passion" next to "passionate" (sentences are hashed
    as they are, so only the query expansion can join the two)."""

    FAMILIES: ClassVar[dict[str, str]] = {"passionate": "passion"}

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        return super().encode([self.FAMILIES.get(t, t) for t in texts])


def test_query_expansion_finds_messages_through_nearby_words(tmp_path: Path) -> None:
    pairs = [
        ("I have a real passion for the animal shelter.", "That is lovely."),
        ("My passion is the shelter, every weekend.", "Good for you."),
        ("Such a passionate match last night!", "Passionate fans too."),
        *FILLER,
        *[(f"Lunch was fine, day {i}.", "Nice.") for i in range(100)],  # "passion" is not common
    ]
    memory = RetrievalMemory(WordEncoder(), config=RetrievalConfig(min_score=0.0))
    memory.remember_turns("s", turns_of(pairs))
    assert "passion" in memory.expansion("What is Ann passionate about?", session_id="s")
    assert memory.expansion("What is Ann passionate about?", session_id="nobody") == []
    off = RetrievalMemory(WordEncoder(), config=RetrievalConfig(min_score=0.0, expand_terms=0))
    off.remember_turns("s", turns_of(pairs))

    def rank(mem: RetrievalMemory) -> int:
        hits = mem.retrieve("What is she so passionate about?", session_id="s", top_k=20)
        return next(i for i, p in enumerate(hits) if "shelter" in p.text)

    assert rank(memory) < rank(off)
    # Saved and loaded with the session; extended by later turns.
    words = memory.vocabulary("s")
    assert "passion" in words and "zumba" not in words
    memory.save(tmp_path / "m")
    again = RetrievalMemory.load(tmp_path / "m", embedder=WordEncoder())
    calls = again.embedder.calls
    assert again.vocabulary("s") == words
    assert again.embedder.calls == calls  # loaded with its vectors: no word embedded again
    again.remember_turns("s", turns_of([("Zumba people again.", "Zumba!")], start=len(pairs)))
    extended = again.vocabulary("s")
    assert extended[: len(words)] == words and "zumba" in extended  # the new turn's words join
    again.forget_session("s")
    assert again.vocabulary("s") == [] and again.expansion("passionate", session_id="s") == []
    # A damaged vocabulary file is rebuilt from the session's words, not an error.
    saved = next((tmp_path / "m" / "sessions").iterdir()) / "vocabulary.npz"
    saved.write_bytes(b"not a zip")
    rebuilt = RetrievalMemory.load(tmp_path / "m", embedder=WordEncoder())
    calls = rebuilt.embedder.calls
    assert sorted(rebuilt.vocabulary("s")) == sorted(words)
    assert rebuilt.embedder.calls > calls  # rebuilt: the words were embedded again
    assert "passion" in rebuilt.expansion("What is Ann passionate about?", session_id="s")


def test_query_expansion_by_the_whole_query_vector() -> None:
    class InstrumentEncoder(HashEncoder):
        """The single word "piano" sits next to "instruments" (its hashed vector)."""

        def encode(self, texts: Sequence[str]) -> np.ndarray:
            return super().encode(["instruments" if t == "piano" else t for t in texts])

    pairs = [  # ties break by position: the piano turns come last
        *[(f"Lunch was fine, day {i}.", "Nice.") for i in range(100)],
        ("I practised the piano for an hour.", "Nice."),
        ("My piano teacher is strict.", "Ha."),
    ]
    question = "What instruments does she play?"

    def setup(words: int) -> tuple[RetrievalMemory, list[str]]:
        config = RetrievalConfig(min_score=0.0, expand_terms=0, expand_query_words=words)
        memory = RetrievalMemory(InstrumentEncoder(), config=config)
        memory.remember_turns("s", turns_of(pairs))
        return memory, memory.expansion(question, session_id="s")

    memory, words = setup(4)
    assert "piano" in words  # no word of the question, but near its meaning
    off, none = setup(0)
    assert none == []

    def rank(mem: RetrievalMemory) -> int:
        hits = mem.retrieve(question, session_id="s", top_k=20)
        return next((i for i, p in enumerate(hits) if "piano" in p.text), len(hits))

    assert rank(memory) < rank(off)


def test_second_hop_seeds_come_from_different_days() -> None:
    from convo.retrieval.ranking import hop_seeds

    # Three turns of two messages: units 0-3 on 1 May, 4-5 on 9 May.
    units = list(range(6))
    episode_of = {u: "date:1 May 2023" if u < 4 else "date:9 May 2023" for u in units}
    fused = {u: 1.0 - 0.01 * i for i, u in enumerate(units)}
    ranking = sorted(fused, key=lambda u: -fused[u])
    config = RetrievalConfig(min_score=0.0, hop_seeds=2)
    assert hop_seeds(fused, ranking, episode_of, config) == [units[0], units[4]]  # one per day
    same_day = RetrievalConfig(min_score=0.0, hop_seeds=2, hop_distinct_days=False)
    assert hop_seeds(fused, ranking, episode_of, same_day) == [units[0], units[1]]
    fused[units[4]] = fused[units[5]] = 0.4  # an also-ran is no seed, even from another day
    assert hop_seeds(fused, ranking, episode_of, RetrievalConfig(hop_seeds=2)) == [units[0]]


def test_memory_forget_really_forgets() -> None:
    memory = RetrievalMemory(HashEncoder(), config=RetrievalConfig(min_score=0.0))
    memory.remember_turns("s", turns_of([("The vault code is 9911.", "OK."), *FILLER]))
    assert memory.forget_turns("s", [0]) == 1
    assert all("9911" not in p.text for p in memory.retrieve("vault code", session_id="s", top_k=10))
    memory.forget_session("s")
    assert memory.retrieve("weekend", session_id="s", top_k=3) == []
    assert memory.turn_count("s") == 0


def test_memory_turn_indexed_again_is_replaced() -> None:
    memory = RetrievalMemory(HashEncoder(), config=RetrievalConfig(min_score=0.0))
    memory.remember_turns("s", turns_of([("I like tea.", "Nice.")]))
    memory.remember_turns("s", turns_of([("I like coffee.", "Nice.")]))
    assert memory.turn_count("s") == 1
    hits = memory.retrieve("tea or coffee", session_id="s", top_k=3)
    assert {p.key for p in hits} <= {turn_key(0, 0), turn_key(0, 1)} and "coffee" in hits[0].text
    assert not any("tea" in p.text for p in hits)


def test_documents_are_shared_between_sessions(cl100k: TiktokenCounter) -> None:
    enc = HashEncoder()
    docs = DocumentCollection("manual", embedder=enc, counter=cl100k, chunk_tokens=30, overlap_tokens=5)
    docs.add_text("The reset button is behind the left hinge. " + "Filler text here. " * 20, source="m.txt")
    memory = RetrievalMemory(enc, collections=[docs], config=RetrievalConfig(min_score=0.0))
    private = DocumentCollection("private", embedder=enc, counter=cl100k)
    private.add_text("The secret reset phrase is zebra.", source="p.txt")
    memory.attach(private, session_id="a")
    for sid in ("a", "b"):
        hits = memory.retrieve("where is the reset button", session_id=sid, top_k=2)
        assert any("left hinge" in p.text for p in hits)
    assert any("zebra" in p.text for p in memory.retrieve("reset phrase", session_id="a", top_k=3))
    assert not any("zebra" in p.text for p in memory.retrieve("reset phrase", session_id="b", top_k=3))


def test_memory_save_load_round_trip(tmp_path: Path, cl100k: TiktokenCounter) -> None:
    enc = HashEncoder()
    docs = DocumentCollection("kb", embedder=enc, counter=cl100k, chunk_tokens=20, overlap_tokens=4)
    docs.add_text("Invoices are paid within 30 days. " * 6, source="kb.md")
    memory = RetrievalMemory(enc, collections=[docs], config=RetrievalConfig(fusion="rrf", min_score=0.1))
    memory.remember_turns("s1", turns_of([("My cat is called Miso.", "Cute."), *FILLER]), dates={0: "1 Jan"})
    memory.remember_turns("s/2", turns_of(FILLER))
    before = {sid: memory.retrieve("cat name invoices", session_id=sid, top_k=4) for sid in ("s1", "s/2")}
    memory.save(tmp_path / "mem")
    loaded = RetrievalMemory.load(tmp_path / "mem", embedder=enc, counter=cl100k)
    assert loaded.min_score == 0.1 and loaded.config.fusion is Fusion.RRF
    for sid, hits in before.items():
        again = loaded.retrieve("cat name invoices", session_id=sid, top_k=4)
        assert [(p.key, p.text, round(p.score, 6)) for p in again] == [
            (p.key, p.text, round(p.score, 6)) for p in hits
        ]
    # Turns indexed after a load keep distinct ids.
    loaded.remember_turns("s1", turns_of([("Parking is on level 3.", "OK.")], start=50))
    assert loaded.retrieve("parking level", session_id="s1", top_k=1)[0].key == turn_key(50, 0)


# ---------------------------------------------------------------------------------------
# Files on disk are checked, not trusted (issue 27)
# ---------------------------------------------------------------------------------------

SECRETS = {"a": "The vault code of Ann is 1234.", "b": "The vault code of Bea is 9876."}


def saved_pair(folder: Path) -> Path:
    """Two sessions of as many turns (so their unit ids match), each with a secret, saved."""
    memory = RetrievalMemory(HashEncoder(), config=RetrievalConfig(min_score=0.0))
    for sid, secret in SECRETS.items():
        memory.remember_turns(sid, turns_of([(secret, "Noted."), *FILLER]))
    memory.save(folder)
    return folder


def session_folder(folder: Path, sid: str) -> Path:
    return folder / "sessions" / json.loads((folder / "memory.json").read_text())["sessions"][sid]


def assert_never_crosses(folder: Path) -> None:
    """Loading ``folder`` fails with a StoreError, or each session finds only its own secret."""
    try:
        loaded = RetrievalMemory.load(folder, embedder=HashEncoder())
    except StoreError as exc:
        assert "restore" in str(exc) or "delete" in str(exc)  # says what to do
        return
    for sid in SECRETS:
        texts = [p.text for p in loaded.retrieve("vault code", session_id=sid, top_k=10)]
        others = [s for other, s in SECRETS.items() if other != sid]
        assert not any(o.split()[-1] in t for o in others for t in texts), (sid, texts)


def test_saved_files_record_their_owner(tmp_path: Path) -> None:
    folder = saved_pair(tmp_path / "m")
    for sid in SECRETS:
        data = json.loads((session_folder(folder, sid) / "passages.json").read_text())
        assert data["owner"] == f"session:{sid}"
    # A folder saved before owners were recorded still loads.
    for sid in SECRETS:
        path = session_folder(folder, sid) / "passages.json"
        data = json.loads(path.read_text())
        del data["owner"]
        path.write_text(json.dumps(data))
    loaded = RetrievalMemory.load(folder, embedder=HashEncoder())
    assert "1234" in loaded.retrieve("vault code", session_id="a", top_k=1)[0].text


def test_swapped_passages_file_never_crosses_sessions(tmp_path: Path) -> None:
    folder = saved_pair(tmp_path / "m")
    a, b = session_folder(folder, "a"), session_folder(folder, "b")
    (a / "passages.json").write_bytes((b / "passages.json").read_bytes())
    with pytest.raises(StoreError, match="session"):
        RetrievalMemory.load(folder, embedder=HashEncoder())
    # Also with the owner field gone (a file of an older save), and with the vectors too.
    data = json.loads((a / "passages.json").read_text())
    del data["owner"]
    (a / "passages.json").write_text(json.dumps(data))
    for name in ("vectors.faiss", "vectors.faiss.json"):
        (a / name).write_bytes((b / name).read_bytes())
    with pytest.raises(StoreError, match="session"):
        RetrievalMemory.load(folder, embedder=HashEncoder())
    assert_never_crosses(folder)


@pytest.mark.parametrize("escape", ["parent", "absolute", "other-session"])
def test_memory_file_cannot_point_outside_or_at_another_session(tmp_path: Path, escape: str) -> None:
    victim = saved_pair(tmp_path / "victim")
    folder = saved_pair(tmp_path / "m")
    meta = json.loads((folder / "memory.json").read_text())
    target = session_folder(victim, "b")
    meta["sessions"]["a"] = {
        "parent": f"../../victim/sessions/{target.name}",
        "absolute": str(target),
        "other-session": meta["sessions"]["b"],
    }[escape]
    (folder / "memory.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError):
        RetrievalMemory.load(folder, embedder=HashEncoder())
    assert_never_crosses(folder)


def test_collection_folder_cannot_escape(tmp_path: Path, cl100k: TiktokenCounter) -> None:
    docs = DocumentCollection("kb", embedder=HashEncoder(), counter=cl100k)
    docs.add_text("Invoices are paid within 30 days.", source="kb.md")
    memory = RetrievalMemory(HashEncoder(), collections=[docs])
    memory.save(tmp_path / "m")
    docs.save(tmp_path / "outside")
    meta = json.loads((tmp_path / "m" / "memory.json").read_text())
    meta["collections"]["kb"] = "../../outside"
    (tmp_path / "m" / "memory.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError):
        RetrievalMemory.load(tmp_path / "m", embedder=HashEncoder(), counter=cl100k)


def damage(data: dict, how: str) -> object:
    if how == "not-an-object":
        return [data]
    if how == "missing-key":
        return {k: v for k, v in data.items() if k not in ("records", "sessions", "dim")}
    if how == "wrong-type":
        return {**data, **{k: "x" for k in ("next_pid", "records", "sessions", "config", "dim")}}
    if how == "bad-unit":  # a unit without its lexical text / a session folder that is a number
        out = json.loads(json.dumps(data))
        for rec in out.get("records", []):
            rec["units"] = [u[:2] for u in rec["units"]]
        for sid in out.get("sessions", {}):
            out["sessions"][sid] = 7
        return out
    if how == "id-clash":  # two units with one id / an unknown setting
        out = json.loads(json.dumps(data))
        recs = out.get("records", [])
        if len(recs) > 1:
            recs[1]["units"][0][0] = recs[0]["units"][0][0]
        if "config" in out:
            out["config"]["no_such_option"] = 1
        return out
    raise AssertionError(how)


@pytest.mark.parametrize(
    ("which", "how"),
    [
        *itertools.product(
            ["passages.json", "memory.json"],
            ["not-an-object", "missing-key", "wrong-type", "bad-unit", "id-clash"],
        ),
        *itertools.product(["vectors.faiss.json"], ["not-an-object", "missing-key", "wrong-type"]),
    ],
)
def test_damaged_files_raise_store_error(tmp_path: Path, which: str, how: str) -> None:
    folder = saved_pair(tmp_path / "m")
    path = folder / "memory.json" if which == "memory.json" else session_folder(folder, "a") / which
    path.write_text(json.dumps(damage(json.loads(path.read_text()), how)))
    with pytest.raises(StoreError) as info:
        RetrievalMemory.load(folder, embedder=HashEncoder())
    assert "restore" in str(info.value) or "delete" in str(info.value)


def test_damaged_collection_file_raises_store_error(tmp_path: Path, cl100k: TiktokenCounter) -> None:
    docs = DocumentCollection("kb", embedder=HashEncoder(), counter=cl100k)
    docs.add_text("Invoices are paid within 30 days.", source="kb.md")
    docs.save(tmp_path / "kb")
    (tmp_path / "kb" / "collection.json").write_text(json.dumps({"format": 1, "name": "kb"}))
    with pytest.raises(StoreError):
        DocumentCollection.load(tmp_path / "kb", embedder=HashEncoder(), counter=cl100k)


def vocabulary_memory() -> RetrievalMemory:
    pairs = [
        ("I have a real passion for the animal shelter.", "That is lovely."),
        ("My passion is the shelter, every weekend.", "Good for you."),
        ("Such a passionate match last night!", "Passionate fans too."),
        *FILLER,
    ]
    memory = RetrievalMemory(WordEncoder(), config=RetrievalConfig(min_score=0.0))
    memory.remember_turns("s", turns_of(pairs))
    memory.remember_turns("t", turns_of(FILLER))
    return memory


@pytest.mark.parametrize("field", ["near-too-high", "near-too-low", "not-finite", "owner"])
def test_vocabulary_that_does_not_fit_is_rebuilt(tmp_path: Path, field: str) -> None:
    memory = vocabulary_memory()
    question = "What is Ann passionate about?"
    before = memory.retrieve(question, session_id="s", top_k=5)
    words = memory.vocabulary("s")
    memory.save(tmp_path / "m")
    path = session_folder(tmp_path / "m", "s") / "vocabulary.npz"
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    n = len(arrays["terms"])
    if field == "near-too-high":
        arrays["near"][:, 0] = n + 5  # ids past the words it holds
    elif field == "near-too-low":
        arrays["near"][:, 0] = -7
    elif field == "not-finite":
        arrays["vectors"][0, 0] = np.nan
    else:  # the vocabulary of another session copied in
        arrays = {k: v for k, v in arrays.items() if k != "owner"}
        with np.load(session_folder(tmp_path / "m", "t") / "vocabulary.npz") as other:
            arrays = {k: other[k] for k in other.files} if "owner" in other.files else arrays
            if "owner" not in other.files:
                pytest.fail("vocabulary.npz records no owner")
    np.savez(path, **arrays)
    loaded = RetrievalMemory.load(tmp_path / "m", embedder=WordEncoder())
    calls = loaded.embedder.calls
    again = loaded.retrieve(question, session_id="s", top_k=5)  # today: IndexError
    assert loaded.embedder.calls > calls + 1  # rebuilt: words embedded, not only the query
    assert [(p.key, round(p.score, 6)) for p in again] == [(p.key, round(p.score, 6)) for p in before]
    assert sorted(loaded.vocabulary("s")) == sorted(words)


def test_passages_feed_the_planner_inside_the_budget() -> None:
    counter = TiktokenCounter("cl100k_base")
    memory = RetrievalMemory(HashEncoder(), config=RetrievalConfig(min_score=0.05))
    notes = [(f"Note {i}: the weather report number {i}.", "OK.") for i in range(20)]
    history = turns_of(
        [("My passport number is X123.", "Saved."), *notes, ("I renewed my passport photo.", "Nice.")]
    )
    memory.remember_turns("s", history)
    question = Turn(
        index=len(history), messages=(Message(role=Role.USER, content="What is my passport number?"),)
    )
    budget = Budget(
        context_tokens=300, max_new_tokens=32, window_turns=3, retrieval_tokens=80, retrieval_top_k=2
    )
    passages = memory.retrieve("What is my passport number?", session_id="s", top_k=budget.retrieval_top_k)
    plan = plan_prompt(
        budget=budget,
        counter=counter,
        turns=[*history, question],
        passages=passages,
        min_score=memory.min_score,
    )
    assert plan.total_tokens <= 300 and plan.parts["retrieved"] <= 80
    assert plan.passages_used and "X123" in plan.passages_used[0].text
    assert len(plan.passages_used) <= 2
    reasons = {d.reason for d in plan.passages_dropped}
    assert reasons <= {"min_score", "in_window", "duplicate", "top_k", "token_cap"}
    assert "in_window" in reasons  # the window's own turns were offered and skipped


def test_retrieval_config_rejects_nonsense() -> None:
    with pytest.raises(ConfigError):
        RetrievalConfig(fusion="magic")
    with pytest.raises(ConfigError):
        RetrievalConfig(dense_weight=1.5)
    with pytest.raises(ConfigError):
        RetrievalConfig(candidates_factor=0)
    with pytest.raises(ConfigError):
        RetrievalMemory(HashEncoder()).remember_turns("", [])


def test_lexical_only_and_dense_only_modes() -> None:
    for fusion in ("lexical", "dense", "mix", "rrf"):
        memory = RetrievalMemory(HashEncoder(), config=RetrievalConfig(fusion=fusion, min_score=0.0))
        memory.remember_turns("s", turns_of([("I bought a kayak.", "Fun!"), *FILLER]))
        assert memory.retrieve("kayak bought", session_id="s", top_k=1)[0].key == turn_key(0, 0), fusion


# ---------------------------------------------------------------------------------------
# Dependencies and real model
# ---------------------------------------------------------------------------------------


def test_importing_does_not_load_heavy_modules() -> None:
    code = (
        "import sys, convo.retrieval, convo.embeddings; "
        "heavy = [m for m in ('torch', 'faiss', 'sentence_transformers') if m in sys.modules]; "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_old_import_paths_still_work() -> None:
    """convo.retrieval was one module; as a package it serves the same public names, and
    ``convo`` serves the same objects (the moved names with a DeprecationWarning)."""
    import warnings

    import convo
    import convo.retrieval as retrieval
    from convo import dates

    public = {
        "BM25Index",
        "Chunk",
        "DEFAULT_CHUNK_TOKENS",
        "DEFAULT_EXACT_MAX",
        "DEFAULT_NPROBE",
        "DEFAULT_OVERLAP_TOKENS",
        "DocumentCollection",
        "Fusion",
        "NEAR_KEPT",
        "RetrievalConfig",
        "RetrievalMemory",
        "ScopedMemory",
        "TURN_LINES",
        "VectorIndex",
        "chunk_text",
        "day_label",
        "terms",
    }
    assert set(retrieval.__all__) == public
    assert all(hasattr(retrieval, name) for name in public)
    assert retrieval.DEFAULT_EXACT_MAX == 20_000 and retrieval.NEAR_KEPT == 8
    assert retrieval.day_label is dates.day_label
    assert convo.RetrievalMemory is RetrievalMemory and convo.DocumentCollection is DocumentCollection
    for name in ("BM25Index", "Chunk", "RetrievalConfig", "VectorIndex", "chunk_text"):
        with pytest.warns(DeprecationWarning):
            assert getattr(convo, name) is getattr(retrieval, name)
    with pytest.warns(DeprecationWarning, match="RetrievalMemory"):
        assert retrieval.Memory is RetrievalMemory  # type: ignore[attr-defined]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from convo.retrieval import BM25Index as again  # noqa: F401  (no warning)
    with pytest.raises(AttributeError):
        _ = retrieval.NoSuchName  # type: ignore[attr-defined]


def test_missing_faiss_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "faiss", None)
    with pytest.raises(MissingDependency, match=r"convo\[retrieval\]"):
        VectorIndex(8)


@pytest.fixture(scope="module")
def minilm():  # type: ignore[no-untyped-def]
    from convo.embeddings import Embedder

    return Embedder()


def test_minilm_embeds_offline_normalized(minilm) -> None:  # type: ignore[no-untyped-def]
    vecs = minilm.encode(["The cat sat on the mat.", "A feline rested on a rug.", "Tax forms are due."])
    assert vecs.shape == (3, 384) and vecs.dtype == np.float32
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    assert vecs[0] @ vecs[1] > vecs[0] @ vecs[2]
    assert minilm.encode([]).shape == (0, 384)


def test_minilm_one_query_matches_the_batched_vector(minilm) -> None:  # type: ignore[no-untyped-def]
    # A single text takes the short path (straight through the modules); it must give the
    # vector sentence-transformers' own encode gives, also past the 256-token truncation.
    # (In float32: bfloat16, the default on CPUs with native bf16, is checked apart.)
    texts = ["Where did Maria go camping last summer?", " ".join(["word"] * 600)]
    from sentence_transformers import SentenceTransformer

    from convo.embeddings import Embedder

    minilm = Embedder(precision="float32")
    model = SentenceTransformer(minilm.model_path, device="cpu", local_files_only=True)
    for text in texts:
        ours = minilm.encode([text])
        theirs = model.encode([text], normalize_embeddings=True, convert_to_numpy=True)
        assert ours.shape == (1, 384) and ours.dtype == np.float32
        assert np.allclose(ours, theirs, atol=1e-5)
    both = minilm.encode(texts)  # cached now; a batch of two still goes through encode
    assert np.allclose(both[0], minilm.encode(texts[:1])[0])


def test_minilm_memory_finds_paraphrase(minilm) -> None:  # type: ignore[no-untyped-def]
    memory = RetrievalMemory(minilm, config=RetrievalConfig(min_score=0.0))
    memory.remember_turns(
        "s", turns_of([("I adopted a golden retriever puppy last week.", "Congrats!"), *FILLER])
    )
    hits = memory.retrieve("Does she have a dog?", session_id="s", top_k=1)
    assert hits[0].key == turn_key(0, 0)


def test_embedder_rejects_nonsense() -> None:
    from convo.embeddings import Embedder

    with pytest.raises(ConfigError):
        Embedder(batch_size=0)
    assert os.environ.get("HF_HUB_OFFLINE") in (None, "1")  # we never switch it on globally


# ---------------------------------------------------------------------------------------
# Multi-hop recall: lines, speakers, second hop, episodes, diversity, packing
# ---------------------------------------------------------------------------------------


def _rank(hits: Sequence[object], key: str) -> int:
    keys = [p.key for p in hits]  # type: ignore[attr-defined]
    return keys.index(key) if key in keys else len(keys)


#: Scoring parts a test of another part keeps off, so it measures that part alone.
PINNED: dict[str, float] = {"episode_weight": 0.0, "content_weight": 0.0, "neighbour_weight": 0.0}


def test_second_hop_finds_evidence_only_reachable_through_the_first_hit() -> None:
    # The question names the trip; only the first hit names the friend; only the second
    # evidence line (about the friend) says what she does, with no word of the question.
    history = turns_of(
        [
            ("On the sailing trip I met Zelda.", "Nice!"),
            *FILLER,
            ("Zelda opened a bakery downtown.", "Cool."),
            *FILLER,
        ]
    )
    question = "Who did I meet on the sailing trip, and what does that person do?"
    second = turn_key(len(FILLER) + 1, 0)
    plain = RetrievalMemory(
        HashEncoder(),
        config=RetrievalConfig(min_score=0.0, speaker_boost=0.0, neighbours=False, second_hop=0.0, **PINNED),
    )
    plain.remember_turns("s", history)
    hop = RetrievalMemory(
        HashEncoder(),
        config=RetrievalConfig(min_score=0.0, speaker_boost=0.0, neighbours=False, second_hop=0.5, **PINNED),
    )
    hop.remember_turns("s", history)
    without = plain.retrieve(question, session_id="s", top_k=3)
    with_hop = hop.retrieve(question, session_id="s", top_k=3)
    assert without[0].key == with_hop[0].key == turn_key(0, 0)
    assert _rank(with_hop, second) == 1  # right after the hit it was found through
    assert _rank(without, second) > 3


def test_content_prior_lifts_messages_that_say_something() -> None:
    history = turns_of(
        [
            ("Garden, yes!", "Ha."),
            *FILLER,
            ("The garden now has tomatoes, basil, peppers, zucchini and beans by the fence.", "Wow."),
            *FILLER,
        ]
    )
    short, rich = turn_key(0, 0), turn_key(len(FILLER) + 1, 0)
    ranks = {}
    # (0.4: the rich line's first line is indexed with the previous turn's last line as
    # context, which dilutes its match to "the garden")
    for weight in (0.0, 0.4):
        cfg = RetrievalConfig(
            min_score=0.0, speaker_boost=0.0, second_hop=0.0, episode_weight=0.0, neighbour_weight=0.0
        )
        memory = RetrievalMemory(HashEncoder(), config=replace(cfg, content_weight=weight, content_terms=8))
        memory.remember_turns("s", history)
        hits = memory.retrieve("the garden", session_id="s", top_k=3)
        ranks[weight] = (_rank(hits, short), _rank(hits, rich))
    assert ranks[0.0][0] < ranks[0.0][1]  # alone, the short line matches better
    assert ranks[0.4][1] < ranks[0.4][0]  # the prior puts the news first
    with pytest.raises(ConfigError):
        RetrievalConfig(content_weight=-0.1)
    with pytest.raises(ConfigError):
        RetrievalConfig(content_terms=0)


def maria_and_john(first: tuple[str, str]) -> list[Turn]:
    """Turns of Maria (user) and John (assistant), each line prefixed with its speaker:
    ``first``, then the filler."""
    return [
        Turn(
            index=i,
            messages=(
                Message(role=Role.USER, content=f"Maria: {a}", name="Maria"),
                Message(role=Role.ASSISTANT, content=f"John: {b}", name="John"),
            ),
        )
        for i, (a, b) in enumerate([first, *FILLER])
    ]


def test_speaker_named_in_the_question_is_boosted() -> None:
    turns = maria_and_john(("I painted a sunset.", "I painted a red barn."))
    scores = {}
    for boost in (0.0, 0.25):
        config = RetrievalConfig(
            min_score=0.0, speaker_boost=boost, strip_names=False, second_hop=0.0, episode_weight=0.0
        )
        memory = RetrievalMemory(HashEncoder(), config=config)
        memory.remember_turns("s", turns)
        for q in ("What did John paint?", "What was painted?"):
            scores[boost, q] = {p.key: p.score for p in memory.retrieve(q, session_id="s", top_k=4)}
    for key, score in scores[0.0, "What did John paint?"].items():
        lift = 0.25 if key.endswith(":1") else 0.0  # John speaks second in every turn
        assert scores[0.25, "What did John paint?"][key] == pytest.approx(score + lift)
    assert scores[0.25, "What was painted?"] == pytest.approx(scores[0.0, "What was painted?"])


def test_strip_names_stops_greetings_matching_the_name() -> None:
    turns = maria_and_john(("Thanks John, bye John!", "I painted a red barn."))
    first, greeting = {}, {}
    for strip in (False, True):
        config = RetrievalConfig(
            min_score=0.0, speaker_boost=0.01, strip_names=strip, second_hop=0.0, neighbours=False
        )
        memory = RetrievalMemory(HashEncoder(), config=config)
        memory.remember_turns("s", turns)
        hits = memory.retrieve("What did John paint?", session_id="s", top_k=5)
        first[strip] = hits[0].key
        greeting[strip] = next(p.score for p in hits if p.key == turn_key(0, 0))
    assert first[True] == turn_key(0, 1)
    assert greeting[True] < greeting[False] / 2  # "John" alone no longer matches it


def test_episode_score_lifts_the_lines_of_a_matching_day() -> None:
    history = turns_of(
        [
            ("We hiked up the mountain trail.", "The mountain view was great."),
            ("Then a picnic by the trail.", "Great sandwiches."),
            ("The tax forms are due.", "Sandwiches, sandwiches!"),
        ]
    )
    dates = {0: "1 May", 1: "1 May", 2: "9 June"}
    question = "Which sandwiches on the mountain trail?"
    ranks = {}
    for weight in (0.0, 1.0):
        memory = RetrievalMemory(
            HashEncoder(),
            config=RetrievalConfig(
                min_score=0.0,
                speaker_boost=0.0,
                neighbours=False,
                neighbour_weight=0.0,
                episode_weight=weight,
            ),
        )
        memory.remember_turns("s", history, dates=dates)
        hits = memory.retrieve(question, session_id="s", top_k=6)
        ranks[weight] = (_rank(hits, turn_key(1, 1)), _rank(hits, turn_key(2, 1)))
    assert ranks[0.0][0] > ranks[0.0][1]  # alone, June's line says "sandwiches" twice
    assert ranks[1.0][0] < ranks[1.0][1]  # the hiking day lifts its own lunch line


def test_mmr_demotes_a_near_repeat() -> None:
    history = turns_of(
        [
            ("My cat Miso likes tuna.", "My cat Miso likes tuna a lot."),
            ("My cat Miso sleeps all day.", "OK."),
            *FILLER,
        ]
    )
    question = "What does my cat Miso like?"
    keys = {}
    for lam in (0.0, 0.8):
        memory = RetrievalMemory(
            HashEncoder(),
            config=RetrievalConfig(min_score=0.0, speaker_boost=0.0, neighbours=False, mmr_lambda=lam),
        )
        memory.remember_turns("s", history)
        keys[lam] = [p.key for p in memory.retrieve(question, session_id="s", top_k=3)[:2]]
    assert set(keys[0.0]) == {turn_key(0, 0), turn_key(0, 1)}  # the repeat is second
    assert turn_key(1, 0) in keys[0.8]  # diversity brings the other fact up


def test_expand_lines_offers_the_neighbours_right_after_the_hit() -> None:
    history = turns_of([*FILLER, ("Guess what I adopted yesterday?", "A kitten?"), *FILLER])
    i = len(FILLER)
    memory = RetrievalMemory(
        HashEncoder(),
        config=RetrievalConfig(min_score=0.0, speaker_boost=0.0, neighbours=False, expand_lines=1),
    )
    memory.remember_turns("s", history)
    hits = memory.retrieve("adopted yesterday", session_id="s", top_k=2)
    assert [p.key for p in hits[:3]] == [turn_key(i, 0), turn_key(i - 1, 1), turn_key(i, 1)]
    assert len({p.key for p in hits}) == len(hits)  # no line offered twice


def test_planner_packs_lines_of_one_date_under_one_header(cl100k: TiktokenCounter) -> None:
    memory = RetrievalMemory(HashEncoder(), config=RetrievalConfig(min_score=0.0))
    history = turns_of([("I bought a red kayak.", "Fun!"), ("The kayak is red and light.", "Nice."), *FILLER])
    memory.remember_turns("s", history, dates={0: "2 May 2023", 1: "2 May 2023"})
    question = Turn(index=len(history), messages=(Message(role=Role.USER, content="Which kayak did I buy?"),))
    budget = Budget(
        context_tokens=600, max_new_tokens=32, window_turns=2, retrieval_tokens=200, retrieval_top_k=4
    )
    passages = memory.retrieve("Which kayak did I buy?", session_id="s", top_k=4)
    plan = plan_prompt(budget=budget, counter=cl100k, turns=[*history, question], passages=passages)
    packed = [m.content for m in plan.messages if "2 May 2023" in m.content]
    assert len(packed) == 1 and packed[0].count("2 May 2023") == 1
    body = packed[0].split("\n")[1:]
    assert body.index("Ann: I bought a red kayak.") < body.index("Ann: The kayak is red and light.")
    retrieved = [m for m in plan.messages if m.content.startswith("Relevant memory")]
    assert plan.parts["retrieved"] == sum(cl100k.message_tokens(m) for m in retrieved) <= 200
    assert plan.prompt_tokens == cl100k.count_prompt(plan.messages)


def test_line_passage_of_a_turn_in_the_window_is_dropped() -> None:
    counter = TiktokenCounter("cl100k_base")
    memory = RetrievalMemory(HashEncoder(), config=RetrievalConfig(min_score=0.0, neighbours=False))
    history = turns_of([*FILLER, ("My passport number is X123.", "Saved.")])
    memory.remember_turns("s", history)
    question = Turn(index=len(history), messages=(Message(role=Role.USER, content="passport number?"),))
    budget = Budget(
        context_tokens=400, max_new_tokens=32, window_turns=2, retrieval_tokens=100, retrieval_top_k=3
    )
    passages = memory.retrieve("passport number?", session_id="s", top_k=3)
    assert passages[0].key == turn_key(len(FILLER), 0)
    plan = plan_prompt(budget=budget, counter=counter, turns=[*history, question], passages=passages)
    assert any(d.passage.key == passages[0].key and d.reason == "in_window" for d in plan.passages_dropped)
    assert sum("X123" in m.content for m in plan.messages) == 1


def test_new_retrieval_options_reject_nonsense() -> None:
    for bad in (
        {"turn_lines": "some"},
        {"second_hop": 1.5},
        {"hop_seeds": 0},
        {"speaker_boost": -1.0},
        {"mmr_lambda": -0.1},
        {"expand_lines": -1},
        {"episode_turns": 0},
        {"neighbour_weight": -0.5},
    ):
        with pytest.raises(ConfigError):
            RetrievalConfig(**bad)


def test_neighbour_share_finds_the_line_a_matching_reply_answers() -> None:
    # The photo line shares no word with the question; only the reply to it does.
    history = turns_of([*FILLER, ("Look at this!", "What a lovely sunset painting!"), *FILLER])
    photo, reply = turn_key(len(FILLER), 0), turn_key(len(FILLER), 1)
    ranks = {}
    for weight in (0.0, 0.5):
        config = RetrievalConfig(
            min_score=0.0,
            speaker_boost=0.0,
            neighbours=False,
            second_hop=0.0,
            neighbour_weight=weight,
            **PINNED_NB,
        )
        memory = RetrievalMemory(HashEncoder(), config=config)
        memory.remember_turns("s", history)
        hits = memory.retrieve("the sunset painting", session_id="s", top_k=4)
        assert _rank(hits, reply) == 0
        ranks[weight] = _rank(hits, photo)
    assert ranks[0.0] > 3  # alone it ranks with the filler
    assert ranks[0.5] == 1  # lifted right behind the reply that matches


#: PINNED without the neighbour share (for the test that sets it).
PINNED_NB = {k: v for k, v in PINNED.items() if k != "neighbour_weight"}


def test_neighbour_order_runs_across_turns() -> None:
    # A line gains a share of the better of the lines right before and after it, across
    # the boundary between turns too. No context line and no second hop, so only that
    # share and the content prior (the long last line has the most words) move scores.
    config = RetrievalConfig(min_score=0.0, neighbours=False, second_hop=0.0, episode_weight=0.0)
    memory = RetrievalMemory(HashEncoder(), config=config)
    pairs = [("alpha one", "bravo one"), ("charlie two", "delta two echo foxtrot golf")]
    memory.remember_turns("s", turns_of(pairs))

    def keys(query: str) -> list[str]:
        return [p.key for p in memory.retrieve(query, session_id="s", top_k=4)]

    # "bravo" (the last line of turn 0) lifts the next line, the first of turn 1, above
    # the long last line.
    assert keys("bravo") == [turn_key(0, 1), turn_key(0, 0), turn_key(1, 0), turn_key(1, 1)]
    # "charlie" (the first line of turn 1) lifts the previous line, the last of turn 0,
    # above the first line of turn 0.
    assert keys("charlie") == [turn_key(1, 0), turn_key(1, 1), turn_key(0, 1), turn_key(0, 0)]


def test_chat_indexing_one_turn_at_a_time_ranks_as_indexing_all_at_once() -> None:
    """A turn's first line is indexed with the previous turn's last line as context
    whether the two are indexed together or one at a time (a resumed session indexes its
    history at once, a chat a turn at a time), and what the ranking derives per unit
    (speakers, sizes, episodes, days, conversation order) is kept up to date a turn at a
    time: both rank as if built from scratch, also after a turn is forgotten and another
    indexed again."""
    pairs = [*FILLER, ("I adopted a cat named Miso.", "Lovely!"), ("Miso hid under the bed.", "Cats do.")]
    pairs += [(f"Day {i}: the garden again.", f"Bob: the roses, part {i}.") for i in range(12)]
    turns = turns_of(pairs)
    dates = {t.index: f"{1 + t.index // 3} May, 2023" for t in turns}
    queries = ["What did Ann say about Miso on 3 May, 2023?", "roses in the garden", "Bob weekend book"]

    def ranked(memory: RetrievalMemory) -> list[list[tuple[str, float]]]:
        return [
            [(p.key, round(p.score, 5)) for p in memory.retrieve(q, session_id="s", top_k=8)] for q in queries
        ]

    chat = RetrievalMemory(HashEncoder(), config=RetrievalConfig(min_score=0.0))
    for turn in turns:  # a question between turns, as in a chat: the derived state is read each time
        chat.remember_turns("s", [turn], dates={turn.index: dates[turn.index]})
        chat.retrieve("cat", session_id="s", top_k=3)
    batch = RetrievalMemory(HashEncoder(), config=RetrievalConfig(min_score=0.0))
    batch.remember_turns("s", turns, dates=dates)
    assert ranked(chat) == ranked(batch)

    # A forgotten turn and one indexed again (its record replaced): rebuilt from scratch.
    for memory in (chat, batch):
        memory.forget_turns("s", [5])
        memory.remember_turns("s", [turns[6]], dates={6: dates[6]})
    fresh = RetrievalMemory(HashEncoder(), config=RetrievalConfig(min_score=0.0))
    fresh.remember_turns("s", [t for t in turns if t.index != 5], dates=dates)
    assert ranked(chat) == ranked(fresh) == ranked(batch)


def test_propagate_lifts_neighbours_of_the_best_candidates_only() -> None:
    from convo.retrieval.ranking import propagate

    seq = np.arange(6)
    order = np.stack([np.concatenate([[-1], seq[:-1]]), np.concatenate([seq[1:], [-1]])])
    out = propagate(order, {1: 1.0, 4: 0.2}, 0.5, 1)
    floor = 0.2
    assert out[1] == pytest.approx(1.0)  # its neighbours score the floor: no gain
    assert out[0] == out[2] == pytest.approx(floor + 0.5 * (1.0 - floor))  # new candidates
    assert out[4] == pytest.approx(floor)
    assert 3 not in out and 5 not in out  # neighbours of a candidate outside the best `grow`
    assert set(propagate(order, {1: 1.0, 4: 0.2}, 0.5, 2)) == set(range(6))
    assert propagate(order, {}, 0.5, 4) == {}
    assert propagate(order, {99: 0.3}, 0.5, 4) == {99: 0.3}  # a unit it does not know keeps its score


def test_top_matches_a_full_sort_with_ties_by_key() -> None:
    from convo.retrieval.ranking import top_keys

    rng = np.random.default_rng(0)
    for _ in range(50):
        keys = rng.permutation(200)[: int(rng.integers(1, 60))].tolist()
        score = {k: float(rng.integers(0, 5)) for k in keys}  # many ties
        k = int(rng.integers(0, 70))
        assert top_keys(score, k) == sorted(score, key=lambda u: (-score[u], u))[:k]


def test_vector_index_hands_back_vectors_after_ivf_save_load(tmp_path: Path) -> None:
    vecs = unit_vectors(120, 8, seed=3)
    index = VectorIndex(8, exact_max=50)
    index.add(list(range(120)), vecs)
    assert index.kind == "ivf"
    index.remove([5])
    index.save(tmp_path / "v.faiss")
    loaded = VectorIndex.load(tmp_path / "v.faiss")
    assert np.allclose(loaded.vectors([0, 119, 7]), vecs[[0, 119, 7]])
    with pytest.raises(KeyError):
        loaded.vectors([5])


def _day_lines(n: int, *, first_turn: int = 0) -> list[Passage]:
    """``n`` one-line passages of two days, best first, as RetrievalMemory offers them."""
    return [
        Passage(
            text=f"Ann: On day {i} I noted fact number {i} about the garden.",
            score=1.0 - i / (2 * n),
            source=f"turn {first_turn + i}",
            key=turn_key(first_turn + i, 0),
            meta={"group": "2 May 2023" if i % 2 else "9 May 2023", "turn": first_turn + i, "line": 0},
        )
        for i in range(n)
    ]


def test_planner_fills_the_retrieval_room_exactly(cl100k: TiktokenCounter) -> None:
    """Lines counted apart overstate the joined memory message (".\\n" is one token): the
    planner counts it exactly before refusing a line, so no refused line would have fit."""
    passages = _day_lines(60)
    turns = [Turn(index=100, messages=(Message(role=Role.USER, content="What did I note?"),))]
    budget = Budget(context_tokens=1024, max_new_tokens=32, retrieval_tokens=400, retrieval_top_k=60)
    plan = plan_prompt(budget=budget, counter=cl100k, turns=turns, passages=passages)
    assert plan.prompt_tokens == cl100k.count_prompt(plan.messages)
    assert plan.total_tokens <= budget.context_tokens
    assert plan.parts["retrieved"] <= 400
    refused = [d.passage for d in plan.passages_dropped if d.reason == "token_cap"]
    assert refused, "the room must bind for this test to mean anything"
    for p in refused:
        grown = passage_messages([*plan.passages_used, p])
        assert sum(cl100k.message_tokens(m) for m in grown) > 400
    # Adding up the pieces' own counts would have stopped short of that.
    opened: set[str] = set()
    pieces = cl100k.message_tokens(Message(role=Role.SYSTEM, content=MEMORY_HEADER))
    for p in plan.passages_used:
        group = str(p.meta["group"])
        label = "" if group in opened else GROUP_LABEL.format(group=group) + "\n"
        opened.add(group)
        pieces += cl100k.count_text("\n" + label + p.text)
    assert pieces > 400


def test_room_the_whole_recent_turns_leave_goes_to_retrieval(cl100k: TiktokenCounter) -> None:
    """The recent turns keep their guaranteed share (the same turns are shown); what they
    cannot use, a turn being shown whole or not at all, goes to retrieved passages."""
    long = "I talked about the garden, the weather and the shed for quite a while today. " * 3
    history = [
        Turn(
            index=i,
            messages=(
                Message(role=Role.USER, content=f"Ann: {long}{i}", name="Ann"),
                Message(role=Role.ASSISTANT, content=f"Bob: {long}{i}", name="Bob"),
            ),
        )
        for i in range(6)
    ]
    question = Turn(index=6, messages=(Message(role=Role.USER, content="What did I note?"),))
    turns = [*history, question]
    budget = Budget(  # a turn costs 122 tokens: two and the question fit in 330, not three
        context_tokens=1024,
        max_new_tokens=32,
        window_turns=7,
        retrieval_tokens=1024,
        retrieval_top_k=60,
        recent_min_tokens=330,
    )
    alone = plan_prompt(budget=budget, counter=cl100k, turns=turns)
    plan = plan_prompt(budget=budget, counter=cl100k, turns=turns, passages=_day_lines(60, first_turn=200))
    avail = budget.available_prompt_tokens - cl100k.overhead_tokens(True)
    first_share = avail - budget.recent_min
    assert plan.parts["recent"] < budget.recent_min  # whole turns do not fill their share
    assert plan.parts["retrieved"] > first_share  # ... and retrieval gets the rest
    assert plan.turns_shown == tuple(t for t in alone.turns_shown if t >= plan.turns_shown[0])
    assert plan.parts["recent"] + plan.parts["retrieved"] <= avail
    assert plan.prompt_tokens == cl100k.count_prompt(plan.messages)
    assert plan.total_tokens <= budget.context_tokens


def _cosine_of(found: Sequence[Passage], line: str) -> float:
    return float(next(p.meta["cosine"] for p in found if p.text == line))


def _unit(own: np.ndarray, context: np.ndarray | None, weight: float) -> np.ndarray:
    v = own + weight * context if context is not None else own
    return v / np.linalg.norm(v)


def test_a_long_previous_message_does_not_crowd_out_the_message_in_its_vector() -> None:
    # Issue 24: each message was embedded as "previous message + message"; a long previous
    # message filled MiniLM's 256 word pieces and none of the message's own text was read.
    # Now every line is embedded alone (its head), and the context is added as a vector.
    enc = RecordingEncoder()
    cfg = RetrievalConfig(expand_terms=0, expand_query_words=0, min_score=0.0, embed_alone=True)
    mem = RetrievalMemory(enc, config=cfg)
    long_reply = "word " * 2000
    turns = [
        Turn(
            index=0,
            messages=(
                Message(role=Role.USER, content="hi"),
                Message(role=Role.ASSISTANT, content=long_reply),
            ),
        ),
        Turn(index=1, messages=(Message(role=Role.USER, content="My dog is called Biscuit."),)),
    ]
    mem.remember_turns("s", turns, dates={0: "2023/05/01 (Mon) 10:00", 1: "2023/05/01 (Mon) 10:05"})
    assert "user: My dog is called Biscuit." in enc.seen  # its own text, alone
    assert max(map(len, enc.seen)) <= cfg.embed_chars  # the long reply: its head only
    query = "What is my dog called?"
    found = mem.retrieve(query, session_id="s", top_k=3)
    own, ctx = enc.encode(["user: My dog is called Biscuit.", next(t for t in enc.seen if "word" in t)])
    expected = float(_unit(own, ctx, cfg.context_weight) @ enc.encode([query])[0])
    assert _cosine_of(found, "user: My dog is called Biscuit.") == pytest.approx(expected, abs=1e-4)


def test_a_new_session_is_not_embedded_with_the_last_reply_of_an_earlier_one() -> None:
    enc = RecordingEncoder()
    cfg = RetrievalConfig(expand_terms=0, expand_query_words=0, min_score=0.0, embed_alone=True)
    mem = RetrievalMemory(enc, config=cfg)
    first = Turn(index=0, messages=(Message(role=Role.ASSISTANT, content="Anything else about your trip?"),))
    mem.remember_turns("s", [first], dates={0: "2023/05/01 (Mon) 10:00"})
    later = Turn(index=1, messages=(Message(role=Role.ASSISTANT, content="Welcome back! Your new job?"),))
    mem.remember_turns("s", [later], dates={1: "2023/06/01 (Thu) 09:00"})
    query = "Anything else about your new job?"
    q = enc.encode([query])[0]
    own = enc.encode(["assistant: Welcome back! Your new job?"])[0]
    found = mem.retrieve(query, session_id="s", top_k=3)
    welcome = "assistant: Welcome back! Your new job?"
    assert _cosine_of(found, welcome) == pytest.approx(float(own @ q), abs=1e-4)
    # Within one call too; the same day still reads its context.
    mem2 = RetrievalMemory(enc, config=cfg)
    same = Turn(index=2, messages=(Message(role=Role.USER, content="Yes, it starts Monday."),))
    mem2.remember_turns("s", [first, later, same], dates={0: "2023/05/01", 1: "2023/06/01", 2: "2023/06/01"})
    found = mem2.retrieve(query, session_id="s", top_k=3, today="2023/06/02")
    welcome = "assistant: Welcome back! Your new job?"
    assert _cosine_of(found, welcome) == pytest.approx(float(own @ q), abs=1e-4)
    reply = enc.encode(["user: Yes, it starts Monday."])[0]
    with_context = float(_unit(reply, own, cfg.context_weight) @ q)
    assert _cosine_of(found, "user: Yes, it starts Monday.") == pytest.approx(with_context, abs=1e-4)
    assert any("2023/06/01" in str(p.meta.get("date")) for p in found)


def test_embedder_encodes_short_texts_in_bigger_batches_in_order() -> None:
    # A vocabulary of thousands of words is embedded in one call; short texts go
    # SHORT_BATCH_FACTOR times as many per forward pass, and rows keep the input order.
    from convo import embeddings

    class FakeModel:
        def __init__(self) -> None:
            self.batches: list[tuple[int, int]] = []

        def encode(self, texts: list[str], *, batch_size: int, **_: object) -> np.ndarray:
            self.batches.append((len(texts), batch_size))
            return HashEncoder(8).encode(texts)

    emb = embeddings.Embedder(batch_size=4, cache_size=0, word_cache=False)  # words reach the model
    fake = FakeModel()
    emb._model, emb._dim = fake, 8
    long = "a sentence well over forty characters long, number "
    texts = ["cat", long + "one", "dog", long + "two", "fish"]
    out = emb.encode(texts)
    assert np.allclose(out, HashEncoder(8).encode(texts))
    assert sorted(fake.batches) == [(2, 4), (3, 4 * embeddings.SHORT_BATCH_FACTOR)]


def test_recency_weight_prefers_the_newest_of_changed_facts() -> None:
    # Knowledge updates (issue 24): the same fact told twice, the newest should win.
    turns = [
        Turn(index=0, messages=(Message(role=Role.USER, content="My car is a red Honda, sadly old."),)),
        Turn(index=1, messages=(Message(role=Role.USER, content="I bake bread on Sundays."),)),
        Turn(index=2, messages=(Message(role=Role.USER, content="My car is a blue Honda, brand new."),)),
    ]
    dates = {0: "2023/01/02 (Mon) 10:00", 1: "2023/02/01 (Wed) 10:00", 2: "2023/03/01 (Wed) 10:00"}

    def ranked(weight: float) -> list[Passage]:
        mem = RetrievalMemory(HashEncoder(), config=RetrievalConfig(recency_weight=weight, min_score=-1.0))
        mem.remember_turns("s", turns, dates=dates)
        return [
            p
            for p in mem.retrieve("What car do I have, a Honda?", session_id="s", top_k=3)
            if "Honda" in p.text
        ]

    off, on = ranked(0.0), ranked(0.5)
    gap = {k: {p.meta["turn"]: p.score for p in r} for k, r in (("off", off), ("on", on))}
    assert gap["on"][2] - gap["on"][0] > gap["off"][2] - gap["off"][0] + 0.3
    assert on[0].meta["turn"] == 2 and "2023/03/01" in str(on[0].meta.get("group", on[0].text))
    with pytest.raises(ConfigError):
        RetrievalConfig(recency_weight=-1.0)


def test_budget_defaults_give_memory_the_room_the_recent_turns_leave(cl100k: TiktokenCounter) -> None:
    """Issue 24: the defaults capped memory at 384 tokens and 6 passages, half the evidence
    of LongMemEval's questions. Now retrieval takes what the recent turns' guaranteed share
    leaves, and the recent turns keep that share."""
    budget = Budget()
    assert budget.retrieval_tokens is None and budget.retrieval_cap == budget.available_prompt_tokens
    assert Budget(retrieval_tokens=100).retrieval_cap == 100
    assert Budget.from_dict(budget.to_dict()) == budget
    long = "I talked about the garden, the weather and the shed for quite a while today. " * 3
    history = [
        Turn(
            index=i,
            messages=(
                Message(role=Role.USER, content=f"{i}: {long}"),
                Message(role=Role.ASSISTANT, content="ok"),
            ),
        )
        for i in range(7)  # with the question: window_turns (8)
    ]
    turns = [*history, Turn(index=7, messages=(Message(role=Role.USER, content="What did I note?"),))]
    plan = plan_prompt(budget=budget, counter=cl100k, turns=turns, passages=_day_lines(60, first_turn=1000))
    assert plan.parts["retrieved"] > 384
    assert len(plan.passages_used) > 6
    history_tokens = sum(cl100k.message_tokens(m) for t in turns for m in t.messages)
    assert plan.parts["recent"] >= 0.9 * min(budget.recent_min, history_tokens)
    assert plan.total_tokens <= budget.context_tokens


def test_a_long_question_is_embedded_as_its_head_and_tail_and_searched_by_all_its_words() -> None:
    # Issue 24: the query's embedding is most of retrieval's cost and grows with its length.
    assert query_text("short question?", 600) == "short question?"
    long = " ".join(f"w{i}" for i in range(400)) + " where is Biscuit?"
    cut = query_text(long, 600)
    assert len(cut) <= 600 + 5 and cut.startswith("w0 w1 ") and cut.endswith(" where is Biscuit?")
    enc = RecordingEncoder()
    cfg = RetrievalConfig(expand_terms=0, expand_query_words=0, min_score=0.0)
    mem = RetrievalMemory(enc, config=cfg)
    turns = [Turn(index=0, messages=(Message(role=Role.USER, content="My dog Biscuit sleeps under w399."),))]
    mem.remember_turns("s", turns)
    enc.seen.clear()
    found = mem.retrieve(long, session_id="s", top_k=3)
    assert enc.seen and max(map(len, enc.seen)) <= 605  # the dense query: head and tail
    assert any("Biscuit" in p.text for p in found)
    with pytest.raises(ConfigError, match="query_chars"):
        RetrievalConfig(query_chars=0)
