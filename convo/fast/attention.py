"""Triton kernels of attention over the KV slot pool: split (flash-decoding) attention for
decode rows, causal (flash) attention of prefill chunks over their slots, and the write of
new K/V into an fp8 slot pool.

fp8 KV (``float8_e4m3fn``): each head vector of each token's K and V is stored as 8-bit
floats with one bfloat16 scale, ``amax(|x|) / 448`` over its ``head_dim`` values, computed
when the token is written (:func:`quantize_kv`). Why per token and head: the scale needs
no calibration and is known the moment the token is (a fixed per-head scale would have to
be measured on real activations first, and clips outliers it did not see); it costs 2
bytes per ``head_dim`` bytes (1.6 % at 128) and one scalar load per key in the kernels. The
attention kernels read the fp8 values, convert them exactly (every e4m3 value is a bf16
value), and apply the scales to the float32 scores (K) and probabilities (V), so the
products and the softmax accumulate in float32 as they do for bf16 KV.
"""

from __future__ import annotations

import math
from typing import Any

from convo.models.defaults import FP8_KV_SCALE_DTYPE

#: Tokens one program of the split decode-attention kernel reads (a power of two), in
#: blocks of :data:`ATTENTION_BLOCK_TOKENS`, with :data:`ATTENTION_WARPS` warps. Swept on
#: the H200 (Llama-2-7B heads, 2,048-token slots): 16 rows at 1,000 tokens 99 us a layer
#: (was 155 with 128 / 64 / 4 warps), at 1,900 tokens 133 us (was 186); one row ~50 us.
ATTENTION_SPLIT_TOKENS = 256
ATTENTION_BLOCK_TOKENS = 128
ATTENTION_WARPS = 2

#: Launch settings of the chunk-attention kernel (:func:`chunk_attention`) by chunk length:
#: ``(up to tokens, BLOCK_M, BLOCK_N, warps, stages)``, the first row whose bound holds the
#: chunk. Swept on the H200 (Llama-2-7B heads, 2,048-token slots), per layer: 16 tokens
#: after 1,500 cached 0.032 ms, 256 tokens 0.043 ms, 2,048 tokens 0.10 ms, against 0.14,
#: 0.21 and 0.31 ms for the keys gathered and SDPA under a mask.
CHUNK_ATTENTION_CONFIGS: tuple[tuple[int, int, int, int, int], ...] = (
    (16, 16, 64, 8, 3),
    (32, 32, 64, 4, 2),
    (64, 64, 64, 4, 2),
    (128, 32, 128, 8, 2),
    (256, 32, 64, 4, 3),
    (512, 128, 64, 8, 3),
    (1 << 30, 64, 64, 4, 3),
)


def _attention_reference(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    slots: Any,
    lengths: Any,
    length: int,
    scale: float,
    k_scale: Any = None,
    v_scale: Any = None,
) -> Any:
    """Decode attention in plain torch: ``q`` ``[B, H, D]`` over the first ``lengths[b]``
    tokens of slot ``slots[b]`` (``length`` >= every entry of ``lengths``); an fp8 pool's
    K/V (with ``k_scale``, ``v_scale``) are dequantized to ``q``'s dtype first."""
    import torch
    import torch.nn.functional as F

    k = _gather(k_cache, k_scale, slots, length, q.dtype)
    v = _gather(v_cache, v_scale, slots, length, q.dtype)
    mask = torch.arange(length, device=q.device)[None, :] < lengths[:, None]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :],
        k,
        v,
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out[:, :, 0, :]


def _gather(cache: Any, scales: Any, slots: Any, length: int, dtype: Any) -> Any:
    """The first ``length`` tokens of slots ``slots`` of one layer's K or V, in ``dtype``
    (dequantized when the pool is fp8)."""
    x = cache.index_select(0, slots)[:, :, :length]
    if scales is None:
        return x
    return dequantize_kv(x, scales.index_select(0, slots)[:, :, :length], dtype)


#: Largest finite value of ``float8_e4m3fn``: a head vector's largest magnitude maps here.
FP8_E4M3_MAX = 448.0


def is_fp8(t: Any) -> bool:
    """Whether ``t`` (a tensor or a torch dtype) is stored as ``float8_e4m3fn``."""
    import torch

    return getattr(t, "dtype", t) == torch.float8_e4m3fn


