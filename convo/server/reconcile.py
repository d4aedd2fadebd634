"""Reconciling the messages a client sends with the history the server has stored.

Clients of an OpenAI-compatible API do one of two things with a conversation: send only
the new message (the server keeps the rest), or resend the whole conversation every time
(the ``openai`` SDK used as documented, LangChain's ``ChatOpenAI``, LlamaIndex's
``OpenAI``). Some trim what they resend to a recent window. :func:`reconcile` tells the
cases apart so that the server stores every message exactly once::

    stored   : u1 a1 u2 a2
    incoming : u1 a1 u2 a2 u3      resend      -> append u3
    incoming :             u3      only new    -> append u3
    incoming :       u2 a2 u3      window      -> append u3 (longest stored tail it repeats)
    incoming : u1 a1 u2' ...       divergence  -> fork at 2 (u2 was edited)
    incoming : u1 a1 u2            regenerate  -> fork at 3 (a new answer to u2)

Messages match on role, content, tool call ids/names/arguments and ``tool_call_id``.
System messages are not part of this comparison: a session keeps the system prompt it was
created with.

**The divergence rule.** When the client's history starts like the stored one (its first
message matches the stored first message) but differs at position ``k``, the session
forks at ``k``: the stored messages from ``k`` on move, readable, to a new session
``<id>~<n>`` (same owner; ``GET /v1/sessions/<id>~<n>``), and the session continues as
``stored[:k] + incoming[k:]``. A resent prefix of the stored history (more than one
message) asks for a new answer to its last message: the same rule with nothing to add. A
single message equal to the first stored one is read as a new message. The response
reports a fork in ``convo.forked``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from convo.messages import Message

#: Separates a session id from the number of a fork holding its replaced tail.
FORK_SEPARATOR = "~"


@dataclass(frozen=True, kw_only=True)
class Reconciled:
    """What to do with a request's messages.

    Attributes:
        new: the messages to append (after the fork point, when there is one).
        fork_at: index into the stored conversation where the client diverged (the
            stored messages from there on are replaced), or ``None``.
    """

    new: tuple[Message, ...]
    fork_at: int | None = None


def match_key(message: Message) -> tuple[Any, ...]:
    """What two messages must share to be the same message."""
    calls = tuple((c.id, c.name, c.arguments) for c in message.tool_calls)
    return (message.role, message.content, calls, message.tool_call_id)


def reconcile(stored: Sequence[Message], incoming: Sequence[Message]) -> Reconciled:
    """Split ``incoming`` into what is already stored and what is new.

    Args:
        stored: the session's conversation (unpinned messages), oldest first.
        incoming: the request's messages without system messages, oldest first.

    Returns:
        :class:`Reconciled`: ``new`` to append, and ``fork_at`` when the client's
        history diverged from the stored one (see the module docstring for the rule).
    """
    have = [match_key(m) for m in stored]
    got = [match_key(m) for m in incoming]
    if have and got and got[0] == have[0]:
        # The client resends from the start: everything up to the first difference is stored.
        k = 0
        while k < len(have) and k < len(got) and got[k] == have[k]:
            k += 1
        if k == len(have):
            return Reconciled(new=tuple(incoming[k:]))
        if k < len(got) or len(got) > 1:
            # Edited (k < len(got)) or asked to regenerate what follows (a stored prefix).
            return Reconciled(new=tuple(incoming[k:]), fork_at=k)
        # A single message equal to the first stored one: read as a new message.
    # Only the new messages, or a recent window: skip the longest stored tail it repeats.
    for j in range(min(len(have), len(got)), 0, -1):
        if have[len(have) - j :] == got[:j]:
            return Reconciled(new=tuple(incoming[j:]))
    return Reconciled(new=tuple(incoming))


def fork_id(session_id: str, n: int) -> str:
    """The id of the ``n``-th fork of ``session_id`` (``n`` from 1)."""
    return f"{session_id}{FORK_SEPARATOR}{n}"
