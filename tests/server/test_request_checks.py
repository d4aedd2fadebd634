"""Issue 14 (hardening), server side: secrets in errors, cost amplification, poison input,
cross-site requests, one client starving others, refused requests leaving state, loose edges.
A real uvicorn on loopback, the echo engine."""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import serve, start_redis, stop_redis

from convo import Budget, InMemoryStore, SQLiteStore
from convo.errors import ConfigError, RemoteEngineError
from convo.messages import Message
from convo.server.app import create_app
from convo.server.limits import ServerLimits
from convo.stores import Store
from convo.testing import EchoEngine

BUDGET = Budget(context_tokens=4000, max_new_tokens=200, window_turns=4)  # summaries on


def chat(http: httpx.Client, content: Any, *, session: str | None = None, **extra: Any) -> httpx.Response:
    body: dict[str, Any] = {"model": "echo", "messages": [{"role": "user", "content": content}], **extra}
    headers = {"X-Session-Id": session} if session else {}
    return raw(http, json.dumps(body), **headers)  # ASCII escapes: a lone surrogate travels as JSON does


def raw(http: httpx.Client, text: str, **headers: str) -> httpx.Response:
    return http.post(
        "/v1/chat/completions", content=text.encode(), headers={"Content-Type": "application/json", **headers}
    )


def openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.text
    err: dict[str, Any] = r.json()["error"]
    assert set(err) >= {"message", "type", "code"}
    return err


# -- item 1: no store URL, path, key or stack trace in an error body ---------------------------


def test_error_bodies_name_no_sqlite_path(tmp_path: Path) -> None:
    secret_dir = tmp_path / "very-secret-folder"
    app = create_app(EchoEngine(), store=SQLiteStore(secret_dir / "s.db"), budget=BUDGET)
    with serve(app) as base, httpx.Client(base_url=base) as http:
        r = http.get("/v1/sessions/nope")
        openai_error(r, 404)
        assert "very-secret-folder" not in r.text and ".db" not in r.text


def test_error_bodies_name_no_redis_url_or_password(tmp_path: Path) -> None:
    from convo.stores import RedisStore

    url, proc = start_redis(tmp_path, "--requirepass", "s3cr3t-pw")
    try:
        secret_url = url.replace("redis://", "redis://:s3cr3t-pw@")
        store = RedisStore(secret_url, socket_timeout_s=1)
        with serve(create_app(EchoEngine(), store=store, budget=BUDGET)) as base:
            with httpx.Client(base_url=base, timeout=10) as http:
                assert http.get("/health").json()["status"] == "ok"
                r = http.get("/v1/sessions/nope")
                openai_error(r, 404)
                assert "s3cr3t" not in r.text and "redis://" not in r.text
                proc.kill()  # the store goes away: JSON errors, still no URL
                proc.wait()
                for r in (http.get("/v1/sessions/nope"), chat(http, "hi", session="s1")):
                    err = openai_error(r, 500)
                    assert err["code"] == "store_error"
                    assert "s3cr3t" not in r.text and "redis://" not in r.text and "Traceback" not in r.text
                health = http.get("/health")  # item 8: /health says the store is down
                assert health.status_code == 503 and health.json()["status"] == "unavailable"
    finally:
        stop_redis(proc)


# -- item 2: a stateless request costs one generation ------------------------------------------


def test_stateless_request_generates_once_whatever_its_length() -> None:
    engine = EchoEngine()
    msgs = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 5} for i in range(255)
    ]
    budget = Budget(context_tokens=2000, max_new_tokens=50, window_turns=4, summary_tokens=200)
    with serve(create_app(engine, store=InMemoryStore(), budget=budget)) as base:
        with httpx.Client(base_url=base, timeout=30) as http:
            r = http.post("/v1/chat/completions", json={"model": "echo", "messages": msgs})
    assert r.status_code == 200, r.text
    assert engine.calls == 1  # on main: 32 (earlier messages replayed through the summarizer)
    shown = engine.prompts[0]
    assert shown[-1].content == msgs[-1]["content"]  # the newest message is in the prompt
    assert 4 < len(shown) < 255  # as many recent turns as fit, not the window or everything
    assert engine.counter.count_prompt(list(shown)) + budget.max_new_tokens <= budget.context_tokens


