"""Sampling of the scheduler's rows: one argmax for the greedy rows, each other row with
its own temperature, top-p, top-k, repetition penalty, minimum length and generator."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, Protocol

__all__ = ["SampledRow", "sample_rows"]


class SampledRow(Protocol):
    """What sampling reads of a row (a :class:`~convo.fast.scheduler.DecodeRequest`)."""

    @property
    def ids(self) -> Sequence[int]:
        """The prompt's token ids."""

    @property
    def new_ids(self) -> Sequence[int]:
        """The tokens generated so far."""

    @property
    def eos(self) -> Collection[int]:
        """Tokens that end the reply (masked until ``min_new_tokens``)."""

    @property
    def sampling(self) -> Any:
        """``temperature``, ``top_p``, ``top_k``, ``repetition_penalty``, ``min_new_tokens``."""

    @property
    def _generator(self) -> Any:
        """The row's seeded ``torch.Generator``, or ``None``."""


def sample_rows(logits: Any, rows: Sequence[SampledRow]) -> list[int]:
    """Next token per row: greedy rows by one argmax, the others with their own settings."""
    import torch

    out = logits.argmax(dim=-1)
    special = [
        i
        for i, r in enumerate(rows)
        if r.sampling.temperature > 0
        or r.sampling.repetition_penalty != 1.0
        or len(r.new_ids) < r.sampling.min_new_tokens
    ]
    if not special:
        return [int(t) for t in out.tolist()]
    result = out.tolist()
    for i in special:
        r, s = rows[i], rows[i].sampling
        row = logits[i].clone()
        if s.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.ids) | set(r.new_ids)), device=row.device)
            seen = seen[seen < row.shape[0]]
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / s.repetition_penalty, vals * s.repetition_penalty)
        if len(r.new_ids) < s.min_new_tokens and r.eos:
            eos = torch.tensor(sorted(r.eos), device=row.device)
            row[eos[eos < row.shape[0]]] = float("-inf")
        if s.temperature == 0:
            result[i] = int(row.argmax())
            continue
        row = row / s.temperature
        if s.top_k:
            kth = torch.topk(row, min(s.top_k, row.shape[0])).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if s.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
            drop = cum - torch.softmax(sorted_logits, dim=-1) > s.top_p
            row[order[drop]] = float("-inf")
        probs = torch.softmax(row, dim=-1)
        result[i] = int(torch.multinomial(probs, 1, generator=r._generator))
    return [int(t) for t in result]
