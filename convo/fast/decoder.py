"""The static decoder: a Llama-family model over the KV slot pool, prefill and a captured step.

Imports torch (through :mod:`convo.fast.int4`); :mod:`convo.fast` loads it on first use.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from convo.errors import ConfigError
from convo.fast.attention import _interpreting, chunk_attention, decode_attention, dequantize_kv, store_kv
from convo.fast.config import DecoderConfig
from convo.fast.graphs import GraphSpec, capture, capture_order
from convo.fast.int4 import W4_KERNEL_MAX_ROWS, Int4Linear, keep_dense_copies
from convo.fast.kernels import _w4_op
from convo.fast.kv_pool import KVSlotPool, PrefillChunk
from convo.fast.kv_shift import rope_frequencies
from convo.fast.packing import MIXED_PACK_CHUNKS, MIXED_PACK_TOKENS, pack_chunks, packed_tokens, static_pieces
from convo.fast.staging import build_staged
from convo.models.defaults import (
    KV_DTYPE_CHOICES,
    MIXED_CHUNK_TOKENS,
    WARMUP_EAGER_RUNS,
    batch_buckets,
    chunk_buckets,
    mixed_buckets,
)
from convo.models.device import empty_device_cache
from convo.models.legacy import split_legacy
from convo.models.quant import int4_group_size
from convo.models.spec import STATIC_DECODE_MODEL_TYPES

__all__ = [
    "MIXED_CHUNK_TOKENS",
    "PREFILL_GRAPH_MAX_CHUNKS",
    "SUPPORTED_MODEL_TYPES",
    "DecoderConfig",
    "PrefillChunk",
    "StaticDecoder",
    "tensor_nbytes",
]

#: Model types whose decoder layers :class:`StaticDecoder` knows how to run.
SUPPORTED_MODEL_TYPES = STATIC_DECODE_MODEL_TYPES


#: A linear layer as the decoder holds it: ``torch.nn.Linear`` (dense, q/k/v and gate/up
#: fused), :class:`~convo.fast.int4.Int4Linear`, or a quantized module such as
#: bitsandbytes' ``Linear4bit``, each called as ``linear(x)``.
Linear = Any


def _linears(x: Any, linears: tuple[Linear, ...]) -> Any:
    """``x`` through each of ``linears`` (unfused modules of one group), concatenated."""
    import torch

    if len(linears) == 1:
        return linears[0](x)
    return torch.cat([m(x) for m in linears], dim=-1)


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


def _norm(x: Any, weight: Any, eps_pico: int) -> Any:
    return _rms_norm(x, weight, eps_pico * 1e-12)


def _rotary(q: Any, k: Any, cos: Any, sin: Any) -> tuple[Any, Any]:
    return _rope(q, cos, sin), _rope(k, cos, sin)


def _add_norm(x: Any, y: Any, weight: Any, eps_pico: int) -> tuple[Any, Any]:
    x = x + y
    return x, _rms_norm(x, weight, eps_pico * 1e-12)


def _swiglu(gate_up: Any) -> Any:
    import torch.nn.functional as F

    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class _Pointwise:
    """The elementwise parts of a layer: the norms (``eps`` in 1e-12 units: an int, so
    every layer shares one compile), rotary embedding, residual + norm, SwiGLU. Eager, or
    each compiled with dynamic shapes for the static forwards (one compile serves every
    bucket, fusing ~30 kernels a layer into ~6)."""

    norm: Callable[..., Any] = _norm
    rotary: Callable[..., Any] = _rotary
    add_norm: Callable[..., Any] = _add_norm
    swiglu: Callable[..., Any] = _swiglu

    @classmethod
    def compiled(cls) -> _Pointwise:
        import torch

        return cls(
            *(
                torch.compile(_own_copy(fn), fullgraph=True, dynamic=True)
                for fn in (_norm, _rotary, _add_norm, _swiglu)
            )
        )


_EAGER = _Pointwise()


def _pre_attention(
    x: Any,
    ln: Any,
    qkv: tuple[Linear, ...],
    cos: Any,
    sin: Any,
    shape: tuple[int, ...],
    pw: _Pointwise = _EAGER,
) -> Any:
    """Norm, fused q/k/v projection and rotary embedding of ``x`` ``[N, hidden]``."""
    heads, kv_heads, dim, eps_pico = shape
    h = pw.norm(x, ln, eps_pico)
    out = _linears(h, qkv)
    n = x.shape[0]
    q = out[:, : heads * dim].view(n, heads, dim)
    k = out[:, heads * dim : (heads + kv_heads) * dim].view(n, kv_heads, dim)
    v = out[:, (heads + kv_heads) * dim :].reshape(n, kv_heads, dim)
    q, k = pw.rotary(q, k, cos, sin)
    return q, k, v


def _post_attention(
    x: Any,
    attn: Any,
    o: Linear,
    ln: Any,
    gate_up: tuple[Linear, ...],
    down: Linear,
    eps_pico: int,
    pw: _Pointwise = _EAGER,
) -> Any:
    """Output projection, residual, norm, SwiGLU MLP, residual."""
    x, h = pw.add_norm(x, o(attn), ln, eps_pico)
    return x + down(pw.swiglu(_linears(h, gate_up)))


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


def _modules(layer: _Layer) -> tuple[Any, ...]:
    """The linear modules of a built layer."""
    return (*layer.qkv, layer.o, *layer.gate_up, layer.down)


def _is_plain_linear(module: Any) -> bool:
    import torch

    weight = getattr(module, "weight", None)
    return (
        type(module) is torch.nn.Linear
        and weight is not None
        and weight.dtype.is_floating_point
        and weight.device.type != "meta"
    )


#: Most chunks one prefill step runs as captured graphs, one replay each; more chunks run
#: together in one eager forward (one weight read for all of them, at a fixed cost of
#: Python launching every kernel: ~30 ms for a 32-layer model on the H200).
PREFILL_GRAPH_MAX_CHUNKS = 4


class StaticDecoder:
    """A Llama-family model decoding over a :class:`KVSlotPool` with static shapes.

    Args:
        model: a loaded ``*ForCausalLM`` of a supported type (:data:`SUPPORTED_MODEL_TYPES`).
        slots: KV slots (sessions generating or cached at once). Default 8.
        slot_tokens: tokens per slot: prompt + reply of one session (its budget).
        kv_dtype: how the pool stores K/V (:data:`~convo.models.defaults.KV_DTYPE_CHOICES`):
            ``"auto"`` (default) in the model's dtype; ``"fp8"`` as float8 e4m3 with a
            bfloat16 scale per token and head, about half the bytes of bf16 (the
            attention kernels read it directly; without them, on CPU, it is dequantized
            for SDPA: fp8 storage emulated).
        weights: ``"as-loaded"`` (default: the model's own weights; plain linears are
            fused q/k/v and gate/up, quantized modules such as bitsandbytes' are called as
            they are) or ``"int4"`` (quantize plain linears to
            :class:`~convo.fast.int4.Int4Linear`).
        config: the int4 grid and what is compiled and captured
            (:class:`~convo.fast.config.DecoderConfig`). Default ``DecoderConfig()``.
        stage: called as ``stage(index, layer)`` with each decoder layer just before the
            decoder reads it, to bring it onto the decoder's device (the device of the
            embeddings): the layers may then wait in host memory or on ``meta`` while the
            rest of the model is on the device, and with ``weights="int4"`` and
            ``free_dense`` each is quantized and its dense copy freed before the next one
            comes over, so the dense model never sits on the device whole
            (:func:`convo.engines.local.loading.layer_stager`). Default ``None``: the whole
            model is on one device already.
        **legacy: the fields of ``config`` as flat keywords (``group_size=32``), as before:
            deprecated, with a ``DeprecationWarning``, for one release.

    Raises:
        ConfigError: unsupported architecture (sliding-window attention shorter than a
            slot, an unknown model type, a non-SwiGLU MLP), an unknown ``kv_dtype``.
    """

    def __init__(
        self,
        model: Any,
        *,
        slots: int = 8,
        slot_tokens: int,
        kv_dtype: str = "auto",
        weights: str = "as-loaded",
        config: DecoderConfig | None = None,
        stage: Callable[[int, Any], None] | None = None,
        **legacy: Any,
    ) -> None:
        (config,) = split_legacy(legacy, [("config", config or DecoderConfig())], owner="StaticDecoder")
        #: The decoder's settings (the config given, with any flat keywords applied).
        self.config = config
        group_size, int4_kernel, free_dense = config.group_size, config.int4_kernel, config.free_dense
        compile, cuda_graphs, static_prefill = config.compile, config.cuda_graphs, config.static_prefill
        prefill_chunk_tokens, mixed_chunk_tokens = config.prefill_chunk_tokens, config.mixed_chunk_tokens
        buckets = config.buckets

        cfg = model.config.get_text_config()
        model_type = getattr(cfg, "model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"static decode supports {sorted(SUPPORTED_MODEL_TYPES)}, not {model_type!r}")
        window = getattr(cfg, "sliding_window", None)
        if window and getattr(cfg, "use_sliding_window", True) and window < slot_tokens:
            raise ConfigError(f"sliding window {window} < slot_tokens {slot_tokens}: not supported")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ConfigError(f"static decode needs a SiLU MLP, not {cfg.hidden_act!r}")
        if kv_dtype not in KV_DTYPE_CHOICES:
            raise ConfigError(f"kv_dtype must be one of {', '.join(KV_DTYPE_CHOICES)}, not {kv_dtype!r}")
        if weights not in ("as-loaded", "int4"):
            raise ConfigError(f"weights must be 'as-loaded' or 'int4', not {weights!r}")
        base = model.model
        staged = {id(p) for layer in base.layers for p in layer.parameters()} if stage else set()
        devices = {p.device for p in model.parameters() if id(p) not in staged}
        if len(devices) > 1:
            raise ConfigError(
                f"static decode needs the whole model on one device, not {sorted(map(str, devices))}"
            )
        self.model = model
        self.device = base.embed_tokens.weight.device
        self.dtype = base.embed_tokens.weight.dtype
        cuda = self.device.type == "cuda"
        # (Triton's interpreter runs the kernels on CPU: tests use it with int4_kernel="triton".)
        triton_ok = (cuda or _interpreting()) and _w4_op() is not None
        if int4_kernel == "triton" and not (triton_ok and weights == "int4"):
            raise ConfigError("int4_kernel='triton' needs CUDA, Triton and weights='int4'")
        #: The int4 layout of the linears (``"plain"`` / ``"tinygemm"``), or None (no int4).
        self.int4_layout: str | None = None
        if weights == "int4":
            layouts = {"auto": "both", "triton": "plain", "tinygemm": "tinygemm"}
            self.int4_layout = layouts[int4_kernel] if triton_ok else "tinygemm"
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads)
        self.vocab_size = int(cfg.vocab_size)
        self.weights = weights
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self._eps = [round(float(layer.input_layernorm.variance_epsilon) * 1e12) for layer in base.layers]

        with torch.no_grad():
            self.layers = []
            for index, layer in enumerate(base.layers):
                if stage is None:
                    self.layers.append(self._layer(layer, weights, group_size, free_dense))
                    continue

                def build(index: int = index, layer: Any = layer) -> _Layer:
                    stage(index, layer)
                    return self._layer(layer, weights, group_size, free_dense)

                # staged and quantized in a private pool, what it keeps copied out: no holes
                self.layers.append(
                    build_staged(self.device, build, lambda b, layer=layer: (layer, *_modules(b)))
                )
            self.embed = base.embed_tokens.weight
            self.norm = base.norm.weight
            self.norm_eps = round(float(base.norm.variance_epsilon) * 1e12)
            self.lm_head = self._linear_group([model.lm_head], "as-loaded", group_size, False)[0]
            positions = torch.arange(slot_tokens, device=self.device)[None]
            probe = torch.zeros(1, dtype=self.dtype, device=self.device)
            cos, sin = base.rotary_emb(probe, positions)
            self.cos, self.sin = cos[0].to(self.dtype).contiguous(), sin[0].to(self.dtype).contiguous()
            self._positions = positions[0]
        self.quantized = any(isinstance(m, Int4Linear) for m in self.layers[0].qkv)
        #: Bytes of the int4 weights' dense copies kept (``DecoderConfig.dense_copy_bytes``).
        self.dense_copy_nbytes = keep_dense_copies(
            [_modules(b) for b in self.layers], config.dense_copy_bytes
        )
        #: Linears that are neither dense nor convo's int4 (bitsandbytes): not compiled.
        self.modules = any(type(m) not in (torch.nn.Linear, Int4Linear) for m in self.layers[0].qkv)
        #: The allocator's reserved peak while the weights loaded, before the pool (CUDA; 0
        #: on CPU): what ``convo plan``'s load peak predicts.
        self.load_peak_reserved_bytes = 0
        #: The allocator's reserved bytes (now, not the peak) once the weights loaded, before
        #: the pool (CUDA; 0 on CPU): above :attr:`weights_allocated_bytes`, blocks it holds.
        self.weights_reserved_bytes = 0
        if cuda:
            torch.cuda.synchronize(self.device)
            self.load_peak_reserved_bytes = int(torch.cuda.max_memory_reserved(self.device))
            self.weights_reserved_bytes = int(torch.cuda.memory_reserved(self.device))
        allocated_before = torch.cuda.memory_allocated(self.device) if cuda else 0
        #: Device bytes allocated once the weights loaded, before the pool (CUDA; 0 on CPU).
        self.weights_allocated_bytes = int(allocated_before)
        #: How the pool stores K/V: ``"auto"`` (the model's dtype) or ``"fp8"``.
        self.kv_dtype = kv_dtype
        pool_dtype = torch.float8_e4m3fn if kv_dtype == "fp8" else self.dtype
        self.pool = KVSlotPool(
            num_layers=len(self.layers),
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            slots=slots,
            slot_tokens=slot_tokens,
            dtype=pool_dtype,
            device=self.device,
        )
        #: Device bytes the pool took, measured with ``torch.cuda.memory_allocated`` (CUDA),
        #: or from the tensors (CPU).
        self.pool_measured_bytes = (
            torch.cuda.memory_allocated(self.device) - allocated_before if cuda else self.pool.nbytes
        )
        self.pool.rope_inv_freq = rope_frequencies(base.rotary_emb)  # (None: no context shift)
        self.pool_predicted_bytes = KVSlotPool.predicted_nbytes(
            num_layers=len(self.layers),
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            slots=slots,
            slot_tokens=slot_tokens,
            dtype_bytes=torch.empty((), dtype=pool_dtype).element_size(),
            scaled=self.pool.scaled,
        )
        self.compiled = (cuda and not self.modules) if compile is None else compile
        self.cuda_graphs = cuda if cuda_graphs is None else (cuda_graphs and cuda)
        self.static_prefill = self.cuda_graphs if static_prefill is None else static_prefill
        #: Whether the scheduler should hand decode rows and prefill chunks to
        #: :meth:`mixed_step`, one forward for both (one weight pass, and for int4 one
        #: dequantization): eager, or a graph captured per (decode bucket, chunk bucket).
        #: An eager mixed forward on CUDA is launch-bound (H200, Llama-2-7B int4, 16 rows +
        #: 256 tokens: up to 75 ms against ~28 ms for a decode replay plus a prefill
        #: replay), so with graphs but no mixed graphs the scheduler keeps them apart.
        self.mixed_steps = not self.cuda_graphs or mixed_chunk_tokens > 0
        #: Prefill chunks one mixed step takes (``None``: any, in an eager forward; the
        #: static forward packs up to :data:`MIXED_PACK_CHUNKS`, each but the last on whole
        #: blocks of :attr:`mixed_pack_tokens`, :func:`~convo.fast.packing.pack_chunks`).
        self.mixed_chunks: int | None = MIXED_PACK_CHUNKS if self.static_prefill else None
        #: The block a chunk packed into a mixed step starts on (1: no blocks, eager).
        self.mixed_pack_tokens = MIXED_PACK_TOKENS if self.static_prefill else 1
        self._capture_stream: Any = None  # the side stream every capture warms up on
        self._pre: Callable[..., Any] = _pre_attention
        self._post: Callable[..., Any] = _post_attention
        #: Batch sizes the decode step is built for; a step of n rows runs in the smallest
        #: bucket >= n (extra rows repeat the first, writing the same values).
        self.buckets = sorted(set(buckets or batch_buckets(slots)))
        if self.buckets[0] < 1:
            raise ConfigError("batch buckets must be >= 1")
        #: Chunk lengths prefill is captured for (powers of two from 16 up to
        #: ``prefill_chunk_tokens``, within a slot); a chunk runs padded to the smallest
        #: bucket that holds it.
        self.prefill_buckets = chunk_buckets(prefill_chunk_tokens, slot_tokens)
        #: Chunk buckets the mixed step is captured for (with each decode bucket).
        self.mixed_buckets = mixed_buckets(prefill_chunk_tokens, slot_tokens, mixed_chunk_tokens)
        if self.compiled:
            # Each decoder compiles its own copies: dynamo keys its cache (and its limit of
            # recompiles) on the code object, which every decoder in a process would share.
            self._pre = torch.compile(_own_copy(_pre_attention), fullgraph=True, dynamic=False)
            self._post = torch.compile(_own_copy(_post_attention), fullgraph=True, dynamic=False)
        #: The elementwise parts of the static forwards (prefill and mixed graphs).
        self._static_pw = _Pointwise.compiled() if self.compiled and self.static_prefill else _EAGER
        if self.compiled:
            limit = getattr(torch._dynamo.config, "recompile_limit", None)
            if limit is not None and limit < 2 * len(self.buckets):
                torch._dynamo.config.recompile_limit = 2 * len(self.buckets)
        self._graphs: dict[int, tuple[Any, Any, Any]] = {}
        self._prefill_graphs: dict[int, tuple[Any, Any, Any]] = {}
        self._mixed_graphs: dict[tuple[int, int], tuple[Any, Any, Any]] = {}
        #: The int4 kernel each decode bucket runs ("triton", "cublas" or "tinygemm").
        self.kernel_choice: dict[int, str] = {}
        if self.quantized:
            first = next(m for m in self.layers[0].qkv if isinstance(m, Int4Linear))
            self.kernel_choice = {b: first.kernel(b) for b in self.buckets}
        #: CUDA graph captures so far (the warm-up captures one per bucket).
        self.captures = 0

    # -- weights -------------------------------------------------------------------------------
    def _layer(self, layer: Any, weights: str, group_size: int, free: bool) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = self._linear_group([attn.q_proj, attn.k_proj, attn.v_proj], weights, group_size, free)
        gate_up = self._linear_group([mlp.gate_proj, mlp.up_proj], weights, group_size, free)
        return _Layer(
            ln1=layer.input_layernorm.weight,
            ln2=layer.post_attention_layernorm.weight,
            qkv=qkv,
            o=self._linear_group([attn.o_proj], weights, group_size, free)[0],
            gate_up=gate_up,
            down=self._linear_group([mlp.down_proj], weights, group_size, free)[0],
            scale=float(getattr(attn, "scaling", self.head_dim**-0.5)),
        )

    def _linear_group(self, mods: list[Any], weights: str, group_size: int, free: bool) -> tuple[Linear, ...]:
        """One fused linear for plain modules (int4 where asked and possible), else the
        modules as they are."""
        if not all(_is_plain_linear(m) for m in mods):
            return tuple(mods)
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
            if len(mods) == 1:
                return (mods[0],)
            row = 0
            for m in mods:  # the modules now view the fused weight: no second copy
                m.weight = torch.nn.Parameter(weight[row : row + m.out_features], requires_grad=False)
                row += m.out_features
            fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
            fused.weight = torch.nn.Parameter(weight, requires_grad=False)
            if bias is not None:
                fused.bias = torch.nn.Parameter(bias, requires_grad=False)
            return (fused,)
        layout = self.int4_layout
        q = Int4Linear.quantize(weight, group_size=gs, bias=bias, dtype=self.dtype, layout=layout)  # type: ignore[arg-type]
        if free:
            for m in mods:
                m.weight = torch.nn.Parameter(m.weight.new_empty(0), requires_grad=False)
        return (q,)

    def weight_nbytes(self) -> int:
        """Bytes of the weights one decode step reads (all layers, final norm, lm_head)."""
        parts: list[Any] = [self.norm, self.lm_head]
        for layer in self.layers:
            parts += [layer.ln1, layer.ln2, layer.qkv, layer.o, layer.gate_up, layer.down]
        return tensor_nbytes(*parts)

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
        """Run ``ids[start:]`` into slot ``slot`` (its first ``start`` tokens are kept), in
        chunks of ``prefill_chunk_tokens`` with the clock checked between chunks.

        Args:
            all_logits: return the logits after every token of ``ids[start:]``
                (``[n, vocab]``, for perplexity), not only after the last.

        Returns:
            ``(logits, done)``: float32 logits ``[vocab]`` after the last token, or ``None``
            when the deadline or ``cancel`` stopped it between chunks; ``done`` is how many
            tokens of ``ids`` the slot now holds.
        """
        import torch

        if not 0 <= start < len(ids) <= self.pool.slot_tokens:
            raise ConfigError(f"prefill of {len(ids)} tokens from {start} does not fit a slot")
        pos = start
        outputs = []
        last = None
        while pos < len(ids):
            end = min(pos + self.prefill_chunk_tokens, len(ids))
            out = self.prefill_batch(
                [PrefillChunk(slot=slot, ids=ids, start=pos, end=end)], all_logits=all_logits
            )
            last = out[0]
            if all_logits:
                outputs.append(last)
            pos = end
            if pos < len(ids) and (
                (deadline is not None and time.monotonic() >= deadline)
                or (cancel is not None and cancel.is_set())
            ):
                return None, pos
        if all_logits:
            return torch.cat(outputs), pos
        return last, pos

    def prefill_batch(self, chunks: Sequence[PrefillChunk], *, all_logits: bool = False) -> list[Any]:
        """Run the chunks of several turns (each into its own slot).

        Up to :data:`PREFILL_GRAPH_MAX_CHUNKS` chunks run one by one through the static
        prefill (with ``cuda_graphs``: a replay of the graph captured for the chunk's
        length bucket, so no per-kernel launch cost). More chunks, or ``all_logits``, run
        together in one eager forward: the matrix products once over all the chunks'
        tokens, attention per chunk over its slot with SDPA (causal from the chunk's start).
        Either way dense weights multiply through cuBLAS, plain int4 through the Triton
        kernel for a few rows and dequantized once per forward (one kernel) for more.

        Returns:
            per chunk, float32 logits ``[vocab]`` after its last token (``[n, vocab]`` after
            every token with ``all_logits``).
        """
        self._check_chunks(chunks)
        if not chunks:
            return []
        if self.static_prefill and not all_logits and len(chunks) <= PREFILL_GRAPH_MAX_CHUNKS:
            plans = [static_pieces(c, self.prefill_buckets, self.pool.slot_tokens) for c in chunks]
            if all(p is not None for p in plans):
                return [self._prefill_static_chunk(c, p) for c, p in zip(chunks, plans, strict=True)]  # type: ignore[arg-type]
        return self._prefill_eager(chunks, all_logits)

    def _check_chunks(self, chunks: Sequence[PrefillChunk]) -> None:
        for c in chunks:
            if not 0 <= c.start < c.end <= len(c.ids) or c.end > self.pool.slot_tokens:
                raise ConfigError(f"prefill of tokens {c.start}..{c.end} of {len(c.ids)} does not fit a slot")

    def _prefill_static_chunk(self, chunk: PrefillChunk, pieces: list[tuple[int, int, int]]) -> Any:
        import torch

        out = None
        with torch.inference_mode():
            for start, end, bucket in pieces:
                # Padding rows write K/V past ``end`` (inside the slot: never read before a
                # later token overwrites it) and their outputs are dropped.
                piece = PrefillChunk(slot=chunk.slot, ids=chunk.ids, start=start, end=end)
                host = _host_tensor(pack_chunks([piece], bucket, self.pool.slot_tokens))
                if bucket in self._prefill_graphs:
                    graph, inputs, result = self._prefill_graphs[bucket]
                    inputs.copy_(host, non_blocking=False)
                    graph.replay()
                    out = result.clone()
                else:
                    out = self._prefill_static(host.to(self.device), bucket)
        return out

    def _prefill_static(self, inputs: Any, tokens: int) -> Any:
        """The static-shape prefill of one chunk: ``inputs`` is its flat layout in ``tokens``
        rows (:func:`~convo.fast.packing.pack_chunks`). Attention reads the slot causally
        from position 0 (the slot and positions are device values), so every shape depends
        on ``tokens`` alone and the forward can be captured as a CUDA graph. Returns float32
        logits ``[vocab]`` after the chunk's last token."""
        return self._static_forward(None, inputs, tokens)[-1]

    def _static_forward(self, decode: Any | None, inputs: Any, tokens: int, out: Any = None) -> Any:
        """Decode rows (``decode``: ``[3, B]`` tokens, slots, positions, or ``None``) and
        prefill chunks packed in ``tokens`` rows (``inputs``: their flat layout,
        :func:`~convo.fast.packing.pack_chunks`; one chunk without rows) in one static-shape
        forward: the matrix products once over the ``B + tokens`` rows, attention per decode
        row with the split kernel and for the chunks over their slots, causally
        (:func:`~convo.fast.attention.chunk_attention`, packed blocks with rows).

        Returns:
            float32 logits: each decode row's, then each chunk's last token's
            (``[B + MIXED_PACK_CHUNKS, vocab]``); without rows ``[1, vocab]``.
        """
        import torch
        import torch.nn.functional as F

        t = tokens
        ids, chunk_positions, slots = inputs[:t], inputs[t : 2 * t], inputs[2 * t : 3 * t]
        last = inputs[3 * t :] if decode is not None else inputs[3 * t : 3 * t + 1]
        pack = self.mixed_pack_tokens if decode is not None else 0
        if pack:  # each block's slot and first position
            slot, start = slots[::pack].contiguous(), chunk_positions[::pack].contiguous()
        else:
            slot, start = slots[:1], chunk_positions[:1]
        rows = 0 if decode is None else decode.shape[1]
        if decode is None:
            positions, x = chunk_positions, F.embedding(ids, self.embed)
        else:
            positions = torch.cat([decode[2], chunk_positions])
            x = F.embedding(torch.cat([decode[0], ids]), self.embed)
            lengths = (decode[2] + 1).to(torch.int32)
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        shape = (self.heads, self.kv_heads, self.head_dim)
        pw = self._static_pw
        for i, layer in enumerate(self.layers):
            q, k, v = _pre_attention(x, layer.ln1, layer.qkv, cos, sin, (*shape, self._eps[i]), pw)
            k_cache, v_cache, sc = self._kv_layer(i)
            outs = []
            if decode is not None:
                self._store(i, decode[1], decode[2], k[:rows], v[:rows])
                a = decode_attention(q[:rows], k_cache, v_cache, decode[1], lengths, scale=layer.scale, **sc)
                outs.append(a.reshape(rows, -1))
            self._store(i, slots, chunk_positions, k[rows:], v[rows:])
            a = chunk_attention(q[rows:], k_cache, v_cache, slot, start, scale=layer.scale, pack=pack, **sc)
            outs.append(a.reshape(tokens, self.heads * self.head_dim))
            a = outs[0] if len(outs) == 1 else torch.cat(outs)
            x = _post_attention(x, a, layer.o, layer.ln2, layer.gate_up, layer.down, self._eps[i], pw)
        pick = last + rows if decode is None else torch.cat([self._positions[:rows], last + rows])
        return self._logits(_rms_norm(x.index_select(0, pick), self.norm, self.norm_eps * 1e-12), out)

    def _prefill_eager(self, chunks: Sequence[PrefillChunk], all_logits: bool) -> list[Any]:
        return self._forward_eager((), (), (), chunks, all_logits)[1]

    def _forward_eager(
        self,
        tokens: Sequence[int],
        slots: Sequence[int],
        positions: Sequence[int],
        chunks: Sequence[PrefillChunk],
        all_logits: bool = False,
    ) -> tuple[Any, list[Any]]:
        """One eager forward over decode rows (one token each, at ``positions`` of
        ``slots``) and prefill chunks together: the matrix products once over all rows;
        attention per decode row with the split kernel, per chunk with SDPA over its slot.

        Returns:
            ``(decode logits [rows, vocab] or None, per chunk logits as prefill_batch)``.
        """
        import torch
        import torch.nn.functional as F
        from torch.nn.attention.bias import causal_lower_right

        rows = len(tokens)
        sizes = [c.end - c.start for c in chunks]
        shape = (self.heads, self.kv_heads, self.head_dim)
        with torch.inference_mode():
            flat = [*tokens, *(t for c in chunks for t in c.ids[c.start : c.end])]
            where = [*positions, *(p for c in chunks for p in range(c.start, c.end))]
            host = torch.tensor([flat, where, [*slots, *[0] * sum(sizes)]], dtype=torch.long)
            dev = host.to(self.device, non_blocking=True)
            x = F.embedding(dev[0], self.embed)
            cos, sin = self.cos[dev[1]][:, None, :], self.sin[dev[1]][:, None, :]
            row_slots, row_positions = dev[2, :rows], dev[1, :rows]
            lengths = (row_positions + 1).to(torch.int32)
            masks = [None if c.start == 0 else causal_lower_right(c.end - c.start, c.end) for c in chunks]
            for i, layer in enumerate(self.layers):
                q, k, v = _pre_attention(x, layer.ln1, layer.qkv, cos, sin, (*shape, self._eps[i]))
                k_cache, v_cache, sc = self._kv_layer(i)
                outs = []
                if rows:
                    self._store(i, row_slots, row_positions, k[:rows], v[:rows])
                    a = decode_attention(
                        q[:rows], k_cache, v_cache, row_slots, lengths, scale=layer.scale, **sc
                    )
                    outs.append(a.reshape(rows, -1))
                off = rows
                for c, n, mask in zip(chunks, sizes, masks, strict=True):
                    part = slice(off, off + n)
                    outs.append(self._chunk_eager(i, c, q[part], k[part], v[part], dev[1, part], mask))
                    off += n
                a = outs[0] if len(outs) == 1 else torch.cat(outs)
                x = _post_attention(x, a, layer.o, layer.ln2, layer.gate_up, layer.down, self._eps[i])
            if all_logits:
                logits = self.lm_head(_rms_norm(x[rows:], self.norm, self.norm_eps * 1e-12)).float()
                return None, list(torch.split(logits, sizes))
            ends = [rows + sum(sizes[: j + 1]) - 1 for j in range(len(sizes))]
            pick = torch.tensor([*range(rows), *ends], device=self.device)
            h = _rms_norm(x.index_select(0, pick), self.norm, self.norm_eps * 1e-12)
            logits = self.lm_head(h).float()
            return (logits[:rows] if rows else None), list(logits[rows:].unbind(0))

    def _chunk_eager(self, i: int, c: PrefillChunk, q: Any, k: Any, v: Any, positions: Any, mask: Any) -> Any:
        """Layer ``i``'s K/V of chunk ``c`` (``[n, kv_heads, head_dim]``, at ``positions``)
        written into its slot, and the chunk's attention over the slot's first ``c.end``
        tokens, causal from ``c.start`` (``mask``: ``None`` from position 0), as
        ``[n, heads * head_dim]``: SDPA on the slot's K/V; an fp8 pool's through the chunk
        kernel on CUDA (in place), dequantized for SDPA elsewhere."""
        import torch.nn.functional as F

        k_cache, v_cache, sc = self._kv_layer(i)
        n, scale = q.shape[0], self.layers[i].scale
        if not sc:
            k_cache[c.slot, :, c.start : c.end] = k.transpose(0, 1)
            v_cache[c.slot, :, c.start : c.end] = v.transpose(0, 1)
            kc, vc = k_cache[c.slot, :, : c.end][None], v_cache[c.slot, :, : c.end][None]
        else:
            self._store(i, positions.new_full((n,), c.slot), positions, k, v)
            if q.device.type == "cuda":
                slot = positions.new_full((1,), c.slot)
                return chunk_attention(q, k_cache, v_cache, slot, positions[:1], scale=scale, **sc).reshape(
                    n, -1
                )
            kc = dequantize_kv(k_cache[c.slot, :, : c.end], sc["k_scale"][c.slot, :, : c.end], self.dtype)[
                None
            ]
            vc = dequantize_kv(v_cache[c.slot, :, : c.end], sc["v_scale"][c.slot, :, : c.end], self.dtype)[
                None
            ]
        qc, gqa = q.transpose(0, 1)[None], self.kv_heads != self.heads
        if mask is None:
            a = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            a = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=scale, enable_gqa=gqa)
        return a[0].transpose(0, 1).reshape(n, self.heads * self.head_dim)

    def mixed_step(
        self,
        tokens: Sequence[int],
        slots: Sequence[int],
        positions: Sequence[int],
        chunks: Sequence[PrefillChunk],
    ) -> tuple[Any, list[Any]]:
        """Decode one token for each row and run prefill chunks of waiting turns in the
        same forward (vLLM's mixed batch): the weights are read (and int4 dequantized)
        once for both, so a step that carries a prefill chunk costs about that chunk's
        forward, not a decode step plus it.

        With static prefill, up to :attr:`mixed_chunks` chunks that fit a mixed bucket
        (:attr:`mixed_buckets`) packed (:func:`~convo.fast.packing.packed_tokens`) run with
        the rows padded to their decode bucket and the chunks packed in the smallest such
        bucket: a replay of the graph captured for the pair (CUDA). Other steps run as a
        decode step, then :meth:`prefill_batch`; without static prefill, in one eager forward.

        Returns:
            ``(logits [rows, vocab], per chunk float32 logits [vocab] after its last token)``.
        """
        import torch

        rows = len(tokens)
        if not rows:
            raise ConfigError("a mixed step needs at least one decode row")
        if max(positions) >= self.pool.slot_tokens:
            raise ConfigError(f"position {max(positions)} is past the slot ({self.pool.slot_tokens} tokens)")
        self._check_chunks(chunks)
        if not self.static_prefill:
            return self._forward_eager(tokens, slots, positions, chunks)
        need = packed_tokens([c.end - c.start for c in chunks], self.mixed_pack_tokens)
        bucket = min((t for t in self.mixed_buckets if t >= need), default=0)
        layout = pack_chunks(chunks, bucket, self.pool.slot_tokens) if chunks and bucket else None
        if layout is None:
            logits = self.step(tokens, slots, positions)
            return logits, self.prefill_batch(chunks)
        b = self.bucket(rows)
        decode = torch.tensor([list(tokens), list(slots), list(positions)], dtype=torch.long)
        decode = torch.cat([decode, decode[:, :1].expand(3, b - rows)], dim=1)  # pad: copies of row 0
        chunk = _host_tensor(layout)
        with torch.inference_mode():
            if (b, bucket) in self._mixed_graphs:
                graph, inputs, out = self._mixed_graphs[b, bucket]
                inputs.copy_(torch.cat([decode.flatten(), chunk]), non_blocking=False)
                graph.replay()
                out = out.clone()
            else:
                out = self._static_forward(decode.to(self.device), chunk.to(self.device), bucket)
        return out[:rows], [out[b + j] for j in range(len(chunks))]

    def _mixed_static(self, inputs: Any, rows: int, tokens: int, out: Any = None) -> Any:
        """:meth:`_static_forward` over one flat input (what a mixed graph copies in):
        ``[3 * rows]`` decode inputs, then the chunks' layout (``3 * tokens`` and the lasts)."""
        return self._static_forward(inputs[: 3 * rows].view(3, rows), inputs[3 * rows :], tokens, out)

    # -- the pool's K/V ------------------------------------------------------------------------
    def _kv_layer(self, i: int) -> tuple[Any, Any, dict[str, Any]]:
        """Layer ``i``'s K and V caches, and the attention kernels' ``k_scale`` and
        ``v_scale`` keywords (empty unless the pool is fp8)."""
        pool = self.pool
        scales = {"k_scale": pool.k_scale[i], "v_scale": pool.v_scale[i]} if pool.scaled else {}
        return pool.k[i], pool.v[i], scales

    def _store(self, i: int, slots: Any, positions: Any, k: Any, v: Any) -> None:
        """Write ``k``, ``v`` ``[N, kv_heads, head_dim]`` at ``positions`` of ``slots`` of
        layer ``i`` (an fp8 pool quantizes them, :func:`~convo.fast.attention.store_kv`)."""
        pool = self.pool
        if pool.scaled:
            store_kv(pool.k[i], pool.v[i], pool.k_scale[i], pool.v_scale[i], slots, positions, k, v)
        else:
            pool.k[i][slots, :, positions] = k
            pool.v[i][slots, :, positions] = v

    # -- decode --------------------------------------------------------------------------------
    def _step(self, inputs: Any, out: Any = None) -> Any:
        """One token for each row of ``inputs`` (``[3, B]``: tokens, slots, positions);
        float32 logits ``[B, vocab]`` (in ``out``'s first rows where given)."""
        import torch
        import torch.nn.functional as F

        tokens, slots, positions = inputs[0], inputs[1], inputs[2]
        n = tokens.shape[0]
        x = F.embedding(tokens, self.embed)
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        lengths = (positions + 1).to(torch.int32)
        shape = (self.heads, self.kv_heads, self.head_dim)
        for i, layer in enumerate(self.layers):
            q, k, v = self._pre(x, layer.ln1, layer.qkv, cos, sin, (*shape, self._eps[i]))
            k_cache, v_cache, sc = self._kv_layer(i)
            self._store(i, slots, positions, k, v)
            a = decode_attention(q, k_cache, v_cache, slots, lengths, scale=layer.scale, **sc)
            x = self._post(x, a.reshape(n, -1), layer.o, layer.ln2, layer.gate_up, layer.down, self._eps[i])
        return self._logits(_rms_norm(x, self.norm, self.norm_eps * 1e-12), out)

    def _logits(self, h: Any, out: Any) -> Any:
        """float32 logits of the final hidden states ``h``: a new tensor, or the first rows
        of ``out`` (a captured graph's output is then that shared buffer)."""
        logits = self.lm_head(h)
        if out is None:
            return logits.float()
        out[: logits.shape[0]].copy_(logits)
        return out[: logits.shape[0]]

    @property
    def mixed_graphs(self) -> list[tuple[int, int]]:
        """The ``(decode bucket, chunk bucket)`` pairs a mixed step is captured for (after
        :meth:`warmup`; empty without CUDA graphs or with ``mixed_chunk_tokens=0``)."""
        return sorted(self._mixed_graphs)

    def bucket(self, rows: int) -> int:
        """The batch size a step of ``rows`` rows runs at."""
        for b in self.buckets:
            if b >= rows:
                return b
        raise ConfigError(f"{rows} rows > {self.buckets[-1]}: more rows than slots")

    def warmup(self) -> None:
        """Compile and capture the decode step for every batch bucket, the prefill for
        every chunk bucket and the mixed step for every pair of a batch bucket and a mixed
        bucket (CUDA), or run one short prefill and step (their kernels load before the
        first request). Call before any session uses the pool: warm-up writes
        the first positions of slot 0.

        Every graph is captured into one memory pool, the largest first
        (:func:`~convo.fast.graphs.capture_order`), so each reuses the blocks the ones
        before it freed: the graphs together hold about what the largest one needs, not
        the sum over buckets. The decode and mixed graphs write their logits into one
        buffer of the largest step's rows (a replay's logits are copied out at once)."""
        import torch

        self._prefill_eager([PrefillChunk(slot=0, ids=[0] * 16, start=0, end=16)], False)
        with torch.inference_mode():
            if self.quantized and self.device.type == "cuda":
                self._tune_int4()
            if self.cuda_graphs:
                self._capture_all()
            else:
                for b in self.buckets:
                    self._step(torch.zeros((3, b), dtype=torch.long, device=self.device))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        empty_device_cache()

    def _capture_all(self) -> None:
        """Capture every decode, prefill and mixed graph into one pool, largest first."""
        import torch

        pool = torch.cuda.graph_pool_handle()
        rows = self.buckets[-1] + MIXED_PACK_CHUNKS
        logits = torch.empty((rows, self.vocab_size), dtype=torch.float32, device=self.device)
        specs = [GraphSpec(rows=b) for b in self.buckets]
        specs += [GraphSpec(tokens=t) for t in self.prefill_buckets]
        specs += [GraphSpec(rows=b, tokens=t) for b in self.buckets for t in self.mixed_buckets]
        inter = sum(getattr(m, "out_features", 0) for m in self.layers[0].gate_up) // 2
        sizes = {"hidden": int(self.embed.shape[1]), "intermediate": inter, "vocab": self.vocab_size}
        for spec in capture_order(specs, **sizes):
            b, t = spec.rows, spec.tokens
            inputs = torch.zeros(
                (3, b) if not t else 3 * b + 3 * t + MIXED_PACK_CHUNKS, dtype=torch.long, device=self.device
            )
            if not t:
                graph, out = self._capture(functools.partial(self._step, inputs, logits), pool)
                self._graphs[b] = (graph, out, inputs)
                continue
            inputs[-MIXED_PACK_CHUNKS:] = t - 1
            if not b:
                graph, out = self._capture(functools.partial(self._prefill_static, inputs, t), pool)
                self._prefill_graphs[t] = (graph, inputs, out)
            else:
                graph, out = self._capture(functools.partial(self._mixed_static, inputs, b, t, logits), pool)
                self._mixed_graphs[b, t] = (graph, inputs, out)

    def _tune_int4(self) -> None:
        """Run each int4 weight shape once at every power-of-two row count its kernels
        see (decode buckets, mixed steps, short chunks), so the Triton kernel picks its
        launch settings now, not during a request."""
        seen = set()
        for layer in self.layers:
            for m in (*layer.qkv, layer.o, *layer.gate_up, layer.down):
                if isinstance(m, Int4Linear) and (m.in_features, m.out_features) not in seen:
                    seen.add((m.in_features, m.out_features))
                    for rows in (1 << i for i in range(W4_KERNEL_MAX_ROWS.bit_length())):
                        m(self.embed.new_zeros((rows, m.in_features)))

    def _capture(self, fn: Callable[[], Any], pool: Any) -> tuple[Any, Any]:
        """:func:`~convo.fast.graphs.capture` on the decoder's one side stream: cuBLAS
        keeps a workspace per stream it runs on, and blocks freed on a stream are cached
        for that stream alone, so a fresh stream per capture (PyTorch cycles through 32)
        held ~1.1 GiB more on an H200 (Llama-2-7B int4, 42 captures: 32 MiB each, kept)."""
        import torch

        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        self.captures += 1
        return capture(fn, self._capture_stream, pool, WARMUP_EAGER_RUNS)

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
            if rows < b and (self.compiled or self.cuda_graphs):  # pad with copies of row 0:
                host = torch.cat([host, host[:, :1].expand(3, b - rows)], dim=1)  # same values
            if not self.cuda_graphs:
                return self._step(host.to(self.device))[:rows]
            if b not in self._graphs:
                raise ConfigError("warmup() first: the decode step is captured at start")
            graph, out, inputs = self._graphs[b]
            inputs.copy_(host, non_blocking=False)
            graph.replay()
            return out[:rows].clone()  # the buffer is shared with the other steps' graphs


def _host_tensor(values: list[int]) -> Any:
    """An int64 CPU tensor of ``values`` (through numpy: ~7x faster than ``torch.tensor`` on
    a list of a mixed step's ~800 ints, which the step waits for)."""
    return torch.from_numpy(np.array(values, dtype=np.int64))
