"""A server sized to a memory limit, on a capped GPU: predicted vs measured peak reserved.

For Llama-2-7B and Qwen2.5-7B (``random:`` of ``benchmarks/configs/``: the real
architectures, random weights, no download), each budget and each cap, one run:

1. the cap: ``torch.cuda.set_per_process_memory_fraction(cap / total)``, so the caching
   allocator fails past ``cap`` as a card of that size would (the CUDA context is not
   counted: the sizing's headroom is for it on a real card);
2. ``TransformersEngine(kv=KVConfig(gpu_memory=cap, slot_tokens=budget))``: the planner
   picks the slots and the int4 layouts (:func:`convo.planner.fit.fit_serve`), the engine
   loads int4 a layer at a time from host memory and warms up;
3. a chat load through the engine: ``--sessions`` sessions at once, ``--turns`` turns each,
   a ~``--user-tokens``-token user message per turn, the history trimmed to the budget,
   ``--new-tokens``-token replies, each session's KV kept between turns (``cache_key``).

Recorded per run: the slots and layouts picked, the predicted peak reserved and load peak,
the measured ``max_memory_reserved`` after the layers were quantized and the pool taken
(the load peak), after warm-up, and over the chat load, OOMs, the error of the prediction
(the target: within +-10 %, never under). KV dtypes: ``bf16`` and ``fp8`` (fp8 is skipped,
with a note, where the engine has no ``KVConfig.kv_dtype``).

Each run is a subprocess (a crash or OOM ends that run only, and each starts with an empty
allocator) with a time limit; the whole benchmark stops starting runs past ``--time-limit``
and still writes what it has. JSON on stdout, ``--png`` a plot.

The command (H200, ~8 min):

    python benchmarks/fit_gpu.py --quick --time-limit 480 --png benchmarks/results/fit_gpu.png \
        > benchmarks/results/fit_gpu.json

``--dry-run`` prints the runs and their predictions with no GPU (CPU: what the sizing
picks). ``--quick``: Llama-2-7B 2,048 at 12 and 24 GiB, Qwen2.5-7B 8,192 at 16 GiB (the
issue's 4 x 8,192 case), 16 sessions x 2 turns of 16-token replies; the full matrix is
2 models x budgets x 3 caps x 2 KV dtypes, 16 sessions x 4 turns.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from convo.engines.local.config import KVConfig  # noqa: E402
from convo.messages import Message, assistant, system, user  # noqa: E402
from convo.models import GiB, load_config  # noqa: E402
from convo.planner.fit import FIT_MAX_KV_SLOTS, fit_serve  # noqa: E402

CONFIGS = ROOT / "benchmarks" / "configs"
#: label -> (model spec, budgets)
MODELS = {
    "llama-2-7b": (f"random:{CONFIGS / 'llama-2-7b'}", (2048,)),
    "qwen2.5-7b": (f"random:{CONFIGS / 'qwen2.5-7b'}", (2048, 8192)),
}
CAPS_GIB = (12, 16, 24)
KV_DTYPES = ("bf16", "fp8")
#: (model label, budget, cap GiB) of ``--quick``.
QUICK = (("llama-2-7b", 2048, 12), ("qwen2.5-7b", 8192, 16), ("llama-2-7b", 2048, 24))
#: Seconds a run may take at most (a 7B build, warm-up and the chat load take ~40-90 s; more
#: with hundreds of slots: a capture per batch bucket and per mixed pair).
RUN_TIMEOUT_S = 420
#: Seconds kept back at the end of ``--time-limit`` for writing the results.
RESERVE_S = 5
#: A run is not started with fewer seconds than this left.
MIN_RUN_S = 30
#: What the child prints before its JSON line on stdout.
RESULT_MARK = "FIT_GPU_RESULT "

WORDS = (
    "the train to porto leaves at seven and the museum near the river opens at ten please "
    "remind me to buy tickets and to call my sister about the dinner on friday evening"
).split()


@dataclasses.dataclass(frozen=True)
class Run:
    """One capped run."""

    model: str  # label (MODELS)
    spec: str  # the --model value
    budget: int
    cap_gib: float
    kv_dtype: str
    quant: str = "int4"

    @property
    def name(self) -> str:
        return f"{self.model} {self.budget} @ {self.cap_gib:g} GiB, {self.quant}, KV {self.kv_dtype}"


def fp8_supported() -> bool:
    """Whether this build's engine stores KV in fp8 (``KVConfig.kv_dtype``)."""
    return "kv_dtype" in {f.name for f in dataclasses.fields(KVConfig)}


