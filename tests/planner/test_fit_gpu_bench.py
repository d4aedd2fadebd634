"""benchmarks/fit_gpu.py without a GPU: the runs, their predictions, the chat load, the
subprocess runner's time limits, the comparison and the plot (the GPU part runs on the H200)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from convo.models import GiB
from convo.tokens import CharCounter

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fit_gpu_bench", ROOT / "benchmarks" / "fit_gpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_runs_and_what_the_sizing_predicts_for_them(bench: ModuleType) -> None:
    quick = bench.plan_runs(quick=True, kv_dtypes=["bf16", "fp8"])
    assert len(quick) == 6 and len(bench.plan_runs(quick=False, kv_dtypes=["bf16", "fp8"])) == 18
    for run in quick:
        pick = bench.predict(run)
        assert 1 <= pick["kv_slots"] <= bench.FIT_MAX_KV_SLOTS, run
        assert pick["peak_reserved_bytes"] <= run.cap_gib * GiB
        assert pick["load_peak_bytes"] <= pick["peak_reserved_bytes"]  # int4 loads inside its steady peak
    qwen = next(r for r in quick if r.model == "qwen2.5-7b" and r.kv_dtype == "bf16")
    assert (qwen.budget, qwen.cap_gib) == (8192, 16.0) and bench.predict(qwen)["kv_slots"] >= 4


def test_each_turn_fits_the_budget_with_the_newest_history(bench: ModuleType) -> None:
    counter = CharCounter()
    history: list[Any] = []
    for turn in range(12):
        msgs = bench.turn_messages(
            history, bench.user_text(3, turn, 300), count=counter.count_prompt, max_prompt_tokens=2000
        )
        assert counter.count_prompt(msgs) <= 2000 and msgs[-1].content.startswith(f"session 3 turn {turn}")
        history += [msgs[-1], bench.assistant("ok")]
    assert len(msgs) < 2 * 12  # the oldest turns went


class FakeEngine:
    counter = CharCounter()

    def __init__(self) -> None:
        self.calls: list[str] = []

    def generate(self, messages: Any, *, max_new_tokens: int, cache_key: str, timeout_s: float) -> Any:
        self.calls.append(cache_key)
        if cache_key == "s1" and self.calls.count("s1") == 2:
            raise RuntimeError("OutOfMemoryError: pretend")
        return type("G", (), {"text": "fine"})()


def test_the_chat_load_records_errors_and_goes_on(bench: ModuleType) -> None:
    engine = FakeEngine()
    out = bench.chat_load(engine, sessions=4, turns=3, user_tokens=50, new_tokens=8, budget=1024)
    assert out["replies"] == 3 * 3 + 1 and len(out["errors"]) == 1 and "OutOfMemory" in out["errors"][0]


def test_runs_are_subprocesses_under_a_time_limit(
    bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench, "RUN_TIMEOUT_S", 6)
    monkeypatch.setattr(bench, "MIN_RUN_S", 10)
    runs = bench.plan_runs(quick=True, kv_dtypes=["bf16"])
    measured = {"peak_reserved_bytes": 10 * GiB, "load_peak_reserved_bytes": 6 * GiB, "oom": None}
    ok = [
        sys.executable,
        "-c",
        f"print('noise'); print({bench.RESULT_MARK!r} + {json.dumps(json.dumps(measured))})",
    ]
    slow = [sys.executable, "-c", "import time; time.sleep(60)"]
    logs: list[str] = []
    rows = bench.run_all(
        runs,
        {},
        time_limit_s=20,
        dry_run=False,
        log=logs.append,
        cmd=lambda r: ok if r.cap_gib != 16 else slow,
    )
    assert ("measured" in rows[0], rows[0].get("skipped")) == (True, None)
    assert rows[0]["measured"] == measured
    timed_out = next(r for r in rows if r["cap_gib"] == 16)
    assert "timed out" in timed_out["measured"]["error"]
    assert "out of time" in rows[2]["skipped"]  # < MIN_RUN_S left for the third
    summary = bench.summarize(rows)
    assert summary["runs"] == 3 and summary["measured"] == 2 and summary["no_oom"] == 1
    assert bench.write_png(rows, str(tmp_path / "fit.png")) and (tmp_path / "fit.png").stat().st_size > 1000


def test_the_comparison_wants_the_plan_within_ten_percent_and_never_under(bench: ModuleType) -> None:
    pred = {"peak_reserved_bytes": 105, "load_peak_bytes": 60, "weights_bytes": 40, "kv_pool_bytes": 30}
    good = bench.compare(pred, {"peak_reserved_bytes": 100, "load_peak_reserved_bytes": 70})
    assert good == {"steady_err": 0.05, "load_err": 0.0, "within_10pct_never_under": True}
    # the load phase ends with weights + pool (70 here) taken: a measured 80 is an under-prediction
    assert bench.compare(pred, {"peak_reserved_bytes": 100, "load_peak_reserved_bytes": 80}) == {
        "steady_err": 0.05,
        "load_err": -0.125,
        "within_10pct_never_under": False,
    }
    assert bench.compare(pred, {"peak_reserved_bytes": 110, "load_peak_reserved_bytes": 58})["steady_err"] < 0


def test_reports_from_several_calls_merge_into_one(bench: ModuleType, tmp_path: Path) -> None:
    run = next(r for r in bench.plan_runs(quick=True, kv_dtypes=["fp8"]) if r.model == "qwen2.5-7b")
    pick = bench.predict(run)
    case = {"model": run.model, "spec": run.spec, "budget": run.budget, "cap_gib": run.cap_gib,
            "quant": run.quant}  # fmt: skip
    measured = {"peak_reserved_bytes": int(pick["peak_reserved_bytes"] / 1.05),
                "load_peak_reserved_bytes": pick["load_end_reserved_bytes"], "oom": None}  # fmt: skip
    killed = {**case, "kv_dtype": "fp8", "predicted": pick, "measured": {"error": "exit -9"}}
    # an older prediction with the same slots: re-judged by today's planner
    older = {**pick, "load_end_reserved_bytes": pick["load_end_reserved_bytes"] - (1 << 20)}
    good = {**case, "kv_dtype": "fp8", "predicted": older, "measured": measured,
            "compare": bench.compare(older, measured)}  # fmt: skip
    assert good["compare"]["load_err"] < 0 and not good["compare"]["within_10pct_never_under"]
    other = {**case, "kv_dtype": "bf16", "predicted": {"refused": "no"}}
    rows = bench.merge_reports([{"rows": [killed, other]}, {"rows": [good]}, {"rows": [killed]}])
    assert [r["kv_dtype"] for r in rows] == ["bf16", "fp8"]
    fp8 = rows[1]
    assert fp8["predicted"] == pick and fp8["predicted_at_run"] == older  # the measured run, re-judged
    assert fp8["compare"]["load_err"] == 0 and fp8["compare"]["within_10pct_never_under"]
    out = tmp_path / "r.json"
    out.write_text(json.dumps({"benchmark": "fit_gpu", "rows": [good]}))
    assert bench.main(["--merge", str(out), "--png", str(tmp_path / "p.png")]) == 0
