"""Admission control: many sessions, one memory budget.

Accounting answers, policy decides. :class:`Ledger` only answers "is there room
for N bytes" and keeps the books; :class:`AdmissionController` decides to admit, queue or
refuse; :class:`Batcher` groups admitted requests into one ``generate``::

    submit ──> too big for the whole budget?  ── yes ──> AdmissionError
      │
      ├─ short queue (FIFO) ─┐     admit while ledger has room and
      │                      ├──>  running < max_concurrency      ──> acquire() returns
      ├─ long queue (FIFO) ──┘     (a long head gets a turn after
      │                            long_every shorts or long_max_wait_s)
      ├─ queue full ──> QueueFullError(retry_after_s)
      └─ waited > queue_timeout_s ──> QueueTimeoutError

A request's cost is its KV bytes for ``prompt + max_new_tokens`` plus its share of the
activations (:meth:`convo.planner.VRAMModel.request_bytes`); inject any ``cost_fn``.

The core is thread-based; :meth:`AdmissionController.acquire` blocks the calling thread,
:meth:`AdmissionController.acquire_async` awaits the same core without blocking the event
loop (the core resolves an asyncio future through ``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import enum
import itertools
import logging
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from convo.errors import AdmissionError, ConfigError, QueueFullError, QueueTimeoutError
from convo.metrics import ServingMetrics

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------
# Accounting
# --------------------------------------------------------------------------------------


class Ledger:
    """Units (bytes of device memory, or tokens) charged against a budget. Thread-safe.
    Never raises for lack of room: running out of room is a ``False``, not an exception.

    Args:
        budget: the most that may be charged at once, in ``unit``.
        unit: ``"bytes"`` (a memory model prices requests) or ``"tokens"`` (prompt +
            reply cap). Default ``"bytes"``.

    Example::

        ledger = Ledger(1 << 30)
        ledger.try_charge(300 << 20)   # True
        ledger.room_for(900 << 20)     # False
        ledger.credit(300 << 20)
    """

    def __init__(self, budget: int, unit: str = "bytes") -> None:
        if unit not in ("bytes", "tokens"):
            raise ConfigError(f"unit must be 'bytes' or 'tokens', got {unit!r}")
        if budget <= 0:
            raise ConfigError(f"the ledger's budget must be positive, got {budget} {unit}")
        self.budget = int(budget)
        self.unit = unit
        self._in_use = 0
        self._peak = 0
        self._lock = threading.Lock()

    @property
    def in_use(self) -> int:
        """Charged now, in :attr:`unit`."""
        return self._in_use

    @property
    def peak(self) -> int:
        """The most ever charged at once (a test asserts it never passed the budget)."""
        return self._peak

    @property
    def free(self) -> int:
        return self.budget - self._in_use

    def room_for(self, amount: int) -> bool:
        """Would ``amount`` fit now?"""
        return self._in_use + amount <= self.budget

    def try_charge(self, amount: int) -> bool:
        """Charge ``amount`` if it fits; ``False`` (nothing charged) if not."""
        if amount < 0:
            raise ConfigError(f"cannot charge negative {self.unit}")
        with self._lock:
            if self._in_use + amount > self.budget:
                return False
            self._in_use += amount
            self._peak = max(self._peak, self._in_use)
            return True

    def credit(self, amount: int) -> None:
        """Give back what was charged earlier."""
        with self._lock:
            if amount > self._in_use:
                raise AssertionError(f"credit of {amount} exceeds {self._in_use} {self.unit} in use")
            self._in_use -= amount


#: Old names in this module, with their name now: served for one release with a
#: DeprecationWarning. ``MemoryLedger`` was :class:`Ledger` when it counted bytes only;
#: it counts tokens too now, so the name says what it is: a ledger of a budget.
_RENAMED = {"MemoryLedger": "Ledger"}


def __getattr__(name: str) -> Any:
    new = _RENAMED.get(name)
    if new is None:
        raise AttributeError(f"module 'convo.admission' has no attribute {name!r}")
    warnings.warn(f"convo.admission.{name} is deprecated; use {new}", DeprecationWarning, stacklevel=2)
    return globals()[new]


# --------------------------------------------------------------------------------------
# Config and requests
# --------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class AdmissionLimits:
    """The limits of an :class:`AdmissionController`.

    Args:
        kv_budget_bytes: bytes of KV cache + activations all admitted requests may hold
            together (e.g. from ``convo plan``: device memory minus reserved weights,
            divided by the allocator ratio); requests are charged by a bytes ``cost_fn``.
        kv_budget_tokens: instead of bytes, tokens (prompt + reply cap) all admitted
            requests may hold together; requests are charged their tokens. Exactly one of
            the two budgets is required.
        max_concurrency: requests admitted at once. Default 16.
        max_queue_short: short requests waiting at most; more are refused with
            :class:`~convo.errors.QueueFullError`. Default 256.
        max_queue_long: long requests waiting at most. Default 64.
        queue_timeout_s: seconds a request may wait before
            :class:`~convo.errors.QueueTimeoutError`. Default 30.
        long_request_tokens: a request of more than this many tokens (prompt +
            ``max_new_tokens``) queues as *long*. Default 2048.
        long_every: after this many short admissions while a long request waits, the long
            head goes next, and shorts wait behind it until it fits. Default 4.
        long_max_wait_s: a long head that has waited this long goes next too. Default 5.
    """

    kv_budget_bytes: int | None = None
    kv_budget_tokens: int | None = None
    max_concurrency: int = 16
    max_queue_short: int = 256
    max_queue_long: int = 64
    queue_timeout_s: float = 30.0
    long_request_tokens: int = 2048
    long_every: int = 4
    long_max_wait_s: float = 5.0

    def __post_init__(self) -> None:
        if (self.kv_budget_bytes is None) == (self.kv_budget_tokens is None):
            raise ConfigError("give exactly one of kv_budget_bytes and kv_budget_tokens")
        if self.budget <= 0:
            raise ConfigError(f"kv_budget_{self.unit} must be positive, got {self.budget}")
        if self.max_concurrency < 1:
            raise ConfigError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.max_queue_short < 0 or self.max_queue_long < 0:
            raise ConfigError("queue sizes must be >= 0")
        if not self.queue_timeout_s > 0:
            raise ConfigError(f"queue_timeout_s must be > 0, got {self.queue_timeout_s}")
        if self.long_request_tokens < 1:
            raise ConfigError("long_request_tokens must be >= 1")
        if self.long_every < 1:
            raise ConfigError("long_every must be >= 1")
        if self.long_max_wait_s < 0:
            raise ConfigError("long_max_wait_s must be >= 0")

    @property
    def unit(self) -> str:
        """What the ledger charges: ``"bytes"`` or ``"tokens"``."""
        return "bytes" if self.kv_budget_bytes is not None else "tokens"

    @property
    def budget(self) -> int:
        """The budget in :attr:`unit`."""
        value = self.kv_budget_bytes if self.kv_budget_bytes is not None else self.kv_budget_tokens
        assert value is not None
        return value


_ids = itertools.count(1)


@dataclass(kw_only=True, eq=False)
class Request:
    """One generation request as the admission controller sees it.

    Args:
        prompt_tokens: prompt length in tokens.
        max_new_tokens: reply cap in tokens.
        payload: anything the runner needs (messages, input ids, sampling options...).
        cost_bytes: bytes to charge; filled by the controller's ``cost_fn`` when ``None``.
        id: unique id (auto).
    """

    prompt_tokens: int
    max_new_tokens: int
    payload: Any = None
    cost_bytes: int | None = None
    id: int = field(default_factory=lambda: next(_ids))

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.max_new_tokens


class _State(enum.Enum):
    WAITING = "waiting"
    ADMITTED = "admitted"
    CANCELLED = "cancelled"


class _Waiter:
    __slots__ = ("enqueued", "event", "future", "long", "loop", "request", "state")

    def __init__(self, request: Request, long: bool) -> None:
        self.request = request
        self.long = long
        self.enqueued = time.monotonic()
        self.state = _State.WAITING
        self.event = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.future: asyncio.Future[None] | None = None

    def wake(self) -> None:
        self.event.set()
        if self.loop is not None and self.future is not None:
            fut = self.future

            def _resolve() -> None:
                if not fut.done():
                    fut.set_result(None)

            try:
                self.loop.call_soon_threadsafe(_resolve)
            except RuntimeError:  # loop closed: the waiter is gone
                pass


class Ticket:
    """An admitted request. Release it (or use it as a context manager) when done.

    Attributes:
        request: the request.
        cost_bytes: bytes charged to the ledger.
        queue_wait_s: seconds spent queued.
    """

    def __init__(self, controller: AdmissionController, request: Request, queue_wait_s: float):
        self.request = request
        self.cost_bytes = int(request.cost_bytes or 0)
        self.queue_wait_s = queue_wait_s
        self._controller = controller
        self._released = False
        self._t_admit = time.monotonic()

    def release(self) -> None:
        """Give the bytes and the concurrency slot back (idempotent)."""
        if not self._released:
            self._released = True
            self._controller._release(self, time.monotonic() - self._t_admit)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    async def __aenter__(self) -> Ticket:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


# --------------------------------------------------------------------------------------
# Policy
# --------------------------------------------------------------------------------------


def _token_cost(prompt_tokens: int, max_new_tokens: int) -> int:
    return prompt_tokens + max_new_tokens


class AdmissionController:
    """Admits requests while they fit the memory budget and the concurrency cap.

    Args:
        limits: the :class:`AdmissionLimits`.
        cost_fn: ``(prompt_tokens, max_new_tokens) -> bytes`` for requests without a
            ``cost_bytes`` (e.g. ``MemoryModel.request_bytes``). With ``kv_budget_tokens``
            the default charges ``prompt_tokens + max_new_tokens``.
        ledger: the accountant; a new :class:`Ledger` over the limits' budget
            by default.
        metrics: optional :class:`~convo.metrics.ServingMetrics` to update.
        clock: monotonic clock in seconds (tests inject a fake one).

    Example::

        ctl = AdmissionController(AdmissionLimits(kv_budget_bytes=8 << 30),
                                  cost_fn=mm.request_bytes)
        with ctl.acquire(Request(prompt_tokens=900, max_new_tokens=256)) as ticket:
            ...generate...
    """

    def __init__(
        self,
        limits: AdmissionLimits,
        *,
        cost_fn: Callable[[int, int], int] | None = None,
        ledger: Ledger | None = None,
        metrics: ServingMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self.ledger = ledger or Ledger(limits.budget, limits.unit)
        if cost_fn is None and limits.unit == "tokens":
            cost_fn = _token_cost
        self._cost_fn = cost_fn
        self.metrics = metrics
        self._clock = clock
        self._lock = threading.Lock()
        self._short: collections.deque[_Waiter] = collections.deque()
        self._long: collections.deque[_Waiter] = collections.deque()
        self._running = 0
        self._shorts_since_long = 0
        self._mean_hold_s = 1.0  # EMA of how long requests hold their slot (retry hint)
        self.peak_running = 0
        if metrics is not None:
            metrics.kv_budget.set(self.ledger.budget)

    # -- public --------------------------------------------------------------------------

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return len(self._short) + len(self._long)

    def acquire(self, request: Request, *, timeout_s: float | None = None) -> Ticket:
        """Block until ``request`` is admitted.

        Args:
            request: the request.
            timeout_s: queue timeout; default ``limits.queue_timeout_s``.

        Returns:
            A :class:`Ticket`; release it when the generation ends.

        Raises:
            AdmissionError: the request can never fit the budget.
            QueueFullError: its queue is full (``retry_after_s`` says when to retry).
            QueueTimeoutError: it waited longer than ``timeout_s``.
        """
        waiter = self._submit(request)
        if waiter.state is _State.ADMITTED:
            return self._ticket(waiter)
        timeout = self.limits.queue_timeout_s if timeout_s is None else timeout_s
        waiter.event.wait(timeout)
        return self._finish_wait(waiter, timeout)

    async def acquire_async(self, request: Request, *, timeout_s: float | None = None) -> Ticket:
        """Like :meth:`acquire`, awaiting without blocking the event loop."""
        loop = asyncio.get_running_loop()
        waiter = self._submit(request, loop=loop)
        if waiter.state is _State.ADMITTED:
            return self._ticket(waiter)
        timeout = self.limits.queue_timeout_s if timeout_s is None else timeout_s
        assert waiter.future is not None
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
        except TimeoutError:
            pass
        except asyncio.CancelledError:
            self._cancel_or_release(waiter)
            raise
        return self._finish_wait(waiter, timeout)

    def retry_after_s(self) -> float:
        """A hint for refused callers: time until the queue has likely moved."""
        with self._lock:
            return self._retry_after_locked()

    # -- core ----------------------------------------------------------------------------

    def _cost(self, request: Request) -> int:
        if request.cost_bytes is None:
            if self._cost_fn is None:
                raise ConfigError("request has no cost_bytes and the controller no cost_fn")
            request.cost_bytes = int(self._cost_fn(request.prompt_tokens, request.max_new_tokens))
        return request.cost_bytes

    def _retry_after_locked(self) -> float:
        ahead = len(self._short) + len(self._long) + 1
        return round(self._mean_hold_s * ahead / self.limits.max_concurrency, 3)

    def _refuse(self, reason: str) -> None:
        logger.info("refused a request: %s", reason)
        if self.metrics is not None:
            self.metrics.refused.inc(reason=reason)

    def _submit(self, request: Request, loop: asyncio.AbstractEventLoop | None = None) -> _Waiter:
        if request.prompt_tokens < 0 or request.max_new_tokens < 0:
            raise ConfigError("prompt_tokens and max_new_tokens must be >= 0")
        cost = self._cost(request)
        if cost > self.ledger.budget:
            self._refuse("too_large")
            raise AdmissionError(
                f"request {request.id} needs {cost:,} {self.limits.unit} but the whole budget is "
                f"{self.ledger.budget:,}: shorten the prompt or max_new_tokens, or "
                f"raise kv_budget_{self.limits.unit}"
            )
        long = request.total_tokens > self.limits.long_request_tokens
        waiter = _Waiter(request, long)
        waiter.enqueued = self._clock()
        if loop is not None:
            waiter.loop = loop
            waiter.future = loop.create_future()
        with self._lock:
            queue = self._long if long else self._short
            cap = self.limits.max_queue_long if long else self.limits.max_queue_short
            # Fast path only when nobody is queued ahead (FIFO).
            if not self._short and not self._long and self._fits_locked(waiter):
                self._admit_locked(waiter)
                return waiter
            if len(queue) >= cap:
                retry = self._retry_after_locked()
                self._refuse("queue_full")
                raise QueueFullError(
                    f"the {'long' if long else 'short'} queue is full ({cap} waiting); "
                    f"retry in ~{retry:.1f}s",
                    retry_after_s=retry,
                )
            queue.append(waiter)
            self._dispatch_locked()
            self._update_gauges_locked()
        return waiter

    def _fits_locked(self, w: _Waiter) -> bool:
        return self._running < self.limits.max_concurrency and self.ledger.room_for(
            int(w.request.cost_bytes or 0)
        )

    def _admit_locked(self, w: _Waiter) -> None:
        if not self.ledger.try_charge(int(w.request.cost_bytes or 0)):
            raise AssertionError("ledger refused a request that fitted")  # lock held: cannot
        self._running += 1
        self.peak_running = max(self.peak_running, self._running)
        if w.long:
            self._shorts_since_long = 0
        elif self._long:
            self._shorts_since_long += 1
        w.state = _State.ADMITTED
        w.wake()
        self._update_gauges_locked()

    def _dispatch_locked(self) -> None:
        """Admit queue heads in policy order while they fit."""
        while self._short or self._long:
            long_due = bool(self._long) and (
                not self._short
                or self._shorts_since_long >= self.limits.long_every
                or self._clock() - self._long[0].enqueued >= self.limits.long_max_wait_s
            )
            order = (self._long, self._short) if long_due else (self._short, self._long)
            admitted = False
            for queue in order:
                if not queue:
                    continue
                if self._fits_locked(queue[0]):
                    self._admit_locked(queue.popleft())
                    admitted = True
                    break
                if queue is self._long and long_due:
                    break  # hold the room for the due long request: no starvation
            if not admitted:
                return

    def _finish_wait(self, waiter: _Waiter, timeout: float) -> Ticket:
        with self._lock:
            if waiter.state is _State.ADMITTED:
                pass
            else:
                waiter.state = _State.CANCELLED
                queue = self._long if waiter.long else self._short
                try:
                    queue.remove(waiter)
                except ValueError:
                    pass
                self._dispatch_locked()  # a held long head may have been the blocker
                self._update_gauges_locked()
                self._refuse("queue_timeout")
                raise QueueTimeoutError(
                    f"request {waiter.request.id} waited {timeout:.1f}s in the "
                    f"{'long' if waiter.long else 'short'} queue; the server is saturated, "
                    f"retry later or raise queue_timeout_s"
                )
        return self._ticket(waiter)

    def _cancel_or_release(self, waiter: _Waiter) -> None:
        with self._lock:
            admitted = waiter.state is _State.ADMITTED
            if not admitted:
                waiter.state = _State.CANCELLED
                queue = self._long if waiter.long else self._short
                if waiter in queue:
                    queue.remove(waiter)
                self._dispatch_locked()
                self._update_gauges_locked()
        if admitted:
            self._ticket(waiter).release()

    def _ticket(self, waiter: _Waiter) -> Ticket:
        wait = max(self._clock() - waiter.enqueued, 0.0)
        if self.metrics is not None:
            self.metrics.admitted.inc()
            self.metrics.queue_wait.observe(wait)
        return Ticket(self, waiter.request, wait)

    def _release(self, ticket: Ticket, held_s: float) -> None:
        with self._lock:
            self.ledger.credit(ticket.cost_bytes)
            self._running -= 1
            self._mean_hold_s = 0.9 * self._mean_hold_s + 0.1 * held_s
            self._dispatch_locked()
            self._update_gauges_locked()
        if self.metrics is not None:
            self.metrics.completed.inc()

    def _update_gauges_locked(self) -> None:
        m = self.metrics
        if m is not None:
            m.running.set(self._running)
            m.waiting.set(len(self._short) + len(self._long))
            m.kv_in_use.set(self.ledger.in_use)


# --------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------

T = TypeVar("T")
R = TypeVar("R")


def split_for_padding(
    items: Sequence[T], length_fn: Callable[[T], int], *, max_padding_ratio: float = 0.25
) -> list[list[T]]:
    """Split a batch into length-sorted sub-batches that waste little to left padding.

    A left-padded batch holds ``rows * longest`` tokens of KV, not the sum of the rows'
    lengths, so a batch of admitted requests can need more memory than they were charged.
    Each sub-batch here satisfies ``rows * longest <= (1 + max_padding_ratio) * sum``; an
    engine that runs the sub-batches one after another stays within the charge when the
    admission cost includes the same slack (``cost * (1 + max_padding_ratio)``).

    Args:
        items: the batch.
        length_fn: tokens of one item (prompt + max_new_tokens).
        max_padding_ratio: tolerated padding, as a fraction of the real tokens.

    Returns:
        Sub-batches, longest items first; together they hold every item once.
    """
    if max_padding_ratio < 0:
        raise ConfigError("max_padding_ratio must be >= 0")
    ordered = sorted(items, key=length_fn, reverse=True)
    groups: list[list[T]] = []
    total = 0
    for item in ordered:
        n = length_fn(item)
        if groups:
            longest = length_fn(groups[-1][0])
            rows = len(groups[-1]) + 1
            if rows * longest <= (1 + max_padding_ratio) * (total + n):
                groups[-1].append(item)
                total += n
                continue
        groups.append([item])
        total = n
    return groups


class Batcher(Generic[T, R]):
    """Collects items for up to ``batch_window_s`` and runs them as one batch.

    The first item of a batch starts the window; the batch closes when the window ends
    or ``max_batch_size`` items are in. ``run_batch`` must return one result per item,
    in order (e.g. an engine's ``generate_batch`` with left padding and per-row
    stopping). An exception from ``run_batch`` goes to every item of that batch.

    Args:
        run_batch: ``list[item] -> list[result]``.
        max_batch_size: items per batch at most. Default 8.
        batch_window_s: seconds to wait for more items after the first. Default 0.005.

    Example::

        batcher = Batcher(engine.generate_batch, max_batch_size=8)
        result = batcher.run(request)             # from a thread
        result = await batcher.run_async(request) # from a coroutine
    """

    def __init__(
        self,
        run_batch: Callable[[list[T]], Sequence[R]],
        *,
        max_batch_size: int = 8,
        batch_window_s: float = 0.005,
    ) -> None:
        if max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if batch_window_s < 0:
            raise ConfigError(f"batch_window_s must be >= 0, got {batch_window_s}")
        self._run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self._items: collections.deque[tuple[T, concurrent.futures.Future[R]]] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self.batch_sizes: list[int] = []
        self._thread = threading.Thread(target=self._loop, name="convo-batcher", daemon=True)
        self._thread.start()

    def submit(self, item: T) -> concurrent.futures.Future[R]:
        """Queue ``item``; the future resolves to its result."""
        fut: concurrent.futures.Future[R] = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("batcher is closed")
            self._items.append((item, fut))
            self._cond.notify()
        return fut

    def run(self, item: T) -> R:
        """Submit and wait (blocking)."""
        return self.submit(item).result()

    async def run_async(self, item: T) -> R:
        """Submit and await without blocking the event loop."""
        return await asyncio.wrap_future(self.submit(item))

    def close(self) -> None:
        """Finish queued items, then stop the worker thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def __enter__(self) -> Batcher[T, R]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                if not self._items and self._closed:
                    return
                deadline = time.monotonic() + self.batch_window_s
                while len(self._items) < self.max_batch_size and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                batch = [self._items.popleft() for _ in range(min(self.max_batch_size, len(self._items)))]
            self.batch_sizes.append(len(batch))
            items = [b[0] for b in batch]
            try:
                results = list(self._run_batch(items))
                if len(results) != len(items):
                    raise RuntimeError(f"run_batch returned {len(results)} results for {len(items)} items")
            except BaseException as exc:
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, fut), res in zip(batch, results, strict=True):
                if not fut.done():
                    fut.set_result(res)