def plan_runs(*, quick: bool, kv_dtypes: Sequence[str], quant: str = "int4") -> list[Run]:
    """The runs of the benchmark (``--quick``: :data:`QUICK`), bf16 before fp8 per case."""
    cases = (
        list(QUICK)
        if quick
        else [(m, b, c) for m, (_, budgets) in MODELS.items() for b in budgets for c in CAPS_GIB]
    )
    return [Run(m, MODELS[m][0], b, float(c), kv, quant) for m, b, c in cases for kv in kv_dtypes]


def predict(run: Run) -> dict[str, Any]:
    """What the sizing picks for ``run`` and what the planner predicts it takes (no GPU)."""
    try:
        fit = fit_serve(
            load_config(run.spec),
            memory_bytes=int(run.cap_gib * GiB),
            slot_tokens=run.budget,
            quant=run.quant,
            kv_dtype=run.kv_dtype,
        )
    except Exception as exc:  # a refusal is a result too
        return {"refused": str(exc)}
    return fit.to_json()


def user_text(session: int, turn: int, tokens: int) -> str:
    """A user message of about ``tokens`` tokens (one word ~ 1.3 tokens), distinct per turn."""
    n = max(1, int(tokens / 1.3))
    start = (session * 7 + turn * 13) % len(WORDS)
    words = [WORDS[(start + i) % len(WORDS)] for i in range(n)]
    return f"session {session} turn {turn}: " + " ".join(words)


def turn_messages(
    history: Sequence[Message], new: str, *, count: Callable[[Sequence[Message]], int], max_prompt_tokens: int
) -> list[Message]:
    """The prompt of one turn: a system line, as much recent history as fits, the new user
    message; the oldest turns (user + reply pairs) go first. ``count`` is the engine's
    ``counter.count_prompt``."""
    head = [system("You are a helpful assistant.")]
    kept = list(history)
    while True:
        messages = [*head, *kept, user(new)]
        if count(messages) <= max_prompt_tokens or not kept:
            return messages
        kept = kept[2:]


def chat_load(
    engine: Any, *, sessions: int, turns: int, user_tokens: int, new_tokens: int, budget: int
) -> dict[str, Any]:
    """``sessions`` conversations at once through ``engine.generate``; per turn the history
    is trimmed to the budget. Returns counts, errors and seconds."""
    count = engine.counter.count_prompt
    max_prompt = budget - new_tokens - 16  # the chat template's own tokens
    errors: list[str] = []
    replies = [0]
    lock = threading.Lock()

    def one(session: int) -> None:
        history: list[Message] = []
        for turn in range(turns):
            msgs = turn_messages(
                history, user_text(session, turn, user_tokens), count=count, max_prompt_tokens=max_prompt
            )
            try:
                out = engine.generate(msgs, max_new_tokens=new_tokens, cache_key=f"s{session}", timeout_s=300)
            except Exception as exc:  # an OOM among them: recorded, the others go on
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}"[:300])
                return
            history += [msgs[-1], assistant(out.text or ".")]
            with lock:
                replies[0] += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(s,)) for s in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"replies": replies[0], "errors": errors, "seconds": round(time.perf_counter() - t0, 2)}


