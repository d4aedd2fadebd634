"""The array ranking (convo.retrieval.turn_ranking) retrieves exactly what the dictionary
ranking it replaced did (issue 24: the search at 10,000 turns went from ~12 ms to ~5 ms).

``reference_rank_units`` below is the previous ``RetrievalMemory._search_turns`` scoring,
stage by stage, on ``{unit id: score}`` dictionaries with the pure functions of
:mod:`convo.retrieval.ranking`. Each test retrieves from one fixed corpus twice, through
the library and with the reference swapped in, and compares the passages whole (text,
key, score to the last bit, metadata)."""

from __future__ import annotations

import random
from collections.abc import Callable, Collection
from datetime import date

import numpy as np
import pytest
from conftest import HashEncoder

import convo.retrieval.memory as memory_module
from convo.messages import Message, Role
from convo.plan import Passage, Turn
from convo.retrieval import RetrievalConfig, RetrievalMemory
from convo.retrieval.config import Fusion
from convo.retrieval.features import UnitFeatures
from convo.retrieval.indexes.bm25 import terms
from convo.retrieval.ranking import fuse, hop_seeds, propagate, role_boosted, speaker_boosted, time_scored
from convo.retrieval.turn_ranking import RankedUnits, UnitScores
from convo.retrieval.units import UnitStore

WORDS = (
    "painting camping guitar marathon pottery adoption concert garden puppy recipe startup "
    "hiking museum library beach sister bakery violin novel tomato kayak chess yoga"
).split()
FILLER = "we it was really nice and then later on the new old big small first".split()
#: Replies said more than once (exact ties in the scores).
REPEATED = ("Sounds good!", "Thanks, that helps.")


def corpus(named: bool, turns: int = 90, seed: int = 7) -> tuple[list[Turn], dict[int, str]]:
    """``turns`` dated turns of two messages, a few topic words in each, some replies
    repeated word for word; named speakers (Ann, Bob) or a user and an assistant."""
    rng = random.Random(seed)
    out, dates = [], {}
    for i in range(turns):
        msgs = []
        for role, name in ((Role.USER, "Ann"), (Role.ASSISTANT, "Bob")):
            if role is Role.ASSISTANT and rng.random() < 0.15:
                text = rng.choice(REPEATED)
            else:
                words = rng.sample(WORDS, 2) + rng.sample(FILLER, rng.randint(3, 8))
                rng.shuffle(words)
                text = " ".join(words).capitalize() + "."
            msgs.append(Message(role=role, content=text, name=name if named else None))
        out.append(Turn(index=i, messages=tuple(msgs)))
        dates[i] = f"{1 + (i // 4) % 28} {('May', 'June', 'July')[i // 40]} 2023"
    return out, dates


QUESTIONS = (
    ("What did Ann say about the guitar and the concert?", None),
    ("When did Bob go kayak on the beach?", "2023-06-20"),
    ("What did you recommend for the tomato garden in May 2023?", None),
    ("Remind me of the novel we talked about last week", "2023-06-12"),
    ("Which recipe did I try at the bakery on 3 June 2023?", None),
    ("sounds good thanks", None),
)

CONFIGS = (
    {},
    {"fusion": "rrf"},
    {"fusion": "dense"},
    {"fusion": "lexical"},
    {"turn_lines": "best"},
    {"recency_weight": 0.2, "embed_alone": True},
    {"mmr_lambda": 0.3, "expand_lines": 1},
    {"second_hop": 0.0},
    {"unit_candidates": 8, "neighbour_weight": 1.0},
)


def reference_rank_units(
    store: UnitStore,
    features: UnitFeatures,
    qvec: np.ndarray,
    query: str,
    n: int,
    named: Collection[str],
    config: RetrievalConfig,
    *,
    asked: str = "",
    today: date | None = None,
    expansion: Callable[[str, np.ndarray], list[str]] | None = None,
) -> RankedUnits | None:
    """The dictionary ranking ``RetrievalMemory._search_turns`` ran before the arrays."""
    cfg = config
    k = max(cfg.unit_candidates, 4 * n)
    speakers = features.speaker
    named = set(named)
    fused, dense, lexical = store.unit_scores(qvec, query, k, cfg)
    if not fused:
        return None
    if cfg.second_hop > 0 and store.vectors is not None:
        boosted = speaker_boosted(fused, speakers, named, cfg.speaker_boost)
        if cfg.role_weight > 0:
            boosted = role_boosted(boosted, speakers, asked or query, cfg.role_weight)
        ranking = sorted(boosted, key=lambda u: (-boosted[u], u))
        seeds = hop_seeds(fused, ranking, features.episode_of, cfg)
        q2 = qvec + store.vectors.vectors(seeds).mean(axis=0)
        q2 = (q2 / (np.linalg.norm(q2) or 1.0)).astype(np.float32)
        extra = store.lexical.rare_terms(
            (store.unit_lex[u] for u in seeds), cfg.hop_terms, exclude=terms(query)
        )
        if expansion is not None and (cfg.expand_terms > 0 or cfg.expand_query_words > 0):
            extra += [t for t in expansion(query, qvec) if t not in extra]
        lexical2 = dict(store.lexical.search(query, k, extra)) if cfg.fusion is not Fusion.DENSE else {}
        dense2: dict[int, float] = {}
        if cfg.fusion is not Fusion.LEXICAL:
            cand = list(fused.keys() | lexical2.keys())
            dense2 = dict(zip(cand, (store.vectors.vectors(cand) @ q2).tolist(), strict=True))
        fused2 = fuse(dense2, lexical2, cfg)
        floor1, floor2 = min(fused.values()), min(fused2.values(), default=0.0)
        h = cfg.second_hop
        fused = {
            u: (1 - h) * fused.get(u, floor1) + h * fused2.get(u, floor2)
            for u in fused.keys() | fused2.keys()
        }
    if cfg.episode_weight > 0 and store.vectors is not None:
        ep_score = dict(zip(features.episode_keys, (features.centroids @ qvec).tolist(), strict=True))
        for u in fused:
            fused[u] += cfg.episode_weight * ep_score[features.episode_of[u]]
    if cfg.time_weight > 0:
        years = tuple(sorted(features.years))
        fused = time_scored(fused, features.days, years, asked or query, today, cfg)
    if cfg.recency_weight > 0:
        days = features.days
        known = days[days >= 0]
        lo, span = int(known.min()), max(int(known.max() - known.min()), 1)
        for u in fused:
            d = int(days[u])
            if d >= 0:
                fused[u] += cfg.recency_weight * (d - lo) / span
    if cfg.neighbour_weight > 0:
        fused = propagate(features.order, fused, cfg.neighbour_weight, 2 * max(n, 1))
    if cfg.content_weight > 0:
        full = float(cfg.content_terms)
        for u in fused:
            fused[u] += cfg.content_weight * min(features.size.get(u, 0) / full, 1.0)
    if named:
        fused = speaker_boosted(fused, speakers, named, cfg.speaker_boost)
    if cfg.role_weight > 0:
        fused = role_boosted(fused, speakers, asked or query, cfg.role_weight)
    scores = UnitScores.empty(len(features.days))
    ids = list(fused)
    scores.value[ids] = list(fused.values())
    scores.has[ids] = True
    return RankedUnits(scores=scores, dense=dense, lexical=lexical)


