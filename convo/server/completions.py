"""The shapes of a chat completion in OpenAI's JSON: the whole response, the stream's
chunks and their usage, plus convo's own ``convo`` block (what the prompt held, what the
summary did). One :class:`Completion` per request gives its id and creation time to every
piece, streamed or not."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from convo.engines.base import FinishReason
from convo.messages import ToolCall
from convo.metrics import ServingMetrics
from convo.models.generation import ToolCallDelta
from convo.plan import Passage
from convo.session import Reply

#: OpenAI's ``finish_reason`` for each of convo's: a cancelled reply ended (``stop``), a
#: timed-out one was cut (``length``), as a reply that reached ``max_tokens``.
FINISH_REASONS: dict[FinishReason, str] = {
    FinishReason.STOP: "stop",
    FinishReason.CANCELLED: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.TIMEOUT: "length",
    FinishReason.TOOL_CALLS: "tool_calls",
}


def finish_reason(reason: FinishReason, tool_calls: bool = False) -> str:
    """OpenAI's ``finish_reason`` (:data:`FINISH_REASONS`); ``"tool_calls"`` too for a
    reply that ended with tool calls (``tool_calls``) whatever reason its engine gave for
    ending it (an engine reporting ``stop`` after a call), unless the reply was cut."""
    if tool_calls and reason in (FinishReason.STOP, FinishReason.TOOL_CALLS):
        return "tool_calls"
    return FINISH_REASONS.get(reason, "length")


def reply_finish_reason(reply: Reply) -> str:
    """OpenAI's ``finish_reason`` of a reply."""
    return finish_reason(reply.finish_reason, bool(reply.tool_calls))


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    """One item of OpenAI's ``message.tool_calls``."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_delta_json(delta: ToolCallDelta) -> dict[str, Any]:
    """One item of a stream chunk's ``delta.tool_calls``: ``index``, then ``id`` and
    ``type`` on the call's first piece, and ``function`` with the ``name`` (when the piece
    carries it) and an ``arguments`` fragment."""
    item: dict[str, Any] = {"index": delta.index}
    if delta.id is not None:
        item["id"] = delta.id
        item["type"] = "function"
    function: dict[str, Any] = {}
    if delta.name is not None:
        function["name"] = delta.name
    function["arguments"] = delta.arguments
    item["function"] = function
    return item


def message_json(reply: Reply) -> dict[str, Any]:
    """The response's ``message``: ``content`` is ``null`` when a reply with tool calls
    has no text beside them (OpenAI's shape)."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.text}
    if reply.tool_calls:
        message["content"] = reply.text or None
        message["tool_calls"] = [tool_call_json(c) for c in reply.tool_calls]
    return message


def usage(reply: Reply) -> dict[str, Any]:
    """OpenAI's ``usage``: prompt, completion and total tokens, and of the prompt, the
    tokens whose KV the engine reused instead of prefilling them
    (``prompt_tokens_details.cached_tokens``, as OpenAI reports its prompt cache)."""
    g = reply.stats.generation
    completion = g.new_tokens if g is not None else 0
    prompt = reply.stats.prompt_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached_tokens(reply)},
    }


def cached_tokens(reply: Reply) -> int:
    """Prompt tokens of ``reply`` whose KV the engine reused (0 for an engine that keeps none)."""
    g = reply.stats.generation
    return min(g.cached_tokens, reply.stats.prompt_tokens) if g is not None else 0


def convo_stats(reply: Reply, session_id: str | None, forked: str | None = None) -> dict[str, Any]:
    """The response's ``convo`` block: the session, the prompt's parts and the summary."""
    s = reply.stats
    return {
        "session_id": session_id,
        "forked": forked,  # where the replaced tail went, when the client's history diverged
        "turn": s.turn,
        "context_tokens": s.context_tokens,
        "parts": dict(s.parts),
        "evicted_turns": s.evicted_turns,
        # The first turn the prompt showed (``evicted_turns`` is after the turn: the window
        # may have moved for the next one already).
        "first_shown_turn": reply.plan.first_shown_turn,
        "summarized_turns": s.summarized_turns,
        "hidden_turns": s.hidden_turns,
        "provisional_summary": s.provisional_summary,
        "summary_wait_s": round(s.summarize_s, 4),
        # Seconds the turn took before its prompt went to the engine (indexing, retrieval,
        # planning), and generating.
        "plan_s": round(s.plan_s, 4),
        "generate_s": round(s.generate_s, 4),
        "summary": s.summary.to_dict() if s.summary is not None else None,
        # What retrieval put in the prompt, for citation: where each passage comes from.
        "passages": [passage_json(p) for p in reply.plan.passages_used],
    }


def passage_json(p: Passage) -> dict[str, Any]:
    """One retrieved passage of the prompt: its source (``turn 3``, ``session <id> turn
    3``), key, score and position (session, turn, line, date), without its text."""
    position = {k: p.meta[k] for k in ("session_id", "turn", "line", "date") if k in p.meta}
    return {"source": p.source, "key": p.key, "score": round(float(p.score), 4), **position}


class Completion:
    """The ids and the JSON shapes of one chat completion.

    Args:
        model_name: the ``model`` every piece names.
        session_id: the conversation the server keeps, if any.
        metrics: where :meth:`count` adds the reply's tokens.
    """

    def __init__(self, model_name: str, session_id: str | None, metrics: ServingMetrics) -> None:
        self.model_name = model_name
        self.session_id = session_id
        self.metrics = metrics
        #: Set when the client's history diverged: the id holding the replaced tail.
        self.forked: str | None = None
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_name}

    def body(self, reply: Reply) -> dict[str, Any]:
        """The non-streaming response (its tokens are counted)."""
        self.count(reply)
        return {
            **self._head("chat.completion"),
            "choices": [
                {
                    "index": 0,
                    "message": message_json(reply),
                    "finish_reason": reply_finish_reason(reply),
                    "logprobs": None,
                }
            ],
            "usage": usage(reply),
            "convo": convo_stats(reply, self.session_id, self.forked),
        }

    def chunk(self, delta: dict[str, Any], finish: str | None = None, reply: Reply | None = None) -> str:
        """One server-sent event of the stream; the final one (with the ``reply``) carries
        the ``convo`` block, as the non-streaming response does (``forked`` included)."""
        data: dict[str, Any] = {
            **self._head("chat.completion.chunk"),
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }
        if reply is not None:
            data["convo"] = convo_stats(reply, self.session_id, self.forked)
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    def usage_chunk(self, reply: Reply) -> str:
        """The stream's last chunk with ``stream_options.include_usage``."""
        data = {**self._head("chat.completion.chunk"), "choices": [], "usage": usage(reply)}
        return f"data: {json.dumps(data)}\n\n"

    def count(self, reply: Reply) -> None:
        """Add the reply's tokens to the server's metrics."""
        if reply.stats.generation is not None:
            self.metrics.add_tokens(reply.stats.generation.new_tokens)
