"""Which kept KV cache to give away first: eviction by expected next use.

A chat server has more sessions than KV slots, and its users pause between turns. The
session whose slot was used least recently (LRU's victim) is, under that load, the one
whose user has been reading and typing longest: the next to speak. Evicting it is the
worst choice; the session that just got its reply will be silent for a whole think time.

:class:`NextUsePolicy` estimates, for every kept cache, the seconds until its session is
expected to need it again, and gives away the one needed last (Belady's rule with an
estimate of the future):

* a session with queued work (its next turn, a summary due for it, a background prefill:
  the ``wanted`` keys) needs its cache now: ``0``, kept whatever else;
* a session that has been idle ``age`` seconds, whose users take ``think`` seconds between
  turns, is expected back in ``|think - age|`` seconds: just replied, a whole think time;
  about due, now; long overdue, probably gone (the estimate grows again with the age);
* ``think`` is learnt per session (an exponential average of the gaps between its
  release and its next turn), else the average over all sessions, else
  :data:`DEFAULT_THINK_S`.

The same order decides what host memory drops when it is full (the entry needed last;
among equals the one of fewest tokens, the cheapest to recompute). A closed session is
forgotten by the pool itself (worth nothing). :class:`LRUPolicy` is the old order, kept for
comparison (``benchmarks/kv_policy.py`` and the tests).

No torch here: the policy sees keys, token counts and times.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "DEFAULT_THINK_S",
    "GONE_THINK_FACTOR",
    "MAX_TRACKED_SESSIONS",
    "THINK_EMA_WEIGHT",
    "CacheUse",
    "EvictionPolicy",
    "LRUPolicy",
    "NextUsePolicy",
]

#: Seconds a user is assumed to read and type between turns before any gap was observed.
DEFAULT_THINK_S = 5.0
#: Weight of the newest observed gap in a session's (and the global) think-time average.
THINK_EMA_WEIGHT = 0.3
#: Sessions whose release times and think times the policy remembers (the oldest go first).
MAX_TRACKED_SESSIONS = 65536
#: A session idle longer than this many think times is no longer "thinking": its user has
#: left or paused. Background work for another session, which never evicts a thinking
#: session, may take its slot (its KV goes to host memory when there is some).
GONE_THINK_FACTOR = 3.0


@dataclass(frozen=True)
class CacheUse:
    """What a policy sees of one kept cache (in a slot or in host memory).

    Attributes:
        key: the session (cache key).
        tokens: tokens the cache holds.
        last_used: clock time the session last let go of it.
    """

    key: str
    tokens: int
    last_used: float


class EvictionPolicy(Protocol):
    """Orders kept caches for eviction; told when sessions come and go."""

    def next_use_s(self, use: CacheUse, now: float, wanted: Collection[str]) -> float:
        """How far off the cache's next use is: the largest is given away first."""
        ...

    def thinking(self, use: CacheUse, now: float) -> bool:
        """Whether the session's user may still be reading or typing (its cache is kept
        from background work done for other sessions)."""
        ...

    def released(self, key: str, now: float) -> None:
        """The session's turn ended at ``now`` (its reply is out)."""
        ...

    def returned(self, key: str, now: float) -> None:
        """The session's next turn arrived at ``now``."""
        ...

    def forget(self, key: str) -> None:
        """The session is closed."""
        ...


class NextUsePolicy:
    """Give away the cache whose session is expected to speak last (module docstring).

    Args:
        think_s: the think time assumed before any gap was observed
            (:data:`DEFAULT_THINK_S`).
        weight: weight of a new gap in the averages (:data:`THINK_EMA_WEIGHT`).
    """

    def __init__(self, *, think_s: float = DEFAULT_THINK_S, weight: float = THINK_EMA_WEIGHT) -> None:
        self.default_think_s = think_s
        self.weight = weight
        self._released: OrderedDict[str, float] = OrderedDict()
        self._think: OrderedDict[str, float] = OrderedDict()
        self._global: float | None = None

    def think_s(self, key: str) -> float:
        """The think time expected of ``key``'s user."""
        own = self._think.get(key)
        if own is not None:
            return own
        return self._global if self._global is not None else self.default_think_s

    def next_use_s(self, use: CacheUse, now: float, wanted: Collection[str]) -> float:
        if use.key in wanted:
            return 0.0
        return abs(self.think_s(use.key) - max(now - use.last_used, 0.0))

    def thinking(self, use: CacheUse, now: float) -> bool:
        return now - use.last_used <= GONE_THINK_FACTOR * self.think_s(use.key)

    def released(self, key: str, now: float) -> None:
        self._released[key] = now
        self._released.move_to_end(key)
        _bound(self._released)

    def returned(self, key: str, now: float) -> None:
        last = self._released.pop(key, None)
        if last is None:
            return
        gap = max(now - last, 0.0)
        w = self.weight
        own = self._think.get(key)
        self._think[key] = gap if own is None else (1 - w) * own + w * gap
        self._think.move_to_end(key)
        _bound(self._think)
        self._global = gap if self._global is None else (1 - w) * self._global + w * gap

    def forget(self, key: str) -> None:
        self._released.pop(key, None)
        self._think.pop(key, None)


class LRUPolicy:
    """Give away the cache used least recently (the order before :class:`NextUsePolicy`;
    queued work's caches are still kept)."""

    def next_use_s(self, use: CacheUse, now: float, wanted: Collection[str]) -> float:
        return 0.0 if use.key in wanted else max(now - use.last_used, 0.0)

    def thinking(self, use: CacheUse, now: float) -> bool:
        return True  # LRU knows no think time: every kept cache is someone's

    def released(self, key: str, now: float) -> None:
        return None

    def returned(self, key: str, now: float) -> None:
        return None

    def forget(self, key: str) -> None:
        return None


def _bound(table: OrderedDict[str, float]) -> None:
    while len(table) > MAX_TRACKED_SESSIONS:
        table.popitem(last=False)
