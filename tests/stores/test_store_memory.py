"""Retrieval-memory rows in every store: appended fenced by the session's epoch, read from
a position, deleted with their session (and its forks) in every scope, exported."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import start_redis, stop_redis

from convo.messages import user
from convo.stores import InMemoryStore, SessionState, SQLiteStore, Store


@pytest.fixture(params=["sqlite", "memory", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "redis":
        from convo.stores import RedisStore

        url, proc = start_redis(tmp_path)
        s: Store = RedisStore(url)
        try:
            yield s
        finally:
            s.close()
            stop_redis(proc)
    elif request.param == "sqlite":
        s = SQLiteStore(tmp_path / "s.db")
        yield s
        s.close()
    else:
        yield InMemoryStore()


def made(store: Store, sid: str, owner: str = "o") -> str:
    store.create(SessionState(session_id=sid, owner=owner), [user("hi")])
    return store.peek(sid)[0].epoch


def test_rows_are_fenced_by_the_sessions_epoch(store: Store) -> None:
    epoch = made(store, "a")
    assert store.append_memory("a", [{"n": 1}, {"n": 2}], session_id="a", epoch=epoch)
    assert not store.append_memory("a", [{"n": 3}], session_id="a", epoch="another")
    assert not store.append_memory("nobody", [{"n": 3}], session_id="nobody")
    log = store.memory_log("a")
    assert (log.count, log.records) == (2, [{"n": 1}, {"n": 2}])
    assert store.memory_log("a", after=1).records == [{"n": 2}]
    assert store.memory_counts(["a", "never"]) == {"a": 2, "never": 0}
    # Deleted and made again: the old epoch's writer is refused, the old rows are gone.
    store.delete("a")
    fresh = made(store, "a")
    assert not store.append_memory("a", [{"n": 4}], session_id="a", epoch=epoch)
    assert store.memory_log("a").count == 0
    assert store.append_memory("a", [{"n": 5}], session_id="a", epoch=fresh)


def test_deleting_a_session_deletes_its_rows_in_every_scope_and_its_forks(store: Store) -> None:
    made(store, "p")
    store.create(SessionState(session_id="p~1", owner="o", settings={"fork": {"parent": "p", "prefix": 1}}))
    made(store, "q")
    for sid in ("p", "p~1", "q"):
        assert store.append_memory(sid, [{"turn": sid}], session_id=sid)
        assert store.append_memory("person:o:alice", [{"member": sid}], session_id=sid)
    store.delete("p", forks=True)
    assert store.memory_log("p").count == 0 and store.memory_log("p~1").count == 0
    assert store.memory_log("person:o:alice").records == [{"member": "q"}]
    assert store.memory_log("q").records == [{"turn": "q"}]
    assert store.delete_memory("person:o:alice") == 1
    assert store.memory_log("person:o:alice").count == 0


def test_export_includes_the_memory_and_import_restores_it(store: Store) -> None:
    made(store, "e")
    store.append_memory("e", [{"turn": 0, "text": "cat"}], session_id="e")
    data = store.export_session("e")
    assert data["memory"] == [{"turn": 0, "text": "cat"}]
    store.import_session(data, session_id="e2")
    assert store.memory_log("e2").records == [{"turn": 0, "text": "cat"}]


def test_rows_of_no_session_are_kept_until_their_scope_is_deleted(store: Store) -> None:
    """Documents' rows (written by no session): appended unfenced, untouched by deleting
    sessions, gone with their scope."""
    made(store, "s")
    assert store.append_memory("files/o", [{"op": "create", "id": "file-1"}], session_id=None)
    assert store.append_memory("files/o", [], session_id=None)
    store.delete("s")
    assert store.memory_log("files/o").records == [{"op": "create", "id": "file-1"}]
    assert store.delete_memory("files/o") == 1 and store.memory_log("files/o").count == 0
