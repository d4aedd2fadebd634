"""How long planning one new turn takes over a long history.

Builds a session with ``--messages`` messages (alternating user / assistant, 20-80 words
each), then times, for ``--turns`` new turns: adding the user message and planning the
prompt (``Session.plan``: cached per-message counts, the pure planner, and the exact check of
the rendered prompt). Counters: the default model's tokenizer + chat template
(``hf``) and tiktoken cl100k (``tiktoken``).

    python benchmarks/plan_speed.py --messages 10000 --json

Prints one JSON object with hardware, versions and, per counter, the median / p95 of the
whole step and of its parts (planner alone, exact check).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from typing import Any

WORDS = "lisbon flight may tea walk sea museum tram tile river bridge castle fado pastry coffee".split()


def make_text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 80)))


def bench(counter: Any, n_messages: int, turns: int) -> dict[str, Any]:
    import convo
    from convo.plan import plan_prompt

    rng = random.Random(0)
    budget = convo.Budget(context_tokens=4096, max_new_tokens=256, window_turns=8)
    session = convo.Session(counter=counter, budget=budget, system_prompt="You are a helpful assistant.")
    t0 = time.perf_counter()
    for i in range(n_messages):
        session.add(convo.user(make_text(rng)) if i % 2 == 0 else convo.assistant(make_text(rng)))
    build_s = time.perf_counter() - t0
    session.plan()  # counts the window once, as the previous turns would have
    steps, planner, exact = [], [], []
    for _ in range(turns):
        session.add(convo.assistant(make_text(rng)))
        t = time.perf_counter()
        session.add(convo.user(make_text(rng)))
        plan = session.plan()
        steps.append(time.perf_counter() - t)
        # The parts, timed alone on the same state.
        window = session.turns(session.evicted_turns)
        t = time.perf_counter()
        plan_prompt(
            budget=budget, counter=counter, turns=window, pinned=session._pinned, summary=session.summary
        )
        planner.append(time.perf_counter() - t)
        t = time.perf_counter()
        counter.count_prompt(plan.messages)
        exact.append(time.perf_counter() - t)

    def ms(xs: list[float]) -> dict[str, float]:
        xs = sorted(xs)
        return {
            "median_ms": round(statistics.median(xs) * 1e3, 3),
            "p95_ms": round(xs[int(0.95 * (len(xs) - 1))] * 1e3, 3),
        }

    return {
        "history_messages": len(session.messages),
        "prompt_tokens": plan.prompt_tokens,
        "turns_timed": turns,
        "build_history_s": round(build_s, 2),
        "add_and_plan": ms(steps),
        "planner_only": ms(planner),
        "exact_count": ms(exact),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--messages", type=int, default=10_000)
    p.add_argument("--turns", type=int, default=200)
    p.add_argument("--counters", default="hf,tiktoken")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    import convo

    result: dict[str, Any] = {
        "hardware": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "processor": platform.processor(),
        },
        "versions": {"python": sys.version.split()[0]},
        "results": {},
    }
    for name in args.counters.split(","):
        if name == "hf":
            from transformers import AutoTokenizer

            from convo.engines.local.loading import default_model_path

            tok = AutoTokenizer.from_pretrained(str(default_model_path()), local_files_only=True)
            counter: Any = convo.HFTokenCounter(tok)
        else:
            counter = convo.TiktokenCounter("cl100k_base")
        result["results"][name] = bench(counter, args.messages, args.turns)
    if args.json:
        print(json.dumps(result))
    else:
        for name, r in result["results"].items():
            step = r["add_and_plan"]
            print(
                f"{name:9s} {r['history_messages']} messages: add+plan median {step['median_ms']} ms "
                f"(p95 {step['p95_ms']}), planner {r['planner_only']['median_ms']} ms, "
                f"exact check {r['exact_count']['median_ms']} ms"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
