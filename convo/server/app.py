"""An OpenAI-compatible HTTP server that keeps each conversation inside its budget.

``convo serve`` (or :func:`create_app` for an app of your own) answers
``POST /v1/chat/completions`` like OpenAI's API, with and without ``stream``. With a
session id (header ``X-Session-Id`` or ``metadata.session_id``; the ``user`` field only
with ``session_from_user``) the server keeps the conversation. The client may send only the
new message or resend the whole conversation: each message is stored once
(:mod:`convo.server.reconcile`, which also states the rule for a history that diverges).
convo builds the prompt from the pinned system part, the rolling summary and the recent
window (:class:`convo.Session`). Without one, it plans the given messages in a
throw-away session, so even a stateless request never exceeds the budget::

    request ── foreign Host (keyless) / Origin? 403 ── not application/json? 415
       │        body > max_body_bytes? 413 ── bad JSON / fields? 400 ── bad key? 401
       ├─ session queue (one turn per session in this process; no slot, no thread held)
       │   └─ waited > session_lock_timeout_s? 409
       ├─ admission (token ledger, FIFO queues) ── queue full? 429 + Retry-After
       │   (never waits for a worker thread)    └─ waited > queue_timeout_s? 503
       └─ worker thread: store.lock(session) ── Session.send / .stream ── store
                          (one turn at a time, across replicas for SQLite and Redis)

Cross-site requests: without an API key the server serves only requests whose ``Host``
names the address it is bound to (loopback), so DNS rebinding cannot reach it, and it
refuses any request with a foreign ``Origin`` unless ``allowed_origins`` lists it; POST
bodies must be ``application/json`` (a plain HTML form cannot send that cross-site).

A session belongs to the API key that created it (the store keeps a hash of the key as
``owner``); any other key gets 404 for it, as if it did not exist.

Every ConvoError maps to an HTTP status in :func:`error_status` (one place).
FastAPI and uvicorn are imported only by this module (``import convo`` does not load it):
``pip install 'convo[server]'``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from convo.budget import Budget
from convo.engines.base import FinishReason, TextStream
from convo.errors import (
    BudgetError,
    ConfigError,
    ConvoError,
    MessageError,
    MissingDependency,
    SessionBusy,
    SessionNotFound,
    StoreError,
)
from convo.messages import Message, Role, validate_sequence
from convo.metrics import ServingMetrics
from convo.server.auth import key_owner
from convo.server.errors import ApiError, error_status
from convo.server.limits import ServerLimits
from convo.server.prometheus import CONTENT_TYPE as PROMETHEUS_CONTENT_TYPE
from convo.server.prometheus import metrics_registry, render
from convo.server.reconcile import fork_id, reconcile
from convo.server.requests import ChatRequest, parse_chat_request
from convo.session import Reply, Session
from convo.store import MemoryStore, SessionState, Store
from convo.summarize import SummaryWorker

try:
    import anyio
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException
except ImportError as exc:  # only `convo serve` and create_app need them
    raise MissingDependency(f"the server needs {exc.name}; run: pip install 'convo[server]'") from None

if TYPE_CHECKING:
    from convo.admission import AdmissionController
    from convo.engines.base import Engine

logger = logging.getLogger(__name__)

#: Host names a keyless server answers to besides the address it is bound to.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")

# --------------------------------------------------------------------------------------
# Turns (run in worker threads; the engine is synchronous)
# --------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class _Turn:
    """Everything a worker needs to run one request."""

    request: ChatRequest
    owner: str
    budget: Budget
    store: Store
    engine: Engine
    limits: ServerLimits
    summaries: SummaryWorker
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    #: Set when the client's history diverged: the id holding the replaced tail.
    forked: str | None = None

    def run(
        self, on_text: Callable[[str], None] | None = None, cancel: threading.Event | None = None
    ) -> Reply:
        kwargs: dict[str, Any] = {
            "sampling": self.request.sampling,
            "on_text": on_text,
            "cancel": cancel,
            "stop": self.request.stop,
        }
        if self.request.session_id is None:
            return self._stateless(kwargs)
        with self.store.lock(self.request.session_id, self.limits.session_lock_timeout_s):
            return self._stateful(self.request.session_id, kwargs)

    def _stateful(self, sid: str, kwargs: dict[str, Any]) -> Reply:
        msgs = list(self.request.messages)
        exists = self.store.exists(sid)
        stored: list[Message] = []
        if exists:
            state, history = self.store.load(sid)
            if state.owner != self.owner:
                raise SessionNotFound(f"no session {sid!r}")  # another key's: do not reveal it exists
            stored = [m for m in history if not m.pinned]
        # Store only what the session does not hold yet (see convo.server.reconcile); an
        # existing session keeps the system part it was created with.
        plan = reconcile(stored, [m for m in msgs if m.role is not Role.SYSTEM])
        # The message to answer: the last new one; else the last one kept (a regenerated
        # answer after a fork, or a retry of a turn whose user message is already stored).
        kept = stored if plan.fork_at is None else stored[: plan.fork_at]
        last = plan.new[-1] if plan.new else (kept[-1] if kept else None)
        if last is None or last.role not in (Role.USER, Role.TOOL):
            raise ApiError(
                400,
                "with a session id, the messages must end with a new user message or tool results "
                "(or resend the history up to the message to answer again)",
                code="invalid_messages",
            )
        if plan.fork_at is not None:
            # A summary still running folds turns the fork may drop: it must not land.
            self.summaries.forget(self.store, sid)
            self.forked = _fork(self.store, sid, plan.fork_at)
        system = "\n\n".join(m.content for m in msgs if m.role is Role.SYSTEM)
        session = Session(
            self.engine,
            budget=self.budget,
            store=self.store,
            session_id=sid,
            owner=self.owner,
            system_prompt=system if not exists else None,
            timeout_s=self.limits.generation_timeout_s,
            summaries=self.summaries,
            summary_wait_s=self.limits.summary_wait_s,
        )
        # (The session is not closed: its summary runs on after the reply, outside the lock.)
        try:
            if not plan.new:
                return session.reply(**kwargs)
            *earlier, final = plan.new
            # Earlier new messages are stored at once: the reply's one summary pass folds
            # what left the window (not one summary per message).
            session.extend(earlier)
            return session.send(final, **kwargs)
        except (ApiError, MessageError, BudgetError, ConfigError):
            if not exists:  # a refused request leaves nothing behind (we still hold the lock)
                self.store.delete(sid)
            raise

    def _stateless(self, kwargs: dict[str, Any]) -> Reply:
        """Fit the given messages (recent turns that fit + truncation) and generate once.

        The messages are not replayed through the summarizer: the throw-away session
        shows as many recent turns as the budget holds and summarizes nothing, so a
        request costs exactly one generation whatever its length.
        """
        msgs = list(self.request.messages)
        turns = sum(1 for m in msgs if m.role is Role.USER) + 1
        budget = replace(
            self.budget,
            window_turns=max(1, turns),
            summarize_batch_turns=1,
            summary_tokens=0,
            retrieval_tokens=0,
        )
        validate_sequence(msgs)  # tool results answer the calls before them (MessageError: 400)
        store = MemoryStore()
        store.create(SessionState(session_id=self.session_id, settings={"budget": budget.to_dict()}), msgs)
        with Session(
            self.engine,
            budget=budget,
            store=store,
            session_id=self.session_id,
            timeout_s=self.limits.generation_timeout_s,
            summaries=self.summaries,
            summary_wait_s=self.limits.summary_wait_s,
        ) as session:  # (closing releases the engine's KV cache and cancels its summary)
            return session.reply(**kwargs)


def _fork(store: Store, sid: str, at: int) -> str:
    """Apply the divergence rule: the whole session as it was moves, readable, to the
    next free ``<sid>~<n>``; ``sid`` keeps its first ``at`` conversation messages (and its
    pinned part). Its summary and window survive when every summarized turn lies before
    ``at``; otherwise they start again. Returns the fork's id."""
    data = store.export_session(sid)
    n = 1
    while store.exists(fork_id(sid, n)):
        n += 1
    archive = store.import_session(data, session_id=fork_id(sid, n))
    state, history = store.load(sid)
    pinned = [m for m in history if m.pinned]
    convo = [m for m in history if not m.pinned][:at]
    # Turns wholly before the fork point (the last kept turn may be cut).
    starts = sum(1 for i, m in enumerate(convo) if m.role is Role.USER or i == 0)
    if state.evicted_turns > max(starts - 1, 0):
        state = replace(state, summary="", summarized_turns=0, evicted_turns=0)
    store.delete(sid)
    store.create(state)
    store.append(sid, [*pinned, *convo])
    logger.info("session %s: history diverged at message %d; the replaced tail is in %s", sid, at, archive)
    return archive


