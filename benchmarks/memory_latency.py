"""What retrieval memory adds to a whole chat turn, on the real model.

A :class:`convo.Session` on the embedded default model (SmolLM2-135M, CPU) with a
:class:`convo.RetrievalMemory` holds a whole LoCoMo conversation (replayed with its session
dates: about 200 turns), then is asked that conversation's questions with ``send`` as a user
would, each a full turn: index the last completed turn, retrieve, plan, generate. Each
configuration (the default, and the retrieval of the fourth round: no time-aware scoring,
second-hop seeds from any day, no query expansion) reports per turn the wall time, the
model's time (``generate_s``), the planning before it (``plan_s``: indexing, retrieval,
prompt), the retrieval (``retrieve``, query embedding included) and the indexing of the turn
that completed (``remember_turns``); and the indexing per turn while the history is replayed
(each turn indexed as the next starts, as in a chat).

Usage::

    python benchmarks/memory_latency.py --data PATH/locomo-dev.json [--conversation conv-26]
        [--questions 12] [--max-new-tokens 32] [--json] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import convo
from benchmarks._common import env_info
from benchmarks.locomo import HEADLINE_CATEGORIES, RETRIEVAL_VARIANTS, load, replay
from convo.retrieval import RetrievalConfig, RetrievalMemory

#: The configurations compared: name -> RetrievalConfig overrides of the default.
CONFIGS: dict[str, dict[str, Any]] = {"default": {}, "fourth": RETRIEVAL_VARIANTS["fourth"]}


class _Timed:
    """Wall time of each call of ``fn``, in ms."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.ms: list[float] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.ms.append(1000 * (time.perf_counter() - t0))


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {"median": round(statistics.median(values), 2), "max": round(max(values), 2)}


def run_config(
    engine: Any, conv: Any, overrides: dict[str, Any], *, questions: int, max_new_tokens: int
) -> dict[str, Any]:
    memory = RetrievalMemory(config=RetrievalConfig(**overrides))
    retrieve, remember = _Timed(memory.retrieve), _Timed(memory.remember_turns)
    memory.retrieve, memory.remember_turns = retrieve, remember  # type: ignore[method-assign]
    session = convo.Session(
        engine,
        retriever=memory,
        # Retrieval only (no summaries), as in benchmarks/locomo.py's window+retrieval.
        budget=convo.Budget(
            context_tokens=2048, max_new_tokens=max_new_tokens, summary_tokens=0, retrieval_top_k=40
        ),
        session_id=f"latency-{conv.sample_id}",
    )
    t0 = time.perf_counter()
    replay(conv, session)  # each completed turn is indexed as the next one starts, as in a chat
    replay_s = time.perf_counter() - t0
    indexed = list(remember.ms)
    asked = [q for q in conv.questions if q.category in HEADLINE_CATEGORIES][:questions]
    turns = []
    for q in asked:
        before = len(remember.ms)
        t0 = time.perf_counter()
        reply = session.send(q.question)
        turns.append(
            {
                "wall_s": round(time.perf_counter() - t0, 3),
                "generate_s": round(reply.stats.generate_s, 3),
                "plan_s": round(reply.stats.plan_s, 3),
                "prompt_tokens": reply.stats.prompt_tokens,
                "passages_used": reply.stats.passages_used,
                "retrieve_ms": round(retrieve.ms[-1], 2),
                "remember_ms": round(sum(remember.ms[before:]), 2),
            }
        )
    wall = sum(t["wall_s"] for t in turns)
    return {
        "replay": {"turns": len(indexed), "seconds": round(replay_s, 1), "remember_ms": _stats(indexed)},
        "turns": turns,
        "summary": {
            "wall_s": _stats([t["wall_s"] for t in turns]),
            "generate_s": _stats([t["generate_s"] for t in turns]),
            "plan_s": _stats([t["plan_s"] for t in turns]),
            "retrieve_ms": _stats([t["retrieve_ms"] for t in turns]),
            "remember_ms": _stats([t["remember_ms"] for t in turns]),
            "memory_share_of_wall": round(
                sum(t["retrieve_ms"] + t["remember_ms"] for t in turns) / 1000 / max(wall, 1e-9), 4
            ),
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="path to a LoCoMo JSON file")
    ap.add_argument("--conversation", default="conv-26", help="sample id (default conv-26)")
    ap.add_argument("--questions", type=int, default=12, help="questions asked (categories 1-4)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--json", action="store_true", help="print the whole result as JSON")
    ap.add_argument("--out", default="benchmarks/results", help="folder for memory_latency.json")
    args = ap.parse_args()
    conv = next((c for c in load(args.data) if c.sample_id == args.conversation), None)
    if conv is None:
        ap.error(f"no conversation {args.conversation!r} in {args.data}")
    from convo.engines.local.engine import TransformersEngine

    engine = TransformersEngine()
    engine.generate([convo.Message(role=convo.Role.USER, content="Hello")], max_new_tokens=4)  # warm up
    result: dict[str, Any] = {
        "benchmark": "memory_latency",
        "conversation": conv.sample_id,
        "lines": len(conv.lines),
        "max_new_tokens": args.max_new_tokens,
        "env": env_info("cpu"),
        "configs": {},
    }
    for name in args.configs.split(","):
        result["configs"][name] = run_config(
            engine, conv, CONFIGS[name], questions=args.questions, max_new_tokens=args.max_new_tokens
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory_latency.json").write_text(json.dumps(result, indent=1))
    brief = {k: {"replay": v["replay"], **v["summary"]} for k, v in result["configs"].items()}
    print(json.dumps(result if args.json else brief, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
