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

__all__ = [
    "MAX_SHIFT_RUNS",
    "SHIFT_AFTER_HEAD_TOKENS",
    "SHIFT_ANCHOR_TOKENS",
    "SHIFT_EXTRA_MIN_TOKENS",
    "SHIFT_MIN_TOKENS",
    "KVShift",
    "find_shift",
    "find_shifts",
    "rope_frequencies",
    "shift_kv",
    "shifted_tokens",
]

#: A run of cached tokens shorter than this is prefilled again rather than moved (a move
#: costs a few kernel launches per layer; below this, prefilling it costs about as much).
SHIFT_MIN_TOKENS = 64
#: Tokens of the anchors :func:`find_shift` looks a run up by (every position of the slot's
#: tokens is indexed by the anchor starting there).
SHIFT_ANCHOR_TOKENS = 8
#: Most runs one prompt moves (:func:`find_shifts`): the kept turns, and pieces of the
#: turns that just left the window that the prompt shows again, in front of them (a
#: provisional summary's excerpts) or after the question (retrieval memory's passages).
MAX_SHIFT_RUNS = 32
#: Fewest tokens of a run moved beside a longer one (:func:`find_shifts`): all of a turn's
#: runs move together (one gather and one scatter per layer), so a short one costs its
#: index entries only, where prefilling it costs its tokens.
SHIFT_EXTRA_MIN_TOKENS = 16
#: Tokens at the head of each run after the longest that are prefilled again rather than
#: moved (:func:`find_shifts`): retrieval memory's passages of the turns that just left the
#: window, shown after the question. Moved whole they cost the reply much more than the
#: kept turns do (``benchmarks/kv_shift.py --memory 3``, 12 slides: top-1 agreement with
#: the recomputed prompt 0.847 against 0.962 for the kept turns alone, 0.965 for fp8 K/V);
#: with each passage's first 32 tokens computed in its new place, 0.951, while the memory
#: slide turn prefills 513 tokens instead of 1,499 (``benchmarks/slide_prefill.py
#: --memory``, 300-token turns; an ordinary turn: 287).
SHIFT_AFTER_HEAD_TOKENS = 32
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


