"""Tool calls in an OpenAI-compatible reply, without I/O: read from a whole message, or
put together from the pieces of a stream.

What a server sends, and what convo makes of it (:class:`~convo.messages.ToolCall`)::

    non-streamed   choices[0].message.tool_calls = [{id, type, function: {name, arguments}}]
                   (or the legacy message.function_call = {name, arguments}: one call)
    streamed       choices[0].delta.tool_calls = [{index, id?, function: {name?, arguments?}}]
                   first piece of a call: its index, id and name; then argument fragments

Pieces are joined by ``index``: argument fragments are concatenated in order, the first
non-empty ``id`` is the call's, and name fragments are concatenated except a piece that
repeats the whole name so far (llama-cpp-python repeats the id and the name on every
piece; the ``openai`` SDK would glue them into ``get_weatherget_weather``). A piece
without ``index`` belongs to the call at its position in the list. The
:class:`~convo.models.generation.ToolCallDelta` passed on carries the id and the name
only on the piece that first gave them, as OpenAI streams them.

Policy for what a remote server gets wrong (the same for both shapes):

* **arguments that are not valid JSON** are kept exactly as the server sent them:
  OpenAI's own API may return such arguments too, and OpenAI clients expect the text the
  model produced, which only the caller can judge (retry, repair, report it to the model).
  Nothing is repaired or dropped; the call's
  :attr:`~convo.messages.ToolCall.parsed_arguments` is ``None`` and a warning is logged
  (``convo.engines.openai``, with the call id and function name, never the arguments).
  Arguments sent as a JSON object instead of a string are serialized; missing or empty
  arguments become ``"{}"`` (a call without parameters).
* **a call without an id** gets a fresh one (``call_`` + 24 hex digits), so that the tool
  result can name it.
* **a call without a function name**, or text convo cannot hold (a lone surrogate), is a
  :class:`~convo.errors.RemoteEngineError`: there is nothing to call.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from convo.errors import MessageError, RemoteEngineError
from convo.messages import ToolCall
from convo.models.generation import ToolCallDelta

logger = logging.getLogger("convo.engines.openai")


def new_call_id() -> str:
    """A fresh tool call id, for a server that sent none (OpenAI's ``call_...`` shape)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def arguments_text(value: Any) -> str:
    """The arguments as JSON text: a string as it is (``""`` or ``None``: ``"{}"``), any
    other JSON value serialized."""
    if value is None or value == "":
        return "{}"
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def make_call(*, id: str | None, name: Any, arguments: Any, where: str) -> ToolCall:
    """A :class:`ToolCall` from what a server sent, by the module's policy (``where``
    names the server in errors and warnings).

    Raises:
        RemoteEngineError: no function name, or text a message cannot hold.
    """
    if not isinstance(name, str) or not name:
        raise RemoteEngineError(f"{where} sent a tool call without a function name")
    try:
        call = ToolCall(id=id or new_call_id(), name=name, arguments=arguments_text(arguments))
    except MessageError as exc:
        raise RemoteEngineError(f"{where} sent a tool call convo cannot hold: {exc}") from exc
    if call.parsed_arguments is None:
        logger.warning(
            "%s: tool call %s (%s) has arguments that are not a JSON object; passed on as sent",
            where,
            call.id,
            call.name,
        )
    return call


def message_tool_calls(message: Mapping[str, Any], *, where: str) -> tuple[ToolCall, ...]:
    """The calls of a non-streamed reply's ``message``: its ``tool_calls``, else a legacy
    ``function_call``; ``()`` when it has neither.

    Raises:
        RemoteEngineError: a malformed call (see the module's policy).
    """
    raw = message.get("tool_calls")
    if not raw:
        legacy = message.get("function_call")
        if isinstance(legacy, Mapping):
            return (
                make_call(id=None, name=legacy.get("name"), arguments=legacy.get("arguments"), where=where),
            )
        return ()
    if not isinstance(raw, Sequence) or isinstance(raw, str):
        raise RemoteEngineError(f"{where} sent tool_calls that are not a list")
    calls = []
    for item in raw:
        fn = item.get("function") if isinstance(item, Mapping) else None
        if not isinstance(fn, Mapping):
            raise RemoteEngineError(f"{where} sent a tool call without a 'function' object")
        calls.append(
            make_call(id=item.get("id"), name=fn.get("name"), arguments=fn.get("arguments"), where=where)
        )
    return tuple(calls)


@dataclass
class _Partial:
    """One call being put together: its id and the name and argument fragments so far."""

    id: str | None = None
    name: list[str] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)


class ToolCallStream:
    """The tool calls of a streamed reply, put together from its ``delta.tool_calls``.

    Each piece is passed on (to ``on_delta``) as a :class:`ToolCallDelta` as soon as it
    comes; :meth:`calls` gives the finished calls, in index order.

    Example:
        >>> s = ToolCallStream("server")
        >>> s.feed([{"index": 0, "id": "c1", "function": {"name": "add", "arguments": ""}}])
        >>> s.feed([{"index": 0, "function": {"arguments": '{"a": 1}'}}])
        >>> s.calls()
        (ToolCall(id='c1', name='add', arguments='{"a": 1}'),)
    """

    def __init__(self, where: str, on_delta: Callable[[ToolCallDelta], None] | None = None) -> None:
        self.where = where
        self.on_delta = on_delta
        self._partials: dict[int, _Partial] = {}
        #: Pieces taken so far.
        self.pieces = 0

    def feed(self, deltas: Any) -> None:
        """Take one event's ``delta.tool_calls`` list.

        Raises:
            RemoteEngineError: not a list of objects, or an index that is not an int.
        """
        if not isinstance(deltas, Sequence) or isinstance(deltas, str):
            raise RemoteEngineError(f"{self.where} streamed tool_calls that are not a list")
        for position, raw in enumerate(deltas):
            if not isinstance(raw, Mapping):
                raise RemoteEngineError(f"{self.where} streamed a tool call piece that is not an object")
            index = raw.get("index", position)
            if not isinstance(index, int) or isinstance(index, bool) or index < 0:
                raise RemoteEngineError(f"{self.where} streamed a tool call with index {index!r}")
            got = raw.get("function")
            fn: Mapping[str, Any] = got if isinstance(got, Mapping) else {}
            name = fn.get("name") if isinstance(fn.get("name"), str) else None
            args = fn.get("arguments")
            args = args if isinstance(args, str) else ("" if args is None else json.dumps(args))
            call_id = raw.get("id") if isinstance(raw.get("id"), str) and raw.get("id") else None
            partial = self._partials.setdefault(index, _Partial())
            if call_id is not None and partial.id is None:
                partial.id = call_id
            else:
                call_id = None  # only the piece that gave the id carries it on
            if name and name == "".join(partial.name):
                name = None  # a repeat of the whole name, not a fragment
            if name:
                partial.name.append(name)
            if args:
                partial.arguments.append(args)
            self.pieces += 1
            if self.on_delta is not None:
                self.on_delta(ToolCallDelta(index=index, id=call_id, name=name or None, arguments=args))

    def calls(self, *, cut: bool = False) -> tuple[ToolCall, ...]:
        """The calls, in index order (by the module's policy). ``cut``: the stream ended
        early (deadline, cancel), so a call that never got its name is dropped rather than
        an error, and the last call's arguments may be unfinished JSON.

        Raises:
            RemoteEngineError: a call of a whole stream never got a function name.
        """
        partials = [p for _, p in sorted(self._partials.items()) if p.name or not cut]
        return tuple(
            make_call(id=p.id, name="".join(p.name), arguments="".join(p.arguments), where=self.where)
            for p in partials
        )
