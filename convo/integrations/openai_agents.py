"""OpenAI Agents SDK: :class:`ConvoSession`, a ``Session`` whose ``get_items`` returns the
history fitted into a budget, and a model-input filter that fits every model call.

::

    session = ConvoSession("carol", budget=Budget(context_tokens=8192), counter=TiktokenCounter())
    result = await Runner.run(
        agent, "Book me a flight", session=session,
        run_config=RunConfig(call_model_input_filter=session.model_input_filter),
    )

``get_items`` fits the stored history alone; the Runner then appends the new input, and
within one run it appends every tool call and result to that list before the next model
call. :meth:`ConvoSession.model_input_filter` fits what each model call actually receives
(the agent's instructions pinned, the new input and the tool steps included), so use it
for a hard guarantee. The full history stays in the underlying storage (an in-memory
``SQLiteSession`` by default, or any Agents ``Session`` you pass).

Responses items map to convo messages as the Chat Completions converter does: a message
item is a message, consecutive ``function_call`` items join the assistant message before
them (one block, kept with every ``function_call_output`` answering it). Items with no
chat equivalent (reasoning, hosted tool calls) travel with the message after them and are
counted in it, as their JSON: every item that reaches the model is counted.

Install with ``pip install 'convo[agents]'``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from convo.integrations import require

require("agents", "agents")

from agents.memory import SessionABC, SQLiteSession  # noqa: E402
from agents.run_config import CallModelData, ModelInputData  # noqa: E402

from convo.budget import Budget  # noqa: E402
from convo.errors import MessageError  # noqa: E402
from convo.messages import Message, Role, ToolCall  # noqa: E402
from convo.plan import PromptPlan, fit_plan  # noqa: E402
from convo.tokens import TokenCounter  # noqa: E402

__all__ = ["ConvoSession", "items_to_messages", "messages_to_items"]

_TEXT_PARTS = ("input_text", "output_text", "text")


def _as_dict(item: Any) -> dict[str, Any]:
    if isinstance(item, Mapping):
        return dict(item)
    if hasattr(item, "model_dump"):
        return dict(item.model_dump(exclude_unset=True))
    raise MessageError(f"an input item must be a mapping, got {type(item).__name__}")


def _text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        p = _as_dict(part)
        if p.get("type") in _TEXT_PARTS:
            parts.append(str(p.get("text", "")))
        elif p.get("type") == "refusal":
            parts.append(str(p.get("refusal", "")))
        else:
            raise MessageError(f"convo budgets text; a {p.get('type')!r} content part cannot be counted")
    return "".join(parts)


#: The messages :func:`items_to_messages` builds are dated from one clock reading, this far
#: apart, so a message the budget shortened (a copy with new content and the same
#: ``created_at``) is matched back to the items it stands for.
_STAMP_STEP_S = 1e-6


@dataclass
class _Group:
    """A convo message, the items it stands for, and the text of those items alone (the
    message's content also counts the items with no chat equivalent)."""

    message: Message
    items: list[Any]
    text: str
    extra: bool = False  # some of ``items`` have no chat equivalent


def _extra_text(items: Sequence[Any]) -> str:
    """What items with no chat equivalent (reasoning, hosted tool calls) are counted as:
    their JSON, an upper bound of what a model is shown of them."""
    return "\n".join(json.dumps(_as_dict(i), ensure_ascii=False, default=str) for i in items)


def _carry(group: _Group, extra: Sequence[Any], items: Sequence[Any] = ()) -> _Group:
    """``group`` with ``extra`` (counted) and ``items`` (already in its message) added."""
    if not extra and not items:
        return group
    content = group.message.content
    if extra:
        content = f"{content}\n{_extra_text(extra)}" if content else _extra_text(extra)
    message = replace(group.message, content=content)
    return _Group(message, [*group.items, *extra, *items], group.text, group.extra or bool(extra))


def _groups(items: Sequence[Any]) -> list[_Group]:
    stamp = time.time()
    groups: list[_Group] = []
    waiting: list[Any] = []  # items with no chat equivalent, attached to the next message

    def add(message: Message, item: Any) -> None:
        nonlocal waiting
        message = replace(message, created_at=stamp + len(groups) * _STAMP_STEP_S)
        groups.append(_carry(_Group(message, [], message.content), waiting, [item]))
        waiting = []

    results_since_call = False
    for item in items:
        d = _as_dict(item)
        kind = d.get("type")
        if kind in (None, "message") and "role" in d:
            add(Message.from_openai({"role": d["role"], "content": _text(d.get("content"))}), item)
            results_since_call = False
        elif kind == "function_call":
            call = ToolCall(
                id=d.get("call_id") or "", name=d.get("name", ""), arguments=d.get("arguments") or "{}"
            )
            last = groups[-1] if groups else None
            if last is not None and last.message.role is Role.ASSISTANT and not results_since_call:
                merged = replace(last.message, tool_calls=(*last.message.tool_calls, call))
                groups[-1] = _carry(_Group(merged, last.items, last.text, last.extra), waiting, [item])
                waiting = []
            else:
                add(Message(role=Role.ASSISTANT, content="", tool_calls=(call,)), item)
        elif kind == "function_call_output":
            output = d.get("output")
            text = output if isinstance(output, str) else _text(output)
            add(Message(role=Role.TOOL, content=text, tool_call_id=d.get("call_id")), item)
            results_since_call = True
        else:
            waiting.append(item)
    if waiting:
        if groups:
            groups[-1] = _carry(groups[-1], waiting)
        else:
            empty = Message(role=Role.ASSISTANT, content="", created_at=stamp)
            groups.append(_carry(_Group(empty, [], ""), waiting))
    return groups


def items_to_messages(items: Sequence[Any]) -> list[tuple[Message, list[Any]]]:
    """Responses input items as convo messages, each with the items it stands for.

    Items with no chat equivalent (reasoning, hosted tool calls such as a web search)
    travel with the message after them, and are counted in it: that message's content
    holds their JSON after its own text, so a budget is never spent twice over on content
    it did not see.

    Raises:
        MessageError: a content part that is not text, or a malformed item.
    """
    return [(g.message, g.items) for g in _groups(items)]


def messages_to_items(message: Message) -> list[dict[str, Any]]:
    """A convo message as Responses input items (for a summary, a passage, or a message
    the ``TRUNCATE`` policy shortened)."""
    if message.role is Role.TOOL:
        return [{"type": "function_call_output", "call_id": message.tool_call_id, "output": message.content}]
    out: list[dict[str, Any]] = []
    if message.content or not message.tool_calls:
        out.append({"role": message.role.value, "content": message.content})
    for call in message.tool_calls:
        out.append(
            {"type": "function_call", "call_id": call.id, "name": call.name, "arguments": call.arguments}
        )
    return out


class ConvoSession(SessionABC):
    """An Agents SDK session that fits what the model sees into a token budget.

    Args:
        session_id: the session id.
        budget: the token budget (``max_new_tokens`` is held back for the reply; set the
            model's ``max_tokens`` to the same value).
        counter: the model's counter (``TiktokenCounter()`` with ``Budget(margin_tokens=...)``
            for a hosted model; ``HFTokenCounter(tokenizer)`` for a local one).
        storage: where items live (default: ``SQLiteSession(session_id)``, in memory).
        instructions: counted as the pinned system part by :meth:`get_items` (the
            filter reads them from each call).
        summary: a summary of older turns, shown as a system message.
    """

    session_settings = None

    def __init__(
        self,
        session_id: str,
        *,
        budget: Budget,
        counter: TokenCounter,
        storage: Any = None,
        instructions: str | None = None,
        summary: str | None = None,
    ) -> None:
        self.session_id = session_id
        self.budget = budget
        self.counter = counter
        self.storage = storage if storage is not None else SQLiteSession(session_id)
        self.instructions = instructions
        self.summary = summary
        self.last_plan: PromptPlan | None = None

    def fit_items(self, items: Sequence[Any], *, instructions: str | None = None) -> list[Any]:
        """The items to send, within the budget: unchanged items are the objects passed
        in. The plan is kept in :attr:`last_plan`.

        Every item is counted, reasoning and hosted tool calls included (see
        :func:`items_to_messages`). A message the ``TRUNCATE`` policy shortened comes back
        as new items, its own text cut to what was counted for it, without the reasoning
        or hosted tool items it carried.
        """
        groups = _groups(items)
        by_id = {id(g.message): g for g in groups}
        by_stamp = {g.message.created_at: g for g in groups}
        pinned = [Message(role=Role.SYSTEM, content=instructions)] if instructions else []
        plan = fit_plan(
            [*pinned, *(g.message for g in groups)],
            budget=self.budget,
            counter=self.counter,
            summary=self.summary,
        )
        self.last_plan = plan
        out: list[Any] = []
        for m in plan.messages:
            if pinned and m is pinned[0]:
                continue  # the instructions travel apart from the items
            group = by_id.get(id(m))
            if group is not None:
                out.extend(group.items)
                continue
            shortened = by_stamp.get(m.created_at) if m.role is not Role.SYSTEM else None
            if shortened is not None and shortened.extra:  # its text alone, cut to the tokens counted
                text = self.counter.truncate_middle(shortened.text, self.counter.count_text(m.content))
                m = replace(m, content=text)
            out.extend(messages_to_items(m))
        return out

    async def get_items(self, limit: int | None = None) -> list[Any]:
        """The stored history fitted into the budget (the newest ``limit`` stored items
        at most, starting at a message)."""
        items = list(await self.storage.get_items(limit))
        while items and _as_dict(items[0]).get("type") not in (None, "message"):
            items.pop(0)  # never start at a tool result whose call was cut off
        return self.fit_items(items, instructions=self.instructions)

    async def add_items(self, items: list[Any]) -> None:
        await self.storage.add_items(items)

    async def pop_item(self) -> Any:
        return await self.storage.pop_item()

    async def clear_session(self) -> None:
        await self.storage.clear_session()

    def model_input_filter(self, data: CallModelData[Any]) -> ModelInputData:
        """For ``RunConfig(call_model_input_filter=...)``: fit every model call's input,
        the agent's instructions pinned."""
        model_data = data.model_data
        fitted = self.fit_items(model_data.input, instructions=model_data.instructions)
        return ModelInputData(input=fitted, instructions=model_data.instructions)
