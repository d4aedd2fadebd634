"""A session's KV outlives its slot: host offload, eviction by expected next use, work done
for a session in its own slot, background prefill (issue 22).

The fake decoder here writes a value per token into the pool's K and V, and its "model"
answers with the sum of the slot's K values up to the position: a slot that does not hold
exactly the KV a session left (a restore that copied nothing, or the wrong tokens) answers
other tokens. The real decoder on a tiny random model checks the same on CPU; the CUDA
test (skipped without CUDA) checks it with pinned memory, side-stream copies and graphs.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from convo.fast import KVSlotPool, PrefillChunk  # noqa: E402
from convo.fast.kv_policy import LRUPolicy, NextUsePolicy  # noqa: E402
from convo.fast.scheduler import DecodeRequest, DecodeScheduler, FinishReason, Priority  # noqa: E402
from convo.models import GREEDY  # noqa: E402

VOCAB = 997
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _value(token: int, pos: int) -> float:
    return float((token * 31 + pos * 7) % 101)


class KVDecoder:
    """The scheduler's view of a decoder whose next token depends on the KV in its slot."""

    def __init__(self, slots: int, slot_tokens: int = 256, **pool: Any) -> None:
        self.pool = KVSlotPool(
            num_layers=2, num_kv_heads=2, head_dim=2, slots=slots, slot_tokens=slot_tokens,
            dtype=torch.float64, device="cpu", **pool,
        )  # fmt: skip
        self.device = torch.device("cpu")
        self.prefilled: list[tuple[int, int, int]] = []

    def _write(self, slot: int, pos: int, token: int) -> None:
        for i, t in enumerate(self.pool.slot_tensors()):
            t[slot, :, pos, :] = _value(token, pos) + i

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
        return [self._logits(c.slot, c.end - 1) for c in chunks]

    def step(self, tokens: list[int], slots: list[int], positions: list[int]) -> Any:
        for t, s, p in zip(tokens, slots, positions, strict=True):
            self._write(s, p, t)
        return torch.stack([self._logits(s, p) for s, p in zip(slots, positions, strict=True)])


def _req(ids: list[int], n: int = 5, **kw: Any) -> DecodeRequest:
    return DecodeRequest(ids=ids, max_new_tokens=n, deadline=time.monotonic() + 60, sampling=GREEDY, **kw)


def _drain(sched: DecodeScheduler) -> None:
    for _ in range(1000):
        if sched.idle:
            return
        sched.run_step()


def _run(sched: DecodeScheduler, req: DecodeRequest) -> DecodeRequest:
    sched.submit(req)
    _drain(sched)
    assert req.finish is not None and req.error is None
    return req


def _conversation(dec: KVDecoder) -> tuple[DecodeRequest, DecodeRequest, DecodeRequest]:
    """a, then b (on one slot: b takes a's), then a's next turn."""
    sched = DecodeScheduler(dec, background=False, step_tokens=64)
    a1 = _run(sched, _req(list(range(1, 41)), cache_key="a"))
    b = _run(sched, _req(list(range(500, 530)), cache_key="b"))
    a2 = _run(sched, _req([*a1.ids, *a1.new_ids, 77, 78, 79], cache_key="a"))
    return a1, b, a2


def test_an_evicted_session_comes_back_from_host_with_the_same_reply() -> None:
    kept = KVDecoder(slots=2)  # a never leaves its slot
    ref = _conversation(kept)
    dec = KVDecoder(slots=1)
    dec.pool.set_host_memory(1 << 20)
    a1, b, a2 = _conversation(dec)
    assert [r.new_ids for r in (a1, b, a2)] == [r.new_ids for r in ref]
    # a's KV came back: the same tokens were reused as in its own slot, only the rest ran.
    assert a2.cached_tokens == ref[2].cached_tokens == 44
    assert dec.prefilled[-1] == (0, 44, 48)
    stats = DecodeScheduler(dec, background=False).stats()
    held = dec.pool.host_nbytes(44)
    assert (stats.swaps_out, stats.swaps_in) == (2, 1)  # a out (for b), b out (for a), a in
    assert stats.swap_bytes == 2 * held + dec.pool.host_nbytes(34)
    assert stats.host_bytes == dec.pool.host_nbytes(34) and stats.host_bytes_peak == held + stats.host_bytes
    assert stats.host_limit_bytes == 1 << 20 and stats.host_dropped == 0
    assert sorted(dec.pool.owners()) == ["a", "b"]


