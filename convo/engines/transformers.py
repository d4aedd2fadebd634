"""Deprecated: ``convo.engines.transformers`` moved to :mod:`convo.engines.local.engine`;
this alias goes away in the next release."""

from convo._deprecated import moved

__getattr__ = moved(
    "convo.engines.transformers",
    "convo.engines.local.engine",
    ["convo.engines.local.engine", "convo.engines.local.loading"],
)
