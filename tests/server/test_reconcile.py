"""Clients that resend history, clients that send only the new message, and the ``user``
field: a real uvicorn on loopback with the echo engine, driven by the official ``openai``
client and LangChain's ``ChatOpenAI``. The stored history holds each message once."""

from __future__ import annotations

import sqlite3
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import redis_or_skip, serve  # the suite's live-server helper
from hypothesis import given, settings
from hypothesis import strategies as st

from convo import Budget, Message, RedisStore, SQLiteStore
from convo.errors import ConfigError
from convo.messages import ToolCall
from convo.server.app import create_app
from convo.server.limits import ServerLimits
from convo.server.reconcile import Reconciled, reconcile
from convo.stores import Store
from convo.summarize import Summarizer
from convo.testing import EchoEngine

BUDGET = Budget(context_tokens=4000, max_new_tokens=200, window_turns=4, summary_tokens=0)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return SQLiteStore(tmp_path / "reconcile.db")


@pytest.fixture
def url(store: Store) -> Iterator[str]:
    with serve(create_app(EchoEngine(), store=store, budget=BUDGET, model_name="echo")) as base:
        yield base


def stored(url: str, sid: str) -> list[tuple[str, str]]:
    r = httpx.get(f"{url}/v1/sessions/{sid}")
    assert r.status_code == 200, r.text
    return [(m["role"], m["content"]) for m in r.json()["messages"]]


def u(text: str) -> Message:
    return Message(role="user", content=text)


def a(text: str) -> Message:
    return Message(role="assistant", content=text)


# -- the pure rule ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("incoming", "new", "fork_at"),
    [
        (["u1", "a1", "u2", "a2", "u3"], ["u3"], None),  # resend everything
        (["u3"], ["u3"], None),  # only the new message
        (["u2", "a2", "u3"], ["u3"], None),  # a recent window
        (
            [
                "u1",
                "a1",
                "u2*",
            ],
            ["u2*"],
            2,
        ),  # an edited message: fork
        (["u1", "a1", "u2"], [], 3),  # a resent prefix: answer u2 again
        (["u1"], ["u1"], None),  # one message equal to the first: a new message
        (["a2", "u2"], ["u2"], None),  # the stored tail "a2" repeated, then new
        (["u1", "a1 ", "u2", "a2\n", "u3"], ["u3"], None),  # the client's copy, whitespace trimmed
        (["u1", "a1 again", "u3"], ["a1 again", "u3"], 1),  # a word added to a reply: an edit
        (["u1", " u2"], [" u2"], 1),  # the first message, then something else: a fork
    ],
)
def test_reconcile_rule(incoming: list[str], new: list[str], fork_at: int | None) -> None:
    history = [u("u1"), a("a1"), u("u2"), a("a2")]
    msg = {"u": u, "a": a}
    out = reconcile(history, [msg[x.strip()[0]](x) for x in incoming])
    assert [m.content for m in out.new] == new
    assert out.fork_at == fork_at


@pytest.mark.parametrize(
    ("resent", "same"),
    [
        ("**Porto** in *May*:\n\n* trains\n* food\n", True),
        ("__Porto__ in _May_:\n- trains\n- food", True),  # markdown re-rendered, trimmed
        ("  **Porto**   in *May*:  \n\n\n\n* trains\n* food", True),
        ("**Porto** in *June*:\n\n* trains\n* food\n", False),  # a word changed
        ("**Porto** in *May*:\n\n* trains\n", False),  # a word dropped
    ],
)
def test_an_assistant_reply_matches_by_its_words(resent: str, same: bool) -> None:
    reply = "**Porto** in *May*:\n\n* trains\n* food\n"
    out = reconcile([u("plan"), a(reply)], [u("plan"), a(resent), u("more")])
    assert (out.fork_at is None) is same


def test_a_user_edit_forks_but_whitespace_does_not() -> None:
    history = [u("plan a trip"), a("ok"), u("to Porto")]
    assert reconcile(history, [u("plan  a trip\n"), a("ok"), u("to Porto "), a("x"), u("y")]).fork_at is None
    assert reconcile(history, [u("plan a trip"), a("ok"), u("to Porto!")]).fork_at == 2


