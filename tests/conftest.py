"""Shared fixtures: small real components, and the real default model loaded once."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from convo.engine import GREEDY, FinishReason, Generation, GenerationStats, Sampling
from convo.errors import BudgetError, DeviceOutOfMemory
from convo.messages import Message
from convo.tokens import CharCounter, TokenCounter


def _stats(prompt: int, new: int) -> GenerationStats:
    return GenerationStats(
        prompt_tokens=prompt,
        cached_tokens=0,
        prefill_tokens=prompt,
        new_tokens=new,
        kv_tokens=prompt + new,
        prefill_s=0.0,
        decode_s=0.0,
        ttft_s=0.0,
        total_s=0.0,
        tokens_per_s=0.0,
        memory_kind="none",
        attention="none",
    )


class FakeEngine:
    """A deterministic engine for unit tests of session logic (no model).

    It answers ``reply {n}`` (or what ``replies`` yields), records every prompt, and can be
    told to fail: ``fail_with`` is raised on the next ``fail_times`` calls.
    """

    def __init__(self, counter: TokenCounter | None = None, *, context_window: int = 100_000) -> None:
        self._counter = counter or CharCounter()
        self.context_window = context_window
        self.prompts: list[tuple[Message, ...]] = []
        self.released: list[str] = []
        self.fail_with: BaseException | None = None
        self.fail_times = 0
        self.reply_fn: Callable[[Sequence[Message]], str] | None = None

    @property
    def counter(self) -> TokenCounter:
        return self._counter

    def generate(
        self,
        messages: Sequence[Message],
        *,
        max_new_tokens: int,
        timeout_s: float | None = None,
        sampling: Sampling = GREEDY,
        stop: Sequence[str] = (),
        cache_key: str | None = None,
        on_text: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
        max_prompt_tokens: int | None = None,
    ) -> Generation:
        if max_prompt_tokens is not None and self._counter.count_prompt(messages) > max_prompt_tokens:
            raise BudgetError("rendered prompt over the budget")  # as the real engine does
        if self.fail_times > 0 and self.fail_with is not None:
            self.fail_times -= 1
            raise self.fail_with
        self.prompts.append(tuple(messages))
        text = self.reply_fn(messages) if self.reply_fn else f"reply {len(self.prompts)}"
        if on_text is not None:
            for word in text.split(" "):
                on_text(word + " ")
        prompt = self._counter.count_prompt(messages)
        return Generation(
            text=text,
            finish_reason=FinishReason.STOP,
            token_ids=(),
            stats=_stats(prompt, self._counter.count_text(text)),
        )

    def release(self, cache_key: str) -> None:
        self.released.append(cache_key)


@pytest.fixture
def counter() -> CharCounter:
    return CharCounter()


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def oom() -> DeviceOutOfMemory:
    return DeviceOutOfMemory("injected")


@pytest.fixture(scope="session")
def real_engine() -> Any:
    """The embedded default model (SmolLM2-135M-Instruct), greedy, loaded once."""
    from convo.engine import TransformersEngine

    return TransformersEngine()


@pytest.fixture(scope="session")
def smol_counter() -> TokenCounter:
    """The exact counter of the default model's tokenizer and chat template (no weights)."""
    from transformers import AutoTokenizer

    from convo.engine import default_model_path
    from convo.tokens import HFTokenCounter

    return HFTokenCounter(AutoTokenizer.from_pretrained(str(default_model_path()), local_files_only=True))
