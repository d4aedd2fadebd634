"""One request's turn, run in a worker thread (the engine is synchronous): store only what
the session lacks (:mod:`convo.server.reconcile`), then generate. The reply's JSON shapes
are :mod:`convo.server.completions`'."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from convo.budget import Budget
from convo.errors import (
    BudgetError,
    ConfigError,
    MessageError,
)
from convo.messages import Message, Role, validate_sequence
from convo.plan import Retriever
from convo.server.auth import peek_owned
from convo.server.documents import DocumentsView
from convo.server.errors import ApiError
from convo.server.limits import ServerLimits
from convo.server.reconcile import fork_id, reconcile
from convo.server.requests import ChatRequest
from convo.session import Reply, Session
from convo.stores import InMemoryStore, SessionState, Store
from convo.stores.base import FORK_SETTING
from convo.summarize import SummaryWorker

if TYPE_CHECKING:
    from convo.engines.base import Engine
    from convo.models.generation import ToolCallDelta
    from convo.retrieval.documents import DocumentCollection
    from convo.server.documents import Documents
    from convo.server.memory import ServerMemory

logger = logging.getLogger(__name__)


#: What refuses a request (400): a refused request stores nothing.
_REFUSALS = (ApiError, MessageError, BudgetError, ConfigError)


@dataclass(kw_only=True)
class Turn:
    """Everything a worker needs to run one request.

    ``budget`` is the server's: a session is created with it and keeps it; the request's
    ``max_tokens`` applies to this turn only (:attr:`reply_budget`).
    """

    request: ChatRequest
    owner: str
    budget: Budget
    store: Store
    engine: Engine
    limits: ServerLimits
    summaries: SummaryWorker
    #: The system prompt of a new session (or a stateless request) that sends none.
    system_prompt: str | None = None
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    #: Set when the client's history diverged: the id holding the replaced tail.
    forked: str | None = None
    #: The server's retrieval memory (``None``: off): the session retrieves its evicted
    #: turns, and with ``request.user_id`` that person's earlier sessions too.
    memory: ServerMemory | None = None
    #: Files and vector stores (``None``: off); ``request.vector_store_ids`` name the stores.
    documents: Documents | None = None
    _collections: list[DocumentCollection] = field(default_factory=list)

    @property
    def reply_budget(self) -> Budget:
        """The budget of this turn: the server's, with the request's ``max_tokens``."""
        cap = self.request.max_tokens
        if cap is None or cap == self.budget.max_new_tokens:
            return self.budget
        return replace(self.budget, max_new_tokens=cap)

    def run(
        self,
        on_text: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
        on_tool_call_delta: Callable[[ToolCallDelta], None] | None = None,
    ) -> Reply:
        """Run the turn (blocking). ``on_text`` gets the reply's text as it comes,
        ``on_tool_call_delta`` the pieces of its tool calls (a streaming response)."""
        kwargs: dict[str, Any] = {
            "sampling": self.request.sampling,
            "on_text": on_text,
            "cancel": cancel,
            "stop": self.request.stop,
            **self.request.tool_options(),
        }
        if on_tool_call_delta is not None:
            kwargs["on_tool_call_delta"] = on_tool_call_delta
        if self.request.vector_store_ids:  # another key's store: 404 before anything is stored
            if self.documents is None:
                raise ApiError(404, "this server keeps no vector stores", code="documents_off")
            self._collections = self.documents.collections(self.owner, self.request.vector_store_ids)
        if self.request.session_id is None:
            return self._stateless(kwargs)
        with self.store.lock(self.request.session_id, self.limits.session_lock_timeout_s):
            return self._stateful(self.request.session_id, kwargs)

    def _session(self, sid: str, system_prompt: str | None) -> Session:
        """The session (created with ``system_prompt`` when new; loaded once), planning
        this turn with :attr:`reply_budget` while it keeps the server's budget stored."""
        session = Session(
            self.engine,
            budget=self.budget,
            store=self.store,
            session_id=sid,
            owner=self.owner,
            system_prompt=system_prompt,
            timeout_s=self.limits.generation_timeout_s,
            summaries=self.summaries,
            summary_wait_s=self.limits.summary_wait_s,
            retriever=self._retriever(),
        )
        session.budget = self.reply_budget  # in memory: this turn's reply cap, never stored
        return session

    def _retriever(self) -> Retriever | None:
        """The session's memory (its own, or its person's) and the named stores' chunks."""
        view = self.memory.view(owner=self.owner, user=self.request.user_id) if self.memory else None
        if not self._collections:
            return view
        return DocumentsView(self._collections, view)

    def _stateful(self, sid: str, kwargs: dict[str, Any]) -> Reply:
        msgs = list(self.request.messages)
        before = peek_owned(self.store, sid, self.owner)  # another key's: as if missing (404)
        system = "\n\n".join(m.content for m in msgs if m.role is Role.SYSTEM) or self.system_prompt
        incoming = [m for m in msgs if m.role is not Role.SYSTEM]
        session: Session | None = None
        history: list[Message] | None = None  # the session as it was, once loaded
        count = 0  # its stored messages
        try:
            stored: list[Message] = []
            if before is not None:
                # An existing session keeps the system part it was created with.
                session = self._session(sid, None)
                count = session.message_count
                if len(incoming) == 1 and session.turn_count:
                    # One message is matched against the last stored one only (a retry of
                    # a stored message, else a new one; see convo.server.reconcile): the
                    # last turn is all it needs, and a session resumed from its window
                    # reads nothing older.
                    stored = [m for t in session.turns(session.turn_count - 1) for m in t.messages]
                else:
                    history = session.messages  # what a refusal puts back
                    stored = [m for m in history if not m.pinned]
            # Store only what the session does not hold yet (see convo.server.reconcile).
            plan = reconcile(stored, incoming)
            # The message to answer: the last new one; else the last one kept (a regenerated
            # answer after a fork, or a retry of a turn whose user message is already stored).
            kept = stored if plan.fork_at is None else stored[: plan.fork_at]
            last = plan.new[-1] if plan.new else (kept[-1] if kept else None)
            if last is None or last.role not in (Role.USER, Role.TOOL):
                raise ApiError(
                    400,
                    "with a session id, the messages must end with a new user message or tool "
                    "results (or resend the history up to the message to answer again)",
                    code="invalid_messages",
                )
            if plan.fork_at is not None:
                # A summary still running folds turns the fork may drop: it must not land.
                self.summaries.forget(self.store, sid)
                self.forked = _fork(self.store, sid, plan.fork_at, self.limits.max_forks_per_session)
                if self.memory is not None:
                    self.memory.session_reset(sid)  # what was indexed of the old tail goes
                session = None  # the fork rewrote the session: load it as it now is
            if session is None:
                session = self._session(sid, system if before is None else None)
            # (The session is not closed: its summary runs on after the reply, outside the lock.)
            if not plan.new:
                return session.reply(**kwargs)
            *earlier, final = plan.new
            # Earlier new messages are stored at once: the reply's one summary pass folds
            # what left the window (not one summary per message).
            session.extend(earlier)
            return session.send(final, **kwargs)
        except _REFUSALS:
            # A refused request leaves nothing behind (we still hold the lock).
            if before is None:
                if self.store.exists(sid):
                    self.store.delete(sid)
                    if self.memory is not None:
                        self.memory.session_deleted([sid])
            elif session is not None or history is not None:
                if history is None:  # one message, no fork: the stored messages it appended to
                    history = self.store.load(sid)[1][:count]
                if _restore(self.store, sid, before, history) and self.memory is not None:
                    self.memory.session_reset(sid)
            if self.forked is not None:
                self.store.delete(self.forked)
                self.forked = None
            raise

    def _stateless(self, kwargs: dict[str, Any]) -> Reply:
        """Fit the given messages (recent turns that fit + truncation) and generate once.

        The messages are not replayed through the summarizer: the throw-away session
        shows as many recent turns as the budget holds and summarizes nothing, so a
        request costs exactly one generation whatever its length.
        """
        msgs = list(self.request.messages)
        if self.system_prompt and not any(m.role is Role.SYSTEM for m in msgs):
            msgs.insert(0, Message.from_openai({"role": "system", "content": self.system_prompt}))
        turns = sum(1 for m in msgs if m.role is Role.USER) + 1
        budget = replace(
            self.reply_budget,
            window_turns=max(1, turns),
            summarize_batch_turns=1,
            summary_tokens=0,
            # Retrieval only from the named vector stores (a stateless request has no memory).
            retrieval_tokens=self.reply_budget.retrieval_tokens if self._collections else 0,
        )
        validate_sequence(msgs)  # tool results answer the calls before them (MessageError: 400)
        store = InMemoryStore()
        store.create(SessionState(session_id=self.session_id, settings={"budget": budget.to_dict()}), msgs)
        with Session(
            self.engine,
            budget=budget,
            store=store,
            session_id=self.session_id,
            timeout_s=self.limits.generation_timeout_s,
            summaries=self.summaries,
            summary_wait_s=self.limits.summary_wait_s,
            retriever=DocumentsView(self._collections) if self._collections else None,
        ) as session:  # (closing releases the engine's KV cache and cancels its summary)
            return session.reply(**kwargs)