def test_tool_arguments_match_as_json() -> None:
    def call(arguments: str) -> Message:
        return Message(
            role="assistant", content="", tool_calls=(ToolCall(id="c1", name="f", arguments=arguments),)
        )

    history = [u("q"), call('{"city": "Porto", "days": [1, 2]}')]
    assert reconcile(history, [u("q"), call('{"days":[1,2],"city":"Porto"}'), u("n")]).new == (u("n"),)
    assert reconcile(history, [u("q"), call('{"city": "Lisbon", "days": [1, 2]}'), u("n")]).fork_at == 1


def test_a_window_is_aligned_where_it_starts_not_at_an_equal_first_message() -> None:
    history = [u("hi"), a("h1"), u("u2"), a("a2"), u("hi"), a("h2"), u("u4"), a("a4")]
    assert reconcile(history, [u("hi"), a("h2"), u("u4"), a("a4"), u("u5")]).new == (u("u5"),)
    # A window that diverges is anchored where it repeats the stored run, not at the start.
    out = reconcile(history, [u("hi"), a("h2"), u("u4*")])
    assert (out.fork_at, out.new) == (6, (u("u4*"),))
    # One equal message in the middle is no anchor: a new message.
    assert reconcile(history, [u("u2"), u("more")]) == Reconciled(new=(u("u2"), u("more")))


@settings(max_examples=200, deadline=None)
@given(modes=st.lists(st.sampled_from(["all", "new", "window"]), min_size=1, max_size=12), data=st.data())
def test_property_each_message_stored_once_whatever_the_client_resends(modes: list[str], data: Any) -> None:
    """Whatever mix of resend-everything, only-new and recent-window requests a client
    makes, the stored conversation is the conversation, each message once."""
    stored: list[Message] = []
    truth: list[Message] = []
    for turn, mode in enumerate(modes):
        question = u(f"q{turn} " + data.draw(st.sampled_from(["", "again", "hi"])))
        if mode == "all":
            incoming = [*truth, question]
        elif mode == "new":
            incoming = [question]
        else:
            w = data.draw(st.integers(1, max(1, len(truth))))
            incoming = [*truth[-w:], question]
        out = reconcile(stored, incoming)
        assert out.fork_at is None
        stored += out.new
        truth.append(question)
        answer = a(f"a{turn}")
        stored.append(answer)  # the server's reply
        truth.append(answer)
    assert stored == truth


# -- live server, official client -------------------------------------------------------------


def test_openai_client_resending_everything_stores_each_message_once(url: str) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "be brief"}]
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:
        for i in range(4):
            messages.append({"role": "user", "content": f"question {i}"})
            out = c.chat.completions.create(
                model="echo", messages=messages, metadata={"session_id": "carol-1"}
            )
            messages.append({"role": "assistant", "content": out.choices[0].message.content})
    assert stored(url, "carol-1") == [(m["role"], m["content"]) for m in messages]


def test_openai_client_sending_only_new_messages(url: str) -> None:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:
        replies = []
        for i in range(3):
            out = c.chat.completions.create(
                model="echo",
                messages=[{"role": "user", "content": f"q{i}"}],
                extra_headers={"X-Session-Id": "dana"},
            )
            replies.append(out.choices[0].message.content)
    assert replies == ["heard 1: q0", "heard 3: q1", "heard 5: q2"]  # the server kept the rest
    assert stored(url, "dana") == [
        ("user", "q0"), ("assistant", replies[0]), ("user", "q1"),
        ("assistant", replies[1]), ("user", "q2"), ("assistant", replies[2]),
    ]  # fmt: skip


def test_tool_calls_resent_by_an_agent_are_stored_once(url: str) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Porto"}'}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "weather in Porto?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:
        out = c.chat.completions.create(
            model="echo", messages=messages, extra_headers={"X-Session-Id": "agent"}
        )
        messages.append({"role": "assistant", "content": out.choices[0].message.content})
        messages.append({"role": "user", "content": "and tomorrow?"})
        c.chat.completions.create(model="echo", messages=messages, extra_headers={"X-Session-Id": "agent"})
    roles = [r for r, _ in stored(url, "agent")]
    assert roles == ["user", "assistant", "tool", "assistant", "user", "assistant"]


