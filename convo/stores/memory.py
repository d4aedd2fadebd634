"""An in-process store: sessions in a dict (tests, throw-away sessions)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace

from convo.errors import SessionNotFound, StoreError
from convo.messages import Message
from convo.stores.base import SessionState, Store


class InMemoryStore(Store):
    """A store in a dict, for tests and throw-away sessions (thread-safe), gone with the
    process. Named as LangGraph names its own; formerly ``MemoryStore`` (in convo "memory"
    means GPU memory, :class:`~convo.MemoryModel`, or :class:`~convo.RetrievalMemory`).

    Example:
        >>> store = InMemoryStore()
        >>> store.create(SessionState(session_id="s1"))
        >>> store.list_sessions()
        ['s1']
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, tuple[SessionState, list[Message]]] = {}

    def create(self, state: SessionState, messages: Sequence[Message] = ()) -> None:
        with self._lock:
            if state.session_id in self._data:
                raise StoreError(f"session {state.session_id!r} already exists")
            self._data[state.session_id] = (state, list(messages))

    def create_if_missing(self, state: SessionState, messages: Sequence[Message] = ()) -> bool:
        with self._lock:
            if state.session_id in self._data:
                return False
            self._data[state.session_id] = (state, list(messages))
            return True

    def load(self, session_id: str) -> tuple[SessionState, list[Message]]:
        with self._lock:
            if session_id not in self._data:
                raise SessionNotFound(f"no session {session_id!r}")
            state, msgs = self._data[session_id]
        return state, self._stitched(state, list(msgs))

    def exists(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._data

    def append(
        self, session_id: str, messages: Sequence[Message], *, state: SessionState | None = None
    ) -> None:
        with self._lock:
            if session_id not in self._data:
                raise SessionNotFound(f"no session {session_id!r}")
            old, msgs = self._data[session_id]
            msgs.extend(messages)
            self._data[session_id] = (state or old, msgs)

    def truncate(self, session_id: str, keep: int, *, state: SessionState | None = None) -> None:
        with self._lock:
            if session_id not in self._data:
                raise SessionNotFound(f"no session {session_id!r}")
            old, msgs = self._data[session_id]
            self._data[session_id] = (state or old, msgs[: max(keep, 0)])

    def save_state(self, state: SessionState) -> None:
        with self._lock:
            if state.session_id not in self._data:
                raise SessionNotFound(f"no session {state.session_id!r}")
            self._data[state.session_id] = (state, self._data[state.session_id][1])

    def save_summary(
        self, session_id: str, *, summary: str, covered_from: int, summarized_turns: int
    ) -> bool:
        with self._lock:
            if session_id not in self._data:
                raise SessionNotFound(f"no session {session_id!r}")
            state, msgs = self._data[session_id]
            if state.summarized_turns != covered_from:
                return False
            self._data[session_id] = (
                replace(state, summary=summary, summarized_turns=summarized_turns),
                msgs,
            )
            return True

    def delete(self, session_id: str) -> None:
        with self._lock:
            if self._data.pop(session_id, None) is None:
                raise SessionNotFound(f"no session {session_id!r}")

    def list_sessions(self) -> list[str]:
        with self._lock:
            return sorted(self._data)
