"""Prefill speed: stock transformers against every convo path, in one process.

One ``--tokens`` prompt (2,048 by default), medians of ``--repeats`` timed runs after
``--warmup`` untimed ones, each path on the same random-weight model:

* ``stock-bf16-sdpa``: transformers' own forward, bf16 weights, SDPA attention, one
  forward (``logits_to_keep=1``: the logits of the last token only, as convo computes);
* ``convo-bf16``: the static decoder's prefill into a KV slot (one chunk of the prompt);
* ``convo-int4``: the same with convo's int4 weights (the plain layout dequantized once per
  layer weight and forward, then cuBLAS);
* ``convo-int4-chunk512`` / ``convo-bf16-chunk512``: the prompt in 512-token chunks (what a
  scheduler step of 512 tokens runs);
* ``convo-int4-scheduler``: submit to the continuous-batching scheduler, time to the first
  token (step budget ``--tokens``);
* ``convo-int4-graphs`` (CUDA): the prompt in ``--chunk``-token chunks, each a replay of
  the prefill captured for that length (what a step runs while replies stream); also
  times one chunk of 16, 256 and ``--chunk`` tokens captured and eager (the fixed cost of
  a forward: ``chunk_ms``);
* ``stock-nf4-sdpa`` / ``convo-nf4``: with bitsandbytes nf4 (double quant) linears, when
  bitsandbytes is installed.

Also times one dequantization of every int4 layer weight (the cost each prefill forward
pays on top of bf16). Each row reports tokens/s and its ratio to ``stock-bf16-sdpa``.

GPU (H200):  python benchmarks/prefill.py --model random:llama-2-7b --out benchmarks/results
CPU smoke:   python benchmarks/prefill.py --model random:tiny-llama --tokens 256 --repeats 2

Prints one JSON object and writes ``prefill_<device>.json`` and ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import env_info, pick_device, pyplot, random_model, stderr_log, sync, to_nf4

from convo.fast import DecodeRequest, DecodeScheduler, PrefillChunk, StaticDecoder
from convo.fast.int4 import Int4Linear
from convo.fast.kernels import dequantize_plain_int4
from convo.models import GREEDY

#: Share of stock bf16 + SDPA prefill throughput that the int4 and nf4 paths aim for (issue 11).
TARGET_FRACTION = 0.8


log = stderr_log("prefill")


def timed(fn: Any, device: str, warmup: int, repeats: int) -> float:
    """Median seconds of ``fn()`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="random:llama-2-7b on CUDA, random:tiny-llama on CPU")
    p.add_argument("--tokens", type=int, default=2048, help="prompt tokens (2048)")
    p.add_argument("--chunk", type=int, default=512, help="chunk of the chunked rows (512)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--paths", default=None, help="comma list (default: all that apply)")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()

    gpu, device, name = pick_device(args.model)
    try:
        import bitsandbytes  # noqa: F401

        has_bnb = gpu
    except ImportError:
        has_bnb = False
    all_paths = [
        "stock-bf16-sdpa", "convo-bf16", "convo-bf16-chunk512", "convo-int4", "convo-int4-chunk512",
        "convo-int4-scheduler", "convo-int4-graphs", "stock-nf4-sdpa", "convo-nf4",
    ]  # fmt: skip
    paths = args.paths.split(",") if args.paths else all_paths
    if not has_bnb:
        paths = [x for x in paths if "nf4" not in x]
    t0 = time.perf_counter()
    model = random_model(name, device)
    tdtype = next(model.parameters()).dtype
    vocab = int(model.config.vocab_size)
    log(f"{name} on {device} in {time.perf_counter() - t0:.1f}s; paths {paths}")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, vocab - 1, (args.tokens,), generator=g).tolist()
    x = torch.tensor([ids], device=device)
    n = args.tokens
    rows: list[dict[str, Any]] = []
    kw = {"warmup": args.warmup, "repeats": args.repeats}

    def add(path: str, seconds: float, **extra: Any) -> None:
        rows.append({"path": path, "seconds": seconds, "tok_s": n / seconds, **extra})
        log(f"{path}: {n / seconds:,.0f} tok/s ({seconds * 1000:.1f} ms)")

    def stock() -> None:
        with torch.inference_mode():
            model(x, logits_to_keep=1)

    def run_paths(kind: str) -> None:
        if f"stock-{kind}-sdpa" in paths:
            add(f"stock-{kind}-sdpa", timed(stock, device, **kw))
        if kind == "nf4":
            if "convo-nf4" in paths:
                nf4 = StaticDecoder(model, slots=1, slot_tokens=n, compile=False, cuda_graphs=False,
                                    prefill_chunk_tokens=n)  # fmt: skip
                add("convo-nf4", timed(lambda: nf4.prefill(0, ids, 0), device, **kw))
            return
        for weights in ("bf16", "int4"):
            wanted = [x for x in paths if x.startswith(f"convo-{weights}")]
            if not wanted:
                continue
            dec = StaticDecoder(
                model, slots=1, slot_tokens=n, weights="int4" if weights == "int4" else "as-loaded",
                group_size=args.group_size, compile=False, cuda_graphs=False, prefill_chunk_tokens=n,
            )  # fmt: skip
            if f"convo-{weights}" in wanted:
                add(f"convo-{weights}", timed(lambda d=dec: d.prefill(0, ids, 0), device, **kw))
            if f"convo-{weights}-chunk512" in wanted:
                dec.prefill_chunk_tokens = args.chunk
                add(f"convo-{weights}-chunk512", timed(lambda d=dec: d.prefill(0, ids, 0), device, **kw),
                    chunk=args.chunk)  # fmt: skip
                dec.prefill_chunk_tokens = n
            if weights == "int4":
                plain = [w for layer in dec.layers for w in (*layer.qkv, layer.o, *layer.gate_up, layer.down)
                         if isinstance(w, Int4Linear) and w.qweight is not None]  # fmt: skip
                if plain:
                    grids = [(w.qweight, w.scales_zeros) for w in plain]
                    dq = timed(lambda g=grids: [dequantize_plain_int4(q, sz) for q, sz in g], device, **kw)
                    info["int4_dequantize_all_layers_ms"] = round(dq * 1000, 3)
                    log(f"dequantize every int4 layer weight once: {dq * 1000:.2f} ms")
            if f"convo-{weights}-graphs" in wanted and gpu:
                graphs = StaticDecoder(
                    model, slots=1, slot_tokens=n, weights="int4" if weights == "int4" else "as-loaded",
                    group_size=args.group_size, compile=False, prefill_chunk_tokens=args.chunk,
                )  # fmt: skip
                graphs.warmup()
                add(f"convo-{weights}-graphs", timed(lambda d=graphs: d.prefill(0, ids, 0), device, **kw),
                    chunk=args.chunk)  # fmt: skip
                chunk_ms: dict[str, float] = {}
                for size in (16, 256, args.chunk):
                    one = [PrefillChunk(slot=0, ids=ids, start=0, end=size)]
                    for label, d in (("graph", graphs), ("eager", dec)):
                        sec = timed(lambda d=d, one=one: d.prefill_batch(one), device, **kw)
                        chunk_ms[f"{label}_{size}"] = round(sec * 1000, 3)
                info[f"{weights}_chunk_ms"] = chunk_ms
                log(f"one chunk, captured vs eager (ms): {chunk_ms}")
                del graphs
            if f"convo-{weights}-scheduler" in wanted:
                sched = DecodeScheduler(dec, step_tokens=n)

                def first_token(s: DecodeScheduler = sched) -> None:
                    r = s.run(DecodeRequest(ids=ids, max_new_tokens=1, deadline=time.monotonic() + 600,
                                            sampling=GREEDY))  # fmt: skip
                    assert r.first_token_at is not None

                add(f"convo-{weights}-scheduler", timed(first_token, device, **kw), step_tokens=n)
                sched.close()
            del dec
            gc.collect()
            if gpu:
                torch.cuda.empty_cache()

    info: dict[str, Any] = {}
    run_paths("bf16")
    if has_bnb and any("nf4" in x for x in paths):
        to_nf4(model, tdtype)
        if gpu:
            torch.cuda.empty_cache()
        run_paths("nf4")
    base = next((r for r in rows if r["path"] == "stock-bf16-sdpa"), None)
    for r in rows:
        r["vs_stock_bf16"] = round(r["tok_s"] / base["tok_s"], 3) if base else None
    summary = {r["path"]: round(r["tok_s"]) for r in rows}
    report = {
        "benchmark": "prefill",
        "model": name,
        "device": device,
        "env": env_info(device),
        "tokens": n,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "group_size": args.group_size,
        "target_fraction_of_stock_bf16": TARGET_FRACTION,
        **info,
        "results": rows,
        "summary_tok_s": summary,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"prefill_{'h200' if 'H200' in report['env'].get('gpu', '') else device}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    _plot(report, out / f"{stem}.png")
    print(json.dumps(report, indent=2))


def _plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot(log)
    if plt is None:
        return
    rows = report["results"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    colors = ["tab:gray" if r["path"].startswith("stock") else "tab:blue" for r in rows]
    ax.barh([r["path"] for r in rows], [r["tok_s"] for r in rows], color=colors)
    base = next((r for r in rows if r["path"] == "stock-bf16-sdpa"), None)
    if base:
        ax.axvline(TARGET_FRACTION * base["tok_s"], color="tab:red", ls="--", label="80 % of stock bf16")
        ax.legend(fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("prefill tokens/s")
    env = report["env"]
    ax.set_title(
        f"prefill of {report['tokens']} tokens, {report['model']} on {env.get('gpu', report['device'])}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