def test_a_new_session_with_long_history_costs_one_generation_and_one_summary_pass() -> None:
    engine = EchoEngine()
    msgs = [{"role": ("user", "assistant")[i % 2], "content": f"message {i} " * 5} for i in range(255)]
    budget = Budget(context_tokens=2000, max_new_tokens=50, window_turns=4, summary_tokens=200)
    with serve(create_app(engine, store=InMemoryStore(), budget=budget)) as base:
        with httpx.Client(base_url=base, timeout=30) as http:
            r = http.post(
                "/v1/chat/completions", json={"messages": msgs, "metadata": {"session_id": "imported"}}
            )
            assert r.status_code == 200, r.text
            stored = http.get("/v1/sessions/imported").json()
    assert engine.calls == 2  # the reply, then one fold of every turn that left the window
    assert len(stored["messages"]) == 256 and stored["summarized_turns"] == stored["evicted_turns"] > 100


# -- item 3: poison input gets 400 and the session stays usable; every error is JSON ----------


def test_lone_surrogate_gets_400_and_the_session_stays_usable() -> None:
    with serve(create_app(EchoEngine(), store=InMemoryStore(), budget=BUDGET)) as base:
        with httpx.Client(base_url=base) as http:
            assert chat(http, "hello", session="p").status_code == 200
            for content in ("hi \ud800", [{"type": "text", "text": "\udfff"}]):
                err = openai_error(chat(http, content, session="p"), 400)
                assert "surrogate" in err["message"]
            assert http.get("/v1/sessions/p").status_code == 200
            assert chat(http, "still fine", session="p").status_code == 200
            history = http.get("/v1/sessions/p").json()["messages"]
    assert [m["content"] for m in history if m["role"] == "user"] == ["hello", "still fine"]


def test_bad_inputs_get_openai_style_json_errors() -> None:
    engine = EchoEngine()
    with serve(create_app(engine, store=InMemoryStore(), budget=BUDGET)) as base:
        with httpx.Client(base_url=base) as http:
            openai_error(raw(http, "[" * 100_000 + "]" * 100_000), 400)  # RecursionError on main
            openai_error(
                raw(http, '{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}'), 400
            )
            openai_error(
                raw(http, '{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}'), 400
            )
            openai_error(chat(http, "x", seed=2**80), 400)
            openai_error(chat(http, "x", temperature=5), 400)
            assert chat(http, "x", temperature=1e-300).status_code == 200  # greedy
            assert chat(http, "x", temperature=0.7, seed=2**40).status_code == 200


class _Breaks(EchoEngine):
    """Says one word, then fails with an error convo does not know."""

    def generate(
        self, messages: Sequence[Message], *, on_text: Callable[[str], None] | None = None, **kw: Any
    ) -> Any:
        if on_text is not None:
            on_text("partial")
        raise RuntimeError("device exploded at /secret/path")


def test_a_stream_that_fails_ends_with_an_error_event() -> None:
    with serve(create_app(_Breaks(), store=InMemoryStore(), budget=BUDGET)) as base:
        with httpx.Client(base_url=base) as http:
            body = {"model": "echo", "messages": [{"role": "user", "content": "x"}], "stream": True}
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            plain = chat(http, "x")
    assert lines[-1] == "[DONE]"
    err = json.loads(lines[-2])["error"]
    assert err["code"] == "internal_error" and "/secret/path" not in err["message"]
    assert openai_error(plain, 500)["code"] == "internal_error" and "/secret/path" not in plain.text


# -- item 5: cross-site requests -----------------------------------------------------------------