def _prompt_estimate(turn: _Turn) -> int:
    """Prompt tokens to charge at admission: a stateless prompt's own size, a session's
    upper bound (its prompt never exceeds ``context_tokens - max_new_tokens``). Only the
    stateless case counts tokens; a session's costs nothing to compute."""
    bound = turn.budget.context_tokens - turn.budget.max_new_tokens
    if turn.request.session_id is not None:
        return bound
    return min(bound, turn.engine.counter.count_prompt(list(turn.request.messages)))


# --------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------


def _finish(reason: FinishReason) -> str:
    return "stop" if reason in (FinishReason.STOP, FinishReason.CANCELLED) else "length"


def _usage(reply: Reply) -> dict[str, int]:
    g = reply.stats.generation
    completion = g.new_tokens if g is not None else 0
    prompt = reply.stats.prompt_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _convo_stats(reply: Reply, session_id: str | None, forked: str | None = None) -> dict[str, Any]:
    s = reply.stats
    return {
        "session_id": session_id,
        "forked": forked,  # where the replaced tail went, when the client's history diverged
        "turn": s.turn,
        "context_tokens": s.context_tokens,
        "parts": dict(s.parts),
        "evicted_turns": s.evicted_turns,
        "summarized_turns": s.summarized_turns,
        "hidden_turns": s.hidden_turns,
        "summary_wait_s": round(s.summarize_s, 4),
        "summary": s.summary.to_dict() if s.summary is not None else None,
    }


