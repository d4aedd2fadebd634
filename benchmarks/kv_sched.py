"""Summaries under a chat load, through the real decode scheduler, on a fake clock (issue 22).

No model and no device: the real :class:`~convo.fast.scheduler.DecodeScheduler` and
:class:`~convo.fast.kv_pool.KVSlotPool` (one-float tensors; host memory on the CPU), over a
fake decoder whose steps advance a fake clock by a model of the H200's step times
(Llama-2-7B int4: a decode step ``--decode-s`` plus ``--row-s`` per row, a prompt token
``--token-s``; a token's K/V copied to or from host memory ``copy_token_s``, the copies
queued one after another beside the steps). Unlike ``benchmarks/kv_policy.py``, which
re-enacts the admission rules, this runs the scheduler's own code, so a change of policy
there shows here.

The load follows ``benchmarks/serve_load.py`` and the session's window: users arrive over
``spread_s``, each turn sends ``user_tokens`` and gets ``reply_tokens``; the prompt is the
system prompt, the summary block and the kept window. When a turn would not fit the budget,
the oldest turns leave the window (as the session's window slides: about ``slide_turns``
turns of the recent size, keeping the newest; or down to ``slide_to`` of the budget) and a summary of them
is due: its prompt is its own instructions, the previous summary and the evicted turns (no
prefix in common with the session's KV), ``summary_tokens`` new tokens, background priority,
``owner=`` the session; up to ``summary_threads`` run at once (the server runs one per slot).
Until it is written, the summary block is a provisional stand-in (the same text turn after
turn). Once it is written, the session's next prompt prefix is prefilled in the background
(``prefill_only``) when the session is idle, as :meth:`~convo.session.Session.prefill_next` does.

Reported per run: ``preemptions`` (and of them ``parked``: resumed by a copy from host);
``summaries_due``, ``summaries_written`` and ``summary_backlog_end`` (jobs queued or running
when the last user's last turn ends), ``drain_s`` (seconds after it until none is left;
``None``: not within :data:`DRAIN_LIMIT_S`), ``provisional_turns`` (turns whose prompt
carried the stand-in); summary lag p50/p95 (due to written); ``reprefill`` (prompt tokens
the scheduler prefilled, summaries and background prefills included, over the replies'
prompt tokens) and ``reprefill_floor`` (``novel_prompt_tokens``, the part an unbounded
exact cache would still prefill: past each prompt's common prefix with what its session's
KV last held, as the window slides and the summary changes, and the summaries' own
prompts; over the same; ``reprefill - reprefill_floor`` is what evictions cost); TTFT and
turn p50/p95 of the replies (fake seconds); swaps.

Since 2026-12-02 the load follows the session's own rules (``Load.lookahead``,
``summary_from_prompt``, ``sticky_provisional``; ``--load NAME=JSON`` turns each off), which
the older model did not: turns leave right after the reply that makes the next one
overflow, a provisional summary once shown stays until the window moves, and a summary
continues the last prompt when that prompt showed the turns after the written summary.
With those rules the model gives think-16 a re-prefill of 0.74 without the summary from the
prompt (the H200 measured 0.75 before it) and 0.695 with it (floor 0.59); chat-users 0.572
and 0.529 (floor 0.485).

    python benchmarks/kv_sched.py --preset think-16
    python benchmarks/kv_sched.py --preset think-16 --load summary_from_prompt=false
    python benchmarks/kv_sched.py --preset chat-users --out benchmarks/results/kv_policy_chat-users.json
    python benchmarks/kv_sched.py --preset think-16 --load 'scheduler={"context_shift": true}'
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from convo.fast.kv_pool import KVSlotPool, PrefillChunk
from convo.fast.packing import MIXED_PACK_CHUNKS, MIXED_PACK_TOKENS, packed_tokens
from convo.fast.scheduler import SLOT_POLL_S, DecodeRequest, DecodeScheduler
from convo.models import GREEDY, Priority
from convo.models.defaults import MIXED_CHUNK_TOKENS, PREFILL_GRAPH_TOKENS, mixed_buckets

#: Fake seconds the run goes on after the last turn, for the summaries left to be written.
DRAIN_LIMIT_S = 120.0
#: The loads of issue 22 (``benchmarks/serve_load.py``'s presets of the same names).
PRESETS: dict[str, dict[str, Any]] = {
    "think-16": {"users": 16, "slots": 16, "turns": 12, "think": (2.0, 2.0), "spread_s": 0.0},
    "chat-users": {"users": 64, "slots": 16, "turns": 6, "think": (3.0, 8.0), "spread_s": 10.0},
    # Issue 11's load, twice (``serve_load.py --preset gpu-chat --waves 2``): 16 sessions, 8
    # turns, no pause but the client's between a reply and its next turn (0.05-0.15 s);
    # once the first wave's last turn ends, 16 new sessions.
    "gpu-chat": {"users": 16, "slots": 16, "turns": 8, "think": (0.05, 0.15), "spread_s": 0.0, "waves": 2},
}


@dataclass
class Load:
    users: int = 16
    slots: int = 16
    turns: int = 12
    think: tuple[float, float] = (2.0, 2.0)
    spread_s: float = 0.0
    user_tokens: int = 299
    reply_tokens: int = 32
    budget: int = 2048  # a slot: prompt and reply
    reply_reserve: int = 64  # the window leaves this much of the budget to the reply
    system_tokens: int = 19
    summary_tokens: int = 256
    summary_instruction_tokens: int = 100
    slide_to: float = 0.6
    # As the session slides (``convo.session.window.turns_to_push_out``): the oldest turns
    # leave until about ``slide_turns`` more turns of the recent size fit beside the rest
    # and the summary at its cap, keeping the newest; 0: down to ``slide_to`` of the budget
    # instead (the model before 2026-12-03).
    slide_turns: int = 3
    summary_threads: int = 16
    prefill_next: bool = True
    # Summarize ahead: when the next turn will slide, summarize the turns that will leave
    # right after this reply, from the session's own cached prompt (its KV: only the
    # instruction is new), so the summary is written before the slide (a session-level
    # change, not the summarizer's prompt of today: measured here for what it would give).
    # Measured: it does not pay while a summary outlasts the think time (think-16:
    # preemptions 2 -> 24, re-prefill 0.66 -> 0.77): the owner's next turn finds its KV
    # in the slot the summary holds and prefills it again elsewhere.
    summary_ahead: bool = False
    # As the session does since 2026-12-02: after each reply it looks one turn ahead and
    # moves the turns that the next turn would push out now (owed, until their summary is
    # written); the summary's prompt continues the session's last prompt (its system part,
    # the block it showed, the turns to fold, then the instruction), so it shares that
    # prompt's cached KV (``ModelSummarizer`` with the session's ``context``). Both off: the
    # turns leave at the next turn, and the summary's prompt is its own (the template).
    lookahead: bool = True
    summary_from_prompt: bool = True
    # As the session does: a provisional summary, once shown, stays in the prompt until the
    # window moves again, also when the summary is written meanwhile (one re-prefill per
    # slide, not two); off: the written summary replaces it at once.
    sticky_provisional: bool = True
    # As the session does since 2026-12-07 (``PROVISIONAL_MIN_TOKENS`` 64): the provisional
    # block is excerpts of the owed turns' latest messages (each message's head and tail,
    # at least 64 tokens a message), which the slot still holds, so a context shift moves
    # them (``find_shifts``); off: the block is new text (the model before).
    provisional_excerpts: bool = True
    # When the window slides after a reply (lookahead), prefill the next prompt's prefix
    # (system, the provisional block, the kept window) in the background at once, before
    # the summary is written, as ``Session.prefill_next`` does once it is. Measured
    # (2026-12-07, context shift on): it does not pay, the prefill and the summary contend
    # for the session's slot (think-16: re-prefill 0.38 -> 0.485, slide 1.24x -> 1.27x,
    # preemptions 21 -> 26; gpu-chat: re-prefill 0.283 -> 0.332, wall 13.3 -> 13.9 s).
    prefill_at_slide: bool = False
    host_slots: int = 48  # host memory, in whole slots (0: off)
    decode_s: float = 0.010
    row_s: float = 0.00015
    prefill_fixed_s: float = 0.004
    token_s: float = 0.00005
    # What a step with prompt tokens costs beside its decode rows, whatever its tokens: an
    # int4 model dequantizes its weights for the dense product (on an H100, Llama-2-7B:
    # decode 16 rows 5.9 ms, with 256 prompt tokens 17.3 ms, with 512 21.6 ms: ~7.1 ms and
    # 16.8 us a token, ``--load mixed_fixed_s=0.0071 --load token_s=0.0000168``).
    mixed_fixed_s: float = 0.0
    # A token's K/V copied between a slot and host memory, in seconds: the copies queue one
    # after another (one side stream) beside the steps, and a slot is used once its copy is
    # done. Llama-2-7B's 512 KiB a token at ~50 GB/s (pinned host memory over PCIe 5);
    # 0: copies are instant (the model before 2026-12-06).
    copy_token_s: float = 0.0000105
    copy_duplex: bool = False  # copies out and in on two queues (SimPool.duplex)
    seed: int = 0
    waves: int = 1  # loads of ``users`` new sessions, each once the one before has ended
    scheduler: dict[str, Any] = field(default_factory=dict)  # DecodeScheduler keywords


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SimDecoder:
    """The scheduler's view of a decoder: each call advances the clock by the model's cost
    and answers token 1 (never an end of turn: every request runs to its length)."""

    vocab = 8
    mixed_steps = True
    # As the captured mixed step on CUDA: up to MIXED_PACK_CHUNKS chunks packed, each but
    # the last on whole blocks (priced as the rows they take).
    mixed_chunks = MIXED_PACK_CHUNKS
    mixed_pack_tokens = MIXED_PACK_TOKENS
    mixed_buckets = tuple(
        mixed_buckets(PREFILL_GRAPH_TOKENS, 2048, MIXED_CHUNK_TOKENS)
    )  # (a grown step past them: one chunk)

    def __init__(self, pool: KVSlotPool, clock: Clock, load: Load) -> None:
        self.pool, self.clock, self.load = pool, clock, load

    def _logits(self, n: int) -> Any:
        import torch

        out = torch.zeros(n, self.vocab)
        out[:, 1] = 1.0
        return out

    def _decode_s(self, rows: int) -> float:
        return self.load.decode_s + self.load.row_s * rows

    def step(self, tokens: list[int], slots: list[int], positions: list[int]) -> Any:
        self.clock.now += self._decode_s(len(tokens))
        return self._logits(len(tokens))

    def prefill_batch(self, chunks: list[PrefillChunk]) -> list[Any]:
        n = sum(c.end - c.start for c in chunks)
        self.clock.now += self.load.prefill_fixed_s + self.load.token_s * n
        return list(self._logits(len(chunks)))

    def mixed_step(
        self, tokens: list[int], slots: list[int], positions: list[int], chunks: list[PrefillChunk]
    ) -> tuple[Any, list[Any]]:
        n = packed_tokens([c.end - c.start for c in chunks])
        self.clock.now += self._decode_s(len(tokens)) + self.load.mixed_fixed_s + self.load.token_s * n
        return self._logits(len(tokens)), list(self._logits(len(chunks)))


class FakeEvent:
    """A copy's CUDA event on the fake clock: done at ``at``; waiting for it moves the clock."""

    def __init__(self, clock: Clock, at: float) -> None:
        self.clock, self.at = clock, at

    def query(self) -> bool:
        return self.clock.now >= self.at

    def synchronize(self) -> None:
        self.clock.now = max(self.clock.now, self.at)


