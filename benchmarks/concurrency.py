"""Concurrency benchmark: plain concurrent ``generate`` vs convo's admission + batching.

On a GPU (default: Llama-2-7B architecture, nf4 + double quant, random weights) the
process is capped at ``--budget`` with ``torch.cuda.set_per_process_memory_fraction``:

1. plain: every request calls ``model.generate`` at once from its own thread; requests
   that hit ``torch.OutOfMemoryError`` are counted (the budget is blown);
2. one by one: a sample of requests run alone, for the sequential tokens/s;
3. convo: the same requests go through ``AdmissionController`` (KV budget from
   ``convo.memory``) and a ``Batcher`` (left-padded batched generate): all complete.

Prints one JSON object (hardware, versions, tokens/s, peak reserved vs budget, OOMs) and
writes ``concurrency.json`` and ``concurrency.png`` under ``--out``.

GPU:  python benchmarks/concurrency.py --out out/bench
CPU smoke (< 1 min):  python benchmarks/concurrency.py --model random:tiny-llama \
          --device cpu --requests 24 --out /tmp/bench
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import run_in_threads  # (the tests import this module as benchmarks.concurrency)
from convo.admission import (
    AdmissionController,
    AdmissionLimits,
    Batcher,
    Request,
    split_for_padding,
)
from convo.errors import AdmissionError
from convo.metrics import ServingMetrics
from convo.models import Attn, DType, Quant, load_config, parse_size
from convo.planner import VRAMModel as MemoryModel
from convo.planner.measure import _device_info, build_random_model


def build_model(name: str, *, device: str, quant: str) -> Any:
    """A random-weight model of ``name``'s config on ``device`` (no download)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = load_config(name)
    if device == "cuda":
        return build_random_model(cfg, quant=Quant.parse(quant), dtype=DType.BF16, attn=Attn.SDPA)
    cfg = dict(cfg)
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


class TinyRunner:
    """``run_batch`` for :class:`~convo.admission.Batcher`: one left-padded ``generate``.

    Each request's payload may hold ``input_ids`` (list of ints); otherwise a random
    prompt of ``prompt_tokens`` is made. Every row generates up to the batch's largest
    ``max_new_tokens`` and is then cut to its own (per-row stopping).
    """

    def __init__(self, model: Any, pad_token_id: int = 0, max_padding_ratio: float = 0.25) -> None:
        self.model = model
        self.max_padding_ratio = max_padding_ratio
        self.pad = pad_token_id
        self.vocab = int(model.config.vocab_size)
        self.device = next(model.parameters()).device
        self.batches: list[int] = []

    def __call__(self, reqs: list[Request]) -> list[list[int]]:
        # left padding costs rows x longest: run length-sorted sub-batches one by one so a
        # batch never holds more than its requests were charged (see split_for_padding)
        out: dict[int, list[int]] = {}
        for group in split_for_padding(
            reqs, lambda r: r.total_tokens, max_padding_ratio=self.max_padding_ratio
        ):
            for r, toks in zip(group, self._generate(group), strict=True):
                out[r.id] = toks
        return [out[r.id] for r in reqs]

    def _generate(self, reqs: list[Request]) -> list[list[int]]:
        import torch

        prompts = []
        for r in reqs:
            ids = (r.payload or {}).get("input_ids") if isinstance(r.payload, dict) else None
            if ids is None:
                rng = random.Random(r.id)
                ids = [rng.randrange(3, self.vocab) for _ in range(max(r.prompt_tokens, 1))]
            prompts.append(list(ids))
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(reqs), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(reqs), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        new = max(max(r.max_new_tokens for r in reqs), 1)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=mask.to(self.device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=self.pad,
            )
        self.batches.append(len(reqs))
        gen = out[:, width:].tolist()
        return [row[: r.max_new_tokens] for row, r in zip(gen, reqs, strict=True)]


def make_requests(n: int, lo: int, hi: int, new: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request(prompt_tokens=rng.randint(lo, hi), max_new_tokens=new) for _ in range(n)]


