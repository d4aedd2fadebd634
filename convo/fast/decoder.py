"""The static decoder: a Llama-family model over the KV slot pool, prefill and a captured step."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from convo.engines.base import empty_device_cache
from convo.errors import ConfigError
from convo.fast.int4 import (
    Linear,
    _dense_linear,
    _dense_linears,
    _linear,
    _linears,
    int4_group_size,
    quantize_int4,
)
from convo.fast.kernels import _interpreting, _w4_op, decode_attention
from convo.fast.kv_pool import KVSlotPool

#: Model types whose decoder layers :class:`StaticDecoder` knows how to run.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})


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


def _pre_attention_dense(
    x: Any, ln: Any, qkv: tuple[Linear, ...], cos: Any, sin: Any, shape: tuple[int, ...]
) -> Any:
    """:func:`_pre_attention` for many rows (prefill): plain int4 dequantized, then cuBLAS."""
    heads, kv_heads, dim, eps_pico = shape
    h = _rms_norm(x, ln, eps_pico * 1e-12)
    out = _dense_linears(h, qkv)
    n = x.shape[0]
    q = out[:, : heads * dim].view(n, heads, dim)
    k = out[:, heads * dim : (heads + kv_heads) * dim].view(n, kv_heads, dim)
    v = out[:, (heads + kv_heads) * dim :].reshape(n, kv_heads, dim)
    return _rope(q, cos, sin), _rope(k, cos, sin), v


def _post_attention_dense(
    x: Any, attn: Any, o: Linear, ln: Any, gate_up: tuple[Linear, ...], down: Linear, eps_pico: int
) -> Any:
    """:func:`_post_attention` for many rows (prefill)."""
    import torch.nn.functional as F

    x = x + _dense_linear(attn, o)
    h = _rms_norm(x, ln, eps_pico * 1e-12)
    gate, up = _dense_linears(h, gate_up).chunk(2, dim=-1)
    return x + _dense_linear(F.silu(gate) * up, down)


@dataclass(frozen=True)
class PrefillChunk:
    """Tokens ``ids[start:end]`` of one turn, to run into slot ``slot`` (which holds
    ``ids[:start]`` already)."""

    slot: int
    ids: Sequence[int]
    start: int
    end: int


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
            (convo's W4A16 kernel over a plain layout), or ``"auto"`` (default): on CUDA
            with Triton both are captured at warm-up and each batch bucket keeps the
            faster (tinygemm's layout is dropped when no bucket uses it); elsewhere
            tinygemm. On CUDA with Triton the plain layout is always kept: prefill
            dequantizes it, one layer weight at a time, for cuBLAS.

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
        # On CUDA int4 weights also keep the plain layout: prefill dequantizes it for cuBLAS
        # (tinygemm is slow on hundreds of rows), and the Triton decode kernel reads it.
        self._plain_candidate = weights == "int4" and on_cuda and _w4_op() is not None
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
        """One forward over the chunks of several turns together (each into its own slot).

        The matrix products run once over all the chunks' tokens: dense weights through
        cuBLAS, plain int4 dequantized once per layer (one kernel) and then cuBLAS, modules
        (bitsandbytes) called once per layer. Attention runs per chunk over its slot with
        SDPA (causal from the chunk's start: flash or memory-efficient kernels).

        Returns:
            per chunk, float32 logits ``[vocab]`` after its last token (``[n, vocab]`` after
            every token with ``all_logits``).
        """
        import torch
        import torch.nn.functional as F
        from torch.nn.attention.bias import causal_lower_right

        if not chunks:
            return []
        for c in chunks:
            if not 0 <= c.start < c.end <= len(c.ids) or c.end > self.pool.slot_tokens:
                raise ConfigError(f"prefill of tokens {c.start}..{c.end} of {len(c.ids)} does not fit a slot")
        sizes = [c.end - c.start for c in chunks]
        shape = (self.heads, self.kv_heads, self.head_dim)
        gqa = self.kv_heads != self.heads
        with torch.inference_mode():
            flat = [t for c in chunks for t in c.ids[c.start : c.end]]
            positions = [p for c in chunks for p in range(c.start, c.end)]
            host = torch.tensor([flat, positions], dtype=torch.long)
            dev = host.to(self.device, non_blocking=True)
            x = F.embedding(dev[0], self.embed)
            cos, sin = self.cos[dev[1]][:, None, :], self.sin[dev[1]][:, None, :]
            masks = [None if c.start == 0 else causal_lower_right(c.end - c.start, c.end) for c in chunks]
            for i, layer in enumerate(self._layer_set(alt=True)):
                q, k, v = _pre_attention_dense(x, layer.ln1, layer.qkv, cos, sin, (*shape, self._eps[i]))
                k_cache, v_cache = self.pool.k[i], self.pool.v[i]
                outs = []
                off = 0
                for c, n, mask in zip(chunks, sizes, masks, strict=True):
                    k_cache[c.slot, :, c.start : c.end] = k[off : off + n].transpose(0, 1)
                    v_cache[c.slot, :, c.start : c.end] = v[off : off + n].transpose(0, 1)
                    qc = q[off : off + n].transpose(0, 1)[None]
                    kc, vc = k_cache[c.slot, :, : c.end][None], v_cache[c.slot, :, : c.end][None]
                    if mask is None:
                        a = F.scaled_dot_product_attention(
                            qc, kc, vc, is_causal=True, scale=layer.scale, enable_gqa=gqa
                        )
                    else:
                        a = F.scaled_dot_product_attention(
                            qc, kc, vc, attn_mask=mask, scale=layer.scale, enable_gqa=gqa
                        )
                    outs.append(a[0].transpose(0, 1).reshape(n, self.heads * self.head_dim))
                    off += n
                a = outs[0] if len(outs) == 1 else torch.cat(outs)
                x = _post_attention_dense(x, a, layer.o, layer.ln2, layer.gate_up, layer.down, self._eps[i])
            if all_logits:
                logits = _dense_linear(_rms_norm(x, self.norm, self.norm_eps * 1e-12), self.lm_head).float()
                return list(torch.split(logits, sizes))
            last = torch.tensor([sum(sizes[: j + 1]) - 1 for j in range(len(sizes))], device=self.device)
            h = _rms_norm(x.index_select(0, last), self.norm, self.norm_eps * 1e-12)
            logits = _dense_linear(h, self.lm_head).float()
            return list(logits.unbind(0))

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
        """Compile and capture the step for every batch bucket, and run one short prefill
        (its kernels load before the first request). Call before any session uses the pool:
        warm-up writes the first positions of slot 0."""
        import torch

        self.prefill_batch([PrefillChunk(slot=0, ids=[0] * 16, start=0, end=16)])
        has_alt = self.layers[0].alt is not None
        if not has_alt or self.int4_kernel == "tinygemm":
            variants = [False]
        else:
            variants = [False, True] if self.int4_kernel == "auto" else [True]
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
        """Free tinygemm's layout when no bucket chose it (the plain layout stays: prefill
        dequantizes it)."""
        import dataclasses as dc

        used = set(self.kernel_choice.values())
        if used == {"triton"}:
            self.layers = [dc.replace(layer.alt, alt=None) for layer in self.layers if layer.alt is not None]
            self._graphs = {b: (g, i, o, False) for b, (g, i, o, _) in self._graphs.items()}
        empty_device_cache()

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
