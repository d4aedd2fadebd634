"""The ranking stages of a retrieval: pure functions of unit scores.

A unit is one indexed piece (a message of a turn, a chunk of a document), named by its
int id; a stage takes ``{unit id: score}`` and returns new scores or an order:

- :func:`fuse`: one score per unit from its cosine and its BM25 score;
- :func:`hop_seeds`: the first hits a second query is built from;
- :func:`time_scored`: messages of the days a question names gain;
- :func:`propagate`: a share of the better neighbour's score;
- :func:`speaker_boosted`: messages of a speaker the question names gain;
- :func:`asked_role`, :func:`role_boosted`: in a user-assistant chat, the messages of the
  side the question asks about gain;
- :func:`top_keys`, :func:`mmr`: the best units, plainly or with diversity.

:class:`~convo.retrieval.RetrievalMemory` chains them (see
:class:`~convo.retrieval.RetrievalConfig` for what each weight does).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import date

import numpy as np

from convo.dates import DaySpan, time_spans
from convo.retrieval.config import Fusion, RetrievalConfig
from convo.retrieval.indexes.bm25 import WORD, terms


def fuse(
    dense: Mapping[int, float], lexical: Mapping[int, float], config: RetrievalConfig
) -> dict[int, float]:
    """One score per unit from its cosine and its BM25 score (see :class:`Fusion`)."""
    fused: dict[int, float] = {}
    if config.fusion is Fusion.RRF:
        scale = (config.rrf_k + 1) / 2
        for ranking in (dense, lexical):
            ordered = sorted(ranking, key=lambda u, r=ranking: -r[u])  # type: ignore[misc]
            for rank, uid in enumerate(ordered):
                fused[uid] = fused.get(uid, 0.0) + scale / (config.rrf_k + rank + 1)
    else:
        w = {Fusion.DENSE: 1.0, Fusion.LEXICAL: 0.0}.get(config.fusion, config.dense_weight)
        floor = min(dense.values()) if dense else 0.0
        for uid in dense.keys() | lexical.keys():
            lex = lexical.get(uid, 0.0)
            fused[uid] = w * dense.get(uid, floor) + (1.0 - w) * lex / (lex + config.bm25_half)
    return fused


def mmr(
    ranked: Sequence[int], score: Mapping[int, float], vecs: np.ndarray, lam: float
) -> tuple[list[int], dict[int, float]]:
    """Greedy maximal-marginal-relevance order of ``ranked`` (best first), and new scores.

    Each step takes the candidate with the highest ``score - lam * max cosine`` to those
    already taken; its new score is that value, capped by the previous one so the scores
    stay in the new order (callers sort by score).
    """
    left = list(range(len(ranked)))
    base = np.asarray([score[u] for u in ranked], dtype=np.float64)
    sims = vecs @ vecs.T
    worst = np.full(len(ranked), -np.inf)
    out: list[int] = []
    new: dict[int, float] = {}
    last = np.inf
    while left:
        cur = base[left] - lam * np.maximum(worst[left], 0.0)
        pick = int(np.argmax(cur))
        j = left[pick]
        last = min(last, float(cur[pick]))
        out.append(ranked[j])
        new[ranked[j]] = last
        left.remove(j)
        worst = np.maximum(worst, sims[j])
    return out, new


def propagate(order: np.ndarray, fused: Mapping[int, float], weight: float, grow: int) -> dict[int, float]:
    """``own + weight * (better neighbour - floor)`` for every candidate.

    ``order`` is ``(2, n)``: the previous and next unit of each unit id (``-1``: none).
    The floor is the lowest fused score; a unit not in ``fused`` scores the floor. The
    neighbours of the best ``grow`` candidates join the candidates (the others' neighbours
    could not climb into the ranking anyway), so a line with no word of the query is
    found through its reply.
    """
    if not fused:
        return {}
    ids = np.fromiter(fused.keys(), dtype=np.int64, count=len(fused))
    vals = np.fromiter(fused.values(), dtype=np.float64, count=len(fused))
    floor = float(vals.min())
    n = order.shape[1]
    inside = (ids >= 0) & (ids < n)
    ids, vals = ids[inside], vals[inside]
    score = np.full(n + 1, floor)  # the last slot stands for "no neighbour"
    score[ids] = vals
    top = ids[np.argpartition(-vals, grow - 1)[:grow]] if 0 < grow < len(ids) else ids
    near = order[:, top]
    cand = np.unique(np.concatenate([ids, near[near >= 0]]))
    nb = order[:, cand]
    nb = np.where(nb >= 0, nb, n)
    best = np.maximum(score[nb[0]], score[nb[1]])
    out = dict(fused)  # a unit the order does not know keeps its score
    out.update(zip(cand.tolist(), (score[cand] + weight * (best - floor)).tolist(), strict=True))
    return out


def top_keys(score: Mapping[int, float], k: int) -> list[int]:
    """The ``k`` best keys of ``score``, best first (ties: the smaller key first)."""
    if k <= 0 or not score:
        return []
    ids = np.fromiter(score.keys(), dtype=np.int64, count=len(score))
    vals = np.fromiter(score.values(), dtype=np.float64, count=len(score))
    return top_of(ids, vals, k)


def top_of(ids: np.ndarray, vals: np.ndarray, k: int) -> list[int]:
    """:func:`top_keys` of the scores ``vals`` of ``ids`` (two arrays of one length)."""
    if k <= 0 or not len(ids):
        return []
    if k < len(ids):
        # Everything tied with the k-th best stays in, so ties break by key as in a full sort.
        kth = np.partition(-vals, k - 1)[k - 1]
        keep = -vals <= kth
        ids, vals = ids[keep], vals[keep]
    order = np.lexsort((ids, -vals))[:k]
    return ids[order].tolist()


def strip_names(query: str, names: Iterable[str]) -> str:
    """``query`` without the words of ``names`` (and a possessive ``'s`` after them)."""
    words = {w for name in names for w in WORD.findall(name.lower())}
    if not words:
        return query
    pattern = r"\b(?:" + "|".join(re.escape(w) for w in sorted(words)) + r")(?:'s|’s)?\b"
    stripped = re.sub(pattern, "", query, flags=re.IGNORECASE)
    stripped = re.sub(r"\s+", " ", stripped).strip()
    return stripped if terms(stripped) else query


def speaker_boosted(
    fused: Mapping[int, float], speaker: Mapping[int, str], named: set[str], boost: float
) -> dict[int, float]:
    """``fused`` with ``boost`` added to the units whose speaker is in ``named``."""
    return {u: sc + (boost if named and speaker.get(u) in named else 0.0) for u, sc in fused.items()}


#: How a question asks what the assistant itself said earlier ("you mentioned", "did you
#: recommend", "our previous conversation"): then the assistant's messages hold the answer.
ASKS_ASSISTANT = re.compile(
    r"\byou\s+(?:\w+ly\s+)?(?:said|told|mentioned|suggested|recommended|gave|provided|listed|shared|"
    r"wrote|created|described|explained|named|offered|proposed|came up)\b"
    r"|\b(?:did|do|would|could) you (?:say|tell|mention|suggest|recommend|give|provide|list|share)\b"
    r"|\bour (?:previous|last|earlier|past|recent) (?:conversation|chat|discussion|session|talk)",
    re.IGNORECASE,
)
#: How a question asks to recall something without saying who said it ("remind me of
#: that restaurant", "I'm trying to recall"): either side may hold the answer.
ASKS_EITHER = re.compile(r"\bremind me\b|\brecall\b|\bwe (?:talked|discussed|spoke)\b", re.IGNORECASE)
#: The speaker of a message without a name, by side (``Role.value``).
USER, ASSISTANT = "user", "assistant"


def asked_role(query: str) -> str | None:
    """Whose messages answer ``query`` in a chat between a person and an assistant:
    ``"assistant"`` when it asks what the assistant said earlier (:data:`ASKS_ASSISTANT`);
    ``None`` when it asks to recall something without saying whose (:data:`ASKS_EITHER`);
    else ``"user"`` (a person's facts, plans and tastes are in what they said)."""
    if ASKS_ASSISTANT.search(query):
        return ASSISTANT
    return None if ASKS_EITHER.search(query) else USER


def role_boosted(
    fused: Mapping[int, float], speaker: Mapping[int, str], query: str, weight: float
) -> dict[int, float]:
    """``fused`` with ``weight`` added to the units said by :func:`asked_role` of ``query``.

    Only unnamed messages have a role for a speaker (``"user"``, ``"assistant"``); in a
    conversation between named people nothing changes."""
    side = asked_role(query)
    if weight <= 0 or side is None:
        return dict(fused)
    return {u: sc + (weight if speaker.get(u) == side else 0.0) for u, sc in fused.items()}


def hop_seeds(
    fused: Mapping[int, float], ranking: Sequence[int], episode_of: Mapping[int, str], config: RetrievalConfig
) -> list[int]:
    """The first hits the second query is built from: the best of ``ranking`` (best
    first), not the also-rans (half the best score at least), one per episode
    (``episode_of``: each unit's episode key) with ``config.hop_distinct_days``; at most
    ``config.hop_seeds``."""
    good = [u for u in ranking[: 4 * config.hop_seeds] if fused[u] >= 0.5 * fused[ranking[0]]]
    if not config.hop_distinct_days:
        return good[: config.hop_seeds]
    seeds: list[int] = []
    days: set[str] = set()
    for u in good:
        if episode_of[u] not in days:
            days.add(episode_of[u])
            seeds.append(u)
    return seeds[: config.hop_seeds]


def time_scored(
    fused: dict[int, float],
    days: np.ndarray,
    years: tuple[int, ...],
    question: str,
    today: date | None,
    config: RetrievalConfig,
) -> dict[int, float]:
    """``fused`` raised for the messages of the days ``question`` names (see
    ``RetrievalConfig.time_weight``); those days' messages join the candidates when they
    are few.

    Args:
        fused: each unit's score so far.
        days: each unit's day, by unit id: a proleptic ordinal, ``-1`` for none.
        years: the years those days fall in, sorted (a month named without a year is
            looked for in them).
        question: the question as asked.
        today: the day it is asked, for relative phrases; ``None``: calendar dates only.
        config: ``time_weight``, ``time_grace_days`` and ``time_candidates``.
    """
    cfg = config
    if not fused or not years:
        return fused
    # A month or day named without a year: in the years the turns were dated in.
    spans = time_spans(question, years, today=today)
    if not spans:
        return fused
    near = day_nearness(days, spans, cfg.time_grace_days)
    out = dict(fused)
    inside = np.flatnonzero(near >= 1.0)
    if 0 < len(inside) <= cfg.time_candidates:
        floor = min(fused.values())
        for u in inside.tolist():
            out.setdefault(u, floor)
    ids = np.fromiter(out.keys(), dtype=np.int64, count=len(out))
    known = ids[(ids >= 0) & (ids < len(days))]
    gain = cfg.time_weight * near[known]
    for u, g in zip(known[gain > 0].tolist(), gain[gain > 0].tolist(), strict=True):
        out[u] += g
    return out


def day_nearness(days: np.ndarray, spans: Sequence[DaySpan], grace_days: int) -> np.ndarray:
    """Per unit, how near its day (``days``: proleptic ordinals, ``-1`` for none) falls to
    the nearest of ``spans``: 1 inside one, falling to 0 over ``grace_days`` outside (0
    for no day)."""
    near = np.zeros(len(days))
    for span in spans:
        lo = span.first.toordinal() if span.first != date.min else -(10**9)
        hi = span.last.toordinal() if span.last != date.max else 10**9
        dist = np.maximum(lo - days, 0) + np.maximum(days - hi, 0)
        near = np.maximum(near, np.clip(1.0 - dist / grace_days, 0.0, 1.0))
    near[days < 0] = 0.0
    return near
