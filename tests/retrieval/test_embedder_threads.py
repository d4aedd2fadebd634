"""Embedder under concurrent callers: shared forward passes, a thread-safe cache, errors
that reach only the call that caused them."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from convo.embeddings import _Coalescer


def _vec(text: str) -> np.ndarray:
    return np.full(4, float(len(text)), dtype=np.float32)


class _GatedCompute:
    """A compute whose first pass blocks until released, so other calls pile up."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.batches: list[list[str]] = []

    def __call__(self, texts: Sequence[str]) -> dict[str, np.ndarray]:
        self.batches.append(list(texts))
        if len(self.batches) == 1:
            self.entered.set()
            self.gate.wait(10)
        if any(t.startswith("bad") for t in texts):
            raise ValueError("bad text")
        return {t: _vec(t) for t in texts}


def _run_queued(co: _Coalescer, compute: _GatedCompute, calls: list[list[str]]) -> list[object]:
    """Start a first call that blocks in its pass, then ``calls`` while it blocks; release."""
    results: list[object] = [None] * len(calls)

    def one(i: int) -> None:
        try:
            results[i] = co.run(calls[i])
        except Exception as exc:
            results[i] = exc

    first = threading.Thread(target=co.run, args=(["x"],))
    first.start()
    assert compute.entered.wait(10)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    deadline = threading.Event()
    while len(co._queue) < len(calls) and not deadline.wait(0.01):
        pass
    compute.gate.set()
    for t in [first, *threads]:
        t.join(10)
    return results


def test_calls_made_while_a_pass_runs_share_the_next_pass() -> None:
    compute = _GatedCompute()
    co = _Coalescer(compute)
    calls = [[f"text {i}", "shared"] for i in range(6)]
    results = _run_queued(co, compute, calls)
    # The first pass, then one for all six waiting calls (their texts once each).
    assert len(compute.batches) == 2
    assert sorted(compute.batches[1]) == sorted({t for c in calls for t in c})
    for call, got in zip(calls, results, strict=True):
        assert isinstance(got, dict) and set(got) == set(call)
        for t in call:
            assert np.array_equal(got[t], _vec(t))
    assert co.passes == 2 and co.calls == 7


def test_a_failing_pass_fails_only_the_call_that_causes_it() -> None:
    compute = _GatedCompute()
    co = _Coalescer(compute)
    calls = [["good one"], ["bad one"], ["good two"]]
    results = _run_queued(co, compute, calls)
    assert isinstance(results[1], ValueError)
    assert isinstance(results[0], dict) and np.array_equal(results[0]["good one"], _vec("good one"))
    assert isinstance(results[2], dict) and np.array_equal(results[2]["good two"], _vec("good two"))
    # The shared pass failed; each call then ran alone.
    assert sorted(map(tuple, compute.batches[2:])) == [("bad one",), ("good one",), ("good two",)]


def test_a_lone_call_runs_at_once() -> None:
    seen: list[list[str]] = []
    co = _Coalescer(lambda texts: (seen.append(list(texts)), {t: _vec(t) for t in texts})[1])
    assert set(co.run(["a", "b"])) == {"a", "b"}
    assert seen == [["a", "b"]] and co.passes == 1


@pytest.fixture(scope="module")
def minilm():  # type: ignore[no-untyped-def]
    from convo.embeddings import Embedder

    return Embedder(precision="float32", cache_size=64)


