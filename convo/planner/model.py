"""Memory model of a transformers causal LM: weights, KV cache, activations, allocator.

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
  (no memory, no download). bitsandbytes quantizes only ``nn.Linear`` layers and leaves
  the output embedding (``lm_head``) and tied weights alone, so those stay in ``dtype``.
  nf4/fp4 cost 4 bits per parameter plus one absmax per 64-value block: fp32 (4.5
  bits/param) or, with double quantization, uint8 re-quantized per 256 blocks (4.127).
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

import enum
import functools
import importlib.util
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from convo.engines.base import INT4_GROUP_SIZE, Quant
from convo.errors import ConfigError
from convo.planner.calibration import Calibration

GiB = 1024**3
MiB = 1024**2

# --------------------------------------------------------------------------------------
# Built-in configs: planning works with no download and no model folder.
# --------------------------------------------------------------------------------------

_LLAMA_2_7B: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    # SmolLM2-135M (HuggingFaceTB/SmolLM2-135M config.json).
    "default": {
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    },
    "random:llama-2-7b": _LLAMA_2_7B,
    "random:llama-3-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "random:mistral-7b": {  # Mistral-7B-v0.1: 4096-token sliding window on every layer
        "model_type": "mistral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "random:tiny-llama": {  # for CPU smoke tests: 2 layers, random weights
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 49152,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    },
}
BUILTIN_CONFIGS["random:smollm2-135m"] = BUILTIN_CONFIGS["default"]


class DType(enum.StrEnum):
    """A tensor dtype as spelled on the command line."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def nbytes(self) -> float:
        """Bytes per element (0.5 for int4)."""
        return _DTYPE_BYTES[self]

    @classmethod
    def parse(cls, value: str | DType) -> DType:
        """Turn ``"bfloat16"``, ``"bf16"``, ``"torch.float16"``... into a :class:`DType`.

        Raises:
            ConfigError: unknown dtype.
        """
        if isinstance(value, DType):
            return value
        key = str(value).lower().removeprefix("torch.")
        key = _DTYPE_ALIASES.get(key, key)
        try:
            return cls(key)
        except ValueError:
            raise ConfigError(f"unknown dtype {value!r}; use one of {[d.value for d in cls]}") from None


_DTYPE_BYTES = {
    DType.FP32: 4.0,
    DType.BF16: 2.0,
    DType.FP16: 2.0,
    DType.FP8: 1.0,
    DType.INT8: 1.0,
    DType.INT4: 0.5,
}
_DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float8": "fp8",
    "float8_e4m3fn": "fp8",
}


class Attn(enum.StrEnum):
    """Attention implementation; eager materializes the ``tokens²`` score matrix."""

    SDPA = "sdpa"
    EAGER = "eager"

    @classmethod
    def parse(cls, value: str | Attn) -> Attn:
        if isinstance(value, Attn):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ConfigError(f"unknown attention {value!r}; use 'sdpa' or 'eager'") from None


# --------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
}


