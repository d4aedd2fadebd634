"""The shared facts of convo's local models: a leaf package that the planner
(:mod:`convo.planner`), the fast path (:mod:`convo.fast`) and the engines
(:mod:`convo.engines`) read, and that imports none of them (only :mod:`convo.errors`;
torch and transformers only inside :func:`build_random_model`).

* :mod:`~convo.models.spec` — :class:`ModelShape`, :class:`DType`, :class:`Attn`,
  :data:`BUILTIN_CONFIGS`, :func:`load_config`;
* :mod:`~convo.models.units` — :func:`parse_size`, :func:`format_size`, ``KiB``/``MiB``/``GiB``;
* :mod:`~convo.models.quant` — :class:`Quant` and the int4 grid (:data:`INT4_GROUP_SIZES`,
  :data:`INT4_GROUP_SIZE`, :func:`int4_group_size`, :data:`INT4_KERNELS`);
* :mod:`~convo.models.defaults` — KV slot, scheduler and chunk defaults,
  :func:`auto_kv_slots` and the KV pool's byte formula :func:`kv_pool_bytes`;
* :mod:`~convo.models.generation` — :class:`Sampling`, :class:`Generation`,
  :class:`GenerationStats`, :class:`FinishReason`, :class:`Priority`;
* :mod:`~convo.models.random_model` — :func:`build_random_model`.
"""

from __future__ import annotations

from convo.models.defaults import (
    AUTO_SLOTS_MEMORY_FRACTION,
    DEFAULT_INTERLEAVE_TOKENS,
    DEFAULT_KV_SLOTS,
    DEFAULT_SLOT_TOKENS,
    DEFAULT_STEP_TOKENS,
    MIXED_CHUNK_TOKENS,
    PREFILL_GRAPH_TOKENS,
    auto_kv_slots,
    kv_pool_bytes,
)
from convo.models.generation import GREEDY, FinishReason, Generation, GenerationStats, Priority, Sampling
from convo.models.quant import (
    INT4_GROUP_SIZE,
    INT4_GROUP_SIZES,
    INT4_KERNELS,
    LARGEST_INT4_GROUP_SIZE,
    Quant,
    check_int4_group_size,
    int4_group_size,
)
from convo.models.random_model import build_random_model
from convo.models.spec import (
    BUILTIN_CONFIGS,
    STATIC_DECODE_MODEL_TYPES,
    Attn,
    DType,
    ModelShape,
    load_config,
    model_key,
)
from convo.models.units import GiB, KiB, MiB, format_size, parse_size

__all__ = [
    "AUTO_SLOTS_MEMORY_FRACTION",
    "BUILTIN_CONFIGS",
    "DEFAULT_INTERLEAVE_TOKENS",
    "DEFAULT_KV_SLOTS",
    "DEFAULT_SLOT_TOKENS",
    "DEFAULT_STEP_TOKENS",
    "GREEDY",
    "INT4_GROUP_SIZE",
    "INT4_GROUP_SIZES",
    "INT4_KERNELS",
    "LARGEST_INT4_GROUP_SIZE",
    "MIXED_CHUNK_TOKENS",
    "PREFILL_GRAPH_TOKENS",
    "STATIC_DECODE_MODEL_TYPES",
    "Attn",
    "DType",
    "FinishReason",
    "Generation",
    "GenerationStats",
    "GiB",
    "KiB",
    "MiB",
    "ModelShape",
    "Priority",
    "Quant",
    "Sampling",
    "auto_kv_slots",
    "build_random_model",
    "check_int4_group_size",
    "format_size",
    "int4_group_size",
    "kv_pool_bytes",
    "load_config",
    "model_key",
    "parse_size",
]
