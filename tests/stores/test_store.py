"""Stores: the same contract for every implementation, plus SQLite under concurrency."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import convo
import convo.store
import convo.stores
from convo.errors import SessionBusy, SessionNotFound, StoreError
from convo.messages import Message, Role, ToolCall, assistant, tool, user
from convo.stores import InMemoryStore, SessionState, SQLiteStore, Store

REDIS_URL = os.environ.get("CONVO_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def redis_store() -> Iterator[Store]:
    """A RedisStore under a fresh key prefix (deleted after). Skips without a Redis server,
    except with CONVO_REQUIRE_REDIS=1 (CI), where a missing server fails the test."""
    from convo.stores import RedisStore

    try:
        store = RedisStore(REDIS_URL, prefix=f"convo-test:{uuid.uuid4().hex}:")
    except (ImportError, StoreError) as exc:
        if os.environ.get("CONVO_REQUIRE_REDIS") == "1":
            pytest.fail(f"CONVO_REQUIRE_REDIS=1 but there is no Redis at {REDIS_URL}: {exc}")
        pytest.skip(f"no Redis at {REDIS_URL}: {exc}")
    yield store
    for key in store._r.scan_iter(match=store.prefix + "*"):
        store._r.delete(key)
    store.close()


@pytest.fixture(params=["sqlite", "memory", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "redis":
        yield from redis_store()
    else:
        yield SQLiteStore(tmp_path / "s.db") if request.param == "sqlite" else InMemoryStore()


def test_lock_serializes_holders_and_times_out(store: Store) -> None:
    inside, overlaps = [0], []

    def hold(n: int) -> None:
        for _ in range(n):
            with store.lock("L", timeout_s=10):
                inside[0] += 1
                overlaps.append(inside[0])
                time.sleep(0.002)
                inside[0] -= 1

    threads = [threading.Thread(target=hold, args=(10,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlaps == [1] * 40
    errors: list[StoreError] = []

    def second() -> None:
        try:
            with store.lock("L", timeout_s=0.1):
                pass
        except StoreError as exc:
            errors.append(exc)

    with store.lock("L"):
        waiter = threading.Thread(target=second)
        waiter.start()
        waiter.join()
        with store.lock("other", timeout_s=0.1):  # other sessions are not blocked
            pass
    assert len(errors) == 1 and "busy" in str(errors[0]) and isinstance(errors[0], SessionBusy)


def _locked_counter(path: str, n: int) -> None:
    store = SQLiteStore(path)
    for _ in range(n):
        with store.lock("shared"):  # read-modify-write: safe only under the lock
            count = len(store.load("shared")[1])
            store.append("shared", [user(str(count))])


def test_sqlite_lock_holds_across_processes(tmp_path: Path) -> None:
    path = str(tmp_path / "l.db")
    SQLiteStore(path).create(SessionState(session_id="shared"))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_locked_counter, args=(path, 25)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    assert [m.content for m in SQLiteStore(path).load("shared")[1]] == [str(i) for i in range(75)]


#: A process that takes a session's lock in a SQLite store and holds it until killed.
HOLD_A_LOCK = """
import sys, time
from convo.stores import SQLiteStore
with SQLiteStore(sys.argv[1]).lock(sys.argv[2]):
    print("held", flush=True)
    time.sleep(600)
"""


def _lock_in_a_process(path: str, session_id: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_A_LOCK, path, session_id], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_sqlite_open_removes_the_lock_files_of_killed_holders_only(tmp_path: Path) -> None:
    """A holder killed with SIGKILL cannot remove its lock file; the next open of the store
    does, and leaves a live holder's file (and lock) alone."""
    path = str(tmp_path / "k.db")
    locks = path + ".locks"
    killed, alive = _lock_in_a_process(path, "killed"), _lock_in_a_process(path, "alive")
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
        assert len(os.listdir(locks)) == 2  # the dead holder left its file behind
        store = SQLiteStore(path)
        assert len(os.listdir(locks)) == 1  # the live holder's file stays
        with pytest.raises(SessionBusy), store.lock("alive", timeout_s=0.2):
            pass
        with store.lock("killed", timeout_s=1):  # the dead holder's lock is free
            pass
        assert len(os.listdir(locks)) == 1
    finally:
        for proc in (killed, alive):
            proc.kill()
            proc.wait(30)
            assert proc.stdout is not None
            proc.stdout.close()
    SQLiteStore(path)
    assert os.listdir(locks) == []


