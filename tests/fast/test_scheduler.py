"""The continuous-batching scheduler over a fake decoder (pure logic, fast, CPU).

The fake decoder's "model" answers token ``t + 1`` after token ``t``, so every reply is
known in advance; it records every decode step and prefill forward, so the tests can check
what ran between two decode steps (interleaving), who got slots and budget first
(priorities), and what a cancelled or expired request leaves behind.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from conftest import drain  # noqa: E402

from convo.errors import ConfigError  # noqa: E402
from convo.fast import KVSlotPool, PrefillChunk  # noqa: E402
from convo.fast.scheduler import (  # noqa: E402
    SLOT_COPY_MIN_TOKENS,
    DecodeRequest,
    DecodeScheduler,
    FinishReason,
    Priority,
    decode_priority,
)

VOCAB = 1000


class Greedy:
    temperature = 0.0
    top_p = 1.0
    top_k = 0
    repetition_penalty = 1.0
    seed = None
    min_new_tokens = 0


def _logits(last: list[int]) -> Any:
    out = torch.zeros((len(last), VOCAB))
    out[range(len(last)), [(t + 1) % VOCAB for t in last]] = 1.0
    return out


class FakeDecoder:
    """The scheduler's view of a decoder: a real slot pool, a fake step and prefill."""

    def __init__(self, slots: int = 2, slot_tokens: int = 512) -> None:
        self.pool = KVSlotPool(
            num_layers=1, num_kv_heads=1, head_dim=2, slots=slots, slot_tokens=slot_tokens,
            dtype=torch.float32, device="cpu",
        )  # fmt: skip
        self.events: list[tuple[str, Any]] = []
        self.fail_prefill: bool | BaseException = False
        self.device = torch.device("cpu")

    def step(self, tokens: list[int], slots: list[int], positions: list[int]) -> Any:
        self.events.append(("step", list(zip(slots, positions, strict=True))))
        return _logits(tokens)

    def prefill_batch(self, chunks: list[PrefillChunk]) -> list[Any]:
        if isinstance(self.fail_prefill, BaseException):
            raise self.fail_prefill
        if self.fail_prefill:
            raise RuntimeError("device error")
        self.events.append(("prefill", [(c.slot, c.start, c.end) for c in chunks]))
        return list(_logits([c.ids[c.end - 1] for c in chunks]))


def request(n: int, *, first: int = 1, max_new: int = 4, **kw: Any) -> DecodeRequest:
    kw.setdefault("deadline", time.monotonic() + 60)
    return DecodeRequest(ids=list(range(first, first + n)), max_new_tokens=max_new, sampling=Greedy(), **kw)


def test_reply_tokens_follow_the_model_and_slots_are_released() -> None:
    dec = FakeDecoder()
    sched = DecodeScheduler(dec, step_tokens=64)  # on its own thread
    req = sched.submit(request(10, max_new=5))
    sched.close()  # the loop thread finishes the queued work, then stops
    assert req.done.wait(10)
    assert req.new_ids == [11, 12, 13, 14, 15]
    assert req.finish is FinishReason.LENGTH
    assert req.kv_tokens == 14  # the prompt and every reply token but the last are in the slot
    assert dec.pool.acquire(None) is not None and dec.pool.acquire(None) is not None  # both free


def test_long_prefill_never_stalls_running_replies_more_than_one_chunk() -> None:
    dec = FakeDecoder(slots=2)
    sched = DecodeScheduler(dec, background=False, step_tokens=16)
    running = sched.submit(request(5, max_new=30))
    for _ in range(3):
        sched.run_step()
    long = sched.submit(request(100, first=200, max_new=3))
    drain(sched)
    assert running.new_ids == list(range(6, 36))
    assert long.new_ids == [300, 301, 302]
    # Between two decode steps of the running reply: at most one prefill forward, of at
    # most the budget left after the decode rows.
    between = 0
    steps_with_running = [e for e in dec.events if e[0] == "step" and any(s == running.slot for s, _ in e[1])]
    assert len(steps_with_running) == 29  # every token after the first, one step each
    for kind, what in dec.events:
        if kind == "step":
            between = 0
            continue
        between += 1
        assert between <= 1
        assert sum(end - start for _, start, end in what) <= 16
    long_chunks = [c for kind, what in dec.events if kind == "prefill" for c in what if c[0] == long.slot]
    assert [c[1] for c in long_chunks] == list(range(0, 100, 15))  # 15 = budget - 1 running row
    # The running reply's positions advance by one every step: no step skipped it.
    positions = [p for _, rows in dec.events if _ == "step" for s, p in rows if s == running.slot]
    assert positions == list(range(5, 34))


