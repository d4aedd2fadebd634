"""Bytes of a model's weights on the device, per kind, without loading any weights.

Weights are summed module by module over the model built on the ``meta`` device (no
memory, no download; :func:`weight_bytes`), or counted for a Llama-style layout when
transformers cannot build it. bitsandbytes quantizes only ``nn.Linear`` layers and leaves
the output embedding (``lm_head``) and tied weights alone, so those stay in ``dtype``.
nf4/fp4 cost 4 bits per parameter plus one absmax per 64-value block: fp32 (4.5
bits/param) or, with double quantization, uint8 re-quantized per 256 blocks (4.127).
convo's int4 (:mod:`convo.fast.int4`) costs half a byte per parameter plus a scale and a
zero per group, per layout kept (:data:`INT4_CUDA_LAYOUTS`).

Nothing here imports torch or transformers at import time.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from convo.errors import ConfigError
from convo.models.quant import INT4_GROUP_SIZE, Quant, check_int4_group_size, int4_group_size
from convo.models.spec import STATIC_DECODE_MODEL_TYPES, DType, ModelShape
from convo.planner.allocator import reserved_bytes

#: The CUDA caching allocator rounds every block up to this many bytes.
ALLOC_ROUND_BYTES = 512


@dataclass(frozen=True, kw_only=True)
class WeightReport:
    """Bytes of the weights on the device, per kind.

    Attributes:
        total_bytes: everything (parameters and buffers, allocator-rounded).
        quantized_params: parameters stored quantized (``nn.Linear`` weights).
        unquantized_params: parameters kept in ``dtype`` (embeddings, norms, lm_head...).
        quantized_bytes: bytes of the quantized weights incl. their quantization state.
        unquantized_bytes: bytes of everything else.
        largest_linear_params: the biggest quantized ``nn.Linear`` (its dequantized copy
            is a prefill temporary).
        method: ``"meta"`` (measured on the meta device) or ``"analytic"``.
        loaded_bytes: the weights on the device once loaded, before the KV slots are
            taken (``int4``: the quantized weights: the dense model stays in host memory,
            moved over a layer at a time); never below ``total_bytes``.
        load_peak_bytes: the most the weights take while loading (``int4``: the weights
            kept plus one dense layer and the temporaries of quantizing its largest linear,
            :func:`int4_load_peak_bytes`); never below ``total_bytes``.
        reserved_bytes: what the caching allocator reserves for the weights once loaded,
            where it is modelled (``int4`` counted on ``meta``: the tensors kept, in loading
            order, packed into segments by :func:`convo.planner.allocator.reserved_bytes`);
            0 where it is not (the planner then applies its calibration's
            ``weights_reserved_ratio`` to ``total_bytes``).
        load_sequence: the sizes of the kept allocations in loading order, where
            ``reserved_bytes`` is modelled (the planner appends what the decoder allocates
            next); empty where it is not.
    """

    total_bytes: int
    quantized_params: int
    unquantized_params: int
    quantized_bytes: int
    unquantized_bytes: int
    largest_linear_params: int
    method: str
    loaded_bytes: int = 0
    load_peak_bytes: int = 0
    reserved_bytes: int = 0
    load_sequence: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("loaded_bytes", "load_peak_bytes"):
            if getattr(self, name) < self.total_bytes:
                object.__setattr__(self, name, self.total_bytes)


def round_alloc(nbytes: float) -> int:
    """``nbytes`` rounded up to the allocator's block (:data:`ALLOC_ROUND_BYTES`)."""
    return int(math.ceil(nbytes / ALLOC_ROUND_BYTES) * ALLOC_ROUND_BYTES)