def child(run: Run, load: dict[str, Any]) -> dict[str, Any]:
    """One run on the GPU (in its own process): cap, size, load, serve, measure."""
    import torch

    from convo.engines.local.engine import TransformersEngine

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, run.cap_gib * GiB / total))
    marks: dict[str, int] = {}

    def progress(text: str) -> None:  # the engine's loading steps: read the allocator at each
        torch.cuda.synchronize()
        if text.startswith("static decode: compiling"):
            marks["load_peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
            marks["weights_and_pool_allocated_bytes"] = int(torch.cuda.memory_allocated())
            marks["weights_and_pool_reserved_bytes"] = int(torch.cuda.memory_reserved())

    kv: dict[str, Any] = {"gpu_memory": int(run.cap_gib * GiB), "slot_tokens": run.budget}
    if run.kv_dtype != "bf16":
        kv["kv_dtype"] = run.kv_dtype
    out: dict[str, Any] = {"oom": None}
    t0 = time.perf_counter()
    try:
        engine = TransformersEngine(run.spec, quant=run.quant, kv=KVConfig(**kv), progress=progress)
    except torch.OutOfMemoryError as exc:
        return {**marks, "oom": "load", "error": str(exc)[:300]}
    torch.cuda.synchronize()
    out.update(marks)
    out["load_s"] = round(time.perf_counter() - t0, 1)
    out["warm_peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
    fit = engine.memory_fit
    out["engine_slots"] = engine.decoder.pool.slots if engine.decoder is not None else 0
    out["engine_int4_layout"] = engine.decoder.int4_layout if engine.decoder is not None else None
    out["engine_fit"] = fit.to_json() if fit is not None else None
    out["pool_bytes"] = engine.decoder.pool_measured_bytes if engine.decoder is not None else 0
    if engine.decoder is not None:  # the weights alone: reserved peak and allocated, before the pool
        out["weights_load_peak_reserved_bytes"] = engine.decoder.load_peak_reserved_bytes
        out["weights_allocated_bytes"] = engine.decoder.weights_allocated_bytes
        out["weights_reserved_bytes"] = engine.decoder.weights_reserved_bytes
    out["chat"] = chat_load(engine, budget=run.budget, **load)
    torch.cuda.synchronize()
    out["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
    out["peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    if any("OutOfMemory" in e for e in out["chat"]["errors"]):
        out["oom"] = "serve"
    engine.close()
    return out


def run_child(
    run: Run, load: dict[str, Any], timeout_s: float, cmd: Sequence[str] | None = None
) -> dict[str, Any]:
    """``run`` in a subprocess (``cmd``: the command, default this script's ``--child``),
    killed after ``timeout_s``; its result, or why there is none."""
    payload = json.dumps({"run": dataclasses.asdict(run), "load": load})
    argv = list(cmd) if cmd is not None else [sys.executable, __file__, "--child", payload]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK) :])  # type: ignore[no-any-return]
    tail = (proc.stderr or "")[-600:]
    return {
        "error": f"exit {proc.returncode}",
        "stderr_tail": tail,
        "oom": "load" if "OutOfMemory" in tail else None,
    }


def compare(predicted: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """Predicted vs measured peaks: ``err`` = predicted / measured - 1 (the target: 0 to +10 %,
    a negative error is an under-prediction)."""
    out: dict[str, Any] = {}
    if "peak_reserved_bytes" in predicted and measured.get("peak_reserved_bytes"):
        peak = max(measured["peak_reserved_bytes"], measured.get("load_peak_reserved_bytes", 0))
        out["steady_err"] = round(predicted["peak_reserved_bytes"] / peak - 1, 4)
    if "load_peak_bytes" in predicted and measured.get("load_peak_reserved_bytes"):
        # the load phase ends with the pool taken: the quantization peak, or the weights'
        # reserved bytes + the pool (weights + pool where the plan has no reserved figure)
        end = (
            predicted.get("load_end_reserved_bytes")
            or predicted["weights_bytes"] + predicted["kv_pool_bytes"]
        )
        pred = max(predicted["load_peak_bytes"], end)
        out["load_err"] = round(pred / measured["load_peak_reserved_bytes"] - 1, 4)
    out["within_10pct_never_under"] = all(0 <= v <= 0.10 for v in out.values()) if out else None
    # Informative, not targets: what `convo plan` says the weights take while loading (an
    # upper bound) and once loaded, against the weights' own figures before the pool.
    for key, pred_key, meas_key in (
        ("weights_load_err", "load_peak_bytes", "weights_load_peak_reserved_bytes"),
        ("weights_err", "weights_bytes", "weights_allocated_bytes"),
        ("weights_reserved_err", "weights_reserved_bytes", "weights_reserved_bytes"),
    ):
        if pred_key in predicted and measured.get(meas_key):
            out[key] = round(predicted[pred_key] / measured[meas_key] - 1, 4)
    return out


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """fp8 slots over bf16 slots per case (marked ``capped`` where either has the most
    slots sizing picks, :data:`~convo.planner.fit.FIT_MAX_KV_SLOTS`), and how many runs
    held the targets."""
    slots: dict[tuple[str, int, float], dict[str, int]] = {}
    for r in rows:
        pick = r.get("predicted", {})
        if "kv_slots" in pick:
            slots.setdefault((r["model"], r["budget"], r["cap_gib"]), {})[r["kv_dtype"]] = pick["kv_slots"]
    ratios: dict[str, Any] = {}
    for (m, b, c), v in slots.items():
        if {"fp8", "bf16"} <= set(v):
            capped = max(v["bf16"], v["fp8"]) >= FIT_MAX_KV_SLOTS  # the ceiling, not memory, decides
            ratios[f"{m} {b} @ {c:g} GiB"] = "capped" if capped else round(v["fp8"] / v["bf16"], 2)
    measured = [r for r in rows if "measured" in r]
    return {
        "runs": len(rows),
        "measured": len(measured),
        "no_oom": sum(1 for r in measured if not r["measured"].get("oom") and "error" not in r["measured"]),
        "within_10pct_never_under": sum(
            1 for r in measured if r.get("compare", {}).get("within_10pct_never_under")
        ),
        "fp8_over_bf16_slots": ratios,
    }


def merge_reports(reports: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of several reports (runs split over calls or processes), one per case and
    KV dtype: the last measured one without an error, else the last one."""
    best: dict[tuple[Any, ...], dict[str, Any]] = {}
    for report in reports:
        for r in report["rows"]:
            key = (r["model"], r["budget"], r["cap_gib"], r["kv_dtype"])
            ok = "compare" in r and "error" not in r.get("measured", {})
            if ok or key not in best or "compare" not in best[key]:
                best[key] = r
    rows = sorted(best.values(), key=lambda r: (r["model"], r["budget"], r["cap_gib"], r["kv_dtype"]))
    return [_repredicted(r) for r in rows]


def _repredicted(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` judged by today's planner where it picks the same slots the run took (a fix
    to a figure the pick does not depend on then applies to runs made before it)."""
    if "measured" not in row:
        return row
    fields = {f.name for f in dataclasses.fields(Run)}
    pick = predict(Run(**{k: v for k, v in row.items() if k in fields}))
    if pick.get("kv_slots") != row["predicted"].get("kv_slots") or pick == row["predicted"]:
        return row
    return {**row, "predicted_at_run": row["predicted"], "predicted": pick,
            "compare": compare(pick, row["measured"])}  # fmt: skip


#: Where the plot goes by default (only when a run was measured).
DEFAULT_PNG = "benchmarks/results/fit_gpu.png"


def write_png(rows: Sequence[dict[str, Any]], path: str) -> bool:
    """Predicted vs measured peak reserved (and the cap) per run; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shown = [r for r in rows if "kv_slots" in r.get("predicted", {})]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(shown) + 2), 4.5))
    xs = range(len(shown))
    pred = [r["predicted"]["peak_reserved_bytes"] / GiB for r in shown]
    meas = [
        max(
            r.get("measured", {}).get("peak_reserved_bytes") or 0,
            r.get("measured", {}).get("load_peak_reserved_bytes") or 0,
        )
        / GiB
        for r in shown
    ]
    ax.bar([x - 0.2 for x in xs], pred, 0.4, label="predicted peak reserved")
    ax.bar([x + 0.2 for x in xs], meas, 0.4, label="measured (load and serve)")
    ax.scatter(list(xs), [r["cap_gib"] for r in shown], marker="_", s=600, color="k", label="cap", zorder=3)
    labels = [
        f"{r['model']}\n{r['budget']} @ {r['cap_gib']:g}G\n{r['kv_dtype']}: "
        f"{r['predicted']['kv_slots']} slots"
        for r in shown
    ]
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("GiB")
    ax.set_title("convo serve --gpu-memory CAP on a capped H200: predicted vs measured")
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run_all(
    runs: Sequence[Run],
    load: dict[str, Any],
    *,
    time_limit_s: float,
    dry_run: bool,
    log: Callable[[str], None],
    cmd: Callable[[Run], Sequence[str]] | None = None,
    on_row: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """Predict every run; unless ``dry_run``, run each in a subprocess while time is left."""
    start = time.monotonic()
    rows: list[dict[str, Any]] = []
    fp8 = fp8_supported()
    for run in runs:
        row: dict[str, Any] = {**dataclasses.asdict(run), "predicted": predict(run)}
        left = time_limit_s - (time.monotonic() - start) - RESERVE_S
        if run.kv_dtype == "fp8" and not fp8:
            row["skipped"] = "fp8 KV is not in this build (KVConfig has no kv_dtype)"
        elif "refused" in row["predicted"]:
            row["skipped"] = "the sizing refuses it"
        elif dry_run:
            row["skipped"] = "dry run"
        elif left < MIN_RUN_S:
            row["skipped"] = f"out of time ({time_limit_s:.0f} s limit)"
        else:
            limit = min(left, RUN_TIMEOUT_S)
            log(f"{run.name}: {row['predicted'].get('kv_slots')} slots predicted; running (<= {limit:.0f} s)")
            measured = run_child(run, load, limit, cmd(run) if cmd else None)
            row["measured"] = measured
            row["compare"] = compare(row["predicted"], measured)
            oom, error = measured.get("oom"), measured.get("error", "")
            log(f"{run.name}: {json.dumps(row['compare'])} oom={oom} {error}")
        rows.append(row)
        if on_row is not None:
            on_row(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="3 cases x 2 KV dtypes, 2 turns (~75 s a run on an H200: --time-limit 480)",
    )
    parser.add_argument(
        "--case",
        action="append",
        default=[],
        help="only this case, MODEL:BUDGET:CAP_GIB (e.g. llama-2-7b:2048:24; repeatable)",
    )
    parser.add_argument("--dry-run", action="store_true", help="predictions only, no GPU")
    parser.add_argument("--kv-dtypes", default=",".join(KV_DTYPES), help="comma-separated: bf16,fp8")
    parser.add_argument("--quant", default="int4", help="weight format sized (default int4)")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=None, help="turns per session (default 4; --quick 2)")
    parser.add_argument("--user-tokens", type=int, default=300)
    parser.add_argument("--new-tokens", type=int, default=None, help="reply tokens (default 32; --quick 16)")
    parser.add_argument("--time-limit", type=float, default=330.0, help="seconds for the whole benchmark")
    parser.add_argument(
        "--png",
        default=None,
        help=f"the plot (default {DEFAULT_PNG}, written only when a run was measured: a dry run "
        "does not replace the measured plot; name a file to plot predictions alone)",
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="REPORT",
        help="merge these reports (runs made in several calls) into one report and plot, no runs",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.merge:
        reports = [json.loads(Path(f).read_text()) for f in args.merge]
        rows = merge_reports(reports)
        merged = {**reports[0], "summary": summarize(rows), "rows": rows, "merged_from": len(reports)}
        print(json.dumps(merged, indent=2))
        if write_png(rows, args.png or DEFAULT_PNG):
            print(f"[fit_gpu] wrote {args.png or DEFAULT_PNG}", file=sys.stderr)
        return 0
    if args.child is not None:
        payload = json.loads(args.child)
        try:
            result = child(Run(**payload["run"]), payload["load"])
        except Exception as exc:  # any failure is a result: the parent records it and goes on
            oom = "OutOfMemory" in type(exc).__name__ or "out of memory" in str(exc)
            result = {"error": f"{type(exc).__name__}: {exc}"[:600], "oom": "load" if oom else None}
        print(RESULT_MARK + json.dumps(result), flush=True)
        return 0

    def log(msg: str) -> None:
        print(f"[fit_gpu] {msg}", file=sys.stderr, flush=True)

    load = {
        "sessions": args.sessions,
        "turns": args.turns or (2 if args.quick else 4),
        "user_tokens": args.user_tokens,
        "new_tokens": args.new_tokens or (16 if args.quick else 32),
    }
    runs = plan_runs(
        quick=args.quick and not args.case,  # --case picks from every case
        kv_dtypes=[k for k in args.kv_dtypes.split(",") if k],
        quant=args.quant,
    )
    if args.case:
        wanted = {tuple(c.split(":")) for c in args.case}
        runs = [r for r in runs if (r.model, str(r.budget), f"{r.cap_gib:g}") in wanted]
        if not runs:
            parser.error(f"--case: none of {sorted(args.case)} is a case (MODEL:BUDGET:CAP_GIB)")
    gpu = False
    if not args.dry_run:
        try:
            import torch

            gpu = torch.cuda.is_available()
        except ImportError:
            pass
        if not gpu:
            log("no CUDA GPU: predictions only (--dry-run)")
    rows = run_all(runs, load, time_limit_s=args.time_limit, dry_run=args.dry_run or not gpu, log=log)
    report = {
        "benchmark": "fit_gpu",
        "load": load,
        "fp8_kv_supported": fp8_supported(),
        "env": _env(gpu),
        "summary": summarize(rows),
        "rows": rows,
    }
    print(json.dumps(report, indent=2))
    measured = any("measured" in r for r in rows)
    png = args.png if args.png is not None else (DEFAULT_PNG if measured else "")
    if png and write_png(rows, png):
        log(f"wrote {png}")
    return 0


def _env(gpu: bool) -> dict[str, Any]:
    info: dict[str, Any] = {"python": sys.version.split()[0], "pid": os.getpid()}
    try:
        import torch

        info["torch"] = torch.__version__
        if gpu:
            info["device"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


if __name__ == "__main__":
    raise SystemExit(main())
