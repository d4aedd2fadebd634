"""The remote engine's two transports: the same protocol (:mod:`.protocol`), sent with a
blocking ``httpx.Client`` or awaited on an ``httpx.AsyncClient``.

Each only does I/O: send, read bytes, wait between attempts. What the bytes mean, what
a failure means and whether to retry are decided by :class:`~.protocol.Attempt` and
:func:`~.retry.decide_retry`, shared by both::

    SyncTransport.send(call)                 AsyncTransport.send(call)
      loop: attempt = Attempt(call)            loop: attempt = Attempt(call)
            with attempt.errors():                   with attempt.errors():
              client.send / iter_bytes                 await client.send / aiter_bytes
              (a watchdog thread closes the            (asyncio.timeout ends it at
               response at the deadline                 the deadline; cancel is checked
               or on cancel)                            between chunks)
            Retryable -> next_wait() -> sleep        Retryable -> next_wait() -> asyncio.sleep

Clients are made once: the sync one with the transport, the async one on first use in
each event loop (an ``AsyncClient``'s connections belong to the loop that opened them),
and closed by :meth:`close` / :meth:`aclose`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
import weakref
from collections.abc import AsyncGenerator
from contextlib import closing
from dataclasses import dataclass

import httpx

from convo.engines.openai.config import ConnectionLimits, Timeouts
from convo.engines.openai.protocol import CANCELLED, Attempt, Call, Endpoint, Reply, unreachable
from convo.engines.openai.retry import Retryable, decide_retry

logger = logging.getLogger("convo.engines.openai")

#: Seconds between two looks at a call's cancel event while waiting (watchdog, retry waits).
CANCEL_POLL_S = 0.05


def next_wait(endpoint: Endpoint, call: Call, failure: Retryable, rng: random.Random) -> float:
    """Seconds to wait before the call's next attempt, counted as a retry (logged).

    Raises:
        RemoteEngineError | GenerationTimeout: :func:`~.retry.decide_retry` gives up.
    """
    decision = decide_retry(
        call.policy,
        failure,
        attempts=call.retries,
        now=time.monotonic(),
        start=call.start,
        deadline=call.deadline,
        where=endpoint.shown,
        rng=rng,
    )
    if decision.error is not None:
        raise decision.error from failure
    logger.warning(
        "%s: %s; retry %d of %d in %.2f s",
        endpoint.shown,
        failure,
        call.retries + 1,
        call.policy.max_retries,
        decision.wait_s,
    )
    call.retries += 1
    return decision.wait_s


def _limits(limits: ConnectionLimits) -> httpx.Limits:
    return httpx.Limits(
        max_connections=limits.max_connections, max_keepalive_connections=limits.max_connections
    )


class SyncTransport:
    """Blocking calls on one ``httpx.Client`` (thread-safe: one connection per call)."""

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        timeouts: Timeouts,
        limits: ConnectionLimits,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeouts = timeouts
        self._rng = random.Random()
        self._client = httpx.Client(
            headers=endpoint.headers, auth=endpoint.auth, transport=transport, limits=_limits(limits)
        )

    def get(self, path: str) -> tuple[int, bytes]:
        """``GET {api root}{path}`` once (no retry), within the connect timeout: the
        status and the body.

        Raises:
            RemoteEngineError: no answer.
        """
        try:
            r = self._client.get(f"{self.endpoint.url}{path}", timeout=httpx.Timeout(self.timeouts.connect_s))
        except httpx.HTTPError as exc:
            raise unreachable(self.endpoint, path, exc) from exc
        return r.status_code, r.content

    def send(self, call: Call) -> Reply:
        """All the attempts of ``call``, with the waits between them."""
        cancel = call.request.cancel
        while True:
            try:
                return self._attempt(call)
            except Retryable as failure:
                wait = next_wait(self.endpoint, call, failure, self._rng)
            if cancel is not None:
                if cancel.wait(wait):
                    return CANCELLED
            else:
                time.sleep(wait)

    def _attempt(self, call: Call) -> Reply:
        attempt = Attempt(self.endpoint, call, connect_s=self.timeouts.connect_s)
        request = self._client.build_request("POST", attempt.url, json=call.body, timeout=attempt.timeout)
        with attempt.errors():
            response = self._client.send(request, stream=True)
            attempt.responded()
            with closing(response), _Watchdog(response, attempt):
                if response.status_code != 200:
                    attempt.refused(
                        response.status_code, response.read(), response.headers.get("retry-after")
                    )
                if not call.request.streams:
                    attempt.read_plain(response.read())
                else:
                    for chunk in response.iter_bytes():
                        if attempt.feed(chunk):
                            break
                    else:
                        attempt.end_of_stream()
        return attempt.reply()

    def close(self) -> None:
        self._client.close()


class _Watchdog:
    """Closes a streaming response when the call is cancelled or its deadline passes, so
    a blocked read ends instead of waiting for the next token; marks the attempt so its
    error mapping knows the cut was ours."""

    def __init__(self, response: httpx.Response, attempt: Attempt) -> None:
        self.response = response
        self.attempt = attempt
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="convo-remote-watchdog", daemon=True)

    def __enter__(self) -> _Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        attempt, deadline = self.attempt, self.attempt.call.deadline
        cancel = attempt.call.request.cancel
        while not self._done.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                attempt.deadline_hit = True
                break
            if cancel is not None and cancel.is_set():
                attempt.cancelled = True
                break
            self._done.wait(min(remaining, CANCEL_POLL_S))
        if (attempt.deadline_hit or attempt.cancelled) and not self._done.is_set():
            try:
                self.response.close()
            except Exception:  # the reader may be closing it too
                pass


class AsyncTransport:
    """Awaited calls: one ``httpx.AsyncClient`` per event loop, made on first use there
    and closed when that loop shuts down (``asyncio.run`` closes it on the way out, as it
    finalizes async generators), or by :meth:`aclose`.

    ``transport`` serves the async clients too when it can (``httpx.MockTransport`` can);
    else httpx's default transport is used.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        timeouts: Timeouts,
        limits: ConnectionLimits,
        transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeouts = timeouts
        self._limits = limits
        self._transport = transport if isinstance(transport, httpx.AsyncBaseTransport) else None
        self._rng = random.Random()
        self._lock = threading.Lock()
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopClient] = (
            weakref.WeakKeyDictionary()
        )

    async def _client(self) -> httpx.AsyncClient:
        """The running loop's client (made once per loop)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            entry = self._clients.get(loop)
            if entry is not None and not entry.client.is_closed:
                return entry.client
            client = httpx.AsyncClient(
                headers=self.endpoint.headers,
                auth=self.endpoint.auth,
                transport=self._transport,
                limits=_limits(self._limits),
            )
            entry = _LoopClient(client, self._close_with_loop(loop, client))
            self._clients[loop] = entry
        await entry.keeper.__anext__()  # registers it with the loop's async-generator hooks
        return client

    async def _close_with_loop(
        self, loop: asyncio.AbstractEventLoop, client: httpx.AsyncClient
    ) -> AsyncGenerator[None, None]:
        """Suspended for the client's life; finalized (closing the client) by the loop's
        shutdown, by :meth:`aclose`, or when dropped."""
        try:
            yield
        finally:
            with self._lock:
                entry = self._clients.get(loop)
                if entry is not None and entry.client is client:
                    del self._clients[loop]
            await client.aclose()

    async def send(self, call: Call) -> Reply:
        """All the attempts of ``call``, with the waits between them (on the event loop)."""
        client = await self._client()
        while True:
            try:
                return await self._attempt(client, call)
            except Retryable as failure:
                wait = next_wait(self.endpoint, call, failure, self._rng)
            if await _sleep_unless_cancelled(wait, call.request.cancel):
                return CANCELLED

    async def _attempt(self, client: httpx.AsyncClient, call: Call) -> Reply:
        attempt = Attempt(self.endpoint, call, connect_s=self.timeouts.connect_s)
        request = client.build_request("POST", attempt.url, json=call.body, timeout=attempt.timeout)
        with attempt.errors():
            async with asyncio.timeout(attempt.remaining_s):
                response = await client.send(request, stream=True)
                attempt.responded()
                try:
                    if response.status_code != 200:
                        body = await response.aread()
                        attempt.refused(response.status_code, body, response.headers.get("retry-after"))
                    if not call.request.streams:
                        attempt.read_plain(await response.aread())
                    else:
                        async for chunk in response.aiter_bytes():
                            if attempt.feed(chunk):
                                break
                        else:
                            attempt.end_of_stream()
                finally:
                    await response.aclose()
        return attempt.reply()

    async def aclose(self) -> None:
        """Close the running loop's client now; those of other loops close on their loop."""
        loop = asyncio.get_running_loop()
        with self._lock:
            entries, self._clients = dict(self._clients), weakref.WeakKeyDictionary()
        for owner, entry in entries.items():
            if owner is loop:
                await entry.keeper.aclose()

    def close(self) -> None:
        """Let go of every async client: each is closed on its own loop (a dropped keeper
        is finalized there), or with it when that loop is already closed."""
        with self._lock:
            self._clients = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class _LoopClient:
    """An event loop's client, and the suspended generator that closes it with the loop."""

    client: httpx.AsyncClient
    keeper: AsyncGenerator[None, None]


async def _sleep_unless_cancelled(wait_s: float, cancel: threading.Event | None) -> bool:
    """Sleep ``wait_s`` on the event loop, waking early when ``cancel`` is set; whether it was."""
    if cancel is None:
        await asyncio.sleep(wait_s)
        return False
    end = time.monotonic() + wait_s
    while not cancel.is_set() and (left := end - time.monotonic()) > 0:
        await asyncio.sleep(min(CANCEL_POLL_S, left))
    return cancel.is_set()
