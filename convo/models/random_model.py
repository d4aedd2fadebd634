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


def build_random_model(
    config: Mapping[str, Any],
    *,
    quant: Quant,
    dtype: DType,
    attn: Attn,
    device: str = "cuda",
    workdir: str | None = None,
) -> Any:
    """A random-weight model on ``device``; quantized like ``from_pretrained`` would.

    Builds in ``dtype`` on the device, saves to a temporary folder and reloads with a
    ``BitsAndBytesConfig`` (nf4 + double quant, bf16 compute), so the weights land in the
    allocator the way a real quantized load does. No download.
    """
    if quant is Quant.INT4:
        raise ConfigError("int4 is quantized by the static decoder (TransformersEngine), not at load")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tdtype = {DType.BF16: torch.bfloat16, DType.FP16: torch.float16, DType.FP32: torch.float32}[dtype]
    cfg_dict = dict(config)
    model_type = cfg_dict.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **cfg_dict)
    cfg._attn_implementation = attn.value
    torch.manual_seed(0)
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
