"""What the server keeps of the responses of a conversation, and the turn that keeps it.

A conversation's messages live in its session (``resp-<conversation>``), kept under the
budget, summarized and retrieved as every session is. Its response objects (what
``GET /v1/responses/{id}`` answers) live beside it in a session of their own without
messages, ``resp-<conversation>.responses``, whose ``settings`` hold them, newest last: no
background summary ever writes that one, so keeping a response never races a summary.
Both belong to the API key that created them; to another key they do not exist (404).

Only the newest response of a conversation can be continued (``previous_response_id``):
the session holds one line of conversation, and an older response's continuation would
branch it. Such a request gets 400 naming ``previous_response_id``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from convo.errors import SessionNotFound
from convo.server.auth import peek_owned
from convo.server.errors import ApiError
from convo.server.responses.objects import ResponseShape, conversation_of, session_of
from convo.server.turns import Turn
from convo.stores import SessionState, Store

if TYPE_CHECKING:
    import threading

    from convo.models.generation import ToolCallDelta
    from convo.session import Reply

#: Most response objects kept per conversation (``GET`` answers 404 for older ones; they
#: can no longer be continued anyway: only the newest can).
MAX_KEPT_RESPONSES = 32
#: The ``settings`` key of the records session that holds the response objects.
RESPONSES_SETTING = "responses"


def records_of(session_id: str) -> str:
    """The id of the session that keeps a conversation's response objects."""
    return f"{session_id}.responses"


def _missing(response_id: str, param: str | None) -> ApiError:
    where = f"{param}: " if param else ""
    return ApiError(404, f"{where}no response {response_id!r}", code="response_not_found", param=param)


def kept(store: Store, response_id: str, owner: str, param: str | None = None) -> tuple[str, list[Any]]:
    """The conversation's session id and its kept response objects (newest last), when
    ``response_id`` is one of them and the caller's; else 404 naming ``param``."""
    conversation = conversation_of(response_id)
    if conversation is None:
        raise _missing(response_id, param)
    sid = session_of(conversation)
    try:
        found = peek_owned(store, records_of(sid), owner)
    except SessionNotFound:
        found = None
    if found is None:
        raise _missing(response_id, param)
    bodies = list(found[0].settings.get(RESPONSES_SETTING, []))
    if not any(b.get("id") == response_id for b in bodies):
        raise _missing(response_id, param)
    return sid, bodies


def find(store: Store, response_id: str, owner: str) -> dict[str, Any]:
    """The kept response object (404 when it is not the caller's or not kept)."""
    _, bodies = kept(store, response_id, owner)
    body: dict[str, Any] = next(b for b in bodies if b["id"] == response_id)
    return body


def check_latest(store: Store, response_id: str, owner: str) -> str:
    """The session to continue ``response_id`` in; 404 when it is unknown, 400 when a
    newer response of its conversation exists (branching is not supported)."""
    sid, bodies = kept(store, response_id, owner, "previous_response_id")
    if bodies[-1]["id"] != response_id:
        raise ApiError(
            400,
            f"previous_response_id: {response_id!r} is not the latest response of its conversation "
            f"(that is {bodies[-1]['id']!r}); this server continues only the latest one",
            code="invalid_value",
            param="previous_response_id",
        )
    if not store.exists(sid):
        raise _missing(response_id, "previous_response_id")
    return sid


def keep(store: Store, session_id: str, owner: str, body: dict[str, Any], timeout_s: float) -> None:
    """Add a response object to its conversation's records (the oldest past
    :data:`MAX_KEPT_RESPONSES` dropped)."""
    rid = records_of(session_id)
    with store.lock(rid, timeout_s):
        found = peek_owned(store, rid, owner)
        if found is None:
            store.create(SessionState(session_id=rid, owner=owner, settings={RESPONSES_SETTING: [body]}))
            return
        state = found[0]
        bodies = [*state.settings.get(RESPONSES_SETTING, []), body][-MAX_KEPT_RESPONSES:]
        store.save_state(replace(state, settings={**state.settings, RESPONSES_SETTING: bodies}))


def forget(store: Store, response_id: str, owner: str) -> tuple[str, int]:
    """Drop a kept response object; returns its conversation's session id and how many
    responses it keeps still (0: the records session is deleted too)."""
    sid, bodies = kept(store, response_id, owner)
    rid = records_of(sid)
    rest = [b for b in bodies if b["id"] != response_id]
    if not rest:
        store.delete(rid)
        return sid, 0
    state = store.peek(rid)[0]
    store.save_state(replace(state, settings={**state.settings, RESPONSES_SETTING: rest}))
    return sid, len(rest)


@dataclass(kw_only=True)
class ResponseTurn(Turn):
    """A chat turn that answers as a response: holding the session's lock, it checks that
    ``previous_response_id`` is still the newest response, runs, and keeps the response
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
            self.shape.forked, self.body = self.forked, self.shape.body(reply)
            return reply
        # The check, the turn and its record under one hold of the session (reentrant: the
        # turn takes it again), so no other replica's turn comes between them.
        with self.store.lock(sid, self.limits.session_lock_timeout_s):
            previous = self.shape.request.previous_response_id
            if previous is not None:
                check_latest(self.store, previous, self.owner)  # a turn that ran meanwhile: 400
            reply = super().run(on_text=on_text, cancel=cancel, on_tool_call_delta=on_tool_call_delta)
            self.shape.forked, self.body = self.forked, self.shape.body(reply)
            keep(self.store, sid, self.owner, self.body, self.limits.session_lock_timeout_s)
        return reply
