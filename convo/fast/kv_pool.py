"""The KV slot pool: per-layer K and V tensors of every slot, taken once at start, and
:class:`PrefillChunk`, a piece of a turn to prefill into a slot.

With host memory (:meth:`KVSlotPool.set_host_memory`), a session that loses its slot keeps
its KV: the cached tokens are copied into blocks of a preallocated
:class:`~convo.fast.kv_host.HostKVArena` (a :class:`~convo.fast.kv_host.HostKVStore`
entry) and copied back into whichever slot its next turn gets. Work stopped to free its
slot (a summary a reply preempts) can be parked there too (:meth:`KVSlotPool.park`) and
resume by a copy instead of a recompute. Which slot is given away is the
:mod:`~convo.fast.kv_policy`'s choice (by default the one whose session is expected to
speak last, not the least recently used).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from convo.errors import ConfigError
from convo.fast.kv_host import HostEntry, HostKVArena, HostKVStore, Region
from convo.fast.kv_policy import CacheUse, EvictionPolicy, NextUsePolicy
from convo.fast.kv_shift import KVShift, find_shifts, shift_kv, shifted_tokens
from convo.models.defaults import FP8_KV_SCALE_BYTES, FP8_KV_SCALE_DTYPE, KV_POOL_ALIGN_BYTES, kv_pool_bytes
from convo.tokens import common_prefix_length

#: Tokens of one block of the host KV arena (every layer's K and V, and an fp8 pool's
#: scales, of one slot): host memory is taken and accounted in whole blocks, and an entry's
#: run of consecutive blocks moves in one copy per pool tensor.
HOST_BLOCK_TOKENS = 128
#: Host keys of work parked by :meth:`KVSlotPool.park` start with this (no session's key
#: does): they are the work's own KV, not a session's, and :meth:`KVSlotPool.owners` omits them.
PARKED_PREFIX = "\x00parked:"


@dataclass(frozen=True)
class PrefillChunk:
    """Tokens ``ids[start:end]`` of one turn, to run into slot ``slot`` (which holds
    ``ids[:start]`` already): what the scheduler hands the decoder's prefill."""

    slot: int
    ids: Sequence[int]
    start: int
    end: int


@dataclass
class _Slot:
    owner: str | None = None  # the cache key (session) whose tokens the slot holds
    tokens: list[int] = field(default_factory=list)  # tokens whose K/V are in the slot
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)
    guest: bool = False  # busy with work done for ``owner`` (a summary) that keeps none of its KV
    copies: list[_Copy] = field(default_factory=list)  # copies in flight on the slot


@dataclass(eq=False)
class _Copy:
    """A copy between a slot and the host arena: done once ``event`` is (``None``: done)."""

    event: Any = None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())


def _one_allocation(layout: Sequence[tuple[tuple[int, ...], Any]], device: Any) -> tuple[Any, list[Any]]:
    """One zeroed byte buffer holding a tensor of each ``(shape, dtype)`` in ``layout``,
    back to back (each offset aligned to 256 bytes, which every element size divides),
    and the tensors as views into it."""
    import torch

    sizes = [
        int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        for shape, dtype in layout
    ]
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // _ALIGN) * _ALIGN
    buffer = torch.zeros(end, dtype=torch.uint8, device=device)
    views = [
        buffer[off : off + size].view(dtype).view(shape)
        for (shape, dtype), off, size in zip(layout, offsets, sizes, strict=True)
    ]
    return buffer, views


_ALIGN = KV_POOL_ALIGN_BYTES  # bytes between the starts of the pool's tensors in its buffer


