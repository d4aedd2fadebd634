"""The :class:`Session`: one conversation that never exceeds its token budget.

Each turn plans the prompt (:func:`convo.plan.plan_prompt`: pinned system part, rolling
summary, earlier recent turns, retrieved passages after the question being answered, reply
reserve), checks the plan against an exact count of the rendered prompt, calls the engine
with a capped ``generate``, stores the reply, and returns. The parts live beside this file:
the history in memory (:mod:`.history`), how the window slides (:mod:`.window`), the
rolling summary's coordination (:mod:`.summaries`), the turn as a sans-I/O core and its two
drivers (:mod:`.turn`), and what a turn returns (:mod:`.reply`).

Nothing stored is ever lost: the full history stays in the store even when the prompt only
shows the window and the summary; the user message is stored before generation starts, so
a crash or timeout mid-turn keeps it; a turn that fails can be re-run with
:meth:`Session.reply`.

Nothing is stored for a refused request: text, ids, the budget (against the engine's
context window) and the system prompt are checked before a new session is created, and a
message is checked before it is appended. Each turn holds the store's lock on the session
(:meth:`convo.stores.Store.lock`: a file lock for SQLite, a lease for Redis), so two
processes driving one session (two ``convo chat --session X``) take turns instead of
interleaving them; a session that finds the lock free catches up with what the other
stored before it adds anything.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Generator, Mapping, Sequence
from dataclasses import replace
from typing import Any, Unpack, cast

from convo.budget import Budget
from convo.dates import as_day
from convo.engines.base import (
    AsyncTextStream,
    Engine,
    GenerateOptions,
    Generation,
    TextStream,
)
from convo.errors import BudgetError, ConfigError, DeviceOutOfMemory, MessageError, SessionBusy
from convo.messages import Message, MessageLike, Role, check_text
from convo.plan import Passage, PreparesTurns, PromptPlan, Retriever, Turn, check_retriever, plan_checked
from convo.session import known, window
from convo.session.ahead import prepare_later
from convo.session.config import (
    LegacyKwargs,
    ReplyConfig,
    SummaryConfig,
    check_budget_fits,
    from_legacy_kwargs,
    summary_cap,
)
from convo.session.history import (
    RESUME_SETTING,
    Clock,
    History,
    check_session_id,
    clock_date,
    incoming_messages,
    read_window,
    resume_mark,
    starts_turn,
)
from convo.session.locking import TurnLock
from convo.session.reply import Reply, TurnStats
from convo.session.summaries import (
    SessionSummary,
    summary_wait_limit,
)
from convo.session.turn import Step, SummaryWait, TurnArgs, TurnOptions, adrive, check_turn_tools, drive
from convo.stores import InMemoryStore, SessionState, Store
from convo.summarize import ModelSummarizer, Summarizer, SummaryJob, SummaryState, SummaryWorker
from convo.tokens import TokenCounter, Tool

logger = logging.getLogger(__package__)


class Session:
    """One conversation kept inside a token budget.

    Args:
        engine: generates replies (e.g. :class:`~convo.engine.TransformersEngine`). May be
            ``None`` for a session that only plans prompts (then pass ``counter``).
        budget: the token budget (default ``Budget()``).
        system_prompt: a pinned system message, set when the session is created.
        store: where history lives (default: a new :class:`~convo.stores.InMemoryStore`).
        session_id: resume this session if the store has it, else create it with this id.
        retriever: a retrieval memory (e.g. :class:`convo.RetrievalMemory`), or ``None``.
        counter: token counter; default: the engine's.
        owner: recorded with a new session (the server stores the API key's hash).
        summarizing: how the rolling summary is written and waited for: the summarizer,
            the background worker, the wait (:class:`~convo.session.SummaryConfig`;
            default ``SummaryConfig()``: the engine summarizes, on the shared worker, and a
            turn waits ``"auto"``).
        replies: the defaults of every reply's generate call, sampling and timeout
            (:class:`~convo.session.ReplyConfig`; default greedy, the engine's timeout).
        lock_timeout_s: seconds a turn waits for another holder of the session's store
            lock (another thread or process) before :class:`~convo.errors.SessionBusy`.
            Default 60.
        clock: dates new turns. Called when a turn starts without an explicit date
            (:meth:`add`'s ``date``); a ``datetime`` is kept to the minute
            (``"2026-12-01T09:30"``), a ``date`` as ``"2026-12-01"``, a string as it is.
            The retriever indexes turns with their dates (memory shows one label per day,
            and a question that names days favours theirs), and a question is asked on
            its turn's date, so "yesterday" or "last week" count from it. Turns read from
            the store (a resumed session) or imported by :meth:`extend` are dated by
            their first message's ``created_at``. E.g. ``clock=datetime.now``. Default
            ``None``: turns are dated only by ``add(..., date=...)``.

    The keywords ``summarizer``, ``summaries``, ``summary_wait_s`` (now in
    ``summarizing``) and ``sampling``, ``timeout_s`` (now in ``replies``) still work for one
    release, with a ``DeprecationWarning``.

    Raises:
        ConfigError: a bad ``session_id``, or a budget the engine's context window cannot
            hold. MessageError / BudgetError: a bad or too long ``system_prompt``. In every
            case nothing is stored.

    Example:
        >>> session = Session(engine, budget=Budget(context_tokens=2048))  # doctest: +SKIP
        >>> reply = session.send("My name is Priya.")                     # doctest: +SKIP
        >>> reply.stats.prompt_tokens + reply.stats.max_new_tokens <= 2048  # doctest: +SKIP
        True
    """

    def __init__(
        self,
        engine: Engine | None = None,
        *,
        budget: Budget | None = None,
        system_prompt: str | None = None,
        store: Store | None = None,
        session_id: str | None = None,
        retriever: Retriever | None = None,
        counter: TokenCounter | None = None,
        owner: str = "",
        summarizing: SummaryConfig | None = None,
        replies: ReplyConfig | None = None,
        lock_timeout_s: float = 60.0,
        clock: Clock | None = None,
        **deprecated: Unpack[LegacyKwargs],
    ) -> None:
        if engine is None and counter is None:
            raise ConfigError("a Session needs an engine or, to only plan prompts, a counter")
        summarizing, replies = from_legacy_kwargs(deprecated, summarizing=summarizing, replies=replies)
        if session_id is not None:
            check_session_id(session_id)
        if budget is not None and not isinstance(budget, Budget):
            raise ConfigError(f"budget must be a Budget, got {type(budget).__name__}")
        if system_prompt is not None:
            check_text(system_prompt, "system_prompt")
        if not lock_timeout_s > 0:
            raise ConfigError(f"lock_timeout_s must be > 0, got {lock_timeout_s!r}")
        if clock is not None and not callable(clock):
            raise ConfigError(f"clock must be a callable returning a date, got {type(clock).__name__}")
        self.summarizing = summarizing
        self.replies = replies
        self.summary_wait_s = summarizing.wait_s
        self.sampling = replies.sampling
        self.timeout_s = replies.timeout_s
        self.clock = clock
        self.lock_timeout_s = lock_timeout_s
        self.engine = engine
        self.counter: TokenCounter = counter or engine.counter  # type: ignore[union-attr]
        self.store: Store = store if store is not None else InMemoryStore()
        check_retriever(retriever)
        self.retriever = retriever
        self.id = session_id or uuid.uuid4().hex
        self._turn_lock = TurnLock(
            self.store,
            self.id,
            catch_up=self._sync,
            after_turn=self._prefill_if_due,
            after_turn_due=lambda: self._prefill_due,
        )
        # A summary written while a turn of this object held it: the turn prefills the
        # next prompt's prefix on its way out (:meth:`prefill_next`).
        self._prefill_due = False
        self._history = History()
        self._indexed_turns = 0  # turns handed to the retriever
        worker = summarizing.worker or SummaryWorker.shared()
        # The summarizer is set once the budget is known (_check_budget).
        self._summary = SessionSummary(
            worker=worker,
            store=self.store,
            session_id=self.id,
            counter=self.counter,
            on_written=self._summary_written,
        )
        with self.store.lock(self.id, self.lock_timeout_s):  # two creators: one creates, one resumes
            if self.store.exists(self.id):
                self._resume(budget)
            else:
                self._create(budget, system_prompt, owner)

    def _resume(self, budget: Budget | None) -> None:
        state = self._read_stored(None)
        stored = state.settings.get("budget")
        self.budget = budget or (Budget.from_dict(dict(stored)) if stored else Budget())
        self._check_budget()
        self._state = state
        self._summary.epoch = state.epoch
        self._date_stored_turns()
        if budget is not None and stored != budget.to_dict():
            self._state = replace(state, settings={**state.settings, "budget": budget.to_dict()})
            self._write()

    def _create(self, budget: Budget | None, system_prompt: str | None, owner: str) -> None:
        self.budget = budget or Budget()
        self._check_budget()
        self._state = SessionState(
            session_id=self.id, settings={"budget": self.budget.to_dict()}, owner=owner
        )
        first: list[Message] = []
        if system_prompt:
            first.append(Message(role=Role.SYSTEM, content=system_prompt))
            self._history.check(first[0], budget=self.budget, counter=self.counter)
        self.store.create(self._state, first)  # the session and its system prompt at once
        # The store mints the session's epoch (its identity, see SessionState.epoch).
        self._state = self.store.peek(self.id)[0]
        self._summary.epoch = self._state.epoch
        known.remember(self.store, self.id, self._state.epoch, self._history)
        for m in first:
            self._history.index(m)

    def _check_budget(self) -> None:
        """Refuse a budget the engine cannot hold, and set the summarizer and the summary's
        cap for it (:func:`~convo.session.config.summary_cap`), before anything is stored."""
        check_budget_fits(self.budget, self.engine)
        summarizer = self.summarizing.summarizer
        if summarizer is not None and not isinstance(summarizer, Summarizer):
            raise ConfigError(
                f"{type(summarizer).__name__} is not a convo.summarize.Summarizer: subclass it, or "
                "declare supports_cancel, supports_owner and summarize()"
            )
        if summarizer is None and self.engine is not None and self.budget.summary_tokens > 0:
            summarizer = ModelSummarizer(engine=self.engine)
        self._summary.max_tokens = summary_cap(summarizer, self.budget.summary_tokens)
        self._summary.summarizer = summarizer

    @property
    def summary_cap(self) -> int:
        """The cap of this session's summary, in tokens: ``budget.summary_tokens``, lowered
        to what one summary call holds in the model's context (see
        :class:`~convo.summarize.ModelSummarizer`); 0: no summary."""
        return self._summary.max_tokens if self._summary.active else 0

    @property
    def summarizer(self) -> Summarizer | None:
        """Folds evicted turns into the summary (``None``: turns that leave go)."""
        return self._summary.summarizer

    @property
    def summaries(self) -> SummaryWorker:
        """The background worker that runs this session's summaries."""
        return self._summary.worker

    def _read_stored(self, mine: tuple[str, History] | None) -> SessionState:
        """Read the stored history into ``self._history`` and return the state: only the
        messages stored since what this process knows of this epoch of the session
        (:mod:`convo.session.known`: its own history, or another session object's), else
        all of them. ``mine``: this object's epoch and history, when it has read them."""
        for epoch, history in filter(None, (mine, known.known(self.store, self.id))):
            # From the last known message on: it must still be there (a fork's truncate
            # keeps the epoch; cut back and grown again elsewhere, the history is another).
            seen = history.message_count
            tail = self.store.load_tail(self.id, max(seen - 1, 0))
            if tail.state.epoch != epoch or tail.count != tail.after + len(tail.messages):
                continue  # another session under this id since
            new = tail.messages[1:] if seen else tail.messages
            if seen and tail.messages[:1] != [history.last_message]:
                continue  # cut back below what is known, and grown again
            if history is not self._history:
                history.dates.clear()  # another object's: a resumed session dates its turns anew
            for m in new:
                history.index(m)
            self._history = history
            known.remember(self.store, self.id, epoch, history)
            return tail.state
        window_read = read_window(self.store, self.id) if mine is None and self.retriever is None else None
        if window_read is not None:  # a first resume here: the window and the pinned part only
            state, self._history = window_read
            known.remember(self.store, self.id, state.epoch, self._history)
            return state
        state, messages = self.store.load(self.id)
        if mine is not None and state.epoch != mine[0]:
            self._history = History()  # (dates of another session's turns do not carry over)
        self._history.load(messages)
        known.remember(self.store, self.id, state.epoch, self._history)
        return state

    def _sync(self) -> None:
        """Catch up with what another process (or session object) wrote to the session
        since: a cheap :meth:`~convo.stores.Store.peek` first (nothing more is read when
        nothing changed), then only the messages stored since (:meth:`_read_stored`)."""
        state, count = self.store.peek(self.id)
        if count == self._history.message_count and replace(state, created_at=0.0, updated_at=0.0) == replace(
            self._state, created_at=0.0, updated_at=0.0
        ):
            return
        previous = self._state.epoch
        state = self._read_stored((previous, self._history))
        if state.epoch != previous:
            # Another session under this id (deleted and created again, or rewritten by a
            # fork): nothing this object knew of the old one carries over.
            logger.info("session %s was replaced in the store; starting from what it holds now", self.id)
            self._indexed_turns = 0
            self._summary = self._summary.renewed(state.epoch)
        self._state = state
        self._date_stored_turns()
        self._indexed_turns = min(self._indexed_turns, max(0, self.turn_count - 1))

    def _date_stored_turns(self) -> None:
        """With a clock, date the turns read from the store (a resumed session, turns
        another process added) or imported (:meth:`extend`) by when their first message
        was created (``Message.created_at``, local time); a date already known is kept."""
        if self.clock is not None:
            self._history.date_stored_turns()

    # -- state -------------------------------------------------------------------------------
    def _synced_state(self) -> SessionState:
        """The state, with a background summary that finished picked up."""
        self._state = self._summary.picked_up(self._state)
        return self._state

    @property
    def summary(self) -> str:
        """The rolling summary of turns that left the window (as far as it is written)."""
        return self._synced_state().summary

    @property
    def summary_state(self) -> SummaryState:
        """Where the rolling summary stands: done, pending, running or failed, and which
        turns it covers (see :class:`~convo.summarize.SummaryState`)."""
        return self._summary.status(self._synced_state())

    def wait_summary(self, timeout_s: float | None = None) -> SummaryState:
        """Bring the summary up to date and return its state: start jobs for the turns it
        owes (also after a failure, once per call) and wait for them, up to ``timeout_s``
        in all (``None``: without limit). Turns never call this (they wait only as
        ``summary_wait_s`` says); it is for callers that want the summary now (tests,
        exports, shutdown)."""
        with self._turn_lock.local_turn():
            self._summary.catch_up(timeout_s, sync=self._synced_state, history=self._history)
        return self.summary_state

    # -- the next prompt's prefix, ahead of the turn ---------------------------------------------
    def next_prompt_prefix(self) -> list[Message]:
        """The messages the next turn's prompt starts with, as it would be planned now: the
        pinned system part, the summary and the kept window (everything before the
        retrieved passages and the next user message). Planned for an empty next message:
        the window is sized at the end of each turn so that a next turn of the recent
        turns' size fits beside it (see :mod:`convo.session.window`)."""
        plan, _ = self._plan_now("")
        return list(plan.messages[:-1])  # (without retrieval: the probe asks nothing)

    def prefill_next(self) -> bool:
        """Have the engine compute the KV of :meth:`next_prompt_prefix` in the background
        (:meth:`Engine.prefill <convo.engines.base.Engine.prefill>`, under this session's
        ``cache_key``), so that the next turn prefills only its new message. Done only
        when the engine declares ``supports_prefill`` and the session is idle (no turn of
        it runs in this process or holds the store's lock: a running turn computes its own
        prompt). Returns whether the engine was asked.

        A session calls it when a background summary of it is written: the summary and the
        window changed together, so the next turn would otherwise re-prefill its whole
        prompt (the turn after a slide then costs what an ordinary turn costs)."""
        engine = self.engine
        if engine is None or not engine.supports_prefill:
            return False
        # Due first, then the lock: a turn of this object that holds it reads the flag
        # after it lets go, so a summary written during the turn is never dropped.
        self._prefill_due = True
        if not self._turn_lock.local.acquire(blocking=False):
            return False  # a turn of this object runs; it prefills on its way out
        try:
            self._prefill_due = False
            with self._turn_lock.hold(0):  # (0: another holder of the store's lock -> busy)
                self._synced_state()
                prefix = self.next_prompt_prefix()
                engine.prefill(prefix, cache_key=self.id)
            logger.debug(
                "session %s: prefilling its next prompt's prefix (%d messages)", self.id, len(prefix)
            )
            return True
        except SessionBusy:
            return False  # a turn runs elsewhere
        finally:
            self._turn_lock.local.release()

    def _prefill_if_due(self) -> None:
        """After a turn let go (``TurnLock.after_turn``, called while ``_prefill_due``): the
        prefill that a summary written during the turn asked for."""
        try:
            self.prefill_next()
        except Exception:  # (the turn is done; a failed prefill only costs the next one)
            logger.exception("session %s: prefilling the next prompt's prefix failed", self.id)

    def _summary_written(self, job: SummaryJob) -> None:
        """A background summary of this session was stored (worker thread): prefill the
        next prompt's prefix, unless the session was closed (or replaced) meanwhile."""
        if self._summary.job() is job:
            self.prefill_next()

    @property
    def summary_wait_limit(self) -> float | None:
        """Seconds a turn waits for a late summary (``summary_wait_s``, ``"auto"`` resolved
        for this session's engine); ``None``: no limit."""
        return summary_wait_limit(self.summary_wait_s, self.engine)

    @property
    def evicted_turns(self) -> int:
        """How many turns have left the prompt window (they are summarized / retrievable)."""
        return self._state.evicted_turns

    @property
    def summarized_turns(self) -> int:
        """How many turns are folded into the summary (as far as it is written)."""
        return self._synced_state().summarized_turns

    @property
    def turn_count(self) -> int:
        """Turns so far (a turn starts at each user message)."""
        return self._history.turn_count

    @property
    def message_count(self) -> int:
        """How many stored messages (pinned included) this session holds, read or not: a
        session resumed from its window counts the earlier ones without reading them."""
        return self._history.message_count

    @property
    def messages(self) -> list[Message]:
        """The full stored history: pinned messages first, then the conversation (a
        session resumed from its window reads the earlier turns from the store first)."""
        return self._history.all_messages()

    @property
    def turn_dates(self) -> Mapping[int, str]:
        """The date of each dated turn (turn index -> date, see ``clock`` and :meth:`add`),
        as the retriever indexes it."""
        return dict(self._history.dates)

    @property
    def owner(self) -> str:
        return self._state.owner

    def turns(self, start: int = 0) -> list[Turn]:
        """Turns ``start..`` as :class:`~convo.plan.Turn` (index, messages)."""
        return self._history.turns(start)

    # -- adding messages ---------------------------------------------------------------------
    def _commit(
        self, messages: Sequence[Message], *, dated: str | None = None, imported: bool = False
    ) -> None:
        """Check, store and index ``messages``; date the turns they start: ``dated``, or
        with a clock its reading (``imported``: each turn's first message's
        ``created_at``, for earlier turns a client hands over)."""
        self._history.check_all(messages, budget=self.budget, counter=self.counter)
        self._write(messages)
        started = self.turn_count
        for m in messages:
            self._history.index(m)
        if imported and dated is None:
            self._date_stored_turns()
            return
        stamp = dated if dated is not None else clock_date(self.clock)
        if stamp is not None:
            self._history.date_turns_from(started, stamp)

    def _write(self, messages: Sequence[Message] = ()) -> None:
        """Store the state (and append ``messages``) after picking up a background summary
        that finished, so a state write never rolls a newer summary back."""
        with self._summary.key_lock():
            self._state = self._summary.picked_up(self._state, locked=True)
            self._mark_window()
            if messages:
                self.store.append(self.id, messages, state=self._state)
            else:
                self.store.save_state(self._state)

    def _mark_window(self) -> None:
        """Record where the window starts in the state (:data:`RESUME_SETTING`), so that a
        resume where nothing of the session is known reads only from there."""
        mark = resume_mark(self._history, self._state, self._summary.first_candidate_turn(self._state))
        if mark != self._state.settings.get(RESUME_SETTING):
            settings = {k: v for k, v in self._state.settings.items() if k != RESUME_SETTING}
            if mark is not None:
                settings[RESUME_SETTING] = mark
            self._state = replace(self._state, settings=settings)

    def add(self, message: MessageLike, *, date: str | None = None) -> None:
        """Append a message without generating (tool results, imported history...).

        Args:
            message: a :class:`~convo.messages.Message` or an OpenAI message dict
                (assistant ``tool_calls``, ``tool`` results...); tool results must answer
                a pending tool call.
            date: a human date for the turn this message starts or belongs to (indexed
                with it for retrieval, e.g. ``"8 May 2023"``). An assistant message dated
                another day than the turn it would join opens a turn of its own (an
                earlier chat that opened with the assistant, imported after a chat that
                ended on a user message), so it is not indexed under the old day.

        Raises:
            MessageError / BudgetError: invalid message; nothing is stored.
        """
        message = Message.from_openai(message)
        with self._turn_lock.turn(self.lock_timeout_s):
            if date is not None and self._opens_a_new_day(message, date):
                message = replace(message, opens_turn=True)
            self._commit([message], dated=date)
            if date is not None and self.turn_count:
                self._history.dates.setdefault(self.turn_count - 1, date)
            if not message.pinned:
                self._advance_window()
                self._remember_completed_turns()
                self._maybe_summarize()

    def _opens_a_new_day(self, message: Message, date: str) -> bool:
        """Whether ``message``, dated ``date``, would join a turn of another day as its
        reply: an assistant message (no tool calls) right after that turn's unanswered
        user message. A reply after tool results, or a call, stays with its turn."""
        history = self._history
        if message.role is not Role.ASSISTANT or message.tool_calls or message.pinned or not history.log:
            return False
        if history.log[-1].role is not Role.USER or starts_turn(history.log[-1], message):
            return False
        day, turn_day = as_day(date), as_day(history.dates.get(self.turn_count - 1))
        return day is not None and turn_day is not None and day != turn_day

    def extend(self, messages: Sequence[MessageLike]) -> None:
        """Append several messages at once (imported history, a client's earlier turns):
        one store write, and no summary until the next reply, which folds whatever left
        the window in one pass. Pin system prompts with :meth:`pin`.

        Raises:
            MessageError / BudgetError: an invalid message; nothing is stored.
        """
        msgs = [Message.from_openai(m) for m in messages]
        if any(m.pinned for m in msgs):
            raise MessageError("extend() takes conversation messages; pin() system prompts")
        if not msgs:
            return
        with self._turn_lock.turn(self.lock_timeout_s):
            # Each checked against the history as it will stand before it; dated by when
            # they were written (``created_at``), not by the clock.
            self._commit(msgs, imported=True)
            self._advance_window()

    def pin(self, text: str, *, role: Role = Role.SYSTEM) -> None:
        """Pin a fact or instruction: it is shown in every prompt and never evicted.

        Raises:
            BudgetError: the pinned part would exceed ``budget.pinned_tokens``.
        """
        self.add(Message(role=role, content=text, pinned=True))

    # -- turns -------------------------------------------------------------------------------
    def send(
        self, content: str | MessageLike | Sequence[MessageLike], **options: Unpack[TurnOptions]
    ) -> Reply:
        """Send a user message (or tool results) and return the reply.

        Args:
            content: the user's text; or a message (a :class:`~convo.messages.Message` or
                an OpenAI dict); or a list of them, e.g. the results of every tool an
                assistant message called. The last one must be a user or tool message.
            **options: :class:`TurnOptions` (``sampling``, ``timeout_s``, ``on_text``,
                ``cancel``, ``stop``, ``tools``, ``tool_choice``, ``parallel_tool_calls``,
                ``on_tool_call_delta``).

        The messages are stored (all or none) before generation starts. With ``tools``,
        the reply may ask for calls (``reply.tool_calls``, ``finish_reason``
        ``tool_calls``); they are stored on the assistant message, and the results go in
        the next turn: ``send([tool(result, tool_call_id=call.id), ...], tools=...)``.

        Raises:
            MessageError: a malformed message, a tool result answering no pending call,
                or a last message that is neither user nor tool.
            BudgetError: the message is too large and the oversize policy is RAISE, or
                the tool schemas with the pinned part exceed ``budget.pinned_cap``
                (nothing is stored).
            ToolsNotSupported: ``tools`` on an engine that does not declare
                ``supports_tools`` (nothing is stored).
            DeviceOutOfMemory: out of memory even after one retry with a smaller plan
                (the message stays stored; call :meth:`reply` to try again).
        """
        args = TurnArgs(**options)
        with self._turn_lock.turn(self.lock_timeout_s):
            self._check_tools(args)
            started = self._accept(content)
            return drive(self._turn(started, args.tools), lambda step: self._do_step(step, args))

    def stream(self, content: str | MessageLike | Sequence[MessageLike], **kwargs: Any) -> TextStream[Reply]:
        """Like :meth:`send`, but an iterator of text chunks; ``.result`` is the Reply.

        Closing the stream early cancels generation; what was generated is stored.
        """
        return TextStream(lambda **kw: self.send(content, **kw), kwargs)

    async def asend(
        self, content: str | MessageLike | Sequence[MessageLike], **options: Unpack[TurnOptions]
    ) -> Reply:
        """:meth:`send` on the event loop.

        The same turn as :meth:`send` (one planning core, :meth:`_turn`); generation
        is awaited through the engine's ``agenerate`` when it has one (``OpenAIEngine``:
        an ``httpx.AsyncClient``, no thread), else the engine's ``generate`` runs in a worker
        thread (a local model computes on its own device anyway). Turns of one session run
        one at a time, across tasks, threads and processes: the turn holds the store's lock
        on the session as :meth:`send` does, waited for without blocking the event loop
        (:class:`~convo.errors.SessionBusy` after ``lock_timeout_s``).
        """
        args = TurnArgs(**options)
        async with self._turn_lock.aturn(self.lock_timeout_s):
            self._check_tools(args)
            started = self._accept(content)
            return await adrive(self._turn(started, args.tools), lambda step: self._ado_step(step, args))

    def astream(
        self, content: str | MessageLike | Sequence[MessageLike], **kwargs: Any
    ) -> AsyncTextStream[Reply]:
        """Like :meth:`asend`, but an async iterator of text chunks; ``.result`` is the Reply.

        ``async with session.astream("hi") as stream: async for piece in stream: ...``.
        Leaving the block early cancels generation; what was generated is stored.
        """
        return AsyncTextStream(lambda **kw: self.asend(content, **kw), kwargs)

    def reply(self, **options: Unpack[TurnOptions]) -> Reply:
        """Generate the assistant's next message for the history as it stands.

        Use it after :meth:`add` (e.g. tool results) or to re-run a failed turn.
        ``options``: :class:`TurnOptions`, as for :meth:`send`.
        """
        args = TurnArgs(**options)
        with self._turn_lock.turn(self.lock_timeout_s):
            self._check_tools(args)
            return drive(self._turn(time.monotonic(), args.tools), lambda step: self._do_step(step, args))

    def _check_tools(self, args: TurnArgs) -> None:
        """Refuse a turn's tools before anything is stored (:func:`check_turn_tools`)."""
        check_turn_tools(
            args,
            engine=self.engine,
            counter=self.counter,
            budget=self.budget,
            pinned_tokens=sum(self.counter.message_tokens(m) for m in self._history.pinned),
        )

    def _accept(self, content: str | MessageLike | Sequence[MessageLike]) -> float:
        """Store the incoming messages of a turn (all or none); when the turn started."""
        started = time.monotonic()
        self._commit(incoming_messages(content))
        self._advance_window()
        return started

    def _do_step(self, step: Step, args: TurnArgs) -> bool | Generation:
        """One step of :meth:`_turn`, blocking: wait for the summary, or generate."""
        if isinstance(step, SummaryWait):
            return step.job.wait(step.left)
        return self._generate(step, args)

    async def _ado_step(self, step: Step, args: TurnArgs) -> bool | Generation:
        """:meth:`_do_step` on the event loop (the summary is waited for in a worker thread)."""
        if isinstance(step, SummaryWait):
            return await asyncio.to_thread(step.job.wait, step.left)
        return await self._agenerate(step, args)

    def _turn(self, started: float, tools: Sequence[Tool] | None = None) -> Generator[Step, Any, Reply]:
        """One turn, without I/O: the summary waits (:meth:`SessionSummary.waits`), then
        the generations (:meth:`_reply_flow`). :func:`~convo.session.turn.drive` and
        :func:`~convo.session.turn.adrive` run it."""
        waited = yield from self._summary.waits(
            self.summary_wait_limit,
            sync=self._synced_state,
            history=self._history,
            plan_start=lambda: self._plan_now(tools=tools)[1],
        )
        return (yield from self._reply_flow(started, waited, tools))

    def _reply_flow(
        self, started: float, waited: float = 0.0, tools: Sequence[Tool] | None = None
    ) -> Generator[PromptPlan, Generation, Reply]:
        """One turn, without I/O of the model: it yields each prompt to generate and is sent
        the :class:`Generation` (or thrown the engine's error). :meth:`_reply` drives it
        with blocking calls, :meth:`_areply` with awaited ones; ``waited`` is the seconds
        the turn waited for the summary (:meth:`_summary_waits`) first; ``tools`` are the
        turn's tool schemas, planned as a pinned part."""
        if self.engine is None:
            raise ConfigError("this session has no engine; it can only plan prompts")
        self._remember_completed_turns(ahead=True)
        self._prefill_due = False  # (this turn's prompt shows every summary stored so far)
        self._synced_state()
        plan, start = self._plan_now(tools=tools)
        planned = self._summary.planned(start, self._state, self._history)
        summarize_s = waited
        plan_s = time.monotonic() - started - waited
        oom_retries, recovery = 0, ""
        t_gen = time.monotonic()
        try:
            try:
                gen = yield plan
            except BudgetError:
                # The template cost more than the counter's sum: re-plan on exact counts.
                plan = self._plan(None, None, True, start=planned.start, tools=tools)
                gen = yield plan
        except DeviceOutOfMemory:
            # Half the turns that were shown, half the passages, no window slack.
            smaller = replace(
                self.budget,
                window_turns=max(1, len(plan.turns_shown) // 2),
                summarize_batch_turns=1,
                retrieval_top_k=self.budget.retrieval_top_k // 2,
            )
            plan = self.plan(budget=smaller, tools=tools)
            oom_retries = 1
            recovery = (
                f"out of memory: freed cached blocks, retried with window_turns="
                f"{smaller.window_turns}, retrieval_top_k={smaller.retrieval_top_k} "
                f"({plan.prompt_tokens} prompt tokens)"
            )
            logger.warning("session %s: %s", self.id, recovery)
            gen = yield plan
        generate_s = time.monotonic() - t_gen
        real = gen.stats.prompt_tokens  # counted on the token ids the model got
        if real != plan.prompt_tokens:
            parts = dict(plan.parts)
            parts["template"] += real - plan.prompt_tokens
            plan = replace(plan, prompt_tokens=real, parts=parts)
        answer = Message(role=Role.ASSISTANT, content=gen.text, tool_calls=gen.tool_calls)
        self._commit([answer])
        evicted_before = self.evicted_turns
        budget_cut = plan.first_shown_turn > self.evicted_turns
        self._state = replace(self._state, evicted_turns=max(self.evicted_turns, plan.first_shown_turn))
        # Slide the window for the next turn now, so that the summary changes on the same
        # turn as the window: one re-prefill per batch instead of two.
        self._advance_window(lookahead=1)
        # A plan that still shows unsummarized turns is larger than the window's: it must
        # not push turns out early (the window moves when the summary is in).
        late = planned.start < evicted_before
        if budget_cut or (not late and self._next_turn_overflows(plan)):
            self._make_room_for_batch(plan)
        self._write()  # the turn is stored before its summary starts
        moved = self.evicted_turns != evicted_before
        self._maybe_summarize(window_moved=moved, prompt=[*plan.messages, answer])
        self._index_ahead()
        stats = TurnStats(
            turn=self.turn_count,
            parts=dict(plan.parts),
            prompt_tokens=plan.prompt_tokens,
            context_tokens=self.budget.context_tokens,
            max_new_tokens=self.budget.max_new_tokens,
            summary_tokens=self.counter.count_text(planned.summary) if planned.summary else 0,
            evicted_turns=self.evicted_turns,
            summarized_turns=self.summarized_turns,
            passages_used=len(plan.passages_used),
            passages_dropped=len(plan.passages_dropped),
            truncated_messages=plan.truncated_messages,
            plan_s=plan_s,
            generate_s=generate_s,
            summarize_s=summarize_s,
            latency_s=time.monotonic() - started,
            oom_retries=oom_retries,
            recovery=recovery,
            generation=gen.stats,
            hidden_turns=planned.hidden_turns(plan),
            summary=self.summary_state,
            provisional_summary=planned.provisional,
        )
        return Reply(
            text=gen.text, finish_reason=gen.finish_reason, stats=stats, plan=plan, tool_calls=gen.tool_calls
        )

    def _generate(self, plan: PromptPlan, args: TurnArgs) -> Generation:
        assert self.engine is not None
        with self.summaries.replying():  # background summaries defer to replies
            return self.engine.generate(
                plan.messages, max_new_tokens=self.budget.max_new_tokens, **self._generate_options(plan, args)
            )

    async def _agenerate(self, plan: PromptPlan, args: TurnArgs) -> Generation:
        if not self.engine.supports_async:  # a synchronous engine: its own call, in a worker thread
            return await asyncio.to_thread(self._generate, plan, args)
        with self.summaries.replying():  # background summaries defer to replies
            result = await self.engine.agenerate(
                plan.messages, max_new_tokens=self.budget.max_new_tokens, **self._generate_options(plan, args)
            )
        return cast(Generation, result)

    def _generate_options(self, plan: PromptPlan, args: TurnArgs) -> GenerateOptions:
        """The engine's arguments for ``plan``, the session's defaults filled in (the tool
        fields only when the turn has them: an engine that predates tools need not take them)."""
        options = GenerateOptions(
            timeout_s=args.timeout_s or self.timeout_s,
            sampling=args.sampling or self.sampling,
            cache_key=self.id,
            on_text=args.on_text,
            cancel=args.cancel,
            stop=tuple(args.stop),
            # The engine checks the real token ids against the budget before the model runs.
            max_prompt_tokens=plan.context_tokens - self.budget.max_new_tokens,
        )
        if args.wants_tools:
            options["tools"] = args.tools
            options["tool_choice"] = args.tool_choice
            options["parallel_tool_calls"] = args.parallel_tool_calls
        if args.on_tool_call_delta is not None:
            options["on_tool_call_delta"] = args.on_tool_call_delta
        return options

    # -- planning ------------------------------------------------------------------------------
    def plan(
        self,
        query: str | None = None,
        *,
        budget: Budget | None = None,
        exact: bool = False,
        tools: Sequence[Tool] | None = None,
    ) -> PromptPlan:
        """The prompt this session would send now.

        Args:
            query: a hypothetical user message appended for planning only (not stored),
                e.g. a question to evaluate what the session would show for it.
            budget: plan under another budget (default: the session's).
            exact: re-count the rendered prompt even when the counter is additive.
            tools: the function tools the call would offer (a pinned part,
                ``parts["tools"]``).

        The plan is checked against an exact count of the rendered prompt; if the
        template costs more than the per-message counts add up to, it is re-planned with
        that difference held back, so ``prompt_tokens + max_new_tokens <= context_tokens``
        always holds.

        While the summary is behind, the prompt keeps the turns it does not cover yet when
        they all fit, and is the window with the previous summary otherwise (what a turn
        sends when it does not wait for the summary).
        """
        if budget is not None:
            return self._plan(query, budget, exact, start=self.evicted_turns, tools=tools)
        plan, _ = self._plan_now(query, exact, tools=tools)
        return plan

    def _plan_now(
        self, query: str | None = None, exact: bool = False, *, tools: Sequence[Tool] | None = None
    ) -> tuple[PromptPlan, int]:
        """The plan from the first turn the summary does not cover, if that hides no
        turn, else from the window's first turn; and that start."""
        start = self._summary.first_candidate_turn(self._state)
        if start < self.evicted_turns:
            plan = self._plan(query, None, exact, start=start, tools=tools)
            if plan.first_shown_turn <= start:
                return plan, start
        return self._plan(query, None, exact, start=self.evicted_turns, tools=tools), self.evicted_turns

    def _plan(
        self,
        query: str | None,
        budget: Budget | None,
        exact: bool,
        *,
        start: int,
        tools: Sequence[Tool] | None = None,
    ) -> PromptPlan:
        turns = self.turns(start)
        if query is not None:
            probe = Message(role=Role.USER, content=query)
            turns.append(Turn(index=self.turn_count, messages=(probe,)))
        # Every turn still inside the window is shown; while the summary is late, the
        # turns it does not cover yet stay candidates too.
        budget = window.planning_budget(
            budget or self.budget, candidates=len(turns), late=start < self.evicted_turns
        )
        asker, last_user = next(
            ((t, m.content) for t in reversed(turns) for m in t.messages if m.role is Role.USER), (None, "")
        )
        passages: list[Passage] = []
        min_score = float("-inf")
        if (
            self.retriever is not None
            and budget.retrieval_cap > 0
            and budget.retrieval_top_k > 0
            and last_user
        ):
            asked_on = self._history.dates.get(asker.index) if asker is not None else None
            if asked_on is None and query is not None:
                asked_on = clock_date(self.clock)  # a hypothetical question is asked now
            extra = {"today": asked_on} if asked_on is not None and self.retriever.supports_today else {}
            passages = self.retriever.retrieve(
                last_user, session_id=self.id, top_k=budget.retrieval_top_k, **extra
            )
            min_score = self.retriever.min_score
        summary = self._summary.text(start, self._state, self._history)[0]
        if passages:  # the window's turns hold their place beside memory until it slides
            budget = window.hold_window(budget, turns, self._history.pinned, summary, tools, self.counter)
        return plan_checked(
            budget=budget,
            counter=self.counter,
            turns=turns,
            pinned=self._history.pinned,
            summary=summary,
            passages=passages,
            min_score=min_score,
            exact=exact,
            tools=tuple(tools or ()),
        )

    # -- eviction, summary, retrieval ------------------------------------------------------------
    @property
    def max_window_turns(self) -> int:
        """The most turns the window holds: ``window_turns + summarize_batch_turns - 1``."""
        return window.max_window_turns(self.budget)

    def _advance_window(self, lookahead: int = 0) -> None:
        """Slide the window a batch at a time (see :mod:`convo.session.window`); after a
        reply, ``lookahead=1`` moves it for the next turn already."""
        evicted = window.evicted_after(
            self.budget, turn_count=self.turn_count, evicted=self.evicted_turns, lookahead=lookahead
        )
        if evicted != self.evicted_turns:
            logger.info("session %s: turns %d-%d left the window", self.id, self.evicted_turns, evicted - 1)
            self._state = replace(self._state, evicted_turns=evicted)
            self._write()

    def _next_turn_overflows(self, plan: PromptPlan) -> bool:
        """Whether the next turn, at the recent turns' average size, would not fit."""
        recent = self.turns(max(self.evicted_turns, self.turn_count - self.budget.summarize_batch_turns))
        return window.next_turn_overflows(plan, recent, self.budget, self.counter)

    def _make_room_for_batch(self, plan: PromptPlan) -> None:
        """The token budget, not the turn count, pushed turns out: push out a batch."""
        memory = self.retriever is not None
        room = window.window_room(plan, self.budget, self.summary_cap, self.counter, memory=memory)
        drop = window.turns_to_push_out(self.turns(self.evicted_turns), self.budget, self.counter, room=room)
        if drop:
            first, last = self.evicted_turns, self.evicted_turns + drop - 1
            logger.info("session %s: the token budget pushed turns %d-%d out", self.id, first, last)
            self._state = replace(self._state, evicted_turns=self.evicted_turns + drop)

    def _maybe_summarize(self, *, window_moved: bool = False, prompt: Sequence[Message] = ()) -> None:
        """Fold evicted turns into the summary in the background, once a batch is waiting
        or when the window has just moved (:meth:`SessionSummary.maybe_submit`; ``prompt``:
        the turn just answered, whose cached KV the summary may continue)."""
        self._summary.maybe_submit(
            self._state,
            self._history,
            batch_turns=self.budget.summarize_batch_turns,
            window_moved=window_moved,
            prompt=prompt,
        )

    def _remember_completed_turns(self, *, ahead: bool = False) -> None:
        """Hand every completed turn (all but the last) to the retriever, once each; ``ahead``
        (a reply) and a retriever that defers: the turns the window still shows only once
        their vectors are ready (:meth:`_index_ahead`), else when they leave the window."""
        done = self.turn_count - 1
        if self.retriever is None or done <= self._indexed_turns:
            return
        dates = self._history.dates
        if ahead and isinstance(self.retriever, PreparesTurns) and self.retriever.defer_window_turns:
            start = max(self._indexed_turns, min(done, self.evicted_turns))
            if shown := self.turns(start)[: done - start]:
                done = start + self.retriever.turns_ready(self.id, shown, dates=dates)
            if done <= self._indexed_turns:
                return
        turns = self.turns(self._indexed_turns)[: done - self._indexed_turns]
        self.retriever.remember_turns(
            self.id, turns, dates={t.index: dates[t.index] for t in turns if t.index in dates}
        )
        self._indexed_turns = done

    def _index_ahead(self) -> None:
        """Have the retriever embed the turns not handed to it yet (this one too) in the
        background, for the next turn's :meth:`_remember_completed_turns`."""
        if isinstance(self.retriever, PreparesTurns) and self.turn_count > self._indexed_turns:
            prepare_later(self.retriever, self.id, self.turns(self._indexed_turns), self._history.dates)

    # -- lifecycle ---------------------------------------------------------------------------------
    def export(self) -> dict[str, Any]:
        """The whole session as JSON-safe data (see :meth:`Store.export_session`)."""
        return self.store.export_session(self.id)

    def close(self) -> None:
        """Release the engine's KV cache for this session and cancel its queued or running
        summary (the history stays stored; a later session with this id re-runs the summary)."""
        self._summary.forget()
        if self.engine is not None:
            self.engine.release(self.id)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
