"""CUDA graph capture for the static decoder: what is captured, in which order, and how.

The decoder captures a graph per decode bucket, per prefill chunk bucket and per pair of
the two (the mixed step). All of them share one memory pool: a graph's temporaries are
dead when it ends, and graphs never run at the same time, so a capture may reuse the
blocks an earlier capture freed. The caching allocator splits a free block for a smaller
request but cannot merge blocks for a larger one, so the largest graph is captured first
(:func:`capture_order`): the pool then holds about the largest graph's temporaries,
where captures in growing order each took new segments (about twice the largest).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from convo.models.defaults import MIXED_PACK_CHUNKS


@dataclass(frozen=True)
class GraphSpec:
    """One captured forward: ``rows`` decode rows and a prefill chunk of ``tokens`` tokens
    (a decode step: ``tokens=0``; a prefill chunk: ``rows=0``; a mixed step: both)."""

    rows: int = 0
    tokens: int = 0

    @property
    def logit_rows(self) -> int:
        """Rows of logits it computes: each decode row's, and the last token's of its chunk
        (of each packed chunk in a mixed step, :data:`MIXED_PACK_CHUNKS`)."""
        if not self.tokens:
            return self.rows
        return self.rows + (MIXED_PACK_CHUNKS if self.rows else 1)

    def size(self, *, hidden: int, intermediate: int, vocab: int) -> int:
        """A proxy of its temporaries (in compute-dtype elements): per token through the
        layers about ``3 * intermediate + 4 * hidden`` (the planner's activation model),
        and the logits of its logit rows."""
        return (self.rows + self.tokens) * (3 * intermediate + 4 * hidden) + self.logit_rows * vocab


def capture_order(
    specs: Sequence[GraphSpec], *, hidden: int, intermediate: int, vocab: int
) -> list[GraphSpec]:
    """``specs`` largest first (by :meth:`GraphSpec.size`; ties: more decode rows first)."""
    return sorted(
        specs,
        key=lambda s: (s.size(hidden=hidden, intermediate=intermediate, vocab=vocab), s.rows),
        reverse=True,
    )


def capture(fn: Callable[[], Any], stream: Any, pool: Any, eager_runs: int) -> tuple[Any, Any]:
    """Run ``fn`` ``eager_runs`` times on ``stream`` (compiles, tunes kernels), then capture
    it into a CUDA graph whose memory comes from ``pool``.

    Returns:
        ``(graph, output)``: replaying the graph rewrites ``output`` in place.
    """
    import torch

    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        for _ in range(eager_runs):
            fn()
    torch.cuda.current_stream(stream.device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out
