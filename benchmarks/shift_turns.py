"""Whole turns through the SDK with a context shift (CPU): what each turn prefills and how
long it takes, with memory's passages moved less their heads or not moved at all.

A ``Session`` on the embedded model (SmolLM2-135M-Instruct), 2 static KV slots with a
context shift and ``--host-memory`` bytes of host KV (left out: the engine's default,
twice the slots' pool on CPU since 2026-12-07; 0, the CPU default before: then the
background summary takes the session's slot at the slide and nothing is left to shift),
budget 2,048, summaries in the background (the turn after the slide shows a provisional
one), ``RetrievalMemory`` unless ``--no-memory``, ``--turns`` user turns of ~300 tokens
(``slide_prefill.py``'s). ``--head K`` sets ``find_shifts``'s ``after_head_tokens`` for the
scheduler and the host copy-back (``none``: runs after the kept turns are not moved, the
default before 2026-12-07).

    python benchmarks/shift_turns.py --head 32     # ~1 min on 2 cores
    python benchmarks/shift_turns.py --head none

Prints one JSON object: per turn the seconds, prompt and prefilled tokens, and whether
the summary shown was provisional.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slide_prefill import WORDS

import convo.fast.kv_pool as kv_pool
import convo.fast.scheduler as scheduler
from convo import Budget, Session
from convo.fast.kv_shift import find_shifts
from convo.session import SummaryConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--head", default="32", help="after_head_tokens, or none")
    p.add_argument("--host-memory", type=int, default=None, help="bytes of host KV (default: the engine's)")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--words", type=int, default=270)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    head = None if args.head == "none" else int(args.head)

    def shifts(*a: Any, **k: Any) -> Any:
        k.setdefault("after_head_tokens", head)
        return find_shifts(*a, **k)

    scheduler.find_shifts = shifts  # type: ignore[assignment]
    kv_pool.find_shifts = shifts  # type: ignore[assignment]

    from convo.engines.local import KVConfig, TransformersEngine
    from convo.retrieval import RetrievalMemory

    engine = TransformersEngine(kv=KVConfig(kv_slots=2, context_shift=True, kv_host_memory=args.host_memory))
    session = Session(
        engine,
        budget=Budget(context_tokens=2048, max_new_tokens=64),
        retriever=None if args.no_memory else RetrievalMemory(),
        summarizing=SummaryConfig(wait_s=0),
    )
    rng = random.Random(args.seed)
    turns = []
    for t in range(args.turns):
        started = time.perf_counter()
        reply = session.send(" ".join(rng.choice(WORDS) for _ in range(args.words)))
        gen = reply.stats.generation
        turns.append(
            {
                "turn": t,
                "seconds": round(time.perf_counter() - started, 2),
                "prompt": gen.prompt_tokens,
                "prefilled": gen.prefill_tokens,
                "provisional": reply.stats.provisional_summary,
                "evicted_turns": reply.stats.evicted_turns,
                "summarized_turns": reply.stats.summarized_turns,
                "parts": dict(reply.stats.parts),
            }
        )
    print(
        json.dumps(
            {
                "benchmark": "shift_turns",
                "config": vars(args),
                "kv_host_memory": engine.kv_host_memory,
                "turns": turns,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
