"""The CPU default path against its alternatives (issue 27 #21): per-turn latency of a
scripted chat on the embedded default model (SmolLM2-135M), fp32 with plain ``generate``
(DynamicKV, ``kv_slots=0``: the CPU default), fp32 with static KV slots (``kv_slots`` 2
and 1) and ``quant="int4"`` (static slots, the CPU default of 2).

Each setting loads its engine and runs one warm-up turn on a throwaway session (the static
decoder captures its step at load; the first call of every path also pays for lazy kernel
set-up). Then every setting runs ``--chats`` scripted chats of ``--turns`` turns, each on a
fresh session, greedy, interleaved (turn 1 of every setting, then turn 2...) so that the
load of a shared machine falls on every setting alike; replies stream to a callback, as
``convo chat`` prints them (``--no-stream``: none). A reply is
``exact`` when its text equals the fp32 DynamicKV reply of the same turn (the reference:
slots change only where the KV lives, so greedy replies should match; int4 changes the
weights, so its replies may differ).

Prints one JSON object on stdout: the environment, and per setting the load seconds, the
warm-up seconds, and per turn the latency, prefill/decode seconds, new tokens, tokens/s and
whether the reply matched; with the medians. Progress goes to stderr.

    PYTHONPATH=. python benchmarks/cpu_default.py [--turns 5] [--chats 2] [--max-new-tokens 48]
        [--settings dynamic,slots2,slots1,int4] [--window 8] [--summary-tokens 256]
        [--sequential] [--threads N] [--out results.json]

    # the CLI's defaults past the window (summaries in the background), one setting at a time
    PYTHONPATH=. python benchmarks/cpu_default.py --turns 12 --chats 1 --max-new-tokens 256 \
        --window 4 --settings dynamic,slots2 --sequential
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import env_info, stderr_log

from convo import Budget, InMemoryStore, Session
from convo.engines.local import KVConfig, TransformersEngine

log = stderr_log("cpu_default")

#: The scripted chat: short user turns, as a person types them.
SCRIPT = (
    "Hi! I'm planning a trip to Lisbon next month.",
    "What should I pack for the weather there?",
    "Which neighbourhoods are good for walking?",
    "Can you suggest a simple three-day plan?",
    "What local food should I try?",
    "Thanks. Summarize my trip plan in two sentences.",
    "One more thing: how do I get from the airport to the centre?",
    "Is it easy to find vegetarian food?",
    "What is the best day trip from the city?",
    "How much should I budget per day?",
    "Which museum should I not miss?",
    "Remind me: which month am I going?",
)
#: The warm-up turn, on its own session.
WARMUP = "Hello, how are you today?"

#: Setting name -> (quant, kv_slots).
SETTINGS: dict[str, tuple[str, int | None]] = {
    "dynamic": ("none", 0),
    "slots2": ("none", 2),
    "slots1": ("none", 1),
    "int4": ("int4", None),
}


class Setting:
    """One engine setting, loaded and warmed up, with the figures of its turns."""

    def __init__(self, name: str, budget: Budget) -> None:
        self.name = name
        self.quant, self.slots = SETTINGS[name]
        t0 = time.perf_counter()
        self.engine = TransformersEngine(quant=self.quant, device="cpu", kv=KVConfig(kv_slots=self.slots))
        self.load_s = time.perf_counter() - t0
        self.budget = budget
        t0 = time.perf_counter()
        Session(self.engine, budget=self.budget, store=InMemoryStore()).send(WARMUP)
        self.warmup_s = time.perf_counter() - t0
        self.rows: list[dict[str, Any]] = []
        self.session: Session | None = None
        log(f"{name}: loaded in {self.load_s:.1f} s, warm-up turn {self.warmup_s:.1f} s")

    def new_chat(self) -> None:
        self.session = Session(self.engine, budget=self.budget, store=InMemoryStore())

    def turn(self, chat: int, i: int, text: str, stream: bool) -> None:
        assert self.session is not None
        pieces: list[str] = []
        t0 = time.perf_counter()
        reply = self.session.send(text, on_text=pieces.append if stream else None)
        latency = time.perf_counter() - t0
        g = reply.stats.generation
        self.rows.append(
            {
                "chat": chat,
                "turn": i,
                "latency_s": round(latency, 4),
                "prompt_tokens": g.prompt_tokens,
                "cached_tokens": g.cached_tokens,
                "prefill_s": round(g.prefill_s, 4),
                "decode_s": round(g.decode_s, 4),
                "new_tokens": g.new_tokens,
                "tokens_per_s": round(g.tokens_per_s, 2),
                "summary_wait_s": round(reply.stats.summarize_s, 4),
                "evicted_turns": reply.stats.evicted_turns,
                "text": reply.text,
            }
        )
        log(
            f"{self.name} chat {chat} turn {i}: {latency:.2f} s, {g.new_tokens} tokens, "
            f"{g.tokens_per_s:.1f} tok/s"
        )

    def result(self) -> dict[str, Any]:
        kv_slots = self.engine.concurrent_calls if self.engine.decoder is not None else 0
        rows = self.rows
        return {
            "quant": self.quant,
            "kv_slots_asked": self.slots,
            "kv_slots": kv_slots,
            "load_s": round(self.load_s, 3),
            "warmup_s": round(self.warmup_s, 3),
            "median_latency_s": round(statistics.median(r["latency_s"] for r in rows), 4),
            "median_decode_s": round(statistics.median(r["decode_s"] for r in rows), 4),
            "median_prefill_s": round(statistics.median(r["prefill_s"] for r in rows), 4),
            "median_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in rows), 2),
            "total_s": round(sum(r["latency_s"] for r in rows), 3),
            "turns": rows,
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=5, help=f"scripted turns per chat (up to {len(SCRIPT)})")
    p.add_argument("--chats", type=int, default=2, help="scripted chats per setting, each on a new session")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma list of " + ", ".join(SETTINGS))
    p.add_argument("--window", type=int, default=8, help="window_turns (8: the CLI's default)")
    p.add_argument("--summary-tokens", type=int, default=256, help="summary cap (0: off; 256 the CLI's)")
    p.add_argument(
        "--sequential",
        action="store_true",
        help="one setting's chats after another's (a chat that summarizes in the background "
        "would otherwise share the CPU with the next setting's turn)",
    )
    p.add_argument(
        "--no-stream",
        action="store_true",
        help="no on_text callback (by default each reply streams, as convo chat prints it)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    names = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        p.error(f"unknown settings {unknown}; choose from {list(SETTINGS)}")
    budget = Budget(
        context_tokens=2048,
        max_new_tokens=args.max_new_tokens,
        window_turns=args.window,
        summary_tokens=args.summary_tokens,
    )
    settings = [Setting(n, budget) for n in names]
    groups = [[s] for s in settings] if args.sequential else [settings]
    # Interleaved (default): turn i of every setting, then turn i + 1, so that the load of
    # a shared machine falls on all settings alike.
    for group in groups:
        for chat in range(1, args.chats + 1):
            for s in group:
                s.new_chat()
            for i, text in enumerate(SCRIPT[: args.turns], 1):
                for s in group:
                    s.turn(chat, i, text, not args.no_stream)
            for s in group:
                assert s.session is not None
                s.session.close()  # (cancels a summary still running)
    results = {s.name: s.result() for s in settings}
    reference = results.get("dynamic")
    for r in results.values():
        if reference is None:
            break
        same = [a["text"] == b["text"] for a, b in zip(r["turns"], reference["turns"], strict=False)]
        for row, s in zip(r["turns"], same, strict=False):
            row["exact"] = s
        r["exact_turns"] = sum(same)
        r["speedup_vs_dynamic"] = round(reference["median_latency_s"] / r["median_latency_s"], 2)
    out = {
        "benchmark": "cpu_default",
        "model": "embedded default (SmolLM2-135M)",
        "env": env_info("cpu") | {"torch_threads": torch.get_num_threads()},
        "config": {
            "turns": args.turns,
            "chats": args.chats,
            "max_new_tokens": args.max_new_tokens,
            "window_turns": args.window,
            "summary_tokens": args.summary_tokens,
            "order": "sequential" if args.sequential else "interleaved",
            "stream": not args.no_stream,
            "sampling": "greedy",
        },
        "settings": results,
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
