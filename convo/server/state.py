"""What every route of one app shares: its collaborators, limits and per-process queues."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from convo.budget import Budget
from convo.errors import SessionBusy, SessionNotFound, StoreError
from convo.metrics import ServingMetrics
from convo.server.auth import key_owner, peek_owned
from convo.server.errors import ApiError
from convo.server.limits import ServerLimits
from convo.session.summaries import summary_state
from convo.stores import Store
from convo.summarize import SummaryWorker

if TYPE_CHECKING:
    from fastapi import Request

    from convo.admission import AdmissionController
    from convo.engines.base import Engine
    from convo.server.documents import Documents
    from convo.server.memory import ServerMemory

logger = logging.getLogger(__name__)


def _ignore_result(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()  # read, so asyncio does not log it as never retrieved


@dataclass(kw_only=True)
class ServerState:
    """One app's collaborators (see :func:`convo.server.app.create_app` for each argument)
    and its per-process state: worker-thread limiters and the per-session turn queues."""

    engine: Engine
    store: Store
    budget: Budget
    limits: ServerLimits
    model_name: str
    metrics: ServingMetrics
    admission: AdmissionController
    summaries: SummaryWorker
    keys: Sequence[str]
    hosts: frozenset[str]
    origins: frozenset[str]
    session_from_user: bool
    scrape: Any
    #: The system prompt of a request that sends none (new sessions, stateless requests).
    system_prompt: str | None = None
    #: Retrieval memory of sessions and people (``None``: off, ``--no-memory``).
    memory: ServerMemory | None = None
    #: Files and vector stores (``None``: no embedder, or ``--no-memory``).
    documents: Documents | None = None
    #: Admitted turns and streams hold worker threads; sized from the controller in use (not
    #: ``limits``, which a custom controller overrides), so admitted turns never run out.
    threads: anyio.CapacityLimiter = field(init=False)
    #: Admission must not wait for those threads: a request to refuse gets its 429 in
    #: milliseconds however busy generation is. The work before the decision (counting a
    #: stateless prompt's tokens, looking up a session's owner) has threads of its own.
    counting: anyio.CapacityLimiter = field(init=False)
    #: One turn per session at a time in this process, queued before admission, so waiting
    #: turns of a busy session hold no generation slot and no worker thread.
    gates: dict[str, tuple[asyncio.Lock, list[int]]] = field(default_factory=dict)

    #: The store ping in flight, shared by every ``/health`` that comes meanwhile: a hung
    #: store holds one thread, not one per health check.
    _ping: asyncio.Future[None] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.threads = anyio.CapacityLimiter(2 * self.admission.limits.max_concurrency + 8)
        self.counting = anyio.CapacityLimiter(2)

    async def store_answers(self) -> bool:
        """Whether the store answers a ping within ``limits.health_timeout_s``. A ping
        still in flight from an earlier check is waited for, not repeated."""
        if self._ping is None or self._ping.done():
            self._ping = asyncio.ensure_future(asyncio.to_thread(self.store.ping))
            self._ping.add_done_callback(_ignore_result)  # its error is read here or never
        try:
            await asyncio.wait_for(asyncio.shield(self._ping), self.limits.health_timeout_s)
        except (TimeoutError, StoreError):
            return False
        except Exception:  # a store without a ping of its own may fail otherwise
            logger.warning("the store's ping failed", exc_info=True)
            return False
        return True

    @property
    def max_tokens_cap(self) -> int:
        """The largest ``max_tokens`` a request may ask for."""
        return min(self.limits.max_tokens or self.budget.max_new_tokens, self.budget.context_tokens - 1)

    def owner_of(self, given: str) -> str:
        """The owner hash of the bearer key ``given``; 401 unless it is one of ours."""
        if not self.keys:
            return ""
        for k in self.keys:
            if given and hmac.compare_digest(given.encode(), k.encode()):
                return key_owner(k)
        raise ApiError(
            401,
            "invalid or missing API key (Authorization: Bearer ...)",
            code="invalid_api_key",
        )

    async def read_body(self, request: Request) -> tuple[bytes, Any]:
        """The body and its JSON: 415 unless ``application/json``, 413 past
        ``max_body_bytes``, 400 for bad or too deeply nested JSON."""
        kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if kind != "application/json":
            raise ApiError(
                415, "the body must be sent as Content-Type: application/json", code="invalid_content_type"
            )
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"request body over {limit} bytes", code="body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body over {limit} bytes", code="body_too_large")
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            return raw, json.loads(raw)
        except RecursionError:
            raise ApiError(400, "the body's JSON is nested too deeply", code="invalid_json") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None

    async def in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run blocking work (a turn, a store call) in a worker thread."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.threads)

    async def session_exists(self, session_id: str, owner: str) -> bool:
        """Whether the caller has this session (a peek: no messages read), asked before any
        queue or lock; another key's raises SessionNotFound (404) at once."""
        found = await anyio.to_thread.run_sync(
            peek_owned, self.store, session_id, owner, limiter=self.counting
        )
        return found is not None

    def owned(self, session_id: str, owner: str) -> Any:
        """The session's export, or SessionNotFound when it is not the caller's."""
        data = self.store.export_session(session_id)
        if data["owner"] != owner:
            raise SessionNotFound(f"no session {session_id!r}")
        return data

    def summary_of(self, session_id: str, owner: str) -> dict[str, Any]:
        """The session's :class:`~convo.summarize.SummaryState` as JSON (status, lag,
        backlog), read from the store and this process's summary worker."""
        found = peek_owned(self.store, session_id, owner)
        if found is None:
            raise SessionNotFound(f"no session {session_id!r}")
        stored = found[0]
        job = self.summaries.job(self.store, session_id)
        if job is not None and job.epoch != stored.epoch:
            job = None  # another session's, under a reused id
        active = self.budget.summary_tokens > 0
        backlog = self.summaries.stats().backlog
        return summary_state(job, stored, active=active, backlog=backlog).to_dict()

    async def enter_session(self, sid: str, timeout_s: float) -> Callable[[], None]:
        """Queue for ``sid``'s turn in this process; returns the release function.

        ``timeout_s == 0`` fails at once when the session is busy. Raises SessionBusy (409).
        """
        lock, users = self.gates.setdefault(sid, (asyncio.Lock(), [0]))
        users[0] += 1

        def leave() -> None:
            users[0] -= 1
            if users[0] == 0:
                self.gates.pop(sid, None)

        try:
            if timeout_s == 0:
                if lock.locked():
                    raise SessionBusy(f"session {sid!r} is busy with another turn")
                await lock.acquire()
            else:
                await asyncio.wait_for(lock.acquire(), timeout_s)
        except TimeoutError:
            leave()
            raise SessionBusy(
                f"session {sid!r} is busy with another turn (waited {timeout_s:.0f} s)"
            ) from None
        except BaseException:
            leave()
            raise
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                lock.release()
                leave()

        return release
