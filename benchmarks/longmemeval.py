"""LongMemEval evidence recall: what would convo put in the prompt for each question?

Each question's haystack (about 48 earlier chat sessions of one person, dated by
``haystack_dates``) is replayed turn by turn, a new turn at every user message and at
every session boundary (a session that opens with an assistant message is not folded
into the previous session's last turn), each turn dated with its session's date. The
question is then asked on its ``question_date`` (``retrieve(today=...)``) and the prompt
convo would send under ``--budget`` is planned. A question counts when EVERY
``has_answer`` message is in the prompt, verbatim (``recall_all``); ``session_recall`` is
the share of answer sessions with at least one evidence message in the prompt.
Abstention questions (``_abs`` ids) report tokens only. Model-free strategies, each filling
the same token room (``Budget.retrieval_tokens = context_tokens``):

==================  ==============================================================
``window``          recent turns only, as many as fit
``bm25``            recent window + plain BM25 over messages
``dense``           recent window + MiniLM cosine over messages (message text alone)
``retrieval``       recent window + :class:`convo.RetrievalMemory` (library defaults)
``retrieval:NAME``  the same with :data:`VARIANTS` ``NAME`` on top
``defaults``        the library's ``Budget`` defaults (``retrieval_tokens`` None: the room left, top-k 40)
``defaults:NAME``   the same with :data:`VARIANTS` ``NAME`` as the memory's config
``budget:S/K``      ``Budget`` defaults but ``retrieval_tokens = S * context_tokens``, top-k ``K``
==================  ==============================================================

With ``--folds 2`` (default) the questions are cut into two folds (alternating within
each type, so each fold has every type); for each fold the retrieval strategy with the best ``recall_all``
on the other fold is chosen and scored on this one (``cross_validation``).

Usage::

    python benchmarks/longmemeval.py --budget 2048,4096 --limit 20 --json

Real vectors are kept in ``--embed-cache`` (under convo's cache folder). Embedding a
whole split's ~58k messages costs tens of minutes of a busy CPU; ``--precompute`` (same
``--limit``, ``--strategies`` and ``--variants`` as the run it prepares) embeds question
by question, in length-sorted batches, saving as it goes, so a stopped run keeps whole
questions and the run itself embeds nothing. ``embed_alone`` variants and ``dense`` share
one set of texts (each message's head, at most ``embed_chars``), shorter and cheaper than the
default's context-joint texts.

The data file is read by path and never copied.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import zip_longest
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.locomo import REPLY_TOKENS, CachedEmbeddings, environment
from convo.budget import Budget
from convo.messages import Message, Role
from convo.paths import cache_dir
from convo.plan import Passage, Turn, plan_prompt, turn_key
from convo.retrieval.indexes.bm25 import BM25Index
from convo.retrieval.memory import RetrievalMemory, head_text
from convo.tokens import TiktokenCounter, TokenCounter

_DATA = Path("shared") / "data" / "longmemeval" / "longmemeval-s-dev.json.gz"
#: ``../shared/data/longmemeval/longmemeval-s-dev.json.gz`` beside the checkout (or one up).
DEFAULT_DATA = next(
    (p / _DATA for p in Path(__file__).resolve().parents[1:4] if (p / _DATA).exists()),
    Path(__file__).resolve().parents[2] / _DATA,
)
#: Passages the planner may use at most (tokens bind first at these budgets).
TOP_K = 60
#: Embeddings kept between runs: under convo's cache folder, never in the repository.
DEFAULT_EMBED_CACHE = cache_dir() / "longmemeval" / "longmemeval-s-dev-all-MiniLM-L6-v2.npz"
#: Texts embedded between saves of the embedding cache by ``--precompute``.
PRECOMPUTE_CHUNK = 2048
#: Histories indexed between saves of the embedding cache.
SAVE_EVERY = 2
#: Recent turns considered for the window in retrieval strategies (``Budget.window_turns``).
WINDOW_TURNS = 8
TYPES = (
    "single-session-user",
    "single-session-assistant",
    "single-session-preference",
    "multi-session",
    "knowledge-update",
    "temporal-reasoning",
)
SHORT = ("ss-user", "ss-assistant", "ss-pref", "multi", "update", "temporal")
#: Query-time / index-time variants of ``retrieval`` (``RetrievalConfig(**overrides)``).
VARIANTS: dict[str, dict[str, Any]] = {
    "own-words": {"context_words": False},
    "embed-alone": {"embed_alone": True},  # with the default role_weight
    "no-hop": {"second_hop": 0.0},
    "no-episode": {"episode_weight": 0.0},
    "no-neighbour": {"neighbour_weight": 0.0},
    "no-time": {"time_weight": 0.0},
    "no-expansion": {"expand_terms": 0, "expand_query_words": 0},
    "lexical-heavy": {"dense_weight": 0.3},
    "recency": {"recency_weight": 0.1},
    "recency-lexical": {"recency_weight": 0.1, "dense_weight": 0.3},
    "role": {"role_weight": 0.1},
    "role-2": {"role_weight": 0.2},
    "role-3": {"role_weight": 0.3},
    "role-5": {"role_weight": 0.5},
    "role-10": {"role_weight": 1.0},
    "role-3-own-words": {"role_weight": 0.3, "context_words": False},
    "role-3-recency": {"role_weight": 0.3, "recency_weight": 0.05},
    "role-3-lexical": {"role_weight": 0.3, "dense_weight": 0.3},
    "no-role": {"role_weight": 0.0},
    "alone-no-role": {"embed_alone": True, "role_weight": 0.0},
    "role-3-alone": {"role_weight": 0.3, "embed_alone": True},
    "role-5-alone": {"role_weight": 0.5, "embed_alone": True},
    "role-10-alone": {"role_weight": 1.0, "embed_alone": True},
}


#: What ``--lexical-only`` sets on every retrieval strategy's config.
LEXICAL_ONLY: dict[str, Any] = {
    "fusion": "lexical",
    "expand_terms": 0,
    "expand_query_words": 0,
    "episode_weight": 0.0,
}


class ZeroEncoder:
    """A text encoder with no model: every vector is zero (``--lexical-only``)."""

    dim = 8

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        return np.zeros((len(list(texts)), self.dim), dtype=np.float32)


class RecordingEncoder:
    """A text encoder that records what it is asked to embed and answers zeros: a dry run
    of a strategy collects every text it needs (``--precompute``)."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.texts: dict[str, None] = {}

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        texts = list(texts)
        self.texts.update(dict.fromkeys(texts))
        return np.zeros((len(texts), self.dim), dtype=np.float32)


