"""The local engine sized to a memory limit (KVConfig.gpu_memory / gpu_memory_utilization):
validated when built, priced before any weight loads, CUDA only."""

from __future__ import annotations

import pytest

from convo.engines.local.config import KVConfig, LoadConfig
from convo.engines.local.loading import dense_copy_bytes, memory_fit, pending_int4_bytes, sized_configs
from convo.errors import ConfigError
from convo.models import GiB, Quant, load_config
from convo.planner.fit import fit_serve
from convo.planner.weights import weight_bytes

LLAMA = load_config("random:llama-2-7b")


def test_a_memory_limit_is_checked_when_the_config_is_built() -> None:
    assert KVConfig(gpu_memory="24GiB").gpu_memory == "24GiB"
    assert KVConfig(gpu_memory_utilization=0.9).gpu_memory_utilization == 0.9
    for bad in (
        {"gpu_memory": "24"},
        {"gpu_memory_utilization": 2.0},
        {"gpu_memory": 1, "gpu_memory_utilization": 0.5},
    ):
        with pytest.raises(ConfigError):
            KVConfig(**bad)  # type: ignore[arg-type]


def test_the_engine_takes_what_the_planner_picks_and_given_flags_win() -> None:
    load = LoadConfig()
    kv = KVConfig(gpu_memory="16GiB", slot_tokens=2048)
    fit = memory_fit(
        LLAMA, kv=kv, load=load, quant=Quant.INT4, max_input_tokens=None, device_total_bytes=None
    )
    assert fit is not None
    assert fit.kv_slots == fit_serve(LLAMA, memory_bytes=16 * GiB, slot_tokens=2048, quant="int4").kv_slots
    sized_kv, sized_load = sized_configs(fit, kv, load)
    assert (sized_kv.kv_slots, sized_kv.slot_tokens, sized_load.int4_kernel) == (fit.kv_slots, 2048, "triton")
    share = KVConfig(gpu_memory_utilization=0.5, slot_tokens=2048)
    half = memory_fit(
        LLAMA, kv=share, load=load, quant=Quant.INT4, max_input_tokens=None, device_total_bytes=32 * GiB
    )
    assert half is not None and half.kv_slots == fit.kv_slots  # half of 32 GiB is 16 GiB
    assert (
        memory_fit(
            LLAMA, kv=KVConfig(), load=load, quant=Quant.INT4, max_input_tokens=None, device_total_bytes=None
        )
        is None
    )
    with pytest.raises(ConfigError, match="largest safe setting is --kv-slots"):
        memory_fit(
            LLAMA, kv=KVConfig(gpu_memory="16GiB", kv_slots=40, slot_tokens=2048), load=load,
            quant=Quant.INT4, max_input_tokens=None, device_total_bytes=None,
        )  # fmt: skip
    # the dense copies the budget allows come out of the limit before the slots are sized
    copies = LoadConfig(int4_dense_copy_bytes=4 * GiB)
    fewer = memory_fit(
        LLAMA, kv=kv, load=copies, quant=Quant.INT4, max_input_tokens=None, device_total_bytes=None
    )
    assert fewer is not None
    kept = dense_copy_bytes(LLAMA, 4 * GiB)  # (10 whole layers, 3.77 GiB)
    assert (
        fewer.kv_slots
        == fit_serve(LLAMA, memory_bytes=16 * GiB - kept, slot_tokens=2048, quant="int4").kv_slots
    )
    assert fewer.kv_slots < fit.kv_slots
    # whole layers, never more than every layer's (Llama-2-7B: 202,375,168 weights a layer)
    layer = 202_375_168 * 2
    assert dense_copy_bytes(LLAMA, 4 * GiB) == (4 * GiB // layer) * layer
    assert dense_copy_bytes(LLAMA, 1 << 50) == 32 * layer and dense_copy_bytes(LLAMA, layer - 1) == 0
    big = KVConfig(gpu_memory="40GiB", slot_tokens=2048)
    all_layers = memory_fit(
        LLAMA, kv=big, load=LoadConfig(int4_dense_copy_bytes=1 << 50), quant=Quant.INT4,
        max_input_tokens=None, device_total_bytes=None,
    )  # fmt: skip
    assert all_layers is not None
    assert (
        all_layers.kv_slots
        == fit_serve(LLAMA, memory_bytes=40 * GiB - 32 * layer, slot_tokens=2048, quant="int4").kv_slots
    )
    # the default slots, sized before the layers come over, count the int4 bytes still to come
    assert (
        pending_int4_bytes(LLAMA, int4_kernel="triton", group_size=32)
        == weight_bytes(LLAMA, "int4", int4_layouts=1).quantized_bytes
    )


def test_a_memory_limit_on_cpu_is_refused_before_loading() -> None:
    pytest.importorskip("torch")
    from convo.engines.local.engine import TransformersEngine

    with pytest.raises(ConfigError, match="CUDA"):
        TransformersEngine("random:tiny-llama", device="cpu", kv=KVConfig(gpu_memory="1GiB"))


@pytest.mark.gpu
def test_cuda_int4_7b_loads_a_layer_at_a_time_inside_its_sized_plan() -> None:
    """Llama-2-7B int4 (random weights) sized to 16 GiB: the slots picked are the slots
    taken, and the device never held more than the plan's usable memory while loading
    (the dense model, 12.6 GiB, never sits on the GPU)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from pathlib import Path

    from convo.engines.local.engine import TransformersEngine

    config = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "llama-2-7b"
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_reserved()
    engine = TransformersEngine(
        f"random:{config}", quant="int4", kv=KVConfig(gpu_memory="16GiB", slot_tokens=2048)
    )
    try:
        fit = engine.memory_fit
        assert fit is not None and engine.decoder is not None
        assert (
            engine.decoder.pool.slots == fit.kv_slots
            and engine.decoder.pool_measured_bytes == fit.prediction.kv_bytes
        )
        assert engine.decoder.int4_layout == ("both" if fit.int4_layouts == 2 else "plain")
        assert torch.cuda.max_memory_reserved() - base <= fit.usable_bytes
    finally:
        engine.close()
