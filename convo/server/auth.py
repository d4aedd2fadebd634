"""API keys: who owns a session. A session belongs to the key that created it; to any
other key it looks exactly like a session that does not exist."""

from __future__ import annotations

import hashlib

from convo.errors import SessionNotFound
from convo.stores import SessionState, Store


def key_owner(api_key: str | None) -> str:
    """What the store records as a session's owner: a hash of the key, never the key."""
    if not api_key:
        return ""
    return hashlib.sha256(b"convo-owner:" + api_key.encode()).hexdigest()[:32]


def peek_owned(store: Store, session_id: str, owner: str) -> tuple[SessionState, int] | None:
    """The session's state and stored message count (no messages are read); ``None`` when
    there is no such session. Another key's session raises :class:`SessionNotFound`, as a
    missing one would for a read: it must look exactly like one that does not exist."""
    try:
        state, count = store.peek(session_id)
    except SessionNotFound:
        return None
    if state.owner != owner:
        raise SessionNotFound(f"no session {session_id!r}")
    return state, count