def precompute(
    items: Sequence[Item],
    factory: Callable[[str, Item, Any], Any],
    strategies: Sequence[str],
    cache: CachedEmbeddings,
    *,
    chunk: int = PRECOMPUTE_CHUNK,
    progress: Callable[[str], None] = print,
) -> int:
    """Embed, in few large length-sorted batches, every text ``strategies`` need on
    ``items`` and is not in ``cache`` (found by a dry run with a :class:`RecordingEncoder`),
    saving the cache after each ``chunk`` texts, so a later run embeds nothing and a
    stopped one keeps what it did. Returns how many texts were embedded."""
    t0 = time.perf_counter()
    total = 0
    todo: list[str] = []
    for i, item in enumerate(items):  # item by item: a stopped run leaves whole questions
        rec = RecordingEncoder(cache.dim)
        for name in strategies:
            retriever = factory(name, item, rec)
            if retriever is None:
                continue
            retriever.retrieve(item.question, session_id=item.qid, top_k=TOP_K, today=item.question_date)
            if isinstance(retriever, RetrievalMemory):
                # The expansion vocabulary's words (the same for every config), as
                # RetrievalMemory picks them: the dry run does not build its neighbour
                # lists (seconds per history), see ``build`` in :func:`main`.
                rec.encode(vocabulary_words(retriever, item.qid))
        todo += sorted((t for t in rec.texts if not cache.has(t)), key=len)
        if len(todo) >= chunk or i == len(items) - 1:
            cache.encode(todo)
            cache.save()
            total += len(todo)
            todo = []
            progress(
                f"precompute: {i + 1}/{len(items)} questions, {total} texts, {time.perf_counter() - t0:.0f} s"
            )
    return total


def vocabulary_words(memory: RetrievalMemory, session_id: str) -> list[str]:
    """The words ``memory``'s expansion vocabulary of ``session_id`` embeds: indexed
    words two or more messages use, numbers left out."""
    lexical = memory._sessions[session_id].lexical
    return [t for t in lexical.indexed_terms() if not t.isdigit() and lexical.document_frequency(t) >= 2]


