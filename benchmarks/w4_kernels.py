"""The int4 projections of one step, by kernel and row count: where a W4A16 step's time goes.

For the Llama-2-7B shapes (one layer's fused q/k/v, o, gate/up and down projections, int4
group 32 as the engine quantizes): convo's Triton W4A16 kernel (its tuned settings),
the op as the engine runs it (``op``: the setting its own tuner took at the first call),
each of the op's candidate settings (``candidates_us``; with ``--sweep`` also a sweep of
tile sizes, split K, K blocks of 128 or 256, the weight tile loaded as ``[K, N]`` or
transposed, and the ``SWAP`` settings, which the op no longer times),
tinygemm, and the plain layout dequantized then multiplied by cuBLAS (what steps of more
than ``W4_KERNEL_MAX_ROWS`` rows run), with bf16 ``F.linear`` as the bandwidth reference.
Each call is timed as a replay of a CUDA graph of 20 calls (how a step runs them), and
checked against the dequantized weight's product. ``GBps``: the weight's bytes (bf16, or
int4 with its scales) over the time, whatever else a method moves. CUDA only; prints one
JSON object.

    python benchmarks/w4_kernels.py --rows 16,64,80,144,272 --out w4.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from _common import replay_ms

from convo.fast.int4 import Int4Linear
from convo.fast.kernels import (
    W4_SWAP_CONFIGS,
    dequantize_plain_int4,
    w4a16_candidates,
    w4a16_row_bucket,
    w4a16_settings,
    w4a16_tuned,
    w4a16_with_config,
)

SHAPES = {"qkv": (3 * 4096, 4096), "o": (4096, 4096), "gate_up": (2 * 11008, 4096), "down": (4096, 11008)}


def graph_ms(fn: Any, calls: int = 20, reps: int = 7) -> float:
    """Median ms of one call, from replays of a CUDA graph of ``calls`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return replay_ms(graph, reps, calls)


def candidates(rows: int) -> list[tuple[Any, ...]]:
    """The launch settings swept at ``rows`` rows (``(BLOCK_M, BLOCK_N, SPLIT_K, warps,
    stages, BLOCK_K, TRANS[, MAGIC])``): above 64 rows each tile with the float32 conversion
    and with ``MAGIC`` 2, and from 192 rows tiles 256 rows tall (one weight tile read for a
    whole 256-row step)."""
    if rows <= 64:
        bm = max(16, 1 << (rows - 1).bit_length())
        return [
            (bm, bn, sk, 4, 3, bk, t)
            for bn, sk, bk, t in itertools.product((32, 64, 128), (1, 2, 4, 8), (128, 256), (False, True))
            if not (bk == 256 and bn == 128 and bm >= 64)
        ]
    tiles = [
        (bm, bn, 1, w, 3, bk, t)
        for bm, bn, bk, w, t in itertools.product(
            (64, 128, 256) if rows >= 192 else (64, 128), (64, 128, 256), (64, 128), (4, 8), (False, True)
        )
        if bm * bn <= 128 * 128
        and not (bm == 128 and bn == 128 and w == 4)
        and not (bk == 128 and bm * bn > 8192)
    ]
    # The widest tiles (one weight tile read for 256 rows), and a deeper pipeline for the usual ones.
    tiles += [(bm, bn, 1, 8, 3, 64, t) for bm, bn in ((128, 256), (256, 128)) for t in (False, True)] * (
        rows >= 192
    )
    tiles += [(bm, bn, 1, 8, 4, 64, False) for bm, bn in ((128, 128), (256, 64), (128, 64))]
    return [*tiles, *((*c, 2) for c in tiles)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="16,64,80,144,272")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--out", default=None)
    p.add_argument(
        "--sweep", action="store_true", help="also sweep launch settings beyond the op's candidates (slow)"
    )
    p.add_argument(
        "--min-block-m", type=int, default=0, help="with --sweep: only settings at least this many rows tall"
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("CUDA only")
    torch.manual_seed(0)
    report: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": []}
    weights = {}
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q = Int4Linear.quantize(w, group_size=32, layout="both")
        weights[name] = (w, q, dequantize_plain_int4(q.qweight, q.scales_zeros))
    started = time.perf_counter()
    for rows in (int(r) for r in args.rows.split(",")):
        per_method: dict[str, float] = {}
        for name, (w, q, dense) in weights.items():
            x = torch.randn(rows, w.shape[1], device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.float(), dense.float())
            scale = ref.abs().max().item()
            found: dict[str, tuple[float, Any]] = {
                "bf16": (graph_ms(lambda x=x, w=w: F.linear(x, w)), None),
                "dequant": (graph_ms(lambda q=q: dequantize_plain_int4(q.qweight, q.scales_zeros)), None),
                "dequant+cublas": (
                    graph_ms(lambda x=x, q=q: F.linear(x, dequantize_plain_int4(q.qweight, q.scales_zeros))),
                    None,
                ),
            }
            if rows <= 32:
                found["tinygemm"] = (
                    graph_ms(
                        lambda x=x, q=q: torch.ops.aten._weight_int4pack_mm(
                            x, q.packed, 32, q.packed_scales_zeros
                        )
                    ),
                    None,
                )
            timed: dict[str, float] = {}
            swept: dict[str, float] = {}
            families = [("convo", w4a16_candidates(rows))] + (
                [("sweep", [c for c in (*candidates(rows), *W4_SWAP_CONFIGS) if c[0] >= args.min_block_m])]
                if args.sweep
                else []
            )
            for family, cfgs in families:
                for cfg in cfgs:
                    fn = lambda x=x, q=q, cfg=cfg: w4a16_with_config(x, q.qweight, q.scales_zeros, cfg)  # noqa: E731
                    try:
                        err = (fn().float() - ref).abs().max().item() / scale
                        ms = graph_ms(fn) if err < 2e-2 else float("inf")
                    except Exception as e:  # a setting the compiler refuses
                        report["results"].append(
                            {"rows": rows, "proj": name, "cfg": cfg, "error": str(e)[:200]}
                        )
                        continue
                    label = ",".join(map(str, w4a16_settings(cfg) if len(cfg) > 1 else cfg))
                    (timed if family == "convo" else swept)[label] = round(ms * 1e3, 1)
                    if len(cfg) == 1:  # W4_DENSE: no tile
                        layout = "dense"
                    else:
                        full = w4a16_settings(cfg)
                        layout = "swap" if full[8] else "trans" if full[6] else "plain"
                    kind = family if family == "convo" else f"sweep-{layout}"
                    if ms < found.get(kind, (1e9, None))[0]:
                        found[kind] = (ms, cfg)
                    if err >= 2e-2:
                        report["results"].append({"rows": rows, "proj": name, "cfg": cfg, "bad": err})
            # What the engine runs: the op, with the setting its own tuner took at the first call.
            op = lambda x=x, q=q: torch.ops.convo.w4a16_mm(x, q.qweight, q.scales_zeros)  # noqa: E731
            op()
            found["op"] = (graph_ms(op), w4a16_tuned().get((w4a16_row_bucket(rows), *w.shape, 0)))
            report["results"].append({"rows": rows, "proj": name, "candidates_us": timed})
            if swept:  # the sweep's ten fastest settings
                fastest = dict(sorted(swept.items(), key=lambda kv: kv[1])[:10])
                report["results"].append({"rows": rows, "proj": name, "sweep_fastest_us": fastest})
            print(json.dumps({"rows": rows, "proj": name, "candidates_us": timed}), flush=True)
            for method, (ms, cfg) in found.items():
                per_method[method] = per_method.get(method, 0.0) + ms
                row = {"rows": rows, "proj": name, "method": method, "us": round(ms * 1000, 2), "cfg": cfg}
                row["GBps"] = round((w.numel() * (2 if method == "bf16" else 0.5625)) / ms / 1e6)
                report["results"].append(row)
                print(json.dumps(row), flush=True)
        layer = {m: round(v * 32, 3) for m, v in sorted(per_method.items(), key=lambda kv: kv[1])}
        report.setdefault("step_ms_32_layers", {})[rows] = layer
        print(
            json.dumps(
                {"rows": rows, "step_ms_32_layers": layer, "elapsed_s": round(time.perf_counter() - started)}
            ),
            flush=True,
        )
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report["step_ms_32_layers"]))


if __name__ == "__main__":
    main()