def test_keyless_server_refuses_foreign_host_origin_and_non_json() -> None:
    app = create_app(
        EchoEngine(), store=InMemoryStore(), budget=BUDGET, allowed_origins=["https://ok.example"]
    )
    with serve(app) as base:
        port = base.rsplit(":", 1)[1]
        with httpx.Client(base_url=base) as http:
            assert chat(http, "mine", session="victim").status_code == 200
            # DNS rebinding: the victim's history under a foreign Host name
            r = http.get("/v1/sessions/victim", headers={"Host": f"evil.example:{port}"})
            assert openai_error(r, 403)["code"] == "forbidden_host"
            assert http.get("/v1/sessions/victim", headers={"Host": f"localhost:{port}"}).status_code == 200
            # CSRF: a cross-site form or fetch
            body = json.dumps(
                {"messages": [{"role": "user", "content": "injected"}], "metadata": {"session_id": "victim"}}
            )
            r = http.post("/v1/chat/completions", content=body, headers={"Content-Type": "text/plain"})
            assert openai_error(r, 415)["code"] == "invalid_content_type"
            r = raw(http, body, Origin="https://evil.example")
            assert openai_error(r, 403)["code"] == "forbidden_origin"
            assert raw(http, body, Origin="https://ok.example").status_code == 200  # allowed by flag
            assert raw(http, body, Origin=f"http://127.0.0.1:{port}").status_code == 200  # same origin
    with serve(create_app(EchoEngine(), store=InMemoryStore(), api_key="k")) as base:  # a key: any Host
        port = base.rsplit(":", 1)[1]
        r = httpx.get(
            f"{base}/v1/models", headers={"Host": f"api.example:{port}", "Authorization": "Bearer k"}
        )
        assert r.status_code == 200


# -- item 6: one session's burst does not take every generation slot ---------------------------


def test_a_burst_on_one_session_does_not_starve_another() -> None:
    engine = EchoEngine(delay_s=0.04, pad_words=10)  # ~0.5 s per turn
    limits = ServerLimits(max_concurrency=2)
    with serve(create_app(engine, store=InMemoryStore(), budget=BUDGET, limits=limits)) as base:
        with httpx.Client(base_url=base, timeout=60) as http:
            burst = [
                threading.Thread(target=chat, args=(http, f"b{i}"), kwargs={"session": "hog"})
                for i in range(12)
            ]
            for t in burst:
                t.start()
            time.sleep(0.3)
            t0 = time.monotonic()
            assert chat(http, "me", session="other").status_code == 200
            other_s = time.monotonic() - t0
            for t in burst:
                t.join()
            assert len(http.get("/v1/sessions/hog").json()["messages"]) == 24
    assert other_s < 2.0, other_s  # on main ~5 s: queued behind the burst's slots


# -- item 7: a refused request stores nothing --------------------------------------------------


def test_too_long_system_prompt_gets_400_and_creates_no_session() -> None:
    budget = Budget(context_tokens=1000, max_new_tokens=100, summary_tokens=0)
    with serve(create_app(EchoEngine(), store=InMemoryStore(), budget=budget)) as base:
        with httpx.Client(base_url=base) as http:

            def turn(system: str) -> httpx.Response:
                msgs = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
                return http.post(
                    "/v1/chat/completions", json={"messages": msgs, "metadata": {"session_id": "fresh"}}
                )

            openai_error(turn("x" * 20_000), 400)
            assert http.get("/v1/sessions/fresh").status_code == 404
            assert turn("Be brief.").status_code == 200
            history = http.get("/v1/sessions/fresh").json()["messages"]
    assert history[0] == {"role": "system", "content": "Be brief."}


# -- item 8: strict booleans, unsupported parameters refused, stop honoured ---------------------


@pytest.mark.parametrize(
    "extra",
    [
        {"stream": "false"},
        {"stream": 0},
        {"stream_options": {"include_usage": "false"}},
        {"n": 2},
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        {"logprobs": True},
        {"response_format": {"type": "json_object"}},
        {"stop": ["a", "b", "c", "d", "e"]},
        {"stop": 7},
    ],
)
def test_loose_parameters_are_refused(extra: dict[str, Any]) -> None:
    with serve(create_app(EchoEngine(), store=InMemoryStore(), budget=BUDGET)) as base:
        with httpx.Client(base_url=base) as http:
            openai_error(chat(http, "x", **extra), 400)


def test_stop_is_honoured() -> None:
    with serve(create_app(EchoEngine(), store=InMemoryStore(), budget=BUDGET)) as base:
        with httpx.Client(base_url=base) as http:
            plain = chat(http, "hello brave world", stop="world", n=1, logprobs=False)
            one = chat(http, "hello brave world", stop=["brave", "zzz"], stream=False)
    assert plain.json()["choices"][0]["message"]["content"] == "heard 1: hello brave "
    assert one.json()["choices"][0]["message"]["content"] == "heard 1: hello "


