"""The way in for a turn, shared by ``/v1/chat/completions`` and ``/v1/responses``: the
owner check of its session, the session's queue, then an admission slot (in that order,
so a turn waiting behind its session's running turn holds no slot)::

    stateless? count the prompt (a thread of its own) ── session? 404 for another key's,
        then queue behind its running turn (409 past session_lock_timeout_s)
    └─ admission: prompt estimate + reply cap (429 queue full, 503 waited too long)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import anyio

from convo.admission import Request as AdmissionRequest
from convo.server.requests import ChatRequest
from convo.server.state import ServerState
from convo.server.turns import Turn, prompt_estimate

T = TypeVar("T", bound=Turn)


@dataclass(frozen=True)
class Admitted:
    """An admitted turn's hold on the server.

    Attributes:
        release: gives back the admission slot, then the session's queue (idempotent
            only through the stream's close: call it once).
        started: when admission was granted (``time.monotonic()``), for the TTFT metric.
    """

    release: Callable[[], None]
    started: float


@overload
def turn_of(state: ServerState, request: ChatRequest, owner: str) -> Turn: ...
@overload
def turn_of(state: ServerState, request: ChatRequest, owner: str, kind: type[T], **extra: Any) -> T: ...
def turn_of(
    state: ServerState, request: ChatRequest, owner: str, kind: type[Turn] = Turn, **extra: Any
) -> Turn:
    """The turn of ``request`` for ``owner`` on this app's engine, store, budget and
    limits (``kind``: a :class:`Turn` subclass, given its own ``extra`` fields)."""
    return kind(
        request=request,
        owner=owner,
        budget=state.budget,
        store=state.store,
        engine=state.engine,
        limits=state.limits,
        summaries=state.summaries,
        system_prompt=state.system_prompt,
        memory=state.memory,
        documents=state.documents,
        **extra,
    )


async def admit(state: ServerState, turn: Turn) -> Admitted:
    """Take ``turn``'s session queue (when it has a session) and an admission slot.

    Raises:
        SessionNotFound: the session is another key's (404, before any queue).
        SessionBusy: the session's running turn did not end in time (409).
        QueueFullError / QueueTimeoutError: admission refused (429 / 503).
    """
    sid = turn.request.session_id
    leave_session: Callable[[], None] = lambda: None  # noqa: E731
    if sid is None:
        prompt_est = await anyio.to_thread.run_sync(prompt_estimate, turn, limiter=state.counting)
    else:
        prompt_est = prompt_estimate(turn)  # a bound from the budget: no counting
        # Another key's session: 404 at once, not after queueing behind its turns.
        await state.session_exists(sid, turn.owner)
        # Queue behind this session's running turn before taking an admission slot.
        leave_session = await state.enter_session(sid, state.limits.session_lock_timeout_s)
    started = time.monotonic()
    try:
        ticket = await state.admission.acquire_async(
            AdmissionRequest(prompt_tokens=prompt_est, max_new_tokens=turn.reply_budget.max_new_tokens)
        )
    except BaseException:
        leave_session()
        raise

    def release() -> None:
        ticket.release()
        leave_session()

    return Admitted(release=release, started=started)
