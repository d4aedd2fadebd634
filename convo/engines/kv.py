"""Deprecated: ``convo.engines.kv`` moved to :mod:`convo.engines.local.kv`;
this alias goes away in the next release."""

from convo._deprecated import moved

__getattr__ = moved("convo.engines.kv", "convo.engines.local.kv", ["convo.engines.local.kv"])
