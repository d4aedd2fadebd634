"""4-bit weights: group-wise int4 in two layouts (tinygemm tile-packed, plain for Triton),
and the linear helpers the decoder's layer functions call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from convo.errors import ConfigError
from convo.fast.kernels import _w4_op, dequantize_plain_int4


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
        y = F.linear(x2, dequantize_plain_int4(qweight, sz).to(x.dtype))
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _linears(x: Any, ws: tuple[Linear, ...]) -> Any:
    import torch

    if len(ws) == 1:
        return _linear(x, ws[0])
    return torch.cat([_linear(x, w) for w in ws], dim=-1)


def _dense_linear(x: Any, w: Linear) -> Any:
    """:func:`_linear` for many rows (prefill): a plain int4 weight is dequantized once, in
    one kernel, and multiplied by cuBLAS; everything else as :func:`_linear`."""
    import torch.nn.functional as F

    if isinstance(w, tuple) and isinstance(w[0], str):
        y = F.linear(x, dequantize_plain_int4(w[1], w[2]).to(x.dtype))
        return y + w[3] if len(w) > 3 else y
    return _linear(x, w)


def _dense_linears(x: Any, ws: tuple[Linear, ...]) -> Any:
    import torch

    if len(ws) == 1:
        return _dense_linear(x, ws[0])
    return torch.cat([_dense_linear(x, w) for w in ws], dim=-1)
