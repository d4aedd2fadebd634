"""The defaults the engine, the fast path and the planner share: KV slots, scheduler
budgets, captured chunk sizes, and the byte formula of the KV slot pool.

The planner prices what the engine will take (``convo plan --kv-slots auto``), so both
read these numbers and formulas from here; neither imports the other.
"""

from __future__ import annotations

import math
import os

#: KV slots of the static decoder when ``kv_slots`` is left to the engine (CUDA, int4).
DEFAULT_KV_SLOTS = 8
#: KV slots ``kv_slots=None`` takes on CPU with ``quant="int4"`` (which runs only through
#: the static decoder): a CPU decodes a few rows at once, so 8 slots of the budget would
#: only take memory.
#:
#: fp32 on CPU keeps plain ``generate`` (DynamicKV, 0 slots) by default, measured (issue
#: 27 #21, ``benchmarks/cpu_default.py``, the embedded SmolLM2-135M on this 2-core machine,
#: greedy, a warm-up turn first, scripted chats): static slots give the same replies (every
#: turn's text equal to DynamicKV's) but are not faster. Median turn of 48 tokens, quiet
#: machine: DynamicKV 3.10 s (16.1 tok/s), 2 slots 3.86 s (12.7), 1 slot 6.47 s (7.6), int4
#: 4.16 s (11.6, other replies); loaded (load average ~10, turns interleaved across the
#: settings): 6.85 s, 10.93 s, 10.44 s, 7.78 s; streamed, load ~14, two runs: DynamicKV
#: 15.7 s and 14.3 s, 2 slots 18.9 s and 8.4 s (there the machine's load decides more than
#: the path); 200-token replies, load ~14: 57.5 s against 63.5 s. On a loaded machine every
#: path runs at 2-4 tok/s. What the static decoder does save is the first call: it warms up
#: at load, while plain ``generate``'s first turn pays its set-up (5.6 s against 3.1 s
#: quiet; 37-106 s loaded).
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
#: Longest prefill chunk (tokens) a mixed step is captured for by default: twice the
#: scheduler's chunk while replies stream (:data:`DEFAULT_INTERLEAVE_TOKENS`), so that a
#: step grown under a pile of prompts (:class:`~convo.fast.step_budget.StepCosts`) still
#: reads the weights once for its rows and its chunk.
MIXED_CHUNK_TOKENS = 2 * DEFAULT_INTERLEAVE_TOKENS
#: Prefill chunks (of as many turns) one captured mixed step runs packed in its chunk
#: bucket, each but the last on whole blocks of :data:`MIXED_PACK_TOKENS` tokens
#: (:func:`convo.fast.packing.pack_chunks`). One chunk a step left most steps short: a
#: 300-token prompt ran as a 256-token step and a 64-token one, each paying the forward's
#: fixed cost (an int4 weight dequantized once per forward).
MIXED_PACK_CHUNKS = 4
#: The block a packed chunk starts on: the chunk-attention kernel's query blocks each lie in
#: one slot (a power of two; a chunk wastes up to one block less a token of the bucket).
MIXED_PACK_TOKENS = 32
#: Longest prefill chunk (tokens) the static decoder captures as a CUDA graph, and the
#: chunk prefill runs in (its ``prefill_chunk_tokens`` default, the engine's too): the
#: graphs' shared pool holds one such forward.
PREFILL_GRAPH_TOKENS = 512


def batch_buckets(slots: int) -> list[int]:
    """Row counts the static decoder captures a step for: powers of two up to the first
    that holds ``slots`` rows (a step runs in the smallest that holds its rows)."""
    return [1 << i for i in range(max(slots - 1, 0).bit_length() + 1)]


def chunk_buckets(chunk_tokens: int, slot_tokens: int) -> list[int]:
    """Chunk lengths the static decoder captures prefill for: powers of two from 16 below
    ``min(chunk_tokens, slot_tokens)``, then that length itself."""
    top = min(chunk_tokens, slot_tokens)
    return [b for b in (16 << i for i in range(16)) if b < top] + [top]


def mixed_buckets(chunk_tokens: int, slot_tokens: int, mixed_chunk_tokens: int) -> list[int]:
    """Chunk lengths a mixed step is captured for (with each batch bucket): the
    :func:`chunk_buckets` of at most ``mixed_chunk_tokens`` tokens."""
    return [b for b in chunk_buckets(chunk_tokens, slot_tokens) if b <= mixed_chunk_tokens]


