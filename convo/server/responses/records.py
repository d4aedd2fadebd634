"""What the server keeps of the responses of a conversation, and the turn that keeps it.

A conversation's messages live in its session (``resp-<conversation>``), kept under the
budget, summarized and retrieved as every session is. Its response objects (what
``GET /v1/responses/{id}`` answers) live beside it in a session of their own without
messages, ``resp-<conversation>.responses``, whose ``settings`` hold them (newest last)
with the number of messages the conversation held after each: no background summary ever
writes that one, so keeping a response never races a summary. Both belong to the API key
that created them; to another key they do not exist (404).

Continuing an older response (``previous_response_id`` that is not the newest) branches the
conversation there, with the resend rule of :mod:`convo.server.reconcile`: the messages up
to that response and the new input are reconciled with the session, which forks (the
replaced tail stays readable as the session ``resp-<conversation>~<n>``). The responses of
the replaced tail are still answered by ``GET``; continuing one of them gets 400 naming
``previous_response_id`` (its conversation is that fork now).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from convo.errors import SessionNotFound
from convo.messages import Role
from convo.server.auth import peek_owned
from convo.server.errors import ApiError
from convo.server.responses.objects import ResponseShape, conversation_of, session_of
from convo.server.turns import Turn
from convo.stores import SessionState, Store

if TYPE_CHECKING:
    import threading

    from convo.models.generation import ToolCallDelta
    from convo.session import Reply

#: Most response objects kept per conversation, newest first: ``GET`` (and
#: ``previous_response_id``) answer 404 for older ones.
MAX_KEPT_RESPONSES = 32
#: The ``settings`` keys of the records session: the response objects, each one's stored
#: message count, and the responses a branch replaced.
RESPONSES_SETTING = "responses"
ENDS_SETTING = "ends"
REPLACED_SETTING = "replaced"


def records_of(session_id: str) -> str:
    """The id of the session that keeps a conversation's response objects."""
    return f"{session_id}.responses"


def _missing(response_id: str, param: str | None) -> ApiError:
    where = f"{param}: " if param else ""
    return ApiError(404, f"{where}no response {response_id!r}", code="response_not_found", param=param)


@dataclass(frozen=True)
class Book:
    """A conversation's records: its response objects (newest last), how many stored
    messages the conversation held after each, and the responses a branch replaced (with
    the fork that holds their conversation now)."""

    session_id: str
    bodies: list[dict[str, Any]]
    ends: dict[str, int]
    replaced: dict[str, str]

    def body(self, response_id: str) -> dict[str, Any] | None:
        return next((b for b in self.bodies if b.get("id") == response_id), None)

    def settings(self) -> dict[str, Any]:
        kept = {b["id"] for b in self.bodies}
        return {
            RESPONSES_SETTING: self.bodies,
            ENDS_SETTING: {k: v for k, v in self.ends.items() if k in kept},
            REPLACED_SETTING: {k: v for k, v in self.replaced.items() if k in kept},
        }


def _book(store: Store, session_id: str, owner: str) -> tuple[Book, SessionState] | None:
    try:
        found = peek_owned(store, records_of(session_id), owner)
    except SessionNotFound:
        return None
    if found is None:
        return None
    settings = found[0].settings
    book = Book(
        session_id,
        list(settings.get(RESPONSES_SETTING, [])),
        dict(settings.get(ENDS_SETTING, {})),
        dict(settings.get(REPLACED_SETTING, {})),
    )
    return book, found[0]


def kept(store: Store, response_id: str, owner: str, param: str | None = None) -> Book:
    """The records of ``response_id``'s conversation, when it is kept there and the
    caller's; else 404 naming ``param``."""
    conversation = conversation_of(response_id)
    found = _book(store, session_of(conversation), owner) if conversation is not None else None
    if found is None or found[0].body(response_id) is None:
        raise _missing(response_id, param)
    return found[0]


def find(store: Store, response_id: str, owner: str) -> dict[str, Any]:
    """The kept response object (404 when it is not the caller's or not kept)."""
    body = kept(store, response_id, owner).body(response_id)
    assert body is not None
    return body


@dataclass(frozen=True)
class Continuation:
    """Where a turn continues: the session, and for an older response the number of stored
    messages its conversation had (``None``: the newest response, nothing to branch)."""

    session_id: str
    branch_at: int | None = None


