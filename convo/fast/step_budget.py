"""The prompt tokens one scheduler step may prefill while replies stream (issue 22 #3).

While replies stream, a step prefills ``interleave_tokens`` prompt tokens beside the decode
rows. When prompt tokens pile up, the step's share grows toward full prefill speed, but
never past what keeps the gap between two tokens of a running reply within
:data:`DEFAULT_GAP_STEPS` decode-only steps.

What a grown step costs is measured, not extrapolated (:class:`StepCosts`): a step's cost
is not linear in its prompt tokens. On an int4 GPU model the weights are dequantized (or
read) once per forward whatever its rows, so twice the chunk costs much less than twice
the step's extra time; a line through the ordinary chunk's cost priced the grown chunk
past the gap and the step never grew (H100, Llama-2-7B int4, stop 44). Grown steps come in
sizes that double from ``interleave_tokens`` (a static decoder's mixed step is captured
for such chunk buckets); each size's cost is the running mean of the steps of that size,
and a size not seen yet is tried once when the size below it is within the gap, then
kept or left by what it cost. That try is the one step that may pass the gap: twice a size
within ``gap_steps`` decode steps costs at most ``2 * gap_steps - 1`` of them, even if its
cost were linear in its tokens. A size left for its cost is not tried again.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_GAP_STEPS",
    "MIN_COST_STEPS",
    "PILEUP_CHUNKS",
    "SHRINK_HALVINGS",
    "STEP_KINDS",
    "StepCosts",
    "step_costs",
]

#: The kinds of scheduler step: decode rows alone, decode rows with a prefill chunk in the
#: same forward, prefill alone.
STEP_KINDS = ("decode", "mixed", "prefill")

#: While replies stream and prompt tokens pile up, a step may grow its prefill until it is
#: expected to take this many decode-only steps: the gap between two tokens of a running
#: reply (issue 22 bounds the p95 gap at 3x the steady step; this keeps a margin).
DEFAULT_GAP_STEPS = 2.5
#: Prompt tokens pile up once more than this many streaming steps' chunks
#: (``interleave_tokens`` each) wait; the step then takes 1/PILEUP_CHUNKS of what waits,
#: so a burst drains in about this many steps at most, as fast as the gap allows.
PILEUP_CHUNKS = 16
#: How many times a streaming step whose ordinary chunk (``interleave_tokens``) costs more
#: than the gap may halve it (down to ``interleave_tokens >> halvings``; 0: never). Off by
#: default: where a forward has a large fixed cost the halves cost nearly as much as the
#: whole, so halving trades the prefill's throughput for little gap. H100, Llama-2-7B int4
#: (a 16-row decode step 6.6 ms on the fused W4A16 kernel; with a chunk, dense), measured
#: during ``benchmarks/interleave.py``: a step of 64 prompt tokens 14.6 ms, 128 15.7, 256
#: 21.3; with two halvings ``serve_load.py --preset gpu-chat`` ran its steps at ~64 tokens
#: (755 mixed steps against 280) and took 12.5 s against 8.1 s without (same machine,
#: 2026-12-07). Where a step's cost is near linear in its tokens, halving keeps the gap at
#: little cost: :class:`StepCosts` takes ``shrink_halvings``.
SHRINK_HALVINGS = 0
#: Decode-only steps measured before the step cost is trusted (until then, and on a
#: decoder whose steps cost nothing measurable, a streaming step prefills
#: ``interleave_tokens``).
MIN_COST_STEPS = 8
#: Weight of the newest step in a size's running mean, and in the decode-only steps' (recent
#: steps count most: a step's cost moves with its rows and the context its attention reads).
COST_EMA = 0.2


class StepCosts:
    """The scheduler's measured step costs, and the prompt budget of a streaming step.

    :meth:`record` takes every step and counts it by kind (:attr:`steps`, :attr:`busy_s`):
    decode-only steps give the steady step (:attr:`decode_s`); steps with decode rows and
    prompt tokens give the cost of their size (:meth:`price`, :meth:`size`).

    Args:
        interleave_tokens: the ordinary chunk of a streaming step.
        gap_steps: the gap bound, in decode-only steps (:data:`DEFAULT_GAP_STEPS`).
        shrink_halvings: how often an ordinary chunk past the gap may be halved
            (:data:`SHRINK_HALVINGS`; 0 by default: never).

    >>> costs = StepCosts(interleave_tokens=256)
    >>> for _ in range(8):
    ...     costs.record("decode", 0, 0.010)
    >>> costs.budget(waiting=30_000, rows=16, step_tokens=2048)  # 512 not seen yet: try it
    512
    >>> costs.record("mixed", 512, 0.020)
    >>> costs.budget(waiting=30_000, rows=16, step_tokens=2048)  # within 2.5 steps; try 1024
    1024
    >>> costs.record("mixed", 1024, 0.040)
    >>> costs.budget(waiting=30_000, rows=16, step_tokens=2048)  # 1024 is past the gap
    512
    """

    def __init__(
        self,
        *,
        interleave_tokens: int,
        gap_steps: float = DEFAULT_GAP_STEPS,
        shrink_halvings: int = SHRINK_HALVINGS,
    ) -> None:
        self.interleave_tokens = max(interleave_tokens, 1)
        self.gap_steps = gap_steps
        self.shrink_halvings = shrink_halvings
        #: steps run and their seconds, by kind (:data:`STEP_KINDS`)
        self.steps = dict.fromkeys(STEP_KINDS, 0)
        self.busy_s = dict.fromkeys(STEP_KINDS, 0.0)
        #: size -> running mean seconds of the steps of that size with decode rows
        self.sized_s: dict[int, float] = {}
        self._decode_s: float | None = None  # running mean of the decode-only steps

    @property
    def smallest(self) -> int:
        """The smallest size: ``interleave_tokens`` halved ``shrink_halvings`` times
        (:data:`SHRINK_HALVINGS`)."""
        return max(self.interleave_tokens >> self.shrink_halvings, 1)

    def size(self, prompt_tokens: int) -> int:
        """The size of a step of ``prompt_tokens``: the smallest of :attr:`smallest` doubled
        that holds them."""
        size = self.smallest
        while size < prompt_tokens:
            size *= 2
        return size

    def record(self, kind: str, prompt_tokens: int, seconds: float) -> None:
        """Count one step: ``kind`` ``"decode"`` (no prompt tokens), ``"mixed"`` (decode rows
        and ``prompt_tokens``, priced) or ``"prefill"`` (no rows: not a gap, not priced)."""
        self.steps[kind] += 1
        self.busy_s[kind] += seconds
        if kind == "decode":
            old = self._decode_s
            self._decode_s = seconds if old is None else old + COST_EMA * (seconds - old)
        elif kind == "mixed":
            self.price(prompt_tokens, seconds)

    def price(self, prompt_tokens: int, seconds: float) -> None:
        """Take ``seconds`` as the gap of a streaming step that prefilled ``prompt_tokens``
        (a mixed step, or a decode step and the prefill forward after it)."""
        if prompt_tokens > 0:
            size = self.size(prompt_tokens)
            old = self.sized_s.get(size)
            self.sized_s[size] = seconds if old is None else old + COST_EMA * (seconds - old)

    @property
    def decode_s(self) -> float | None:
        """The recent decode-only steps' running mean seconds (weight :data:`COST_EMA`;
        ``None`` before :data:`MIN_COST_STEPS` of them, or while they cost nothing)."""
        if self.steps["decode"] < MIN_COST_STEPS or not self._decode_s:
            return None
        return self._decode_s

    def budget(self, *, waiting: int, rows: int, step_tokens: int) -> int:
        """Prompt tokens one step may prefill beside ``rows`` streaming rows while
        ``waiting`` prompt tokens wait.

        Normally ``interleave_tokens`` (within what ``step_tokens`` leaves beside the rows,
        at least 1), or less where that size's measured cost is past ``gap_steps``
        decode-only steps: the largest of its halves (down to :attr:`smallest`) that is not,
        each half tried once. When more than :data:`PILEUP_CHUNKS` chunks wait, the largest
        size up to ``waiting / PILEUP_CHUNKS`` (and the step's room) whose measured cost,
        and that of each size below it, is within the gap; the first size not measured yet
        is taken once, to measure it.
        """
        room = max(step_tokens - rows, 1)
        base = max(min(room, self.interleave_tokens), 1)
        want = min(waiting // PILEUP_CHUNKS, room)
        decode_s = self.decode_s
        if decode_s is None:
            return base
        limit = self.gap_steps * decode_s
        ordinary = size = self.size(base)
        while size > self.smallest and (cost := self.sized_s.get(size)) is not None and cost > limit:
            size //= 2  # the ordinary chunk is past the gap: half of it
        if size < ordinary:
            return min(size, base)
        if want <= base:
            return base
        take = base
        size = ordinary * 2
        while size // 2 < want:
            cost = self.sized_s.get(size)
            if cost is not None and cost > limit:
                break
            take = min(size, want)
            if cost is None:  # not seen yet: try it once
                break
            size *= 2
        return take


def step_costs(
    steps: dict[str, int], busy_s: dict[str, float], prompt_tokens: int
) -> tuple[float, float] | None:
    """``(decode_s, token_s)`` from the scheduler's counters: a decode-only step's mean
    seconds, and the seconds of prefill and mixed steps per prompt token they ran (the
    mixed steps' decode rows counted in: a slot's expected hold, on the high side);
    ``None`` until measured."""
    if steps["decode"] < MIN_COST_STEPS or prompt_tokens <= 0:
        return None
    decode_s = busy_s["decode"] / steps["decode"]
    token_s = (busy_s["mixed"] + busy_s["prefill"]) / prompt_tokens
    return (decode_s, token_s) if token_s > 0 else None
