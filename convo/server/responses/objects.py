"""The Responses API's JSON shapes of one reply: the ``response`` object and its output
items (a ``message`` with ``output_text``, then one ``function_call`` per tool call), with
OpenAI's ``usage`` (``input_tokens``, ``output_tokens``, ``total_tokens``) and convo's own
``convo`` block, as chat completions carry it.

Ids: a response id names the conversation convo keeps for it, so any replica finds it
without an index: ``resp_<conversation: 32 hex><turn: 16 hex>``; the conversation is the
session ``resp-<conversation>`` (readable at ``/v1/sessions/resp-<conversation>``)."""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from convo.engines.base import FinishReason
from convo.metrics import ServingMetrics
from convo.server.completions import cached_tokens, convo_stats
from convo.server.responses.request import ResponsesRequest
from convo.session import Reply

#: A response id: ``resp_`` + the conversation's 32 hex + the turn's 16 hex.
RESPONSE_ID = re.compile(r"^resp_([0-9a-f]{32})([0-9a-f]{16})$")
#: The session id of a conversation kept for the Responses API.
SESSION_PREFIX = "resp-"


def new_conversation() -> str:
    """A new conversation's 32 hex digits."""
    return uuid.uuid4().hex


def session_of(conversation: str) -> str:
    """The session that keeps a conversation."""
    return f"{SESSION_PREFIX}{conversation}"


def conversation_of(response_id: str) -> str | None:
    """The conversation a response id names, or ``None`` for what is not one of ours."""
    found = RESPONSE_ID.match(response_id)
    return found.group(1) if found else None


#: convo's finish reasons as a response's ``status`` and ``incomplete_details.reason``.
_STATUS: dict[FinishReason, tuple[str, str | None]] = {
    FinishReason.STOP: ("completed", None),
    FinishReason.TOOL_CALLS: ("completed", None),
    FinishReason.CANCELLED: ("cancelled", None),
    FinishReason.LENGTH: ("incomplete", "max_output_tokens"),
    FinishReason.TIMEOUT: ("incomplete", "max_output_tokens"),
}


@dataclass
class ResponseShape:
    """The ids and JSON shapes of one response, streamed or not.

    Args:
        request: the validated request (what the response repeats back).
        conversation: its conversation's 32 hex digits (a fresh one for ``store: false``).
        session_id: the session that keeps it (``None``: ``store: false``).
        model_name: the ``model`` it names.
    """

    request: ResponsesRequest
    conversation: str
    session_id: str | None
    model_name: str
    id: str = ""
    created_at: int = field(default_factory=lambda: int(time.time()))
    message_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    #: Set when the client's history diverged (see ``convo.server.reconcile``).
    forked: str | None = None

    def __post_init__(self) -> None:
        self.id = f"resp_{self.conversation}{uuid.uuid4().hex[:16]}"

    def call_item_id(self, index: int) -> str:
        """The output item id of the reply's ``index``-th function call."""
        return f"fc_{self.id[5:]}_{index}"

    def message_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {
            "id": self.message_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content if status == "completed" or text else [],
        }

    def call_item(
        self, index: int, call_id: str, name: str, arguments: str, status: str = "completed"
    ) -> dict[str, Any]:
        return {
            "id": self.call_item_id(index),
            "type": "function_call",
            "status": status,
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
        }

    def output(self, reply: Reply) -> list[dict[str, Any]]:
        """The output items: the text (when there is text, or no call), then each call."""
        items = []
        if reply.text or not reply.tool_calls:
            items.append(self.message_item(reply.text))
        for i, call in enumerate(reply.tool_calls):
            items.append(self.call_item(i, call.id, call.name, call.arguments))
        return items

    def body(self, reply: Reply | None = None, *, status: str | None = None) -> dict[str, Any]:
        """The ``response`` object: finished with ``reply``, else in progress (no output yet)."""
        incomplete = None
        if reply is not None:
            status, reason = _STATUS.get(reply.finish_reason, ("incomplete", "max_output_tokens"))
            incomplete = {"reason": reason} if reason else None
        r = self.request
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status or "in_progress",
            "background": False,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": r.instructions,
            "max_output_tokens": r.chat.max_tokens,
            "model": self.model_name,
            "output": self.output(reply) if reply is not None else [],
            "parallel_tool_calls": r.parallel_tool_calls,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": r.store,
            "temperature": r.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": r.tool_choice,
            "tools": r.tools,
            "top_p": r.top_p,
            "truncation": r.truncation,
            "usage": usage(reply) if reply is not None else None,
            "user": None,
            "metadata": r.metadata,
            "convo": convo_stats(reply, self.session_id, self.forked) if reply is not None else None,
        }


def usage(reply: Reply) -> dict[str, Any]:
    """The Responses API's ``usage``: input, output and total tokens."""
    g = reply.stats.generation
    output = g.new_tokens if g is not None else 0
    prompt = reply.stats.prompt_tokens
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached_tokens(reply)},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


def count_tokens(metrics: ServingMetrics, reply: Reply) -> None:
    """Add the reply's tokens to the server's metrics (as chat completions count theirs)."""
    if reply.stats.generation is not None:
        metrics.add_tokens(reply.stats.generation.new_tokens)
