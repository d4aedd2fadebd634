"""What a model is, as convo's layers see it: its shape, dtypes and built-in configs.

* :class:`ModelShape` — the numbers of a decoder config that memory and speed depend on
  (layers, heads, KV heads, head size, widths, vocabulary, sliding windows);
* :class:`DType` — a tensor dtype as spelled on the command line, with its bytes;
* :class:`Attn` — the attention implementation;
* :data:`BUILTIN_CONFIGS` and :func:`load_config` — configs that need no download.

The planner (:mod:`convo.planner`), the fast path (:mod:`convo.fast`) and the engines read
these facts from here; this module imports nothing of convo but :mod:`convo.errors`, and
no torch or transformers.
"""

from __future__ import annotations

import enum
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from convo.errors import ConfigError

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
            :data:`BUILTIN_CONFIGS`, ``"random:<folder or config.json>"`` (any
            architecture's config, built with random weights by the engine), a model
            folder holding ``config.json``, or the path of a ``config.json``.

    Returns:
        The config as a dict (always with ``model_type``).

    Raises:
        ConfigError: unknown name or unreadable file.
    """
    name = str(model)
    if name in BUILTIN_CONFIGS:
        return dict(BUILTIN_CONFIGS[name])
    path = random_config_path(name) or Path(name).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"no model {name!r}: give a folder with config.json, a config.json, "
            f"random:<folder or config.json>, or one of {sorted(BUILTIN_CONFIGS)}"
        )
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} is not a JSON object")
    cfg.setdefault("model_type", "llama")
    return cfg


#: The prefix of a model with random weights: ``random:<built-in name>`` or
#: ``random:<config folder or config.json>``.
RANDOM_PREFIX = "random:"


def is_random_model(model: str | os.PathLike[str] | None) -> bool:
    """Whether ``model`` asks for random weights (``random:...``)."""
    return model is not None and os.fspath(model).startswith(RANDOM_PREFIX)


def random_config_path(model: str | os.PathLike[str]) -> Path | None:
    """The ``config.json`` a ``random:<folder or config.json>`` model names, or ``None``
    (not ``random:``, or a built-in name). The path need not exist (:func:`load_config`
    says so)."""
    name = os.fspath(model)
    if not name.startswith(RANDOM_PREFIX) or name in BUILTIN_CONFIGS:
        return None
    path = Path(name[len(RANDOM_PREFIX) :]).expanduser()
    return path / "config.json" if path.is_dir() or path.suffix != ".json" else path


def model_key(model: str) -> str:
    """A file-name-safe key of a model name or folder (calibration files are named by it)."""
    if model in BUILTIN_CONFIGS:
        return model.replace(":", "-")
    path = random_config_path(model)
    if path is not None:
        folder = path.parent if path.name == "config.json" else path.with_suffix("")
        return "random-" + re.sub(r"[^A-Za-z0-9._-]+", "_", folder.resolve().name or "config")
    return re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model).expanduser().resolve().name or model)


#: Model types whose decoder layers the static decoder (:class:`convo.fast.decoder.StaticDecoder`)
#: runs, and so the architectures ``quant=int4`` supports.
STATIC_DECODE_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
