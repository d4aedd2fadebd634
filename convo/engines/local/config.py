"""How the local engine loads its model (:class:`LoadConfig`) and where its sessions' KV
caches live and how they are decoded (:class:`KVConfig`).

Both are keyword-only and validated when built, so a bad value fails before any model is
loaded::

    TransformersEngine(
        "random:llama-2-7b",
        quant="int4",
        load=LoadConfig(int4_group_size=128),
        kv=KVConfig(kv_slots=16, slot_tokens=8192),
    )
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from convo.errors import ConfigError
from convo.models.defaults import (
    DEFAULT_INTERLEAVE_TOKENS,
    DEFAULT_STEP_TOKENS,
    KV_DTYPE_CHOICES,
    PREFILL_GRAPH_TOKENS,
)
from convo.models.quant import INT4_GROUP_SIZE, INT4_KERNELS, check_int4_group_size
from convo.planner.fit import memory_limit_bytes

#: What ``LoadConfig.tool_parser`` (and ``--tool-parser``) take.
TOOL_PARSER_CHOICES = ("auto", "hermes", "llama3_json", "mistral", "none")


@dataclass(frozen=True, kw_only=True)
class LoadConfig:
    """How the model is loaded.

    Args:
        device_map: passed to ``from_pretrained`` (e.g. ``"auto"`` to spread a large model
            over devices); default ``None``: the whole model on the engine's ``device``.
        offload_folder: where ``device_map="auto"`` may offload weights that do not fit.
        attn_implementation: asked of transformers explicitly (default ``"sdpa"``); the
            engine's ``attention`` reports what the model actually uses.
        int4_group_size: with ``quant="int4"``, input features per scale/zero pair (32, 64
            or 128). Default :data:`~convo.models.quant.INT4_GROUP_SIZE` (32): the block of
            GGUF Q4_0/Q4_1, so a model that comes from such a file (the default model does)
            keeps its own grid; 128 reads ~10 % fewer bytes per token (measured on the
            H200: 309 vs 277 tok/s for Llama-2-7B at batch 1).
        int4_kernel: ``"auto"`` (default), ``"tinygemm"`` or ``"triton"``
            (:data:`~convo.models.quant.INT4_KERNELS`): the int4 layouts kept, and so the
            kernels the decode step runs (see :class:`~convo.fast.decoder.StaticDecoder`).
        int4_dense_copy_bytes: with ``quant="int4"`` on KV slots, keep dense copies of the
            int4 weights, whole layers up to this many bytes
            (``DecoderConfig.dense_copy_bytes``): mixed steps and prefill chunks multiply
            them instead of dequantizing each forward; decode steps still read int4.
            Memory for prefill speed where a card has room beyond its slots (Llama-2-7B:
            12.1 GiB for every layer). Default 0: none.
        tool_parser: how tool calls are read out of the model's replies:
            ``"auto"`` (default) detects the family from the chat template
            (:func:`~convo.tools.detect_parser`), ``"hermes"``, ``"llama3_json"`` or
            ``"mistral"`` name it, ``"none"`` turns tools off. Without a parser (or when
            the template renders no tools) the engine declares ``supports_tools = False``.

    Raises:
        ConfigError: an int4 group size or kernel the kernels do not have, an unknown
            tool parser.
    """

    device_map: str | dict[str, Any] | None = None
    offload_folder: str | os.PathLike[str] | None = None
    attn_implementation: str = "sdpa"
    int4_group_size: int = INT4_GROUP_SIZE
    int4_kernel: str = "auto"
    int4_dense_copy_bytes: int = 0
    tool_parser: str = "auto"

    def __post_init__(self) -> None:
        check_int4_group_size(self.int4_group_size, name="int4_group_size")
        if self.tool_parser not in TOOL_PARSER_CHOICES:
            raise ConfigError(
                f"tool_parser must be one of {', '.join(TOOL_PARSER_CHOICES)}, not {self.tool_parser!r}"
            )
        if self.int4_kernel not in INT4_KERNELS:
            raise ConfigError(f"int4_kernel must be 'auto', 'tinygemm' or 'triton', not {self.int4_kernel!r}")
        if self.int4_dense_copy_bytes < 0:
            raise ConfigError("int4_dense_copy_bytes must be >= 0")


@dataclass(frozen=True, kw_only=True)
class KVConfig:
    """Where the sessions' KV caches live and how calls are decoded on them.

    Args:
        kv_slots: static KV slots (:mod:`convo.fast`): the KV memory of ``kv_slots``
            sessions of ``slot_tokens`` tokens is taken once at load, every generating
            session holds a slot, and sessions generating at once decode together in one
            graph-captured step. ``None`` (default): :data:`~convo.models.defaults.DEFAULT_KV_SLOTS`
            on CUDA for a supported architecture (Llama, Mistral, Qwen2 families),
            :data:`~convo.models.defaults.DEFAULT_CPU_KV_SLOTS` (2) for ``int4`` on CPU,
            else 0 (on CUDA no more than fit in
            :data:`~convo.models.defaults.AUTO_SLOTS_MEMORY_FRACTION`, half, of the memory
            the weights left free; plain ``generate`` if not one fits); 0: plain
            ``generate`` with a growing cache.
        slot_tokens: tokens per KV slot: the largest prompt + reply of one call, and so
            the input cap. Default ``None``: the engine's ``max_input_tokens`` if given,
            else the model's context limit up to
            :data:`~convo.models.defaults.DEFAULT_SLOT_TOKENS`.
        kv_dtype: how the KV slots store K and V
            (:data:`~convo.models.defaults.KV_DTYPE_CHOICES`): ``"auto"`` (default) in the
            model's dtype; ``"fp8"`` as float8 e4m3 with a bfloat16 scale per token and head
            (:mod:`convo.fast.kernels`): about half the bytes of bf16, so twice the slots or
            the context in the same memory, at a small accuracy cost (``benchmarks/kv_fp8.py``
            measures it). fp8 lives in static slots only: ``kv_slots=0`` is refused, and
            ``kv_slots=None`` takes slots on CPU too
            (:data:`~convo.models.defaults.DEFAULT_CPU_KV_SLOTS`).
        step_tokens: static decode: the token budget of one scheduler step (running
            replies' rows first, then prefill chunks of waiting turns; see
            :mod:`convo.fast.scheduler`). Default
            :data:`~convo.models.defaults.DEFAULT_STEP_TOKENS` (2,048).
        interleave_tokens: static decode: while replies stream, a step prefills one chunk
            of at most this many tokens, so a new turn delays each running reply's next
            token by one short chunk; when prompts pile up, the chunk doubles as far as the
            measured step stays within the gap target
            (:class:`~convo.fast.step_budget.StepCosts`), and mixed steps are captured up
            to twice this. Default
            :data:`~convo.models.defaults.DEFAULT_INTERLEAVE_TOKENS` (256).
        prefill_chunk_tokens: prefill runs in chunks of this many tokens, checking the
            clock between chunks (also bounds prefill activation memory). Default
            :data:`~convo.models.defaults.PREFILL_GRAPH_TOKENS` (512).
        compile_decode: fuse the decode step's pointwise work with ``torch.compile``.
            Default ``None``: on CUDA (for plain and int4 weights).
        max_cached_sessions: KV caches kept for sessions between turns (LRU), without
            slots. Default 8. With static decode the slots bound this instead.
        cache_idle_s: seconds after which an unused session's KV cache is dropped. Default 600.
        kv_host_memory: static decode: bytes of host memory for the KV of sessions whose
            slot was given to another session (pinned on CUDA): their next turn copies it
            back instead of prefilling it again. Beyond it, the entries needed last are
            dropped; 0 turns it off. ``None`` (default): a share of the RAM
            (:func:`~convo.models.defaults.default_kv_host_memory`: half, at most half of
            what is free and 8 times the slots' KV pool on CUDA, twice it on CPU;
            :data:`~convo.models.defaults.DEFAULT_KV_HOST_MEMORY` says what it was
            measured against).
        gpu_memory: size the engine to this much device memory (bytes, or a size with a
            unit: ``"24GiB"``): the planner picks the KV slots, and with int4 one weight
            layout or both, to fit under it with a headroom
            (:func:`convo.planner.fit.fit_serve`), before any weight loads; a setting that
            cannot fit raises :class:`~convo.errors.ConfigError` naming the largest safe
            one. A given ``kv_slots`` (and ``LoadConfig.int4_kernel``) wins and is checked.
            CUDA only. Default ``None``: the default slots (up to 8, as memory allows).
        gpu_memory_utilization: the same as a share of the device's total memory (vLLM's
            spelling, e.g. 0.9); not with ``gpu_memory``.
        context_shift: static decode: when a session's window slid, move the turns it kept
            to their new positions in its slot, keys turned, instead of prefilling them
            again (:mod:`convo.fast.kv_shift`, llama.cpp's context shift). Not exact: the
            kept turns' KV still reflects the turns that were dropped, so a reply can
            differ from one on a recomputed prompt. Default False.

    Raises:
        ConfigError: a count or size out of range, an unknown ``kv_dtype``, fp8 without slots.
    """

    kv_slots: int | None = None
    slot_tokens: int | None = None
    kv_dtype: str = "auto"
    step_tokens: int = DEFAULT_STEP_TOKENS
    interleave_tokens: int = DEFAULT_INTERLEAVE_TOKENS
    prefill_chunk_tokens: int = PREFILL_GRAPH_TOKENS
    compile_decode: bool | None = None
    max_cached_sessions: int = 8
    cache_idle_s: float = 600.0
    kv_host_memory: int | None = None
    gpu_memory: int | str | None = None
    gpu_memory_utilization: float | None = None
    context_shift: bool = False

    def __post_init__(self) -> None:
        if self.kv_host_memory is not None and self.kv_host_memory < 0:
            raise ConfigError("kv_host_memory must be >= 0 bytes")
        if self.gpu_memory is not None or self.gpu_memory_utilization is not None:
            memory_limit_bytes(self.gpu_memory, self.gpu_memory_utilization, 1)  # validated here
        if self.prefill_chunk_tokens < 1:
            raise ConfigError("prefill_chunk_tokens must be >= 1")
        if self.max_cached_sessions < 0:
            raise ConfigError("max_cached_sessions must be >= 0")
        if self.kv_slots is not None and self.kv_slots < 0:
            raise ConfigError("kv_slots must be >= 0")
        if self.slot_tokens is not None and self.slot_tokens < 2:
            raise ConfigError("slot_tokens must be >= 2")
        if self.step_tokens < 1 or self.interleave_tokens < 1:
            raise ConfigError("step_tokens and interleave_tokens must be >= 1")
        if self.kv_dtype not in KV_DTYPE_CHOICES:
            raise ConfigError(f"kv_dtype must be one of {', '.join(KV_DTYPE_CHOICES)}, not {self.kv_dtype!r}")
        if self.kv_dtype == "fp8" and self.kv_slots == 0:
            raise ConfigError("kv_dtype='fp8' is stored in static KV slots: kv_slots must be > 0 (or None)")
