"""The KV slot pool: per-layer K and V tensors of every slot, taken once at start, and
:class:`PrefillChunk`, a piece of a turn to prefill into a slot."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from convo.errors import ConfigError
from convo.models.defaults import FP8_KV_SCALE_BYTES, kv_pool_bytes


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


class KVSlotPool:
    """Preallocated KV memory: ``slots`` caches of ``slot_tokens`` tokens each.

    Per layer ``k[layer]`` and ``v[layer]`` are ``[slots, kv_heads, slot_tokens, head_dim]``;
    an fp8 pool (``dtype=torch.float8_e4m3fn``) also holds ``k_scale[layer]`` and
    ``v_scale[layer]``, float32 ``[slots, kv_heads, slot_tokens]``: one scale per token and
    head (:func:`convo.fast.kernels.quantize_kv`). :attr:`tensors` lists every tensor, each
    indexed by slot first. The pool answers who may use which slot; the scheduler decides
    when to ask.

    Args:
        num_layers, num_kv_heads, head_dim: from the model config.
        slots: sessions that can hold KV at once.
        slot_tokens: tokens one slot holds (prompt + reply): the session budget.
        dtype, device: the KV dtype (the model's, or ``torch.float8_e4m3fn``) and device.

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
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        #: Whether K/V are fp8 with per token and head scales (:attr:`k_scale`, :attr:`v_scale`).
        self.scaled = dtype == torch.float8_e4m3fn
        n = num_layers if self.scaled else 0
        self.k_scale = [torch.zeros(shape[:3], dtype=torch.float32, device=device) for _ in range(n)]
        self.v_scale = [torch.zeros(shape[:3], dtype=torch.float32, device=device) for _ in range(n)]
        self._table = [_Slot() for _ in range(slots)]
        self._lock = threading.Lock()

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
        bytes)`` (``scaled``: an fp8 pool's float32 scales): the one pool-size formula,
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
        """Bytes of the pool's tensors (K, V and any scales; measured from the tensors)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def slot_nbytes(self) -> int:
        """Bytes one slot occupies."""
        return self.nbytes // self.slots

    def acquire(self, key: str | None, *, min_idle_s: float = 0.0) -> tuple[int, list[int]] | None:
        """A slot for ``key`` and the tokens already in it, or ``None`` when none is free.

        The session's own idle slot comes first (its tokens are reused), then an empty
        slot, then the least recently used idle slot of another session (its tokens are
        dropped), if it has been idle for ``min_idle_s`` seconds at least.
        """
        with self._lock:
            chosen = None
            if key is not None:
                chosen = next((i for i, s in enumerate(self._table) if s.owner == key and not s.busy), None)
            if chosen is None:
                chosen = next((i for i, s in enumerate(self._table) if s.owner is None and not s.busy), None)
            if chosen is None:
                idle = [(s.last_used, i) for i, s in enumerate(self._table) if not s.busy]
                if not idle or min(idle)[0] > time.monotonic() - min_idle_s:
                    return None
                chosen = min(idle)[1]
            slot = self._table[chosen]
            if slot.owner != key or key is None:
                slot.tokens = []
            slot.owner, slot.busy = key, True
            return chosen, list(slot.tokens)

    def release(self, index: int, tokens: Sequence[int]) -> None:
        """Give slot ``index`` back; it keeps ``tokens`` for its owner's next turn."""
        with self._lock:
            slot = self._table[index]
            slot.busy, slot.last_used = False, time.monotonic()
            slot.tokens = list(tokens) if slot.owner is not None else []

    def forget(self, key: str) -> None:
        """Drop what an idle slot keeps for ``key`` (a closed session)."""
        with self._lock:
            for slot in self._table:
                if slot.owner == key and not slot.busy:
                    slot.owner, slot.tokens = None, []

    def owners(self) -> list[str]:
        """Keys of the sessions whose tokens are kept in a slot."""
        with self._lock:
            return [s.owner for s in self._table if s.owner is not None]
