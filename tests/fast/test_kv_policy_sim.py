"""benchmarks/kv_policy.py: eviction by expected next use against LRU on issue 22's loads,
simulated over the real slot pool and a fake clock (seconds, no model)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from benchmarks import kv_policy


def _run(preset: str, **load: object) -> dict[str, dict[str, object]]:
    spec = {**kv_policy.PRESETS[preset], **load}
    return {p: kv_policy.simulate(kv_policy.Load(**spec), p) for p in kv_policy.POLICIES}  # type: ignore[arg-type]


def test_more_users_than_slots_with_think_time() -> None:
    """64 users on 16 slots, think 3-8 s: LRU evicts the user about to speak and recomputes
    every turn (re-prefill 1.0, as measured on the H200: 1.08); host memory keeps the KV, and
    next use swaps less; with host memory for only 16 sessions, next use keeps what is
    needed soon and recomputes much less than LRU."""
    full = _run("chat-users")
    assert full["lru"]["reprefill"] >= 0.95
    assert full["next-use"]["reprefill"] < full["lru"]["reprefill"]
    assert full["next-use+host"]["reprefill"] <= 0.35
    assert full["next-use+host"]["swaps_out"] < full["lru+host"]["swaps_out"]
    short = _run("chat-users", host_entries=16)
    assert short["next-use+host"]["reprefill"] < short["lru+host"]["reprefill"] - 0.1
    assert short["next-use+host"]["host_dropped"] < short["lru+host"]["host_dropped"]


def test_as_many_users_as_slots_with_summaries() -> None:
    """16 users on 16 slots, 2 s think, a summary every 4 turns: summaries that take a
    thinking session's slot (LRU, one-off) make its next turn recompute and get preempted;
    run for their session from its own slot, they cost neither."""
    got = _run("think-2s", turns=8)
    assert got["lru"]["preemptions"] > 0 and got["lru"]["reprefill"] > 0.5
    assert got["next-use+host"]["preemptions"] == 0
    assert got["next-use+host"]["reprefill"] <= 0.35
    assert got["next-use+host"]["swaps_out"] == 0
