"""Context shift: a session's cached turns reused where its window slid them.

When a session's window slides, its next prompt drops the oldest turns and the summary in
front of the kept turns changes, so the kept turns sit at earlier positions than in the
slot. With exact reuse only the system prompt is a common prefix and everything after it
is prefilled again: on a 2,048-token budget with ~390-token turns that is ~1,500 tokens on
every third turn (issue 22's think-16 load: re-prefill 0.58, its exact floor 0.50).

With a context shift the scheduler finds the kept turns in the slot (:func:`find_shift`:
the longest run of the prompt the slot holds at another place), moves their K and V to
the positions the prompt gives them, and turns their keys by the position difference
(:func:`shift_kv`: rotary embeddings compose, ``R(p + d) = R(d) R(p)``). Only the new
summary and what follows the kept turns are prefilled. llama.cpp's context shift and
StreamingLLM reuse KV this way.

It is **not exact**. A kept turn's K and V were computed while it attended to the turns
now dropped and the old summary, not to the new summary; the moved keys are rounded to the
cache's dtype once more. The reply can differ from one computed on a recomputed prompt
(``benchmarks/kv_shift.py`` measures how much on a real model). So it is off unless asked
for (``KVConfig.context_shift``, ``convo serve --context-shift``). Exact reuse (a common
prefix, host copies) is unchanged by it.

Rotary embeddings whose frequencies depend on the sequence length (``dynamic``,
``longrope``) have no fixed rotation to apply: the decoder then shifts nothing
(:func:`rope_frequencies` returns ``None``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from convo.fast.attention import dequantize_kv, quantize_kv

__all__ = ["SHIFT_ANCHOR_TOKENS", "SHIFT_MIN_TOKENS", "KVShift", "find_shift", "rope_frequencies", "shift_kv"]

#: A run of cached tokens shorter than this is prefilled again rather than moved (a move
#: costs a few kernel launches per layer; below this, prefilling it costs about as much).
SHIFT_MIN_TOKENS = 64
#: Tokens of the anchors :func:`find_shift` looks a run up by (every position of the slot's
#: tokens is indexed by the anchor starting there).
SHIFT_ANCHOR_TOKENS = 8
#: Rotary types with fixed frequencies (the rotation by a position difference is exact).
FIXED_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
#: Slot positions one anchor may be looked up at (repeated text has an anchor at many).
_MAX_ANCHOR_HITS = 16


@dataclass(frozen=True)
class KVShift:
    """Move ``length`` cached tokens from slot position ``src`` to ``dst`` (their place in
    the prompt): after it, the slot holds ``ids[dst:dst + length]`` there."""

    src: int
    dst: int
    length: int

    @property
    def delta(self) -> int:
        """Positions the run moves by (negative: towards the start)."""
        return self.dst - self.src


def _run_forward(a: Sequence[int], i: int, b: Sequence[int], j: int, most: int) -> int:
    """How many tokens ``a[i:]`` and ``b[j:]`` share from their start, at most ``most``
    (binary search over slice comparisons, each one pass in C)."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[i : i + mid] == b[j : j + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _run_backward(a: Sequence[int], i: int, b: Sequence[int], j: int, most: int) -> int:
    """How many tokens ``a[:i]`` and ``b[:j]`` share from their end, at most ``most``."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[i - mid : i] == b[j - mid : j]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def find_shift(
    cached: Sequence[int],
    ids: Sequence[int],
    *,
    start: int,
    limit: int,
    min_tokens: int = SHIFT_MIN_TOKENS,
) -> KVShift | None:
    """The longest run of ``ids[start:limit]`` that ``cached`` (a slot's tokens) holds at a
    position ``>= start``, at least ``min_tokens`` long; ``None``: no such run.

    ``start`` is the common prefix of the two (exact reuse covers it) and ``limit`` the
    last prompt position the slot may fill (a request that samples prefills its last token
    whatever is cached). Anchors of :data:`SHIFT_ANCHOR_TOKENS` tokens are taken every
    ``min_tokens // 2`` positions of the prompt (a run of ``min_tokens`` contains one) and
    looked up among every anchor of the slot; each hit is grown both ways. A few
    milliseconds for two 2,000-token sequences.
    """
    ids = list(ids)
    cached = list(cached)
    limit = min(limit, len(ids))
    width = SHIFT_ANCHOR_TOKENS
    if min_tokens < width or limit - start < min_tokens or len(cached) - start < min_tokens:
        return None
    index: dict[tuple[int, ...], list[int]] = {}
    for i in range(start, len(cached) - width + 1):
        hits = index.setdefault(tuple(cached[i : i + width]), [])
        if len(hits) < _MAX_ANCHOR_HITS:
            hits.append(i)
    best: KVShift | None = None
    covered = (0, 0)  # the prompt positions of the best run: its anchors find nothing longer
    for j in range(start, limit - width + 1, max(1, min_tokens // 2)):
        if covered[0] <= j and j + width <= covered[1]:
            continue
        for i in index.get(tuple(ids[j : j + width]), ()):
            back = _run_backward(cached, i, ids, j, min(i, j) - start)
            ahead = _run_forward(cached, i, ids, j, min(len(cached) - i, limit - j))
            length = back + ahead
            if length >= min_tokens and (best is None or length > best.length):
                best = KVShift(src=i - back, dst=j - back, length=length)
                covered = (best.dst, best.dst + length)
    return best


def rope_frequencies(rotary: Any) -> Any | None:
    """The inverse frequencies (float32) of a transformers rotary embedding module whose
    rotation by a position difference is fixed (:data:`FIXED_ROPE_TYPES`); ``None``
    otherwise (no context shift for that model)."""
    import torch

    kind = getattr(rotary, "rope_type", "default")
    inv_freq = getattr(rotary, "inv_freq", None)
    if kind not in FIXED_ROPE_TYPES or not isinstance(inv_freq, torch.Tensor):
        return None
    return inv_freq.detach().to(torch.float32).clone()


def shift_kv(pool: Any, slot: int, shift: KVShift, inv_freq: Any) -> None:
    """Move slot ``slot``'s K and V of ``shift.length`` tokens from ``shift.src`` to
    ``shift.dst`` in every layer of ``pool`` (a :class:`~convo.fast.kv_pool.KVSlotPool`),
    turning the keys by ``shift.delta`` positions (float32 products, stored in the pool's
    dtype; an fp8 pool's keys are quantized again, with new scales). The runs may overlap.
    Queued on the current stream: it runs before the work queued after it."""
    import torch

    src = slice(shift.src, shift.src + shift.length)
    dst = slice(shift.dst, shift.dst + shift.length)
    freqs = shift.delta * inv_freq.to(pool.device)
    angles = torch.cat((freqs, freqs))
    cos, sin = angles.cos(), angles.sin()
    half = angles.shape[0] // 2
    for layer in range(pool.num_layers):
        k = pool.k[layer][slot, :, src]
        kf = dequantize_kv(k, pool.k_scale[layer][slot, :, src], torch.float32) if pool.scaled else k.float()
        turned = kf * cos + torch.cat((-kf[..., half:], kf[..., :half]), dim=-1) * sin
        if pool.scaled:
            q, scale = quantize_kv(turned)
            pool.k[layer][slot, :, dst] = q
            pool.k_scale[layer][slot, :, dst] = scale
            pool.v_scale[layer][slot, :, dst] = pool.v_scale[layer][slot, :, src].clone()
        else:
            pool.k[layer][slot, :, dst] = turned.to(pool.dtype)
        pool.v[layer][slot, :, dst] = pool.v[layer][slot, :, src].clone()
