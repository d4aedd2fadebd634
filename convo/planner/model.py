"""Deprecated: ``convo.planner.model`` was split; this alias goes away in the next release.

* :mod:`convo.planner.weights` — weight bytes (:func:`~convo.planner.weights.weight_bytes`,
  :class:`~convo.planner.weights.WeightReport`);
* :mod:`convo.planner.memory` — :class:`~convo.planner.memory.VRAMModel` (was ``MemoryModel``);
* :mod:`convo.planner.grid` — :class:`~convo.planner.grid.Plan`,
  :func:`~convo.planner.grid.plan_grid`, :class:`~convo.planner.memory.CellPrediction`;
* :mod:`convo.models` — model shapes, dtypes, sizes, int4 groups and defaults.
"""

from convo._deprecated import moved

__getattr__ = moved(
    "convo.planner.model",
    "convo.planner (weights, memory, grid) and convo.models",
    [
        "convo.planner.memory",  # first: it serves MemoryModel (with its own warning)
        "convo.planner.weights",
        "convo.planner.grid",
        "convo.models.spec",
        "convo.models.units",
        "convo.models.quant",
        "convo.models.defaults",
        "convo.planner._legacy",
    ],
)