#: Eager runs of each forward before the static decoder captures it in a CUDA graph
#: (compiles, tunes the kernels). The planner prices one run of the largest prefill chunk
#: on top of the graphs' pool, at the load's peak: its blocks stay cached for the capture's
#: side stream while the pool already holds the smaller buckets, and the later runs on that
#: stream reuse them.
WARMUP_EAGER_RUNS = 2

#: Bytes of host memory for the KV of sessions evicted from their slots when
#: ``KVConfig.kv_host_memory`` / ``--kv-host-memory`` is left out. ``None``:
#: :func:`default_kv_host_memory` (a share of the RAM, at most a multiple of the KV pool:
#: :data:`KV_HOST_POOL_MULTIPLE` on CUDA, :data:`CPU_KV_HOST_POOL_MULTIPLE` on CPU).
#: Measured on the H200 (``benchmarks/serve_load.py --preset chat-users``:
#: Llama-2-7B int4, 16 slots, 64 users, think time 3-8 s, 2026-12-02): host KV off, TTFT p50
#: 0.15 s / p95 1.34 s, turn p95 1.85 s, re-prefill 0.99; 8 GiB, p95 1.64 s, re-prefill 0.82
#: (8 GiB holds ~10 of the 64 windows); 32 GiB, **p95 0.34 s, turn p95 0.99 s, re-prefill
#: 0.51**, and the server's RSS flat at the arena's size. Page-locking the arena at start
#: adds seconds to it (server start 49.5 s with 32 GiB against 28 s without, not isolated
#: from the compile caches).
DEFAULT_KV_HOST_MEMORY: int | None = None
#: Share of the machine's RAM :func:`default_kv_host_memory` takes for host KV on CUDA at
#: most. A 1,700-token window of Llama-2-7B is ~0.85 GB of KV: a quarter of a 128 GiB host
#: (the default before 2026-12-06) held ~37 of chat-users' 64 sessions, and the arena was
#: full through the load; half holds them all.
KV_HOST_MEMORY_FRACTION = 0.5
#: ... and never more than this share of the RAM that is free when the engine loads.
KV_HOST_AVAILABLE_FRACTION = 0.5
#: ... and never more than this many times the device's KV pool: the host tier is sized to
#: the GPU tier (as SGLang's HiCache sizes its host pool by a ratio to the device's), so a
#: model with a small KV (grouped-query attention, fp8 KV, few slots) does not page-lock RAM
#: it can never fill. 8 pools hold the windows of 8x as many sessions as there are slots.
KV_HOST_POOL_MULTIPLE = 8
#: ... and on CPU never more than this many times the slots' pool. The slots live in the
#: same RAM there, and more slots would hold more sessions too; but a slot is the whole
#: budget while host KV holds only the tokens cached, and a session's own summary (which
#: runs in its slot, :mod:`convo.fast.scheduler`) would otherwise overwrite the window the
#: session's next turn reuses. Before 2026-12-07 it was 0 on CPU: with a context shift the
#: slide turn then prefilled its whole prompt, 1,840 tokens against 557
#: (``benchmarks/shift_turns.py``); 4 users on 2 slots (``benchmarks/kv_host.py``), TTFT
#: p95 12.2 s against 6.0 s and re-prefill 1.0 against 0.37.
CPU_KV_HOST_POOL_MULTIPLE = 2


