"""Background work (summaries, background prefills) under replies, over a fake step (issue 22).

The fake decoder writes a value per token into the pool's K and V, its next token depends on
the sum of the slot's K values, and every step advances a fake clock: a slot that does not
hold exactly the KV its request left (a summary resumed from the wrong bytes, a reply whose
KV was dropped) answers other tokens, and the scheduler's measured step costs are those of
the fake clock. The rules tested: a reply keeps its KV while its session's summary runs in
another slot; a reply parks a summary in host memory (it resumes by a copy, exactly) rather
than recompute it, never stops one about to finish, and stops the one with the most left;
background work holds at most ``background_slots`` slots; with host memory, a summary takes
the slot of a session expected back only after it ends, never of one due sooner.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from convo.fast import KVSlotPool, PrefillChunk  # noqa: E402
from convo.fast.kv_policy import NextUsePolicy  # noqa: E402
from convo.fast.scheduler import (  # noqa: E402
    DEFAULT_BACKGROUND_SLOT_SHARE,
    SLOT_POLL_S,
    DecodeRequest,
    DecodeScheduler,
    FinishReason,
    Priority,
)
from convo.models import GREEDY  # noqa: E402

VOCAB = 997
STEP_S = 0.01  # a decode step on the fake clock
TOKEN_S = 0.0001  # a prompt token


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class KVDecoder:
    """A decoder whose next token depends on the KV in its slot; steps take fake time."""

    def __init__(self, slots: int, *, host: int = 0, think_s: float = 5.0, slot_tokens: int = 256) -> None:
        self.clock = Clock()
        self.pool = KVSlotPool(
            num_layers=1, num_kv_heads=1, head_dim=2, slots=slots, slot_tokens=slot_tokens,
            dtype=torch.float64, device="cpu", policy=NextUsePolicy(think_s=think_s), clock=self.clock,
        )  # fmt: skip
        if host:
            self.pool.set_host_memory(host)
        self.prefilled: list[tuple[int, int, int]] = []

    def _write(self, slot: int, pos: int, token: int) -> None:
        for i, t in enumerate(self.pool.slot_tensors()):
            t[slot, :, pos, :] = float((token * 31 + pos * 7) % 101) + i

    def _logits(self, slot: int, pos: int) -> Any:
        total = int(sum(float(t[slot, :, : pos + 1, :].sum()) for t in self.pool.slot_tensors()))
        out = torch.zeros(VOCAB)
        out[total % VOCAB] = 1.0
        return out

    def prefill_batch(self, chunks: list[PrefillChunk]) -> list[Any]:
        for c in chunks:
            for pos in range(c.start, c.end):
                self._write(c.slot, pos, c.ids[pos])
            self.prefilled.append((c.slot, c.start, c.end))
        self.clock.now += TOKEN_S * sum(c.end - c.start for c in chunks)
        return [self._logits(c.slot, c.end - 1) for c in chunks]

    def step(self, tokens: list[int], slots: list[int], positions: list[int]) -> Any:
        for t, s, p in zip(tokens, slots, positions, strict=True):
            self._write(s, p, t)
        self.clock.now += STEP_S
        return torch.stack([self._logits(s, p) for s, p in zip(slots, positions, strict=True)])


def _sched(dec: KVDecoder, **kw: Any) -> DecodeScheduler:
    kw.setdefault("background_max_wait_s", 600.0)
    return DecodeScheduler(dec, background=False, step_tokens=64, clock=dec.clock, timer=dec.clock, **kw)


def _req(dec: KVDecoder, ids: list[int], n: int = 5, **kw: Any) -> DecodeRequest:
    return DecodeRequest(
        ids=ids, max_new_tokens=n, deadline=float("inf"), sampling=GREEDY, started_at=dec.clock.now, **kw
    )


def _summary(dec: KVDecoder, owner: str, n: int = 30, first: int = 900) -> DecodeRequest:
    """A summary of its own prompt (no prefix in common with its session's KV)."""
    return _req(dec, list(range(first, first + 12)), n, owner=owner, priority=Priority.BACKGROUND)


def _step(sched: DecodeScheduler) -> None:
    """One step; when nothing ran (work waits for a slot), the loop's poll interval passes."""
    clock = sched.clock
    before = clock()
    sched.run_step()
    if clock() == before:
        clock.now += SLOT_POLL_S  # type: ignore[attr-defined]


def _steps(sched: DecodeScheduler, n: int) -> None:
    for _ in range(n):
        _step(sched)


def _drain(sched: DecodeScheduler) -> None:
    for _ in range(2000):
        if sched.idle:
            return
        _step(sched)
    raise AssertionError("the scheduler did not drain")


def _run(sched: DecodeScheduler, req: DecodeRequest) -> DecodeRequest:
    sched.submit(req)
    _drain(sched)
    assert req.finish is not None and req.error is None
    return req


def _alone(req: DecodeRequest, **dec: Any) -> list[int]:
    """What ``req``'s prompt answers on a scheduler of its own."""
    d = KVDecoder(1, **dec)
    return _run(_sched(d), _req(d, req.ids, req.max_new_tokens)).new_ids


def test_a_reply_keeps_its_kv_while_its_sessions_summary_runs_in_another_slot() -> None:
    dec = KVDecoder(2, host=1 << 20)
    sched = _sched(dec)
    a1 = _run(sched, _req(dec, list(range(1, 41)), cache_key="a"))
    summary = sched.submit(_summary(dec, "a", n=40))
    _steps(sched, 3)
    assert summary.slot == a1.slot  # in a's own slot (a's KV went to host first)
    a2 = _run(sched, _req(dec, [*a1.ids, *a1.new_ids, 7, 8], 2, cache_key="a"))
    assert a2.slot != summary.slot and a2.cached_tokens == 44
    assert summary.finish is FinishReason.LENGTH
    a3 = _run(sched, _req(dec, [*a2.ids, *a2.new_ids, 9], 2, cache_key="a"))
    assert a3.cached_tokens == len(a2.ids) + 1  # a2's KV was kept, not dropped as a twin


def test_a_reply_parks_a_summary_in_host_memory_and_it_resumes_exactly_by_a_copy() -> None:
    dec = KVDecoder(1, host=1 << 20)
    sched = _sched(dec)
    a1 = _run(sched, _req(dec, list(range(1, 31)), cache_key="a"))
    summary = sched.submit(_summary(dec, "a", n=40))
    _steps(sched, 6)
    done = len(summary.new_ids)
    assert 0 < done < 40 - sched.background_finish_tokens
    reply = _run(sched, _req(dec, list(range(500, 520)), 3, cache_key="b"))  # no slot: parks it
    stats = sched.stats()
    assert (stats.preemptions, stats.parked) == (1, 1) and summary.preemptions == 1
    assert reply.new_ids == _alone(reply)
    assert summary.finish is FinishReason.LENGTH and summary.new_ids == _alone(summary)
    # Resumed from host: only the last token it had sampled was prefilled again, not its prompt.
    resumed = [p for p in dec.prefilled if p[2] == len(summary.ids) + done]
    assert resumed == [(0, len(summary.ids) + done - 1, len(summary.ids) + done)]
    assert "a" in dec.pool.owners() and all(not k.startswith("\x00") for k in dec.pool.owners())
    assert dec.pool.host is not None and [k for k in dec.pool.host.keys() if k.startswith("\x00")] == []
    assert a1.finish is FinishReason.LENGTH


def _slid_turn_before_its_summary(
    host: int,
) -> tuple[KVDecoder, DecodeScheduler, DecodeRequest, DecodeRequest]:
    """On one slot: session a's turn; then, queued together, the summary of the turns its
    window left (its prompt's first 30 tokens, then an instruction) and a's next turn, whose
    slid window keeps only the first 10 of them. The turn runs first and overwrites them."""
    dec = KVDecoder(1, host=host)
    sched = _sched(dec)
    a1 = _run(sched, _req(dec, list(range(1, 41)), 4, cache_key="a"))
    summary = sched.submit(_req(dec, [*a1.ids[:30], 700, 701], 6, owner="a", priority=Priority.BACKGROUND))
    a2 = sched.submit(_req(dec, [*a1.ids[:10], *a1.ids[30:], *a1.new_ids, 9], 3, cache_key="a"))
    _drain(sched)
    assert a2.first_token_at is not None and summary.first_token_at is not None
    assert a2.first_token_at < summary.first_token_at  # the turn went first
    return dec, sched, summary, a2


def test_a_turn_that_overwrites_the_prefix_its_summary_waits_for_parks_it_first() -> None:
    """The prefix goes to host memory before the turn's writes, and the summary resumes
    from it by a copy: it prefills only its instruction and writes what it writes alone;
    the turn's own KV comes back for the session's next turn."""
    dec, sched, summary, a2 = _slid_turn_before_its_summary(host=1 << 20)
    assert summary.cached_tokens == 30 and summary.new_ids == _alone(summary)
    assert (0, 30, 32) in dec.prefilled and (0, 0, 32) not in dec.prefilled
    assert sched.stats().prompt_tokens_by_work["background"] == 2 and sched.kept_for_background == 1
    a3 = _run(sched, _req(dec, [*a2.ids, *a2.new_ids, 5], 2, cache_key="a"))
    assert a3.cached_tokens == len(a2.ids) + len(a2.new_ids) - 1 and a3.new_ids == _alone(a3)
    assert dec.pool.host is not None and [k for k in dec.pool.host.keys() if k.startswith("\x00")] == []


def test_a_turn_that_copies_back_part_of_its_sessions_host_kv_hands_the_rest_to_its_summary() -> None:
    """Session a's KV went to host memory (b took the slot). Its next turn, whose window
    slid, copies back only the prefix it keeps; the queued summary, which reads the turns
    the window left, gets host memory's copy (no copy made: the entry is handed over) and
    resumes from it."""
    dec = KVDecoder(1, host=1 << 20)
    sched = _sched(dec)
    a1 = _run(sched, _req(dec, list(range(1, 41)), 4, cache_key="a"))
    _run(sched, _req(dec, list(range(500, 520)), 3, cache_key="b"))  # a's KV to host
    swaps_out = sched.stats().swaps_out
    summary = sched.submit(_req(dec, [*a1.ids[:30], 700, 701], 6, owner="a", priority=Priority.BACKGROUND))
    a2 = sched.submit(_req(dec, [*a1.ids[:10], *a1.ids[30:], *a1.new_ids, 9], 3, cache_key="a"))
    _drain(sched)
    assert a2.cached_tokens == 10 and a2.new_ids == _alone(a2)
    assert a2.first_token_at < summary.first_token_at  # type: ignore[operator]
    assert summary.cached_tokens == 30 and summary.new_ids == _alone(summary)
    assert sched.kept_for_background == 1
    # Out: b's KV (for a2), then a2's (for the summary); nothing was copied for the summary.
    assert sched.stats().swaps_out == swaps_out + 2
    assert dec.pool.host is not None and [k for k in dec.pool.host.keys() if k.startswith("\x00")] == []


def test_without_host_memory_a_summary_whose_prefix_was_overwritten_recomputes_it() -> None:
    _, sched, summary, _ = _slid_turn_before_its_summary(host=0)
    assert summary.cached_tokens == 10 and summary.new_ids == _alone(summary)
    assert sched.kept_for_background == 0


def test_without_host_memory_a_stopped_summary_is_recomputed_and_still_exact() -> None:
    dec = KVDecoder(1)
    sched = _sched(dec, reply_wait_tokens=0, background_finish_tokens=0)
    summary = sched.submit(_summary(dec, "a", n=40))
    _steps(sched, 6)
    done = len(summary.new_ids)
    _run(sched, _req(dec, list(range(500, 520)), 3, cache_key="b"))
    assert sched.stats().parked == 0 and summary.preemptions == 1
    assert summary.new_ids == _alone(summary)
    assert (0, 0, len(summary.ids) + done) in dec.prefilled  # its prompt and tokens again


def test_a_reply_waits_for_a_summary_about_to_finish_instead_of_stopping_it() -> None:
    dec = KVDecoder(1, host=1 << 20)
    sched = _sched(dec, background_finish_tokens=8)
    summary = sched.submit(_summary(dec, "a", n=12))
    _steps(sched, 6)  # 12 - 5 = 7 tokens left: about to finish
    reply = sched.submit(_req(dec, list(range(500, 520)), 3, cache_key="b"))
    _step(sched)
    assert reply.slot == -1 and summary.slot == 0  # the reply waits
    _drain(sched)
    assert sched.stats().preemptions == 0 and summary.finish is FinishReason.LENGTH
    assert reply.first_token_at is not None and summary.finished_at is not None
    assert reply.first_token_at > summary.finished_at


def test_of_two_summaries_the_reply_stops_the_one_with_most_left() -> None:
    dec = KVDecoder(2, host=1 << 20)
    sched = _sched(dec, background_slots=2)
    short = sched.submit(_summary(dec, "a", n=60, first=900))  # (more left than a reply waits for)
    _steps(sched, 10)
    long = sched.submit(_summary(dec, "b", n=200, first=950))  # later, and with more left
    _steps(sched, 3)
    sched.submit(_req(dec, list(range(500, 520)), 3, cache_key="c"))
    _step(sched)
    assert (short.preemptions, long.preemptions) == (0, 1)
    _drain(sched)
    assert short.new_ids == _alone(short) and long.new_ids == _alone(long)


def test_background_work_holds_at_most_its_share_of_the_slots_and_drains() -> None:
    dec = KVDecoder(4, host=1 << 20)
    sched = _sched(dec)
    assert sched.background_slots == int(4 * DEFAULT_BACKGROUND_SLOT_SHARE) == 2
    jobs = [sched.submit(_summary(dec, f"s{i}", n=20, first=900 + 20 * i)) for i in range(4)]
    peak = 0
    for _ in range(400):
        if sched.idle:
            break
        _step(sched)
        peak = max(peak, sum(j.slot >= 0 and j.finish is None for j in jobs))
    assert peak == 2 and all(j.finish is FinishReason.LENGTH for j in jobs)
    # A reply finds a slot at once, without stopping any of them.
    more = [sched.submit(_summary(dec, f"t{i}", n=30, first=700 + 20 * i)) for i in range(2)]
    _steps(sched, 4)
    reply = sched.submit(_req(dec, list(range(500, 520)), 3, cache_key="c"))
    _step(sched)
    assert reply.slot >= 0 and sched.stats().preemptions == 0
    _drain(sched)
    assert all(j.finish is FinishReason.LENGTH for j in more)


@pytest.mark.parametrize(("think_s", "takes"), [(60.0, True), (2.0, False)])
def test_with_host_memory_a_summary_takes_the_slot_of_a_session_back_only_after_it(
    think_s: float, takes: bool
) -> None:
    """z has no slot; a and b hold both, idle 1.5 s, their users thinking. They are
    expected back ``think_s`` after their reply: in a minute, and the summary (~1 s of
    fake steps) takes the slot of the one needed last, its KV to host; in half a second
    more, and it waits for a slot."""
    dec = KVDecoder(2, host=1 << 20, think_s=think_s)
    sched = _sched(dec)
    a = _run(sched, _req(dec, list(range(1, 41)), 12, cache_key="a"))  # (the step costs are measured)
    _run(sched, _req(dec, list(range(300, 340)), 12, cache_key="b"))
    dec.clock.now += 1.5
    summary = sched.submit(_summary(dec, "z", n=100))
    _steps(sched, 2)
    assert (summary.slot >= 0) is takes
    if takes:
        _drain(sched)
        assert dec.pool.swaps_out == 1 and sorted(dec.pool.owners()) == ["a", "b"]
        again = _run(sched, _req(dec, [*a.ids, *a.new_ids, 5], 2, cache_key="a"))
        assert again.cached_tokens == len(a.ids) + len(a.new_ids) - 1  # back from host
    else:
        assert dec.pool.swaps_out == 0 and summary.finish is None
