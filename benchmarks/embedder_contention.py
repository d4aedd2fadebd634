"""A question's vector beside a busy Python thread: the embedding model in this process or in
a child process of its own (``Embedder(process=True)``, what ``convo serve`` runs; issue 24).

A server's engine loop is a Python thread that is almost never idle. A model run in the
same process then waits for the GIL between its operations (every layer of a MiniLM is a
few dozen of them), and a retrieval's question vector waits with it. This times one
question (~600 characters, the length retrieval embeds) alone and beside ``--busy`` threads
that spin in Python, for both placements, and prints JSON.

    python benchmarks/embedder_contention.py [--model PATH] [--busy 1] [--repeats 20] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from convo.embeddings import Embedder, default_process_threads

QUESTION = (
    "the tide came in slowly over the harbour while we argued about the budget for the new boat "
    "and whether the engine would survive another winter on the north coast "
) * 4


def _times(embedder: Embedder, repeats: int) -> list[float]:
    out = []
    for i in range(repeats):
        text = f"{i} {time.time_ns()} {QUESTION}"[:600]  # new text each time: no cache
        started = time.perf_counter()
        embedder.encode([text])
        out.append(time.perf_counter() - started)
    return out


def measure(embedder: Embedder, busy: int, repeats: int) -> dict[str, Any]:
    _times(embedder, 3)  # warm up
    alone = _times(embedder, repeats)
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i

    spinners = [threading.Thread(target=spin, daemon=True) for _ in range(busy)]
    for t in spinners:
        t.start()
    try:
        beside = _times(embedder, repeats)
    finally:
        stop.set()
        for t in spinners:
            t.join()
    return {
        "alone_ms_p50": round(1000 * statistics.median(alone), 1),
        "beside_busy_ms_p50": round(1000 * statistics.median(beside), 1),
        "beside_busy_ms_max": round(1000 * max(beside), 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a local sentence-transformers folder (default: MiniLM)")
    p.add_argument("--busy", type=int, default=1, help="Python threads spinning beside the calls (1)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=None, help="torch threads of the child (half the cores)")
    p.add_argument("--out", default=None, help="folder for embedder_contention.json")
    args = p.parse_args()
    results: dict[str, Any] = {}
    here = Embedder(args.model, cache_size=0, word_cache=False)
    results["in_process"] = measure(here, args.busy, args.repeats)
    threads = args.threads or default_process_threads()
    there = Embedder(args.model, cache_size=0, word_cache=False, process=True, threads=threads)
    try:
        results["child_process"] = {**measure(there, args.busy, args.repeats), "threads": threads}
    finally:
        there.close()
    results["beside_busy_in_process_over_child"] = round(
        results["in_process"]["beside_busy_ms_p50"] / results["child_process"]["beside_busy_ms_p50"], 1
    )
    report = {
        "benchmark": "embedder_contention",
        "config": {"model": args.model or "MiniLM", "busy_threads": args.busy, "repeats": args.repeats},
        "hardware": {"cpus": os.cpu_count()},
        "results": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "embedder_contention.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
