"""Memory model and planner: real numbers from ANCHORS.md and an H200 calibration run."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from convo.cli.plan import add_plan_arguments, run_plan_cli
from convo.errors import ConfigError
from convo.planner.model import (
    BUILTIN_CONFIGS,
    GiB,
    MemoryModel,
    ModelShape,
    Quant,
    kv_generations,
    load_config,
    parse_size,
    quantized_linear_bytes,
    weight_bytes,
)


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
            "--context",
            "1024,4096,16384",
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
    assert out["kv_bytes_per_token"] == 524_288
    assert out["weights_bytes"] / GiB == pytest.approx(3.6, rel=0.02)
    assert len(out["cells"]) == 9
    keys = {
        "context",
        "concurrency",
        "kv_bytes",
        "activation_bytes",
        "peak_allocated_bytes",
        "peak_reserved_bytes",
        "safe",
    }
    for cell in out["cells"]:
        assert keys <= set(cell)
        assert cell["peak_reserved_bytes"] >= cell["peak_allocated_bytes"] > out["weights_bytes"]
        assert cell["safe"] == (cell["peak_reserved_bytes"] <= 24 * GiB)
    assert out["max_safe_concurrency"]["1024"] == 16
    assert out["max_safe_concurrency"]["16384"] == 1
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