def _restore(store: Store, sid: str, before: tuple[SessionState, int], history: list[Message]) -> bool:
    """Put a session back as it was before a refused turn (its state and ``history``),
    unless nothing was written. The session is cut back to what it still shares with
    ``history`` and the rest re-appended: it is never deleted (its forks share its prefix).
    Returns whether anything was put back."""
    state, count = before
    now, now_count = store.peek(sid)
    if now_count == count and replace(now, updated_at=0.0) == replace(state, updated_at=0.0):
        return False
    _, current = store.load(sid)
    keep = 0
    while keep < min(len(current), len(history)) and current[keep] == history[keep]:
        keep += 1
    store.truncate(sid, keep, state=state)
    if history[keep:]:
        store.append(sid, history[keep:])
    return True


#: The parent's ``settings`` key that keeps its forks' bookkeeping: ``{"next": n, "live":
#: [ids, oldest first]}``. Numbers are never reused, so a dropped fork's id stays missing.
FORKS_SETTING = "forks"


def _live_forks(store: Store, sid: str, state: SessionState) -> tuple[int, list[str]]:
    """The next fork number of ``sid`` and its forks still stored, oldest first (a session
    forked before the bookkeeping existed: its ``~1``, ``~2``... found by probing)."""
    book = state.settings.get(FORKS_SETTING)
    if isinstance(book, dict):
        live = [f for f in book.get("live", []) if isinstance(f, str) and store.exists(f)]
        return max(int(book.get("next", 1)), 1), live
    live = []
    n = 1
    while store.exists(fork_id(sid, n)):
        live.append(fork_id(sid, n))
        n += 1
    return n, live


