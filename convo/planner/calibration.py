"""Calibration of the memory model: the activation and allocator constants, built in
(measured on an H200) or measured by ``convo plan --measure`` and cached as JSON under
``<cache>/calibration/`` (see :func:`convo.paths.cache_dir`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from convo.errors import ConfigError
from convo.paths import cache_dir

if TYPE_CHECKING:
    from convo.models.quant import Quant
    from convo.models.spec import Attn

MiB = 1024**2

# ANCHORS (H200, Llama-2-7B nf4, SDPA): peak allocated above weights = 1.19 x KV at 4k+
# contexts. KV per token is 524,288 B, so activations are ~0.19 x 524,288 = 99.6 kB per
# prompt token = bf16 x (3 x 11008 + 4 x 4096): three MLP-wide tensors (act(gate), up,
# product) and four residual-wide ones (residual, normed input, q/attn-out, rotary copy).
DEFAULT_ACT_INTERMEDIATE_FACTOR = 3.0
DEFAULT_ACT_HIDDEN_FACTOR = 4.0
# eager attention, per score element: bf16 scores + masked copy + fp32 softmax + bf16 cast
# (= 10 B); ANCHORS 8192-token prefill: eager 24.38 GiB vs SDPA 4.76 GiB.
DEFAULT_EAGER_BYTES_PER_SCORE = 10.0
DEFAULT_WORKSPACE_BYTES = 32 * MiB  # cuBLAS workspace, allocated through the torch pool
# Measured on an H200 (torch 2.11, transformers 5.17, bnb 0.50.2, Llama-2-7B nf4, SDPA,
# 16 new tokens, 24 cells of contexts 1k-16k x concurrency 1-16): the prefill leaves the
# reserved pool at 1.27-1.31x the allocated peak above the weights (1.06-1.09 below 2 GiB);
# the weights themselves reserve 1.047x their allocated bytes.
DEFAULT_PREFILL_RESERVED_RATIO = 1.285
DEFAULT_WEIGHTS_RESERVED_RATIO = 1.047


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Constants of the activation and allocator model, measured or default.

    Args:
        act_intermediate_factor: prefill activation bytes per token = dtype bytes *
            (this * intermediate_size + ``act_hidden_factor`` * hidden_size).
        act_hidden_factor: see above.
        eager_bytes_per_score: bytes per ``rows * heads * prompt²`` score element, eager.
        workspace_bytes: constant activation bytes (cuBLAS workspace...).
        prefill_reserved_ratio: reserved/allocated, both above the weights, at the end
            of the prefill.
        weights_reserved_ratio: reserved/allocated of the weights alone after loading.
        source: where the constants come from (``"anchors"``, a calibration path...).
    """

    act_intermediate_factor: float = DEFAULT_ACT_INTERMEDIATE_FACTOR
    act_hidden_factor: float = DEFAULT_ACT_HIDDEN_FACTOR
    eager_bytes_per_score: float = DEFAULT_EAGER_BYTES_PER_SCORE
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES
    prefill_reserved_ratio: float = DEFAULT_PREFILL_RESERVED_RATIO
    weights_reserved_ratio: float = DEFAULT_WEIGHTS_RESERVED_RATIO
    source: str = "built-in (H200, 2026-11-29)"

    def __post_init__(self) -> None:
        if self.prefill_reserved_ratio < 1.0 or self.weights_reserved_ratio < 1.0:
            raise ConfigError("reserved ratios must be >= 1 (reserved >= allocated)")
        if (
            min(
                self.act_intermediate_factor,
                self.act_hidden_factor,
                self.eager_bytes_per_score,
                self.workspace_bytes,
            )
            < 0
        ):
            raise ConfigError("activation constants must be >= 0")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Calibration:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def calibration_dir() -> Path:
    """``<cache>/calibration`` (not created); the cache folder is :func:`convo.paths.cache_dir`."""
    return cache_dir() / "calibration"


def calibration_path(model_key: str, quant: Quant, attn: Attn, device_name: str) -> Path:
    dev = re.sub(r"[^A-Za-z0-9._-]+", "_", device_name)
    return calibration_dir() / f"{model_key}__{quant.value}__{attn.value}__{dev}.json"


def find_calibration(model_key: str, quant: Quant, attn: Attn) -> Path | None:
    """The newest cached calibration for this model/quant/attention on any device."""
    folder = calibration_dir()
    if not folder.is_dir():
        return None
    found = sorted(
        folder.glob(f"{model_key}__{quant.value}__{attn.value}__*.json"),
        key=lambda p: p.stat().st_mtime,
    )
    return found[-1] if found else None


def load_calibration(path: str | os.PathLike[str]) -> Calibration:
    """Read a calibration JSON written by ``convo plan --measure``."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read calibration {path}: {exc}") from exc
    cal = Calibration.from_json(data.get("calibration", data))
    return dataclasses.replace(cal, source=str(path))


# --------------------------------------------------------------------------------------