def parse_size(text: str | int | float, *, unit_required: bool = False) -> int:
    """Parse a memory size into bytes.

    ``24GiB`` and ``24G`` are binary (24 * 2**30), ``80GB`` is decimal (80 * 10**9),
    ``24000MiB``, ``512 MB``, ``100B`` and (unless ``unit_required``) a bare number of
    bytes work too.

    Args:
        text: the size, or a number of bytes.
        unit_required: refuse text without a unit (``"24"``: 24 bytes or 24 GiB?).

    Returns:
        The size in bytes.

    Raises:
        ConfigError: unparseable, no unit when one is required, or not positive.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ConfigError(f"cannot parse size {text!r}; write e.g. 24GiB, 80GB, 24000MiB")
        bare = match.group(1)
        if unit_required and not unit:
            raise ConfigError(
                f"size {text!r} has no unit (it would mean {bare} bytes); "
                f"write e.g. {bare}GiB, {bare}GB, 24000MiB or 512B"
            )
        value = float(match.group(1)) * _SIZE_UNITS[unit]
    if not value > 0 or math.isinf(value):
        raise ConfigError(f"size must be positive, got {text!r}")
    return int(value)


def format_size(nbytes: float) -> str:
    """Human-readable binary size: ``3.64 GiB``, ``512.0 MiB``."""
    if abs(nbytes) >= GiB:
        return f"{nbytes / GiB:.2f} GiB"
    if abs(nbytes) >= MiB:
        return f"{nbytes / MiB:.1f} MiB"
    return f"{nbytes / 1024:.1f} KiB"


def _parse_int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(parse_size(v)) if v.strip()[-1:].isalpha() else int(v) for v in text.split(",")]
    except (ValueError, IndexError):
        raise ConfigError(f"--{what} takes comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ConfigError(f"--{what} values must be positive, got {text!r}")
    return sorted(set(values))


# --------------------------------------------------------------------------------------
# Model shape
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The numbers of a decoder config that memory depends on.

    Args:
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (GQA/MQA: fewer than ``num_heads``).
        head_dim: size of one head (``hidden_size // num_heads`` unless the config says).
        hidden_size: residual width.
        intermediate_size: MLP width.
        vocab_size: vocabulary size.
        max_position_embeddings: the model's context limit in tokens.
        sliding_windows: per layer, the window in tokens, or ``None`` for full attention.
        tie_word_embeddings: ``lm_head`` shares the input embedding.
        dtype: the checkpoint dtype (weights that stay unquantized).
        model_type: e.g. ``"llama"``.
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    sliding_windows: tuple[int | None, ...] = ()
    tie_word_embeddings: bool = False
    dtype: DType = DType.BF16
    model_type: str = "llama"

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "hidden_size",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise ConfigError("sliding_windows needs one entry per layer")

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Any) -> ModelShape:
        """Read a ``config.json`` dict or a transformers ``PretrainedConfig``.

        Multimodal configs are read through their ``text_config``.
        """
        cfg = _config_dict(config)
        if "text_config" in cfg and "num_hidden_layers" not in cfg:
            cfg = _config_dict(cfg["text_config"])
        try:
            layers = int(cfg["num_hidden_layers"])
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
        except KeyError as exc:
            raise ConfigError(f"config has no {exc.args[0]!r}; is it a decoder LM?") from None
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        intermediate = int(cfg.get("intermediate_size") or 4 * hidden)
        windows = _sliding_windows(cfg, layers)
        dtype_name = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
        try:
            dtype = DType.parse(str(dtype_name))
        except ConfigError:
            dtype = DType.BF16
        return cls(
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            hidden_size=hidden,
            intermediate_size=intermediate,
            vocab_size=int(cfg["vocab_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
            sliding_windows=windows,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype=dtype,
            model_type=str(cfg.get("model_type", "llama")),
        )

    def kv_bytes_per_token(self, kv_dtype: DType | str = DType.BF16) -> int:
        """KV bytes one token adds across all layers (K and V), ignoring windows.

        ``2 * layers * kv_heads * head_dim * dtype_bytes``: Llama-2-7B bf16 = 524,288.
        """
        nbytes = DType.parse(kv_dtype).nbytes
        return int(2 * self.num_layers * self.num_kv_heads * self.head_dim * nbytes)

    def kv_bytes(
        self,
        tokens: int,
        batch: int = 1,
        kv_dtype: DType | str = DType.BF16,
        *,
        cap_windows: bool = True,
    ) -> int:
        """KV cache bytes of ``batch`` rows holding ``tokens`` tokens each.

        Args:
            tokens: tokens per row (prompt + generated so far).
            batch: rows.
            kv_dtype: KV cache dtype.
            cap_windows: cap sliding-window layers at their window (steady state);
                ``False`` counts every token (the prefill peak of a dynamic cache).

        Returns:
            Bytes.
        """
        if tokens < 0 or batch < 0:
            raise ConfigError("tokens and batch must be >= 0")
        per_layer_token = 2 * self.num_kv_heads * self.head_dim * DType.parse(kv_dtype).nbytes
        total = 0.0
        for window in self.sliding_windows:
            kept = tokens if (window is None or not cap_windows) else min(tokens, window)
            total += per_layer_token * kept
        return int(total * batch)


def _config_dict(config: Mapping[str, Any] | Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        out = dict(config.to_dict())
        # PretrainedConfig.to_dict drops class-level defaults of some models
        for key in ("head_dim", "sliding_window", "layer_types", "num_key_value_heads"):
            if key not in out and getattr(config, key, None) is not None:
                out[key] = getattr(config, key)
        return out
    raise ConfigError(f"not a config: {type(config).__name__}")


def _sliding_windows(cfg: Mapping[str, Any], layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:  # Qwen2 ships a window but disables it
        window = None
    layer_types = cfg.get("layer_types")
    if layer_types:
        return tuple(
            int(window) if (t in ("sliding_attention", "chunked_attention") and window) else None
            for t in layer_types
        )
    if window:
        return (int(window),) * layers
    return (None,) * layers


def load_config(model: str | os.PathLike[str]) -> dict[str, Any]:
    """Resolve a model name to a config dict, with no network access.

    Args:
        model: ``"default"`` (SmolLM2-135M), a ``"random:..."`` name from
            :data:`BUILTIN_CONFIGS`, a model folder holding ``config.json``, or the path
            of a ``config.json``.

    Returns:
        The config as a dict (always with ``model_type``).

    Raises:
        ConfigError: unknown name or unreadable file.
    """
    name = str(model)
    if name in BUILTIN_CONFIGS:
        return dict(BUILTIN_CONFIGS[name])
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"no model {name!r}: give a folder with config.json, a config.json, or one of "
            f"{sorted(BUILTIN_CONFIGS)}"
        )
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} is not a JSON object")
    cfg.setdefault("model_type", "llama")
    return cfg


def _model_key(model: str) -> str:
    if model in BUILTIN_CONFIGS:
        return model.replace(":", "-")
    return re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model).expanduser().resolve().name or model)


# --------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------

_ALLOC_ROUND = 512  # the CUDA caching allocator rounds every block up to 512 bytes


@dataclass(frozen=True, kw_only=True)
class WeightReport:
    """Bytes of the weights on the device, per kind.

    Attributes:
        total_bytes: everything (parameters and buffers, allocator-rounded).
        quantized_params: parameters stored quantized (``nn.Linear`` weights).
        unquantized_params: parameters kept in ``dtype`` (embeddings, norms, lm_head...).
        quantized_bytes: bytes of the quantized weights incl. their quantization state.
        unquantized_bytes: bytes of everything else.
        largest_linear_params: the biggest quantized ``nn.Linear`` (its dequantized copy
            is a prefill temporary).
        method: ``"meta"`` (measured on the meta device) or ``"analytic"``.
        loaded_bytes: the weights as loaded, before the static decoder is built
            (``int4``: the dense model); never below ``total_bytes``.
        load_peak_bytes: the most the weights take while loading (``int4``: the dense
            model plus the temporaries of quantizing one linear); never below ``total_bytes``.
    """

    total_bytes: int
    quantized_params: int
    unquantized_params: int
    quantized_bytes: int
    unquantized_bytes: int
    largest_linear_params: int
    method: str
    loaded_bytes: int = 0
    load_peak_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("loaded_bytes", "load_peak_bytes"):
            if getattr(self, name) < self.total_bytes:
                object.__setattr__(self, name, self.total_bytes)


def _round_alloc(nbytes: float) -> int:
    return int(math.ceil(nbytes / _ALLOC_ROUND) * _ALLOC_ROUND)


#: Model types whose layers ``quant=int4`` can run (the static decoder's, convo.fast).
INT4_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
#: Temporaries of quantizing one fused linear to int4, per parameter on top of its dense
#: copy (a float32 copy, the int32 grid, rounding intermediates; the plain layout's shifted
#: int32 halves). Measured on an H200 (Llama-2-7B, group 32, tinygemm layout only): the
#: load peak was the dense model + 13.6 bytes per parameter of the largest fused linear, of
#: which 2 are its bf16 copy; the plain layout adds ~4.5 (counted, not measured).
INT4_QUANTIZE_TEMP_BYTES_PER_PARAM = 16
#: Copies of the int4 weights the static decoder keeps on CUDA by default
#: (``convo.fast.int4.Int4Linear`` layout ``"both"``: tinygemm's for steps of a few rows,
#: the plain one for the Triton kernel and prefill); ``int4_kernel="triton"`` or
#: ``"tinygemm"`` keeps one. On CPU: 1.
INT4_CUDA_LAYOUTS = 2
#: Longest prefill chunk the static decoder captures as a CUDA graph (its
#: ``prefill_chunk_tokens`` default): the graphs' shared pool holds one such forward.
PREFILL_GRAPH_TOKENS = 512


@functools.cache
def _has_triton() -> bool:
    """Whether Triton is installed (the static decoder's kernels run), looked up once."""
    return importlib.util.find_spec("triton") is not None


def quantized_linear_bytes(
    out_features: int, in_features: int, quant: Quant, *, double_quant: bool = True
) -> int:
    """Device bytes of one bitsandbytes-quantized ``nn.Linear`` weight (no bias).

    nf4/fp4: packed 4-bit data (``n/2``) + absmax per 64-value block (fp32, or uint8 plus
    an fp32 absmax per 256 blocks with double quantization: 4.127 bits/param in all).
    int8 (LLM.int8): ``n`` bytes + one fp32 scale per output row.
    """
    n = out_features * in_features
    if quant is Quant.INT8:
        return _round_alloc(n) + _round_alloc(4 * out_features)
    if quant in (Quant.NF4, Quant.FP4):
        blocks = math.ceil(n / 64)
        if double_quant:
            state = _round_alloc(blocks) + _round_alloc(4 * math.ceil(blocks / 256))
            state += _round_alloc(256 * 4) + _round_alloc(4)  # code book, offset
        else:
            state = _round_alloc(4 * blocks)
        return _round_alloc(math.ceil(n / 2)) + state
    raise ConfigError(f"{quant} is not a bitsandbytes quantization")


#: Group sizes convo's int4 kernels accept, largest first.
INT4_GROUP_SIZES = (128, 64, 32)


def int4_group(in_features: int, preferred: int = INT4_GROUP_SIZE) -> int | None:
    """The group size the int4 path uses for ``in_features`` inputs: the largest of
    :data:`INT4_GROUP_SIZES` that is <= ``preferred`` and divides it, or ``None`` when none
    does (the weight then stays dense). ``convo.fast.int4`` quantizes by this rule."""
    for gs in INT4_GROUP_SIZES:
        if gs <= preferred and in_features % gs == 0 and in_features % 32 == 0:
            return gs
    return None


def int4_linear_bytes(out_features: int, in_features: int, dtype: DType, group_size: int) -> int | None:
    """Device bytes of one linear weight in convo's int4 format (``convo.fast.int4.Int4Linear``),
    no bias: packed int4 (``out * in / 2`` bytes, tinygemm's tile layout on CUDA, ``uint8
    [out, in/2]`` on CPU) + a scale and a zero per group of ``group_size`` inputs, in the
    compute ``dtype``. ``None`` when the shape stays dense (no group size fits ``in``, or
    ``out`` is not a multiple of 8)."""
    gs = int4_group(in_features, group_size)
    if gs is None or out_features % 8:
        return None
    packed = _round_alloc(out_features * in_features // 2)
    scales_zeros = _round_alloc(2 * out_features * (in_features // gs) * dtype.nbytes)
    return packed + scales_zeros


def planned_quant(quant: Quant | str | None, dtype: DType | str | None) -> tuple[Quant, DType | None]:
    """What the memory model prices for a weight format: ``(quant, dtype)``.

    Every dense format becomes ``NONE`` (its dtype, when it names one and ``dtype`` does
    not, becomes the dtype); ``AUTO`` is what the engine picks on CUDA (``NF4``).
    """
    q = Quant.parse(quant).resolved(cuda=True)
    dt = DType.parse(dtype) if dtype is not None else None
    if q.is_dense:
        if dt is None and q.dense_dtype is not None:
            dt = DType.parse(q.dense_dtype)
        q = Quant.NONE
    return q, dt


def weight_bytes(
    config: Mapping[str, Any],
    quant: Quant | str = Quant.NONE,
    dtype: DType | str | None = None,
    *,
    double_quant: bool = True,
    method: str = "auto",
    group_size: int = INT4_GROUP_SIZE,
    int4_layouts: int = INT4_CUDA_LAYOUTS,
) -> WeightReport:
    """Bytes of the weights on the GPU, module by module.

    Args:
        config: a config dict (see :func:`load_config`).
        quant: a :class:`~convo.engines.base.Quant`: dense (``none``, ``bf16``...),
            bitsandbytes (``int8``, ``nf4``, ``fp4``) or convo's ``int4`` (the decoder
            layers' linears, fused q/k/v and gate/up, group-wise; embeddings, norms and
            ``lm_head`` stay dense; the dense copies are freed after quantizing, so
            ``load_peak_bytes`` is the dense model plus one linear's temporaries).
        dtype: dtype of unquantized weights; default: the config's (bf16 for ``int4``,
            what the engine loads it in on CUDA).
        double_quant: nf4/fp4 with ``bnb_4bit_use_double_quant``.
        method: ``"meta"`` builds the model on the meta device (needs torch and
            transformers); ``"analytic"`` counts a Llama-style layout; ``"auto"`` tries
            meta first.
        group_size: int4 inputs per scale/zero pair (default :data:`INT4_GROUP_SIZE`,
            the engine's).
        int4_layouts: copies of the int4 weights kept (default :data:`INT4_CUDA_LAYOUTS`,
            2 as on CUDA; 1 on CPU or when every batch bucket runs the Triton kernel).

    Returns:
        A :class:`WeightReport`.

    Raises:
        ConfigError: ``int4`` for an architecture the static decoder does not run.
    """
    q, dt_given = planned_quant(quant, dtype)
    shape = ModelShape.from_config(config)
    if q is Quant.INT4:
        if shape.model_type not in INT4_MODEL_TYPES:
            raise ConfigError(
                f"int4 runs on the static decoder, which supports {sorted(INT4_MODEL_TYPES)}, "
                f"not {shape.model_type!r}"
            )
        if group_size not in (32, 64, 128):
            raise ConfigError("int4 group_size must be 32, 64 or 128")
        if int4_layouts not in (1, 2):
            raise ConfigError("int4_layouts must be 1 or 2")
    dt = dt_given or (DType.BF16 if q is Quant.INT4 else shape.dtype)
    if method in ("auto", "meta"):
        try:
            key = json.dumps(dict(config), sort_keys=True, default=str)
            return _weight_bytes_meta_cached(key, q, dt, double_quant, group_size, int4_layouts)
        except (ImportError, ValueError, KeyError) as exc:
            if method == "meta":
                raise ConfigError(f"cannot build {config.get('model_type')} on meta: {exc}") from exc
    return _weight_bytes_analytic(shape, q, dt, double_quant, group_size, int4_layouts)


@functools.lru_cache(maxsize=32)
def _weight_bytes_meta_cached(
    config_json: str, quant: Quant, dtype: DType, double_quant: bool, group_size: int, layouts: int
) -> WeightReport:
    return _weight_bytes_meta(json.loads(config_json), quant, dtype, double_quant, group_size, layouts)


_INT4_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)


def _int4_fused_groups(model: Any) -> list[list[tuple[str, Any]]]:
    """The linears the static decoder fuses and quantizes: per layer q/k/v, o, gate/up, down."""
    groups: list[list[tuple[str, Any]]] = []
    for i, layer in enumerate(model.model.layers):
        for names in _INT4_GROUPS:
            groups.append([(f"model.layers.{i}.{n}", layer.get_submodule(n)) for n in names])
    return groups


def _weight_bytes_meta(
    config: Mapping[str, Any],
    quant: Quant,
    dtype: DType,
    double_quant: bool,
    group_size: int,
    layouts: int,
) -> WeightReport:
    import torch
    from torch import nn
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_dict = {k: v for k, v in config.items() if k not in ("architectures", "auto_map")}
    cfg_dict.pop("quantization_config", None)
    model_type = cfg_dict.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **cfg_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    elem = dtype.nbytes
    qbytes = ubytes = 0
    qparams = uparams = 0
    largest = 0
    seen: set[int] = set()
    if quant is Quant.INT4:
        for group in _int4_fused_groups(model):
            mods = [m for _, m in group]
            out_f = sum(int(m.out_features) for m in mods)
            in_f = int(mods[0].in_features)
            nbytes = int4_linear_bytes(out_f, in_f, dtype, group_size)
            if nbytes is None:
                continue  # stays dense: counted with the rest below
            nbytes *= layouts
            if any(m.bias is not None for m in mods):
                nbytes += _round_alloc(out_f * elem)  # the fused bias (the modules keep theirs)
            qbytes += nbytes
            qparams += out_f * in_f
            largest = max(largest, out_f * in_f)
            seen.update(id(m.weight) for m in mods)  # freed after quantizing
    skip: set[str] = set()
    if quant.is_bitsandbytes:
        from transformers.quantizers.base import get_keys_to_not_convert

        skip = set(get_keys_to_not_convert(model))
    for name, module in model.named_modules():
        quantize_here = (
            quant.is_bitsandbytes
            and isinstance(module, nn.Linear)
            and not any(name == s or name.endswith("." + s) for s in skip)
        )
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # tied weights count once
                continue
            seen.add(id(param))
            if quantize_here and pname == "weight":
                out_f, in_f = param.shape
                qbytes += quantized_linear_bytes(out_f, in_f, quant, double_quant=double_quant)
                qparams += param.numel()
                largest = max(largest, param.numel())
            else:
                ubytes += _round_alloc(param.numel() * elem)
                uparams += param.numel()
        for _bname, buf in module.named_buffers(recurse=False):
            if id(buf) in seen:
                continue
            seen.add(id(buf))
            ubytes += _round_alloc(buf.numel() * buf.element_size())
    return _weight_report("meta", quant, dtype, qbytes, qparams, ubytes, uparams, largest)


def _weight_report(
    method: str,
    quant: Quant,
    dtype: DType,
    qbytes: int,
    qparams: int,
    ubytes: int,
    uparams: int,
    largest: int,
) -> WeightReport:
    """The report of weights counted by ``method``: ``qparams`` quantized parameters in
    ``qbytes``, ``uparams`` others in ``ubytes``, the largest quantized linear's
    parameters. int4 loads the model dense, then quantizes linear by linear (freeing each
    dense copy): its load peak is the dense model plus the temporaries of the first,
    largest linear."""
    load: dict[str, int] = {}
    if quant is Quant.INT4:
        dense = ubytes + _round_alloc(qparams * dtype.nbytes)
        peak = dense + largest * (dtype.nbytes + INT4_QUANTIZE_TEMP_BYTES_PER_PARAM)
        load = {"loaded_bytes": dense, "load_peak_bytes": int(peak)}
    return WeightReport(
        total_bytes=qbytes + ubytes,
        quantized_params=qparams,
        unquantized_params=uparams,
        quantized_bytes=qbytes,
        unquantized_bytes=ubytes,
        largest_linear_params=largest,
        method=method,
        **load,
    )


def _weight_bytes_analytic(
    shape: ModelShape, quant: Quant, dtype: DType, double_quant: bool, group_size: int, layouts: int
) -> WeightReport:
    h, i, hd = shape.hidden_size, shape.intermediate_size, shape.head_dim
    q_out, kv_out = shape.num_heads * hd, shape.num_kv_heads * hd
    if quant is Quant.INT4:  # the static decoder's fused groups
        layer = [(q_out + 2 * kv_out, h), (h, q_out), (2 * i, h), (h, i)]
    else:
        layer = [(q_out, h), (kv_out, h), (kv_out, h), (h, q_out), (i, h), (i, h), (h, i)]
    linears = layer * shape.num_layers
    elem = dtype.nbytes
    norms = (2 * shape.num_layers + 1) * h
    emb = shape.vocab_size * h * (1 if shape.tie_word_embeddings else 2)
    qbytes = qparams = largest = 0
    uparams = norms + emb
    for o, n in linears:
        nbytes: int | None = None
        if quant is Quant.INT4:
            one = int4_linear_bytes(o, n, dtype, group_size)
            nbytes = None if one is None else one * layouts
        elif quant.is_bitsandbytes:
            nbytes = quantized_linear_bytes(o, n, quant, double_quant=double_quant)
        if nbytes is None:
            uparams += o * n
        else:
            qbytes += nbytes
            qparams += o * n
            largest = max(largest, o * n)
    ubytes = _round_alloc(uparams * elem)
    return _weight_report("analytic", quant, dtype, qbytes, qparams, ubytes, uparams, largest)


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
    seg = _segment_bytes(_round_alloc(bytes_per_token * prompt_tokens))
    for t in range(prompt_tokens + 1, prompt_tokens + max(new_tokens, 1)):
        need = _round_alloc(bytes_per_token * t)
        if need > seg:
            gens += 1
            seg = _segment_bytes(need)
    return gens


# Prediction
# --------------------------------------------------------------------------------------


class _Cell(NamedTuple):
    """A cell asked of :meth:`MemoryModel.predict`: its requests' shape, and the device
    memory it must fit (``None``: not checked)."""

    context: int
    concurrency: int
    prompt: int
    new: int
    memory_bytes: int | None


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

    def __post_init__(self) -> None:
        if not self.running:
            object.__setattr__(self, "running", self.concurrency - self.queued)


@dataclass(frozen=True, kw_only=True)
class MemoryModel:
    """Everything needed to price requests: shape, weights, dtypes, calibration.

    Example::

        mm = MemoryModel.from_model("random:llama-2-7b", quant="nf4")
        mm.predict(context=4096, concurrency=4).peak_reserved_bytes / 2**30   # ~16-20 GiB
        mm.request_bytes(prompt_tokens=1000, max_new_tokens=256)              # KV + share

    Args:
        shape: the model's shape.
        weights: the weight report.
        compute_dtype: dtype of activations (bf16 for nf4 with bf16 compute).
        kv_dtype: KV cache dtype.
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
    ) -> MemoryModel:
        """Build from a model name/folder/config.json (see :func:`load_config`).

        ``quant`` is any :class:`~convo.engines.base.Quant` spelling; dense ones price as
        ``NONE`` in their dtype (see :func:`planned_quant`), ``int4`` in groups of
        ``int4_group_size`` inputs, ``int4_layouts`` copies (see :func:`weight_bytes`).
        """
        cfg = load_config(model)
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
        """KV bytes per token across layers, in ``kv_dtype``."""
        return self.shape.kv_bytes_per_token(self.kv_dtype)

    def kv_pool_bytes(self, slots: int, slot_tokens: int) -> int:
        """The static KV slot pool (:class:`convo.fast.kv_pool.KVSlotPool`): ``slots`` caches of
        ``slot_tokens`` tokens, taken once at load. Exact: the pool is these bytes (checked
        against ``torch.cuda.memory_allocated`` in the decode tests and benchmark)."""
        from convo.fast.kv_pool import KVSlotPool

        s = self.shape
        return KVSlotPool.predicted_nbytes(
            num_layers=s.num_layers,
            num_kv_heads=s.num_kv_heads,
            head_dim=s.head_dim,
            slots=slots,
            slot_tokens=slot_tokens,
            dtype_bytes=self.kv_dtype.nbytes,
        )

    def auto_kv_slots(self, memory_bytes: int, slot_tokens: int) -> int:
        """The slots ``TransformersEngine(kv_slots=None)`` takes on a CUDA device of
        ``memory_bytes``: :data:`~convo.engines.transformers.DEFAULT_KV_SLOTS`, or fewer
        when they do not fit in :data:`~convo.engines.transformers.AUTO_SLOTS_MEMORY_FRACTION`
        of the memory free after loading (``int4``: the dense model is still there); at least 1."""
        from convo.engines.transformers import auto_kv_slots

        free = memory_bytes - self.weights.loaded_bytes * self.calibration.weights_reserved_ratio
        return max(1, auto_kv_slots(free, self.kv_pool_bytes(1, slot_tokens)))

    def act_bytes_per_token(self) -> float:
        """Prefill activation bytes per prompt token (all rows), SDPA."""
        c = self.calibration
        s = self.shape
        return self.compute_dtype.nbytes * (
            c.act_intermediate_factor * s.intermediate_size + c.act_hidden_factor * s.hidden_size
        )

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
        fixed = self.weights.total_bytes * self.calibration.weights_reserved_ratio
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
                (default :data:`convo.fast.scheduler.DEFAULT_STEP_TOKENS`, the engine's).

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
        reserved = int(weights * self.calibration.weights_reserved_ratio + reserved_above)
        memory_bytes = cell.memory_bytes
        safe = None
        if memory_bytes is not None:
            safe = reserved <= memory_bytes and self.weights.load_peak_bytes <= memory_bytes
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
            **slots,
        )

    def _predict_slots(self, cell: _Cell, kv_slots: int, step_tokens: int | None) -> CellPrediction:
        """The static decoder: weights + the slot pool + one step's prefill activations
        (the running turns' prompts, up to ``step_tokens`` tokens in one forward, with one
        dequantized int4 weight) + the captured steps' buffers (per batch bucket 1, 2, 4...
        >= slots: a cuBLAS workspace for its capture stream and the step's rows) + the
        captured prefill's pool (one :data:`PREFILL_GRAPH_TOKENS`-token forward and a
        dequantized weight; its attention reads the slot in place, or, without Triton,
        from a gathered copy under a mask, counted then; the mixed steps' graphs share it and add
        their logits, per batch bucket and chunk bucket up to
        :data:`~convo.fast.decoder.MIXED_CHUNK_TOKENS`).

        Measured on an H200 (Llama-2-7B int4 group 32, 4 slots of 4096 tokens): pool exact;
        weights 8.68 GB with both int4 layouts (predicted -0.7 %), 4.62 GB with tinygemm's
        alone (-1.1 %); captured steps 135 MB and a 3,840-token prefill of the earlier
        one-turn, 512-token-chunk decoder 88 MB above them (predicted together 0.37 GB).
        """
        from convo.fast.decoder import MIXED_CHUNK_TOKENS

        if step_tokens is None:
            from convo.fast.scheduler import DEFAULT_STEP_TOKENS

            step_tokens = DEFAULT_STEP_TOKENS
        if kv_slots < 1 or step_tokens < 1:
            raise ConfigError("kv_slots and step_tokens must be >= 1")
        s = self.shape
        pool = self.kv_pool_bytes(kv_slots, cell.context)
        running = min(cell.concurrency, kv_slots)
        tokens = min(step_tokens, running * cell.prompt)
        prefill = int(tokens * self.act_bytes_per_token()) + self.workspace_bytes()
        buckets = [1 << i for i in range(max(kv_slots - 1, 0).bit_length() + 1)]
        per_row = self.act_bytes_per_token() + s.vocab_size * (self.compute_dtype.nbytes + 4)
        graphs = int(len(buckets) * self.calibration.workspace_bytes + sum(buckets) * per_row)
        chunk = min(PREFILL_GRAPH_TOKENS, cell.context)
        gather = 0
        if not _has_triton():  # no chunk-attention kernel: SDPA over a gathered slot
            slot_view = 2 * cell.context * s.num_heads * s.head_dim * self.compute_dtype.nbytes
            gather = int(slot_view + chunk * cell.context)  # and its mask
        graphs += int(chunk * self.act_bytes_per_token() + self.workspace_bytes() + gather)
        mixed_buckets = sum(1 for i in range(16) if 16 << i <= min(MIXED_CHUNK_TOKENS, cell.context))
        graphs += mixed_buckets * (sum(buckets) + len(buckets)) * s.vocab_size * 4
        return self._prediction(
            cell, kv=pool, activations=prefill + graphs,
            reserved_above=pool + graphs + prefill * self.calibration.prefill_reserved_ratio,
            phase="slots", kv_slots=kv_slots, running=running, queued=cell.concurrency - running,
        )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A grid of predictions and what is safe."""

    model: str
    memory_bytes: int
    cells: tuple[CellPrediction, ...]
    weights_bytes: int
    kv_bytes_per_token: int
    calibration_source: str
    kv_slots: int | str | None = None  # a number, "auto" (the engine's choice per context) or None
    load_peak_bytes: int = 0

    def max_safe_concurrency(self) -> dict[int, int]:
        """Per context: the largest concurrency of the grid that is safe (0: none); with KV
        slots, the requests that run at once (at most the slots; more queue)."""
        return self._largest_safe(by="context", value="running")

    def max_safe_context(self) -> dict[int, int]:
        """Per concurrency: the largest context of the grid that is safe (0: none)."""
        return self._largest_safe(by="concurrency", value="context")

    def _largest_safe(self, *, by: str, value: str) -> dict[int, int]:
        out: dict[int, int] = {}
        for c in self.cells:
            key = getattr(c, by)
            out[key] = max(out.get(key, 0), getattr(c, value) if c.safe else 0)
        return out


def plan_grid(
    mm: MemoryModel,
    *,
    model: str,
    contexts: Sequence[int],
    concurrencies: Sequence[int],
    memory_bytes: int,
    new_tokens: int = 256,
    kv_slots: int | str | None = None,
) -> Plan:
    """Predict every (context, concurrency) cell against ``memory_bytes``.

    ``kv_slots``: a slot pool of that many slots of each cell's context, or ``"auto"``:
    as many as the engine takes by default (:meth:`MemoryModel.auto_kv_slots`, per context).
    """
    if kv_slots is not None and kv_slots != "auto" and not isinstance(kv_slots, int):
        raise ConfigError(f"kv_slots must be a number of slots or 'auto', not {kv_slots!r}")

    def slots(ctx: int) -> int | None:
        if kv_slots == "auto":
            return mm.auto_kv_slots(memory_bytes, ctx)
        return kv_slots if isinstance(kv_slots, int) else None

    cells = tuple(
        mm.predict(
            context=ctx,
            concurrency=conc,
            new_tokens=new_tokens,
            memory_bytes=memory_bytes,
            kv_slots=slots(ctx),
        )
        for ctx in contexts
        for conc in concurrencies
    )
    return Plan(
        model=model,
        memory_bytes=memory_bytes,
        cells=cells,
        weights_bytes=mm.weights.total_bytes,
        kv_bytes_per_token=mm.kv_bytes_per_token(),
        calibration_source=mm.calibration.source,
        kv_slots=kv_slots,
        load_peak_bytes=mm.weights.load_peak_bytes,
    )
