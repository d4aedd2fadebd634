"""Retrieval memory across processes: two ``convo serve`` replicas on one real Redis share
a session's memory, and a replica killed with SIGKILL while it indexes loses no
acknowledged turn's memory (the fake engine and the hashing encoder: no model)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import free_port, start_redis, stop_redis, wait_healthy

from convo.retrieval.scopes import MemoryRecord

ENV = {"CONVO_FAKE_ENGINE": "1", "CONVO_FAKE_EMBEDDER": "1", "CONVO_FAKE_DELAY_S": "0"}
FACT = "My cat is called Miso and she loves cardboard boxes."


@contextmanager
def replica(store_args: list[str], env: dict[str, str]) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    cmd = [sys.executable, "-m", "convo.cli", "serve", *store_args, "--port", str(port), "--api-key", "k"]
    cmd += ["--window-turns", "2", "--summary-tokens", "0"]
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, 60, lambda: proc.stderr.read() if proc.stderr else "")
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)
        if proc.stderr:
            proc.stderr.close()


def ask(base: str, sid: str, text: str) -> Any:
    with openai.OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0) as c:
        return c.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": text}], metadata={"session_id": sid}
        )


def cited_turns(reply: Any) -> list[int]:
    return [p["turn"] for p in (reply.model_extra or {})["convo"]["passages"]]


def test_two_replicas_on_one_redis_share_a_sessions_memory(tmp_path: Path) -> None:
    url, redis_proc = start_redis(tmp_path)
    try:
        with replica(["--redis", url], ENV) as (a, _), replica(["--redis", url], ENV) as (b, _):
            ask(a, "shared", FACT)
            for i in range(4):  # alternate: each replica indexes some of the turns
                ask((a, b)[i % 2], "shared", f"chatter {i} about trains and the weather")
            # b never saw turn 0 indexed: it rebuilds from Redis.
            assert 0 in cited_turns(ask(b, "shared", "What is my cat called?"))
            ask(b, "shared", "My dog is called Pepper.")
            for i in range(3):
                ask(b, "shared", f"more chatter {i} about buses")
            # a's cached index is behind: it catches up with what b wrote.
            assert 6 in cited_turns(ask(a, "shared", "What is my dog called?"))
    finally:
        stop_redis(redis_proc)


def test_kill_9_while_indexing_loses_no_acknowledged_turns_memory(tmp_path: Path) -> None:
    db = str(tmp_path / "sessions.db")
    acknowledged: list[str] = []
    with replica(["--db", db], ENV) as (base, proc):
        stop = threading.Event()

        def talk() -> None:
            i = 0
            while not stop.is_set():
                text = f"fact number {i}: the code word is word{i}"
                try:
                    ask(base, "victim", text)
                except (openai.APIError, httpx.HTTPError):
                    return
                acknowledged.append(text)
                i += 1

        talker = threading.Thread(target=talk)
        talker.start()
        while len(acknowledged) < 12:
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)  # mid-turn: indexing, storing or generating
        proc.wait(10)
        stop.set()
        talker.join(30)
    with replica(["--db", db], ENV) as (base, _):
        ask(base, "victim", "one more turn: every earlier turn is complete now")
        data = httpx.get(f"{base}/v1/sessions/victim/export", headers={"Authorization": "Bearer k"}).json()
    records = [MemoryRecord.from_dict(r) for r in data["memory"]]  # every row whole
    indexed = {c for r in records for _, _, c in r.messages}
    missing = [t for t in acknowledged if t not in indexed]
    assert not missing, missing


@pytest.fixture(autouse=True)
def _no_real_model() -> None:
    """These tests must never load a model."""
    assert ENV["CONVO_FAKE_ENGINE"] == "1"