class SimPool(KVSlotPool):
    """The real pool (its copies made at once, on the CPU) whose copies take fake time
    (``copy_token_s`` a token): each starts once the one before it ends, or with
    ``duplex``, copies out and copies in queue apart (the two directions of PCIe), a copy
    into a slot starting once that slot's copy out has ended."""

    def __init__(self, *args: Any, copy_token_s: float = 0.0, duplex: bool = False, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.copy_token_s, self.duplex = copy_token_s, duplex
        self.copy_busy_s = 0.0
        self._free = {True: 0.0, False: 0.0}  # when the last copy out (True) / in queued ends
        self._slot_out: dict[int, float] = {}  # when each slot's last copy out ends

    def _timed(self, index: int, tokens: int, *, out: bool) -> Any:
        if not self.copy_token_s:
            return None
        lane = out if self.duplex else True
        start = max(self.clock(), self._free[lane])
        if not out:
            start = max(start, self._slot_out.get(index, 0.0))
        end = start + tokens * self.copy_token_s
        self._free[lane] = end
        if out:
            self._slot_out[index] = end
        self.copy_busy_s += tokens * self.copy_token_s
        return FakeEvent(self.clock, end)  # type: ignore[arg-type]

    def copy_out(self, index: int, tokens: int, blocks: Any) -> Any:
        super().copy_out(index, tokens, blocks)
        return self._timed(index, min(tokens, self.slot_tokens), out=True)

    def copy_in(self, index: int, blocks: Any, tokens: int, ranges: Any = None) -> Any:
        super().copy_in(index, blocks, tokens, ranges)
        n = min(tokens, self.slot_tokens) if ranges is None else sum(b - a for a, b in ranges)
        return self._timed(index, n, out=False)


@dataclass
class User:
    key: str
    wave: int = 0
    window: list[list[int]] = field(default_factory=list)  # kept turns: message and reply
    summary: list[int] = field(default_factory=list)  # the written summary
    owed: list[list[int]] = field(default_factory=list)  # evicted turns not summarized yet
    owed_since: float | None = None
    version: int = 0  # summaries written
    ahead: int = 0  # oldest window turns a summary ahead covers (queued, running or written)
    ahead_written: bool = False
    sticky: list[int] | None = None  # the provisional block shown, kept until the window moves
    shown: list[int] = field(default_factory=list)  # system and block of the last prompt
    shown_turns: list[list[int]] = field(default_factory=list)  # its turns, and the new one
    turns: int = 0
    in_turn: bool = False
    job: bool = False  # a summary of it is queued or running
    held: list[int] = field(default_factory=list)  # the last prompt and its reply


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))], 3)


