"""Where a decode step's time goes, by kernel, at each row count (CUDA).

The static decoder of ``--model`` (int4, ``--slots`` slots of ``--slot-tokens``) after its
warm-up: for each row count in ``--rows``, the captured decode step is replayed with every
row at ``--context`` tokens (a step's cost depends on the shapes, not on what the slots
hold), timed (median of ``--steps`` synchronized steps) and profiled (``torch.profiler``:
each kernel's total device time over the profiled steps, per step). Rows past a power of
two run in the next bucket, padded. Prints one JSON object.

    python benchmarks/step_profile.py --model random:llama-2-7b --rows 16,17,24,32
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from _common import random_model

from convo.fast import DecoderConfig, StaticDecoder


def kernel_table(dec: StaticDecoder, rows: int, context: int, steps: int) -> dict[str, float]:
    """Each kernel's device microseconds per step, largest first."""
    from torch.profiler import ProfilerActivity, profile

    tokens, slots, positions = [100] * rows, list(range(rows)), [context] * rows
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            dec.step(tokens, slots, positions)
        torch.cuda.synchronize()
    table: dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if us:
            table[e.key[:90]] = table.get(e.key[:90], 0.0) + us / steps
    return dict(sorted(((k, round(v, 1)) for k, v in table.items()), key=lambda kv: -kv[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="random:llama-2-7b")
    p.add_argument("--rows", default="16,17,24,32")
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--slot-tokens", type=int, default=2048)
    p.add_argument("--context", type=int, default=1500)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--out", default="")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("CUDA only")
    model = random_model(args.model, "cuda")
    t = time.perf_counter()
    dec = StaticDecoder(
        model,
        slots=args.slots,
        slot_tokens=args.slot_tokens,
        weights="int4",
        config=DecoderConfig(free_dense=True),
    )
    dec.warmup()
    report: dict[str, Any] = {
        "benchmark": "step_profile",
        "model": args.model,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "warmup_s": round(time.perf_counter() - t, 1),
        "context": args.context,
        "kernel_choice": dict(dec.kernel_choice) or None,
        "rows": {},
    }
    for rows in (int(r) for r in args.rows.split(",")):
        tokens, slots, positions = [100] * rows, list(range(rows)), [args.context] * rows
        for _ in range(3):
            dec.step(tokens, slots, positions)
        times = []
        for _ in range(args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dec.step(tokens, slots, positions)
            torch.cuda.synchronize()
            times.append(1000 * (time.perf_counter() - t0))
        table = kernel_table(dec, rows, args.context, args.steps)
        entry = {
            "step_ms": round(sorted(times)[len(times) // 2], 3),
            "bucket": dec.bucket(rows),
            "kernels_us": dict(list(table.items())[: args.top]),
            "kernels_total_us": round(sum(table.values()), 1),
        }
        report["rows"][rows] = entry
        print(
            f"[step_profile] {rows} rows (bucket {entry['bucket']}): {entry['step_ms']} ms", file=sys.stderr
        )
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
