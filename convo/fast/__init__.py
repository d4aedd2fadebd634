"""The fast local path: static KV slots, a captured decode step, sessions decoded together.

convo bounds every session's context, so the largest KV cache a session can need is known
before it starts. This package turns that into exact memory and speed:

* :class:`~convo.fast.kv_pool.KVSlotPool` takes the KV memory once, at start: per layer one
  K and one V tensor of shape ``[slots, kv_heads, slot_tokens, head_dim]`` in the model's
  dtype. A session holds a slot while it generates; between turns the slot keeps its
  tokens, so the next turn prefills only what changed (the prefix reuse of the engine,
  inside the slot)::

      K[layer]   slot 0 | session a: 0 ........ 731 |                       free |
                 slot 1 | session b: 0 ............................ 2047 | free |
                 slot 2 | (idle: keeps session c's tokens until it is needed)   |

* :class:`~convo.fast.decoder.StaticDecoder` runs a Llama-family model (Llama, Mistral
  without a sliding window, Qwen2, SmolLM2) on that pool with its own forward: prefill runs
  the waiting turns' chunks together at matrix-multiply speed (cuBLAS on dense or
  dequantized-once weights, SDPA attention); the decode step has static shapes (a batch
  bucket of 1, 2, 4, ... rows over fixed-size slots; per-row positions are data, not
  shapes), each layer's pointwise work is fused by ``torch.compile`` on CUDA, and the whole
  step is captured once per bucket as a CUDA graph, so a token costs one graph replay.
* :mod:`convo.fast.int4` holds :class:`~convo.fast.int4.Int4Linear`, the int4 weight-only
  linear module, :mod:`convo.fast.kernels` the Triton kernels (W4A16 matmul, int4
  dequantization, split decode attention).
* :class:`~convo.fast.scheduler.DecodeScheduler` is the continuous-batching loop: each step
  decodes every running reply, then fills the rest of a token budget with prefill chunks
  of waiting turns (replies before background work such as summaries).

Nothing here imports torch at import time but :mod:`convo.fast.int4` (its names load on
first use).
"""

from __future__ import annotations

from convo.fast.decoder import SUPPORTED_MODEL_TYPES, PrefillChunk, StaticDecoder, tensor_nbytes
from convo.fast.kernels import ATTENTION_SPLIT_TOKENS, decode_attention, dequantize_plain_int4
from convo.fast.kv_pool import KVSlotPool
from convo.fast.scheduler import (
    DEFAULT_STEP_TOKENS,
    DecodeRequest,
    DecodeScheduler,
    Priority,
    decode_priority,
)

__all__ = [
    "ATTENTION_SPLIT_TOKENS",
    "DEFAULT_STEP_TOKENS",
    "SUPPORTED_MODEL_TYPES",
    "DecodeRequest",
    "DecodeScheduler",
    "Int4Linear",
    "KVSlotPool",
    "PrefillChunk",
    "Priority",
    "StaticDecoder",
    "decode_attention",
    "decode_priority",
    "dequantize_int4",
    "dequantize_plain_int4",
    "int4_group_size",
    "quantize_int4",
    "tensor_nbytes",
]

_INT4_NAMES = frozenset({"Int4Linear", "dequantize_int4", "int4_group_size", "quantize_int4"})


def __getattr__(name: str) -> object:
    if name in _INT4_NAMES:  # convo.fast.int4 imports torch: load it on first use
        from convo.fast import int4

        return getattr(int4, name)
    raise AttributeError(f"module 'convo.fast' has no attribute {name!r}")
