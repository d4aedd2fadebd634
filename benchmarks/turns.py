"""N-turn conversation through a convo Session and, side by side, the naive script.

The naive script is what people write first: every turn re-sends the whole history to
``model.generate``. convo plans each prompt under its budget and reuses the KV cache.

    python benchmarks/turns.py --turns 20 --json                         # CPU, default model
    python benchmarks/turns.py --model random:llama-2-7b --quant nf4 \
        --turns 200 --naive-turns 24 --json --out out/turns              # H200

Prints one JSON object: {"hardware", "versions", "config", "convo": [rows], "naive": [rows],
"summary"}; each row has turn, context_tokens, kv_bytes, peak_allocated_bytes,
peak_reserved_bytes (RSS-based on CPU, as "hardware.memory_kind" says), latency_s, ttft_s.
Writes turns.png (memory and latency against the turn) into --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FILLER = (
    "I have been thinking about our plans and the many small things that need care, the "
    "tickets, the bags, the neighbours who water the plants, the long list of errands. "
)


def user_turn(i: int, words: int, rng: random.Random) -> str:
    """A synthetic user turn of about ``words`` words with a planted fact."""
    fact = f"Note {i}: the locker code for box {i} is {rng.randint(1000, 9999)}."
    body = (FILLER * (words // 30 + 1)).split()[: max(words - 15, 0)]
    return fact + " " + " ".join(body)


def hardware(engine: Any) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"device": engine.device, "platform": platform.platform(), "cpu_count": None}
    import os

    info["cpu_count"] = os.cpu_count()
    if engine.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_bytes=props.total_memory, memory_kind="cuda")
    else:
        info.update(memory_kind="rss (process resident set; peak_* is the process peak so far)")
    return info


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "bitsandbytes", "convo"):
        try:
            out[name] = __import__(name).__version__
        except Exception:
            out[name] = "missing"
    return out


def run_convo(engine: Any, args: argparse.Namespace, weights: int, deadline: float) -> list[dict[str, Any]]:
    import convo

    budget = convo.Budget(
        context_tokens=args.budget,
        max_new_tokens=args.max_new_tokens,
        window_turns=args.window,
        summary_tokens=args.summary_tokens,
        summarize_batch_turns=args.summarize_batch,
    )
    sampling = convo.Sampling(min_new_tokens=args.max_new_tokens if args.fixed_length else 0)
    session = convo.Session(
        engine, budget=budget, sampling=sampling, system_prompt="You are a helpful assistant."
    )
    rng = random.Random(0)
    rows = []
    for turn in turns_until(deadline, args.turns, "convo"):
        if turn > 1 and args.think_s:
            time.sleep(args.think_s)  # the user reads and types; background summaries run
        reply = session.send(user_turn(turn, args.user_words, rng))
        g = reply.stats.generation
        row = {
            "turn": turn,
            "context_tokens": reply.stats.prompt_tokens,
            "kv_bytes": g.kv_bytes,
            "kv_bytes_expected": g.kv_bytes_expected,
            "peak_allocated_bytes": g.peak_allocated_bytes,
            "peak_reserved_bytes": g.peak_reserved_bytes,
            "peak_above_weights_bytes": g.peak_allocated_bytes - weights,
            "latency_s": round(reply.stats.latency_s, 4),
            "generate_s": round(reply.stats.generate_s, 4),
            "summarize_s": round(reply.stats.summarize_s, 4),
            "ttft_s": round(g.ttft_s, 4),
            "cached_tokens": g.cached_tokens,
            "prefill_tokens": g.prefill_tokens,
            "new_tokens": g.new_tokens,
            "tokens_per_s": round(g.tokens_per_s, 2),
            "evicted_turns": reply.stats.evicted_turns,
            "summary_tokens": reply.stats.summary_tokens,
        }
        summary = getattr(reply.stats, "summary", None)  # (absent before summaries went off the reply path)
        if summary is not None:
            row.update(
                summary_status=summary.status.value,
                summarized_turns=summary.summarized_turns,
                hidden_turns=reply.stats.hidden_turns,
            )
        if args.ttft_compare and g.cached_tokens > 0:
            # The same prompt without reuse: a fresh prefill and one token.
            fresh = engine.generate(reply.plan.messages, max_new_tokens=1)
            row["ttft_noreuse_s"] = round(fresh.stats.ttft_s, 4)
        rows.append(row)
        print(
            f"[turns] convo {turn}: ctx={row['context_tokens']} ttft={row['ttft_s']:.3f}s "
            f"lat={row['latency_s']:.2f}s peak={row['peak_allocated_bytes'] / 2**30:.2f}GiB",
            file=sys.stderr,
        )
    if hasattr(session, "wait_summary"):
        session.wait_summary()  # no background work left to disturb what runs next
    session.close()
    return rows


class FirstToken:
    """A ``generate`` streamer that notes when the first new token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_at: float | None = None

    def put(self, value: Any) -> None:
        self.calls += 1
        if self.calls == 2:  # the first call carries the prompt
            self.first_at = time.monotonic()

    def end(self) -> None:
        pass


