"""The kernels of one decode step, timed alone: where a step's time goes.

For the Llama-2-7B shapes (one layer's fused q/k/v, o, gate/up and down projections):
tinygemm int4 (group 32 and 128) and bf16 ``F.linear`` at 1, 4, 8 and 16 rows, as
achieved weight bandwidth; and convo's split decode-attention kernel at 1 and 16 rows.
CUDA only; prints one JSON object (times are medians of CUDA-event timings).

    python benchmarks/decode_kernels.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from convo.fast import decode_attention, quantize_int4


def time_ms(fn, reps: int = 50) -> float:  # type: ignore[no-untyped-def]
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("CUDA only")
    hidden, inter = 4096, 11008
    shapes = {
        "qkv": (3 * hidden, hidden),
        "o": (hidden, hidden),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }
    out: dict[str, object] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "linear": []}
    rows_list = (1, 4, 8, 16)
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        variants = {"bf16": (w.numel() * 2, lambda x, w=w: F.linear(x, w))}
        for gs in (32, 128):
            q = quantize_int4(w, group_size=gs)
            variants[f"int4-g{gs}"] = (
                q.nbytes,
                lambda x, q=q, gs=gs: torch.ops.aten._weight_int4pack_mm(x, q.packed, gs, q.scales_zeros),
            )
        for label, (nbytes, fn) in variants.items():
            for rows in rows_list:
                x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                ms = time_ms(lambda fn=fn, x=x: fn(x))
                out["linear"].append(  # type: ignore[union-attr]
                    {"proj": name, "kind": label, "rows": rows, "ms": ms, "GBps": nbytes / ms / 1e6}
                )
    attn = []
    k_cache = torch.randn(16, 32, 1024, 128, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    for rows in (1, 16):
        q = torch.randn(rows, 32, 128, device="cuda", dtype=torch.bfloat16)
        slots = torch.arange(rows, device="cuda")
        lengths = torch.full((rows,), 576, device="cuda", dtype=torch.int32)
        ms = time_ms(lambda q=q, s=slots, n=lengths: decode_attention(q, k_cache, v_cache, s, n, scale=0.088))
        read = rows * 576 * 32 * 128 * 2 * 2
        attn.append({"rows": rows, "tokens": 576, "ms": ms, "GBps": read / ms / 1e6})
    out["attention_per_layer"] = attn
    print(json.dumps(out, indent=1))
    table = {}
    for r in out["linear"]:  # type: ignore[union-attr]
        table.setdefault((r["kind"], r["rows"]), 0.0)
        table[(r["kind"], r["rows"])] += r["ms"]
    for (kind, rows), ms in sorted(table.items()):
        print(f"{kind:>9} rows {rows:>2}: one layer's projections {ms:.3f} ms, x32 layers {32 * ms:.2f} ms")
    for a in attn:
        print(f"attention rows {a['rows']:>2}: {a['ms']:.3f} ms per layer ({a['GBps']:.0f} GB/s)")


if __name__ == "__main__":
    main()
