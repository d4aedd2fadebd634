"""Memory model and planner: real numbers from ANCHORS.md and an H200 calibration run."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from typing import Any

import pytest
from conftest import check_plan_json

from convo.cli.plan import add_plan_arguments, run_plan_cli
from convo.errors import ConfigError
from convo.models import BUILTIN_CONFIGS, DType, GiB, ModelShape, Quant, load_config, parse_size
from convo.planner.memory import VRAMModel as MemoryModel
from convo.planner.memory import kv_generations
from convo.planner.weights import quantized_linear_bytes, weight_bytes


def shape(name: str) -> ModelShape:
    return ModelShape.from_config(load_config(name))


@pytest.mark.parametrize(
    ("name", "per_token"),
    [
        ("default", 23_040),
        ("random:llama-2-7b", 524_288),
        ("random:llama-3-8b", 131_072),
        ("random:mistral-7b", 131_072),
    ],
)
def test_kv_bytes_per_token_bf16(name: str, per_token: int) -> None:
    assert shape(name).kv_bytes_per_token("bf16") == per_token


def test_kv_dtype_and_batch_scale() -> None:
    s = shape("random:llama-2-7b")
    assert s.kv_bytes(1000, 4, "fp8") == 1000 * 4 * 524_288 // 2
    assert s.kv_bytes(1000, 1, "fp32") == 2 * 1000 * 524_288


def test_head_dim_from_config_wins() -> None:
    cfg = dict(load_config("default"), hidden_size=512, head_dim=128)
    assert ModelShape.from_config(cfg).head_dim == 128


def test_sliding_window_caps_tokens() -> None:
    s = shape("random:mistral-7b")
    assert s.kv_bytes(10_000) == s.kv_bytes(4096)
    assert s.kv_bytes(10_000, cap_windows=False) == 10_000 * 131_072
    assert s.kv_bytes(1000) == 1000 * 131_072


def test_layer_types_mix_full_and_sliding() -> None:
    cfg = dict(
        load_config("default"),
        sliding_window=512,
        layer_types=["sliding_attention", "full_attention"] * 15,
    )
    s = ModelShape.from_config(cfg)
    per_layer = 2 * 3 * 64 * 2
    assert s.kv_bytes(2048) == 15 * per_layer * 512 + 15 * per_layer * 2048


def test_nf4_double_quant_is_4127_bits() -> None:
    n = 4096 * 11008
    bits = 8 * quantized_linear_bytes(11008, 4096, Quant.NF4) / n
    assert bits == pytest.approx(4.127, abs=0.002)


def test_llama2_7b_weights_match_h200() -> None:
    # ANCHORS: 12.55 GiB bf16, 3.64 GiB nf4; an H200 run of this repo measured 3.61 GiB
    cfg = load_config("random:llama-2-7b")
    bf16 = weight_bytes(cfg, "none")
    nf4 = weight_bytes(cfg, "nf4")
    assert bf16.method == "meta"
    assert bf16.total_bytes / GiB == pytest.approx(12.55, rel=0.01)
    assert nf4.total_bytes / GiB == pytest.approx(3.64, rel=0.02)
    # embeddings and lm_head stay bf16: 2 x 32000 x 4096
    assert nf4.unquantized_params >= 2 * 32000 * 4096


def test_llama3_8b_nf4_is_not_half_a_byte_per_param() -> None:
    nf4 = weight_bytes(load_config("random:llama-3-8b"), "nf4")
    assert nf4.total_bytes / GiB == pytest.approx(5.3, rel=0.03)


def test_meta_and_analytic_agree() -> None:
    for name in ("default", "random:llama-2-7b"):
        cfg = load_config(name)
        a = weight_bytes(cfg, "nf4", method="analytic").total_bytes
        m = weight_bytes(cfg, "nf4", method="meta").total_bytes
        assert a == pytest.approx(m, rel=0.001)


# H200 measurement (this repo's `convo plan --measure`, torch 2.11, transformers 5.17,
# bnb 0.50.2): (context, concurrency) -> (peak allocated, peak reserved), 16 new tokens.
H200_NF4 = {
    (1024, 1): (4617162752, 4865392640),
    (1024, 16): (13968314368, 20589838336),
    (2048, 8): (14055546880, 17095983104),
    (4096, 4): (14093297664, 17167286272),
    (4096, 16): (44621991936, 71250739200),
    (8192, 8): (44708110336, 56103010304),
    (8192, 16): (85493387264, 137891938304),
    (16384, 8): (85579505664, 108250791936),
}


@pytest.mark.parametrize(("cell", "measured"), list(H200_NF4.items()))
def test_prediction_matches_h200(cell: tuple[int, int], measured: tuple[int, int]) -> None:
    mm = MemoryModel.from_model("random:llama-2-7b", quant="nf4")
    p = mm.predict(context=cell[0], concurrency=cell[1], new_tokens=16)
    alloc, reserved = measured
    assert p.peak_allocated_bytes == pytest.approx(alloc, rel=0.03)
    err = p.peak_reserved_bytes / reserved - 1
    assert -0.05 <= err <= 0.10, f"{cell}: {err:+.1%}"


def test_kv_generations_follows_segment_rounding() -> None:
    # batch 16 Llama-2-7B: 128 KiB per token per K tensor; 1008 tokens = 126 MiB exactly
    assert kv_generations(128 * 1024, 1008, 16) == 1
    assert kv_generations(64 * 1024, 1008, 16) == 0  # 63 MiB in a 64 MiB segment
    assert kv_generations(64 * 1024, 1008, 64) >= 1


def test_eager_costs_quadratic_scores() -> None:
    sdpa = MemoryModel.from_model("random:llama-2-7b", quant="nf4")
    eager = MemoryModel.from_model("random:llama-2-7b", quant="nf4", attn="eager")
    a = sdpa.predict(context=8192 + 16, concurrency=1, new_tokens=16)
    b = eager.predict(context=8192 + 16, concurrency=1, new_tokens=16)
    # ANCHORS: prefill peak above weights 4.76 GiB (SDPA) vs 24.38 GiB (eager)
    assert (a.peak_allocated_bytes - a.weights_bytes) / GiB == pytest.approx(4.76, rel=0.05)
    assert (b.peak_allocated_bytes - b.weights_bytes) / GiB == pytest.approx(24.38, rel=0.05)


def test_request_bytes_is_kv_plus_activation_share() -> None:
    mm = MemoryModel.from_model("default")
    cost = mm.request_bytes(1000, 24)
    assert cost > 1024 * 23_040
    assert cost < 1024 * 23_040 * 2


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("24GiB", 24 * 2**30),
        ("80GB", 80 * 10**9),
        ("24000MiB", 24000 * 2**20),
        ("1.5G", 3 * 2**29),
        ("512 MB", 512 * 10**6),
        (1024, 1024),
    ],
)
def test_parse_size(text: str, nbytes: int) -> None:
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("bad", ["", "abc", "-3GiB", "0", "12XB"])
def test_parse_size_rejects(bad: str) -> None:
    with pytest.raises(ConfigError):
        parse_size(bad)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_plan_arguments(p)
    return p.parse_args(list(argv))


def test_plan_json_contract(capsys: pytest.CaptureFixture[str]) -> None:
    rc = run_plan_cli(
        _args(
            "--model",
            "random:llama-2-7b",
            "--quant",
            "nf4",
            "--kv-slots",
            "0",  # transformers' generate, one growing cache per request
            "--context",
            "1024,2048,4096",
            "--concurrency",
            "1,4,16",
            "--gpu-memory",
            "24GiB",
            "--calibration",
            "none",
            "--json",
        )
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    check_plan_json(out, cells=9, gpu_memory_bytes=24 * GiB)
    assert out["kv_slots"] is None
    assert out["max_safe_concurrency"]["1024"] == 16
    assert out["max_safe_concurrency"]["4096"] == 4
    assert out["max_safe_context"]["16"] == 1024


def test_plan_table_from_config_json(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "config.json").write_text(json.dumps(BUILTIN_CONFIGS["default"]))
    rc = run_plan_cli(_args("--model", str(tmp_path), "--gpu-memory", "2GiB", "--calibration", "none"))
    assert rc == 0
    text = capsys.readouterr().out
    assert "23,040 B/token" in text and "largest safe concurrency" in text


def test_plan_bad_input_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_plan_cli(_args("--gpu-memory", "lots")) == 2
    assert run_plan_cli(_args("--model", "no/such/model")) == 2
    assert run_plan_cli(_args("--context", "0,5")) == 2


def test_import_convo_memory_does_not_import_torch() -> None:
    code = (
        "import sys, convo.planner, convo.planner.measure, convo.admission, convo.metrics;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- one Quant enum ------------------------------------------------------------------------------


def test_one_quant_enum_with_the_old_spellings() -> None:
    import convo
    from convo.models.quant import Quant as ModelsQuant

    assert ModelsQuant is Quant is convo.Quant  # (its old homes: test_moved_names.py)
    assert Quant.parse(None) is Quant.parse("") is Quant.parse("none") is Quant.NONE
    assert Quant.parse("bfloat16") is Quant.parse("BF16") is Quant.BF16
    assert Quant.parse("torch.float32") is Quant.FP32 and Quant.parse("NF4") is Quant.NF4
    with pytest.raises(ConfigError, match="unknown weight format"):
        Quant.parse("q5_k")
    assert [q for q in Quant if q.is_dense] == [Quant.BF16, Quant.FP16, Quant.FP32, Quant.NONE]
    assert {q for q in Quant if q.is_bitsandbytes} == {Quant.NF4, Quant.FP4, Quant.INT8}
    assert Quant.INT4.bits_per_weight == 4 and Quant.INT8.bits_per_weight == 8
    assert Quant.AUTO.bits_per_weight is None and Quant.BF16.dense_dtype == "bf16"
    assert Quant.AUTO.resolved(cuda=True) is Quant.NF4 and Quant.AUTO.resolved(cuda=False) is Quant.FP32


def test_engine_takes_the_same_enum_and_refuses_plan_only_fp4() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from convo.engines.local.engine import TransformersEngine

    with pytest.raises(ConfigError, match="fp4"):
        TransformersEngine("random:tiny-llama", device="cpu", quant="FP4")
    with pytest.raises(ConfigError, match="unknown weight format"):
        TransformersEngine("random:tiny-llama", device="cpu", quant="q5")


def test_dense_formats_price_as_none_in_their_dtype() -> None:
    none = MemoryModel.from_model("random:llama-2-7b", quant="none", calibration=None)
    bf16 = MemoryModel.from_model("random:llama-2-7b", quant="bf16")
    fp32 = MemoryModel.from_model("random:llama-2-7b", quant="fp32")
    assert none.quant is bf16.quant is fp32.quant is Quant.NONE
    assert bf16.weights == none.weights
    assert fp32.weights.total_bytes == pytest.approx(2 * bf16.weights.total_bytes, rel=1e-4)
    auto = MemoryModel.from_model("random:llama-2-7b", quant="auto")  # convo serve's choice on CUDA
    assert auto.quant is Quant.NF4


# -- int4, priced against a real quantization -------------------------------------------------------


def _fast() -> Any:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import convo.fast

    return convo.fast


@pytest.mark.parametrize(("model_type", "group_size"), [("llama", 32), ("llama", 128), ("qwen2", 64)])
def test_int4_weight_bytes_match_a_real_quantization(model_type: str, group_size: int) -> None:
    """The static decoder quantizes a random model on CPU (dense copies freed); the planner
    prices the same bytes: packed int4 + scales/zeros per group + what stays dense."""
    fast = _fast()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {
        "model_type": model_type,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1024,
        "max_position_embeddings": 256,
        "tie_word_embeddings": model_type == "llama",
    }
    cfg = dict(config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(cfg.pop("model_type"), **cfg), dtype=torch.float32
    ).eval()
    decoder = fast.StaticDecoder(
        model,
        slots=1,
        slot_tokens=16,
        weights="int4",
        config=fast.DecoderConfig(group_size=group_size, free_dense=True),
    )
    assert decoder.quantized
    int4 = [t for layer in decoder.layers for t in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    real_int4 = fast.tensor_nbytes(*int4)
    real_total = fast.tensor_nbytes(model, *int4)
    for method in ("meta", "analytic"):
        report = weight_bytes(config, "int4", "fp32", method=method, group_size=group_size, int4_layouts=1)
        if method == "analytic" and model_type == "qwen2":
            continue  # the analytic count knows no biases
        assert report.quantized_bytes == pytest.approx(real_int4, rel=0.01), method
        assert report.total_bytes == pytest.approx(real_total, rel=0.01), method
        dense = weight_bytes(config, "none", "fp32", method=method)
        # moved over and quantized a layer at a time: the device never holds the dense model
        assert report.loaded_bytes == report.total_bytes < dense.total_bytes
        layer = (dense.total_bytes - report.unquantized_bytes) / config["num_hidden_layers"]
        assert report.total_bytes + layer <= report.load_peak_bytes


def test_int4_needs_a_static_decoder_architecture() -> None:
    from convo.fast import SUPPORTED_MODEL_TYPES
    from convo.models import int4_group_size
    from convo.planner.weights import INT4_MODEL_TYPES, int4_linear_bytes

    assert SUPPORTED_MODEL_TYPES == INT4_MODEL_TYPES
    for in_features in (32, 64, 96, 128, 192, 256, 4096, 11008, 100):
        for preferred in (32, 64, 128):
            gs = int4_group_size(in_features, preferred)
            # The planner prices a weight dense exactly when the kernels' rule finds no group.
            assert (int4_linear_bytes(64, in_features, DType.BF16, preferred) is None) == (gs is None)
    assert int4_group_size(576) == 64 and int4_group_size(576, 32) == 32 and int4_group_size(100) is None
    cfg = {**BUILTIN_CONFIGS["default"], "model_type": "gpt2"}
    with pytest.raises(ConfigError, match="static decoder"):
        weight_bytes(cfg, "int4", method="analytic")


def test_int4_llama2_7b_on_cuda_keeps_two_layouts() -> None:
    cuda = MemoryModel.from_model("random:llama-2-7b", quant="int4").weights
    one = MemoryModel.from_model("random:llama-2-7b", quant="int4", int4_layouts=1).weights
    bf16 = MemoryModel.from_model("random:llama-2-7b", quant="bf16").weights
    # group 32: 4 bits + a bf16 scale and zero per 32 weights = 5 bits per linear weight
    assert one.quantized_bytes * 8 / one.quantized_params == pytest.approx(5.0, rel=0.001)
    assert cuda.quantized_bytes == 2 * one.quantized_bytes  # tinygemm's layout + the plain one
    assert cuda.unquantized_bytes == one.unquantized_bytes
    assert (cuda.loaded_bytes, one.loaded_bytes) == (cuda.total_bytes, one.total_bytes)
    # loading peaks at the kept weights + one dense layer (0.4 GB) + its largest linear's
    # temporaries: measured 6.45 GiB on the H200 with one layout (the dense model: 12.55)
    assert one.load_peak_bytes < 0.55 * bf16.total_bytes and cuda.load_peak_bytes < 0.85 * bf16.total_bytes
    # H200, group 32: 8.68 GB with both layouts, 4.62 GB with one (measured)
    assert cuda.total_bytes == pytest.approx(8_676_976_128, rel=0.01)
    assert one.total_bytes == pytest.approx(4_620_000_000, rel=0.02)
    assert one.total_bytes < 0.35 * bf16.total_bytes


# -- convo plan: a unit for --gpu-memory, the GPU's own memory, headroom, slots ------------------


def _plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:  # type: ignore[type-arg]
    assert run_plan_cli(_args(*argv, "--calibration", "none", "--json")) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_gpu_memory_without_a_unit_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_plan_cli(_args("--gpu-memory", "24")) == 2
    err = capsys.readouterr().err
    assert "--gpu-memory" in err and "no unit" in err and "24GiB" in err
    assert parse_size("512B", unit_required=True) == 512
    with pytest.raises(ConfigError, match="no unit"):
        parse_size("80", unit_required=True)


def test_gpu_memory_defaults_to_the_gpu_or_says_none_is_visible(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import convo.cli.plan as plan_cli

    monkeypatch.setattr(plan_cli, "cuda_device_memory", lambda: None)
    out = _plan_json(capsys, "--model", "random:llama-2-7b")
    assert out["memory_bytes"] == 24 * GiB and "no GPU visible" in out["memory_source"]
    fake = plan_cli.DeviceMemory(total_bytes=80 * GiB, source="Fake GPU (CUDA device 0)", free_bytes=GiB)
    monkeypatch.setattr(plan_cli, "cuda_device_memory", lambda: fake)
    out = _plan_json(capsys, "--model", "random:llama-2-7b")
    assert out["memory_bytes"] == 80 * GiB and out["memory_free_bytes"] == GiB
    assert run_plan_cli(_args("--model", "random:llama-2-7b", "--calibration", "none")) == 0
    assert "memory 80.00 GiB (Fake GPU (CUDA device 0))" in capsys.readouterr().out
    out = _plan_json(capsys, "--model", "random:llama-2-7b", "--gpu-memory", "40GiB")
    assert out["memory_bytes"] == 40 * GiB and out["memory_source"] == "--gpu-memory"


def test_headroom_is_memory_minus_the_reserved_peak(capsys: pytest.CaptureFixture[str]) -> None:
    out = _plan_json(capsys, "--model", "random:llama-2-7b", "--quant", "nf4", "--gpu-memory", "24GiB")
    for cell in out["cells"]:
        assert cell["headroom_bytes"] == 24 * GiB - cell["peak_reserved_bytes"]
        assert cell["safe"] == (cell["headroom_bytes"] >= 0 and cell["reason"] is None)
    assert any(c["reason"] == "model max 4096" for c in out["cells"])  # 8192 > Llama-2's window
    out = _plan_json(
        capsys, "--model", "random:llama-2-7b", "--quant", "nf4", "--kv-slots", "0", "--gpu-memory", "24GiB"
    )
    assert any(c["headroom_bytes"] < 0 for c in out["cells"])
    assert run_plan_cli(_args("--model", "random:llama-2-7b", "--gpu-memory", "24GiB")) == 0
    assert "headroom" in capsys.readouterr().out


def test_kv_slots_price_the_pool_and_queue_the_rest(capsys: pytest.CaptureFixture[str]) -> None:
    out = _plan_json(
        capsys,
        "--model", "random:llama-2-7b", "--quant", "nf4", "--gpu-memory", "80GB",
        "--kv-slots", "4", "--context", "1024,4096", "--concurrency", "1,4,16",
    )  # fmt: skip
    mm = MemoryModel.from_model("random:llama-2-7b", quant="nf4")
    assert out["kv_slots"] == 4
    by_cell = {(c["context"], c["concurrency"]): c for c in out["cells"]}
    for (ctx, conc), cell in by_cell.items():
        assert cell["kv_bytes"] == mm.kv_pool_bytes(4, ctx)  # the pool, whatever the concurrency
        assert cell["kv_slots"] == 4 and cell["phase"] == "slots"
        assert (cell["running"], cell["queued"]) == (min(conc, 4), max(conc - 4, 0))
        # queued requests take no memory: 16 in flight cost what 4 (the slots) cost
        assert cell["peak_reserved_bytes"] == by_cell[(ctx, min(conc, 4))]["peak_reserved_bytes"]
        assert cell["peak_reserved_bytes"] >= by_cell[(ctx, 1)]["peak_reserved_bytes"]
    assert out["max_safe_concurrency"] == {"1024": 4, "4096": 4}  # 16 requests: 4 run, 12 queue


def test_plan_int4_uses_the_engines_slots_and_its_load_peak(capsys: pytest.CaptureFixture[str]) -> None:
    mm = MemoryModel.from_model("random:llama-2-7b", quant="int4")
    out = _plan_json(capsys, "--model", "random:llama-2-7b", "--quant", "int4", "--gpu-memory", "24GiB")
    assert out["quant"] == "int4" and out["kv_slots"] == "auto"
    assert out["weights_bytes"] == mm.weights.total_bytes
    # loaded a layer at a time: the load peak is below the steady peak of every cell
    steady = min(c["peak_reserved_bytes"] for c in out["cells"])
    assert mm.weights.total_bytes < out["load_peak_bytes"] < steady
    for cell in out["cells"]:
        assert cell["kv_slots"] == mm.auto_kv_slots(24 * GiB, cell["context"]) >= 1
        assert cell["kv_bytes"] == mm.kv_pool_bytes(cell["kv_slots"], cell["context"])
    assert [c["kv_slots"] for c in out["cells"] if c["concurrency"] == 1] == [8, 3, 1]
    # 10 GiB hold the int4 weights (both layouts, 8.0 GiB) but not the load peak: every cell is NO.
    out = _plan_json(capsys, "--model", "random:llama-2-7b", "--quant", "int4", "--gpu-memory", "9.5GiB")
    assert not any(c["safe"] for c in out["cells"])
    small = ("--model", "random:llama-2-7b", "--quant", "int4", "--gpu-memory", "9.5GiB")
    assert run_plan_cli(_args(*small)) == 0
    assert "does NOT fit" in capsys.readouterr().out
