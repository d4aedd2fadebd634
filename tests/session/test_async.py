"""Session.asend / astream on the async core: an OpenAIEngine awaits httpx.AsyncClient
(no worker thread) against a live echo server; a sync engine runs in a worker thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import serve

from convo import Budget, OpenAIEngine, Session
from convo.models import FinishReason
from convo.testing import EchoEngine

BUDGET = Budget(context_tokens=2048, max_new_tokens=64, window_turns=4, summary_tokens=0)


@pytest.fixture
def echo_base() -> Iterator[str]:
    from convo import InMemoryStore
    from convo.server.app import create_app

    with serve(
        create_app(EchoEngine(delay_s=0.01), store=InMemoryStore(), budget=BUDGET, model_name="echo")
    ) as base:
        yield base


def test_asend_and_astream_await_the_remote_engine(echo_base: str) -> None:
    engine = OpenAIEngine(f"{echo_base}/v1", context_window=2048, max_retries=0)
    session = Session(engine, budget=BUDGET, system_prompt="be brief")
    threads: set[str] = set()

    async def main() -> tuple[Any, list[str], Any]:
        original = engine.generate

        def sync_generate(*args: Any, **kwargs: Any) -> Any:  # must not be used
            threads.add(threading.current_thread().name)
            return original(*args, **kwargs)

        engine.generate = sync_generate  # type: ignore[method-assign]
        first = await session.asend("my name is Ada")
        stream = session.astream({"role": "user", "content": "who am I"})
        pieces = [p async for p in stream]
        return first, pieces, stream.result

    first, pieces, second = asyncio.run(main())
    assert threads == set()  # every generation went through agenerate
    assert first.text == "heard 2: my name is Ada"
    assert "".join(pieces) == second.text == "heard 4: who am I" and len(pieces) > 1
    assert [m.role.value for m in session.messages] == ["system", "user", "assistant", "user", "assistant"]


def test_leaving_an_astream_early_cancels_and_stores_the_partial_reply(echo_base: str) -> None:
    from convo import InMemoryStore
    from convo.server.app import create_app

    slow = EchoEngine(delay_s=0.05, pad_words=60)
    with serve(create_app(slow, store=InMemoryStore(), budget=BUDGET, model_name="echo")) as base:
        engine = OpenAIEngine(f"{base}/v1", context_window=2048, max_retries=0)
        session = Session(engine, budget=BUDGET)

        async def main() -> list[str]:
            got = []
            async with session.astream("talk for a while") as stream:
                async for piece in stream:
                    got.append(piece)
                    if len(got) == 3:
                        break
            assert stream.result is None  # cancelled: the reply is stored, not returned here
            return got

        got = asyncio.run(main())
    assert len(got) == 3
    stored = session.messages[-1]
    assert stored.role.value == "assistant" and 0 < len(stored.content.split()) < 60


def test_a_sync_engine_runs_in_a_worker_thread_and_turns_stay_ordered(fake_engine: Any) -> None:
    session = Session(fake_engine, budget=BUDGET)

    async def main() -> list[Any]:
        return await asyncio.gather(*(session.asend(f"q{i}") for i in range(5)))

    replies = asyncio.run(main())
    assert all(r.finish_reason is FinishReason.STOP for r in replies)
    roles = [m.role.value for m in session.messages]
    assert roles == ["user", "assistant"] * 5  # one turn at a time, never interleaved


def test_async_turns_exclude_sync_turns_of_the_same_session(fake_engine: Any) -> None:
    session = Session(fake_engine, budget=BUDGET)
    entered = threading.Event()
    release = threading.Event()

    def slow_reply(messages: Any) -> str:
        entered.set()
        release.wait(5)
        return "slow"

    fake_engine.reply_fn = slow_reply
    worker = threading.Thread(target=session.send, args=("sync turn",))
    worker.start()
    entered.wait(5)

    async def main() -> Any:
        fake_engine.reply_fn = None
        task = asyncio.ensure_future(session.asend("async turn"))
        await asyncio.sleep(0.1)
        assert not task.done()  # waiting for the thread's turn
        release.set()
        return await task

    asyncio.run(main())
    worker.join()
    assert [m.content for m in session.messages][:2] == ["sync turn", "slow"]


#: One process's side of the test below: ``turns`` asend calls on the shared session,
#: started together with the other process (at ``start_at``, a wall-clock time).
ASEND_PROCESS = """
import asyncio, sys, time
from convo import Budget, Session, SQLiteStore
from convo.testing import EchoEngine

