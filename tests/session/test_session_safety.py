"""Issue 14 (hardening), SDK side: poison text, refused requests that leave nothing behind,
typed errors for bad options, lock files that go away, cross-process session locks, and
Redis leases that survive timeouts and fence a turn whose lease was lost."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest
from conftest import FakeEngine, redis_or_skip

from convo import Budget, InMemoryStore, RedisStore, Session, SQLiteStore
from convo.errors import BudgetError, ConfigError, MessageError, SessionLockLost
from convo.messages import Message, Role, ToolCall, user
from convo.stores import SessionState, Store
from convo.summarize import Summarizer

# -- item 3: text that is not valid Unicode is refused before anything is stored --------------


@pytest.mark.parametrize("bad", ["hi \ud800", "\udfff", "ok\ud83d"])
def test_lone_surrogate_is_a_message_error(bad: str) -> None:
    with pytest.raises(MessageError, match="lone surrogates"):
        Message(role=Role.USER, content=bad)
    with pytest.raises(MessageError):
        Message.from_record({"role": "user", "content": "x", "name": bad})
    with pytest.raises(MessageError):
        ToolCall(id="c1", name="f", arguments=bad)


def test_from_record_bad_fields_are_message_errors() -> None:
    with pytest.raises(MessageError):
        Message.from_record({"role": "user", "content": "x", "created_at": "yesterday"})
    with pytest.raises(MessageError):
        Message.from_record({"role": "assistant", "content": "", "tool_calls": [{"function": "f"}]})


def test_send_poison_text_stores_nothing_and_session_stays_usable(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    session = Session(FakeEngine(), store=store, session_id="poison")
    session.send("hello")
    before = store.load("poison")[1]
    with pytest.raises(MessageError):
        session.send("hi \ud800")
    assert store.load("poison")[1] == before
    again = Session(FakeEngine(), store=store, session_id="poison")  # loads fine
    assert again.send("still here").text
    assert [m.content for m in store.load("poison")[1]][-2] == "still here"


# -- item 7: a refused Session leaves nothing stored ------------------------------------------


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_too_long_system_prompt_creates_no_session(kind: str, tmp_path: Path) -> None:
    store: Store = InMemoryStore() if kind == "memory" else SQLiteStore(tmp_path / "s.db")
    budget = Budget(context_tokens=400, max_new_tokens=50)
    with pytest.raises(BudgetError):
        Session(FakeEngine(), store=store, session_id="sys", budget=budget, system_prompt="x" * 20_000)
    assert not store.exists("sys")
    retry = Session(FakeEngine(), store=store, session_id="sys", budget=budget, system_prompt="Be brief.")
    assert [m.content for m in retry.messages] == ["Be brief."]
    assert [m.content for m in store.load("sys")[1]] == ["Be brief."]


def test_budget_over_the_engines_window_is_refused_before_storing() -> None:
    store = InMemoryStore()
    engine = FakeEngine(context_window=8192)
    with pytest.raises(ConfigError, match="context window"):
        Session(engine, store=store, session_id="big", budget=Budget(context_tokens=50_000))
    assert not store.exists("big")
    Session(engine, store=store, session_id="ok", budget=Budget(context_tokens=8192)).send("hi")
    # A stored budget the engine cannot hold is refused on resume too, before any write.
    Session(FakeEngine(), store=store, session_id="wide", budget=Budget(context_tokens=50_000))
    with pytest.raises(ConfigError):
        Session(engine, store=store, session_id="wide")
    assert store.load("wide")[1] == []


# -- item 8: typed errors for bad options ------------------------------------------------------


def test_bad_options_raise_typed_errors() -> None:
    with pytest.raises(ConfigError, match="oversize"):
        Budget(oversize="explode")  # type: ignore[arg-type]
    for bad in (123, "", "x" * 300, "a\ud800"):
        with pytest.raises(ConfigError, match="session_id"):
            Session(FakeEngine(), session_id=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        Session(FakeEngine(), budget={"context_tokens": 10})  # type: ignore[arg-type]


# -- item 8: lock files go away; the lock still excludes --------------------------------------


def test_sqlite_lock_files_are_removed(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    for i in range(200):
        with store.lock(f"unknown-{i}", timeout_s=1):
            pass
    assert os.listdir(str(tmp_path / "s.db") + ".locks") == []


def test_store_lock_is_reentrant_per_thread(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    with store.lock("r", timeout_s=1):
        assert store.holds_lock("r")
        with store.lock("r", timeout_s=0.2):  # would time out if not reentrant
            pass
        assert store.holds_lock("r")
        seen: list[bool] = []
        t = threading.Thread(target=lambda: seen.append(store.holds_lock("r")))
        t.start()
        t.join()
        assert seen == [False]
    assert not store.holds_lock("r")


def _bump(path: str, rounds: int) -> None:
    store = SQLiteStore(path)
    counter = path + ".counter"
    for _ in range(rounds):
        with store.lock("hot", timeout_s=30):
            with open(counter) as f:
                n = int(f.read() or 0)
            time.sleep(0.001)
            with open(counter, "w") as f:
                f.write(str(n + 1))


def test_sqlite_lock_excludes_across_processes_while_removing_files(tmp_path: Path) -> None:
    path = str(tmp_path / "s.db")
    SQLiteStore(path)
    Path(path + ".counter").write_text("0")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_bump, args=(path, 40)) for _ in range(3)]
    for p in procs:
        p.start()
    _bump(path, 40)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert Path(path + ".counter").read_text() == "160"  # no lost update
    assert os.listdir(path + ".locks") == []


# -- item 8: two drivers of one session take turns instead of interleaving --------------------


def test_two_session_objects_on_one_session_do_not_interleave(tmp_path: Path) -> None:
    path = tmp_path / "s.db"

    def echo(messages: Sequence[Message]) -> str:
        time.sleep(0.02)  # long enough for the other driver to try to slip in
        return "re: " + next(m.content for m in reversed(messages) if m.role is Role.USER)

    Session(FakeEngine(), store=SQLiteStore(path), session_id="shared")
    errors: list[BaseException] = []

    def drive(name: str) -> None:
        try:
            engine = FakeEngine()
            engine.reply_fn = echo
            s = Session(engine, store=SQLiteStore(path), session_id="shared")  # "another process"
            for i in range(6):
                s.send(f"{name}{i}")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=drive, args=(n,)) for n in "AB"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    history = SQLiteStore(path).load("shared")[1]
    assert len(history) == 24
    for u, a in zip(history[::2], history[1::2], strict=True):
        assert u.role is Role.USER and a.role is Role.ASSISTANT
        assert a.content == "re: " + u.content
    # each driver saw the other's turns: its last prompt held the whole conversation
    assert Session(FakeEngine(), store=SQLiteStore(path), session_id="shared").turn_count == 12


# -- item 4: Redis leases survive timeouts; a lost lease fences the turn ----------------------


def _pause(proc: subprocess.Popen[bytes], seconds: float) -> None:
    proc.send_signal(signal.SIGSTOP)
    time.sleep(seconds)
    proc.send_signal(signal.SIGCONT)


def test_redis_lease_renewal_survives_a_timeout(own_redis: tuple[str, subprocess.Popen[bytes]]) -> None:
    from convo.store import RedisStore

    url, proc = own_redis
    store = RedisStore(url, prefix="h:", lock_lease_s=1.5, socket_timeout_s=0.2)
    with store.lock("s", timeout_s=1):
        time.sleep(0.55)  # a renewal has happened
        _pause(proc, 0.7)  # the next renewal times out; the lease (1.5 s) is not lost yet
        time.sleep(2.0)  # on main the renewal thread is dead by now and the lease expires
        assert store._r.get("h:lock:s") is not None
        store.create(SessionState(session_id="s"))  # a fenced write still lands
    assert store.exists("s")


def test_redis_turn_that_lost_its_lease_does_not_commit(
    own_redis: tuple[str, subprocess.Popen[bytes]],
) -> None:
    from convo.store import RedisStore

    url, proc = own_redis
    store_a = RedisStore(url, prefix="h:", lock_lease_s=0.9, socket_timeout_s=0.2)
    store_b = RedisStore(url, prefix="h:", lock_lease_s=0.9, socket_timeout_s=0.2)
    engine = FakeEngine()

    def slow_reply(messages: Sequence[Message]) -> str:
        _pause(proc, 1.6)  # Redis stops mid-turn for longer than the lease
        with store_b.lock("t", timeout_s=2):  # replica B gets the expired lease...
            store_b.append("t", [user("B's turn")])  # ...and writes
        return "A's reply"

    session = Session(engine, store=store_a, session_id="t", budget=Budget(summary_tokens=0))
    engine.reply_fn = slow_reply
    with pytest.raises(SessionLockLost):
        session.send("A's turn")
    assert [m.content for m in store_a.load("t")[1]] == ["A's turn", "B's turn"]


# -- item 9: clean exit; item 8: a request's seed is its own ------------------------------------


@pytest.mark.slow
def test_chat_script_exits_cleanly_under_cpu_load(tmp_path: Path) -> None:
    """The README's first command (a shorter script), 3 times while every core is busy: exit 0
    each time."""
    import sys

    script = tmp_path / "turns.txt"
    script.write_text("Hi, I am Priya.\nWhat is my name?\n", encoding="utf-8")

    spin = "import time\nend = time.time() + 600\nwhile time.time() < end: pass"
    hogs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() or 2)]
    try:
        for i in range(3):
            cmd = [sys.executable, "-m", "convo.cli", "chat", "--script", str(script), "--json"]
            cmd += ["--max-new-tokens", "4", "--db", str(tmp_path / f"run{i}.db")]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stderr[-2000:]
            assert len(done.stdout.splitlines()) == 2
            assert "terminate called" not in done.stderr
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


@pytest.mark.slow
def test_engine_close_joins_its_threads_and_a_seed_leaves_the_global_generator_alone() -> None:
    import torch

    from convo.engines.base import Sampling
    from convo.engines.transformers import TransformersEngine

    engine = TransformersEngine(cache_idle_s=30)
    prompt = [user("Tell me a short story about a cat.")]
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    seeded = Sampling(temperature=1.0, seed=7)
    first = engine.generate(prompt, max_new_tokens=6, sampling=seeded, cache_key="k")
    assert torch.equal(torch.rand(3), expected)  # on main: the request's seed reseeded torch
    assert engine.generate(prompt, max_new_tokens=6, sampling=seeded).text == first.text
    sweeper = engine._sweeper
    assert sweeper is not None and sweeper.is_alive()
    engine.close()
    assert not sweeper.is_alive()


def test_peek_gives_state_and_count_without_messages(
    tmp_path: Path, own_redis: tuple[str, subprocess.Popen[bytes]]
) -> None:
    from convo.errors import SessionNotFound
    from convo.store import RedisStore

    for store in (InMemoryStore(), SQLiteStore(tmp_path / "s.db"), RedisStore(own_redis[0], prefix="pk:")):
        store.create(SessionState(session_id="p", summary="s"), [user("a")])
        store.append("p", [user("b"), user("c")])
        state, count = store.peek("p")
        assert (state.summary, count) == ("s", 3)
        with pytest.raises(SessionNotFound):
            store.peek("missing")


# -- issue 27: identity, deletion, reads --------------------------------------------------------


class _Gated(Summarizer):
    """A summarizer that folds ``messages`` into text naming them, once ``gate`` is set."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()

    def summarize(self, *, previous: str, messages: Sequence[Message], max_tokens: int) -> str:
        self.started.set()
        assert self.gate.wait(10), "test gate never opened"
        return " ".join(m.content.split()[0] for m in messages)[:max_tokens]