def test_sqlite_lock_files_do_not_pile_up_from_deletes(tmp_path: Path) -> None:
    store: Store = SQLiteStore(tmp_path / "s.db")
    with serve(create_app(EchoEngine(), store=store, budget=BUDGET)) as base:
        with httpx.Client(base_url=base) as http:
            for i in range(200):
                assert http.delete(f"/v1/sessions/unknown-{i}").status_code == 404
    locks = tmp_path / "s.db.locks"
    assert not locks.exists() or list(locks.iterdir()) == []


# -- request bodies are a pydantic model: each refusal names its field; /openapi.json shows it --


def test_each_refusal_names_its_field_and_says_what_failed() -> None:
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"n": 2}, "n", "unsupported_parameter"),
        ({"response_format": {"type": "json_object"}}, "response_format", "unsupported_parameter"),
        ({"temperature": 5}, "temperature", "invalid_value"),
        ({"top_p": 0}, "top_p", "invalid_value"),
        ({"seed": True}, "seed", "invalid_value"),
        ({"stream": "false"}, "stream", "invalid_value"),
        ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage", "invalid_value"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
        ({"max_tokens": 201}, "max_tokens", "invalid_max_tokens"),
        ({"max_completion_tokens": 201}, "max_completion_tokens", "invalid_max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}] * 257}, "messages", "too_many_messages"),
        ({"max_tokens": 1.5}, "max_tokens", "invalid_max_tokens"),
        ({"metadata": {"session_id": "bad id!"}}, "metadata.session_id", "invalid_session_id"),
        ({"messages": []}, "messages", "invalid_value"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "invalid_role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
            "invalid_content",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "4"}]},
            "messages[1]",
            "invalid_messages",
        ),
    ]
    with serve(create_app(EchoEngine(), store=InMemoryStore(), budget=BUDGET)) as base:
        with httpx.Client(base_url=base) as http:
            for extra, param, code in cases:
                err = openai_error(chat(http, "x", **extra), 400)
                assert (err["param"], err["code"]) == (param, code), (extra, err)
                assert err["message"].startswith(f"{param}: "), err
            r = http.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "x"}]},
                headers={"X-Session-Id": "no spaces"},
            )
            assert (openai_error(r, 400)["param"], r.json()["error"]["code"]) == (
                "x-session-id",
                "invalid_session_id",
            )
            huge = "z" * 5000  # the refused value is not echoed back
            r = chat(http, "x", temperature=huge)
            assert openai_error(r, 400)["param"] == "temperature" and huge not in r.text
            # OpenAI parameters the server leaves to its defaults are ignored, as before
            assert chat(http, "x", frequency_penalty=0.5, presence_penalty=0, model="any").status_code == 200


