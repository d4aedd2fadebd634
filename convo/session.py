"""A conversation that never exceeds its token budget.

A :class:`Session` owns the history of one conversation. Each turn it plans the prompt
(:func:`convo.plan.plan_prompt`: pinned system part, rolling summary, earlier recent
turns, retrieved passages next to the turn being answered, reply reserve), checks the
plan against an exact count of the rendered prompt, calls the engine with a capped
``generate``, stores the reply, and returns. The
turns that left the window are folded into the summary (in batches) in the background,
by a :class:`~convo.summarize.SummaryWorker`, at lower priority than replies::

    turn n:   plan ── generate ── store reply, slide window ── return ─┐
                                                                       └─ summary job (background)
    turn n+1: [wait for the job only if the turns it folds do not fit beside the window,
               at most summary_wait_s] ── plan ── generate ── ...

While a summary is late, the prompt shows the previous summary and the turns it does not
cover yet when they all fit (the prompt then extends the previous one); otherwise the turn
goes on without it: at once on an engine that runs calls together (the reply runs beside
the summary), after waiting at most ``summary_wait_s`` on one that runs a call at a time
(where the reply would queue behind the summary anyway). Such a prompt shows a
provisional summary in the summary's place
(:func:`~convo.summarize.provisional_summary`: the previous summary and excerpts of the
turns it misses) and the window. The budget invariant holds in every case, and nothing
stored is lost.


Nothing stored is ever lost: the full history stays in the store even when the prompt only
shows the window and the summary; the user message is stored before generation starts, so
a crash or timeout mid-turn keeps it; a turn that fails can be re-run with
:meth:`Session.reply`.

Nothing is stored for a refused request: text, ids, the budget (against the engine's
context window) and the system prompt are checked before a new session is created, and a
message is checked before it is appended. Each turn holds the store's lock on the session
(:meth:`convo.store.Store.lock`: a file lock for SQLite, a lease for Redis), so two
processes driving one session (two ``convo chat --session X``) take turns instead of
interleaving them; a session that finds the lock free catches up with what the other
stored before it adds anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import date, datetime
from typing import Any, Final, Literal, Protocol, TypedDict, Unpack, cast

from convo.budget import Budget, OversizePolicy
from convo.engines.base import (
    GREEDY,
    AsyncTextStream,
    Engine,
    FinishReason,
    GenerateOptions,
    Generation,
    GenerationStats,
    Sampling,
    TextStream,
    concurrent_calls,
)
from convo.errors import BudgetError, ConfigError, ConvoError, DeviceOutOfMemory, MessageError
from convo.messages import Message, MessageLike, Role, check_text
from convo.plan import Passage, PromptPlan, Turn, plan_checked
from convo.store import MemoryStore, SessionState, Store
from convo.summarize import (
    JobStatus,
    ModelSummarizer,
    Summarizer,
    SummaryJob,
    SummaryState,
    SummaryStatus,
    SummaryWorker,
    provisional_summary,
)
from convo.tokens import TokenCounter

logger = logging.getLogger(__name__)

#: Seconds a turn waits for its session's background summary, when the turns it folds do
#: not fit beside the window, on an engine that runs one call at a time (``summary_wait_s``
#: ``"auto"``, the default): the reply would queue behind the summary's model call anyway.
#: A summary takes 5-60 s with the default model on a small shared CPU.
DEFAULT_SUMMARY_WAIT_S = 30.0
#: ``Session(summary_wait_s="auto")``: :data:`DEFAULT_SUMMARY_WAIT_S` on an engine that runs
#: one call at a time, 0 on one that runs calls together
#: (:func:`~convo.engines.base.concurrent_calls` > 1: a batching local engine, a server).
SUMMARY_WAIT_AUTO: Final = "auto"


def check_summary_wait(value: object) -> None:
    """Raise :class:`~convo.errors.ConfigError` unless ``value`` is a valid
    ``summary_wait_s``: seconds >= 0, ``"auto"`` or ``None``."""
    if value is None or value == SUMMARY_WAIT_AUTO:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ConfigError(f"summary_wait_s must be seconds >= 0, 'auto' or None, got {value!r}")


@dataclass(frozen=True)
class _Planned:
    """The summary a turn's prompt was planned with."""

    summary: str  # the stored summary, or the provisional one the prompt showed
    summarized_turns: int
    summarizing: bool  # False: turns that leave the window are meant to go (no summary)
    start: int  # the first turn the planner could show
    provisional: bool = False

    def hidden_turns(self, plan: PromptPlan) -> int:
        """Turns neither in that summary nor in the prompt."""
        return max(plan.first_shown_turn - self.summarized_turns, 0) if self.summarizing else 0


#: How often an async turn checks whether a thread's turn on the same session has ended.
TURN_LOCK_POLL_S = 0.005

#: Longest session id a :class:`Session` accepts, in characters.
MAX_SESSION_ID_CHARS = 256


class Retriever(Protocol):
    """What a session needs from a retrieval memory (see :mod:`convo.retrieval`)."""

    min_score: float

    def remember_turns(
        self, session_id: str, turns: Sequence[Turn], *, dates: Mapping[int, str] | None = None
    ) -> None: ...

    def retrieve(self, query: str, *, session_id: str, top_k: int) -> list[Passage]: ...


def _takes_today(retriever: Retriever) -> bool:
    """Whether ``retriever.retrieve`` takes ``today`` (:class:`convo.RetrievalMemory` does;
    a retriever written to the :class:`Retriever` protocol need not)."""
    try:
        params = inspect.signature(retriever.retrieve).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "today" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


