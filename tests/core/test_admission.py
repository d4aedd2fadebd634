"""Admission control: ledger, policy, batching, and proof under load."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

import convo.admission
from convo.admission import (
    AdmissionController,
    AdmissionLimits,
    Batcher,
    Ledger,
    Request,
    split_for_padding,
)
from convo.errors import AdmissionError, ConfigError, QueueFullError, QueueTimeoutError
from convo.metrics import ServingMetrics

KB = 1024


def cost(prompt: int, new: int) -> int:
    return (prompt + new) * KB  # 1 KiB per token: easy arithmetic


def controller(**kw: object) -> AdmissionController:
    limits = AdmissionLimits(**{"kv_budget_bytes": 100 * KB, **kw})  # type: ignore[arg-type]
    return AdmissionController(limits, cost_fn=cost, metrics=ServingMetrics())


# -- accounting ---------------------------------------------------------------------------


def test_memory_ledger_is_a_deprecated_alias_of_ledger() -> None:
    with pytest.warns(DeprecationWarning, match=r"MemoryLedger is deprecated; use Ledger"):
        from convo.admission import MemoryLedger
    assert MemoryLedger is Ledger
    with pytest.raises(AttributeError):
        convo.admission.NoSuchLedger  # noqa: B018


def test_ledger_answers_without_raising() -> None:
    led = Ledger(100)
    assert led.try_charge(60) and not led.try_charge(41) and led.try_charge(40)
    assert led.in_use == 100 and not led.room_for(1)
    led.credit(100)
    assert led.peak == 100 and led.free == 100


@pytest.mark.parametrize(
    "kw",
    [
        {"kv_budget_bytes": 0},
        {"max_concurrency": 0},
        {"queue_timeout_s": 0},
        {"max_queue_short": -1},
        {"long_every": 0},
        {"long_request_tokens": 0},
    ],
)
def test_limits_reject_nonsense(kw: dict[str, int]) -> None:
    with pytest.raises(ConfigError):
        AdmissionLimits(**{"kv_budget_bytes": 1, **kw})  # type: ignore[arg-type]


# -- policy at the capacity edge ------------------------------------------------------------


def test_admits_exactly_to_the_budget_then_queues() -> None:
    ctl = controller()
    a = ctl.acquire(Request(prompt_tokens=40, max_new_tokens=10))  # 50 KiB
    b = ctl.acquire(Request(prompt_tokens=40, max_new_tokens=10))  # 100 KiB: exactly full
    assert ctl.ledger.in_use == 100 * KB
    with pytest.raises(QueueTimeoutError):
        ctl.acquire(Request(prompt_tokens=0, max_new_tokens=1), timeout_s=0.05)
    a.release()
    with ctl.acquire(Request(prompt_tokens=49, max_new_tokens=1)):
        assert ctl.ledger.in_use == 100 * KB
    b.release()
    assert ctl.ledger.in_use == 0 and ctl.running == 0 and ctl.waiting == 0


def test_concurrency_cap() -> None:
    ctl = controller(max_concurrency=2)
    t1 = ctl.acquire(Request(prompt_tokens=1, max_new_tokens=1))
    t2 = ctl.acquire(Request(prompt_tokens=1, max_new_tokens=1))
    with pytest.raises(QueueTimeoutError):
        ctl.acquire(Request(prompt_tokens=1, max_new_tokens=1), timeout_s=0.02)
    t1.release()
    t2.release()


def test_too_large_is_refused_at_once_and_typed() -> None:
    ctl = controller()
    with pytest.raises(AdmissionError, match="whole budget"):
        ctl.acquire(Request(prompt_tokens=200, max_new_tokens=1))


def test_queue_full_carries_retry_after() -> None:
    ctl = controller(max_queue_short=1, max_concurrency=1)
    held = ctl.acquire(Request(prompt_tokens=1, max_new_tokens=1))
    waiter = threading.Thread(
        target=lambda: ctl.acquire(Request(prompt_tokens=1, max_new_tokens=1), timeout_s=5).release()
    )
    waiter.start()
    while ctl.waiting == 0:
        time.sleep(0.001)
    with pytest.raises(QueueFullError) as info:
        ctl.acquire(Request(prompt_tokens=1, max_new_tokens=1))
    assert info.value.retry_after_s > 0
    held.release()
    waiter.join()
    snap = ctl.metrics.snapshot()  # type: ignore[union-attr]
    assert snap["convo_requests_refused_total"][(("reason", "queue_full"),)] == 1


class LoggingLedger(Ledger):
    """Records every charge, in admission order (under the controller's lock)."""

    def __init__(self, budget_bytes: int) -> None:
        super().__init__(budget_bytes)
        self.charges: list[int] = []

    def try_charge(self, nbytes: int) -> bool:
        ok = super().try_charge(nbytes)
        if ok:
            self.charges.append(nbytes)
        return ok


def test_long_requests_get_a_turn_and_do_not_starve_shorts() -> None:
    # budget fits one long (80 KiB) or several shorts (10 KiB each); shorts keep arriving
    ledger = LoggingLedger(100 * KB)
    ctl = AdmissionController(
        AdmissionLimits(kv_budget_bytes=100 * KB, long_request_tokens=50, long_every=3, long_max_wait_s=60),
        cost_fn=cost,
        ledger=ledger,
    )
    first = [ctl.acquire(Request(prompt_tokens=10, max_new_tokens=0)) for _ in range(10)]

    def go(tokens: int) -> None:
        with ctl.acquire(Request(prompt_tokens=tokens, max_new_tokens=0), timeout_s=10):
            time.sleep(0.002)

    threads = [threading.Thread(target=go, args=(80,))]
    threads[0].start()
    while ctl.waiting < 1:
        time.sleep(0.001)
    for _ in range(12):
        threads.append(threading.Thread(target=go, args=(10,)))
        threads[-1].start()
    while ctl.waiting < 13:
        time.sleep(0.001)
    for t in first:
        t.release()
    for t in threads:
        t.join()
    order = ["long" if c == 80 * KB else "short" for c in ledger.charges[10:]]
    assert order.count("short") == 12  # the long one did not starve the shorts
    assert order.index("long") <= 3  # shorts did not starve it: its turn came after 3


# -- batching -------------------------------------------------------------------------------


def test_batcher_groups_concurrent_items() -> None:
    calls: list[list[int]] = []

    def run_batch(items: list[int]) -> list[int]:
        calls.append(items)
        time.sleep(0.01)
        return [i * 2 for i in items]

    with Batcher(run_batch, max_batch_size=4, batch_window_s=0.02) as b:
        futs = [b.submit(i) for i in range(10)]
        assert [f.result() for f in futs] == [i * 2 for i in range(10)]
    assert max(len(c) for c in calls) == 4 and len(calls) <= 4


def test_split_for_padding_bounds_waste() -> None:
    rng = random.Random(5)
    lengths = [rng.randint(10, 3000) for _ in range(200)]
    groups = split_for_padding(lengths, lambda n: n, max_padding_ratio=0.25)
    assert sorted(x for g in groups for x in g) == sorted(lengths)
    for g in groups:
        assert len(g) * max(g) <= 1.25 * sum(g)
    assert max(len(g) for g in groups) > 1


def test_batcher_errors_reach_every_caller() -> None:
    def boom(items: list[int]) -> list[int]:
        raise RuntimeError("engine down")

    with Batcher(boom, batch_window_s=0.01) as b:
        futs = [b.submit(i) for i in range(3)]
        for f in futs:
            with pytest.raises(RuntimeError, match="engine down"):
                f.result()


# -- proof under load -----------------------------------------------------------------------


@dataclass
class Outcome:
    """How the requests of a stress test ended (counted from any thread)."""

    ok: int = 0
    refused: int = 0
    timed_out: int = 0
    untyped: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @contextlib.contextmanager
    def tally(self) -> Iterator[None]:
        """Count how the block ends: ok, refused, timed out, or an untyped error (kept)."""
        try:
            yield
            kind = "ok"
        except QueueFullError as exc:
            assert exc.retry_after_s >= 0
            kind = "refused"
        except QueueTimeoutError:
            kind = "timed_out"
        except Exception:
            kind = "untyped"
        with self.lock:
            setattr(self, kind, getattr(self, kind) + 1)


class FakeRunner:
    """A run_batch that checks, while running, that the ledger never passes its budget."""

    def __init__(self, ctl: AdmissionController) -> None:
        self.ctl = ctl
        self.max_seen = 0
        self.lock = threading.Lock()

    def __call__(self, reqs: list[Request]) -> list[str]:
        in_use = self.ctl.ledger.in_use
        with self.lock:
            self.max_seen = max(self.max_seen, in_use)
        assert in_use <= self.ctl.ledger.budget
        assert self.ctl.running <= self.ctl.limits.max_concurrency
        time.sleep(0.001 * max(r.max_new_tokens for r in reqs) / 16)
        return [f"reply-{r.id}" for r in reqs]


def _started_threads(client: Callable[[Request], None], reqs: list[Request]) -> list[threading.Thread]:
    """A thread per request running ``client``, all started."""
    threads = [threading.Thread(target=client, args=(r,)) for r in reqs]
    for t in threads:
        t.start()
    return threads


def _mixed(rng: random.Random) -> Request:
    if rng.random() < 0.2:
        return Request(prompt_tokens=rng.randint(300, 700), max_new_tokens=rng.randint(16, 64))
    return Request(prompt_tokens=rng.randint(5, 120), max_new_tokens=rng.randint(4, 32))


def _check(ctl: AdmissionController, out: Outcome, n: int, runner: FakeRunner) -> None:
    assert out.untyped == 0
    assert out.ok + out.refused + out.timed_out == n  # no request lost
    assert out.ok > n // 2
    assert ctl.ledger.peak <= ctl.ledger.budget  # never admitted past budget
    assert runner.max_seen <= ctl.ledger.budget
    assert ctl.ledger.in_use == 0 and ctl.running == 0 and ctl.waiting == 0  # drained
    snap = ctl.metrics.snapshot()  # type: ignore[union-attr]
    assert snap["convo_requests_completed_total"] == out.ok
    refused = snap["convo_requests_refused_total"]
    assert sum(refused.values()) == out.refused + out.timed_out  # type: ignore[union-attr]


def _stress_setup(
    seed: int, *, max_queue_short: int, max_queue_long: int
) -> tuple[AdmissionController, FakeRunner, Outcome, list[Request]]:
    """A controller (2,000 KB, 8 at once, 20 s queue timeout) with these queues, its
    checking runner, an empty tally and 400 mixed requests drawn from ``seed``."""
    ctl = controller(
        kv_budget_bytes=2000 * KB,
        max_concurrency=8,
        max_queue_short=max_queue_short,
        max_queue_long=max_queue_long,
        long_request_tokens=256,
        queue_timeout_s=20,
    )
    rng = random.Random(seed)
    return ctl, FakeRunner(ctl), Outcome(), [_mixed(rng) for _ in range(400)]


def test_stress_threads() -> None:
    ctl, runner, out, reqs = _stress_setup(0, max_queue_short=150, max_queue_long=20)
    with Batcher(runner, max_batch_size=8, batch_window_s=0.002) as batcher:

        def client(req: Request) -> None:
            with out.tally(), ctl.acquire(req):
                assert batcher.run(req) == f"reply-{req.id}"

        for t in _started_threads(client, reqs):
            t.join()
    _check(ctl, out, len(reqs), runner)
    assert max(batcher.batch_sizes) > 1  # concurrent requests were batched


def test_stress_asyncio() -> None:
    ctl, runner, out, reqs = _stress_setup(1, max_queue_short=300, max_queue_long=80)

    async def main() -> None:
        with Batcher(runner, max_batch_size=8, batch_window_s=0.002) as batcher:
            beat = 0

            async def heartbeat() -> None:  # proves the loop is never blocked for long
                nonlocal beat
                while True:
                    beat += 1
                    await asyncio.sleep(0.001)

            hb = asyncio.create_task(heartbeat())

            async def client(req: Request) -> None:
                with out.tally():
                    async with await ctl.acquire_async(req):
                        assert await batcher.run_async(req) == f"reply-{req.id}"

            await asyncio.gather(*(client(r) for r in reqs))
            hb.cancel()
            assert beat > 5

    asyncio.run(main())
    _check(ctl, out, len(reqs), runner)


def test_stress_tight_queue_refuses_typed() -> None:
    ctl = controller(
        kv_budget_bytes=300 * KB,
        max_concurrency=2,
        max_queue_short=5,
        max_queue_long=2,
        long_request_tokens=256,
        queue_timeout_s=0.5,
    )
    runner = FakeRunner(ctl)
    out = Outcome()
    rng = random.Random(2)
    reqs = [_mixed(rng) for _ in range(200)]
    reqs = [r for r in reqs if r.total_tokens <= 300]

    def client(req: Request) -> None:
        with out.tally(), ctl.acquire(req):
            runner([req])

    # Both slots are taken while the burst arrives, so the small queues must overflow
    # whatever the scheduler does; then the slots free up and the queue drains.
    held = [ctl.acquire(Request(prompt_tokens=8, max_new_tokens=8)) for _ in range(2)]
    threads = _started_threads(client, reqs)
    deadline = time.monotonic() + 10
    while ctl.waiting < 7 and time.monotonic() < deadline:
        time.sleep(0.01)
    for ticket in held:
        ticket.release()
    for t in threads:
        t.join()
    assert out.refused > 0
    assert out.untyped == 0 and out.ok + out.refused + out.timed_out == len(reqs)
    assert ctl.ledger.peak <= ctl.ledger.budget
    assert ctl.ledger.in_use == 0 and ctl.waiting == 0


# -- a real tiny model -----------------------------------------------------------------------


@pytest.mark.slow
def test_stress_real_tiny_model() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from benchmarks.concurrency import TinyRunner, build_model
    from convo.planner import VRAMModel as MemoryModel

    torch.manual_seed(0)
    model = build_model("random:tiny-llama", device="cpu", quant="none")
    mm = MemoryModel.from_model("random:tiny-llama")
    budget = 8 * mm.request_bytes(200, 16)
    ctl = AdmissionController(
        AdmissionLimits(
            kv_budget_bytes=budget, max_concurrency=8, queue_timeout_s=120, long_request_tokens=128
        ),
        cost_fn=mm.request_bytes,
        metrics=ServingMetrics(),
    )
    runner = TinyRunner(model)
    rng = random.Random(3)
    reqs = [Request(prompt_tokens=rng.randint(8, 200), max_new_tokens=rng.randint(2, 16)) for _ in range(120)]
    results: dict[int, int] = {}
    errors: list[BaseException] = []
    with Batcher(runner, max_batch_size=8, batch_window_s=0.01) as batcher:

        def client(req: Request) -> None:
            try:
                with ctl.acquire(req):
                    assert ctl.ledger.in_use <= budget
                    results[req.id] = len(batcher.run(req))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=client, args=(r,)) for r in reqs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    assert len(results) == len(reqs)
    assert all(results[r.id] == r.max_new_tokens for r in reqs)
    assert ctl.ledger.peak <= budget and ctl.ledger.in_use == 0
    assert max(batcher.batch_sizes) > 1


def test_a_token_budget_is_named_and_charged_in_tokens() -> None:
    limits = AdmissionLimits(kv_budget_tokens=1000)
    assert (limits.unit, limits.budget) == ("tokens", 1000)
    ctl = AdmissionController(limits)
    assert ctl.ledger.unit == "tokens"
    with ctl.acquire(Request(prompt_tokens=600, max_new_tokens=100)):
        assert ctl.ledger.in_use == 700
    with pytest.raises(AdmissionError, match="1,001 tokens"):
        with ctl.acquire(Request(prompt_tokens=901, max_new_tokens=100)):
            pass
    for bad in ({}, {"kv_budget_bytes": 1, "kv_budget_tokens": 1}):
        with pytest.raises(ConfigError, match="exactly one"):
            AdmissionLimits(**bad)  # type: ignore[arg-type]
