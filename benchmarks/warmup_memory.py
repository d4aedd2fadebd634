"""Where the static decoder's device memory above weights + KV pool goes during warm-up.

Builds ``TransformersEngine(<model>, quant=int4, kv=KVConfig(gpu_memory=...))`` on CUDA and
reads the allocator (reserved, allocated, max reserved; GiB) before each decoder layer
comes over, around the KV pool's allocation, after int4 tuning and after each graph
capture. ``--fresh-streams`` warms each capture up on a new
``torch.cuda.Stream`` (what the decoder did before 2026-12-02) instead of the decoder's one
side stream: cuBLAS keeps a workspace per stream, and PyTorch cycles 32 streams. Prints one
JSON object::

    python benchmarks/warmup_memory.py --model random:benchmarks/configs/llama-2-7b --gpu-memory 24GiB
    python benchmarks/warmup_memory.py --fresh-streams ...

H200, Llama-2-7B int4, 17 slots x 2,048 (``benchmarks/results/h200_warmup_memory_streams.json``):
after warm-up 23.52 GiB reserved (22.36 allocated) with fresh streams against 22.42 (21.43)
with one; the peak 23.84 against 22.84 GiB, predicted 22.45 then (the warm-up's eager
prefill runs are priced since: ``convo.planner.memory.WARMUP_EAGER_RUNS``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=f"random:{Path(__file__).parent / 'configs' / 'llama-2-7b'}")
    p.add_argument("--gpu-memory", default="24GiB")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--fresh-streams", action="store_true", help="a new side stream per capture (the old way)")
    args = p.parse_args()

    import torch

    from convo.engines.local import engine as engine_module
    from convo.engines.local.config import KVConfig
    from convo.engines.local.engine import TransformersEngine
    from convo.fast import decoder as dec
    from convo.fast import kv_pool as pool_module

    log: list[tuple[str, float, float, float]] = []

    def mark(tag: str) -> None:
        torch.cuda.synchronize()
        read = (torch.cuda.memory_reserved(), torch.cuda.memory_allocated(), torch.cuda.max_memory_reserved())
        log.append((tag, *(round(b / 2**30, 3) for b in read)))

    cls = dec.StaticDecoder
    tune, capture, warm = cls._tune_int4, cls._capture, cls.warmup

    def tune_logged(self: Any) -> None:
        mark("before_tune")
        tune(self)
        mark("after_tune")

    def capture_logged(self: Any, fn: Any, pool: Any = None) -> Any:
        if args.fresh_streams:
            self._capture_stream = None  # the next capture makes a new stream
        out = capture(self, fn, pool)
        mark(f"capture{'_pool' if pool is not None else ''}_{self.captures}")
        return out

    def warm_logged(self: Any) -> None:
        mark("warm_start")
        warm(self)
        mark("warm_end")

    cls._tune_int4, cls._capture, cls.warmup = tune_logged, capture_logged, warm_logged
    # the load: each layer as it comes over (the int4 layers so far + one dense layer), and
    # the KV pool's allocation (the load phase measured 0.5-1.1 GiB above weights + pool)
    stager = engine_module.layer_stager

    def stager_logged(device: Any, **kw: Any) -> Any:
        stage = stager(device, **kw)

        def logged(index: int, layer: Any) -> None:
            mark(f"before_layer_{index}")
            stage(index, layer)

        return logged

    engine_module.layer_stager = stager_logged
    pool_init = pool_module.KVSlotPool.__init__

    def pool_logged(self: Any, *a: Any, **kw: Any) -> None:
        mark("before_pool")
        pool_init(self, *a, **kw)
        mark("after_pool")

    pool_module.KVSlotPool.__init__ = pool_logged
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    kv = KVConfig(gpu_memory=args.gpu_memory, slot_tokens=args.budget, kv_host_memory=0)
    engine = TransformersEngine(args.model, quant="int4", kv=kv)
    mark("engine_ready")
    fit = engine.memory_fit
    decoder = engine.decoder
    print(json.dumps({
        "variant": "fresh-streams" if args.fresh_streams else "one-stream",
        "gpu_memory": args.gpu_memory, "load_s": round(time.time() - t0, 1),
        "slots": fit.kv_slots if fit else None,
        "predicted_peak_gib": round(fit.peak_reserved_bytes / 2**30, 3) if fit else None,
        "pool_gib": round(fit.prediction.kv_bytes / 2**30, 3) if fit else None,
        "buckets": decoder.buckets, "prefill_buckets": decoder.prefill_buckets,
        "mixed_buckets": decoder.mixed_buckets,
        "log": log,
    }))  # fmt: skip
    engine.close()


if __name__ == "__main__":
    main()