_TIGHT = Budget(
    context_tokens=700, max_new_tokens=50, window_turns=2, summarize_batch_turns=1, summary_tokens=40
)


def _replicas(kind: str, tmp_path: Path) -> tuple[Store, Store]:
    """Two store objects on one backend, as two server replicas hold them."""
    if kind == "sqlite":
        return SQLiteStore(tmp_path / "r.db"), SQLiteStore(tmp_path / "r.db")
    url = redis_or_skip()  # (conftest: fails instead with CONVO_REQUIRE_REDIS=1)
    prefix = f"convo-test:{uuid.uuid4().hex}:"
    return RedisStore(url, prefix=prefix), RedisStore(url, prefix=prefix)


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
@pytest.mark.parametrize("how", ["deleted", "forked"])
def test_a_background_summary_never_lands_in_a_new_session_under_the_same_id(
    kind: str, how: str, tmp_path: Path
) -> None:
    from convo.summarize import JobStatus, SummaryWorker

    store_a, store_b = _replicas(kind, tmp_path)
    worker_a, worker_b = SummaryWorker(threads=1, max_defer_s=0.0), SummaryWorker(threads=1, max_defer_s=0.0)
    try:
        summ = _Gated()
        k1 = Session(
            FakeEngine(), budget=_TIGHT, store=store_a, session_id="shared", owner="k1",
            summarizer=summ, summaries=worker_a, summary_wait_s=0,
        )  # fmt: skip
        for i in range(3):
            k1.send(f"k1secret{i} " + "w" * 800)
        assert summ.started.wait(10)  # replica A is folding k1's turns now
        job = worker_a.job(store_a, "shared")
        assert job is not None and job.start == 0
        # Replica B: k1 deletes the session (or a fork rewrites it), k2 creates one under the id.
        if how == "deleted":
            store_b.delete("shared")
            Session(FakeEngine(), store=store_b, session_id="shared", owner="k2", summaries=worker_b)
        else:
            state, history = store_b.load("shared")
            store_b.import_session(store_b.export_session("shared"), session_id="shared~1")
            store_b.delete("shared")
            store_b.create(replace_state(state), [m for m in history if m.pinned])
        summ.gate.set()
        assert job.wait(10)
        assert job.status is JobStatus.CANCELLED  # refused by the new session's epoch
        state_b, _ = store_b.load("shared")
        assert "k1secret" not in state_b.summary and state_b.summarized_turns == 0
        # k2's next request lands on replica A: its worker still knows k1's job.
        again = Session(FakeEngine(), budget=_TIGHT, store=store_a, session_id="shared", summaries=worker_a)
        assert "k1secret" not in again.summary
        reply = again.send("k2 hello")
        assert all("k1secret" not in m.content for m in reply.plan.messages)
        assert "k1secret" not in store_a.load("shared")[0].summary
    finally:
        worker_a.close(wait=False)
        worker_b.close(wait=False)
        store_a.close()
        store_b.close()


