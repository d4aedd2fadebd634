"""An in-process store: sessions in a dict (tests, throw-away sessions)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace

from convo.errors import SessionNotFound, StoreError
from convo.messages import Message
from convo.stores.base import SessionState, Store, StoredTail, is_fork_of, new_epoch


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
            self._data[state.session_id] = (replace(state, epoch=new_epoch()), list(messages))

    def create_if_missing(self, state: SessionState, messages: Sequence[Message] = ()) -> bool:
        with self._lock:
            if state.session_id in self._data:
                return False
            self._data[state.session_id] = (replace(state, epoch=new_epoch()), list(messages))
            return True

    def load(self, session_id: str) -> tuple[SessionState, list[Message]]:
        with self._lock:
            if session_id not in self._data:
                raise SessionNotFound(f"no session {session_id!r}")
            state, msgs = self._data[session_id]
        return state, self._stitched(state, list(msgs))

    def load_tail(self, session_id: str, after: int) -> StoredTail:
        if after < 0:
            raise ValueError(f"after must be >= 0, got {after}")
        with self._lock:
            if session_id not in self._data:
                raise SessionNotFound(f"no session {session_id!r}")
            state, msgs = self._data[session_id]
            return StoredTail(state=state, count=len(msgs), after=after, messages=msgs[after:])

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
            new = old if state is None else replace(state, epoch=old.epoch)  # the epoch never changes
            self._data[session_id] = (new, msgs)

    def truncate(self, session_id: str, keep: int, *, state: SessionState | None = None) -> None:
        with self._lock:
            if session_id not in self._data:
                raise SessionNotFound(f"no session {session_id!r}")
            old, msgs = self._data[session_id]
            self._data[session_id] = (replace(state or old, epoch=new_epoch()), msgs[: max(keep, 0)])

    def save_state(self, state: SessionState) -> None:
        with self._lock:
            if state.session_id not in self._data:
                raise SessionNotFound(f"no session {state.session_id!r}")
            old, msgs = self._data[state.session_id]
            self._data[state.session_id] = (replace(state, epoch=old.epoch), msgs)

    def save_summary(
        self,
        session_id: str,
        *,
        summary: str,
        covered_from: int,
        summarized_turns: int,
        epoch: str | None = None,
    ) -> bool:
        with self._lock:
            if session_id not in self._data:
                raise SessionNotFound(f"no session {session_id!r}")
            state, msgs = self._data[session_id]
            if state.summarized_turns != covered_from or (epoch is not None and state.epoch != epoch):
                return False
            self._data[session_id] = (
                replace(state, summary=summary, summarized_turns=summarized_turns),
                msgs,
            )
            return True

    def delete(self, session_id: str, *, forks: bool = False) -> None:
        with self._lock:
            if session_id not in self._data:
                raise SessionNotFound(f"no session {session_id!r}")
            doomed = [session_id, *(self._forks_of(session_id) if forks else [])]
            for sid in doomed:
                del self._data[sid]
        self._drop_memory_of(doomed)  # its retrieval memory goes with it

    def forks_of(self, session_id: str) -> list[str]:
        with self._lock:
            if session_id not in self._data:
                raise SessionNotFound(f"no session {session_id!r}")
            return self._forks_of(session_id)

    def _forks_of(self, session_id: str) -> list[str]:
        owner = self._data[session_id][0].owner
        return sorted(
            sid for sid, (st, _) in self._data.items() if is_fork_of(sid, session_id) and st.owner == owner
        )

    def list_sessions(self) -> list[str]:
        with self._lock:
            return sorted(self._data)
