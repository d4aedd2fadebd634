"""LlamaIndex: :class:`ConvoMemory`, a ``BaseMemory`` that keeps every message in a convo
store and returns a prompt that fits the budget.

::

    memory = ConvoMemory.from_defaults(
        session_id="carol", budget=Budget(context_tokens=4096), counter=counter,
        system_prompt="You are a travel agent.", store=SQLiteStore("chats.db"),
    )
    engine = SimpleChatEngine.from_defaults(llm=llm, memory=memory)

``get()`` plans the prompt through a convo :class:`~convo.session.Session`: the system
prompt pinned, the recent turns newest first, tool calls kept with their results, the
reply reserve held back. Chat engines ``put()`` the new user message before ``get()``;
agents that call ``get(input=...)`` first get a plan made *with* that message, so adding
it afterwards stays in the budget. Put the system prompt in the memory rather than in the
engine's prefix messages: prefix messages are only estimated (``initial_token_count``).

Install with ``pip install 'convo[llamaindex]'``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from convo.integrations import require

require("llama_index.core", "llamaindex")

from llama_index.core.base.llms.types import (  # noqa: E402
    CachePoint,
    ChatMessage,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)
from llama_index.core.memory.types import BaseMemory  # noqa: E402
from pydantic import ConfigDict, Field, PrivateAttr  # noqa: E402

from convo.budget import Budget  # noqa: E402
from convo.errors import MessageError  # noqa: E402
from convo.messages import Message, Role, ToolCall  # noqa: E402
from convo.plan import PromptPlan  # noqa: E402
from convo.session import Retriever, Session  # noqa: E402
from convo.stores import InMemoryStore, Store  # noqa: E402
from convo.summarize import Summarizer  # noqa: E402
from convo.tokens import TokenCounter  # noqa: E402

__all__ = ["ConvoMemory", "from_llamaindex", "to_llamaindex"]

#: LlamaIndex roles that mean the assistant.
_ASSISTANT_ROLES = {"assistant", "chatbot", "model"}


def from_llamaindex(message: ChatMessage) -> Message:
    """A LlamaIndex ``ChatMessage`` as a convo message.

    Tool calls come from ``ToolCallBlock`` blocks or from ``additional_kwargs["tool_calls"]``
    (OpenAI shape); a tool result's id from ``additional_kwargs["tool_call_id"]``.
    Thinking blocks and cache points are left out.

    Raises:
        MessageError: an image, audio, video or document block (convo budgets text).
    """
    texts: list[str] = []
    calls: list[ToolCall] = []
    for block in message.blocks:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolCallBlock):
            args = block.tool_kwargs if isinstance(block.tool_kwargs, str) else json.dumps(block.tool_kwargs)
            calls.append(ToolCall(id=block.tool_call_id or "", name=block.tool_name, arguments=args))
        elif not isinstance(block, (ThinkingBlock, CachePoint)):
            raise MessageError(
                f"convo keeps text and tool calls; a {type(block).__name__} cannot be budgeted"
            )
    extra = message.additional_kwargs
    for raw in extra.get("tool_calls") or ():
        d = raw.model_dump() if hasattr(raw, "model_dump") else dict(raw)
        fn = d.get("function") or {}
        args = fn.get("arguments", "{}")
        calls.append(
            ToolCall(
                id=d.get("id") or "",
                name=fn.get("name", ""),
                arguments=args if isinstance(args, str) else json.dumps(args),
            )
        )
    role = message.role.value
    return Message(
        role=Role.ASSISTANT if role in _ASSISTANT_ROLES else ("system" if role == "developer" else role),  # type: ignore[arg-type]
        content="\n".join(texts),
        tool_calls=tuple(calls),
        tool_call_id=extra.get("tool_call_id"),
        name=extra.get("name"),
    )


def to_llamaindex(message: Message) -> ChatMessage:
    """A convo message as a LlamaIndex ``ChatMessage`` (tool calls as ``ToolCallBlock``)."""
    blocks: list[Any] = [TextBlock(text=message.content)] if message.content or not message.tool_calls else []
    for call in message.tool_calls:
        blocks.append(ToolCallBlock(tool_call_id=call.id, tool_name=call.name, tool_kwargs=call.arguments))
    extra: dict[str, Any] = {}
    if message.tool_call_id is not None:
        extra["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        extra["name"] = message.name
    return ChatMessage(role=message.role.value, blocks=blocks, additional_kwargs=extra)


class ConvoMemory(BaseMemory):
    """A LlamaIndex memory that never returns more than the budget allows.

    Args:
        session_id: the convo session (resumed when the store has it).
        budget: the token budget (``max_new_tokens`` is held back for the reply).
        counter: the model's counter (``HFTokenCounter(tokenizer)``; ``TiktokenCounter()``
            with a ``margin_tokens`` for a hosted model).
        store: where messages live (default: in memory).
        system_prompt: pinned; shown first in every prompt.
        summarizer / retriever: as for :class:`~convo.session.Session` (without a
            summarizer, turns that leave the window are only kept in the store).

    Example:
        >>> from convo.tokens import CharCounter
        >>> memory = ConvoMemory.from_defaults(session_id="m1", counter=CharCounter())
        >>> memory.put(ChatMessage(role="user", content="hi"))
        >>> [m.content for m in memory.get()]
        ['hi']
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    session_id: str
    budget: Budget = Field(default_factory=Budget)
    counter: TokenCounter
    store: Store = Field(default_factory=InMemoryStore)
    system_prompt: str | None = None
    # (protocols: pydantic cannot check them, so the fields are typed where they are used)
    summarizer: Any = None
    retriever: Any = None
    _session: Session = PrivateAttr()

    def model_post_init(self, context: Any, /) -> None:
        self._session = self._open()

    def _open(self) -> Session:
        summarizer: Summarizer | None = self.summarizer
        retriever: Retriever | None = self.retriever
        return Session(
            counter=self.counter,
            budget=self.budget,
            store=self.store,
            session_id=self.session_id,
            system_prompt=self.system_prompt,
            summarizer=summarizer,
            retriever=retriever,
        )

    @classmethod
    def class_name(cls) -> str:
        return "ConvoMemory"

    @classmethod
    def from_defaults(cls, **kwargs: Any) -> ConvoMemory:
        """``ConvoMemory(**kwargs)`` (LlamaIndex's constructor convention)."""
        return cls(**kwargs)

    @property
    def session(self) -> Session:
        """The convo session behind this memory."""
        return self._session

    def plan(self, input: str | None = None, *, initial_token_count: int = 0) -> PromptPlan:
        """The plan :meth:`get` returns the messages of (see :class:`~convo.plan.PromptPlan`)."""
        budget = self.budget
        if initial_token_count:
            budget = replace(budget, margin_tokens=budget.margin_tokens + initial_token_count)
        last = self._session.messages[-1] if self._session.messages else None
        if input is not None and not (last is not None and last.role is Role.USER and last.content == input):
            plan = self._session.plan(input, budget=budget)
            return replace(plan, messages=plan.messages[:-1])  # the new message is the caller's to add
        return self._session.plan(budget=budget)

    def get(self, input: str | None = None, **kwargs: Any) -> list[ChatMessage]:
        """The messages to send the model now, within the budget.

        Args:
            input: the new user message, when the caller adds it after this call: the
                plan leaves room for it. Ignored when it is already the newest message.
            initial_token_count: tokens the caller puts before these messages (prefix
                messages), held back from the budget.
        """
        plan = self.plan(input, initial_token_count=int(kwargs.get("initial_token_count") or 0))
        return [to_llamaindex(m) for m in plan.messages]

    def get_all(self) -> list[ChatMessage]:
        """Every stored message."""
        return [to_llamaindex(m) for m in self._session.messages]

    def put(self, message: ChatMessage) -> None:
        """Store a message (checked first: a tool result must answer a pending call)."""
        self._session.add(from_llamaindex(message))

    def put_messages(self, messages: Sequence[ChatMessage]) -> None:
        for m in messages:
            self.put(m)

    def set(self, messages: Sequence[ChatMessage]) -> None:
        """Replace the history with ``messages`` (the system prompt stays).

        Every message is converted and checked first, in order, on a scratch session with
        this memory's settings (no summarizer, no retriever, nothing stored): a message it
        refuses leaves the stored history as it was.

        Raises:
            MessageError / BudgetError: a message :meth:`put` would refuse; nothing changed.
        """
        converted = [from_llamaindex(m) for m in messages]
        scratch = Session(
            counter=self.counter,
            budget=self.budget,
            store=InMemoryStore(),
            session_id=self.session_id,
            system_prompt=self.system_prompt,
        )
        try:
            for message in converted:
                scratch.add(message)
        finally:
            scratch.close()
        self.reset()
        for message in converted:
            self._session.add(message)

    def reset(self) -> None:
        """Delete the stored history and start the session again."""
        if self.store.exists(self.session_id):
            self.store.delete(self.session_id)
        self._session = self._open()