def simulate(load: Load) -> dict[str, Any]:
    """Run ``load`` through the scheduler; its figures (module docstring)."""
    import torch

    rng = random.Random(load.seed)
    clock = Clock()
    pool = SimPool(
        num_layers=1, num_kv_heads=1, head_dim=2, slots=load.slots, slot_tokens=load.budget,
        dtype=torch.float32, device="cpu", clock=clock,
        copy_token_s=load.copy_token_s, duplex=load.copy_duplex,
    )  # fmt: skip
    # Rotary frequencies, so that ``--load 'scheduler={"context_shift": true}'`` shifts (a
    # move costs no fake time: a few kernels per layer against a prefill's tokens).
    pool.rope_inv_freq = torch.ones(1)
    if load.host_slots:
        pool.set_host_memory(load.host_slots * pool.host_nbytes(load.budget))
    sched = DecodeScheduler(
        SimDecoder(pool, clock, load), background=False, clock=clock, timer=clock, **load.scheduler
    )
    fresh = itertools.count(1000)
    system = [next(fresh) for _ in range(load.system_tokens)]
    users = [User(f"w{w}u{i}", wave=w) for w in range(load.waves) for i in range(load.users)]
    waves: list[dict[str, Any]] = [{"ttft": [], "start": None, "end": None} for _ in range(load.waves)]
    events: list[tuple[float, int, str, Any]] = []
    seq = itertools.count()

    def push(t: float, kind: str, item: Any) -> None:
        heapq.heappush(events, (t, next(seq), kind, item))

    def tokens(n: int) -> list[int]:
        return [next(fresh) for _ in range(n)]

    def block(u: User) -> list[int]:
        if u.sticky is not None:
            return u.sticky
        if not u.owed:
            return u.summary
        # The provisional stand-in: the same text while the same turns are owed.
        seed = hash((u.key, u.version, len(u.owed))) % 10**6
        if load.provisional_excerpts:
            return excerpts(u, seed)
        return [10**7 + seed * 1000 + i for i in range(min(load.summary_tokens, 40 + 60 * len(u.owed)))]

    def excerpts(u: User, seed: int) -> list[int]:
        """``provisional_summary``'s shape: the previous summary (at most half the cap), a
        header, then the latest owed messages that get 64 tokens each, cut in the middle
        (head 2/3, a marker, tail 1/3) to an equal share; new tokens are fresh ids."""
        new = iter(range(10**7 + seed * 1000, 10**7 + seed * 1000 + 1000))
        out = [*u.summary[: load.summary_tokens // 2], *(next(new) for _ in range(12))]
        room = load.summary_tokens - len(out)
        messages = [part for t in u.owed for part in (t[: load.user_tokens], t[load.user_tokens :]) if part]
        shown = messages[-max(room // 68, 1) :]
        share = room // len(shown) - 4
        for m in shown:
            out += [next(new) for _ in range(3)]  # "speaker: "
            if len(m) <= share:
                out += m
            else:
                keep = share - 8
                head = keep - keep // 3
                out += [*m[:head], *(next(new) for _ in range(8)), *m[len(m) - (keep - head) :]]
        return out

    def prefix(u: User) -> list[int]:
        return [*system, *block(u), *itertools.chain.from_iterable(u.window)]

    flight: list[tuple[str, User, DecodeRequest, Any]] = []
    worker: list[User] = []  # summaries queued (not started)
    running_jobs = [0]
    requested = [0]
    ttft: list[float] = []
    turn_s: list[float] = []
    lag: list[float] = []
    written = [0]
    due = [0]
    provisional = [0]  # turns whose prompt carried the provisional stand-in
    slide_s: list[float] = []  # turn seconds of turns whose prompt does not extend the last
    plain_s: list[float] = []  # ... and of those that do
    by_turn: dict[int, list[tuple[float, float]]] = {}  # turn index: (TTFT, turn seconds) each

    def submit(kind: str, u: User, req: DecodeRequest, extra: Any = None) -> None:
        req.started_at = clock.now
        sched.submit(req)
        flight.append((kind, u, req, extra))

    def start_jobs() -> None:
        while worker and running_jobs[0] < load.summary_threads:
            u = worker.pop(0)
            covered = len(u.owed)
            body = [
                *tokens(load.summary_instruction_tokens),
                *u.summary,
                *itertools.chain.from_iterable(u.owed),
            ]
            if u.ahead and not u.owed:  # from the session's cached prompt: only the instruction is new
                covered = u.ahead
                body = [*prefix(u), *tokens(load.summary_instruction_tokens)]
            elif (
                load.summary_from_prompt
                and u.shown[len(system) :] == u.summary
                and u.owed == u.shown_turns[: len(u.owed)]
            ):
                # The last prompt showed the owed turns right after the summary: continue it
                # (as the session does, not after a provisional one: prompt_context).
                owed = itertools.chain.from_iterable(u.owed)
                body = [*u.shown, *owed, *tokens(load.summary_instruction_tokens)]
            body = body[: load.budget - load.summary_tokens - 1]
            req = DecodeRequest(
                ids=body, max_new_tokens=load.summary_tokens, deadline=float("inf"), sampling=GREEDY,
                priority=Priority.BACKGROUND, owner=u.key,
            )  # fmt: skip
            running_jobs[0] += 1
            submit("summary", u, req, covered)

    def leaving(u: User) -> int:
        """How many of the oldest turns the next turn's slide would evict (0: no slide)."""
        limit = load.budget - load.reply_reserve
        window = list(u.window)
        size = len(system) + len(block(u)) + sum(map(len, window)) + load.user_tokens
        if size <= limit:
            return 0
        if load.slide_turns:
            return push_out(window)
        k = 0
        while k < len(window) and size > load.slide_to * load.budget:
            size -= len(window[k])
            k += 1
        return k

    def push_out(window: list[list[int]]) -> int:
        """The session's rule (``turns_to_push_out``): push out enough that about
        ``slide_turns`` more turns of the recent size fit in the window's room (the prompt
        room less the system prompt and the summary at its cap), keeping the newest turn."""
        costs = [len(t) for t in window]
        recent = costs[-(load.slide_turns + 1) :]
        per_turn = sum(recent) / max(len(recent), 1)
        room = load.budget - load.reply_reserve - len(system) - load.summary_tokens
        target = sum(costs) + load.slide_turns * per_turn - room
        freed, k = 0.0, 0
        while k < len(window) - 1 and freed + per_turn / 2 < target:
            freed += costs[k]
            k += 1
        return k

    def turn(u: User) -> None:
        message = tokens(load.user_tokens)
        limit = load.budget - load.reply_reserve
        if u.ahead_written:  # the summary of the leaving turns is written: they just leave
            u.window = u.window[u.ahead :]
            u.ahead, u.ahead_written = 0, False
        elif u.ahead:  # its summary is not written yet: they leave owed, the job covers them
            u.owed, u.window = u.window[: u.ahead], u.window[u.ahead :]
            u.ahead = 0
        if len(prefix(u)) + len(message) > limit:  # the window slides
            u.sticky = None
            k = push_out(u.window) if load.slide_turns else 0
            u.owed.extend(u.window[:k])
            u.window = u.window[k:]
            while u.window and len(prefix(u)) + len(message) > (
                limit if load.slide_turns else load.slide_to * load.budget
            ):
                u.owed.append(u.window.pop(0))
            u.owed_since = clock.now if u.owed_since is None else u.owed_since
        ids = [*prefix(u), *message]
        if load.sticky_provisional and u.owed and u.sticky is None:
            u.sticky = block(u)
        u.shown, u.shown_turns = [*system, *block(u)], list(u.window)
        requested[0] += len(ids)
        provisional[0] += bool(u.owed)
        u.in_turn = True
        first: list[float] = []
        req = DecodeRequest(
            ids=ids, max_new_tokens=load.reply_tokens, deadline=float("inf"), sampling=GREEDY,
            cache_key=u.key, on_token=lambda _t: bool(first.append(clock.now)) and False,
        )  # fmt: skip
        slid = bool(u.held) and ids[: len(u.held)] != u.held
        submit("reply", u, req, (message, clock.now, first, slid))

    def finished(kind: str, u: User, req: DecodeRequest, extra: Any) -> None:
        if kind == "reply":
            message, at, first, slid = extra
            (slide_s if slid else plain_s).append(clock.now - at)
            by_turn.setdefault(u.turns, []).append((first[0] - at, clock.now - at))
            u.held = [*req.ids, *req.new_ids]
            ttft.append(first[0] - at)
            waves[u.wave]["ttft"].append(first[0] - at)
            turn_s.append(clock.now - at)
            u.window.append([*message, *req.new_ids])
            u.shown_turns.append(u.window[-1])
            u.in_turn, u.turns = False, u.turns + 1
            if load.lookahead and not u.owed and not u.job and u.turns < load.turns:
                k = leaving(u)  # the next turn would slide: the turns leave now
                if k:
                    u.owed, u.window = u.window[:k], u.window[k:]
                    u.owed_since, u.sticky = clock.now, None
                    if load.prefill_at_slide:
                        u.sticky = block(u)
                        ids = [*system, *u.sticky, *itertools.chain.from_iterable(u.window)]
                        submit("prefill", u, DecodeRequest(
                            ids=ids, max_new_tokens=1, deadline=float("inf"), sampling=GREEDY,
                            cache_key=u.key, prefill_only=True, priority=Priority.BACKGROUND,
                        ))  # fmt: skip
            if u.owed and not u.job:
                u.job = True
                due[0] += 1
                worker.append(u)
            elif load.summary_ahead and not u.job and not u.owed and u.turns < load.turns:
                k = leaving(u)
                if k:
                    u.ahead, u.job, u.owed_since = k, True, clock.now
                    due[0] += 1
                    worker.append(u)
            if u.turns < load.turns:
                push(clock.now + rng.uniform(*load.think), "turn", u)
            elif all(v.turns >= load.turns for v in users if v.wave == u.wave):
                waves[u.wave]["end"] = clock.now
                if u.wave + 1 < load.waves:  # the next wave: new sessions
                    start_wave(u.wave + 1)
        elif kind == "summary":
            running_jobs[0] -= 1
            u.job = False
            u.summary = tokens(load.summary_tokens)
            if u.ahead and not u.owed:
                u.ahead_written = True
            u.owed = u.owed[extra:]
            u.version += 1
            written[0] += 1
            if u.owed_since is not None:
                lag.append(clock.now - u.owed_since)
            u.owed_since = clock.now if u.owed else None
            if u.owed:  # turns evicted while it ran: the next job
                u.job = True
                due[0] += 1
                worker.append(u)
            if load.prefill_next and not u.in_turn:
                window = u.window[u.ahead :] if u.ahead_written else u.window
                ids = [*system, *block(u), *itertools.chain.from_iterable(window)]
                submit("prefill", u, DecodeRequest(
                    ids=ids, max_new_tokens=1, deadline=float("inf"), sampling=GREEDY,
                    cache_key=u.key, prefill_only=True, priority=Priority.BACKGROUND,
                ))  # fmt: skip
        start_jobs()

    def reap() -> None:
        for entry in [f for f in flight if f[2].done.is_set()]:
            flight.remove(entry)
            finished(*entry)

    def start_wave(w: int) -> None:
        waves[w]["start"] = clock.now
        for u in users:
            if u.wave == w:
                push(clock.now + rng.uniform(0, load.spread_s), "turn", u)

    start_wave(0)
    end: float | None = None
    at_end: dict[str, Any] = {}
    while True:
        while events and events[0][0] <= clock.now:
            _, _, _, u = heapq.heappop(events)
            turn(u)
        reap()
        if end is None and all(u.turns >= load.turns for u in users):
            end = clock.now  # the load is over: what is left drains (or not) from here
            stats = sched.stats()
            at_end = {"written": written[0], "backlog": len(worker) + running_jobs[0], "stats": stats}
        backlog = len(worker) + running_jobs[0]
        if end is not None and (not backlog or clock.now > end + DRAIN_LIMIT_S):
            break
        if sched.idle:
            clock.now = events[0][0]
            continue
        before = clock.now
        sched.run_step()
        reap()
        if clock.now == before:  # only work that waits for a slot: the loop polls
            clock.now = min(events[0][0] if events else before + SLOT_POLL_S, before + SLOT_POLL_S)
    assert end is not None
    stats = at_end["stats"]
    per_wave = [
        {
            "wall_s": round(w["end"] - w["start"], 2),
            "ttft_p50_s": _pct(w["ttft"], 0.5),
            "ttft_p95_s": _pct(w["ttft"], 0.95),
        }
        for w in waves
    ]
    extra: dict[str, Any] = {}
    if load.waves > 1:
        a, b = per_wave[0], per_wave[1]
        extra = {
            "waves": per_wave,
            "wave2_over_wave1": {
                "wall": round(b["wall_s"] / a["wall_s"], 2),
                "ttft_p50": round(b["ttft_p50_s"] / a["ttft_p50_s"], 2),
            },
        }
    return {
        "wall_s": round(end, 2),
        "preemptions": stats.preemptions,
        "parked": getattr(stats, "parked", 0),  # (absent before parking)
        "summaries_due": due[0],
        "summaries_written": at_end["written"],
        "summary_backlog_end": at_end["backlog"],
        "drain_s": round(clock.now - end, 2) if not len(worker) + running_jobs[0] else None,
        "provisional_turns": provisional[0],
        "summary_lag_p50_s": _pct(lag, 0.5),
        "summary_lag_p95_s": _pct(lag, 0.95),
        "reprefill": round(stats.prompt_tokens / max(requested[0], 1), 3),
        "prefilled_prompt_tokens": stats.prompt_tokens,
        "requested_prompt_tokens": requested[0],
        "novel_prompt_tokens": stats.novel_prompt_tokens,
        "reprefill_floor": round(stats.novel_prompt_tokens / max(requested[0], 1), 3),
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p95_s": _pct(ttft, 0.95),
        "turn_p50_s": _pct(turn_s, 0.5),
        "turn_p95_s": _pct(turn_s, 0.95),
        # As serve_load's window_slide_vs_ordinary: turn p50 of the turns whose prompt does
        # not extend the last (the window slid) over that of the others.
        "slide_turns": len(slide_s),
        "slide_vs_ordinary": round(_pct(slide_s, 0.5) / _pct(plain_s, 0.5), 2)
        if slide_s and plain_s
        else None,
        "ttft_p50_s_by_turn": {t: _pct([x for x, _ in v], 0.5) for t, v in sorted(by_turn.items())},
        "turn_p50_s_by_turn": {t: _pct([y for _, y in v], 0.5) for t, v in sorted(by_turn.items())},
        "swaps_out": stats.swaps_out,
        "swaps_in": stats.swaps_in,
        "copy_busy_s": round(pool.copy_busy_s, 2),
        "background_prefills": stats.prefills,
        **extra,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="think-16")
    parser.add_argument("--host-slots", type=int, default=None, help="host memory, in whole slots (0: off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], help="a DecodeScheduler keyword: name=value")
    parser.add_argument("--load", action="append", default=[], help="a Load field: name=value (JSON)")
    parser.add_argument("--out", default=None, help="write the JSON here too")
    args = parser.parse_args(argv)
    load = Load(**PRESETS[args.preset], seed=args.seed)
    if args.host_slots is not None:
        load.host_slots = args.host_slots
    for item in args.load:
        name, _, value = item.partition("=")
        if not hasattr(load, name):
            parser.error(f"--load: no Load field {name!r}")
        setattr(load, name, json.loads(value))
    for item in args.set:
        name, _, value = item.partition("=")
        load.scheduler[name] = json.loads(value)
    out = {"preset": args.preset, "load": {k: v for k, v in vars(load).items()}, "result": simulate(load)}
    text = json.dumps(out, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
