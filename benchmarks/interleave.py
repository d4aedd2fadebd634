"""Inter-token latency of running replies while new turns arrive (continuous batching).

``--streams`` replies decode together (300-token prompts, long replies). First alone: the
steady-state step time (median gap between two tokens of a stream). Then, while they keep
decoding, a new turn arrives every ``--arrival-ms`` (``--arrival-tokens`` prompt, 32-token
reply; every fourth one ``--long-tokens`` long), for each ``--step-tokens`` budget. Reports
the running streams' inter-token gaps during the arrivals (p50, p95, max) against the
steady step: issue 11 asks p95 <= 3x. Each run also reports the streams' median gap once
the arrivals are done (``steady_after_ms``: decode-only steps at the longer contexts the
streams reached) and the p95 against it, the scheduler's recent decode-step mean (what its
gap bound is reckoned in) and its measured cost by chunk size. ``--burst N`` adds N
prompts of ``--burst-tokens`` at once when the arrivals start (a pile of waiting prompt
tokens, as when a wave of sessions comes back): the step's prompt budget grows toward full
prefill speed (issue 22), the report adds the arrivals' prefill throughput
(``prefill_tok_s``), and the p95 gap must still hold at 3x.

GPU (H200):  python benchmarks/interleave.py --model random:llama-2-7b --out benchmarks/results
GPU pile-up: python benchmarks/interleave.py --model random:llama-2-7b --burst 16 --burst-tokens 1700
CPU smoke:   python benchmarks/interleave.py --model random:tiny-llama --streams 2 --arrivals 4

Prints one JSON object and writes ``interleave_<device>.json`` and ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import itertools

from _common import pick_device, random_model, replay_ms, stderr_log

from convo.fast import DecoderConfig, DecodeRequest, DecodeScheduler, StaticDecoder
from convo.models import GREEDY

#: Issue 11: the running streams' p95 inter-token gap under arrivals, in steady steps.
TARGET_RATIO = 3.0


log = stderr_log("interleave")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))] if values else 0.0


def graph_replays(dec: StaticDecoder, rows: int, chunk: int) -> dict[str, float]:
    """Median ms of one replay of the captured decode step (``rows`` rows), prefill
    (``chunk`` tokens) and mixed steps (both; and with a chunk twice as long, as a step
    grown under a pile of prompts runs), where they were captured (CUDA)."""
    b = dec.bucket(rows)
    t = min((x for x in dec.prefill_buckets if x >= chunk), default=dec.prefill_buckets[-1])
    out = {}
    for label, graphs, key in (
        (f"decode_{b}", dec._graphs, b),
        (f"prefill_{t}", dec._prefill_graphs, t),
        (f"mixed_{b}_{t}", dec._mixed_graphs, (b, t)),
        (f"mixed_{b}_{2 * t}", dec._mixed_graphs, (b, 2 * t)),
    ):
        if key in graphs:
            out[label] = round(replay_ms(graphs[key][0]), 3)  # type: ignore[index]
    return out


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="random:llama-2-7b on CUDA, random:tiny-llama on CPU")
    p.add_argument("--weights", default="int4", choices=("int4", "as-loaded"))
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--arrivals", type=int, default=24)
    p.add_argument("--arrival-ms", type=float, default=100.0)
    p.add_argument("--arrival-tokens", type=int, default=300)
    p.add_argument("--long-tokens", type=int, default=1500)
    p.add_argument("--step-tokens", default="2048", help="step budgets to compare (comma list)")
    p.add_argument(
        "--interleave-tokens", default="256,512", help="prefill chunk while replies stream (comma list)"
    )
    p.add_argument("--slot-tokens", type=int, default=2048)
    p.add_argument("--burst", type=int, default=0, help="prompts submitted at once as the arrivals start")
    p.add_argument("--burst-tokens", type=int, default=1700, help="prompt tokens of each burst prompt")
    p.add_argument(
        "--mixed",
        choices=("auto", "on", "off"),
        default="auto",
        help="decode rows and prefill chunks in one forward (auto: the decoder's choice, CPU only)",
    )
    p.add_argument(
        "--dense-copy-gib",
        type=float,
        default=0.0,
        help="keep dense copies of the int4 weights, up to this many GiB (DecoderConfig.dense_copy_bytes)",
    )
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()

    gpu, device, name = pick_device(args.model)
    model = random_model(name, device)
    slots = args.streams + max(8, args.burst)
    t = time.perf_counter()
    dec = StaticDecoder(
        model,
        slots=slots,
        slot_tokens=args.slot_tokens,
        weights=args.weights,
        config=DecoderConfig(free_dense=True, dense_copy_bytes=int(args.dense_copy_gib * 2**30)),
    )
    dec.warmup()
    if args.mixed != "auto":
        dec.mixed_steps = args.mixed == "on"
    warm = time.perf_counter() - t
    log(f"{name} {args.weights}: {slots} slots, mixed steps {dec.mixed_steps}, warm-up {warm:.1f}s")
    replay_ms = graph_replays(dec, args.streams, max(int(i) for i in args.interleave_tokens.split(",")))
    if replay_ms:
        log(f"graph replays (ms): {replay_ms}")
    vocab = dec.vocab_size
    g = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(100, vocab - 1, (n,), generator=g).tolist()

    def streams(sched: DecodeScheduler, new: int) -> tuple[list[DecodeRequest], list[list[float]]]:
        stamps: list[list[float]] = [[] for _ in range(args.streams)]
        reqs = []
        for i in range(args.streams):
            reqs.append(
                DecodeRequest(
                    ids=prompt(args.prompt_tokens),
                    max_new_tokens=new,
                    deadline=time.monotonic() + 600,
                    sampling=GREEDY,
                    on_token=lambda _t, s=stamps[i]: s.append(time.monotonic()) and False,
                )
            )
        for r in reqs:
            sched.submit(r)
        return reqs, stamps

    def gaps(stamps: list[list[float]], lo: float, hi: float) -> list[float]:
        return [b - a for s in stamps for a, b in itertools.pairwise(s) if lo <= a and b <= hi]

    # Steady state: the streams alone (after every one has its first token).
    sched = DecodeScheduler(dec)
    reqs, stamps = streams(sched, 128)
    for r in reqs:
        r.done.wait()
    lo = max(s[0] for s in stamps)
    steady = gaps(stamps, lo, max(s[-1] for s in stamps))
    steady_ms = 1000 * pct(steady, 0.5)
    sched.close()
    log(
        f"steady step at {args.streams} rows: {steady_ms:.2f} ms "
        f"({args.streams / steady_ms * 1000:.0f} tok/s)"
    )
    runs = []
    combos = [
        (int(b), int(i)) for b in args.step_tokens.split(",") for i in args.interleave_tokens.split(",")
    ]
    for budget, interleave in combos:
        sched = DecodeScheduler(dec, step_tokens=budget, interleave_tokens=interleave)
        reqs, stamps = streams(sched, args.slot_tokens - args.prompt_tokens - 1)
        while min(len(s) for s in stamps) < 8:
            time.sleep(0.01)
        start = time.monotonic()
        arrivals = [
            sched.submit(
                DecodeRequest(
                    ids=prompt(args.burst_tokens),
                    max_new_tokens=32,
                    deadline=time.monotonic() + 600,
                    sampling=GREEDY,
                )
            )
            for _ in range(args.burst)
        ]
        for i in range(args.arrivals):
            n = args.long_tokens if i % 4 == 3 else args.arrival_tokens
            arrivals.append(
                sched.submit(
                    DecodeRequest(
                        ids=prompt(n), max_new_tokens=32, deadline=time.monotonic() + 600, sampling=GREEDY
                    )
                )
            )
            time.sleep(args.arrival_ms / 1000)
        for a in arrivals:
            a.done.wait()
        end = time.monotonic()
        # The streams alone again, at the contexts they reached (is the gap's growth the
        # longer context, or the arrivals?).
        mark = [len(s) for s in stamps]
        while min(len(s) - m for s, m in zip(stamps, mark, strict=True)) < 24 and time.monotonic() - end < 5:
            time.sleep(0.01)
        after = gaps(stamps, end, time.monotonic())
        stop = threading.Event()
        for r in reqs:
            r.cancel = stop
        stop.set()
        for r in reqs:
            r.done.wait()
        sched.close()
        during = gaps(stamps, start, end)
        ttft = [a.first_token_at - a.started_at for a in arrivals if a.first_token_at is not None]
        prefilled = sum(len(a.ids) for a in arrivals)
        firsts = [a.first_token_at for a in arrivals if a.first_token_at is not None]
        prefill_window = max(firsts, default=start) - min((a.started_at for a in arrivals), default=start)
        run = {
            "step_tokens": budget,
            "interleave_tokens": interleave,
            "arrivals": len(arrivals),
            "window_s": round(end - start, 3),
            "itl_p50_ms": round(1000 * pct(during, 0.5), 3),
            "itl_p95_ms": round(1000 * pct(during, 0.95), 3),
            "itl_max_ms": round(1000 * max(during, default=0.0), 3),
            "itl_p95_vs_steady": round(1000 * pct(during, 0.95) / steady_ms, 2),
            "steady_after_ms": round(1000 * pct(after, 0.5), 3) if after else None,
            "itl_p95_vs_steady_after": round(pct(during, 0.95) / pct(after, 0.5), 2) if after else None,
            "decode_s_ema_ms": round(1000 * sched.costs.decode_s, 3) if sched.costs.decode_s else None,
            "chunk_ms_by_size": {k: round(1000 * v, 3) for k, v in sorted(sched.costs.sized_s.items())},
            "steps_by_kind": dict(sched.costs.steps),
            "arrival_ttft_p50_s": round(pct(ttft, 0.5), 4),
            "arrival_ttft_p95_s": round(pct(ttft, 0.95), 4),
            "max_prefill_tokens_between_steps": sched.max_prefill_tokens,
            "burst": args.burst,
            "prefill_tok_s": round(prefilled / prefill_window, 1) if prefill_window > 0 else None,
            "gaps_ms": [round(1000 * x, 3) for x in during[:4000]],
        }
        runs.append(run)
        log(
            f"budget {budget}, interleave {interleave}: ITL p50 {run['itl_p50_ms']} ms, "
            f"p95 {run['itl_p95_ms']} ms "
            f"({run['itl_p95_vs_steady']}x steady, {run['itl_p95_vs_steady_after']}x the streams' step "
            f"after the arrivals, {run['steady_after_ms']} ms), max {run['itl_max_ms']} ms; "
            f"chunks {run['chunk_ms_by_size']}; arrivals' TTFT p50 "
            f"{run['arrival_ttft_p50_s']} s"
        )
    report = {
        "benchmark": "interleave",
        "model": name,
        "device": device,
        "gpu": torch.cuda.get_device_name() if gpu else None,
        "torch": torch.__version__,
        "weights": args.weights,
        "dense_copy_bytes": dec.dense_copy_nbytes,
        "mixed_steps": dec.mixed_steps,
        "warmup_s": round(warm, 1),
        "replay_ms": replay_ms,
        "streams": args.streams,
        "prompt_tokens": args.prompt_tokens,
        "arrival_ms": args.arrival_ms,
        "arrival_tokens": args.arrival_tokens,
        "long_tokens": args.long_tokens,
        "burst": args.burst,
        "burst_tokens": args.burst_tokens,
        "kernel_choice": dict(dec.kernel_choice) or None,
        "steady_step_ms": round(steady_ms, 3),
        "steady_tok_s": round(args.streams / steady_ms * 1000, 1),
        "target_p95_ratio": TARGET_RATIO,
        "runs": runs,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"interleave_{'h200' if gpu and 'H200' in (report['gpu'] or '') else device}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    _plot(report, out / f"{stem}.png")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    print(json.dumps([{k: v for k, v in r.items() if k != "gaps_ms"} for r in runs], indent=2))


def _plot(report: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for run in report["runs"]:
        gaps = sorted(run["gaps_ms"])
        if gaps:
            ax.plot(
                gaps,
                [i / len(gaps) for i in range(len(gaps))],
                label=f"step {run['step_tokens']}, chunk {run['interleave_tokens']}",
            )
    ax.axvline(report["steady_step_ms"], color="k", ls=":", label="steady step")
    ax.axvline(TARGET_RATIO * report["steady_step_ms"], color="tab:red", ls="--", label="3x steady step")
    ax.set_xscale("log")
    ax.set_xlabel("inter-token gap of running replies while turns arrive (ms)")
    ax.set_ylabel("fraction of gaps")
    ax.set_title(
        f"{report['streams']} streams, {report['model']} {report['weights']} on {report['gpu'] or 'cpu'}"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
