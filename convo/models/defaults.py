"""The defaults the engine, the fast path and the planner share: KV slots, scheduler
budgets, captured chunk sizes, and the byte formula of the KV slot pool.

The planner prices what the engine will take (``convo plan --kv-slots auto``), so both
read these numbers and formulas from here; neither imports the other.
"""

from __future__ import annotations

#: KV slots of the static decoder when ``kv_slots`` is left to the engine (CUDA, int4).
DEFAULT_KV_SLOTS = 8
#: KV slots ``kv_slots=None`` takes on CPU with ``quant="int4"`` (which runs only through
#: the static decoder): a CPU decodes a few rows at once, so 8 slots of the budget would
#: only take memory. fp32 on CPU keeps plain ``generate`` (0 slots) by default: whether
#: static slots are faster there is not yet measured (issue 27, defect 21).
DEFAULT_CPU_KV_SLOTS = 2
#: Share of the free device memory (after the weights) that ``kv_slots=None`` lets the slot
#: pool take on CUDA; the rest is left to prefill activations, graphs and other work.
AUTO_SLOTS_MEMORY_FRACTION = 0.5
#: Tokens per slot when neither ``slot_tokens`` nor ``max_input_tokens`` is given.
DEFAULT_SLOT_TOKENS = 4096

#: Tokens one scheduler step may run by default: the running replies' rows, then prefill
#: chunks of waiting turns. Larger: faster prefill (fewer weight reads per prompt token);
#: smaller: shorter stalls of the running replies while a prompt is prefilled.
DEFAULT_STEP_TOKENS = 2048
#: Prompt tokens a step may prefill while replies stream: larger, faster prefill under
#: load; smaller, shorter gaps between a streaming reply's tokens. On the H200 (Llama-2-7B
#: int4) a 256-token prefill forward takes about two decode steps.
DEFAULT_INTERLEAVE_TOKENS = 256
#: Longest prefill chunk (tokens) a mixed step is captured for by default: the scheduler's
#: chunk while replies stream (:data:`DEFAULT_INTERLEAVE_TOKENS`).
MIXED_CHUNK_TOKENS = DEFAULT_INTERLEAVE_TOKENS
#: Longest prefill chunk (tokens) the static decoder captures as a CUDA graph, and the
#: chunk prefill runs in (its ``prefill_chunk_tokens`` default, the engine's too): the
#: graphs' shared pool holds one such forward.
PREFILL_GRAPH_TOKENS = 512


def auto_kv_slots(free_bytes: float, slot_bytes: int) -> int:
    """The KV slots ``kv_slots=None`` takes on CUDA: :data:`DEFAULT_KV_SLOTS`, or as many
    slots of ``slot_bytes`` as fit in :data:`AUTO_SLOTS_MEMORY_FRACTION` of ``free_bytes``
    (the device memory free after loading); 0 when not one fits. The engine takes this
    count and the planner's :meth:`~convo.planner.memory.VRAMModel.auto_kv_slots` prices it."""
    return max(0, min(DEFAULT_KV_SLOTS, int(AUTO_SLOTS_MEMORY_FRACTION * free_bytes // max(slot_bytes, 1))))


#: What ``KVConfig.kv_dtype`` (and ``convo serve --kv-dtype``) take: ``"auto"``, K/V in
#: the model's dtype; ``"fp8"``, float8 e4m3 values with a float32 scale per token and head
#: (about half the bytes of bf16: :data:`FP8_KV_SCALE_BYTES` more per ``head_dim`` bytes).
KV_DTYPE_CHOICES = ("auto", "fp8")
#: Bytes of the scale an fp8 KV pool stores with each head vector of each token's K and V
#: (a float32: ``amax / 448`` of the vector, see :func:`convo.fast.kernels.quantize_kv`).
FP8_KV_SCALE_BYTES = 4


def kv_pool_bytes(
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    slots: int,
    slot_tokens: int,
    dtype_bytes: float,
    scale_bytes: int = 0,
) -> int:
    """Bytes of the static KV slot pool: ``2 x layers x slots x kv_heads x slot_tokens x
    (head_dim x dtype bytes + scale bytes)`` (one K and one V tensor per layer, and for an
    fp8 pool one scale per head vector, :data:`FP8_KV_SCALE_BYTES`). The one pool-size
    formula: :class:`convo.fast.kv_pool.KVSlotPool` predicts its own size with it and the
    planner prices a pool with it (exact: checked against ``torch.cuda.memory_allocated``)."""
    return int(2 * num_layers * slots * num_kv_heads * slot_tokens * (head_dim * dtype_bytes + scale_bytes))
