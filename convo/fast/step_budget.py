"""The prompt tokens one scheduler step may prefill while replies stream (issue 22 #3).

While replies stream, a step prefills ``interleave_tokens`` prompt tokens beside the decode
rows. When prompt tokens pile up, the step's share grows toward full prefill speed, but
never past what keeps the gap between two tokens of a running reply within
:data:`DEFAULT_GAP_STEPS` decode-only steps (:func:`prompt_token_budget`, from the step
costs the scheduler measures, :func:`step_costs`).
"""

from __future__ import annotations

__all__ = ["DEFAULT_GAP_STEPS", "MIN_COST_STEPS", "PILEUP_CHUNKS", "prompt_token_budget", "step_costs"]

#: While replies stream and prompt tokens pile up, a step may grow its prefill until it is
#: expected to take this many decode-only steps: the gap between two tokens of a running
#: reply (issue 22 bounds the p95 gap at 3x the steady step; this keeps a margin).
DEFAULT_GAP_STEPS = 2.5
#: Prompt tokens pile up once more than this many streaming steps' chunks
#: (``interleave_tokens`` each) wait; the step then takes 1/PILEUP_CHUNKS of what waits,
#: so a burst drains in about this many steps at most, as fast as the gap allows.
PILEUP_CHUNKS = 16
#: Decode-only steps measured before the step cost is trusted (until then, and on a
#: decoder whose steps cost nothing measurable, a streaming step prefills
#: ``interleave_tokens``).
MIN_COST_STEPS = 8


def prompt_token_budget(
    *,
    waiting: int,
    rows: int,
    step_tokens: int,
    interleave_tokens: int,
    decode_s: float | None,
    token_s: float | None,
    gap_steps: float = DEFAULT_GAP_STEPS,
) -> int:
    """Prompt tokens one step may prefill while replies stream.

    Normally ``interleave_tokens`` (within what ``step_tokens`` leaves beside the ``rows``
    decode rows, at least 1). When more than :data:`PILEUP_CHUNKS` such chunks of prompt
    tokens are ``waiting``, it grows to 1/PILEUP_CHUNKS of them, toward the whole step
    budget (full prefill speed), but never past what keeps the step within ``gap_steps``
    decode-only steps: a step of ``p`` prompt tokens costs about ``decode_s + p *
    token_s`` (both measured by the scheduler; ``None``: not known yet, no growth).

    >>> prompt_token_budget(waiting=300, rows=16, step_tokens=2048, interleave_tokens=256,
    ...                     decode_s=0.02, token_s=0.02 / 256)
    256
    >>> prompt_token_budget(waiting=30_000, rows=16, step_tokens=2048, interleave_tokens=256,
    ...                     decode_s=0.02, token_s=0.02 / 256)
    384
    """
    room = max(step_tokens - rows, 1)
    base = max(min(room, interleave_tokens), 1)
    want = waiting // PILEUP_CHUNKS
    if want <= base or not decode_s or not token_s or decode_s <= 0 or token_s <= 0:
        return base
    afford = int((gap_steps - 1.0) * decode_s / token_s)
    return max(base, min(want, room, afford))


def step_costs(
    steps: dict[str, int], busy_s: dict[str, float], prompt_tokens: int
) -> tuple[float, float] | None:
    """``(decode_s, token_s)`` from the scheduler's counters: a decode-only step's mean
    seconds, and the seconds of prefill and mixed steps per prompt token they ran (the
    mixed steps' decode rows counted in: on the high side, as a grown chunk runs in a
    forward of its own beside the rows' step); ``None`` until measured."""
    if steps["decode"] < MIN_COST_STEPS or prompt_tokens <= 0:
        return None
    decode_s = busy_s["decode"] / steps["decode"]
    token_s = (busy_s["mixed"] + busy_s["prefill"]) / prompt_tokens
    return (decode_s, token_s) if token_s > 0 else None
