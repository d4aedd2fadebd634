"""``KVConfig(kv_dtype="fp8")`` on the local engine: slots on CPU too, fp8 K/V in them, the
reports' KV bytes those of the fp8 pool; ``--kv-dtype`` on ``convo serve``/``chat``."""

from __future__ import annotations

import argparse

import pytest

from convo.cli.common import add_local_engine_arguments
from convo.engines.local.config import KVConfig
from convo.errors import ConfigError
from convo.messages import user
from convo.models.defaults import DEFAULT_CPU_KV_SLOTS, FP8_KV_SCALE_BYTES

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from convo.engines.local.engine import TransformersEngine  # noqa: E402


def test_fp8_engine_on_cpu_takes_slots_and_reports_their_bytes() -> None:
    engine = TransformersEngine(
        "random:tiny-llama", device="cpu", kv=KVConfig(slot_tokens=128, kv_dtype="fp8")
    )
    try:
        assert engine.kv_dtype == "fp8"
        decoder = engine.decoder
        assert decoder is not None and decoder.pool.scaled
        assert decoder.pool.slots == DEFAULT_CPU_KV_SLOTS  # fp32 on CPU alone would keep plain generate
        # tiny-llama: 2 layers x 2 kv heads x (16 fp8 values + a float32 scale), for K and V
        assert engine.kv_bytes_per_token == 2 * 2 * 2 * (16 + FP8_KV_SCALE_BYTES)
        first = engine.generate([user("hello")], max_new_tokens=4, cache_key="s")
        second = engine.generate([user("hello"), user("again")], max_new_tokens=4, cache_key="s")
        assert second.stats.cached_tokens > 0
        assert second.stats.kv_bytes == second.stats.kv_bytes_expected > 0
        assert first.stats.kv_slot_bytes == decoder.pool.slot_nbytes == 128 * engine.kv_bytes_per_token
    finally:
        engine.close()


def test_fp8_without_slots_is_refused_before_loading() -> None:
    with pytest.raises(ConfigError, match="kv_slots must be > 0"):
        TransformersEngine("random:tiny-llama", device="cpu", kv=KVConfig(kv_slots=0, kv_dtype="fp8"))


def test_kv_dtype_flag_takes_the_choices() -> None:
    p = argparse.ArgumentParser()
    add_local_engine_arguments(p)
    assert p.parse_args([]).kv_dtype == "auto"
    assert p.parse_args(["--kv-dtype", "fp8"]).kv_dtype == "fp8"
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-dtype", "int8"])
