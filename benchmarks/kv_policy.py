"""Eviction by expected next use against LRU, on the chat loads of issue 22, simulated.

No model and no device: the real :class:`~convo.fast.kv_pool.KVSlotPool` (one-float
tensors, host memory on the CPU) under a fake clock, and the scheduler's admission rules
re-enacted over a fake step whose time is a model of the H200's (``--prefill-tps``,
``--step-s``). The re-enactment is of the admission rules before the background rules of
``benchmarks/kv_sched.py`` (slot share, parking, waits), which drives the scheduler's own
code with window slides and summaries: use that one for background work.

Users arrive spread over ``--spread-s``, each turn sends ``--user-tokens`` new tokens and
gets ``--reply-tokens`` back, then the user thinks uniform
``--think-lo``..``--think-hi`` seconds. With ``--summary-every N`` a rolling summary of the
session (its transcript and an instruction, 64 new tokens) is queued at background
priority after every N-th turn.

Each policy is run on the same seeded load:

* ``lru`` (main before issue 22): LRU eviction, evicted KV dropped, summaries as one-off
  background calls (they take a slot idle 1 s, and a reply preempts them);
* ``next-use``: eviction by expected next use, evicted KV dropped, summaries for their
  session (``owner``);
* ``lru+host``: LRU with host memory (summaries one-off, as in ``lru``);
* ``next-use+host`` (now): eviction by expected next use, host memory, and summaries run
  for their session (``owner``) from its own slot.

It prints a JSON object per policy: ``reprefill`` (prompt tokens prefilled, summaries and
recomputes included, over the replies' prompt tokens: ``convo_engine_prompt_tokens_total``
over ``usage.prompt_tokens``), ``swaps_out``/``swaps_in``, ``host_dropped``,
``preemptions``, ``ttft_p50_s``/``ttft_p95_s`` (of the model, not a measurement).

    python benchmarks/kv_policy.py --preset chat-users        # 64 users, 16 slots, 3-8 s
    python benchmarks/kv_policy.py --preset think-2s          # 16 users, 16 slots, 12 turns
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import sys
from dataclasses import dataclass, field
from typing import Any

from convo.fast.kv_policy import LRUPolicy, NextUsePolicy
from convo.fast.kv_pool import KVSlotPool
from convo.tokens import common_prefix_length

#: The presets: the loads of issue 22.
PRESETS: dict[str, dict[str, Any]] = {
    "chat-users": {"users": 64, "slots": 16, "turns": 6, "think": (3.0, 8.0), "spread_s": 10.0},
    "think-2s": {
        "users": 16,
        "slots": 16,
        "turns": 12,
        "think": (2.0, 2.0),
        "spread_s": 1.0,
        "user_tokens": 150,
        "summary_every": 4,
    },
}
#: The same with summaries whose prompt starts with their own instructions (they share no
#: prefix with the session's cache: run in its slot, they push its KV to host first).
PRESETS["think-2s-own-prompt"] = {**PRESETS["think-2s"], "summary_shares_prefix": False}
POLICIES = ("lru", "next-use", "lru+host", "next-use+host")
SYSTEM_TOKENS = 60
SUMMARY_INSTRUCTION_TOKENS = 20
SUMMARY_NEW_TOKENS = 64
#: Background work waits this long for an idle slot of another session (the scheduler's).
BACKGROUND_MIN_IDLE_S = 1.0
BACKGROUND_MAX_WAIT_S = 10.0


@dataclass
class Load:
    users: int = 64
    slots: int = 16
    turns: int = 6
    think: tuple[float, float] = (3.0, 8.0)
    spread_s: float = 10.0
    user_tokens: int = 300
    reply_tokens: int = 32
    summary_every: int = 0
    summary_shares_prefix: bool = True
    prefill_tps: float = 20000.0
    step_s: float = 0.012
    host_entries: int = 48  # host memory, in whole slots
    seed: int = 0

    @property
    def slot_tokens(self) -> int:
        return SYSTEM_TOKENS + self.turns * (self.user_tokens + self.reply_tokens) + 64


@dataclass(eq=False)
class Work:
    user: int
    ids: list[int]
    new_tokens: int
    arrived: float
    background: bool = False
    owner: str | None = None
    key: str | None = None
    slot: int = -1
    kept_for_owner: int = 0
    started: float = 0.0
    order: int = field(default_factory=itertools.count().__next__)


def simulate(load: Load, policy: str) -> dict[str, Any]:
    """Run ``load`` under ``policy`` (one of :data:`POLICIES`); its figures."""
    import torch

    rng = random.Random(load.seed)
    now = [0.0]
    pool = KVSlotPool(
        num_layers=1,
        num_kv_heads=1,
        head_dim=1,
        slots=load.slots,
        slot_tokens=load.slot_tokens,
        dtype=torch.float32,
        device="cpu",
        policy=NextUsePolicy() if policy.startswith("next-use") else LRUPolicy(),
        clock=lambda: now[0],
    )
    if policy.endswith("+host"):
        pool.set_host_memory(pool.host_nbytes(load.slot_tokens) * load.host_entries)
    owner_summaries = policy.startswith("next-use")
    events: list[tuple[float, int, str, Any]] = []
    seq = itertools.count()
    transcripts: dict[int, list[int]] = {}
    turn_of: dict[int, int] = {}
    fresh = itertools.count(10**6)

    def new_ids(n: int) -> list[int]:
        return [next(fresh) for _ in range(n)]

    def push(t: float, kind: str, item: Any) -> None:
        heapq.heappush(events, (t, next(seq), kind, item))

    for u in range(load.users):
        transcripts[u] = new_ids(SYSTEM_TOKENS)
        turn_of[u] = 0
        push(rng.uniform(0, load.spread_s), "turn", u)
    pending: list[Work] = []
    running: list[Work] = []
    requested = prefilled = preemptions = 0
    ttfts: list[float] = []

    def admit() -> None:
        nonlocal prefilled, preemptions
        passed: set[int] = set()
        while True:
            waiting = [w for w in pending if id(w) not in passed]
            if not waiting:
                return
            w = min(waiting, key=lambda w: (w.background, w.order))
            patient = w.background and now[0] - w.arrived < BACKGROUND_MAX_WAIT_S
            wanted = {k for p in pending if (k := p.owner or p.key) is not None}
            got = pool.acquire(
                w.owner or w.key,
                min_idle_s=BACKGROUND_MIN_IDLE_S if patient else 0.0,
                ids=w.ids,
                guest=w.owner is not None,
                evict=not (patient and w.owner is not None),
                wanted=wanted,
                reply=not w.background,
            )
            if got is None:
                victims = [r for r in running if r.background] if not w.background else []
                if not victims:
                    if w.background:  # the scheduler lets the background work behind it try
                        passed.add(id(w))
                        continue
                    return
                v = max(victims, key=lambda r: r.order)  # the scheduler's preemption
                running.remove(v)
                pool.release(v.slot, v.ids[: v.kept_for_owner] if v.owner else v.ids)
                preemptions += 1
                v.slot = -1
                pending.append(v)
                continue
            pending.remove(w)
            w.slot, kept = got
            pool.ready(w.slot, wait=True)
            common = common_prefix_length(kept, w.ids, len(w.ids) - 1)
            w.kept_for_owner = common
            todo = len(w.ids) - common
            prefilled += todo
            w.started = now[0]
            first = now[0] + todo / load.prefill_tps + load.step_s
            if not w.background:
                ttfts.append(first - w.arrived)
            running.append(w)
            push(first + w.new_tokens * load.step_s, "done", w)

    while events:
        t, _, kind, item = heapq.heappop(events)
        now[0] = t
        if kind == "turn":
            u = item
            transcripts[u] += new_ids(load.user_tokens)
            ids = list(transcripts[u])
            requested += len(ids)
            pending.append(Work(u, ids, load.reply_tokens, t, key=f"u{u}"))
        elif kind == "summary":
            u = item
            instruction = new_ids(SUMMARY_INSTRUCTION_TOKENS)
            if load.summary_shares_prefix:
                ids = transcripts[u] + instruction
            else:
                ids = instruction + transcripts[u][SYSTEM_TOKENS:]
            owner = f"u{u}" if owner_summaries else None
            pending.append(Work(u, ids, SUMMARY_NEW_TOKENS, t, background=True, owner=owner))
        else:
            w = item
            if w not in running:
                continue  # preempted: its rerun has its own event
            running.remove(w)
            if w.background:
                pool.release(w.slot, w.ids[: w.kept_for_owner] if w.owner else w.ids)
            else:
                reply = new_ids(w.new_tokens)
                transcripts[w.user] = w.ids + reply
                pool.release(w.slot, (w.ids + reply)[:-1])
                turn_of[w.user] += 1
                n = turn_of[w.user]
                if load.summary_every and n % load.summary_every == 0:
                    push(t, "summary", w.user)
                if n < load.turns:
                    push(t + rng.uniform(*load.think), "turn", w.user)
        admit()
    ttfts.sort()
    host = pool.host
    return {
        "policy": policy,
        "reprefill": round(prefilled / max(requested, 1), 3),
        "prefilled_prompt_tokens": prefilled,
        "requested_prompt_tokens": requested,
        "swaps_out": pool.swaps_out,
        "swaps_in": pool.swaps_in,
        "host_dropped": host.dropped if host is not None else 0,
        "host_peak_entries": round(host.peak_bytes / pool.host_nbytes(load.slot_tokens), 1) if host else 0,
        "preemptions": preemptions,
        "ttft_p50_s": round(ttfts[len(ttfts) // 2], 3),
        "ttft_p95_s": round(ttfts[int(len(ttfts) * 0.95)], 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="chat-users")
    parser.add_argument("--host-entries", type=int, default=None, help="host memory, in whole slots")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", choices=POLICIES, action="append", help="default: all")
    args = parser.parse_args(argv)
    load = Load(**PRESETS[args.preset], seed=args.seed)
    if args.host_entries is not None:
        load.host_entries = args.host_entries
    out = {"preset": args.preset, "results": [simulate(load, p) for p in args.policy or POLICIES]}
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