def turns_until(deadline: float, count: int, who: str) -> Iterator[int]:
    """Turn numbers 1 to ``count``, until ``time.monotonic()`` passes ``deadline`` (logged)."""
    for turn in range(1, count + 1):
        if time.monotonic() > deadline:
            print(f"[turns] {who} stopped at turn {turn} (--max-seconds)", file=sys.stderr)
            return
        yield turn


def run_naive(engine: Any, args: argparse.Namespace, weights: int, deadline: float) -> list[dict[str, Any]]:
    """Plain transformers: the whole history through the chat template into generate."""
    import torch

    model, tok = engine.model, engine.tokenizer
    device = model.device
    cuda = device.type == "cuda"
    history: list[dict[str, str]] = [{"role": "system", "content": "You are a helpful assistant."}]
    rng = random.Random(0)
    rows = []
    for turn in turns_until(deadline, args.naive_turns, "naive"):
        history.append({"role": "user", "content": user_turn(turn, args.user_words, rng)})
        text = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        model_ids = engine._model_ids(ids)
        streamer = FirstToken()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        start = time.monotonic()
        try:
            with torch.inference_mode():
                out = model.generate(
                    input_ids=torch.tensor([model_ids], device=device),
                    attention_mask=torch.ones(1, len(model_ids), dtype=torch.long, device=device),
                    max_new_tokens=args.max_new_tokens,
                    min_new_tokens=args.max_new_tokens if args.fixed_length else 0,
                    do_sample=False,
                    streamer=streamer,
                    pad_token_id=tok.pad_token_id or 0,
                )
        except torch.OutOfMemoryError:
            rows.append({"turn": turn, "context_tokens": len(ids), "oom": True})
            print(f"[turns] naive OOM at turn {turn}", file=sys.stderr)
            break
        elapsed = time.monotonic() - start
        new = out[0, len(ids) :].tolist()
        history.append({"role": "assistant", "content": tok.decode(new, skip_special_tokens=True)})
        kv_tokens = len(ids) + len(new) - 1
        from convo.engines.local.engine import _memory_report

        mem = _memory_report(device)
        rows.append(
            {
                "turn": turn,
                "context_tokens": len(ids),
                "kv_bytes": kv_tokens * engine.kv_bytes_per_token,
                "peak_allocated_bytes": mem["peak_allocated_bytes"],
                "peak_reserved_bytes": mem["peak_reserved_bytes"],
                "peak_above_weights_bytes": mem["peak_allocated_bytes"] - weights,
                "latency_s": round(elapsed, 4),
                "ttft_s": round((streamer.first_at or time.monotonic()) - start, 4),
                "new_tokens": len(new),
            }
        )
        print(
            f"[turns] naive {turn}: ctx={len(ids)} lat={elapsed:.2f}s "
            f"peak={mem['peak_allocated_bytes'] / 2**30:.2f}GiB",
            file=sys.stderr,
        )
        del out
        if cuda:
            torch.cuda.empty_cache()
    return rows


