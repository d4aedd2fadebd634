"""A session's settings that travel together: :class:`SummaryConfig` (how the rolling
summary is written and waited for) and :class:`ReplyConfig` (the defaults of every reply's
generate call), and the checks a budget passes against the engine before a session stores
anything (:func:`check_budget_fits`, :func:`summary_cap`).

``Session(summarizer=..., summaries=..., summary_wait_s=..., sampling=..., timeout_s=...)``,
the keywords these objects replace, still work for one release: :func:`from_legacy_kwargs`
maps them, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

from convo.budget import Budget
from convo.engines.base import GREEDY, Engine, Sampling
from convo.errors import ConfigError, ConvoError
from convo.session.summaries import SUMMARY_WAIT_AUTO, check_summary_wait
from convo.summarize import ModelSummarizer, Summarizer, SummaryWorker

logger = logging.getLogger(__package__)


@dataclass(frozen=True, kw_only=True)
class SummaryConfig:
    """How a session keeps its rolling summary of the turns that left the window.

    Args:
        summarizer: folds evicted turns into the summary; default ``None``: the engine
            itself through :class:`~convo.summarize.ModelSummarizer` (no summary without an
            engine or with ``budget.summary_tokens == 0``).
        worker: the background worker that runs the summarizer; default ``None``: the
            process-wide :meth:`SummaryWorker.shared() <convo.summarize.SummaryWorker.shared>`.
        wait_s: how long a turn waits for this session's summary while it is still
            running, in seconds. A turn waits only when the turns the summary does not
            cover yet cannot all be shown beside the window (while they can, the prompt
            shows them and extends the previous one). Default ``"auto"``
            (:data:`~convo.session.SUMMARY_WAIT_AUTO`):
            :data:`~convo.session.DEFAULT_SUMMARY_WAIT_S` on an engine that runs one call at
            a time, 0 on one that runs calls together (the reply then runs beside the
            summary instead of after it); 0 never waits; ``None`` waits as long as it takes.
            Past the bound the turn shows a provisional summary
            (:func:`~convo.summarize.provisional_summary`: the previous summary and
            excerpts of the turns it misses) and the window. Those turns
            (``TurnStats.hidden_turns``) stay stored and are folded in when the job ends;
            the budget holds either way.

    Raises:
        ConfigError: ``wait_s`` is neither seconds >= 0, ``"auto"`` nor ``None``.

    Example:
        >>> SummaryConfig(wait_s=0).wait_s
        0
    """

    summarizer: Summarizer | None = None
    worker: SummaryWorker | None = None
    wait_s: float | Literal["auto"] | None = SUMMARY_WAIT_AUTO

    def __post_init__(self) -> None:
        check_summary_wait(self.wait_s)
        if self.worker is not None and not isinstance(self.worker, SummaryWorker):
            raise ConfigError(
                f"SummaryConfig.worker must be a SummaryWorker, got {type(self.worker).__name__}"
            )


@dataclass(frozen=True, kw_only=True)
class ReplyConfig:
    """The defaults of every reply's generate call (a turn's ``sampling=`` and
    ``timeout_s=`` options override them for that turn).

    Args:
        sampling: decoding settings. Default greedy.
        timeout_s: wall-clock limit of one generate call, in seconds (> 0). Default
            ``None``: the engine's.

    Raises:
        ConfigError: ``sampling`` is not a :class:`~convo.engines.base.Sampling`, or
            ``timeout_s`` is not a number of seconds > 0.
    """

    sampling: Sampling = GREEDY
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, Sampling):
            raise ConfigError(f"ReplyConfig.sampling must be a Sampling, got {type(self.sampling).__name__}")
        t = self.timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, int | float) or not t > 0):
            raise ConfigError(f"ReplyConfig.timeout_s must be seconds > 0 or None, got {t!r}")


class LegacyKwargs(TypedDict, total=False):
    """``Session`` keywords replaced by :class:`SummaryConfig` and :class:`ReplyConfig`
    (deprecated, kept for one release)."""

    summarizer: Summarizer | None
    summaries: SummaryWorker | None
    summary_wait_s: float | Literal["auto"] | None
    sampling: Sampling
    timeout_s: float | None


#: Each deprecated ``Session`` keyword: (the config object, its field).
LEGACY_KWARGS: Mapping[str, tuple[str, str]] = {
    "summarizer": ("summarizing", "summarizer"),
    "summaries": ("summarizing", "worker"),
    "summary_wait_s": ("summarizing", "wait_s"),
    "sampling": ("replies", "sampling"),
    "timeout_s": ("replies", "timeout_s"),
}
_CLASSES: Mapping[str, type[SummaryConfig] | type[ReplyConfig]] = {
    "summarizing": SummaryConfig,
    "replies": ReplyConfig,
}


def from_legacy_kwargs(
    kwargs: Mapping[str, Any], *, summarizing: SummaryConfig | None, replies: ReplyConfig | None
) -> tuple[SummaryConfig, ReplyConfig]:
    """The two config objects, built from the deprecated keywords in ``kwargs`` (with a
    ``DeprecationWarning`` naming the replacement) when they are not given.

    Raises:
        TypeError: an unknown keyword (as Python says for any function).
        ConfigError: a deprecated keyword beside the config object that replaces it.
    """
    unknown = sorted(set(kwargs) - set(LEGACY_KWARGS))
    if unknown:
        raise TypeError(f"Session() got an unexpected keyword argument {unknown[0]!r}")
    given = {"summarizing": summarizing, "replies": replies}
    fields: dict[str, dict[str, Any]] = {"summarizing": {}, "replies": {}}
    for name, value in kwargs.items():
        group, field_name = LEGACY_KWARGS[name]
        cls = _CLASSES[group].__name__
        if given[group] is not None:
            raise ConfigError(
                f"Session({name}=...) and {group}=... both given; set {cls}({field_name}=...) only"
            )
        warnings.warn(
            f"Session({name}=...) is deprecated; use Session({group}={cls}({field_name}=...))",
            DeprecationWarning,
            stacklevel=3,
        )
        fields[group][field_name] = value
    return (
        summarizing or SummaryConfig(**fields["summarizing"]),
        replies or ReplyConfig(**fields["replies"]),
    )


def check_budget_fits(budget: Budget, engine: Engine | None) -> None:
    """Refuse a budget the engine's context window cannot hold (before anything is stored).

    Raises:
        ConfigError: ``budget.context_tokens`` is larger than the engine's window (a remote
            engine's window counts the margin it holds back for an inexact counter).
    """
    if engine is None:
        return
    try:
        window = int(engine.context_window)
    except ConvoError:  # e.g. a remote engine that cannot be asked now: it checks each call
        return
    # A remote engine's window is the server's less the margin it holds back for an
    # inexact counter; a budget may span the server's whole window (it holds its own margin).
    window += int(engine.margin_tokens)
    if budget.context_tokens > window:
        raise ConfigError(
            f"Budget.context_tokens={budget.context_tokens} is larger than the model's "
            f"context window ({window} tokens); use context_tokens <= {window}"
        )


_CAPS_LOGGED: set[tuple[int, int, int]] = set()  # (cap, summary_tokens, context) said already


def summary_cap(summarizer: Summarizer | None, summary_tokens: int) -> int:
    """The cap a session's summaries get: ``Budget.summary_tokens``, lowered for a
    :class:`~convo.summarize.ModelSummarizer` to what one summary call holds in its
    model's context (:meth:`~convo.summarize.ModelSummarizer.summary_cap`:
    ``(context - instructions) // 3``, e.g. ~150 tokens in a 512-token context).

    Raises:
        ConfigError: the model's context holds no summary; the message says to set
            ``Budget(summary_tokens=0)`` or how large a context would.
    """
    if summary_tokens <= 0 or not isinstance(summarizer, ModelSummarizer):
        return summary_tokens
    try:
        cap = summarizer.check_cap(summary_tokens)
    except ConfigError as exc:
        raise ConfigError(f"Budget.summary_tokens={summary_tokens}: {exc}") from None
    except ConvoError:  # e.g. a remote engine that cannot be asked now: each summary checks
        return summary_tokens
    if cap < summary_tokens and (key := (cap, summary_tokens, summarizer.context_tokens)) not in _CAPS_LOGGED:
        _CAPS_LOGGED.add(key)  # once per setting, not at every session a server opens
        logger.info(
            "summaries capped at %d tokens: Budget.summary_tokens=%d leaves a summary call no room "
            "in the model's %d-token context",
            cap,
            summary_tokens,
            summarizer.context_tokens,
        )
    return cap
