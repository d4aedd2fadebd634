"""Retrieval latency: milliseconds per query at 10,000 stored turns, query embedding included.

Builds one :class:`convo.retrieval.RetrievalMemory` session of ``--turns`` synthetic turns (a user
and an assistant message each, named speakers, dates, a Zipf-distributed vocabulary so
BM25 posting lists look like real text), then times :meth:`RetrievalMemory.retrieve` for
``--queries`` distinct questions: each is embedded by the real model (the embedder's
cache is off), searched in FAISS and BM25, fused and ranked with the given
:class:`~convo.retrieval.RetrievalConfig`. Reported per ``top_k``: mean, median and p90
milliseconds per query, the embedding alone, the search alone (the same queries
again with their vectors cached), and as in a live chat (``retrieve_after_new_turn``: one
more turn indexed before each query, its indexing timed apart). The load average is recorded: on a
shared CPU the numbers measure the neighbours too.

``--store-encoder hash`` stores hashed bag-of-words vectors instead of model vectors (the
search cost does not depend on the vectors' values; only the queries need the model): a
quick run when the CPU is busy.

Usage::

    python benchmarks/retrieval_speed.py [--turns 10000] [--queries 200] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from convo.embeddings import Embedder
from convo.messages import Message, Role
from convo.plan import Turn
from convo.retrieval import RetrievalConfig, RetrievalMemory, terms

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


def measure(memory: RetrievalMemory, qs: Sequence[str], top_k: int) -> dict[str, float]:
    times = []
    for q in qs:
        t0 = time.perf_counter()
        memory.retrieve(q, session_id="s", top_k=top_k)
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return {
        "min_ms": round(times[0], 2),
        "mean_ms": round(statistics.fmean(times), 2),
        "median_ms": round(statistics.median(times), 2),
        "p90_ms": round(times[int(0.9 * (len(times) - 1))], 2),
    }


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
    times.sort()
    return {
        "min_ms": round(times[0], 2),
        "mean_ms": round(statistics.fmean(times), 2),
        "median_ms": round(statistics.median(times), 2),
        "p90_ms": round(times[int(0.9 * (len(times) - 1))], 2),
        "index_turn_ms": {"median": round(statistics.median(index), 2), "max": round(max(index), 2)},
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=10_000, help="stored turns (default 10,000)")
    ap.add_argument("--queries", type=int, default=200, help="timed queries (default 200)")
    ap.add_argument("--top-k", default="6,40", help="retrieve top_k values timed (default 6,40)")
    ap.add_argument("--store-encoder", choices=["model", "hash"], default="model")
    ap.add_argument("--embedder", help="sentence-transformers model path (default MiniLM)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch and FAISS (OpenMP) threads (default 1: one short query gains nothing from more, "
        "and on a shared CPU more threads only wait for each other; 0 leaves the libraries' defaults)",
    )
    ap.add_argument(
        "--config",
        default="{}",
        help="RetrievalConfig overrides as JSON, e.g. '{\"neighbour_weight\": 0}' (default: the defaults)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    try:
        overrides = json.loads(args.config)
        config = RetrievalConfig(**overrides)
    except (ValueError, TypeError) as exc:
        ap.error(f"--config: {exc}")

    if args.threads:
        import faiss
        import torch

        torch.set_num_threads(args.threads)
        faiss.omp_set_num_threads(args.threads)
    query_encoder = Embedder(args.embedder, cache_size=0)
    encoder: Any = query_encoder
    if args.store_encoder == "hash":
        encoder = SplitEncoder(HashEncoder(query_encoder.dim), query_encoder)
    memory = RetrievalMemory(encoder, config=config)
    ks = [int(k) for k in args.top_k.split(",")]
    # The stored turns, then the ones a chat adds before each timed query.
    turns, dates = synthetic_turns(args.turns + args.queries * len(ks), args.seed)
    turns, later = turns[: args.turns], turns[args.turns :]
    t0 = time.perf_counter()
    memory.remember_turns("s", turns, dates={t.index: dates[t.index] for t in turns})
    index_s = time.perf_counter() - t0
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    qs = questions(args.queries + 20, args.seed)
    for q in qs[:20]:  # warm-up: model, FAISS, caches
        memory.retrieve(q, session_id="s", top_k=6)
    qs = qs[20:]
    embed = []
    for q in qs:
        t0 = time.perf_counter()
        query_encoder.encode([q + " (embed only)"])
        embed.append((time.perf_counter() - t0) * 1000)
    embed.sort()
    embed_ms = statistics.median(embed)
    results = {f"top_k={k}": measure(memory, qs, int(k)) for k in args.top_k.split(",")}
    # The same queries again with their vectors cached: the search alone.
    query_encoder.cache_size = 2 * len(qs) + 10
    for q in qs:
        memory.retrieve(q, session_id="s", top_k=6)
    search_only = {f"top_k={k}": measure(memory, qs, int(k)) for k in args.top_k.split(",")}
    query_encoder.cache_size = 0
    chat_qs = questions(len(qs), args.seed + 100)  # not seen yet: embedded again
    chat = {
        f"top_k={k}": measure_chat(memory, chat_qs, k, later[i * len(qs) : (i + 1) * len(qs)], dates)
        for i, k in enumerate(ks)
    }
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    report = {
        "turns": args.turns,
        "units": sum(len(t.messages) for t in turns),
        "queries": len(qs),
        "index_kind": memory._sessions["s"].vectors.kind if memory._sessions["s"].vectors else None,
        "store_encoder": args.store_encoder,
        "index_seconds": round(index_s, 1),
        "query_embedding_ms": {"min": round(embed[0], 2), "median": round(embed_ms, 2)},
        "threads": args.threads,
        "retrieve": results,
        "search_only": search_only,
        "retrieve_after_new_turn": chat,
        "retrieval": config.to_dict(),
        "environment": {
            "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "load_average_start": [round(x, 2) for x in load_start] if load_start else None,
            "load_average_end": [round(x, 2) for x in load] if load else None,
        },
    }
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"{args.turns} turns ({report['index_kind']}), query embedding median {embed_ms:.1f} ms")
        for k, r in results.items():
            print(
                f"  retrieve {k}: min {r['min_ms']} ms, median {r['median_ms']} ms, "
                f"mean {r['mean_ms']} ms, p90 {r['p90_ms']} ms; search alone median "
                f"{search_only[k]['median_ms']} ms; after a new turn median {chat[k]['median_ms']} ms "
                f"(indexing the turn {chat[k]['index_turn_ms']['median']} ms)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
