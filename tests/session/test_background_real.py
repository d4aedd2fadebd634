"""Background work through the SDK on real engines: the rolling summary runs for its
session (``owner``), and once it is written the idle session's next prompt prefix is
prefilled, so the turn after a slide prefills little more than its new message.

Slow: the default model on CPU (the ``DynamicKV`` path, whose prefill runs in a thread
between calls). GPU: a random tiny Llama on static KV slots. The prefill checks skip on an
engine that does not declare ``supports_prefill``."""

from __future__ import annotations

import time
from typing import Any

import pytest

from convo import Budget, Session
from convo.summarize import JobStatus, SummaryWorker

torch = pytest.importorskip("torch")

BUDGET = Budget(
    context_tokens=1024, max_new_tokens=16, window_turns=2, summarize_batch_turns=1, summary_tokens=64
)
#: Seconds a real model gets for a summary (a small shared CPU is slow).
SUMMARY_WAIT_S = 300.0
#: Prompt tokens the turn after a slide may prefill beyond its new message (the template's
#: turn markers, and the generation prompt).
MARGIN_TOKENS = 24


def _background_prefill_done(engine: Any) -> bool:
    """Whether the next prompt's background prefill has run: the scheduler's first one, or,
    on the growing cache, no prefill thread still running. (The written summary's callback
    starts the thread before ``job.wait`` returns; the engine is shared with other tests, so
    its prefill count may be past one already: waiting on the count raced the thread.)"""
    if engine.scheduler_stats is not None:
        return engine.scheduler_stats.prefills >= 1
    return not any(t.is_alive() for t in list(engine._kv._prefill_threads))


def _slide_then_turn(engine: Any) -> tuple[Session, Any, int]:
    """Three turns (the window slides, its summary is written), then a fourth; returns
    the session, the fourth reply, and the tokens of its new message."""
    worker = SummaryWorker(max_defer_s=0.0)
    session = Session(engine, budget=BUDGET, system_prompt="You are terse.", summaries=worker)
    for text in ("My name is Ana.", "My boat is called Nautilus.", "I live in Brest."):
        session.send(text)
    job = worker.job(session.store, session.id)
    assert job is not None and job.wait(SUMMARY_WAIT_S) and job.status is JobStatus.DONE
    if engine.supports_prefill:  # let the background prefill run (slots: the scheduler's)
        deadline = time.monotonic() + 60
        while not _background_prefill_done(engine) and time.monotonic() < deadline:
            time.sleep(0.05)
    question = "What is my boat called?"
    reply = session.send(question)
    worker.close(wait=False)
    return session, reply, session.counter.count_text(question)


def _check_prefilled(engine: Any) -> None:
    if not engine.supports_prefill:
        pytest.skip(f"{type(engine).__name__} does not declare supports_prefill")
    session, reply, new_tokens = _slide_then_turn(engine)
    assert session.summarized_turns >= 1
    gen = reply.stats.generation
    assert gen.cached_tokens > 0
    assert gen.prefill_tokens <= new_tokens + MARGIN_TOKENS, (gen.prefill_tokens, gen.prompt_tokens)


@pytest.mark.slow
def test_cpu_summary_for_its_session_then_the_turn_goes_on(real_engine: Any) -> None:
    session, reply, _ = _slide_then_turn(real_engine)
    assert session.summarized_turns >= 1 and session.summary.strip()
    assert reply.text.strip()
    state = session.summary_state
    assert state.lag_s is not None and state.lag_s >= 0.0


@pytest.mark.slow
def test_cpu_turn_after_a_slide_prefills_only_its_message(real_engine: Any) -> None:
    _check_prefilled(real_engine)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_turn_after_a_slide_prefills_only_its_message() -> None:
    from convo.engines.local.engine import TransformersEngine

    engine = TransformersEngine(
        "random:tiny-llama", device="cuda", kv_slots=4, slot_tokens=BUDGET.context_tokens
    )
    try:
        _check_prefilled(engine)
    finally:
        engine.close()