def test_without_host_memory_the_evicted_session_recomputes_and_still_answers_the_same() -> None:
    ref = _conversation(KVDecoder(slots=2))
    dec = KVDecoder(slots=1)
    a2 = _conversation(dec)[2]
    assert a2.new_ids == ref[2].new_ids and a2.cached_tokens == 0
    stats = DecodeScheduler(dec, background=False).stats()
    assert (stats.swaps_out, stats.swaps_in, stats.host_bytes, stats.host_limit_bytes) == (0, 0, 0, 0)


def test_host_copies_hold_only_the_cached_tokens_in_whole_blocks() -> None:
    from convo.fast.kv_pool import HOST_BLOCK_TOKENS

    pool = KVDecoder(slots=2, slot_tokens=4 * HOST_BLOCK_TOKENS).pool
    per_token = pool.slot_nbytes // pool.slot_tokens
    assert pool.host_block_bytes == HOST_BLOCK_TOKENS * per_token
    assert pool.host_nbytes(1) == HOST_BLOCK_TOKENS * per_token
    assert pool.host_nbytes(HOST_BLOCK_TOKENS + 1) == 2 * HOST_BLOCK_TOKENS * per_token
    assert pool.host_nbytes(10**6) == pool.slot_nbytes  # never more than the slot
    pool.set_host_memory(pool.host_nbytes(3))
    assert pool.host is not None
    blocks = pool.host.arena.alloc(1)
    assert blocks is not None and pool.copy_out(1, 3, blocks) is None  # CPU: done on return


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _pool(slots: int, policy: Any, clock: Clock) -> KVSlotPool:
    return KVSlotPool(
        num_layers=1, num_kv_heads=1, head_dim=1, slots=slots, slot_tokens=256,
        dtype=torch.float32, device="cpu", policy=policy, clock=clock,
    )  # fmt: skip


def _turn(pool: KVSlotPool, clock: Clock, key: str, at: float, n: int = 100, **kw: Any) -> int:
    clock.now = at
    got = pool.acquire(key, **kw)
    assert got is not None
    pool.release(got[0], [hash(key) % 1000 + i for i in range(n)])
    return got[0]


@pytest.mark.parametrize(("policy", "kept"), [(NextUsePolicy(think_s=5.0), "a"), (LRUPolicy(), "b")])
def test_the_slot_given_away_is_the_one_needed_last_not_the_least_recently_used(
    policy: Any, kept: str
) -> None:
    """a replied 5 s ago (its user is about to speak), b just now (a whole think time
    away): a newcomer takes b's slot under next use, a's under LRU."""
    clock = Clock()
    pool = _pool(2, policy, clock)
    _turn(pool, clock, "a", 0.0)
    _turn(pool, clock, "b", 4.9)
    _turn(pool, clock, "c", 5.0)
    assert sorted(pool.owners()) == sorted([kept, "c"])


def test_sessions_with_queued_work_keep_their_slot() -> None:
    clock = Clock()
    pool = _pool(2, NextUsePolicy(think_s=5.0), clock)
    _turn(pool, clock, "a", 0.0)
    _turn(pool, clock, "b", 4.9)
    _turn(pool, clock, "c", 5.0, wanted={"b"})  # b's summary (or next turn) is queued
    assert sorted(pool.owners()) == ["b", "c"]


