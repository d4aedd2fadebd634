"""`convo serve --kv-dtype fp8` end to end on the CPU default model: more sessions than KV
slots, through the official `openai` client, streamed and not, and a session that comes
back after the others took its slot."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from conftest import free_port, wait_healthy

pytestmark = pytest.mark.slow

BUDGET, REPLY = 512, 12


@contextmanager
def fp8_server(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, "-m", "convo.cli", "serve", "--kv-slots", "2", "--kv-dtype", "fp8"]
    cmd += ["--budget", str(BUDGET), "--max-new-tokens", "16", "--db", str(tmp_path / "s.db")]
    cmd += ["--port", str(port)]
    log = open(tmp_path / "serve.log", "w+b")
    proc = subprocess.Popen(cmd, env=dict(os.environ), stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:

        def printed() -> bytes:
            log.seek(0)
            return log.read()[-3000:]

        wait_healthy(base, proc, 240, printed)
        yield base
    finally:
        proc.terminate()
        proc.wait(30)
        log.seek(0)
        out = log.read().decode(errors="replace")
        log.close()
        assert "fp8 K/V" in out, out[-3000:]  # the slots really were fp8


def test_fp8_kv_slots_serve_more_sessions_than_slots(tmp_path: Path) -> None:
    with fp8_server(tmp_path) as base, openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as c:
        for sid in ("a", "b", "c"):  # three sessions on two slots
            out = c.chat.completions.create(
                model="x",
                messages=[{"role": "user", "content": f"My name is {sid.upper()}lex. Say hello."}],
                extra_headers={"X-Session-Id": sid},
                max_tokens=REPLY,
            )
            assert out.choices[0].message.content and out.usage is not None
            assert 0 < out.usage.completion_tokens <= REPLY and out.usage.prompt_tokens + REPLY <= BUDGET
        stream = c.chat.completions.create(  # "a" comes back: its slot went to "c"
            model="x",
            messages=[{"role": "user", "content": "What is my name?"}],
            extra_headers={"X-Session-Id": "a"},
            max_tokens=REPLY,
            stream=True,
        )
        text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        assert text.strip()
        messages = httpx.get(f"{base}/v1/sessions/a").json()["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant"] * 2
        assert messages[-1]["content"] == text
        assert "convo_engine_prompt_tokens_total" in httpx.get(f"{base}/metrics").text
