"""The command line, as scripts use it: `convo chat --script --json` and `convo plan --json`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REQUIRED = {
    "turn": int,
    "reply": str,
    "prompt_tokens": int,
    "parts": dict,
    "budget": int,
    "max_new_tokens": int,
    "summary_tokens": int,
    "evicted_turns": int,
    "latency_s": float,
}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "convo.cli", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_chat_script_json_lines_and_resume(tmp_path: Path) -> None:
    script = tmp_path / "turns.txt"
    script.write_text("Hi, I am Priya.\n\nI like green tea.\nWhat is 2 + 2?\n", encoding="utf-8")
    db = tmp_path / "chat.db"
    common = ["chat", "--script", str(script), "--json", "--db", str(db), "--session", "s1"]
    first = run_cli(
        *common, "--budget", "512", "--max-new-tokens", "12", "--window", "1", "--summary-tokens", "32"
    )
    assert first.returncode == 0, first.stderr[-2000:]
    rows = [json.loads(line) for line in first.stdout.splitlines()]
    assert [r["turn"] for r in rows] == [1, 2, 3]  # the blank line is skipped
    for row in rows:
        for key, typ in REQUIRED.items():
            assert isinstance(row[key], typ), (key, row[key])
        assert row["prompt_tokens"] + row["max_new_tokens"] <= row["budget"] == 512
        assert row["prompt_tokens"] == sum(v for k, v in row["parts"].items() if k != "reserve")
        assert row["reply"].strip()
    assert "loading model" in first.stderr  # the progress indicator
    # Resumed in a new process: numbering and settings continue.
    second = run_cli(*common)
    assert second.returncode == 0, second.stderr[-2000:]
    rows2 = [json.loads(line) for line in second.stdout.splitlines()]
    assert [r["turn"] for r in rows2] == [4, 5, 6]
    assert all(r["budget"] == 512 and r["max_new_tokens"] == 12 for r in rows2)
    assert rows2[-1]["evicted_turns"] >= 3


def test_plan_json_contract() -> None:
    out = run_cli(
        "plan",
        "--model",
        "random:llama-2-7b",
        "--context",
        "1024,4096",
        "--concurrency",
        "1,4",
        "--gpu-memory",
        "24GiB",
        "--quant",
        "nf4",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["kv_bytes_per_token"] == 524_288
    assert abs(data["weights_bytes"] / 2**30 - 3.6) < 0.15
    assert len(data["cells"]) == 4
    for cell in data["cells"]:
        for key in (
            "context",
            "concurrency",
            "kv_bytes",
            "activation_bytes",
            "peak_allocated_bytes",
            "peak_reserved_bytes",
            "safe",
        ):
            assert key in cell
        assert cell["peak_reserved_bytes"] >= cell["peak_allocated_bytes"] > data["weights_bytes"]
    small = next(c for c in data["cells"] if c["context"] == 1024 and c["concurrency"] == 1)
    big = next(c for c in data["cells"] if c["context"] == 4096 and c["concurrency"] == 4)
    assert small["safe"] and big["kv_bytes"] == 16 * small["kv_bytes"]


def test_bad_arguments_fail_cleanly(tmp_path: Path) -> None:
    out = run_cli(
        "chat",
        "--script",
        str(tmp_path / "missing.txt"),
        "--budget",
        "100",
        "--max-new-tokens",
        "200",
        "--db",
        str(tmp_path / "x.db"),
    )
    assert out.returncode == 2
    assert "convo: error:" in out.stderr and "Traceback" not in out.stderr
    missing = run_cli("chat", "--script", str(tmp_path / "missing.txt"), "--db", str(tmp_path / "x.db"))
    assert missing.returncode == 2 and "no such file" in missing.stderr