def test_openapi_json_documents_the_chat_body_and_the_error_shape() -> None:
    from convo.server.requests import MAX_SEED, MAX_STOP_SEQUENCES, MAX_TEMPERATURE

    with serve(create_app(EchoEngine(), store=InMemoryStore(), api_key="k")) as base:
        spec = httpx.get(f"{base}/openapi.json").json()  # no key needed: it is the API's shape
    op = spec["paths"]["/v1/chat/completions"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletionBody")
    assert [p["name"] for p in op["parameters"]] == ["x-session-id"]
    assert "422" not in op["responses"]  # refusals are 400 with OpenAI's error JSON
    assert op["security"] == [{"HTTPBearer": []}] and "security" not in spec["paths"]["/health"]["get"]
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert op["responses"]["4XX"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
    schemas = spec["components"]["schemas"]
    assert set(schemas["ErrorDetail"]["properties"]) == {"message", "type", "param", "code"}
    body = schemas["ChatCompletionBody"]
    assert body["required"] == ["messages"] and body["properties"]["messages"]["minItems"] == 1
    props = body["properties"]
    assert props["temperature"]["anyOf"][0]["maximum"] == MAX_TEMPERATURE
    assert props["seed"]["anyOf"][0]["maximum"] == float(MAX_SEED)
    assert props["stop"]["anyOf"][1]["maxItems"] == MAX_STOP_SEQUENCES
    assert props["n"]["anyOf"][0]["const"] == 1
    roles = schemas["ChatMessage"]["properties"]["role"]["enum"]
    assert set(roles) == {"system", "developer", "user", "assistant", "tool"}


# -- issue 27 (hardening) ------------------------------------------------------------------------


def test_long_or_many_stop_strings_get_400_naming_stop() -> None:
    engine = EchoEngine()
    limits = ServerLimits(max_stop_chars=64)
    with serve(create_app(engine, store=InMemoryStore(), budget=BUDGET, limits=limits)) as base:
        with openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0) as c:
            for stop in ("x" * 65, ["ok", "y" * 100_000], ["a", "b", "c", "d", "e"]):
                with pytest.raises(openai.BadRequestError) as refused:
                    c.chat.completions.create(
                        model="echo", messages=[{"role": "user", "content": "x"}], stop=stop
                    )
                assert refused.value.param == "stop", refused.value
                assert "y" * 100 not in str(refused.value)  # the refused value is not echoed
            ok = c.chat.completions.create(
                model="echo", messages=[{"role": "user", "content": "hello world"}], stop=["w" + "z" * 63]
            )
    assert ok.choices[0].message.content == "heard 1: hello world"
    assert engine.calls == 1  # the refused requests never reached the engine
    assert ServerLimits().max_stop_chars == 256
    with pytest.raises(ConfigError):
        ServerLimits(max_stop_chars=0)


def _drop_mid_stream(base: str, session: str | None) -> None:
    """Start a stream on a real socket, read until the reply's first words, then close the
    socket (a client that goes away mid-stream)."""
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({"messages": [{"role": "user", "content": "tell me"}], "stream": True}).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
    if session is not None:
        head += f"X-Session-Id: {session}\r\n"
    head += f"Content-Length: {len(body)}\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head.encode() + body)
        got = b""
        while b"heard" not in got:
            chunk = sock.recv(4096)
            assert chunk, got
            got += chunk
        assert got.startswith(b"HTTP/1.1 200")


def test_dropped_streams_free_their_slot_and_session_at_once() -> None:
    engine = EchoEngine(delay_s=0.05, pad_words=1000)  # 10 s a reply unless cancelled
    limits = ServerLimits(max_concurrency=4, queue_timeout_s=5, session_lock_timeout_s=5)
    store = InMemoryStore()
    gc.disable()  # the leak hid behind the garbage collector: it must not be needed
    try:
        with serve(create_app(engine, store=store, budget=BUDGET, limits=limits)) as base:
            t0 = time.monotonic()
            for i in range(8):  # twice the slots: each drop must give its slot back
                _drop_mid_stream(base, f"drop{i}" if i % 2 else None)
            assert time.monotonic() - t0 < 5, "a dropped stream held its slot"
            with httpx.Client(base_url=base, timeout=30) as http:
                deadline = time.monotonic() + 5  # each generation is cancelled, its partial reply stored
                while not all(len(store.load(f"drop{i}")[1]) == 2 for i in (1, 3, 5, 7)):
                    assert time.monotonic() < deadline, "a dropped stream's generation ran on"
                    time.sleep(0.02)
                full = " ".join(["heard 1: tell me", *(f"w{i}" for i in range(1000))])
                for i in (1, 3, 5, 7):
                    partial = store.load(f"drop{i}")[1][1].content
                    assert partial and full.startswith(partial) and len(partial.split()) < 60
                engine.delay_s = 0
                t1 = time.monotonic()
                for i in range(8):  # the slots and the dropped sessions' queues are free
                    r = chat(http, f"after {i}", session=f"drop{i}" if i % 2 else None)
                    assert r.status_code == 200, r.text
                assert time.monotonic() - t1 < 4
    finally:
        gc.enable()


def test_a_refused_request_on_an_existing_session_stores_nothing() -> None:
    store = InMemoryStore()
    with serve(create_app(EchoEngine(), store=store, budget=BUDGET)) as base:
        with httpx.Client(base_url=base, timeout=30) as http:
            assert chat(http, "first", session="s").status_code == 200
            before = http.get("/v1/sessions/s/export").json()
            call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "a" * 30_000}}
            agent = [
                {"role": "user", "content": "use the tool"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "done"},
            ]
            for messages in (
                agent,  # only the new messages
                [
                    {"role": "user", "content": "first"},
                    {"role": "assistant", "content": "heard 1: first"},
                    *agent,
                ],
                [
                    {"role": "user", "content": "first"},
                    {"role": "assistant", "content": "edited"},
                    *agent,
                ],  # fork
            ):
                r = http.post(
                    "/v1/chat/completions", json={"messages": messages}, headers={"X-Session-Id": "s"}
                )
                assert r.status_code == 400, r.text[:300]
                assert openai_error(r, 400)["code"] == "context_length_exceeded", r.text[:300]
                after = http.get("/v1/sessions/s/export").json()
                assert after["messages"] == before["messages"]
                assert {k: v for k, v in after.items() if k != "updated_at"} == {
                    k: v for k, v in before.items() if k != "updated_at"
                }
            assert store.list_sessions() == ["s"]  # no fork left behind
            assert (
                chat(http, "second", session="s").json()["choices"][0]["message"]["content"]
                == "heard 3: second"
            )