def _candidate_runs(
    cached: Sequence[int], ids: Sequence[int], start: int, limit: int, min_tokens: int
) -> list[KVShift]:
    """Every run of ``ids[start:limit]`` held by ``cached`` at a position ``>= start`` and at
    least ``min_tokens`` long, found from anchors of :data:`SHIFT_ANCHOR_TOKENS` tokens
    taken every ``min_tokens // 2`` prompt positions (a run of ``min_tokens`` contains one)
    and looked up among every anchor of ``cached``; each hit is grown both ways. A run is
    found once (anchors inside a run found already are not grown again)."""
    width = SHIFT_ANCHOR_TOKENS
    if min_tokens < width or limit - start < min_tokens or len(cached) - start < min_tokens:
        return []
    index: dict[tuple[int, ...], list[int]] = {}
    for i in range(start, len(cached) - width + 1):
        hits = index.setdefault(tuple(cached[i : i + width]), [])
        if len(hits) < _MAX_ANCHOR_HITS:
            hits.append(i)
    runs: list[KVShift] = []
    for j in range(start, limit - width + 1, max(1, min_tokens // 2)):
        for i in index.get(tuple(ids[j : j + width]), ()):
            if any(r.src - r.dst == i - j and r.dst <= j and j + width <= r.dst + r.length for r in runs):
                continue
            back = _run_backward(cached, i, ids, j, min(i, j) - start)
            ahead = _run_forward(cached, i, ids, j, min(len(cached) - i, limit - j))
            if back + ahead >= min_tokens:
                runs.append(KVShift(src=i - back, dst=j - back, length=back + ahead))
    return runs


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
    whatever is cached). A few milliseconds for two 2,000-token sequences.
    """
    runs = _candidate_runs(list(cached), list(ids), start, min(limit, len(ids)), min_tokens)
    return max(runs, key=lambda r: r.length, default=None)


def find_shifts(
    cached: Sequence[int],
    ids: Sequence[int],
    *,
    start: int,
    limit: int,
    min_tokens: int = SHIFT_MIN_TOKENS,
    extra_min_tokens: int = SHIFT_EXTRA_MIN_TOKENS,
    most: int = MAX_SHIFT_RUNS,
    after_head_tokens: int | None = SHIFT_AFTER_HEAD_TOKENS,
    toward_start: bool = True,
) -> tuple[KVShift, ...]:
    """Runs of ``ids[start:limit]`` that ``cached`` holds at positions ``>= start`` (as
    :func:`find_shift`), at most ``most``, filling disjoint prompt positions, in prompt
    order: the longest first (at least ``min_tokens``: else none), then the longest of what
    is left uncovered (at least ``extra_min_tokens``), and so on; a run that overlaps one
    taken keeps its longest uncovered part. A run after the longest leaves its first
    ``after_head_tokens`` to prefill, and is taken only if at least ``extra_min_tokens``
    remain (``None``: runs after the longest are not taken). With ``toward_start``, nothing
    moves unless the longest run moves towards the start of the prompt.

    After a slide the longest run is the kept turns. The prompt often shows pieces of the
    turns that just left the window too, which the slot still holds: a provisional
    summary's excerpts (each message's head and tail) in front of the kept turns,
    retrieval memory's passages after the question (llama.cpp's ``--cache-reuse`` reuses
    such chunks too). Moved whole, the passages cost the reply more than the kept turns
    (``benchmarks/kv_shift.py --memory 3``, 29 slides: top-1 agreement with the
    recomputed prompt 0.860 against 0.955, mean KL 0.076 against 0.013 nats): they sit
    right before the reply, and their K/V were computed as turns of the chat, not as
    memory. Most of that is in each passage's first tokens, which attended to another
    context: with those prefilled (:data:`SHIFT_AFTER_HEAD_TOKENS`) the passages cost about
    one point of top-1 agreement beside the kept turns' move (fp8 K/V costs 3.5 on the same
    prompts). Sources may overlap each other and the prompt positions others move to:
    :func:`shift_kv` reads every source before it writes.

    The kept turns move towards the start: the turns that left the window were in front of
    them. On a turn where nothing left, the runs are the last reply (its K/V computed after
    the last question's passages) and passages both turns retrieved (moving towards the
    end: a reply and a question now stand in front of them), and moving them costs far more
    than it saves (``benchmarks/kv_shift.py --memory 3 --ordinary``, 17 turns: top-1
    agreement 0.872 against 0.939 for fp8 K/V, mean KL 0.077 against 0.010 nats, one greedy
    reply in 17 the recomputed one, for 12.7 % of the prompt). So with ``toward_start``
    (the default) such a turn is prefilled, exact: 15 of the 17 were (the other two led
    with a run moving towards the start, a reordered passage or a long reply), and the 17
    gave 0.988 and 0.0049 nats, 15 replies the recomputed ones; the slides of the first 10
    LoCoMo conversations, with and without memory, move what they moved before."""
    shortest = min(min_tokens, extra_min_tokens)
    runs = _candidate_runs(list(cached), list(ids), start, min(limit, len(ids)), shortest)
    taken: list[KVShift] = []
    heads: list[KVShift] = []  # prompt positions left to prefill: no other run fills them
    for run in sorted(runs, key=lambda r: (-r.length, r.dst)):
        if len(taken) >= most:
            break
        piece = _uncovered(run, [*taken, *heads])
        if piece is None or piece.length < (extra_min_tokens if taken else min_tokens):
            continue
        if not taken and toward_start and piece.delta >= 0:
            return ()
        if taken and piece.dst + piece.length > taken[0].dst:  # after the longest
            if after_head_tokens is None or piece.length - after_head_tokens < extra_min_tokens:
                continue
            n = after_head_tokens
            heads.append(KVShift(src=piece.src, dst=piece.dst, length=n))
            piece = KVShift(src=piece.src + n, dst=piece.dst + n, length=piece.length - n)
        taken.append(piece)
    return tuple(sorted(taken, key=lambda r: r.dst))


def _uncovered(run: KVShift, taken: Sequence[KVShift]) -> KVShift | None:
    """The longest part of ``run`` whose prompt positions no run of ``taken`` fills."""
    lo, hi = run.dst, run.dst + run.length
    cuts = sorted((t.dst, t.dst + t.length) for t in taken if t.dst < hi and lo < t.dst + t.length)
    best: tuple[int, int] | None = None
    at = lo
    for a, b in [*cuts, (hi, hi)]:
        if a > at and (best is None or a - at > best[1] - best[0]):
            best = (at, min(a, hi))
        at = max(at, b)
    if best is None:
        return None
    return KVShift(src=run.src + best[0] - run.dst, dst=best[0], length=best[1] - best[0])


def shifted_tokens(shifts: Sequence[KVShift]) -> int:
    """Prompt tokens ``shifts`` fill (not prefilled)."""
    return sum(s.length for s in shifts)


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


def shift_kv(pool: Any, slot: int, shifts: KVShift | Sequence[KVShift], inv_freq: Any) -> None:
    """Move slot ``slot``'s K and V of each run of ``shifts`` from its ``src`` to its ``dst``
    in every layer of ``pool`` (a :class:`~convo.fast.kv_pool.KVSlotPool`), turning the keys
    by the run's ``delta`` positions (float32 products, stored in the pool's dtype; an fp8
    pool's keys are quantized again, with new scales). Every source is read before any
    destination is written, so runs may overlap each other's sources and destinations.
    Queued on the current stream: it runs before the work queued after it."""
    import torch

    runs = [shifts] if isinstance(shifts, KVShift) else list(shifts)
    if not runs:
        return
    device = pool.device
    src = torch.cat([torch.arange(r.src, r.src + r.length) for r in runs]).to(device)
    dst = torch.cat([torch.arange(r.dst, r.dst + r.length) for r in runs]).to(device)
    delta = torch.cat([torch.full((r.length,), float(r.delta)) for r in runs]).to(device)
    freqs = delta[:, None] * inv_freq.to(device)[None, :]  # (tokens, head_dim / 2)
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    half = angles.shape[-1] // 2
    for layer in range(pool.num_layers):
        k_all, v_all = _raw(pool.k[layer][slot]), _raw(pool.v[layer][slot])
        k = k_all[:, src].view(pool.k[layer].dtype)  # (gathers: copies, read before any write)
        v = v_all[:, src]
        if pool.scaled:
            kf = dequantize_kv(k, pool.k_scale[layer][slot][:, src], torch.float32)
            v_scale = pool.v_scale[layer][slot][:, src]
        else:
            kf = k.float()
        turned = kf * cos + torch.cat((-kf[..., half:], kf[..., :half]), dim=-1) * sin
        if pool.scaled:
            q, scale = quantize_kv(turned)
            k_all[:, dst] = _raw(q)
            pool.k_scale[layer][slot][:, dst] = scale
            pool.v_scale[layer][slot][:, dst] = v_scale
        else:
            k_all[:, dst] = turned.to(pool.dtype)
        v_all[:, dst] = v


def _raw(t: Any) -> Any:
    """``t``, or its bytes for a one-byte float (fp8: gathers and scatters by index are not
    implemented for it everywhere)."""
    import torch

    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else t
