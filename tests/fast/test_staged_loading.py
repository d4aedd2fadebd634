"""int4 that loads where it runs: the decoder takes its layers one at a time from host
memory (or ``meta`` for random weights) and quantizes each before the next comes over.

On CPU the "device" is the host, so these tests check what the staging must not change
(the weights the decoder ends up with, its logits) and that each layer is brought over
just before it is read; the device-memory side runs in ``benchmarks/fit_gpu.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from convo.errors import ConfigError, ModelLoadError

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from convo.engines.local.loading import layer_stager, move_all_but_layers  # noqa: E402
from convo.fast import DecoderConfig, StaticDecoder  # noqa: E402
from convo.models import Attn, DType, Quant  # noqa: E402
from convo.models.random_model import build_random_model, init_random_layer  # noqa: E402

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}


def staged(config: dict[str, Any] = TINY) -> Any:
    return build_random_model(
        config, quant=Quant.NONE, dtype=DType.FP32, attn=Attn.SDPA, device="cpu", staged_layers=True
    )


def materialized(config: dict[str, Any] = TINY) -> Any:
    """The same random model with every layer given its weights up front (the reference)."""
    model = staged(config)
    for i, layer in enumerate(model.model.layers):
        init_random_layer(layer, "cpu", seed=i)
    return model


def test_a_staged_random_model_holds_no_layer_weights_until_asked() -> None:
    model = staged()
    layer_devices = {p.device.type for layer in model.model.layers for p in layer.parameters()}
    assert layer_devices == {"meta"}
    assert model.model.embed_tokens.weight.device.type == "cpu"
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    with pytest.raises(ConfigError):
        build_random_model(TINY, quant=Quant.NF4, dtype=DType.BF16, attn=Attn.SDPA, staged_layers=True)


@pytest.mark.parametrize("weights", ["as-loaded", "int4"])
def test_staged_layers_give_the_decoder_what_a_loaded_model_gives(weights: str) -> None:
    ids = list(range(3, 40))
    ref_model = materialized()
    ref = StaticDecoder(
        ref_model,
        slots=1,
        slot_tokens=64,
        weights=weights,
        config=DecoderConfig(free_dense=weights == "int4"),
    )
    order: list[int] = []
    stage = layer_stager("cpu", init=init_random_layer)

    def recording(index: int, layer: Any) -> None:
        # every earlier layer is quantized (its dense weights freed) before this one arrives
        if weights == "int4" and index:
            assert model.model.layers[index - 1].self_attn.q_proj.weight.numel() == 0
        order.append(index)
        stage(index, layer)

    model = staged()
    dec = StaticDecoder(
        model,
        slots=1,
        slot_tokens=64,
        weights=weights,
        config=DecoderConfig(free_dense=weights == "int4"),
        stage=recording,
    )
    assert order == [0, 1, 2]
    assert dec.weight_nbytes() == ref.weight_nbytes()
    got, _ = dec.prefill(0, ids, 0)
    want, _ = ref.prefill(0, ids, 0)
    assert torch.equal(got, want)
    if weights == "as-loaded":
        with torch.no_grad():  # and the reference is transformers' own forward
            logits = ref_model(torch.tensor([ids])).logits[0, -1]
        assert torch.allclose(got, logits, atol=1e-4)


def test_a_meta_layer_without_init_is_refused_and_a_host_model_moves_over() -> None:
    with pytest.raises(ModelLoadError, match="meta"):
        StaticDecoder(staged(), slots=1, slot_tokens=32, stage=layer_stager("cpu"))
    model = materialized()
    move_all_but_layers(model, "cpu")  # on CPU a no-op move, tied weights kept tied
    assert model.lm_head.weight is model.model.embed_tokens.weight
    dec = StaticDecoder(model, slots=1, slot_tokens=32, weights="int4", stage=layer_stager("cpu"))
    assert dec.quantized


def test_relocate_copies_what_a_layer_keeps_and_keeps_parameters_and_views() -> None:
    from convo.fast.staging import relocate

    lin = torch.nn.Linear(8, 6)
    norm = torch.nn.LayerNorm(8)
    flat = torch.arange(12.0)
    lin.register_buffer("a", flat[:6])
    lin.register_buffer("b", flat[6:].view(2, 3))
    weight, before = lin.weight, {n: t.clone() for n, t in [*lin.named_parameters(), *lin.named_buffers()]}
    old_ptr = lin.weight.untyped_storage().data_ptr()
    copied = relocate([torch.nn.ModuleList([lin, norm]), lin], "cpu")  # lin twice: copied once
    assert lin.weight is weight and lin.weight.untyped_storage().data_ptr() != old_ptr
    for name, t in [*lin.named_parameters(), *lin.named_buffers()]:
        assert torch.equal(t, before[name]), name
    assert lin.a.untyped_storage().data_ptr() == lin.b.untyped_storage().data_ptr()  # still one storage
    assert lin.a.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
    assert lin.b.shape == (2, 3) and lin.b.storage_offset() == 6
    params = sum(p.numel() * 4 for p in [*lin.parameters(), *norm.parameters()])
    assert copied == params + 12 * 4
    assert relocate([lin], "meta") == 0  # nothing of lin is on that device


@pytest.mark.gpu
def test_staged_weights_reserve_no_more_than_the_planner_prices() -> None:
    """On CUDA the layers are staged in a private pool and what they keep copied out, so
    the weights' reserved bytes are the kept tensors packed by the allocator: no more than
    :meth:`~convo.planner.memory.VRAMModel.weights_reserved_bytes` prices (holes left by
    the staging's temporaries would push them past it: 11-19 % on 7B models before)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from convo.planner.memory import VRAMModel

    config = {**TINY, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 6}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    model = build_random_model(
        config, quant=Quant.NONE, dtype=DType.BF16, attn=Attn.SDPA, device="cuda", staged_layers=True
    )
    dec = StaticDecoder(
        model,
        slots=1,
        slot_tokens=64,
        weights="int4",
        config=DecoderConfig(free_dense=True, compile=False, cuda_graphs=False),
        stage=layer_stager("cuda", init=init_random_layer),
    )
    layouts = 2 if dec.int4_layout == "both" else 1
    priced = VRAMModel.from_config(config, quant="int4", int4_layouts=layouts).weights_reserved_bytes(64)
    assert dec.weights_reserved_bytes - before <= priced
    assert dec.weights_allocated_bytes <= dec.weights_reserved_bytes
    assert dec.prefill(0, list(range(3, 20)), 0)[0].isfinite().all()
