"""The ranking of one session's messages for a question, on arrays indexed by unit id.

:meth:`RetrievalMemory.retrieve <convo.retrieval.RetrievalMemory.retrieve>` scores a
thousand or more candidate messages per question, through a dozen stages (fusion, the
second hop, episodes, dates, neighbours, speakers...). The stages are those of
:mod:`convo.retrieval.ranking`, which keeps them as pure functions over ``{unit id:
score}`` (a document search and the tests use them); here each is a few numpy operations
over :class:`UnitScores`, arrays as long as the session's unit ids, instead of a Python
loop over a dictionary. At 10,000 turns that took the search from about 12 ms to about
4 ms a question on one core (issue 24).

The arithmetic is the same, operation for operation, so every score is the same float
and the ranking the same. One thing needed care: a matrix-vector product's last bit can
depend on a row's position in the matrix, so the second hop's candidates are scored in
the order the dictionary version listed them (:func:`_first_order`, :func:`_rrf_order`).

:func:`rank_units` runs the stages; the memory turns its result into passages.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import date

import numpy as np

from convo.dates import time_spans
from convo.retrieval.config import Fusion, RetrievalConfig
from convo.retrieval.features import UnitFeatures
from convo.retrieval.indexes.bm25 import terms
from convo.retrieval.ranking import asked_role, day_nearness, hop_seeds, top_of
from convo.retrieval.units import UnitStore

__all__ = ["RankedUnits", "UnitScores", "rank_units"]

#: ``(ids, scores)``: int64 unit ids and their float64 scores, in an index's order.
Found = tuple[np.ndarray, np.ndarray]


def _nothing() -> Found:
    return np.zeros(0, np.int64), np.zeros(0, np.float64)


@dataclass
class UnitScores:
    """The candidates of one search and their scores, by unit id: unit ``u`` is a
    candidate where ``has[u]``, with score ``value[u]`` (elsewhere ``value`` means nothing).

    Both arrays are as long as the session's per-unit arrays (:class:`UnitFeatures`).
    """

    value: np.ndarray  # float64
    has: np.ndarray  # bool

    @classmethod
    def empty(cls, size: int) -> UnitScores:
        """No candidate, over ``size`` unit ids."""
        return cls(np.zeros(size, np.float64), np.zeros(size, bool))

    def copy(self) -> UnitScores:
        return UnitScores(self.value.copy(), self.has.copy())

    def __len__(self) -> int:
        return int(np.count_nonzero(self.has))

    def ids(self) -> np.ndarray:
        """The candidates' unit ids, ascending."""
        return np.flatnonzero(self.has)

    def floor(self, default: float = 0.0) -> float:
        """The lowest candidate score (``default`` for none)."""
        return float(self.value[self.has].min()) if self.has.any() else default

    def as_dict(self) -> dict[int, float]:
        """``{unit id: score}`` of the candidates, by ascending id."""
        ids = self.ids()
        return dict(zip(ids.tolist(), self.value[ids].tolist(), strict=True))


@dataclass(frozen=True)
class RankedUnits:
    """What :func:`rank_units` found: every candidate's final score, and the first hop's
    cosine (``dense``) and BM25 score (``lexical``) of the units each index found."""

    scores: UnitScores
    dense: dict[int, float]
    lexical: dict[int, float]


def fused_scores(size: int, dense: Found, lexical: Found, config: RetrievalConfig) -> UnitScores:
    """:func:`convo.retrieval.ranking.fuse` of the units ``dense`` and ``lexical`` found
    (each ``(ids, scores)`` in its index's order, best first)."""
    out = UnitScores.empty(size)
    if config.fusion is Fusion.RRF:
        scale = (config.rrf_k + 1) / 2
        for ids, vals in (dense, lexical):
            ordered = ids[np.argsort(-vals, kind="stable")]
            out.value[ordered] += scale / (config.rrf_k + np.arange(len(ordered)) + 1)
            out.has[ids] = True
        return out
    w = {Fusion.DENSE: 1.0, Fusion.LEXICAL: 0.0}.get(config.fusion, config.dense_weight)
    (d_ids, d_vals), (l_ids, l_vals) = dense, lexical
    cos = np.full(size, float(d_vals.min()) if len(d_vals) else 0.0)  # floor: not found
    cos[d_ids] = d_vals
    lex = np.zeros(size)
    lex[l_ids] = l_vals
    out.has[d_ids] = True
    out.has[l_ids] = True
    idx = out.ids()
    c, lx = cos[idx], lex[idx]
    out.value[idx] = w * c + (1.0 - w) * lx / (lx + config.bm25_half)
    return out


