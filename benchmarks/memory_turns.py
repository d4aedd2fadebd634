"""Prompt tokens a chat with retrieval memory runs through the model, turn by turn.

A :class:`convo.Session` on the embedded default model (SmolLM2-135M, CPU) with a
:class:`convo.RetrievalMemory` and a small window (4 turns, summaries of 2), so turns leave
the window early and later questions retrieve them. Each turn reports its prompt tokens,
the tokens whose KV came from the previous turn (``cached_tokens``), the tokens run
(``prefill_tokens``), the memory's tokens and whether the window slid (turns left it). The summary line
is the mean of ``prefill_tokens`` over turns that carried memory, split by slide.

The memory message sits after the question being answered, so on a turn where the window
did not slide only the previous reply, the new message and the memory run again.

Usage::

    python benchmarks/memory_turns.py [--json] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import convo
from benchmarks._common import env_info

FACTS = [
    "My sister Ana lives in Lisbon and teaches piano.",
    "I adopted a grey cat called Miso in March.",
    "Our team ships the billing service on Fridays.",
    "I am allergic to peanuts and shellfish.",
    "The wifi password at the cabin is pine-4412.",
    "My favourite band is Khruangbin.",
    "I run 10 km every Sunday along the river.",
    "The budget review moved to the 14th.",
]
QUESTIONS = [
    "Where does my sister live?",
    "What is my cat called?",
    "What is the cabin wifi password?",
    "When do we ship billing?",
    "What am I allergic to?",
    "Which band do I like?",
]


def run(max_new_tokens: int) -> dict[str, Any]:
    from convo.engines.local.engine import TransformersEngine

    session = convo.Session(
        TransformersEngine(),
        retriever=convo.RetrievalMemory(),
        system_prompt="You are a helpful assistant.",
        budget=convo.Budget(
            context_tokens=1024, max_new_tokens=max_new_tokens, window_turns=4, summarize_batch_turns=2
        ),
    )
    turns = []
    evicted = 0
    for i, text in enumerate(FACTS + QUESTIONS):
        started = time.monotonic()
        reply = session.send(text)
        g = reply.stats.generation
        turns.append(
            {
                "turn": i + 1,
                "prompt_tokens": reply.stats.prompt_tokens,
                "cached_tokens": g.cached_tokens,
                "prefill_tokens": g.prefill_tokens,
                "memory_tokens": reply.stats.parts.get("retrieved", 0),
                "window_slid": reply.stats.evicted_turns > evicted,  # older turns left: the prefix changed
                "prefill_s": round(g.prefill_s, 3),
                "latency_s": round(time.monotonic() - started, 3),
            }
        )
        evicted = reply.stats.evicted_turns
    memory = [t for t in turns if t["memory_tokens"]]

    def mean(rows: list[dict[str, Any]]) -> float | None:
        return round(statistics.mean(t["prefill_tokens"] for t in rows), 1) if rows else None

    return {
        "benchmark": "memory_turns",
        "env": env_info("cpu"),
        "turns": turns,
        "summary": {
            "memory_turns": len(memory),
            "prefill_tokens_mean_memory_turns_no_slide": mean([t for t in memory if not t["window_slid"]]),
            "prefill_tokens_mean_memory_turns_slide": mean([t for t in memory if t["window_slid"]]),
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--json", action="store_true", help="print the whole result as JSON")
    ap.add_argument("--out", default="benchmarks/results", help="folder for memory_turns.json")
    args = ap.parse_args()
    result = run(args.max_new_tokens)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory_turns.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result if args.json else result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