def summarize(
    convo_rows: list[dict[str, Any]], naive_rows: list[dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if convo_rows:
        # "After the window fills": once turns start leaving it.
        filled = [r for r in convo_rows if r["evicted_turns"] > 0] or convo_rows
        peaks = [r["peak_above_weights_bytes"] for r in filled]
        out["convo_peak_above_weights_min_bytes"] = min(peaks)
        out["convo_peak_above_weights_max_bytes"] = max(peaks)
        out["convo_peak_flatness"] = round(max(peaks) / max(min(peaks), 1), 3)
        out["convo_max_context_tokens"] = max(r["context_tokens"] for r in convo_rows)

        def lat(turns: range) -> float | None:
            vals = [r["latency_s"] for r in convo_rows if r["turn"] in turns]
            return round(statistics.median(vals), 4) if vals else None

        out["convo_latency_median_turns_16_25_s"] = lat(range(16, 26))
        n = convo_rows[-1]["turn"]
        out[f"convo_latency_median_turns_{n - 9}_{n}_s"] = lat(range(n - 9, n + 1))
        # Turns whose prompt extends the previous one (most of it comes from the cache),
        # against a fresh prefill of the same prompt.
        ext = [
            r for r in convo_rows if "ttft_noreuse_s" in r and r["cached_tokens"] >= r["context_tokens"] // 2
        ]
        if ext:
            out["reuse_ttft_median_s"] = round(statistics.median(r["ttft_s"] for r in ext), 4)
            out["noreuse_ttft_median_s"] = round(statistics.median(r["ttft_noreuse_s"] for r in ext), 4)
            out["reuse_ttft_cut_median"] = round(
                statistics.median(1 - r["ttft_s"] / r["ttft_noreuse_s"] for r in ext), 3
            )
            out["reuse_turns_compared"] = len(ext)
        after = [r for r in convo_rows if r["turn"] > args.window]
        if after:
            out["share_of_turns_extending_previous_prompt"] = round(
                sum(r["cached_tokens"] >= r["context_tokens"] // 2 for r in after) / len(after), 3
            )
    if naive_rows:
        ok = [r for r in naive_rows if not r.get("oom")]
        if ok:
            out["naive_last_turn"] = ok[-1]["turn"]
            out["naive_peak_above_weights_last_bytes"] = ok[-1]["peak_above_weights_bytes"]
            out["naive_context_tokens_last"] = ok[-1]["context_tokens"]
            out["naive_latency_last_s"] = ok[-1]["latency_s"]
        out["naive_oom"] = any(r.get("oom") for r in naive_rows)
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, style in (("convo", "-"), ("naive", "--")):
        rows = [r for r in result[name] if not r.get("oom")]
        if not rows:
            continue
        turns = [r["turn"] for r in rows]
        ax1.plot(
            turns,
            [r["peak_above_weights_bytes"] / 2**30 for r in rows],
            style,
            label=f"{name} peak allocated above weights",
        )
        ax2.plot(turns, [r["latency_s"] for r in rows], style, label=f"{name} turn latency")
        ax2.plot(turns, [r["ttft_s"] for r in rows], ":", label=f"{name} time to first token")
    ax1.set_xlabel("turn")
    ax1.set_ylabel("GiB")
    ax1.set_title(f"memory ({result['hardware'].get('gpu', result['hardware']['device'])})")
    ax2.set_xlabel("turn")
    ax2.set_ylabel("seconds")
    ax2.set_title("latency")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default, a folder, or random:llama-2-7b")
    p.add_argument("--quant", default="auto")
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--naive-turns", type=int, default=None, help="default: --turns")
    p.add_argument("--naive", dest="naive", action="store_true", default=True)
    p.add_argument("--no-naive", dest="naive", action="store_false")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--summary-tokens", type=int, default=64)
    p.add_argument("--summarize-batch", type=int, default=4)
    p.add_argument("--user-words", type=int, default=220, help="about 300 tokens")
    p.add_argument("--fixed-length", action="store_true", help="force every reply to max_new_tokens")
    p.add_argument(
        "--ttft-compare", action="store_true", help="also time a fresh prefill of each reused prompt"
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--think-s", type=float, default=0.0, help="pause between turns (a user reading and typing)"
    )
    p.add_argument(
        "--kv-slots",
        type=int,
        default=None,
        help="static KV slots (default: the engine's; 0 = plain generate)",
    )
    p.add_argument("--max-seconds", type=float, default=1e9, help="stop the convo side after this long")
    p.add_argument("--naive-max-seconds", type=float, default=1e9, help="stop the naive side after this long")
    p.add_argument("--oom-check", action="store_true", help="then provoke a real CUDA OOM and recover (GPU)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default="out/turns")
    args = p.parse_args()
    args.naive_turns = args.naive_turns or args.turns

    import torch

    import convo

    engine = convo.TransformersEngine(
        args.model,
        quant=args.quant,
        kv_slots=args.kv_slots,
        slot_tokens=args.budget,  # a slot holds one session's whole budget (static decode)
        progress=lambda m: print(f"[turns] {m}", file=sys.stderr),
    )
    cuda = engine.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    weights = torch.cuda.memory_allocated() if cuda else engine.model.get_memory_footprint()
    # Warm up kernels and allocator before anything is timed.
    for _ in range(args.warmup):
        engine.generate([convo.user(user_turn(0, args.user_words, random.Random(1)))], max_new_tokens=8)
    result: dict[str, Any] = {
        "hardware": hardware(engine),
        "versions": versions(),
        "config": {
            **vars(args),
            "attention": engine.attention,
            "quant_resolved": engine.quant.value,
            "weights_bytes": weights,
            "kv_bytes_per_token": engine.kv_bytes_per_token,
        },
    }
    result["convo"] = run_convo(engine, args, weights, time.monotonic() + args.max_seconds)
    engine.release_all()
    result["naive"] = (
        run_naive(engine, args, weights, time.monotonic() + args.naive_max_seconds) if args.naive else []
    )
    result["summary"] = summarize(result["convo"], result["naive"], args)
    if args.oom_check and cuda:
        import oom_recovery

        engine.release_all()
        result["oom_check"] = [oom_recovery.run(engine, headroom_fraction=f) for f in (0.9, 0.7)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "turns.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "turns.png")
    if args.json:
        print(json.dumps(result))
    print(json.dumps(result["summary"], indent=1), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