def boosted(scores: UnitScores, units: np.ndarray, gain: float) -> UnitScores:
    """``scores`` with ``gain`` added to the candidates where ``units`` (bool, by id)."""
    out = scores.copy()
    out.value[scores.has & units] += gain
    return out


def role_scored(scores: UnitScores, features: UnitFeatures, query: str, weight: float) -> UnitScores:
    """:func:`convo.retrieval.ranking.role_boosted`: the side :func:`asked_role` of
    ``query`` names gains ``weight``."""
    side = asked_role(query)
    if weight <= 0 or side is None:
        return scores
    return boosted(scores, features.speaking({side}), weight)


def time_scored(
    scores: UnitScores,
    days: np.ndarray,
    years: tuple[int, ...],
    question: str,
    today: date | None,
    config: RetrievalConfig,
) -> UnitScores:
    """:func:`convo.retrieval.ranking.time_scored` (the same arguments, ``days`` as long as
    the scores' arrays)."""
    if not years or not scores.has.any():
        return scores
    spans = time_spans(question, years, today=today)
    if not spans:
        return scores
    near = day_nearness(days, spans, config.time_grace_days)
    out = scores.copy()
    inside = np.flatnonzero(near >= 1.0)
    if 0 < len(inside) <= config.time_candidates:
        joined = inside[~out.has[inside]]
        out.value[joined] = scores.floor()
        out.has[joined] = True
    known = out.ids()
    gain = config.time_weight * near[known]
    up = gain > 0
    out.value[known[up]] += gain[up]
    return out


def recency_scored(scores: UnitScores, days: np.ndarray, weight: float) -> UnitScores:
    """Each dated candidate raised by up to ``weight``, by how late its day falls between
    the session's first and last dated day (see ``recency_weight``)."""
    known = days[days >= 0]
    if not len(known):
        return scores
    lo, span = int(known.min()), max(int(known.max() - known.min()), 1)
    out = scores.copy()
    idx = np.flatnonzero(scores.has & (days >= 0))
    out.value[idx] += weight * (days[idx] - lo) / span
    return out


def propagated(order: np.ndarray, scores: UnitScores, weight: float, grow: int) -> UnitScores:
    """:func:`convo.retrieval.ranking.propagate` (``order`` as long as the scores' arrays).

    Which of the best ``grow`` candidates bring their neighbours in is chosen among the
    candidates by ascending id (the dictionary version: in its keys' order); the two
    differ only where candidates tie exactly at the ``grow``-th score.
    """
    ids = scores.ids()
    if not len(ids):
        return scores
    vals = scores.value[ids]
    floor = float(vals.min())
    n = order.shape[1]
    score = np.full(n + 1, floor)  # the last slot stands for "no neighbour"
    score[ids] = vals
    top = ids[np.argpartition(-vals, grow - 1)[:grow]] if 0 < grow < len(ids) else ids
    near = order[:, top]
    joined = scores.has.copy()
    joined[near[near >= 0]] = True
    cand = np.flatnonzero(joined)  # the candidates and those neighbours, ascending
    nb = order[:, cand]
    nb = np.where(nb >= 0, nb, n)
    best = np.maximum(score[nb[0]], score[nb[1]])
    value = scores.value.copy()
    value[cand] = score[cand] + weight * (best - floor)
    return UnitScores(value, joined)


def _first_order(dense_ids: list[int], lexical_ids: list[int]) -> list[int]:
    """The keys of :func:`~convo.retrieval.ranking.fuse`'s result (not RRF) in its order:
    that of the set CPython builds for ``dense.keys() | lexical.keys()``.

    The second hop's candidates are then listed as the set ``fused.keys() |
    lexical2.keys()`` and their vectors scored in one matrix product, whose last bits
    depend on a row's position: in this order the scores are the dictionary version's."""
    return list(dict.fromkeys(dense_ids).keys() | dict.fromkeys(lexical_ids).keys())


def _rrf_order(dense: Found, lexical: Found) -> list[int]:
    """The keys of :func:`~convo.retrieval.ranking.fuse`'s RRF result in its order: each
    ranking best first (stable), the dense one first."""
    out: dict[int, None] = {}
    for ids, vals in (dense, lexical):
        out.update(dict.fromkeys(ids[np.argsort(-vals, kind="stable")].tolist()))
    return list(out)