def test_a_requests_max_tokens_caps_that_reply_only() -> None:
    store = InMemoryStore()
    with serve(create_app(EchoEngine(pad_words=20), store=store, budget=BUDGET)) as base:
        with httpx.Client(base_url=base, timeout=30) as http:
            short = chat(http, "hi", session="m", max_tokens=3).json()
            assert short["choices"][0]["message"]["content"] == "heard 1: hi"
            assert http.get("/v1/sessions/m/export").json()["settings"]["budget"] == BUDGET.to_dict()
            full = chat(http, "again", session="m").json()["choices"][0]["message"]["content"]
    assert full.endswith("w19")  # the earlier request's cap did not stay with the session


class _CountingStore(InMemoryStore):
    """Counts the full loads of a session (its messages read)."""

    def __init__(self) -> None:
        super().__init__()
        self.loads = 0

    def load(self, session_id: str) -> Any:
        self.loads += 1
        return super().load(session_id)

    def peek(self, session_id: str) -> tuple[Any, int]:  # as SQLite's and Redis's: no messages read
        state, messages = super().load(session_id)
        return state, len(messages)


def test_a_turn_reads_its_session_once() -> None:
    store = _CountingStore()
    with serve(create_app(EchoEngine(), store=store, budget=BUDGET)) as base:
        with httpx.Client(base_url=base, timeout=30) as http:
            assert chat(http, "one", session="l").status_code == 200
            store.loads = 0
            assert chat(http, "two", session="l").status_code == 200
    assert store.loads <= 1  # at most once (none: this process knows the session, a tail read)


def test_another_keys_session_looks_missing_at_once() -> None:
    engine = EchoEngine(delay_s=0.05, pad_words=120)  # a turn of ~6 s
    app = create_app(engine, store=InMemoryStore(), api_key=["k1", "k2"], budget=BUDGET)
    with serve(app) as base:
        mine = httpx.Client(base_url=base, timeout=30, headers={"Authorization": "Bearer k1"})
        other = httpx.Client(base_url=base, timeout=30, headers={"Authorization": "Bearer k2"})
        with mine, other:
            assert chat(mine, "hello", session="p").status_code == 200

            def probe(sid: str) -> list[tuple[int, str, str]]:
                answers = []
                for r in (
                    other.delete(f"/v1/sessions/{sid}"),
                    other.get(f"/v1/sessions/{sid}"),
                    other.get(f"/v1/sessions/{sid}/export"),
                ):
                    err = openai_error(r, r.status_code)
                    answers.append((r.status_code, err["code"], err["message"].replace(sid, "ID")))
                return answers

            missing = probe("nobody")
            assert {status for status, _, _ in missing} == {404}
            assert probe("p") == missing  # idle
            turn = threading.Thread(target=chat, args=(mine, "a long one"), kwargs={"session": "p"})
            turn.start()
            time.sleep(0.3)
            t0 = time.monotonic()
            assert probe("p") == missing  # during a turn: no 409, no wait
            err = openai_error(chat(other, "hi", session="p"), 404)  # a turn of its own: 404 too
            assert (err["code"], err["message"].replace("p", "ID")) == missing[0][1:]
            assert time.monotonic() - t0 < 2.0
            turn.join()
            assert len(mine.get("/v1/sessions/p").json()["messages"]) == 4  # untouched by k2


