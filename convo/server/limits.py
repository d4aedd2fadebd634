"""The server's limits: one frozen, validated config object."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from convo.errors import ConfigError
from convo.session import SUMMARY_WAIT_AUTO, check_summary_wait


@dataclass(frozen=True, kw_only=True)
class ServerLimits:
    """What one request may ask for and how much the server runs at once.

    Args:
        max_body_bytes: largest request body; larger gets 413. Default 1 MiB.
        max_messages: most messages in one request; more gets 400. Default 256.
        max_tokens: largest ``max_tokens`` a request may ask for; more gets 400.
            ``None`` (default): the budget's ``max_new_tokens``. A request without
            ``max_tokens`` gets the budget's.
        admission_tokens: tokens (prompt + reply cap) all running requests may hold
            together; the admission ledger counts tokens, so a request is charged at most
            its budget's ``context_tokens``. Default 65536.
        max_concurrency: requests generating at once. Default 4. With a local engine
            that has static KV slots, the slot count is used instead (each admitted turn
            holds a slot; they decode together).
        max_queue: requests waiting for admission; more get 429 with ``Retry-After``.
            Default 64.
        queue_timeout_s: seconds a request may wait for admission before 503. Default 30.
        session_lock_timeout_s: seconds a turn waits for another turn of the same session
            (in this process or another replica) before 409. Default 60.
        generation_timeout_s: wall-clock cap of one generation, seconds (the reply is cut
            and ``finish_reason`` is ``"length"``). ``None``: the engine's default.
        health_timeout_s: seconds ``GET /health`` waits for the store to answer before it
            answers 503 (a hung Redis must not hang the health check). Default 1.
        max_stop_chars: longest ``stop`` string a request may give, in characters; longer
            gets 400 naming ``stop``. Default 256. (How many: at most
            :data:`~convo.server.requests.MAX_STOP_SEQUENCES`, OpenAI's 4.) A stop string
            is matched against the reply as it grows, so its length multiplies the work
            and memory of every generated piece.
        summary_wait_s: seconds a turn waits for its session's background summary, only
            when the turns it folds do not fit beside the window (see
            ``Session(summary_wait_s=...)``); past it the turn goes on with a provisional
            summary. ``None``: no limit. Default ``"auto"``: 0 with an engine that runs
            calls together (static KV slots, a remote server), else
            :data:`convo.session.DEFAULT_SUMMARY_WAIT_S` (30 s). The summary never delays
            the reply that caused it: a stream ends, and the turn is stored, before the
            summary starts.
    """

    max_body_bytes: int = 1 << 20
    max_messages: int = 256
    max_tokens: int | None = None
    admission_tokens: int = 65536
    max_concurrency: int = 4
    max_queue: int = 64
    queue_timeout_s: float = 30.0
    session_lock_timeout_s: float = 60.0
    generation_timeout_s: float | None = None
    health_timeout_s: float = 1.0
    max_stop_chars: int = 256
    summary_wait_s: float | Literal["auto"] | None = SUMMARY_WAIT_AUTO
    max_forks_per_session: int = 8

    def __post_init__(self) -> None:
        positive = (
            "max_body_bytes",
            "max_messages",
            "admission_tokens",
            "max_concurrency",
            "max_stop_chars",
            "max_forks_per_session",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"ServerLimits.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ConfigError(f"ServerLimits.max_tokens must be >= 1, got {self.max_tokens}")
        if self.max_queue < 0:
            raise ConfigError(f"ServerLimits.max_queue must be >= 0, got {self.max_queue}")
        for name in ("queue_timeout_s", "session_lock_timeout_s", "health_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"ServerLimits.{name} must be > 0, got {getattr(self, name)}")
        if self.generation_timeout_s is not None and not self.generation_timeout_s > 0:
            raise ConfigError("ServerLimits.generation_timeout_s must be > 0 or None")
        check_summary_wait(self.summary_wait_s)