@dataclass(frozen=True, kw_only=True)
class Item:
    """One LongMemEval question with its haystack as convo turns."""

    qid: str
    qtype: str
    question: str
    question_date: str
    turns: tuple[Turn, ...]
    dates: dict[int, str]
    #: (turn index, line, session id, content) of every ``has_answer`` message.
    evidence: tuple[tuple[int, int, str, str], ...]
    answer_sessions: tuple[str, ...]

    @property
    def abstention(self) -> bool:
        return self.qid.endswith("_abs")


def build_item(rec: dict[str, Any]) -> Item:
    """The haystack of ``rec`` as dated turns: a new turn at each user message and at each
    session's first message."""
    turns: list[Turn] = []
    dates: dict[int, str] = {}
    evidence = []
    for sid, day, session in zip(
        rec["haystack_session_ids"], rec["haystack_dates"], rec["haystack_sessions"], strict=True
    ):
        groups: list[list[tuple[Message, bool]]] = []
        for m in session:
            content = str(m.get("content", ""))
            if not content.strip():
                continue
            role = Role.USER if m["role"] == "user" else Role.ASSISTANT
            if role is Role.USER or not groups:
                groups.append([])
            groups[-1].append((Message(role=role, content=content), bool(m.get("has_answer"))))
        for group in groups:
            idx = len(turns)
            turns.append(Turn(index=idx, messages=tuple(m for m, _ in group)))
            dates[idx] = str(day)
            evidence += [(idx, line, str(sid), m.content.strip()) for line, (m, ev) in enumerate(group) if ev]
    return Item(
        qid=str(rec["question_id"]),
        qtype=str(rec["question_type"]),
        question=str(rec["question"]),
        question_date=str(rec["question_date"]),
        turns=tuple(turns),
        dates=dates,
        evidence=tuple(evidence),
        answer_sessions=tuple(str(s) for s in rec.get("answer_session_ids", [])),
    )


def load(path: str | Path, *, types: Sequence[str] = (), limit: int | None = None) -> list[Item]:
    """Read the gzipped JSON at ``path`` (nothing is copied)."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    kept = [r for r in data if not types or r["question_type"] in types]
    if limit:  # round-robin over the types, so a small subset has each
        by_type: dict[str, list[Any]] = defaultdict(list)
        for r in kept:
            by_type[r["question_type"]].append(r)
        order = [r for group in zip_longest(*by_type.values()) for r in group if r is not None]
        kept = order[:limit]
    return [build_item(r) for r in kept]


def evidence_in(item: Item, prompt: Sequence[str]) -> tuple[int, int, float]:
    """``(found, known, session recall)`` of ``item``'s evidence in the prompt texts."""
    hit = [any(text in p for p in prompt) for _, _, _, text in item.evidence]
    sessions: dict[str, bool] = {}
    for (_, _, sid, _), h in zip(item.evidence, hit, strict=True):
        sessions[sid] = sessions.get(sid, False) or h
    srec = sum(sessions.values()) / len(sessions) if sessions else 0.0
    return sum(hit), len(hit), srec


def newest_in(item: Item, prompt: Sequence[str]) -> bool:
    """Whether the evidence of the latest answer session (the newest value, where a fact
    changed: knowledge-update questions) is all in the prompt texts."""
    if not item.evidence:
        return False
    last = max(item.evidence)[2]
    return all(any(text in p for p in prompt) for _, _, sid, text in item.evidence if sid == last)


# ---------------------------------------------------------------------------------------
# Baseline retrievers over messages (same passage shape as RetrievalMemory's lines)
# ---------------------------------------------------------------------------------------


def _line_passages(item: Item) -> list[Passage]:
    out = []
    for t in item.turns:
        for pos, m in enumerate(t.messages):
            out.append(
                Passage(
                    text=f"[{item.dates[t.index]}]\n{m.role.value}: {m.content.strip()}",
                    score=0.0,
                    source=f"turn {t.index}",
                    key=turn_key(t.index, pos),
                )
            )
    return out


class BM25Messages:
    """Plain BM25 over every message (``min_score`` -inf)."""

    min_score = float("-inf")

    def __init__(self, item: Item) -> None:
        self.passages = _line_passages(item)
        self.index = BM25Index()
        i = 0
        for t in item.turns:
            for m in t.messages:
                self.index.add(i, m.content)
                i += 1

    def retrieve(self, query: str, *, top_k: int, **_: Any) -> list[Passage]:
        hits = self.index.search(query, top_k * 3)
        return [_scored(self.passages[u], s) for u, s in hits]


