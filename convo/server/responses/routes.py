"""The Responses API's routes: ``POST /v1/responses`` (streamed or not), ``GET`` and
``DELETE /v1/responses/{id}``. A response runs as a chat completion's turn does (the same
admission, session queue, reconciliation, budget and summaries: :mod:`convo.server.admit`,
:class:`~convo.server.turns.Turn`); ``previous_response_id`` names the session it continues."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from convo.server.admit import admit, turn_of
from convo.server.errors import ERROR_RESPONSES, ApiError
from convo.server.responses import records
from convo.server.responses.events import ResponseEvents
from convo.server.responses.objects import (
    ResponseShape,
    conversation_of,
    count_tokens,
    new_conversation,
    session_of,
)
from convo.server.responses.request import ResponsesBody
from convo.server.routes import Owner, State
from convo.server.routes import router as chat_router
from convo.server.streaming import stream_events

#: Routes whose body is read (and the caller checked) as ``/v1/chat/completions``' is.
router = APIRouter(route_class=chat_router.route_class, responses=ERROR_RESPONSES)


@router.post("/v1/responses")
async def create_response(body: ResponsesBody, state: State, owner: Owner) -> Response:
    """OpenAI's Responses API on convo's sessions, with and without ``stream``."""
    request = body.to_request(limits=state.limits, max_tokens_cap=state.max_tokens_cap)
    conversation = new_conversation()
    if request.previous_response_id is not None:
        if not request.store:
            raise ApiError(
                400,
                "store: false cannot continue a kept conversation (previous_response_id): "
                "the turn would be kept in it",
                code="invalid_value",
                param="store",
            )
        # Unknown or another key's: 404 before any queue (checked again under the queue).
        await state.in_thread(records.continuation, state.store, request.previous_response_id, owner)
        conversation = conversation_of(request.previous_response_id) or conversation
    session_id = session_of(conversation) if request.store else None
    shape = ResponseShape(request, conversation, session_id, state.model_name)
    chat = replace(request.chat, session_id=session_id)
    turn = turn_of(state, chat, owner, records.ResponseTurn, shape=shape)
    admitted = await admit(state, turn)
    if not request.chat.stream:
        try:
            reply = await state.in_thread(turn.run)
        finally:
            admitted.release()
        count_tokens(state.metrics, reply)
        return JSONResponse(turn.body)
    events = ResponseEvents(shape, state.metrics)
    return await stream_events(
        state, turn, events, started=admitted.started, release=admitted.release, headers={}
    )


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, state: State, owner: Owner) -> dict[str, Any]:
    """A kept response object; 404 for one not kept (``store: false``), deleted, or another key's."""
    body: dict[str, Any] = await state.in_thread(records.find, state.store, response_id, owner)
    return body


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, state: State, owner: Owner) -> dict[str, Any]:
    """Delete a kept response. Deleting a conversation's last kept response deletes the
    conversation (its session, its forks, its summaries); 409 at once while a turn of it runs."""
    sid = (await state.in_thread(records.kept, state.store, response_id, owner)).session_id
    release = await state.enter_session(sid, 0)

    def work() -> None:
        with state.store.lock(sid, 0):  # another replica's turn: 409 at once too
            _, left = records.forget(state.store, response_id, owner)
            if left == 0 and state.store.exists(sid):
                for each in (sid, *state.store.forks_of(sid)):  # no summary lands in a new one
                    state.summaries.forget(state.store, each)
                state.store.delete(sid, forks=True)

    try:
        await state.in_thread(work)
    finally:
        release()
    return {"id": response_id, "object": "response.deleted", "deleted": True}
