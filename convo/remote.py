"""Deprecated: ``convo.remote`` moved to :mod:`convo.engines.openai` (alias for one release)."""

from convo._deprecated import moved

__getattr__ = moved("convo.remote", "convo.engines.openai", ["convo.engines.openai"])