def rank_units(
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
    """Score the messages of one session's ``store`` for a question (see
    :class:`RetrievalConfig` for each stage), ``None`` when neither index finds any.

    Args:
        store: the session's units and indexes.
        features: what the ranking reads per unit, up to date with ``store``.
        qvec: the question's vector; ``query``: its text as searched (the names of the
            speakers it names taken out, see ``strip_names``).
        n: passages wanted (``top_k * candidates_factor``).
        named: speakers the question names (they gain ``speaker_boost``).
        config: the ranking settings.
        asked: the question as asked (dates, whose side it asks about); ``""``: ``query``.
        today: the day it is asked, for relative dates.
        expansion: the words query expansion adds for ``(query, qvec)`` (the session's
            vocabulary); ``None``: none.
    """
    cfg = config
    size = len(features.days)
    k = max(cfg.unit_candidates, 4 * n)
    dense: Found = _nothing()
    if cfg.fusion is not Fusion.LEXICAL and store.vectors is not None:
        sims, ids = store.vectors.search(qvec[None, :], k)
        keep = ids[0] >= 0
        dense = ids[0][keep].astype(np.int64), sims[0][keep].astype(np.float64)
    lexical: Found = store.lexical.top(query, k) if cfg.fusion is not Fusion.DENSE else _nothing()
    fused = fused_scores(size, dense, lexical, cfg)
    if not fused.has.any():
        return None
    names = features.speaking(named) if named else None
    if cfg.second_hop > 0 and store.vectors is not None:
        ranked = boosted(fused, names, cfg.speaker_boost) if names is not None else fused
        if cfg.role_weight > 0:
            ranked = role_scored(ranked, features, asked or query, cfg.role_weight)
        ids = ranked.ids()
        ranking = top_of(ids, ranked.value[ids], 4 * cfg.hop_seeds)
        seeds = hop_seeds(fused.value, ranking, features.episode_of, cfg)
        q2 = qvec + store.vectors.vectors(seeds).mean(axis=0)
        q2 = (q2 / (np.linalg.norm(q2) or 1.0)).astype(np.float32)
        seed_words = (store.unit_lex[u] for u in seeds)
        extra = store.lexical.rare_terms(seed_words, cfg.hop_terms, exclude=terms(query))
        if expansion is not None and (cfg.expand_terms > 0 or cfg.expand_query_words > 0):
            extra += [t for t in expansion(query, qvec) if t not in extra]
        # The new words may find new units; the new vector only re-scores the units
        # found so far (a second full vector search would double the search time).
        lexical2 = store.lexical.top(query, k, extra) if cfg.fusion is not Fusion.DENSE else _nothing()
        dense2: Found = _nothing()
        if cfg.fusion is not Fusion.LEXICAL:
            if cfg.fusion is Fusion.RRF:
                first = _rrf_order(dense, lexical)
            else:
                first = _first_order(dense[0].tolist(), lexical[0].tolist())
            cand = list(dict.fromkeys(first).keys() | dict.fromkeys(lexical2[0].tolist()).keys())
            dense2 = np.asarray(cand, np.int64), (store.vectors.vectors(cand) @ q2).astype(np.float64)
        fused2 = fused_scores(size, dense2, lexical2, cfg)
        floor1, floor2 = fused.floor(), fused2.floor()
        h = cfg.second_hop
        merged = UnitScores.empty(size)
        merged.has = fused.has | fused2.has
        idx = merged.ids()
        one = np.where(fused.has[idx], fused.value[idx], floor1)
        two = np.where(fused2.has[idx], fused2.value[idx], floor2)
        merged.value[idx] = (1 - h) * one + h * two
        fused = merged
    if cfg.episode_weight > 0 and store.vectors is not None:
        ep_score = (features.centroids @ qvec).astype(np.float64)
        idx = fused.ids()
        fused.value[idx] += cfg.episode_weight * ep_score[features.episode_index[idx]]
    if cfg.time_weight > 0:
        years = tuple(sorted(features.years))
        fused = time_scored(fused, features.days, years, asked or query, today, cfg)
    if cfg.recency_weight > 0:
        fused = recency_scored(fused, features.days, cfg.recency_weight)
    if cfg.neighbour_weight > 0:
        fused = propagated(features.order, fused, cfg.neighbour_weight, 2 * max(n, 1))
    if cfg.content_weight > 0:
        idx = fused.ids()
        full = float(cfg.content_terms)
        fused.value[idx] += cfg.content_weight * np.minimum(features.sizes[idx] / full, 1.0)
    if names is not None:
        fused = boosted(fused, names, cfg.speaker_boost)
    if cfg.role_weight > 0:
        fused = role_scored(fused, features, asked or query, cfg.role_weight)
    return RankedUnits(
        scores=fused,
        dense=dict(zip(dense[0].tolist(), dense[1].tolist(), strict=True)),
        lexical=dict(zip(lexical[0].tolist(), lexical[1].tolist(), strict=True)),
    )
