"""Context shift (convo.fast.kv_shift): finding the kept turns in a slot, moving their K/V
with the keys turned, and the scheduler prefilling around them.

A one-layer model is where a shift is exact (a layer-0 key depends on its token and
position only): there the shifted session must decode exactly what a recomputed prompt
decodes. With more layers only layer 0 is exact, and the test says so.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from conftest import drain  # noqa: E402

from convo.fast import DecodeRequest, DecodeScheduler, StaticDecoder  # noqa: E402
from convo.fast.kv_shift import (  # noqa: E402
    MAX_SHIFT_RUNS,
    SHIFT_AFTER_HEAD_TOKENS,
    SHIFT_EXTRA_MIN_TOKENS,
    SHIFT_MIN_TOKENS,
    KVShift,
    find_shift,
    find_shifts,
    rope_frequencies,
    shift_kv,
)
from convo.models import GREEDY  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _tokens(n: int, seed: int, vocab: int = 500) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


# -- finding the run -------------------------------------------------------------------------------


def test_find_shift_finds_the_kept_turns_after_a_slide() -> None:
    system, old_summary, dropped, kept, question = (
        _tokens(20, 1), _tokens(30, 2), _tokens(200, 3), _tokens(300, 4), _tokens(40, 5),
    )  # fmt: skip
    new_summary, next_question = _tokens(45, 6), _tokens(50, 7)
    cached = system + old_summary + dropped + kept + question
    ids = system + new_summary + kept + question + next_question
    shift = find_shift(cached, ids, start=20, limit=len(ids) - 1)
    # The kept turns and the question after them: one run, moved towards the start.
    assert shift == KVShift(src=250, dst=65, length=340)
    assert shift.delta == -185
    assert cached[shift.src : shift.src + shift.length] == ids[shift.dst : shift.dst + shift.length]


def test_find_shift_stays_within_its_bounds_and_minimum() -> None:
    a, b = _tokens(100, 1), _tokens(100, 2)
    cached = a + b
    ids = a[:10] + b + [1]
    # The run may not reach past ``limit``, nor start before ``start`` on either side.
    found = find_shift(cached, ids, start=10, limit=len(ids) - 1)
    assert found == KVShift(src=100, dst=10, length=100)
    assert find_shift(cached, ids, start=10, limit=60, min_tokens=32) == KVShift(src=100, dst=10, length=50)
    assert find_shift(cached, ids, start=10, limit=60, min_tokens=51) is None
    assert find_shift(cached, a[:10] + _tokens(100, 9), start=10, limit=110) is None  # nothing shared
    assert find_shift(cached, ids, start=150, limit=len(ids) - 1) is None  # too little left


def test_find_shift_finds_the_longest_run_in_repeated_text() -> None:
    phrase = _tokens(12, 4)
    kept = phrase * 20 + _tokens(30, 5)  # repeated text: its anchors are found in many places
    cached = _tokens(10, 1) + phrase * 9 + kept
    ids = cached[:10] + _tokens(7, 2) + kept + [1, 2]
    shift = find_shift(cached, ids, start=10, limit=len(ids) - 1)
    assert shift is not None and shift.length == len(kept)
    assert cached[shift.src : shift.src + shift.length] == ids[shift.dst : shift.dst + shift.length]


def test_find_shifts_moves_the_excerpts_in_front_of_the_kept_turns() -> None:
    """After a slide a provisional summary shows pieces of the dropped turns in front of
    the kept turns: the slot holds them too, so they are runs of their own."""
    system, old_summary, dropped1, dropped2, kept = (
        _tokens(20, 1), _tokens(30, 2), _tokens(200, 3), _tokens(150, 8), _tokens(300, 4),
    )  # fmt: skip
    header, marker, question = [1] * 5, [2] * 6, _tokens(50, 7)
    cached = system + old_summary + dropped1 + dropped2 + kept
    block = header + dropped2[:40] + marker + dropped2[100:120] + marker  # a message's head and tail
    ids = system + block + kept + question + [1]
    runs = find_shifts(cached, ids, start=20, limit=len(ids) - 1)
    assert runs == (
        KVShift(src=250, dst=25, length=40),  # the excerpt's head
        KVShift(src=350, dst=71, length=20),  # its tail
        KVShift(src=400, dst=97, length=300),  # the kept turns
    )
    for r in runs:
        assert cached[r.src : r.src + r.length] == ids[r.dst : r.dst + r.length]
    # find_shift still gives the longest one only. Beside it, a run of 16 tokens moves;
    # a shorter one is prefilled; alone, a run moves only from 64 tokens on.
    assert find_shift(cached, ids, start=20, limit=len(ids) - 1) == runs[-1]
    for n, moved in ((SHIFT_EXTRA_MIN_TOKENS, 2), (SHIFT_EXTRA_MIN_TOKENS - 1, 1)):
        short = system + header + dropped2[:n] + marker + kept + question + [1]
        assert len(find_shifts(cached, short, start=20, limit=len(short) - 1)) == moved
    alone = system + header + dropped2[: SHIFT_MIN_TOKENS - 1] + question + [1]
    assert find_shifts(cached, alone, start=20, limit=len(alone) - 1) == ()


def test_a_passage_after_the_kept_turns_moves_without_its_head() -> None:
    """Retrieval memory shows passages of the dropped turns after the question, right
    before the reply: a passage moves, but its first ``SHIFT_AFTER_HEAD_TOKENS`` are
    prefilled (they attended to another context, which costs the reply most)."""
    system, dropped, kept = _tokens(20, 1), _tokens(150, 8), _tokens(300, 4)
    cached = system + _tokens(30, 2) + dropped + kept
    ids = system + _tokens(45, 6) + kept + _tokens(50, 7) + [1] * 5 + dropped[10:140] + [1, 2]
    limit = len(ids) - 1
    n = SHIFT_AFTER_HEAD_TOKENS
    assert find_shifts(cached, ids, start=20, limit=limit) == (
        KVShift(src=200, dst=65, length=300),
        KVShift(src=60 + n, dst=420 + n, length=130 - n),  # towards the end, its head prefilled
    )
    assert find_shifts(cached, ids, start=20, limit=limit, after_head_tokens=0) == (
        KVShift(src=200, dst=65, length=300),
        KVShift(src=60, dst=420, length=130),
    )
    kept_only = (KVShift(src=200, dst=65, length=300),)
    assert find_shifts(cached, ids, start=20, limit=limit, after_head_tokens=None) == kept_only
    # A passage left shorter than SHIFT_EXTRA_MIN_TOKENS without its head is prefilled whole.
    short = ids[:420] + dropped[10 : 10 + n + SHIFT_EXTRA_MIN_TOKENS - 1] + [1, 2]
    assert find_shifts(cached, short, start=20, limit=len(short) - 1) == kept_only
    # No other copy of the text fills the head's positions.
    twice = system + _tokens(30, 2) + dropped + dropped[:60] + kept
    again = find_shifts(twice, ids, start=20, limit=limit)
    assert [(r.dst, r.length) for r in again] == [(65, 300), (420 + n, 130 - n)]


def test_a_turn_where_nothing_left_the_window_moves_nothing() -> None:
    """The turn after: the slot holds the last question, its passages and the reply; the
    prompt shows the reply after the question, then a new question and passages both turns
    retrieved. The longest run (a passage) moves towards the end: nothing moves, the turn
    is prefilled exactly (moving costs the reply far more than at a slide)."""
    prefix, passage_a, passage_b, reply = _tokens(400, 1), _tokens(120, 2), _tokens(90, 3), _tokens(40, 4)
    question = _tokens(60, 5)
    cached = prefix + passage_a + passage_b + reply
    ids = prefix + reply + question + passage_a + passage_b[:50] + [1, 2]
    limit = len(ids) - 1
    assert find_shifts(cached, ids, start=400, limit=limit) == ()
    before = find_shifts(cached, ids, start=400, limit=limit, toward_start=False)
    assert before[0] == KVShift(src=610, dst=400, length=40)  # the reply: towards the start
    assert before[1] == KVShift(src=400, dst=500, length=170)  # the longest: towards the end
    # A reply longer than every passage leads (towards the start): it moves, and the
    # passages after it keep their heads to prefill, as after a slide.
    long_reply = _tokens(200, 6)
    cached = prefix + passage_a + long_reply
    ids = prefix + long_reply + question + passage_a + [1, 2]
    n = SHIFT_AFTER_HEAD_TOKENS
    assert find_shifts(cached, ids, start=400, limit=len(ids) - 1) == (
        KVShift(src=520, dst=400, length=200),
        KVShift(src=400 + n, dst=660 + n, length=120 - n),
    )


def test_find_shifts_fill_disjoint_positions_and_stop_at_the_most() -> None:
    a = _tokens(100, 1)
    cached = _tokens(10, 4) + a + a[30:] + _tokens(20, 2)  # a's tail twice: two sources
    ids = _tokens(10, 3) + a + [5]
    runs = find_shifts(cached, ids, start=10, limit=len(ids) - 1, min_tokens=16, toward_start=False)
    covered = [p for r in runs for p in range(r.dst, r.dst + r.length)]
    assert len(covered) == len(set(covered)) == 100  # every prompt position once
    pieces = [_tokens(40, 10 + i) for i in range(MAX_SHIFT_RUNS + 2)]
    cached = [t for p in pieces for t in p]
    ids = [1, 2] + [t for p in reversed(pieces) for t in [7, *p]] + [5]
    runs = find_shifts(
        cached, ids, start=2, limit=len(ids) - 1, min_tokens=16, after_head_tokens=0, toward_start=False
    )
    assert len(runs) == MAX_SHIFT_RUNS and [r.dst for r in runs] == sorted(r.dst for r in runs)


def test_shift_kv_reads_every_source_before_it_writes() -> None:
    """Two runs where one's destination is the other's source: each gets the K/V its
    source held before the move (V as is, K turned by the run's own distance)."""
    from convo.fast.kv_pool import KVSlotPool

    pool = KVSlotPool(
        num_layers=2, num_kv_heads=2, head_dim=4, slots=1, slot_tokens=64, dtype=torch.float32, device="cpu"
    )
    pool.rope_inv_freq = torch.tensor([1.0, 0.01])
    for t in (*pool.k, *pool.v):
        t.copy_(torch.randn_like(t))
    k0, v0 = [t.clone() for t in pool.k], [t.clone() for t in pool.v]
    a, b = KVShift(src=30, dst=5, length=20), KVShift(src=10, dst=40, length=15)  # a writes b's source
    shift_kv(pool, 0, [a, b], pool.rope_inv_freq)
    for layer in range(2):
        for run in (a, b):
            src, dst = slice(run.src, run.src + run.length), slice(run.dst, run.dst + run.length)
            assert torch.equal(pool.v[layer][0, :, dst], v0[layer][0, :, src])
            back = pool.k[layer][0, :, dst].clone()
            undo = KVShift(src=run.dst, dst=run.src, length=run.length)  # turned back by -delta
            single = KVSlotPool(
                num_layers=1, num_kv_heads=2, head_dim=4, slots=1, slot_tokens=64,
                dtype=torch.float32, device="cpu",
            )  # fmt: skip
            single.k[0][0, :, dst] = back
            shift_kv(single, 0, undo, pool.rope_inv_freq)
            assert torch.allclose(single.k[0][0, :, src], k0[layer][0, :, src], atol=1e-5)


# -- moving K/V ------------------------------------------------------------------------------------


@pytest.mark.gpu
@cuda
def test_cuda_after_a_slide_only_the_reused_tokens_come_back_from_host_exactly() -> None:
    """On CUDA (bf16, pinned host memory, copies on the side stream), without the shift: a
    session whose KV went to host and whose window then slid gets back its system prompt
    only, and answers exactly as a session that never left its slot."""
    model = tiny_model(2, seed=3).to("cuda", torch.bfloat16)
    dec = StaticDecoder(model, slots=1, slot_tokens=512)
    dec.warmup()
    dec.pool.set_host_memory(dec.pool.host_nbytes(512) * 4)
    sched = DecodeScheduler(dec)
    system, old = _tokens(16, 1), _tokens(24, 2) + _tokens(150, 3)
    kept = _tokens(160, 4)
    ref1 = sched.run(_request(system + old + kept, 8, "ref"))  # never leaves the slot
    slide = system + _tokens(30, 5) + kept + ref1.new_ids + _tokens(20, 6)
    ref2 = sched.run(_request(slide, 12, "ref"))
    dec.pool.forget("ref")
    a1 = sched.run(_request(system + old + kept, 8, "a"))
    sched.run(_request(_tokens(40, 9), 4, "b"))  # a's KV to host
    before = dec.pool.swapped_in_tokens
    a2 = sched.run(_request(slide, 12, "a"))
    assert a1.new_ids == ref1.new_ids and dec.pool.swapped_in_tokens - before == 16
    assert a2.new_ids == ref2.new_ids and a2.cached_tokens == ref2.cached_tokens == 16
    sched.close()


def tiny_model(layers: int, seed: int = 0) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_shifted_layer0_kv_is_the_recomputed_one(kv_dtype: str) -> None:
    dec = StaticDecoder(tiny_model(2), slots=2, slot_tokens=512, kv_dtype=kv_dtype)
    assert dec.pool.can_shift
    head, dropped, kept = _tokens(10, 1), _tokens(90, 2), _tokens(120, 3)
    with torch.no_grad():
        dec.prefill(0, head + dropped + kept, 0)
        dec.prefill(1, head + kept, 0)
        dec.pool.shift(0, KVShift(src=100, dst=10, length=120))
    pool = dec.pool

    def layer(i: int, slot: int) -> tuple[Any, Any]:
        k, v = pool.k[i][slot, :, 10:130].float(), pool.v[i][slot, :, 10:130].float()
        if pool.scaled:
            k, v = (
                k * pool.k_scale[i][slot, :, 10:130, None].float(),
                v * pool.v_scale[i][slot, :, 10:130, None].float(),
            )
        return k, v

    (k0, v0), (k1, v1) = layer(0, 0), layer(0, 1)
    tol = 0.1 if pool.scaled else 1e-4  # fp8: quantized again after the turn
    assert torch.allclose(k0, k1, atol=tol, rtol=tol) and torch.allclose(v0, v1, atol=tol, rtol=tol)
    # Layer 1's K/V saw the dropped tokens: not what a recompute gives (a shift is not exact).
    (k0, _), (k1, _) = layer(1, 0), layer(1, 1)
    assert not torch.allclose(k0, k1, atol=1e-3)


def _request(ids: list[int], n: int, key: str) -> DecodeRequest:
    return DecodeRequest(
        ids=ids, max_new_tokens=n, deadline=time.monotonic() + 60, sampling=GREEDY, cache_key=key
    )


def test_a_shifted_turn_decodes_what_a_recomputed_prompt_decodes_on_a_one_layer_model() -> None:
    """The whole path (find, move, prefill around the run, decode) on a model where a shift
    is exact: the reply is the recomputed prompt's, token for token, and the kept run is
    not prefilled again."""
    dec = StaticDecoder(tiny_model(1, seed=3), slots=2, slot_tokens=512)
    sched = DecodeScheduler(dec, context_shift=True)
    system, summary, dropped, kept = _tokens(16, 1), _tokens(24, 2), _tokens(150, 3), _tokens(160, 4)
    first = sched.run(_request(system + summary + dropped + kept, 8, "s"))
    assert first.error is None
    # The window slid: a new summary, the kept turns and the reply, a new question.
    turn = system + _tokens(30, 5) + kept + first.new_ids + _tokens(20, 6)
    before = sched.prefill_tokens
    shifted = sched.run(_request(turn, 12, "s"))
    prefilled = sched.prefill_tokens - before
    assert sched.shifts == 1 and sched.shifted_tokens >= len(kept)
    assert prefilled <= len(turn) - 16 - len(kept)  # neither the system prompt nor the run
    assert shifted.cached_tokens == len(turn) - prefilled
    recomputed = sched.run(_request(turn, 12, "fresh"))
    assert shifted.new_ids == recomputed.new_ids
    assert sched.stats().shifted_tokens == sched.shifted_tokens
    sched.close()


def test_a_turn_with_excerpts_of_a_dropped_turn_moves_every_run_on_a_one_layer_model() -> None:
    """A provisional summary after the slide: a piece of a dropped turn in front of the
    kept turns. Both runs move (one shift), only the rest of the summary and the question
    are prefilled, and the reply is the recomputed prompt's (one layer: exact)."""
    dec = StaticDecoder(tiny_model(1, seed=3), slots=2, slot_tokens=512)
    sched = DecodeScheduler(dec, context_shift=True)
    system, dropped, kept = _tokens(16, 1), _tokens(150, 3), _tokens(160, 4)
    first = sched.run(_request(system + _tokens(24, 2) + dropped + kept, 8, "s"))
    turn = [*system, 9, 9, *dropped[20:120], 3, 3, *kept, *first.new_ids, *_tokens(20, 6)]
    before = sched.prefill_tokens
    shifted = sched.run(_request(turn, 12, "s"))
    prefilled = sched.prefill_tokens - before
    assert sched.shifts == 1 and sched.shifted_tokens >= len(kept) + 100
    assert prefilled <= len(turn) - 16 - len(kept) - 100
    assert shifted.cached_tokens == len(turn) - prefilled
    assert shifted.new_ids == sched.run(_request(turn, 12, "fresh")).new_ids
    sched.close()


def test_a_passage_after_the_question_moves_without_its_head_on_a_one_layer_model() -> None:
    """Retrieval memory after the slide: a dropped turn's passage after the question. The
    kept turns and the passage move, the passage's first ``SHIFT_AFTER_HEAD_TOKENS`` and
    what lies between the runs are prefilled, and the reply is the recomputed prompt's
    (one layer: exact)."""
    dec = StaticDecoder(tiny_model(1, seed=3), slots=2, slot_tokens=512)
    sched = DecodeScheduler(dec, context_shift=True)
    system, dropped, kept = _tokens(16, 1), _tokens(150, 3), _tokens(160, 4)
    first = sched.run(_request(system + _tokens(24, 2) + dropped + kept, 8, "s"))
    question = _tokens(20, 6)
    turn = [*system, *_tokens(30, 5), *kept, *first.new_ids, *question, 7, 7, *dropped[10:130], 8]
    before = sched.prefill_tokens
    shifted = sched.run(_request(turn, 12, "s"))
    prefilled = sched.prefill_tokens - before
    passage = 120 - SHIFT_AFTER_HEAD_TOKENS
    assert sched.shifts == 1 and sched.shifted_tokens >= len(kept) + passage
    assert prefilled <= len(turn) - 16 - len(kept) - passage
    assert shifted.cached_tokens == len(turn) - prefilled
    assert shifted.new_ids == sched.run(_request(turn, 12, "fresh")).new_ids
    sched.close()


def test_without_context_shift_nothing_moves_and_the_turn_is_exact() -> None:
    dec = StaticDecoder(tiny_model(2, seed=3), slots=2, slot_tokens=512)
    sched = DecodeScheduler(dec)  # off by default
    system, kept = _tokens(16, 1), _tokens(160, 4)
    first = sched.run(_request(system + _tokens(150, 3) + kept, 8, "s"))
    turn = system + kept + first.new_ids + _tokens(20, 6)
    again = sched.run(_request(turn, 12, "s"))
    assert sched.shifts == 0 and again.cached_tokens == 16
    assert again.new_ids == sched.run(_request(turn, 12, "fresh")).new_ids
    sched.close()


@pytest.mark.parametrize("shift", [False, True])
def test_after_a_slide_only_the_reused_tokens_come_back_from_host(shift: bool) -> None:
    """A session whose KV went to host and whose window then slid gets back only what its
    prompt reuses: the common prefix and (with the shift) the moved run, not the dropped
    turns between them. The reply is the recomputed prompt's (one layer: a shift is exact;
    without it, two layers and exact reuse)."""
    dec = StaticDecoder(tiny_model(1 if shift else 2, seed=3), slots=1, slot_tokens=512)
    dec.pool.set_host_memory(dec.pool.host_nbytes(512) * 4)
    sched = DecodeScheduler(dec, context_shift=shift)
    system, dropped, kept = _tokens(16, 1), _tokens(150, 3), _tokens(160, 4)
    first = sched.run(_request(system + _tokens(24, 2) + dropped + kept, 8, "s"))
    sched.run(_request(_tokens(40, 9), 4, "other"))  # takes the only slot: "s" goes to host
    assert dec.pool.swaps_out == 1 and dec.pool.swapped_in_tokens == 0
    turn = system + _tokens(30, 5) + kept + first.new_ids + _tokens(20, 6)
    again = sched.run(_request(turn, 12, "s"))
    # (The run: the kept turns and the reply but its last token, which has no K/V yet.)
    reused = 16 + (len(kept) + len(first.new_ids) - 1 if shift else 0)
    assert dec.pool.swaps_in == 1 and dec.pool.swapped_in_tokens == reused  # (of 357 on host)
    assert again.cached_tokens == reused and sched.shifts == int(shift)
    assert again.new_ids == sched.run(_request(turn, 12, "fresh")).new_ids
    sched.close()


def test_a_turn_shorter_than_the_minimum_run_is_prefilled() -> None:
    dec = StaticDecoder(tiny_model(1), slots=1, slot_tokens=512)
    sched = DecodeScheduler(dec, context_shift=True)
    system, kept = _tokens(16, 1), _tokens(SHIFT_MIN_TOKENS - 1, 4)
    sched.run(_request(system + _tokens(50, 3) + kept + [7], 2, "s"))
    sched.run(_request(system + kept + [2, 2, 2], 2, "s"))  # (the slot holds kept + [7])
    assert sched.shifts == 0
    sched.close()


def test_dynamic_rope_has_no_shift() -> None:
    class Rotary:
        rope_type = "dynamic"
        inv_freq = torch.ones(4)

    assert rope_frequencies(Rotary()) is None
    Rotary.rope_type = "llama3"
    assert torch.equal(rope_frequencies(Rotary()), torch.ones(4))


@pytest.mark.gpu
@cuda
def test_cuda_shifted_turn_matches_recompute_on_a_one_layer_model() -> None:
    model = tiny_model(1, seed=3).to("cuda", torch.bfloat16)
    dec = StaticDecoder(model, slots=2, slot_tokens=512)
    dec.warmup()
    sched = DecodeScheduler(dec, context_shift=True)
    system, kept = _tokens(16, 1), _tokens(200, 4)
    first = sched.run(_request(system + _tokens(30, 2) + _tokens(150, 3) + kept, 8, "s"))
    turn = system + _tokens(30, 5) + kept + first.new_ids + _tokens(20, 6)
    shifted = sched.run(_request(turn, 12, "s"))
    assert sched.shifts == 1
    recomputed = sched.run(_request(turn, 12, "fresh"))
    # bf16 keys are rounded once more after the turn: the first tokens agree.
    assert shifted.new_ids[:4] == recomputed.new_ids[:4]
    sched.close()


# -- the scheduler around a shift, on a fake decoder -------------------------------------------------


class _Decoder:
    """A real slot pool that can shift (one float per token), a fake step and prefill that
    record what runs."""

    def __init__(self, slots: int = 1, host_bytes: int = 0) -> None:
        from convo.fast.kv_pool import KVSlotPool

        self.pool = KVSlotPool(
            num_layers=1, num_kv_heads=1, head_dim=2, slots=slots, slot_tokens=1024,
            dtype=torch.float32, device="cpu",
        )  # fmt: skip
        self.pool.rope_inv_freq = torch.ones(1)
        if host_bytes:
            self.pool.set_host_memory(host_bytes)
        self.prefilled: list[tuple[int, int]] = []

    @staticmethod
    def _logits(last: list[int]) -> Any:
        out = torch.zeros((len(last), 2048))
        out[range(len(last)), [(t + 1) % 2048 for t in last]] = 1.0
        return out

    def step(self, tokens: list[int], slots: list[int], positions: list[int]) -> Any:
        return self._logits(tokens)

    def prefill_batch(self, chunks: list[Any]) -> list[Any]:
        self.prefilled += [(c.start, c.end) for c in chunks]
        return list(self._logits([c.ids[c.end - 1] for c in chunks]))


def _fake_request(ids: list[int], key: str, n: int = 2, **kw: Any) -> DecodeRequest:
    return DecodeRequest(
        ids=ids, max_new_tokens=n, deadline=time.monotonic() + 60, sampling=GREEDY, cache_key=key, **kw
    )


def test_the_prompt_is_prefilled_around_the_moved_run_in_chunks() -> None:
    dec = _Decoder()
    sched = DecodeScheduler(dec, background=False, context_shift=True, step_tokens=64)
    system, kept = _tokens(16, 1), _tokens(300, 4)
    sched.submit(_fake_request(system + _tokens(200, 3) + kept, "s"))
    drain(sched)
    dec.prefilled.clear()
    summary, question = _tokens(100, 5), _tokens(50, 6)
    turn = sched.submit(_fake_request(system + summary + kept + question, "s"))
    drain(sched)
    assert turn.error is None and sched.shifts == 1
    # Chunks of at most 64 tokens cover the summary up to the run, then the question: the
    # run (positions 116-416) is never prefilled.
    assert dec.prefilled[0][0] == 16 and max(e - s for s, e in dec.prefilled) <= 64
    covered = [p for s, e in dec.prefilled for p in range(s, e)]
    assert covered == list(range(16, 116)) + list(range(416, 466))
    assert turn.cached_tokens == 16 + 300


def test_the_prompt_is_prefilled_around_each_moved_run() -> None:
    dec = _Decoder()
    sched = DecodeScheduler(dec, background=False, context_shift=True, step_tokens=64)
    system, dropped, kept = _tokens(16, 1), _tokens(200, 3), _tokens(300, 4)
    sched.submit(_fake_request(system + dropped + kept, "s"))
    drain(sched)
    dec.prefilled.clear()
    header, question = _tokens(30, 5), _tokens(50, 6)
    turn = sched.submit(
        _fake_request(system + header + dropped[:100] + [2] * 20 + kept + question + [7], "s")
    )
    drain(sched)
    assert turn.error is None and sched.shifts == 1 and turn._holes == ()
    # The header up to the excerpt, the marker up to the kept turns, then the question.
    covered = [p for s, e in dec.prefilled for p in range(s, e)]
    assert covered == [*range(16, 46), *range(146, 166), *range(466, 517)]
    assert turn.cached_tokens == 16 + 100 + 300


def test_a_preempted_prefill_before_its_run_keeps_only_what_it_computed() -> None:
    """Work stopped while it prefills the summary in front of its moved run (its ``hole``)
    gives back only the tokens it computed, never the run's positions; resumed, it
    prefills the rest and its session's KV ends up holding exactly its prompt."""
    dec = _Decoder(slots=1, host_bytes=1 << 20)
    sched = DecodeScheduler(
        dec, background=False, context_shift=True, step_tokens=32, background_max_wait_s=0
    )
    system, kept = _tokens(16, 1), _tokens(300, 4)
    sched.submit(_fake_request(system + _tokens(200, 3) + kept, "s"))
    drain(sched)
    ids = system + _tokens(100, 5) + kept + [7]
    prefill = sched.submit(_fake_request(ids, "s", prefill_only=True, priority=2))
    sched.run_step()  # admitted, the run moved, a first chunk of the summary prefilled
    sched.run_step()
    assert prefill._holes == ((116, 416),) and 16 < prefill.kv_tokens < 116
    stopped_at = prefill.kv_tokens
    reply = sched.submit(_fake_request(_tokens(40, 9), "other"))  # needs the only slot
    drain(sched)
    after = [p for a, b in dec.prefilled for p in range(a, b) if p >= stopped_at]  # ("other": below)
    assert reply.error is None and prefill.error is None and prefill.preemptions == 1
    # Parked with the tokens it computed only (not the run's positions past them).
    assert dec.pool.host is not None
    assert sched.shifts == 1
    assert prefill.kv_tokens == len(ids)
    held = dec.pool.host.get("s")
    slot_tokens = dec.pool._table[0].tokens if dec.pool._table[0].owner == "s" else None
    assert (held.tokens if held is not None else slot_tokens) == ids
    # Resumed from what it had computed: everything after it is prefilled, the run too
    # (its moved K/V were not the session's to keep: the run comes back as a prefill).
    assert after[-(len(ids) - stopped_at) :] == list(range(stopped_at, len(ids)))


def test_a_host_copy_with_a_longer_run_is_taken_when_the_prefix_ties() -> None:
    dec = _Decoder(slots=1, host_bytes=1 << 20)
    sched = DecodeScheduler(dec, background=False, context_shift=True)
    system, kept = _tokens(16, 1), _tokens(300, 4)
    sched.submit(_fake_request(system + _tokens(200, 3) + kept, "s"))
    drain(sched)
    sched.submit(_fake_request(system + _tokens(30, 8), "other"))  # takes the slot: "s" to host
    drain(sched)
    assert dec.pool.swaps_out == 1
    turn = sched.submit(_fake_request(system + _tokens(60, 5) + kept + [7], "s"))
    drain(sched)
    # Both share only the system prompt; the host copy holds the run: it is copied back.
    assert dec.pool.swaps_in == 1 and sched.shifts == 1 and turn.cached_tokens == 16 + 300
