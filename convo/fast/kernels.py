"""Triton kernels of the fast path: the W4A16 matmul, split (flash-decoding) attention for
decode rows and causal (flash) attention of a prefill chunk over its slot, and the write of
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

import logging
import math
from collections.abc import Callable
from typing import Any

from convo.models.defaults import FP8_KV_SCALE_DTYPE

logger = logging.getLogger(__name__)

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


_W4: dict[str, Any] = {}

#: Candidate launch settings of the W4A16 kernel: ``(BLOCK_M, BLOCK_N, SPLIT_K, warps,
#: stages, BLOCK_K, TRANS, MAGIC, SWAP)`` (:func:`w4a16_settings`), or :data:`W4_DENSE`. Few
#: rows want many programs (split K: each program reads a slice of the input features, the
#: slices add up atomically in float32); more rows want taller tiles. ``TRANS``: the weight
#: tile is loaded ``[K, N]`` (no transpose before the product). ``MAGIC`` (0, 1, 2): how a
#: nibble becomes a float. 0: an integer conversion and float32 math; the conversion units
#: run at a quarter of the float rate, so at a few rows they, not the weight's bytes, bound
#: the kernel. 1: the nibble set into the low mantissa bits of 128 (bf16; 1024 for fp16,
#: 2^23 for float32) and the math done in the activations' dtype, two values an
#: instruction. 2: the same for bf16 written in PTX four bytes at a time, about 2 integer
#: instructions a byte where Triton's join and casts take ~9 (``benchmarks/w4_sass.py``
#: counts them); other dtypes run 1. The candidates hold each tile with 0 and with 2.
#: ``SWAP``: the product is taken as ``W @ x.T``, the dequantized tile the left operand. On
#: sm_90 that operand stays in registers (wgmma's A) and the product runs asynchronously
#: beside the next block's dequantization, where the tile as the right operand is written
#: to shared memory first and each block waits for its product; the rows become the
#: product's N (8 to 256), so a 16-row step wastes none of it. Each weight is rounded once
#: every way. Measured on an H100, the ``SWAP`` tiles lost to the others at 16 rows and to
#: the dense path at 272 and 528 (``benchmarks/w4_kernels.py``, 2026-12-07): they are not
#: the tuner's candidates (:data:`W4_SWAP_CONFIGS`; the benchmark's ``--sweep`` times them).
_W4_TILES: tuple[tuple[Any, ...], ...] = (
    *((16, bn, sk, w, 3) for bn, sk, w in ((32, 1, 4), (64, 1, 4), (128, 1, 4), (32, 2, 4), (64, 2, 4))),
    *((16, bn, sk, w, 3) for bn, sk, w in ((16, 4, 2), (32, 4, 4), (64, 4, 4), (128, 4, 4), (32, 8, 4))),
    (16, 64, 8, 4, 3),
    *((32, bn, sk, 4, 3) for bn, sk in ((64, 1), (128, 1), (64, 2), (32, 4))),
    *((64, bn, sk, 4, 3) for bn, sk in ((64, 1), (128, 1), (64, 2))),
)


def w4a16_settings(cfg: tuple[Any, ...]) -> tuple[Any, ...]:
    """A W4A16 launch setting as its nine fields ``(BLOCK_M, BLOCK_N, SPLIT_K, warps, stages,
    BLOCK_K, TRANS, MAGIC, SWAP)``: fields left off are ``BLOCK_K`` 128, not ``TRANS``,
    ``MAGIC`` 0, not ``SWAP``."""
    return (*cfg, *(128, False, 0, False)[len(cfg) - 5 :])


def _magic(cfgs: tuple[tuple[Any, ...], ...]) -> tuple[tuple[Any, ...], ...]:
    return tuple((*s[:7], 2, s[8]) for s in map(w4a16_settings, cfgs))


#: The ``SWAP`` tiles, short then tall (``MAGIC`` 2 only: they are not bound by the
#: conversions' rate); not timed by the op's tuner (see above).
W4_SWAP_CONFIGS: tuple[tuple[Any, ...], ...] = tuple(
    (bm, bn, sk, bn // 16, 3, bk, False, 2, True)
    for bm, bn, sk, bk in (
        (16, 64, 4, 128),
        (16, 64, 8, 128),
        (16, 128, 4, 128),
        (32, 64, 4, 128),
        (64, 64, 2, 128),
        *((bm, bn, sk, 64) for bm, bn, sk in ((64, 128, 1), (128, 128, 1), (256, 128, 1), (128, 64, 1))),
        *((bm, bn, sk, 64) for bm, bn, sk in ((256, 64, 1), (128, 128, 2))),
    )
)
#: Tiles loaded ``[K, N]`` with the float32 conversion (``MAGIC`` 0): the best swept settings
#: for some 16- and 32-row projections (H100, Llama-2-7B: fused q/k/v 27.8 us at 16 rows
#: against the tuner's 32.7, gate/up 49.8 against 56.0; ``w4_kernels.py --sweep``, 2026-12-07).
_W4_TRANS_TILES: tuple[tuple[Any, ...], ...] = tuple(
    (bm, bn, sk, 4, 3, bk, True)
    for bm, bn, sk, bk in (
        (16, 32, 1, 256),
        (16, 64, 1, 128),
        (16, 64, 4, 128),
        (32, 64, 1, 128),
        (32, 128, 8, 128),
    )
)
W4_CONFIGS: tuple[tuple[Any, ...], ...] = (*_W4_TILES, *_magic(_W4_TILES), *_W4_TRANS_TILES)
#: The product done by dequantizing the weight once (one kernel) and multiplying with
#: cuBLAS: a candidate beside the launch settings above for more than 64 rows.
W4_DENSE = ("dense",)
#: Candidate settings for steps of more than 64 rows (a mixed step, a prefill chunk): the
#: weight read once in int4 rather than written and read again in bf16.
_W4_LARGE_TILES: tuple[tuple[Any, ...], ...] = (
    *(
        (64, bn, 1, w, 3, 64, t)
        for bn, w, t in ((64, 4, False), (128, 4, False), (128, 8, False), (128, 4, True))
    ),
    *((128, bn, 1, 8, 3, 64, t) for bn, t in ((64, False), (128, False), (128, True))),
)
W4_LARGE_CONFIGS: tuple[tuple[Any, ...], ...] = (
    W4_DENSE,
    *_W4_LARGE_TILES,
    *_magic(_W4_LARGE_TILES),
)
#: Rows up to which the W4A16 op also times :data:`W4_CONFIGS`' 32- and 64-row tiles beside
#: :data:`W4_LARGE_CONFIGS` (16 decode rows and a chunk of up to 128 tokens).
W4_SHORT_LARGE_ROWS = 160
#: Relative error (of the norm) past which the W4A16 op's tuner drops a launch setting: each
#: is checked once, on random rows, against the dequantized weight's product.
W4_CHECK_TOLERANCE = 1e-2
#: Launches of each setting the W4A16 op's tuner times, and the device clock cycles it holds
#: the stream before them (~1 ms) so that they queue up and run back to back.
W4_TUNE_LAUNCHES = 10
W4_TUNE_HOLD_CYCLES = 2_000_000
_W4_BEST: dict[tuple[int, int, int, int], tuple[Any, ...]] = {}


def w4a16_candidates(rows: int) -> list[tuple[Any, ...]]:
    """The settings the W4A16 op times for a product of ``rows`` rows (its row bucket), the
    one it takes untimed first: :data:`W4_CONFIGS` whose row tile is no taller than needed
    up to 64 rows; above, :data:`W4_LARGE_CONFIGS`, and up to :data:`W4_SHORT_LARGE_ROWS`
    rows (a mixed step's 16 replies and a short chunk) :data:`W4_CONFIGS`' 32- and 64-row
    tiles too (a few row blocks: their split K still fills the device)."""
    if rows <= 64:
        return [c for c in W4_CONFIGS if c[0] <= max(16, rows)]
    short = [c for c in W4_CONFIGS if c[0] >= 32] if rows <= W4_SHORT_LARGE_ROWS else []
    return [*W4_LARGE_CONFIGS, *short]


def w4a16_row_bucket(rows: int) -> int:
    """The row count the W4A16 op tunes a product of ``rows`` rows for: a power of two up to
    64 rows, above a multiple of 32 (a mixed step's 272 rows are not a 512-token chunk)."""
    return -(-rows // 32) * 32 if rows > 64 else _next_power_of_2(rows)


def w4a16_tuned() -> dict[tuple[int, int, int, int], tuple[Any, ...]]:
    """The settings the W4A16 op's tuner has taken: ``(row bucket, out features, in
    features, device index) -> setting`` (``benchmarks/w4_kernels.py`` reports them)."""
    return dict(_W4_BEST)


def w4a16_with_config(x: Any, qweight: Any, scales_zeros: Any, config: tuple[Any, ...]) -> Any:
    """``x @ W.T`` for a plain int4 weight through the Triton kernel with the launch settings
    ``config`` (as :data:`W4_CONFIGS`' or :data:`W4_LARGE_CONFIGS`') rather than the tuned
    ones: tests check every setting (split K adds float32 partial sums atomically), and
    ``benchmarks/w4_kernels.py`` times them.

    Raises:
        RuntimeError: Triton is not installed.
    """
    if _w4_op() is None:
        raise RuntimeError("the W4A16 kernel needs Triton")
    return _W4["launch"](x, qweight, scales_zeros, config)


def _w4_op() -> Callable[..., Any] | None:
    """``convo::w4a16_mm``: the Triton kernel as a torch custom op (opaque to torch.compile),
    or ``None`` without Triton."""
    if "op" in _W4:
        return _W4["op"]  # type: ignore[no-any-return,unused-ignore]
    try:
        import torch
        import triton
        import triton.language as tl
    except ImportError:
        _W4["op"] = None
        return None

    # One compile whatever the rows (a mixed step's 272, an eager chunk's 300, ...).
    @triton.jit(do_not_specialize=["M"])  # type: ignore[misc,unused-ignore]
    def _kernel(  # type: ignore[no-untyped-def]
        X, W, SZ, Y, M, N, K,
        stride_xm, stride_wn, stride_szn, stride_ym,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr, TRANS: tl.constexpr, MAGIC: tl.constexpr, SWAP: tl.constexpr,
    ):  # fmt: skip
        # Programs run along M first: those of one weight tile run together, so it is
        # read from memory once however many row blocks there are.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        offs_kh = tl.arange(0, BLOCK_K // 2)
        offs_g = tl.arange(0, BLOCK_K // GROUP)
        m_mask = offs_m < M
        n_mask = offs_n < N
        if SWAP:  # (W @ x.T: the tile's product with the rows, transposed at the end)
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        # Program pid_k takes every SPLIT_K-th block of BLOCK_K input features. Each weight
        # is one multiply-add: (q - 8) * scale + zero, or q * scale + (zero - 8 * scale).
        for kb in range(pid_k, K // BLOCK_K, SPLIT_K):
            k0 = kb * BLOCK_K
            x_ptr = X + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :]
            x = tl.load(x_ptr, mask=m_mask[:, None], other=0.0)
            if TRANS:  # the tile as [K, N]: the nibbles interleave along K
                sz_ptr = SZ + offs_n[None, :] * stride_szn + (k0 // GROUP + offs_g)[:, None] * 2
                sz_mask = n_mask[None, :]
                w_ptr = W + offs_n[None, :] * stride_wn + (k0 // 2 + offs_kh)[:, None]
                b = tl.load(w_ptr, mask=n_mask[None, :], other=0)
            else:
                sz_ptr = SZ + offs_n[:, None] * stride_szn + (k0 // GROUP + offs_g)[None, :] * 2
                sz_mask = n_mask[:, None]
                w_ptr = W + offs_n[:, None] * stride_wn + (k0 // 2 + offs_kh)[None, :]
                b = tl.load(w_ptr, mask=n_mask[:, None], other=0)
            scale = tl.load(sz_ptr, mask=sz_mask, other=0.0)
            zero = tl.load(sz_ptr + 1, mask=sz_mask, other=0.0)
            if MAGIC == 2 and X.dtype.element_ty == tl.bfloat16:
                # In PTX, four bytes at a time: the low and the high nibbles of two bytes
                # masked into the mantissas of a bf16 pair of 128s, 136 taken off, then
                # scaled (about 2 integer instructions a byte, against ~9 in MAGIC 1).
                sb = scale.to(tl.bfloat16)
                zb = zero.to(tl.bfloat16)
                if TRANS:  # each group's scale and zero beside each of its bytes
                    shape: tl.constexpr = (BLOCK_K // GROUP, GROUP // 2, BLOCK_N)
                    s = tl.broadcast_to(sb[:, None, :], shape).reshape(BLOCK_K // 2, BLOCK_N)
                    z = tl.broadcast_to(zb[:, None, :], shape).reshape(BLOCK_K // 2, BLOCK_N)
                else:
                    shape: tl.constexpr = (BLOCK_N, BLOCK_K // GROUP, GROUP // 2)
                    s = tl.broadcast_to(sb[:, :, None], shape).reshape(BLOCK_N, BLOCK_K // 2)
                    z = tl.broadcast_to(zb[:, :, None], shape).reshape(BLOCK_N, BLOCK_K // 2)
                lo, hi = tl.inline_asm_elementwise(
                    """{
                    .reg .b32 x, y, m, c, e, one;
                    mov.b32 m, 0x000F000F;
                    mov.b32 c, 0x43004300;
                    mov.b32 e, 0xC308C308;
                    mov.b32 one, 0x3F803F80;
                    prmt.b32 x, $4, 0, 0x4140;
                    lop3.b32 $0, x, m, c, 0xEA;
                    shr.b32 y, x, 4;
                    lop3.b32 $2, y, m, c, 0xEA;
                    prmt.b32 x, $4, 0, 0x4342;
                    lop3.b32 $1, x, m, c, 0xEA;
                    shr.b32 y, x, 4;
                    lop3.b32 $3, y, m, c, 0xEA;
                    fma.rn.bf16x2 $0, $0, one, e;
                    fma.rn.bf16x2 $1, $1, one, e;
                    fma.rn.bf16x2 $2, $2, one, e;
                    fma.rn.bf16x2 $3, $3, one, e;
                    fma.rn.bf16x2 $0, $0, $5, $7;
                    fma.rn.bf16x2 $1, $1, $6, $8;
                    fma.rn.bf16x2 $2, $2, $5, $7;
                    fma.rn.bf16x2 $3, $3, $6, $8;
                    }""",
                    "=r,=r,=r,=r,r,r,r,r,r",
                    [b, s, z],
                    dtype=(tl.bfloat16, tl.bfloat16),
                    is_pure=True,
                    pack=4,
                )
                if TRANS:
                    w = tl.permute(tl.join(lo, hi), (0, 2, 1)).reshape(BLOCK_K, BLOCK_N)
                else:
                    w = tl.join(lo, hi).reshape(BLOCK_N, BLOCK_K)
            else:
                if TRANS:
                    j = tl.permute(tl.join(b & 0xF, b >> 4), (0, 2, 1))
                else:
                    j = tl.join(b & 0xF, b >> 4)
                if MAGIC:  # q - 8 exactly in x's dtype: q in the low mantissa bits of 128, 1024 or 2^23
                    if X.dtype.element_ty == tl.bfloat16:
                        q = (j.to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True) - 136.0
                    elif X.dtype.element_ty == tl.float16:
                        q = (j.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
                    else:
                        q = (j.to(tl.uint32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
                    scale = scale.to(X.dtype.element_ty)
                    zero = zero.to(X.dtype.element_ty)
                else:  # in float32, converted
                    q = j.to(tl.float32)
                    scale = scale.to(tl.float32)
                    zero = zero.to(tl.float32) - 8.0 * scale
                if TRANS:
                    q = q.reshape(BLOCK_K // GROUP, GROUP, BLOCK_N)
                    w = tl.fma(q, scale[:, None, :], zero[:, None, :]).reshape(BLOCK_K, BLOCK_N).to(x.dtype)
                else:
                    q = q.reshape(BLOCK_N, BLOCK_K // GROUP, GROUP)
                    w = tl.fma(q, scale[:, :, None], zero[:, :, None]).reshape(BLOCK_N, BLOCK_K).to(x.dtype)
            if TRANS:
                acc += tl.dot(x, w)
            elif SWAP:
                acc += tl.dot(w, tl.trans(x))
            else:
                acc += tl.dot(x, tl.trans(w))
        if SWAP:
            acc = tl.trans(acc)
        y_ptr = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
        y_mask = m_mask[:, None] & n_mask[None, :]
        if SPLIT_K == 1:
            tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=y_mask)
        else:  # Y is a zeroed float32 buffer
            tl.atomic_add(y_ptr, acc, mask=y_mask)

    def launch(
        x: torch.Tensor, qweight: torch.Tensor, sz: torch.Tensor, cfg: tuple[Any, ...]
    ) -> torch.Tensor:
        if cfg == W4_DENSE:
            return torch.nn.functional.linear(x, dequantize_plain_int4(qweight, sz).to(x.dtype))
        m, k = x.shape
        n = qweight.shape[0]
        group = k // sz.shape[1]
        bm, bn, split, warps, stages, block_k, trans, magic, swap = w4a16_settings(cfg)
        if k % block_k or block_k % group:
            block_k = 128 if k % 128 == 0 and 128 % group == 0 else group
        split = min(split, k // block_k)
        if split == 1:
            y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        else:
            y = torch.zeros((m, n), dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
        extra = {} if _interpreting() else {"num_warps": warps, "num_stages": stages}
        _kernel[grid](
            x, qweight, sz, y, m, n, k,
            x.stride(0), qweight.stride(0), sz.stride(0), y.stride(0),
            GROUP=group, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=block_k, SPLIT_K=split, TRANS=trans, MAGIC=magic,
            SWAP=swap and not trans, **extra,
        )  # fmt: skip
        return y if split == 1 else y.to(x.dtype)

    def best(x: torch.Tensor, qweight: torch.Tensor, sz: torch.Tensor) -> tuple[Any, ...]:
        """The fastest launch settings for this shape and row bucket (a power of two up to 64
        rows; above, a multiple of 32: the best of the tall tiles and the dense path turns
        on the rows, and a mixed step's 272 is not a 512-token chunk), timed on the device
        at the first call (the decoder's warm-up runs, before any graph is captured)."""
        rows = w4a16_row_bucket(x.shape[0])
        key = (rows, qweight.shape[0], x.shape[1], x.device.index or 0)
        if key in _W4_BEST:
            return _W4_BEST[key]
        candidates = w4a16_candidates(rows)
        if _interpreting() or x.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return candidates[0]
        # A setting the compiler refuses, or whose product is off, is never taken.
        gen = torch.Generator(device=x.device).manual_seed(0)  # (the global RNG stays the sampler's)
        xr = torch.randn(x.shape, generator=gen, device=x.device, dtype=x.dtype)
        ref = torch.nn.functional.linear(xr, dequantize_plain_int4(qweight, sz).to(x.dtype)).float()
        tolerance = W4_CHECK_TOLERANCE * float(ref.norm())
        hold = getattr(torch.cuda, "_sleep", None)
        timings = []
        for cfg in candidates:
            try:
                off = float((launch(xr, qweight, sz, cfg).float() - ref).norm()) > tolerance
            except Exception as exc:  # a setting this device's compiler refuses
                logger.debug("W4A16 setting %s refused: %s", cfg, exc)
                continue
            if off:
                logger.warning("W4A16 setting %s is off on this device; not taken", cfg)
                continue
            for _ in range(2):
                launch(x, qweight, sz, cfg)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            # The device waits while the launches queue up, so they run back to back as in a
            # CUDA graph: timed one after another from Python, a 15-60 us product measures
            # the launch's overhead (and a split K's three launches), not the kernel.
            if hold is not None:
                hold(W4_TUNE_HOLD_CYCLES)
            start.record()
            for _ in range(W4_TUNE_LAUNCHES):
                launch(x, qweight, sz, cfg)
            end.record()
            end.synchronize()
            timings.append((start.elapsed_time(end), cfg))
        _W4_BEST[key] = min(timings, key=lambda t: t[0])[1] if timings else W4_DENSE  # (ties: no cfg <)
        return _W4_BEST[key]

    @torch.library.custom_op(  # type: ignore[misc,unused-ignore]
        "convo::w4a16_mm", mutates_args=(), schema="(Tensor x, Tensor qweight, Tensor sz) -> Tensor"
    )
    def w4a16_mm(x: torch.Tensor, qweight: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        return launch(x, qweight, sz, best(x, qweight, sz))

    @w4a16_mm.register_fake  # type: ignore[misc,unused-ignore]
    def _(x: torch.Tensor, qweight: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], qweight.shape[0]))

    _W4.update(op=w4a16_mm, launch=launch, kernel=_kernel)
    return w4a16_mm


_DQ: dict[str, Any] = {}


def dequantize_plain_int4(qweight: Any, sz: Any, out: Any = None) -> Any:
    """The dense ``[out, in]`` weight of a plain int4 layout (``Int4Linear`` layout ``"plain"``)
    in the dtype of ``sz``, in one pass: a Triton kernel on CUDA (or under Triton's
    interpreter), plain torch elsewhere. ``out``: a buffer of that shape and dtype to fill.

    Prefill calls this once per layer weight and forward, then multiplies with cuBLAS:
    reading 4 bits and writing 16 per weight costs a few milliseconds for a 7B model, far
    less than the matrix products of a long chunk.
    """
    import torch

    n, half = qweight.shape
    k = 2 * half
    groups = sz.shape[1]
    group = k // groups
    kernel = _dequant_kernel() if qweight.device.type == "cuda" or _interpreting() else None
    if kernel is None:
        q = torch.stack([qweight & 0xF, qweight >> 4], dim=-1).reshape(n, groups, group)
        w = ((q.to(sz.dtype) - 8) * sz[:, :, 0:1] + sz[:, :, 1:2]).reshape(n, k)
        return w if out is None else out.copy_(w)
    if out is None:
        out = torch.empty((n, k), dtype=sz.dtype, device=qweight.device)
    block_k = 128 if k % 128 == 0 and 128 % group == 0 else group
    block_n = 32
    kernel[(_cdiv(n, block_n), k // block_k)](
        qweight, sz, out, n, qweight.stride(0), sz.stride(0), out.stride(0),
        GROUP=group, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _dequant_kernel() -> Any:
    if "kernel" in _DQ:
        return _DQ["kernel"]
    try:
        import triton
        import triton.language as tl
    except ImportError:
        _DQ["kernel"] = None
        return None

    @triton.jit  # type: ignore[misc,unused-ignore]
    def _kernel(  # type: ignore[no-untyped-def]
        W, SZ, OUT, N, stride_wn, stride_szn, stride_on,
        GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_kh = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        offs_g = pid_k * (BLOCK_K // GROUP) + tl.arange(0, BLOCK_K // GROUP)
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        b = tl.load(W + offs_n[:, None] * stride_wn + offs_kh[None, :], mask=n_mask[:, None], other=0)
        q = tl.join((b & 0xF).to(tl.float32), (b >> 4).to(tl.float32)).reshape(BLOCK_N, BLOCK_K)
        sz_ptr = SZ + offs_n[:, None] * stride_szn + offs_g[None, :] * 2
        scale = tl.load(sz_ptr, mask=n_mask[:, None], other=0.0).to(tl.float32)
        zero = tl.load(sz_ptr + 1, mask=n_mask[:, None], other=0.0).to(tl.float32)
        q3 = q.reshape(BLOCK_N, BLOCK_K // GROUP, GROUP)
        w = ((q3 - 8.0) * scale[:, :, None] + zero[:, :, None]).reshape(BLOCK_N, BLOCK_K)
        out_ptr = OUT + offs_n[:, None] * stride_on + offs_k[None, :]
        tl.store(out_ptr, w.to(OUT.dtype.element_ty), mask=n_mask[:, None])

    _DQ["kernel"] = _kernel
    return _kernel


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
        SCALED: tl.constexpr, BYTES: tl.constexpr,
    ):  # fmt: skip
        mb = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(Slot).to(tl.int64)
        start = tl.load(Start).to(tl.int32)
        kvh = h // GROUP
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        m_valid = offs_m < T
        q_ptr = Q + offs_m[:, None] * stride_qt + h * stride_qh + offs_d[None, :]
        q = tl.load(q_ptr, mask=m_valid[:, None], other=0.0)
        pos = start + offs_m  # each query's position in the slot
        k_base = K + slot * stride_ks + kvh * stride_kh
        v_base = V + slot * stride_vs + kvh * stride_vh
        s_off = slot * stride_ss + kvh * stride_sh  # fp8: the scales of this slot and head
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        # Keys up to the block's last query; blocks before ``lo`` are seen by every query of
        # the block (no mask). Trip counts depend on the chunk's start (read on the
        # device), the grid on the shapes only: the kernel can be captured in a graph.
        lo = (start + mb * BLOCK_M + 1) // BLOCK_N * BLOCK_N
        hi = start + tl.minimum(mb * BLOCK_M + BLOCK_M, T)
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
) -> Any:
    """:func:`chunk_attention` in plain torch: the slot's keys gathered (dequantized from
    fp8 with ``k_scale``, ``v_scale``), SDPA under a causal mask over the whole slot
    (static shapes)."""
    import torch
    import torch.nn.functional as F

    tokens, heads = q.shape[0], q.shape[1]
    length, index = k_cache.shape[2], slot.reshape(1)
    kc = _gather(k_cache, k_scale, index, length, q.dtype)
    vc = _gather(v_cache, v_scale, index, length, q.dtype)
    group = heads // kc.shape[1]
    if group > 1:
        kc, vc = kc.repeat_interleave(group, dim=1), vc.repeat_interleave(group, dim=1)
    keys = torch.arange(k_cache.shape[2], device=q.device)
    mask = keys[None, :] <= (start + torch.arange(tokens, device=q.device))[:, None]
    qt = q.transpose(0, 1)[None]
    a = F.scaled_dot_product_attention(qt, kc, vc, attn_mask=mask[None, None], scale=scale)
    return a[0].transpose(0, 1)


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
) -> Any:
    """Causal attention of a prefill chunk over its slot, whose K/V already hold the chunk.

    Args:
        q: ``[tokens, heads, head_dim]`` queries (rotated) at positions ``start ..
            start + tokens - 1`` of the slot.
        k_cache, v_cache: one layer of the pool, ``[slots, kv_heads, slot_tokens, head_dim]``.
        slot, start: the chunk's slot and first position, as one-element device tensors
            (so a captured graph replays for any slot and start).
        scale: the softmax scale.
        k_scale, v_scale: an fp8 pool's scales, as :func:`decode_attention`'s.

    Returns:
        ``[tokens, heads, head_dim]``.

    On CUDA with Triton (or under Triton's interpreter) a flash-attention kernel reads the
    slot's keys in place, up to each query block's last position, with the launch settings
    of :data:`CHUNK_ATTENTION_CONFIGS`; elsewhere the keys are gathered and SDPA runs under
    a mask over the whole slot.
    """
    tokens, heads, dim = q.shape
    cfg = next((c for c in CHUNK_ATTENTION_CONFIGS if tokens <= c[0]), None)
    kernels = _triton_kernels() if q.device.type == "cuda" or _interpreting() else None
    if kernels is None or cfg is None or dim & (dim - 1) or dim < 16:
        return _chunk_attention_reference(q, k_cache, v_cache, slot, start, scale, k_scale, v_scale)
    import torch

    scaled = k_scale is not None
    ks, vs = (k_scale, v_scale) if scaled else (k_cache, v_cache)  # unread without scales
    if scaled and not native_fp8(q.device):  # the kernel decodes the bytes itself
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _, block_m, block_n, warps, stages = cfg
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
        BYTES=k_cache.dtype == torch.uint8, **extra,
    )  # fmt: skip
    return out


def _next_power_of_2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"
