"""Deprecated: ``convo.engines.models`` moved to :mod:`convo.engines.local.loading`;
this alias goes away in the next release."""

from convo._deprecated import moved

__getattr__ = moved("convo.engines.models", "convo.engines.local.loading", ["convo.engines.local.loading"])
