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

    request ── foreign Host (keyless) / Origin? 403 ── CORS preflight? 204
       │        bad key? 401 ── not application/json? 415 ── body > max_body_bytes? 413
       │        bad JSON / fields (pydantic model)? 400
       ├─ another key's session? 404 at once (as a missing one)
       ├─ session queue (one turn per session in this process; no slot, no thread held)
       │   └─ waited > session_lock_timeout_s? 409
       ├─ admission (token ledger, FIFO queues) ── queue full? 429 + Retry-After
       │   (never waits for a worker thread)    └─ waited > queue_timeout_s? 503
       └─ worker thread: store.lock(session) ── Session.send / .stream ── store
                          (one turn at a time, across replicas for SQLite and Redis;
                          a refused turn (400) stores nothing; a dropped stream is
                          cancelled and frees its slot and queue at once)

Cross-site requests: without an API key the server serves only requests whose ``Host``
names the address it is bound to (loopback), so DNS rebinding cannot reach it, and it
refuses any request with a foreign ``Origin`` (scheme, host and port) unless
``allowed_origins`` lists it; the listed origins get CORS, preflight included. POST bodies
must be ``application/json`` (a plain HTML form cannot send that cross-site).

A session belongs to the API key that created it (the store keeps a hash of the key as
``owner``); any other key gets 404 for it, as if it did not exist.