def test_while_replies_stream_a_step_prefills_one_short_chunk() -> None:
    """With a reply streaming, each step prefills one chunk of at most interleave_tokens
    (one turn's); once nothing streams, the waiting turns' chunks share the whole budget."""
    dec = FakeDecoder(slots=3)
    sched = DecodeScheduler(dec, background=False, step_tokens=64, interleave_tokens=8)
    running = sched.submit(request(5, max_new=6))
    sched.run_step()  # its prefill: nothing streams yet
    a, b = sched.submit(request(40, first=100, max_new=2)), sched.submit(request(40, first=300, max_new=2))
    prefills = []
    while True:
        seen = len(dec.events)
        sched.run_step()
        if running.finished_at is not None:  # its last step: nothing streams after it
            break
        prefills += [what for kind, what in dec.events[seen:] if kind == "prefill"]
    assert prefills and all(len(what) == 1 and what[0][2] - what[0][1] <= 8 for what in prefills)
    assert {what[0][0] for what in prefills} == {a.slot}  # in arrival order: a first
    drain(sched)
    assert a.new_ids == [140, 141] and b.new_ids == [340, 341]
    with pytest.raises(ConfigError):
        DecodeScheduler(dec, interleave_tokens=0)


def test_background_rows_do_not_hold_prefill_to_short_chunks() -> None:
    """Only streaming replies limit a step's prefill: while just a summary decodes, a
    waiting turn prefills with the whole step budget."""
    dec = FakeDecoder(slots=2)
    sched = DecodeScheduler(dec, background=False, step_tokens=64, interleave_tokens=8)
    summary = sched.submit(request(5, max_new=20, priority=Priority.BACKGROUND))
    sched.run_step()
    turn = sched.submit(request(40, first=100, max_new=2))
    sched.run_step()
    assert ("prefill", [(turn.slot, 0, 40)]) in dec.events
    drain(sched)
    assert summary.new_ids == list(range(6, 26)) and turn.new_ids == [140, 141]


class MixedDecoder(FakeDecoder):
    """A decoder that runs decode rows and prefill chunks in one forward."""

    def mixed_step(
        self, tokens: list[int], slots: list[int], positions: list[int], chunks: list[PrefillChunk]
    ) -> tuple[Any, list[Any]]:
        self.events.append(
            ("mixed", (list(zip(slots, positions, strict=True)), [(c.slot, c.start, c.end) for c in chunks]))
        )
        return _logits(tokens), list(_logits([c.ids[c.end - 1] for c in chunks]))


def test_prefill_rides_in_the_decode_rows_forward() -> None:
    """With a mixed-step decoder, the chunks of several waiting turns (up to
    interleave_tokens) run in the same forward as the streaming replies' rows: every step
    advances every reply by one token, and the answers are those of separate forwards."""
    dec = MixedDecoder(slots=3)
    sched = DecodeScheduler(dec, background=False, step_tokens=64, interleave_tokens=12)
    running = sched.submit(request(5, max_new=12))
    sched.run_step()
    a, b = sched.submit(request(10, first=100, max_new=3)), sched.submit(request(10, first=300, max_new=3))
    drain(sched)
    assert running.new_ids == list(range(6, 18))
    assert a.new_ids == [110, 111, 112] and b.new_ids == [310, 311, 312]
    mixed = [what for kind, what in dec.events if kind == "mixed"]
    assert mixed[0][1] == [(a.slot, 0, 10), (b.slot, 0, 2)]  # two turns' chunks, 12 tokens
    assert mixed[1][1] == [(b.slot, 2, 10)]
    assert all(sum(end - start for _, start, end in chunks) <= 12 for _, chunks in mixed)
    rows = [what if kind == "step" else what[0] for kind, what in dec.events if kind != "prefill"]
    positions = [p for step in rows for s, p in step if s == running.slot]
    assert positions == list(range(5, 16))  # one token every step, mixed or not


