"""4-bit weights: group-wise asymmetric int4 and :class:`Int4Linear`, the module that runs them.

``w ~= (q - 8) * scale + zero`` per group of ``group_size`` input features, with ``q`` in
0..15 (gpt-fast's and torchao's int4 weight-only grid). One :class:`Int4Linear` holds the
grid in one layout, chosen for the device:

* ``"plain"`` (CUDA with Triton, the default there): ``uint8 [out, in / 2]`` (low nibble =
  even input) and ``[out, in / group, 2]`` scale/zero pairs. Up to
  :data:`W4_KERNEL_MAX_ROWS` rows (decode steps, short chunks) run through convo's Triton
  W4A16 kernel, whose cost barely depends on the rows; more rows (prefill) dequantize the
  weight once, in one kernel, and multiply with cuBLAS, which beats any int4 kernel there.
* ``"tinygemm"`` (CPU, or CUDA without Triton): PyTorch's tile-packed int4 and
  ``[in / group, out, 2]`` scale/zero pairs, through ``aten._weight_int4pack_mm`` (fast for
  one row, 2.3x slower at 16 on the H200) or its CPU twin.

Both take ``in * out / 2`` bytes plus the scales, so the planner counts one layout.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F

from convo.errors import ConfigError
from convo.fast.kernels import _interpreting, _w4_op, dequantize_plain_int4
from convo.planner.model import INT4_GROUP_SIZES, int4_group

#: The int4 layouts (see the module docstring).
Int4Layout = Literal["plain", "tinygemm"]

#: Rows up to which a plain int4 weight multiplies through the Triton kernel; more rows are
#: dequantized once and multiplied by cuBLAS.
W4_KERNEL_MAX_ROWS = 64

_INTERPRETING = _interpreting()  # Triton's interpreter runs the kernels on CPU (tests)


def int4_group_size(in_features: int, preferred: int = 128) -> int | None:
    """The largest group size <= ``preferred`` (128, 64 or 32) the kernels accept for
    ``in_features``, or ``None`` when none does (the weight then stays dense). The rule
    lives with the planner (:func:`convo.planner.model.int4_group`), which counts the bytes."""
    return int4_group(in_features, preferred)


def default_int4_layout(device: Any) -> Int4Layout:
    """``"plain"`` on CUDA with Triton (or under Triton's interpreter), else ``"tinygemm"``."""
    on_cuda = torch.device(device).type == "cuda"
    return "plain" if (on_cuda or _INTERPRETING) and _w4_op() is not None else "tinygemm"


class Int4Linear(torch.nn.Module):
    """A weight-only int4 linear layer (gpt-fast's ``WeightOnlyInt4Linear``).

    Build one with :meth:`quantize` (or :func:`quantize_int4`). Buffers: ``qweight`` (the
    packed grid), ``scales_zeros`` and an optional ``bias``, all on the weight's device;
    activations and scales share the compute dtype (bf16 on CUDA). Modules of one layout
    and shape family share compiled code: the decoder's compiled layer functions take them
    as arguments (dynamo treats their buffers as inputs).
    """

    qweight: torch.Tensor
    scales_zeros: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        qweight: torch.Tensor,
        scales_zeros: torch.Tensor,
        *,
        in_features: int,
        out_features: int,
        group_size: int,
        layout: Int4Layout,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        self.layout: Int4Layout = layout
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales_zeros", scales_zeros)
        self.register_buffer("bias", bias)

    @classmethod
    def quantize(
        cls,
        weight: torch.Tensor,
        *,
        group_size: int = 128,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        layout: Int4Layout | None = None,
    ) -> Int4Linear:
        """Quantize a dense ``[out, in]`` weight on its device.

        Args:
            weight: the dense weight (any float dtype).
            group_size: input features per scale/zero pair (128, 64 or 32).
            bias: an optional bias, kept in ``dtype``.
            dtype: compute dtype of scales, zeros and activations. Default: bf16 on CUDA,
                the weight's dtype on CPU.
            layout: ``"plain"`` or ``"tinygemm"``; default :func:`default_int4_layout`.

        Raises:
            ConfigError: the shape does not suit the kernels (``int4_group_size`` says
                which do), or an unknown layout.
        """
        out_features, in_features = (int(s) for s in weight.shape)
        if group_size not in INT4_GROUP_SIZES or in_features % group_size:
            raise ConfigError(f"group_size={group_size} does not divide in_features={in_features}")
        if in_features % 32:
            raise ConfigError(f"in_features={in_features} is not a multiple of 32")
        layout = layout or default_int4_layout(weight.device)
        if layout not in ("plain", "tinygemm"):
            raise ConfigError(f"int4 layout must be 'plain' or 'tinygemm', not {layout!r}")
        cuda = weight.device.type == "cuda"
        if dtype is None:
            dtype = torch.bfloat16 if cuda else weight.dtype
        w = weight.detach().to(torch.float32).reshape(-1, group_size)
        w_min = w.amin(dim=1, keepdim=True)
        scales = (w.amax(dim=1, keepdim=True) - w_min).clamp(min=1e-6) / 15
        zeros = w_min + scales * 8
        q = w.sub(w_min).div(scales).round().clamp(0, 15).to(torch.int32).reshape(out_features, in_features)
        del w
        pairs = torch.cat([scales.reshape(out_features, -1, 1), zeros.reshape(out_features, -1, 1)], dim=2)
        if layout == "plain":
            qweight = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8).contiguous()
            scales_zeros = pairs.to(dtype).contiguous()
        else:
            tiles = next(t for t in (8, 4, 2) if in_features % (t * 16) == 0)
            if cuda:
                packed_bytes = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
                qweight = torch.ops.aten._convert_weight_to_int4pack(packed_bytes, tiles)
            else:
                qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, tiles)
            scales_zeros = pairs.transpose(0, 1).contiguous().to(dtype)
        return cls(
            qweight,
            scales_zeros,
            in_features=in_features,
            out_features=out_features,
            group_size=group_size,
            layout=layout,
            bias=None if bias is None else bias.detach().to(dtype),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.layout == "tinygemm":
            y = _tinygemm_mm(x2, self.qweight, self.scales_zeros, self.group_size)
        elif x2.shape[0] <= W4_KERNEL_MAX_ROWS and (x2.is_cuda or _INTERPRETING) and _w4_op() is not None:
            y = _w4_op()(x2, self.qweight, self.scales_zeros)  # type: ignore[misc]
        else:
            y = F.linear(x2, dequantize_plain_int4(self.qweight, self.scales_zeros).to(x.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The dense ``[out, in]`` float32 weight this module stands for."""
        if self.layout == "plain":
            return dequantize_plain_int4(self.qweight, self.scales_zeros).float()
        eye = torch.eye(self.in_features, dtype=self.scales_zeros.dtype, device=self.qweight.device)
        return _tinygemm_mm(eye, self.qweight, self.scales_zeros, self.group_size).t().float()

    @property
    def nbytes(self) -> int:
        """Bytes the weight occupies (packed ints + scales and zeros + bias)."""
        parts = [self.qweight, self.scales_zeros] + ([] if self.bias is None else [self.bias])
        return sum(t.numel() * t.element_size() for t in parts)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, layout={self.layout!r}, bias={self.bias is not None}"
        )


def quantize_int4(
    weight: torch.Tensor,
    *,
    group_size: int = 128,
    bias: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    layout: Int4Layout | None = None,
) -> Int4Linear:
    """:meth:`Int4Linear.quantize` as a function."""
    return Int4Linear.quantize(weight, group_size=group_size, bias=bias, dtype=dtype, layout=layout)


def dequantize_int4(linear: Int4Linear) -> torch.Tensor:
    """The dense ``[out, in]`` float32 weight of ``linear`` (:meth:`Int4Linear.dequantize`)."""
    return linear.dequantize()


def _tinygemm_mm(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int) -> Any:
    if x.device.type == "cuda":
        return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, scales_zeros)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_zeros)