class KVSlotPool:
    """Preallocated KV memory: ``slots`` caches of ``slot_tokens`` tokens each.

    Per layer ``k[layer]`` and ``v[layer]`` are ``[slots, kv_heads, slot_tokens, head_dim]``;
    an fp8 pool (``dtype=torch.float8_e4m3fn``) also holds ``k_scale[layer]`` and
    ``v_scale[layer]``, bfloat16 ``[slots, kv_heads, slot_tokens]``: one scale per token and
    head (:func:`convo.fast.attention.quantize_kv`). :attr:`tensors` lists every tensor, each
    indexed by slot first (:meth:`slot_tensors`: every tensor a slot's KV is made of). The
    pool answers who may use which slot; the scheduler decides when to ask. With host memory
    (:meth:`set_host_memory`), :meth:`acquire` copies the KV of the session it evicts to
    host and copies a session's KV back from host; a slot it hands out is usable once
    :meth:`ready` (at once on CPU; on CUDA when the side-stream copies are done).

    Args:
        num_layers, num_kv_heads, head_dim: from the model config.
        slots: sessions that can hold KV at once.
        slot_tokens: tokens one slot holds (prompt + reply): the session budget.
        dtype, device: the KV dtype (the model's, or ``torch.float8_e4m3fn``) and device.
        policy: which kept cache to give away first
            (:class:`~convo.fast.kv_policy.NextUsePolicy` by default).
        clock: the time source of the policy (``time.monotonic``; simulations pass their own).

    Example:
        >>> pool = KVSlotPool(num_layers=2, num_kv_heads=1, head_dim=8, slots=2,
        ...                   slot_tokens=16, dtype=torch.float32, device="cpu")  # doctest: +SKIP
        >>> pool.nbytes                                        # doctest: +SKIP
        4096
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        slots: int,
        slot_tokens: int,
        dtype: Any,
        device: Any,
        policy: EvictionPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        import torch

        if slots < 1:
            raise ConfigError("kv slots must be >= 1")
        if slot_tokens < 2:
            raise ConfigError("slot_tokens must be >= 2")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.slots, self.slot_tokens = slots, slot_tokens
        self.dtype = dtype
        shape = (slots, num_kv_heads, slot_tokens, head_dim)
        #: Whether K/V are fp8 with per token and head scales (:attr:`k_scale`, :attr:`v_scale`).
        self.scaled = dtype == torch.float8_e4m3fn
        n = num_layers if self.scaled else 0
        scale_dtype = getattr(torch, FP8_KV_SCALE_DTYPE)
        layout = [(shape, dtype)] * (2 * num_layers) + [(shape[:3], scale_dtype)] * (2 * n)
        #: The pool's one device allocation; every K, V and scale tensor is a view into it.
        #: One allocation is what makes the pool's device bytes exactly the predicted ones:
        #: the CUDA allocator serves a tensor from a cached free block up to 1 MiB larger
        #: without splitting it (counted whole), so a hundred separate tensors made next to
        #: freed ones (a second decoder, after warm-up) came out MiBs over the formula.
        self.buffer, views = _one_allocation(layout, device)
        self.k, self.v = views[:num_layers], views[num_layers : 2 * num_layers]
        self.k_scale, self.v_scale = views[2 * num_layers : 2 * num_layers + n], views[2 * num_layers + n :]
        self.device = torch.device(device)
        self.policy: EvictionPolicy = policy if policy is not None else NextUsePolicy()
        self.clock = clock
        self._table = [_Slot(last_used=clock()) for _ in range(slots)]
        self._lock = threading.Lock()
        #: Host memory for evicted sessions' KV (``None``: evicted KV is dropped).
        self.host: HostKVStore | None = None
        #: Sessions' KV copied to host / back into a slot, and the bytes both moved.
        self.swaps_out = self.swaps_in = self.swap_bytes = 0
        self.swapped_in_tokens = 0  # tokens copied into slots from host memory
        #: Session prefixes copied from one slot to another (:meth:`copy_slot`), and tokens.
        self.slot_copies = self.slot_copied_tokens = 0
        self._stream: Any = None  # CUDA: the side stream the copies run on
        self._host_block_bytes: int | None = None
        #: The model's rotary inverse frequencies (float32), set by the decoder when its
        #: keys can be turned to other positions (:meth:`shift`); ``None``: they cannot.
        self.rope_inv_freq: Any = None

    @staticmethod
    def predicted_nbytes(
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        slots: int,
        slot_tokens: int,
        dtype_bytes: float,
        scaled: bool = False,
    ) -> int:
        """``2 x layers x slots x kv_heads x slot_tokens x (head_dim x dtype bytes + scale
        bytes)`` (``scaled``: an fp8 pool's bfloat16 scales): the one pool-size formula,
        :func:`convo.models.defaults.kv_pool_bytes` (the planner prices a pool with it too)."""
        return kv_pool_bytes(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            slots=slots,
            slot_tokens=slot_tokens,
            dtype_bytes=dtype_bytes,
            scale_bytes=FP8_KV_SCALE_BYTES if scaled else 0,
        )

    @property
    def tensors(self) -> list[Any]:
        """Every tensor of the pool (K, V, and an fp8 pool's scales), each indexed by slot
        first: slot ``i``'s state is ``[t[i] for t in pool.tensors]``."""
        return [*self.k, *self.v, *self.k_scale, *self.v_scale]

    @property
    def nbytes(self) -> int:
        """Bytes of the pool's device allocation (K, V, any scales, and the alignment
        between them, none for the usual sizes): what ``torch.cuda.memory_allocated`` sees."""
        return int(self.buffer.numel())

    @property
    def slot_nbytes(self) -> int:
        """Bytes one slot occupies."""
        return self.nbytes // self.slots

    def slot_tensors(self) -> list[Any]:
        """Every tensor the pool holds, each ``[slots, kv_heads, slot_tokens, ...]``: what
        one slot's KV is. The host copies go through this list only, so a tensor added here
        (scales of a quantized cache) moves with the rest, up to the cached tokens on axis 2."""
        return self.tensors

    # -- host memory -------------------------------------------------------------------------------
    def set_host_memory(self, limit_bytes: int) -> None:
        """Keep evicted sessions' KV in at most ``limit_bytes`` of host memory (0: drop it,
        the default). The arena is taken here, once: as many whole blocks
        (:attr:`host_block_bytes`) as fit, page-locked on CUDA. Call it at start, not while
        the scheduler steps (it allocates, and waits for copies to the old arena)."""
        if limit_bytes < 0:
            raise ConfigError("kv host memory must be >= 0 bytes")
        with self._lock:
            if self._stream is not None:
                self._stream.synchronize()  # no copy may still use the old arena
            if self.host is not None:
                self.host.clear()
            self.host = None
            if limit_bytes:
                arena = HostKVArena(
                    self._host_layout(),
                    block_tokens=HOST_BLOCK_TOKENS,
                    blocks=limit_bytes // self.host_block_bytes,
                    pin=self.device.type == "cuda",
                )
                self.host = HostKVStore(limit_bytes, self.policy, arena)

    @property
    def host_limit_bytes(self) -> int:
        """The host memory bound (0: none)."""
        return self.host.limit_bytes if self.host is not None else 0

    @property
    def host_reserved_bytes(self) -> int:
        """Bytes of the host arena (the whole blocks within the bound; 0: none): what the
        process holds for host KV, whatever is in use."""
        return self.host.reserved_bytes if self.host is not None else 0

    def _host_layout(self) -> list[Region]:
        layout = []
        for t in self.slot_tensors():
            if t.dim() < 3 or t.shape[2] != self.slot_tokens:
                raise ConfigError("every slot tensor needs its tokens on axis 2 to go to host memory")
            layout.append((t.dtype, (t.shape[1], *t.shape[3:])))
        return layout

    @property
    def host_block_bytes(self) -> int:
        """Bytes of one host block: :data:`HOST_BLOCK_TOKENS` tokens of one slot's KV."""
        if self._host_block_bytes is None:
            self._host_block_bytes = HostKVArena.block_nbytes(self._host_layout(), HOST_BLOCK_TOKENS)
        return self._host_block_bytes

    def host_nbytes(self, tokens: int) -> int:
        """Bytes a host copy of ``tokens`` cached tokens takes: whole blocks
        (:data:`HOST_BLOCK_TOKENS` tokens each), never more than a slot's."""
        n = min(tokens, self.slot_tokens)
        return -(-n // HOST_BLOCK_TOKENS) * self.host_block_bytes

    def _token_views(self, index: int, start: int, end: int) -> list[Any]:
        """Slot ``index``'s tokens ``start:end`` of every slot tensor, ``[tokens, ...]``."""
        return [t[index, :, start:end].movedim(1, 0) for t in self.slot_tensors()]

    def _side_stream(self) -> Any:
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # after what ran on the slot
        return self._stream

    def _copies(
        self,
        index: int,
        blocks: Sequence[int],
        tokens: int,
        *,
        out: bool,
        ranges: Sequence[tuple[int, int]] | None = None,
    ) -> Any:
        """Copy the first ``tokens`` tokens of slot ``index`` into (``out``) or from the
        host ``blocks``, run by run (``ranges``: only the tokens ``[a, b)`` of these): the
        CUDA event after which they are done (``None`` on CPU: done). One code path: on
        CUDA the copies are queued on the side stream."""
        import torch

        host = self.host
        if host is None:
            raise ConfigError("the pool has no host memory")
        arena = host.arena
        cuda = self.device.type == "cuda"
        spans = [(0, tokens)] if ranges is None else list(ranges)
        stream = self._side_stream() if cuda else None
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            for first, count, start, end in arena.runs(blocks, min(tokens, self.slot_tokens)):
                views = arena.run_views(first, count, end - start)
                for lo, hi in ((max(start, a), min(end, b)) for a, b in spans):
                    if lo >= hi:
                        continue
                    hosts = [h[lo - start : hi - start] for h in views]
                    for h, v in zip(hosts, self._token_views(index, lo, hi), strict=True):
                        if out:
                            h.copy_(v, non_blocking=cuda)
                        else:
                            v.copy_(h, non_blocking=cuda)
            if not cuda:
                return None
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def copy_out(self, index: int, tokens: int, blocks: Sequence[int]) -> Any:
        """Copy the first ``tokens`` cached tokens of slot ``index`` into host ``blocks``
        (from :meth:`~convo.fast.kv_host.HostKVStore.reserve`): the CUDA event after which
        they hold them (``None`` on CPU: done)."""
        return self._copies(index, blocks, tokens, out=True)

    def copy_in(
        self, index: int, blocks: Sequence[int], tokens: int, ranges: Sequence[tuple[int, int]] | None = None
    ) -> Any:
        """Copy ``tokens`` tokens from host ``blocks`` (filled by :meth:`copy_out`) into
        slot ``index`` (``ranges``: only the tokens ``[a, b)`` of these, at their
        positions): the CUDA event after which the slot holds them (``None`` on CPU)."""
        return self._copies(index, blocks, tokens, out=False, ranges=ranges)

    def ready(self, index: int, *, wait: bool = False) -> bool:
        """Whether slot ``index``'s copies (to or from host) are done, so the model may
        write and read it (``wait``: block until they are). A slot :meth:`acquire` hands out
        must be ready before it is used."""
        with self._lock:
            copies = list(self._table[index].copies)
        if wait:
            for c in copies:
                c.wait()
        if all(c.done() for c in copies):
            with self._lock:
                self._table[index].copies = [c for c in self._table[index].copies if c not in copies]
            return True
        return False

    def _swap_out(self, index: int, now: float, wanted: Collection[str]) -> None:
        """Copy slot ``index``'s cached tokens to host memory under its owner (unless the
        host already holds them all, or they would be the first entry dropped)."""
        slot, host = self._table[index], self.host
        if host is None or slot.owner is None or not slot.tokens:
            return
        held = host.get(slot.owner)
        if held is not None and held.tokens[: len(slot.tokens)] == slot.tokens:
            return
        use = CacheUse(key=slot.owner, tokens=len(slot.tokens), last_used=slot.last_used)
        got = host.reserve(use, min(len(slot.tokens), self.slot_tokens), now=now, wanted=wanted)
        if got is None:
            return  # it would be the first to go: no copy
        blocks = got[0]
        event = self.copy_out(index, len(slot.tokens), blocks)
        nbytes = len(blocks) * host.arena.block_bytes
        host.put(HostEntry(slot.owner, list(slot.tokens), blocks, nbytes, slot.last_used, event))
        slot.copies.append(_Copy(event))
        self.swaps_out += 1
        self.swap_bytes += nbytes

    def _swap_in(
        self, index: int, entry: HostEntry, *, keep: bool, ranges: Sequence[tuple[int, int]] | None = None
    ) -> None:
        """Copy ``entry`` (``ranges``: only those tokens of it) into slot ``index``; the host
        lets go of it unless ``keep``. (A copy into the entry still running is on the same
        side stream: ordered before; its blocks, freed, are written again only by later
        copies on that stream.)"""
        event = self.copy_in(index, entry.blocks, len(entry.tokens), ranges)
        self._table[index].copies.append(_Copy(event))
        if not keep and self.host is not None:
            self.host.discard(entry.key)
        self.swaps_in += 1
        copied = len(entry.tokens) if ranges is None else sum(b - a for a, b in ranges)
        self.swap_bytes += entry.nbytes * copied // max(len(entry.tokens), 1)
        self.swapped_in_tokens += copied

    def park(self, index: int, key: str, tokens: Sequence[int], *, wanted: Collection[str] = ()) -> bool:
        """Copy the first ``len(tokens)`` tokens of slot ``index`` (``tokens``: what it
        holds) to host memory under ``key`` (:data:`PARKED_PREFIX` first): work stopped to
        free its slot, to be resumed by :meth:`acquire` with ``restore=key`` (a copy back,
        not a recompute). False, copying nothing, when host memory is off or has no room
        (then it is recomputed). Dropped by :meth:`forget` once the work is done."""
        with self._lock:
            host = self.host
            if host is None or not tokens:
                return False
            now = self.clock()
            n = min(len(tokens), self.slot_tokens)
            use = CacheUse(key=key, tokens=n, last_used=now)
            got = host.reserve(use, n, now=now, wanted={*wanted, key})
            if got is None:
                return False
            blocks = got[0]
            event = self.copy_out(index, n, blocks)
            nbytes = len(blocks) * host.arena.block_bytes
            host.put(HostEntry(key, list(tokens[:n]), blocks, nbytes, now, event))
            self._table[index].copies.append(_Copy(event))
            self.swaps_out += 1
            self.swap_bytes += nbytes
            return True

    def copy_slot(self, src: int, dst: int, tokens: Sequence[int]) -> None:
        """Copy the K/V of slot ``src``'s first ``len(tokens)`` tokens (``tokens``: what
        they are) into the same positions of busy slot ``dst``, which then holds them: a
        session's prefix, from the slot where its running turn holds it, for other work of
        that session (its summary) that got another slot. On CUDA the copy is queued on the
        side stream after the work already launched (both slots wait for it: :meth:`ready`);
        ``src``'s work may go on meanwhile, as it writes only past these tokens."""
        import torch

        with self._lock:
            n = min(len(tokens), self.slot_tokens)
            cuda = self.device.type == "cuda"
            stream = self._side_stream() if cuda else None
            with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                for t in self.slot_tensors():
                    t[dst, :, :n].copy_(t[src, :, :n], non_blocking=cuda)
                event = None
                if cuda:
                    event = torch.cuda.Event()
                    event.record(stream)
            self._table[dst].tokens = list(tokens[:n])
            for index in (src, dst):
                self._table[index].copies.append(_Copy(event))
            self.slot_copies += 1
            self.slot_copied_tokens += n

    # -- context shift -----------------------------------------------------------------------------
    @property
    def can_shift(self) -> bool:
        """Whether :meth:`shift` can move cached tokens (the decoder gave the rotary
        frequencies of its model)."""
        return self.rope_inv_freq is not None

    def shift(self, index: int, shifts: KVShift | Sequence[KVShift]) -> None:
        """Move slot ``index``'s cached K/V of each run of ``shifts`` (``length`` tokens) to
        the positions ``dst`` onwards, keys turned to them (:func:`~convo.fast.kv_shift.shift_kv`;
        not exact, see :mod:`convo.fast.kv_shift`). The slot must be ready (:meth:`ready`)
        and busy: its tokens are the caller's to account."""
        if self.rope_inv_freq is None:
            raise ConfigError("this pool's model has no fixed rotary embedding: no context shift")
        shift_kv(self, index, shifts, self.rope_inv_freq)

    # -- who holds which slot ---------------------------------------------------------------------
    def acquire(
        self,
        key: str | None,
        *,
        min_idle_s: float = 0.0,
        ids: Sequence[int] | None = None,
        guest: bool = False,
        evict: bool = True,
        wanted: Collection[str] = (),
        reply: bool = True,
        restore: str | None = None,
        spare_s: float | None = None,
        shift: bool = False,
        handoff: str | None = None,
    ) -> tuple[int, list[int]] | None:
        """A slot for ``key`` and the tokens already in it, or ``None`` when none is free.

        The session's own idle slot comes first, then an empty slot, then the idle slot of
        another session that the policy expects to be needed last, if it has been idle
        ``min_idle_s`` seconds at least (never one of ``wanted``'s, the sessions with queued
        work, while another is idle; without ``evict``, only the slot of a session whose
        user is no longer :meth:`~convo.fast.kv_policy.EvictionPolicy.thinking`). The
        evicted session's cached tokens go to host memory when there is one (else they are
        dropped). When host memory holds ``key``'s KV and it covers more of ``ids`` (the
        prompt; without it: more tokens) than the slot does, it is copied in: the slot is
        usable once :meth:`ready`.

        Args:
            key: the session whose KV the work reuses (``None``: a one-off).
            min_idle_s: how long another session's slot must have been idle to be taken.
            ids: the prompt about to run (decides between the slot's tokens and the host's).
            guest: the work is done for ``key`` (a summary) and keeps none of its own KV:
                the slot keeps ``key``'s tokens that the work shares, and if the work would
                overwrite more of them, they are copied to host first.
            evict: whether the slot of a session that is thinking may be taken.
            wanted: sessions with queued work (their caches are kept).
            reply: the work is ``key``'s next turn (the policy learns its think time).
            restore: the host key of this work's own KV, parked (:meth:`park`): copied into
                the slot (``key``'s tokens there go to host first) and returned as the
                tokens held; if host memory dropped it meanwhile, nothing is restored.
            spare_s: without ``evict``, the slot of a thinking session may still be taken
                when host memory would keep its KV (it comes back by a copy, not a
                recompute) and the policy expects it back no sooner than ``spare_s``
                seconds (the work's expected length); ``None``: never.
            shift: the work can reuse cached tokens by a context shift (:meth:`shift`):
                host memory's copy of ``key``'s KV is also taken when it shares no more of
                ``ids``' prefix than the slot but holds a longer run of it.
            handoff: when only part of host memory's copy of ``key``'s KV is copied in
                (the prompt's window slid), keep the copy under this host key instead of
                letting go of it: queued work of the session reads the rest (its summary),
                and restores it as its own parked KV (``restore=``) instead of recomputing.
        """
        with self._lock:
            now = self.clock()
            chosen = None
            if key is not None:
                chosen = next((i for i, s in enumerate(self._table) if s.owner == key and not s.busy), None)
            if chosen is None:
                chosen = next((i for i, s in enumerate(self._table) if s.owner is None and not s.busy), None)
            if chosen is None:
                idle = [
                    i for i, s in enumerate(self._table) if not s.busy and now - s.last_used >= min_idle_s
                ]
                if not evict:  # only the slots of sessions whose users are gone (or away long enough)
                    idle = [
                        i for i in idle if self._gone(i, now, wanted) or self._away(i, now, wanted, spare_s)
                    ]
                if not idle:
                    return None
                chosen = max(idle, key=lambda i: self._eviction_order(i, now, wanted))
                self._swap_out(chosen, now, wanted)
            slot = self._table[chosen]
            if slot.owner != key or key is None:
                slot.tokens = []
            if key is not None and reply and not guest:
                self.policy.returned(key, now)
            parked = self.host.get(restore) if self.host is not None and restore is not None else None
            entry = self.host.get(key) if self.host is not None and key is not None else None
            if parked is not None:  # the work's own KV comes back; the slot's go to host first
                if slot.tokens and common_prefix_length(slot.tokens, parked.tokens) < len(slot.tokens):
                    self._swap_out(chosen, now, wanted)
                self._swap_in(chosen, parked, keep=False)
                slot.tokens = list(parked.tokens)
            elif entry is not None and _covers_more(entry.tokens, slot.tokens, ids, shift=shift):
                if guest or ids is None:  # a guest overwrites part: host keeps it
                    self._swap_in(chosen, entry, keep=guest)
                    slot.tokens = list(entry.tokens)
                else:  # only what the prompt reuses comes back
                    slot.tokens, spans = _reused(entry.tokens, ids, shift=shift)
                    self._swap_in(chosen, entry, keep=handoff is not None, ranges=spans)
                    if handoff is not None and self.host is not None:
                        self.host.rename(entry.key, handoff, now=now)
            elif guest and ids is not None and slot.tokens:
                if common_prefix_length(slot.tokens, ids, len(ids) - 1) < len(slot.tokens):
                    self._swap_out(chosen, now, wanted)  # the summary would overwrite them
            slot.owner, slot.busy, slot.guest = key, True, guest and key is not None
            return chosen, list(slot.tokens)

    def _away(self, index: int, now: float, wanted: Collection[str], spare_s: float | None) -> bool:
        """Whether slot ``index``'s session is expected back no sooner than ``spare_s`` and
        host memory would keep its KV meanwhile (see :meth:`acquire`)."""
        s, host = self._table[index], self.host
        if spare_s is None or host is None or s.owner is None or s.owner in wanted:
            return False
        use = CacheUse(key=s.owner, tokens=len(s.tokens), last_used=s.last_used)
        if self.policy.next_use_s(use, now, wanted) < spare_s:
            return False
        held = host.get(s.owner)
        if held is not None and held.tokens[: len(s.tokens)] == s.tokens:
            return True  # the host has it all already
        return host.would_keep(use, self.host_nbytes(len(s.tokens)), now=now, wanted=wanted)

    def _gone(self, index: int, now: float, wanted: Collection[str]) -> bool:
        s = self._table[index]
        if s.owner is None or not s.tokens:
            return True
        if s.owner in wanted:
            return False
        return not self.policy.thinking(
            CacheUse(key=s.owner, tokens=len(s.tokens), last_used=s.last_used), now
        )

    def _eviction_order(self, index: int, now: float, wanted: Collection[str]) -> tuple[float, float, int]:
        """Larger first: empty slots, then the policy's next use, then fewer tokens."""
        s = self._table[index]
        if s.owner is None or not s.tokens:
            return (1.0, 0.0, 0)
        use = CacheUse(key=s.owner, tokens=len(s.tokens), last_used=s.last_used)
        return (0.0, self.policy.next_use_s(use, now, wanted), -len(s.tokens))

    def release(self, index: int, tokens: Sequence[int]) -> None:
        """Give slot ``index`` back; it keeps ``tokens`` for its owner's next turn (unless
        another slot holds the owner's KV already: the one its own turn left wins)."""
        with self._lock:
            now = self.clock()
            slot = self._table[index]
            slot.busy, slot.last_used = False, now
            owner = slot.owner
            # (A slot busy with work done for the owner, a summary, holds that work's tokens,
            # not the owner's: it is no twin.)
            twin = owner is not None and any(
                s.owner == owner and not (s.busy and s.guest) for i, s in enumerate(self._table) if i != index
            )
            if owner is None or twin or not tokens:  # nothing (new) to keep for the owner
                slot.owner, slot.tokens = None, []
            else:
                slot.tokens = list(tokens)
                if not slot.guest:
                    self.policy.released(owner, now)
                    if self.host is not None:
                        self.host.discard(owner)  # the slot holds the newest
            slot.guest = False

    def forget(self, key: str) -> None:
        """Drop what an idle slot, or host memory, keeps for ``key`` (a closed session)."""
        with self._lock:
            for slot in self._table:
                if slot.owner == key and not slot.busy:
                    slot.owner, slot.tokens = None, []
            if self.host is not None:
                self.host.discard(key)
            self.policy.forget(key)

    def owners(self) -> list[str]:
        """Keys of the sessions whose tokens are kept in a slot or in host memory."""
        with self._lock:
            keys = [s.owner for s in self._table if s.owner is not None]
            if self.host is not None:
                keys += [k for k in self.host.keys() if k not in keys and not k.startswith(PARKED_PREFIX)]
            return keys


#: Tokens between two runs that :func:`_reused` copies with them rather than copying the
#: runs apart (each range is a copy per layer and tensor: an excerpt's pieces are ~20
#: tokens apart).
COPY_GAP_TOKENS = 64
#: What :func:`_reused` puts in a slot's tokens where the host copy's were not copied in:
#: no token id (they are ``>= 0``), so no prompt ever matches them.
NOT_COPIED = -1


def _reused(
    cached: Sequence[int], ids: Sequence[int], *, shift: bool
) -> tuple[list[int], list[tuple[int, int]]]:
    """What a slot holds of ``cached`` (a host copy of a session's tokens) once only what
    the prompt ``ids`` reuses is copied in: the common prefix and (``shift``) the runs a
    context shift moves, :data:`NOT_COPIED` between them (nothing after); and those
    ``[a, b)`` spans of ``cached``, the copy. The scheduler finds the same prefix and runs
    in it as in ``cached``. After a slide the dropped turns between them are most of the
    copy (think-16: about 1,300 of 2,000 tokens a session)."""
    common = common_prefix_length(cached, ids)  # (all of it: work that only prefills uses it)
    limit = len(ids) - 1
    runs = find_shifts(cached, ids, start=common, limit=limit) if shift and common < limit else ()
    spans = [(0, common)]
    for a, b in sorted((r.src, r.src + r.length) for r in runs):  # (sources may overlap)
        if a <= spans[-1][1] + COPY_GAP_TOKENS:  # (a short gap costs less than another copy)
            spans[-1] = (spans[-1][0], max(spans[-1][1], b))
        else:
            spans.append((a, b))
    held = [NOT_COPIED] * spans[-1][1]
    for a, b in spans:
        held[a:b] = cached[a:b]
    return held, spans


def _covers_more(
    host: Sequence[int], slot: Sequence[int], ids: Sequence[int] | None, *, shift: bool = False
) -> bool:
    """Whether the host copy serves the prompt better than what the slot holds (``shift``:
    counting the runs a context shift would move, :func:`~convo.fast.kv_shift.find_shifts`)."""
    if ids is None:
        return len(host) > len(slot)
    limit = len(ids) - 1
    on_host, in_slot = common_prefix_length(host, ids, limit), common_prefix_length(slot, ids, limit)
    if shift and on_host == in_slot and len(host) > on_host:
        runs = shifted_tokens(find_shifts(host, ids, start=on_host, limit=limit))
        kept = (
            shifted_tokens(find_shifts(slot, ids, start=in_slot, limit=limit)) if len(slot) > in_slot else 0
        )
        return runs > kept
    return on_host > in_slot