class PackingDecoder(MixedDecoder):
    """A mixed-step decoder that packs up to two chunks, each but the last on blocks of 8."""

    mixed_chunks = 2
    mixed_pack_tokens = 8
    mixed_buckets = (16, 32)


def test_packed_chunks_start_on_blocks_within_the_budget() -> None:
    """With a decoder that packs chunks on blocks, a streaming step counts each chunk but
    the last in whole blocks and takes no more chunks than it packs."""
    dec = PackingDecoder(slots=5)
    sched = DecodeScheduler(dec, background=False, step_tokens=64, interleave_tokens=16)
    running = sched.submit(request(5, max_new=10))
    sched.run_step()
    a, b, c = (sched.submit(request(n, first=f, max_new=2)) for n, f in ((5, 100), (6, 200), (30, 300)))
    sched.run_step()
    first = next(what for kind, what in dec.events if kind == "mixed")
    assert first[1] == [(a.slot, 0, 5), (b.slot, 0, 6)]  # 8 + 6 rows of 16; no third chunk
    drain(sched)
    assert running.new_ids == list(range(6, 16)) and c.new_ids == [330, 331]
    assert sched._plan_prefill(16, 8) == []  # nothing waits
    for kind, what in dec.events:
        if kind == "mixed":
            sizes = [end - start for _, start, end in what[1]]
            assert len(sizes) <= 2 and sum(-(-n // 8) * 8 for n in sizes[:-1]) + sizes[-1] <= 16


def test_stats_count_every_step_by_kind() -> None:
    """SchedulerStats: decode, mixed and prefill steps, their time, rows and prompt tokens,
    the same totals the scheduler's own counters keep."""
    dec = MixedDecoder(slots=3)
    sched = DecodeScheduler(dec, background=False, step_tokens=64, interleave_tokens=12)
    assert sched.stats().steps == {"decode": 0, "mixed": 0, "prefill": 0}
    running = sched.submit(request(5, max_new=12))
    sched.run_step()  # prefill alone
    sched.submit(request(10, first=100, max_new=3))
    drain(sched)
    stats = sched.stats()
    kinds = [{"step": "decode"}.get(kind, kind) for kind, _ in dec.events]
    assert stats.steps == {k: kinds.count(k) for k in ("decode", "mixed", "prefill")}
    assert stats.steps["mixed"] >= 1 and stats.steps["decode"] >= 1 and stats.steps["prefill"] == 1
    assert set(stats.busy_s) == set(stats.steps) and all(v >= 0 for v in stats.busy_s.values())
    assert stats.decode_rows == sched.rows and stats.prompt_tokens == sched.prefill_tokens == 15
    assert stats.preemptions == 0 and len(running.new_ids) == 12


def test_waiting_prefills_run_together_in_one_forward() -> None:
    dec = FakeDecoder(slots=3)
    sched = DecodeScheduler(dec, background=False, step_tokens=64)
    reqs = [sched.submit(request(10, first=100 * i + 1, max_new=2)) for i in range(3)]
    sched.run_step()
    assert dec.events[0] == ("prefill", [(r.slot, 0, 10) for r in reqs])
    drain(sched)
    assert [r.new_ids for r in reqs] == [[11, 12], [111, 112], [211, 212]]


def test_replies_get_slots_and_prefill_budget_before_background_work() -> None:
    dec = FakeDecoder(slots=1)
    sched = DecodeScheduler(dec, background=False, step_tokens=64)
    summary = sched.submit(request(8, max_new=2, priority=Priority.BACKGROUND))
    reply = sched.submit(request(8, first=50, max_new=2))
    sched.run_step()
    assert reply.slot == 0 and summary.slot == -1  # the later reply got the only slot
    drain(sched)
    assert reply.finished_at is not None and summary.finished_at is not None
    assert reply.finished_at <= summary.finished_at
    assert summary.new_ids == [9, 10]

    dec = FakeDecoder(slots=2)
    sched = DecodeScheduler(dec, background=False, step_tokens=10)
    summary = sched.submit(request(30, max_new=1, priority=Priority.BACKGROUND))  # a summary's call
    reply = sched.submit(request(30, first=50, max_new=1))
    sched.run_step()  # both hold a slot; the budget goes to the reply first
    assert dec.events[0] == ("prefill", [(reply.slot, 0, 10)])


def test_cancel_while_waiting_prefilling_and_decoding() -> None:
    dec = FakeDecoder(slots=1)
    sched = DecodeScheduler(dec, background=False, step_tokens=8)
    cancels = [threading.Event() for _ in range(3)]
    decoding = sched.submit(request(4, max_new=50, cancel=cancels[0], cache_key="a"))
    waiting = sched.submit(request(4, max_new=5, cancel=cancels[1]))
    sched.run_step()
    sched.run_step()
    cancels[1].set()
    sched.run_step()
    assert waiting.finish is FinishReason.CANCELLED and waiting.slot == -1 and waiting.done.is_set()
    cancels[0].set()
    sched.run_step()
    assert decoding.finish is FinishReason.CANCELLED
    prefilling = sched.submit(request(40, first=300, max_new=5, cancel=cancels[2], cache_key="b"))
    sched.run_step()  # 8 of 40 tokens
    sched.run_step()  # 16
    cancels[2].set()
    sched.run_step()
    assert prefilling.finish is FinishReason.CANCELLED and prefilling.new_ids == []
    # The slot keeps the prefilled part for that session's next turn.
    _, kept = dec.pool.acquire("b")  # type: ignore[misc]
    assert kept == list(range(300, 316))


def test_deadlines_while_waiting_and_prefilling() -> None:
    dec = FakeDecoder(slots=1)
    sched = DecodeScheduler(dec, background=False, step_tokens=4)
    past = sched.submit(request(4, deadline=time.monotonic() - 1))
    sched.run_step()
    assert past.finish is FinishReason.TIMEOUT and past.slot == -1
    slow = sched.submit(request(40, deadline=time.monotonic() + 0.05))
    sched.run_step()
    time.sleep(0.06)
    sched.run_step()
    assert slow.finish is FinishReason.TIMEOUT and slow.kv_tokens == 4


def test_next_turn_prefills_only_what_changed() -> None:
    dec = FakeDecoder(slots=1)
    sched = DecodeScheduler(dec, background=False, step_tokens=64)
    first = sched.submit(request(10, max_new=3, cache_key="s"))
    drain(sched)
    second = sched.submit(
        DecodeRequest(
            ids=first.ids + first.new_ids + [500, 501], max_new_tokens=1, deadline=time.monotonic() + 60,
            sampling=Greedy(), cache_key="s",
        )
    )  # fmt: skip
    drain(sched)
    assert second.cached_tokens == 12  # the prompt and the first two reply tokens were in the slot
    assert dec.events[-1] == ("prefill", [(0, 12, 15)])
    assert second.new_ids == [502]


def _turn(ids: list[int], key: str | None, max_new: int = 1, **kw: Any) -> DecodeRequest:
    deadline = time.monotonic() + 60
    return DecodeRequest(
        ids=ids, max_new_tokens=max_new, deadline=deadline, sampling=Greedy(), cache_key=key, **kw
    )


def _counted(sched: DecodeScheduler, req: DecodeRequest) -> tuple[int, int]:
    """Prompt tokens prefilled and novel prompt tokens counted for ``req``, run alone."""
    before = sched.stats()
    sched.submit(req)
    drain(sched)
    after = sched.stats()
    return after.prompt_tokens - before.prompt_tokens, after.novel_prompt_tokens - before.novel_prompt_tokens


def test_novel_prompt_tokens_are_those_past_what_the_sessions_kv_last_held() -> None:
    """A turn that extends the last prompt and reply is novel from the reply's last token
    on (its K/V was never computed); one whose prefix changed, from the change on. With no
    eviction the scheduler prefills exactly the novel tokens."""
    sched = DecodeScheduler(FakeDecoder(slots=1), background=False, step_tokens=64)
    first = _turn(list(range(1, 11)), "s", max_new=3)
    assert _counted(sched, first) == (10, 10)  # unknown session: all of it
    assert first.new_ids == [11, 12, 13]
    second = _turn([*first.ids, *first.new_ids, 500, 501, 502, 503, 504], "s")
    assert _counted(sched, second) == (6, 6)  # token 13 and the 5 new ones
    slid = _turn([*second.ids[:3], 900, *second.ids[4:], *second.new_ids, 600], "s")  # 4th changed
    assert _counted(sched, slid) == (len(slid.ids) - 3, len(slid.ids) - 3)
    again = _turn(list(slid.ids), "s")  # the same prompt: its last token runs for the logits
    assert _counted(sched, again) == (1, 1)
    assert _counted(sched, _turn([1, 2, 3], None)) == (3, 3)  # no session: all of it, always
    assert _counted(sched, _turn([1, 2, 3], None)) == (3, 3)


def test_a_session_evicted_and_dropped_costs_prompt_tokens_but_is_not_novel() -> None:
    dec = FakeDecoder(slots=1)  # no host memory: an evicted session's KV is dropped
    sched = DecodeScheduler(dec, background=False, step_tokens=64)
    a = _turn(list(range(1, 11)), "a", max_new=3)
    _counted(sched, a)
    assert _counted(sched, _turn(list(range(100, 120)), "b")) == (20, 20)  # b takes a's slot
    nxt = _turn([*a.ids, *a.new_ids, 500, 501, 502, 503, 504], "a")
    assert _counted(sched, nxt) == (18, 6)  # recomputed in full; only 6 were new
    assert nxt.cached_tokens == 0
    stats = sched.stats()
    assert stats.prompt_tokens - stats.novel_prompt_tokens == 12  # what the eviction cost
    sched.forget("a")  # a closed session: its KV and what the ledger held of it
    assert dec.pool.owners() == [] and _counted(sched, _turn(list(nxt.ids), "a")) == (18, 18)


def test_work_for_an_owner_does_not_change_what_its_session_is_counted_against() -> None:
    """A summary (``owner=``) is novel past its common prefix with its session's KV, and
    keeps none of its own: the session's next turn counts against its own last turn."""
    sched = DecodeScheduler(FakeDecoder(slots=2), background=False, step_tokens=64)
    a = _turn(list(range(1, 11)), "a", max_new=3)
    _counted(sched, a)
    summary = DecodeRequest(
        ids=[*a.ids[:5], 700, 701, 702], max_new_tokens=4, deadline=time.monotonic() + 60,
        sampling=Greedy(), owner="a", priority=Priority.BACKGROUND,
    )  # fmt: skip
    assert _counted(sched, summary) == (3, 3)  # it shares a's first 5 tokens
    nxt = _turn([*a.ids, *a.new_ids, 500], "a")
    assert _counted(sched, nxt)[1] == 2  # token 13 and 500: not counted against the summary


def test_prompt_tokens_are_counted_by_kind_of_work_and_recomputes_apart() -> None:
    """Replies, background work and prefills ahead are counted apart (they add up to the
    totals), and what preempted work prefilled again after its stop is counted too."""
    dec = FakeDecoder(slots=1)
    sched = DecodeScheduler(
        dec, background=False, step_tokens=64, background_finish_tokens=0, background_min_idle_s=0.0
    )
    sched.submit(_turn(list(range(1, 21)), "a", prefill_only=True, priority=Priority.BACKGROUND))
    drain(sched)
    summary = sched.submit(_turn(list(range(30, 36)), None, max_new=8, priority=Priority.BACKGROUND))
    for _ in range(3):
        sched.run_step()
    reply = sched.submit(_turn([*range(1, 21), 500, 501], "a"))  # preempts the summary
    drain(sched)
    assert summary.preemptions == 1 and reply.new_ids
    stats = sched.stats()
    assert stats.prompt_tokens_by_work["prefill"] == 20
    assert stats.prompt_tokens_by_work["reply"] == 22  # its slot went to the summary meanwhile
    assert stats.prompt_tokens_by_work["background"] == 6 + 6 + 3  # again, with its 3 tokens
    assert stats.recomputed_tokens == 9
    assert sum(stats.prompt_tokens_by_work.values()) == stats.prompt_tokens
    assert sum(stats.novel_tokens_by_work.values()) == stats.novel_prompt_tokens
    assert stats.novel_tokens_by_work == {"reply": 2, "background": 6, "prefill": 20}


def test_a_summary_copies_its_sessions_prefix_from_the_slot_where_its_turn_runs() -> None:
    """A summary queued while its session's turn holds the session's slot takes another
    slot and copies the prefix it shares from the turn's slot (K/V and all), instead of
    prefilling it again; what it writes is the same."""
    dec = FakeDecoder(slots=2)
    sched = DecodeScheduler(dec, background=False, step_tokens=64, background_min_idle_s=0.0)
    turn = sched.submit(_turn(list(range(1, 41)), "a", max_new=6))
    sched.run_step()  # the turn's prompt is in, its reply streams
    assert turn.new_ids == [41]
    for t in dec.pool.slot_tensors():  # what the turn's slot holds
        t[turn.slot, :, :40] = torch.arange(40, dtype=t.dtype)[None, :, None] + 1
    ids = [*range(1, 31), 900, 901]  # the session's first 30 tokens, then the instruction
    summary = sched.submit(
        DecodeRequest(
            ids=ids, max_new_tokens=2, deadline=time.monotonic() + 60, sampling=Greedy(), owner="a",
            priority=Priority.BACKGROUND,
        )
    )  # fmt: skip
    drain(sched)
    assert summary.new_ids == [902, 903] and turn.new_ids[-1] == 46
    assert summary.cached_tokens == 30
    other = summary.slot
    assert other == 1 - turn.slot
    assert [w for k, w in dec.events if k == "prefill" and w[0][0] == other] == [[(other, 30, 32)]]
    for t in dec.pool.slot_tensors():
        assert torch.equal(t[other, :, :30], t[turn.slot, :, :30])
    stats = sched.stats()
    assert (stats.slot_copies, stats.slot_copied_tokens) == (1, 30)
    assert stats.prompt_tokens_by_work["background"] == 2
    # Sharing fewer than SLOT_COPY_MIN_TOKENS more tokens: prefilled, not copied.
    turn = sched.submit(_turn([*turn.ids, *turn.new_ids, 500], "a", max_new=6))
    sched.run_step()
    short = sched.submit(
        DecodeRequest(
            ids=[*range(1, SLOT_COPY_MIN_TOKENS - 1), 900], max_new_tokens=1, deadline=time.monotonic() + 60,
            sampling=Greedy(), owner="a", priority=Priority.BACKGROUND,
        )
    )  # fmt: skip
    drain(sched)
    assert short.cached_tokens == 0 and sched.stats().slot_copies == 1


def test_a_turn_queued_behind_its_sessions_prefill_counts_against_that_prefill() -> None:
    """The ledger takes a session's prompt at submit: a turn queued behind its session's
    background prefill is novel only past that prefix (an exact cache would serve it), and
    neither counts before its prompt is in (work still queued is in neither figure)."""
    sched = DecodeScheduler(FakeDecoder(slots=2), background=False, step_tokens=64)
    prefix = list(range(1, 41))
    prefill = sched.submit(_turn(prefix, "a", prefill_only=True, priority=Priority.BACKGROUND))
    turn = sched.submit(_turn([*prefix, 500, 501], "a"))
    assert sched.stats().novel_prompt_tokens == 0
    drain(sched)
    assert prefill.finish is FinishReason.STOP and turn.new_ids == [502]
    assert sched.stats().novel_prompt_tokens == 40 + 2


def test_prefill_error_fails_its_requests_only() -> None:
    dec = FakeDecoder(slots=2)
    sched = DecodeScheduler(dec, background=False, step_tokens=64)
    ok = sched.submit(request(4, max_new=10))
    sched.run_step()
    dec.fail_prefill = True
    bad = sched.submit(request(4, first=40, max_new=3))
    sched.run_step()
    assert isinstance(bad.error, RuntimeError) and bad.done.is_set()
    dec.fail_prefill = False
    drain(sched)
    assert ok.error is None and ok.new_ids == list(range(5, 15))


def test_step_tokens_must_be_positive() -> None:
    from convo.errors import ConfigError

    with pytest.raises(ConfigError):
        DecodeScheduler(FakeDecoder(), step_tokens=0)


def test_engine_refuses_a_step_budget_below_one_before_loading() -> None:
    pytest.importorskip("transformers")
    from convo.engines.local.engine import TransformersEngine
    from convo.errors import ConfigError

    with pytest.raises(ConfigError, match="step_tokens"):
        TransformersEngine(step_tokens=0)


def test_out_of_memory_is_recognized_by_convo_errors_and_mapped_to_device_out_of_memory() -> None:
    from convo.errors import DeviceOutOfMemory

    class OutOfMemoryError(Exception):  # a look-alike outside torch is not a device OOM
        pass

    dec = FakeDecoder(slots=2)
    sched = DecodeScheduler(dec, background=False, step_tokens=64)
    dec.fail_prefill = torch.OutOfMemoryError("CUDA out of memory (injected)")
    oom = sched.submit(request(4))
    sched.run_step()
    assert isinstance(oom.error, DeviceOutOfMemory) and "out of memory" in str(oom.error)
    dec.fail_prefill = OutOfMemoryError("not torch")
    other = sched.submit(request(4, first=40))
    sched.run_step()
    assert type(other.error) is OutOfMemoryError


def test_slot_backend_implements_the_kv_interface() -> None:
    from convo.engines.base import KVBackend, KVCall
    from convo.engines.local.kv import SlotKV

    def call(ids: list[int], max_new: int) -> KVCall:
        return KVCall(ids=ids, max_new_tokens=max_new, timeout_s=30, sampling=Greedy(), cache_key="a")

    dec = FakeDecoder(slots=2, slot_tokens=64)
    per_token = dec.pool.slot_nbytes // 64
    kv: KVBackend = SlotKV(dec, None, model_ids=list, eos=[], step_tokens=64, interleave_tokens=16)
    try:
        first = kv.generate(call([1, 2, 3, 4], 3))
        assert (first.new_ids, first.cached_tokens, first.kv_tokens) == ([5, 6, 7], 0, 6)
        assert (first.kv_slot_bytes, first.kv_bytes) == (dec.pool.slot_nbytes, 6 * per_token)
        assert not (first.cancelled or first.timed_out) and first.start <= first.end
        assert kv.cached_sessions == ["a"]
        # The next turn extends the kept tokens: only what changed is prefilled.
        again = kv.generate(call([1, 2, 3, 4, 5, 6, 7, 9], 2))
        assert again.cached_tokens == 6 and again.new_ids == [10, 11]
        kv.release("a")
        assert kv.cached_sessions == []
    finally:
        kv.close()


def test_the_slot_backend_hands_the_calls_priority_to_the_scheduler() -> None:
    from convo.engines.base import KVCall
    from convo.engines.local.kv import SlotKV

    seen: list[int] = []

    class Recording(DecodeScheduler):
        def run(self, request: DecodeRequest) -> DecodeRequest:
            seen.append(request.priority)
            return super().run(request)

    kv = SlotKV(FakeDecoder(slots=1), None, model_ids=list, eos=[], step_tokens=64, interleave_tokens=16)
    kv.scheduler.close()
    kv.scheduler = Recording(kv.decoder, step_tokens=64)
    try:
        for priority in (None, Priority.BACKGROUND, Priority.REPLY):
            kv.generate(
                KVCall(ids=[1, 2], max_new_tokens=1, timeout_s=30, sampling=Greedy(), priority=priority)
            )
    finally:
        kv.close()
    assert seen == [Priority.REPLY, Priority.BACKGROUND, Priority.REPLY]


def test_auto_kv_slots_is_one_count_for_the_engine_and_the_planner() -> None:
    from convo.models import DEFAULT_KV_SLOTS, auto_kv_slots

    slot = 1 << 20
    assert auto_kv_slots(10 * slot, slot) == 5  # half of the free memory
    assert auto_kv_slots(1000 * slot, slot) == DEFAULT_KV_SLOTS
    assert auto_kv_slots(1.5 * slot, slot) == 0  # not one fits: plain generate


def test_background_work_leaves_hot_session_caches_alone() -> None:
    """A summary takes an empty slot, or a session's cached slot only once it has idled
    ``background_min_idle_s`` (or the summary has waited ``background_max_wait_s``): the
    session's next turn finds its prompt still cached."""
    dec = FakeDecoder(slots=2)
    sched = DecodeScheduler(dec, background=False, background_min_idle_s=60.0, background_max_wait_s=60.0)
    turns = [sched.submit(request(10, first=f, max_new=2, cache_key=k)) for f, k in ((100, "a"), (300, "b"))]
    drain(sched)
    summary = sched.submit(request(5, max_new=2, priority=Priority.BACKGROUND))
    for _ in range(3):
        sched.run_step()
    assert summary.slot == -1 and sched.queued == 1  # both slots hold hot caches
    nxt = sched.submit(request(12, first=100, max_new=1, cache_key="a"))  # turn a's prompt + 2
    sched.run_step()
    assert nxt.cached_tokens == 11 and nxt.slot == turns[0].slot  # its cache was kept
    sched.background_min_idle_s = 0.0  # the caches have now idled long enough
    drain(sched)
    assert summary.new_ids == [6, 7] and summary.finish is FinishReason.LENGTH
    # The bound on waiting: a summary that waited background_max_wait_s takes a hot slot.
    sched.background_min_idle_s, sched.background_max_wait_s = 60.0, 0.0
    late = sched.submit(request(5, max_new=2, priority=Priority.BACKGROUND))
    drain(sched)
    assert late.new_ids == [6, 7]


def test_a_reply_preempts_background_work_which_then_goes_on() -> None:
    """A reply that finds every slot busy stops the latest background request (its slot
    freed at once); the summary, re-admitted later, prefills its prompt and the tokens it
    had generated, and its reply is the one it would have written without the stop."""
    dec = FakeDecoder(slots=1)
    # (0: preempt even work about to finish; by default it would be waited for.)
    sched = DecodeScheduler(dec, background=False, step_tokens=64, background_finish_tokens=0)
    summary = sched.submit(request(5, max_new=8, priority=Priority.BACKGROUND))
    for _ in range(3):
        sched.run_step()
    assert summary.new_ids == [6, 7, 8]
    reply = sched.submit(request(10, first=100, max_new=2))
    sched.run_step()
    assert summary.slot == -1 and summary.preemptions == 1 and sched.preemptions == 1
    assert reply.slot == 0
    drain(sched)
    assert reply.new_ids == [110, 111]
    assert summary.new_ids == [6, 7, 8, 9, 10, 11, 12, 13] and summary.finish is FinishReason.LENGTH
    # Re-admitted, it prefilled its prompt and the 3 tokens it had, then decoded on.
    resumed = [what for kind, what in dec.events if kind == "prefill" and what[0][2] == 8]
    assert resumed == [[(0, 0, 8)]]
    # The recompute costs prompt tokens but is not novel: each prompt counts once.
    assert (sched.prefill_tokens, sched.novel_prompt_tokens) == (5 + 10 + 8, 5 + 10)
    assert summary.first_token_at is not None and summary.first_token_at < reply.first_token_at  # type: ignore[operator]
    # A request of the same priority is never preempted: it waits for the slot.
    a = sched.submit(request(5, max_new=4))
    sched.run_step()
    b = sched.submit(request(5, first=50, max_new=1))
    sched.run_step()
    assert b.slot == -1 and a.slot == 0
    drain(sched)
    assert a.new_ids == [6, 7, 8, 9] and b.new_ids == [55]


def test_the_deprecated_decode_priority_still_marks_requests_made_in_its_block() -> None:
    with pytest.warns(DeprecationWarning, match="decode_priority"), decode_priority(Priority.BACKGROUND):
        inside = DecodeRequest(ids=[1], max_new_tokens=1, deadline=0.0, sampling=None)
    outside = DecodeRequest(ids=[1], max_new_tokens=1, deadline=0.0, sampling=None)
    assert (inside.priority, outside.priority) == (Priority.BACKGROUND, Priority.REPLY)


def test_queued_running_and_idle_say_where_requests_are() -> None:
    sched = DecodeScheduler(FakeDecoder(slots=1), background=False, step_tokens=64)
    assert sched.idle and (sched.queued, sched.running, sched.waiting) == (0, 0, 0)
    first, second = sched.submit(request(5, max_new=3)), sched.submit(request(5, first=50, max_new=3))
    assert (sched.queued, sched.waiting) == (2, 2)
    sched.run_step()  # the one slot: the first prefills and samples its first token
    assert (sched.queued, sched.running) == (1, 1) and not sched.idle
    drain(sched)
    assert sched.idle and first.finished_at is not None and second.finished_at is not None


def test_a_request_that_cannot_fit_a_slot_is_refused_alone_at_submit() -> None:
    dec = FakeDecoder(slots=1, slot_tokens=64)
    sched = DecodeScheduler(dec, background=False, step_tokens=16)
    running = sched.submit(request(10, max_new=4))
    with pytest.raises(ConfigError, match="do not fit a slot of 64 tokens"):
        sched.submit(request(60, max_new=8))
    drain(sched)
    assert running.error is None and running.new_ids == [11, 12, 13, 14]
