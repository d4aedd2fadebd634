"""The planner prices an fp8 KV slot pool to the byte (values and their scales), and
``convo plan --kv-dtype fp8`` plans it with slots."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from convo.cli.plan import add_plan_arguments, run_plan_cli
from convo.models import DType, ModelShape, load_config
from convo.models.defaults import FP8_KV_SCALE_BYTES
from convo.planner.memory import VRAMModel

#: A Qwen2.5-7B shape (28 layers, 4 KV heads of 128): the issue's other 7B target.
QWEN25_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
}


def _plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    add_plan_arguments(p)
    assert run_plan_cli(p.parse_args([*argv, "--calibration", "none", "--json"])) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


@pytest.mark.parametrize("slots,tokens", [(1, 2048), (16, 2048), (3, 8192)])
def test_fp8_pool_prediction_is_the_pool_to_the_byte(slots: int, tokens: int) -> None:
    torch = pytest.importorskip("torch")
    from convo.fast.kv_pool import KVSlotPool

    mm = VRAMModel.from_model("random:llama-2-7b", quant="int4", kv_dtype="fp8")
    s = mm.shape
    pool = KVSlotPool(
        num_layers=s.num_layers,
        num_kv_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        slots=slots,
        slot_tokens=tokens,
        dtype=torch.float8_e4m3fn,
        device="meta",  # the tensors' sizes, none of their memory
    )
    assert mm.kv_pool_bytes(slots, tokens) == pool.nbytes
    assert mm.kv_pool_bytes(slots, tokens) == 2 * 32 * slots * 32 * tokens * (128 + FP8_KV_SCALE_BYTES)
    assert mm.kv_bytes_per_token() * tokens * slots == pool.nbytes


@pytest.mark.parametrize("config", ["random:llama-2-7b", "qwen2.5-7b"])
def test_fp8_holds_at_least_1_9x_the_slots_of_bf16(tmp_path: Any, config: str) -> None:
    if config == "qwen2.5-7b":
        path = tmp_path / "config.json"
        path.write_text(json.dumps(QWEN25_7B))
        config = str(path)
        assert ModelShape.from_config(load_config(config)).head_dim == 128
    bf16 = VRAMModel.from_model(config, quant="int4")
    fp8 = VRAMModel.from_model(config, quant="int4", kv_dtype="fp8")
    assert bf16.kv_dtype is DType.BF16 and fp8.kv_dtype is DType.FP8
    # head_dim 128: (2 x 128) / (128 + 4) = 1.94 x the slots in the same bytes
    assert bf16.kv_pool_bytes(1, 2048) / fp8.kv_pool_bytes(1, 2048) >= 1.9
    budget = 20 * 2**30  # the pool's share of a 24 GiB card
    slots = (budget // fp8.kv_pool_bytes(1, 2048)) / (budget // bf16.kv_pool_bytes(1, 2048))
    assert slots >= 1.9, slots


def test_plan_prices_fp8_slots(capsys: pytest.CaptureFixture[str]) -> None:
    common = ("--model", "random:llama-2-7b", "--quant", "int4", "--gpu-memory", "24GiB", "--kv-slots", "8")
    fp8 = _plan_json(capsys, *common, "--kv-dtype", "fp8", "--context", "2048,4096")
    bf16 = _plan_json(capsys, *common, "--context", "2048,4096")
    mm = VRAMModel.from_model("random:llama-2-7b", quant="int4", kv_dtype="fp8")
    assert fp8["kv_dtype"] == "fp8" and fp8["kv_bytes_per_token"] == mm.kv_bytes_per_token()
    for a, b in zip(fp8["cells"], bf16["cells"], strict=True):
        assert a["kv_bytes"] == mm.kv_pool_bytes(8, a["context"])
        assert a["kv_bytes"] < 0.52 * b["kv_bytes"]


def test_plan_refuses_other_kv_dtypes_with_slots(capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser()
    add_plan_arguments(p)
    args = p.parse_args(["--model", "random:llama-2-7b", "--kv-slots", "4", "--kv-dtype", "int8"])
    assert run_plan_cli(args) == 2
    assert "--kv-dtype" in capsys.readouterr().err
