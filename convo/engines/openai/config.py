"""The remote engine's settings: keyword-only, validated values, each with its unit.

:class:`~convo.engines.openai.OpenAIEngine` takes them grouped::

    OpenAIEngine(url, model,
                 timeouts=Timeouts(call_s=60, connect_s=10),     # seconds
                 limits=ConnectionLimits(max_connections=16),   # connections
                 retry=RetryPolicy(max_retries=3, backoff_s=0.5))

The flat keywords of convo 0.1 (``timeout_s=``, ``connect_timeout_s=``,
``max_connections=``, ``max_retries=``, ``backoff_s=``) still work for one release, with a
``DeprecationWarning``: :func:`from_legacy` maps them onto these groups.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from convo.engines.openai.retry import RetryPolicy
from convo.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Timeouts:
    """How long the engine waits, in seconds.

    Args:
        call_s: default wall-clock cap of one ``generate`` call, retries and waits
            included (a call's own ``timeout_s=`` wins). Default 60.
        connect_s: cap on opening one connection (and on the ``/v1/models`` question).
            Default 10.

    Raises:
        ConfigError: a value <= 0.

    Example:
        >>> Timeouts(call_s=120).connect_s
        10.0
    """

    call_s: float = 60.0
    connect_s: float = 10.0

    def __post_init__(self) -> None:
        if not (self.call_s > 0 and self.connect_s > 0):
            raise ConfigError("Timeouts: call_s and connect_s must be > 0 seconds")


@dataclass(frozen=True, kw_only=True)
class ConnectionLimits:
    """The connection pool to the server.

    Args:
        max_connections: connections kept open to the server, per client (one sync
            client, one async client per event loop). It is also the engine's
            ``concurrent_calls``: calls from that many threads run together, and the
            server decides how. Default 16.

    Raises:
        ConfigError: ``max_connections`` < 1.
    """

    max_connections: int = 16

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ConfigError("ConnectionLimits: max_connections must be >= 1")


#: The flat keywords of convo 0.1: (group, field) each maps to.
LEGACY_KEYWORDS: Mapping[str, tuple[str, str]] = {
    "timeout_s": ("timeouts", "call_s"),
    "connect_timeout_s": ("timeouts", "connect_s"),
    "max_connections": ("limits", "max_connections"),
    "max_retries": ("retry", "max_retries"),
    "backoff_s": ("retry", "backoff_s"),
}


def from_legacy(
    legacy: Mapping[str, Any],
    *,
    timeouts: Timeouts | None,
    limits: ConnectionLimits | None,
    retry: RetryPolicy | None,
) -> tuple[Timeouts, ConnectionLimits, RetryPolicy]:
    """The three groups, with the flat 0.1 keywords in ``legacy`` folded in.

    A flat keyword warns (``DeprecationWarning``, naming its replacement). As in 0.1 a
    whole ``retry=`` wins over ``max_retries=`` / ``backoff_s=``; a flat keyword given
    with its own group (``timeout_s=`` with ``timeouts=``) is a ``TypeError``, and so is
    an unknown keyword.
    """
    groups: dict[str, Any] = {"timeouts": timeouts, "limits": limits, "retry": retry}
    defaults: dict[str, Any] = {"timeouts": Timeouts(), "limits": ConnectionLimits(), "retry": RetryPolicy()}
    changes: dict[str, dict[str, Any]] = {}
    for name, value in legacy.items():
        if name not in LEGACY_KEYWORDS:
            raise TypeError(f"OpenAIEngine() got an unexpected keyword argument {name!r}")
        group, field_name = LEGACY_KEYWORDS[name]
        new = f"{group}={type(defaults[group]).__name__}({field_name}=...)"
        warnings.warn(
            f"OpenAIEngine({name}=) is deprecated; pass {new} instead", DeprecationWarning, stacklevel=3
        )
        if groups[group] is not None:
            if group == "retry":
                continue  # 0.1: a full policy wins over max_retries / backoff_s
            raise TypeError(f"OpenAIEngine() got both {group}= and {name}=; pass {new} only")
        changes.setdefault(group, {})[field_name] = value
    out = {
        group: groups[group]
        if groups[group] is not None
        else replace(defaults[group], **changes.get(group, {}))
        for group in groups
    }
    return out["timeouts"], out["limits"], out["retry"]