def replace_state(state: SessionState) -> SessionState:
    """What a server fork creates again: the state with its summary and window reset."""
    from dataclasses import replace

    return replace(state, summary="", summarized_turns=0, evicted_turns=0)


def test_a_session_stored_before_epochs_loads_and_summarizes(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript(
        """CREATE TABLE sessions (id TEXT PRIMARY KEY, settings TEXT NOT NULL,
        summary TEXT NOT NULL DEFAULT '', summarized_turns INTEGER NOT NULL DEFAULT 0,
        evicted_turns INTEGER NOT NULL DEFAULT 0, owner TEXT NOT NULL DEFAULT '',
        created_at REAL NOT NULL, updated_at REAL NOT NULL);
        CREATE TABLE messages (session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
        seq INTEGER NOT NULL, record TEXT NOT NULL, PRIMARY KEY (session_id, seq));
        INSERT INTO sessions VALUES ('old', '{}', 'before', 0, 0, 'o', 1.0, 1.0);"""
    )
    db.commit()
    db.close()
    store = SQLiteStore(path)
    state, messages = store.load("old")
    assert (state.epoch, state.summary, messages) == ("", "before", [])
    assert store.save_summary("old", summary="s", covered_from=0, summarized_turns=1, epoch="")
    assert not store.save_summary("old", summary="x", covered_from=1, summarized_turns=2, epoch="other")
    session = Session(FakeEngine(), store=store, session_id="old")
    session.send("hi")
    assert store.load("old")[0].epoch == ""  # an epoch is minted at creation only
    store.create(SessionState(session_id="new"))
    assert len(store.load("new")[0].epoch) == 32