@dataclass(frozen=True, kw_only=True)
class TurnStats:
    """What a turn cost and what its prompt held.

    Attributes:
        turn: 1-based number of the turn in the session (continues across resumes).
        parts: tokens per prompt part (see :class:`~convo.plan.PromptPlan`).
        prompt_tokens: the exact token count of the rendered prompt.
        context_tokens / max_new_tokens: the budget.
        summary_tokens: tokens of the rolling summary this turn's prompt was planned with.
        evicted_turns: turns that have left the window so far (total).
        summarized_turns: turns folded into the stored summary when the reply returned
            (the summary of the turns that left the window on this turn is written after it).
        hidden_turns: turns that were neither in the summary nor shown whole in this prompt:
            the summary had not caught up with them (the turn went on without it, see
            ``summary_wait_s``, or the budget cut them on this turn). The prompt showed
            excerpts of them in a provisional summary (``provisional_summary``); they stay
            stored and are folded in later.
        provisional_summary: the prompt showed a provisional summary
            (:func:`~convo.summarize.provisional_summary`) in the summary's place.
        passages_used / passages_dropped: retrieval outcome.
        truncated_messages: messages the TRUNCATE policy shortened in this prompt.
        plan_s / generate_s / latency_s: seconds.
        summarize_s: seconds this turn waited for a background summary (the summary itself
            runs after the reply; 0 when the turn did not wait).
        summary: the session's summary state when the reply returned (see
            :class:`~convo.summarize.SummaryState`).
        oom_retries: 1 when the turn ran out of device memory and was re-run smaller.
        recovery: what the OOM retry changed (empty when none).
        generation: the engine's report (tokens, KV bytes, memory, timings).
    """

    turn: int
    parts: Mapping[str, int]
    prompt_tokens: int
    context_tokens: int
    max_new_tokens: int
    summary_tokens: int
    evicted_turns: int
    summarized_turns: int
    passages_used: int
    passages_dropped: int
    truncated_messages: int
    plan_s: float
    generate_s: float
    summarize_s: float
    latency_s: float
    oom_retries: int = 0
    recovery: str = ""
    generation: GenerationStats | None = None
    hidden_turns: int = 0
    summary: SummaryState | None = None
    provisional_summary: bool = False


@dataclass(frozen=True, kw_only=True)
class Reply:
    """The assistant's answer to one turn."""

    text: str
    finish_reason: FinishReason
    stats: TurnStats
    plan: PromptPlan = field(repr=False)

    @property
    def message(self) -> Message:
        """The reply as an assistant :class:`~convo.messages.Message` (``.to_openai()``
        gives the dict an agent loop appends to its history)."""
        return Message(role=Role.ASSISTANT, content=self.text)

    @property
    def timed_out(self) -> bool:
        """Generation hit its wall-clock limit (``text`` holds what was produced)."""
        return self.finish_reason is FinishReason.TIMEOUT


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


class TurnOptions(TypedDict, total=False):
    """The keyword arguments of a turn (:meth:`Session.send`, :meth:`Session.reply`,
    :meth:`Session.asend`, and the streams):

    * ``sampling``: decoding settings (default: the session's);
    * ``timeout_s``: wall-clock limit of the generate call (default: the session's);
    * ``on_text``: called with each new piece of the reply;
    * ``cancel``: a ``threading.Event``; set it to stop generation early;
    * ``stop``: strings that end the reply where they first appear (not part of it).
    """

    sampling: Sampling | None
    timeout_s: float | None
    on_text: Any
    cancel: threading.Event | None
    stop: Sequence[str]


@dataclass(frozen=True)
class _TurnArgs:
    """:class:`TurnOptions` with their defaults (an unknown keyword is a ``TypeError``)."""

    sampling: Sampling | None = None
    timeout_s: float | None = None
    on_text: Any = None
    cancel: threading.Event | None = None
    stop: Sequence[str] = ()


@dataclass(frozen=True)
class _SummaryWait:
    """A step of a turn: wait up to ``left`` seconds (``None``: no limit) for ``job``."""

    job: SummaryJob
    left: float | None


@dataclass(frozen=True)
class _Raised:
    """A step's outcome that is an exception (thrown into the turn)."""

    error: Exception


class _TurnDriver:
    """Runs a turn's steps (:meth:`Session._turn`) one by one: the outcome of each step,
    its value or its exception, goes back into the turn. The blocking (:meth:`run`) and
    the awaited (:meth:`arun`) drivers differ only in how they get that outcome."""

    def __init__(self, turn: Generator[_SummaryWait | PromptPlan, Any, Reply]) -> None:
        self._turn = turn
        self.step: _SummaryWait | PromptPlan | None = None
        self._reply: Reply | None = None
        self._resume(None)

    def run(self, do: Callable[..., Any], *args: Any) -> None:
        try:
            outcome = do(*args)
        except Exception as exc:
            outcome = _Raised(exc)
        self._resume(outcome)

    async def arun(self, do: Awaitable[Any]) -> None:
        try:
            outcome = await do
        except Exception as exc:
            outcome = _Raised(exc)
        self._resume(outcome)

    def _resume(self, outcome: Any) -> None:
        try:
            if isinstance(outcome, _Raised):
                self.step = self._turn.throw(outcome.error)
            else:
                self.step = self._turn.send(outcome)
        except StopIteration as done:
            self.step, self._reply = None, done.value

    def result(self) -> Reply:
        assert self._reply is not None, "the turn has not ended"
        return self._reply