def run_plain_concurrent(model: Any, reqs: list[Request], runner: TinyRunner) -> dict[str, Any]:
    """Every request generates at once in its own thread, no admission control."""
    import torch

    ooms = ok = other = 0
    lock = threading.Lock()
    start = threading.Barrier(len(reqs))

    def one(r: Request) -> None:
        nonlocal ooms, ok, other
        start.wait()
        try:
            runner([r])
            kind = "ok"
        except torch.OutOfMemoryError:
            kind = "oom"
        except Exception as exc:
            print(f"plain: {type(exc).__name__}: {exc}", file=sys.stderr)
            kind = "other"
        with lock:
            if kind == "ok":
                ok += 1
            elif kind == "oom":
                ooms += 1
            else:
                other += 1

    seconds = run_in_threads(one, reqs)
    return {"completed": ok, "oom": ooms, "other_errors": other, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model", default=None, help="default: random:llama-2-7b on GPU, random:tiny-llama on CPU"
    )
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--quant", default=None, help="nf4 on GPU, none on CPU by default")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--prompt-min", type=int, default=None)
    p.add_argument("--prompt-max", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--budget", default="16GiB", help="GPU memory the process may use")
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument(
        "--sequential-sample",
        type=int,
        default=6,
        help="requests timed one by one for the sequential tokens/s",
    )
    p.add_argument("--skip-plain", action="store_true")
    p.add_argument("--out", required=True, help="folder for concurrency.json and .png")
    args = p.parse_args(argv)

    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = device == "cuda"
    model_name = args.model or ("random:llama-2-7b" if gpu else "random:tiny-llama")
    quant = args.quant or ("nf4" if gpu else "none")
    lo = args.prompt_min or (1000 if gpu else 16)
    hi = args.prompt_max or (3000 if gpu else 96)
    new = args.max_new_tokens or (64 if gpu else 8)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    model = build_model(model_name, device=device, quant=quant)
    runner = TinyRunner(model)
    mm = MemoryModel.from_model(model_name, quant=quant if gpu else "none", dtype="bf16" if gpu else "fp32")
    budget = parse_size(args.budget)
    weights_alloc = weights_res = None
    if gpu:
        gc.collect()
        torch.cuda.empty_cache()
        weights_alloc = int(torch.cuda.memory_allocated())
        weights_res = int(torch.cuda.memory_reserved())
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(budget / total, 1.0))
    log(f"model {model_name} ({quant}) on {device} in {time.perf_counter() - t0:.1f}s")

    reqs = make_requests(args.requests, lo, hi, new, seed=0)
    runner([Request(prompt_tokens=32, max_new_tokens=4)])  # warm-up
    runner([Request(prompt_tokens=32, max_new_tokens=4)] * 2)

    result: dict[str, Any] = {
        "model": model_name,
        "quant": quant,
        "device": device,
        "requests": len(reqs),
        "prompt_tokens": [lo, hi],
        "max_new_tokens": new,
        "budget_bytes": budget,
        "weights_allocated_bytes": weights_alloc,
        "weights_reserved_bytes": weights_res,
        "predicted_weights_bytes": mm.weights.total_bytes,
        "env": _device_info(),
    }

    # 1. plain concurrent generate under the cap
    if not args.skip_plain:
        if gpu:
            torch.cuda.reset_peak_memory_stats()
        plain = run_plain_concurrent(
            model,
            [Request(prompt_tokens=r.prompt_tokens, max_new_tokens=r.max_new_tokens) for r in reqs],
            runner,
        )
        if gpu:
            plain["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
            gc.collect()
            torch.cuda.empty_cache()
        result["plain_concurrent"] = plain
        log(f"plain concurrent: {plain}")

    # 2. one by one
    sample = reqs[: args.sequential_sample]
    t = time.perf_counter()
    for r in sample:
        runner([r])
    seq_s = time.perf_counter() - t
    seq_tokens = sum(r.max_new_tokens for r in sample)
    result["one_by_one"] = {"requests": len(sample), "seconds": seq_s, "tokens_per_s": seq_tokens / seq_s}
    log(f"one by one: {result['one_by_one']}")

    # 3. convo: admission + batching
    if gpu:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        kv_budget = mm.admission_budget_bytes(budget)
    else:
        kv_budget = 6 * mm.request_bytes(hi, new)
    metrics = ServingMetrics()
    ctl = AdmissionController(
        AdmissionLimits(
            kv_budget_bytes=kv_budget,
            max_concurrency=args.max_batch_size,
            max_queue_short=len(reqs),
            max_queue_long=len(reqs),
            queue_timeout_s=3600,
            long_request_tokens=hi + new,
        ),
        cost_fn=lambda p, n: int(mm.request_bytes(p, n) * (1 + runner.max_padding_ratio)),
        metrics=metrics,
    )
    done: list[int] = []
    failed: list[str] = []
    lock = threading.Lock()
    with Batcher(runner, max_batch_size=args.max_batch_size, batch_window_s=0.05) as batcher:

        def client(r: Request) -> None:
            try:
                with ctl.acquire(r):
                    toks = batcher.run(r)
                metrics.add_tokens(len(toks))
                with lock:
                    done.append(len(toks))
            except (AdmissionError, Exception) as exc:
                with lock:
                    failed.append(f"{type(exc).__name__}: {exc}")

        runner.batches.clear()
        convo_s = run_in_threads(client, reqs)
    result["convo"] = {
        "completed": len(done),
        "failed": len(failed),
        "errors": failed[:5],
        "seconds": convo_s,
        "tokens_per_s": sum(done) / convo_s,
        "kv_budget_bytes": kv_budget,
        "ledger_peak_bytes": ctl.ledger.peak,
        "peak_running": ctl.peak_running,
        "batch_sizes": runner.batches,
        "peak_reserved_bytes": int(torch.cuda.max_memory_reserved()) if gpu else None,
        "peak_allocated_bytes": int(torch.cuda.max_memory_allocated()) if gpu else None,
    }
    result["speedup_batched_vs_one_by_one"] = (
        result["convo"]["tokens_per_s"] / result["one_by_one"]["tokens_per_s"]
    )
    log(f"convo: completed {len(done)}/{len(reqs)} in {convo_s:.1f}s")
    (out_dir / "concurrency.json").write_text(json.dumps(result, indent=2))
    _plot(result, out_dir / "concurrency.png")
    print(json.dumps(result, indent=2))
    plain_r = result.get("plain_concurrent", {})
    print(f"\n{'run':<20}{'done':>6}{'oom':>6}{'tok/s':>10}{'peak reserved GiB':>20}", file=sys.stderr)
    for name, row in (
        ("plain concurrent", plain_r),
        ("one by one", result["one_by_one"]),
        ("convo batched", result["convo"]),
    ):
        pr = row.get("peak_reserved_bytes")
        print(
            f"{name:<20}{row.get('completed', row.get('requests', '-')):>6}"
            f"{row.get('oom', '-'):>6}{row.get('tokens_per_s', float('nan')):>10.1f}"
            f"{(pr / 2**30 if pr else float('nan')):>20.2f}",
            file=sys.stderr,
        )
    print(f"budget {budget / 2**30:.2f} GiB", file=sys.stderr)
    return 0 if not failed else 1


def _plot(result: dict[str, Any], path: Path) -> None:
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["one by one", "convo batched"]
    vals = [result["one_by_one"]["tokens_per_s"], result["convo"]["tokens_per_s"]]
    a.bar(names, vals, color=["#999", "#2a7"])
    a.set_ylabel("aggregate tokens/s")
    a.set_title(f"{result['model']} {result['quant']} on {result['env'].get('device')}")
    plain = result.get("plain_concurrent")
    labels, done, oom = [], [], []
    if plain:
        labels.append("plain concurrent")
        done.append(plain["completed"])
        oom.append(plain["oom"])
    labels.append("convo")
    done.append(result["convo"]["completed"])
    oom.append(0)
    b.bar(labels, done, color="#2a7", label="completed")
    b.bar(labels, oom, bottom=done, color="#c33", label="OOM")
    b.set_ylabel("requests")
    b.legend()
    b.set_title(f"budget {result['budget_bytes'] / 2**30:.1f} GiB")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