def test_the_policy_learns_each_sessions_think_time() -> None:
    policy = NextUsePolicy(think_s=5.0)
    for t in range(4):
        policy.released("fast", 10.0 * t)
        policy.returned("fast", 10.0 * t + 1.0)
    policy.released("slow", 50.0)
    policy.returned("slow", 59.0)
    assert policy.think_s("fast") == pytest.approx(1.0) and policy.think_s("slow") == pytest.approx(9.0)
    assert 1.0 < policy.think_s("new") < 5.0  # the average over sessions, not the default
    policy.forget("fast")
    assert policy.think_s("fast") == policy.think_s("new")


def test_host_memory_is_bounded_and_drops_the_entry_needed_last() -> None:
    clock = Clock()
    pool = _pool(1, NextUsePolicy(think_s=5.0), clock)
    pool.set_host_memory(2 * pool.host_nbytes(100))
    _turn(pool, clock, "a", 0.0)
    _turn(pool, clock, "b", 4.0)  # a to host
    _turn(pool, clock, "c", 5.0)  # b to host
    assert pool.host is not None and sorted(pool.host.keys()) == ["a", "b"]
    _turn(pool, clock, "d", 5.5)  # c to host: full; c replied last, it is needed last
    assert sorted(pool.host.keys()) == ["a", "b"] and pool.host.dropped == 1
    assert pool.host.nbytes <= pool.host_limit_bytes
    assert sorted(pool.owners()) == ["a", "b", "d"]
    pool.set_host_memory(pool.host_nbytes(100) - 1)  # smaller than one entry: never kept
    _turn(pool, clock, "e", 6.0)
    assert pool.host.keys() == [] and pool.host.dropped == 1
    pool.forget("e")
    assert pool.owners() == []


def test_work_for_a_session_runs_in_its_slot_and_keeps_its_kv() -> None:
    """A summary for a (``owner``) runs in a's slot, not in b's, whose user is thinking;
    a's KV goes to host first (the summary's prompt overwrites it) and comes back for a's
    next turn, whose reply is the one it gives without a summary."""
    dec, ref = KVDecoder(slots=2), KVDecoder(slots=2)
    dec.pool.set_host_memory(1 << 20)
    outs, stats = [], []
    for d, summarize in ((dec, True), (ref, False)):
        sched = DecodeScheduler(d, background=False, step_tokens=64, background_max_wait_s=60.0)
        a1 = _run(sched, _req(list(range(1, 41)), cache_key="a"))
        b1 = _run(sched, _req(list(range(500, 530)), cache_key="b"))
        if summarize:
            summary = _run(
                sched, _req([*range(1, 11), 900, 901, 902], 4, owner="a", priority=Priority.BACKGROUND)
            )
            assert summary.slot == a1.slot and summary.cached_tokens == 10
            assert summary.finish is FinishReason.LENGTH
        a2 = _run(sched, _req([*a1.ids, *a1.new_ids, 77], cache_key="a"))
        b2 = _run(sched, _req([*b1.ids, *b1.new_ids, 66], cache_key="b"))
        outs.append((a2.new_ids, a2.cached_tokens, b2.new_ids, b2.cached_tokens))
        stats.append(sched.stats())
    assert outs[0] == outs[1] and outs[0][1] == 44 and outs[0][3] == 34
    assert [(s.swaps_out, s.swaps_in, s.preemptions) for s in stats] == [(1, 1, 0), (0, 0, 0)]


def test_work_for_a_session_without_a_slot_never_evicts_a_thinking_session() -> None:
    dec = KVDecoder(slots=1)
    dec.pool.set_host_memory(1 << 20)
    sched = DecodeScheduler(dec, background=False, step_tokens=64, background_max_wait_s=60.0)
    _run(sched, _req(list(range(1, 41)), cache_key="a"))
    summary = sched.submit(_req([300, 301, 302], 2, owner="z", priority=Priority.BACKGROUND))
    for _ in range(5):
        sched.run_step()
    assert summary.slot == -1 and dec.pool.owners() == ["a"]  # waits: a is thinking
    sched.background_max_wait_s = 0.0  # waited long enough: takes a's slot, a to host
    _drain(sched)
    assert summary.new_ids and dec.pool.swaps_out == 1 and "a" in dec.pool.owners()


