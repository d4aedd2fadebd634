"""API keys: who owns a session."""

from __future__ import annotations

import hashlib


def key_owner(api_key: str | None) -> str:
    """What the store records as a session's owner: a hash of the key, never the key."""
    if not api_key:
        return ""
    return hashlib.sha256(b"convo-owner:" + api_key.encode()).hexdigest()[:32]
