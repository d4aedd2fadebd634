"""The static decoder's graph captures (convo.fast.graphs): the largest first, into one
pool, logits written into one buffer. The captures themselves run on CUDA
(tests/fast/test_decoder.py, marked gpu); the order and the shared-buffer forward are
checked here on CPU."""

from __future__ import annotations

import pytest

from convo.fast.graphs import GraphSpec, capture_order
from convo.models.defaults import MIXED_PACK_CHUNKS

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_captures_run_largest_first_so_later_ones_reuse_its_blocks() -> None:
    # Qwen2.5-7B's sizes: one logit row costs about two tokens through the layers
    sizes = {"hidden": 3584, "intermediate": 18944, "vocab": 152_064}
    specs = [GraphSpec(rows=b) for b in (1, 2, 4, 8, 16, 32, 64)]
    specs += [GraphSpec(tokens=t) for t in (16, 32, 64, 128, 256, 512)]
    specs += [GraphSpec(rows=b, tokens=t) for b in (1, 64) for t in (16, 256)]
    order = capture_order(specs, **sizes)
    assert sorted(order, key=repr) == sorted(specs, key=repr)
    assert order[0] == GraphSpec(tokens=512)  # 512 rows through the layers, one logit row
    assert order.index(GraphSpec(rows=64, tokens=256)) == 1  # 320 rows and 65 logit rows
    cost = [s.size(**sizes) for s in order]
    assert cost == sorted(cost, reverse=True)
    assert GraphSpec(rows=4).logit_rows == 4 and GraphSpec(tokens=16).logit_rows == 1
    assert GraphSpec(rows=4, tokens=16).logit_rows == 4 + MIXED_PACK_CHUNKS  # each packed chunk's
    # with a small vocabulary the widest mixed step is the largest
    small = capture_order(specs, hidden=4096, intermediate=11008, vocab=32_000)
    assert small[0] == GraphSpec(tokens=512) and small[1] == GraphSpec(rows=64, tokens=256)


def test_a_forward_into_the_shared_buffer_gives_the_same_logits() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from convo.fast import StaticDecoder

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=256,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg).eval()
    dec = StaticDecoder(model, slots=4, slot_tokens=64)
    dec.prefill(0, list(range(1, 20)), 0)
    dec.prefill(1, list(range(5, 15)), 0)
    inputs = torch.tensor([[20, 15], [0, 1], [19, 10]])
    with torch.inference_mode():
        fresh = dec._step(inputs)
        buf = torch.full((5, 512), float("nan"))
        shared = dec._step(inputs, buf)
    assert shared.data_ptr() == buf.data_ptr() and shared.shape == (2, 512)
    assert torch.equal(fresh, shared) and torch.isnan(buf[2:]).all()  # its rows only
