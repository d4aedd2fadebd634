"""A turn as a sans-I/O core driven by two transports.

:meth:`Session._turn <convo.session.Session>` is a generator that plans, stores and
reports, and *yields* the two things a turn waits on::

    SummaryWait(job, left)  ->  sent back: whether the job ended in time
    PromptPlan              ->  sent back: the engine's Generation (or thrown its error)

:func:`drive` answers those steps with blocking calls (``Session.send``), :func:`adrive`
with awaited ones (``Session.asend``). Nothing else differs between the two front ends.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, TypeVar

from convo.budget import Budget
from convo.engines.base import GenerateRequest, Sampling
from convo.errors import BudgetError, ToolsNotSupported
from convo.plan import PromptPlan
from convo.summarize import SummaryJob
from convo.tokens import TokenCounter, check_tools_fit

R = TypeVar("R")


class TurnOptions(TypedDict, total=False):
    """The keyword arguments of a turn (:meth:`Session.send`, :meth:`Session.reply`,
    :meth:`Session.asend`, and the streams):

    * ``sampling``: decoding settings (default: the session's);
    * ``timeout_s``: wall-clock limit of the generate call (default: the session's);
    * ``on_text``: called with each new piece of the reply;
    * ``cancel``: a ``threading.Event``; set it to stop generation early;
    * ``stop``: strings that end the reply where they first appear (not part of it);
    * ``tools``: OpenAI function tools the model may call (``[{"type": "function",
      "function": {"name", "description", "parameters"}}]``). Their schemas are a pinned
      part of the prompt (``parts["tools"]``); the reply's calls are stored on the
      assistant message (:attr:`Reply.tool_calls <convo.session.Reply.tool_calls>`);
    * ``tool_choice``: ``"auto"``, ``"none"``, ``"required"`` or a named function
      (OpenAI's; default the engine's);
    * ``parallel_tool_calls``: whether the model may ask for several calls at once;
    * ``on_tool_call_delta``: called with each
      :class:`~convo.models.generation.ToolCallDelta` while the reply streams.
    """

    sampling: Sampling | None
    timeout_s: float | None
    on_text: Any
    cancel: threading.Event | None
    stop: Sequence[str]
    tools: Sequence[Mapping[str, Any]] | None
    tool_choice: str | Mapping[str, Any] | None
    parallel_tool_calls: bool | None
    on_tool_call_delta: Any


@dataclass(frozen=True)
class TurnArgs:
    """:class:`TurnOptions` with their defaults (an unknown keyword is a ``TypeError``)."""

    sampling: Sampling | None = None
    timeout_s: float | None = None
    on_text: Any = None
    cancel: threading.Event | None = None
    stop: Sequence[str] = ()
    tools: Sequence[Mapping[str, Any]] | None = None
    tool_choice: str | Mapping[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    on_tool_call_delta: Any = None

    @property
    def wants_tools(self) -> bool:
        """The turn offers the model tools (or a ``tool_choice`` other than ``"none"``)."""
        return bool(self.tools) or (self.tool_choice is not None and self.tool_choice != "none")


def check_turn_tools(
    args: TurnArgs, *, engine: Any, counter: TokenCounter, budget: Budget, pinned_tokens: int
) -> None:
    """Refuse a turn's tools before anything is stored: an engine that does not declare
    ``supports_tools``, a malformed tool or ``tool_choice``, or schemas that do not fit
    beside the pinned messages (``pinned_tokens``) under ``budget.pinned_cap``.

    Raises:
        ToolsNotSupported: tools on an engine without them.
        ConfigError: a malformed tool or ``tool_choice``.
        BudgetError: the schemas do not fit.
    """
    if not args.wants_tools:
        return
    # The capability an engine declares (an engine that predates tools lacks it: False).
    if not engine.supports_tools:
        raise ToolsNotSupported(
            f"{type(engine).__name__} does not support tools; drop tools= / tool_choice=, or "
            "use an engine that declares supports_tools (OpenAIEngine, --engine-url)"
        )
    GenerateRequest(
        max_new_tokens=budget.max_new_tokens,
        tools=args.tools,
        tool_choice=args.tool_choice,
        parallel_tool_calls=args.parallel_tool_calls,
    )  # ConfigError: a malformed tool or tool_choice
    if not args.tools:
        return
    cost = check_tools_fit(counter, args.tools, budget)
    if pinned_tokens + cost > budget.pinned_cap:
        raise BudgetError(
            f"the {len(args.tools)} tool schema(s) take {cost} tokens and the pinned messages "
            f"{pinned_tokens}, over pinned_tokens={budget.pinned_cap}; send fewer or shorter "
            "tools, or raise Budget.pinned_tokens or context_tokens"
        )


@dataclass(frozen=True)
class SummaryWait:
    """A step of a turn: wait up to ``left`` seconds (``None``: no limit) for ``job``."""

    job: SummaryJob
    left: float | None


#: What a turn yields: a summary to wait for, or a prompt to generate.
Step = SummaryWait | PromptPlan


@dataclass(frozen=True)
class _Raised:
    """A step's outcome that is an exception (thrown into the turn)."""

    error: Exception


class _Driver:
    """Feeds each step's outcome, its value or its exception, back into a turn."""

    def __init__(self, turn: Generator[Step, Any, Any]) -> None:
        self._turn = turn
        self.step: Step | None = None
        self.result: Any = None
        self.resume(None)

    def resume(self, outcome: Any) -> None:
        try:
            if isinstance(outcome, _Raised):
                self.step = self._turn.throw(outcome.error)
            else:
                self.step = self._turn.send(outcome)
        except StopIteration as done:
            self.step, self.result = None, done.value


def drive(turn: Generator[Step, Any, R], do: Callable[[Step], Any]) -> R:
    """Run ``turn`` to its end, answering each step with ``do(step)`` (blocking)."""
    driver = _Driver(turn)
    while (step := driver.step) is not None:
        try:
            outcome = do(step)
        except Exception as exc:
            outcome = _Raised(exc)
        driver.resume(outcome)
    return driver.result


async def adrive(turn: Generator[Step, Any, R], do: Callable[[Step], Awaitable[Any]]) -> R:
    """:func:`drive`, awaiting ``do(step)`` for each step (the same turn)."""
    driver = _Driver(turn)
    while (step := driver.step) is not None:
        try:
            outcome = await do(step)
        except Exception as exc:
            outcome = _Raised(exc)
        driver.resume(outcome)
    return driver.result