def create_app(
    engine: Engine,
    *,
    store: Store,
    api_key: str | Sequence[str] | None = None,
    budget: Budget | None = None,
    limits: ServerLimits | None = None,
    model_name: str = "convo",
    metrics: ServingMetrics | None = None,
    admission: AdmissionController | None = None,
    session_from_user: bool = False,
    summaries: SummaryWorker | None = None,
    allowed_hosts: Sequence[str] = (),
    allowed_origins: Sequence[str] = (),
) -> FastAPI:
    """Build the FastAPI app.

    Args:
        engine: generates replies (synchronous; runs in worker threads).
        store: where sessions live (SQLiteStore / RedisStore for several replicas).
        api_key: one key or several; when given, every ``/v1`` call needs
            ``Authorization: Bearer <key>``. ``None``: no auth (loopback only).
        budget: every session's budget (default ``Budget()``).
        limits: request and admission limits (default :class:`ServerLimits`).
        model_name: the id ``/v1/models`` lists and responses carry.
        metrics: where to count (default: new :class:`~convo.metrics.ServingMetrics`).
        admission: an admission controller of your own (default: a token ledger over
            ``limits.admission_tokens``).
        session_from_user: also take the request's ``user`` field as the session id (after
            ``X-Session-Id`` and ``metadata.session_id``). Off by default: OpenAI's ``user``
            names an end user, and one user's separate chats must not merge.
        summaries: runs the sessions' rolling summaries in the background, after their
            replies (default: the process-wide :meth:`SummaryWorker.shared`).
        allowed_hosts: without an API key, the ``Host`` names served besides
            :data:`LOOPBACK_HOSTS` (``convo serve`` adds the address it binds); any other
            ``Host`` gets 403, which defeats DNS rebinding. Ignored when keys are set.
        allowed_origins: browser origins (``"https://app.example"``) allowed to call the
            server; a request with any other ``Origin`` header gets 403 (``"*"``: any).

    Example::

        app = create_app(TransformersEngine(), store=SQLiteStore("sessions.db"))
        uvicorn.run(app, host="127.0.0.1", port=8000)
    """
    from convo.admission import AdmissionController, AdmissionLimits
    from convo.admission import Request as AdmissionRequest

    limits = limits or ServerLimits()
    budget = budget or Budget()
    summaries = summaries or SummaryWorker.shared()
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if any(not k for k in keys):
        raise ConfigError("an API key must not be empty")
    # The default controller charges tokens (prompt + reply cap): its ledger gauges say so.
    metrics = metrics or ServingMetrics(ledger_unit=admission.limits.unit if admission else "tokens")
    scrape = metrics_registry(metrics)
    if admission is None:
        # With static KV slots the pool is the capacity: every admitted turn holds a slot
        # and decodes in the shared step, so admit as many as there are slots.
        decoder = getattr(engine, "decoder", None)
        slots = decoder.pool.slots if decoder is not None else limits.max_concurrency
        admission = AdmissionController(
            AdmissionLimits(
                kv_budget_tokens=limits.admission_tokens,
                max_concurrency=slots,
                max_queue_short=limits.max_queue,
                max_queue_long=limits.max_queue,
                queue_timeout_s=limits.queue_timeout_s,
                long_request_tokens=budget.context_tokens,
            ),
            metrics=metrics,
        )
    controller = admission
    cap = min(limits.max_tokens or budget.max_new_tokens, budget.context_tokens - 1)
    # Admitted turns and streams hold worker threads; sized from the controller in use (not
    # `limits`, which a custom controller overrides), so admitted turns alone never run out.
    threads = anyio.CapacityLimiter(2 * controller.limits.max_concurrency + 8)
    # Admission must not wait for those threads: a request to refuse gets its 429 in
    # milliseconds however busy generation is. Counting a stateless prompt's tokens, the
    # only work before the decision, has threads of its own.
    counting = anyio.CapacityLimiter(2)
    hosts = {h.lower().strip("[]") for h in (*LOOPBACK_HOSTS, *allowed_hosts)}
    origins = {o.rstrip("/").lower() for o in allowed_origins}
    # One turn per session at a time in this process, queued before admission, so waiting
    # turns of a busy session hold no generation slot and no worker thread.
    gates: dict[str, tuple[asyncio.Lock, list[int]]] = {}
    app = FastAPI(title="convo", version="1", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.store, app.state.engine, app.state.metrics, app.state.admission = (
        store,
        engine,
        metrics,
        controller,
    )

    def error_response(err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(ConvoError)
    async def _convo_error(request: Request, exc: ConvoError) -> JSONResponse:
        return error_response(error_status(exc))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(ApiError(exc.status_code, str(exc.detail), code=f"http_{exc.status_code}"))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(ApiError(400, "the request is malformed", code="invalid_request"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return error_response(error_status(exc))  # a fixed message; the details are logged

    def _host_name(value: str) -> str:
        value = value.strip().lower()
        if value.startswith("["):  # [::1]:8000
            return value[1 : value.find("]")] if "]" in value else value
        return value.rsplit(":", 1)[0] if value.count(":") == 1 else value

    def _origin_allowed(origin: str) -> bool:
        if "*" in origins or origin.rstrip("/").lower() in origins:
            return True
        from urllib.parse import urlsplit

        try:
            parts = urlsplit(origin)
        except ValueError:
            return False
        # Same origin as the server itself: a page it served (it serves none) or a tool.
        return parts.scheme in ("http", "https") and (parts.hostname or "") in hosts and not keys

    @app.middleware("http")
    async def _cross_site(request: Request, call_next: Callable[[Request], Any]) -> Response:
        """Refuse cross-site requests before any route runs (see the module docstring)."""
        if not keys and _host_name(request.headers.get("host", "")) not in hosts:
            return error_response(
                ApiError(403, "this Host is not served here", type="permission_error", code="forbidden_host")
            )
        origin = request.headers.get("origin")
        if origin is not None and not _origin_allowed(origin):
            return error_response(
                ApiError(
                    403,
                    "cross-origin requests are refused (convo serve --allow-origin ORIGIN)",
                    type="permission_error",
                    code="forbidden_origin",
                )
            )
        response: Response = await call_next(request)
        return response

    async def enter_session(sid: str, timeout_s: float) -> Callable[[], None]:
        """Queue for ``sid``'s turn in this process; returns the release function.

        ``timeout_s == 0`` fails at once when the session is busy. Raises SessionBusy (409).
        """
        lock, users = gates.setdefault(sid, (asyncio.Lock(), [0]))
        users[0] += 1

        def leave() -> None:
            users[0] -= 1
            if users[0] == 0:
                gates.pop(sid, None)

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

    def owner_of(request: Request) -> str:
        """The caller's owner hash; 401 unless the bearer key is one of ours."""
        if not keys:
            return ""
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        for k in keys:
            if given and hmac.compare_digest(given.encode(), k.encode()):
                return key_owner(k)
        raise ApiError(
            401,
            "invalid or missing API key (Authorization: Bearer ...)",
            type="authentication_error",
            code="invalid_api_key",
        )

    async def read_body(request: Request) -> Any:
        kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if kind != "application/json":
            raise ApiError(
                415, "the body must be sent as Content-Type: application/json", code="invalid_content_type"
            )
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
            raise ApiError(413, f"request body over {limits.max_body_bytes} bytes", code="body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise ApiError(413, f"request body over {limits.max_body_bytes} bytes", code="body_too_large")
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except RecursionError:
            raise ApiError(400, "the body's JSON is nested too deeply", code="invalid_json") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None

    async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
        return await anyio.to_thread.run_sync(fn, *args, limiter=threads)

    def owned(session_id: str, owner: str) -> Any:
        """The session's export, or SessionNotFound when it is not the caller's."""
        data = store.export_session(session_id)
        if data["owner"] != owner:
            raise SessionNotFound(f"no session {session_id!r}")
        return data

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 ``ok`` when the store answers, else 503 ``unavailable``."""
        status, code = "ok", 200
        try:
            await anyio.to_thread.run_sync(store.ping, limiter=counting)
        except StoreError:
            status, code = "unavailable", 503
        body = {
            "status": status,
            "store": "ok" if code == 200 else "unreachable",
            "model": model_name,
            "running": controller.running,
            "waiting": controller.waiting,
        }
        return JSONResponse(body, status_code=code)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(render(scrape), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        owner_of(request)
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "convo"}],
        }

    @app.get("/v1/sessions/{session_id}")
    async def history(session_id: str, request: Request) -> dict[str, Any]:
        data = await in_thread(owned, session_id, owner_of(request))
        return {
            "id": session_id,
            "object": "session",
            "summary": data["summary"],
            "evicted_turns": data["evicted_turns"],
            "summarized_turns": data["summarized_turns"],
            "messages": [{"role": r["role"], "content": r["content"]} for r in data["messages"]],
        }

    @app.get("/v1/sessions/{session_id}/export")
    async def export(session_id: str, request: Request) -> dict[str, Any]:
        data: dict[str, Any] = await in_thread(owned, session_id, owner_of(request))
        return data

    @app.delete("/v1/sessions/{session_id}")
    async def delete(session_id: str, request: Request) -> dict[str, Any]:
        """Delete a session; 409 at once if a turn of it is running (no waiting)."""
        owner = owner_of(request)

        def work() -> None:
            with store.lock(session_id, 0):  # another replica's turn: 409 at once too
                owned(session_id, owner)
                summaries.forget(store, session_id)  # its summary must not land in a new one
                store.delete(session_id)

        release = await enter_session(session_id, 0)
        try:
            await in_thread(work)
        finally:
            release()
        return {"id": session_id, "object": "session.deleted", "deleted": True}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        owner = owner_of(request)
        body = await read_body(request)
        parsed = parse_chat_request(
            body,
            header_session_id=request.headers.get("x-session-id"),
            limits=limits,
            max_tokens_cap=cap,
            session_from_user=session_from_user,
        )
        turn_budget = budget
        if parsed.max_tokens is not None and parsed.max_tokens != budget.max_new_tokens:
            turn_budget = replace(budget, max_new_tokens=parsed.max_tokens)
        turn = _Turn(
            request=parsed,
            owner=owner,
            budget=turn_budget,
            store=store,
            engine=engine,
            limits=limits,
            summaries=summaries,
        )
        leave_session: Callable[[], None] = lambda: None  # noqa: E731
        if parsed.session_id is None:
            prompt_est = await anyio.to_thread.run_sync(_prompt_estimate, turn, limiter=counting)
        else:
            prompt_est = _prompt_estimate(turn)  # a bound from the budget: no counting
            # Queue behind this session's running turn before taking an admission slot.
            leave_session = await enter_session(parsed.session_id, limits.session_lock_timeout_s)
        started = time.monotonic()
        try:
            ticket = await controller.acquire_async(
                AdmissionRequest(prompt_tokens=prompt_est, max_new_tokens=turn_budget.max_new_tokens)
            )
        except BaseException:
            leave_session()
            raise
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        headers = {"X-Session-Id": parsed.session_id} if parsed.session_id else {}
        if not parsed.stream:
            try:
                reply: Reply = await in_thread(turn.run)
            finally:
                ticket.release()
                leave_session()
            if reply.stats.generation is not None:
                metrics.add_tokens(reply.stats.generation.new_tokens)
            out = {
                "id": completion_id,
                "object": "chat.completion",
                "created": created,
                "model": model_name,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": reply.text},
                        "finish_reason": _finish(reply.finish_reason),
                        "logprobs": None,
                    }
                ],
                "usage": _usage(reply),
                "convo": _convo_stats(reply, parsed.session_id, turn.forked),
            }
            return JSONResponse(out, headers=headers)

        stream: TextStream[Reply] = TextStream(turn.run, {})
        chunks: Iterator[str] = iter(stream)
        end = object()

        async def close() -> None:
            # Shielded: on a client disconnect this runs in a cancelled scope. Closing
            # cancels generation; the worker stores the partial reply before it returns.
            with anyio.CancelScope(shield=True):
                try:
                    await in_thread(stream.close)
                finally:
                    ticket.release()
                    leave_session()

        try:
            first = await in_thread(next, chunks, end)  # errors before any text -> HTTP status
        except BaseException:
            await close()
            raise
        metrics.ttft.observe(time.monotonic() - started)

        def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
            data = {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model_name,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
            }
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        async def events() -> AsyncIterator[str]:
            try:
                yield chunk({"role": "assistant", "content": ""})
                text = first
                while text is not end:
                    if text:
                        yield chunk({"content": text})
                    text = await in_thread(next, chunks, end)
                reply = stream.result
                assert reply is not None
                if reply.stats.generation is not None:
                    metrics.add_tokens(reply.stats.generation.new_tokens)
                yield chunk({}, _finish(reply.finish_reason))
                if parsed.include_usage:
                    data = {
                        "id": completion_id,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": model_name,
                        "choices": [],
                        "usage": _usage(reply),
                    }
                    yield f"data: {json.dumps(data)}\n\n"
                yield "data: [DONE]\n\n"
            except Exception as exc:  # headers are sent: end the stream with an error event
                yield f"data: {json.dumps(error_status(exc).body())}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                await close()

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    return app
