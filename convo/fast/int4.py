"""4-bit weights: group-wise asymmetric int4 and :class:`Int4Linear`, the module that runs them.

``w ~= (q - 8) * scale + zero`` per group of ``group_size`` input features, with ``q`` in
0..15 (gpt-fast's and torchao's int4 weight-only grid). An :class:`Int4Linear` holds the
grid in one or two layouts:

* ``"plain"``: ``uint8 [out, in / 2]`` (low nibble = even input) and ``[out, in / group,
  2]`` scale/zero pairs. On CUDA, up to :data:`W4_KERNEL_MAX_ROWS` rows run through
  convo's Triton W4A16 op, whose cost grows slowly with the rows (above 64 rows it also
  weighs dequantizing the weight and cuBLAS, and takes the faster); more rows (long
  prefill chunks) dequantize the weight once, in one kernel, and multiply with cuBLAS.
* ``"tinygemm"``: PyTorch's tile-packed int4 and ``[in / group, out, 2]`` scale/zero pairs,
  through ``aten._weight_int4pack_mm`` (CUDA, bf16) or its CPU twin. The fastest kernel
  for a row or a few (H200, Llama-2-7B step: 3.2 ms at 1 row against Triton's 5.8), it
  slows down with more (10.5 ms at 16 against 8.5) and is slow for prefill.
* ``"both"`` (the default on CUDA with Triton): tinygemm's layout up to
  :data:`TINYGEMM_MAX_ROWS` rows, the plain one above. Twice the weight bytes of one
  layout (Llama-2-7B: +3.4 GiB), for the fastest step at every batch size.

Each layout takes ``in * out / 2`` bytes plus the scales and zeros.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F

from convo.errors import ConfigError
from convo.fast.attention import _interpreting
from convo.fast.kernels import _w4_op, dequantize_plain_int4
from convo.models.quant import INT4_GROUP_SIZES, LARGEST_INT4_GROUP_SIZE, int4_group_size

__all__ = [
    "DENSE_COPY_MIN_ROWS",
    "TINYGEMM_MAX_ROWS",
    "W4_KERNEL_MAX_ROWS",
    "Int4Layout",
    "Int4Linear",
    "default_int4_layout",
    "dequantize_int4",
    "int4_group_size",
    "keep_dense_copies",
    "quantize_int4",
]

#: The int4 layouts (see the module docstring).
Int4Layout = Literal["plain", "tinygemm", "both"]

#: Rows up to which a plain int4 weight multiplies through the Triton kernel's op; more rows
#: are dequantized once and multiplied by cuBLAS. Above 64 rows (a mixed step's 16 replies
#: and a prefill chunk beside them) the op times, on the device at warm-up, its tiles
#: (:data:`~convo.fast.kernels.W4_LARGE_CONFIGS` and the shorter ones, which read the int4
#: weight once) against that same dense path, which stays a candidate, so it never runs
#: slower than the dense path by more than the tuner's timing noise. Measured on an H100
#: (Llama-2-7B projections, 32 layers, graph replays, ``benchmarks/w4_kernels.py``): 64 rows
#: 6.99 ms through the kernel against 12.1 dequantized for cuBLAS; at 272 rows the dense
#: path won every projection (13.2 ms; the best tiles 16.2), and at 528 rows too (16.0 ms),
#: ``SWAP`` tiles included (2026-12-07): past 160 rows the tuner would only spend warm-up
#: time finding the dense path again.
W4_KERNEL_MAX_ROWS = 160
#: With both layouts, rows up to which tinygemm's kernel runs (faster than the Triton
#: kernel up to 4 rows on the H200, slower from 16).
TINYGEMM_MAX_ROWS = 8
#: An int4 weight with a dense copy (:meth:`Int4Linear.keep_dense`) multiplies products of
#: more than this many rows (a mixed step, a prefill chunk) with that copy through cuBLAS,
#: not dequantizing the weight again; up to it (decode steps) it reads the int4 weight,
#: four times fewer bytes.
DENSE_COPY_MIN_ROWS = 64

_INTERPRETING = _interpreting()  # Triton's interpreter runs the kernels on CPU (tests)


def default_int4_layout(device: Any) -> Int4Layout:
    """``"both"`` on CUDA with Triton (or under Triton's interpreter), else ``"tinygemm"``."""
    on_cuda = torch.device(device).type == "cuda"
    return "both" if (on_cuda or _INTERPRETING) and _w4_op() is not None else "tinygemm"


class Int4Linear(torch.nn.Module):
    """A weight-only int4 linear layer (gpt-fast's ``WeightOnlyInt4Linear``).

    Build one with :meth:`quantize`; :func:`~convo.models.quant.int4_group_size` says which
    group a weight shape takes. Buffers, on the weight's
    device: ``qweight`` and ``scales_zeros`` (the plain layout, or ``None``), ``packed`` and
    ``packed_scales_zeros`` (tinygemm's, or ``None``), and an optional ``bias``;
    activations, scales and zeros share the compute dtype (bf16 on CUDA). Modules of one
    layout share compiled code: the decoder's compiled layer functions take them as
    arguments (dynamo treats their buffers as inputs).
    """

    qweight: torch.Tensor | None
    scales_zeros: torch.Tensor | None
    packed: torch.Tensor | None
    packed_scales_zeros: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(
        self,
        *,
        in_features: int,
        out_features: int,
        group_size: int,
        plain: tuple[torch.Tensor, torch.Tensor] | None = None,
        tinygemm: tuple[torch.Tensor, torch.Tensor] | None = None,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if plain is None and tinygemm is None:
            raise ConfigError("an Int4Linear needs at least one layout")
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        self.layout: Int4Layout = "both" if plain and tinygemm else ("plain" if plain else "tinygemm")
        self.register_buffer("qweight", plain[0] if plain else None)
        self.register_buffer("scales_zeros", plain[1] if plain else None)
        self.register_buffer("packed", tinygemm[0] if tinygemm else None)
        self.register_buffer("packed_scales_zeros", tinygemm[1] if tinygemm else None)
        self.register_buffer("bias", bias)
        #: The dense copy of the weight that steps of more than DENSE_COPY_MIN_ROWS rows
        #: multiply (:meth:`keep_dense`), or None.
        self.dense: torch.Tensor | None = None

    @classmethod
    def quantize(
        cls,
        weight: torch.Tensor,
        *,
        group_size: int = LARGEST_INT4_GROUP_SIZE,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        layout: Int4Layout | None = None,
    ) -> Int4Linear:
        """Quantize a dense ``[out, in]`` weight on its device.

        Args:
            weight: the dense weight (any float dtype).
            group_size: input features per scale/zero pair (one of
                :data:`~convo.models.quant.INT4_GROUP_SIZES`; default the largest, 128).
            bias: an optional bias, kept in ``dtype``.
            dtype: compute dtype of scales, zeros and activations. Default: bf16 on CUDA,
                the weight's dtype on CPU.
            layout: ``"plain"``, ``"tinygemm"`` or ``"both"``; default
                :func:`default_int4_layout`.

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
        if layout not in ("plain", "tinygemm", "both"):
            raise ConfigError(f"int4 layout must be 'plain', 'tinygemm' or 'both', not {layout!r}")
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
        plain = tinygemm = None
        if layout in ("plain", "both"):
            qweight = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8).contiguous()
            plain = (qweight, pairs.to(dtype).contiguous())
        if layout in ("tinygemm", "both"):
            tiles = next(t for t in (8, 4, 2) if in_features % (t * 16) == 0)
            if cuda:
                packed_bytes = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
                packed = torch.ops.aten._convert_weight_to_int4pack(packed_bytes, tiles)
            else:
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, tiles)
            tinygemm = (packed, pairs.transpose(0, 1).contiguous().to(dtype))
        return cls(
            in_features=in_features,
            out_features=out_features,
            group_size=group_size,
            plain=plain,
            tinygemm=tinygemm,
            bias=None if bias is None else bias.detach().to(dtype),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        kernel = self.kernel(x2.shape[0], x2.device.type)
        if kernel == "dense":
            y = F.linear(x2, self.dense)
        elif kernel == "tinygemm":
            y = _tinygemm_mm(x2, self.packed, self.packed_scales_zeros, self.group_size)
        elif kernel == "triton":
            y = _w4_op()(x2, self.qweight, self.scales_zeros)  # type: ignore[misc]
        else:
            y = F.linear(x2, dequantize_plain_int4(self.qweight, self.scales_zeros).to(x.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def kernel(self, rows: int, device_type: str = "cuda") -> str:
        """The kernel a product of ``rows`` rows on ``device_type`` runs: ``"tinygemm"``,
        ``"triton"``, ``"cublas"`` (the plain layout dequantized once, then a matmul) or
        ``"dense"`` (the kept dense copy, :meth:`keep_dense`, past
        :data:`DENSE_COPY_MIN_ROWS` rows)."""
        if self.dense is not None and rows > DENSE_COPY_MIN_ROWS:
            return "dense"
        if self.packed is not None and (self.qweight is None or rows <= TINYGEMM_MAX_ROWS):
            return "tinygemm"
        on_triton = device_type == "cuda" or _INTERPRETING
        return "triton" if rows <= W4_KERNEL_MAX_ROWS and on_triton and _w4_op() is not None else "cublas"

    def keep_dense(self, dtype: torch.dtype) -> int:
        """Keep a ``dtype`` copy of the dense weight beside the int4 one, for products of
        more than :data:`DENSE_COPY_MIN_ROWS` rows: memory (``out * in`` elements) for the
        dequantization each such product would run. Its values are the int4 grid's, so the
        products match the dequantized path's. Returns the bytes it takes (0: kept already)."""
        if self.dense is not None:
            return 0
        with torch.no_grad():
            self.dense = self.dequantize().to(dtype)
        return self.dense.numel() * self.dense.element_size()

    def dequantize(self) -> torch.Tensor:
        """The dense ``[out, in]`` float32 weight this module stands for."""
        if self.qweight is not None and self.scales_zeros is not None:
            return dequantize_plain_int4(self.qweight, self.scales_zeros).float()
        assert self.packed is not None and self.packed_scales_zeros is not None
        eye = torch.eye(self.in_features, dtype=self.packed_scales_zeros.dtype, device=self.packed.device)
        return (
            _tinygemm_mm(eye, self.packed, self.packed_scales_zeros, self.group_size, exact=True).t().float()
        )

    @property
    def nbytes(self) -> int:
        """Bytes the weight occupies (every layout kept, its dense copy, bias)."""
        dense = 0 if self.dense is None else self.dense.numel() * self.dense.element_size()
        return dense + sum(t.numel() * t.element_size() for t in self.buffers())

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, layout={self.layout!r}, bias={self.bias is not None}, "
            f"dense_copy={self.dense is not None}"
        )


def keep_dense_copies(layers: Sequence[Sequence[Any]], budget: int) -> int:
    """Dense copies (:meth:`Int4Linear.keep_dense`, in each one's compute dtype) of the
    int4 linears of ``layers`` (each a sequence of modules), layer by layer from the first,
    while a whole layer's fit in ``budget`` bytes; the bytes kept."""
    kept = 0
    for mods in layers:
        int4 = [m for m in mods if isinstance(m, Int4Linear)]
        need = sum(m.out_features * m.in_features * _dtype(m).itemsize for m in int4)
        if not int4 or kept + need > budget:
            break
        kept += sum(m.keep_dense(_dtype(m)) for m in int4)
    return kept


def _dtype(linear: Int4Linear) -> torch.dtype:
    """An int4 linear's compute dtype (its scales')."""
    sz = linear.scales_zeros if linear.scales_zeros is not None else linear.packed_scales_zeros
    assert sz is not None
    return sz.dtype


def quantize_int4(weight: torch.Tensor, **kwargs: Any) -> Int4Linear:
    """Deprecated: :meth:`Int4Linear.quantize` (the same arguments)."""
    warnings.warn(
        "convo.fast.int4.quantize_int4 is deprecated; use convo.fast.int4.Int4Linear.quantize",
        DeprecationWarning,
        stacklevel=2,
    )
    return Int4Linear.quantize(weight, **kwargs)


def dequantize_int4(linear: Int4Linear) -> torch.Tensor:
    """The dense ``[out, in]`` float32 weight of ``linear`` (:meth:`Int4Linear.dequantize`)."""
    return linear.dequantize()


def _tinygemm_mm(
    x: torch.Tensor, packed: Any, scales_zeros: Any, group_size: int, *, exact: bool = False
) -> Any:
    if x.device.type == "cuda":
        return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, scales_zeros)
    if x.dtype != torch.float32 or exact:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_zeros)
    # PyTorch's CPU kernel is vectorized for bfloat16, not float32: float32 activations run
    # in bfloat16, 20-75x faster (AVX-512, a 576 x 1,536 weight: 0.05 ms against 1.0 ms for
    # one row, 4 ms against 302 ms for 290 rows) at a relative error of ~3e-3, far below
    # int4's own. The scales stay float32 in the module (its grid, ``dequantize``).
    bf16 = torch.bfloat16
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(bf16), packed, group_size, scales_zeros.to(bf16))
    return y.float()
