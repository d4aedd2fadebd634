"""Shared fixtures: small real components, and the real default model loaded once."""

from __future__ import annotations

from typing import Any

import pytest

from convo.errors import DeviceOutOfMemory
from convo.testing import ScriptedEngine
from convo.tokens import CharCounter, TokenCounter

FakeEngine = ScriptedEngine


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
    from convo.engines.transformers import TransformersEngine

    return TransformersEngine()


@pytest.fixture(scope="session")
def smol_counter() -> TokenCounter:
    """The exact counter of the default model's tokenizer and chat template (no weights)."""
    from transformers import AutoTokenizer

    from convo.engines.transformers import default_model_path
    from convo.tokens import HFTokenCounter

    return HFTokenCounter(AutoTokenizer.from_pretrained(str(default_model_path()), local_files_only=True))