def test_a_summary_that_waits_does_not_hold_back_one_whose_slot_is_idle() -> None:
    dec = KVDecoder(slots=2)
    sched = DecodeScheduler(dec, background=False, step_tokens=64, background_max_wait_s=60.0)
    _run(sched, _req(list(range(1, 41)), cache_key="a"))
    _run(sched, _req(list(range(500, 530)), cache_key="b"))
    first = sched.submit(_req([300, 301, 302], 2, owner="z", priority=Priority.BACKGROUND))
    mine = sched.submit(_req([*range(1, 41), 7], 2, owner="a", priority=Priority.BACKGROUND))
    for _ in range(6):
        sched.run_step()
    assert mine.finish is FinishReason.LENGTH and mine.cached_tokens == 40
    assert first.slot == -1 and first.finish is None  # z has no slot, and a and b are thinking


def test_background_work_may_take_the_slot_of_a_session_whose_user_is_gone() -> None:
    clock = Clock()
    pool = _pool(1, NextUsePolicy(think_s=5.0), clock)
    pool.set_host_memory(1 << 20)
    _turn(pool, clock, "a", 0.0)
    clock.now = 10.0  # within GONE_THINK_FACTOR think times: a's user may be typing
    assert pool.acquire("z", guest=True, evict=False) is None
    clock.now = 16.0  # over three think times idle: gone; its KV goes to host
    got = pool.acquire("z", guest=True, evict=False)
    assert got is not None and got[1] == [] and pool.swaps_out == 1 and "a" in pool.owners()


def test_a_background_prefill_leaves_the_next_prompt_cached() -> None:
    ref = KVDecoder(slots=1)
    plain = _run(
        DecodeScheduler(ref, background=False, step_tokens=64), _req([*range(1, 31), 5, 6], cache_key="a")
    )
    dec = KVDecoder(slots=1)
    sched = DecodeScheduler(dec, background=False, step_tokens=64)
    pre = _run(
        sched, _req(list(range(1, 31)), cache_key="a", prefill_only=True, priority=Priority.BACKGROUND)
    )
    assert pre.finish is FinishReason.STOP and pre.new_ids == [] and pre.kv_tokens == 30
    turn = _run(sched, _req([*range(1, 31), 5, 6], cache_key="a"))
    assert turn.cached_tokens == 30 and turn.new_ids == plain.new_ids
    assert dec.prefilled[-1] == (0, 30, 32) and sched.stats().prefills == 1
    again = _run(sched, _req(list(range(1, 31)), cache_key="a", prefill_only=True))
    assert again.finish is FinishReason.STOP and sched.stats().prefills == 1  # all cached: nothing ran


# -- the real decoder ----------------------------------------------------------------------------------


def _tiny(device: str = "cpu", dtype: Any = None) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            cfg, dtype=dtype or torch.float32, attn_implementation="sdpa"
        )
    return model.eval()


def _prompts() -> dict[str, list[int]]:
    """Three sessions' first prompts: random tokens, the last 50 the same for all (the
    replies then depend on the KV of the first 100: a slot holding another session's KV
    answers differently)."""
    g = torch.Generator().manual_seed(1)
    tail = torch.randint(0, 512, (50,), generator=g).tolist()
    return {k: [*torch.randint(0, 512, (100,), generator=g).tolist(), *tail] for k in "abc"}


def _real_conversation(model: Any, slots: int, host: int, **decoder: Any) -> tuple[list[list[int]], int, Any]:
    from convo.fast.decoder import StaticDecoder

    dec = StaticDecoder(model, slots=slots, slot_tokens=384, **decoder)
    dec.warmup()
    dec.pool.set_host_memory(host)
    sched = DecodeScheduler(dec)
    try:
        outs = []
        prompts = _prompts()
        for _ in range(2):  # two turns each; on one slot every turn evicts the session before
            for key, ids in prompts.items():
                r = sched.run(_req(ids, 12, cache_key=key))
                outs.append(r.new_ids)
                prompts[key] = [*ids, *r.new_ids, 11, 12, 13]
        cached = r.cached_tokens
        return outs, cached, sched.stats()
    finally:
        sched.close()


