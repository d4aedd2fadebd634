"""The GPU memory planner: will this model fit context N with M sessions on this device?

* :mod:`convo.planner.weights` — the weights' bytes (measured on the meta device);
* :mod:`convo.planner.memory` — :class:`VRAMModel`: KV cache, activations and the caching
  allocator above the weights, per request and per batch;
* :mod:`convo.planner.grid` — :func:`plan_grid`: a grid of contexts x concurrencies priced
  against a device (:class:`Plan`, :class:`CellPrediction`);
* :mod:`convo.planner.calibration` — its constants, built in or measured;
* :mod:`convo.planner.measure` — the measurement harness on a real GPU (``convo plan --measure``).

Model shapes, dtypes and sizes are :mod:`convo.models`' (exported here too; ``Quant`` only
there, its name here is deprecated).
``MemoryModel`` is the old name of :class:`VRAMModel` (deprecated: "memory" is the
conversation's memory elsewhere in convo). Nothing here imports torch or transformers at
import time.
"""

from __future__ import annotations

from typing import Any

from convo.models import quant as _quant
from convo.models.legacy import warn_moved
from convo.models.spec import Attn, DType, ModelShape, load_config
from convo.models.units import format_size, parse_size
from convo.planner.calibration import Calibration, load_calibration
from convo.planner.grid import Plan, plan_grid
from convo.planner.memory import CellPrediction, VRAMModel
from convo.planner.weights import WeightReport, weight_bytes

__all__ = [
    "Attn",
    "Calibration",
    "CellPrediction",
    "DType",
    "ModelShape",
    "Plan",
    "VRAMModel",
    "WeightReport",
    "format_size",
    "load_calibration",
    "load_config",
    "parse_size",
    "plan_grid",
    "weight_bytes",
]


def __getattr__(name: str) -> Any:
    if name == "Quant":
        warn_moved("convo.planner.Quant", "convo.models.Quant")
        return _quant.Quant
    if name == "MemoryModel":
        warn_moved("convo.planner.MemoryModel", "convo.planner.VRAMModel")
        return VRAMModel
    raise AttributeError(f"module 'convo.planner' has no attribute {name!r}")