def _open_and_bump(path: str, rounds: int) -> None:
    for _ in range(rounds):  # every open removes stale lock files while others hold or wait
        with SQLiteStore(path).lock("hot", timeout_s=30):
            counter = Path(path + ".counter")
            n = int(counter.read_text())
            time.sleep(0.001)
            counter.write_text(str(n + 1))


def test_sqlite_lock_still_excludes_while_opens_remove_stale_files(tmp_path: Path) -> None:
    path = str(tmp_path / "s.db")
    SQLiteStore(path)
    Path(path + ".counter").write_text("0")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_open_and_bump, args=(path, 30)) for _ in range(3)]
    for p in procs:
        p.start()
    _open_and_bump(path, 30)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert Path(path + ".counter").read_text() == "120"  # no lost update
    assert os.listdir(path + ".locks") == []


def test_create_append_load_round_trip(store: Store) -> None:
    store.create(SessionState(session_id="a", settings={"budget": {"context_tokens": 99}}))
    msgs = [
        user("hi ☃"),
        assistant("", tool_calls=[ToolCall(id="c", name="f", arguments='{"x": 1}')]),
        tool("42", tool_call_id="c"),
    ]
    store.append("a", msgs[:1])
    store.append(
        "a", msgs[1:], state=SessionState(session_id="a", summary="S", summarized_turns=2, evicted_turns=3)
    )
    state, loaded = store.load("a")
    assert loaded == msgs
    assert (state.summary, state.summarized_turns, state.evicted_turns) == ("S", 2, 3)
    assert store.list_sessions() == ["a"]


def test_unknown_and_duplicate_sessions(store: Store) -> None:
    with pytest.raises(SessionNotFound):
        store.load("nope")
    with pytest.raises(SessionNotFound):
        store.append("nope", [user("x")])
    with pytest.raises(SessionNotFound):
        store.delete("nope")
    store.create(SessionState(session_id="a"))
    with pytest.raises(StoreError):
        store.create(SessionState(session_id="a"))


class _DefaultCreateIfMissing(InMemoryStore):
    """A store that inherits :meth:`Store.create_if_missing` (as a third-party one would)."""

    create_if_missing = Store.create_if_missing


def test_create_if_missing_creates_once_among_racing_threads(store: Store) -> None:
    _race_create_if_missing(store)


def test_default_create_if_missing_creates_once_among_racing_threads() -> None:
    _race_create_if_missing(_DefaultCreateIfMissing())


def _race_create_if_missing(store: Store) -> None:
    created: list[bool] = []
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def create() -> None:
        start.wait(10)
        try:
            created.append(store.create_if_missing(SessionState(session_id="new"), [user("first")]))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sorted(created) == [False] * 7 + [True]
    store.append("new", [user("second")])
    assert not store.create_if_missing(SessionState(session_id="new", summary="other"), [user("x")])
    state, messages = store.load("new")  # an existing session is left as it is
    assert [m.content for m in messages] == ["first", "second"] and state.summary == ""


def test_export_import_and_delete(store: Store) -> None:
    store.create(SessionState(session_id="a", summary="sum", settings={"k": 1}))
    store.append("a", [user("one"), assistant("two")])
    data = json.loads(json.dumps(store.export_session("a")))
    new_id = store.import_session(data, session_id="b")
    assert store.load("b")[1] == store.load("a")[1]
    assert store.load("b")[0].summary == "sum"
    store.delete("a")
    assert not store.exists("a") and store.exists("b")
    with pytest.raises(StoreError):
        store.import_session({"format": "other"})
    assert new_id == "b"


