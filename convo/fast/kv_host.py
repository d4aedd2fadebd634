"""Host memory for the KV of sessions that lost their slot (:class:`HostKVStore`).

When the slot pool gives a session's slot to another session, the session's cached tokens
are copied here (pinned memory and a side stream on CUDA, so the copy runs on the copy
engine beside the model's steps; plain tensors on CPU) instead of being dropped. Its next
turn copies them back into whichever slot it gets and prefills only what is new.

The store is bounded in bytes (``limit_bytes``; the engine's default is
:func:`convo.models.defaults.default_kv_host_memory`). Beyond it, entries are dropped in the
order of the pool's :class:`~convo.fast.kv_policy.EvictionPolicy` (the one needed last
first, among equals the one of fewest tokens). An entry larger than the whole limit is
never kept.

An entry holds the copy's tensors and the CUDA event after which the copy is complete: an
entry is never let go of (dropped, or handed back to a slot) while a copy into or out of
it may still run.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from convo.errors import ConfigError
from convo.fast.kv_policy import CacheUse, EvictionPolicy

__all__ = ["HostEntry", "HostKVStore"]


@dataclass(eq=False)
class HostEntry:
    """One session's KV in host memory.

    Attributes:
        key: the session.
        tokens: the tokens whose K/V the tensors hold (positions ``0..len(tokens)-1``).
        tensors: one host tensor per pool tensor (:meth:`~convo.fast.kv_pool.KVSlotPool.slot_tensors`).
        nbytes: bytes of those tensors.
        last_used: clock time the session last let go of its KV.
        event: CUDA event recorded after the copy that fills (or reads) the tensors;
            ``None`` on CPU (copies there are done when the call returns).
    """

    key: str
    tokens: list[int]
    tensors: list[Any]
    nbytes: int
    last_used: float
    event: Any = None

    def wait(self) -> None:
        """Block until the copy into or out of the tensors is done."""
        if self.event is not None:
            self.event.synchronize()

    def done(self) -> bool:
        """Whether that copy is done (never blocks)."""
        return self.event is None or bool(self.event.query())

    def use(self) -> CacheUse:
        return CacheUse(key=self.key, tokens=len(self.tokens), last_used=self.last_used)


@dataclass
class HostKVStore:
    """Sessions' KV in host memory, at most ``limit_bytes`` of it.

    Args:
        limit_bytes: the bound (> 0; a pool without host memory has no store).
        policy: orders entries for dropping (the pool's).

    Attributes:
        dropped: entries dropped because the store was full (counted, never reset).
        peak_bytes: most bytes held at once.
    """

    limit_bytes: int
    policy: EvictionPolicy
    dropped: int = 0
    peak_bytes: int = 0
    _entries: dict[str, HostEntry] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.limit_bytes < 1:
            raise ConfigError("host KV memory must be > 0 bytes (0 = no host store)")

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return sum(e.nbytes for e in self._entries.values())

    def keys(self) -> list[str]:
        return list(self._entries)

    def get(self, key: str) -> HostEntry | None:
        return self._entries.get(key)

    def fits(self, nbytes: int) -> bool:
        """Whether an entry of ``nbytes`` may be kept at all."""
        return nbytes <= self.limit_bytes

    def would_keep(self, use: CacheUse, nbytes: int, *, now: float, wanted: Collection[str] = ()) -> bool:
        """Whether an entry like ``use`` of ``nbytes`` would survive :meth:`put` (so that
        a copy that would be dropped at once is never made)."""
        if nbytes > self.limit_bytes:
            return False
        others = [e for e in self._entries.values() if e.key != use.key]
        room = self.limit_bytes - sum(e.nbytes for e in others)
        mine = self._drop_key(use, now, wanted)
        for e in sorted(others, key=lambda e: self._drop_key(e.use(), now, wanted), reverse=True):
            if room >= nbytes:
                break
            if self._drop_key(e.use(), now, wanted) < mine:
                return False  # everything left is worth more than the newcomer
            room += e.nbytes
        return room >= nbytes

    def _drop_key(self, use: CacheUse, now: float, wanted: Collection[str]) -> tuple[float, int]:
        """Larger is dropped first: needed last, then fewer tokens (cheaper to recompute)."""
        return (self.policy.next_use_s(use, now, wanted), -use.tokens)

    def put(self, entry: HostEntry, *, now: float, wanted: Collection[str] = ()) -> list[str]:
        """Keep ``entry`` (replacing the session's older one), then drop entries in the
        policy's order until the store is within its limit; returns the dropped keys
        (possibly ``entry``'s own, when it is the one needed last)."""
        old = self._entries.pop(entry.key, None)
        if old is not None:
            old.wait()
        self._entries[entry.key] = entry
        dropped = []
        while self.nbytes > self.limit_bytes:
            worst = max(self._entries.values(), key=lambda e: self._drop_key(e.use(), now, wanted))
            self.discard(worst.key)
            self.dropped += 1
            dropped.append(worst.key)
        self.peak_bytes = max(self.peak_bytes, self.nbytes)
        return dropped

    def pop(self, key: str) -> HostEntry | None:
        """Take the session's entry out (the caller keeps it alive until its copy is done)."""
        return self._entries.pop(key, None)

    def discard(self, key: str) -> None:
        """Drop the session's entry, once no copy runs on it."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            entry.wait()

    def clear(self) -> None:
        for key in list(self._entries):
            self.discard(key)
