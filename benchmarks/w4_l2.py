"""The dense int4 path, whole or in slices that stay in L2: where a long step's dequantization goes.

A W4A16 step of more than ``W4_KERNEL_MAX_ROWS`` rows (a mixed step's 16 replies and a
256-token chunk, a prefill chunk) dequantizes each weight to bf16 and multiplies with
cuBLAS: the bf16 weight is written to device memory and read back (on an H100, ~6.8 ms of
a Llama-2-7B forward's 13.2 ms of projections at 272 rows). Sliced, each block of
``--slices`` output features is dequantized into one reused scratch buffer that fits in L2
(50 MB on an H100) and multiplied at once, so the bf16 bytes may never leave L2.

For the Llama-2-7B shapes (fused q/k/v, o, gate/up, down; group 32), each method is timed
as the replay of a CUDA graph of 20 calls that cycle through ``--copies`` copies of the
weight (more than L2 holds, as 32 layers would be), and checked against the whole
weight's product. Prints one JSON object: ms per call and per 32 layers by rows, method.

    python benchmarks/w4_l2.py --rows 272,528 --slices 1024,2048,4096
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from w4_kernels import SHAPES, graph_ms

from convo.fast.int4 import Int4Linear
from convo.fast.kernels import dequantize_plain_int4


def dense(x: torch.Tensor, qw: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    return F.linear(x, dequantize_plain_int4(qw, sz).to(x.dtype))


def sliced(
    x: torch.Tensor, qw: torch.Tensor, sz: torch.Tensor, scratch: torch.Tensor, step: int
) -> torch.Tensor:
    """Dequantize ``step`` output features at a time into ``scratch`` and multiply them at
    once, into the transposed output (each block a contiguous run of its rows)."""
    n = qw.shape[0]
    yt = torch.empty((n, x.shape[0]), dtype=x.dtype, device=x.device)
    xt = x.t()
    for n0 in range(0, n, step):
        n1 = min(n0 + step, n)
        w = dequantize_plain_int4(qw[n0:n1], sz[n0:n1], out=scratch[: n1 - n0])
        torch.mm(w, xt, out=yt[n0:n1])
    return yt.t().contiguous()


def time_method(fn: Any, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """ms of one call of ``fn(qweight, sz)``, the graph's calls cycling through ``layers``."""
    calls = itertools.count()
    return graph_ms(lambda: fn(*layers[next(calls) % len(layers)]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="272,528")
    ap.add_argument("--slices", default="1024,2048,4096")
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    rows = [int(r) for r in args.rows.split(",")]
    steps = [int(s) for s in args.slices.split(",")]
    out: dict[str, Any] = {"benchmark": "w4_l2", "gpu": torch.cuda.get_device_name()}
    out["torch"] = torch.__version__
    per_layer: dict[str, dict[str, float]] = {}
    for name, (n, k) in SHAPES.items():
        layers = []
        for _ in range(args.copies):
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
            lin = Int4Linear.quantize(w, group_size=32, layout="plain")
            layers.append((lin.qweight, lin.scales_zeros))
        scratch = torch.empty((max(steps), k), dtype=torch.bfloat16, device=dev)
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = dense(x, *layers[0]).float()
            methods: dict[str, Any] = {"dense": functools.partial(dense, x)}
            for st in steps:
                methods[f"sliced_{st}"] = lambda q, s, x=x, st=st, buf=scratch: sliced(x, q, s, buf, st)
            for label, fn in methods.items():
                err = float((fn(*layers[0]).float() - ref).norm() / ref.norm())
                ms = time_method(fn, layers)
                per_layer.setdefault(f"{m}", {}).setdefault(label, 0.0)
                per_layer[f"{m}"][label] += ms
                out.setdefault("by_shape", {}).setdefault(name, {}).setdefault(f"{m}", {})[label] = {
                    "ms": round(ms, 4),
                    "rel_err": err,
                }
                print(f"[w4_l2] {name} {m} rows {label}: {ms:.4f} ms (err {err:.1e})", file=sys.stderr)
    out["per_32_layers_ms"] = {
        m: {lab: round(32 * v, 2) for lab, v in d.items()} for m, d in per_layer.items()
    }
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
