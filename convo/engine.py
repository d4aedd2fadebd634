"""Deprecated: ``convo.engine`` moved to :mod:`convo.engines`; this alias goes away in the next release."""

from convo._deprecated import moved

__getattr__ = moved(
    "convo.engine",
    "convo.engines",
    ["convo.engines.base", "convo.engines.transformers", "convo.engines.models", "convo.paths"],
)
