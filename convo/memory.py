"""Deprecated: ``convo.memory`` moved to :mod:`convo.planner`; this alias goes away in the next release."""

from convo._deprecated import moved

__getattr__ = moved(
    "convo.memory",
    "convo.planner",
    [
        "convo.planner.memory",
        "convo.planner.weights",
        "convo.planner.grid",
        "convo.planner.calibration",
        "convo.planner.measure",
        "convo.models",
    ],
)