def test_divergence_forks_and_the_replaced_tail_stays_readable(url: str) -> None:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:

        def ask(messages: list[dict[str, Any]]) -> Any:
            return c.chat.completions.create(model="echo", messages=messages, metadata={"session_id": "ed"})

        first = ask([{"role": "user", "content": "plan a trip to Porto"}])
        a1 = first.choices[0].message.content
        start = [{"role": "user", "content": "plan a trip to Porto"}, {"role": "assistant", "content": a1}]
        ask([*start, {"role": "user", "content": "in May"}])
        edited = ask([*start, {"role": "user", "content": "in June"}])  # the client edited its turn
    assert edited.model_extra is not None and edited.model_extra["convo"]["forked"] == "ed~1"
    now = stored(url, "ed")
    assert [c for _, c in now][:3] == ["plan a trip to Porto", a1, "in June"] and len(now) == 4
    replaced = stored(url, "ed~1")
    assert [c for _, c in replaced][2] == "in May" and len(replaced) == 4


def test_deleting_a_session_deletes_its_forks(url: str, store: Store) -> None:
    """After DELETE of X, its fork X~1 is gone too (it answered the old tail before)."""
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:

        def ask(messages: list[dict[str, Any]]) -> Any:
            return c.chat.completions.create(model="echo", messages=messages, metadata={"session_id": "del"})

        a1 = ask([{"role": "user", "content": "plan a trip to Porto"}]).choices[0].message.content
        start = [{"role": "user", "content": "plan a trip to Porto"}, {"role": "assistant", "content": a1}]
        ask([*start, {"role": "user", "content": "in May"}])
        assert ask([*start, {"role": "user", "content": "in June"}]).model_extra["convo"]["forked"] == "del~1"
    assert httpx.get(f"{url}/v1/sessions/del~1").status_code == 200
    assert httpx.delete(f"{url}/v1/sessions/del").status_code == 200
    assert httpx.get(f"{url}/v1/sessions/del~1").status_code == 404
    assert [sid for sid in store.list_sessions() if sid.startswith("del")] == []


def test_user_field_is_not_a_session_unless_the_server_says_so(store: Store) -> None:
    secret = [{"role": "system", "content": "A's system"}, {"role": "user", "content": "my secret is 42"}]
    other = [{"role": "system", "content": "B's system"}, {"role": "user", "content": "hello"}]
    with serve(create_app(EchoEngine(), store=store, budget=BUDGET)) as base:
        with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) as c:
            c.chat.completions.create(model="echo", messages=secret, user="alice@example.com")
            b = c.chat.completions.create(model="echo", messages=other, user="alice@example.com")
    assert b.choices[0].message.content == "heard 2: hello"  # chat B saw only itself
    assert store.list_sessions() == []  # stateless: nothing stored under the user's name
    with serve(create_app(EchoEngine(), store=store, budget=BUDGET, session_from_user=True)) as base:
        with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) as c:
            c.chat.completions.create(model="echo", messages=secret, user="alice-chat-1")
            with pytest.raises(openai.BadRequestError) as bad:  # a user that is no session id
                c.chat.completions.create(model="echo", messages=secret, user="alice chat 2")
            assert (bad.value.param, bad.value.code) == ("user", "invalid_session_id")
    assert store.list_sessions() == ["alice-chat-1"]


# -- live server, LangChain's ChatOpenAI --------------------------------------------------------


def test_langchain_chat_openai_resending_history(url: str) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model="echo",
        base_url=f"{url}/v1",
        api_key="unused",  # type: ignore[arg-type]
        max_retries=0,
        default_headers={"X-Session-Id": "lc-1"},
    )
    history: list[Any] = [SystemMessage("be brief")]
    for i in range(3):
        history.append(HumanMessage(f"turn {i}"))
        history.append(llm.invoke(history))
    assert all(isinstance(m, AIMessage) for m in history[2::2])
    assert stored(url, "lc-1") == [
        ("system" if isinstance(m, SystemMessage) else "user" if isinstance(m, HumanMessage) else "assistant",
         m.content)
        for m in history
    ]  # fmt: skip


# -- /metrics through prometheus_client ----------------------------------------------------------