def auto_kv_slots(free_bytes: float, slot_bytes: int) -> int:
    """The KV slots ``kv_slots=None`` takes on CUDA: :data:`DEFAULT_KV_SLOTS`, or as many
    slots of ``slot_bytes`` as fit in :data:`AUTO_SLOTS_MEMORY_FRACTION` of ``free_bytes``
    (the device memory free after loading); 0 when not one fits. The engine takes this
    count and the planner's :meth:`~convo.planner.memory.VRAMModel.auto_kv_slots` prices it."""
    return max(0, min(DEFAULT_KV_SLOTS, int(AUTO_SLOTS_MEMORY_FRACTION * free_bytes // max(slot_bytes, 1))))


def default_kv_host_memory(
    total_bytes: int | None = None,
    available_bytes: int | None = None,
    *,
    pool_bytes: int | None = None,
    pool_multiple: int = KV_HOST_POOL_MULTIPLE,
) -> int:
    """Bytes of host memory the KV of evicted sessions may take by default:
    :data:`KV_HOST_MEMORY_FRACTION` of the RAM, at most :data:`KV_HOST_AVAILABLE_FRACTION` of
    the RAM free now (both read from ``os.sysconf`` when not given; 0 where it cannot say)
    and, when ``pool_bytes`` (the KV slots' pool) is given, at most ``pool_multiple``
    times it. What an engine takes when ``kv_host_memory`` is left out.

    Example:
        >>> default_kv_host_memory(128 << 30, 120 << 30) >> 30
        60
        >>> default_kv_host_memory(128 << 30, 120 << 30, pool_bytes=2 << 30) >> 30
        16
    """
    total = _ram_bytes("SC_PHYS_PAGES") if total_bytes is None else total_bytes
    available = _ram_bytes("SC_AVPHYS_PAGES") if available_bytes is None else available_bytes
    limit = min(KV_HOST_MEMORY_FRACTION * total, KV_HOST_AVAILABLE_FRACTION * available)
    if pool_bytes is not None:
        limit = min(limit, pool_multiple * pool_bytes)
    return max(0, int(limit))


def resolve_kv_host_memory(given: int | None, *, cuda: bool, pool_bytes: int | None = None) -> int:
    """The host KV bytes an engine takes: ``given``, else :data:`DEFAULT_KV_HOST_MEMORY`,
    else (``None``) :func:`default_kv_host_memory`, capped by ``pool_bytes`` (the KV
    slots' pool) times :data:`KV_HOST_POOL_MULTIPLE` on CUDA; on CPU only with a pool, at
    most :data:`CPU_KV_HOST_POOL_MULTIPLE` times it."""
    if given is not None:
        return int(given)
    if DEFAULT_KV_HOST_MEMORY is not None:
        return DEFAULT_KV_HOST_MEMORY
    if cuda:
        return default_kv_host_memory(pool_bytes=pool_bytes)
    if not pool_bytes:
        return 0
    return default_kv_host_memory(pool_bytes=pool_bytes, pool_multiple=CPU_KV_HOST_POOL_MULTIPLE)


def _ram_bytes(name: str) -> int:
    try:
        return int(os.sysconf(name)) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return 0


#: What ``KVConfig.kv_dtype`` (and ``convo serve --kv-dtype``) take: ``"auto"``, K/V in
#: the model's dtype; ``"fp8"``, float8 e4m3 values with a bfloat16 scale per token and
#: head (about half the bytes of bf16: :data:`FP8_KV_SCALE_BYTES` more per ``head_dim`` bytes).
KV_DTYPE_CHOICES = ("auto", "fp8")
#: The torch dtype (by name) of the scale an fp8 KV pool stores with each head vector of
#: each token's K and V: ``amax / 448`` of the vector (:func:`convo.fast.attention.quantize_kv`).
#: bfloat16 has float32's exponent range, so any scale is representable; its 8-bit mantissa
#: moves a value by at most 2**-8, below e4m3's own step (2**-4). A float32 scale cost 4
#: bytes per 128: on Qwen2.5-7B at 8,192 tokens in 12 GiB, 15 fp8 slots against 16.
FP8_KV_SCALE_DTYPE = "bfloat16"
#: Bytes of one :data:`FP8_KV_SCALE_DTYPE` scale.
FP8_KV_SCALE_BYTES = 2


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
    planner prices a pool with it (exact: checked against ``torch.cuda.memory_allocated``).
    The pool's tensors sit in one buffer at offsets aligned to :data:`KV_POOL_ALIGN_BYTES`,
    so each tensor's bytes are rounded up to that (no padding at the usual sizes)."""
    vectors = slots * num_kv_heads * slot_tokens

    def aligned(nbytes: float) -> int:
        return -(-math.ceil(nbytes) // KV_POOL_ALIGN_BYTES) * KV_POOL_ALIGN_BYTES

    scales = aligned(vectors * scale_bytes) if scale_bytes else 0
    return 2 * num_layers * (aligned(vectors * head_dim * dtype_bytes) + scales)


def fp8_kv_bytes_per_token(*, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """KV bytes one token costs in an fp8 pool, across layers: K and V, one byte per value
    and a :data:`FP8_KV_SCALE_BYTES` scale per head vector (the pool's alignment aside,
    which :func:`kv_pool_bytes` counts)."""
    return 2 * num_layers * num_kv_heads * (head_dim + FP8_KV_SCALE_BYTES)


#: Bytes between the starts of the KV pool's tensors in its one buffer (every element size
#: divides it): :func:`kv_pool_bytes` and :class:`convo.fast.kv_pool.KVSlotPool`.
KV_POOL_ALIGN_BYTES = 256
