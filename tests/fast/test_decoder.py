"""Static KV slots, the batched decode step and int4 weights (convo.fast).

Three tiers: pure accounting (the slot pool), a tiny random-weight Llama checked against
transformers' own forward on CPU, and the real default model (slow). Tests marked ``gpu``
run on CUDA only: the pool's measured bytes, the triton kernel, and no recompiles or
re-captures after warm-up.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from convo.errors import ConfigError

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from convo.fast import (  # noqa: E402
    DecoderConfig,
    DecodeRequest,
    DecodeScheduler,
    Int4Linear,
    KVSlotPool,
    PrefillChunk,
    StaticDecoder,
    decode_attention,
    dequantize_int4,
    int4_group_size,
)
from convo.fast.attention import _attention_reference, _chunk_attention_reference, chunk_attention  # noqa: E402
from convo.fast.decoder import _modules  # noqa: E402
from convo.fast.int4 import DENSE_COPY_MIN_ROWS, W4_KERNEL_MAX_ROWS  # noqa: E402
from convo.fast.kernels import (  # noqa: E402
    W4_CONFIGS,
    W4_LARGE_CONFIGS,
    W4_SWAP_CONFIGS,
    w4a16_candidates,
    w4a16_settings,
    w4a16_with_config,
)
from convo.fast.packing import pack_chunks, packed_tokens, static_pieces  # noqa: E402
from convo.models import GREEDY, Sampling  # noqa: E402
from convo.planner import memory  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def tiny_model(model_type: str = "llama", device: str = "cpu", dtype: Any = None) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"tie_word_embeddings": True} if model_type == "llama" else {}
    cfg = AutoConfig.for_model(
        model_type,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=256,
        **extra,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            cfg, dtype=dtype or torch.float32, attn_implementation="sdpa"
        )
    if model_type == "qwen2":  # give the q/k/v biases values, so a dropped bias would show
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model.eval()


# -- the slot pool ---------------------------------------------------------------------------------


def test_pool_bytes_are_the_formula_and_slots_follow_their_sessions() -> None:
    from convo.fast.kv_policy import LRUPolicy

    pool = KVSlotPool(  # LRU order here; the default, by expected next use: tests/fast/test_kv_host.py
        num_layers=3, num_kv_heads=2, head_dim=8, slots=2, slot_tokens=16, dtype=torch.float16, device="cpu",
        policy=LRUPolicy(),
    )  # fmt: skip
    assert pool.nbytes == KVSlotPool.predicted_nbytes(
        num_layers=3, num_kv_heads=2, head_dim=8, slots=2, slot_tokens=16, dtype_bytes=2
    )
    assert pool.nbytes == 2 * 3 * 2 * 2 * 16 * 8 * 2
    # The planner prices a pool the same way: Llama-2-7B, 16 slots of 1,024 tokens is 8 GiB
    # (the H200 benchmark measured 8,589,934,592 bytes allocated for it).
    planner = memory.VRAMModel.from_model("random:llama-2-7b", quant="nf4", dtype="bf16")
    assert planner.kv_pool_bytes(16, 1024) == 8 << 30
    a, kept = pool.acquire("a") or (None, None)
    assert kept == []
    pool.release(a, [1, 2, 3])
    b, _ = pool.acquire("b") or (None, None)
    assert b != a  # an empty slot before another session's idle one
    again, kept = pool.acquire("a") or (None, None)
    assert (again, kept) == (a, [1, 2, 3])  # the session's own tokens come back
    assert pool.acquire("c") is None  # both busy: the caller waits
    pool.release(again, [1, 2, 3, 4])
    pool.release(b, [9])
    c, kept = pool.acquire("c") or (None, None)
    assert c == a and kept == []  # least recently used idle slot, its tokens dropped
    assert sorted(pool.owners()) == ["b", "c"]
    pool.forget("b")
    assert pool.owners() == ["c"]
    with pytest.raises(ConfigError):
        KVSlotPool(
            num_layers=1,
            num_kv_heads=1,
            head_dim=8,
            slots=0,
            slot_tokens=16,
            dtype=torch.float32,
            device="cpu",
        )


# -- int4 ------------------------------------------------------------------------------------------


def test_int4_weights_are_the_group_grid_and_the_kernel_multiplies_by_it() -> None:
    torch.manual_seed(1)
    w = torch.randn(48, 256)
    q = Int4Linear.quantize(w, group_size=64)
    deq = dequantize_int4(q)
    # Independent reference: per group of 64, 16 evenly spaced levels from min to max.
    groups = w.reshape(-1, 64)
    lo, hi = groups.amin(1, keepdim=True), groups.amax(1, keepdim=True)
    step = (hi - lo) / 15
    ref = (((groups - lo) / step).round().clamp(0, 15) * step + lo).reshape_as(w)
    assert torch.allclose(deq, ref, atol=1e-5)
    assert (deq - w).abs().max() <= step.max() / 2 + 1e-5
    assert q.layout == "tinygemm"  # CPU: PyTorch's int4 kernel
    x = torch.randn(5, 256)
    exact = x @ deq.t()  # the kernel runs float32 activations in bfloat16 on CPU
    assert float((q(x) - exact).norm() / exact.norm()) < 5e-3
    assert q.nbytes < w.numel()  # under a byte per weight, scales included
    # The plain layout holds the same grid (its torch dequantization on CPU).
    plain = Int4Linear.quantize(w, group_size=64, layout="plain", bias=torch.ones(48))
    assert torch.allclose(plain.dequantize(), ref, atol=1e-5) and plain.nbytes < w.numel()
    assert torch.allclose(plain(x), x @ ref.t() + 1, atol=1e-3, rtol=1e-4)  # CPU: dequantized, then matmul
    assert "layout='plain'" in repr(plain)
    assert int4_group_size(576) == 64 and int4_group_size(576, 32) == 32 and int4_group_size(100) is None
    with pytest.raises(ConfigError):
        Int4Linear.quantize(w, group_size=100)
    with pytest.raises(ConfigError):
        Int4Linear.quantize(w, layout="nibbles")  # type: ignore[arg-type]


def test_dense_copies_of_int4_weights_serve_long_products_with_the_same_grid() -> None:
    """``DecoderConfig.dense_copy_bytes``: whole layers' int4 weights get a dense copy while
    the budget holds; a product of more than DENSE_COPY_MIN_ROWS rows multiplies the copy
    (the int4 grid's values: the same logits as dequantizing each time), fewer rows still
    run the int4 kernel, and the copies' bytes are counted apart from what a step reads."""
    torch.manual_seed(1)
    w = torch.randn(48, 256)
    q = Int4Linear.quantize(w, group_size=64, layout="plain")
    x = torch.randn(DENSE_COPY_MIN_ROWS + 1, 256)
    before = q(x)
    assert q.kernel(len(x), "cpu") == "cublas" and q.keep_dense(torch.float32) == 48 * 256 * 4
    assert q.kernel(len(x), "cpu") == "dense" and q.kernel(DENSE_COPY_MIN_ROWS, "cpu") != "dense"
    assert torch.allclose(q(x), before, atol=1e-5) and q.keep_dense(torch.float32) == 0
    assert "dense_copy=True" in repr(q) and q.nbytes > 48 * 256 * 4
    with pytest.raises(ConfigError):
        DecoderConfig(dense_copy_bytes=-1)
    model = tiny_model()
    kw: dict[str, Any] = dict(slots=1, slot_tokens=128, weights="int4")
    plain = StaticDecoder(model, config=DecoderConfig(group_size=32), **kw)
    per_layer = sum(m.in_features * m.out_features for m in _modules(plain.layers[0])) * 4  # float32
    one = StaticDecoder(model, config=DecoderConfig(group_size=32, dense_copy_bytes=per_layer + 1), **kw)
    every = StaticDecoder(model, config=DecoderConfig(group_size=32, dense_copy_bytes=1 << 30), **kw)
    assert (plain.dense_copy_nbytes, one.dense_copy_nbytes, every.dense_copy_nbytes) == (
        0,
        per_layer,
        2 * per_layer,
    )
    assert [m.dense is not None for m in (*_modules(one.layers[0]), *_modules(one.layers[1]))] == [
        True
    ] * 4 + [False] * 4
    assert every.weight_nbytes() == plain.weight_nbytes()  # a decode step reads the int4 weights
    ids = list(range(3, 3 + DENSE_COPY_MIN_ROWS + 20))
    ref = plain.prefill(0, ids, 0)[0]
    for dec in (one, every):
        out = dec.prefill(0, ids, 0)[0]
        # (tinygemm's CPU kernel runs float32 activations in bfloat16; the copy is exact)
        assert float((out - ref).norm() / ref.norm()) < 5e-3
        step, ref_step = dec.step([7], [0], [len(ids)]), plain.step([7], [0], [len(ids)])  # (K/V as above)
        assert float((step - ref_step).norm() / ref_step.norm()) < 5e-3


# -- the decoder against transformers ---------------------------------------------------------------


def with_reference(model_type: str, *, tokens: int, seed: int) -> tuple[Any, list[int], Any]:
    """A tiny random model, ``tokens`` random ids and transformers' logits after each."""
    model = tiny_model(model_type)
    ids = torch.randint(0, 512, (tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    return model, ids, ref


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_decoder_matches_transformers_forward(model_type: str) -> None:
    model, ids, ref = with_reference(model_type, tokens=40, seed=2)
    dec = StaticDecoder(model, slots=3, slot_tokens=64, config=DecoderConfig(prefill_chunk_tokens=7))
    dec.warmup()
    # q/k/v are fused without a second copy: the model's modules view the fused weight.
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    assert q_proj.untyped_storage().data_ptr() == dec.layers[0].qkv[0].weight.untyped_storage().data_ptr()
    with torch.no_grad():
        assert torch.equal(model(torch.tensor([ids])).logits[0], ref)
    logits, done = dec.prefill(1, ids[:30], 0)
    assert done == 30 and torch.allclose(logits, ref[29], atol=1e-4)
    all_logits, _ = dec.prefill(2, ids[:25], 0, all_logits=True)
    assert torch.allclose(all_logits, ref[:25], atol=1e-4)
    # Two rows at different positions in one step, then three (padded to the 4 bucket).
    for p in range(30, 35):
        out = dec.step([ids[p], ids[p - 5]], [1, 2], [p, p - 5])
        assert torch.allclose(out[0], ref[p], atol=1e-4) and torch.allclose(out[1], ref[p - 5], atol=1e-4)
    dec.prefill(0, ids[:10], 0)
    out = dec.step([ids[35], ids[30], ids[10]], [1, 2, 0], [35, 30, 10])
    assert out.shape == (3, 512)
    for row, p in enumerate((35, 30, 10)):
        assert torch.allclose(out[row], ref[p], atol=1e-4)
    # Prefill from a kept prefix: only the new tokens run.
    logits, _ = dec.prefill(0, ids[:40], 11)
    assert torch.allclose(logits, ref[39], atol=1e-4)
    with pytest.raises(ConfigError):
        dec.step([1], [0], [64])  # past the slot


def test_prefill_batch_runs_several_turns_in_one_forward() -> None:
    """Chunks of three turns (one continuing a kept prefix) in one forward give each turn
    the logits of transformers' forward, and decoding continues from every slot."""
    model, ids, ref = with_reference("qwen2", tokens=50, seed=3)  # grouped-query attention and q/k/v biases
    dec = StaticDecoder(model, slots=3, slot_tokens=64)
    dec.warmup()
    dec.prefill(1, ids[:10], 0)
    chunks = [PrefillChunk(slot=0, ids=ids, start=0, end=20), PrefillChunk(slot=1, ids=ids, start=10, end=30)]
    chunks.append(PrefillChunk(slot=2, ids=ids, start=0, end=45))
    outs = dec.prefill_batch(chunks)
    for out, p in zip(outs, (19, 29, 44), strict=True):
        assert torch.allclose(out, ref[p], atol=1e-4)
    out = dec.step([ids[20], ids[30], ids[45]], [0, 1, 2], [20, 30, 45])
    for row, p in enumerate((20, 30, 45)):
        assert torch.allclose(out[row], ref[p], atol=1e-4)
    with pytest.raises(ConfigError):
        dec.prefill_batch([PrefillChunk(slot=0, ids=ids, start=0, end=65)])


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_static_prefill_matches_transformers_forward(model_type: str) -> None:
    """The static-shape prefill that CUDA graphs capture (chunks padded to a bucket,
    attention over the whole slot under a mask), run eagerly on CPU: the logits of
    transformers' forward, from the start, from a kept prefix, across the end of a slot
    (pieces of smaller buckets), and decoding continues from what it wrote."""
    model, ids, ref = with_reference(
        model_type, tokens=64, seed=4
    )  # qwen2: grouped-query attention and q/k/v biases
    dec = StaticDecoder(
        model, slots=2, slot_tokens=64, config=DecoderConfig(prefill_chunk_tokens=32, static_prefill=True)
    )
    assert dec.prefill_buckets == [16, 32]
    dec.warmup()
    logits, _ = dec.prefill(0, ids[:21], 0)  # one 32-token bucket, 11 rows of padding
    assert torch.allclose(logits, ref[20], atol=1e-4)
    logits, _ = dec.prefill(0, ids[:45], 21)  # the kept prefix stays
    assert torch.allclose(logits, ref[44], atol=1e-4)
    out = dec.step([ids[45]], [0], [45])  # the padding rows' K/V past 45 were never read
    assert torch.allclose(out[0], ref[45], atol=1e-4)
    # Near the slot's end a piece starts earlier, re-running tokens the slot holds.
    late, early = (
        PrefillChunk(slot=1, ids=ids, start=40, end=63),
        PrefillChunk(slot=1, ids=ids, start=0, end=40),
    )
    assert static_pieces(late, dec.prefill_buckets, 64) == [(32, 63, 32)]
    assert static_pieces(early, dec.prefill_buckets, 64) == [(0, 32, 32), (32, 40, 16)]
    outs = dec.prefill_batch([PrefillChunk(slot=1, ids=ids, start=0, end=40)])
    outs += dec.prefill_batch([PrefillChunk(slot=1, ids=ids, start=40, end=61)])
    outs += dec.prefill_batch([PrefillChunk(slot=1, ids=ids, start=61, end=64)])
    for out, p in zip(outs, (39, 60, 63), strict=True):
        assert torch.allclose(out, ref[p], atol=1e-4)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_mixed_step_decodes_and_prefills_in_one_forward(static: bool) -> None:
    """Decode rows and prefill chunks in one forward give transformers' logits for both,
    and what each wrote to its slot carries on: eager, and in the static-shape forward
    that CUDA graphs capture per (decode bucket, chunk bucket), rows and chunk padded."""
    model, ids, ref = with_reference("qwen2", tokens=50, seed=5)
    dec = StaticDecoder(
        model, slots=3, slot_tokens=64, config=DecoderConfig(static_prefill=static, mixed_chunk_tokens=16)
    )
    assert dec.mixed_steps and dec.mixed_buckets == [16] and dec.buckets == [1, 2, 4]
    dec.warmup()
    dec.prefill(0, ids[:30], 0)
    dec.prefill(1, ids[:20], 0)
    chunks = [PrefillChunk(slot=2, ids=ids, start=0, end=12), PrefillChunk(slot=1, ids=ids, start=21, end=26)]
    rows, outs = dec.mixed_step([ids[30], ids[20]], [0, 1], [30, 20], chunks[:1])
    assert torch.allclose(rows[0], ref[30], atol=1e-4) and torch.allclose(rows[1], ref[20], atol=1e-4)
    assert torch.allclose(outs[0], ref[11], atol=1e-4)
    rows, outs = dec.mixed_step([ids[31]], [0], [31], chunks[1:])  # slot 1 continues after its row
    assert torch.allclose(rows[0], ref[31], atol=1e-4) and torch.allclose(outs[0], ref[25], atol=1e-4)
    out = dec.step([ids[26], ids[12]], [1, 2], [26, 12])
    assert torch.allclose(out[0], ref[26], atol=1e-4) and torch.allclose(out[1], ref[12], atol=1e-4)
    # Three rows (bucket 4) beside a chunk longer than the mixed buckets: static prefill
    # runs it after the decode step, in pieces; the eager forward takes it as it is.
    rows, outs = dec.mixed_step([ids[27], ids[13], ids[32]], [1, 2, 0], [27, 13, 32], [])
    assert torch.allclose(rows[2], ref[32], atol=1e-4) and outs == []
    long = PrefillChunk(slot=2, ids=ids, start=14, end=40)
    rows, outs = dec.mixed_step([ids[28], ids[33]], [1, 0], [28, 33], [long])
    assert torch.allclose(rows[0], ref[28], atol=1e-4) and torch.allclose(rows[1], ref[33], atol=1e-4)
    assert torch.allclose(outs[0], ref[39], atol=1e-4)
    with pytest.raises(ConfigError):
        dec.mixed_step([], [], [], chunks)


def test_packed_chunks_layout() -> None:
    """Each chunk but the last on whole blocks, the last to the bucket's end; a chunk near
    its slot's end starts earlier; what does not fit is refused."""
    ids = list(range(100, 200))
    a, b = PrefillChunk(slot=2, ids=ids, start=0, end=20), PrefillChunk(slot=1, ids=ids, start=21, end=40)
    assert packed_tokens([20, 19], 32) == 51 and packed_tokens([], 32) == 0
    flat = pack_chunks([a, b], 64, 128, unit=32, lasts=4)
    assert flat is not None and len(flat) == 3 * 64 + 4
    tok, pos, slots, lasts = flat[:64], flat[64:128], flat[128:192], flat[192:]
    assert (
        tok[:20] == ids[:20] and tok[20:32] == [0] * 12 and tok[32:51] == ids[21:40] and tok[51:] == [0] * 13
    )
    assert pos[:32] == list(range(32)) and pos[32:] == list(range(21, 53))
    assert slots == [2] * 32 + [1] * 32 and lasts == [19, 50, 50, 50]
    near = PrefillChunk(slot=0, ids=ids, start=110 - 100, end=60)  # 50 tokens, slot of 64
    flat = pack_chunks([near], 64, 64, unit=32, lasts=1)
    assert flat is not None and flat[64] == 0 and flat[:60] == ids[:60] and flat[-1] == 59  # from 0
    assert pack_chunks([a, b], 32, 128, unit=32) is None  # 51 rows > 32
    assert pack_chunks([a] * 5, 512, 128, unit=32, lasts=4) is None
    assert pack_chunks([], 64, 128) is None


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_mixed_step_packs_chunks_of_several_turns(fp8: bool) -> None:
    """Three turns' chunks packed in one static mixed forward beside two decode rows give
    transformers' logits for each, and every slot carries on from what it wrote."""
    model, ids, ref = with_reference("qwen2", tokens=60, seed=7)
    config = DecoderConfig(static_prefill=True, mixed_chunk_tokens=128)
    dec = StaticDecoder(model, slots=6, slot_tokens=128, config=config, kv_dtype="fp8" if fp8 else "auto")
    assert dec.mixed_chunks == 4 and dec.mixed_pack_tokens == 32 and dec.mixed_buckets == [16, 32, 64, 128]
    dec.warmup()
    dec.prefill(0, ids[:30], 0)
    dec.prefill(1, ids[:20], 0)
    dec.prefill(4, ids[:7], 0)
    chunks = [
        PrefillChunk(slot=2, ids=ids, start=0, end=33),  # 64 rows
        PrefillChunk(slot=4, ids=ids, start=7, end=12),  # 32 rows
        PrefillChunk(slot=3, ids=ids, start=0, end=9),  # the last: to the bucket's end
    ]
    rows, outs = dec.mixed_step([ids[30], ids[20]], [0, 1], [30, 20], chunks)
    tol = 0.05 if fp8 else 1e-4
    for got, want in zip([*rows, *outs], [ref[30], ref[20], ref[32], ref[11], ref[8]], strict=True):
        assert float((got - want).abs().max()) < tol * (1 + float(want.abs().max()))
    after = dec.step([ids[33], ids[12], ids[9], ids[31]], [2, 4, 3, 0], [33, 12, 9, 31])
    for got, p in zip(after, (33, 12, 9, 31), strict=True):
        assert float((got - ref[p]).abs().max()) < tol * (1 + float(ref[p].abs().max()))
    # More chunks than a step packs: a decode step, then the chunks apart.
    many = [
        PrefillChunk(slot=s, ids=ids, start=p, end=p + 2)
        for s, p in ((0, 32), (1, 21), (2, 34), (3, 10), (4, 13))
    ]
    rows, outs = dec.mixed_step([ids[32]], [0], [32], many)
    assert torch.allclose(rows[0], ref[32], atol=tol * 20) and len(outs) == 5


def test_unsupported_architectures_are_refused() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gpt2", n_embd=32, n_layer=1, n_head=2, vocab_size=64)
    gpt2 = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ConfigError, match="static decode supports"):
        StaticDecoder(gpt2, slot_tokens=32)
    with pytest.raises(ConfigError, match="weights"):
        StaticDecoder(tiny_model(), slot_tokens=32, weights="fp8")


def test_decode_attention_kernel_interpreted_matches_sdpa() -> None:
    pytest.importorskip("triton")
    code = (
        "import torch\n"
        "from convo.fast.attention import decode_attention, _attention_reference\n"
        "torch.manual_seed(0)\n"
        "k, v = torch.randn(4, 2, 300, 64), torch.randn(4, 2, 300, 64)\n"
        "q = torch.randn(3, 4, 64)\n"
        "slots, lens = torch.tensor([2, 0, 3]), torch.tensor([1, 129, 300], dtype=torch.int32)\n"
        "ref = _attention_reference(q, k, v, slots, lens, 300, 0.3)\n"
        "out = decode_attention(q, k, v, slots, lens, scale=0.3)\n"
        "print(float((out - ref).abs().max()))\n"
    )
    assert _interpreted_errors(code)[0] < 1e-4


def test_chunk_attention_kernel_interpreted_matches_sdpa() -> None:
    """The prefill chunk's flash-attention kernel (Triton's interpreter) against the keys
    gathered and SDPA under a mask: grouped heads, chunks shorter than a block, cached
    prefixes of any length, a chunk that ends at the slot's last token; and packed
    (``pack``): blocks of queries in different slots, kernel blocks shorter than a pack
    entry, a partial last block."""
    pytest.importorskip("triton")
    code = (
        "import torch\n"
        "from convo.fast.attention import chunk_attention, _chunk_attention_reference\n"
        "torch.manual_seed(0)\n"
        "err = 0.0\n"
        "cases = [(4, 2, 64, 48, 0), (4, 4, 32, 16, 100), (8, 2, 64, 128, 37), (2, 1, 16, 64, 192),\n"
        "         (2, 2, 16, 300, 200), (2, 1, 16, 200, 0)]  # every launch setting\n"
        "for heads, kvh, dim, tokens, start in cases:\n"
        "    k, v = torch.randn(3, kvh, 512, dim), torch.randn(3, kvh, 512, dim)\n"
        "    q = torch.randn(tokens, heads, dim)\n"
        "    slot, st = torch.tensor([2]), torch.tensor([start])\n"
        "    ref = _chunk_attention_reference(q, k, v, slot, st, 0.2)\n"
        "    out = chunk_attention(q, k, v, slot, st, scale=0.2)\n"
        "    assert out.shape == ref.shape\n"
        "    err = max(err, float((out - ref).abs().max()))\n"
        "packed = [(4, 2, 32, 256, 32), (2, 2, 16, 64, 32), (2, 1, 16, 16, 32)]\n"
        "for heads, kvh, dim, tokens, pack in packed:\n"
        "    k, v = torch.randn(4, kvh, 512, dim), torch.randn(4, kvh, 512, dim)\n"
        "    q = torch.randn(tokens, heads, dim)\n"
        "    n = -(-tokens // pack)\n"
        "    slot, st = torch.randint(0, 4, (n,)), torch.randint(0, 512 - pack, (n,))\n"
        "    ref = _chunk_attention_reference(q, k, v, slot, st, 0.2, pack=pack)\n"
        "    out = chunk_attention(q, k, v, slot, st, scale=0.2, pack=pack)\n"
        "    err = max(err, float((out - ref).abs().max()))\n"
        "print(err)\n"
    )
    assert _interpreted_errors(code)[0] < 1e-4


def test_packed_chunk_attention_is_each_chunk_on_its_own() -> None:
    """Chunks of three turns packed in one call (each on whole blocks of ``pack`` queries,
    the last with padding queries after it) attend as each chunk alone over its slot."""
    torch.manual_seed(0)
    k, v = torch.randn(4, 2, 128, 16), torch.randn(4, 2, 128, 16)
    q = torch.randn(96, 4, 16)
    layout = [(2, 40, 32), (0, 0, 32), (3, 90, 32)]  # (slot, first position, queries)
    slots = torch.tensor([s for s, _, n in layout for _ in range(n // 16)])
    starts = torch.tensor([p + 16 * i for _, p, n in layout for i in range(n // 16)])
    packed = _chunk_attention_reference(q, k, v, slots, starts, 0.3, pack=16)
    off = 0
    for slot, first, n in layout:
        alone = _chunk_attention_reference(
            q[off : off + n], k, v, torch.tensor([slot]), torch.tensor([first]), 0.3
        )
        assert torch.allclose(packed[off : off + n], alone, atol=1e-5)
        off += n


def _interpreted_errors(code: str) -> list[float]:
    """Run ``code`` with Triton's interpreter (kernels on CPU); the numbers on the last
    line it prints."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [float(v) for v in done.stdout.strip().splitlines()[-1].split()]


@pytest.mark.slow  # ~80 s: Triton's interpreter runs the kernels on the CPU
def test_plain_int4_triton_kernel_interpreted_matches_tinygemm() -> None:
    """The W4A16 kernel and the dequantization kernel (in Triton's interpreter), compiled
    into the decode step, give the logits of the tinygemm layout: both hold the same grid."""
    pytest.importorskip("triton")
    code = (
        "import sys, torch\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_decoder import tiny_model\n"
        "from convo.fast import DecoderConfig, Int4Linear, StaticDecoder\n"
        "from convo.fast.int4 import W4_KERNEL_MAX_ROWS\n"
        "w = torch.randn(96, 256)\n"
        "q = Int4Linear.quantize(w, group_size=32, layout='plain')\n"
        "ref_w = Int4Linear.quantize(w, group_size=32, layout='tinygemm').dequantize()\n"
        "err = float((q.dequantize() - ref_w).abs().max())\n"
        "for rows in (5, W4_KERNEL_MAX_ROWS + 1):  # the kernel, then dequantize + matmul\n"
        "    x = torch.randn(rows, 256)\n"
        "    err = max(err, float((q(x) - x @ ref_w.t()).abs().max()))\n"
        "from convo.fast.kernels import W4_CONFIGS, W4_LARGE_CONFIGS, w4a16_with_config\n"
        "x = torch.randn(3, 256)\n"
        "for cfg in [c for c in W4_CONFIGS if c[2] > 1][:2]:  # split K: float32 atomics\n"
        "    y = w4a16_with_config(x, q.qweight, q.scales_zeros, cfg)\n"
        "    err = max(err, float((y - x @ ref_w.t()).abs().max()))\n"
        "x = torch.randn(70, 256)  # tall tiles, the tile loaded as [K, N], the dense path\n"
        "for cfg in [*W4_LARGE_CONFIGS, (16, 32, 2, 4, 3, 256, True)]:\n"
        "    y = w4a16_with_config(x, q.qweight, q.scales_zeros, cfg)\n"
        "    err = max(err, float((y - x @ ref_w.t()).abs().max()))\n"
        "model = tiny_model()\n"
        "kw = dict(slots=2, slot_tokens=64, weights='int4')\n"
        "a = StaticDecoder(model, config=DecoderConfig(group_size=32, int4_kernel='tinygemm'), **kw)\n"
        "triton = DecoderConfig(group_size=32, int4_kernel='triton', compile=True)\n"
        "b = StaticDecoder(model, config=triton, **kw)\n"
        "assert a.int4_layout == 'tinygemm' and b.int4_layout == 'plain'\n"
        "assert StaticDecoder(model, config=DecoderConfig(group_size=32), **kw).int4_layout == 'both'\n"
        "a.warmup(); b.warmup()\n"
        "assert set(b.kernel_choice.values()) == {'triton'}, b.kernel_choice\n"
        "ids = list(range(3, 40))\n"
        "pairs = [(a.prefill(0, ids, 0)[0], b.prefill(0, ids, 0)[0])]\n"
        "pairs += [(a.step([p], [0], [p]), b.step([p], [0], [p])) for p in range(37, 42)]\n"
        "rel = max(float((u - v).norm() / v.norm()) for u, v in pairs)\n"
        "print(err, rel)\n"
    )
    # The kernels hold tinygemm's grid to float32 precision; the tinygemm decoder runs its
    # CPU kernel in bfloat16 (vectorized), so the decoders' logits agree to bfloat16's.
    kernels, decoders = _interpreted_errors(code)
    assert kernels < 1e-3 and decoders < 1e-2


@pytest.mark.slow  # ~30 s: Triton's interpreter runs the kernel on the CPU
def test_swap_settings_interpreted_match_the_dequantized_product() -> None:
    """The SWAP settings (``W @ x.T``, the product transposed at the end; split K adding
    the transposed partial sums) give the dequantized weight's product, at fewer rows than
    one row tile and at several row tiles with a ragged last one."""
    pytest.importorskip("triton")
    code = (
        "import torch\n"
        "from convo.fast import Int4Linear\n"
        "from convo.fast.kernels import W4_SWAP_CONFIGS, w4a16_settings, w4a16_with_config\n"
        "torch.manual_seed(0)\n"
        "q = Int4Linear.quantize(torch.randn(192, 256), group_size=32, layout='plain')\n"
        "ref_w = q.dequantize()\n"
        "swap = list(W4_SWAP_CONFIGS)\n"
        "assert all(w4a16_settings(c)[8] for c in swap) and any(w4a16_settings(c)[2] > 1 for c in swap)\n"
        "err = 0.0\n"
        "for rows in (3, 70):\n"
        "    x = torch.randn(rows, 256)\n"
        "    for cfg in swap:\n"
        "        y = w4a16_with_config(x, q.qweight, q.scales_zeros, cfg)\n"
        "        err = max(err, float((y - x @ ref_w.t()).abs().max()))\n"
        "print(err, len(swap))\n"
    )
    err, count = _interpreted_errors(code)
    assert err < 1e-3 and count >= 8


# -- the scheduler -------------------------------------------------------------------------------------


def _request(ids: list[int], n: int, **kwargs: Any) -> DecodeRequest:
    kwargs.setdefault("sampling", GREEDY)
    return DecodeRequest(ids=ids, max_new_tokens=n, deadline=time.monotonic() + 60, **kwargs)


def test_scheduler_decodes_sessions_together_with_their_own_lengths() -> None:
    model = tiny_model()
    dec = StaticDecoder(model, slots=3, slot_tokens=64)
    dec.warmup()
    sched = DecodeScheduler(dec)
    prompts = [list(range(5, 5 + n)) for n in (7, 12, 20)]
    alone = [sched.run(_request(p, 9 + i)).new_ids for i, p in enumerate(prompts)]
    steps_before = sched.steps
    reqs = [sched.submit(_request(p, 9 + i)) for i, p in enumerate(prompts)]
    for r in reqs:
        assert r.done.wait(60) and r.error is None
    assert [r.new_ids for r in reqs] == alone  # same tokens batched as alone
    assert [r.finish for r in reqs] == ["length"] * 3
    assert sched.steps - steps_before < sum(len(a) for a in alone) - 3  # rows shared steps
    # Reference: transformers' greedy continuation of the first prompt.
    out = model.generate(torch.tensor([prompts[0]]), max_new_tokens=9, do_sample=False)
    assert out[0, 7:].tolist() == alone[0]
    sched.close()


def test_scheduler_packs_arriving_turns_beside_a_streaming_reply() -> None:
    """Through the real scheduler and the static forward (as captured on CUDA), turns that
    arrive while a reply streams are prefilled packed in mixed steps (several in one step,
    on 32-token blocks): every logit row the decoder gives, decode rows and each chunk's
    last token, is transformers' for that sequence at that position."""
    model = tiny_model("qwen2")
    config = DecoderConfig(static_prefill=True, mixed_chunk_tokens=128, prefill_chunk_tokens=128)
    dec = StaticDecoder(model, slots=5, slot_tokens=192, config=config)
    dec.warmup()
    seen: list[tuple[int, int, Any]] = []  # (slot, position, logits)
    packs: list[int] = []
    mixed, step = dec.mixed_step, dec.step

    def mixed_step(tokens: Any, slots: Any, positions: Any, chunks: Any) -> Any:
        rows, outs = mixed(tokens, slots, positions, chunks)
        packs.append(len(chunks))
        seen.extend(zip(slots, positions, rows, strict=True))
        seen.extend((c.slot, c.end - 1, out) for c, out in zip(chunks, outs, strict=True))
        return rows, outs

    def decode_step(tokens: Any, slots: Any, positions: Any) -> Any:
        rows = step(tokens, slots, positions)
        seen.extend(zip(slots, positions, rows, strict=True))
        return rows

    dec.mixed_step, dec.step = mixed_step, decode_step  # type: ignore[method-assign]
    sched = DecodeScheduler(dec, background=False, interleave_tokens=128)
    g = torch.Generator().manual_seed(3)
    streaming = sched.submit(_request(torch.randint(0, 512, (10,), generator=g).tolist(), 40))
    sched.run_step()  # its prefill, alone
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (30, 45, 20, 70)]
    reqs = [sched.submit(_request(p, 6)) for p in prompts]
    while not all(r.done.is_set() for r in (streaming, *reqs)):
        sched.run_step()
    assert max(packs) >= 2  # several turns' chunks in one mixed step
    by_slot = {r.slot: r for r in (streaming, *reqs)}  # (no slot changed hands: 5 slots)
    with torch.no_grad():
        ref = {s: model(torch.tensor([r.ids + r.new_ids])).logits[0] for s, r in by_slot.items()}
    for slot, position, logits in seen:
        assert torch.allclose(logits, ref[slot][position], atol=1e-4), (slot, position)
    assert len(seen) >= sum(r.max_new_tokens for r in (streaming, *reqs)) - 5
    sched.close()


def test_scheduler_queues_for_a_slot_and_times_out_while_waiting() -> None:
    dec = StaticDecoder(tiny_model(), slots=1, slot_tokens=64)
    dec.warmup()
    sched = DecodeScheduler(dec)
    slow_gate = threading.Event()

    def hold(token: int) -> bool:
        slow_gate.wait(5)
        return False

    first = sched.submit(_request([1, 2, 3], 3, on_token=hold, cache_key="a"))
    waiting = sched.submit(
        DecodeRequest(ids=[4, 5], max_new_tokens=3, deadline=time.monotonic() + 0.2, sampling=GREEDY)
    )
    assert waiting.done.wait(10)
    assert waiting.finish == "timeout" and waiting.new_ids == []
    slow_gate.set()
    assert first.done.wait(10) and first.finish == "length"
    # The slot kept session a's tokens; its next turn reuses them.
    follow = sched.run(_request([1, 2, 3, *first.new_ids, 7], 2, cache_key="a"))
    assert follow.cached_tokens == 3 + len(first.new_ids) - 1
    cancel = threading.Event()
    cancel.set()
    assert sched.run(_request([1], 5, cancel=cancel)).finish == "cancelled"
    sampled = sched.run(_request([1, 2], 4, eos=frozenset({0})))
    seeded = [
        sched.run(_request([1, 2], 6, sampling=Sampling(temperature=0.8, seed=3))).new_ids for _ in "ab"
    ]
    assert seeded[0] == seeded[1] and len(sampled.new_ids) >= 1
    sched.close()


def test_engine_with_slots_on_a_random_model_keeps_its_contract() -> None:
    from convo.engines.local.engine import TransformersEngine

    stock = TransformersEngine("random:tiny-llama", device="cpu", kv_slots=0)
    fast = TransformersEngine.from_model(
        stock.model, stock.tokenizer, quant="fp32", kv_slots=2, slot_tokens=128
    )
    fast._vocab_limit = stock._vocab_limit
    assert fast.context_window == 128 and fast.decoder is not None
    from convo.messages import user

    q = [user("hello there")]
    a, b = stock.generate(q, max_new_tokens=6), fast.generate(q, max_new_tokens=6, cache_key="s")
    assert a.token_ids == b.token_ids
    assert (
        b.stats.kv_bytes == b.stats.kv_bytes_expected
        and b.stats.kv_slot_bytes == fast.decoder.pool.slot_nbytes
    )
    assert fast.cached_sessions == ["s"]
    fast.release("s")
    assert fast.cached_sessions == []
    from convo.errors import BudgetError

    with pytest.raises(BudgetError):
        fast.generate(q, max_new_tokens=200)


def test_int4_engine_runs_only_through_its_slots() -> None:
    from convo.engines.local.engine import TransformersEngine
    from convo.messages import user
    from convo.models import Quant

    engine = TransformersEngine("random:tiny-llama", device="cpu", quant="int4", slot_tokens=96)
    assert engine.quant is Quant.INT4 and engine.decoder is not None and engine.decoder.quantized
    assert engine.model.model.layers[0].mlp.down_proj.weight.numel() == 0  # dense copy freed
    first = engine.generate([user("hi")], max_new_tokens=4, cache_key="a")
    again = engine.generate([user("hi"), user("more")], max_new_tokens=4, cache_key="a")
    assert first.stats.new_tokens == 4 and again.stats.cached_tokens > 0
    with pytest.raises(ConfigError, match="kv_slots"):
        TransformersEngine("random:tiny-llama", device="cpu", quant="int4", kv_slots=0)
    with pytest.raises(ConfigError, match="int4_group_size"):
        TransformersEngine("random:tiny-llama", device="cpu", int4_group_size=100)


def test_int4_engine_keeps_dense_copies_when_asked_and_answers_the_same() -> None:
    """``LoadConfig.int4_dense_copy_bytes`` (``--int4-dense-copy``) reaches the decoder: a
    prompt of more than DENSE_COPY_MIN_ROWS tokens prefills through the copies, and the
    greedy reply is the one the engine without them gives."""
    from convo.cli.common import add_local_engine_arguments
    from convo.engines.local.config import LoadConfig
    from convo.engines.local.engine import TransformersEngine
    from convo.messages import user

    kw: dict[str, Any] = dict(device="cpu", quant="int4", slot_tokens=256)
    plain = TransformersEngine("random:tiny-llama", **kw)
    kept = TransformersEngine("random:tiny-llama", load=LoadConfig(int4_dense_copy_bytes=1 << 30), **kw)
    assert plain.decoder.dense_copy_nbytes == 0 and kept.decoder.dense_copy_nbytes > 0
    prompt = [user(" ".join(f"word{i}" for i in range(60)))]
    a, b = (e.generate(prompt, max_new_tokens=6) for e in (plain, kept))  # (greedy by default)
    assert a.stats.prompt_tokens > DENSE_COPY_MIN_ROWS and a.text == b.text
    with pytest.raises(ConfigError, match="int4_dense_copy_bytes"):
        LoadConfig(int4_dense_copy_bytes=-1)
    parser = argparse.ArgumentParser()
    add_local_engine_arguments(parser)
    assert parser.parse_args(["--int4-dense-copy", "13GiB"]).int4_dense_copy == 13 << 30
    assert parser.parse_args([]).int4_dense_copy == 0


# -- the real default model ------------------------------------------------------------------------

PASSAGE = (
    "The river rises in the hills above the town and runs for forty miles to the sea. In spring "
    "the snow melts and the water climbs the stone steps of the old mill, and the miller's family "
    "moves the flour to the upper floor. Children wait on the bridge to count the boats that come "
    "down from the farms, loaded with wool, apples and timber. In summer the river is slow and "
    "clear, and the fish gather in the shade under the willows. The town council meets every "
    "month to decide how much water the mill may take, and the farmers argue that the mill takes "
    "too much. Every autumn there is a fair on the meadow by the water, with music, bread and "
    "cider, and the best horse wins a blue ribbon from the mayor."
)


def _perplexity(logits: Any, ids: list[int]) -> float:
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    nll = -logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    return math.exp(float(nll.mean()))


@pytest.mark.slow
def test_static_engine_matches_the_stock_engine_on_the_real_model(real_engine: Any) -> None:
    from convo.engines.local.engine import TransformersEngine
    from convo.messages import assistant, user
    from convo.models import FinishReason

    fast = TransformersEngine.from_model(
        real_engine.model, real_engine.tokenizer, quant="fp32", kv_slots=3, slot_tokens=512
    )
    q = [user("What is the capital of France?")]
    a = real_engine.generate(q, max_new_tokens=12)
    b = fast.generate(q, max_new_tokens=12, cache_key="s")
    assert "Paris" in b.text and a.token_ids == b.token_ids
    follow = [*q, assistant(b.text), user("And of Italy?")]
    c = fast.generate(follow, max_new_tokens=10, cache_key="s")
    assert c.stats.cached_tokens > 0 and c.text == real_engine.generate(follow, max_new_tokens=10).text
    stopped = fast.generate(q, max_new_tokens=12, stop=["Paris"])
    assert "Paris" not in stopped.text and stopped.finish_reason is FinishReason.STOP
    # Three sessions at once: batched, each the same as alone.
    prompts = [[user(f"Count from {i} to {i + 5}.")] for i in range(3)]
    alone = [fast.generate(p, max_new_tokens=16).token_ids for p in prompts]
    results: dict[int, Any] = {}
    threads = [
        threading.Thread(
            target=lambda i=i: results.__setitem__(i, fast.generate(prompts[i], max_new_tokens=16))
        )
        for i in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i].token_ids for i in range(3)] == alone


@pytest.mark.slow
def test_int4_quality_on_the_real_model(real_engine: Any) -> None:
    """int4 (group 32) against bf16 and fp32 on a fixed text, and a sensible greedy answer.

    The default model comes from a Q4_1 GGUF (blocks of 32), so group 32 lands on its own
    grid; coarser groups cost more (measured: +42 % at 64, +45 % at 128 over 1,000 tokens).
    """
    ids = real_engine.tokenizer(PASSAGE)["input_ids"]
    assert 120 < len(ids) < 200
    with torch.no_grad():
        fp32 = _perplexity(real_engine.model(torch.tensor([ids])).logits[0], ids)
    int4 = StaticDecoder(
        real_engine.model, slots=1, slot_tokens=256, weights="int4", config=DecoderConfig(group_size=32)
    )
    assert int4.quantized
    int4_ppl = _perplexity(int4.prefill(0, ids, 0, all_logits=True)[0], ids)
    assert abs(int4_ppl / fp32 - 1) < 0.03, (int4_ppl, fp32)
    logits, _ = int4.prefill(0, real_engine.counter.render_ids(_question()), 0)
    assert "Paris" in _greedy(int4, logits, real_engine)


def _question() -> list[Any]:
    from convo.messages import user

    return [user("What is the capital of France?")]


def _greedy(dec: StaticDecoder, logits: Any, engine: Any, n: int = 10) -> str:
    ids = engine.counter.render_ids(_question())
    out = [int(logits.argmax())]
    for _ in range(n - 1):
        out.append(int(dec.step([out[-1]], [0], [len(ids) + len(out) - 1])[0].argmax()))
    return str(engine.tokenizer.decode(out, skip_special_tokens=True))


# -- CUDA ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@cuda
def test_cuda_pool_is_taken_once_and_matches_the_prediction() -> None:
    model = tiny_model(device="cuda", dtype=torch.bfloat16)
    dec = StaticDecoder(model, slots=4, slot_tokens=2048)
    assert abs(dec.pool_measured_bytes / dec.pool_predicted_bytes - 1) < 0.01
    dec.warmup()
    before = torch.cuda.memory_allocated()
    dec.prefill(0, list(range(300)), 0)
    for p in range(300, 340):
        dec.step([1, 2], [0, 1], [p, p - 200])
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < 1 << 20  # no KV growth: decode allocates nothing


@pytest.mark.gpu
@cuda
def test_cuda_chunk_attention_matches_reference() -> None:
    torch.manual_seed(0)
    k = torch.randn(4, 8, 2048, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for heads, tokens, start in ((32, 256, 0), (32, 64, 1500), (8, 2048, 0), (32, 16, 2032)):  # 8 kv heads
        q = torch.randn(tokens, heads, 128, device="cuda", dtype=torch.bfloat16)
        slot, st = torch.tensor([3], device="cuda"), torch.tensor([start], device="cuda")
        ref = _chunk_attention_reference(q.float(), k.float(), v.float(), slot, st, 0.088)
        out = chunk_attention(q, k, v, slot, st, scale=0.088)
        assert float((out.float() - ref).norm() / ref.norm()) < 1e-2
    for tokens in (16, 64, 256, 512):  # packed: a slot and a start per 32 queries
        q = torch.randn(tokens, 32, 128, device="cuda", dtype=torch.bfloat16)
        n = -(-tokens // 32)
        slot, st = torch.randint(0, 4, (n,), device="cuda"), torch.randint(0, 2048 - 32, (n,), device="cuda")
        ref = _chunk_attention_reference(q.float(), k.float(), v.float(), slot, st, 0.088, pack=32)
        out = chunk_attention(q, k, v, slot, st, scale=0.088, pack=32)
        assert float((out.float() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.gpu
@cuda
def test_cuda_attention_kernel_and_int4_kernel_match_references() -> None:
    torch.manual_seed(0)
    k = torch.randn(4, 2, 1000, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(3, 8, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([2, 0, 3], device="cuda")
    lens = torch.tensor([1, 129, 1000], device="cuda", dtype=torch.int32)
    ref = _attention_reference(q.float(), k.float(), v.float(), slots, lens, 1000, 0.088)
    out = decode_attention(q, k, v, slots, lens, scale=0.088)
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2
    w = torch.randn(256, 512, device="cuda")
    ref_w = Int4Linear.quantize(w, group_size=128, layout="tinygemm")
    plain = Int4Linear.quantize(w, group_size=128, layout="plain")
    both = Int4Linear.quantize(w, group_size=128)
    assert both.layout == "both" and both.nbytes == plain.nbytes + ref_w.nbytes  # CUDA with Triton
    assert torch.allclose(plain.dequantize(), ref_w.dequantize(), atol=1e-2)
    kinds = [both.kernel(r) for r in (1, 8, 9, W4_KERNEL_MAX_ROWS, W4_KERNEL_MAX_ROWS + 1)]
    assert kinds == ["tinygemm"] * 2 + ["triton"] * 2 + ["cublas"]
    for rows in (1, 7, 9, 16, 40, 64, 65, 300, 600):  # tinygemm, the Triton kernel's op, cuBLAS
        xr = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
        ref_r = xr.float() @ ref_w.dequantize().t()
        for linear in (ref_w, plain, both):
            yr = linear(xr).float()
            assert float((yr - ref_r).norm() / ref_r.norm()) < 2e-2, (rows, linear.layout)


@pytest.mark.gpu
@cuda
def test_cuda_every_w4a16_launch_setting_matches_the_dequantized_product() -> None:
    """Every setting the tuner may time is right, not only those its one check on random
    rows lets through (tall tiles, K blocks of 256, the tile loaded as [K, N], split K, the
    dense path, the nibbles made floats by their mantissa bits in bf16 and fp16)."""
    torch.manual_seed(0)
    w = torch.randn(384, 1024, device="cuda")
    q = Int4Linear.quantize(w, group_size=32, layout="plain")
    dense = q.dequantize()
    extra = [
        (16, bn, sk, 4, 3, bk, t)
        for bn, sk, bk, t in itertools.product((32, 128), (1, 4), (128, 256), (0, 1))
    ]
    extra += list(W4_SWAP_CONFIGS)  # (the benchmark's sweep times them)
    for rows in (5, 16, 64, 144, 272):
        x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ dense.t()
        cfgs = [*W4_CONFIGS, *W4_LARGE_CONFIGS, *extra] if rows <= 64 else [*w4a16_candidates(rows), *extra]
        for cfg in cfgs:
            y = w4a16_with_config(x, q.qweight, q.scales_zeros, cfg).float()
            assert float((y - ref).norm() / ref.norm()) < 1e-2, (rows, cfg)
    # fp16 activations and scales: the nibble set into 1024's mantissa
    q16 = Int4Linear.quantize(w, group_size=32, layout="plain", dtype=torch.float16)
    x = torch.randn(16, 1024, device="cuda", dtype=torch.float16)
    ref = x.float() @ q16.dequantize().t()
    for cfg in [c for c in W4_CONFIGS if w4a16_settings(c)[7]][:4]:
        y = w4a16_with_config(x, q16.qweight, q16.scales_zeros, cfg).float()
        assert float((y - ref).norm() / ref.norm()) < 1e-2, ("fp16", cfg)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("weights", ["as-loaded", "int4"])
def test_cuda_no_recompiles_or_recaptures_after_warmup(weights: str) -> None:
    from torch._dynamo.utils import counters

    model = tiny_model(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref_logits = model(torch.tensor([list(range(1, 50))], device="cuda")).logits[0, -1].float()
    dec = StaticDecoder(model, slots=4, slot_tokens=256, weights=weights, config=DecoderConfig(group_size=32))
    assert dec.compiled and dec.cuda_graphs
    dec.warmup()
    graphs, captures = counters["stats"]["unique_graphs"], dec.captures
    assert captures == len(dec.buckets) * (1 + len(dec.mixed_buckets)) + len(dec.prefill_buckets)
    if weights == "int4":  # both layouts: tinygemm for a few rows, Triton for more
        assert dec.kernel_choice == {1: "tinygemm", 2: "tinygemm", 4: "tinygemm"}, dec.kernel_choice
    sched = DecodeScheduler(dec)
    # Turns of different lengths, alone and together: no new graphs, no new captures.
    for n in (5, 17, 49, 120):
        sched.run(_request(list(range(1, n + 1)), 8, cache_key=f"s{n}"))
    reqs = [sched.submit(_request(list(range(1, n + 1)), 12)) for n in (3, 30, 90)]
    for r in reqs:
        assert r.done.wait(60) and r.error is None and len(r.new_ids) == 12
    assert counters["stats"]["unique_graphs"] == graphs
    assert dec.captures == captures
    dec.prefill(0, list(range(1, 49)), 0)
    step = dec.step([49], [0], [48])[0]
    tol = 0.05 if weights == "as-loaded" else 0.25
    assert float((step - ref_logits).norm() / ref_logits.norm()) < tol
    sched.close()


@pytest.mark.gpu
@cuda
def test_cuda_mixed_graph_matches_a_step_then_a_prefill() -> None:
    """A replay of the graph captured for (3 rows -> bucket 4, a 20-token chunk -> bucket
    32), then of (2 rows, three turns' chunks packed in 128 rows), gives the logits of a
    decode replay followed by the chunks' prefill replays on a twin pool."""
    model = tiny_model(device="cuda", dtype=torch.bfloat16)
    ids = list(range(1, 200))
    outs = []
    for mixed in (True, False):
        dec = StaticDecoder(
            model, slots=6, slot_tokens=256, config=DecoderConfig(mixed_chunk_tokens=0 if not mixed else 256)
        )
        dec.warmup()
        assert ((4, 32) in dec.mixed_graphs and (2, 128) in dec.mixed_graphs) is mixed
        for slot, n in ((0, 40), (1, 50), (2, 60), (5, 9)):
            dec.prefill(slot, ids[:n], 0)
        chunk = PrefillChunk(slot=3, ids=ids, start=0, end=20)
        rows, chunks = dec.mixed_step([ids[40], ids[50], ids[60]], [0, 1, 2], [40, 50, 60], [chunk])
        after = dec.step([ids[20], ids[41]], [3, 0], [20, 41])  # both slots carry on
        packed = [
            PrefillChunk(slot=4, ids=ids, start=0, end=45),
            PrefillChunk(slot=5, ids=ids, start=9, end=30),
            PrefillChunk(slot=3, ids=ids, start=21, end=40),
        ]
        rows2, chunks2 = dec.mixed_step([ids[51], ids[61]], [1, 2], [51, 61], packed)
        after2 = dec.step([ids[45], ids[30], ids[40], ids[42]], [4, 5, 3, 0], [45, 30, 40, 42])
        outs.append(
            torch.cat([rows, torch.stack(chunks), after, rows2, torch.stack(chunks2), after2]).float()
        )
    assert float((outs[0] - outs[1]).norm() / outs[1].norm()) < 2e-2


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("quant", ["auto", "int4"])
def test_cuda_engine_defaults_to_static_slots(quant: str) -> None:
    from convo.engines.local.engine import TransformersEngine
    from convo.messages import user

    engine = TransformersEngine("random:tiny-llama", quant=quant, slot_tokens=256)
    assert engine.decoder is not None and engine.decoder.cuda_graphs
    assert 1 <= engine.decoder.pool.slots <= 8, engine.decoder.pool.slots
    engine.generate([user("warm up")], max_new_tokens=2)  # the decode thread's first kernels
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    first = engine.generate([user("hello")], max_new_tokens=8, cache_key="s")
    second = engine.generate([user("hello"), user("again")], max_new_tokens=8, cache_key="s")
    assert second.stats.cached_tokens > 0, second.stats
    assert first.stats.kv_slot_bytes == engine.decoder.pool.slot_nbytes, first.stats
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - allocated
    assert grown < 1 << 20, grown  # the pool was taken at load


def test_flat_decoder_keywords_still_work_and_warn() -> None:
    model = tiny_model()
    with pytest.warns(DeprecationWarning, match=r"config=DecoderConfig\(prefill_chunk_tokens=\.\.\.\)"):
        old = StaticDecoder(model, slots=2, slot_tokens=32, prefill_chunk_tokens=8)
    assert old.config == DecoderConfig(prefill_chunk_tokens=8) and old.prefill_chunk_tokens == 8
    with pytest.raises(TypeError, match="group"):
        StaticDecoder(model, slots=2, slot_tokens=32, group=32)
