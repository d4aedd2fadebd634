"""Host KV offload on the device: copy times, and a chat load with LRU (KV dropped) against
eviction by next use with host memory (issue 22), through the real decode scheduler.

1. Copy: one session's KV of ``--copy-tokens`` tokens out to pinned host memory and back
   (side stream), against prefilling the same tokens.
2. Load: ``--users`` users on ``--slots`` slots (``--slot-tokens`` each), every user a
   thread: ``--turns`` turns of ``--user-tokens`` new tokens and ``--reply-tokens`` back,
   think uniform ``--think`` seconds, starts spread over ``--spread-s``; with
   ``--summary-every N``, a summary (the transcript and 20 instruction tokens, 64 new
   tokens, background priority) after every N-th turn: for next use with ``owner``, for
   LRU as a one-off. Run once per policy on the same decoder. Re-prefill is the prompt
   tokens the scheduler prefilled over the turns' prompt tokens (1.0: nothing reused).
   The share of replies identical in both runs is reported (greedy; batches differ).

GPU (H200):
    python benchmarks/kv_host.py --model random:llama-2-7b                    # 64 users / 16 slots
    python benchmarks/kv_host.py --model random:llama-2-7b --users 16 --turns 12 \\
        --think 2,2 --spread-s 1 --user-tokens 150 --summary-every 4
CPU smoke:
    python benchmarks/kv_host.py --model random:tiny-llama --weights as-loaded --users 4 \\
        --slots 2 --slot-tokens 512 --turns 2 --think 0.1,0.2 --spread-s 0.2 --user-tokens 40

Prints one JSON object (and writes ``kv_host_<device>.json`` under ``--out``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import env_info, pick_device, random_model, stderr_log, sync

from convo.fast import DecodeRequest, DecodeScheduler, PrefillChunk, StaticDecoder
from convo.fast.kv_policy import LRUPolicy, NextUsePolicy
from convo.models import GREEDY, Priority
from convo.models.defaults import default_kv_host_memory

log = stderr_log("kv_host")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))] if values else 0.0


def copy_times(dec: StaticDecoder, tokens: int, device: str) -> dict[str, float]:
    """Median ms of one slot's KV of ``tokens`` out to host and back, and of prefilling them."""
    pool = dec.pool
    pool.set_host_memory(4 * pool.slot_nbytes)
    ids = list(range(1, tokens + 1))
    out, back, prefill = [], [], []
    for _ in range(5):
        sync(device)
        t = time.perf_counter()
        dec.prefill_batch([PrefillChunk(slot=0, ids=ids, start=0, end=tokens)])
        sync(device)
        prefill.append(time.perf_counter() - t)
        t = time.perf_counter()
        assert pool.host is not None
        blocks = pool.host.arena.alloc(pool.host.arena.blocks_for(tokens))
        assert blocks is not None
        event = pool.copy_out(0, tokens, blocks)  # into the arena: nothing is allocated
        if event is not None:
            event.synchronize()
        out.append(time.perf_counter() - t)
        t = time.perf_counter()
        event = pool.copy_in(1, blocks, tokens)
        if event is not None:
            event.synchronize()
        back.append(time.perf_counter() - t)
        pool.host.arena.free(blocks)
    nbytes = pool.host_nbytes(tokens)
    return {
        "tokens": tokens,
        "bytes": nbytes,
        "out_ms": round(1000 * pct(out[1:], 0.5), 2),
        "in_ms": round(1000 * pct(back[1:], 0.5), 2),
        "prefill_ms": round(1000 * pct(prefill[1:], 0.5), 2),
        "in_gb_s": round(nbytes / max(pct(back[1:], 0.5), 1e-9) / 1e9, 1),
    }


