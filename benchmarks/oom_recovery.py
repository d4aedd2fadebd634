"""A real CUDA out-of-memory error inside a turn, and convo's recovery from it.

The GPU is filled with a ballast tensor until a session's full plan no longer fits, then
the session sends a turn: the engine hits ``torch.OutOfMemoryError`` during prefill, frees
the session's cache and the allocator's cached blocks, and the session retries once with
half the window. Prints JSON: the recovery note, prompt tokens of both plans, and whether
the stored history is intact.

    python benchmarks/oom_recovery.py --model random:llama-2-7b --quant nf4
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def run(
    engine: Any, *, turn_words: int = 300, window: int = 8, headroom_fraction: float = 0.85
) -> dict[str, Any]:
    """Fill the GPU so the full plan cannot fit but half of it can; send one turn."""
    import torch

    import convo

    budget = convo.Budget(
        context_tokens=4096, max_new_tokens=16, window_turns=window, summary_tokens=0, summarize_batch_turns=1
    )
    session = convo.Session(engine, budget=budget)
    for i in range(window + 1):
        session.add(
            convo.user(f"Turn {i}. " + "the quick brown fox jumps over the lazy dog " * (turn_words // 9))
        )
        session.add(convo.assistant(f"Noted {i}."))
    full = session.plan("What was in turn 3?")
    need = (full.prompt_tokens + budget.max_new_tokens) * engine.kv_bytes_per_token
    engine.release_all()
    free, _total = torch.cuda.mem_get_info()
    ballast = torch.empty(free - int(headroom_fraction * need), dtype=torch.uint8, device="cuda")
    before = len(session.store.load(session.id)[1])
    result: dict[str, Any] = {
        "full_plan_prompt_tokens": full.prompt_tokens,
        "full_plan_kv_bytes": need,
        "headroom_fraction": headroom_fraction,
        "free_after_ballast_bytes": torch.cuda.mem_get_info()[0],
    }
    try:
        reply = session.send("What was in turn 3?")
        g = reply.stats.generation
        result.update(
            ok=True,
            oom_retries=reply.stats.oom_retries,
            recovery=reply.stats.recovery,
            retry_prompt_tokens=reply.stats.prompt_tokens,
            finish_reason=reply.finish_reason.value,
            peak_reserved_bytes=g.peak_reserved_bytes if g else None,
        )
    except convo.DeviceOutOfMemory as exc:
        result.update(ok=False, error=str(exc)[:300])
    after = session.store.load(session.id)[1]
    result.update(
        stored_messages_before=before,
        stored_messages_after=len(after),
        history_intact=after[:before] == session.messages[:before],
    )
    del ballast
    session.close()
    torch.cuda.empty_cache()
    return result


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="random:llama-2-7b")
    p.add_argument("--quant", default="nf4")
    p.add_argument(
        "--headroom-fraction",
        type=float,
        default=0.85,
        help="free memory left = this x the KV bytes of the full plan",
    )
    args = p.parse_args()

    import convo

    engine = convo.TransformersEngine(args.model, quant=args.quant, prefill_chunk_tokens=256)
    print(json.dumps(run(engine, headroom_fraction=args.headroom_fraction)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
