"""A turn streamed as server-sent events, that lets go of everything the moment it ends.

The turn runs in a worker thread (:class:`~convo.engines.base.TextStream`); its pieces are
read with ``TextStream.aiter()`` (the worker wakes the event loop: no thread hop per piece).
:class:`EventStream` is the response: besides sending the events it listens for the client
going away, and then cancels the generation at once (the worker stores the partial reply).
However the response ends (the last event, a disconnect, an error, the server stopping),
its ``close`` runs before the request's task does: the admission slot and the session's
queue are given back then, not when the garbage collector finds a suspended generator.

A reply with tool calls streams them as OpenAI does: ``delta.tool_calls`` items (the
call's ``index``, ``id``, ``type`` and function ``name`` first, then ``arguments``
fragments), from the engine's ``on_tool_call_delta`` in order with the text, then a last
chunk whose ``finish_reason`` is ``tool_calls``. An engine that hands its calls over only
at the end gets them sent whole, one item per call, before that last chunk.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, cast

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from convo.engines.base import TextStream
from convo.models.generation import ToolCallDelta
from convo.server.completions import Completion, reply_finish_reason, tool_call_delta_json
from convo.server.errors import error_status
from convo.server.state import ServerState
from convo.server.turns import Turn
from convo.session import Reply


class EventStream(StreamingResponse):
    """A ``text/event-stream`` response with a cancel on disconnect and a close that always runs.

    Args:
        events: the events to send.
        cancel: awaited when the client disconnects (stop producing events soon).
        close: awaited once when the response ends, however it ends (shielded from
            cancellation).
        headers: extra response headers.
    """

    def __init__(
        self,
        events: AsyncIterator[str],
        *,
        cancel: Callable[[], Awaitable[None]],
        close: Callable[[], Awaitable[None]],
        headers: dict[str, str],
    ) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._cancel = cancel
        self._close = close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        failed: Exception | None = None
        try:
            async with anyio.create_task_group() as group:

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    await self._cancel()  # the events then end by themselves, quickly

                group.start_soon(watch)
                try:
                    await self.stream_response(send)  # uvicorn drops sends to a gone client
                except OSError:
                    pass  # a server that raises on a send to a gone client: the close cancels
                except Exception as exc:  # raised below as itself, not in an ExceptionGroup
                    failed = exc
                group.cancel_scope.cancel()
            if failed is not None:
                raise failed
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
                await self._close()


async def stream_turn(
    state: ServerState,
    turn: Turn,
    completion: Completion,
    *,
    include_usage: bool,
    started: float,
    release: Callable[[], None],
    headers: dict[str, str],
) -> EventStream:
    """Start ``turn`` and stream it. An error before the first text is raised (it gets an
    HTTP status); a later one ends the stream with an error event and ``[DONE]``.

    Args:
        state: the app's state (worker threads, metrics).
        turn: the turn to run.
        completion: the ids and JSON shapes of the response.
        include_usage: end with a usage chunk (``stream_options.include_usage``).
        started: when the request was admitted (``time.monotonic()``), for the TTFT metric.
        release: gives back the admission slot and the session's queue; called once.
    """

    def run(on_text: Callable[[Any], None], cancel: threading.Event) -> Reply:
        # Text and tool-call pieces share the stream's queue: they go out in their order.
        return turn.run(on_text=on_text, cancel=cancel, on_tool_call_delta=on_text)

    stream: TextStream[Reply] = TextStream(run, {})
    # aiter() is an async generator (typed as an iterator): aclose() finishes it. Its items
    # are text (str) or ToolCallDelta.
    pieces = cast("AsyncGenerator[str | ToolCallDelta, None]", stream.aiter())
    end = object()
    released = False

    async def cancel() -> None:
        # Cancel and wait in a worker thread: joining the generation must not block the loop.
        await state.in_thread(stream.close)

    async def close() -> None:
        nonlocal released
        if released:
            return
        released = True
        try:
            await cancel()
            await pieces.aclose()  # the generation has ended: this does not block
        finally:
            release()

    try:
        first = await anext(pieces, end)  # an error before any text -> an HTTP status
    except BaseException:
        with anyio.CancelScope(shield=True):
            await close()
        raise
    state.metrics.ttft.observe(time.monotonic() - started)
    # The history is reconciled before the first text: a fork is known before the headers.
    completion.forked = turn.forked
    if turn.forked is not None:
        headers = {**headers, "X-Convo-Forked": turn.forked}

    async def events() -> AsyncIterator[str]:
        try:
            yield completion.chunk({"role": "assistant", "content": ""})
            item = first
            calls_sent = False
            while item is not end:
                if isinstance(item, ToolCallDelta):
                    calls_sent = True
                    yield completion.chunk({"tool_calls": [tool_call_delta_json(item)]})
                elif item:
                    yield completion.chunk({"content": item})
                item = await anext(pieces, end)
            reply = stream.result
            assert reply is not None
            completion.count(reply)
            if reply.tool_calls and not calls_sent:  # an engine that gave them only at the end
                for i, call in enumerate(reply.tool_calls):
                    whole = ToolCallDelta(index=i, id=call.id, name=call.name, arguments=call.arguments)
                    yield completion.chunk({"tool_calls": [tool_call_delta_json(whole)]})
            yield completion.chunk({}, reply_finish_reason(reply), reply)
            if include_usage:
                yield completion.usage_chunk(reply)
            yield "data: [DONE]\n\n"
        except Exception as exc:  # headers are sent: end the stream with an error event
            yield f"data: {json.dumps(error_status(exc).body())}\n\n"
            yield "data: [DONE]\n\n"

    return EventStream(events(), cancel=cancel, close=close, headers=headers)
