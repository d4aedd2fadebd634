"""LangChain: a chat message history in a convo store, and a Runnable that fits the
prompt into a budget *with* the new message.

A history alone cannot keep a prompt inside a budget: ``RunnableWithMessageHistory``
reads the history before the new message is added, so a history trimmed to the budget
plus the new message is over it. Keep the two jobs apart: :class:`ConvoChatMessageHistory`
stores every message, and :func:`fit_messages` is a step placed right before the model,
where it sees the whole prompt (system, history and the new message)::

    chain = RunnableWithMessageHistory(
        prompt | fit_messages(budget=budget, counter=counter) | model,
        lambda sid: ConvoChatMessageHistory(sid, store=store),
        input_messages_key="input",
        history_messages_key="history",
    )

Install with ``pip install 'convo[langchain]'``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from convo.integrations import require

require("langchain_core", "langchain")

from langchain_core.chat_history import BaseChatMessageHistory  # noqa: E402
from langchain_core.messages import (  # noqa: E402
    BaseMessage,
    convert_to_messages,
    convert_to_openai_messages,
)
from langchain_core.prompt_values import PromptValue  # noqa: E402
from langchain_core.runnables import Runnable, RunnableLambda  # noqa: E402

from convo.budget import Budget  # noqa: E402
from convo.errors import SessionNotFound  # noqa: E402
from convo.messages import Message  # noqa: E402
from convo.plan import PassageSource, PromptPlan, fit  # noqa: E402
from convo.stores import InMemoryStore, SessionState, Store  # noqa: E402
from convo.tokens import TokenCounter  # noqa: E402

__all__ = [
    "ConvoChatMessageHistory",
    "fit_langchain_messages",
    "fit_messages",
    "from_langchain",
    "to_langchain",
]


def from_langchain(messages: Sequence[BaseMessage]) -> list[Message]:
    """LangChain messages as convo messages (tool calls and tool results included)."""
    return [Message.from_openai(d) for d in _openai_dicts(messages)]


def to_langchain(messages: Sequence[Message]) -> list[BaseMessage]:
    """Convo messages as LangChain messages."""
    return list(convert_to_messages([m.to_openai() for m in messages]))


def _openai_dicts(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    out = convert_to_openai_messages(list(messages))
    return [out] if isinstance(out, dict) else list(out)


class ConvoChatMessageHistory(BaseChatMessageHistory):
    """A LangChain chat message history kept in a convo store.

    Every message is stored (nothing is trimmed here; put :func:`fit_messages` before the
    model for that). The session is created on first use.

    Args:
        session_id: the convo session id.
        store: a :class:`~convo.stores.Store` (``SQLiteStore``, ``RedisStore``...);
            default: a new in-memory store.

    Example:
        >>> history = ConvoChatMessageHistory("s1")
        >>> history.add_user_message("hi")
        >>> [m.type for m in history.messages]
        ['human']
    """

    def __init__(self, session_id: str, *, store: Store | None = None) -> None:
        self.session_id = session_id
        self.store: Store = store if store is not None else InMemoryStore()

    @property
    def messages(self) -> list[BaseMessage]:  # type: ignore[override]
        """The whole stored history."""
        if not self.store.exists(self.session_id):
            return []
        return to_langchain(self.store.load(self.session_id)[1])

    def add_messages(self, messages: Sequence[BaseMessage]) -> None:
        """Store ``messages`` in one append (raises :class:`~convo.errors.MessageError`
        for a message convo cannot represent, before anything is stored)."""
        converted = from_langchain(messages)
        # Create-if-missing is one atomic step of the store: of two writers (threads or
        # processes) making the session at once, one creates it and both append.
        self.store.create_if_missing(SessionState(session_id=self.session_id))
        self.store.append(self.session_id, converted)

    def clear(self) -> None:
        """Delete the session and its history (nothing to do if it does not exist)."""
        try:
            self.store.delete(self.session_id)
        except SessionNotFound:  # never made, or another writer cleared it first
            pass


def fit_langchain_messages(
    messages: Sequence[BaseMessage] | PromptValue,
    *,
    budget: Budget,
    counter: TokenCounter,
    summary: str | None = None,
    retriever: PassageSource | None = None,
    session_id: str = "",
) -> tuple[list[BaseMessage], PromptPlan]:
    """:func:`convo.fit` for LangChain messages: the messages to send, and the plan.

    Messages kept unchanged are the very objects passed in.
    """
    if isinstance(messages, PromptValue):
        messages = messages.to_messages()
    originals = list(messages)
    dicts = _openai_dicts(originals)
    by_id = {id(d): m for d, m in zip(dicts, originals, strict=True)}
    kept, plan = fit(
        dicts, budget=budget, counter=counter, summary=summary, retriever=retriever, session_id=session_id
    )
    out = [by_id[id(d)] if id(d) in by_id else convert_to_messages([d])[0] for d in kept]
    return out, plan


def fit_messages(
    *,
    budget: Budget,
    counter: TokenCounter,
    summary: str | None = None,
    retriever: PassageSource | None = None,
) -> Runnable[Any, list[BaseMessage]]:
    """A Runnable that fits a prompt (a list of messages or a ``ChatPromptValue``) into
    ``budget``, as :func:`convo.fit` does. Place it right before the model, so that it
    sees the new message too.

    Args:
        budget: the token budget (``max_new_tokens`` is held back for the reply; give the
            model the same cap).
        counter: the model's counter (e.g. ``HFTokenCounter(tokenizer)``, or
            ``TiktokenCounter()`` with ``Budget(margin_tokens=...)`` for a hosted model).
        summary / retriever: as in :func:`convo.fit`.
    """

    def run(value: Any) -> list[BaseMessage]:
        if not isinstance(value, PromptValue):
            value = list(convert_to_messages(value))
        return fit_langchain_messages(
            value, budget=budget, counter=counter, summary=summary, retriever=retriever
        )[0]

    return RunnableLambda(run, name="convo_fit")
