"""The decode loop: continuous batching over the KV slots.

Modelled on vLLM v1's scheduler. Each step has a token budget (``step_tokens``):

1. every running reply gets its row first (one token each, one batched decode step);
2. the rest of the budget goes to prefill chunks of turns that hold a slot but have not
   produced their first token yet, in priority order (replies before background work
   such as summaries), then arrival order
   (:meth:`~convo.fast.decoder.StaticDecoder.prefill_batch` runs them).

While replies stream (rows of :data:`Priority.REPLY`; background rows such as summaries
do not count), a step prefills at most ``interleave_tokens`` prompt tokens, and
runs them in the same forward as the decode rows (vLLM's mixed batch,
:meth:`~convo.fast.decoder.StaticDecoder.mixed_step`: the weights are read, and for int4
dequantized, once for both), so a prompt that arrives delays each running reply's next
token by one short chunk, never by its whole prefill. Steps without prefill replay the
captured decode step. When no reply is streaming, the whole ``step_tokens`` budget goes
to prefill, the chunks of several turns together in one forward.

A request waits for a slot (in priority, then arrival order) while every slot holds a
turn. Background work takes a slot whose session's cache is hot only once it has been
idle a while (``background_min_idle_s``) or the work has waited long
(``background_max_wait_s``). A request finishes with ``timeout`` when its deadline passes
and with ``cancelled`` when its ``cancel`` event is set, whether it is waiting, prefilling
or decoding.

Sessions' KV outlives their slots when the pool has host memory
(:meth:`~convo.fast.kv_pool.KVSlotPool.set_host_memory`): a request whose slot receives
KV from host (or gives its old KV to host) waits until the copy is done, while the other
sessions' steps run; then it prefills only what is not cached. A ``prefill_only`` request
computes a prompt's KV and keeps it for its session, sampling nothing.

With ``context_shift``, a session's turn whose prompt holds, at other positions, runs of
the tokens its slot caches (the turns its window kept after a slide, behind a new summary;
the excerpts of the turns that just left it, in a provisional summary in front of them;
retrieval memory's passages of those turns after the question, less their first tokens)
moves those runs' K/V where the prompt puts them and prefills only around them
(:mod:`convo.fast.kv_shift`; not exact, off by default). A turn whose longest such run
moves towards the end (nothing left the window: the last reply and passages both turns
retrieved) moves nothing and is prefilled exactly.

Beside the prompt tokens it prefills, the scheduler counts the novel ones
(``novel_prompt_tokens``, with a :class:`~convo.fast.prefix_ledger.PrefixLedger` of what
each session's KV last held): those an unbounded exact cache would still prefill, past each
prompt's common prefix with that. The difference is what evictions (and recomputed
preemptions) cost.

Background work never costs the foreground more than it must (issue 22; each rule
measured with ``benchmarks/kv_sched.py``, the real scheduler on a fake clock):

* it holds at most ``background_slots`` slots at once (half the pool by default), so a
  wave of turns finds slots while the summaries drain in the pauses;
* work done for a session (``owner``: its summary) runs in that session's own slot, or in
  an empty one, and takes no other session's slot before it has waited
  ``background_max_wait_s`` (then it evicts, to host, the session needed last); with host
  memory it may take at once the slot of a session the policy expects back only after
  the work is done (``evict_to_host``: that session's KV comes back by a copy);
* a reply that finds every slot busy waits for a running request that frees its slot
  within a few tokens (``reply_wait_tokens``; ``background_finish_tokens`` when the stop
  would throw work away), else it preempts background work: never work about to finish
  (``background_finish_tokens``), of the rest the one with the most left. Work done for a
  session keeps none of its KV in the slot, so with host memory it is parked there
  (:meth:`~convo.fast.kv_pool.KVSlotPool.park`) and resumes by a copy; otherwise (and for
  other work, whose KV stays with its session) it later prefills its prompt and what it
  generated again and goes on (vLLM's preemption by recompute).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from convo.errors import ConfigError, DeviceOutOfMemory, is_out_of_memory
from convo.fast.kv_pool import PARKED_PREFIX, PrefillChunk
from convo.fast.kv_shift import find_shifts, shifted_tokens
from convo.fast.packing import block_rows
from convo.fast.prefix_ledger import PrefixLedger
from convo.fast.request import WORK_KINDS, DecodeRequest, decode_priority, work_kind
from convo.fast.sampling import sample_rows
from convo.fast.step_budget import (
    DEFAULT_GAP_STEPS,
    MIN_COST_STEPS,
    PILEUP_CHUNKS,
    SHRINK_HALVINGS,
    STEP_KINDS,
    StepCosts,
    step_costs,
)
from convo.models.defaults import DEFAULT_INTERLEAVE_TOKENS, DEFAULT_STEP_TOKENS
from convo.models.device import empty_device_cache
from convo.models.generation import FinishReason, Priority, SchedulerStats
from convo.tokens import common_prefix_length

__all__ = [
    "DEFAULT_BACKGROUND_FINISH_TOKENS",
    "DEFAULT_BACKGROUND_MAX_WAIT_S",
    "DEFAULT_BACKGROUND_MIN_IDLE_S",
    "DEFAULT_BACKGROUND_SLOT_SHARE",
    "DEFAULT_GAP_STEPS",
    "DEFAULT_INTERLEAVE_TOKENS",
    "DEFAULT_REPLY_WAIT_TOKENS",
    "DEFAULT_STEP_TOKENS",
    "MIN_COST_STEPS",
    "PILEUP_CHUNKS",
    "SHRINK_HALVINGS",
    "SLOT_COPY_MIN_TOKENS",
    "SLOT_POLL_S",
    "STEP_KINDS",
    "WORK_KINDS",
    "DecodeRequest",
    "DecodeScheduler",
    "Priority",
    "SchedulerStats",
    "StepCosts",
    "decode_priority",
]
#: Seconds another session's cached prompt must have sat idle in its slot before background
#: work (a summary) may take the slot: while sessions keep talking, summaries use empty
#: slots and the ones sessions left, not the caches that their next turns will reuse.
DEFAULT_BACKGROUND_MIN_IDLE_S = 1.0
#: Seconds background work waits for such a slot before it takes the least recently used
#: idle one anyway, so it never starves.
DEFAULT_BACKGROUND_MAX_WAIT_S = 10.0
#: How often the loop looks for a slot again while only work that waits for one is left.
SLOT_POLL_S = 0.02
#: A reply that finds every slot busy does not preempt background work with at most this
#: many tokens left to generate: it waits for it (that many steps at most) rather than
#: throw the work away or copy it out, and of the others it stops the one with the most
#: left to do (``benchmarks/kv_sched.py``: on think-16, a third of the summaries a reply
#: stopped had over 200 of their 256 tokens).
DEFAULT_BACKGROUND_FINISH_TOKENS = 16
#: A reply that finds every slot busy waits, rather than stop background work, while a
#: running request will free its slot within this many tokens (within
#: :data:`DEFAULT_BACKGROUND_FINISH_TOKENS` when the stopped work would be recomputed, not
#: parked in host memory). A park is a copy queued behind the copies of the sessions that
#: come back with the same wave, so when a chat's replies are short, waiting for one of
#: them to end frees a slot about as soon and stops nothing. Measured on an H100
#: (``serve_load.py --model random:llama-2-7b --quant int4 --kv-slots 16 --context-shift``,
#: 2026-12-07), 32 against 16: think-16 (32-token replies) **0 preemptions** in two runs
#: against 21, TTFT p95 0.56 and 0.62 s against 0.73, turn p95 1.23 and 1.33 s against
#: 1.42, slide turn 2.01x and 1.97x an ordinary one against 2.21x, re-prefill 0.345 and
#: 0.357 against 0.344; gpu-chat 0 preemptions against 2, TTFT p95 0.64 s against 0.66;
#: chat-users unchanged (TTFT p95 0.18 s, turn p95 0.75 s, re-prefill 0.295). On
#: ``benchmarks/kv_sched.py``, where copies are free, it costs think-16's TTFT p95
#: 0.611 -> 0.65 s (fake seconds). Earlier, 16 rather than 4 took think-16 on the fake clock
#: from 21 preemptions to 8.
DEFAULT_REPLY_WAIT_TOKENS = 32
#: Share of the KV slots that background work (summaries, background prefills) may hold
#: at once (at least one slot): the rest is left to replies, so a wave of turns finds
#: slots without stopping the summaries, which drain in the pauses. Measured with
#: ``benchmarks/kv_sched.py`` on think-16 (16 users on 16 slots, host memory on): no cap,
#: 49 preemptions; 8 slots, 2 and summaries as fast (lag p50 8.1 s against 7.5 s); 4 slots,
#: summaries lag 13 s.
DEFAULT_BACKGROUND_SLOT_SHARE = 0.5

#: Fewest more prompt tokens a request copies from a running request of its session in
#: another slot (:meth:`DecodeScheduler._borrow`), or a turn parks in host memory for its
#: session's queued summary (:meth:`DecodeScheduler._keep_for_background`), instead of
#: leaving them to be prefilled; fewer are prefilled (a copy is one more kernel per pool
#: tensor, and an event to wait for).
SLOT_COPY_MIN_TOKENS = 16


logger = logging.getLogger(__name__)


class DecodeScheduler:
    """Continuous batching over the decoder's KV slots (see the module docstring).

    Args:
        decoder: the :class:`~convo.fast.decoder.StaticDecoder` (warmed up), or any object
            with its ``pool``, ``step`` and ``prefill_batch`` (tests use a fake).
        step_tokens: the token budget of one step (:data:`DEFAULT_STEP_TOKENS`): decode
            rows first, prefill chunks fill the rest. At least one prefill token runs per
            step while a turn waits, whatever the rows.
        interleave_tokens: while replies stream, a step prefills at most this many prompt
            tokens (:data:`DEFAULT_INTERLEAVE_TOKENS`, and within ``step_tokens``), in the
            decode rows' forward when the decoder has ``mixed_step`` (as many chunks as its
            ``mixed_chunks``, each but the last counted in blocks of its
            ``mixed_pack_tokens``: a captured mixed step packs them), else one chunk in a
            forward of its own.
        background: run the loop in its own thread (``False``: the caller calls
            :meth:`run_step`).
        background_min_idle_s: seconds another session's cached prompt must have been
            idle before a request of lower priority than a reply takes its slot
            (:data:`DEFAULT_BACKGROUND_MIN_IDLE_S`).
        background_max_wait_s: seconds such a request waits before it takes the least
            recently used idle slot anyway (:data:`DEFAULT_BACKGROUND_MAX_WAIT_S`).
        clock: the time of deadlines, waits and first tokens (``time.monotonic``; a
            request's ``deadline`` and ``started_at`` are on it). Simulations pass their own.
        timer: the time steps are measured with (``time.perf_counter``; the step costs
            that grow a streaming step's prefill, :class:`StepCosts`).
        park: with host memory, work done for a session (``owner``: a summary) that a
            reply preempts is parked there (:meth:`~convo.fast.kv_pool.KVSlotPool.park`)
            and resumes by a copy, not a recompute (``False``: recompute, as before).
        background_finish_tokens: background work with at most this many tokens left is
            not preempted (:data:`DEFAULT_BACKGROUND_FINISH_TOKENS`; 0: any may be).
        background_slots: slots background work may hold at once (default
            :data:`DEFAULT_BACKGROUND_SLOT_SHARE` of the pool's, at least 1).
        reply_wait_tokens: a reply waits for a slot that frees within this many tokens
            rather than park background work (:data:`DEFAULT_REPLY_WAIT_TOKENS`).
        evict_to_host: with host memory, work done for a session may take the slot of a
            session the policy expects back only after the work is done (its KV goes to
            host and comes back by a copy) instead of waiting ``background_max_wait_s``.
        context_shift: a session's turn (or background prefill) whose prompt holds runs
            of at least :data:`~convo.fast.kv_shift.SHIFT_MIN_TOKENS` of its slot's cached
            tokens at other positions (the turns its window kept after a slide; at most
            :data:`~convo.fast.kv_shift.MAX_SHIFT_RUNS`) moves them there, keys turned,
            instead of prefilling them (:mod:`convo.fast.kv_shift`:
            not exact, so off by default). Needs a pool that can shift
            (:attr:`~convo.fast.kv_pool.KVSlotPool.can_shift`).

    Raises:
        ConfigError: ``step_tokens`` or ``interleave_tokens`` < 1, or a negative
            background bound.
    """

    def __init__(
        self,
        decoder: Any,
        *,
        step_tokens: int = DEFAULT_STEP_TOKENS,
        interleave_tokens: int = DEFAULT_INTERLEAVE_TOKENS,
        background: bool = True,
        background_min_idle_s: float = DEFAULT_BACKGROUND_MIN_IDLE_S,
        background_max_wait_s: float = DEFAULT_BACKGROUND_MAX_WAIT_S,
        clock: Callable[[], float] | None = None,
        timer: Callable[[], float] | None = None,
        park: bool = True,
        background_finish_tokens: int = DEFAULT_BACKGROUND_FINISH_TOKENS,
        background_slots: int | None = None,
        reply_wait_tokens: int = DEFAULT_REPLY_WAIT_TOKENS,
        evict_to_host: bool = True,
        context_shift: bool = False,
    ) -> None:
        if step_tokens < 1 or interleave_tokens < 1:
            raise ConfigError("step_tokens and interleave_tokens must be >= 1")
        if not (background_min_idle_s >= 0 and background_max_wait_s >= 0):
            raise ConfigError("background_min_idle_s and background_max_wait_s must be >= 0")
        self.background_min_idle_s = background_min_idle_s
        self.clock = clock if clock is not None else time.monotonic
        self.timer = timer if timer is not None else time.perf_counter
        self.park = park
        if background_finish_tokens < 0:
            raise ConfigError("background_finish_tokens must be >= 0")
        self.background_finish_tokens = background_finish_tokens
        if background_slots is None:
            background_slots = max(1, int(decoder.pool.slots * DEFAULT_BACKGROUND_SLOT_SHARE))
        if background_slots < 1 or reply_wait_tokens < 0:
            raise ConfigError("background_slots must be >= 1 and reply_wait_tokens >= 0")
        self.background_slots = background_slots
        self.reply_wait_tokens = reply_wait_tokens
        self.evict_to_host = evict_to_host
        self.context_shift = context_shift and decoder.pool.can_shift
        self.background_max_wait_s = background_max_wait_s
        self.decoder = decoder
        self.step_tokens = step_tokens
        self.interleave_tokens = interleave_tokens
        # A decoder that runs decode rows and prefill chunks in one forward, and gains by it.
        self._mixed = callable(getattr(decoder, "mixed_step", None)) and getattr(decoder, "mixed_steps", True)
        #: Chunks a streaming step prefills: those one mixed step takes, else one; packed
        #: in a mixed step, each but the last starts on a block of ``_pack`` tokens, and
        #: no more than ``_pack_max`` tokens are (past them the chunks run apart: one).
        self._mixed_chunks: int | None = getattr(decoder, "mixed_chunks", None) if self._mixed else 1
        self._pack: int = getattr(decoder, "mixed_pack_tokens", 1)
        self._pack_max = max(getattr(decoder, "mixed_buckets", None) or [1 << 30])
        self.background = background
        self._pending: list[DecodeRequest] = []  # no slot yet
        self._copying: list[DecodeRequest] = []  # a slot whose copy to or from host runs
        self._prefilling: list[DecodeRequest] = []  # a slot, no first token yet
        self._active: list[DecodeRequest] = []  # decoding
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        #: Decode steps run, and rows decoded in them (rows / steps = mean batch).
        self.steps = 0
        self.rows = 0
        #: Prefill forwards run, and prompt tokens they ran.
        self.prefills = 0
        self.prefill_tokens = 0
        #: Most prompt tokens one prefill forward ran between two decode steps.
        self.max_prefill_tokens = 0
        #: Requests stopped to free a slot for a reply (they went on later).
        self.preemptions = 0
        #: Of those, the ones whose KV was parked in host memory (resumed by a copy).
        self.parked = 0
        #: Context shifts run, and the cached tokens they moved instead of prefilling.
        self.shifts = 0
        self.shifted_tokens = 0
        #: Background prefill requests (``prefill_only``) run to their end.
        self.prefill_requests = 0
        #: Prompt tokens an unbounded exact cache would still prefill: each request's tokens
        #: past its common prefix with what its session's KV last held (:meth:`_count_novel`).
        self.novel_prompt_tokens = 0
        #: Prompt tokens prefilled, and novel ones, by kind of work (:data:`WORK_KINDS`);
        #: and the prompt tokens that preempted work prefilled again after its stop.
        self.prompt_tokens_by_work = dict.fromkeys(WORK_KINDS, 0)
        self.novel_tokens_by_work = dict.fromkeys(WORK_KINDS, 0)
        self.recomputed_tokens = 0
        #: Session prefixes kept in host memory for queued background work of the session
        #: before its turn overwrote them: parked from the slot (:meth:`_keep_for_background`)
        #: or host memory's copy handed over (``handoff``).
        self.kept_for_background = 0
        self._ledger = PrefixLedger()
        #: every step counted by kind, and the grown steps' costs
        self.costs = StepCosts(interleave_tokens=interleave_tokens)
        self._blocked = False  # the last admission left work waiting for a slot

    def submit(self, request: DecodeRequest) -> DecodeRequest:
        """Queue ``request``; wait on ``request.done``.

        Raises:
            ConfigError: the scheduler is closed, or the prompt and its reply cap do not fit
                a slot (refused here, alone, rather than failing a whole step later).
        """
        need = len(request.ids) + request.max_new_tokens
        if need > self.decoder.pool.slot_tokens:
            raise ConfigError(
                f"{len(request.ids)} prompt tokens + max_new_tokens {request.max_new_tokens} do not fit "
                f"a slot of {self.decoder.pool.slot_tokens} tokens"
            )
        with self._cv:
            if self._closed:
                raise ConfigError("the decode scheduler is closed")
            self._count_novel(request)
            self._pending.append(request)
            if self._thread is None and self.background:
                self._thread = threading.Thread(target=self._loop, name="convo-decode", daemon=True)
                self._thread.start()
            self._cv.notify()
        return request

    def run(self, request: DecodeRequest) -> DecodeRequest:
        """Submit and wait until done; re-raises the scheduler's error for this request."""
        self.submit(request).done.wait()
        if request.error is not None:
            raise request.error
        return request

    def forget(self, key: str) -> None:
        """Forget a closed session: what the pool keeps for it
        (:meth:`~convo.fast.kv_pool.KVSlotPool.forget`) and what the scheduler remembers of
        its KV for counting novel prompt tokens."""
        self.decoder.pool.forget(key)
        with self._cv:
            self._ledger.forget(key)

    def close(self) -> None:
        """Stop the loop once the work queued so far is done, and join its thread; later
        submits are refused."""
        with self._cv:
            self._closed = True
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    @property
    def waiting(self) -> int:
        """Requests without a first token yet (queued for a slot or prefilling)."""
        with self._cv:
            return len(self._pending) + len(self._copying) + len(self._prefilling)

    @property
    def queued(self) -> int:
        """Requests that hold no slot yet (every slot is busy, or, for background work,
        holds a session's hot cache)."""
        with self._cv:
            return len(self._pending)

    @property
    def running(self) -> int:
        """Requests decoding (they have their first token)."""
        with self._cv:
            return len(self._active)

    @property
    def idle(self) -> bool:
        """Nothing is queued, prefilling or decoding."""
        with self._cv:
            return not (self._pending or self._copying or self._prefilling or self._active)

    def stats(self) -> SchedulerStats:
        """A snapshot of what the scheduler has run (:class:`SchedulerStats`), with the
        pool's host-memory figures."""
        pool = self.decoder.pool
        host = pool.host
        return SchedulerStats(
            steps=dict(self.costs.steps),
            busy_s=dict(self.costs.busy_s),
            decode_rows=self.rows,
            prompt_tokens=self.prefill_tokens,
            novel_prompt_tokens=self.novel_prompt_tokens,
            preemptions=self.preemptions,
            swaps_out=pool.swaps_out,
            swaps_in=pool.swaps_in,
            swap_bytes=pool.swap_bytes,
            host_bytes=host.nbytes if host is not None else 0,
            host_bytes_peak=host.peak_bytes if host is not None else 0,
            host_dropped=host.dropped if host is not None else 0,
            host_limit_bytes=pool.host_limit_bytes,
            prefills=self.prefill_requests,
            host_reserved_bytes=pool.host_reserved_bytes,
            parked=self.parked,
            shifts=self.shifts,
            shifted_tokens=self.shifted_tokens,
            prompt_tokens_by_work=dict(self.prompt_tokens_by_work),
            novel_tokens_by_work=dict(self.novel_tokens_by_work),
            recomputed_tokens=self.recomputed_tokens,
            kept_for_background=self.kept_for_background,
            slot_copies=pool.slot_copies,
            slot_copied_tokens=pool.slot_copied_tokens,
        )

    def _count_novel(self, req: DecodeRequest) -> None:
        """Count ``req``'s novel prompt tokens against what its session's KV last held (a
        request that samples runs its last prompt token whatever is cached: its logits).
        They are added to :attr:`novel_prompt_tokens` once its prompt is in (as
        ``prefill_tokens`` are: work still queued is in neither), and once only: a
        preempted request, resumed or recomputed, is not counted again. Its session's KV
        will hold its prompt (unless it is work done for an ``owner``, which keeps none of
        its own): the ledger says so now, so that a request queued behind it (a turn
        behind its session's background prefill) counts against it, as an exact cache
        would serve it."""
        novel = self._ledger.novel(req.session, req.ids)
        req._novel = novel if req.prefill_only or not req.ids else max(novel, 1)
        if req.owner is None and req.cache_key is not None:
            self._ledger.remember(req.cache_key, req.ids)

    def _prompt_in(self, req: DecodeRequest) -> None:
        """``req``'s prompt is in its slot: its novel tokens count (the first time only)."""
        self.novel_prompt_tokens += req._novel
        self.novel_tokens_by_work[work_kind(req)] += req._novel
        req._novel = 0

    def _count(self, kind: str, started: float, prompt_tokens: int = 0) -> float:
        """Count a step that began at ``started``; its seconds."""
        seconds = self.timer() - started
        self.costs.record(kind, prompt_tokens, seconds)
        return seconds

    # -- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (
                    self._pending or self._copying or self._prefilling or self._active or self._closed
                ):
                    self._cv.wait()
                if self._closed and not (self._pending or self._copying or self._prefilling or self._active):
                    self._thread = None
                    return
                if self._blocked and not (self._prefilling or self._active):
                    self._cv.wait(SLOT_POLL_S)  # only work that waits for a slot: look again soon
            self.run_step()

    def run_step(self) -> None:
        """One scheduler step: expire, admit, decode the running rows, prefill with the rest
        of the budget. The loop thread calls it; with ``background=False`` the caller does."""
        self._expire()
        self._admit()
        self._copied()
        batch: list[tuple[DecodeRequest, PrefillChunk]] = []
        if self._prefilling:
            if any(r.priority <= Priority.REPLY for r in self._active):  # replies stream: a short chunk
                waiting = sum(self._prompt_left(r) for r in self._prefilling)
                rows = len(self._active)
                budget = self.costs.budget(waiting=waiting, rows=rows, step_tokens=self.step_tokens)
                packs = self._mixed and budget <= self._pack_max
                batch = self._plan_prefill(budget, self._pack if packs else 1)
                if self._mixed or budget <= self.interleave_tokens:  # (a grown chunk may run apart)
                    batch = batch[: self._mixed_chunks if packs else 1]
            else:
                batch = self._plan_prefill(self.step_tokens)
        if self._active and batch and self._mixed:  # one forward for both
            rows = self._active
            started = self.timer()
            try:
                logits, outs = self.decoder.mixed_step(*self._rows(rows), [c for _, c in batch])
            except BaseException as exc:  # a device error ends every request in it
                self._active = []
                self._prefilling = [r for r in self._prefilling if all(r is not b for b, _ in batch)]
                self._fail([*rows, *(r for r, _ in batch)], exc)
                return
            self._decoded(rows, logits)
            self._prefilled(batch, outs)
            self._count("mixed", started, sum(c.end - c.start for _, c in batch))
            return
        streamed = 0.0  # a decode step's seconds: with the prefill after it, the rows' gap
        if self._active:
            started = self.timer()
            try:
                self._step()
                streamed = self._count("decode", started)
            except BaseException as exc:  # a device error ends every row in flight
                self._fail(self._active, exc)
                self._active = []
        if batch:
            started = self.timer()
            try:
                self._prefill(batch)
                prefilled = self._count("prefill", started)
                if streamed:
                    self.costs.price(sum(c.end - c.start for _, c in batch), streamed + prefilled)
            except BaseException as exc:
                failed = [r for r, _ in batch]
                self._prefilling = [r for r in self._prefilling if r not in failed]
                self._fail(failed, exc)

    def _finish(
        self, req: DecodeRequest, reason: FinishReason | None, error: BaseException | None = None
    ) -> None:
        req.finish, req.error = reason, error
        req.finished_at = self.clock()
        if req._parked is not None:  # (it ended while it waited to resume)
            self.decoder.pool.forget(req._parked)
            req._parked = None
        if req.slot >= 0:
            kept = req.kept() if error is None else []
            self.decoder.pool.release(req.slot, kept)
            if error is None and req.owner is None and req.cache_key is not None and kept:
                with self._cv:  # what its session's KV holds now (work for an owner keeps none)
                    self._ledger.remember(req.cache_key, kept)
        req.done.set()

    def _fail(self, reqs: Sequence[DecodeRequest], exc: BaseException) -> None:
        error = _device_error(exc)
        for req in reqs:
            req.kv_tokens = 0
            self._finish(req, None, error)
        empty_device_cache()

    def _expire(self) -> None:
        """Finish waiting and prefilling requests that were cancelled or ran out of time."""
        now = self.clock()
        with self._cv:
            gone = [(r, why) for r in self._pending if (why := r._stop_reason(now)) is not None]
            self._pending = [r for r in self._pending if r._stop_reason(now) is None]
        gone += [(r, why) for r in self._prefilling if (why := r._stop_reason(now)) is not None]
        self._prefilling = [r for r in self._prefilling if r._stop_reason(now) is None]
        for req, why in [(r, why) for r in self._copying if (why := r._stop_reason(now)) is not None]:
            self.decoder.pool.ready(req.slot, wait=True)  # the slot is let go of once its copy is done
            self._copying.remove(req)
            gone.append((req, why))
        for req, why in gone:
            self._finish(req, why)

    def _admit(self) -> None:
        """Give free slots to waiting requests: by priority, then arrival. Work of lower
        priority than a reply takes another session's cached slot only when it has been
        idle ``background_min_idle_s`` (or the work waited ``background_max_wait_s``); a
        request that finds no slot preempts running work of lower priority
        (:meth:`_preempt`). Background work that must wait (for its session's own slot, say)
        lets the background work behind it try; a reply that must wait holds everything
        behind it."""
        self._blocked = False
        passed: set[int] = set()  # background requests that wait, this admission
        while True:
            with self._cv:
                waiting = [r for r in self._pending if id(r) not in passed]
                if not waiting:
                    return
                req = min(waiting, key=lambda r: (r.priority, r._order))
                if req.priority > Priority.REPLY and self._background_full():
                    self._blocked = True
                    passed.add(id(req))
                    continue
                patient = req.priority > Priority.REPLY
                patient = patient and self.clock() - req.started_at < self.background_max_wait_s
                # Work for a session (its summary, its prefill) takes only its own or an empty
                # slot while it is patient: it never evicts a session that is thinking.
                own = req.owner is not None or req.prefill_only
                wanted = {k for r in self._pending for k in (r.session, r._parked) if k is not None}
                reader = self._reader(req)  # the session's queued summary, if any
                handoff = f"{PARKED_PREFIX}{reader._order}" if reader is not None else None
                got = self.decoder.pool.acquire(
                    req.session,
                    min_idle_s=self.background_min_idle_s if patient else 0.0,
                    ids=req.context(),
                    guest=req.owner is not None,
                    evict=not (patient and own),
                    wanted=wanted,
                    reply=req.priority <= Priority.REPLY,
                    restore=req._parked,
                    spare_s=self._expected_s(req) if self.evict_to_host else None,
                    shift=self.context_shift and req.owner is None,
                    handoff=handoff,
                )
                if got is None:
                    if self._preempt(req):
                        continue
                    self._blocked = True  # every slot holds a turn: wait for one to finish
                    if req.priority > Priority.REPLY:
                        passed.add(id(req))
                        continue
                    return
                self._pending.remove(req)
                host = self.decoder.pool.host
                if reader is not None and host is not None and host.get(handoff) is not None:
                    reader._parked = handoff  # host memory's copy was handed to it
                    self.kept_for_background += 1
            req.slot, kept = got
            ids = req.context()
            common = common_prefix_length(kept, ids, len(ids) if req.prefill_only else len(ids) - 1)
            if req._parked is None:
                kept, common = self._borrow(req, kept, ids, common)
                req._shared = common
                self._keep_for_background(req, reader, kept, common, wanted)
            else:  # resumed: its own KV came back (or, dropped by host memory, is recomputed)
                self.decoder.pool.forget(req._parked)
                req._parked = None
                if not req.preemptions:  # (parked for it before it first ran: its session's)
                    req._shared = common
            req.cached_tokens = req.kv_tokens = common
            if self.context_shift and req.owner is None and req.cache_key is not None:
                req._shift = find_shifts(kept, ids, start=common, limit=len(ids) - 1)
                req.cached_tokens += shifted_tokens(req._shift)
            if req.prefill_only and common == len(ids):  # all of it is cached already
                self.decoder.pool.release(req.slot, kept)
                req.slot = -1
                self._prompt_in(req)
                self._finish(req, FinishReason.STOP)
                continue
            self._copying.append(req)

    def _borrow(
        self, req: DecodeRequest, kept: list[int], ids: list[int], common: int
    ) -> tuple[list[int], int]:
        """The tokens ``req``'s slot holds and shares with ``ids``, after copying in what
        a running request of its session holds in another slot, where that shares
        :data:`SLOT_COPY_MIN_TOKENS` more of ``ids``: a summary queued while its session's
        turn runs copies the prefix from that turn's slot (a device-to-device copy of
        microseconds per token) instead of prefilling it again."""
        if req.session is None:
            return kept, common
        limit = len(ids) if req.prefill_only else len(ids) - 1
        best, most = None, common
        for other in (*self._active, *self._prefilling):
            if other is req or other.slot < 0 or other.slot == req.slot or other.session != req.session:
                continue
            shared = common_prefix_length(other.held(), ids, limit)
            if shared > most:
                best, most = other, shared
        if best is None or most - common < SLOT_COPY_MIN_TOKENS:
            return kept, common
        tokens = ids[:most]
        self.decoder.pool.copy_slot(best.slot, req.slot, tokens)
        return tokens, most

    def _reader(self, req: DecodeRequest) -> DecodeRequest | None:
        """For a turn (not background work), its session's queued background work that
        has not run yet and reads the session's KV (its summary: the oldest); ``None``."""
        if req.priority > Priority.REPLY or req.owner is not None or req.session is None:
            return None
        waiting = [
            r
            for r in self._pending
            if r.priority > Priority.REPLY and r.session == req.session and not (r._parked or r.new_ids)
        ]
        return min(waiting, key=lambda r: r._order, default=None)

    def _keep_for_background(
        self,
        req: DecodeRequest,
        reader: DecodeRequest | None,
        kept: list[int],
        common: int,
        wanted: set[str],
    ) -> None:
        """A turn about to overwrite the cached tokens past its first ``common`` (a slid
        window: prefilled or shifted over) that queued background work of its session
        still shares (a summary of the turns the window left, which reads the prompt those
        turns were in): the slot's tokens are parked in host memory for that work first,
        and it resumes from them by a copy (:meth:`KVSlotPool.park`, as preempted work
        does) instead of prefilling them again. (Where host memory held them and the turn
        copied in only part, they were handed over already: ``handoff``.) ``reader``:
        that work (:meth:`_reader`, found before the turn got its slot); ``wanted``: the
        sessions and parked work with queued requests (their host entries are kept)."""
        if reader is None or reader._parked is not None:  # (none, or handed over already)
            return
        needs = common_prefix_length(kept, reader.context())
        if needs - common < SLOT_COPY_MIN_TOKENS:
            return
        key = f"{PARKED_PREFIX}{reader._order}"
        if self.decoder.pool.park(req.slot, key, kept[:needs], wanted={*wanted, key}):
            reader._parked = key
            self.kept_for_background += 1

    def _copied(self) -> None:
        """Requests whose slot's copies (to or from host) are done go on to prefill. When
        nothing else runs, wait for the copies instead of polling."""
        pool = self.decoder.pool
        idle = not (self._prefilling or self._active)
        for req in list(self._copying):
            if pool.ready(req.slot, wait=idle):
                self._copying.remove(req)
                self._shift(req)
                self._prefilling.append(req)

    def _shift(self, req: DecodeRequest) -> None:
        """Move the cached runs ``req`` reuses to their prompt positions (context shift,
        :func:`~convo.fast.kv_shift.find_shifts`); the prompt tokens before each are
        prefilled first (its ``_holes``), or, none, it counts as cached at once. A failed
        move is no loss: the runs are prefilled instead. Nothing to move: nothing done."""
        shifts, req._shift = req._shift, ()
        if not shifts:
            return
        try:
            self.decoder.pool.shift(req.slot, shifts)
        except Exception:  # (only positions past the common prefix were written)
            logger.exception("a context shift failed: the tokens are prefilled instead")
            req.cached_tokens -= shifted_tokens(shifts)
            return
        self.shifts += 1
        self.shifted_tokens += shifted_tokens(shifts)
        req._holes = tuple((s.dst, s.dst + s.length) for s in shifts)
        self._skip_holes(req)

    @staticmethod
    def _skip_holes(req: DecodeRequest) -> None:
        """Past the moved runs that start where ``req``'s computed tokens end."""
        while req._holes and req._holes[0][0] == req.kv_tokens:
            req.kv_tokens, req._holes = req._holes[0][1], req._holes[1:]

    def _preempt(self, req: DecodeRequest) -> bool:
        """Free a slot for ``req``: stop the running request of lowest priority below
        ``req``'s (of those, the one with the most tokens left, then the latest; never one
        with at most ``background_finish_tokens`` left) and put it back in the queue.
        Work done for a session is parked in host memory when there is some (it resumes by
        a copy); else, re-admitted, it prefills its prompt and the reply so far
        (:meth:`DecodeRequest.context`) and goes on where it stopped (vLLM's preemption by
        recompute). False, stopping nothing: no such request, or a running request frees
        its slot within ``reply_wait_tokens`` tokens (``background_finish_tokens`` when the
        stop would be a recompute), which ``req`` waits for."""
        running = [r for r in (*self._active, *self._prefilling) if r.priority > req.priority]
        parks = self.park and self.decoder.pool.host is not None
        wait = self.reply_wait_tokens if parks else self.background_finish_tokens
        if any(self._left(r) <= wait for r in self._active):
            return False  # a slot frees within that many steps: wait for it
        running = [r for r in running if self._left(r) > self.background_finish_tokens]
        if not running:
            return False
        victim = max(running, key=lambda r: (r.priority, self._left(r), r._order))
        self._active = [r for r in self._active if r is not victim]
        self._prefilling = [r for r in self._prefilling if r is not victim]
        pool = self.decoder.pool
        if self.park and victim.owner is not None and victim.kv_tokens > victim._shared:
            # Work done for a session keeps none of its own KV in the slot: park it in host
            # memory, so that it resumes by a copy instead of a recompute.
            key = f"{PARKED_PREFIX}{victim._order}"
            wanted = {k for r in self._pending for k in (r.session, r._parked) if k is not None}
            if pool.park(victim.slot, key, victim.held(), wanted=wanted):
                victim._parked = key
                self.parked += 1
        pool.release(victim.slot, victim.kept())
        victim.slot, victim.kv_tokens = -1, 0
        victim._shift, victim._holes = (), ()  # (re-admitted, it looks for runs again)
        victim.preemptions += 1
        self.preemptions += 1
        self._pending.append(victim)
        return True

    def _expected_s(self, req: DecodeRequest) -> float | None:
        """Seconds ``req`` is expected to hold a slot: its prompt at the measured cost per
        prompt token, then its tokens at the measured decode step (``None``: not measured)."""
        costs = step_costs(self.costs.steps, self.costs.busy_s, self.prefill_tokens)
        if costs is None:
            return None
        decode_s, token_s = costs
        prompt = len(req.ids) + len(req.new_ids) - req.kv_tokens
        return prompt * token_s + self._left(req) * decode_s

    def _background_full(self) -> bool:
        """Whether background work holds ``background_slots`` slots already."""
        held = sum(
            1 for r in (*self._copying, *self._prefilling, *self._active) if r.priority > Priority.REPLY
        )
        return held >= self.background_slots

    @staticmethod
    def _prompt_left(req: DecodeRequest) -> int:
        """Prompt tokens ``req`` has left to prefill (a moved run's are not)."""
        holes = sum(b - a for a, b in req._holes)
        return len(req.ids) + len(req.new_ids) - req.kv_tokens - holes

    @staticmethod
    def _left(req: DecodeRequest) -> int:
        """Tokens ``req`` has left to generate (a prefill has all of them left)."""
        if req.prefill_only:
            return req.max_new_tokens + len(req.ids) - req.kv_tokens
        return req.max_new_tokens - len(req.new_ids)

    def _plan_prefill(self, budget: int, block: int = 1) -> list[tuple[DecodeRequest, PrefillChunk]]:
        """Chunks of the turns waiting to prefill, in priority then arrival order, within
        ``budget`` tokens, each but the last counted in whole blocks of ``block`` tokens
        (packed in one mixed step, :func:`~convo.fast.packing.packed_tokens`)."""
        batch = []
        for req in sorted(self._prefilling, key=lambda r: (r.priority, r._order)):
            if budget <= 0:
                break
            ids = req.context()
            end = min(len(ids), req.kv_tokens + budget)
            if req._holes:  # up to the next moved run
                end = min(end, req._holes[0][0])
            batch.append((req, PrefillChunk(slot=req.slot, ids=ids, start=req.kv_tokens, end=end)))
            budget -= block_rows(end - req.kv_tokens, block)
        return batch

    def _prefill(self, batch: list[tuple[DecodeRequest, PrefillChunk]]) -> None:
        self._prefilled(batch, self.decoder.prefill_batch([c for _, c in batch]))

    def _prefilled(self, batch: list[tuple[DecodeRequest, PrefillChunk]], logits: Sequence[Any]) -> None:
        """Account a prefill forward's chunks; turns whose prompt is in get their first token."""
        tokens = sum(c.end - c.start for _, c in batch)
        self.prefills += 1
        self.prefill_tokens += tokens
        for req, chunk in batch:
            self.prompt_tokens_by_work[work_kind(req)] += chunk.end - chunk.start
            if req.preemptions:
                self.recomputed_tokens += chunk.end - chunk.start
        self.max_prefill_tokens = max(self.max_prefill_tokens, tokens)
        ready = []
        for (req, chunk), out in zip(batch, logits, strict=True):
            req.kv_tokens = chunk.end
            self._skip_holes(req)  # (a moved run is in)
            if chunk.end == len(chunk.ids):
                self._prompt_in(req)
                ready.append((req, out))
        if not ready:
            return
        done = {id(r) for r, _ in ready}
        self._prefilling = [r for r in self._prefilling if id(r) not in done]
        for req in [r for r, _ in ready if r.prefill_only]:  # its KV is in: nothing to sample
            self.prefill_requests += 1
            self._finish(req, FinishReason.STOP)
        ready = [(r, out) for r, out in ready if not r.prefill_only]
        if not ready:
            return
        reqs = [r for r, _ in ready]
        for req in reqs:
            if req.sampling.seed is not None and req._generator is None:
                import torch

                req._generator = torch.Generator(device=ready[0][1].device).manual_seed(req.sampling.seed)
        import torch

        first = sample_rows(torch.stack([out for _, out in ready]), reqs)
        now = self.clock()
        for req, token in zip(reqs, first, strict=True):
            if req.first_token_at is None:  # (a preempted request had its first token)
                req.first_token_at = now
            if not self._accept(req, token):
                self._active.append(req)

    def _accept(self, req: DecodeRequest, token: int) -> bool:
        """Record ``token`` for ``req``; True when the request finished."""
        req.new_ids.append(token)
        stop_string = req.on_token(token) if req.on_token is not None else False
        if token in req.eos or stop_string:
            reason: FinishReason | None = FinishReason.STOP
        elif len(req.new_ids) >= req.max_new_tokens:
            reason = FinishReason.LENGTH
        else:
            reason = req._stop_reason(self.clock())
            if reason is None:
                return False
        self._finish(req, reason)
        return True

    @staticmethod
    def _rows(rows: Sequence[DecodeRequest]) -> tuple[list[int], list[int], list[int]]:
        """A decode step's inputs: each row's last token, slot and position."""
        return [r.new_ids[-1] for r in rows], [r.slot for r in rows], [r.position for r in rows]

    def _step(self) -> None:
        self._decoded(self._active, self.decoder.step(*self._rows(self._active)))

    def _decoded(self, rows: list[DecodeRequest], logits: Any) -> None:
        """Take a decode step's logits: sample, record, finish rows that are done."""
        for r in rows:
            r.kv_tokens = r.position + 1
        tokens = sample_rows(logits, rows)
        self.steps += 1
        self.rows += len(rows)
        self._active = [r for r, t in zip(rows, tokens, strict=True) if not self._accept(r, t)]


def _device_error(exc: BaseException) -> BaseException:
    if is_out_of_memory(exc):
        return DeviceOutOfMemory(f"out of memory in the decode loop: {exc}")
    return exc
