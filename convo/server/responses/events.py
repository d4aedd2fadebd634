"""A response streamed as the Responses API's server-sent events (a
:class:`~convo.server.streaming.StreamFormat` that :func:`~convo.server.streaming.stream_events`
drives, so disconnects and the release of the admission slot work as for chat)::

    response.created, response.in_progress
    text:  response.output_item.added (message), response.content_part.added,
           response.output_text.delta ...
    call:  response.output_item.added (function_call), response.function_call_arguments.delta ...
    end:   per item, in output order: response.output_text.done, response.content_part.done
           / response.function_call_arguments.done, then response.output_item.done;
           last response.completed (or response.incomplete: the reply was cut)
    error after the headers: error, then response.failed

Every event carries ``type`` and a ``sequence_number`` counting from 0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from convo.metrics import ServingMetrics
from convo.models.generation import ToolCallDelta
from convo.server.errors import error_status
from convo.server.responses.objects import ResponseShape, count_tokens
from convo.session import Reply

#: The last event for each final ``status``.
_LAST_EVENT = {"completed": "response.completed", "incomplete": "response.incomplete"}


@dataclass
class _Item:
    """An output item opened in the stream: its index, and what was streamed of it."""

    output_index: int
    call_index: int | None = None  # None: the message
    streamed: str = ""


@dataclass
class ResponseEvents:
    """The events of one streamed response.

    Args:
        shape: the response's ids and JSON shapes.
        metrics: where the reply's tokens are counted.
    """

    shape: ResponseShape
    metrics: ServingMetrics
    sequence: int = 0
    items: list[_Item] = field(default_factory=list)

    def _event(self, kind: str, **data: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def opening(self, forked: str | None) -> list[str]:
        self.shape.forked = forked
        body = self.shape.body()
        return [
            self._event("response.created", response=body),
            self._event("response.in_progress", response=body),
        ]

    def _message(self) -> tuple[_Item, list[str]]:
        for item in self.items:
            if item.call_index is None:
                return item, []
        item = _Item(output_index=len(self.items))
        self.items.append(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        ids = {"item_id": self.shape.message_id, "output_index": item.output_index}
        return item, [
            self._event(
                "response.output_item.added",
                output_index=item.output_index,
                item=self.shape.message_item("", "in_progress"),
            ),
            self._event("response.content_part.added", **ids, content_index=0, part=part),
        ]

    def text(self, piece: str) -> list[str]:
        item, out = self._message()
        item.streamed += piece
        out.append(
            self._event(
                "response.output_text.delta",
                item_id=self.shape.message_id,
                output_index=item.output_index,
                content_index=0,
                delta=piece,
                logprobs=[],
            )
        )
        return out

    def tool_call(self, delta: ToolCallDelta) -> list[str]:
        out = []
        item = next((i for i in self.items if i.call_index == delta.index), None)
        if item is None:
            item = _Item(output_index=len(self.items), call_index=delta.index)
            self.items.append(item)
            added = self.shape.call_item(delta.index, delta.id or "", delta.name or "", "", "in_progress")
            out.append(self._event("response.output_item.added", output_index=item.output_index, item=added))
        if delta.arguments:
            item.streamed += delta.arguments
            out.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=self.shape.call_item_id(delta.index),
                    output_index=item.output_index,
                    delta=delta.arguments,
                )
            )
        return out

    def closing(self, reply: Reply) -> list[str]:
        count_tokens(self.metrics, reply)
        out: list[str] = []
        if (reply.text or not reply.tool_calls) and not any(i.call_index is None for i in self.items):
            out += self._message()[1]  # a reply with no streamed text still has its message
        for item in self.items:
            out += self._close(item, reply)
        body = self.shape.body(reply)
        out.append(self._event(_LAST_EVENT.get(body["status"], "response.failed"), response=body))
        return out

    def _close(self, item: _Item, reply: Reply) -> list[str]:
        where = {"output_index": item.output_index}
        if item.call_index is None:
            ids = {"item_id": self.shape.message_id, **where}
            part = {"type": "output_text", "text": reply.text, "annotations": [], "logprobs": []}
            return [
                self._event(
                    "response.output_text.done", **ids, content_index=0, text=reply.text, logprobs=[]
                ),
                self._event("response.content_part.done", **ids, content_index=0, part=part),
                self._event("response.output_item.done", **where, item=self.shape.message_item(reply.text)),
            ]
        calls = reply.tool_calls
        if item.call_index < len(calls):
            call = calls[item.call_index]
            done = self.shape.call_item(item.call_index, call.id, call.name, call.arguments)
        else:  # streamed as a call, read as text in the end (an invalid call)
            done = self.shape.call_item(item.call_index, "", "", item.streamed, "incomplete")
        return [
            self._event(
                "response.function_call_arguments.done",
                item_id=done["id"],
                **where,
                name=done["name"],
                arguments=done["arguments"],
            ),
            self._event("response.output_item.done", **where, item=done),
        ]

    def failure(self, exc: Exception) -> list[str]:
        err = error_status(exc)
        body = self.shape.body(status="failed")
        body["error"] = {"code": err.code or "server_error", "message": err.message}
        return [
            self._event("error", code=err.code, message=err.message, param=err.param),
            self._event("response.failed", response=body),
        ]
