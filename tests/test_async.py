"""Session.asend / astream on the async core: an OpenAIEngine awaits httpx.AsyncClient
(no worker thread) against a live echo server; a sync engine runs in a worker thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from test_server import serve

from convo import Budget, OpenAIEngine, Session
from convo.engines.base import FinishReason
from convo.testing import EchoEngine

BUDGET = Budget(context_tokens=2048, max_new_tokens=64, window_turns=4, summary_tokens=0)


@pytest.fixture
def echo_base() -> Iterator[str]:
    from convo import MemoryStore
    from convo.server.app import create_app

    with serve(
        create_app(EchoEngine(delay_s=0.01), store=MemoryStore(), budget=BUDGET, model_name="echo")
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
    from convo import MemoryStore
    from convo.server.app import create_app

    slow = EchoEngine(delay_s=0.05, pad_words=60)
    with serve(create_app(slow, store=MemoryStore(), budget=BUDGET, model_name="echo")) as base:
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