def test_metrics_names_say_what_they_count(url: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:
        c.chat.completions.create(model="echo", messages=[{"role": "user", "content": "hi"}])
    r = httpx.get(f"{url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}  # parses: valid exposition
    # The server's ledger counts tokens, and says so (it once reported them as bytes).
    budget = families["convo_kv_budget_tokens"].samples[0].value
    assert budget == 65536  # ServerLimits.admission_tokens
    assert "convo_kv_budget_bytes" not in families and "convo_kv_tokens_in_use" in families
    assert families["convo_generated_tokens"].samples[0].value == 3  # counter: _total on the sample
    assert families["convo_requests_admitted"].type == "counter"
    assert families["convo_queue_wait_seconds"].type == "histogram"
    assert "process_cpu_seconds" in families  # the process collector comes with prometheus_client


def test_metrics_export_the_engine_schedulers_counters(store: Store) -> None:
    """An engine with a scheduler (``scheduler_stats``) gets ``convo_engine_*`` counters on
    /metrics; one without (the echo engine above) gets none."""
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from convo.fast.scheduler import SchedulerStats
    from convo.server import create_app
    from convo.testing import EchoEngine

    class Batching(EchoEngine):
        scheduler_stats = SchedulerStats(
            steps={"decode": 7, "mixed": 3, "prefill": 1},
            busy_s={"decode": 0.05, "mixed": 0.06, "prefill": 0.02},
            decode_rows=40,
            prompt_tokens=900,
            preemptions=2,
            novel_prompt_tokens=700,
            prompt_tokens_by_work={"reply": 600, "background": 100, "prefill": 200},
            novel_tokens_by_work={"reply": 500, "background": 100, "prefill": 100},
            recomputed_tokens=40,
        )

    for engine, exported in ((Batching(), True), (EchoEngine(), False)):
        with TestClient(create_app(engine, store=store), base_url="http://127.0.0.1") as client:
            text = client.get("/metrics").text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert ("convo_engine_steps" in families) is exported
        if exported:
            steps = {s.labels["kind"]: s.value for s in families["convo_engine_steps"].samples}
            busy = {s.labels["kind"]: s.value for s in families["convo_engine_busy_seconds"].samples}
            assert steps == {"decode": 7, "mixed": 3, "prefill": 1} and busy["mixed"] == 0.06
            assert families["convo_engine_prompt_tokens"].samples[0].value == 900
            novel = families["convo_engine_novel_prompt_tokens"]
            assert novel.type == "counter" and novel.samples[0].value == 700
            assert novel.samples[0].name == "convo_engine_novel_prompt_tokens_total"
            assert families["convo_engine_preemptions"].type == "counter"
            work = families["convo_engine_work_prompt_tokens"]
            assert {s.labels["work"]: s.value for s in work.samples} == {
                "reply": 600, "background": 100, "prefill": 200,
            }  # fmt: skip
            novel_work = families["convo_engine_work_novel_prompt_tokens"].samples
            assert {s.labels["work"]: s.value for s in novel_work}["prefill"] == 100
            assert families["convo_engine_recomputed_prompt_tokens"].samples[0].value == 40


def test_convo_serve_has_the_user_flag() -> None:
    from convo.cli import build_parser

    assert build_parser().parse_args(["serve"]).session_from_user is False
    assert build_parser().parse_args(["serve", "--session-from-user"]).session_from_user is True


# -- live server: ordinary client behaviour that is no divergence (issue 27, defect 4) -------------


def forks(store: Store, sid: str) -> list[str]:
    return [s for s in store.list_sessions() if s.startswith(f"{sid}~")]


def rerender(markdown: str) -> str:
    """What a chat UI's copy of a reply looks like: markdown re-rendered, whitespace trimmed."""
    lines = [line.strip().replace("* ", "- ", 1) for line in markdown.replace("**", "__").splitlines()]
    return "\n".join(line for line in lines if line).strip()


def test_a_client_keeping_an_edited_copy_of_the_replies_never_forks(url: str, store: Store) -> None:
    messages: list[dict[str, Any]] = []
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:
        for i in range(25):
            messages.append({"role": "user", "content": f"**point {i}**\n\n\n* item  {i}  "})
            out = c.chat.completions.create(model="echo", messages=messages, metadata={"session_id": "copy"})
            assert out.model_extra is not None and out.model_extra["convo"]["forked"] is None
            reply = out.choices[0].message.content
            assert reply is not None and rerender(reply) != reply  # the client's copy differs
            messages.append({"role": "assistant", "content": rerender(reply)})
    now = stored(url, "copy")
    assert len(now) == 50 and forks(store, "copy") == []  # 50 messages stored, once each
    assert [r for r, _ in now] == ["user", "assistant"] * 25
    assert now[1][1].startswith("heard 1: **point 0**")  # the server's own reply is kept


def test_a_window_starting_with_a_repeated_first_message_does_not_fork(url: str, store: Store) -> None:
    truth: list[dict[str, Any]] = []
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:
        for text in ["hi", "u2", "hi", "u4", "u5", "hi", "u7"]:
            window = [*truth[-4:], {"role": "user", "content": text}]  # the last two turns and the new one
            out = c.chat.completions.create(model="echo", messages=window, metadata={"session_id": "hi"})
            assert out.model_extra is not None and out.model_extra["convo"]["forked"] is None
            truth += [window[-1], {"role": "assistant", "content": out.choices[0].message.content}]
    assert stored(url, "hi") == [(m["role"], m["content"]) for m in truth]
    assert forks(store, "hi") == []


def test_tool_call_arguments_reserialized_do_not_fork(url: str, store: Store) -> None:
    def call(arguments: str) -> dict[str, Any]:
        return {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": arguments}}

    first = [
        {"role": "user", "content": "weather in Porto?"},
        {"role": "assistant", "content": None, "tool_calls": [call('{"city": "Porto", "unit": "C"}')]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:
        out = c.chat.completions.create(model="echo", messages=first, extra_headers={"X-Session-Id": "args"})
        again = [
            first[0],
            {**first[1], "tool_calls": [call('{"unit":"C","city":"Porto"}')]},  # another serializer
            first[2],
            {"role": "assistant", "content": out.choices[0].message.content},
            {"role": "user", "content": "and tomorrow?"},
        ]
        second = c.chat.completions.create(
            model="echo", messages=again, extra_headers={"X-Session-Id": "args"}
        )
    assert second.model_extra is not None and second.model_extra["convo"]["forked"] is None
    assert [r for r, _ in stored(url, "args")] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
        "assistant",
    ]
    assert forks(store, "args") == []


def test_a_trimmed_window_that_diverges_forks_where_it_diverges(url: str, store: Store) -> None:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:
        truth: list[dict[str, Any]] = []
        for text in ["u1", "u2", "u3"]:
            truth.append({"role": "user", "content": text})
            out = c.chat.completions.create(model="echo", messages=truth, metadata={"session_id": "win"})
            truth.append({"role": "assistant", "content": out.choices[0].message.content})
        window = [*truth[2:4], {"role": "user", "content": "u3, edited"}]  # u2 a2 u3*
        out = c.chat.completions.create(model="echo", messages=window, metadata={"session_id": "win"})
    assert out.model_extra is not None and out.model_extra["convo"]["forked"] == "win~1"
    now = stored(url, "win")
    assert [m for _, m in now[:5]] == [m["content"] for m in truth[:4]] + ["u3, edited"] and len(now) == 6
    assert stored(url, "win~1") == [(m["role"], m["content"]) for m in truth]


def test_a_streamed_response_reports_its_fork(url: str, store: Store) -> None:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:
        plan = {"role": "user", "content": "plan a trip"}
        first = c.chat.completions.create(model="echo", messages=[plan], metadata={"session_id": "st"})
        start = [plan, {"role": "assistant", "content": first.choices[0].message.content}]
        c.chat.completions.create(
            model="echo",
            messages=[*start, {"role": "user", "content": "in May"}],
            metadata={"session_id": "st"},
        )
        raw = c.chat.completions.with_raw_response.create(
            model="echo",
            messages=[*start, {"role": "user", "content": "in June"}],  # edited: a fork
            metadata={"session_id": "st"},
            stream=True,
        )
        header = raw.headers.get("x-convo-forked")  # known before the stream starts
        chunks = list(raw.parse())
    assert header == "st~1"
    final = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(final) == 1 and final[0].model_extra is not None
    assert final[0].model_extra["convo"]["forked"] == "st~1"
    assert final[0].model_extra["convo"]["session_id"] == "st"
    assert stored(url, "st~1")[2] == ("user", "in May") and len(stored(url, "st~1")) == 4
    assert stored(url, "st")[2] == ("user", "in June") and len(stored(url, "st")) == 4


def test_forks_per_session_are_bounded_the_oldest_dropped(store: Store) -> None:
    limits = ServerLimits(max_forks_per_session=2)
    app = create_app(EchoEngine(), store=store, budget=BUDGET, model_name="echo", limits=limits)
    with serve(app) as base, openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) as c:
        reported = []
        for i in range(5):  # "start", then "start" + another second message each time: a fork each
            versions = [{"role": "user", "content": f"version {i}"}] if i else []
            out = c.chat.completions.create(
                model="echo",
                messages=[{"role": "user", "content": "start"}, *versions],
                metadata={"session_id": "b"},
            )
            assert out.model_extra is not None
            reported.append(out.model_extra["convo"]["forked"])
        assert httpx.get(f"{base}/v1/sessions/b~1").status_code == 404
    assert reported == [None, "b~1", "b~2", "b~3", "b~4"]
    assert forks(store, "b") == ["b~3", "b~4"]  # the two newest; numbers are not reused
    assert [m for _, m in stored_in(store, "b~4")][:2] == ["start", "version 3"]
    assert [m for _, m in stored_in(store, "b")][:2] == ["start", "version 4"]
    with pytest.raises(ConfigError):
        ServerLimits(max_forks_per_session=0)


def stored_in(store: Store, sid: str) -> list[tuple[str, str]]:
    return [(m.role.value, m.content) for m in store.load(sid)[1]]


# -- forks share the prefix ----------------------------------------------------------------------


def raw_message_count(path: Path) -> int:
    """Every message row the SQLite file holds (all sessions, forks included)."""
    with sqlite3.connect(path) as db:
        return int(db.execute("SELECT COUNT(*) FROM messages").fetchone()[0])


def test_forks_store_only_their_tail_and_read_whole(tmp_path: Path) -> None:
    """The issue's client re-edits its last message every turn: storage grows with the
    messages, not with their square; every fork reads (and exports) its whole history."""
    path = tmp_path / "share.db"
    store = SQLiteStore(path)
    app = create_app(
        EchoEngine(),
        store=store,
        budget=BUDGET,
        model_name="echo",
        limits=ServerLimits(max_forks_per_session=50),
    )
    olds: list[list[dict[str, Any]]] = []
    with serve(app) as base, openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) as c:
        hello = {"role": "user", "content": "hello"}
        out = c.chat.completions.create(model="echo", messages=[hello], metadata={"session_id": "e"})
        truth: list[dict[str, Any]] = [
            hello,
            {"role": "assistant", "content": out.choices[0].message.content},
        ]
        for i in range(12):
            q = {"role": "user", "content": f"q{i}"}
            out = c.chat.completions.create(model="echo", messages=[*truth, q], metadata={"session_id": "e"})
            olds.append([*truth, q, {"role": "assistant", "content": out.choices[0].message.content}])
            q = {"role": "user", "content": f"q{i}, edited"}
            out = c.chat.completions.create(model="echo", messages=[*truth, q], metadata={"session_id": "e"})
            assert out.model_extra is not None and out.model_extra["convo"]["forked"] == f"e~{i + 1}"
            truth += [q, {"role": "assistant", "content": out.choices[0].message.content}]
        for i, old in enumerate(olds):  # each fork: the history the client replaced, whole
            assert stored(base, f"e~{i + 1}") == [(m["role"], m["content"]) for m in old]
            export = httpx.get(f"{base}/v1/sessions/e~{i + 1}/export").json()
            assert [r["content"] for r in export["messages"]] == [m["content"] for m in old]
        assert stored(base, "e") == [(m["role"], m["content"]) for m in truth]
        assert raw_message_count(path) == 26 + 12 * 2  # the session, then 2 per fork (full copies: 192)
        # An edit earlier than the forks' shared prefix: they keep their history whole.
        q = {"role": "user", "content": "q0, edited again"}
        out = c.chat.completions.create(model="echo", messages=[*truth[:2], q], metadata={"session_id": "e"})
        assert out.model_extra is not None and out.model_extra["convo"]["forked"] == "e~13"
        for i, old in enumerate(olds):
            assert stored(base, f"e~{i + 1}") == [(m["role"], m["content"]) for m in old]
        assert stored(base, "e~13") == [(m["role"], m["content"]) for m in truth]
        assert len(stored(base, "e")) == 4  # hello, its answer, the new q0 and its answer
        assert httpx.delete(f"{base}/v1/sessions/e").status_code == 200
        assert httpx.get(f"{base}/v1/sessions/e~3").status_code == 404  # a fork goes with its parent


def test_a_refused_turn_after_a_fork_leaves_the_forks_whole(url: str, store: Store) -> None:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:
        plan = {"role": "user", "content": "plan"}
        first = c.chat.completions.create(model="echo", messages=[plan], metadata={"session_id": "r"})
        start = [plan, {"role": "assistant", "content": first.choices[0].message.content}]
        for month in ("May", "June"):
            edit = [*start, {"role": "user", "content": month}]
            c.chat.completions.create(model="echo", messages=edit, metadata={"session_id": "r"})
        before = stored(url, "r"), stored(url, "r~1")
        bad = {"role": "tool", "tool_call_id": "nope", "content": "?"}  # answers no call: 400
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(model="echo", messages=[*start, bad], metadata={"session_id": "r"})
    assert (stored(url, "r"), stored(url, "r~1")) == before
    assert forks(store, "r") == ["r~1"]


# -- an edit of the first message ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("incoming", "new", "fork_at"),
    [
        (["u1*", "a1", "u2", "a2", "u3"], ["u1*", "a1", "u2", "a2", "u3"], 0),  # edited, then more
        (["u1*", "a1", "u2"], ["u1*", "a1", "u2"], 0),  # edited, and u2 answered again
        (["u1*"], ["u1*"], None),  # one message: a new one (an only-new client sends the same)
        (["u1*", "u2"], ["u1*", "u2"], None),  # nothing after it lines up: new messages
    ],
)
def test_an_edit_of_the_first_message_forks_at_it(
    incoming: list[str], new: list[str], fork_at: int | None
) -> None:
    history = [u("u1"), a("a1"), u("u2"), a("a2")]
    msg = {"u": u, "a": a}
    out = reconcile(history, [msg[x[0]](x) for x in incoming])
    assert [m.content for m in out.new] == new
    assert out.fork_at == fork_at


def test_an_edit_of_the_first_message_of_a_one_turn_session_forks() -> None:
    """The rest of the history is one reply: resent at its place, it lines the edit up."""
    out = reconcile([u("u1"), a("a1")], [u("u1*"), a("a1"), u("u2")])
    assert (out.fork_at, [m.content for m in out.new]) == (0, ["u1*", "a1", "u2"])


def test_a_resend_client_editing_its_first_message_does_not_duplicate_history(url: str, store: Store) -> None:
    """A resend client (ChatOpenAI, the openai SDK) that edits its first user message and
    goes on: the session holds the client's conversation once, the old one is a fork (it
    held the old history and then the whole edited copy after it)."""
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as c:

        def ask(messages: list[dict[str, Any]]) -> Any:
            return c.chat.completions.create(
                model="echo",
                messages=[{"role": "system", "content": "be brief"}, *messages],
                metadata={"session_id": "first"},
            )

        truth: list[dict[str, Any]] = []
        for text in ["plan a trip to Porto", "in May"]:
            truth.append({"role": "user", "content": text})
            truth.append({"role": "assistant", "content": ask(truth).choices[0].message.content})
        old = [(m["role"], m["content"]) for m in truth]
        truth[0] = {"role": "user", "content": "plan a trip to Lisbon"}  # the client edits its first turn
        truth.append({"role": "user", "content": "with trains"})
        out = ask(truth)
    assert out.model_extra is not None and out.model_extra["convo"]["forked"] == "first~1"
    now = stored(url, "first")
    assert now[0] == ("system", "be brief")
    assert now[1:-1] == [(m["role"], m["content"]) for m in truth]  # each message once
    assert now[-1][0] == "assistant" and len(now) == 1 + len(truth) + 1
    assert stored(url, "first~1") == [("system", "be brief"), *old]


# -- what a request reads ------------------------------------------------------------------------


class CountingStore(SQLiteStore):
    """Counts the messages its reads hand back."""

    read = 0

    def load(self, session_id: str) -> Any:
        state, messages = super().load(session_id)
        self.read += len(messages)
        return state, messages

    def load_tail(self, session_id: str, after: int) -> Any:
        tail = super().load_tail(session_id, after)
        self.read += len(tail.messages)
        return tail


def test_a_server_new_to_a_session_reads_its_window_for_a_new_message(tmp_path: Path) -> None:
    """The first request on a long session in a new server process (a client that sends
    only its new message) reads the window, not the whole history; a refused one still
    leaves the session as it was."""
    from convo.budget import OversizePolicy
    from convo.session import Session

    budget = Budget(
        context_tokens=4000,
        max_new_tokens=200,
        window_turns=4,
        summary_tokens=0,
        oversize=OversizePolicy.RAISE,
    )
    path = tmp_path / "long.db"
    seeded = Session(EchoEngine(), budget=budget, store=SQLiteStore(path), session_id="long")
    for i in range(60):
        seeded.send(f"question {i}")
    store = CountingStore(path)  # a new process: nothing of "long" known
    with serve(create_app(EchoEngine(), store=store, budget=budget, model_name="echo")) as url:
        body = {"model": "echo", "messages": [{"role": "user", "content": "one more"}]}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"X-Session-Id": "long"})
        assert r.status_code == 200, r.text
        assert store.read < 20  # the window's turns, not 120 messages
        before = stored(url, "long")
        # A refused request (a message larger than the prompt) on it stores nothing.
        store.read = 0
        big = {**body, "messages": [{"role": "user", "content": "word " * 5000}]}
        r = httpx.post(f"{url}/v1/chat/completions", json=big, headers={"X-Session-Id": "long"})
        assert r.status_code == 400, r.text
        assert stored(url, "long") == before
    assert len(before) == 122 and before[-2] == ("user", "one more")


