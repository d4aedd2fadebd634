"""The VRAM model of a transformers causal LM: weights, KV cache, activations, allocator.

The planner predicts the peak GPU memory of ``generate`` for a batch of ``concurrency``
rows of ``context`` tokens each (prompt + new tokens), without loading any weights::

    peak reserved ┌──────────────────────────────────────────────────────────────┐
                  │ allocator slack: freed blocks the caching allocator keeps    │
    peak alloc.   ├──────────────────────────────────────────────────────────────┤
                  │ activations: prefill MLP/attention temporaries, workspace    │
                  ├──────────────────────────────────────────────────────────────┤
                  │ KV cache: 2 * layers * kv_heads * head_dim * tokens * rows   │
                  ├──────────────────────────────────────────────────────────────┤
                  │ weights: measured per module on the meta device              │
                0 └──────────────────────────────────────────────────────────────┘

Where the numbers come from:

* **Weights** are summed module by module over the model built on the ``meta`` device
  (no memory, no download; :mod:`convo.planner.weights`).
* **KV cache** honours ``head_dim``, GQA/MQA (``num_key_value_heads``), sliding-window
  layers (Mistral ``sliding_window``, Gemma/Qwen ``layer_types``) and the KV dtype. A
  sliding layer keeps ``window`` tokens once decoding starts, but transformers'
  ``DynamicSlidingWindowLayer`` keeps the whole prefill alive as a view until the first
  decode step, so the *prefill* peak counts every prompt token.
* **Activations** (analytic, per prompt token of all rows, during prefill; fitted to the
  H200 measurements in ``shared/docs/ANCHORS.md``)::

      prefill  ≈ tokens * dtype * (3 * intermediate + 4 * hidden)     # gate/up/product +
                                                                        # residual, norm, q/k/v
               + eager only: rows * heads * prompt² * 10 bytes         # bf16 scores, masked
                                                                        # copy, fp32 softmax, cast
               + workspace (largest dequantized nf4 weight + 32 MiB cuBLAS)
      decode   ≈ one layer's K tensor (torch.cat copy) + logits rows * vocab * 8 bytes

  HF ``generate`` computes logits for the last position only (``logits_to_keep=1``), so
  the ``tokens * vocab * 4`` logits term of a training forward does not appear.
* **Reserved**: the caching allocator keeps freed blocks, so the pool that OOMs first is
  *reserved*, not allocated. Measured on an H200 (ANCHORS): reserved above the weights is
  1.3-1.75x the allocated peak above the weights. A calibration run (``convo plan
  --measure``) replaces these constants with measured ones, cached as JSON under
  ``<cache>/calibration/`` (:func:`convo.paths.cache_dir`; read only on demand).

Nothing here imports torch or transformers at import time.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from convo.errors import ConfigError
from convo.models.defaults import (
    DEFAULT_STEP_TOKENS,
    FP8_KV_SCALE_BYTES,
    MIXED_CHUNK_TOKENS,
    MIXED_PACK_CHUNKS,
    PREFILL_GRAPH_TOKENS,
    auto_kv_slots,
    batch_buckets,
    chunk_buckets,
    fp8_kv_bytes_per_token,
    kv_pool_bytes,
    mixed_buckets,
)
from convo.models.quant import INT4_GROUP_SIZE, Quant
from convo.models.spec import Attn, DType, ModelShape, load_config
from convo.models.units import MiB, format_size
from convo.planner.allocator import reserved_bytes, segment_bytes
from convo.planner.calibration import Calibration
from convo.planner.weights import INT4_CUDA_LAYOUTS, WeightReport, planned_quant, round_alloc, weight_bytes


@dataclass(frozen=True, kw_only=True)
class CellPrediction:
    """Predicted peak of ``concurrency`` requests of ``context`` tokens each.

    Without KV slots that is one ``generate`` call of ``concurrency`` rows, each with its own
    growing KV cache. With ``kv_slots`` (the static decoder of ``convo serve``) the KV memory
    is the slot pool, taken once whatever the concurrency: ``running`` requests (at most one
    per slot) decode together and the other ``queued`` ones wait for a slot, so they cost
    time, not memory.

    All byte counts are for the whole batch; ``peak_*`` include the weights.
    ``headroom_bytes`` is the device memory minus ``peak_reserved_bytes`` (negative: over).
    A context beyond the model's own window is never safe: ``reason`` says so.
    """

    context: int
    concurrency: int
    prompt_tokens: int
    new_tokens: int
    weights_bytes: int
    kv_bytes: int
    activation_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    phase: str  # "prefill" or "decode": where the peak is; "slots" with a KV slot pool
    safe: bool | None = None
    headroom_bytes: int | None = None
    kv_slots: int | None = None
    running: int = 0  # requests decoding at once (all of them without slots)
    queued: int = 0  # requests waiting for a free slot
    #: Why the cell cannot run whatever the memory (``safe`` is then False), e.g.
    #: ``"model max 4096"``: the context is beyond the model's ``max_position_embeddings``.
    reason: str | None = None

    def __post_init__(self) -> None:
        if not self.running:
            object.__setattr__(self, "running", self.concurrency - self.queued)


@functools.cache
def _has_triton() -> bool:
    """Whether Triton is installed (the static decoder's kernels run), looked up once."""
    return importlib.util.find_spec("triton") is not None


# The CUDA caching allocator: blocks <= 1 MiB come from 2 MiB segments, < 10 MiB from
# 20 MiB segments, larger ones get their own segment rounded up to 2 MiB. Segments never
# merge, so a KV tensor that outgrows its segment during decode needs a new one while the
# old one stays cached ("a generation"): with a 2 MiB-aligned prefill KV (e.g. batch 16)
# the reserved pool ends at ~2x KV, 1.65x the allocated peak (ANCHORS: 1.6-1.75x).
_SMALL_SIZE = 1 * MiB
_MIN_LARGE_ALLOC = 10 * MiB
_ROUND_LARGE = 2 * MiB


def _segment_bytes(nbytes: int) -> int:
    if nbytes <= _SMALL_SIZE:
        return 2 * MiB
    if nbytes < _MIN_LARGE_ALLOC:
        return 20 * MiB
    return -(-nbytes // _ROUND_LARGE) * _ROUND_LARGE


def kv_generations(bytes_per_token: float, prompt_tokens: int, new_tokens: int) -> int:
    """How many times a per-layer KV tensor outgrows its allocator segment while decoding.

    Args:
        bytes_per_token: bytes one token adds to one layer's K tensor (all rows).
        prompt_tokens: tokens after prefill.
        new_tokens: generated tokens (the cache grows by ``new_tokens - 1``).

    Returns:
        The number of new segment generations (0 when the prefill segment has room).
    """
    gens = 0
    seg = _segment_bytes(round_alloc(bytes_per_token * prompt_tokens))
    for t in range(prompt_tokens + 1, prompt_tokens + max(new_tokens, 1)):
        need = round_alloc(bytes_per_token * t)
        if need > seg:
            gens += 1
            seg = _segment_bytes(need)
    return gens


class _Cell(NamedTuple):
    """A cell asked of :meth:`VRAMModel.predict`: its requests' shape, and the device
    memory it must fit (``None``: not checked)."""

    context: int
    concurrency: int
    prompt: int
    new: int
    memory_bytes: int | None


@dataclass(frozen=True, kw_only=True)
class VRAMModel:
    """Everything needed to price requests: shape, weights, dtypes, calibration.

    Example::

        mm = VRAMModel.from_model("random:llama-2-7b", quant="nf4")
        mm.predict(context=4096, concurrency=4).peak_reserved_bytes / 2**30   # ~16-20 GiB
        mm.request_bytes(prompt_tokens=1000, max_new_tokens=256)              # KV + share

    Args:
        shape: the model's shape.
        weights: the weight report.
        compute_dtype: dtype of activations (bf16 for nf4 with bf16 compute).
        kv_dtype: KV cache dtype (``fp8``: convo's fp8 slots, float8 e4m3 with a float32
            scale per token and head, :data:`~convo.models.defaults.FP8_KV_SCALE_BYTES`).
        attn: attention implementation.
        calibration: the activation/allocator constants.
        quant: the weight quantization (decides the dequantization workspace); dense
            formats are ``NONE`` here (see :func:`planned_quant`).
        int4_group_size: with ``quant=int4``, the preferred inputs per scale/zero pair.
        int4_layouts: with ``quant=int4``, copies of the int4 weights (:data:`INT4_CUDA_LAYOUTS`).
    """

    shape: ModelShape
    weights: WeightReport
    compute_dtype: DType = DType.BF16
    kv_dtype: DType = DType.BF16
    attn: Attn = Attn.SDPA
    calibration: Calibration = field(default_factory=Calibration)
    quant: Quant = Quant.NONE
    int4_group_size: int = INT4_GROUP_SIZE
    int4_layouts: int = INT4_CUDA_LAYOUTS

    @classmethod
    def from_model(
        cls,
        model: str,
        *,
        quant: Quant | str = Quant.NONE,
        dtype: DType | str | None = None,
        kv_dtype: DType | str | None = None,
        attn: Attn | str = Attn.SDPA,
        calibration: Calibration | None = None,
        weights_method: str = "auto",
        int4_group_size: int = INT4_GROUP_SIZE,
        int4_layouts: int = INT4_CUDA_LAYOUTS,
    ) -> VRAMModel:
        """Build from a model name/folder/config.json (see :func:`load_config`).

        ``quant`` is any :class:`~convo.models.quant.Quant` spelling; dense ones price as
        ``NONE`` in their dtype (see :func:`planned_quant`), ``int4`` in groups of
        ``int4_group_size`` inputs, ``int4_layouts`` copies (see :func:`weight_bytes`).
        """
        return cls.from_config(
            load_config(model),
            quant=quant,
            dtype=dtype,
            kv_dtype=kv_dtype,
            attn=attn,
            calibration=calibration,
            weights_method=weights_method,
            int4_group_size=int4_group_size,
            int4_layouts=int4_layouts,
        )

    @classmethod
    def from_config(
        cls,
        cfg: Mapping[str, Any],
        *,
        quant: Quant | str = Quant.NONE,
        dtype: DType | str | None = None,
        kv_dtype: DType | str | None = None,
        attn: Attn | str = Attn.SDPA,
        calibration: Calibration | None = None,
        weights_method: str = "auto",
        int4_group_size: int = INT4_GROUP_SIZE,
        int4_layouts: int = INT4_CUDA_LAYOUTS,
    ) -> VRAMModel:
        """Build from a config dict (a ``config.json``'s contents); the other arguments are
        :meth:`from_model`'s."""
        shape = ModelShape.from_config(cfg)
        q, dt_given = planned_quant(quant, dtype)
        dt = dt_given or (DType.BF16 if q is Quant.INT4 else shape.dtype)
        if dt.nbytes < 2:
            raise ConfigError("--dtype is the dtype of unquantized weights: fp32, bf16 or fp16")
        return cls(
            shape=shape,
            weights=weight_bytes(
                cfg, q, dt, method=weights_method, group_size=int4_group_size, int4_layouts=int4_layouts
            ),
            compute_dtype=dt,
            kv_dtype=DType.parse(kv_dtype) if kv_dtype is not None else dt,
            attn=Attn.parse(attn),
            calibration=calibration or Calibration(),
            quant=q,
            int4_group_size=int4_group_size,
            int4_layouts=int4_layouts,
        )

    # -- parts ------------------------------------------------------------------------

    def kv_bytes_per_token(self) -> int:
        """KV bytes per token across layers, in ``kv_dtype`` (fp8: with its scales, as the
        slot pool stores them, :func:`~convo.models.defaults.fp8_kv_bytes_per_token`)."""
        if self.kv_dtype is DType.FP8:
            s = self.shape
            return fp8_kv_bytes_per_token(
                num_layers=s.num_layers, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim
            )
        return self.shape.kv_bytes_per_token(self.kv_dtype)

    def kv_pool_bytes(self, slots: int, slot_tokens: int) -> int:
        """The static KV slot pool (:class:`convo.fast.kv_pool.KVSlotPool`): ``slots`` caches of
        ``slot_tokens`` tokens, taken once at load; an fp8 pool adds its bfloat16 scale per
        token and head. Exact: the pool is these bytes (checked against
        ``torch.cuda.memory_allocated`` in the decode tests and benchmark)."""
        s = self.shape
        return kv_pool_bytes(
            num_layers=s.num_layers,
            num_kv_heads=s.num_kv_heads,
            head_dim=s.head_dim,
            slots=slots,
            slot_tokens=slot_tokens,
            dtype_bytes=self.kv_dtype.nbytes,
            scale_bytes=FP8_KV_SCALE_BYTES if self.kv_dtype is DType.FP8 else 0,
        )

    def auto_kv_slots(self, memory_bytes: int, slot_tokens: int) -> int:
        """The slots ``TransformersEngine(kv_slots=None)`` takes on a CUDA device of
        ``memory_bytes``: :data:`~convo.models.defaults.DEFAULT_KV_SLOTS`, or fewer
        when they do not fit in :data:`~convo.models.defaults.AUTO_SLOTS_MEMORY_FRACTION`
        of the memory free after loading (``int4``: the quantized weights); at least 1."""
        free = memory_bytes - max(self.weights_reserved_bytes(slot_tokens), self.weights.loaded_bytes)
        return max(1, auto_kv_slots(free, self.kv_pool_bytes(1, slot_tokens)))

    def act_bytes_per_token(self) -> float:
        """Prefill activation bytes per prompt token (all rows), SDPA."""
        c = self.calibration
        s = self.shape
        return self.compute_dtype.nbytes * (
            c.act_intermediate_factor * s.intermediate_size + c.act_hidden_factor * s.hidden_size
        )

    def weights_reserved_bytes(self, slot_tokens: int | None = None) -> int:
        """What the caching allocator reserves for the weights once loaded, before the KV
        pool. Where the weights report models it (``int4``: the tensors kept, in loading
        order, :attr:`~convo.planner.weights.WeightReport.load_sequence`), that sequence
        continues with what the static decoder allocates next (its rotary tables for
        ``slot_tokens`` tokens with their float32 temporaries, counted as kept: an upper
        bound) and the cuBLAS workspace its first matmul takes, packed by
        :func:`convo.planner.allocator.reserved_bytes`; elsewhere the weights' bytes
        times the calibration's ``weights_reserved_ratio``."""
        w = self.weights
        if not w.load_sequence:
            return int(w.total_bytes * self.calibration.weights_reserved_ratio)
        tables = _rotary_table_sizes(slot_tokens or 0, self.shape.head_dim, self.compute_dtype.nbytes)
        return reserved_bytes([*w.load_sequence, *tables, self.calibration.workspace_bytes])

    def workspace_bytes(self) -> int:
        """Constant prefill temporaries: cuBLAS workspace + one dequantized weight."""
        deq = 0
        if not self.quant.is_dense:
            deq = int(self.weights.largest_linear_params * self.compute_dtype.nbytes)
        return self.calibration.workspace_bytes + deq

    def prefill_activation_bytes(self, prompt_tokens: int, batch: int) -> int:
        """Peak activation bytes of the prefill forward (excluding KV)."""
        n = prompt_tokens * batch
        act = n * self.act_bytes_per_token()
        if self.attn is Attn.EAGER:
            scores = batch * self.shape.num_heads * prompt_tokens**2
            act += scores * self.calibration.eager_bytes_per_score
        return int(act) + self.workspace_bytes()

    def decode_activation_bytes(self, tokens: int, batch: int) -> int:
        """Peak activation bytes of one decode step at ``tokens`` tokens per row."""
        s = self.shape
        layer_k = self.shape.kv_bytes(tokens, batch, self.kv_dtype) / (2 * s.num_layers)
        logits = batch * s.vocab_size * (self.compute_dtype.nbytes + 4 + 4)
        act = batch * self.act_bytes_per_token()
        if self.attn is Attn.EAGER:
            act += batch * s.num_heads * tokens * self.calibration.eager_bytes_per_score
        return int(layer_k + logits + act) + self.workspace_bytes()

    def request_bytes(self, prompt_tokens: int, max_new_tokens: int, *, share: int = 1) -> int:
        """What one request costs while it runs: KV of prompt + reply, plus activations.

        Args:
            prompt_tokens: prompt length.
            max_new_tokens: reply cap.
            share: the activations of a prefill are shared by the rows of a batch;
                1 charges the request its full prefill activations (safe).

        Returns:
            Bytes above the weights (allocated, not reserved).
        """
        total = prompt_tokens + max_new_tokens
        kv = max(
            self.shape.kv_bytes(total, 1, self.kv_dtype),
            self.shape.kv_bytes(prompt_tokens, 1, self.kv_dtype, cap_windows=False),
        )
        act = self.prefill_activation_bytes(prompt_tokens, 1) - self.workspace_bytes()
        return int(kv + act / max(share, 1))

    def reserved_above_weights(
        self,
        *,
        prefill_above: int,
        kv_prefill: int,
        kv_final: int,
        prompt_tokens: int,
        new_tokens: int,
        batch: int,
        decode_above: int,
    ) -> int:
        """The caching allocator's reserved pool above the weights, at its peak.

        ::

            after prefill   | KV (prefill) | freed activations (cached) |   = ratio * alloc
            decode, no room | KV (prefill, stale) | KV (new segments)  |   = ~2 x KV

        The prefill leaves ``prefill_reserved_ratio`` times its allocated peak reserved.
        If the per-layer KV tensors outgrow their segments while decoding (see
        :func:`kv_generations`), a second copy of the KV is reserved, minus what the
        cached activations can absorb. Only one such generation is counted: when
        ``cudaMalloc`` fails, PyTorch frees stale cached segments and retries, so under
        memory pressure older generations do not add up (on an idle GPU they can).
        """
        c = self.calibration
        prefill_res = prefill_above * c.prefill_reserved_ratio
        layers_with_kv = sum(1 for _ in self.shape.sliding_windows) or 1
        per_tensor_token = batch * self.shape.num_kv_heads * self.shape.head_dim * self.kv_dtype.nbytes
        gens = kv_generations(per_tensor_token, prompt_tokens, new_tokens)
        if gens == 0 or layers_with_kv == 0:
            return int(max(prefill_res, decode_above))
        return int(max(prefill_res, kv_prefill + kv_final + (decode_above - kv_final)))

    def admission_budget_bytes(
        self, memory_bytes: int, *, reserved_ratio: float = 1.7, headroom_bytes: int = 0
    ) -> int:
        """The ``kv_budget_bytes`` for an admission controller on a device of this size.

        ::

            | weights (reserved) | workspace | requests' KV + activations x ratio | headroom |
            |<---------------------------- memory_bytes ------------------------------------>|

        Args:
            memory_bytes: device memory the process may use.
            reserved_ratio: reserved/allocated above the weights to plan for: 1.3 after a
                prefill, up to ~2 while KV tensors move to bigger segments (the allocator
                frees stale ones only when ``cudaMalloc`` fails). Default 1.7.
            headroom_bytes: kept free for anything else (CUDA graphs, other tensors).

        Returns:
            Bytes the sum of :meth:`request_bytes` of admitted requests may reach.

        Raises:
            ConfigError: the weights alone do not fit.
        """
        if reserved_ratio < 1.0:
            raise ConfigError("reserved_ratio must be >= 1")
        fixed = self.weights_reserved_bytes()
        fixed += self.workspace_bytes() * reserved_ratio + headroom_bytes
        room = (memory_bytes - fixed) / reserved_ratio
        if room <= 0:
            raise ConfigError(
                f"the weights ({format_size(self.weights.total_bytes)}) leave no room in "
                f"{format_size(memory_bytes)}; quantize (--quant nf4) or use a bigger device"
            )
        return int(room)

    # -- the whole batch ---------------------------------------------------------------

    def predict(
        self,
        *,
        context: int,
        concurrency: int,
        new_tokens: int = 256,
        memory_bytes: int | None = None,
        kv_slots: int | None = None,
        step_tokens: int | None = None,
    ) -> CellPrediction:
        """Predict the peak of ``concurrency`` requests of ``context`` tokens.

        Args:
            context: tokens per row, prompt + new tokens.
            concurrency: requests in flight (rows of one ``generate`` without slots).
            new_tokens: generated tokens per row (the prompt is ``context - new_tokens``).
            memory_bytes: the device memory; sets ``safe`` (peak reserved fits, and the
                weights' load peak too) and ``headroom_bytes``.
            kv_slots: price the static decoder instead (``convo serve`` with KV slots): a
                pool of ``kv_slots`` slots of ``context`` tokens (:meth:`kv_pool_bytes`),
                prefill of the waiting turns in one forward of up to ``step_tokens`` tokens,
                a captured step per batch bucket.
            step_tokens: with ``kv_slots``, the scheduler's token budget per step
                (default :data:`convo.models.defaults.DEFAULT_STEP_TOKENS`, the engine's).

        Returns:
            A :class:`CellPrediction`.
        """
        if context <= 0 or concurrency <= 0 or new_tokens < 0:
            raise ConfigError("context and concurrency must be positive, new_tokens >= 0")
        new = min(new_tokens, context - 1)
        prompt = context - new
        cell = _Cell(context, concurrency, prompt, new, memory_bytes)
        if kv_slots is not None:
            return self._predict_slots(cell, kv_slots, step_tokens)
        kv_dt = self.kv_dtype
        kv_prefill = self.shape.kv_bytes(prompt, concurrency, kv_dt, cap_windows=False)
        prefill = kv_prefill + self.prefill_activation_bytes(prompt, concurrency)
        kv_final = self.shape.kv_bytes(context, concurrency, kv_dt)
        decode = kv_final + self.decode_activation_bytes(context, concurrency)
        if prefill >= decode:
            phase, kv, above = "prefill", kv_prefill, prefill
        else:
            phase, kv, above = "decode", kv_final, decode
        kv = max(kv_prefill, kv_final)
        reserved_above = self.reserved_above_weights(
            prefill_above=prefill,
            kv_prefill=kv_prefill,
            kv_final=kv_final,
            prompt_tokens=prompt,
            new_tokens=new,
            batch=concurrency,
            decode_above=decode,
        )
        return self._prediction(
            cell, kv=kv, activations=above - kv, reserved_above=reserved_above, phase=phase
        )

    def _prediction(
        self, cell: _Cell, *, kv: int, activations: int, reserved_above: float, phase: str, **slots: int
    ) -> CellPrediction:
        """A cell's prediction from its bytes above the weights: ``kv`` and ``activations``
        allocated, ``reserved_above`` reserved (the weights' reserve is added here); whether
        it is safe under the cell's ``memory_bytes`` (peak reserved fits, and the weights'
        load peak too) and the headroom left. ``slots``: a static-decoder cell's fields."""
        weights = self.weights.total_bytes
        reserved = int(self.weights_reserved_bytes(cell.context) + reserved_above)
        memory_bytes = cell.memory_bytes
        safe = None
        if memory_bytes is not None:
            safe = reserved <= memory_bytes and self.weights.load_peak_bytes <= memory_bytes
        reason = None
        if cell.context > self.shape.max_position_embeddings:
            safe, reason = False, f"model max {self.shape.max_position_embeddings}"
        return CellPrediction(
            context=cell.context,
            concurrency=cell.concurrency,
            prompt_tokens=cell.prompt,
            new_tokens=cell.new,
            weights_bytes=weights,
            kv_bytes=kv,
            activation_bytes=activations,
            peak_allocated_bytes=weights + kv + activations,
            peak_reserved_bytes=reserved,
            phase=phase,
            safe=safe,
            headroom_bytes=None if memory_bytes is None else memory_bytes - reserved,
            reason=reason,
            **slots,
        )

    def _predict_slots(self, cell: _Cell, kv_slots: int, step_tokens: int | None) -> CellPrediction:
        """The static decoder: weights + the slot pool + one step's prefill activations
        (the running turns' prompts, up to ``step_tokens`` tokens in one forward, with one
        dequantized int4 weight) + the captured graphs' pool (the decode step per batch
        bucket 1, 2, 4... >= slots, the prefill per chunk bucket up to
        :data:`PREFILL_GRAPH_TOKENS`, the mixed step per pair up to
        :data:`~convo.models.defaults.MIXED_CHUNK_TOKENS`; captured into one pool, largest
        first, so it holds the largest graph's temporaries and the shared logits buffer;
        without Triton, the chunk's attention reads a gathered copy of the slot under a
        mask, counted then) + the warm-up's eager run of the largest graph.

        Measured on an H200 (Llama-2-7B int4 group 32, 4 slots of 4096 tokens): pool exact;
        weights 8.68 GB with both int4 layouts (predicted -0.7 %), 4.62 GB with tinygemm's
        alone (-1.1 %); captured steps 135 MB and a 3,840-token prefill of the earlier
        one-turn, 512-token-chunk decoder 88 MB above them (predicted together 0.37 GB).
        """
        if step_tokens is None:
            step_tokens = DEFAULT_STEP_TOKENS
        if kv_slots < 1 or step_tokens < 1:
            raise ConfigError("kv_slots and step_tokens must be >= 1")
        s = self.shape
        pool = self.kv_pool_bytes(kv_slots, cell.context)
        running = min(cell.concurrency, kv_slots)
        tokens = min(step_tokens, running * cell.prompt)
        prefill = int(tokens * self.act_bytes_per_token()) + self.workspace_bytes()
        rows = batch_buckets(kv_slots)[-1]  # the widest decode step
        chunks = chunk_buckets(PREFILL_GRAPH_TOKENS, cell.context)
        chunk = chunks[-1]
        mixed = max(mixed_buckets(PREFILL_GRAPH_TOKENS, cell.context, MIXED_CHUNK_TOKENS), default=0)
        logit_bytes = s.vocab_size * self.compute_dtype.nbytes
        act = self.act_bytes_per_token()
        # The graphs share one pool, captured largest first (convo.fast.graphs): it holds the
        # largest graph's temporaries (the prefill chunk, the widest mixed step or the
        # widest decode step, each with its logits and one dequantized int4 weight), the
        # float32 logits buffer of the decode and mixed graphs, and one prefill output per
        # chunk bucket. The capture stream takes a cuBLAS workspace of its own.
        temporaries = (
            max(
                chunk * act,
                (rows + mixed) * act + (rows + MIXED_PACK_CHUNKS) * logit_bytes if mixed else 0,
                rows * (act + logit_bytes),
            )
            + self.workspace_bytes()
        )
        outputs = ((rows + MIXED_PACK_CHUNKS) + len(chunks)) * s.vocab_size * 4
        graphs = int(temporaries + outputs + self.calibration.workspace_bytes)
        gather = 0
        if not _has_triton():  # no chunk-attention kernel: SDPA over a gathered slot
            slot_view = 2 * cell.context * s.num_heads * s.head_dim * self.compute_dtype.nbytes
            gather = int(slot_view + chunk * cell.context)  # and its mask
        graphs += gather
        # Warm-up runs each graph's forward eagerly on the capture side stream before
        # capturing it, the largest first: those blocks stay cached for that stream
        # (released at the end of warm-up) while the graphs' pool holds the same again.
        warmup = int(temporaries)
        return self._prediction(
            cell, kv=pool, activations=prefill + graphs,
            # the pool is one allocation: its segment is rounded to 2 MiB
            reserved_above=segment_bytes(pool) + graphs + warmup
            + prefill * self.calibration.prefill_reserved_ratio,
            phase="slots", kv_slots=kv_slots, running=running, queued=cell.concurrency - running,
        )  # fmt: skip


def _rotary_table_sizes(slot_tokens: int, head_dim: int, dtype_bytes: int) -> list[int]:
    """What :class:`~convo.fast.decoder.StaticDecoder` allocates for its rotary tables
    after the layers: the positions (int64), a probe, transformers' float32 positions,
    frequencies, their concatenation and cos/sin before and after the attention scaling,
    and the cos/sin tables kept in the compute dtype."""
    t, d = slot_tokens, head_dim
    if t <= 0:
        return []
    return [8 * t, dtype_bytes, 4 * t, 2 * t * d, *[4 * t * d] * 5, *[dtype_bytes * t * d] * 2]


def __getattr__(name: str) -> Any:
    if name == "MemoryModel":
        warnings.warn(
            "MemoryModel is deprecated; it is convo.planner.VRAMModel ('memory' means the "
            "conversation's memory elsewhere in convo)",
            DeprecationWarning,
            stacklevel=2,
        )
        return VRAMModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
