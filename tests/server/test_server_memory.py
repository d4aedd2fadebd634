"""Retrieval memory in the server, driven by the official openai client on a live uvicorn:
a session retrieves its evicted turns, a person's sessions share one memory, deletes
forget, other keys read nothing, and the cache stays bounded."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import HashEncoder, serve

from convo import Budget, SQLiteStore
from convo.messages import Message, Role
from convo.plan import Turn
from convo.server.app import create_app
from convo.server.auth import key_owner
from convo.server.memory import ServerMemory, person_scope
from convo.session.ahead import drain_ahead
from convo.stores import SessionState, Store
from convo.testing import EchoEngine

#: Two turns in the window, no summary: what leaves is only in retrieval memory.
BUDGET = Budget(
    context_tokens=2048, max_new_tokens=64, window_turns=2, summarize_batch_turns=1, summary_tokens=0
)
FACT = "My cat is called Miso and she loves cardboard boxes."


def client(url: str, key: str = "k1") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = SQLiteStore(tmp_path / "sessions.db")
    yield s
    s.close()


@pytest.fixture
def memory(store: Store) -> ServerMemory:
    return ServerMemory(store, HashEncoder())


@pytest.fixture
def url(store: Store, memory: ServerMemory) -> Iterator[str]:
    app = create_app(EchoEngine(), store=store, api_key=["k1", "k2"], budget=BUDGET, memory=memory)
    with serve(app) as base:
        yield base


def chat(c: openai.OpenAI, text: str, sid: str, user: str | None = None) -> Any:
    extra: dict[str, Any] = {"metadata": {"session_id": sid}}
    if user is not None:
        extra["user"] = user
    return c.chat.completions.create(model="echo", messages=[{"role": "user", "content": text}], **extra)


def passages(reply: Any) -> list[dict[str, Any]]:
    return list((reply.model_extra or {})["convo"]["passages"])


def filler(c: openai.OpenAI, sid: str, n: int, user: str | None = None) -> None:
    for i in range(n):
        chat(c, f"unrelated chatter number {i} about the weather and trains", sid, user)


def test_a_session_retrieves_its_evicted_turns_and_cites_them(url: str, store: Store) -> None:
    with client(url) as c:
        chat(c, FACT, "s1")
        filler(c, "s1", 4)
        reply = chat(c, "What is my cat called?", "s1")
        used = passages(reply)
        assert used and used[0]["source"] == "turn 0" and used[0]["turn"] == 0
        assert "Miso" in str(reply.choices[0].message.content) or used  # echo: the prompt is what counts
        # Its memory is in the store, in its export.
        exported = httpx.get(f"{url}/v1/sessions/s1/export", headers={"Authorization": "Bearer k1"}).json()
        assert exported["memory"] and any(FACT in str(r["messages"]) for r in exported["memory"])


def test_streaming_replies_list_the_passages_too(url: str) -> None:
    with client(url) as c:
        chat(c, FACT, "st")
        filler(c, "st", 4)
        stream = c.chat.completions.create(
            model="echo",
            messages=[{"role": "user", "content": "What is my cat called?"}],
            metadata={"session_id": "st"},
            stream=True,
        )
        last = [chunk for chunk in stream][-1]
        assert (last.model_extra or {})["convo"]["passages"][0]["turn"] == 0


def test_a_miss_rebuilds_from_the_store_without_the_embedder(store: Store, url: str) -> None:
    with client(url) as c:
        chat(c, FACT, "s2")
        filler(c, "s2", 4)
    # A second replica on the same store, empty cache: its first retrieval rebuilds.
    encoder = HashEncoder()
    other = ServerMemory(store, encoder)
    view = other.view(owner=key_owner("k1"))
    found = view.retrieve("What is my cat called?", session_id="s2", top_k=3)
    assert found and found[0].meta["turn"] == 0
    assert encoder.calls == 1  # only the query: every indexed text came from the store
    assert other.stats().misses == 1


def test_window_turns_wait_in_process_and_a_cold_index_catches_them_up(store: Store, url: str) -> None:
    # A session's own memory indexes a turn when it leaves the window (its passages would
    # be dropped meanwhile); a replica whose index is cold (a restart, kill -9) catches every
    # completed turn up on its first turn, so that the store holds all of them again.
    with client(url) as c:
        chat(c, FACT, "w1")
        chat(c, "hello", "w1")
    assert store.memory_log("w1").count == 0  # both turns are in the window
    other = ServerMemory(store, HashEncoder())
    app = create_app(EchoEngine(), store=store, api_key=["k1"], budget=BUDGET, memory=other)
    with serve(app) as base, client(base) as c:
        chat(c, "one more", "w1")
    records = [r for r in store.export_session("w1")["memory"]]
    turns = {r["turn"] for r in records if "turn" in r}
    assert turns == {0, 1}


def test_deleting_a_session_deletes_its_memory(url: str, store: Store, memory: ServerMemory) -> None:
    with client(url) as c:
        chat(c, FACT, "gone")
        filler(c, "gone", 3)
        assert store.memory_log("gone").count > 0
        c.delete("/sessions/gone", cast_to=httpx.Response)
    assert store.memory_log("gone").count == 0
    found = memory.view(owner=key_owner("k1")).retrieve("cat", session_id="gone", top_k=3)
    assert found == []


def test_a_person_remembers_across_sessions_and_only_for_their_key(url: str, store: Store) -> None:
    with client(url) as c:
        chat(c, FACT, "monday", user="alice")
        filler(c, "monday", 2, user="alice")
        reply = chat(c, "What is my cat called?", "tuesday", user="alice")
        used = passages(reply)
        assert used and used[0]["session_id"] == "monday" and used[0]["date"]
        assert used[0]["source"] == "session monday turn 0"
        # Without the person: the new session has nothing of monday.
        assert passages(chat(c, "What is my cat called?", "wednesday")) == []
    with client(url, "k2") as c:  # another key's alice is another person
        assert passages(chat(c, "What is my cat called?", "k2-session", user="alice")) == []
        seen = c.get("/users/alice/memory", cast_to=httpx.Response).json()
        assert seen["sessions"] == []
    with client(url) as c:
        seen = c.get("/users/alice/memory", cast_to=httpx.Response).json()
        # (tuesday has no completed turn yet: nothing of it is indexed)
        assert [s["session_id"] for s in seen["sessions"]] == ["monday"]
        assert FACT in str(seen["sessions"][0]["turns"][0])


def test_forgetting_a_person_removes_their_memory_and_indexes(
    url: str, store: Store, memory: ServerMemory
) -> None:
    with client(url) as c:
        chat(c, FACT, "p1", user="bob")
        filler(c, "p1", 2, user="bob")
        done = c.delete("/users/bob/memory", cast_to=httpx.Response).json()
        assert done["deleted"] and done["sessions"] == ["p1"] and done["records_deleted"] > 0
        scope = person_scope(key_owner("k1"), "bob")
        assert store.memory_log(scope).count == 0
        # p1 keeps one row: "its first 3 turns are forgotten", no text of them.
        assert [r["op"] for r in store.memory_log("p1").records] == ["floor"]
        assert "Miso" not in str(store.memory_log("p1").records)
        # A new session of bob finds nothing of p1.
        assert passages(chat(c, "What is my cat called?", "p2", user="bob")) == []
        # p1 goes on: what it said before is not indexed again, what it says now is.
        chat(c, "My hamster is called Pip.", "p1", user="bob")
        filler(c, "p1", 2, user="bob")
        cited = passages(chat(c, "What are my cat and hamster called?", "p3", user="bob"))
        assert cited and all(p["session_id"] == "p1" and p["turn"] >= 3 for p in cited), cited


def test_bad_user_ids_are_refused(url: str) -> None:
    with client(url) as c, pytest.raises(openai.BadRequestError):
        c.chat.completions.create(
            model="echo",
            messages=[{"role": "user", "content": "hi"}],
            metadata={"session_id": "u1", "user_id": "x" * 500},
        )


def test_metrics_show_the_cache_bytes(url: str) -> None:
    def metric(name: str) -> float:
        text = httpx.get(f"{url}/metrics").text
        return float(next(x for x in text.splitlines() if x.startswith(name + " ")).split()[1])

    ahead = metric("convo_memory_embedded_ahead_texts_total")
    with client(url) as c:
        chat(c, FACT, "m1")
        chat(c, "hello", "m1")
        # Both turns are in the window: embedded ahead, not indexed yet (a session's own
        # memory indexes a turn when it leaves the window).
        assert drain_ahead(30)
        assert metric("convo_memory_embedded_ahead_texts_total") > ahead
        chat(c, "and one more", "m1")  # the first turn leaves the window
    assert metric("convo_memory_cache_bytes") > 0


@pytest.mark.slow
def test_memory_stays_flat_over_5000_sessions_served_in_turn(tmp_path: Path) -> None:
    """5,000 sessions indexed and asked one after another through the server's memory
    (their rows in a SQLite file, not in this process): the cache holds at most its bound,
    evicting by LRU, and the process's Python memory stops growing."""
    store = SQLiteStore(tmp_path / "many.db")
    memory = ServerMemory(store, HashEncoder(dim=64), cache_bytes=1 << 20)
    owner = key_owner("k1")
    view = memory.view(owner=owner)

    def serve_one(i: int) -> None:
        sid = f"s{i}"
        store.create(SessionState(session_id=sid, owner=owner))
        turns = [
            Turn(
                index=t,
                messages=(
                    Message(role=Role.USER, content=f"session {i} turn {t} fact {i * 7 + t} about llamas"),
                    Message(role=Role.ASSISTANT, content=f"noted {t}"),
                ),
            )
            for t in range(3)
        ]
        view.remember_turns(sid, turns)
        assert view.retrieve("llamas fact", session_id=sid, top_k=2)

    faiss = pytest.importorskip("faiss")
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)  # tiny indexes: OpenMP's start-up would be most of the time
    try:
        for i in range(300):  # warm up: caches and allocator reach their steady state
            serve_one(i)
        readings = []
        for i in range(300, 5300):
            serve_one(i)
            if i % 1000 == 999:
                gc.collect()
                readings.append(_resident_bytes())
                stats = memory.stats()
                assert stats.bytes <= memory.cache_bytes and stats.evictions > 0
    finally:
        faiss.omp_set_num_threads(threads)
        store.close()
    # Flat: 5,000 sessions of ~10 KB of index each would be ~50 MB if they stayed.
    print(f"resident MiB every 1,000 sessions: {[round(r / 2**20, 1) for r in readings]}; cache {stats}")
    assert max(readings) - readings[0] < 12 << 20, readings


def _resident_bytes() -> int:
    """This process's resident memory (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_replicas_stale_index_never_answers_for_a_session_made_again(store: Store) -> None:
    """Replica A indexed session x; x is deleted and made again (here by another key) on
    replica B: A's cached index of the old x must not answer for the new one."""
    a, b = ServerMemory(store, HashEncoder()), ServerMemory(store, HashEncoder())
    store.create(SessionState(session_id="x", owner=key_owner("k1")))
    turns = [Turn(index=0, messages=(Message(role=Role.USER, content=FACT),))]
    a.view(owner=key_owner("k1")).remember_turns("x", turns)
    assert a.view(owner=key_owner("k1")).retrieve("cat called", session_id="x", top_k=2)
    store.delete("x")
    b.session_deleted(["x"])
    store.create(SessionState(session_id="x", owner=key_owner("k2")))
    other = [Turn(index=0, messages=(Message(role=Role.USER, content="My bike is blue."),))]
    b.view(owner=key_owner("k2")).remember_turns("x", other)  # as many rows as the old x had
    found = a.view(owner=key_owner("k2")).retrieve("cat called", session_id="x", top_k=2)
    assert found and all("Miso" not in p.text for p in found)