# -- a fork fences the background summary of the history it replaced ---------------------------


class _Gated(Summarizer):
    """Folds ``messages`` into their first words, once ``gate`` is set."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()

    def summarize(self, *, previous: str, messages: Sequence[Message], max_tokens: int) -> str:
        self.started.set()
        assert self.gate.wait(10), "test gate never opened"
        return " ".join(m.content.split()[0] for m in messages)[:max_tokens]


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_a_summary_of_the_replaced_history_never_lands_after_a_fork_on_another_replica(
    kind: str, tmp_path: Path
) -> None:
    """Replica A is still folding turns into the summary when a client's edit reaches
    replica B, which forks the session there (the replaced turns move to ``~1``): A's
    summary, written from the turns the fork replaced, must not become the session's."""
    from convo.session import Session, SummaryConfig
    from convo.summarize import JobStatus, SummaryWorker

    tight = Budget(
        context_tokens=700, max_new_tokens=50, window_turns=1, summarize_batch_turns=2, summary_tokens=40
    )
    store_a: Store
    store_b: Store
    if kind == "sqlite":
        store_a, store_b = SQLiteStore(tmp_path / "r.db"), SQLiteStore(tmp_path / "r.db")
    else:
        url = redis_or_skip()
        prefix = f"convo-test:{uuid.uuid4().hex}:"
        store_a, store_b = RedisStore(url, prefix=prefix), RedisStore(url, prefix=prefix)
    worker_a = SummaryWorker(threads=1, max_defer_s=0.0)
    summ = _Gated()
    try:
        a_side = Session(
            EchoEngine(),
            budget=tight,
            store=store_a,
            session_id="sh",
            summarizing=SummaryConfig(summarizer=summ, worker=worker_a, wait_s=0),
        )
        for i in range(3):
            a_side.send(f"dropped{i} " + "w " * 100)
        assert summ.started.wait(10)  # replica A is folding the turns now
        job = worker_a.job(store_a, "sh")
        assert job is not None and (job.start, job.end) == (0, 2)  # turns 0 and 1
        _, history = store_b.load("sh")
        first = [{"role": m.role.value, "content": m.content} for m in history[:2]]
        quiet = Budget(context_tokens=700, max_new_tokens=50, window_turns=1, summary_tokens=0)
        with serve(create_app(EchoEngine(), store=store_b, budget=quiet, model_name="echo")) as base:
            body = {"model": "echo", "messages": [*first, {"role": "user", "content": "edited"}]}
            r = httpx.post(f"{base}/v1/chat/completions", json=body, headers={"X-Session-Id": "sh"})
            assert r.status_code == 200, r.text
            assert r.json()["convo"]["forked"] == "sh~1"
            summ.gate.set()
            assert job.wait(10)
            assert job.status is JobStatus.CANCELLED  # refused: the session it read is gone
        state, _ = store_b.load("sh")
        assert "dropped1" not in state.summary  # turn 1 was replaced by the fork
    finally:
        summ.gate.set()
        worker_a.close(wait=False)
        store_a.close()
        store_b.close()