#: Model types whose layers ``quant=int4`` can run (the static decoder's, convo.fast).
INT4_MODEL_TYPES = STATIC_DECODE_MODEL_TYPES
#: Temporaries of quantizing one fused linear to int4, per parameter on top of its dense
#: copy (a float32 copy, the int32 grid, rounding intermediates; the plain layout's shifted
#: int32 halves), in the staging pool's own segments. Measured on an H200 with the layers
#: staged in a private pool (random weights, group 32, one layout): the weights' load peak
#: was the weights kept + one layer's int4 copy + one dense layer + 18.2 bytes per
#: parameter of the largest fused linear beyond its bf16 copy for Llama-2-7B, 14.4 for
#: Qwen2.5-7B (16 before staging, tinygemm layout, Llama); 20 keeps both under.
INT4_QUANTIZE_TEMP_BYTES_PER_PARAM = 20
#: Copies of the int4 weights the static decoder keeps on CUDA by default
#: (``convo.fast.int4.Int4Linear`` layout ``"both"``: tinygemm's for steps of a few rows,
#: the plain one for the Triton kernel and prefill); ``int4_kernel="triton"`` or
#: ``"tinygemm"`` keeps one. On CPU: 1.
INT4_CUDA_LAYOUTS = 2


def quantized_linear_bytes(
    out_features: int, in_features: int, quant: Quant, *, double_quant: bool = True
) -> int:
    """Device bytes of one bitsandbytes-quantized ``nn.Linear`` weight (no bias).

    nf4/fp4: packed 4-bit data (``n/2``) + absmax per 64-value block (fp32, or uint8 plus
    an fp32 absmax per 256 blocks with double quantization: 4.127 bits/param in all).
    int8 (LLM.int8): ``n`` bytes + one fp32 scale per output row.
    """
    n = out_features * in_features
    if quant is Quant.INT8:
        return round_alloc(n) + round_alloc(4 * out_features)
    if quant in (Quant.NF4, Quant.FP4):
        blocks = math.ceil(n / 64)
        if double_quant:
            state = round_alloc(blocks) + round_alloc(4 * math.ceil(blocks / 256))
            state += round_alloc(256 * 4) + round_alloc(4)  # code book, offset
        else:
            state = round_alloc(4 * blocks)
        return round_alloc(math.ceil(n / 2)) + state
    raise ConfigError(f"{quant} is not a bitsandbytes quantization")


def int4_linear_buffers(
    out_features: int, in_features: int, dtype: DType, group_size: int
) -> tuple[int, int] | None:
    """The two device buffers of one linear weight in convo's int4 format
    (``convo.fast.int4.Int4Linear``), one layout, no bias: ``(packed int4, scales and
    zeros)``, ``out * in / 2`` bytes (tinygemm's tile layout on CUDA, ``uint8 [out, in/2]``
    on CPU) and a scale and a zero per group of ``group_size`` inputs in the compute
    ``dtype``. ``None`` when the shape stays dense (no group size fits ``in``, or ``out``
    is not a multiple of 8)."""
    gs = int4_group_size(in_features, group_size)
    if gs is None or out_features % 8:
        return None
    return out_features * in_features // 2, int(2 * out_features * (in_features // gs) * dtype.nbytes)


def int4_linear_bytes(out_features: int, in_features: int, dtype: DType, group_size: int) -> int | None:
    """Device bytes of one linear weight in convo's int4 format, allocator-rounded: the sum
    of :func:`int4_linear_buffers`; ``None`` when the shape stays dense."""
    buffers = int4_linear_buffers(out_features, in_features, dtype, group_size)
    return None if buffers is None else sum(round_alloc(b) for b in buffers)


def int4_load_peak_bytes(
    total_bytes: int, layer_params: int, largest_params: int, dtype: DType, layer_kept_bytes: int = 0
) -> int:
    """The device's peak while int4 weights load layer by layer from host memory.

    ::

        | int4 weights kept     | one layer's | one dense layer | largest fused linear's   |
        | (every layer, at most)| int4, again | (moved over)    | fused copy + temporaries |

    Args:
        total_bytes: the weights the decoder keeps (int4 layers, dense embeddings/norms/head).
        layer_params: parameters of one decoder layer's quantized linears, dense on the
            device while that layer is quantized.
        largest_params: the largest fused linear (its concatenated copy, ``dtype`` bytes, and
            :data:`INT4_QUANTIZE_TEMP_BYTES_PER_PARAM` of temporaries).
        dtype: the dense dtype.
        layer_kept_bytes: what one layer keeps (its int4 linears): built in the staging
            pool and copied out of it (:mod:`convo.fast.staging`), so briefly there twice.

    Returns:
        Bytes: ``total + layer kept + layer * dtype + largest * (dtype + temporaries)``, an
        upper bound (the last layer's int4 copy is counted while its dense copy still exists).
    """
    dense_layer = round_alloc(layer_params * dtype.nbytes)
    fused = largest_params * (dtype.nbytes + INT4_QUANTIZE_TEMP_BYTES_PER_PARAM)
    return int(total_bytes + layer_kept_bytes + dense_layer + fused)


