"""The routes: ``/health``, ``/metrics``, ``/v1/models``, ``/v1/sessions/{id}`` (history,
export, delete), ``/v1/chat/completions`` and ``/v1/users/{id}/memory`` (a person's memory:
read, delete). Each takes the app's
:class:`~convo.server.state.ServerState` and the caller (the API key check) as dependencies."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute

from convo.errors import ConfigError, SessionNotFound
from convo.server.admit import admit, turn_of
from convo.server.auth import peek_owned
from convo.server.completions import Completion
from convo.server.errors import ERROR_RESPONSES, ApiError
from convo.server.memory import ServerMemory, check_user_id
from convo.server.prometheus import CONTENT_TYPE as PROMETHEUS_CONTENT_TYPE
from convo.server.prometheus import render
from convo.server.requests import ChatCompletionBody, SessionId
from convo.server.security import bearer, caller, state_of
from convo.server.state import ServerState
from convo.server.streaming import stream_turn
from convo.session import Reply


class _ReadRequest(Request):
    """A request whose body is already read and decoded."""

    def __init__(self, request: Request, raw: bytes, data: Any) -> None:
        super().__init__(request.scope, request.receive)
        self._raw, self._data = raw, data

    async def body(self) -> bytes:
        return self._raw

    async def json(self) -> Any:
        return self._data


class _BodyRoute(APIRoute):
    """A route whose JSON body is read by :meth:`ServerState.read_body` (415, 413, 400 for
    bad or too deeply nested JSON), after the API key check (401: a stranger's body is never
    parsed), before FastAPI validates it against the route's pydantic model."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def read_first(request: Request) -> Response:
            await caller(request, await bearer(request))
            raw, data = await state_of(request).read_body(request)
            return await handler(_ReadRequest(request, raw, data))

        return read_first


router = APIRouter(route_class=_BodyRoute, responses=ERROR_RESPONSES)

#: The app's shared state, and the caller's owner hash (401 unless the API key is ours).
State = Annotated[ServerState, Depends(state_of)]
Owner = Annotated[str, Depends(caller)]


@router.get("/health")
async def health(state: State) -> JSONResponse:
    """200 ``ok`` when the store answers within ``ServerLimits.health_timeout_s``, else
    503 ``unavailable``."""
    status, code = "ok", 200
    if not await state.store_answers():
        status, code = "unavailable", 503
    body = {
        "status": status,
        "store": "ok" if code == 200 else "unreachable",
        "model": state.model_name,
        "running": state.admission.running,
        "waiting": state.admission.waiting,
    }
    return JSONResponse(body, status_code=code)


@router.get("/metrics")
async def prometheus(state: State) -> Response:
    return Response(render(state.scrape), media_type=PROMETHEUS_CONTENT_TYPE)


@router.get("/v1/models")
async def models(state: State, owner: Owner) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": state.model_name, "object": "model", "created": 0, "owned_by": "convo"}],
    }


@router.get("/v1/sessions/{session_id}")
async def history(session_id: str, state: State, owner: Owner) -> dict[str, Any]:
    data = await state.in_thread(state.owned, session_id, owner)
    summary = await state.in_thread(state.summary_of, session_id, owner)
    return {
        "id": session_id,
        "object": "session",
        "summary": data["summary"],
        "evicted_turns": data["evicted_turns"],
        "summarized_turns": data["summarized_turns"],
        # Where the summary stands: status, lag (due -> written), the worker's backlog.
        "summary_state": summary,
        "messages": [{"role": r["role"], "content": r["content"]} for r in data["messages"]],
    }


@router.get("/v1/sessions/{session_id}/export")
async def export(session_id: str, state: State, owner: Owner) -> dict[str, Any]:
    data: dict[str, Any] = await state.in_thread(state.owned, session_id, owner)
    return data


@router.delete("/v1/sessions/{session_id}")
async def delete(session_id: str, state: State, owner: Owner) -> dict[str, Any]:
    """Delete a session; 409 at once if a turn of it is running (no waiting)."""

    def work() -> None:
        with state.store.lock(session_id, 0):  # another replica's turn: 409 at once too
            if peek_owned(state.store, session_id, owner) is None:
                raise SessionNotFound(f"no session {session_id!r}")
            doomed = (session_id, *state.store.forks_of(session_id))
            for sid in doomed:  # no summary lands in a new one
                state.summaries.forget(state.store, sid)
            state.store.delete(session_id, forks=True)  # its forks go with it (``<id>~N``), memory too
            if state.memory is not None:
                state.memory.session_deleted(doomed)  # and every cached index built from them

    # Another key's session is missing, busy or not: 404 before any queue or lock.
    if not await state.session_exists(session_id, owner):
        raise SessionNotFound(f"no session {session_id!r}")
    release = await state.enter_session(session_id, 0)
    try:
        await state.in_thread(work)
    finally:
        release()
    return {"id": session_id, "object": "session.deleted", "deleted": True}


@router.post("/v1/chat/completions")
async def chat(
    body: ChatCompletionBody,
    state: State,
    owner: Owner,
    x_session_id: Annotated[
        SessionId | None, Header(description="the conversation the server keeps (wins over metadata)")
    ] = None,
) -> Response:
    """OpenAI's Chat Completions, with and without ``stream``; with a session id the
    server keeps the conversation inside its budget."""
    parsed = body.to_request(
        header_session_id=x_session_id,
        limits=state.limits,
        max_tokens_cap=state.max_tokens_cap,
        session_from_user=state.session_from_user,
    )
    turn = turn_of(state, parsed, owner)
    admitted = await admit(state, turn)
    release = admitted.release

    completion = Completion(state.model_name, parsed.session_id, state.metrics)
    headers = {"X-Session-Id": parsed.session_id} if parsed.session_id else {}
    if not parsed.stream:
        try:
            reply: Reply = await state.in_thread(turn.run)
        finally:
            release()
        completion.forked = turn.forked  # set by the turn when the client's history diverged
        return JSONResponse(completion.body(reply), headers=headers)
    return await stream_turn(
        state,
        turn,
        completion,
        include_usage=parsed.include_usage,
        started=admitted.started,
        release=release,
        headers=headers,
    )


# -- a person's memory (see convo.server.memory) -------------------------------------------
def _memory_of(state: ServerState) -> ServerMemory:
    if state.memory is None:
        raise ApiError(404, "this server keeps no memory (started with --no-memory)", code="memory_off")
    return state.memory


def _user_id(user_id: str) -> str:
    try:
        return check_user_id(user_id)
    except ConfigError as exc:
        raise ApiError(400, f"user id: {exc}", code="invalid_value", param="user_id") from None


@router.get("/v1/users/{user_id}/memory")
async def user_memory(user_id: str, state: State, owner: Owner) -> dict[str, Any]:
    """What the server remembers of person ``user_id`` of this API key: their sessions and
    the turns indexed of each, with dates (another key's people: an empty list)."""
    memory = _memory_of(state)
    data: dict[str, Any] = await state.in_thread(memory.person_export, owner, _user_id(user_id))
    return data


@router.delete("/v1/users/{user_id}/memory")
async def forget_user(user_id: str, state: State, owner: Owner) -> dict[str, Any]:
    """Forget person ``user_id`` of this API key: their memory rows (their sessions' too)
    and every index built from them. The sessions' messages stay (delete the sessions for
    those), but what they said so far is never indexed again; what a session continued
    afterwards says is remembered as usual."""
    memory = _memory_of(state)
    removed = await state.in_thread(memory.forget_person, owner, _user_id(user_id))
    return {"id": user_id, "object": "user.memory.deleted", "deleted": True, **removed}
