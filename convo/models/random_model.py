"""A model of a real architecture with random weights, for memory and speed work where no
weights can be downloaded (``random:llama-2-7b``, the planner's measurements, benchmarks).
torch and transformers are imported when a model is built."""

from __future__ import annotations

import gc
import tempfile
from collections.abc import Mapping
from typing import Any

from convo.errors import ConfigError
from convo.models.quant import Quant
from convo.models.spec import Attn, DType

#: Standard deviation of random linear and embedding weights when the config names none
#: (``initializer_range``; transformers' default).
RANDOM_INIT_STD = 0.02


def build_random_model(
    config: Mapping[str, Any],
    *,
    quant: Quant,
    dtype: DType,
    attn: Attn,
    device: str = "cuda",
    workdir: str | None = None,
    staged_layers: bool = False,
) -> Any:
    """A random-weight model on ``device``; quantized like ``from_pretrained`` would.

    Builds in ``dtype`` on the device, saves to a temporary folder and reloads with a
    ``BitsAndBytesConfig`` (nf4 + double quant, bf16 compute), so the weights land in the
    allocator the way a real quantized load does. No download.

    ``staged_layers`` (dense only; the int4 path on CUDA): the decoder layers stay on the
    ``meta`` device, taking no memory anywhere, and everything else (embeddings, final norm,
    ``lm_head``, rotary tables) is built on ``device``; :func:`init_random_layer` gives a
    layer its random weights on the device when the static decoder takes it (one layer at
    a time, so a 7B model never sits on the device dense).
    """
    if quant is Quant.INT4:
        raise ConfigError("int4 is quantized by the static decoder (TransformersEngine), not at load")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tdtype = {DType.BF16: torch.bfloat16, DType.FP16: torch.float16, DType.FP32: torch.float32}[dtype]
    cfg_dict = {k: v for k, v in config.items() if k not in ("architectures", "auto_map")}
    model_type = cfg_dict.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **cfg_dict)
    cfg._attn_implementation = attn.value
    torch.manual_seed(0)
    if staged_layers:
        if quant.is_bitsandbytes:
            raise ConfigError("staged_layers builds dense weights (the int4 path), not bitsandbytes")
        return _build_staged(cfg, tdtype, attn, device)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=tdtype, attn_implementation=attn.value)
    model.eval()
    if not quant.is_bitsandbytes:
        return model
    from transformers import BitsAndBytesConfig

    if quant is Quant.INT8:
        qcfg = BitsAndBytesConfig(load_in_8bit=True)
    else:
        qcfg = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=quant.value,
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=tdtype,
        )
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        model.save_pretrained(tmp)
        del model
        gc.collect()
        torch.cuda.empty_cache()
        model = AutoModelForCausalLM.from_pretrained(
            tmp,
            quantization_config=qcfg,
            dtype=tdtype,
            device_map=device,
            attn_implementation=attn.value,
        )
    model.eval()
    return model


def _build_staged(cfg: Any, tdtype: Any, attn: Attn, device: str) -> Any:
    """The model on ``meta``, all but its decoder layers then materialized on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=tdtype, attn_implementation=attn.value)
    model.eval()
    base = model.model
    std = float(getattr(cfg, "initializer_range", None) or RANDOM_INIT_STD)
    with torch.no_grad():
        base.embed_tokens.to_empty(device=device)
        base.embed_tokens.weight.normal_(0.0, std)
        base.norm.to_empty(device=device)
        base.norm.weight.fill_(1.0)
        if getattr(cfg, "tie_word_embeddings", False):
            model.lm_head.weight = base.embed_tokens.weight
        else:
            model.lm_head.to_empty(device=device)
            model.lm_head.weight.normal_(0.0, std)
    with torch.device(device):  # its inverse frequencies are computed, not random
        base.rotary_emb = type(base.rotary_emb)(config=model.config)
    return model


def init_random_layer(layer: Any, device: Any, seed: int = 0, *, std: float = RANDOM_INIT_STD) -> None:
    """Give a decoder layer on the ``meta`` device random weights on ``device``: linear
    weights ``N(0, std)``, biases 0, norms 1 (transformers' initialization). ``seed`` makes
    each layer's weights reproducible (the engine passes the layer index)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    layer.to_empty(device=device)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() == 1:  # RMSNorm weights
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=gen)