def test_real_decoder_greedy_output_is_exact_after_host_and_back() -> None:
    model = _tiny()
    ref, ref_cached, _ = _real_conversation(model, slots=3, host=0)
    outs, cached, stats = _real_conversation(model, slots=1, host=1 << 24)
    assert outs == ref and cached == ref_cached == 150 + 11
    assert stats.swaps_in == 3 and stats.swaps_out == 5


def _attentive_decoder(device: str, slots: int) -> Any:
    """A warm :class:`~convo.fast.decoder.StaticDecoder` of :func:`_tiny` whose attention
    matters: a slot with the wrong K/V for a prefix answers other greedy tokens."""
    from convo.fast.decoder import StaticDecoder

    model = _tiny(device=device, dtype=torch.bfloat16 if device == "cuda" else None)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(30.0)
    dec = StaticDecoder(model, slots=slots, slot_tokens=384)
    dec.warmup()
    return dec


def _summary_beside_its_turn(device: str) -> tuple[DecodeRequest, list[int], Any]:
    """A session's turn streams in one slot; its summary (the session's first 120 tokens,
    then an instruction) is queued meanwhile and gets the other slot. Returns the summary,
    what the same summary answers in its session's own slot once the same turn is done
    (the prefix cached there by the same prefill), and the scheduler's stats."""
    dec = _attentive_decoder(device, slots=2)
    sched = DecodeScheduler(dec, background=False, background_min_idle_s=0.0)
    prompt = _prompts()["a"]
    summary_ids = [*prompt[:120], 7, 8, 9, 10, 11]

    def drain() -> None:
        while not sched.idle:
            sched.run_step()

    sched.submit(_req(prompt, 40, cache_key="ref"))
    drain()
    ref = sched.submit(_req(summary_ids, 16, owner="ref", priority=Priority.BACKGROUND))
    drain()
    assert ref.cached_tokens == 120  # in its session's slot, after the turn
    dec.pool.forget("ref")
    for t in dec.pool.slot_tensors():  # (no K/V of those runs left behind)
        t.zero_()
    turn = sched.submit(_req(prompt, 40, cache_key="a"))
    for _ in range(4):
        sched.run_step()
    assert turn.new_ids and turn.finish is None  # the turn streams
    summary = sched.submit(_req(summary_ids, 16, owner="a", priority=Priority.BACKGROUND))
    drain()
    assert turn.finish is not None and summary.slot != turn.slot
    for t in dec.pool.slot_tensors():
        assert torch.equal(t[summary.slot, :, :120], t[turn.slot, :, :120])
    return summary, ref.new_ids, sched.stats()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[cuda, pytest.mark.gpu])])
