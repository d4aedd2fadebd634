"""The routes: ``/health``, ``/metrics``, ``/v1/models``, ``/v1/sessions/{id}`` (history,
export, delete) and ``/v1/chat/completions``. Each takes the app's
:class:`~convo.server.state.ServerState` and the caller (the API key check) as dependencies."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import replace
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute

from convo.admission import Request as AdmissionRequest
from convo.engines.base import TextStream
from convo.errors import StoreError
from convo.server.errors import ERROR_RESPONSES, error_status
from convo.server.prometheus import CONTENT_TYPE as PROMETHEUS_CONTENT_TYPE
from convo.server.prometheus import render
from convo.server.requests import ChatCompletionBody, SessionId
from convo.server.security import bearer, caller, state_of
from convo.server.state import ServerState
from convo.server.turns import _convo_stats, _finish, _prompt_estimate, _Turn, _usage
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
    """200 ``ok`` when the store answers, else 503 ``unavailable``."""
    status, code = "ok", 200
    try:
        await anyio.to_thread.run_sync(state.store.ping, limiter=state.counting)
    except StoreError:
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
    return {
        "id": session_id,
        "object": "session",
        "summary": data["summary"],
        "evicted_turns": data["evicted_turns"],
        "summarized_turns": data["summarized_turns"],
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
            state.owned(session_id, owner)
            state.summaries.forget(state.store, session_id)  # its summary must not land in a new one
            state.store.delete(session_id)

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
    budget = state.budget
    if parsed.max_tokens is not None and parsed.max_tokens != budget.max_new_tokens:
        budget = replace(budget, max_new_tokens=parsed.max_tokens)
    turn = _Turn(
        request=parsed,
        owner=owner,
        budget=budget,
        store=state.store,
        engine=state.engine,
        limits=state.limits,
        summaries=state.summaries,
    )
    leave_session: Callable[[], None] = lambda: None  # noqa: E731
    if parsed.session_id is None:
        prompt_est = await anyio.to_thread.run_sync(_prompt_estimate, turn, limiter=state.counting)
    else:
        prompt_est = _prompt_estimate(turn)  # a bound from the budget: no counting
        # Queue behind this session's running turn before taking an admission slot.
        leave_session = await state.enter_session(parsed.session_id, state.limits.session_lock_timeout_s)
    started = time.monotonic()
    try:
        ticket = await state.admission.acquire_async(
            AdmissionRequest(prompt_tokens=prompt_est, max_new_tokens=budget.max_new_tokens)
        )
    except BaseException:
        leave_session()
        raise

    def release() -> None:
        ticket.release()
        leave_session()

    completion = _Completion(state, parsed.session_id)
    headers = {"X-Session-Id": parsed.session_id} if parsed.session_id else {}
    if not parsed.stream:
        try:
            reply: Reply = await state.in_thread(turn.run)
        finally:
            release()
        completion.forked = turn.forked  # set by the turn when the client's history diverged
        return JSONResponse(completion.body(reply), headers=headers)
    return await _stream(state, turn, completion, parsed.include_usage, started, release, headers)


class _Completion:
    """The ids and the JSON shapes of one chat completion."""

    def __init__(self, state: ServerState, session_id: str | None) -> None:
        self.state = state
        self.session_id = session_id
        self.forked: str | None = None
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.state.model_name}

    def body(self, reply: Reply) -> dict[str, Any]:
        """The non-streaming response."""
        self.count(reply)
        return {
            **self._head("chat.completion"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": reply.text},
                    "finish_reason": _finish(reply.finish_reason),
                    "logprobs": None,
                }
            ],
            "usage": _usage(reply),
            "convo": _convo_stats(reply, self.session_id, self.forked),
        }

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> str:
        """One server-sent event of the stream."""
        data = {
            **self._head("chat.completion.chunk"),
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    def usage_chunk(self, reply: Reply) -> str:
        data = {**self._head("chat.completion.chunk"), "choices": [], "usage": _usage(reply)}
        return f"data: {json.dumps(data)}\n\n"

    def count(self, reply: Reply) -> None:
        """Add the reply's tokens to the server's metrics."""
        if reply.stats.generation is not None:
            self.state.metrics.add_tokens(reply.stats.generation.new_tokens)


async def _stream(
    state: ServerState,
    turn: _Turn,
    completion: _Completion,
    include_usage: bool,
    started: float,
    release: Callable[[], None],
    headers: dict[str, str],
) -> Response:
    """Stream the turn as server-sent events; errors before the first text get an HTTP
    status, later ones end the stream with an error event and ``[DONE]``."""
    stream: TextStream[Reply] = TextStream(turn.run, {})
    chunks: Iterator[str] = iter(stream)
    end = object()

    async def close() -> None:
        # Shielded: on a client disconnect this runs in a cancelled scope. Closing cancels
        # generation; the worker stores the partial reply before it returns.
        with anyio.CancelScope(shield=True):
            try:
                await state.in_thread(stream.close)
            finally:
                release()

    try:
        first = await state.in_thread(next, chunks, end)  # errors before any text -> HTTP status
    except BaseException:
        await close()
        raise
    state.metrics.ttft.observe(time.monotonic() - started)

    async def events() -> AsyncIterator[str]:
        try:
            yield completion.chunk({"role": "assistant", "content": ""})
            text = first
            while text is not end:
                if text:
                    yield completion.chunk({"content": text})
                text = await state.in_thread(next, chunks, end)
            reply = stream.result
            assert reply is not None
            completion.count(reply)
            yield completion.chunk({}, _finish(reply.finish_reason))
            if include_usage:
                yield completion.usage_chunk(reply)
            yield "data: [DONE]\n\n"
        except Exception as exc:  # headers are sent: end the stream with an error event
            yield f"data: {json.dumps(error_status(exc).body())}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await close()

    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
