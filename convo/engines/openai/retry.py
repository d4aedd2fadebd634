"""Retry decisions of the remote engine, as pure functions: which failures are worth
another attempt, how long to wait, and when to give up.

Both transports (sync and async) ask :func:`decide_retry` after a :class:`Retryable`
failure and only do the waiting themselves::

    attempt fails ── Retryable(status, retry_after_s)
                        │
                        ▼
    decide_retry(policy, failure, attempts, now, deadline)
        ├─ attempts spent ............................ give up: RemoteEngineError
        ├─ Retry-After over max_retry_after_s ........ give up: RemoteEngineError
        ├─ the wait would pass the call's deadline ... give up: GenerationTimeout
        └─ else ...................................... wait_s = backoff (or Retry-After)

Nothing here reads a clock, sleeps or sends: ``now`` and the random source are passed in.
"""

from __future__ import annotations

import email.utils
import random
import time
from dataclasses import dataclass

from convo.errors import ConfigError, ConvoError, GenerationTimeout, RemoteEngineError

#: HTTP statuses worth retrying: rate limited, and server-side failures that may pass.
#: Any other 5xx is retried too, except 501 (not implemented) and 505 (HTTP version).
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
#: 5xx statuses that no retry can fix.
_FINAL_5XX = frozenset({501, 505})


def is_retryable_status(status: int) -> bool:
    """Whether an HTTP ``status`` may pass on a later attempt (429, 408, most 5xx).

    Example:
        >>> is_retryable_status(503), is_retryable_status(401), is_retryable_status(501)
        (True, False, False)
    """
    return status in RETRY_STATUSES or (status >= 500 and status not in _FINAL_5XX)


class Retryable(Exception):
    """One attempt failed in a way another attempt may not (internal to the engine: the
    transports catch it and ask :func:`decide_retry`; callers never see it).

    Args:
        message: what went wrong, fit to log (no credentials).
        status: the HTTP status, or ``None`` when no answer came (connection error).
        retry_after_s: the server's ``Retry-After``, seconds, when it sent one.
    """

    def __init__(self, message: str, *, status: int | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """When and how long to wait before retrying a failed request.

    Args:
        max_retries: retries after the first attempt (0 = never retry). Default 3.
        backoff_s: the first wait, seconds; doubled on every further retry. Default 0.5.
        max_backoff_s: cap on one computed wait, seconds. Default 8.
        jitter: the wait is drawn uniformly from ``[(1 - jitter) * w, w]`` so that many
            clients refused together do not come back together. Default 0.5.
        max_retry_after_s: the longest server ``Retry-After`` convo will wait; a longer
            one ends the retries at once (:class:`RemoteEngineError` carries it). Default 30.

    Raises:
        ConfigError: a negative count or wait, or a jitter outside ``[0, 1]``.

    Example:
        >>> RetryPolicy(jitter=0).delay_s(2)
        2.0
    """

    max_retries: int = 3
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    jitter: float = 0.5
    max_retry_after_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ConfigError("max_retries must be >= 0")
        if self.backoff_s < 0 or self.max_backoff_s < 0 or self.max_retry_after_s < 0:
            raise ConfigError("backoff_s, max_backoff_s and max_retry_after_s must be >= 0")
        if not 0 <= self.jitter <= 1:
            raise ConfigError("jitter must be in [0, 1]")

    def delay_s(
        self, attempt: int, retry_after_s: float | None = None, rng: random.Random | None = None
    ) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based); a server's
        ``Retry-After`` wins when it asks for longer."""
        wait = min(self.max_backoff_s, self.backoff_s * 2**attempt)
        wait *= 1 - self.jitter * (rng or random).random()
        if retry_after_s is not None:
            wait = max(wait, retry_after_s)
        return wait


@dataclass(frozen=True)
class RetryDecision:
    """What to do after a :class:`Retryable` failure: wait ``wait_s`` seconds and try
    again, or (``error`` set) give up with that error."""

    wait_s: float = 0.0
    error: ConvoError | None = None

    @property
    def retry(self) -> bool:
        return self.error is None


def decide_retry(
    policy: RetryPolicy,
    failure: Retryable,
    *,
    attempts: int,
    now: float,
    start: float,
    deadline: float,
    where: str,
    rng: random.Random | None = None,
) -> RetryDecision:
    """Retry or give up, after ``attempts`` retries already made in this call.

    Args:
        policy: the engine's :class:`RetryPolicy`.
        failure: why the last attempt failed.
        attempts: retries made so far in this call (0 after the first attempt).
        now, start, deadline: ``time.monotonic()`` stamps: now, the call's start and the
            end of its ``timeout_s``.
        where: the endpoint as it may be shown (credentials masked), for the messages.
        rng: random source of the jitter (tests pass a seeded one).

    Returns:
        A :class:`RetryDecision`: a wait, or the error that ends the call.

    Example:
        >>> d = decide_retry(RetryPolicy(jitter=0), Retryable("HTTP 503"), attempts=0,
        ...                  now=0.0, start=0.0, deadline=60.0, where="http://h/v1")
        >>> d.retry, d.wait_s
        (True, 0.5)
    """
    status, retry_after = failure.status, failure.retry_after_s
    if attempts >= policy.max_retries:
        return RetryDecision(
            error=RemoteEngineError(
                f"{where} failed after {attempts + 1} attempts: {failure}",
                status=status,
                retry_after_s=retry_after,
            )
        )
    if retry_after is not None and retry_after > policy.max_retry_after_s:
        return RetryDecision(
            error=RemoteEngineError(
                f"{where} asks to retry after {retry_after:.0f} s (over "
                f"max_retry_after_s={policy.max_retry_after_s:.0f}): {failure}",
                status=status,
                retry_after_s=retry_after,
            )
        )
    wait = policy.delay_s(attempts, retry_after, rng)
    if now + wait >= deadline:
        return RetryDecision(
            error=GenerationTimeout(
                f"no reply from {where} within {deadline - start:.1f} s "
                f"({attempts + 1} attempts; last: {failure})"
            )
        )
    return RetryDecision(wait_s=wait)


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date), or ``None``.

    Args:
        value: the header's value.
        now: the current time (``time.time()``, seconds since the epoch) an HTTP date is
            measured from; ``None``: read the clock.

    Example:
        >>> parse_retry_after("7"), parse_retry_after("soon")
        (7.0, None)
    """
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))