def _rss_peak_bytes() -> int:
    """The process's peak resident set (Linux: ``ru_maxrss`` in KiB): with the arena it
    stays near the model's host share plus ``host_reserved_bytes``, not a multiple of it."""
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def chat_load(dec: StaticDecoder, args: argparse.Namespace, policy: str, vocab: int) -> dict[str, Any]:
    pool = dec.pool
    for key in pool.owners():
        pool.forget(key)
    pool.policy = LRUPolicy() if policy == "lru" else NextUsePolicy()
    pool.set_host_memory(0 if policy == "lru" else args.host_bytes)
    sched = DecodeScheduler(dec)
    before = sched.stats()
    lo, hi = (float(x) for x in args.think.split(","))
    lock = threading.Lock()
    ttft: list[float] = []
    turn_s: list[float] = []
    replies: dict[tuple[int, int], list[int]] = {}
    requested = [0]

    def user(u: int) -> None:
        rng = random.Random(u)
        time.sleep(rng.uniform(0, args.spread_s))
        ids = [rng.randrange(100, vocab - 1) for _ in range(60)]
        for turn in range(args.turns):
            ids = ids + [rng.randrange(100, vocab - 1) for _ in range(args.user_tokens)]
            # The window slides as a session's does: the 60 "system" tokens stay, the oldest
            # turns go, so the prompt, its reply and a summary's 84 tokens fit the slot.
            over = len(ids) + args.reply_tokens + 84 - args.slot_tokens
            if over > 0:
                step = args.user_tokens + args.reply_tokens
                ids = ids[:60] + ids[60 + step * -(-over // step) :]
            req = DecodeRequest(
                ids=ids, max_new_tokens=args.reply_tokens, deadline=time.monotonic() + 600, sampling=GREEDY,
                cache_key=f"u{u}",
            )  # fmt: skip
            sched.run(req)
            with lock:
                requested[0] += len(ids)
                ttft.append((req.first_token_at or req.finished_at or 0) - req.started_at)
                turn_s.append((req.finished_at or 0) - req.started_at)
                replies[u, turn] = req.new_ids
            ids = ids + req.new_ids
            if args.summary_every and (turn + 1) % args.summary_every == 0:
                owner = f"u{u}" if policy != "lru" else None
                sched.submit(
                    DecodeRequest(
                        ids=ids + [rng.randrange(100, vocab - 1) for _ in range(20)],
                        max_new_tokens=64,
                        deadline=time.monotonic() + 600,
                        sampling=GREEDY,
                        priority=Priority.BACKGROUND,
                        owner=owner,
                    )
                )
            time.sleep(rng.uniform(lo, hi))

    threads = [threading.Thread(target=user, args=(u,)) for u in range(args.users)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    while not sched.idle:
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    after = sched.stats()
    sched.close()
    prefilled = after.prompt_tokens - before.prompt_tokens
    return {
        "policy": policy,
        "wall_s": round(wall, 2),
        "reprefill": round(prefilled / max(requested[0], 1), 3),
        "prefilled_prompt_tokens": prefilled,
        "requested_prompt_tokens": requested[0],
        "preemptions": after.preemptions - before.preemptions,
        "swaps_out": after.swaps_out - before.swaps_out,
        "swaps_in": after.swaps_in - before.swaps_in,
        "swap_bytes": after.swap_bytes - before.swap_bytes,
        "host_bytes_peak": after.host_bytes_peak,
        "host_reserved_bytes": after.host_reserved_bytes,
        "rss_peak_bytes": _rss_peak_bytes(),
        "host_dropped": after.host_dropped - before.host_dropped,
        "ttft_p50_s": round(pct(ttft, 0.5), 3),
        "ttft_p95_s": round(pct(ttft, 0.95), 3),
        "turn_p95_s": round(pct(turn_s, 0.95), 3),
        "_replies": replies,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--weights", default="int4", choices=["int4", "as-loaded"])
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--slot-tokens", type=int, default=2048)
    p.add_argument("--users", type=int, default=64)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--think", default="3,8", help="think time range in seconds: lo,hi")
    p.add_argument("--spread-s", type=float, default=10.0)
    p.add_argument("--user-tokens", type=int, default=300)
    p.add_argument("--reply-tokens", type=int, default=32)
    p.add_argument("--summary-every", type=int, default=0)
    p.add_argument("--copy-tokens", type=int, default=1700)
    p.add_argument("--host-bytes", type=int, default=None, help="default: the engine's (from the RAM)")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    args.host_bytes = args.host_bytes or default_kv_host_memory()

    gpu, device, name = pick_device(args.model)
    model = random_model(name, device)
    t = time.perf_counter()
    dec = StaticDecoder(
        model, slots=args.slots, slot_tokens=args.slot_tokens, weights=args.weights, free_dense=True
    )
    dec.warmup()
    warm = time.perf_counter() - t
    log(f"{name} {args.weights}: {args.slots} slots of {args.slot_tokens}, warm-up {warm:.1f}s")
    result: dict[str, Any] = {"model": name, "env": env_info(device), "args": vars(args)}
    result["copy"] = copy_times(dec, min(args.copy_tokens, args.slot_tokens - 1), device)
    log(f"copy: {result['copy']}")
    runs = []
    for policy in ("lru", "next-use+host"):
        run = chat_load(dec, args, policy, dec.vocab_size)
        log(f"{policy}: { {k: v for k, v in run.items() if k != '_replies'} }")
        runs.append(run)
    a, b = runs[0]["_replies"], runs[1]["_replies"]
    same = sum(a[k] == b.get(k) for k in a) / max(len(a), 1)
    for run in runs:
        del run["_replies"]
    result["runs"] = runs
    # Batches differ between the runs, and batched kernels may round differently: this is a
    # sanity figure; exactness is tests/fast/test_kv_host.py's (one session at a time).
    result["replies_identical_fraction"] = round(same, 3)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"kv_host_{'gpu' if gpu else 'cpu'}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