def test_a_summary_that_copies_its_sessions_prefix_from_a_busy_slot_answers_exactly(device: str) -> None:
    """The copied K/V (slot to slot, on CUDA on the side stream) is the K/V the turn
    prefilled: the summary's greedy tokens are those it writes in its session's own slot."""
    summary, ref, stats = _summary_beside_its_turn(device)
    assert summary.cached_tokens == 120 and (stats.slot_copies, stats.slot_copied_tokens) == (1, 120)
    assert summary.new_ids == ref


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[cuda, pytest.mark.gpu])])
def test_a_summary_whose_prefix_a_slid_turn_parked_for_it_answers_exactly(device: str) -> None:
    """On one slot with host memory: a session's summary queued with its next turn, whose
    slid window overwrites the prefix the summary reads. The prefix is parked in host
    memory first (on CUDA, pinned, on the side stream) and copied back for the summary:
    its greedy tokens are those it writes in the session's slot before the turn."""
    dec = _attentive_decoder(device, slots=1)
    dec.pool.set_host_memory(1 << 24)
    sched = DecodeScheduler(dec, background=False, background_min_idle_s=0.0)
    prompt = _prompts()["a"]
    summary_ids = [*prompt[:120], 7, 8, 9, 10, 11]

    def turns(key: str, slid: bool) -> DecodeRequest:
        first = sched.submit(_req(prompt, 12, cache_key=key))
        while not sched.idle:
            sched.run_step()
        summary = sched.submit(_req(summary_ids, 16, owner=key, priority=Priority.BACKGROUND))
        if slid:  # queued with it: the next turn, its window slid past tokens 20..119
            sched.submit(_req([*prompt[:20], *prompt[120:], *first.new_ids, 3], 8, cache_key=key))
        while not sched.idle:
            sched.run_step()
        return summary

    ref = turns("ref", slid=False)
    assert ref.cached_tokens == 120
    dec.pool.forget("ref")
    summary = turns("a", slid=True)
    assert summary.cached_tokens == 120 and sched.kept_for_background == 1
    assert summary.new_ids == ref.new_ids


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["as-loaded", "int4"])
def test_cuda_greedy_output_is_exact_after_host_and_back_and_nothing_recompiles(weights: str) -> None:
    """On CUDA (bf16, compiled, captured graphs; pinned memory, copies on a side stream):
    on one slot, a session whose KV went to host while another session ran answers with
    exactly the tokens it gives when it never left the slot (same decoder, same graphs).
    No new graphs or captures once warm, device memory flat over the rounds, host copies
    pinned, every copy counted."""
    from torch._dynamo.utils import counters

    from convo.fast.config import DecoderConfig
    from convo.fast.decoder import StaticDecoder

    model = _tiny(device="cuda", dtype=torch.bfloat16)
    dec = StaticDecoder(model, slots=1, slot_tokens=384, weights=weights, config=DecoderConfig(group_size=32))
    dec.warmup()
    assert dec.cuda_graphs and dec.compiled
    dec.pool.set_host_memory(1 << 26)
    sched = DecodeScheduler(dec)
    prompts = _prompts()

    def turn(key: str, ids: list[int]) -> DecodeRequest:
        return sched.run(_req(ids, 12, cache_key=key))

    try:
        ref1 = turn("ref", prompts["a"])  # a's two turns, never evicted
        ref2 = turn("ref", [*prompts["a"], *ref1.new_ids, 11, 12, 13])
        assert ref2.cached_tokens == 150 + 11
        dec.pool.forget("ref")
        graphs, captures = counters["stats"]["unique_graphs"], dec.captures
        allocated = []
        for n in range(4):
            a1 = turn(f"a{n}", prompts["a"])
            b1 = turn(f"b{n}", prompts["b"])  # a's KV to host
            a2 = turn(f"a{n}", [*prompts["a"], *a1.new_ids, 11, 12, 13])  # back from host
            assert (a1.new_ids, a2.new_ids) == (ref1.new_ids, ref2.new_ids), n
            assert a2.cached_tokens == ref2.cached_tokens
            b2 = turn(f"b{n}", [*prompts["b"], *b1.new_ids, 4])
            assert b2.cached_tokens == 150 + 11
            host = dec.pool.host
            assert host is not None and host.arena.pinned and host.arena.tensor.is_pinned()
            for key in (f"a{n}", f"b{n}"):
                dec.pool.forget(key)
            torch.cuda.synchronize()
            allocated.append(torch.cuda.memory_allocated())
        stats = sched.stats()
        assert (stats.swaps_out, stats.swaps_in) == (12, 8), stats  # per round: a, b, a out; a, b in
        assert stats.swap_bytes > 0 and stats.host_bytes == 0
        assert counters["stats"]["unique_graphs"] == graphs and dec.captures == captures
        assert max(allocated[1:]) - min(allocated[1:]) < 1 << 20, allocated
    finally:
        sched.close()
