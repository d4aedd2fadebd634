"""``convo plan --quant int4 --kv-slots N`` against the GPU: predicted vs measured bytes.

Builds a random-weight model of a real architecture dense on the GPU (as the engine loads
it for ``--quant int4``), builds the static decoder with int4 weights (dense copies freed)
and a KV slot pool, captures the decode step, prefills one slot, and reads
``torch.cuda.memory_allocated`` / ``max_memory_allocated`` at each stage:

* ``loaded``: the dense model (``WeightReport.loaded_bytes``);
* ``load_peak``: the peak while quantizing (``WeightReport.load_peak_bytes``);
* ``weights``: what stays after quantizing (``WeightReport.total_bytes``);
* ``pool``: the slot pool (``MemoryModel.kv_pool_bytes``);
* ``activations``: captured-step buffers + the peak of one chunked prefill above the pool
  (``CellPrediction.activation_bytes``).

H200, Llama-2-7B architecture (no download), 4 slots of 4096 tokens, group 32:
    python benchmarks/plan_int4.py --model random:llama-2-7b --slots 4 --slot-tokens 4096

Prints one JSON object (with the device and versions).

Measured on an H200 (torch 2.11, transformers 5.17; Llama-2-7B, 4 slots x 4096, group 32,
2026-11-30), measured / predicted: loaded 13.48 / 13.48 GB; int4 weights with both layouts
(tinygemm's and the plain one that prefill dequantizes) 8.68 / 8.62 GB (-0.7 %); pool 8.59 /
8.59 GB (exact); the construction peak is the weights + pool (17.27 GB), above the
predicted quantization peak (15.10 GB). With the earlier decoder (tinygemm layout alone):
weights 4.62 / 4.57 GB, quantization peak 14.70 GB (the dense model + 13.6 B per parameter
of the largest fused linear).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from convo.fast import StaticDecoder
from convo.models import INT4_GROUP_SIZE, Attn, DType, Quant, build_random_model, load_config
from convo.planner import VRAMModel as MemoryModel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="random:llama-2-7b")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--slot-tokens", type=int, default=4096)
    parser.add_argument("--group-size", type=int, default=INT4_GROUP_SIZE)
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args(argv)

    import torch
    import transformers

    if not torch.cuda.is_available():
        print("benchmarks/plan_int4.py needs a CUDA GPU", file=sys.stderr)
        return 2
    mm = MemoryModel.from_model(args.model, quant="int4", int4_group_size=args.group_size)
    cell = mm.predict(
        context=args.slot_tokens, concurrency=args.slots, new_tokens=args.new_tokens, kv_slots=args.slots
    )

    def allocated() -> int:
        torch.cuda.synchronize()
        return int(torch.cuda.memory_allocated())

    model = build_random_model(
        load_config(args.model), quant=Quant.NONE, dtype=DType.BF16, attn=Attn.SDPA, device="cuda"
    )
    gc.collect()
    torch.cuda.empty_cache()
    loaded = allocated()
    torch.cuda.reset_peak_memory_stats()
    decoder = StaticDecoder(
        model,
        slots=args.slots,
        slot_tokens=args.slot_tokens,
        weights="int4",
        group_size=args.group_size,
        free_dense=True,
        compile=False,  # the weights and the pool do not depend on it; saves minutes
    )
    load_peak = int(torch.cuda.max_memory_allocated())
    after_build = allocated()
    pool = int(decoder.pool_measured_bytes)
    weights = after_build - pool - decoder.cos.nbytes - decoder.sin.nbytes
    decoder.warmup()
    after_warmup = allocated()
    torch.cuda.reset_peak_memory_stats()
    prompt = args.slot_tokens - args.new_tokens
    ids = torch.randint(3, int(model.config.vocab_size), (prompt,)).tolist()
    decoder.prefill(0, ids, 0)
    prefill_peak = int(torch.cuda.max_memory_allocated()) - after_warmup
    measured = {
        "loaded_bytes": loaded,
        "load_peak_bytes": load_peak,
        "weights_bytes": weights,
        "pool_bytes": pool,
        "graph_buffers_bytes": after_warmup - after_build,
        "prefill_peak_above_bytes": prefill_peak,
        "activation_bytes": after_warmup - after_build + prefill_peak,
        "peak_allocated_bytes": after_warmup + prefill_peak,
        "peak_reserved_bytes": int(torch.cuda.max_memory_reserved()),
    }
    predicted = {
        "loaded_bytes": mm.weights.loaded_bytes,
        "load_peak_bytes": mm.weights.load_peak_bytes,
        "weights_bytes": mm.weights.total_bytes,
        "pool_bytes": mm.kv_pool_bytes(args.slots, args.slot_tokens),
        "activation_bytes": cell.activation_bytes,
        "peak_allocated_bytes": cell.peak_allocated_bytes,
        "peak_reserved_bytes": cell.peak_reserved_bytes,
    }
    error = {
        k: round(100.0 * (predicted[k] - measured[k]) / max(measured[k], 1), 2)
        for k in predicted
        if k in measured
    }
    out: dict[str, Any] = {
        "model": args.model,
        "slots": args.slots,
        "slot_tokens": args.slot_tokens,
        "group_size": args.group_size,
        "prompt_tokens": prompt,
        "measured": measured,
        "predicted": predicted,
        "error_percent": error,
        "env": {
            "device": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