def test_allowed_origins_get_cors_and_a_preflight_and_ports_count() -> None:
    app = create_app(
        EchoEngine(), store=InMemoryStore(), budget=BUDGET, allowed_origins=["https://ok.example"]
    )
    with serve(app) as base:
        port = int(base.rsplit(":", 1)[1])
        with httpx.Client(base_url=base) as http:
            asked = "authorization, content-type, x-session-id"
            pre = http.options(
                "/v1/chat/completions",
                headers={
                    "Origin": "https://ok.example",
                    "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": asked,
                },
            )
            assert pre.status_code == 204, pre.text
            assert pre.headers["access-control-allow-origin"] == "https://ok.example"
            assert "POST" in pre.headers["access-control-allow-methods"]
            assert pre.headers["access-control-allow-headers"] == asked
            assert int(pre.headers["access-control-max-age"]) > 0
            r = raw(
                http,
                json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
                Origin="https://ok.example:443",  # the same origin, its default port spelled out
                **{"X-Session-Id": "web"},
            )
            assert r.status_code == 200
            assert r.headers["access-control-allow-origin"] == "https://ok.example:443"
            assert "x-session-id" in r.headers["access-control-expose-headers"].lower()
            for foreign in ("https://evil.example", "https://ok.example:8443", "http://ok.example"):
                refused = http.options(
                    "/v1/models", headers={"Origin": foreign, "Access-Control-Request-Method": "GET"}
                )
                assert openai_error(refused, 403)["code"] == "forbidden_origin"
                assert "access-control-allow-origin" not in refused.headers
            # keyless: the server's own origin is scheme, host and port, not any loopback port
            other_port = port + 1 if port < 65535 else port - 1
            assert http.get("/v1/models", headers={"Origin": f"http://127.0.0.1:{port}"}).status_code == 200
            mine = http.get("/v1/models", headers={"Origin": f"http://127.0.0.1:{other_port}"})
            assert openai_error(mine, 403)["code"] == "forbidden_origin"
            assert http.get("/v1/models", headers={"Origin": f"https://127.0.0.1:{port}"}).status_code == 403
    keyed = create_app(
        EchoEngine(), store=InMemoryStore(), api_key="k", allowed_origins=["http://localhost:3000"]
    )
    with serve(keyed) as base, httpx.Client(base_url=base) as http:
        pre = http.options(  # a browser sends no key with a preflight
            "/v1/chat/completions",
            headers={"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"},
        )
        assert (
            pre.status_code == 204 and pre.headers["access-control-allow-origin"] == "http://localhost:3000"
        )
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        r = http.get("/v1/models", headers={"Origin": "http://localhost:3000"})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    with pytest.raises(ConfigError):
        create_app(EchoEngine(), store=InMemoryStore(), allowed_origins=["ok.example"])


def test_health_answers_503_within_its_limit_while_redis_hangs(tmp_path: Path) -> None:
    from convo.stores import RedisStore

    url, proc = start_redis(tmp_path)
    try:
        store = RedisStore(url, socket_timeout_s=10)  # a turn waits this long; /health must not
        with serve(create_app(EchoEngine(), store=store, budget=BUDGET)) as base:  # 1 s for /health
            with httpx.Client(base_url=base, timeout=30) as http:
                assert http.get("/health").json()["status"] == "ok"
                proc.send_signal(signal.SIGSTOP)
                for _ in range(3):
                    t0 = time.monotonic()
                    r = http.get("/health")
                    assert r.status_code == 503 and r.json()["store"] == "unreachable"
                    assert time.monotonic() - t0 < 2.0
                proc.send_signal(signal.SIGCONT)
                deadline = time.monotonic() + 10
                while http.get("/health").status_code != 200:
                    assert time.monotonic() < deadline
                    time.sleep(0.1)
    finally:
        stop_redis(proc)
    assert ServerLimits().health_timeout_s == 1.0


