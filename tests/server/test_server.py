"""The HTTP server: a real uvicorn on loopback, driven by the official openai client."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import REDIS_URL, free_port, redis_or_skip, serve, wait_healthy  # noqa: F401  (also imported from here)

from convo import AdmissionController, Budget, InMemoryStore, SQLiteStore
from convo.admission import AdmissionLimits
from convo.errors import ConfigError
from convo.server.app import create_app
from convo.server.auth import key_owner
from convo.server.limits import ServerLimits
from convo.stores import Store
from convo.testing import EchoEngine

BUDGET = Budget(context_tokens=4000, max_new_tokens=200, window_turns=4, summary_tokens=0)


@pytest.fixture
def echo() -> EchoEngine:
    return EchoEngine()


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return SQLiteStore(tmp_path / "server.db")


@pytest.fixture
def url(echo: EchoEngine, store: Store) -> Iterator[str]:
    app = create_app(echo, store=store, api_key=["k1", "k2"], budget=BUDGET, model_name="echo")
    with serve(app) as base:
        yield base


def client(url: str, key: str = "k1") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def history(url: str, sid: str, key: str = "k1") -> list[dict[str, str]]:
    r = httpx.get(f"{url}/v1/sessions/{sid}", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return list(r.json()["messages"])


# -- the OpenAI surface ----------------------------------------------------------------------


def test_session_keeps_memory_and_belongs_to_its_key(url: str, store: Store) -> None:
    with client(url) as c:
        first = c.chat.completions.create(
            model="echo",
            messages=[
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "my name is Ada"},
            ],
            extra_headers={"X-Session-Id": "s1"},
        )
        assert first.choices[0].message.content == "heard 2: my name is Ada"
        assert first.choices[0].finish_reason == "stop"
        assert first.usage is not None and first.usage.completion_tokens == 6
        # Only the new message: the server adds the system prompt and the earlier turn.
        second = c.chat.completions.create(
            model="echo",
            messages=[{"role": "user", "content": "who am I"}],
            extra_headers={"X-Session-Id": "s1"},
        )
        assert second.choices[0].message.content == "heard 4: who am I"
        third = c.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "x"}], metadata={"session_id": "s1"}
        )
        assert third.choices[0].message.content == "heard 6: x"
    assert [m["role"] for m in history(url, "s1")] == ["system"] + ["user", "assistant"] * 3
    assert store.load("s1")[0].owner == key_owner("k1")
    with client(url, "k2") as other:  # another key: the session does not exist for it
        with pytest.raises(openai.NotFoundError):
            other.chat.completions.create(
                model="echo",
                messages=[{"role": "user", "content": "hi"}],
                extra_headers={"X-Session-Id": "s1"},
            )
    for path in ("/v1/sessions/s1", "/v1/sessions/s1/export"):
        r = httpx.get(url + path, headers={"Authorization": "Bearer k2"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    assert httpx.delete(f"{url}/v1/sessions/s1", headers={"Authorization": "Bearer k2"}).status_code == 404
    assert len(store.load("s1")[1]) == 7  # untouched by k2


def test_stateless_requests_are_planned_in_budget_and_not_stored(
    url: str, store: Store, echo: EchoEngine
) -> None:
    msgs: list[Any] = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    msgs += [{"role": "user", "content": "c " * 9000}]  # 4500 tokens (4 chars each): over the budget
    with client(url) as c:
        out = c.chat.completions.create(model="echo", messages=msgs, max_tokens=3)
    assert out.choices[0].message.content == "heard 1: c"  # 3 words: max_tokens held
    assert out.choices[0].finish_reason == "stop"
    shown = echo.prompts[-1]
    assert echo.counter.count_prompt(shown) + 3 <= BUDGET.context_tokens
    assert len(shown) == 1 and len(shown[0].content) < 18000  # the old turn left, the message was cut
    assert store.list_sessions() == []


def test_streaming_sync_matches_plain_reply(url: str) -> None:
    with client(url) as c:
        stream = c.chat.completions.create(
            model="echo",
            messages=[{"role": "user", "content": "stream me please"}],
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"X-Session-Id": "st"},
        )
        chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == "heard 1: stream me please"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert history(url, "st")[-1] == {"role": "assistant", "content": text}
    raw = httpx.post(
        f"{url}/v1/chat/completions",
        headers={"Authorization": "Bearer k1"},
        json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
    )
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().endswith("data: [DONE]")


def test_async_client_parallel_sessions_and_stream(url: str) -> None:
    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="k2", max_retries=0) as c:

            async def turn(i: int) -> str:
                r = await c.chat.completions.create(
                    model="echo",
                    messages=[{"role": "user", "content": f"n{i}"}],
                    extra_headers={"X-Session-Id": f"a{i}"},
                )
                return r.choices[0].message.content or ""

            out = list(await asyncio.gather(*(turn(i) for i in range(6))))
            stream = await c.chat.completions.create(
                model="echo",
                messages=[{"role": "user", "content": "again"}],
                extra_headers={"X-Session-Id": "a0"},
                stream=True,
            )
            out.append("".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices]))
            return out

    out = asyncio.run(main())
    assert out[:6] == [f"heard 1: n{i}" for i in range(6)]
    assert out[6] == "heard 3: again"


def test_models_health_metrics(url: str) -> None:
    with client(url) as c:
        assert [m.id for m in c.models.list()] == ["echo"]
        c.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hi"}])
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    text = httpx.get(f"{url}/metrics").text
    assert "convo_requests_admitted_total 1" in text and "convo_generated_tokens_total 3" in text


# -- refusals --------------------------------------------------------------------------------


def test_the_openai_client_reads_which_field_was_refused(url: str) -> None:
    with client(url) as c:
        with pytest.raises(openai.BadRequestError) as refused:
            c.chat.completions.create(model="echo", messages=[{"role": "user", "content": "x"}], n=2)
        assert (refused.value.param, refused.value.code) == ("n", "unsupported_parameter")
        with pytest.raises(openai.BadRequestError) as refused:
            c.chat.completions.create(
                model="echo", messages=[{"role": "user", "content": "x"}], temperature=3
            )
        assert (refused.value.param, refused.value.code) == ("temperature", "invalid_value")
        ok = c.chat.completions.create(
            model="echo",
            messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
            n=1,
            temperature=0.5,
            top_p=0.9,
            seed=7,
            stop=["zzz"],
            max_completion_tokens=20,
            stream_options=None,
            metadata={"session_id": "typed", "team": "a"},
            user="someone",
        )
        assert ok.choices[0].message.content == "heard 2: hi"
    assert [m["role"] for m in history(url, "typed")] == ["system", "user", "assistant"]


def test_bad_requests_get_openai_style_errors(url: str) -> None:
    auth = {"Authorization": "Bearer k1", "Content-Type": "application/json"}

    def post(content: bytes | str, headers: dict[str, str] = auth) -> httpx.Response:
        return httpx.post(f"{url}/v1/chat/completions", content=content, headers=headers)

    def chat(**body: Any) -> httpx.Response:
        return post(json.dumps({"model": "echo", **body}))

    cases = {
        400: [
            post("{not json"),
            post("[1, 2]"),
            chat(messages=[]),
            chat(messages=[{"role": "wizard", "content": "x"}]),
            chat(messages=[{"role": "user", "content": 5}]),
            chat(messages=[{"role": "user", "content": "x"}] * 257),  # max_messages
            chat(messages=[{"role": "user", "content": "x"}], max_tokens=201),  # over the budget's cap
            chat(messages=[{"role": "user", "content": "x"}], max_tokens="ten"),
            chat(messages=[{"role": "user", "content": "x"}], temperature=-1),
            chat(messages=[{"role": "user", "content": "x"}], metadata={"session_id": "bad id!"}),
            # with a session, the last message must be a user message or tool results
            chat(messages=[{"role": "assistant", "content": "x"}], metadata={"session_id": "s-bad"}),
        ],
        413: [post(json.dumps({"messages": [{"role": "user", "content": "x" * (1 << 20)}]}))],
        401: [post("{}", {"Authorization": "Bearer nope"}), post("{}", {})],
    }
    for status, responses in cases.items():
        for r in responses:
            assert r.status_code == status, r.text
            error = r.json()["error"]
            assert error["message"] and error["type"] and error["code"]
    with client(url, "wrong") as c, pytest.raises(openai.AuthenticationError):
        c.models.list()
    r = httpx.get(f"{url}/v1/sessions/never", headers=auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    assert httpx.get(f"{url}/nowhere").json()["error"]["code"] == "http_404"


def test_queue_full_gets_429_with_retry_after_and_timeout_gets_503(store: Store) -> None:
    slow = EchoEngine(delay_s=0.05, pad_words=20)  # ~1 s per request
    limits = ServerLimits(max_concurrency=1, max_queue=1, queue_timeout_s=0.3)
    with serve(create_app(slow, store=store, budget=BUDGET, limits=limits)) as base:
        body = {"messages": [{"role": "user", "content": "hi"}]}
        with httpx.Client(base_url=base, timeout=30) as http:
            running = threading.Thread(
                target=http.post, args=("/v1/chat/completions",), kwargs={"json": body}
            )
            running.start()
            while slow.prompts == []:
                time.sleep(0.01)
            results: dict[str, httpx.Response] = {}
            queued = threading.Thread(
                target=lambda: results.update(q=http.post("/v1/chat/completions", json=body))
            )
            queued.start()
            time.sleep(0.1)  # the second one is queued now; the third finds the queue full
            full = http.post("/v1/chat/completions", json=body)
            queued.join()
            running.join()
    assert full.status_code == 429 and int(full.headers["Retry-After"]) >= 1
    assert full.json()["error"]["code"] == "queue_full"
    assert results["q"].status_code == 503 and results["q"].json()["error"]["code"] == "queue_timeout"


def test_refusals_are_quick_while_every_worker_thread_is_busy(store: Store) -> None:
    # One slow turn holds the only generation slot and its session's lock. DELETEs of that
    # session fail at once with 409 (they hold no worker thread waiting for the lock), and
    # requests beyond capacity are still refused at once: admission needs no thread.
    slow = EchoEngine(delay_s=0.05, pad_words=80)  # ~4 s per turn
    limits = ServerLimits(max_concurrency=1, max_queue=0)
    with serve(create_app(slow, store=store, budget=BUDGET, limits=limits)) as base:
        with httpx.Client(base_url=base, timeout=30) as http:
            results: list[int] = []

            def call(method: str, path: str, **kwargs: Any) -> None:
                results.append(http.request(method, path, **kwargs).status_code)

            body = {"messages": [{"role": "user", "content": "hi"}], "metadata": {"session_id": "busy"}}
            busy = threading.Thread(target=call, args=("POST", "/v1/chat/completions"), kwargs={"json": body})
            busy.start()
            while slow.prompts == []:
                time.sleep(0.01)
            t0 = time.monotonic()
            deletes = [http.delete("/v1/sessions/busy").status_code for _ in range(20)]
            delete_s = time.monotonic() - t0
            refused = []
            # a session's turn and a stateless one
            for other in ({**body, "metadata": {"session_id": "other"}}, {"messages": body["messages"]}):
                t0 = time.monotonic()
                r = http.post("/v1/chat/completions", json=other)
                refused.append((r.status_code, time.monotonic() - t0))
            assert results == [], "the refusals came only after the slow turn ended"
            busy.join()
            assert http.delete("/v1/sessions/busy").status_code == 200  # free now
    assert deletes == [409] * 20 and delete_s < 2.0, delete_s
    assert [status for status, _ in refused] == [429, 429]
    assert all(seconds < 1.0 for _, seconds in refused), refused  # the turn takes ~4 s
    assert results == [200]


def test_a_turn_that_cannot_get_its_session_lock_in_time_gets_409(store: Store) -> None:
    slow = EchoEngine(delay_s=0.05, pad_words=40)  # ~2 s per turn
    limits = ServerLimits(max_concurrency=2, session_lock_timeout_s=0.3)
    with serve(create_app(slow, store=store, budget=BUDGET, limits=limits)) as base:
        with httpx.Client(base_url=base, timeout=30) as http:
            body = {"messages": [{"role": "user", "content": "hi"}], "metadata": {"session_id": "locked"}}
            first = threading.Thread(target=http.post, args=("/v1/chat/completions",), kwargs={"json": body})
            first.start()
            while slow.prompts == []:
                time.sleep(0.01)
            second = http.post("/v1/chat/completions", json=body)
            first.join()
            kept = http.get("/v1/sessions/locked").json()
    assert second.status_code == 409 and second.json()["error"]["code"] == "session_busy"
    assert [m["role"] for m in kept["messages"]] == ["user", "assistant"]  # only the first turn


def test_a_custom_controller_runs_all_it_admits_at_once(store: Store) -> None:
    slow = EchoEngine(delay_s=0.05, pad_words=40)  # ~2 s per turn
    admission = AdmissionController(
        AdmissionLimits(kv_budget_bytes=1 << 30, max_concurrency=24), cost_fn=lambda p, n: p + n
    )
    limits = ServerLimits(max_concurrency=1)  # the custom controller decides, not this
    with serve(create_app(slow, store=store, budget=BUDGET, limits=limits, admission=admission)) as base:
        with httpx.Client(base_url=base, timeout=30) as http:
            body = {"messages": [{"role": "user", "content": "hi"}]}
            turns = [
                threading.Thread(target=http.post, args=("/v1/chat/completions",), kwargs={"json": body})
                for _ in range(16)
            ]
            for t in turns:
                t.start()
            deadline = time.monotonic() + 1.5
            while len(slow.prompts) < 16 and time.monotonic() < deadline:
                time.sleep(0.01)
            generating = len(slow.prompts)
            for t in turns:
                t.join()
    assert generating == 16 and admission.peak_running == 16


def test_client_disconnect_mid_stream_keeps_history_consistent(store: Store) -> None:
    slow = EchoEngine(delay_s=0.02, pad_words=500)  # ~10 s if nobody stopped it
    with serve(create_app(slow, store=store, budget=BUDGET)) as base:
        with httpx.Client(base_url=base, timeout=30) as http:
            body = {"messages": [{"role": "user", "content": "tell me everything"}], "stream": True}
            started = time.monotonic()
            with http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Session-Id": "d"}) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                got = [next(lines) for _ in range(8)]
            assert any("heard" in line for line in got)
            deadline = time.monotonic() + 10
            while True:  # the server notices the disconnect, cancels and stores the partial reply
                msgs = http.get("/v1/sessions/d").json()["messages"]
                if len(msgs) == 2 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert time.monotonic() - started < 8, "generation was not cancelled"
            assert [m["role"] for m in msgs] == ["user", "assistant"]
            partial = msgs[1]["content"]
            full = " ".join(["heard 1: tell me everything", *(f"w{i}" for i in range(500))])
            assert partial and full.startswith(partial) and len(partial.split()) < 100
            slow.delay_s = 0
            r2 = http.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "next"}]},
                headers={"X-Session-Id": "d"},
            )  # fmt: skip
            assert r2.status_code == 200 and r2.json()["choices"][0]["message"]["content"].startswith(
                "heard 3: next"
            )
            assert [m["role"] for m in http.get("/v1/sessions/d").json()["messages"]] == [
                "user",
                "assistant",
            ] * 2


def test_one_turn_at_a_time_per_session(store: Store) -> None:
    slow = EchoEngine(delay_s=0.01, pad_words=10)
    with serve(create_app(slow, store=store, budget=BUDGET, limits=ServerLimits(max_concurrency=4))) as base:
        with httpx.Client(base_url=base, timeout=30) as http:

            def turn(i: int) -> None:
                body = {"messages": [{"role": "user", "content": f"m{i}"}], "metadata": {"session_id": "one"}}
                assert http.post("/v1/chat/completions", json=body).status_code == 200

            threads = [threading.Thread(target=turn, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            msgs = http.get("/v1/sessions/one").json()["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant"] * 4
    # Each reply saw exactly the turns stored before it: no interleaving.
    assert sorted(m["content"].split(":")[0] for m in msgs[1::2]) == [f"heard {n}" for n in (1, 3, 5, 7)]


def test_delete_and_export(url: str) -> None:
    with client(url) as c:
        c.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "hi"}], extra_headers={"X-Session-Id": "gone"}
        )
    auth = {"Authorization": "Bearer k1"}
    data = httpx.get(f"{url}/v1/sessions/gone/export", headers=auth).json()
    assert data["format"] == "convo.session/1" and len(data["messages"]) == 2
    assert httpx.delete(f"{url}/v1/sessions/gone", headers=auth).json()["deleted"] is True
    assert httpx.get(f"{url}/v1/sessions/gone", headers=auth).status_code == 404


def test_serve_refuses_public_bind_without_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from convo.cli import build_parser
    from convo.cli.serve import run_server

    monkeypatch.delenv("CONVO_API_KEY", raising=False)
    args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--db", "/nonexistent/never.db"])
    with pytest.raises(ConfigError, match="API key"):
        run_server(args)
    with pytest.raises(ConfigError):
        ServerLimits(max_body_bytes=0)
    with pytest.raises(ConfigError):
        create_app(EchoEngine(), store=InMemoryStore(), api_key="")


# -- replicas on one Redis -------------------------------------------------------------------


@contextmanager
def replica(redis_url: str, env: dict[str, str]) -> Iterator[str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "convo.cli",
        "serve",
        "--redis",
        redis_url,
        "--port",
        str(port),
        "--api-key",
        "k",
    ]
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, 30, lambda: proc.stderr.read() if proc.stderr else "")
        yield base
    finally:
        proc.terminate()
        proc.wait(10)
        if proc.stderr:
            proc.stderr.close()


def test_two_replicas_share_sessions_on_redis() -> None:
    redis_url = redis_or_skip()
    sid = f"replicas-{uuid.uuid4().hex}"
    env = {"CONVO_FAKE_ENGINE": "1", "CONVO_FAKE_DELAY_S": "0.01"}
    with replica(redis_url, env) as a, replica(redis_url, env) as b:
        clients = [openai.OpenAI(base_url=f"{u}/v1", api_key="k", max_retries=0) for u in (a, b)]
        try:
            for i in range(4):  # alternate replicas: each sees every earlier turn
                out = clients[i % 2].chat.completions.create(
                    model="echo",
                    messages=[{"role": "user", "content": f"t{i}"}],
                    extra_headers={"X-Session-Id": sid},
                )
                assert out.choices[0].message.content == f"heard {2 * i + 1}: t{i}"
            errors: list[BaseException] = []

            def burst(c: openai.OpenAI, k: int) -> None:
                try:
                    c.chat.completions.create(
                        model="echo",
                        messages=[{"role": "user", "content": f"b{k}"}],
                        extra_headers={"X-Session-Id": sid},
                    )
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=burst, args=(clients[k % 2], k)) for k in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors
        finally:
            for c in clients:
                c.close()
        msgs = httpx.get(f"{b}/v1/sessions/{sid}", headers={"Authorization": "Bearer k"}).json()["messages"]
        assert [m["role"] for m in msgs] == ["user", "assistant"] * 10  # nothing lost, never interleaved
        heard = sorted(int(m["content"].split(":")[0].split()[1]) for m in msgs[1::2])
        assert heard == list(range(1, 20, 2))
        assert (
            httpx.delete(f"{a}/v1/sessions/{sid}", headers={"Authorization": "Bearer k"}).status_code == 200
        )


# -- the real model --------------------------------------------------------------------------


@pytest.mark.slow
def test_real_model_over_http(real_engine: Any, tmp_path: Path) -> None:
    budget = Budget(context_tokens=512, max_new_tokens=16, window_turns=2, summary_tokens=0)
    app = create_app(real_engine, store=SQLiteStore(tmp_path / "real.db"), budget=budget, model_name="smol")
    with serve(app) as base, openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) as c:
        first = c.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "My name is Priya."}],
            extra_headers={"X-Session-Id": "real"},
            max_tokens=8,
        )
        assert first.usage is not None and 0 < first.usage.completion_tokens <= 8
        assert first.usage.prompt_tokens + 8 <= 512
        assert first.usage.prompt_tokens_details is not None
        assert first.usage.prompt_tokens_details.cached_tokens == 0  # a new session: nothing kept
        stream = c.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "What is my name?"}],
            extra_headers={"X-Session-Id": "real"},
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text.strip()
        second = chunks[-1].usage
        assert second is not None and second.prompt_tokens_details is not None
        # The first turn's prompt and reply were kept: OpenAI's prompt-cache figure says so.
        assert first.usage.prompt_tokens < second.prompt_tokens_details.cached_tokens < second.prompt_tokens
        msgs = httpx.get(f"{base}/v1/sessions/real").json()["messages"]
        assert [m["content"] for m in msgs][2:] == ["What is my name?", text]


def test_the_stream_ends_before_the_summary_and_stats_report_it(store: Store) -> None:
    from convo.models import Priority
    from convo.summarize import SummaryWorker

    gate, started = threading.Event(), threading.Event()

    class SlowSummaries(EchoEngine):
        def generate(self, messages: Any, **kw: Any) -> Any:
            if kw.get("priority") == Priority.BACKGROUND:  # the summarizer's call
                started.set()
                assert gate.wait(10)
            return super().generate(messages, **kw)

    budget = Budget(
        context_tokens=4000, max_new_tokens=50, window_turns=1, summarize_batch_turns=1, summary_tokens=40
    )
    worker = SummaryWorker(max_defer_s=0.0)
    app = create_app(SlowSummaries(), store=store, budget=budget, model_name="echo", summaries=worker)
    try:
        with serve(app) as base, client(base) as c:
            head = {"X-Session-Id": "sum"}
            chunks = c.chat.completions.create(
                model="echo",
                messages=[{"role": "user", "content": "my boat is Nautilus"}],
                stream=True,
                extra_headers=head,
            )
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            assert text == "heard 1: my boat is Nautilus"  # the whole stream, [DONE] included
            assert started.wait(10) and not gate.is_set()  # ...while its summary still runs
            state = store.load("sum")[0]
            assert (state.evicted_turns, state.summarized_turns) == (1, 0)
            r = httpx.post(
                f"{base}/v1/chat/completions",
                json={"model": "echo", "messages": [{"role": "user", "content": "and?"}]},
                headers=head,
            )
            stats = r.json()["convo"]
            assert stats["summary"]["status"] == "running" and stats["summary"]["pending_turns"] >= 1
            assert stats["hidden_turns"] == 0 and stats["summary_wait_s"] == 0.0  # it fit: no wait
            assert stats["provisional_summary"] is False
            # The prompt still showed the turn its running summary owes (it fit).
            assert stats["first_shown_turn"] == 0 < stats["evicted_turns"]
            gate.set()
            job = worker.job(store, "sum")
            assert job is not None and job.wait(10)
            deadline = time.monotonic() + 10
            while store.load("sum")[0].summarized_turns < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert store.load("sum")[0].summary.startswith("heard")  # written by the worker
    finally:
        worker.close(wait=False)
