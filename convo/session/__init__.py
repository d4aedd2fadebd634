"""A conversation that never exceeds its token budget: :class:`Session`.

A :class:`Session` owns the history of one conversation. Each turn it plans the prompt
(:func:`convo.plan.plan_prompt`: pinned system part, rolling summary, earlier recent
turns, retrieved passages after the question being answered, reply reserve), checks the
plan against an exact count of the rendered prompt, calls the engine with a capped
``generate``, stores the reply, and returns. The turns that left the window are folded
into the summary (in batches) in the background, by a
:class:`~convo.summarize.SummaryWorker`, at lower priority than replies.

While a summary is late, the prompt shows the previous summary and the turns it does not
cover yet when they all fit (the prompt then extends the previous one); otherwise the turn
goes on without it: at once on an engine that runs calls together (the reply runs beside
the summary), after waiting at most ``summary_wait_s`` on one that runs a call at a time
(where the reply would queue behind the summary anyway). Such a prompt shows a
provisional summary in the summary's place
(:func:`~convo.summarize.provisional_summary`: the previous summary and excerpts of the
turns it misses) and the window. The budget invariant holds in every case, and nothing
stored is lost.

The package's parts:

* :mod:`convo.session.session`: the :class:`Session` and its turn;
* :mod:`convo.session.turn`: the turn's steps and the blocking and awaited drivers that
  answer them (one core for :meth:`Session.send` and :meth:`Session.asend`);
* :mod:`convo.session.locking`: the turn lock (tasks, threads and processes take turns);
* :mod:`convo.session.history`: the stored messages in memory, cut into turns, and the
  checks a message passes before it is stored;
* :mod:`convo.session.window`: how the window of recent turns slides (pure functions);
* :mod:`convo.session.summaries`: the session's side of its rolling summary (the job, the
  provisional summary, how long a turn waits);
* :mod:`convo.session.config`: settings that travel together (:class:`SummaryConfig`,
  :class:`ReplyConfig`);
* :mod:`convo.session.reply`: what a turn returns (:class:`Reply`, :class:`TurnStats`).
"""

from __future__ import annotations

from convo.plan import Retriever
from convo.session.config import ReplyConfig, SummaryConfig
from convo.session.history import MAX_SESSION_ID_CHARS, incoming_messages
from convo.session.locking import TURN_LOCK_POLL_S
from convo.session.reply import Reply, TurnStats
from convo.session.session import Session
from convo.session.summaries import DEFAULT_SUMMARY_WAIT_S, SUMMARY_WAIT_AUTO, check_summary_wait
from convo.session.turn import TurnOptions

__all__ = [
    "DEFAULT_SUMMARY_WAIT_S",
    "MAX_SESSION_ID_CHARS",
    "SUMMARY_WAIT_AUTO",
    "TURN_LOCK_POLL_S",
    "Reply",
    "ReplyConfig",
    "Retriever",
    "Session",
    "SummaryConfig",
    "TurnOptions",
    "TurnStats",
    "check_summary_wait",
    "incoming_messages",
]
