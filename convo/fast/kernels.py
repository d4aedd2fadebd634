"""Triton kernels of the fast path: the W4A16 matmul and the dequantization of a plain int4
weight. The attention kernels and the fp8 K/V write are in :mod:`convo.fast.attention`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from convo.fast.attention import _interpreting, _next_power_of_2

logger = logging.getLogger(__name__)

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
#: weight read once in int4 rather than written and read again in bf16. Measured on an
#: H100 (``w4_kernels.py --rows 272,256 --sweep --min-block-m 256``, 2026-12-07): tiles 256
#: rows tall beat the dense path at exactly 256 rows (q/k/v 76 us against 98, gate/up 146
#: against 174; 32 layers 11.6 ms against 13.0), but a mixed step has 272 (16 replies
#: beside a 256-token chunk), where no tall tile did, not even one that also takes the 16
#: rows after it with the same dequantized tile (18.0 ms against 13.3; not kept). Cutting
#: the chunk to 240 tokens to make 256 rows would save ~1.7 ms a step for 6 % fewer
#: prompt tokens in it: about even, not done.
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
