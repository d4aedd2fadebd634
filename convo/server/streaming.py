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
from typing import Any, Protocol, cast

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


class StreamFormat(Protocol):
    """How a streamed turn's pieces become server-sent events: chat completion chunks
    (:class:`ChatChunks`) or the Responses API's events
    (:class:`convo.server.responses.events.ResponseEvents`). :func:`stream_events` drives
    it; each method returns the events to send, already framed (``data: ...\n\n``)."""

    def opening(self, forked: str | None) -> list[str]:
        """The first events, once the turn has started (``forked``: the fork it made)."""
        ...

    def text(self, piece: str) -> list[str]:
        """A piece of the reply's text."""
        ...

    def tool_call(self, delta: ToolCallDelta) -> list[str]:
        """A piece of a tool call (a whole call from an engine that streams none)."""
        ...

    def closing(self, reply: Reply) -> list[str]:
        """The last events, with the finished reply (its tokens are counted here)."""
        ...

    def failure(self, exc: Exception) -> list[str]:
        """The events that end a stream that failed after its headers were sent."""
        ...


class ChatChunks:
    """Chat Completions' stream: ``chat.completion.chunk`` events, ``[DONE]`` last.

    Args:
        completion: the ids and JSON shapes of the response.
        include_usage: end with a usage chunk (``stream_options.include_usage``).
    """

    def __init__(self, completion: Completion, include_usage: bool) -> None:
        self.completion = completion
        self.include_usage = include_usage

    def opening(self, forked: str | None) -> list[str]:
        self.completion.forked = forked
        return [self.completion.chunk({"role": "assistant", "content": ""})]

    def text(self, piece: str) -> list[str]:
        return [self.completion.chunk({"content": piece})]

    def tool_call(self, delta: ToolCallDelta) -> list[str]:
        return [self.completion.chunk({"tool_calls": [tool_call_delta_json(delta)]})]

    def closing(self, reply: Reply) -> list[str]:
        self.completion.count(reply)
        out = [self.completion.chunk({}, reply_finish_reason(reply), reply)]
        if self.include_usage:
            out.append(self.completion.usage_chunk(reply))
        return [*out, "data: [DONE]\n\n"]

    def failure(self, exc: Exception) -> list[str]:
        return [f"data: {json.dumps(error_status(exc).body())}\n\n", "data: [DONE]\n\n"]


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
    """Start ``turn`` and stream it as chat completion chunks (:func:`stream_events` with
    :class:`ChatChunks`)."""
    return await stream_events(
        state, turn, ChatChunks(completion, include_usage), started=started, release=release, headers=headers
    )


async def stream_events(
    state: ServerState,
    turn: Turn,
    fmt: StreamFormat,
    *,
    started: float,
    release: Callable[[], None],
    headers: dict[str, str],
) -> EventStream:
    """Start ``turn`` and stream it in ``fmt``'s events. An error before the first text is
    raised (it gets an HTTP status); a later one ends the stream with ``fmt``'s failure
    events.

    Args:
        state: the app's state (worker threads, metrics).
        turn: the turn to run.
        fmt: how pieces become events (:class:`StreamFormat`).
        started: when the request was admitted (``time.monotonic()``), for the TTFT metric.
        release: gives back the admission slot and the session's queue; called once.
        headers: the response's headers (``X-Convo-Forked`` is added for a fork).
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
    if turn.forked is not None:
        headers = {**headers, "X-Convo-Forked": turn.forked}

    async def events() -> AsyncIterator[str]:
        try:
            for event in fmt.opening(turn.forked):
                yield event
            item = first
            calls_sent = False
            while item is not end:
                if isinstance(item, ToolCallDelta):
                    calls_sent = True
                    for event in fmt.tool_call(item):
                        yield event
                elif item:
                    for event in fmt.text(cast(str, item)):
                        yield event
                item = await anext(pieces, end)
            reply = stream.result
            assert reply is not None
            if reply.tool_calls and not calls_sent:  # an engine that gave them only at the end
                for i, call in enumerate(reply.tool_calls):
                    whole = ToolCallDelta(index=i, id=call.id, name=call.name, arguments=call.arguments)
                    for event in fmt.tool_call(whole):
                        yield event
            for event in fmt.closing(reply):
                yield event
        except Exception as exc:  # headers are sent: end the stream with the failure events
            for event in fmt.failure(exc):
                yield event

    return EventStream(events(), cancel=cancel, close=close, headers=headers)