class DenseMessages:
    """MiniLM cosine over every message's own text: its ``role: content`` line's first
    ``embed_chars`` characters, as :class:`convo.RetrievalMemory` embeds it (the same
    texts, so one embedding cache serves both)."""

    min_score = float("-inf")

    def __init__(self, item: Item, embedder: Any, embed_chars: int) -> None:
        self.passages = _line_passages(item)
        self.embedder = embedder
        self.vecs = embedder.encode(
            [
                head_text(f"{m.role.value}: {m.content.strip()}", embed_chars)
                for t in item.turns
                for m in t.messages
            ]
        )

    def retrieve(self, query: str, *, top_k: int, **_: Any) -> list[Passage]:
        sims = self.vecs @ self.embedder.encode([query])[0]
        top = np.argsort(-sims)[: top_k * 3]
        return [_scored(self.passages[int(u)], float(sims[u])) for u in top]


def _scored(p: Passage, score: float) -> Passage:
    return Passage(text=p.text, score=score, source=p.source, key=p.key, meta=p.meta)


# ---------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------


@dataclass
class Tally:
    n: int = 0
    all_: int = 0
    srec: float = 0.0
    tokens: int = 0
    seconds: float = 0.0
    abstention: int = 0
    abs_tokens: int = 0
    newest: int = 0

    def summary(self) -> dict[str, Any]:
        n = self.n or 1
        return {
            "questions": self.n,
            "recall_all": round(self.all_ / n, 4) if self.n else None,
            "session_recall": round(self.srec / n, 4) if self.n else None,
            "newest_recall": round(self.newest / n, 4) if self.n else None,
            "mean_prompt_tokens": round(self.tokens / n, 1) if self.n else None,
            "seconds_per_question": round(self.seconds / n, 3) if self.n else None,
            "abstention_questions": self.abstention,
            "abstention_mean_tokens": round(self.abs_tokens / self.abstention, 1)
            if self.abstention
            else None,
        }


def budget_for(name: str, context_tokens: int, top_k: int) -> Budget:
    if name == "defaults" or name.startswith("defaults:"):
        return Budget(context_tokens=context_tokens, max_new_tokens=REPLY_TOKENS)
    if name.startswith("budget:"):  # "budget:SHARE/TOP_K": Budget defaults but these two
        share, k = name.split(":", 1)[1].split("/")
        return Budget(
            context_tokens=context_tokens,
            max_new_tokens=REPLY_TOKENS,
            retrieval_tokens=int(float(share) * context_tokens),
            retrieval_top_k=int(k),
        )
    window = name == "window"
    return Budget(
        context_tokens=context_tokens,
        max_new_tokens=REPLY_TOKENS,
        window_turns=1_000_000 if window else WINDOW_TURNS,
        summary_tokens=0,
        retrieval_tokens=0 if window else context_tokens,
        retrieval_top_k=0 if window else top_k,
    )


def run_item(
    item: Item,
    retriever: Any,
    budgets: Sequence[int],
    counter: TokenCounter,
    name: str,
    top_k: int,
) -> dict[int, tuple[int, int, float, int, bool]]:
    """Per budget ``(found, known, session recall, prompt tokens, newest value found)`` of
    one question."""
    turns = [
        *item.turns,
        Turn(index=len(item.turns), messages=(Message(role=Role.USER, content=item.question),)),
    ]
    out = {}
    for b in budgets:
        budget = budget_for(name, b, top_k)
        passages: list[Passage] = []
        min_score = float("-inf")
        if retriever is not None and budget.retrieval_cap > 0:
            passages = retriever.retrieve(
                item.question, session_id=item.qid, top_k=budget.retrieval_top_k, today=item.question_date
            )
            min_score = retriever.min_score
        plan = plan_prompt(
            budget=budget, counter=counter, turns=turns, passages=passages, min_score=min_score
        )
        prompt = [m.content for m in plan.messages]
        found, known, srec = evidence_in(item, prompt)
        out[b] = (found, known, srec, plan.prompt_tokens, newest_in(item, prompt))
    return out