def answers(config: RetrievalConfig, named: bool) -> list[list[Passage]]:
    """Every question's passages at two ``top_k``, then again as in a chat (one more turn
    before each question) and after some turns are forgotten."""
    turns, dates = corpus(named)
    memory = RetrievalMemory(HashEncoder(64), config=config)
    memory.remember_turns("s", turns[:80], dates={t.index: dates[t.index] for t in turns[:80]})
    out = []
    for top_k in (4, 40):
        out += [memory.retrieve(q, session_id="s", top_k=top_k, today=today) for q, today in QUESTIONS]
    for turn, (q, today) in zip(turns[80:], QUESTIONS, strict=False):
        memory.remember_turns("s", [turn], dates={turn.index: dates[turn.index]})
        out.append(memory.retrieve(q, session_id="s", top_k=10, today=today))
    memory.forget_turns("s", [0, 1, 2, 41])
    out += [memory.retrieve(q, session_id="s", top_k=10, today=today) for q, today in QUESTIONS]
    return out


@pytest.mark.parametrize("named", [True, False], ids=["named", "user-assistant"])
@pytest.mark.parametrize(
    "overrides", CONFIGS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "defaults"
)
def test_array_ranking_retrieves_what_the_dict_ranking_did(
    monkeypatch: pytest.MonkeyPatch, overrides: dict, named: bool
) -> None:
    config = RetrievalConfig(min_score=0.0, **overrides)
    fast = answers(config, named)
    monkeypatch.setattr(memory_module, "rank_units", reference_rank_units)
    slow = answers(config, named)
    assert sum(len(a) for a in fast) > 100  # the questions find something
    for i, (a, b) in enumerate(zip(fast, slow, strict=True)):
        assert [p.key for p in a] == [p.key for p in b], f"answer {i}: another ranking"
        assert a == b, f"answer {i}: the same ranking with other scores or metadata"


#: The first keys retrieved for three questions with the defaults, by the dictionary
#: ranking (commit 68a0877) on ``corpus(named=True)``'s first 80 turns, ``top_k=6``.
RECORDED = {
    "What did Ann say about the guitar and the concert?": [
        "turn:39:0",
        "turn:49:0",
        "turn:8:0",
        "turn:31:0",
        "turn:38:0",
        "turn:20:0",
        "turn:15:0",
        "turn:43:0",
    ],
    "When did Bob go kayak on the beach?": [
        "turn:17:1",
        "turn:60:1",
        "turn:8:1",
        "turn:46:1",
        "turn:61:1",
        "turn:42:1",
        "turn:66:1",
        "turn:55:1",
    ],
    "What did you recommend for the tomato garden in May 2023?": [
        "turn:19:1",
        "turn:19:0",
        "turn:9:0",
        "turn:9:1",
        "turn:8:1",
        "turn:11:0",
        "turn:10:0",
        "turn:10:1",
    ],
}


@pytest.mark.parametrize("question", sorted(RECORDED))
def test_default_ranking_is_the_one_recorded_before_the_arrays(question: str) -> None:
    turns, dates = corpus(named=True)
    # the defaults of the recorded ranking (the neighbour share was 0.5 then)
    memory = RetrievalMemory(HashEncoder(64), config=RetrievalConfig(min_score=0.0, neighbour_weight=0.5))
    memory.remember_turns("s", turns[:80], dates={t.index: dates[t.index] for t in turns[:80]})
    today = dict(QUESTIONS)[question]
    keys = [p.key for p in memory.retrieve(question, session_id="s", top_k=6, today=today)]
    assert keys[: len(RECORDED[question])] == RECORDED[question]
