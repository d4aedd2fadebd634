"""The real default model (SmolLM2-135M-Instruct) behind the capped engine. Greedy."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from convo import Budget, BudgetError, Session
from convo.engines.local.engine import TransformersEngine
from convo.messages import assistant, system, user
from convo.models import FinishReason, Quant

pytestmark = pytest.mark.slow

QUESTION = [system("You are a helpful assistant."), user("What is the capital of France?")]


def test_defaults_offline_sdpa_fp32_on_cpu(real_engine: TransformersEngine) -> None:
    assert real_engine.attention == "sdpa"
    assert real_engine.quant is Quant.FP32  # AUTO on CPU
    assert real_engine.kv_bytes_per_token == 46_080  # 30 layers * 3 kv heads * 64 * 2 * 4 bytes
    assert real_engine.context_window == 8192
    ids = real_engine.counter.render_ids(QUESTION)
    assert real_engine.counter.count_prompt(QUESTION) == len(ids)


def test_greedy_answer_is_sensible_and_stable(real_engine: TransformersEngine) -> None:
    a = real_engine.generate(QUESTION, max_new_tokens=12)
    b = real_engine.generate(QUESTION, max_new_tokens=12)
    assert "Paris" in a.text
    assert a.text == b.text
    assert a.stats.new_tokens <= 12
    assert a.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


def test_kv_cache_reuse_matches_a_fresh_prefill(real_engine: TransformersEngine) -> None:
    real_engine.release("reuse")
    first = real_engine.generate(QUESTION, max_new_tokens=8, cache_key="reuse")
    follow = [*QUESTION, assistant(first.text), user("And of Italy?")]
    reused = real_engine.generate(follow, max_new_tokens=8, cache_key="reuse")
    fresh = real_engine.generate(follow, max_new_tokens=8)
    assert reused.stats.cached_tokens > 0
    assert reused.stats.prefill_tokens < fresh.stats.prefill_tokens
    assert reused.text == fresh.text
    # The cache in memory is what the config says it should be.
    assert reused.stats.kv_bytes == reused.stats.kv_bytes_expected
    assert reused.stats.kv_bytes == reused.stats.kv_tokens * 46_080
    assert reused.stats.kv_tokens <= reused.stats.prompt_tokens + 8
    # A prompt that diverges early is cropped to the common prefix, and still correct.
    diverged = [system("You are a pirate."), user("And of Italy?")]
    crop = real_engine.generate(diverged, max_new_tokens=8, cache_key="reuse")
    assert 0 < crop.stats.cached_tokens < reused.stats.prompt_tokens
    assert crop.text == real_engine.generate(diverged, max_new_tokens=8).text
    real_engine.release("reuse")
    assert "reuse" not in real_engine.cached_sessions


def test_timeouts_keep_partial_text_and_bound_prefill(real_engine: TransformersEngine) -> None:
    story = [user("Write a very long story about a dragon.")]
    out = real_engine.generate(story, max_new_tokens=400, timeout_s=1.0)
    assert out.finish_reason is FinishReason.TIMEOUT
    # The clock is checked between forward passes: the overshoot is at most one step
    # (generous slack for a loaded CI machine; 400 tokens would take far longer).
    assert out.stats.total_s < 1.0 + 8.0
    assert out.stats.new_tokens < 400
    assert out.text == real_engine.tokenizer.decode(list(out.token_ids), skip_special_tokens=True)
    long_prompt = [user("word " * 3000)]
    engine = TransformersEngine.from_model(real_engine.model, real_engine.tokenizer, prefill_chunk_tokens=64)
    slow = engine.generate(long_prompt, max_new_tokens=4, timeout_s=0.3)
    assert slow.finish_reason is FinishReason.TIMEOUT
    assert slow.stats.new_tokens == 0
    # The chunked prefill stopped at the deadline: a few 64-token chunks, not all 47.
    assert slow.stats.kv_tokens < slow.stats.prompt_tokens // 2


def test_input_cap_is_enforced_before_the_model(real_engine: TransformersEngine) -> None:
    engine = TransformersEngine.from_model(real_engine.model, real_engine.tokenizer, max_input_tokens=64)
    with pytest.raises(BudgetError, match="input cap"):
        engine.generate([user("tell me " * 60)], max_new_tokens=8)


def test_stream_sync_and_async(real_engine: TransformersEngine) -> None:
    whole = real_engine.generate(QUESTION, max_new_tokens=10)
    stream = real_engine.stream(QUESTION, max_new_tokens=10)
    chunks = list(stream)
    assert len(chunks) > 1 and "".join(chunks) == whole.text
    assert stream.result is not None and stream.result.text == whole.text

    async def collect() -> str:
        return "".join([c async for c in real_engine.astream(QUESTION, max_new_tokens=10)])

    assert asyncio.run(collect()) == whole.text


def test_stop_strings(real_engine: TransformersEngine) -> None:
    out = real_engine.generate(
        [user("Count from 1 to 10, separated by commas.")], max_new_tokens=40, stop=["5"]
    )
    assert out.finish_reason is FinishReason.STOP
    assert "5" not in out.text and "6" not in out.text


def test_injected_oom_is_recovered_by_the_session(real_engine: TransformersEngine, monkeypatch: Any) -> None:
    import torch

    session = Session(real_engine, budget=Budget(context_tokens=1024, max_new_tokens=8, summary_tokens=0))
    session.send("Hello there.")
    real_forward = real_engine.model.forward
    calls = {"n": 0}

    def flaky_forward(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(real_engine.model, "forward", flaky_forward)
    reply = session.send("What is the capital of France?")
    assert reply.stats.oom_retries == 1 and "out of memory" in reply.stats.recovery
    assert session.id not in real_engine.cached_sessions or reply.stats.generation.cached_tokens == 0
    assert [m.content for m in session.messages][-2] == "What is the capital of France?"
    assert len(session.store.load(session.id)[1]) == 4


def test_nf4_loads_and_runs_on_cpu(real_engine: TransformersEngine) -> None:
    engine = TransformersEngine(quant="nf4", device="cpu")
    assert engine.quant is Quant.NF4
    bf16 = TransformersEngine(quant="bf16", device="cpu")
    assert bf16.kv_bytes_per_token == 23_040  # the published SmolLM2-135M figure (bf16)
    assert getattr(engine.model, "is_loaded_in_4bit", False)
    assert engine.model.get_memory_footprint() < 0.6 * real_engine.model.get_memory_footprint()
    out = engine.generate(QUESTION, max_new_tokens=6)
    assert out.stats.new_tokens >= 1 and out.text.strip()


def test_idle_kv_caches_are_released_without_further_calls(real_engine: TransformersEngine) -> None:
    import time

    engine = TransformersEngine.from_model(real_engine.model, real_engine.tokenizer, cache_idle_s=0.3)
    engine.generate(QUESTION, max_new_tokens=2, cache_key="idle")
    assert engine.cached_sessions == ["idle"]
    deadline = time.monotonic() + 10
    while engine.cached_sessions and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine.cached_sessions == []
