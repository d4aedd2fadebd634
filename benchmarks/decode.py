"""Decode speed: stock ``generate`` against convo's static KV slots and captured step.

Paths, side by side in one run, each at every ``--batch`` (concurrent sessions, one
``--prompt-tokens`` prompt each, ``--new-tokens`` greedy tokens, end of turn ignored):

* ``nf4-stock``: transformers ``generate`` (dynamic cache) with bitsandbytes nf4 + double
  quant, batched by left padding: what users run today;
* ``nf4-static``: the same bitsandbytes modules inside convo's static decoder;
* ``int4``: convo's fast 4-bit path (tinygemm int4, ``--group-size``), static decoder;
* ``bf16``: dense weights in the static decoder (fp32 on CPU: ``dense``);
* ``bf16-stock`` / ``dense-stock``: dense weights through ``generate``.

The static paths run through :class:`convo.fast.scheduler.DecodeScheduler` (the loop the engine
uses). Each result is set against the bandwidth bound: measured copy bandwidth over the
bytes one step reads (every weight once, plus each row's K and V up to its length), times
the rows. Peak reserved memory per path; predicted vs measured KV pool bytes.

GPU (H200, Llama-2-7B architecture, random weights, no download):
    python benchmarks/decode.py --model random:llama-2-7b --out benchmarks/results
CPU (the default model; slow, so fewer tokens):
    python benchmarks/decode.py --out benchmarks/results

Prints one JSON object and writes ``decode_<device>.json`` and ``.png`` under ``--out``.
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

from _common import decode_round, env_info, pick_device, pyplot, random_model, stderr_log, sync, to_nf4

from convo.engines.local.engine import TransformersEngine
from convo.fast import DecodeRequest, DecodeScheduler, StaticDecoder, tensor_nbytes
from convo.models import GREEDY, DType, ModelShape, Quant
from convo.planner import VRAMModel as MemoryModel
from convo.planner.measure import generate_exactly
from convo.planner.weights import weight_bytes

GiB = 1 << 30


log = stderr_log("decode")


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    import torch

    n = (1 << 30) if device == "cuda" else (1 << 28)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    reps = 20 if device == "cuda" else 5
    t = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * n * reps / (time.perf_counter() - t)


def reset_peak(device: str) -> None:
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_reserved(device: str) -> int:
    import torch

    return int(torch.cuda.max_memory_reserved()) if device == "cuda" else 0


def prompts(batch: int, tokens: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (batch, tokens), generator=g).tolist()


def run_static(dec: StaticDecoder, batch: int, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    sched = DecodeScheduler(dec)

    def round_(new_tokens: int, seed: int) -> tuple[float, int]:
        reqs = [
            DecodeRequest(ids=p, max_new_tokens=new_tokens, deadline=time.monotonic() + 600, sampling=GREEDY)
            for p in prompts(batch, args.prompt_tokens, vocab, seed)
        ]
        return decode_round(sched, reqs)

    round_(min(16, args.new_tokens), seed=1)  # warm-up: first replays, allocator, clocks
    times = [round_(args.new_tokens, seed=2 + i) for i in range(args.repeats)]
    times.sort()
    elapsed, tokens = times[len(times) // 2]
    steps = sched.steps
    sched.close()
    return {"tok_s": tokens / elapsed, "step_ms": 1000 * elapsed / (args.new_tokens - 1), "steps": steps}


def run_stock(model: Any, batch: int, args: argparse.Namespace, vocab: int, device: str) -> dict[str, Any]:
    import torch

    ids = torch.tensor(prompts(batch, args.prompt_tokens, vocab), device=device)

    def gen(n: int) -> float:
        sync(device)
        t = time.perf_counter()
        generate_exactly(model, ids, n)
        sync(device)
        return time.perf_counter() - t

    gen(4)
    gen(4)
    one = sorted(gen(1) for _ in range(args.repeats))[args.repeats // 2]
    full = sorted(gen(args.new_tokens) for _ in range(args.repeats))[args.repeats // 2]
    elapsed = full - one
    if elapsed <= 0:  # a tiny model on a busy machine: the noise exceeds the decode time
        raise RuntimeError(f"decode time not measurable ({elapsed * 1000:.1f} ms): raise --new-tokens")
    return {
        "tok_s": batch * (args.new_tokens - 1) / elapsed,
        "step_ms": 1000 * elapsed / (args.new_tokens - 1),
    }


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default=None, help="default: random:llama-2-7b on CUDA, the default model on CPU"
    )
    p.add_argument("--paths", default=None, help="comma list; default: all that apply to the device")
    p.add_argument("--batch", default=None, help="concurrent sessions, comma list (GPU 1,4,16; CPU 1,4)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="GPU 512, CPU 128")
    p.add_argument("--new-tokens", type=int, default=None, help="GPU 128, CPU 24")
    p.add_argument("--slot-tokens", type=int, default=1024)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()

    gpu, device, name = pick_device(args.model, cpu_model="default")
    batches = [int(b) for b in (args.batch or ("1,4,16" if gpu else "1,4")).split(",")]
    args.prompt_tokens = args.prompt_tokens or (512 if gpu else 128)
    args.new_tokens = args.new_tokens or (128 if gpu else 24)
    dense = "bf16" if gpu else "dense"
    default_paths = (
        ["bf16", "bf16-stock", "int4", "nf4-static", "nf4-stock"] if gpu else ["dense", "dense-stock", "int4"]
    )
    paths = (args.paths or ",".join(default_paths)).replace("dense", dense).split(",")
    if not gpu and any(x.startswith("nf4") for x in paths):
        raise SystemExit("nf4 paths need CUDA here")

    t0 = time.perf_counter()
    if name.startswith("random:"):
        model = random_model(name, device)
    else:
        model = TransformersEngine(name if name != "default" else None, device=device, kv_slots=0,
                                   quant="bf16" if gpu else "fp32").model  # fmt: skip
    dtype = next(model.parameters()).dtype
    shape = ModelShape.from_config(model.config)
    kv_per_token = shape.kv_bytes_per_token(DType.parse(str(dtype)))
    vocab = int(model.config.vocab_size)
    kv_dtype = DType.parse(str(dtype))
    weights_report = weight_bytes(model.config.to_dict(), Quant.NONE, kv_dtype)
    planner = MemoryModel(shape=shape, weights=weights_report, kv_dtype=kv_dtype)
    log(f"{name} on {device} ({dtype}) in {time.perf_counter() - t0:.1f}s; paths {paths}, batches {batches}")
    bandwidth = copy_bandwidth(device)
    log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")

    def write(results: list[dict[str, Any]], *, partial: bool) -> dict[str, Any]:
        """Write the report so far (a run cut short still leaves its numbers)."""
        report = {
            "benchmark": "decode",
            "partial": partial,
            "model": name,
            "device": device,
            "env": env_info(device),
            "dtype": str(dtype),
            "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens,
            "slot_tokens": args.slot_tokens,
            "group_size": args.group_size,
            "copy_bandwidth_TBps": bandwidth / 1e12,
            "kv_bytes_per_token": kv_per_token,
            "results": results,
            "summary": _summary(results, dense),
        }
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"decode_{'h200' if 'H200' in report['env'].get('gpu', '') else device}"
        (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
        if not partial:
            _plot(report, out / f"{stem}.png")
        return report

    # Mean tokens attention reads per row over the timed steps.
    mean_len = args.prompt_tokens + args.new_tokens / 2
    results: list[dict[str, Any]] = []
    known = (dense, f"{dense}-stock", "int4", "int4-triton", "int4-tinygemm", "nf4-static", "nf4-stock")
    order = [x for x in known if x in paths]
    nf4_done = False
    for path in order:
        if path.startswith("nf4") and not nf4_done:
            to_nf4(model, dtype)
            nf4_done = True
        reset_peak(device)
        base_alloc = torch.cuda.memory_allocated() if gpu else 0
        info: dict[str, Any] = {"path": path}
        try:
            if path.endswith("-stock"):
                weights = tensor_nbytes(model.model.layers, model.model.norm, model.lm_head)
                for b in batches:
                    log(f"{path} batch {b}")
                    r = run_stock(model, b, args, vocab, device)
                    results.append(_result(info, b, r, weights, kv_per_token, mean_len, bandwidth, device))
                continue
            t = time.perf_counter()
            dec = StaticDecoder(
                model,
                slots=max(batches),
                slot_tokens=args.slot_tokens,
                weights="int4" if path.startswith("int4") else "as-loaded",
                group_size=args.group_size,
                buckets=batches,
                int4_kernel=path.partition("-")[2] or "auto" if path.startswith("int4") else "auto",
            )
            dec.warmup()
            info.update(
                warmup_s=round(time.perf_counter() - t, 1),
                compiled=dec.compiled,
                cuda_graphs=dec.cuda_graphs,
                int4_layout=dec.int4_layout,
                weights_kept_bytes=dec.weight_nbytes(),
                pool_predicted_bytes=dec.pool_predicted_bytes,
                planner_pool_bytes=planner.kv_pool_bytes(max(batches), args.slot_tokens),
                pool_measured_bytes=dec.pool_measured_bytes,
                pool_error=dec.pool_measured_bytes / dec.pool_predicted_bytes - 1,
                allocated_above_model_GiB=((torch.cuda.memory_allocated() - base_alloc) / GiB)
                if gpu
                else None,
            )
            log(f"{path}: warm-up {info['warmup_s']}s, pool {dec.pool_measured_bytes / GiB:.2f} GiB")
            info["kernel_choice"] = dict(dec.kernel_choice) or None
            for b in batches:
                log(f"{path} batch {b} ({dec.kernel_choice.get(b, 'dense')})")
                weights = dec.weight_nbytes()
                r = run_static(dec, b, args, vocab)
                r["kernel"] = dec.kernel_choice.get(b)
                results.append(_result(info, b, r, weights, kv_per_token, mean_len, bandwidth, device))
            del dec
        except Exception as exc:  # one path failing must not lose the others
            log(f"{path} failed: {type(exc).__name__}: {exc}")
            results.append({**info, "error": f"{type(exc).__name__}: {exc}"})
        finally:
            reset_peak(device)
        write(results, partial=path != order[-1])

    report = write(results, partial=False)
    print(json.dumps(report["summary"], indent=2))
    for r in results:
        if "tok_s" in r:
            print(
                f"{r['path']:>11} batch {r['batch']:>2}: {r['tok_s']:8.1f} tok/s "
                f"({100 * r['fraction_of_bound']:5.1f}% of {r['bound_tok_s']:.0f}), "
                f"step {r['step_ms']:.2f} ms, peak reserved {r['peak_reserved_GiB']:.2f} GiB"
            )
        else:
            print(f"{r['path']:>11}: {r.get('error')}")


def _result(
    info: dict[str, Any],
    batch: int,
    r: dict[str, Any],
    weights: int,
    kv_per_token: int,
    mean_len: float,
    bandwidth: float,
    device: str,
) -> dict[str, Any]:
    step_bytes = weights + batch * mean_len * kv_per_token
    bound = batch * bandwidth / step_bytes
    return {
        **info,
        **r,
        "batch": batch,
        "weights_bytes": weights,
        "step_bytes": int(step_bytes),
        "bound_tok_s": bound,
        "fraction_of_bound": r["tok_s"] / bound,
        "peak_reserved_GiB": peak_reserved(device) / GiB,
    }


def _summary(results: list[dict[str, Any]], dense: str) -> dict[str, Any]:
    def get(path: str, batch: int) -> dict[str, Any] | None:
        return next(
            (r for r in results if r["path"] == path and r.get("batch") == batch and "tok_s" in r), None
        )

    out: dict[str, Any] = {}
    for path in sorted({r["path"] for r in results}):
        one = get(path, 1)
        row = {
            f"b{r['batch']}_tok_s": round(r["tok_s"], 1)
            for r in results
            if r["path"] == path and "tok_s" in r
        }
        row.update({f"b{r['batch']}_of_bound": round(r["fraction_of_bound"], 3) for r in results
                    if r["path"] == path and "tok_s" in r})  # fmt: skip
        if one is not None:
            for r in results:
                if r["path"] == path and "tok_s" in r and r["batch"] > 1:
                    row[f"b{r['batch']}_vs_b1"] = round(r["tok_s"] / one["tok_s"], 2)
        out[path] = row
    stock, fast = get("nf4-stock", 1), get("int4", 1)
    if stock and fast:
        out["int4_vs_nf4_stock_b1"] = round(fast["tok_s"] / stock["tok_s"], 2)
    return out


def _plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot(log)
    if plt is None:
        return
    rows = [r for r in report["results"] if "tok_s" in r]
    paths = list(dict.fromkeys(r["path"] for r in rows))
    batches = sorted({r["batch"] for r in rows})
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(len(paths), 1)
    for i, p in enumerate(paths):
        xs, ys, bounds = [], [], []
        for j, b in enumerate(batches):
            r = next((r for r in rows if r["path"] == p and r["batch"] == b), None)
            if r:
                xs.append(j + i * width)
                ys.append(r["tok_s"])
                bounds.append(r["bound_tok_s"])
        bars = ax.bar(xs, ys, width, label=p)
        ax.scatter(
            xs, bounds, marker="_", s=300, color=bars.patches[0].get_facecolor() if bars.patches else None
        )
    ax.set_xticks([j + width * (len(paths) - 1) / 2 for j in range(len(batches))])
    ax.set_xticklabels([f"{b} session{'s' if b > 1 else ''}" for b in batches])
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s (bars) and bandwidth bound (dashes)")
    env = report["env"]
    ax.set_title(f"decode, {report['model']} on {env.get('gpu', env.get('processor'))}, "
                 f"{report['prompt_tokens']}-token prompts")  # fmt: skip
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
