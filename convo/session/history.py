"""A session's history in memory: its stored messages indexed by turn, and the checks a
message passes before it is stored.

The store is the source of truth (:mod:`convo.stores`); :class:`History` is what a
:class:`~convo.session.Session` read from it, cut into turns (a turn starts at each user
message; messages before the first form turn 0), with the tool calls still open and the
date of each turn.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import date, datetime
from typing import cast

from convo.budget import Budget, OversizePolicy
from convo.errors import BudgetError, ConfigError, MessageError
from convo.messages import Message, MessageLike, Role, check_text
from convo.plan import Turn
from convo.tokens import TokenCounter

#: Longest session id a :class:`~convo.session.Session` accepts, in characters.
MAX_SESSION_ID_CHARS = 256

#: What dates new turns (see ``Session(clock=...)``).
Clock = Callable[[], date | datetime | str]


def check_session_id(session_id: object) -> None:
    """Raise :class:`~convo.errors.ConfigError` unless ``session_id`` is a non-empty
    string of at most :data:`MAX_SESSION_ID_CHARS` printable characters."""
    if not isinstance(session_id, str) or not session_id or len(session_id) > MAX_SESSION_ID_CHARS:
        raise ConfigError(
            f"session_id must be a non-empty string of at most {MAX_SESSION_ID_CHARS} "
            f"characters, got {session_id!r:.60}"
        )
    try:
        check_text(session_id, "session_id")
    except MessageError as exc:
        raise ConfigError(str(exc)) from None


def incoming_messages(content: str | MessageLike | Sequence[MessageLike]) -> list[Message]:
    """What :meth:`Session.send` stores: a string is a user message; a message or an
    OpenAI dict is read as is; a list is read item by item.

    Raises:
        MessageError: a malformed message, or a last message that is neither user nor tool.
    """
    if isinstance(content, str):
        return [Message(role=Role.USER, content=content)]
    if isinstance(content, (Message, Mapping)):
        messages = [Message.from_openai(content)]
    elif isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        # (from_openai refuses items that are not messages)
        messages = [Message.from_openai(cast(MessageLike, m)) for m in content]
    else:
        raise MessageError(
            f"send() takes a string, a message or a list of messages, not {type(content).__name__}"
        )
    if not messages or messages[-1].role not in (Role.USER, Role.TOOL):
        raise MessageError(
            "send() ends with a user message or tool results; store other messages with add() "
            "and generate with reply()"
        )
    return messages


def clock_date(clock: Clock | None) -> str | None:
    """The clock's reading as a turn date, or ``None`` without a clock: a ``datetime`` is
    kept to the minute (``"2026-12-01T09:30"``), a ``date`` as ``"2026-12-01"``, a string
    as it is."""
    if clock is None:
        return None
    now = clock()
    if isinstance(now, datetime):
        return now.isoformat(timespec="minutes")
    if isinstance(now, date):
        return now.isoformat()
    return str(now)


def open_calls_after(message: Message, pending: set[str]) -> set[str]:
    """The tool calls still open once ``message`` follows history whose open calls are
    ``pending``: an assistant message opens its calls, a tool result closes its call, any
    other unpinned message closes them all."""
    if message.role is Role.ASSISTANT:
        return {c.id for c in message.tool_calls}
    if message.role is Role.TOOL:
        return pending - {message.tool_call_id or ""}
    return pending if message.pinned else set()


def starts_turn(previous: Message | None, message: Message) -> bool:
    """Whether ``message`` opens a new turn after ``previous`` (``None``: it is the first).

    A user message opens one; so does an assistant message right after another assistant
    message that called no tool: nothing answered in between, so it opens a new exchange
    (an earlier chat that opened with the assistant's greeting, imported or added after
    the previous chat's last reply) instead of being folded into the previous turn and
    taking that turn's date. Only the stored messages decide, so a session read back
    from its store cuts its turns the same way.
    """
    if previous is None or message.role is Role.USER:
        return True
    return message.role is Role.ASSISTANT and previous.role is Role.ASSISTANT and not previous.tool_calls


class History:
    """One session's messages as read from its store, indexed by turn.

    Attributes:
        pinned: the pinned messages (system prompt, pinned facts), in order.
        log: the conversation's messages, in order.
        turn_starts: where each turn starts in ``log``.
        pending_tool_ids: the tool calls the last assistant message made that no tool
            result answered yet.
        dates: turn index -> the date it is indexed with for retrieval (see
            :func:`clock_date`); kept across :meth:`load`.
    """

    def __init__(self) -> None:
        self.pinned: list[Message] = []
        self.log: list[Message] = []
        self.turn_starts: list[int] = []
        self.pending_tool_ids: set[str] = set()
        self.dates: dict[int, str] = {}

    def load(self, messages: Sequence[Message]) -> None:
        """Replace the messages by ``messages`` (the store's); known dates are kept."""
        self.pinned, self.log, self.turn_starts = [], [], []
        self.pending_tool_ids = set()
        for m in messages:
            self.index(m)

    def index(self, message: Message) -> None:
        """Add a stored message."""
        if message.pinned:
            self.pinned.append(message)
            return
        if not self.turn_starts or starts_turn(self.log[-1] if self.log else None, message):
            self.turn_starts.append(len(self.log))
        self.log.append(message)
        self.pending_tool_ids = open_calls_after(message, self.pending_tool_ids)

    def copy(self) -> History:
        """An independent copy (the messages themselves are immutable and shared)."""
        out = History()
        out.pinned, out.log, out.turn_starts = list(self.pinned), list(self.log), list(self.turn_starts)
        out.pending_tool_ids, out.dates = set(self.pending_tool_ids), dict(self.dates)
        return out

    @property
    def message_count(self) -> int:
        return len(self.pinned) + len(self.log)

    @property
    def turn_count(self) -> int:
        return len(self.turn_starts)

    def turns(self, start: int = 0) -> list[Turn]:
        """Turns ``start..`` as :class:`~convo.plan.Turn` (index, messages)."""
        out = []
        for i in range(start, len(self.turn_starts)):
            end = self.turn_starts[i + 1] if i + 1 < len(self.turn_starts) else len(self.log)
            out.append(Turn(index=i, messages=tuple(self.log[self.turn_starts[i] : end])))
        return out

    def messages_of(self, start: int, end: int) -> list[Message]:
        """The messages of turns ``start..end-1``."""
        return [m for t in self.turns(start)[: end - start] for m in t.messages]

    def date_stored_turns(self) -> None:
        """Date the turns read from the store (or imported) by when their first message
        was created (``Message.created_at``, local time); a date already known is kept."""
        for turn, start in enumerate(self.turn_starts):
            created = datetime.fromtimestamp(self.log[start].created_at)
            self.dates.setdefault(turn, created.isoformat(timespec="minutes"))

    def date_turns_from(self, first: int, stamp: str) -> None:
        """Date turns ``first..`` that have no date yet with ``stamp``."""
        for turn in range(first, self.turn_count):
            self.dates.setdefault(turn, stamp)

    def check(
        self,
        message: Message,
        *,
        budget: Budget,
        counter: TokenCounter,
        pending_tool_ids: set[str] | None = None,
    ) -> None:
        """Validate ``message`` against this history and ``budget`` before it is stored.

        ``pending_tool_ids``: the calls still open before ``message`` (default: the
        history's), for checking several messages before any is stored.

        Raises:
            MessageError: not a message, or a tool result that answers no open call.
            BudgetError: the pinned part would pass ``budget.pinned_cap``, or a user message
                is larger than the prompt can hold under the ``RAISE`` oversize policy.
        """
        if not isinstance(message, Message):
            raise MessageError(f"expected a Message, got {type(message).__name__}")
        pending = self.pending_tool_ids if pending_tool_ids is None else pending_tool_ids
        if message.role is Role.TOOL:
            if message.tool_call_id not in pending:
                raise MessageError(f"tool result {message.tool_call_id!r} answers no pending tool call")
        if message.pinned:
            cost = sum(counter.message_tokens(m) for m in [*self.pinned, message])
            if cost > budget.pinned_cap:
                raise BudgetError(
                    f"pinned messages would take {cost} tokens, over pinned_tokens={budget.pinned_cap}"
                )
        elif message.role is Role.USER and budget.oversize is OversizePolicy.RAISE:
            room = (
                budget.available_prompt_tokens
                - max(counter.overhead_tokens(True), counter.overhead_tokens(False))
                - sum(counter.message_tokens(m) for m in self.pinned)
            )
            if counter.message_tokens(message) > room:
                raise BudgetError(
                    f"message of {counter.message_tokens(message)} tokens exceeds the "
                    f"{room} tokens the budget leaves for it (oversize policy RAISE)"
                )

    def check_all(self, messages: Sequence[Message], *, budget: Budget, counter: TokenCounter) -> None:
        """:meth:`check` each of ``messages`` against the history as it will stand before it."""
        pending = set(self.pending_tool_ids)
        for m in messages:
            self.check(m, budget=budget, counter=counter, pending_tool_ids=pending)
            pending = open_calls_after(m, pending)
