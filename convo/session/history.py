"""A session's history in memory: its stored messages indexed by turn, and the checks a
message passes before it is stored.

The store is the source of truth (:mod:`convo.stores`); :class:`History` is what a
:class:`~convo.session.Session` read from it, cut into turns (a turn starts at each user
message; messages before the first form turn 0), with the tool calls still open and the
date of each turn.

A history may hold only its **window**: the pinned messages and the turns from one turn on
(:meth:`History.load_window`; what a session resumed in a new process reads, see
:data:`RESUME_SETTING`). Turns keep their numbers; the earlier turns are read from the
store the first time something asks for them (:meth:`History.fill`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from datetime import date, datetime
from typing import Any, cast

from convo.budget import Budget, OversizePolicy
from convo.errors import BudgetError, ConfigError, MessageError, StoreError
from convo.messages import Message, MessageLike, Role, check_text
from convo.plan import Turn
from convo.stores import SessionState, Store
from convo.stores.base import FORK_SETTING
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


#: The ``settings`` key of a session's state where its session writes where its window
#: starts in the store: ``{"epoch", "turn", "at", "pinned"}``, the first turn a resumed
#: session needs (the window's first, or the first the summary does not cover yet when
#: it is behind), the stored position of its first message, and the pinned messages stored
#: before it (their positions and records; the pinned part is bounded by the budget's
#: ``pinned_cap``). A session resumed where nothing of it is known reads only those and the
#: messages from ``at`` on (:meth:`~convo.stores.Store.load_tail`), not the whole history.
RESUME_SETTING = "resume"


def resume_mark(history: History, state: SessionState, turn: int) -> dict[str, Any] | None:
    """The :data:`RESUME_SETTING` value for ``history`` under ``state`` where ``turn`` is
    the first turn a prompt may show (the window's first, or the first the summary does not
    cover), or ``None`` when a resume would gain nothing (turn 0) or the mark cannot be made
    (the turn is not read; a fork, whose positions are its parent's)."""
    local = turn - history.base_turns
    if turn <= 0 or local < 0 or local >= len(history.turn_positions) or FORK_SETTING in state.settings:
        return None
    at = history.turn_positions[local]
    pinned = [
        [p, m.to_record()] for p, m in zip(history.pinned_positions, history.pinned, strict=True) if p < at
    ]
    return {"epoch": state.epoch, "turn": turn, "at": at, "pinned": pinned}


def valid_mark(mark: object, state: SessionState, count: int) -> bool:
    """Whether ``mark`` (a :data:`RESUME_SETTING` value read with ``state`` and the stored
    ``count``) can be resumed from: this epoch, a turn no later than the window's first
    (a summary that fell behind it reads the turns it still owes when it asks for them), a
    position inside the stored history, pinned positions before it."""
    if not isinstance(mark, Mapping) or mark.get("epoch") != state.epoch or FORK_SETTING in state.settings:
        return False
    turn, at, pinned = mark.get("turn"), mark.get("at"), mark.get("pinned")
    if not (isinstance(turn, int) and isinstance(at, int) and isinstance(pinned, list)):
        return False
    if not 0 < turn <= state.evicted_turns or not turn <= at < count:
        return False
    return all(
        isinstance(e, list)
        and len(e) == 2
        and isinstance(e[0], int)
        and 0 <= e[0] < at
        and isinstance(e[1], dict)
        for e in pinned
    )


def store_filler(store: Store, session_id: str) -> Callable[[int], Sequence[Message]]:
    """What :meth:`History.fill` reads with: the first ``n`` stored messages of
    ``session_id`` (the store held weakly, as :mod:`convo.session.known` holds it)."""
    ref = weakref.ref(store)

    def head(n: int) -> Sequence[Message]:
        live = ref()
        if live is None:
            raise StoreError(f"the store of session {session_id!r} is gone; its earlier turns cannot be read")
        return live.load(session_id)[1][:n]

    return head


def read_window(store: Store, session_id: str) -> tuple[SessionState, History] | None:
    """Read only the window of ``session_id`` (its :data:`RESUME_SETTING` mark: the
    pinned messages it names, then :meth:`~convo.stores.Store.load_tail` from its
    position): the state and that history, or ``None`` when the session has no usable mark
    (written before marks, a fork, the summary reset since...) and must be read whole.
    The caller holds the store's lock on the session."""
    state, count = store.peek(session_id)
    mark = state.settings.get(RESUME_SETTING)
    if not valid_mark(mark, state, count):
        return None
    assert isinstance(mark, Mapping)
    tail = store.load_tail(session_id, int(mark["at"]))
    first = tail.messages[0] if tail.messages else None
    if (
        tail.state.epoch != state.epoch
        or tail.state.settings.get(RESUME_SETTING) != mark
        or tail.count != tail.after + len(tail.messages)
        or first is None
        or first.pinned
        or first.role is not Role.USER
    ):
        return None  # written since, or not a turn's start: read it whole
    history = History()
    history.load_window(
        pinned=[(int(p), Message.from_record(r)) for p, r in mark["pinned"]],
        turn=int(mark["turn"]),
        at=int(mark["at"]),
        messages=tail.messages,
        filler=store_filler(store, session_id),
    )
    return tail.state, history


def starts_turn(previous: Message | None, message: Message) -> bool:
    """Whether ``message`` opens a new turn after ``previous`` (``None``: it is the first).

    A user message opens one; so does an assistant message right after another assistant
    message that called no tool: nothing answered in between, so it opens a new exchange
    (an earlier chat that opened with the assistant's greeting, imported or added after
    the previous chat's last reply) instead of being folded into the previous turn and
    taking that turn's date. So does a message marked :attr:`~convo.messages.Message.opens_turn`
    (an assistant message added with a new day's date). Only the stored messages decide,
    so a session read back from its store cuts its turns the same way.
    """
    if previous is None or message.role is Role.USER or message.opens_turn:
        return True
    return message.role is Role.ASSISTANT and previous.role is Role.ASSISTANT and not previous.tool_calls


class History:
    """One session's messages as read from its store, indexed by turn.

    Attributes:
        pinned: the pinned messages (system prompt, pinned facts), in order.
        pinned_positions: their positions in the store.
        log: the conversation's messages, in order (from turn ``base_turns`` on).
        turn_starts: where each turn starts in ``log``.
        turn_positions: where each turn starts in the store.
        base_turns: turns before the first turn in ``log`` (0 unless only the window was
            read, :meth:`load_window`).
        base_count: stored messages before that turn's first one.
        pending_tool_ids: the tool calls the last assistant message made that no tool
            result answered yet.
        dates: turn index -> the date it is indexed with for retrieval (see
            :func:`clock_date`); kept across :meth:`load`.
        filler: reads the first ``n`` stored messages (:meth:`fill`); set with
            :meth:`load_window`.
        last_message: the last message read (``None``: none), to check that a store still
            holds it before the messages stored after it are read.
    """

    def __init__(self) -> None:
        self.pinned: list[Message] = []
        self.pinned_positions: list[int] = []
        self.log: list[Message] = []
        self.turn_starts: list[int] = []
        self.turn_positions: list[int] = []
        self.base_turns = 0
        self.base_count = 0
        self.pending_tool_ids: set[str] = set()
        self.dates: dict[int, str] = {}
        self.filler: Callable[[int], Sequence[Message]] | None = None
        self._count = 0
        self._since_base: list[Message] = []  # every message read from base_count on (partial only)
        self.last_message: Message | None = None

    def load(self, messages: Sequence[Message]) -> None:
        """Replace the messages by ``messages`` (the store's); known dates are kept."""
        self.pinned, self.pinned_positions, self.log, self.turn_starts, self.turn_positions = (
            [],
            [],
            [],
            [],
            [],
        )
        self.base_turns = self.base_count = self._count = 0
        self._since_base = []
        self.last_message = None
        self.pending_tool_ids = set()
        for m in messages:
            self.index(m)

    def load_window(
        self,
        *,
        pinned: Sequence[tuple[int, Message]],
        turn: int,
        at: int,
        messages: Sequence[Message],
        filler: Callable[[int], Sequence[Message]],
    ) -> None:
        """Replace the messages by a window: the ``pinned`` messages stored before ``at``
        (with their positions), then ``messages``, the stored ones from position ``at`` on,
        whose first starts turn ``turn``. ``filler`` reads the rest when asked (:meth:`fill`)."""
        self.load(())
        for position, m in pinned:
            self.pinned.append(m)
            self.pinned_positions.append(position)
        self.base_turns, self.base_count, self._count = turn, at, at
        self.filler = filler
        for m in messages:
            self.index(m)

    @property
    def partial(self) -> bool:
        """Whether only the window was read (turns before ``base_turns`` are not held)."""
        return self.base_count > 0

    def fill(self) -> None:
        """Read the turns before the window from the store (once): the history becomes
        whole. Raises :class:`~convo.errors.StoreError` when they cannot be read."""
        if not self.partial:
            return
        if self.filler is None:
            raise StoreError("this history holds only its window and has no store to read the rest from")
        head = list(self.filler(self.base_count))
        if len(head) != self.base_count:
            raise StoreError(f"the store holds {len(head)} of the {self.base_count} earlier messages")
        self.load([*head, *self._since_base])

    def index(self, message: Message) -> None:
        """Add a stored message."""
        position = self._count
        self._count += 1
        self.last_message = message
        if self.partial:
            self._since_base.append(message)
        if message.pinned:
            self.pinned.append(message)
            self.pinned_positions.append(position)
            return
        previous = self.log[-1] if self.log else None
        if (not self.turn_starts and not self.base_turns) or (
            (previous is not None or message.role is Role.USER) and starts_turn(previous, message)
        ):
            self.turn_starts.append(len(self.log))
            self.turn_positions.append(position)
        self.log.append(message)
        self.pending_tool_ids = open_calls_after(message, self.pending_tool_ids)

    def copy(self) -> History:
        """An independent copy (the messages themselves are immutable and shared)."""
        out = History()
        out.pinned, out.pinned_positions = list(self.pinned), list(self.pinned_positions)
        out.log, out.turn_starts, out.turn_positions = (
            list(self.log),
            list(self.turn_starts),
            list(self.turn_positions),
        )
        out.base_turns, out.base_count, out._count = self.base_turns, self.base_count, self._count
        out._since_base, out.filler, out.last_message = list(self._since_base), self.filler, self.last_message
        out.pending_tool_ids, out.dates = set(self.pending_tool_ids), dict(self.dates)
        return out

    @property
    def message_count(self) -> int:
        """Stored messages this history accounts for (read or, before the window, skipped)."""
        return self._count

    @property
    def turn_count(self) -> int:
        return self.base_turns + len(self.turn_starts)

    def all_messages(self) -> list[Message]:
        """Every message, pinned first, then the conversation (reads the turns before the
        window first, :meth:`fill`)."""
        self.fill()
        return self.pinned + self.log

    def turns(self, start: int = 0) -> list[Turn]:
        """Turns ``start..`` as :class:`~convo.plan.Turn` (index, messages); turns before
        the window are read from the store first (:meth:`fill`)."""
        if start < self.base_turns:
            self.fill()
        out = []
        base = self.base_turns
        for i in range(max(start, base) - base, len(self.turn_starts)):
            end = self.turn_starts[i + 1] if i + 1 < len(self.turn_starts) else len(self.log)
            out.append(Turn(index=base + i, messages=tuple(self.log[self.turn_starts[i] : end])))
        return out

    def messages_of(self, start: int, end: int) -> list[Message]:
        """The messages of turns ``start..end-1``."""
        return [m for t in self.turns(start)[: end - start] for m in t.messages]

    def date_stored_turns(self) -> None:
        """Date the turns read from the store (or imported) by when their first message
        was created (``Message.created_at``, local time); a date already known is kept."""
        for turn, start in enumerate(self.turn_starts, self.base_turns):
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