def planned_quant(quant: Quant | str | None, dtype: DType | str | None) -> tuple[Quant, DType | None]:
    """What the memory model prices for a weight format: ``(quant, dtype)``.

    Every dense format becomes ``NONE`` (its dtype, when it names one and ``dtype`` does
    not, becomes the dtype); ``AUTO`` is what the engine picks on CUDA (``NF4``).
    """
    q = Quant.parse(quant).resolved(cuda=True)
    dt = DType.parse(dtype) if dtype is not None else None
    if q.is_dense:
        if dt is None and q.dense_dtype is not None:
            dt = DType.parse(q.dense_dtype)
        q = Quant.NONE
    return q, dt


def weight_bytes(
    config: Mapping[str, Any],
    quant: Quant | str = Quant.NONE,
    dtype: DType | str | None = None,
    *,
    double_quant: bool = True,
    method: str = "auto",
    group_size: int = INT4_GROUP_SIZE,
    int4_layouts: int = INT4_CUDA_LAYOUTS,
) -> WeightReport:
    """Bytes of the weights on the GPU, module by module.

    Args:
        config: a config dict (see :func:`load_config`).
        quant: a :class:`~convo.models.quant.Quant`: dense (``none``, ``bf16``...),
            bitsandbytes (``int8``, ``nf4``, ``fp4``) or convo's ``int4`` (the decoder
            layers' linears, fused q/k/v and gate/up, group-wise; embeddings, norms and
            ``lm_head`` stay dense; layers are moved to the device and quantized one at a
            time, so ``load_peak_bytes`` is the weights kept plus one dense layer and its
            largest linear's temporaries).
        dtype: dtype of unquantized weights; default: the config's (bf16 for ``int4``,
            what the engine loads it in on CUDA).
        double_quant: nf4/fp4 with ``bnb_4bit_use_double_quant``.
        method: ``"meta"`` builds the model on the meta device (needs torch and
            transformers); ``"analytic"`` counts a Llama-style layout; ``"auto"`` tries
            meta first.
        group_size: int4 inputs per scale/zero pair (default :data:`INT4_GROUP_SIZE`,
            the engine's).
        int4_layouts: copies of the int4 weights kept (default :data:`INT4_CUDA_LAYOUTS`,
            2 as on CUDA; 1 on CPU or when every batch bucket runs the Triton kernel).

    Returns:
        A :class:`WeightReport`.

    Raises:
        ConfigError: ``int4`` for an architecture the static decoder does not run.
    """
    q, dt_given = planned_quant(quant, dtype)
    shape = ModelShape.from_config(config)
    if q is Quant.INT4:
        if shape.model_type not in INT4_MODEL_TYPES:
            raise ConfigError(
                f"int4 runs on the static decoder, which supports {sorted(INT4_MODEL_TYPES)}, "
                f"not {shape.model_type!r}"
            )
        check_int4_group_size(group_size)
        if int4_layouts not in (1, 2):
            raise ConfigError("int4_layouts must be 1 or 2")
    dt = dt_given or (DType.BF16 if q is Quant.INT4 else shape.dtype)
    if method in ("auto", "meta"):
        try:
            key = json.dumps(dict(config), sort_keys=True, default=str)
            return _weight_bytes_meta_cached(key, q, dt, double_quant, group_size, int4_layouts)
        except (ImportError, ValueError, KeyError) as exc:
            if method == "meta":
                raise ConfigError(f"cannot build {config.get('model_type')} on meta: {exc}") from exc
    return _weight_bytes_analytic(shape, q, dt, double_quant, group_size, int4_layouts)