def native_fp8(device: Any) -> bool:
    """Whether Triton has an fp8 type on ``device``: CUDA from compute capability 8.9
    (Ada, Hopper), and its interpreter. Elsewhere the attention kernels read an fp8 pool's
    bytes and decode them (``e4m3`` into ``float16`` bits; the kernels take ``uint8``
    views of the caches that way anywhere), and K/V are written by torch."""
    import torch

    if _interpreting():
        return True
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_kv(x: Any) -> tuple[Any, Any]:
    """``x`` ``[..., head_dim]`` as fp8 (e4m3) values and one bfloat16 scale per head
    vector ``[...]``: ``x ~ q.float() * scale[..., None]``, ``scale = amax(|x|) / 448``
    rounded to bfloat16 before the values are divided by it (rounded down, the largest
    value clamps to 448: at most 2**-8 off); a zero vector keeps a tiny positive scale and
    stores zeros."""
    import torch

    xf = x.float()
    scale = (xf.abs().amax(-1).clamp_min(1e-30) / FP8_E4M3_MAX).to(getattr(torch, FP8_KV_SCALE_DTYPE))
    q = (xf / scale.float()[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_kv(q: Any, scale: Any, dtype: Any) -> Any:
    """The values of fp8 K or V ``q`` ``[..., head_dim]`` with their scales ``[...]``, in
    ``dtype`` (products in float32)."""
    return (q.float() * scale.float()[..., None]).to(dtype)


def store_kv(
    k_cache: Any,
    v_cache: Any,
    k_scale: Any,
    v_scale: Any,
    slots: Any,
    positions: Any,
    k: Any,
    v: Any,
) -> None:
    """Write token ``n``'s ``k[n]``, ``v[n]`` (``[N, kv_heads, head_dim]``) at position
    ``positions[n]`` of slot ``slots[n]`` of one layer of an fp8 pool, with their scales
    (:func:`quantize_kv`). On CUDA with Triton one kernel quantizes and scatters K, V and
    both scales (a bf16 pool's write is two scatters: the fp8 write adds no launch);
    elsewhere torch. Shapes alone decide the launch: a captured graph replays it for any
    slots and positions.

    Under Triton's interpreter the torch write runs too: the interpreter (3.9) rounds
    float32 to fp8 wrongly where rounding carries into the exponent (126.8 -> 64, not 128);
    tests check the kernel there on values exact in fp8 (:func:`_store_kv_kernel`).
    """
    caches = (k_cache, v_cache, k_scale, v_scale)
    if k.device.type == "cuda" and native_fp8(k.device) and _store_kv_kernel(*caches, slots, positions, k, v):
        return
    import torch

    kq, ks = quantize_kv(k)
    vq, vs = quantize_kv(v)
    # Scatter the bytes: index_put of float8 is not implemented on every device.
    k_cache.view(torch.uint8)[slots, :, positions] = kq.view(torch.uint8)
    v_cache.view(torch.uint8)[slots, :, positions] = vq.view(torch.uint8)
    k_scale[slots, :, positions] = ks
    v_scale[slots, :, positions] = vs


def _store_kv_kernel(
    k_cache: Any, v_cache: Any, k_scale: Any, v_scale: Any, slots: Any, positions: Any, k: Any, v: Any
) -> bool:
    """:func:`store_kv` through the Triton kernel; False (nothing written) without Triton."""
    kernels = _triton_kernels()
    if kernels is None:
        return False
    n, kv_heads, dim = k.shape
    if n:
        # The kernel reads token n's slot and position at offset n: a chunk's slots come as
        # one slot expanded (stride 0), which it would read past.
        slots, positions = slots.expand(n).contiguous(), positions.expand(n).contiguous()
        kernels["store"][(n, kv_heads)](
            k, v, slots, positions, k_cache, v_cache, k_scale, v_scale,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            k_scale.stride(0), k_scale.stride(1),
            D=dim, D_P2=_next_power_of_2(dim), FP8_MAX=FP8_E4M3_MAX,
        )  # fmt: skip
    return True


_TRITON: dict[str, Any] = {}


def _triton_kernels() -> dict[str, Any] | None:
    """The attention kernels (split decode attention, chunk attention), or ``None`` without
    Triton."""
    if _TRITON:
        return None if "missing" in _TRITON else _TRITON
    try:
        import triton
        import triton.language as tl
    except ImportError:
        _TRITON["missing"] = True
        return None

    @triton.jit  # type: ignore[misc,unused-ignore]
    def _split_kernel(  # type: ignore[no-untyped-def]
        Q, K, V, KS, VS, Slots, Lens, Acc, M, L,
        scale,
        stride_qb, stride_qh,
        stride_ks, stride_kh, stride_kt,
        stride_vs, stride_vh, stride_vt,
        stride_ss, stride_sh,
        GROUP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
        NSPLIT: tl.constexpr, SCALED: tl.constexpr, BYTES: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        slot = tl.load(Slots + b).to(tl.int64)
        length = tl.load(Lens + b)
        kvh = h // GROUP
        offs_d = tl.arange(0, D)
        q = tl.load(Q + b * stride_qb + h * stride_qh + offs_d).to(tl.float32) * scale
        k_base = K + slot * stride_ks + kvh * stride_kh
        v_base = V + slot * stride_vs + kvh * stride_vh
        s_off = slot * stride_ss + kvh * stride_sh  # fp8: the scales of this slot and head
        m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)
        l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), 0)
        acc = tl.zeros([D], tl.float32)
        start = sp * SPLIT
        end = tl.minimum(start + SPLIT, length)
        # A fixed trip count (the grid and the loop depend on shapes only); lanes past the
        # row's length are masked, so their memory is never read.
        for n in range(0, SPLIT, BLOCK_N):
            offs_n = start + n + tl.arange(0, BLOCK_N)
            valid = offs_n < end
            k_ptr = k_base + offs_n[:, None] * stride_kt + offs_d[None, :]
            k = tl.load(k_ptr, mask=valid[:, None], other=0.0)
            if BYTES:  # e4m3 bytes s eeee mmm as float16 bits s 0eeee mmm0000000: value / 2**8
                kb = k.to(tl.int16)
                kb = (((kb & 0x80) << 8) | ((kb & 0x7F) << 7)).to(tl.float16, bitcast=True)
                k = kb.to(tl.float32) * 256.0
            s = tl.sum(k.to(tl.float32) * q[None, :], 1)
            if SCALED:
                s = s * tl.load(KS + s_off + offs_n, mask=valid, other=0.0).to(tl.float32)
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing valid yet
            p = tl.exp(s - m_safe)
            alpha = tl.exp(m_i - m_safe)
            v_ptr = v_base + offs_n[:, None] * stride_vt + offs_d[None, :]
            v = tl.load(v_ptr, mask=valid[:, None], other=0.0)
            if BYTES:  # e4m3 bytes s eeee mmm as float16 bits s 0eeee mmm0000000: value / 2**8
                vb = v.to(tl.int16)
                vb = (((vb & 0x80) << 8) | ((vb & 0x7F) << 7)).to(tl.float16, bitcast=True)
                v = vb.to(tl.float32) * 256.0
            pv = p
            if SCALED:  # V's scales weigh the probabilities (the sum l_i takes p as it is)
                pv = p * tl.load(VS + s_off + offs_n, mask=valid, other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(pv[:, None] * v.to(tl.float32), 0)
            l_i = l_i * alpha + tl.sum(p, 0)
            m_i = m_new
        row = (b * tl.num_programs(1) + h) * NSPLIT + sp
        tl.store(Acc + row * D + offs_d, acc)
        tl.store(M + row, m_i)
        tl.store(L + row, l_i)

    @triton.jit  # type: ignore[misc,unused-ignore]
    def _combine_kernel(  # type: ignore[no-untyped-def]
        Acc, M, L, Out, NSPLIT: tl.constexpr, NSPLIT_P2: tl.constexpr, D: tl.constexpr
    ):
        bh = tl.program_id(0)
        offs_s = tl.arange(0, NSPLIT_P2)
        valid = offs_s < NSPLIT
        m = tl.load(M + bh * NSPLIT + offs_s, mask=valid, other=float("-inf"))
        lse = tl.load(L + bh * NSPLIT + offs_s, mask=valid, other=0.0)
        m_max = tl.max(m, 0)
        w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)
        offs_d = tl.arange(0, D)
        acc = tl.load(
            Acc + (bh * NSPLIT + offs_s[:, None]) * D + offs_d[None, :], mask=valid[:, None], other=0.0
        )
        out = tl.sum(acc * w[:, None], 0) / tl.sum(lse * w, 0)
        tl.store(Out + bh * D + offs_d, out.to(Out.dtype.element_ty))

    @triton.jit  # type: ignore[misc,unused-ignore]
    def _chunk_kernel(  # type: ignore[no-untyped-def]
        Q, K, V, KS, VS, Slot, Start, Out,
        qk_scale, T,
        stride_qt, stride_qh,
        stride_ks, stride_kh, stride_kt,
        stride_vs, stride_vh, stride_vt,
        stride_ss, stride_sh,
        stride_ot, stride_oh,
        GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        SCALED: tl.constexpr, BYTES: tl.constexpr, PACK: tl.constexpr,
    ):  # fmt: skip
        mb = tl.program_id(0)
        h = tl.program_id(1)
        if PACK:  # Slot, Start: one entry per PACK queries (chunks packed in one forward)
            slot = tl.load(Slot + mb * BLOCK_M // PACK).to(tl.int64)
            first = tl.load(Start + mb * BLOCK_M // PACK).to(tl.int32) + mb * BLOCK_M % PACK
        else:  # one chunk
            slot = tl.load(Slot).to(tl.int64)
            first = tl.load(Start).to(tl.int32) + mb * BLOCK_M
        kvh = h // GROUP
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        m_valid = offs_m < T
        q_ptr = Q + offs_m[:, None] * stride_qt + h * stride_qh + offs_d[None, :]
        q = tl.load(q_ptr, mask=m_valid[:, None], other=0.0)
        pos = first + tl.arange(0, BLOCK_M)  # each query's position in its slot
        k_base = K + slot * stride_ks + kvh * stride_kh
        v_base = V + slot * stride_vs + kvh * stride_vh
        s_off = slot * stride_ss + kvh * stride_sh  # fp8: the scales of this slot and head
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        # Keys up to the block's last query; blocks before ``lo`` are seen by every query of
        # the block (no mask). Trip counts depend on the block's first position (read on
        # the device), the grid on the shapes only: the kernel can be captured in a graph.
        lo = (first + 1) // BLOCK_N * BLOCK_N
        hi = first + tl.minimum(BLOCK_M, T - mb * BLOCK_M)
        for n0 in range(0, hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_valid = offs_n < hi
            k_ptr = k_base + offs_n[:, None] * stride_kt + offs_d[None, :]
            k = tl.load(k_ptr, mask=n_valid[:, None], other=0.0)
            if BYTES:  # e4m3 bytes s eeee mmm as float16 bits s 0eeee mmm0000000: value / 2**8
                kb = k.to(tl.int16)
                kb = (((kb & 0x80) << 8) | ((kb & 0x7F) << 7)).to(tl.float16, bitcast=True)
                k = kb.to(tl.float32) * 256.0
            k = k.to(q.dtype)  # fp8 in bf16: exact
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * qk_scale
            if SCALED:
                s = s * tl.load(KS + s_off + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
            if n0 >= lo:  # the blocks on the diagonal
                s = tl.where((offs_n[None, :] <= pos[:, None]) & n_valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a padding row: nothing yet
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            v_ptr = v_base + offs_n[:, None] * stride_vt + offs_d[None, :]
            v = tl.load(v_ptr, mask=n_valid[:, None], other=0.0)
            if BYTES:  # e4m3 bytes s eeee mmm as float16 bits s 0eeee mmm0000000: value / 2**8
                vb = v.to(tl.int16)
                vb = (((vb & 0x80) << 8) | ((vb & 0x7F) << 7)).to(tl.float16, bitcast=True)
                v = vb.to(tl.float32) * 256.0
            v = v.to(q.dtype)
            pv = p
            if SCALED:  # V's scales weigh the probabilities (the sum l_i takes p as it is)
                pv = p * tl.load(VS + s_off + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
            acc = acc * alpha[:, None] + tl.dot(pv.to(q.dtype), v).to(tl.float32)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptr = Out + offs_m[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=m_valid[:, None])

    @triton.jit  # type: ignore[misc,unused-ignore]
    def _store_kernel(  # type: ignore[no-untyped-def]
        Kn, Vn, Slots, Pos, K, V, KS, VS,
        stride_kn, stride_kh, stride_vn, stride_vh,
        stride_cs, stride_ch, stride_ct,
        stride_ss, stride_sh,
        D: tl.constexpr, D_P2: tl.constexpr, FP8_MAX: tl.constexpr,
    ):  # fmt: skip
        n = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(Slots + n).to(tl.int64)
        pos = tl.load(Pos + n).to(tl.int64)
        offs_d = tl.arange(0, D_P2)
        d_valid = offs_d < D
        cache = slot * stride_cs + h * stride_ch + pos * stride_ct + offs_d
        scale_at = slot * stride_ss + h * stride_sh + pos
        k = tl.load(Kn + n * stride_kn + h * stride_kh + offs_d, mask=d_valid, other=0.0).to(tl.float32)
        # the scale rounded to the pool's scale dtype first: the values divide by what is stored
        ks = (tl.maximum(tl.max(tl.abs(k), 0), 1e-30) / FP8_MAX).to(KS.dtype.element_ty)
        kq = tl.minimum(tl.maximum(k / ks.to(tl.float32), -FP8_MAX), FP8_MAX)
        tl.store(K + cache, kq.to(K.dtype.element_ty), mask=d_valid)
        tl.store(KS + scale_at, ks)
        v = tl.load(Vn + n * stride_vn + h * stride_vh + offs_d, mask=d_valid, other=0.0).to(tl.float32)
        vs = (tl.maximum(tl.max(tl.abs(v), 0), 1e-30) / FP8_MAX).to(VS.dtype.element_ty)
        vq = tl.minimum(tl.maximum(v / vs.to(tl.float32), -FP8_MAX), FP8_MAX)
        tl.store(V + cache, vq.to(V.dtype.element_ty), mask=d_valid)
        tl.store(VS + scale_at, vs)

    _TRITON.update(split=_split_kernel, combine=_combine_kernel, chunk=_chunk_kernel, store=_store_kernel)
    return _TRITON


def decode_attention(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    slots: Any,
    lengths: Any,
    *,
    scale: float,
    k_scale: Any = None,
    v_scale: Any = None,
) -> Any:
    """Attention of one new token per row over its slot: reads only ``lengths[b]`` tokens.

    Args:
        q: ``[B, heads, head_dim]`` queries (already rotated).
        k_cache, v_cache: one layer of the pool, ``[slots, kv_heads, slot_tokens, head_dim]``.
        slots: ``[B]`` slot of each row; lengths: ``[B]`` valid tokens (>= 1) of each row.
        scale: the softmax scale (``head_dim ** -0.5`` for Llama).
        k_scale, v_scale: an fp8 pool's bfloat16 scales ``[slots, kv_heads, slot_tokens]``
            (:func:`quantize_kv`); ``None`` for K/V in the model's dtype.

    On CUDA with Triton this is a split-K (flash-decoding) kernel whose grid depends only
    on the shapes, so it can be captured in a CUDA graph (fp8 K/V are converted in the
    kernel, scores and sums in float32); elsewhere plain SDPA (fp8 dequantized first).
    """
    kernels = _triton_kernels() if q.device.type == "cuda" or _interpreting() else None
    if kernels is None:
        length = k_cache.shape[2]
        if q.device.type != "cuda":  # no graph here: read only what the longest row needs
            length = min(length, (int(lengths.max()) + 63) // 64 * 64)
        return _attention_reference(q, k_cache, v_cache, slots, lengths, length, scale, k_scale, v_scale)
    import torch

    scaled = k_scale is not None
    ks, vs = (k_scale, v_scale) if scaled else (k_cache, v_cache)  # unread without scales
    if scaled and not native_fp8(q.device):  # the kernel decodes the bytes itself
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    batch, heads, dim = q.shape
    kv_heads, slot_tokens = k_cache.shape[1], k_cache.shape[2]
    nsplit = math.ceil(slot_tokens / ATTENTION_SPLIT_TOKENS)
    q = q.contiguous()
    acc = torch.empty((batch, heads, nsplit, dim), dtype=torch.float32, device=q.device)
    m = torch.empty((batch, heads, nsplit), dtype=torch.float32, device=q.device)
    lse = torch.empty((batch, heads, nsplit), dtype=torch.float32, device=q.device)
    out = torch.empty((batch, heads, dim), dtype=q.dtype, device=q.device)
    extra = {} if _interpreting() else {"num_warps": ATTENTION_WARPS}
    kernels["split"][(batch, heads, nsplit)](
        q, k_cache, v_cache, ks, vs, slots, lengths, acc, m, lse,
        scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        ks.stride(0), ks.stride(1),
        GROUP=heads // kv_heads, D=dim, BLOCK_N=min(ATTENTION_BLOCK_TOKENS, ATTENTION_SPLIT_TOKENS),
        SPLIT=ATTENTION_SPLIT_TOKENS, NSPLIT=nsplit, SCALED=scaled, BYTES=k_cache.dtype == torch.uint8,
        **extra,
    )  # fmt: skip
    kernels["combine"][(batch * heads,)](
        acc, m, lse, out, NSPLIT=nsplit, NSPLIT_P2=_next_power_of_2(nsplit), D=dim
    )
    return out


def _chunk_attention_reference(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    slot: Any,
    start: Any,
    scale: float,
    k_scale: Any = None,
    v_scale: Any = None,
    pack: int = 0,
) -> Any:
    """:func:`chunk_attention` in plain torch: each block's slot keys gathered (dequantized
    from fp8 with ``k_scale``, ``v_scale``), SDPA under a causal mask over the whole slot
    (static shapes)."""
    import torch
    import torch.nn.functional as F

    tokens, heads, dim = q.shape
    pack = pack or tokens
    index, first = slot.reshape(-1), start.reshape(-1)
    blocks, length = index.shape[0], k_cache.shape[2]
    kc = _gather(k_cache, k_scale, index, length, q.dtype)
    vc = _gather(v_cache, v_scale, index, length, q.dtype)
    group = heads // kc.shape[1]
    if group > 1:
        kc, vc = kc.repeat_interleave(group, dim=1), vc.repeat_interleave(group, dim=1)
    keys = torch.arange(length, device=q.device)
    positions = first[:, None] + torch.arange(pack, device=q.device)[None, :]
    mask = keys[None, None, :] <= positions[:, :, None]
    qb = F.pad(q, (0, 0, 0, 0, 0, blocks * pack - tokens)).reshape(blocks, pack, heads, dim)
    a = F.scaled_dot_product_attention(qb.transpose(1, 2), kc, vc, attn_mask=mask[:, None], scale=scale)
    return a.transpose(1, 2).reshape(blocks * pack, heads, dim)[:tokens]


def chunk_attention(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    slot: Any,
    start: Any,
    *,
    scale: float,
    k_scale: Any = None,
    v_scale: Any = None,
    pack: int = 0,
) -> Any:
    """Causal attention of prefill chunks over their slots, whose K/V already hold them.

    Args:
        q: ``[tokens, heads, head_dim]`` queries (rotated) at positions ``start ..
            start + tokens - 1`` of the slot.
        k_cache, v_cache: one layer of the pool, ``[slots, kv_heads, slot_tokens, head_dim]``.
        slot, start: the chunk's slot and first position, as one-element device tensors
            (so a captured graph replays for any slot and start); with ``pack``, one entry
            per ``pack`` queries (``[ceil(tokens / pack)]``): each such block of queries
            lies in one slot, at consecutive positions from its entry of ``start``, so the
            chunks of several turns run packed in one forward, each on whole blocks.
        scale: the softmax scale.
        k_scale, v_scale: an fp8 pool's scales, as :func:`decode_attention`'s.
        pack: queries per entry of ``slot`` and ``start`` (a power of two), or 0: one chunk.

    Returns:
        ``[tokens, heads, head_dim]``.

    On CUDA with Triton (or under Triton's interpreter) a flash-attention kernel reads the
    slot's keys in place, up to each query block's last position, with the launch settings
    of :data:`CHUNK_ATTENTION_CONFIGS` (packed: blocks of at most ``pack`` queries);
    elsewhere the keys are gathered and SDPA runs under a mask over the whole slot.
    """
    tokens, heads, dim = q.shape
    cfg = next((c for c in CHUNK_ATTENTION_CONFIGS if tokens <= c[0]), None)
    kernels = _triton_kernels() if q.device.type == "cuda" or _interpreting() else None
    if kernels is None or cfg is None or dim & (dim - 1) or dim < 16:
        return _chunk_attention_reference(q, k_cache, v_cache, slot, start, scale, k_scale, v_scale, pack)
    import torch

    scaled = k_scale is not None
    ks, vs = (k_scale, v_scale) if scaled else (k_cache, v_cache)  # unread without scales
    if scaled and not native_fp8(q.device):  # the kernel decodes the bytes itself
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _, block_m, block_n, warps, stages = cfg
    if pack:
        block_m = min(block_m, pack)
    kv_heads = k_cache.shape[1]
    out = torch.empty_like(q)
    extra = {} if _interpreting() else {"num_warps": warps, "num_stages": stages}
    kernels["chunk"][(math.ceil(tokens / block_m), heads)](
        q, k_cache, v_cache, ks, vs, slot, start, out,
        scale * 1.4426950408889634, tokens,  # exp2 in the kernel: log2(e)
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        ks.stride(0), ks.stride(1),
        out.stride(0), out.stride(1),
        GROUP=heads // kv_heads, D=dim, BLOCK_M=block_m, BLOCK_N=block_n, SCALED=scaled,
        BYTES=k_cache.dtype == torch.uint8, PACK=pack, **extra,
    )  # fmt: skip
    return out


def _next_power_of_2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"