def test_each_request_is_logged_once_without_bodies_or_keys(caplog: pytest.LogCaptureFixture) -> None:
    app = create_app(EchoEngine(), store=InMemoryStore(), api_key="sekrit-key", budget=BUDGET)
    with caplog.at_level(logging.INFO, logger="convo.server.access"):
        with (
            serve(app) as base,
            httpx.Client(base_url=base, headers={"Authorization": "Bearer sekrit-key"}) as http,
        ):
            assert chat(http, "my private words", session="logged").status_code == 200
            body = {"messages": [{"role": "user", "content": "streamed words"}], "stream": True}
            with http.stream("POST", "/v1/chat/completions?key=sekrit-key", json=body) as r:
                assert r.status_code == 200 and list(r.iter_lines())
            assert http.get("/v1/sessions/nope").status_code == 404
            assert (
                httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
            )
            deadline = time.monotonic() + 5
            while len([r for r in caplog.records if r.name == "convo.server.access"]) < 4:
                assert time.monotonic() < deadline
                time.sleep(0.02)
    # (A streamed reply is logged when its stream ends on the server, which may come after
    # the client's next request: the lines are compared in the order of what they say.)
    lines = sorted(r.getMessage() for r in caplog.records if r.name == "convo.server.access")
    assert len(lines) == 4, lines
    for line, (method, path, status) in zip(
        lines,
        [
            ("GET", "/v1/models", 401),
            ("GET", "/v1/sessions/nope", 404),
            ("POST", "/v1/chat/completions", 200),
            ("POST", "/v1/chat/completions", 200),
        ],
        strict=True,
    ):
        said_method, said_path, said_status, ms, unit = line.split(" ")
        assert (said_method, said_path, int(said_status), unit) == (method, path, status, "ms"), line
        assert float(ms) >= 0
    text = "\n".join(lines)
    assert "sekrit" not in text and "private" not in text and "streamed" not in text and "?" not in text


def test_convo_serve_has_the_sdks_flags_and_logs_requests(tmp_path: Path) -> None:
    env = {**os.environ, "CONVO_FAKE_ENGINE": "1"}
    cmd = [
        sys.executable, "-m", "convo.cli", "serve", "--port", "0", "--db", str(tmp_path / "s.db"),
        "--window-turns", "3", "--summary-tokens", "0", "--system-prompt", "Be brief.",
        "--timeout", "5", "--device", "cpu", "--log-level", "info",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stderr is not None
        deadline, line = time.monotonic() + 60, ""
        while time.monotonic() < deadline and "listening on" not in line:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "convo serve exited"
        base = line.split("listening on ")[1].split("/v1")[0]
        with httpx.Client(base_url=base, timeout=30) as http:
            assert chat(http, "hi", session="flags").status_code == 200
            data = http.get("/v1/sessions/flags/export").json()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert data["messages"][0]["role"] == "system" and data["messages"][0]["content"] == "Be brief."
    budget = data["settings"]["budget"]
    assert (budget["window_turns"], budget["summary_tokens"]) == (3, 0)
    assert "convo.server.access: POST /v1/chat/completions 200 " in err, err


def test_chat_stats_shows_the_memory_figures_it_promises() -> None:
    from dataclasses import replace

    from convo import Session
    from convo.cli.chat import HELP, _stats

    assert "memory figures" in HELP
    reply = Session(EchoEngine()).send("hi")
    assert "memory: not measured by this engine" in _stats(reply)  # the echo engine measures none
    assert reply.stats.generation is not None
    measured = replace(
        reply.stats.generation,
        memory_kind="cuda",
        kv_bytes=3 << 20,
        kv_tokens=100,
        peak_allocated_bytes=500 << 20,
        peak_reserved_bytes=600 << 20,
    )
    text = _stats(replace(reply, stats=replace(reply.stats, generation=measured)))
    assert "KV cache 3.0 MiB for 100 tokens" in text and "peak cuda allocated 500.0 MiB" in text


class _UpstreamFails(EchoEngine):
    """A remote engine whose server failed (its URL is internal)."""

    def generate(self, messages: Sequence[Message], **kw: Any) -> Any:
        raise RemoteEngineError(
            "http://10.0.0.7:8001/v1 failed after 3 attempts: 500", status=500, retry_after_s=2
        )


def test_a_failing_remote_engine_is_a_502_in_openai_json() -> None:
    with serve(create_app(_UpstreamFails(), store=InMemoryStore(), budget=BUDGET)) as base:
        with httpx.Client(base_url=base) as http:
            r = chat(http, "x", session="up")
            err = openai_error(r, 502)
            assert (err["code"], err["type"]) == ("upstream_error", "server_error")
            assert "10.0.0.7" not in r.text and r.headers["retry-after"] == "2"
            body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
            with http.stream("POST", "/v1/chat/completions", json=body) as streamed:
                assert streamed.status_code == 502  # no text yet: an HTTP status
        with openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0) as c:
            with pytest.raises(openai.APIStatusError) as failed:
                c.chat.completions.create(model="echo", messages=[{"role": "user", "content": "x"}])
    assert failed.value.status_code == 502 and failed.value.code == "upstream_error"