path, name, turns, start_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
budget = Budget(context_tokens=100_000, max_new_tokens=64, window_turns=200, summary_tokens=0)

async def main():
    session = Session(EchoEngine(delay_s=0.005), budget=budget, store=SQLiteStore(path), session_id="shared")
    time.sleep(max(0.0, start_at - time.time()))
    for i in range(turns):
        await session.asend(f"{name} {i}")
        await asyncio.sleep(0)  # let the other process in between turns, not within one

asyncio.run(main())
"""


def test_asend_in_two_processes_takes_turns_on_one_sqlite_session(tmp_path: Any) -> None:
    """``asend`` holds the store's cross-process lock, as ``send`` does: two processes
    driving one session store whole turns (user, then its own reply), never interleaved,
    and each catches up with the other's turns (the reply sees the whole history)."""
    import os
    import subprocess
    import sys
    import time

    from convo import SQLiteStore

    path, turns = str(tmp_path / "sessions.db"), 15
    start_at = time.time() + 4.0  # both processes have imported convo by then
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ASEND_PROCESS, path, name, str(turns), str(start_at)], env=env
        )
        for name in ("a", "b")
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    _, messages = SQLiteStore(path).load("shared")
    assert len(messages) == 4 * turns
    pairs = [(messages[i], messages[i + 1]) for i in range(0, len(messages), 2)]
    assert all(u.role.value == "user" and a.role.value == "assistant" for u, a in pairs)
    for k, (question, answer) in enumerate(pairs):
        # The engine saw the whole history: both processes' turns before this one.
        assert answer.content == f"heard {2 * k + 1}: {question.content}"
    assert {u.content.split()[0] for u, _ in pairs} == {"a", "b"}


def test_asend_waits_for_the_store_lock_without_blocking_the_loop(tmp_path: Any) -> None:
    """Two Session objects on one session in one event loop take turns (the store's lock
    is per thread, and both tasks run on the loop's thread); a turn held elsewhere is
    waited for while the loop runs other tasks, up to ``lock_timeout_s``."""
    from convo import SQLiteStore
    from convo.errors import SessionBusy

    store = SQLiteStore(str(tmp_path / "s.db"))
    first = Session(EchoEngine(delay_s=0.01), budget=BUDGET, store=store, session_id="x")
    second = Session(EchoEngine(delay_s=0.01), budget=BUDGET, store=store, session_id="x", lock_timeout_s=0.3)

    async def both() -> None:
        await asyncio.gather(
            *(s.asend(f"{n} {i}") for i in range(3) for n, s in (("a", first), ("b", second)))
        )

    asyncio.run(both())
    contents = [m.content for m in store.load("x")[1]]
    assert all(
        a.startswith("heard ") and a.endswith(q) for q, a in zip(contents[::2], contents[1::2], strict=True)
    )

    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with store.lock("x"):
            held.set()
            release.wait(5)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(5)

    async def blocked() -> int:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.ensure_future(tick())
        with pytest.raises(SessionBusy, match="busy with another turn"):
            await second.asend("while another thread holds the session")
        ticker.cancel()
        return ticks

    try:
        assert asyncio.run(blocked()) >= 10  # the loop ran on while the turn waited 0.3 s
    finally:
        release.set()
        holder.join()
    assert len(store.load("x")[1]) == 12  # nothing stored for the refused turn
