"""Reconciling the messages a client sends with the history the server has stored.

Clients of an OpenAI-compatible API do one of two things with a conversation: send only
the new message (the server keeps the rest), or resend the whole conversation every time
(the ``openai`` SDK used as documented, LangChain's ``ChatOpenAI``, LlamaIndex's
``OpenAI``). Some trim what they resend to a recent window. :func:`reconcile` tells the
cases apart so that the server stores every message exactly once::

    stored   : u1 a1 u2 a2
    incoming : u1 a1 u2 a2 u3      resend      -> append u3
    incoming :             u3      only new    -> append u3
    incoming :       u2 a2 u3      window      -> append u3 (the stored tail it repeats)
    incoming : u1 a1 u2' ...       divergence  -> fork at 2 (u2 was edited)
    incoming : u1 a1 u2            regenerate  -> fork at 3 (a new answer to u2)
    incoming : u1' a1 u2 a2 u3     first edit  -> fork at 0 (u1 was edited)

**When two messages are the same message** (:func:`match_key`). Clients resend their own
copy of the conversation, not the server's bytes, so messages match on what they say:

* the role, the tool call ids and names, and ``tool_call_id``, exactly;
* tool-call arguments as JSON *values*: ``{"city": "Porto"}`` and ``{"city":"Porto"}``
  (other spacing, other key order) are the same arguments; arguments that are not JSON
  match after whitespace normalisation;
* an **assistant** message's text by its *words*: the runs of letters and digits, in
  order, case kept. Whitespace, punctuation and markdown markup are presentation: a client
  that trims the reply, collapses its blank lines or re-renders its markdown (``**a**`` as
  ``__a__``, ``*`` bullets as ``-``, a heading as plain text) resends the server's reply.
  A changed, added or removed word is an edit;
* any other message's text (user, tool) after whitespace normalisation (runs of whitespace
  as one space, ends trimmed): a user's edit that changes a character other than
  whitespace is an edit, and forks.

The session keeps its own copy of a matched message (the reply as the server generated it).
System messages are not part of this comparison: a session keeps the system prompt it was
created with.

**Alignment.** The client's messages are laid over the stored ones at every position where
its first message matches a stored one:

1. If they repeat a *tail* of the stored history (the whole history when resent from the
   start, or a recent window), the rest is new: appended, no fork. The longest such tail
   wins. A window that starts with a message equal to the first one (a repeated "hi") is
   therefore aligned where it really starts, not at the beginning.
2. Otherwise, if they repeat a run of stored messages and then differ (an edit) or stop
   before the stored end (asking for a new answer to their last message), the session
   **forks** after that run. The run must start at the first stored message, or be at
   least two messages long (:data:`MIN_ANCHOR`): one equal message in the middle is no
   evidence (a client sending only "ok" again is sending a new message). The longest run
   wins; of equal runs, the earliest. A single message equal to the first stored one is a
   new message.
3. Otherwise, if the client's *first* message differs from the stored first one and its
   next messages repeat the stored ones at the same places (at least :data:`MIN_ANCHOR`
   of them, or all the stored rest), the client edited its first message: the session
   forks at 0 and continues as the client's messages (a resending client that edits its
   first turn no longer has its whole history appended again as new). One message alone
   is a new message: an only-new client sends exactly that.
4. Otherwise every message is new.

On a fork at ``k`` the stored messages from ``k`` on move, readable, to a new session
``<id>~<n>`` (same owner; ``GET /v1/sessions/<id>~<n>``), and the session continues as
``stored[:k] + incoming[...]``. The response reports it in ``convo.forked`` (a streamed
response in its final chunk). How many forks a session keeps is bounded
(:attr:`~convo.server.limits.ServerLimits.max_forks_per_session`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from convo.messages import Message, Role

#: Separates a session id from the number of a fork holding its replaced tail.
FORK_SEPARATOR = "~"

#: Fewest consecutive matching messages that anchor a divergence anywhere but at the start
#: of the stored history, or line up the rest after an edited first message (rules 2 and 3
#: of the module docstring).
MIN_ANCHOR = 2

# Letters and digits (``\w`` without the underscore, which is markdown markup).
_WORD = re.compile(r"[^\W_]+")


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


def _spaces(text: str) -> str:
    """``text`` with each run of whitespace as one space and its ends trimmed."""
    return " ".join(text.split())


def _arguments(arguments: str) -> str:
    """Tool-call arguments as canonical JSON (sorted keys, no spacing), when they are JSON."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return _spaces(arguments)
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def match_key(message: Message) -> tuple[Any, ...]:
    """What two messages must share to be the same message (see the module docstring)."""
    calls = tuple((c.id, c.name, _arguments(c.arguments)) for c in message.tool_calls)
    if message.role is Role.ASSISTANT:
        text: Any = tuple(_WORD.findall(message.content))
    else:
        text = _spaces(message.content)
    return (message.role, text, calls, message.tool_call_id)


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
    if not have or not got:
        return Reconciled(new=tuple(incoming))

    def run(p: int) -> int:
        """How many of the client's messages match the stored ones from ``p`` on."""
        k = 0
        while p + k < len(have) and k < len(got) and have[p + k] == got[k]:
            k += 1
        return k

    runs = [(p, run(p)) for p in range(len(have)) if have[p] == got[0]]
    # 1. A stored tail repeated (the whole history, or a window): the longest one.
    for p, k in runs:
        if p + k == len(have):
            return Reconciled(new=tuple(incoming[k:]))
    # 2. A stored run repeated, then an edit or the end (regenerate): fork after it.
    best: tuple[int, int] | None = None
    for p, k in runs:
        if p == 0 and k == 1 and len(got) == 1:
            continue  # one message equal to the first stored one: a new message
        if p > 0 and k < MIN_ANCHOR:
            continue
        if best is None or k > best[1]:
            best = (p, k)
    if best is not None:
        p, k = best
        return Reconciled(new=tuple(incoming[k:]), fork_at=p + k)
    # 3. The first message edited, the rest resent at its place: fork at the start.
    if have[0] != got[0] and len(got) > 1:
        k = 0
        while 1 + k < len(have) and 1 + k < len(got) and have[1 + k] == got[1 + k]:
            k += 1
        if k >= MIN_ANCHOR or (k and 1 + k == len(have)):
            return Reconciled(new=tuple(incoming), fork_at=0)
    # 4. Only new messages.
    return Reconciled(new=tuple(incoming))


def fork_id(session_id: str, n: int) -> str:
    """The id of the ``n``-th fork of ``session_id`` (``n`` from 1)."""
    return f"{session_id}{FORK_SEPARATOR}{n}"