def test_sqlite_many_openers_of_one_new_file_all_open(tmp_path: Path) -> None:
    """Eight openers of the same new file at once (two workers of a server starting, two
    scripts on a fresh machine): every one opens it. Switching a file to WAL does not wait
    on SQLite's busy handler, so without the store's own retry some fail at once with
    "database is locked" (about 1 round in 20 before the fix)."""
    failures: list[str] = []
    for round_ in range(150):
        path = tmp_path / f"new-{round_}.db"
        start = threading.Barrier(8)

        def open_it(path: Path, start: threading.Barrier) -> None:
            start.wait()
            try:
                SQLiteStore(path)
            except Exception as exc:  # collected and asserted below
                failures.append(repr(exc))

        openers = [threading.Thread(target=open_it, args=(path, start)) for _ in range(8)]
        for t in openers:
            t.start()
        for t in openers:
            t.join()
    assert failures == []


def test_sqlite_threads_do_not_lock(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "t.db")
    for i in range(8):
        store.create(SessionState(session_id=f"s{i}"))
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for k in range(50):
                store.append(
                    f"s{i % 8}",
                    [user(f"{i}-{k}")],
                    state=SessionState(session_id=f"s{i % 8}", summary=str(k)),
                )
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sum(len(store.load(f"s{i}")[1]) for i in range(8)) == 16 * 50


def _proc_writer(path: str, worker: int, n: int) -> None:
    store = SQLiteStore(path)
    for k in range(n):
        store.append("shared", [user(f"{worker}-{k}")])


def test_sqlite_processes_do_not_lock(tmp_path: Path) -> None:
    path = str(tmp_path / "p.db")
    SQLiteStore(path).create(SessionState(session_id="shared"))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_proc_writer, args=(path, w, 40)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    _, msgs = SQLiteStore(path).load("shared")
    assert len(msgs) == 160
    for w in range(4):  # each writer's messages stay in its own order
        mine = [m.content for m in msgs if m.content.startswith(f"{w}-")]
        assert mine == [f"{w}-{k}" for k in range(40)]


def test_session_resumes_in_a_new_process(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parents[1])!r})
from conftest import FakeEngine
from convo import Budget, Session, SQLiteStore
s = Session(FakeEngine(), store=SQLiteStore({str(db)!r}), session_id="resume-me",
            budget=Budget(context_tokens=300, max_new_tokens=20, window_turns=2, summary_tokens=0))
for i in range(3):
    s.send("message %d" % i)