def evaluate(
    items: Sequence[Item],
    *,
    strategies: Sequence[str],
    budgets: Sequence[int],
    counter: TokenCounter,
    factory: Callable[[str, Item], Any],
    top_k: int = TOP_K,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every strategy on every question; ``results[strategy][budget]`` with
    ``per_question`` rows (what :func:`cross_validate` reads)."""
    results: dict[str, Any] = {}
    for name in strategies:
        rows: dict[int, list[dict[str, Any]]] = {b: [] for b in budgets}
        for item in items:
            t0 = time.perf_counter()
            retriever = factory(name, item)
            built = time.perf_counter() - t0
            got = run_item(item, retriever, budgets, counter, name, top_k)
            secs = (time.perf_counter() - t0) / len(budgets)
            for b, (found, known, srec, tokens, newest) in got.items():
                rows[b].append(
                    {
                        "id": item.qid,
                        "type": item.qtype,
                        "abs": item.abstention,
                        "found": found,
                        "known": known,
                        "srec": round(srec, 4),
                        "newest": newest,
                        "tokens": tokens,
                        "seconds": round(secs, 3),
                        "index_seconds": round(built, 3),
                    }
                )
        results[name] = {str(b): {**summarize(r), "per_question": r} for b, r in rows.items()}
        if progress:
            progress(
                f"{name}: "
                + ", ".join(f"{b}: recall_all={results[name][str(b)]['recall_all']}" for b in budgets)
            )
    return results


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Overall and per type numbers of ``per_question`` rows."""
    per: dict[str, Tally] = defaultdict(Tally)
    for r in rows:
        for key in ("all", r["type"]):
            t = per[key]
            if r["abs"] or not r["known"]:
                t.abstention += 1
                t.abs_tokens += r["tokens"]
                continue
            t.n += 1
            t.all_ += r["found"] == r["known"]
            t.srec += r["srec"]
            t.newest += bool(r.get("newest"))
            t.tokens += r["tokens"]
            t.seconds += r["seconds"]
    out = per.pop("all", Tally()).summary()
    out["per_type"] = {k: per[k].summary() for k in TYPES if k in per}
    return out


def cross_validate(
    results: dict[str, Any], items: Sequence[Item], budget: int, folds: int = 2
) -> dict[str, Any]:
    """Choose among the ``retrieval*`` strategies on the other folds, score on this one."""
    # Alternating within each type, so every fold has every type (alternating over the
    # round-robin order of ``--limit`` would put types 1, 3, 5 in one fold only).
    seen: dict[str, int] = defaultdict(int)
    fold_of = {}
    for it in items:
        fold_of[it.qid] = seen[it.qtype] % folds
        seen[it.qtype] += 1
    cands = [n for n in results if n.startswith("retrieval")]
    out_folds, test_rows = [], []
    for f in range(folds):

        def rows(name: str, train: bool, f: int = f) -> list[dict[str, Any]]:
            return [r for r in results[name][str(budget)]["per_question"] if (fold_of[r["id"]] != f) == train]

        # Ties (a small fold) are broken by session recall on the same training fold.
        train = {n: summarize(rows(n, True)) for n in cands}
        scored = [(train[n]["recall_all"] or 0.0, n) for n in cands]
        best = max(scored, key=lambda x: (x[0], train[x[1]]["session_recall"] or 0.0))
        held = rows(best[1], False)
        test_rows += held
        out_folds.append({"fold": f, "chosen": best[1], "train_recall_all": best[0], "test": summarize(held)})
    return {"budget": budget, "folds": out_folds, "test": summarize(test_rows), "candidates": cands}


def markdown(report: dict[str, Any]) -> str:
    lines = []
    for b in report["budgets"]:
        lines.append(f"\n### {b} tokens\n")
        head = ["strategy", "recall_all", "session", "tokens", "s/q", *SHORT, "update newest"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        entries = [(n, s[str(b)]) for n, s in report["strategies"].items()]
        cv = report.get("cross_validation", {}).get(str(b))
        if cv:
            entries.append(("held-out (" + ", ".join(f["chosen"] for f in cv["folds"]) + ")", cv["test"]))
        for name, s in entries:
            per = s["per_type"]
            cells = [
                name,
                f"{s['recall_all']}",
                f"{s['session_recall']}",
                f"{s['mean_prompt_tokens']}",
                f"{s['seconds_per_question']}",
            ]
            cells += [f"{per[t]['recall_all']}" if t in per else "" for t in TYPES]
            ku = per.get("knowledge-update", {})
            cells.append(f"{ku.get('newest_recall', '')}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    ap.add_argument("--budget", default="2048,4096", help="comma-separated context_tokens")
    ap.add_argument("--limit", type=int)
    ap.add_argument("--types", default="", help="comma-separated question types (default all)")
    ap.add_argument("--strategies", default="window,bm25,dense,retrieval,defaults")
    ap.add_argument("--variants", default="", help=f"comma-separated of {','.join(VARIANTS)}")
    ap.add_argument("--top-k", type=int, default=TOP_K)
    ap.add_argument("--folds", type=int, default=2)
    ap.add_argument(
        "--lexical-only",
        action="store_true",
        help="RetrievalMemory without a model (zero vectors, fusion lexical, no expansion or "
        "episode score): the word side of the ranking and the budgets, on every question in "
        "minutes; 'dense' is then not meaningful",
    )
    ap.add_argument(
        "--precompute",
        action="store_true",
        help="only embed (length-sorted, in large batches, saved as it goes) every text the "
        "strategies need that the embedding cache lacks, then stop: the first run of a new "
        "setting, on a quiet CPU",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument(
        "--embed-cache",
        default=str(DEFAULT_EMBED_CACHE),
        help="an .npz of embeddings kept between runs (outside the repo; '' for none); "
        "default under convo's cache folder",
    )
    args = ap.parse_args(argv)

    from convo.embeddings import Embedder
    from convo.retrieval import RetrievalConfig

    budgets = [int(b) for b in args.budget.split(",") if b.strip()]
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    items = load(args.data, types=types, limit=args.limit)
    embedder: Any = Embedder(cache_size=0)
    if args.embed_cache:
        embedder = CachedEmbeddings(embedder, Path(args.embed_cache))
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    base: dict[str, Any] = {}
    if args.lexical_only:  # no model: the ranking's word side alone, cheap on a busy CPU
        embedder = ZeroEncoder()
        base = dict(LEXICAL_ONLY)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()] + [
        f"retrieval:{v}" for v in variants
    ]
    configs = {
        "retrieval": RetrievalConfig(**base),
        **{f"retrieval:{v}": RetrievalConfig(**{**base, **VARIANTS[v]}) for v in variants},
        **{
            s: RetrievalConfig(**{**base, **VARIANTS[s.split(":", 1)[1]]})
            for s in strategies
            if s.startswith("defaults:")
        },
    }

    def build(name: str, item: Item, encoder: Any) -> Any:
        if name == "window":
            return None
        if name == "bm25":
            return BM25Messages(item)
        if name == "dense":
            return DenseMessages(item, encoder, RetrievalConfig().embed_chars)
        config = configs.get(name, configs["retrieval"])
        if isinstance(encoder, RecordingEncoder):  # a dry run: the vocabulary apart
            config = replace(config, expand_terms=0, expand_query_words=0)
        mem = RetrievalMemory(encoder, config=config)
        mem.remember_turns(item.qid, item.turns, dates=item.dates)
        return mem

    def factory(name: str, item: Item) -> Any:
        built[0] += 1
        if isinstance(embedder, CachedEmbeddings) and built[0] % SAVE_EVERY == 0:
            embedder.save()  # a long first run keeps what it embedded if it is stopped
        return build(name, item, embedder)

    built = [0]
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    if args.precompute:
        if not isinstance(embedder, CachedEmbeddings):
            ap.error("--precompute needs --embed-cache")
        precompute(items, build, strategies, embedder, progress=log)
        return 0

    counter = TiktokenCounter("cl100k_base")
    results = evaluate(
        items,
        strategies=strategies,
        budgets=budgets,
        counter=counter,
        factory=factory,
        top_k=args.top_k,
        progress=log,
    )
    report: dict[str, Any] = {
        "budgets": budgets,
        "strategies": results,
        "settings": {
            "data": Path(args.data).name,
            "questions": len(items),
            "types": types or list(TYPES),
            "top_k": args.top_k,
            "window_turns": WINDOW_TURNS,
            "reply_tokens": REPLY_TOKENS,
            "retrieval": configs["retrieval"].to_dict(),
            "lexical_only": args.lexical_only,
            "variants": {v: VARIANTS[v] for v in variants},
        },
        "environment": environment(),
    }
    if args.folds and len(items) >= args.folds and any(s.startswith("retrieval") for s in results):
        report["cross_validation"] = {str(b): cross_validate(results, items, b, args.folds) for b in budgets}
    if isinstance(embedder, CachedEmbeddings):
        embedder.save()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = (
        f"longmemeval_dev_{'_'.join(map(str, budgets))}"
        + (f"_n{args.limit}" if args.limit else "")
        + ("_lexical" if args.lexical_only else "")
    )
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, s in results.items():
            ax.plot(budgets, [s[str(b)]["recall_all"] or 0 for b in budgets], marker="o", label=name)
        ax.set_xlabel("context tokens")
        ax.set_ylabel("evidence recall (all)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{stem}.png", dpi=100)
    except ImportError:
        pass
    print(json.dumps(report, indent=1) if args.json else markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
