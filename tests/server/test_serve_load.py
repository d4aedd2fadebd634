"""``benchmarks/serve_load.py`` runs with ``--fake`` on CPU in seconds and reports the
issue-22 figures (KV reuse, background work, waves) beside its old keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Keys the load reported before issue 22 (kept).
OLD_KEYS = {
    "requests", "completed_200", "refused_429", "wall_s", "latency_s", "ttft_stream_s", "lost_messages",
    "admission_ledger", "server_rss_bytes", "reply_tokens_per_s", "ttft_p50_s", "ttft_p95_s",
    "turn_latency_p50_s", "turn_latency_p95_s", "turn_latency_p50_s_by_turn", "window_slide_vs_ordinary",
    "engine",
}  # fmt: skip
#: What issue 22 adds.
NEW_KEYS = {
    "prefilled_prompt_tokens", "requested_prompt_tokens", "reprefill", "preemptions", "swaps_in",
    "swaps_out", "host_kv_bytes_peak", "summary_lag_p50_s", "summary_lag_p95_s", "summary_backlog_peak",
    "ttft_p50_s_by_turn",
}  # fmt: skip
#: The re-prefill floor (``convo_engine_novel_prompt_tokens_total``), beside ``reprefill``.
FLOOR_KEYS = {"novel_prompt_tokens", "reprefill_floor"}


@pytest.mark.timeout(300)
def test_chat_users_preset_with_two_waves_on_the_fake_engine(tmp_path: Path) -> None:
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), "--fake", "--preset", "chat-users",
        "--sessions", "3", "--turns", "6", "--message-words", "300", "--think-min-s", "0.05",
        "--think-max-s", "0.1", "--start-spread-s", "0.2", "--waves", "2", "--delay-s", "0.001",
        "--out", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "serve_load_fake_chat-users_waves2.json").read_text())
    config, results = report["config"], report["results"]
    assert (config["think_min_s"], config["think_max_s"], config["waves"]) == (0.05, 0.1, 2)
    assert config["max_tokens"] == 32 and config["max_new_tokens"] == 64  # the preset's
    assert OLD_KEYS | NEW_KEYS | FLOOR_KEYS <= set(results)
    assert results["completed_200"] == 2 * 3 * 6 and results["lost_messages"] == 0
    assert results["requested_prompt_tokens"] > 0
    assert results["swaps_in"] == results["swaps_out"] == results["host_kv_bytes_peak"] == 0  # absent: 0
    assert results["reprefill"] is None  # the echo engine has no prompt counter
    assert results["reprefill_floor"] is None and results["novel_prompt_tokens"] == 0
    assert set(results["ttft_p50_s_by_turn"]) == {str(t) for t in range(6)}
    # The windows slid: summaries were written, and their lag measured.
    assert results["summary_lag_p50_s"] is not None and results["summary_lag_p50_s"] >= 0
    assert [w["wave"] for w in results["waves"]] == [1, 2]
    assert all(NEW_KEYS | FLOOR_KEYS <= set(w) and w["completed_200"] == 18 for w in results["waves"])
    ratio = results["wave2_over_wave1"]
    assert set(ratio) == {"wall_s", "ttft_p50_s"} and ratio["wall_s"] > 0


def test_the_reprefill_floor_is_the_novel_prompt_tokens_over_the_requested() -> None:
    from benchmarks import serve_load

    def outcome(prompt: int) -> serve_load.Outcome:
        return serve_load.Outcome(
            session="s", turn=0, kind="short", stream=True, status=200, start_s=0.0, latency_s=0.1,
            ttft_s=0.05, user="", reply="", prompt_tokens=prompt,
        )  # fmt: skip

    outs = [outcome(600), outcome(400)]
    outs[0].cached_tokens = 450
    before = {"convo_engine_prompt_tokens_total": 100.0, "convo_engine_novel_prompt_tokens_total": 50.0}
    after = {
        "convo_engine_prompt_tokens_total": 900.0, "convo_engine_novel_prompt_tokens_total": 650.0,
        'convo_engine_work_prompt_tokens_total{work="prefill"}': 300.0,
        "convo_engine_recomputed_prompt_tokens_total": 25.0,
    }  # fmt: skip
    figures = serve_load.background_figures(outs, before, after, host_peak=0.0, backlog_peak=0.0)
    assert figures["prefilled_prompt_tokens_by_work"] == {"reply": 0, "background": 0, "prefill": 300}
    assert figures["recomputed_prompt_tokens"] == 25
    assert figures["prefilled_p50_by_turn"] == {"0": 150}  # the one turn that reported its cache
    assert (figures["prefilled_prompt_tokens"], figures["requested_prompt_tokens"]) == (800, 1000)
    assert figures["novel_prompt_tokens"] == 600
    assert (figures["reprefill"], figures["reprefill_floor"]) == (0.8, 0.6)
    older = {"convo_engine_prompt_tokens_total": 900.0}  # a server without the counter
    figures = serve_load.background_figures(outs, {}, older, host_peak=0.0, backlog_peak=0.0)
    assert figures["reprefill"] == 0.9 and figures["reprefill_floor"] is None


@pytest.mark.timeout(300)
def test_compare_memory_runs_the_load_without_then_with_the_servers_memory(tmp_path: Path) -> None:
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), "--fake", "--sessions", "2",
        "--turns", "8", "--delay-s", "0.001", "--compare-memory", "--out", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "CONVO_FAKE_EMBEDDER": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "serve_load_fake_memory.json").read_text())
    assert report["results"]["memory"] is True and report["memory_off"]["results"]["memory"] is False
    assert report["results"]["memory_indexes_cached"] >= 1  # each session's turns were indexed
    assert report["results"]["memory_cache_bytes"] > 0
    wall = report["side_by_side"]["wall_s"]
    assert wall["on_over_off"] == pytest.approx(wall["memory_on"] / wall["memory_off"], abs=1e-3)