@functools.lru_cache(maxsize=32)
def _weight_bytes_meta_cached(
    config_json: str, quant: Quant, dtype: DType, double_quant: bool, group_size: int, layouts: int
) -> WeightReport:
    return _weight_bytes_meta(json.loads(config_json), quant, dtype, double_quant, group_size, layouts)


_INT4_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)


def _int4_fused_groups(model: Any) -> list[list[tuple[str, Any]]]:
    """The linears the static decoder fuses and quantizes: per layer q/k/v, o, gate/up, down."""
    groups: list[list[tuple[str, Any]]] = []
    for i, layer in enumerate(model.model.layers):
        for names in _INT4_GROUPS:
            groups.append([(f"model.layers.{i}.{n}", layer.get_submodule(n)) for n in names])
    return groups


def _weight_bytes_meta(
    config: Mapping[str, Any],
    quant: Quant,
    dtype: DType,
    double_quant: bool,
    group_size: int,
    layouts: int,
) -> WeightReport:
    import torch
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_dict = {k: v for k, v in config.items() if k not in ("architectures", "auto_map")}
    cfg_dict.pop("quantization_config", None)
    model_type = cfg_dict.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **cfg_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    elem = dtype.nbytes
    qbytes = ubytes = 0
    qparams = uparams = 0
    largest = 0
    seen: set[int] = set()
    sequence: tuple[int, ...] = ()
    if quant is Quant.INT4:
        sequence = tuple(_int4_load_sequence(model, dtype, group_size, layouts))
        for group in _int4_fused_groups(model):
            mods = [m for _, m in group]
            out_f = sum(int(m.out_features) for m in mods)
            in_f = int(mods[0].in_features)
            nbytes = int4_linear_bytes(out_f, in_f, dtype, group_size)
            if nbytes is None:
                continue  # stays dense: counted with the rest below
            nbytes *= layouts
            if any(m.bias is not None for m in mods):
                nbytes += round_alloc(out_f * elem)  # the fused bias (the modules keep theirs)
            qbytes += nbytes
            qparams += out_f * in_f
            largest = max(largest, out_f * in_f)
            seen.update(id(m.weight) for m in mods)  # freed after quantizing
    skip: set[str] = set()
    if quant.is_bitsandbytes:
        from transformers.quantizers.base import get_keys_to_not_convert

        skip = set(get_keys_to_not_convert(model))
    for name, module in model.named_modules():
        quantize_here = (
            quant.is_bitsandbytes
            and isinstance(module, nn.Linear)
            and not any(name == s or name.endswith("." + s) for s in skip)
        )
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # tied weights count once
                continue
            seen.add(id(param))
            if quantize_here and pname == "weight":
                out_f, in_f = param.shape
                qbytes += quantized_linear_bytes(out_f, in_f, quant, double_quant=double_quant)
                qparams += param.numel()
                largest = max(largest, param.numel())
            else:
                ubytes += round_alloc(param.numel() * elem)
                uparams += param.numel()
        for _bname, buf in module.named_buffers(recurse=False):
            if id(buf) in seen:
                continue
            seen.add(id(buf))
            ubytes += round_alloc(buf.numel() * buf.element_size())
    layers = max(len(model.model.layers), 1) if quant is Quant.INT4 else 1
    report = _weight_report(
        "meta", quant, dtype, qbytes, qparams, ubytes, uparams, largest, -(-qparams // layers)
    )
    if not sequence:
        return report
    return dataclasses.replace(report, reserved_bytes=reserved_bytes(sequence), load_sequence=sequence)


def _int4_load_sequence(model: Any, dtype: DType, group_size: int, layouts: int) -> list[int]:
    """The device allocations an int4 load keeps, in order: everything outside the decoder
    layers (moved over first), then per layer what stays of the staged layer (norms,
    biases; its linears' weights are freed) and the fused int4 linears' buffers (per
    layout the packed weight and its scales and zeros, then the fused bias), as
    :class:`~convo.fast.decoder.StaticDecoder` copies them out of its staging pool."""
    import torch

    elem = dtype.nbytes
    layers = list(model.model.layers)
    inside = {id(t) for layer in layers for t in [*layer.parameters(), *layer.buffers()]}
    seen: set[int] = set()
    sizes: list[int] = []
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in inside and id(t) not in seen:  # parameters in the compute dtype, buffers as they are
            seen.add(id(t))
            sizes.append(t.numel() * (elem if isinstance(t, torch.nn.Parameter) else t.element_size()))
    groups = _int4_fused_groups(model)
    per_layer = len(groups) // max(len(layers), 1)
    for index, layer in enumerate(layers):
        mine = groups[index * per_layer : (index + 1) * per_layer]
        fused = {id(m.weight) for group in mine for _, m in group}
        sizes += [int(p.numel() * elem) for p in layer.parameters() if id(p) not in fused]
        for group in mine:
            mods = [m for _, m in group]
            out_f, in_f = sum(int(m.out_features) for m in mods), int(mods[0].in_features)
            buffers = int4_linear_buffers(out_f, in_f, dtype, group_size)
            if buffers is None:
                sizes.append(int(out_f * in_f * elem))  # stays dense, one fused copy
            else:
                sizes += [*buffers] * layouts
            if any(m.bias is not None for m in mods):
                sizes.append(int(out_f * elem))
    return sizes


def _weight_report(
    method: str,
    quant: Quant,
    dtype: DType,
    qbytes: int,
    qparams: int,
    ubytes: int,
    uparams: int,
    largest: int,
    layer_params: int = 0,
) -> WeightReport:
    """The report of weights counted by ``method``: ``qparams`` quantized parameters in
    ``qbytes``, ``uparams`` others in ``ubytes``, the largest quantized linear's
    parameters. int4 on CUDA loads the dense model into host memory and moves it to the
    device one decoder layer at a time, quantizing that layer there and freeing its dense
    copy (:func:`convo.engines.local.loading.stage_layer`): the device never holds more
    than the weights it keeps, one dense layer (``layer_params``) and the temporaries of
    quantizing that layer's largest fused linear (:func:`int4_load_peak_bytes`)."""
    load: dict[str, int] = {}
    if quant is Quant.INT4:
        layers = -(-qparams // max(layer_params, 1))
        peak = int4_load_peak_bytes(qbytes + ubytes, layer_params, largest, dtype, -(-qbytes // layers))
        load = {"loaded_bytes": qbytes + ubytes, "load_peak_bytes": peak}
    return WeightReport(
        total_bytes=qbytes + ubytes,
        quantized_params=qparams,
        unquantized_params=uparams,
        quantized_bytes=qbytes,
        unquantized_bytes=ubytes,
        largest_linear_params=largest,
        method=method,
        **load,
    )


def _weight_bytes_analytic(
    shape: ModelShape, quant: Quant, dtype: DType, double_quant: bool, group_size: int, layouts: int
) -> WeightReport:
    h, i, hd = shape.hidden_size, shape.intermediate_size, shape.head_dim
    q_out, kv_out = shape.num_heads * hd, shape.num_kv_heads * hd
    if quant is Quant.INT4:  # the static decoder's fused groups
        layer = [(q_out + 2 * kv_out, h), (h, q_out), (2 * i, h), (h, i)]
    else:
        layer = [(q_out, h), (kv_out, h), (kv_out, h), (h, q_out), (i, h), (i, h), (h, i)]
    linears = layer * shape.num_layers
    elem = dtype.nbytes
    norms = (2 * shape.num_layers + 1) * h
    emb = shape.vocab_size * h * (1 if shape.tie_word_embeddings else 2)
    qbytes = qparams = largest = 0
    uparams = norms + emb
    for o, n in linears:
        nbytes: int | None = None
        if quant is Quant.INT4:
            one = int4_linear_bytes(o, n, dtype, group_size)
            nbytes = None if one is None else one * layouts
        elif quant.is_bitsandbytes:
            nbytes = quantized_linear_bytes(o, n, quant, double_quant=double_quant)
        if nbytes is None:
            uparams += o * n
        else:
            qbytes += nbytes
            qparams += o * n
            largest = max(largest, o * n)
    ubytes = round_alloc(uparams * elem)
    layer_params = -(-qparams // max(shape.num_layers, 1))
    return _weight_report("analytic", quant, dtype, qbytes, qparams, ubytes, uparams, largest, layer_params)
