"""Shared fixtures: small real components, and the real default model loaded once."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from convo.errors import DeviceOutOfMemory
from convo.retrieval.indexes.bm25 import terms
from convo.testing import ScriptedEngine
from convo.tokens import CharCounter, TokenCounter

FakeEngine = ScriptedEngine


#: What every cell of ``convo plan --json`` has.
PLAN_CELL_KEYS = frozenset(
    (
        "context",
        "concurrency",
        "kv_bytes",
        "activation_bytes",
        "peak_allocated_bytes",
        "peak_reserved_bytes",
        "safe",
    )
)


def check_plan_json(data: dict[str, Any], *, cells: int, gpu_memory_bytes: int) -> None:
    """The ``convo plan --json`` contract, for llama-2-7b in nf4 (the console command and
    the in-process CLI answer alike): its geometry, and every cell's keys and peaks."""
    assert data["kv_bytes_per_token"] == 524_288
    assert data["weights_bytes"] / 2**30 == pytest.approx(3.6, rel=0.02)
    assert len(data["cells"]) == cells
    for cell in data["cells"]:
        assert PLAN_CELL_KEYS <= set(cell)
        assert cell["peak_reserved_bytes"] >= cell["peak_allocated_bytes"] > data["weights_bytes"]
        assert cell["safe"] == (cell["peak_reserved_bytes"] <= gpu_memory_bytes)


@pytest.fixture
def counter() -> CharCounter:
    return CharCounter()


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def oom() -> DeviceOutOfMemory:
    return DeviceOutOfMemory("injected")


@pytest.fixture(scope="session")
def real_engine() -> Any:
    """The embedded default model (SmolLM2-135M-Instruct), greedy, loaded once."""
    from convo.engines.local.engine import TransformersEngine

    return TransformersEngine()


@pytest.fixture(scope="session")
def smol_counter() -> TokenCounter:
    """The exact counter of the default model's tokenizer and chat template (no weights)."""
    from transformers import AutoTokenizer

    from convo.engines.local.loading import default_model_path
    from convo.tokens import HFTokenCounter

    return HFTokenCounter(AutoTokenizer.from_pretrained(str(default_model_path()), local_files_only=True))


def start_redis(folder: Path, *extra: str) -> tuple[str, subprocess.Popen[bytes]]:
    """A redis-server of the test's own on a free loopback port (so it can be SIGSTOPped
    or killed); returns its URL (without a password) and the process. Skips without
    redis-server, except with CONVO_REQUIRE_REDIS=1 (CI)."""
    pytest.importorskip("redis")
    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("CONVO_REQUIRE_REDIS") == "1":
            pytest.fail("CONVO_REQUIRE_REDIS=1 but redis-server is not installed")
        pytest.skip("redis-server is not installed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(
        [*cmd, "--dir", str(folder), *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"redis://127.0.0.1:{port}/0"
    password = extra[extra.index("--requirepass") + 1] if "--requirepass" in extra else None
    for _ in range(200):
        try:
            redis.Redis.from_url(url, password=password).ping()
            break
        except redis.RedisError:
            time.sleep(0.05)
    return url, proc


def stop_redis(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGCONT)
    proc.kill()
    proc.wait()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A redis-server of the test's own (see :func:`start_redis`)."""
    url, proc = start_redis(tmp_path)
    try:
        yield url, proc
    finally:
        stop_redis(proc)


# -- a live server on loopback (the server tests and the async tests share it) -------------

REDIS_URL = os.environ.get("CONVO_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def redis_or_skip() -> str:
    """The test Redis URL; skip when unreachable, unless CONVO_REQUIRE_REDIS=1 (CI)."""
    try:
        import redis

        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=0.5).ping()
    except Exception as exc:
        if os.environ.get("CONVO_REQUIRE_REDIS") == "1":
            pytest.fail(f"CONVO_REQUIRE_REDIS=1 but Redis at {REDIS_URL} is unreachable: {exc}")
        pytest.skip(f"no Redis at {REDIS_URL}")
    return REDIS_URL


def drain(sched: Any, limit: int = 1000) -> None:
    """Step a :class:`~convo.fast.scheduler.DecodeScheduler` made with ``background=False``
    until it is idle; fail after ``limit`` steps."""
    for _ in range(limit):
        if sched.idle:
            return
        sched.run_step()
    raise AssertionError("the scheduler did not finish")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(base: str, proc: subprocess.Popen[Any], timeout_s: float, output: Any) -> None:
    """Poll ``base``'s ``/health`` until it answers 200; fail with ``output()`` (what the
    process printed) when ``proc`` exits first or ``timeout_s`` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the server at {base} did not start: {output()!r}")
        time.sleep(0.1)


@contextmanager
def serve(app: Any) -> Iterator[str]:
    """Run ``app`` on a free loopback port in a thread; yields the base URL."""
    port = free_port()
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


class HashEncoder:
    """Bag-of-words hashed into ``dim`` buckets, L2-normalized: deterministic and fast."""

    def __init__(self, dim: int = 256) -> None:
        self.dim = dim
        self.calls = 0

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        self.calls += 1
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            for w in terms(text):
                h = int(hashlib.md5(w.encode()).hexdigest(), 16)
                out[i, h % self.dim] += 1.0
            norm = np.linalg.norm(out[i])
            if norm:
                out[i] /= norm
        return out


class RecordingEncoder(HashEncoder):
    """A HashEncoder that keeps every text it was asked to embed."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        self.seen += list(texts)
        return super().encode(texts)
