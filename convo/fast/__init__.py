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
  linear module, :mod:`convo.fast.kernels` its Triton kernels (W4A16 matmul, int4
  dequantization), :mod:`convo.fast.attention` those of attention over the slot pool
  (split decode attention, chunk attention, the fp8 K/V write).
* :class:`~convo.fast.scheduler.DecodeScheduler` is the continuous-batching loop: each step
  decodes every running reply, then fills the rest of a token budget with prefill chunks
  of waiting turns (replies before background work such as summaries).

Importing :mod:`convo.fast` loads no torch: the pool, the scheduler and the kernels'
launchers are plain Python; :mod:`convo.fast.decoder` and :mod:`convo.fast.int4` import
torch, and their names here load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from convo._deprecated import lazy
from convo.fast.attention import ATTENTION_SPLIT_TOKENS, decode_attention
from convo.fast.config import DecoderConfig
from convo.fast.kernels import dequantize_plain_int4
from convo.fast.kv_pool import KVSlotPool, PrefillChunk
from convo.fast.scheduler import (
    DEFAULT_STEP_TOKENS,
    DecodeRequest,
    DecodeScheduler,
    Priority,
    decode_priority,
)
from convo.models.quant import int4_group_size
from convo.models.spec import STATIC_DECODE_MODEL_TYPES as SUPPORTED_MODEL_TYPES

if TYPE_CHECKING:
    from convo.fast.decoder import StaticDecoder, tensor_nbytes
    from convo.fast.int4 import Int4Linear, dequantize_int4, quantize_int4

__all__ = [
    "ATTENTION_SPLIT_TOKENS",
    "DEFAULT_STEP_TOKENS",
    "SUPPORTED_MODEL_TYPES",
    "DecodeRequest",
    "DecodeScheduler",
    "DecoderConfig",
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

# These modules import torch: their names load on first use.
__getattr__ = lazy(
    "convo.fast",
    {
        "StaticDecoder": "convo.fast.decoder",
        "tensor_nbytes": "convo.fast.decoder",
        "Int4Linear": "convo.fast.int4",
        "dequantize_int4": "convo.fast.int4",
        "quantize_int4": "convo.fast.int4",
    },
)