print(s.turn_count)
"""
    out1 = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    out2 = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out1.stdout.strip() == "3" and out2.stdout.strip() == "6"
    state, msgs = SQLiteStore(db).load("resume-me")
    assert len(msgs) == 12
    assert state.settings["budget"]["context_tokens"] == 300
    assert state.evicted_turns == 4


def test_save_summary_is_a_compare_and_set_on_the_covered_turns(store: Store) -> None:
    store.create(SessionState(session_id="a", evicted_turns=4, settings={"k": 1}))
    store.append("a", [Message(role=Role.USER, content="hi")])
    assert store.save_summary("a", summary="S1", covered_from=0, summarized_turns=2)
    # A late or repeated job that started from the old summary is refused.
    assert not store.save_summary("a", summary="stale", covered_from=0, summarized_turns=3)
    assert store.save_summary("a", summary="S2", covered_from=2, summarized_turns=4)
    state, messages = store.load("a")
    assert (state.summary, state.summarized_turns, state.evicted_turns) == ("S2", 4, 4)
    assert state.settings == {"k": 1} and len(messages) == 1  # nothing else touched
    with pytest.raises(SessionNotFound):
        store.save_summary("nope", summary="x", covered_from=0, summarized_turns=1)


# -- the old names: convo.store (a module then) and MemoryStore ---------------------------

#: What users imported from ``convo.store`` before it became the package ``convo.stores``.
OLD_STORE_NAMES = ["EXPORT_FORMAT", "RedisStore", "SQLiteStore", "SessionState", "Store", "redact_url"]


def test_memory_store_is_a_deprecated_alias_of_in_memory_store() -> None:
    with pytest.warns(DeprecationWarning, match=r"convo\.stores\.MemoryStore is deprecated.*InMemoryStore"):
        from convo.stores import MemoryStore
    assert MemoryStore is InMemoryStore
    with pytest.warns(DeprecationWarning, match=r"convo\.store\.MemoryStore is deprecated.*InMemoryStore"):
        assert convo.store.MemoryStore is InMemoryStore
    assert convo.MemoryStore is InMemoryStore  # the top-level export table still serves it


@pytest.mark.parametrize("name", OLD_STORE_NAMES)
def test_old_store_module_forwards_its_names_with_a_warning(name: str) -> None:
    with pytest.warns(
        DeprecationWarning, match=rf"convo\.store is deprecated; import {name} from convo\.stores"
    ):
        value = getattr(convo.store, name)
    assert value is getattr(convo.stores, name)
    with pytest.raises(AttributeError):
        convo.store.NoSuchStore  # noqa: B018


def test_import_convo_stays_quiet_while_its_modules_use_the_old_path() -> None:
    """convo's own modules import convo.stores: importing them never warns (or fails under
    -W error); a user's import of the old path does."""
    quiet = subprocess.run(
        [sys.executable, "-W", "error", "-c", "import convo, convo.session, convo.server, convo.cli"],
        capture_output=True,
        text=True,
    )
    assert quiet.returncode == 0, quiet.stderr
    loud = subprocess.run(
        [sys.executable, "-W", "error", "-c", "from convo.store import SQLiteStore"],
        capture_output=True,
        text=True,
    )
    assert loud.returncode != 0 and "DeprecationWarning: convo.store is deprecated" in loud.stderr


def test_delete_with_forks_removes_the_forks_and_nothing_else(store: Store) -> None:
    """Issue 27 #5: a deleted session's forks (``X~1``, forks of forks) hold its old tail;
    ``delete(forks=True)`` removes them in the same call. Ids that only look alike, and
    forks of another owner, stay."""
    for sid, owner in [
        ("X", "k1"), ("X~1", "k1"), ("X~1~1", "k1"), ("X~12", "k1"), ("X~2", "k2"),
        ("X~draft", "k1"), ("X~0", "k1"), ("Xy~1", "k1"), ("X~1x", "k1"),
    ]:  # fmt: skip
        store.create(SessionState(session_id=sid, owner=owner), [user(f"tail of {sid}")])
    assert store.forks_of("X") == ["X~1", "X~12", "X~1~1"]  # sorted
    store.delete("X", forks=True)
    for gone in ("X", "X~1", "X~1~1", "X~12"):
        assert not store.exists(gone)
        with pytest.raises(SessionNotFound):
            store.load(gone)
    assert sorted(store.list_sessions()) == sorted(["X~0", "X~1x", "X~2", "X~draft", "Xy~1"])
    with pytest.raises(SessionNotFound):
        store.delete("X", forks=True)


def test_delete_without_forks_keeps_them(store: Store) -> None:
    """A server fork rewrites a session with delete and create: its fork must stay."""
    store.create(SessionState(session_id="Y"), [user("a")])
    store.create(SessionState(session_id="Y~1"), [user("old tail")])
    store.delete("Y")
    assert store.load("Y~1")[1] == [user("old tail")]


def test_load_tail_reads_the_messages_after_a_position(store: Store) -> None:
    store.create(SessionState(session_id="t", summary="s"), [user("a")])
    store.append("t", [user("b"), user("c")])
    tail = store.load_tail("t", 1)
    assert (tail.state.summary, tail.count, tail.after, tail.messages) == ("s", 3, 1, [user("b"), user("c")])
    assert store.load_tail("t", 3).messages == [] and store.load_tail("t", 9).count == 3
    assert store.load_tail("t", 0).messages == store.load("t")[1]
    with pytest.raises(SessionNotFound):
        store.load_tail("missing", 0)