def continuation(store: Store, response_id: str, owner: str) -> Continuation:
    """How to continue ``response_id``: 404 when it is unknown or its conversation is gone,
    400 when a branch replaced it (its conversation lives on in a fork)."""
    book = kept(store, response_id, owner, "previous_response_id")
    if response_id in book.replaced:
        raise ApiError(
            400,
            f"previous_response_id: {response_id!r} was replaced by a branch of its conversation; "
            f"its conversation is kept as session {book.replaced[response_id]!r}",
            code="invalid_value",
            param="previous_response_id",
        )
    if not store.exists(book.session_id):
        raise _missing(response_id, "previous_response_id")
    if book.bodies[-1]["id"] == response_id or response_id not in book.ends:
        return Continuation(book.session_id)
    return Continuation(book.session_id, book.ends[response_id])


def keep(
    store: Store,
    session_id: str,
    owner: str,
    body: dict[str, Any],
    *,
    end: int,
    branched: tuple[int, str] | None = None,
) -> None:
    """Add a response object to its conversation's records (the oldest past
    :data:`MAX_KEPT_RESPONSES` dropped), with ``end``, the conversation's stored message
    count after it. ``branched``: the turn forked the conversation after that many stored
    messages into that session; the responses after the fork point are marked replaced."""
    rid = records_of(session_id)
    found = _book(store, session_id, owner)
    if found is None:
        book = Book(session_id, [body], {body["id"]: end}, {})
        store.create(SessionState(session_id=rid, owner=owner, settings=book.settings()))
        return
    book, state = found
    if branched is not None:
        at, fork = branched
        for rid_ in [b["id"] for b in book.bodies]:
            if book.ends.get(rid_, 0) > at and rid_ not in book.replaced:
                book.replaced[rid_] = fork
    book.bodies.append(body)
    book.ends[body["id"]] = end
    del book.bodies[:-MAX_KEPT_RESPONSES]
    store.save_state(replace(state, settings={**state.settings, **book.settings()}))


def forget(store: Store, response_id: str, owner: str) -> tuple[str, int]:
    """Drop a kept response object; returns its conversation's session id and how many
    responses it keeps still (0: the records session is deleted too)."""
    book = kept(store, response_id, owner)
    rid = records_of(book.session_id)
    book.bodies[:] = [b for b in book.bodies if b["id"] != response_id]
    if not book.bodies:
        store.delete(rid)
        return book.session_id, 0
    state = store.peek(rid)[0]
    store.save_state(replace(state, settings={**state.settings, **book.settings()}))
    return book.session_id, len(book.bodies)


@dataclass(kw_only=True)
class ResponseTurn(Turn):
    """A chat turn that answers as a response. Holding the session's lock it finds where
    ``previous_response_id`` continues (an older response: the messages up to it are
    resent before the new input, so the session forks there), runs, and keeps the response
    object (``store``). :attr:`body` is the response object."""

    shape: ResponseShape
    body: dict[str, Any] | None = None

    def run(
        self,
        on_text: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
        on_tool_call_delta: Callable[[ToolCallDelta], None] | None = None,
    ) -> Reply:
        sid = self.request.session_id
        if sid is None:  # store: false
            reply = super().run(on_text=on_text, cancel=cancel, on_tool_call_delta=on_tool_call_delta)
            self.shape.forked = self.forked
            self.body = self.shape.body(reply)
            return reply
        # Where to continue, the turn and its record under one hold of the session
        # (reentrant: the turn takes it again), so no other turn comes between them.
        with self.store.lock(sid, self.limits.session_lock_timeout_s):
            previous = self.shape.request.previous_response_id
            at = None
            if previous is not None:
                at = continuation(self.store, previous, self.owner).branch_at
                if at is not None:
                    self._resend_up_to(sid, at)
            reply = super().run(on_text=on_text, cancel=cancel, on_tool_call_delta=on_tool_call_delta)
            self.shape.forked = self.forked
            self.body = self.shape.body(reply)
            branched = (at, self.forked) if at is not None and self.forked is not None else None
            end = self.store.peek(sid)[1]
            keep(self.store, sid, self.owner, self.body, end=end, branched=branched)
        return reply

    def _resend_up_to(self, sid: str, at: int) -> None:
        """Put the conversation's first ``at`` stored messages before the request's own, as
        a client resending its history would: reconciliation forks the session there."""
        _, history = self.store.load(sid)
        prefix = [m for m in history[:at] if not m.pinned]
        own = list(self.request.messages)
        system = [m for m in own if m.role is Role.SYSTEM]
        rest = [m for m in own if m.role is not Role.SYSTEM]
        self.request = replace(self.request, messages=(*system, *prefix, *rest))
