"""What a turn prefills when its session's window slides, with a context shift (CPU, no GPU).

A session on the embedded model (SmolLM2-135M-Instruct) chats ``--turns`` turns of
``--words`` random words (``serve_load.py``'s gpu-chat messages: ~300 tokens), budget
2,048. For every turn the rendered prompt is compared with what the session's KV slot
held after the turn before (that prompt and its reply): the common prefix is reused as
is, and a context shift (:func:`convo.fast.kv_shift.find_shifts`) moves the runs the slot
holds at other positions. Reported per turn: the prompt, the common prefix, the tokens the
longest run moves (``one_run``: the kept turns only) and the runs the scheduler moves,
and what is left to prefill each way: ``prefill`` (the scheduler's: every run, the first
:data:`~convo.fast.kv_shift.SHIFT_AFTER_HEAD_TOKENS` tokens of each run after the kept
turns prefilled), ``prefill_kept`` (the runs up to the kept turns only: the default before
2026-12-07), ``prefill_all_runs`` (every run whole). ``--memory``: with retrieval memory
(``RetrievalMemory``), whose passages of the turns that left the window follow the
question, and which the slot still holds.

The summary is written in the background by the same model (``summary_wait_s=0``), so the
turn after the slide shows a provisional summary: excerpts of the dropped turns, which
the slot still holds.

    python benchmarks/slide_prefill.py            # ~1 min on 2 cores
    python benchmarks/slide_prefill.py --memory   # ~2 min (embeds with MiniLM)

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import stderr_log

from convo import Budget, Session
from convo.fast.kv_shift import find_shift, find_shifts, shifted_tokens
from convo.tokens import common_prefix_length

log = stderr_log("slide_prefill")
WORDS = (
    "the tide came in slowly over the harbour while we argued about the budget for the "
    "new boat and whether the engine would survive another winter on the north coast"
).split()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--words", type=int, default=270, help="words per user turn")
    p.add_argument("--reply-tokens", type=int, default=32)
    p.add_argument("--memory", action="store_true", help="with retrieval memory")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()

    from convo.engines.local import TransformersEngine

    engine = TransformersEngine()
    tok = engine.tokenizer
    prompts: list[Any] = []
    tag = [""]
    generate = engine.generate

    def recording(messages: Any, **options: Any) -> Any:
        users = [m for m in messages if m.role.value == "user"]
        if users and users[-1].content.startswith(tag[0]):  # (not a summary's call)
            prompts.append(list(messages))
        options["max_new_tokens"] = args.reply_tokens
        return generate(messages, **options)

    engine.generate = recording  # type: ignore[method-assign]
    retriever = None
    if args.memory:
        from convo.retrieval import RetrievalMemory

        retriever = RetrievalMemory()
    session = Session(
        engine, budget=Budget(context_tokens=2048, max_new_tokens=64), retriever=retriever, summary_wait_s=0
    )
    rng = random.Random(args.seed)
    held: list[int] | None = None
    turns = []
    for t in range(args.turns):
        tag[0] = f"[s0 t{t}]"
        reply = session.send(f"{tag[0]} " + " ".join(rng.choice(WORDS) for _ in range(args.words)))
        rendered = tok.apply_chat_template(
            [{"role": m.role.value, "content": m.content} for m in prompts[-1]],
            add_generation_prompt=True,
            tokenize=True,
        )
        ids = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
        row: dict[str, Any] = {"turn": t, "prompt": len(ids), "provisional": reply.stats.provisional_summary}
        if held is not None:
            common = common_prefix_length(held, ids)
            one = find_shift(held, ids, start=common, limit=len(ids) - 1)
            runs = find_shifts(held, ids, start=common, limit=len(ids) - 1)
            every = find_shifts(held, ids, start=common, limit=len(ids) - 1, after_head_tokens=0)
            kept = find_shifts(held, ids, start=common, limit=len(ids) - 1, after_head_tokens=None)
            row.update(
                common=common,
                one_run=one.length if one is not None else 0,
                runs=len(runs),
                moved=shifted_tokens(runs),
                prefill_one_run=len(ids) - common - (one.length if one is not None else 0),
                prefill=len(ids) - common - shifted_tokens(runs),
                prefill_all_runs=len(ids) - common - shifted_tokens(every),
                all_runs=len(every),
            )
            row["prefill_kept"] = len(ids) - common - shifted_tokens(kept)
        log(json.dumps(row))
        turns.append(row)
        held = ids + list(tok(reply.text, add_special_tokens=False)["input_ids"])
    ordinary = [r["prefill"] for r in turns[1:] if not r["provisional"] and r["one_run"] == 0]
    slides = [r for r in turns[1:] if r["one_run"] > 0]
    print(
        json.dumps(
            {
                "benchmark": "slide_prefill",
                "config": vars(args),
                "ordinary_prefill_median": sorted(ordinary)[len(ordinary) // 2] if ordinary else None,
                "slide_prefill": [r["prefill"] for r in slides],
                "slide_prefill_one_run": [r["prefill_one_run"] for r in slides],
                "slide_prefill_all_runs": [r["prefill_all_runs"] for r in slides],
                "slide_prefill_kept": [r["prefill_kept"] for r in slides],
                "turns": turns,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