class Session:
    """One conversation kept inside a token budget.

    Args:
        engine: generates replies (e.g. :class:`~convo.engine.TransformersEngine`). May be
            ``None`` for a session that only plans prompts (then pass ``counter``).
        budget: the token budget (default ``Budget()``).
        system_prompt: a pinned system message, set when the session is created.
        store: where history lives (default: a new :class:`~convo.store.MemoryStore`).
        session_id: resume this session if the store has it, else create it with this id.
        summarizer: folds evicted turns into the summary; default: the engine itself
            through :class:`~convo.summarize.ModelSummarizer` (none without an engine or
            with ``budget.summary_tokens == 0``).
        summaries: the background worker that runs the summarizer (default: the
            process-wide :meth:`SummaryWorker.shared`).
        summary_wait_s: how long a turn waits for this session's summary while it is
            still running. A turn waits only when the turns the summary does not cover yet
            cannot all be shown beside the window (while they can, the prompt shows them
            and extends the previous one). Default ``"auto"``
            (:data:`SUMMARY_WAIT_AUTO`): :data:`DEFAULT_SUMMARY_WAIT_S` on an engine that
            runs one call at a time, 0 on one that runs calls together (the reply then
            runs beside the summary instead of after it); 0 never waits; ``None`` waits as
            long as it takes. Past the bound the turn shows a provisional summary
            (:func:`~convo.summarize.provisional_summary`: the previous summary and
            excerpts of the turns it misses) and the window. Those turns
            (``TurnStats.hidden_turns``) stay stored and are folded in when the job ends;
            the budget holds either way.
        retriever: a retrieval memory (e.g. :class:`convo.RetrievalMemory`), or ``None``.
        counter: token counter; default: the engine's.
        sampling: decoding settings (default greedy).
        timeout_s: wall-clock limit of one generate call (default: the engine's).
        owner: recorded with a new session (the server stores the API key's hash).
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
        summarizer: Summarizer | None = None,
        retriever: Retriever | None = None,
        counter: TokenCounter | None = None,
        sampling: Sampling = GREEDY,
        timeout_s: float | None = None,
        owner: str = "",
        summaries: SummaryWorker | None = None,
        summary_wait_s: float | Literal["auto"] | None = SUMMARY_WAIT_AUTO,
        lock_timeout_s: float = 60.0,
        clock: Callable[[], date | datetime | str] | None = None,
    ) -> None:
        if engine is None and counter is None:
            raise ConfigError("a Session needs an engine or, to only plan prompts, a counter")
        check_summary_wait(summary_wait_s)
        self.summary_wait_s = summary_wait_s
        self.summaries = summaries or SummaryWorker.shared()
        self.summarizer: Summarizer | None = None  # set below, once the budget is known
        if session_id is not None:
            if not isinstance(session_id, str) or not session_id or len(session_id) > MAX_SESSION_ID_CHARS:
                raise ConfigError(
                    f"session_id must be a non-empty string of at most {MAX_SESSION_ID_CHARS} "
                    f"characters, got {session_id!r:.60}"
                )
            try:
                check_text(session_id, "session_id")
            except MessageError as exc:
                raise ConfigError(str(exc)) from None
        if budget is not None and not isinstance(budget, Budget):
            raise ConfigError(f"budget must be a Budget, got {type(budget).__name__}")
        if system_prompt is not None:
            check_text(system_prompt, "system_prompt")
        if not lock_timeout_s > 0:
            raise ConfigError(f"lock_timeout_s must be > 0, got {lock_timeout_s!r}")
        if clock is not None and not callable(clock):
            raise ConfigError(f"clock must be a callable returning a date, got {type(clock).__name__}")
        self.clock = clock
        self.lock_timeout_s = lock_timeout_s
        self.engine = engine
        self.counter: TokenCounter = counter or engine.counter  # type: ignore[union-attr]
        self.store: Store = store if store is not None else MemoryStore()
        self.retriever = retriever
        self.sampling = sampling
        self.timeout_s = timeout_s
        self._lock = threading.RLock()
        self._alock: asyncio.Lock | None = None
        self._pinned: list[Message] = []
        self._log: list[Message] = []
        self._turn_starts: list[int] = []
        self._pending_tool_ids: set[str] = set()
        #: (start, text, covered turns) of the provisional summary the last prompt showed.
        self._provisional: tuple[int, str, int] | None = None
        self._indexed_turns = 0
        self._dates: dict[int, str] = {}

        self.id = session_id or uuid.uuid4().hex
        with self.store.lock(self.id, self.lock_timeout_s):  # two creators: one creates, one resumes
            if self.store.exists(self.id):
                state, messages = self.store.load(self.id)
                stored = state.settings.get("budget")
                self.budget = budget or (Budget.from_dict(dict(stored)) if stored else Budget())
                self._check_budget()
                self._state = state
                for m in messages:
                    self._index(m)
                self._date_stored_turns()
                if budget is not None and stored != budget.to_dict():
                    self._state = replace(state, settings={**state.settings, "budget": budget.to_dict()})
                    self._write()
            else:
                self.budget = budget or Budget()
                self._check_budget()
                self._state = SessionState(
                    session_id=self.id, settings={"budget": self.budget.to_dict()}, owner=owner
                )
                first: list[Message] = []
                if system_prompt:
                    first.append(Message(role=Role.SYSTEM, content=system_prompt))
                    self._check(first[0])
                self.store.create(self._state, first)  # the session and its system prompt at once
                for m in first:
                    self._index(m)
        if summarizer is None and engine is not None and self.budget.summary_tokens > 0:
            summarizer = ModelSummarizer(engine=engine)
        self.summarizer = summarizer

    def _check_budget(self) -> None:
        """Refuse a budget the engine's context window cannot hold (before anything is stored)."""
        if self.engine is None:
            return
        try:
            window = int(self.engine.context_window)
        except ConvoError:  # e.g. a remote engine that cannot be asked now: it checks each call
            return
        # A remote engine's window is the server's less the margin it holds back for an
        # inexact counter; a budget may span the server's whole window (it holds its own margin).
        window += int(getattr(self.engine, "margin_tokens", 0) or 0)
        if self.budget.context_tokens > window:
            raise ConfigError(
                f"Budget.context_tokens={self.budget.context_tokens} is larger than the model's "
                f"context window ({window} tokens); use context_tokens <= {window}"
            )

    @contextlib.contextmanager
    def _held_turn(self) -> Iterator[None]:
        """Hold the session's store lock; on a fresh hold, catch up with the store."""
        with self._lock:
            fresh = not self.store.holds_lock(self.id)
            with self.store.lock(self.id, self.lock_timeout_s):
                if fresh:
                    self._sync()
                yield

    def _sync(self) -> None:
        """Reload history and state if another process wrote to the session since (a
        cheap :meth:`~convo.store.Store.peek` first: no messages are read when nothing changed)."""
        state, count = self.store.peek(self.id)
        if count == len(self._pinned) + len(self._log) and replace(
            state, created_at=0.0, updated_at=0.0
        ) == replace(self._state, created_at=0.0, updated_at=0.0):
            return
        state, messages = self.store.load(self.id)
        self._state = state
        self._pinned, self._log, self._turn_starts = [], [], []
        self._pending_tool_ids = set()
        for m in messages:
            self._index(m)
        self._date_stored_turns()
        self._indexed_turns = min(self._indexed_turns, max(0, self.turn_count - 1))

    def _date_stored_turns(self) -> None:
        """With a clock, date the turns read from the store (a resumed session, turns
        another process added) or imported (:meth:`extend`) by when their first message
        was created (``Message.created_at``, local time); a date already known is kept."""
        if self.clock is None:
            return
        for turn, start in enumerate(self._turn_starts):
            created = datetime.fromtimestamp(self._log[start].created_at)
            self._dates.setdefault(turn, created.isoformat(timespec="minutes"))

    # -- state -------------------------------------------------------------------------------
    @property
    def summary(self) -> str:
        """The rolling summary of turns that left the window (as far as it is written)."""
        self._sync_summary()
        return self._state.summary

    @property
    def summary_state(self) -> SummaryState:
        """Where the rolling summary stands: done, pending, running or failed, and which
        turns it covers (see :class:`~convo.summarize.SummaryState`)."""
        self._sync_summary()
        state = self._state
        job = self.summaries.job(self.store, self.id)
        if job is not None and job.end <= state.summarized_turns:
            job = None  # an older job that this session already picked up
        if state.evicted_turns <= state.summarized_turns or not self._summarizing:
            status = SummaryStatus.DONE
        elif job is None or job.status in (JobStatus.CANCELLED, JobStatus.DONE):
            status = SummaryStatus.PENDING
        elif job.status is JobStatus.FAILED:
            status = SummaryStatus.FAILED
        elif job.status is JobStatus.RUNNING:
            status = SummaryStatus.RUNNING
        else:
            status = SummaryStatus.PENDING
        failed = job is not None and job.status is JobStatus.FAILED
        return SummaryState(
            status=status,
            summarized_turns=state.summarized_turns,
            evicted_turns=state.evicted_turns,
            job_turns=(job.start, job.end) if job is not None else None,
            failures=(job.failures + int(failed)) if job is not None else 0,
            error=job.error if failed and job is not None else "",
        )

    def wait_summary(self, timeout_s: float | None = None) -> SummaryState:
        """Bring the summary up to date and return its state: start jobs for the turns it
        owes (also after a failure, once per call) and wait for them, up to ``timeout_s``
        in all (``None``: without limit). Turns never call this (they wait only as
        ``summary_wait_s`` says); it is for callers that want the summary now (tests,
        exports, shutdown)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            submitted: set[int] = set()
            while True:
                self._sync_summary()
                if not self._owes_summary():
                    break
                job = self._live_job()
                if job is None:
                    last = self.summaries.job(self.store, self.id)
                    if last is not None and id(last) in submitted and last.status is not JobStatus.DONE:
                        break  # a job of this call failed or was cancelled: report it
                    job = self._submit_summary()
                    if job is None:
                        break
                    submitted.add(id(job))
                self.summaries.promote(job)
                left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                if not job.wait(left):
                    break
        return self.summary_state

    @property
    def evicted_turns(self) -> int:
        """How many turns have left the prompt window (they are summarized / retrievable)."""
        return self._state.evicted_turns

    @property
    def summarized_turns(self) -> int:
        """How many turns are folded into the summary (as far as it is written)."""
        self._sync_summary()
        return self._state.summarized_turns

    @property
    def turn_count(self) -> int:
        """Turns so far (a turn starts at each user message)."""
        return len(self._turn_starts)

    @property
    def messages(self) -> list[Message]:
        """The full stored history: pinned messages first, then the conversation."""
        return self._pinned + self._log

    @property
    def owner(self) -> str:
        return self._state.owner

    def turns(self, start: int = 0) -> list[Turn]:
        """Turns ``start..`` as :class:`~convo.plan.Turn` (index, messages)."""
        out = []
        for i in range(start, len(self._turn_starts)):
            end = self._turn_starts[i + 1] if i + 1 < len(self._turn_starts) else len(self._log)
            out.append(Turn(index=i, messages=tuple(self._log[self._turn_starts[i] : end])))
        return out

    # -- adding messages ---------------------------------------------------------------------
    def _check(self, message: Message, pending_tool_ids: set[str] | None = None) -> None:
        """Validate ``message`` against the history before anything is stored.

        ``pending_tool_ids``: the calls still open before ``message`` (default: the
        history's), for checking several messages before any is stored.
        """
        if not isinstance(message, Message):
            raise MessageError(f"expected a Message, got {type(message).__name__}")
        pending = self._pending_tool_ids if pending_tool_ids is None else pending_tool_ids
        if message.role is Role.TOOL:
            if message.tool_call_id not in pending:
                raise MessageError(f"tool result {message.tool_call_id!r} answers no pending tool call")
        if message.pinned:
            cost = sum(self.counter.message_tokens(m) for m in [*self._pinned, message])
            if cost > self.budget.pinned_cap:
                raise BudgetError(
                    f"pinned messages would take {cost} tokens, over pinned_tokens={self.budget.pinned_cap}"
                )
        elif message.role is Role.USER and self.budget.oversize is OversizePolicy.RAISE:
            room = (
                self.budget.available_prompt_tokens
                - max(self.counter.overhead_tokens(True), self.counter.overhead_tokens(False))
                - sum(self.counter.message_tokens(m) for m in self._pinned)
            )
            if self.counter.message_tokens(message) > room:
                raise BudgetError(
                    f"message of {self.counter.message_tokens(message)} tokens exceeds the "
                    f"{room} tokens the budget leaves for it (oversize policy RAISE)"
                )

    def _index(self, message: Message) -> None:
        if message.pinned:
            self._pinned.append(message)
            return
        if message.role is Role.USER or not self._turn_starts:
            self._turn_starts.append(len(self._log))
        self._log.append(message)
        if message.role is Role.ASSISTANT:
            self._pending_tool_ids = {c.id for c in message.tool_calls}
        elif message.role is Role.TOOL:
            self._pending_tool_ids.discard(message.tool_call_id or "")
        else:
            self._pending_tool_ids = set()

    def _commit(
        self, messages: Sequence[Message], *, dated: str | None = None, imported: bool = False
    ) -> None:
        """Check, store and index ``messages``; date the turns they start: ``dated``, or
        with a clock its reading (``imported``: each turn's first message's
        ``created_at``, for earlier turns a client hands over)."""
        pending = set(self._pending_tool_ids)
        for m in messages:
            self._check(m, pending)
            if m.role is Role.ASSISTANT:
                pending = {c.id for c in m.tool_calls}
            elif m.role is Role.TOOL:
                pending.discard(m.tool_call_id or "")
            elif not m.pinned:
                pending = set()
        self._write(messages)
        started = len(self._turn_starts)
        for m in messages:
            self._index(m)
        if imported and dated is None:
            self._date_stored_turns()
            return
        stamp = dated if dated is not None else self._clock_date()
        if stamp is not None:
            for turn in range(started, len(self._turn_starts)):
                self._dates.setdefault(turn, stamp)

    def _clock_date(self) -> str | None:
        """The clock's reading as a turn date (see ``clock``), or ``None`` without one."""
        if self.clock is None:
            return None
        now = self.clock()
        if isinstance(now, datetime):
            return now.isoformat(timespec="minutes")
        if isinstance(now, date):
            return now.isoformat()
        return str(now)

    def _write(self, messages: Sequence[Message] = ()) -> None:
        """Store the state (and append ``messages``) after picking up a background summary
        that finished, so a state write never rolls a newer summary back."""
        with self.summaries.key_lock(self.store, self.id):
            self._sync_summary(locked=True)
            if messages:
                self.store.append(self.id, messages, state=self._state)
            else:
                self.store.save_state(self._state)

    def add(self, message: MessageLike, *, date: str | None = None) -> None:
        """Append a message without generating (tool results, imported history...).

        Args:
            message: a :class:`~convo.messages.Message` or an OpenAI message dict
                (assistant ``tool_calls``, ``tool`` results...); tool results must answer
                a pending tool call.
            date: a human date for the turn this message starts or belongs to (indexed
                with it for retrieval, e.g. ``"8 May 2023"``).

        Raises:
            MessageError / BudgetError: invalid message; nothing is stored.
        """
        message = Message.from_openai(message)
        with self._held_turn():
            self._commit([message], dated=date)
            if date is not None and self._turn_starts:
                self._dates.setdefault(len(self._turn_starts) - 1, date)
            if not message.pinned:
                self._advance_window()
                self._remember_completed_turns()
                self._maybe_summarize()

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
        with self._held_turn():
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
                ``cancel``, ``stop``).

        The messages are stored (all or none) before generation starts.

        Raises:
            MessageError: a malformed message, a tool result answering no pending call,
                or a last message that is neither user nor tool.
            BudgetError: the message is too large and the oversize policy is RAISE
                (nothing is stored).
            DeviceOutOfMemory: out of memory even after one retry with a smaller plan
                (the message stays stored; call :meth:`reply` to try again).
        """
        args = _TurnArgs(**options)
        with self._held_turn():
            return self._reply(self._accept(content), args)

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
        one at a time, across threads and tasks.
        """
        args = _TurnArgs(**options)
        async with self._turn_lock():
            return await self._areply(self._accept(content), args)

    def _accept(self, content: str | MessageLike | Sequence[MessageLike]) -> float:
        """Store the incoming messages of a turn (all or none); when the turn started."""
        started = time.monotonic()
        self._commit(incoming_messages(content))
        self._advance_window()
        return started

    def astream(
        self, content: str | MessageLike | Sequence[MessageLike], **kwargs: Any
    ) -> AsyncTextStream[Reply]:
        """Like :meth:`asend`, but an async iterator of text chunks; ``.result`` is the Reply.

        ``async with session.astream("hi") as stream: async for piece in stream: ...``.
        Leaving the block early cancels generation; what was generated is stored.
        """
        return AsyncTextStream(lambda **kw: self.asend(content, **kw), kwargs)

    @contextlib.asynccontextmanager
    async def _turn_lock(self) -> AsyncIterator[None]:
        """The session's turn lock, taken without blocking the event loop."""
        if self._alock is None:
            self._alock = asyncio.Lock()
        async with self._alock:  # tasks of this loop, one at a time
            while not self._lock.acquire(blocking=False):  # and no thread mid-turn
                await asyncio.sleep(TURN_LOCK_POLL_S)
            try:
                yield
            finally:
                self._lock.release()

    def reply(self, **options: Unpack[TurnOptions]) -> Reply:
        """Generate the assistant's next message for the history as it stands.

        Use it after :meth:`add` (e.g. tool results) or to re-run a failed turn.
        ``options``: :class:`TurnOptions`, as for :meth:`send`.
        """
        args = _TurnArgs(**options)
        with self._held_turn():
            return self._reply(time.monotonic(), args)

    def _reply(self, started: float, args: _TurnArgs) -> Reply:
        """Drive :meth:`_turn` with blocking calls."""
        turn = _TurnDriver(self._turn(started))
        while (step := turn.step) is not None:
            turn.run(self._do_step, step, args)
        return turn.result()

    async def _areply(self, started: float, args: _TurnArgs) -> Reply:
        """:meth:`_reply`, awaiting each step (the same turn)."""
        turn = _TurnDriver(self._turn(started))
        while (step := turn.step) is not None:
            await turn.arun(self._ado_step(step, args))
        return turn.result()

    def _do_step(self, step: _SummaryWait | PromptPlan, args: _TurnArgs) -> bool | Generation:
        """One step of :meth:`_turn`, blocking: wait for the summary, or generate."""
        if isinstance(step, _SummaryWait):
            return step.job.wait(step.left)
        return self._generate(step, args)

    async def _ado_step(self, step: _SummaryWait | PromptPlan, args: _TurnArgs) -> bool | Generation:
        """:meth:`_do_step` on the event loop (the summary is waited for in a worker thread)."""
        if isinstance(step, _SummaryWait):
            return await asyncio.to_thread(step.job.wait, step.left)
        return await self._agenerate(step, args)

    def _turn(self, started: float) -> Generator[_SummaryWait | PromptPlan, Any, Reply]:
        """One turn, without I/O: the summary waits (:meth:`_summary_waits`), then the
        generations (:meth:`_reply_flow`). :meth:`_reply` and :meth:`_areply` drive it."""
        waited = yield from self._summary_waits()
        return (yield from self._reply_flow(started, waited))

    def _summary_waits(self) -> Generator[_SummaryWait, bool, float]:
        """The background summary a turn waits for, before it plans: it yields each job to
        wait for, with the seconds left (``None``: no limit), is sent whether the job
        ended, and returns the seconds it waited. :meth:`_reply` waits blocking,
        :meth:`_areply` in a worker thread.

        A finished summary is picked up; turns the summary owes get a job (after a crash, a
        failure or a cancel: the stored turns are the source of truth). While the turns the
        summary misses cannot all be shown beside the window, the turn waits for the job
        (and the next one), at most ``summary_wait_s`` in all.
        """
        t0 = time.monotonic()
        limit = self.summary_wait_limit
        deadline = None if limit is None else t0 + limit
        waited = 0.0
        while True:
            self._sync_summary()
            job = self._live_job() or self._submit_summary()
            if job is None or not job.live or not self._owes_summary():
                return waited  # nothing to wait for: no plan needed (the turn plans next)
            _, start = self._plan_now()
            # The prompt is the window, and the summary misses turns before it: wait for it.
            hides = start == self.evicted_turns
            left = None if deadline is None else deadline - time.monotonic()
            if not hides or (left is not None and left <= 0):
                return waited
            self.summaries.promote(job)
            t_wait = time.monotonic()
            finished = yield _SummaryWait(job, left)
            waited += time.monotonic() - t_wait
            if not finished or job.status is not JobStatus.DONE:
                logger.info(
                    "session %s: summary of turns %d-%d not in after %.1f s (%s); planning without it",
                    self.id, job.start, job.end, time.monotonic() - t0, job.status.value,
                )  # fmt: skip
                return waited

    def _reply_flow(self, started: float, waited: float = 0.0) -> Generator[PromptPlan, Generation, Reply]:
        """One turn, without I/O of the model: it yields each prompt to generate and is sent
        the :class:`Generation` (or thrown the engine's error). :meth:`_reply` drives it
        with blocking calls, :meth:`_areply` with awaited ones; ``waited`` is the seconds
        the turn waited for the summary (:meth:`_summary_waits`) first."""
        if self.engine is None:
            raise ConfigError("this session has no engine; it can only plan prompts")
        self._remember_completed_turns()
        self._sync_summary()
        plan, start = self._plan_now()
        planned = self._planned(start)
        summarize_s = waited
        plan_s = time.monotonic() - started - waited
        oom_retries, recovery = 0, ""
        t_gen = time.monotonic()
        try:
            try:
                gen = yield plan
            except BudgetError:
                # The template cost more than the counter's sum: re-plan on exact counts.
                plan = self._plan(None, None, True, start=planned.start)
                gen = yield plan
        except DeviceOutOfMemory:
            # Half the turns that were shown, half the passages, no window slack.
            smaller = replace(
                self.budget,
                window_turns=max(1, len(plan.turns_shown) // 2),
                summarize_batch_turns=1,
                retrieval_top_k=self.budget.retrieval_top_k // 2,
            )
            plan = self.plan(budget=smaller)
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
        self._commit([Message(role=Role.ASSISTANT, content=gen.text)])
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
            self._make_room_for_batch()
        self._write()  # the turn is stored before its summary starts
        self._maybe_summarize(window_moved=self.evicted_turns != evicted_before)
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
        return Reply(text=gen.text, finish_reason=gen.finish_reason, stats=stats, plan=plan)

    async def _agenerate(self, plan: PromptPlan, args: _TurnArgs) -> Generation:
        agenerate = getattr(self.engine, "agenerate", None)
        if agenerate is None:  # a synchronous engine: its own call, in a worker thread
            return await asyncio.to_thread(self._generate, plan, args)
        with self.summaries.replying():  # background summaries defer to replies
            result = await agenerate(
                plan.messages, max_new_tokens=self.budget.max_new_tokens, **self._generate_options(plan, args)
            )
        return cast(Generation, result)

    def _generate(self, plan: PromptPlan, args: _TurnArgs) -> Generation:
        assert self.engine is not None
        with self.summaries.replying():  # background summaries defer to replies
            return self.engine.generate(
                plan.messages, max_new_tokens=self.budget.max_new_tokens, **self._generate_options(plan, args)
            )

    def _generate_options(self, plan: PromptPlan, args: _TurnArgs) -> GenerateOptions:
        """The engine's arguments for ``plan``, the session's defaults filled in."""
        return GenerateOptions(
            timeout_s=args.timeout_s or self.timeout_s,
            sampling=args.sampling or self.sampling,
            cache_key=self.id,
            on_text=args.on_text,
            cancel=args.cancel,
            stop=tuple(args.stop),
            # The engine checks the real token ids against the budget before the model runs.
            max_prompt_tokens=plan.context_tokens - self.budget.max_new_tokens,
        )

    # -- planning ------------------------------------------------------------------------------
    def plan(
        self, query: str | None = None, *, budget: Budget | None = None, exact: bool = False
    ) -> PromptPlan:
        """The prompt this session would send now.

        Args:
            query: a hypothetical user message appended for planning only (not stored),
                e.g. a question to evaluate what the session would show for it.
            budget: plan under another budget (default: the session's).
            exact: re-count the rendered prompt even when the counter is additive.

        The plan is checked against an exact count of the rendered prompt; if the
        template costs more than the per-message counts add up to, it is re-planned with
        that difference held back, so ``prompt_tokens + max_new_tokens <= context_tokens``
        always holds.

        While the summary is behind, the prompt keeps the turns it does not cover yet when
        they all fit, and is the window with the previous summary otherwise (what a turn
        sends when it does not wait for the summary).
        """
        if budget is not None:
            return self._plan(query, budget, exact, start=self.evicted_turns)
        plan, _ = self._plan_now(query, exact)
        return plan

    def _plan_now(self, query: str | None = None, exact: bool = False) -> tuple[PromptPlan, int]:
        """The plan from the first turn the summary does not cover, if that hides no
        turn, else from the window's first turn; and that start."""
        start = self._first_candidate_turn()
        if start < self.evicted_turns:
            plan = self._plan(query, None, exact, start=start)
            if plan.first_shown_turn <= start:
                return plan, start
        return self._plan(query, None, exact, start=self.evicted_turns), self.evicted_turns

    @property
    def summary_wait_limit(self) -> float | None:
        """Seconds a turn waits for a late summary (``summary_wait_s``, ``"auto"`` resolved
        for this session's engine); ``None``: no limit."""
        if self.summary_wait_s != SUMMARY_WAIT_AUTO:
            return self.summary_wait_s
        return 0.0 if concurrent_calls(self.engine) > 1 else DEFAULT_SUMMARY_WAIT_S

    def _summary_text(self, start: int) -> tuple[str, bool, int]:
        """The summary a prompt that starts at turn ``start`` shows, whether it is
        provisional, and the turns its model-written part covers: the stored summary, or,
        when that misses turns before ``start``, the provisional summary that adds
        excerpts of them. A provisional summary stays until the window moves, even when
        the model's lands meanwhile: the prompt keeps extending the previous one (its KV
        is reused), and the summary changes with the window, one re-prefill per move."""
        done = self._state.summarized_turns
        if self._provisional is not None and self._provisional[0] == start:
            return self._provisional[1], True, self._provisional[2]
        if not self._summarizing or start <= done:
            return self._state.summary, False, done
        missed = [m for t in self.turns(done)[: start - done] for m in t.messages]
        text = provisional_summary(
            previous=self._state.summary,
            messages=missed,
            counter=self.counter,
            max_tokens=self.budget.summary_tokens,
        )
        return text, True, done

    def _plan(self, query: str | None, budget: Budget | None, exact: bool, *, start: int) -> PromptPlan:
        budget = budget or self.budget
        if budget.summarize_batch_turns > 1:
            # Show every turn still inside the window (see _advance_window).
            budget = replace(budget, window_turns=budget.window_turns + budget.summarize_batch_turns - 1)
        turns = self.turns(start)
        if query is not None:
            probe = Message(role=Role.USER, content=query)
            turns.append(Turn(index=self.turn_count, messages=(probe,)))
        if start < self.evicted_turns and budget.window_turns < len(turns):
            # The summary is late: the turns it does not cover yet stay candidates.
            budget = replace(budget, window_turns=len(turns))
        asker, last_user = next(
            ((t, m.content) for t in reversed(turns) for m in t.messages if m.role is Role.USER), (None, "")
        )
        passages: list[Passage] = []
        min_score = float("-inf")
        if (
            self.retriever is not None
            and budget.retrieval_tokens > 0
            and budget.retrieval_top_k > 0
            and last_user
        ):
            asked_on = self._dates.get(asker.index) if asker is not None else None
            if asked_on is None and query is not None:
                asked_on = self._clock_date()  # a hypothetical question is asked now
            extra = {"today": asked_on} if asked_on is not None and _takes_today(self.retriever) else {}
            passages = self.retriever.retrieve(
                last_user, session_id=self.id, top_k=budget.retrieval_top_k, **extra
            )
            min_score = getattr(self.retriever, "min_score", min_score)
        return plan_checked(
            budget=budget,
            counter=self.counter,
            turns=turns,
            pinned=self._pinned,
            summary=self._summary_text(start)[0],
            passages=passages,
            min_score=min_score,
            exact=exact,
        )

    # -- eviction, summary, retrieval ------------------------------------------------------------
    @property
    def max_window_turns(self) -> int:
        """The most turns the window holds: ``window_turns + summarize_batch_turns - 1``."""
        return self.budget.window_turns + self.budget.summarize_batch_turns - 1

    def _advance_window(self, lookahead: int = 0) -> None:
        """Slide the window a batch at a time.

        The window holds between ``window_turns`` and ``window_turns +
        summarize_batch_turns - 1`` turns. When a new turn would make it larger, the oldest
        turns leave together, down to ``window_turns``. Between those moments every prompt
        extends the previous one, so the engine reuses its KV cache and prefills only the
        new turn; the summary changes on the same turn as the window. (The token budget
        may still push turns out earlier, at plan time.) After a reply the session looks one
        turn ahead (``lookahead=1``), so the window moves and the summary is rewritten before
        the next turn, together.
        """
        turns = self.turn_count + lookahead
        if turns - self.evicted_turns > self.max_window_turns:
            logger.info(
                "session %s: turns %d-%d left the window",
                self.id,
                self.evicted_turns,
                turns - self.budget.window_turns - 1,
            )
            self._state = replace(self._state, evicted_turns=turns - self.budget.window_turns)
            self._write()

    def _next_turn_overflows(self, plan: PromptPlan) -> bool:
        """Whether the next turn, at the recent turns' average size, would not fit.

        Making room now (after the reply) instead of letting the planner cut a turn on the
        next one means the window and the summary move together, once per batch.
        """
        recent = self.turns(max(self.evicted_turns, self.turn_count - self.budget.summarize_batch_turns))
        if not recent:
            return False
        per_turn = sum(self.counter.message_tokens(m) for t in recent for m in t.messages) / len(recent)
        return plan.prompt_tokens + per_turn > self.budget.available_prompt_tokens

    def _make_room_for_batch(self) -> None:
        """The token budget, not the turn count, pushed turns out: push out a batch.

        Dropping just enough turns every turn would change the prompt's start every turn
        and defeat KV reuse. Instead, free room for about ``summarize_batch_turns - 1``
        more turns of the recent size, keeping at least one turn and ``recent_min_tokens``
        of recent history, so the next turns extend the prompt until the next cut.
        """
        batch = self.budget.summarize_batch_turns
        turns = self.turns(self.evicted_turns)
        if batch <= 1 or len(turns) <= 1:
            return
        costs = [sum(self.counter.message_tokens(m) for m in t.messages) for t in turns]
        per_turn = sum(costs[-batch:]) / len(costs[-batch:])
        target = (batch - 1) * per_turn
        kept, freed, drop = sum(costs), 0.0, 0
        while drop < len(turns) - 1 and freed < target and kept - costs[drop] >= self.budget.recent_min:
            freed += costs[drop]
            kept -= costs[drop]
            drop += 1
        if drop:
            logger.info(
                "session %s: the token budget pushed turns %d-%d out of the window",
                self.id,
                self.evicted_turns,
                self.evicted_turns + drop - 1,
            )
            self._state = replace(self._state, evicted_turns=self.evicted_turns + drop)

    def _remember_completed_turns(self) -> None:
        """Hand every completed turn (all but the last) to the retriever, once each."""
        done = self.turn_count - 1
        if self.retriever is None or done <= self._indexed_turns:
            return
        turns = self.turns(self._indexed_turns)[: done - self._indexed_turns]
        self.retriever.remember_turns(
            self.id, turns, dates={t.index: self._dates[t.index] for t in turns if t.index in self._dates}
        )
        self._indexed_turns = done

    @property
    def _summarizing(self) -> bool:
        return self.summarizer is not None and self.budget.summary_tokens > 0

    def _first_candidate_turn(self) -> int:
        """The oldest turn the planner may show: the window's first, or the first turn the
        summary does not cover yet when the summary is behind (a turn is never dropped
        from both)."""
        if self._summarizing:
            return min(self.evicted_turns, self._state.summarized_turns)
        return self.evicted_turns

    def _owes_summary(self) -> bool:
        return self._summarizing and self.evicted_turns > self._state.summarized_turns

    def _sync_summary(self, *, locked: bool = False) -> None:
        """Pick up a background summary that finished (the worker has already stored it)."""
        job = self.summaries.job(self.store, self.id)
        if job is None or job.status is not JobStatus.DONE or job.start != self._state.summarized_turns:
            return
        if not locked:
            with self.summaries.key_lock(self.store, self.id):
                self._sync_summary(locked=True)
            return
        if job.end > self._state.summarized_turns:
            self._state = replace(self._state, summary=job.result, summarized_turns=job.end)

    def _live_job(self) -> SummaryJob | None:
        job = self.summaries.job(self.store, self.id)
        return job if job is not None and job.live else None

    def _submit_summary(self) -> SummaryJob | None:
        """Queue a background job for every turn that left the window and is not summarized
        (or return the live one: the next job folds into its result)."""
        if not self._owes_summary():
            return None
        assert self.summarizer is not None
        start, end = self._state.summarized_turns, self.evicted_turns
        return self.summaries.submit(
            store=self.store,
            session_id=self.id,
            summarizer=self.summarizer,
            previous=self._state.summary,
            messages=[m for t in self.turns(start)[: end - start] for m in t.messages],
            start=start,
            end=end,
            max_tokens=self.budget.summary_tokens,
        )

    def _maybe_summarize(self, *, window_moved: bool = False) -> None:
        """Fold evicted turns into the summary once a batch is waiting, or whenever the
        window has just moved (the prompt's start changes anyway, so changing the summary
        on the same turn costs no extra re-prefill). The summary runs in the background."""
        pending = self.evicted_turns - self._state.summarized_turns
        if not self._summarizing or pending <= 0:
            return
        if pending < self.budget.summarize_batch_turns and not window_moved:
            return
        self._submit_summary()

    def _planned(self, start: int) -> _Planned:
        """What the turn's prompt, planned from ``start``, showed as its summary; a
        provisional one is kept for the next prompts from the same start."""
        summary, provisional, covered = self._summary_text(start)
        self._provisional = (start, summary, covered) if provisional else None
        return _Planned(
            summary=summary,
            summarized_turns=covered,
            summarizing=self._summarizing,
            start=start,
            provisional=provisional,
        )

    # -- lifecycle ---------------------------------------------------------------------------------
    def export(self) -> dict[str, Any]:
        """The whole session as JSON-safe data (see :meth:`Store.export_session`)."""
        return self.store.export_session(self.id)

    def close(self) -> None:
        """Release the engine's KV cache for this session and cancel its queued or running
        summary (the history stays stored; a later session with this id re-runs the summary)."""
        self.summaries.forget(self.store, self.id)
        if self.engine is not None:
            self.engine.release(self.id)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