Layout: :mod:`~convo.server.routes` (the endpoints), :mod:`~convo.server.turns` (one
request's turn in a worker thread), :mod:`~convo.server.streaming` (a turn as server-sent
events, cancelled when the client goes away), :mod:`~convo.server.completions` (the
response's JSON shapes), :mod:`~convo.server.state` (what the routes share),
:mod:`~convo.server.security` (API key dependency, Host/Origin checks, CORS),
:mod:`~convo.server.access_log` (one log line per request),
:mod:`~convo.server.requests` (the request bodies' pydantic models, served as
``/openapi.json``), :mod:`~convo.server.errors` (every error to an OpenAI-style JSON body,
one table).
FastAPI and uvicorn are imported only by this module (``import convo`` does not load it):
``pip install 'convo[server]'``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from convo.admission import AdmissionController, AdmissionLimits
from convo.budget import Budget
from convo.engines.base import concurrent_calls
from convo.errors import ConfigError, MessageError, MissingDependency
from convo.messages import check_text
from convo.metrics import ServingMetrics
from convo.server.limits import ServerLimits
from convo.stores import Store
from convo.summarize import SummaryWorker

try:
    from fastapi import FastAPI
except ImportError as exc:  # only `convo serve` and create_app need it
    raise MissingDependency(f"the server needs {exc.name}; run: pip install 'convo[server]'") from None

from convo.server.access_log import RequestLog
from convo.server.documents import Documents
from convo.server.errors import install_error_handlers
from convo.server.files import router as files_router
from convo.server.memory import MemoryCollector, ServerMemory
from convo.server.prometheus import metrics_registry
from convo.server.responses import router as responses_router
from convo.server.routes import router
from convo.server.security import LOOPBACK_HOSTS, install_cross_site_checks, normalize_origin
from convo.server.state import ServerState
from convo.server.summary_metrics import SummaryCollector

if TYPE_CHECKING:
    from convo.engines.base import Engine

__all__ = ["LOOPBACK_HOSTS", "create_app"]


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
    system_prompt: str | None = None,
    memory: ServerMemory | None = None,
    documents: Documents | None = None,
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
        allowed_origins: browser origins (``"https://app.example"``: scheme, host and
            port) allowed to call the server, with CORS (preflight included); a request with
            any other ``Origin`` header gets 403 (``"*"``: any). ConfigError for what is not
            an origin.
        system_prompt: the system prompt of a new session, or of a stateless request,
            whose messages hold none (a client's own system message wins).
        memory: retrieval memory (:class:`~convo.server.memory.ServerMemory` over
            ``store``): each session retrieves its evicted turns, and a request naming a
            person (``user`` / ``metadata.user_id``) that person's earlier sessions too.
            ``None`` (default here; ``convo serve`` turns it on): no retrieval.
        documents: files and vector stores in OpenAI's shapes
            (:class:`~convo.server.documents.Documents` over ``store``); a chat request
            names stores with ``metadata.vector_store_ids``. ``None``: those routes 404.

    Example::

        app = create_app(TransformersEngine(), store=SQLiteStore("sessions.db"))
        uvicorn.run(app, host="127.0.0.1", port=8000)
    """
    limits = limits or ServerLimits()
    budget = budget or Budget()
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if any(not k for k in keys):
        raise ConfigError("an API key must not be empty")
    if system_prompt is not None:
        try:
            check_text(system_prompt, "system_prompt")
        except MessageError as exc:
            raise ConfigError(str(exc)) from None
    # The default controller charges tokens (prompt + reply cap): its ledger gauges say so.
    metrics = metrics or ServingMetrics(ledger_unit=admission.limits.unit if admission else "tokens")
    state = ServerState(
        engine=engine,
        store=store,
        admission=admission or _token_ledger(engine, limits, budget, metrics),
        summaries=summaries or _summary_worker(engine),
        budget=budget,
        limits=limits,
        model_name=model_name,
        metrics=metrics,
        keys=keys,
        hosts=frozenset(h.lower().strip("[]") for h in (*LOOPBACK_HOSTS, *allowed_hosts)),
        origins=frozenset(normalize_origin(o) for o in allowed_origins),
        session_from_user=session_from_user,
        system_prompt=system_prompt or None,
        scrape=metrics_registry(metrics, engine),
        memory=memory,
        documents=documents,
    )
    if memory is not None:
        if memory.store is not store:
            raise ConfigError("the memory must keep its records in the app's store")
        state.scrape.register(MemoryCollector(memory, documents))
    state.scrape.register(SummaryCollector(state.summaries))  # convo_summary_backlog, _lag_seconds
    # /openapi.json documents the routes and request bodies; no docs pages (they load
    # scripts from a CDN).
    app = FastAPI(title="convo", version="1", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.convo = state
    install_error_handlers(app)
    install_cross_site_checks(app, state)
    app.add_middleware(RequestLog)  # outermost: refusals are logged too
    app.include_router(router)
    app.include_router(responses_router)  # /v1/responses
    app.include_router(files_router)  # files and vector stores (multipart uploads: a plain route)
    return app


def _token_ledger(
    engine: Engine, limits: ServerLimits, budget: Budget, metrics: ServingMetrics
) -> AdmissionController:
    """The default admission controller: a token ledger over ``limits.admission_tokens``.
    With static KV slots the pool is the capacity: every admitted turn holds a slot and
    decodes in the shared step, so it admits as many as there are slots."""
    return AdmissionController(
        AdmissionLimits(
            kv_budget_tokens=limits.admission_tokens,
            max_concurrency=_batch(engine) or limits.max_concurrency,
            max_queue_short=limits.max_queue,
            max_queue_long=limits.max_queue,
            queue_timeout_s=limits.queue_timeout_s,
            long_request_tokens=budget.context_tokens,
        ),
        metrics=metrics,
    )


def _summary_worker(engine: Engine) -> SummaryWorker:
    """The process-wide summary worker, sized to an engine that batches calls: as many
    summaries at once as it has KV slots, started without deferring to replies (its step
    scheduler serves replies first by priority)."""
    batch = _batch(engine)
    if batch is None:
        return SummaryWorker.shared()
    return SummaryWorker.shared(min_threads=batch, max_defer_s=0.0)


def _batch(engine: Engine) -> int | None:
    """Calls the engine runs together (its declared ``concurrent_calls``: KV slots, a remote
    server's connections), if it runs more than one."""
    calls = concurrent_calls(engine)
    return calls if calls > 1 else None
