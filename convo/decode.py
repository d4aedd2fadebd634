"""Deprecated: ``convo.decode`` moved to :mod:`convo.fast`; this alias goes away in the next release."""

from convo._deprecated import moved

__getattr__ = moved(
    "convo.decode",
    "convo.fast",
    [
        "convo.fast",
        "convo.fast.int4",
        "convo.fast.decoder",
        "convo.fast.scheduler",
        "convo.fast.kernels",
        "convo.fast.attention",
        "convo.fast.kv_pool",
    ],
)
