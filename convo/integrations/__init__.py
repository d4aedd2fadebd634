"""Adapters for agent frameworks. Each module imports its framework, so import the one
you use; ``import convo`` imports none of them.

* :mod:`convo.integrations.langchain` (``pip install 'convo[langchain]'``): a chat
  message history backed by a convo store, and a Runnable that fits the prompt, new
  message included, into a budget.
* :mod:`convo.integrations.llamaindex` (``pip install 'convo[llamaindex]'``):
  ``ConvoMemory``, a ``BaseMemory``.
* :mod:`convo.integrations.openai_agents` (``pip install 'convo[agents]'``):
  ``ConvoSession``, a ``Session`` for the OpenAI Agents SDK whose ``get_items`` returns
  the budgeted items.
"""

from __future__ import annotations

from convo.errors import MissingDependency


def require(module: str, extra: str) -> None:
    """Raise :class:`~convo.errors.MissingDependency` naming the install when ``module``
    cannot be imported."""
    import importlib.util

    if importlib.util.find_spec(module.split(".")[0]) is None:
        raise MissingDependency(f"{module} is not installed; run: pip install 'convo[{extra}]'")
