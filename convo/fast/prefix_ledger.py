"""What each session's KV last held: the prompt tokens an unbounded exact cache would still prefill.

A turn's prompt shares a prefix with what its session's KV held after the turn before (the
system prompt, the summary, the kept window, the last reply). Only the tokens past that
prefix are new to the session; an exact KV cache with room for every session would prefill
those and nothing else. The scheduler prefills more when a session's KV was evicted and
dropped (a cache miss). :class:`PrefixLedger` remembers, per session, the token sequence
its KV last held, so the scheduler can count the novel part of every prompt beside what it
prefilled::

    what the session's KV held:  | system | summary | turn 1 | reply 1 |
    the next prompt:             | system | summary | turn 1 | reply 1 | turn 2 |
                                                                       ^ novel from here
    after a window slide:        | system | summary' | turn 2 | ...
                                           ^ novel from here (the prefix changed)

``prompt tokens prefilled - novel prompt tokens`` is then what evictions cost.

Memory is bounded by :data:`MAX_LEDGER_TOKENS` (tokens remembered in all, as 32-bit ints);
past it the least recently used sessions are dropped, and a dropped session counts as
unknown: all of its next prompt is novel, so the floor then reads high.

No torch here: the ledger sees keys and token ids.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

from convo.errors import ConfigError
from convo.tokens import common_prefix_length

__all__ = ["MAX_LEDGER_TOKENS", "PrefixLedger"]

#: Tokens the ledger remembers in all sessions together (4 bytes each: 32 MB at this bound).
#: Past it the least recently used sessions are dropped; their next prompts count as wholly
#: novel (the floor reads high). 8 million tokens is ~4,000 sessions of 2,048-token windows.
MAX_LEDGER_TOKENS = 8_000_000


class PrefixLedger:
    """The last token sequence each key's KV held, for counting novel prompt tokens.

    Not thread-safe: the owner (:class:`~convo.fast.scheduler.DecodeScheduler`) calls it
    under its own lock.

    Args:
        max_tokens: tokens remembered in all (:data:`MAX_LEDGER_TOKENS`); the least
            recently used keys (by :meth:`novel` or :meth:`remember`) are dropped past it.

    Raises:
        ConfigError: ``max_tokens`` < 0.

    Example::

        >>> ledger = PrefixLedger()
        >>> ledger.novel("a", [1, 2, 3])  # unknown: all of it
        3
        >>> ledger.remember("a", [1, 2, 3, 9])
        >>> ledger.novel("a", [1, 2, 3, 9, 4, 5])  # it extends what the KV held
        2
        >>> ledger.novel("a", [1, 7, 3, 9])  # the prefix changed at the second token
        3
    """

    def __init__(self, *, max_tokens: int = MAX_LEDGER_TOKENS) -> None:
        if max_tokens < 0:
            raise ConfigError(f"max_tokens must be >= 0, not {max_tokens}")
        self.max_tokens = max_tokens
        self._seqs: OrderedDict[str, array[int]] = OrderedDict()
        self._tokens = 0

    def novel(self, key: str | None, ids: Sequence[int]) -> int:
        """Tokens of ``ids`` past their common prefix with what ``key``'s KV last held:
        all of them when ``key`` is ``None`` or unknown (never seen, forgotten, dropped)."""
        if key is None or key not in self._seqs:
            return len(ids)
        self._seqs.move_to_end(key)
        return len(ids) - common_prefix_length(ids, self._seqs[key])

    def remember(self, key: str, seq: Sequence[int]) -> None:
        """``key``'s KV now holds ``seq`` (it replaces what was remembered)."""
        self.forget(key)
        self._seqs[key] = array("i", seq)
        self._tokens += len(seq)
        while self._tokens > self.max_tokens:  # (a sequence longer than the bound goes too)
            _, dropped = self._seqs.popitem(last=False)
            self._tokens -= len(dropped)

    def forget(self, key: str) -> None:
        """Drop what is remembered for ``key`` (a closed session); no-op if nothing is."""
        seq = self._seqs.pop(key, None)
        if seq is not None:
            self._tokens -= len(seq)

    @property
    def tokens(self) -> int:
        """Tokens remembered now, all keys together."""
        return self._tokens

    def __len__(self) -> int:
        """Keys remembered now."""
        return len(self._seqs)
