"""Forks that share their parent's first messages (``FORK_SETTING``) and ``Store.truncate``,
in every store: a fork stores only its tail, reads (and exports) whole, and reads as
missing once its parent is gone."""

from __future__ import annotations

import pytest
from test_store import store  # noqa: F401  (the memory / SQLite / Redis fixture)

from convo.errors import SessionNotFound
from convo.messages import Message
from convo.stores import SessionState, Store
from convo.stores.base import FORK_SETTING


def msgs(*texts: str) -> list[Message]:
    return [Message(role="user" if i % 2 == 0 else "assistant", content=t) for i, t in enumerate(texts)]


def texts(s: Store, sid: str) -> list[str]:
    return [m.content for m in s.load(sid)[1]]


def test_a_fork_reads_its_parents_prefix_then_its_own_tail(store: Store) -> None:  # noqa: F811
    store.create(SessionState(session_id="p", owner="k"), msgs("u1", "a1", "u2", "a2"))
    link = {FORK_SETTING: {"parent": "p", "prefix": 2}}
    store.create(SessionState(session_id="p~1", owner="k", settings=link), msgs("u2 old", "a2 old"))
    assert texts(store, "p~1") == ["u1", "a1", "u2 old", "a2 old"]
    assert store.peek("p~1")[0].settings[FORK_SETTING] == {"parent": "p", "prefix": 2}
    data = store.export_session("p~1")  # self-contained: the whole history, no link
    assert [r["content"] for r in data["messages"]] == ["u1", "a1", "u2 old", "a2 old"]
    assert FORK_SETTING not in data["settings"]
    store.import_session(data, session_id="copy")
    store.append("p", msgs("u3"))  # the parent grows past the prefix: the fork is unchanged
    assert texts(store, "p~1") == ["u1", "a1", "u2 old", "a2 old"]
    store.delete("p")
    with pytest.raises(SessionNotFound):
        store.load("p~1")
    assert texts(store, "copy") == ["u1", "a1", "u2 old", "a2 old"]


def test_truncate_keeps_the_first_messages_and_replaces_the_state(store: Store) -> None:  # noqa: F811
    store.create(SessionState(session_id="t", summary="old"), msgs("u1", "a1", "u2", "a2"))
    store.truncate("t", 3)
    assert texts(store, "t") == ["u1", "a1", "u2"] and store.load("t")[0].summary == "old"
    store.truncate("t", 1, state=SessionState(session_id="t", summary="new"))
    assert texts(store, "t") == ["u1"] and store.load("t")[0].summary == "new"
    store.append("t", msgs("x", "y"))
    assert texts(store, "t") == ["u1", "x", "y"]
    store.truncate("t", 0)
    assert texts(store, "t") == [] and store.exists("t")
    with pytest.raises(SessionNotFound):
        store.truncate("missing", 0)
