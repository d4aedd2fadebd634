"""What this process already read of each session's history, so that a turn reads only
what was stored since (issue 27 #14: a turn reads O(new), not O(history)).

A server builds a :class:`~convo.session.Session` per request, and ``convo chat
--session X`` one per start; each used to read the whole stored history. A session's
history is append-only within one epoch (:attr:`~convo.stores.SessionState.epoch`: an
id deleted and created again, or rewritten by a fork, gets a new one), so a session
object that finds the history of its store, id and epoch here takes a copy and reads
only the messages stored after it (:meth:`~convo.stores.Store.load_tail`: an index range
in SQLite, ``LRANGE`` in Redis). The first resume of a session in a process still reads
it whole.

The entries are the :class:`~convo.session.history.History` objects of the sessions
themselves (registered when a session creates, resumes or re-reads its history), held
under the store's lock on the session whenever they change or are copied; at most
:data:`MAX_KNOWN_HISTORIES` sessions are kept, the least recently used go first.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

from convo.session.history import History
from convo.stores import Store

#: Sessions whose history this process keeps to resume them cheaply (least recently
#: used dropped first). Each keeps its whole history in memory (the session objects
#: hold it anyway while they live).
MAX_KNOWN_HISTORIES = 256

_GUARD = threading.Lock()
_KNOWN: OrderedDict[tuple[int, str], tuple[weakref.ref[Store], str, History]] = OrderedDict()


def remember(store: Store, session_id: str, epoch: str, history: History) -> None:
    """Register ``history`` as what is known of ``session_id`` of ``epoch`` in ``store``
    (the object itself: it grows as its session stores messages)."""
    with _GUARD:
        key = (id(store), session_id)
        for gone in [k for k, (ref, _, _) in _KNOWN.items() if ref() is None]:
            del _KNOWN[gone]  # the store was dropped: so is what was read from it
        _KNOWN[key] = (weakref.ref(store), epoch, history)
        _KNOWN.move_to_end(key)
        while len(_KNOWN) > MAX_KNOWN_HISTORIES:
            _KNOWN.popitem(last=False)


def known(store: Store, session_id: str) -> tuple[str, History] | None:
    """A copy of the history known of ``session_id`` in ``store``, with its epoch; the
    caller holds the store's lock on the session."""
    with _GUARD:
        entry = _KNOWN.get((id(store), session_id))
        if entry is None or entry[0]() is not store:
            return None
        _KNOWN.move_to_end((id(store), session_id))
        epoch, history = entry[1], entry[2]
    return epoch, history.copy()