def test_minilm_from_many_threads_gives_each_thread_its_vectors(minilm) -> None:  # type: ignore[no-untyped-def]
    texts = [f"Message number {i} says the meeting moved to room {i * 7}." for i in range(48)]
    alone = {t: minilm.encode([t])[0] for t in texts[:8]}
    passes = minilm._coalescer.passes
    minilm.cache_size = 0  # computed again below, concurrently (the cache is cleared)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: minilm.encode([texts[i], texts[(i + 1) % 48]]), range(48)))
    minilm.cache_size = 64
    for i, vecs in enumerate(got):
        assert vecs.shape == (2, 384)
        for row, t in zip(vecs, (texts[i], texts[(i + 1) % 48]), strict=True):
            assert np.isclose(np.linalg.norm(row), 1.0, atol=1e-5)
            if t in alone:
                assert np.allclose(row, alone[t], atol=1e-5)
    # 48 calls, fewer passes: the calls that overlapped shared them.
    assert minilm._coalescer.passes - passes < 48
    # The cache stays consistent under concurrent writers and never passes its size.
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda t: minilm.encode([t]), texts))
    assert len(minilm._cache) <= 64


def _queue_behind_first(co: _Coalescer, compute: _GatedCompute, calls: list[tuple[list[str], bool]]) -> None:
    """A first call blocks in its pass; ``calls`` (texts, background) queue in this order."""
    first = threading.Thread(target=co.run, args=(["x"],))
    first.start()
    assert compute.entered.wait(10)
    threads = []
    for texts, background in calls:
        queued = len(co._queue)
        t = threading.Thread(target=lambda a=texts, b=background: co.run(a, background=b))
        t.start()
        threads.append(t)
        deadline = threading.Event()
        while len(co._queue) == queued and not deadline.wait(0.005):
            pass
    compute.gate.set()
    for t in [first, *threads]:
        t.join(10)
        assert not t.is_alive()


def test_a_turns_call_goes_before_background_calls_queued_ahead_of_it() -> None:
    compute = _GatedCompute()
    co = _Coalescer(compute)
    ahead = [([f"turn {i} part {j}" for j in range(3)], True) for i in range(3)]
    _queue_behind_first(co, compute, [*ahead, (["the question"], False)])
    # The question waited for the pass in flight only, and rode alone: no background text
    # shares its pass, so its wait is not made longer by them.
    assert compute.batches[1] == ["the question"]
    # Background passes then hold at most BACKGROUND_PASS_CHARS of work (at least one call).
    from convo.embeddings import BACKGROUND_PASS_CHARS, pass_chars

    rest = compute.batches[2:]
    assert sorted(t for b in rest for t in b) == sorted(t for c, _ in ahead for t in c)
    assert all(pass_chars(b) <= max(BACKGROUND_PASS_CHARS, pass_chars(ahead[0][0])) for b in rest)


def test_background_calls_share_small_passes_in_order() -> None:
    compute = _GatedCompute()
    co = _Coalescer(compute)
    from convo.embeddings import BACKGROUND_PASS_CHARS, PASS_TEXT_OVERHEAD_CHARS

    # Messages: two fill a pass. Words: many share one.
    long = BACKGROUND_PASS_CHARS // 2 - PASS_TEXT_OVERHEAD_CHARS - 4
    ahead = [([f"t{i} " + "x" * long], True) for i in range(5)] + [([f"w{i}"], True) for i in range(30)]
    _queue_behind_first(co, compute, ahead)
    assert [len(b) for b in compute.batches[1:]] == [2, 2, 1 + 30]
    assert [t for b in compute.batches[1:] for t in b] == [t for c, _ in ahead for t in c]


def test_encode_inside_background_work_splits_into_small_passes(minilm) -> None:  # type: ignore[no-untyped-def]
    from convo.background import background_work, in_background
    from convo.embeddings import background_passes

    texts = [f"Background text {i} about the garden shed and its roof. " * 7 for i in range(10)]
    minilm.cache_size = 0
    try:
        front = minilm.encode(texts)
        passes = minilm._coalescer.passes
        assert not in_background()
        with background_work():
            assert in_background()
            back = minilm.encode(texts)
        assert not in_background()
    finally:
        minilm.cache_size = 64
    assert minilm._coalescer.passes - passes == len(background_passes(texts)) > 1
    assert np.allclose(front, back, atol=1e-5)  # the same vectors, in smaller passes
