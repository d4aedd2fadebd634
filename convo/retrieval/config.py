"""How a :class:`~convo.retrieval.RetrievalMemory` ranks: :class:`RetrievalConfig` and
:class:`Fusion`."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from convo.errors import ConfigError

__all__ = ["TURN_LINES", "Fusion", "RetrievalConfig"]


class Fusion(enum.StrEnum):
    """How dense and lexical evidence are combined.

    ``DENSE`` and ``LEXICAL`` use one index only. ``MIX`` scores ``w * cosine + (1 - w) *
    bm25 / (bm25 + bm25_half)`` (both in [0, 1], so ``min_score`` keeps one meaning across
    queries). ``RRF`` is reciprocal-rank fusion, ``sum 1 / (rrf_k + rank)``, rescaled so
    that a unit ranked first by both indexes scores 1.
    """

    DENSE = "dense"
    LEXICAL = "lexical"
    MIX = "mix"
    RRF = "rrf"


#: The values of :attr:`RetrievalConfig.turn_lines`.
TURN_LINES = ("all", "best", "each")


@dataclass(frozen=True, kw_only=True)
class RetrievalConfig:
    """How a :class:`RetrievalMemory` ranks candidates.

    Args:
        fusion: :class:`Fusion` or its name. Default ``"mix"``.
        dense_weight: weight of the cosine in ``MIX``, in [0, 1]. Default 0.5.
        bm25_half: the BM25 score that maps to 0.5 in ``MIX``. Default 6.0.
        rrf_k: the rank offset of ``RRF``. Default 60.
        candidates_factor: :meth:`RetrievalMemory.retrieve` returns up to ``candidates_factor *
            top_k`` passages, so the planner can skip duplicates. Default 3.
        unit_candidates: units fetched from each index before fusion (at least). Default
            256.
        min_score: passages scoring below this are dropped by the planner. Default 0.2.
        neighbours: also score each message of a turn with the previous message as
            context (a short reply is found by what it answers): it is embedded and its
            words are searched with the last
            :data:`~convo.retrieval.memory.CONTEXT_CHARS` characters of it (with
            ``embed_alone``, its vector gains ``context_weight`` times the previous
            message's instead). Default True.
        context_words: index a message's words (and, without ``embed_alone``, its vector)
            with the tail of the previous message's (``neighbours`` on). Default True;
            measured on LongMemEval with ``benchmarks/longmemeval.py --variants own-words``.
        embed_alone: embed each message alone (its head, ``embed_chars``) and add
            ``context_weight`` times its context's vector, instead of embedding it with the
            tail of the previous message as one text. Half the indexing time (22.5 against
            50.9 CPU-seconds for a 527-message LongMemEval history) and a message's own
            text always in its vector; on LoCoMo dev 0.821 (multi-hop 0.454) against the
            default's 0.830 (0.459). Default False.
        context_weight: with ``embed_alone``, weight of the previous message's vector in a message's vector
            (each is embedded alone, so a long previous message never crowds the
            message's own text out). Default 0.5; 0 embeds the message alone.
        embed_chars: with ``embed_alone``, characters of a message embedded (its head; the whole message is
            searched by its words). MiniLM reads at most 256 word pieces and costs in
            proportion to them: the head of a long assistant reply says what it is about,
            and indexing a 500-message history stays within seconds on a CPU. Default 300.
        query_chars: characters of the question its dense vector is computed from: a longer
            question is embedded as its head and its tail, ``query_chars // 2`` each (its
            words are all searched). The query's embedding is most of retrieval's cost and
            grows with its length: on a 2-core CPU a 270-word chat message took 0.32 s
            against 0.05 s for a short question, and a server's concurrent turns wait for
            one another's. Questions in LoCoMo and LongMemEval are at most 290 characters,
            so their figures do not change. MiniLM was trained on 128 word pieces, about
            600 characters. Default 600.
        date_in_text: prefix a turn passage with its date. Default True.
        turn_lines: what a passage of a turn holds. ``"all"``: the whole turn (one
            passage per turn). ``"best"``: the turn's best-matching message, with
            ``context_lines`` messages before it (one passage per turn). ``"each"``: every
            message is its own candidate, so two messages of one turn can both be
            recalled and a long turn does not cost its whole length. Default ``"each"``.
        context_lines: with ``"best"``, messages shown before the best one. Default 0.
        group_passages: tag line passages with their date (``meta["group"]``) so the
            planner packs the lines of one date under one header instead of repeating it
            per line. Default True.
        speaker_boost: added to the score of a message whose speaker is named in the
            query ("What did Maria ..." favours Maria's own messages). Default 0.25; 0
            turns it off.
        second_hop: weight, in [0, 1], of a second query built from the first hits: their
            rarest words added to the query's terms (names, places, things the question
            did not say), which may find new messages, and their mean vector added to the
            query's, which re-scores the messages found. Default 0.5; 0 skips
            it.
        strip_names: search the turns with the names of the speakers the query names
            taken out of it (the speaker boost already favours their messages, and a
            name alone matches every greeting that addresses that person). Default
            True.
        hop_seeds: first hits the second query is built from. Default 3.
        hop_terms: words taken from the first hits into the second query. Default 12.
        hop_distinct_days: take the first hits the second query is built from from
            different episodes (days): the pieces of a multi-hop answer are spread over
            days, and seeds from one day pull the second query back to it. Default True.
        episode_weight: weight of the score of the message's whole episode (the turns
            of one date; blocks of ``episode_turns`` turns without dates): its mean
            vector against the query, added to each message's score, so an episode about
            the topic lifts its messages. Default 0.2; 0 turns it off.
        episode_turns: turns per episode when turns carry no date. Default 16.
        mmr_lambda: diversity (maximal marginal relevance): a candidate's score is
            lowered by ``mmr_lambda`` times its highest cosine to a better candidate
            already chosen, so near-repeats make room for other evidence. Default 0.0; 0
            keeps the plain ranking.
        expand_lines: with ``"each"``, also offer the messages right before and after a
            hit (``expand_lines`` each side) as candidates just below it. Default 0.
        content_weight: a prior for messages that say something: added to a message's
            score times ``min(1, content words / content_terms)`` (its own words, not the
            context line's, stopwords left out), so "Thanks, see you!" yields to news
            that answers questions later. Default 0.05; 0 turns it off.
        content_terms: content words at which a message gets the whole
            ``content_weight``. Default 20.
        neighbour_weight: a message is raised by ``neighbour_weight`` times the score
            (above the lowest candidate's) of the better of the messages right before and
            after it in the conversation, so the line a matching reply answers ("Look at
            this!" before "What a lovely sunset painting!") is found with it; those
            neighbours become candidates too. Default 0.6 (0.5 until 2026-12-03: LoCoMo dev
            0.8288 -> 0.8333, chosen on both cross-validation folds; LongMemEval dev at
            4,096 tokens 0.983 -> 0.965, multi-session 0.97 -> 0.90); 0 turns it off.
        time_weight: time-aware scoring. When the query names days (``"on 3 June,
            2023"``, ``"in August 2023"``, ``"the first half of September 2022"``,
            ``"between August 11 and August 15 2023"``, ``"as of December 2023"``: see
            :func:`convo.dates.time_spans`), a message of a turn dated inside them gains
            ``time_weight``, one dated within ``time_grace_days`` of them a share
            falling linearly to 0. Relative phrases ("yesterday", "last week") count
            when :meth:`RetrievalMemory.retrieve` is told ``today``. Turns are dated by
            ``Session.add(..., date=...)`` or ``Session(clock=...)``
            (:func:`convo.dates.parse_day` reads the common forms); undated turns and
            queries that name no time are scored as before. Default 0.25; 0 turns it
            off.
        time_grace_days: days around the named ones over which the time gain fades out
            (a turn often tells of the week before). Default 14.
        time_candidates: when the named days hold at most this many messages, all of
            them become candidates (a question "on 25 May, 2022" finds that day's
            messages even when no word matches). Default 120; 0 never adds any.
        expand_terms: query expansion. Each word of the query that two or more of the
            session's messages use brings up to ``expand_terms`` words of the session's
            vocabulary whose embeddings (the same model, one word at a time) are nearest
            to it, at cosine ``expand_min_cosine`` or more, into the second hop's word
            search: "passionate" also finds "passion", "vacationed" "trip" and "travel",
            "food" "meal". The vocabulary's vectors and nearest words are kept up to date
            as turns are indexed, so a query only looks them up. Default 3; 0 turns it off.
        expand_min_cosine: how near a word must be to expand a query word. Default 0.6.
        expand_max_share: words used in more than this share of the session's messages
            are too common to be added. Default 0.05.
        expand_query_words: also up to this many words of the session's vocabulary
            nearest to the whole query's vector (at cosine ``expand_query_min_cosine``
            or more) join the second hop's word search: "What instruments does she
            play?" brings "music", "piano", "violin"; "What does she do to destress?"
            "therapy" and "comfort". Default 4; 0 turns it off.
        expand_query_min_cosine: how near a word must be to the query. Default 0.4.
        recency_weight: where facts changed, prefer the newest (knowledge updates): a
            message of a dated turn gains up to ``recency_weight``, in proportion to how
            late its day falls between the session's first and last dated day (undated
            turns gain nothing). Default 0.0 (off; measured on LongMemEval with
            ``benchmarks/longmemeval.py --variants recency``).
        role_weight: in a chat between a person and an assistant (messages without
            speaker names), a message of the side the question asks about gains
            ``role_weight``: the assistant's when the question asks what it said earlier
            ("you mentioned", "our previous conversation": see
            :func:`convo.retrieval.ranking.asked_role`), neither when it asks to recall
            something without saying whose ("remind me of that restaurant"), else the
            person's own (their facts, plans and tastes are in what they said; the
            replies are long and crowd the prompt). Conversations between named speakers
            are not affected. Default 0.5: on LongMemEval's development questions
            (``benchmarks/longmemeval.py``), with MiniLM vectors (``embed_alone``, 48
            questions) evidence recall at 4,096 tokens is 1.00 against 0.85 without it
            (0.96 at 0.3); word side alone (``--lexical-only``, 126 questions) 0.90
            against 0.78 (0.86 at 0.3, 0.92 at 1.0); LoCoMo's named speakers are
            unaffected. 0 turns it off.

    Raises:
        ConfigError: a value is out of range.
    """

    fusion: Fusion = Fusion.MIX
    dense_weight: float = 0.5
    bm25_half: float = 6.0
    rrf_k: int = 60
    candidates_factor: int = 3
    unit_candidates: int = 256
    min_score: float = 0.2
    neighbours: bool = True
    context_words: bool = True
    embed_alone: bool = False
    context_weight: float = 0.5
    embed_chars: int = 300
    query_chars: int = 600
    date_in_text: bool = True
    turn_lines: str = "each"
    context_lines: int = 0
    group_passages: bool = True
    speaker_boost: float = 0.25
    second_hop: float = 0.5
    hop_seeds: int = 3
    hop_terms: int = 12
    hop_distinct_days: bool = True
    episode_weight: float = 0.2
    episode_turns: int = 16
    strip_names: bool = True
    mmr_lambda: float = 0.0
    expand_lines: int = 0
    content_weight: float = 0.05
    content_terms: int = 20
    neighbour_weight: float = 0.6
    time_weight: float = 0.25
    time_grace_days: int = 14
    time_candidates: int = 120
    expand_terms: int = 3
    expand_min_cosine: float = 0.6
    expand_max_share: float = 0.05
    expand_query_words: int = 4
    expand_query_min_cosine: float = 0.4
    recency_weight: float = 0.0
    role_weight: float = 0.5

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "fusion", Fusion(self.fusion))
        except ValueError:
            names = ", ".join(f.value for f in Fusion)
            raise ConfigError(f"fusion must be one of {names}, got {self.fusion!r}") from None
        if not 0.0 <= self.dense_weight <= 1.0:
            raise ConfigError(f"dense_weight must be in [0, 1], got {self.dense_weight}")
        if self.bm25_half <= 0:
            raise ConfigError(f"bm25_half must be > 0, got {self.bm25_half}")
        for name in (
            "rrf_k",
            "candidates_factor",
            "unit_candidates",
            "hop_seeds",
            "episode_turns",
            "content_terms",
            "time_grace_days",
            "embed_chars",
            "query_chars",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        for name in (
            "context_lines",
            "hop_terms",
            "expand_lines",
            "time_candidates",
            "expand_terms",
            "expand_query_words",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
        if self.turn_lines not in TURN_LINES:
            raise ConfigError(f"turn_lines must be one of {', '.join(TURN_LINES)}, got {self.turn_lines!r}")
        for name in (
            "speaker_boost",
            "episode_weight",
            "mmr_lambda",
            "content_weight",
            "neighbour_weight",
            "time_weight",
            "recency_weight",
            "role_weight",
            "context_weight",
        ):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0.0 <= self.second_hop <= 1.0:
            raise ConfigError(f"second_hop must be in [0, 1], got {self.second_hop}")
        for name in ("expand_min_cosine", "expand_query_min_cosine"):
            if not -1.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must be in [-1, 1], got {getattr(self, name)!r}")
        if not 0.0 < self.expand_max_share <= 1.0:
            raise ConfigError(f"expand_max_share must be in (0, 1], got {self.expand_max_share}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe settings."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["fusion"] = self.fusion.value
        return out
