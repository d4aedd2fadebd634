"""Deprecated: the fast path moved to :mod:`convo.fast` (issue 13). This module re-exports
its public names for old imports and will be removed."""

from __future__ import annotations

from convo.fast import (
    ATTENTION_SPLIT_TOKENS,
    SUPPORTED_MODEL_TYPES,
    DecodeRequest,
    DecodeScheduler,
    Int4Weight,
    KVSlotPool,
    StaticDecoder,
    decode_attention,
    dequantize_int4,
    int4_group_size,
    plain_int4,
    quantize_int4,
    tensor_nbytes,
)

__all__ = [
    "ATTENTION_SPLIT_TOKENS",
    "SUPPORTED_MODEL_TYPES",
    "DecodeRequest",
    "DecodeScheduler",
    "Int4Weight",
    "KVSlotPool",
    "StaticDecoder",
    "decode_attention",
    "dequantize_int4",
    "int4_group_size",
    "plain_int4",
    "quantize_int4",
    "tensor_nbytes",
]
