"""Fast bounded decode: static KV slots, a captured decode step, sessions decoded together.

convo bounds every session's context, so the largest KV cache a session can need is known
before it starts. This module turns that into exact memory and speed:

* :class:`KVSlotPool` takes the KV memory once, at start: per layer one K and one V tensor
  of shape ``[slots, kv_heads, slot_tokens, head_dim]`` in the model's dtype. A session
  holds a slot while it generates; between turns the slot keeps its tokens, so the next
  turn prefills only what changed (the prefix reuse of the engine, inside the slot)::

      K[layer]   slot 0 | session a: 0 ........ 731 |                       free |
                 slot 1 | session b: 0 ............................ 2047 | free |
                 slot 2 | (idle: keeps session c's tokens until it is needed)   |

* :class:`StaticDecoder` runs a Llama-family model (Llama, Mistral without a sliding window,
  Qwen2, SmolLM2) on that pool with its own forward: prefill is eager and chunked, the
  decode step has static shapes (a batch bucket of 1, 2, 4, ... rows over fixed-size
  slots; per-row positions are data, not shapes), each layer's pointwise work is fused by
  ``torch.compile`` on CUDA, and the whole step is captured once per bucket as a CUDA
  graph, so a token costs one graph replay. Turns of any length reuse the same graphs.
* :class:`Int4Weight` is the fast 4-bit weight format: group-wise asymmetric int4 in
  the tile-packed layout of PyTorch's tinygemm kernels (``aten._weight_int4pack_mm``; the
  layout torchao calls ``tile_packed_to_4d``), which run inside the captured step.
* :class:`DecodeScheduler` is the loop that decodes every generating session together,
  one row per slot, with per-row sampling and stopping.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from convo.errors import ConfigError, DeviceOutOfMemory

#: Model types whose decoder layers :class:`StaticDecoder` knows how to run.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})

#: Tokens one program of the split decode-attention kernel reads (a power of two).
ATTENTION_SPLIT_TOKENS = 128


# -- int4 weights ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Int4Weight:
    """A linear weight in group-wise asymmetric int4, tile-packed for tinygemm kernels.

    ``w ~= (q - 8) * scale + zero`` per group of ``group_size`` input features, with
    ``q`` in 0..15; ``scales_zeros`` is ``[in / group_size, out, 2]`` in the compute dtype.
    On CUDA the product runs through ``aten._weight_int4pack_mm`` (bf16 activations), on
    CPU through ``aten._weight_int4pack_mm_for_cpu``.
    """

    packed: Any
    scales_zeros: Any
    group_size: int
    in_features: int
    out_features: int
    bias: Any = None
    plain: tuple[Any, Any] | None = None  # (qweight, scales_zeros) of plain_int4, when asked

    @property
    def nbytes(self) -> int:
        """Bytes the weight occupies (packed ints + scales and zeros + bias)."""
        total = self.packed.numel() * self.packed.element_size()
        total += self.scales_zeros.numel() * self.scales_zeros.element_size()
        if self.bias is not None:
            total += self.bias.numel() * self.bias.element_size()
        return int(total)


def int4_group_size(in_features: int, preferred: int = 128) -> int | None:
    """The largest group size <= ``preferred`` (128, 64 or 32) the kernels accept for
    ``in_features``, or ``None`` when none does (the weight then stays dense)."""
    for gs in (128, 64, 32):
        if gs <= preferred and in_features % gs == 0 and in_features % 32 == 0:
            return gs
    return None


def _inner_k_tiles(in_features: int) -> int:
    for tiles in (8, 4, 2):
        if in_features % (tiles * 16) == 0:
            return tiles
    raise ConfigError(f"in_features={in_features} is not a multiple of 32")


def quantize_int4(
    weight: Any, *, group_size: int = 128, bias: Any = None, dtype: Any = None, plain: bool = False
) -> Int4Weight:
    """Quantize a dense ``[out, in]`` weight to :class:`Int4Weight` on its device.

    Args:
        weight: the dense weight (any float dtype).
        group_size: input features per scale/zero pair (128, 64 or 32).
        bias: an optional bias, kept in ``dtype``.
        dtype: compute dtype of scales, zeros and activations. Default: bf16 on CUDA,
            the weight's dtype on CPU.
        plain: also keep the same grid in the plain layout (:func:`plain_int4`).

    Raises:
        ConfigError: the shape does not suit the kernels (``int4_group_size`` says which do).
    """
    import torch

    out_features, in_features = (int(s) for s in weight.shape)
    if group_size not in (32, 64, 128) or in_features % group_size:
        raise ConfigError(f"group_size={group_size} does not divide in_features={in_features}")
    cuda = weight.device.type == "cuda"
    if dtype is None:
        dtype = torch.bfloat16 if cuda else weight.dtype
    w = weight.detach().to(torch.float32).reshape(-1, group_size)
    w_max = w.amax(dim=1, keepdim=True)
    w_min = w.amin(dim=1, keepdim=True)
    scales = (w_max - w_min).clamp(min=1e-6) / 15
    zeros = w_min + scales * 8
    q = w.sub(w_min).div(scales).round().clamp(0, 15).to(torch.int32).reshape(out_features, in_features)
    scales_zeros = (
        torch.cat([scales.reshape(out_features, -1, 1), zeros.reshape(out_features, -1, 1)], dim=2)
        .transpose(0, 1)
        .contiguous()
        .to(dtype)
    )
    tiles = _inner_k_tiles(in_features)
    if cuda:
        packed_bytes = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
        packed = torch.ops.aten._convert_weight_to_int4pack(packed_bytes, tiles)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, tiles)
    simple = None
    if plain:
        qweight, sz = plain_int4(
            q=q, scales=scales.reshape(out_features, -1), zeros=zeros.reshape(out_features, -1)
        )
        simple = (qweight, sz.to(dtype))
    return Int4Weight(
        packed=packed,
        scales_zeros=scales_zeros,
        group_size=group_size,
        in_features=in_features,
        out_features=out_features,
        bias=None if bias is None else bias.detach().to(dtype),
        plain=simple,
    )


def dequantize_int4(w: Int4Weight) -> Any:
    """The dense ``[out, in]`` float32 weight an :class:`Int4Weight` stands for (tests)."""
    import torch

    eye = torch.eye(w.in_features, dtype=w.scales_zeros.dtype, device=w.packed.device)
    return _int4_mm(eye, w.packed, w.scales_zeros).t().float()


def _int4_mm(x: Any, packed: Any, scales_zeros: Any) -> Any:
    import torch

    k = x.shape[-1]
    group_size = k // scales_zeros.shape[0]
    x2 = x.reshape(-1, k)
    if x.device.type == "cuda":
        y = torch.ops.aten._weight_int4pack_mm(x2, packed, group_size, scales_zeros)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, group_size, scales_zeros)
    return y.reshape(*x.shape[:-1], y.shape[-1])


# A linear is a tuple of tensors, so that one compiled layer function serves every layer:
#   dense: (weight,) or (weight, bias)    int4: (packed, scales_zeros) or (..., bias)
# or a module (bitsandbytes Linear4bit...), called as it is.
Linear = tuple[Any, ...] | Any


def _linear(x: Any, w: Linear) -> Any:
    import torch.nn.functional as F

    if not isinstance(w, tuple):
        return w(x)
    if isinstance(w[0], str):  # ("w4", plain int4, scales/zeros[, bias]): see plain_int4
        y = _plain_int4_mm(x, w[1], w[2])
        return y + w[3] if len(w) > 3 else y
    if w[0].dtype.is_floating_point:
        return F.linear(x, w[0], w[1] if len(w) > 1 else None)
    y = _int4_mm(x, w[0], w[1])
    return y + w[2] if len(w) > 2 else y


# -- plain int4 for a Triton kernel ---------------------------------------------------------------
#
# tinygemm's int4 kernel is fast for one row and slows down with more (measured on the H200:
# 2.3x from 1 to 16 rows, slower than bf16 cuBLAS at 16). The plain layout below is read by
# a small Triton kernel whose cost barely depends on the rows (up to 16: one MMA tile), and
# dequantized in torch for prefill, where cuBLAS on bf16 beats any int4 kernel. Same grid as
# Int4Weight: w = (q - 8) * scale + zero.

#: Rows up to which the plain int4 layout runs through the Triton kernel (one MMA tile).
W4_KERNEL_MAX_ROWS = 16


def plain_int4(*, q: Any, scales: Any, zeros: Any) -> tuple[Any, Any]:
    """``(qweight, scales_zeros)``: ``uint8 [out, in / 2]`` (low nibble = even input) and
    ``[out, in / group, 2]`` scale/zero pairs, from the integer grid ``q`` ``[out, in]``."""
    import torch

    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8).contiguous()
    sz = torch.stack([scales, zeros], dim=-1).contiguous()
    return packed, sz


def _plain_int4_dequant(qweight: Any, sz: Any) -> Any:
    import torch

    n, half = qweight.shape
    groups = sz.shape[1]
    q = torch.stack([qweight & 0xF, qweight >> 4], dim=-1).reshape(n, groups, (2 * half) // groups)
    return ((q.to(sz.dtype) - 8) * sz[:, :, 0:1] + sz[:, :, 1:2]).reshape(n, 2 * half)


def _plain_int4_mm(x: Any, qweight: Any, sz: Any) -> Any:
    import torch.nn.functional as F

    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] <= W4_KERNEL_MAX_ROWS and _w4_op() is not None:
        y = _w4_op()(x2, qweight, sz)  # type: ignore[misc]
    else:
        y = F.linear(x2, _plain_int4_dequant(qweight, sz).to(x.dtype))
    return y.reshape(*x.shape[:-1], y.shape[-1])


_W4: dict[str, Any] = {}


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

    @triton.jit  # type: ignore[misc,unused-ignore]
    def _kernel(  # type: ignore[no-untyped-def]
        X, W, SZ, Y, M, N, M_KEY,
        stride_xm, stride_wn, stride_szn, stride_ym,
        K: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        offs_kh = tl.arange(0, BLOCK_K // 2)
        offs_g = tl.arange(0, BLOCK_K // GROUP)
        m_mask = offs_m < M
        n_mask = offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x_ptr = X + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :]
            x = tl.load(x_ptr, mask=m_mask[:, None], other=0.0)
            w_ptr = W + offs_n[:, None] * stride_wn + (k0 // 2 + offs_kh)[None, :]
            b = tl.load(w_ptr, mask=n_mask[:, None], other=0)
            q = tl.join((b & 0xF).to(tl.float32), (b >> 4).to(tl.float32))
            q = q.reshape(BLOCK_N, BLOCK_K)
            sz_ptr = SZ + offs_n[:, None] * stride_szn + (k0 // GROUP + offs_g)[None, :] * 2
            scale = tl.load(sz_ptr, mask=n_mask[:, None], other=0.0).to(tl.float32)
            zero = tl.load(sz_ptr + 1, mask=n_mask[:, None], other=0.0).to(tl.float32)
            q3 = q.reshape(BLOCK_N, BLOCK_K // GROUP, GROUP)
            w = ((q3 - 8.0) * scale[:, :, None] + zero[:, :, None]).reshape(BLOCK_N, BLOCK_K)
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        y_ptr = Y + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    # Tile width, warps and pipeline depth are tuned per shape and row count on the device,
    # at the first call (the decoder's warm-up, before any graph is captured).
    tuned = None
    if not _interpreting():
        configs = [
            triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st)
            for bn, w, st in ((16, 2, 3), (32, 4, 3), (32, 2, 4), (64, 4, 3), (64, 4, 4), (128, 4, 3))
        ]
        # Keyed on the rows rounded up to a power of two (the decode buckets), so a short
        # prefill chunk reuses a tuned entry instead of tuning during a request.
        tuned = triton.autotune(configs=configs, key=["M_KEY", "N", "K"])(_kernel)

    @torch.library.custom_op(  # type: ignore[misc,unused-ignore]
        "convo::w4a16_mm", mutates_args=(), schema="(Tensor x, Tensor qweight, Tensor sz) -> Tensor"
    )
    def w4a16_mm(x: torch.Tensor, qweight: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        n = qweight.shape[0]
        group = k // sz.shape[1]
        block_k = 128 if k % 128 == 0 and 128 % group == 0 else group
        x = x.contiguous()
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)

        def grid(meta: dict[str, Any]) -> tuple[int, int]:
            return (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, 16))

        fixed = {} if tuned is not None else {"BLOCK_N": 32}  # the interpreter: no tuning
        (tuned or _kernel)[grid](
            x, qweight, sz, y, m, n, _next_power_of_2(m),
            x.stride(0), qweight.stride(0), sz.stride(0), y.stride(0),
            K=k, GROUP=group, BLOCK_M=16, BLOCK_K=block_k, **fixed,
        )  # fmt: skip
        return y

    @w4a16_mm.register_fake  # type: ignore[misc,unused-ignore]
    def _(x: torch.Tensor, qweight: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], qweight.shape[0]))

    _W4["op"] = w4a16_mm
    return w4a16_mm


def _linears(x: Any, ws: tuple[Linear, ...]) -> Any:
    import torch

    if len(ws) == 1:
        return _linear(x, ws[0])
    return torch.cat([_linear(x, w) for w in ws], dim=-1)


def _rms_norm(x: Any, weight: Any, eps: float) -> Any:
    import torch

    # Exactly transformers' LlamaRMSNorm: float32 statistics, then back to the input dtype.
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rope(x: Any, cos: Any, sin: Any) -> Any:
    import torch

    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# -- the slot pool --------------------------------------------------------------------------------


@dataclass
class _Slot:
    owner: str | None = None  # the cache key (session) whose tokens the slot holds
    tokens: list[int] = field(default_factory=list)  # tokens whose K/V are in the slot
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)


class KVSlotPool:
    """Preallocated KV memory: ``slots`` caches of ``slot_tokens`` tokens each.

    Per layer ``k[layer]`` and ``v[layer]`` are ``[slots, kv_heads, slot_tokens, head_dim]``.
    The pool answers who may use which slot; the scheduler decides when to ask.

    Args:
        num_layers, num_kv_heads, head_dim: from the model config.
        slots: sessions that can hold KV at once.
        slot_tokens: tokens one slot holds (prompt + reply): the session budget.
        dtype, device: the model's KV dtype and device.

    Example:
        >>> pool = KVSlotPool(num_layers=2, num_kv_heads=1, head_dim=8, slots=2,
        ...                   slot_tokens=16, dtype=torch.float32, device="cpu")  # doctest: +SKIP
        >>> pool.nbytes                                        # doctest: +SKIP
        4096
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        slots: int,
        slot_tokens: int,
        dtype: Any,
        device: Any,
    ) -> None:
        import torch

        if slots < 1:
            raise ConfigError("kv slots must be >= 1")
        if slot_tokens < 2:
            raise ConfigError("slot_tokens must be >= 2")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.slots, self.slot_tokens = slots, slot_tokens
        self.dtype = dtype
        shape = (slots, num_kv_heads, slot_tokens, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._table = [_Slot() for _ in range(slots)]
        self._lock = threading.Lock()

    @staticmethod
    def predicted_nbytes(
        *, num_layers: int, num_kv_heads: int, head_dim: int, slots: int, slot_tokens: int, dtype_bytes: int
    ) -> int:
        """``2 x layers x slots x kv_heads x slot_tokens x head_dim x dtype bytes``."""
        return 2 * num_layers * slots * num_kv_heads * slot_tokens * head_dim * dtype_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of the K and V tensors (measured from the tensors)."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    @property
    def slot_nbytes(self) -> int:
        """Bytes one slot occupies."""
        return self.nbytes // self.slots

    def acquire(self, key: str | None) -> tuple[int, list[int]] | None:
        """A slot for ``key`` and the tokens already in it, or ``None`` when all are busy.

        The session's own idle slot comes first (its tokens are reused), then an empty
        slot, then the least recently used idle slot of another session (its tokens are
        dropped).
        """
        with self._lock:
            chosen = None
            if key is not None:
                chosen = next((i for i, s in enumerate(self._table) if s.owner == key and not s.busy), None)
            if chosen is None:
                chosen = next((i for i, s in enumerate(self._table) if s.owner is None and not s.busy), None)
            if chosen is None:
                idle = [(s.last_used, i) for i, s in enumerate(self._table) if not s.busy]
                if not idle:
                    return None
                chosen = min(idle)[1]
            slot = self._table[chosen]
            if slot.owner != key or key is None:
                slot.tokens = []
            slot.owner, slot.busy = key, True
            return chosen, list(slot.tokens)

    def release(self, index: int, tokens: Sequence[int]) -> None:
        """Give slot ``index`` back; it keeps ``tokens`` for its owner's next turn."""
        with self._lock:
            slot = self._table[index]
            slot.busy, slot.last_used = False, time.monotonic()
            slot.tokens = list(tokens) if slot.owner is not None else []

    def forget(self, key: str) -> None:
        """Drop what an idle slot keeps for ``key`` (a closed session)."""
        with self._lock:
            for slot in self._table:
                if slot.owner == key and not slot.busy:
                    slot.owner, slot.tokens = None, []

    def owners(self) -> list[str]:
        """Keys of the sessions whose tokens are kept in a slot."""
        with self._lock:
            return [s.owner for s in self._table if s.owner is not None]


# -- decode attention -----------------------------------------------------------------------------


def _attention_reference(
    q: Any, k_cache: Any, v_cache: Any, slots: Any, lengths: Any, length: int, scale: float
) -> Any:
    """Decode attention in plain torch: ``q`` ``[B, H, D]`` over the first ``lengths[b]``
    tokens of slot ``slots[b]`` (``length`` >= every entry of ``lengths``)."""
    import torch
    import torch.nn.functional as F

    k = k_cache.index_select(0, slots)[:, :, :length]
    v = v_cache.index_select(0, slots)[:, :, :length]
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


_TRITON: dict[str, Any] = {}


def _triton_kernels() -> dict[str, Any] | None:
    """The split decode-attention kernels (flash-decoding), or ``None`` without Triton."""
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
        Q, K, V, Slots, Lens, Acc, M, L,
        scale,
        stride_qb, stride_qh,
        stride_ks, stride_kh, stride_kt,
        stride_vs, stride_vh, stride_vt,
        GROUP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
        NSPLIT: tl.constexpr,
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
            s = tl.sum(k.to(tl.float32) * q[None, :], 1)
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing valid yet
            p = tl.exp(s - m_safe)
            alpha = tl.exp(m_i - m_safe)
            v_ptr = v_base + offs_n[:, None] * stride_vt + offs_d[None, :]
            v = tl.load(v_ptr, mask=valid[:, None], other=0.0)
            acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
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

    _TRITON.update(split=_split_kernel, combine=_combine_kernel)
    return _TRITON


def decode_attention(q: Any, k_cache: Any, v_cache: Any, slots: Any, lengths: Any, *, scale: float) -> Any:
    """Attention of one new token per row over its slot: reads only ``lengths[b]`` tokens.

    Args:
        q: ``[B, heads, head_dim]`` queries (already rotated).
        k_cache, v_cache: one layer of the pool, ``[slots, kv_heads, slot_tokens, head_dim]``.
        slots: ``[B]`` slot of each row; lengths: ``[B]`` valid tokens (>= 1) of each row.
        scale: the softmax scale (``head_dim ** -0.5`` for Llama).

    On CUDA with Triton this is a split-K (flash-decoding) kernel whose grid depends only
    on the shapes, so it can be captured in a CUDA graph; elsewhere plain SDPA.
    """
    kernels = _triton_kernels() if q.device.type == "cuda" or _interpreting() else None
    if kernels is None:
        length = k_cache.shape[2]
        if q.device.type != "cuda":  # no graph here: read only what the longest row needs
            length = min(length, (int(lengths.max()) + 63) // 64 * 64)
        return _attention_reference(q, k_cache, v_cache, slots, lengths, length, scale)
    import torch

    batch, heads, dim = q.shape
    kv_heads, slot_tokens = k_cache.shape[1], k_cache.shape[2]
    nsplit = math.ceil(slot_tokens / ATTENTION_SPLIT_TOKENS)
    q = q.contiguous()
    acc = torch.empty((batch, heads, nsplit, dim), dtype=torch.float32, device=q.device)
    m = torch.empty((batch, heads, nsplit), dtype=torch.float32, device=q.device)
    lse = torch.empty((batch, heads, nsplit), dtype=torch.float32, device=q.device)
    out = torch.empty((batch, heads, dim), dtype=q.dtype, device=q.device)
    kernels["split"][(batch, heads, nsplit)](
        q, k_cache, v_cache, slots, lengths, acc, m, lse,
        scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        GROUP=heads // kv_heads, D=dim, BLOCK_N=64, SPLIT=ATTENTION_SPLIT_TOKENS, NSPLIT=nsplit,
    )  # fmt: skip
    kernels["combine"][(batch * heads,)](
        acc, m, lse, out, NSPLIT=nsplit, NSPLIT_P2=_next_power_of_2(nsplit), D=dim
    )
    return out


def _next_power_of_2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


# -- the decoder ----------------------------------------------------------------------------------


def tensor_nbytes(*objs: Any) -> int:
    """Bytes of the tensors in ``objs`` (tensors, tuples of them, modules), each counted
    once; bitsandbytes 4-bit weights include their quantization state (absmax, code)."""
    seen: set[int] = set()
    total = 0

    def add(obj: Any) -> None:
        nonlocal total
        if isinstance(obj, tuple):
            for t in obj:
                add(t)
        elif hasattr(obj, "parameters"):
            for t in (*obj.parameters(), *obj.buffers()):
                add(t)
        elif hasattr(obj, "numel") and id(obj) not in seen:
            seen.add(id(obj))
            total += obj.numel() * obj.element_size()
            state = getattr(obj, "quant_state", None)
            for part in (state, getattr(state, "state2", None)):
                for name in ("absmax", "code", "offset"):
                    t = getattr(part, name, None)
                    if hasattr(t, "numel"):
                        add(t)

    for obj in objs:
        add(obj)
    return total


def _pre_attention(
    x: Any, ln: Any, qkv: tuple[Linear, ...], cos: Any, sin: Any, shape: tuple[int, ...]
) -> Any:
    """Norm, fused q/k/v projection and rotary embedding of ``x`` ``[N, hidden]``."""
    heads, kv_heads, dim, eps_pico = shape  # eps in 1e-12 units: an int, so every layer shares one compile
    h = _rms_norm(x, ln, eps_pico * 1e-12)
    out = _linears(h, qkv)
    n = x.shape[0]
    q = out[:, : heads * dim].view(n, heads, dim)
    k = out[:, heads * dim : (heads + kv_heads) * dim].view(n, kv_heads, dim)
    v = out[:, (heads + kv_heads) * dim :].reshape(n, kv_heads, dim)
    return _rope(q, cos, sin), _rope(k, cos, sin), v


def _post_attention(
    x: Any, attn: Any, o: Linear, ln: Any, gate_up: tuple[Linear, ...], down: Linear, eps_pico: int
) -> Any:
    """Output projection, residual, norm, SwiGLU MLP, residual."""
    import torch.nn.functional as F

    x = x + _linear(attn, o)
    h = _rms_norm(x, ln, eps_pico * 1e-12)
    gu = _linears(h, gate_up)
    gate, up = gu.chunk(2, dim=-1)
    return x + _linear(F.silu(gate) * up, down)


def _own_copy(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with a code object of its own (a fresh dynamo cache)."""
    import types

    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_COPIES)}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


_COPIES = iter(range(1 << 62))


@dataclass(frozen=True)
class _Layer:
    ln1: Any
    ln2: Any
    qkv: tuple[Linear, ...]
    o: Linear
    gate_up: tuple[Linear, ...]
    down: Linear
    scale: float
    alt: _Layer | None = None  # the same layer with plain int4 weights (the Triton kernel)


def _is_plain_linear(module: Any) -> bool:
    import torch

    weight = getattr(module, "weight", None)
    return (
        type(module) is torch.nn.Linear
        and weight is not None
        and weight.dtype.is_floating_point
        and weight.device.type != "meta"
    )


class StaticDecoder:
    """A Llama-family model decoding over a :class:`KVSlotPool` with static shapes.

    Args:
        model: a loaded ``*ForCausalLM`` of a supported type (:data:`SUPPORTED_MODEL_TYPES`).
        slots: KV slots (sessions generating or cached at once). Default 8.
        slot_tokens: tokens per slot: prompt + reply of one session (its budget).
        weights: ``"as-loaded"`` (default: the model's own weights; plain linears are
            fused q/k/v and gate/up, quantized modules such as bitsandbytes' are called as
            they are) or ``"int4"`` (quantize plain linears to :class:`Int4Weight`).
        group_size: int4 group size (128 by default; smaller where a shape needs it).
        compile: fuse each layer's pointwise work with ``torch.compile``. Default: on CUDA
            with plain or int4 weights.
        cuda_graphs: capture the decode step per batch bucket. Default: on CUDA.
        prefill_chunk_tokens: prefill runs in chunks of this many tokens. Default 512.
        free_dense: after quantizing to int4, drop the model's dense linear weights (the
            model can then only run through this decoder). Default False.
        buckets: batch sizes to build the step for (default: powers of two up to the
            next one >= ``slots``). Fewer buckets, fewer captures; steps of more rows than
            the largest bucket are refused.
        int4_kernel: the int4 decode kernel: ``"tinygemm"`` (PyTorch's), ``"triton"``
            (convo's W4A16 kernel over a plain layout; prefill dequantizes to bf16 for
            cuBLAS), or ``"auto"`` (default): on CUDA with Triton both are captured at
            warm-up and each batch bucket keeps the faster (the other layout is dropped
            unless some bucket uses it); elsewhere tinygemm.

    Raises:
        ConfigError: unsupported architecture (sliding-window attention shorter than a
            slot, an unknown model type, a non-SwiGLU MLP).
    """

    def __init__(
        self,
        model: Any,
        *,
        slots: int = 8,
        slot_tokens: int,
        weights: str = "as-loaded",
        group_size: int = 128,
        compile: bool | None = None,
        cuda_graphs: bool | None = None,
        prefill_chunk_tokens: int = 512,
        free_dense: bool = False,
        buckets: Sequence[int] | None = None,
        int4_kernel: str = "auto",
    ) -> None:
        import torch

        cfg = model.config.get_text_config()
        model_type = getattr(cfg, "model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"static decode supports {sorted(SUPPORTED_MODEL_TYPES)}, not {model_type!r}")
        window = getattr(cfg, "sliding_window", None)
        if window and getattr(cfg, "use_sliding_window", True) and window < slot_tokens:
            raise ConfigError(f"sliding window {window} < slot_tokens {slot_tokens}: not supported")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ConfigError(f"static decode needs a SiLU MLP, not {cfg.hidden_act!r}")
        if weights not in ("as-loaded", "int4"):
            raise ConfigError(f"weights must be 'as-loaded' or 'int4', not {weights!r}")
        if prefill_chunk_tokens < 1:
            raise ConfigError("prefill_chunk_tokens must be >= 1")
        if int4_kernel not in ("auto", "tinygemm", "triton"):
            raise ConfigError(f"int4_kernel must be 'auto', 'tinygemm' or 'triton', not {int4_kernel!r}")
        # (Triton's interpreter runs the kernel on CPU: tests use it with int4_kernel="triton".)
        on_cuda = next(model.parameters()).device.type == "cuda" or (
            _interpreting() and int4_kernel == "triton"
        )
        self._plain_candidate = (
            weights == "int4" and on_cuda and int4_kernel != "tinygemm" and _w4_op() is not None
        )
        if int4_kernel == "triton" and not self._plain_candidate:
            raise ConfigError("int4_kernel='triton' needs CUDA, Triton and weights='int4'")
        self.int4_kernel = int4_kernel
        #: The int4 kernel each batch bucket runs ("tinygemm" / "triton"), chosen at warm-up.
        self.kernel_choice: dict[int, str] = {}
        devices = {p.device for p in model.parameters()}
        if len(devices) > 1:
            raise ConfigError(
                f"static decode needs the whole model on one device, not {sorted(map(str, devices))}"
            )
        base = model.model
        self.model = model
        self.device = base.embed_tokens.weight.device
        self.dtype = base.embed_tokens.weight.dtype
        cuda = self.device.type == "cuda"
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads)
        self.vocab_size = int(cfg.vocab_size)
        self.weights = weights
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self._eps = [round(float(layer.input_layernorm.variance_epsilon) * 1e12) for layer in base.layers]

        with torch.no_grad():
            self.layers = [self._layer(layer, weights, group_size, free_dense) for layer in base.layers]
            self.embed = base.embed_tokens.weight
            self.norm = base.norm.weight
            self.norm_eps = round(float(base.norm.variance_epsilon) * 1e12)
            self.lm_head = self._linear_group([model.lm_head], "as-loaded", group_size, False)[0][0]
            positions = torch.arange(slot_tokens, device=self.device)[None]
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = base.rotary_emb(probe, positions)
            self.cos, self.sin = cos[0].to(self.dtype).contiguous(), sin[0].to(self.dtype).contiguous()
        self.quantized = any(
            isinstance(w, tuple) and not w[0].dtype.is_floating_point for w in self.layers[0].qkv
        )
        self.modules = any(not isinstance(w, tuple) for w in self.layers[0].qkv)
        if cuda:
            torch.cuda.synchronize(self.device)
        allocated_before = torch.cuda.memory_allocated(self.device) if cuda else 0
        self.pool = KVSlotPool(
            num_layers=len(self.layers),
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            slots=slots,
            slot_tokens=slot_tokens,
            dtype=self.dtype,
            device=self.device,
        )
        #: Device bytes the pool took, measured with ``torch.cuda.memory_allocated`` (CUDA),
        #: or from the tensors (CPU).
        self.pool_measured_bytes = (
            torch.cuda.memory_allocated(self.device) - allocated_before if cuda else self.pool.nbytes
        )
        self.pool_predicted_bytes = KVSlotPool.predicted_nbytes(
            num_layers=len(self.layers),
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            slots=slots,
            slot_tokens=slot_tokens,
            dtype_bytes=torch.empty((), dtype=self.dtype).element_size(),
        )
        self.compiled = (cuda and not self.modules) if compile is None else compile
        self.cuda_graphs = cuda if cuda_graphs is None else (cuda_graphs and cuda)
        self._pre: Callable[..., Any] = _pre_attention
        self._post: Callable[..., Any] = _post_attention
        #: Batch sizes the decode step is built for; a step of n rows runs in the smallest
        #: bucket >= n (extra rows repeat the first, writing the same values).
        self.buckets = sorted(set(buckets or [1 << i for i in range(max(slots - 1, 0).bit_length() + 1)]))
        if self.buckets[0] < 1:
            raise ConfigError("batch buckets must be >= 1")
        if self.compiled:
            # Each decoder compiles its own copies: dynamo keys its cache (and its limit of
            # recompiles) on the code object, which every decoder in a process would share.
            self._pre = torch.compile(_own_copy(_pre_attention), fullgraph=True, dynamic=False)
            self._post = torch.compile(_own_copy(_post_attention), fullgraph=True, dynamic=False)
            limit = getattr(torch._dynamo.config, "recompile_limit", None)
            if limit is not None and limit < 2 * len(self.buckets):
                torch._dynamo.config.recompile_limit = 2 * len(self.buckets)
        self._graphs: dict[int, tuple[Any, Any, Any, bool]] = {}
        #: CUDA graph captures so far (the warm-up captures one per bucket).
        self.captures = 0

    # -- weights -------------------------------------------------------------------------------
    def _layer(self, layer: Any, weights: str, group_size: int, free: bool) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        groups = [[attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj], [mlp.gate_proj, mlp.up_proj]]
        groups.append([mlp.down_proj])
        built = [self._linear_group(g, weights, group_size, free) for g in groups]
        main, plain = [b[0] for b in built], [b[1] for b in built]
        common: dict[str, Any] = {
            "ln1": layer.input_layernorm.weight,
            "ln2": layer.post_attention_layernorm.weight,
            "scale": float(getattr(attn, "scaling", self.head_dim**-0.5)),
        }
        alt = None
        qkv, o, gate_up, down = plain
        if qkv is not None and o is not None and gate_up is not None and down is not None:
            alt = _Layer(qkv=qkv, o=o[0], gate_up=gate_up, down=down[0], **common)
        return _Layer(qkv=main[0], o=main[1][0], gate_up=main[2], down=main[3][0], alt=alt, **common)

    def _linear_group(
        self, mods: list[Any], weights: str, group_size: int, free: bool
    ) -> tuple[tuple[Linear, ...], tuple[Linear, ...] | None]:
        """One fused linear for plain modules (int4 where asked and possible), else the
        modules; and the plain-int4 alternative when the Triton kernel is a candidate."""
        import torch

        if not all(_is_plain_linear(m) for m in mods):
            return tuple(mods), None
        weight = torch.cat([m.weight for m in mods], dim=0) if len(mods) > 1 else mods[0].weight
        biases = [m.bias for m in mods]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat(
                [
                    b if b is not None else m.weight.new_zeros(m.out_features)
                    for b, m in zip(biases, mods, strict=True)
                ]
            )
        gs = int4_group_size(weight.shape[1], group_size) if weights == "int4" else None
        if gs is None or weight.shape[0] % 8:
            if len(mods) > 1:  # the modules now view the fused weight: no second copy
                row = 0
                for m in mods:
                    m.weight = torch.nn.Parameter(weight[row : row + m.out_features], requires_grad=False)
                    row += m.out_features
            return ((weight,) if bias is None else (weight, bias),), None
        candidate = self._plain_candidate
        q = quantize_int4(weight, group_size=gs, bias=bias, dtype=self.dtype, plain=candidate)
        if free:
            for m in mods:
                m.weight = torch.nn.Parameter(m.weight.new_empty(0), requires_grad=False)
        extra = () if q.bias is None else (q.bias,)
        plain = None if q.plain is None else (("w4", *q.plain, *extra),)
        return ((q.packed, q.scales_zeros, *extra),), plain

    def weight_nbytes(self, *, alt: bool = False) -> int:
        """Bytes of the weights one decode step reads (all layers, final norm, lm_head);
        ``alt``: with the plain int4 layout (the Triton kernel) where the layers have it."""
        parts: list[Any] = [self.norm, self.lm_head]
        for layer in self._layer_set(alt):
            parts += [layer.ln1, layer.ln2, layer.qkv, layer.o, layer.gate_up, layer.down]
        return tensor_nbytes(*parts)

    def _layer_set(self, alt: bool) -> list[_Layer]:
        if alt and self.layers[0].alt is not None:
            return [layer.alt for layer in self.layers if layer.alt is not None]
        return self.layers

    # -- prefill -------------------------------------------------------------------------------
    def prefill(
        self,
        slot: int,
        ids: Sequence[int],
        start: int,
        *,
        deadline: float | None = None,
        cancel: threading.Event | None = None,
        all_logits: bool = False,
    ) -> tuple[Any, int]:
        """Run ``ids[start:]`` into slot ``slot`` (its first ``start`` tokens are kept).

        Args:
            all_logits: return the logits after every token of ``ids[start:]``
                (``[n, vocab]``, for perplexity), not only after the last.

        Returns:
            ``(logits, done)``: float32 logits ``[vocab]`` after the last token, or ``None``
            when the deadline or ``cancel`` stopped it between chunks; ``done`` is how many
            tokens of ``ids`` the slot now holds.
        """
        import torch
        import torch.nn.functional as F

        if not 0 <= start < len(ids) <= self.pool.slot_tokens:
            raise ConfigError(f"prefill of {len(ids)} tokens from {start} does not fit a slot")
        shape = (self.heads, self.kv_heads, self.head_dim)
        pos = start
        x = None
        outputs = []
        with torch.inference_mode():
            while pos < len(ids):
                end = min(pos + self.prefill_chunk_tokens, len(ids))
                n = end - pos
                tokens = torch.tensor(ids[pos:end], device=self.device)
                x = F.embedding(tokens, self.embed)
                cos, sin = self.cos[pos:end, None, :], self.sin[pos:end, None, :]
                keys = torch.arange(end, device=self.device)
                mask = keys[None, :] <= torch.arange(pos, end, device=self.device)[:, None]
                # Plain int4 prefills through bf16 cuBLAS (dequantized per chunk): far faster
                # than tinygemm on hundreds of rows.
                for i, layer in enumerate(self._layer_set(alt=True)):
                    q, k, v = _pre_attention(x, layer.ln1, layer.qkv, cos, sin, (*shape, self._eps[i]))
                    k_cache, v_cache = self.pool.k[i], self.pool.v[i]
                    k_cache[slot, :, pos:end] = k.transpose(0, 1)
                    v_cache[slot, :, pos:end] = v.transpose(0, 1)
                    a = F.scaled_dot_product_attention(
                        q.transpose(0, 1)[None],
                        k_cache[slot, :, :end][None],
                        v_cache[slot, :, :end][None],
                        attn_mask=mask,
                        scale=layer.scale,
                        enable_gqa=self.kv_heads != self.heads,
                    )
                    a = a[0].transpose(0, 1).reshape(n, self.heads * self.head_dim)
                    x = _post_attention(x, a, layer.o, layer.ln2, layer.gate_up, layer.down, self._eps[i])
                pos = end
                if all_logits:
                    outputs.append(
                        _linear(_rms_norm(x, self.norm, self.norm_eps * 1e-12), self.lm_head).float()
                    )
                if pos < len(ids) and (
                    (deadline is not None and time.monotonic() >= deadline)
                    or (cancel is not None and cancel.is_set())
                ):
                    return None, pos
            assert x is not None
            if all_logits:
                return torch.cat(outputs), pos
            h = _rms_norm(x[-1:], self.norm, self.norm_eps * 1e-12)
            return _linear(h, self.lm_head)[0].float(), pos

    # -- decode --------------------------------------------------------------------------------
    def _step(self, inputs: Any, alt: bool = False) -> Any:
        """One token for each row of ``inputs`` (``[3, B]``: tokens, slots, positions);
        ``alt``: with the plain int4 layers (the Triton kernel)."""
        import torch
        import torch.nn.functional as F

        tokens, slots, positions = inputs[0], inputs[1], inputs[2]
        n = tokens.shape[0]
        x = F.embedding(tokens, self.embed)
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        lengths = (positions + 1).to(torch.int32)
        shape = (self.heads, self.kv_heads, self.head_dim)
        for i, layer in enumerate(self._layer_set(alt)):
            q, k, v = self._pre(x, layer.ln1, layer.qkv, cos, sin, (*shape, self._eps[i]))
            k_cache, v_cache = self.pool.k[i], self.pool.v[i]
            k_cache[slots, :, positions] = k
            v_cache[slots, :, positions] = v
            a = decode_attention(q, k_cache, v_cache, slots, lengths, scale=layer.scale)
            x = self._post(x, a.reshape(n, -1), layer.o, layer.ln2, layer.gate_up, layer.down, self._eps[i])
        h = _rms_norm(x, self.norm, self.norm_eps * 1e-12)
        return _linear(h, self.lm_head).float()

    def bucket(self, rows: int) -> int:
        """The batch size a step of ``rows`` rows runs at."""
        for b in self.buckets:
            if b >= rows:
                return b
        raise ConfigError(f"{rows} rows > {self.buckets[-1]}: more rows than slots")

    def warmup(self) -> None:
        """Compile and capture the step for every batch bucket (call before any session
        uses the pool: warm-up writes position 0 of slot 0)."""
        import torch

        has_alt = self.layers[0].alt is not None
        variants = [False, True] if has_alt and self.int4_kernel == "auto" else [has_alt]
        with torch.inference_mode():
            for b in self.buckets:
                inputs = torch.zeros((3, b), dtype=torch.long, device=self.device)
                if not self.cuda_graphs:
                    self._step(inputs, alt=variants[0])
                    if has_alt:
                        self.kernel_choice[b] = "triton" if variants[0] else "tinygemm"
                    continue
                captured = [(self._capture(inputs, alt), alt) for alt in variants]
                if len(captured) > 1:  # keep the faster kernel for this bucket
                    captured.sort(key=lambda c: _replay_ms(c[0][0]))
                (graph, out), alt = captured[0]
                self._graphs[b] = (graph, inputs, out, alt)
                if has_alt:
                    self.kernel_choice[b] = "triton" if alt else "tinygemm"
            if has_alt and self.cuda_graphs:
                self._drop_unused_layout()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    def _capture(self, inputs: Any, alt: bool) -> tuple[Any, Any]:
        import torch

        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(inputs, alt)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._step(inputs, alt)
        self.captures += 1
        return graph, out

    def _drop_unused_layout(self) -> None:
        """Free the int4 layout no bucket chose (both stay when the buckets differ)."""
        import dataclasses as dc

        used = set(self.kernel_choice.values())
        if used == {"triton"}:
            self.layers = [dc.replace(layer.alt, alt=None) for layer in self.layers if layer.alt is not None]
            self._graphs = {b: (g, i, o, False) for b, (g, i, o, _) in self._graphs.items()}
        elif used == {"tinygemm"}:
            self.layers = [dc.replace(layer, alt=None) for layer in self.layers]
        _empty_cuda_cache()

    def step(self, tokens: Sequence[int], slots: Sequence[int], positions: Sequence[int]) -> Any:
        """Decode one token for each row: feed ``tokens[r]`` at ``positions[r]`` of slot
        ``slots[r]``; returns float32 logits ``[rows, vocab]``."""
        import torch

        rows = len(tokens)
        if not rows:
            raise ConfigError("a step needs at least one row")
        if max(positions) >= self.pool.slot_tokens:
            raise ConfigError(f"position {max(positions)} is past the slot ({self.pool.slot_tokens} tokens)")
        host = torch.tensor([list(tokens), list(slots), list(positions)], dtype=torch.long)
        with torch.inference_mode():
            b = self.bucket(rows)
            if not self.cuda_graphs:  # eager; padded to the bucket when compiled (no new shapes)
                if self.compiled and rows < b:
                    host = torch.cat([host, host[:, :1].expand(3, b - rows)], dim=1)
                alt = self.kernel_choice.get(b) == "triton"
                return self._step(host.to(self.device), alt)[:rows]
            if b not in self._graphs:
                raise ConfigError("warmup() first: the decode step is captured at start")
            graph, inputs, out, _ = self._graphs[b]
            if rows < b:  # pad with copies of row 0: same slot, position and value
                host = torch.cat([host, host[:, :1].expand(3, b - rows)], dim=1)
            inputs.copy_(host, non_blocking=False)
            graph.replay()
            return out[:rows]


# -- the scheduler --------------------------------------------------------------------------------


@dataclass(eq=False, kw_only=True)
class DecodeRequest:
    """One generation handed to :class:`DecodeScheduler` (model token ids in and out).

    Args:
        ids: the prompt, as model token ids.
        max_new_tokens: cap on the reply.
        deadline: ``time.monotonic()`` value at which generation stops (finish ``timeout``).
        sampling: an object with ``temperature``, ``top_p``, ``top_k``,
            ``repetition_penalty``, ``seed`` and ``min_new_tokens`` (:class:`~convo.engine.Sampling`).
        eos: token ids that end the reply (finish ``stop``).
        cache_key: the session whose slot (and cached tokens) to use.
        on_token: called with each new token id; returning True stops (a stop string).
        cancel: set to stop early (finish ``cancelled``).
    """

    ids: list[int]
    max_new_tokens: int
    deadline: float
    sampling: Any
    eos: frozenset[int] = frozenset()
    cache_key: str | None = None
    on_token: Callable[[int], bool] | None = None
    cancel: threading.Event | None = None
    # Filled in by the scheduler.
    new_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    kv_tokens: int = 0
    slot: int = -1
    started_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished_at: float | None = None
    finish: str | None = None  # "stop", "length", "timeout", "cancelled"
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    _generator: Any = None

    @property
    def position(self) -> int:
        """Where the last sampled token goes in the slot."""
        return len(self.ids) + len(self.new_ids) - 1


class DecodeScheduler:
    """Decodes every generating session together, one row per slot.

    A background thread admits waiting requests in arrival order as slots free up (a
    request whose deadline passes while it waits finishes with ``timeout``), prefills
    each newcomer into its slot, then runs one batched step for all rows at a time,
    sampling per row and finishing rows as they stop.

    Args:
        decoder: the :class:`StaticDecoder` (warmed up).
    """

    def __init__(self, decoder: StaticDecoder) -> None:
        self.decoder = decoder
        self._pending: list[DecodeRequest] = []
        self._active: list[DecodeRequest] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        #: Steps run, and rows decoded in them (rows / steps = mean batch).
        self.steps = 0
        self.rows = 0

    def submit(self, request: DecodeRequest) -> DecodeRequest:
        """Queue ``request``; wait on ``request.done``."""
        with self._cv:
            if self._closed:
                raise ConfigError("the decode scheduler is closed")
            self._pending.append(request)
            if self._thread is None:
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

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()

    # -- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._active and not self._closed:
                    self._cv.wait()
                if self._closed and not self._pending and not self._active:
                    self._thread = None
                    return
            try:
                self._admit()
                if self._active:
                    self._step()
            except BaseException as exc:  # a device error ends every row in flight
                self._fail_active(exc)

    def _finish(self, req: DecodeRequest, reason: str | None, error: BaseException | None = None) -> None:
        req.finish, req.error = reason, error
        req.finished_at = time.monotonic()
        if req.slot >= 0:
            kept = (req.ids + req.new_ids)[: req.kv_tokens] if error is None else []
            self.decoder.pool.release(req.slot, kept)
        req.done.set()

    def _fail_active(self, exc: BaseException) -> None:
        error = _device_error(exc)
        for req in self._active:
            req.kv_tokens = 0
            self._finish(req, None, error)
        self._active = []
        _empty_cuda_cache()

    def _admit(self) -> None:
        while True:
            with self._cv:
                if not self._pending:
                    return
                req = self._pending[0]
                now = time.monotonic()
                stop = "cancelled" if req.cancel is not None and req.cancel.is_set() else None
                stop = stop or ("timeout" if now >= req.deadline else None)
                got = None
                if stop is None:
                    got = self.decoder.pool.acquire(req.cache_key)
                    if got is None:
                        return  # every slot is generating: wait for a row to finish
                self._pending.pop(0)
            if stop is not None or got is None:
                self._finish(req, stop)
                continue
            req.slot, kept = got
            try:
                self._prefill(req, kept)
            except BaseException as exc:
                req.kv_tokens = 0
                self._finish(req, None, _device_error(exc))
                _empty_cuda_cache()

    def _prefill(self, req: DecodeRequest, kept: list[int]) -> None:
        limit = min(len(kept), len(req.ids) - 1)
        common = 0
        while common < limit and kept[common] == req.ids[common]:
            common += 1
        req.cached_tokens = common
        logits, done = self.decoder.prefill(
            req.slot, req.ids, common, deadline=req.deadline, cancel=req.cancel
        )
        req.kv_tokens = done
        if logits is None:
            self._finish(req, "cancelled" if req.cancel is not None and req.cancel.is_set() else "timeout")
            return
        if req.sampling.seed is not None:
            import torch

            req._generator = torch.Generator(device=logits.device).manual_seed(req.sampling.seed)
        token = _sample(logits[None], [req])[0]
        req.first_token_at = time.monotonic()
        if not self._accept(req, token):
            self._active.append(req)

    def _accept(self, req: DecodeRequest, token: int) -> bool:
        """Record ``token`` for ``req``; True when the request finished."""
        req.new_ids.append(token)
        stop_string = req.on_token(token) if req.on_token is not None else False
        if token in req.eos or stop_string:
            reason: str | None = "stop"
        elif len(req.new_ids) >= req.max_new_tokens:
            reason = "length"
        elif req.cancel is not None and req.cancel.is_set():
            reason = "cancelled"
        elif time.monotonic() >= req.deadline:
            reason = "timeout"
        else:
            return False
        self._finish(req, reason)
        return True

    def _step(self) -> None:
        rows = self._active
        logits = self.decoder.step(
            [r.new_ids[-1] for r in rows], [r.slot for r in rows], [r.position for r in rows]
        )
        for r in rows:
            r.kv_tokens = r.position + 1
        tokens = _sample(logits, rows)
        self.steps += 1
        self.rows += len(rows)
        self._active = [r for r, t in zip(rows, tokens, strict=True) if not self._accept(r, t)]


def _sample(logits: Any, rows: Sequence[DecodeRequest]) -> list[int]:
    """Next token per row: greedy rows by one argmax, the others with their own settings."""
    import torch

    out = logits.argmax(dim=-1)
    special = [
        i
        for i, r in enumerate(rows)
        if r.sampling.temperature > 0
        or r.sampling.repetition_penalty != 1.0
        or len(r.new_ids) < r.sampling.min_new_tokens
    ]
    if not special:
        return [int(t) for t in out.tolist()]
    result = out.tolist()
    for i in special:
        r, s = rows[i], rows[i].sampling
        row = logits[i].clone()
        if s.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.ids) | set(r.new_ids)), device=row.device)
            seen = seen[seen < row.shape[0]]
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / s.repetition_penalty, vals * s.repetition_penalty)
        if len(r.new_ids) < s.min_new_tokens and r.eos:
            eos = torch.tensor(sorted(r.eos), device=row.device)
            row[eos[eos < row.shape[0]]] = float("-inf")
        if s.temperature == 0:
            result[i] = int(row.argmax())
            continue
        row = row / s.temperature
        if s.top_k:
            kth = torch.topk(row, min(s.top_k, row.shape[0])).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if s.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
            drop = cum - torch.softmax(sorted_logits, dim=-1) > s.top_p
            row[order[drop]] = float("-inf")
        probs = torch.softmax(row, dim=-1)
        result[i] = int(torch.multinomial(probs, 1, generator=r._generator))
    return [int(t) for t in result]


def _replay_ms(graph: Any, reps: int = 20) -> float:
    """Median milliseconds of one replay of a captured graph."""
    import torch

    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _device_error(exc: BaseException) -> BaseException:
    if type(exc).__name__ == "OutOfMemoryError" or isinstance(exc, MemoryError):
        return DeviceOutOfMemory(f"out of memory in the decode loop: {exc}")
    return exc


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


__all__ = [
    "DecodeRequest",
    "DecodeScheduler",
    "Int4Weight",
    "KVSlotPool",
    "StaticDecoder",
    "decode_attention",
    "dequantize_int4",
    "int4_group_size",
    "quantize_int4",
    "tensor_nbytes",
]
