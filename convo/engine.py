"""Deprecated: ``convo.engine`` moved to :mod:`convo.engines`; this alias goes away in the next release."""

from convo._deprecated import moved

__getattr__ = moved(
    "convo.engine",
    "convo.engines",
    [
        "convo.engines.base",
        "convo.models.generation",
        "convo.models.quant",
        "convo.engines.local.engine",
        "convo.engines.local.loading",
        "convo.paths",
    ],
)
