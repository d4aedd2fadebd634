"""How much stored history one turn reads (issue 27 #14): a one-message turn on a
SQLite session with ~1k and ~20k stored messages, with a fake engine (no model time).

Three kinds of turn are timed:

* ``cold``: a new store object and session on the stored id, then ``send`` (the first
  turn of a session in a process: nothing of it is known yet);
* ``resumed``: a new :class:`~convo.Session` object on the stored id, then ``send`` (what
  a server does on every request, and ``convo chat --session X`` at start);
* ``live``: ``send`` on a session object that is kept between turns.

Prints JSON on stdout: per stored size, the median seconds of each kind of turn and how
many messages the store handed back (``messages_read``, counted at the store, the most of
any round; ``messages_read_after_first``: of the rounds after the first, since the seeded
session, stored as before window marks, gets its mark on its first turn).

    PYTHONPATH=. python benchmarks/turn_reads.py [--sizes 1000 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from convo import Budget, Session
from convo.messages import Message, Role
from convo.session import SummaryConfig
from convo.stores import SessionState, SQLiteStore
from convo.summarize import SummaryWorker
from convo.testing import ScriptedEngine

#: The budget of the timed sessions: a window of 4 turns, the rest summarized.
BUDGET = Budget(context_tokens=4096, max_new_tokens=64, window_turns=4, summarize_batch_turns=2)


class CountingStore(SQLiteStore):
    """A SQLiteStore that counts the messages its reads return."""

    messages_read = 0

    def load(self, session_id: str) -> tuple[SessionState, list[Message]]:
        state, messages = super().load(session_id)
        CountingStore.messages_read += len(messages)
        return state, messages

    def load_tail(self, session_id: str, after: int) -> Any:
        tail = super().load_tail(session_id, after)
        CountingStore.messages_read += len(tail.messages)
        return tail


def seed(store: SQLiteStore, sid: str, messages: int) -> None:
    """A session with ``messages`` stored messages (user/assistant turns), all but the last
    window's turns evicted and summarized."""
    turns = messages // 2
    history = [
        Message(role=Role.USER if i % 2 == 0 else Role.ASSISTANT, content=f"message {i} " + "x" * 60)
        for i in range(turns * 2)
    ]
    evicted = max(turns - BUDGET.window_turns, 0)
    state = SessionState(
        session_id=sid,
        settings={"budget": BUDGET.to_dict()},
        summary="an earlier summary",
        summarized_turns=evicted,
        evicted_turns=evicted,
    )
    store.create(state, [Message(role=Role.SYSTEM, content="be brief", pinned=True), *history])


def run(sizes: list[int], rounds: int) -> dict[str, Any]:
    worker = SummaryWorker(threads=1, max_defer_s=0.0)
    out: dict[str, Any] = {"benchmark": "turn_reads", "store": "sqlite", "rounds": rounds, "sizes": []}
    with tempfile.TemporaryDirectory() as folder:
        for size in sizes:
            store = CountingStore(Path(folder) / f"s{size}.db")
            seed(store, "s", size)
            engine = ScriptedEngine()
            row: dict[str, Any] = {"stored_messages": size}
            config = SummaryConfig(worker=worker)
            for kind in ("cold", "resumed", "live"):
                times, reads = [], []
                live = Session(engine, store=store, session_id="s", summarizing=config)
                for i in range(rounds):
                    CountingStore.messages_read = 0
                    t0 = time.perf_counter()
                    if kind == "cold":
                        session = Session(
                            engine, store=CountingStore(store.path), session_id="s", summarizing=config
                        )
                    else:
                        session = (
                            live
                            if kind == "live"
                            else Session(engine, store=store, session_id="s", summarizing=config)
                        )
                    session.send(f"one more message {i}")
                    times.append(time.perf_counter() - t0)
                    reads.append(CountingStore.messages_read)
                    session.wait_summary(30)
                row[kind] = {
                    "median_s": round(statistics.median(times), 5),
                    "messages_read": max(reads),
                    # (a session stored before window marks: its first turn writes one)
                    "messages_read_after_first": max(reads[1:], default=0),
                    "first_s": round(times[0], 5),
                }
            out["sizes"].append(row)
            store.close()
    worker.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 20000])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps(run(args.sizes, args.rounds), indent=2))


if __name__ == "__main__":
    main()
