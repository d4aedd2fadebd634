"""Host memory for the KV of sessions that lost their slot (:class:`HostKVStore`).

When the slot pool gives a session's slot to another session, the session's cached tokens
are copied here (on CUDA on a side stream, so the copy runs on the copy engine beside the
model's steps) instead of being dropped. Its next turn copies them back into whichever slot
it gets and prefills only what is new.

The memory is one :class:`HostKVArena`, taken once when host memory is set
(:meth:`~convo.fast.kv_pool.KVSlotPool.set_host_memory`, at the engine's start, never on the
scheduler's step path) and cut into fixed blocks: one block holds
:data:`~convo.fast.kv_pool.HOST_BLOCK_TOKENS` tokens of every layer's K and V (and an fp8
pool's scales) of one slot. An entry holds block indices; dropping it returns its blocks to
the free list. So the bytes held are exactly ``blocks in use x block bytes``, and the
process holds the arena and nothing more: before it, each swap took fresh pinned buffers,
and PyTorch's pinned caching allocator (sizes rounded up to powers of two, freed blocks
kept) held ~4x the bytes accounted (RSS 84 GB at a 32 GiB limit on the H200). On CUDA the
arena is page-locked (``cudaHostRegister`` of one plain allocation: no rounding); on CPU it
is a plain tensor, the same code path.

The store is bounded in bytes (``limit_bytes``; the arena is the whole blocks that fit in
it). Beyond it, entries are dropped in the order of the pool's
:class:`~convo.fast.kv_policy.EvictionPolicy` (the one needed last first, among equals the
one of fewest tokens). An entry larger than the whole arena is never kept.

Every copy into or out of the arena runs on the pool's one side stream (on CPU, within the
call), in the order it was issued: a block freed while a copy from it may still run is
only written by a later copy on the same stream, after that one. So blocks go back to the
free list at once, and dropping an entry never waits.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from convo.errors import ConfigError
from convo.fast.kv_policy import CacheUse, EvictionPolicy

__all__ = ["HostEntry", "HostKVArena", "HostKVStore"]

log = logging.getLogger(__name__)

#: One region of a block: the dtype of a pool tensor and the shape of one token of it in
#: one slot (``(kv_heads, head_dim)`` for K and V, ``(kv_heads,)`` for fp8 scales).
Region = tuple[Any, tuple[int, ...]]


class HostKVArena:
    """One host buffer, taken once, cut into ``blocks`` blocks of ``block_tokens`` tokens.

    The buffer (:attr:`tensor`, uint8) holds one region per pool tensor, each viewed as
    ``[blocks, block_tokens, *token_shape]`` (:attr:`views`): block ``b`` of region ``i``
    is ``views[i][b]``, and a run of consecutive blocks is one contiguous range of each
    region (one copy per pool tensor per run). :meth:`alloc` hands out block indices from
    a free list, consecutive ones when it can; :meth:`free` takes them back. Nothing is
    allocated after construction.

    Args:
        layout: the regions, in the pool's tensor order (:data:`Region`).
        block_tokens: tokens one block holds.
        blocks: how many blocks.
        pin: page-lock the buffer for asynchronous copies (CUDA pools; ``cudaHostRegister``
            of a plain allocation, so no allocator rounds it up).

    Example:
        >>> import torch                                          # doctest: +SKIP
        >>> arena = HostKVArena([(torch.float32, (2, 4))], block_tokens=128, blocks=3,
        ...                     pin=False)                        # doctest: +SKIP
        >>> arena.block_bytes, arena.nbytes, arena.alloc(2)       # doctest: +SKIP
        (4096, 12288, [0, 1])
    """

    def __init__(self, layout: Sequence[Region], *, block_tokens: int, blocks: int, pin: bool) -> None:
        import torch

        if block_tokens < 1 or blocks < 0:
            raise ConfigError("an arena needs block_tokens >= 1 and blocks >= 0")
        self.block_tokens, self.blocks = block_tokens, blocks
        self.block_bytes = self.block_nbytes(layout, block_tokens)
        self.tensor = torch.empty(blocks * self.block_bytes, dtype=torch.uint8)
        self.pinned = bool(pin and blocks) and self._pin()
        self.views: list[Any] = []
        offset = 0
        for dtype, shape in layout:
            size = blocks * _region_bytes(dtype, shape, block_tokens)
            region = self.tensor[offset : offset + size].view(dtype)
            self.views.append(region.view(blocks, block_tokens, *shape))
            offset += size
        self._free: list[int] = list(range(blocks))  # sorted
        self._used: set[int] = set()

    @staticmethod
    def block_nbytes(layout: Sequence[Region], block_tokens: int) -> int:
        """Bytes of one block of ``layout``: the regions' token bytes times ``block_tokens``."""
        return sum(_region_bytes(dtype, shape, block_tokens) for dtype, shape in layout)

    def _pin(self) -> bool:
        import torch

        cudart = torch.cuda.cudart()
        ptr, size = self.tensor.data_ptr(), self.tensor.numel()
        if cudart.cudaHostRegister(ptr, size, 0) != cudart.cudaError.success:
            # Rare (no room to lock pages): one pinned allocation instead, taken once.
            log.warning("cudaHostRegister of %d bytes failed; taking pinned memory from torch", size)
            self.tensor = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            return True
        weakref.finalize(self, _unregister, ptr, self.tensor)
        return True

    @property
    def nbytes(self) -> int:
        """Bytes of the whole arena (what host KV reserves)."""
        return self.blocks * self.block_bytes

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return len(self._used)

    def blocks_for(self, tokens: int) -> int:
        """Blocks an entry of ``tokens`` tokens takes."""
        return -(-tokens // self.block_tokens)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` free blocks (the first run of ``n`` consecutive ones, else the lowest ``n``),
        or ``None`` when fewer are free."""
        if n > len(self._free):
            return None
        free, start = self._free, 0
        for i in range(len(free) - n + 1):
            if free[i + n - 1] - free[i] == n - 1:
                start = i
                break
        got = free[start : start + n]
        del free[start : start + n]
        self._used.update(got)
        return got

    def free(self, blocks: Sequence[int]) -> None:
        """Take ``blocks`` back (each must be in use)."""
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"block {b} is not in use")
            self._used.discard(b)
        self._free = sorted([*self._free, *blocks])

    def runs(self, blocks: Sequence[int], tokens: int) -> list[tuple[int, int, int, int]]:
        """The runs of consecutive blocks among ``blocks`` (an entry's, in token order)
        holding its first ``tokens`` tokens: ``(first block, blocks, first token, end
        token)`` each, one copy per pool tensor."""
        out, i = [], 0
        while i < len(blocks):
            j = i
            while j + 1 < len(blocks) and blocks[j + 1] == blocks[j] + 1:
                j += 1
            start, end = i * self.block_tokens, min((j + 1) * self.block_tokens, tokens)
            if end > start:
                out.append((blocks[i], j - i + 1, start, end))
            i = j + 1
        return out

    def run_views(self, first: int, count: int, tokens: int) -> list[Any]:
        """Each region's ``[tokens, *token_shape]`` view of a run of ``count`` blocks from
        block ``first`` (contiguous)."""
        return [v[first : first + count].flatten(0, 1)[:tokens] for v in self.views]


def _region_bytes(dtype: Any, shape: tuple[int, ...], block_tokens: int) -> int:
    return block_tokens * math.prod(shape) * int(dtype.itemsize)


def _unregister(ptr: int, tensor: Any) -> None:
    try:
        import torch

        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # at interpreter exit CUDA may be gone already
        pass
    del tensor


@dataclass(eq=False)
class HostEntry:
    """One session's KV in host memory.

    Attributes:
        key: the session.
        tokens: the tokens whose K/V the blocks hold (positions ``0..len(tokens)-1``).
        blocks: the arena blocks holding them, in token order.
        nbytes: bytes of those blocks (``len(blocks) x`` the arena's block bytes).
        last_used: clock time the session last let go of its KV.
        event: CUDA event recorded after the copy that fills the blocks; ``None`` on CPU
            (copies there are done when the call returns).
    """

    key: str
    tokens: list[int]
    blocks: list[int]
    nbytes: int
    last_used: float
    event: Any = None

    def wait(self) -> None:
        """Block until the copy into the blocks is done."""
        if self.event is not None:
            self.event.synchronize()

    def done(self) -> bool:
        """Whether that copy is done (never blocks)."""
        return self.event is None or bool(self.event.query())

    def use(self) -> CacheUse:
        return CacheUse(key=self.key, tokens=len(self.tokens), last_used=self.last_used)


@dataclass
class HostKVStore:
    """Sessions' KV in host memory: the blocks of one :class:`HostKVArena`.

    Args:
        limit_bytes: the bound asked for (> 0; a pool without host memory has no store).
        policy: orders entries for dropping (the pool's).
        arena: the blocks (the whole blocks that fit in ``limit_bytes``).

    Attributes:
        dropped: entries dropped because the store was full (counted, never reset).
        peak_bytes: most bytes held at once.
    """

    limit_bytes: int
    policy: EvictionPolicy
    arena: HostKVArena
    dropped: int = 0
    peak_bytes: int = 0
    _entries: dict[str, HostEntry] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.limit_bytes < 1:
            raise ConfigError("host KV memory must be > 0 bytes (0 = no host store)")
        if self.arena.nbytes > self.limit_bytes:
            raise ConfigError("the arena is larger than the host KV limit")

    @property
    def nbytes(self) -> int:
        """Bytes held now: blocks in use times the block bytes."""
        return self.arena.used_blocks * self.arena.block_bytes

    @property
    def reserved_bytes(self) -> int:
        """Bytes the arena takes, held or not (what the process holds for host KV)."""
        return self.arena.nbytes

    def keys(self) -> list[str]:
        return list(self._entries)

    def get(self, key: str) -> HostEntry | None:
        return self._entries.get(key)

    def fits(self, nbytes: int) -> bool:
        """Whether an entry of ``nbytes`` may be kept at all."""
        return nbytes <= self.arena.nbytes

    def would_keep(self, use: CacheUse, nbytes: int, *, now: float, wanted: Collection[str] = ()) -> bool:
        """Whether an entry like ``use`` of ``nbytes`` would get room by dropping only
        entries needed later than it (so that a copy that would be dropped at once is
        never made). The session's own older entry counts as room (it is replaced)."""
        if not self.fits(nbytes):
            return False
        others = [e for e in self._entries.values() if e.key != use.key]
        room = self.arena.nbytes - sum(e.nbytes for e in others)
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

    def reserve(
        self, use: CacheUse, tokens: int, *, now: float, wanted: Collection[str] = ()
    ) -> tuple[list[int], list[str]] | None:
        """Blocks for a new entry like ``use`` of ``tokens`` tokens, and the keys dropped
        to make room (the session's own older entry, then the entries needed last); or
        ``None``, dropping nothing, when it would itself be the first to go (counted in
        :attr:`dropped`)."""
        n = self.arena.blocks_for(tokens)
        if not self.would_keep(use, n * self.arena.block_bytes, now=now, wanted=wanted):
            self.dropped += 1
            return None
        gone = []
        if use.key in self._entries:
            self.discard(use.key)
        while self.arena.free_blocks < n:
            worst = max(self._entries.values(), key=lambda e: self._drop_key(e.use(), now, wanted))
            self.discard(worst.key)
            self.dropped += 1
            gone.append(worst.key)
        blocks = self.arena.alloc(n)
        assert blocks is not None  # room was made above
        return blocks, gone

    def put(self, entry: HostEntry) -> None:
        """Keep ``entry``, whose blocks came from :meth:`reserve` (and hold its tokens once
        its copy is done)."""
        old = self._entries.pop(entry.key, None)
        if old is not None:
            self.arena.free(old.blocks)
        self._entries[entry.key] = entry
        self.peak_bytes = max(self.peak_bytes, self.nbytes)

    def rename(self, key: str, new_key: str, *, now: float) -> None:
        """Keep ``key``'s entry under ``new_key`` instead (same blocks, no copy), last used
        ``now``: a session's KV handed to work that reads it (:meth:`KVSlotPool.acquire`'s
        ``handoff``). Nothing happens when there is no such entry."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self.discard(new_key)
        self._entries[new_key] = replace(entry, key=new_key, last_used=now)

    def discard(self, key: str) -> None:
        """Drop the session's entry; its blocks go back to the free list at once (the
        module docstring says why that is safe while a copy from them runs)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.arena.free(entry.blocks)

    def clear(self) -> None:
        for key in list(self._entries):
            self.discard(key)