def _shared_length(history: list[Message], at: int) -> int:
    """How many stored messages come before the ``at``-th conversation (unpinned) message."""
    seen = 0
    for i, m in enumerate(history):
        if not m.pinned:
            if seen == at:
                return i
            seen += 1
    return len(history)


def _fork(store: Store, sid: str, at: int, max_forks: int) -> str:
    """Apply the divergence rule: ``sid`` as it was stays readable as the next free
    ``<sid>~<n>``, and ``sid`` keeps its first ``at`` conversation messages (and its pinned
    part). The fork **shares** those first messages with ``sid`` instead of copying them:
    it stores only the replaced tail, and links to ``sid`` (``FORK_SETTING`` of
    :mod:`convo.stores.base`: a fork's load stitches ``sid``'s prefix and its tail). An
    older fork that shared more of ``sid`` than is kept now takes those messages into its
    own tail first (only then is ``sid`` cut). Past ``max_forks`` forks the oldest is
    deleted (:attr:`ServerLimits.max_forks_per_session`). ``sid``'s summary and window
    survive when every summarized turn lies before ``at``; otherwise they start again.
    Returns the fork's id."""
    state, history = store.load(sid)
    n, live = _live_forks(store, sid, state)
    while store.exists(fork_id(sid, n)):
        n += 1
    while live and len(live) >= max_forks:
        dropped = live.pop(0)
        store.delete(dropped)
        logger.info("session %s: fork %s dropped (more than %d forks)", sid, dropped, max_forks)
    shared = _shared_length(history, at)
    for other in live:
        other_state, other_history = store.load(other)
        link = other_state.settings.get(FORK_SETTING)
        if isinstance(link, Mapping) and link.get("parent") == sid and int(link["prefix"]) > shared:
            settings = {**other_state.settings, FORK_SETTING: {"parent": sid, "prefix": shared}}
            store.delete(other)
            store.create(replace(other_state, settings=settings), other_history[shared:])
    archive = fork_id(sid, n)
    settings = {k: v for k, v in state.settings.items() if k != FORKS_SETTING}
    settings[FORK_SETTING] = {"parent": sid, "prefix": shared}
    store.create(replace(state, session_id=archive, settings=settings), history[shared:])
    live.append(archive)
    later_pinned = [m for m in history[shared:] if m.pinned]
    convo = [m for m in history if not m.pinned][:at]
    # Turns wholly before the fork point (the last kept turn may be cut).
    starts = sum(1 for i, m in enumerate(convo) if m.role is Role.USER or i == 0)
    if state.evicted_turns > max(starts - 1, 0):
        state = replace(state, summary="", summarized_turns=0, evicted_turns=0)
    state = replace(state, settings={**state.settings, FORKS_SETTING: {"next": n + 1, "live": live}})
    store.truncate(sid, shared, state=state)
    if later_pinned:
        store.append(sid, later_pinned)
    logger.info("session %s: history diverged at message %d; the replaced tail is in %s", sid, at, archive)
    return archive


def prompt_estimate(turn: Turn) -> int:
    """Prompt tokens to charge at admission: a stateless prompt's own size, a session's
    upper bound (its prompt never exceeds ``context_tokens - max_new_tokens``). Only the
    stateless case counts tokens; a session's costs nothing to compute."""
    budget = turn.reply_budget
    bound = budget.context_tokens - budget.max_new_tokens
    if turn.request.session_id is not None:
        return bound
    messages = list(turn.request.messages)
    if turn.request.tools:
        return min(bound, turn.engine.counter.count_with_tools(messages, turn.request.tools))
    return min(bound, turn.engine.counter.count_prompt(messages))
