"""The GPU memory planner: will this model fit context N with M sessions on this device?

* :mod:`convo.planner.model` — the memory model (weights from the meta device, KV cache,
  activations, the caching allocator) and the plan grid;
* :mod:`convo.planner.calibration` — its constants, built in or measured;
* :mod:`convo.planner.measure` — the measurement harness on a real GPU (``convo plan --measure``).

Nothing here imports torch or transformers at import time.
"""

from __future__ import annotations

from convo.planner.calibration import Calibration, load_calibration
from convo.planner.model import (
    Attn,
    CellPrediction,
    DType,
    MemoryModel,
    ModelShape,
    Plan,
    Quant,
    WeightReport,
    format_size,
    load_config,
    parse_size,
    plan_grid,
)

__all__ = [
    "Attn",
    "Calibration",
    "CellPrediction",
    "DType",
    "MemoryModel",
    "ModelShape",
    "Plan",
    "Quant",
    "WeightReport",
    "format_size",
    "load_calibration",
    "load_config",
    "parse_size",
    "plan_grid",
]
