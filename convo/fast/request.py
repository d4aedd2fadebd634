"""One generation the decode loop runs (:class:`DecodeRequest`): the prompt's token ids, its
limits and sampling, and what the scheduler fills in as it runs."""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from convo.fast.kv_shift import KVShift
from convo.models.generation import FinishReason, Priority

__all__ = ["WORK_KINDS", "DecodeRequest", "decode_priority", "work_kind"]

#: The kinds of work whose prompt tokens the scheduler counts apart
#: (:attr:`~convo.models.generation.SchedulerStats.prompt_tokens_by_work`): a turn a user
#: waits for (``reply``: priority :attr:`~Priority.REPLY` or more urgent), work nobody
#: waits on token by token (``background``: the summaries), a prompt's KV computed ahead
#: of its turn (``prefill``: ``prefill_only``).
WORK_KINDS = ("reply", "background", "prefill")

_ARRIVALS = itertools.count()
#: The priority :func:`decode_priority` (deprecated) sets for requests made in its block.
#: Goes away with it: pass ``priority=`` to ``generate`` (or to :class:`DecodeRequest`).
_PRIORITY: contextvars.ContextVar[int] = contextvars.ContextVar(
    "convo_decode_priority", default=Priority.REPLY
)


@contextlib.contextmanager
def decode_priority(level: int) -> Iterator[None]:
    """Deprecated: pass ``priority=Priority.BACKGROUND`` in the generate options instead
    (:class:`~convo.engines.base.GenerateOptions`; the summaries do).

    Requests made inside the block (in this thread or task) that name no priority get
    ``level`` as their :class:`Priority`."""
    warnings.warn(
        "decode_priority is deprecated; pass priority=Priority.BACKGROUND to generate()",
        DeprecationWarning,
        stacklevel=3,
    )
    token = _PRIORITY.set(int(level))
    try:
        yield
    finally:
        _PRIORITY.reset(token)


@dataclass(eq=False, kw_only=True)
class DecodeRequest:
    """One generation handed to :class:`DecodeScheduler` (model token ids in and out).

    Args:
        ids: the prompt, as model token ids.
        max_new_tokens: cap on the reply.
        deadline: ``time.monotonic()`` value at which generation stops (finish ``timeout``).
        sampling: an object with ``temperature``, ``top_p``, ``top_k``,
            ``repetition_penalty``, ``seed`` and ``min_new_tokens`` (``Sampling``).
        eos: token ids that end the reply (finish ``stop``).
        cache_key: the session whose slot (and cached tokens) to use.
        on_token: called with each new token id; returning True stops (a stop string).
        cancel: set to stop early (finish ``cancelled``).
        priority: :class:`Priority` (or any int, lower first): replies before summaries.
            Default ``Priority.REPLY`` (or the deprecated :func:`decode_priority` in effect).
    """

    ids: list[int]
    max_new_tokens: int
    deadline: float
    sampling: Any
    eos: frozenset[int] = frozenset()
    cache_key: str | None = None
    on_token: Callable[[int], bool] | None = None
    cancel: threading.Event | None = None
    priority: int = field(default_factory=_PRIORITY.get)
    #: The session this work is done for (a summary): it runs from that session's slot and
    #: KV, and keeps none of its own (``cache_key`` is ignored for keeping).
    owner: str | None = None
    #: Compute the KV of ``ids`` for ``cache_key`` and stop: nothing is sampled.
    prefill_only: bool = False
    # Filled in by the scheduler.
    new_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    kv_tokens: int = 0
    slot: int = -1
    started_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished_at: float | None = None
    finish: FinishReason | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    _generator: Any = None
    _order: int = field(default_factory=lambda: next(_ARRIVALS))
    _shared: int = 0  # tokens of the owner's cache this work shares
    _parked: str | None = None  # host key of its own KV, parked when it was preempted
    _novel: int = 0  # novel prompt tokens (counted at submit), added once its prompt is in
    _shift: tuple[KVShift, ...] = ()  # cached runs to move once its slot is ready (context shift)
    #: prompt positions ``[a, b)`` the moved runs fill past ``kv_tokens``, in order: not prefilled
    _holes: tuple[tuple[int, int], ...] = ()

    #: Times the scheduler stopped this request to free its slot for a reply.
    preemptions: int = 0

    @property
    def position(self) -> int:
        """Where the last sampled token goes in the slot."""
        return len(self.ids) + len(self.new_ids) - 1

    def context(self) -> list[int]:
        """The tokens to prefill before the next token is sampled: the prompt, and for a
        request that was preempted, the reply so far."""
        return self.ids + self.new_ids if self.new_ids else self.ids

    def held(self) -> list[int]:
        """The tokens whose K/V its slot holds."""
        return (self.ids + self.new_ids)[: self.kv_tokens]

    @property
    def session(self) -> str | None:
        """Whose KV the slot holds for: the owner of work done for a session, else ``cache_key``."""
        return self.owner if self.owner is not None else self.cache_key

    def kept(self) -> list[int]:
        """What the slot keeps for the session when this request lets go: what it holds,
        or for work done for an ``owner``, only the owner's tokens it shares."""
        held = self.held()
        return held[: min(self._shared, len(held))] if self.owner is not None else held

    def _stop_reason(self, now: float) -> FinishReason | None:
        if self.cancel is not None and self.cancel.is_set():
            return FinishReason.CANCELLED
        if now >= self.deadline:
            return FinishReason.TIMEOUT
        return None


def work_kind(req: DecodeRequest) -> str:
    """Which of :data:`WORK_KINDS` ``req`` is."""
    if req.prefill_only:
        return "prefill"
    return "reply" if req.priority <= Priority.REPLY else "background"
