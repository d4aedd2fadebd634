"""Remote engines: any OpenAI-compatible server (vLLM, SGLang, llama.cpp, ``convo serve``).

:class:`OpenAIEngine` implements the :class:`~convo.engine.Engine` protocol over
``POST {base_url}/chat/completions`` with httpx, so a :class:`~convo.session.Session`
(generation) and its :class:`~convo.summarize.ModelSummarizer` (summaries) both run on
the remote model::

    Session ── plan (local counter) ── OpenAIEngine.generate ── HTTP ── server
                                          │  429 / 5xx / connection error: retry with
                                          │  exponential backoff + jitter, Retry-After honored
                                          │  on_text / cancel given: SSE stream, closed on cancel
                                          └─ usage.prompt_tokens -> GenerationStats

Counting. The budget is planned locally, before the request leaves, so the counter decides
whether the prompt really fits:

* with the served model's tokenizer available locally (``tokenizer=`` a Hugging Face
  folder, or a ready tokenizer) the count is exact (:class:`~convo.tokens.HFTokenCounter`)
  and no margin is needed;
* otherwise convo counts with tiktoken ``cl100k_base``, an *estimate* of another
  tokenizer. Measured against SmolLM2's tokenizer (49k vocabulary) the real count was
  1.08x the estimate on code, 1.15x on English prose, 1.45x on mixed-script text and
  2.5x on long digit strings (SmolLM2 splits digits one by one), and the chat template
  adds up to ~25 tokens the estimate does not see (SmolLM2 inserts a default system
  prompt). Hence a margin: :meth:`OpenAIEngine.recommended_margin_tokens` holds back
  ``DEFAULT_TIKTOKEN_MARGIN`` of the prompt room plus ``TEMPLATE_MARGIN_TOKENS``; build
  the session's budget with :meth:`OpenAIEngine.budget` (or pass
  ``Budget(margin_tokens=engine.margin_tokens)``). Digit-heavy or non-Latin
  conversations need a larger ``margin_tokens=``, or the tokenizer.

  :attr:`OpenAIEngine.context_window` is the server's window minus that margin, so the
  summarizer, which plans with ``engine.context_window``, stays inside it too. Every reply
  reports the server's own ``usage.prompt_tokens``; :attr:`OpenAIEngine.observed_token_ratio`
  keeps the largest real/estimated ratio seen, to check the margin against real traffic.

Errors: :class:`~convo.errors.RemoteEngineError` (refused, unreachable, bad answer; its
``status`` is the HTTP status or ``None``), :class:`~convo.errors.GenerationTimeout` (no
text before ``timeout_s``; a stream cut by the deadline returns its partial text with
finish reason ``timeout`` instead), :class:`~convo.errors.BudgetError` (the prompt does
not fit, locally or by the server's 400 "context length" answer).

httpx is imported by this module only (``import convo`` does not load it).
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Unpack

from convo.budget import Budget
from convo.engines.base import (
    FinishReason,
    GenerateOptions,
    GenerateRequest,
    Generation,
    GenerationStats,
    Sampling,
)
from convo.errors import (
    BudgetError,
    ConfigError,
    GenerationTimeout,
    MissingDependency,
    RemoteEngineError,
)
from convo.messages import Message
from convo.tokens import HFTokenCounter, TiktokenCounter, TokenCounter

logger = logging.getLogger(__name__)

try:
    import httpx
except ImportError:  # pragma: no cover - httpx is a dependency of the server extra
    raise MissingDependency("the remote engine needs httpx; run: pip install httpx") from None

#: Fraction of the prompt room held back when counting with tiktoken instead of the
#: served model's tokenizer (see the module docstring for the measured ratios).
DEFAULT_TIKTOKEN_MARGIN = 0.25
#: Tokens held back, on top of the fraction, for chat-template tokens the estimate misses.
TEMPLATE_MARGIN_TOKENS = 32
#: HTTP statuses worth retrying: rate limited, and server-side failures that may pass.
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})

_FINISH = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "eos": FinishReason.STOP,
    "tool_calls": FinishReason.STOP,
    "function_call": FinishReason.STOP,
    "content_filter": FinishReason.STOP,
}


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """When and how long to wait before retrying a failed request.

    Args:
        max_retries: retries after the first attempt (0 = never retry). Default 3.
        backoff_s: the first wait, seconds; doubled on every further retry. Default 0.5.
        max_backoff_s: cap on one computed wait, seconds. Default 8.
        jitter: the wait is drawn uniformly from ``[(1 - jitter) * w, w]`` so that many
            clients refused together do not come back together. Default 0.5.
        max_retry_after_s: the longest server ``Retry-After`` convo will wait; a longer
            one ends the retries at once (:class:`RemoteEngineError` carries it). Default 30.

    Example:
        >>> RetryPolicy(jitter=0).delay_s(2)
        2.0
    """

    max_retries: int = 3
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    jitter: float = 0.5
    max_retry_after_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ConfigError("max_retries must be >= 0")
        if self.backoff_s < 0 or self.max_backoff_s < 0 or self.max_retry_after_s < 0:
            raise ConfigError("backoff_s, max_backoff_s and max_retry_after_s must be >= 0")
        if not 0 <= self.jitter <= 1:
            raise ConfigError("jitter must be in [0, 1]")

    def delay_s(
        self, attempt: int, retry_after_s: float | None = None, rng: random.Random | None = None
    ) -> float:
        """Seconds to wait before retry number ``attempt`` (0-based); a server's
        ``Retry-After`` wins when it asks for longer."""
        wait = min(self.max_backoff_s, self.backoff_s * 2**attempt)
        wait *= 1 - self.jitter * (rng or random).random()
        if retry_after_s is not None:
            wait = max(wait, retry_after_s)
        return wait


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date), or ``None``."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)[:500]
        return str(err)[:500]
    return str(body)[:500]


def _is_context_error(message: str) -> bool:
    text = message.lower()
    return "context" in text and any(w in text for w in ("length", "window", "exceed", "maximum"))


class _Retry(Exception):
    """Internal: this attempt failed in a way worth retrying."""

    def __init__(self, message: str, *, status: int | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


@dataclass
class _Result:
    text: str
    finish: str | None
    usage: Mapping[str, Any] | None
    first_text_at: float | None
    chunks: int


#: What a call cancelled during a retry wait got from the server: nothing.
_CANCELLED = _Result("", None, None, None, 0)


@dataclass
class _Call:
    """One :meth:`OpenAIEngine.generate` call, across its attempts: the checked request,
    the prompt's local count, the body, when it started and its deadline
    (``time.monotonic()``), and the retries so far."""

    request: GenerateRequest
    local: int
    body: dict[str, Any]
    start: float
    deadline: float
    attempts: int = 0


async def _sleep_unless_cancelled(wait_s: float, cancel: threading.Event | None) -> bool:
    """Sleep ``wait_s`` on the event loop, waking early when ``cancel`` is set; whether it was."""
    waited = 0.0
    while waited < wait_s and not (cancel is not None and cancel.is_set()):
        await asyncio.sleep(min(0.05, wait_s - waited))
        waited += 0.05
    return cancel is not None and cancel.is_set()


class OpenAIEngine:
    """An engine that generates on an OpenAI-compatible server.

    Args:
        base_url: the API root, e.g. ``"http://127.0.0.1:8000/v1"`` (a URL without a
            ``/v1`` suffix gets one).
        model: the served model's name; ``None``: the first one ``/v1/models`` lists.
        api_key: sent as ``Authorization: Bearer``; ``None``: no header.
        counter: a token counter of your own (wins over ``tokenizer``).
        tokenizer: the served model's tokenizer: a local Hugging Face folder or a loaded
            tokenizer, for exact counts (:class:`~convo.tokens.HFTokenCounter`). Default:
            tiktoken ``cl100k_base`` with a margin (see the module docstring).
        timeout_s: default wall-clock cap of one call, retries and waits included. Default 60.
        max_retries: retries on 429, 408, 5xx and connection errors. Default 3.
        backoff_s: first retry wait, doubled each time, with jitter. Default 0.5.
        context_window: the server's context length in tokens (prompt + reply);
            ``None``: read from ``/v1/models`` (vLLM's ``max_model_len``, llama.cpp's
            ``meta.n_ctx_train``), else :class:`~convo.errors.ConfigError`.
        margin_tokens: tokens held back for counting errors; ``None`` (default): 0 with an
            exact counter, else :meth:`recommended_margin_tokens` of the window.
        connect_timeout_s: cap on opening a connection, seconds. Default 10.
        max_connections: connections kept to the server (calls run in parallel threads).
            Default 16.
        extra_body: fields added to every request body, for server-specific options
            (e.g. ``{"cache_prompt": True}`` for llama.cpp).
        transport: an httpx transport (tests pass ``httpx.MockTransport``).
        retry: a full :class:`RetryPolicy` (wins over ``max_retries`` / ``backoff_s``).

    Sampling: ``temperature``, ``top_p`` and ``seed`` are standard; ``top_k`` (when > 0),
    ``repetition_penalty`` (when != 1) and ``min_tokens`` (``min_new_tokens`` > 0) are sent
    only when set, as vLLM names them. ``cache_key`` is not sent: prefix caching is the
    server's business (vLLM's automatic prefix caching, llama.cpp's prompt cache).

    Example:
        >>> engine = OpenAIEngine("http://127.0.0.1:8080/v1", "smollm2")   # doctest: +SKIP
        >>> session = Session(engine, budget=engine.budget(max_new_tokens=128))  # doctest: +SKIP
    """

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        api_key: str | None = None,
        counter: TokenCounter | None = None,
        tokenizer: str | Path | Any = None,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        context_window: int | None = None,
        margin_tokens: int | None = None,
        connect_timeout_s: float = 10.0,
        max_connections: int = 16,
        extra_body: Mapping[str, Any] | None = None,
        transport: httpx.BaseTransport | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"base_url must be an http(s) URL, got {base_url!r}")
        if timeout_s <= 0 or connect_timeout_s <= 0:
            raise ConfigError("timeout_s and connect_timeout_s must be > 0")
        if context_window is not None and context_window < 2:
            raise ConfigError("context_window must be >= 2")
        if margin_tokens is not None and margin_tokens < 0:
            raise ConfigError("margin_tokens must be >= 0")
        if max_connections < 1:
            raise ConfigError("max_connections must be >= 1")
        base = base_url.rstrip("/")
        self.base_url = base if base.endswith("/v1") else base + "/v1"
        self._model = model
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retry = retry or RetryPolicy(max_retries=max_retries, backoff_s=backoff_s)
        self.extra_body = dict(extra_body or {})
        self._server_window = context_window
        self._margin = margin_tokens
        if counter is not None:
            self._counter: TokenCounter = counter
            self.exact_counter = isinstance(counter, HFTokenCounter)
        elif tokenizer is not None:
            self._counter = HFTokenCounter(_load_tokenizer(tokenizer))
            self.exact_counter = True
        else:
            self._counter = TiktokenCounter("cl100k_base")
            self.exact_counter = False
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            headers=headers,
            transport=transport,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )
        #: Calls that run together (:func:`~convo.engines.base.concurrent_calls`): one per
        #: connection; the server decides how it runs them.
        self.concurrent_calls = max_connections
        self._lock = threading.Lock()
        self._rng = random.Random()
        #: The largest ``usage.prompt_tokens / local count`` seen so far (1.0 = exact).
        self.observed_token_ratio = 0.0
        #: Retries made so far, over all calls (for metrics and tests).
        self.retries = 0

    # -- discovery -------------------------------------------------------------------------------
    def _discover(self) -> None:
        """Read ``/v1/models`` once for the model name and, where listed, its window."""
        try:
            r = self._client.get(f"{self.base_url}/models", timeout=httpx.Timeout(self.connect_timeout_s))
        except httpx.HTTPError as exc:
            raise RemoteEngineError(f"cannot reach {self.base_url}/models: {exc}") from exc
        if r.status_code != 200:
            raise RemoteEngineError(
                f"{self.base_url}/models answered {r.status_code}: {_error_message(r)}", status=r.status_code
            )
        data = [m for m in (r.json().get("data") or []) if isinstance(m, dict)]
        if not data:
            raise RemoteEngineError(f"{self.base_url}/models lists no model")
        entry = next((m for m in data if m.get("id") == self._model), data[0])
        if self._model is None:
            self._model = str(entry["id"])
        if self._server_window is None:
            meta: dict[str, Any] = entry["meta"] if isinstance(entry.get("meta"), dict) else {}
            for value in (entry.get("max_model_len"), entry.get("context_length"), meta.get("n_ctx_train")):
                if isinstance(value, int) and value > 1:
                    self._server_window = value
                    break

    def _discover_unless(self, attribute: str) -> None:
        """Ask ``/v1/models`` once, when ``attribute`` (what the caller needs) is unknown."""
        if getattr(self, attribute) is None:
            with self._lock:
                if getattr(self, attribute) is None:
                    self._discover()

    @property
    def model(self) -> str:
        """The served model's name (asked from ``/v1/models`` when not given)."""
        self._discover_unless("_model")
        assert self._model is not None
        return self._model

    @property
    def server_context_window(self) -> int:
        """The server's context length in tokens (given, or read from ``/v1/models``)."""
        self._discover_unless("_server_window")
        if self._server_window is None:
            raise ConfigError(
                f"{self.base_url}/models does not say the context length; pass context_window="
                " (convo serve --engine-context N)"
            )
        return self._server_window

    def assume_context_window(self, tokens: int) -> None:
        """Set the server's context length when it cannot be asked (see ``context_window=``)."""
        if tokens < 2:
            raise ConfigError("context_window must be >= 2")
        self._server_window = tokens

    # -- counting and margin -----------------------------------------------------------------------
    @property
    def counter(self) -> TokenCounter:
        """The local counter the budget is planned with (exact, or a tiktoken estimate)."""
        return self._counter

    def recommended_margin_tokens(self, context_tokens: int, max_new_tokens: int = 0) -> int:
        """Tokens a budget of ``context_tokens`` should hold back for counting errors.

        0 with an exact counter; with the tiktoken estimate,
        ``DEFAULT_TIKTOKEN_MARGIN`` of the prompt room plus ``TEMPLATE_MARGIN_TOKENS``.
        """
        if self.exact_counter:
            return 0
        room = max(context_tokens - max_new_tokens, 0)
        return math.ceil(room * DEFAULT_TIKTOKEN_MARGIN) + TEMPLATE_MARGIN_TOKENS

    @property
    def margin_tokens(self) -> int:
        """The margin this engine holds back of the server's window (``margin_tokens=``, or
        the recommended one)."""
        if self._margin is not None:
            return self._margin
        return self.recommended_margin_tokens(self.server_context_window)

    @property
    def context_window(self) -> int:
        """Tokens (prompt + reply) one call may hold *as this engine's counter counts them*:
        the server's window minus :attr:`margin_tokens`."""
        return max(self.server_context_window - self.margin_tokens, 1)

    def budget(self, **kwargs: Any) -> Budget:
        """A :class:`~convo.budget.Budget` for this engine: ``context_tokens`` defaults to the
        server's window and ``margin_tokens`` to :meth:`recommended_margin_tokens` (unless given).

        Example:
            >>> engine.budget(context_tokens=2048, max_new_tokens=128).margin_tokens  # doctest: +SKIP
            544
        """
        context = int(kwargs.pop("context_tokens", None) or self.server_context_window)
        if "margin_tokens" not in kwargs:
            # The margin of the whole window, as the engine holds back in context_window, so
            # the budget's prompt room never exceeds what generate() accepts.
            kwargs["margin_tokens"] = (
                self._margin if self._margin is not None else self.recommended_margin_tokens(context)
            )
        return Budget(context_tokens=context, **kwargs)

    # -- generation --------------------------------------------------------------------------------
    def _body(
        self,
        messages: Sequence[Message],
        max_new_tokens: int,
        sampling: Sampling,
        stop: Sequence[str],
        stream: bool,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [m.to_dict() for m in messages],
            "max_tokens": max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.top_k:
            body["top_k"] = sampling.top_k
        if sampling.repetition_penalty != 1.0:
            body["repetition_penalty"] = sampling.repetition_penalty
        if sampling.min_new_tokens:
            body["min_tokens"] = sampling.min_new_tokens
        if stop:
            body["stop"] = list(stop)
        body.update(self.extra_body)
        return body

    def generate(
        self, messages: Sequence[Message], *, max_new_tokens: int, **options: Unpack[GenerateOptions]
    ) -> Generation:
        """Generate a reply on the server.

        Args:
            messages: the planned prompt.
            max_new_tokens: cap on the reply, in tokens (sent as ``max_tokens``).
            **options: :class:`~convo.engines.base.GenerateOptions`: ``timeout_s`` caps
                the whole call, retries included (default: the engine's); ``stop`` is sent
                as ``stop``; ``cache_key`` is unused (the server caches prefixes itself);
                with ``on_text`` or ``cancel`` the reply is streamed (SSE), and ``cancel``
                closes the stream (finish reason ``cancelled``); ``max_prompt_tokens``
                refuses a prompt whose local count exceeds it.

        Raises:
            BudgetError: the prompt does not fit (local count, or the server said so).
            GenerationTimeout: no text came before the deadline.
            RemoteEngineError: refused after the retries, unreachable, or a bad answer.
        """
        call = self._prepare(messages, GenerateRequest(max_new_tokens=max_new_tokens, **options))
        cancel = call.request.cancel
        while True:
            try:
                return self._generation(call, self._attempt(call))
            except _Retry as exc:
                wait = self._retry_wait(exc, call)
            if cancel is not None and cancel.wait(wait):
                return self._generation(call, _CANCELLED)
            if cancel is None:
                time.sleep(wait)

    async def agenerate(
        self, messages: Sequence[Message], *, max_new_tokens: int, **options: Unpack[GenerateOptions]
    ) -> Generation:
        """:meth:`generate` on the event loop (``httpx.AsyncClient``): same arguments,
        checks, retries, deadline and errors; no thread. ``cancel`` is checked between
        streamed pieces and during retry waits."""
        call = self._prepare(messages, GenerateRequest(max_new_tokens=max_new_tokens, **options))
        async with httpx.AsyncClient(
            headers=self._client.headers, transport=self._async_transport
        ) as client:  # (one per call: an AsyncClient belongs to the event loop that made it)
            while True:
                try:
                    return self._generation(call, await self._aattempt(client, call))
                except _Retry as exc:
                    wait = self._retry_wait(exc, call)
                if await _sleep_unless_cancelled(wait, call.request.cancel):
                    return self._generation(call, _CANCELLED)

    def _prepare(self, messages: Sequence[Message], request: GenerateRequest) -> _Call:
        """Check the prompt against the budget and build the body: the call's state."""
        local = self._counter.count_prompt(messages)
        request.check_prompt(
            local,
            input_cap=self.context_window,
            cap_name=(
                f"this engine's context_window={self.context_window} (server window "
                f"{self.server_context_window} minus a {self.margin_tokens}-token counting margin)"
            ),
        )
        body = self._body(messages, request.max_new_tokens, request.sampling, request.stop, request.streams)
        start = time.monotonic()
        return _Call(request, local, body, start, start + (request.timeout_s or self.timeout_s))

    def _retry_wait(self, exc: _Retry, call: _Call) -> float:
        """Seconds to wait before retrying after ``exc`` (counted as a retry), or the error
        that ends the call."""
        attempt, start, deadline = call.attempts, call.start, call.deadline
        if attempt >= self.retry.max_retries:
            raise RemoteEngineError(
                f"{self.base_url} failed after {attempt + 1} attempts: {exc}",
                status=exc.status,
                retry_after_s=exc.retry_after_s,
            ) from exc
        if exc.retry_after_s is not None and exc.retry_after_s > self.retry.max_retry_after_s:
            raise RemoteEngineError(
                f"{self.base_url} asks to retry after {exc.retry_after_s:.0f} s (over "
                f"max_retry_after_s={self.retry.max_retry_after_s:.0f}): {exc}",
                status=exc.status,
                retry_after_s=exc.retry_after_s,
            ) from exc
        wait = self.retry.delay_s(attempt, exc.retry_after_s, self._rng)
        if time.monotonic() + wait >= deadline:
            raise GenerationTimeout(
                f"no reply from {self.base_url} within {deadline - start:.1f} s "
                f"({attempt + 1} attempts; last: {exc})"
            ) from exc
        logger.warning(
            "%s: %s; retry %d of %d in %.2f s",
            self.base_url,
            exc,
            attempt + 1,
            self.retry.max_retries,
            wait,
        )
        call.attempts += 1
        self.retries += 1
        return wait

    @staticmethod
    def _finish_reason(result: _Result, cancel: threading.Event | None, deadline: float) -> FinishReason:
        if cancel is not None and cancel.is_set() and result.finish is None:
            return FinishReason.CANCELLED
        if result.finish is None and time.monotonic() >= deadline:
            return FinishReason.TIMEOUT
        return _FINISH.get(result.finish or "stop", FinishReason.STOP)

    def _generation(self, call: _Call, result: _Result) -> Generation:
        """The call's :class:`Generation` from what the server answered."""
        local, start, max_new_tokens = call.local, call.start, call.request.max_new_tokens
        if result is _CANCELLED:
            reason = FinishReason.CANCELLED
        else:
            reason = self._finish_reason(result, call.request.cancel, call.deadline)
        end = time.monotonic()
        usage = result.usage or {}
        prompt = usage.get("prompt_tokens")
        prompt = int(prompt) if isinstance(prompt, int) else local
        if local > 0 and result.usage:
            self.observed_token_ratio = max(self.observed_token_ratio, prompt / local)
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        cached = int(cached) if isinstance(cached, int) else 0
        new = usage.get("completion_tokens")
        if not isinstance(new, int):  # no usage: the stream's chunks, else a local count
            new = result.chunks or self._counter.count_text(result.text)
        new = min(int(new), max_new_tokens) if reason is not FinishReason.LENGTH else int(new)
        text = result.text
        stats = GenerationStats.from_times(
            prompt_tokens=prompt,
            cached_tokens=cached,
            new_tokens=new,
            kv_tokens=prompt + new,  # what the request occupied on the server
            start=start,
            first_token_at=result.first_text_at,
            end=end,
            memory_kind="remote",
            attention="remote",
        )
        return Generation(text=text, finish_reason=reason, token_ids=(), stats=stats)

    def _attempt(self, call: _Call) -> _Result:
        on_text, cancel, deadline = call.request.on_text, call.request.cancel, call.deadline
        _, request = self._build_request(self._client, call)
        emitted = False
        try:
            response = self._client.send(request, stream=True)
        except httpx.TransportError as exc:
            raise self._send_failed(exc, deadline) from exc
        watchdog = _Watchdog(response, deadline, cancel)
        try:
            if response.status_code != 200:
                response.read()
                self._raise_for_status(response)
            if not call.request.streams:
                data = json.loads(response.read())
                return self._parse_plain(data)
            state = _StreamState(self.base_url, on_text)
            try:
                for event in _sse_events(response.iter_lines()):
                    state.feed(event)
                    emitted = state.chunks > 0
                    if watchdog.fired:
                        break
            except (httpx.TransportError, httpx.StreamError) as exc:
                if watchdog.fired:
                    pass  # we closed it: cancel or deadline
                elif isinstance(exc, httpx.ReadTimeout):
                    if not emitted:
                        raise GenerationTimeout(f"no text from {self.base_url} before the deadline") from exc
                elif not emitted:
                    raise _Retry(f"stream broke before any text: {exc!r}") from exc
                else:
                    raise RemoteEngineError(f"{self.base_url} stream broke mid-reply: {exc!r}") from exc
            if watchdog.deadline_hit and not emitted:
                raise GenerationTimeout(f"no text from {self.base_url} before the deadline")
            return state.result()
        except httpx.ReadTimeout as exc:
            raise GenerationTimeout(f"no reply from {self.base_url} before the deadline") from exc
        except (httpx.TransportError, httpx.StreamError) as exc:
            if watchdog.deadline_hit:
                raise GenerationTimeout(f"no reply from {self.base_url} before the deadline") from exc
            if watchdog.cancelled:
                return _Result("", None, None, None, 0)
            raise _Retry(f"{type(exc).__name__}: {exc}") from exc
        except json.JSONDecodeError as exc:
            raise RemoteEngineError(f"{self.base_url} answered something that is not JSON: {exc}") from exc
        finally:
            watchdog.stop()
            response.close()

    async def _aattempt(self, client: httpx.AsyncClient, call: _Call) -> _Result:
        """:meth:`_attempt` on the event loop: the same outcomes (``_Retry``, timeouts,
        errors); the deadline is an asyncio timeout instead of a watchdog thread."""
        remaining, request = self._build_request(client, call)
        state = _StreamState(self.base_url, call.request.on_text)
        cancel = call.request.cancel
        try:
            async with asyncio.timeout(remaining):
                try:
                    response = await client.send(request, stream=True)
                except httpx.TransportError as exc:
                    raise self._send_failed(exc, call.deadline) from exc
                try:
                    if response.status_code != 200:
                        await response.aread()
                        self._raise_for_status(response)
                    if not call.request.streams:
                        return self._parse_plain(json.loads(await response.aread()))
                    parser = _SSEParser()
                    async for line in response.aiter_lines():
                        event = parser.feed(line)
                        if event is not None:
                            state.feed(event)
                        if parser.done or (cancel is not None and cancel.is_set()):
                            break
                    else:
                        last = parser.flush()
                        if last is not None:
                            state.feed(last)
                    return state.result()
                except (httpx.TransportError, httpx.StreamError) as exc:
                    if state.chunks:
                        raise RemoteEngineError(f"{self.base_url} stream broke mid-reply: {exc!r}") from exc
                    raise _Retry(f"stream broke before any text: {exc!r}") from exc
                except json.JSONDecodeError as exc:
                    raise RemoteEngineError(
                        f"{self.base_url} answered something that is not JSON: {exc}"
                    ) from exc
                finally:
                    await response.aclose()
        except TimeoutError as exc:
            if state.chunks:
                return state.result()  # cut at the deadline: the text so far, finish None
            raise GenerationTimeout(f"no text from {self.base_url} before the deadline") from exc

    def _build_request(
        self, client: httpx.Client | httpx.AsyncClient, call: _Call
    ) -> tuple[float, httpx.Request]:
        """The seconds left before the call's deadline, and the request of one attempt.

        Raises:
            GenerationTimeout: no time is left.
        """
        remaining = call.deadline - time.monotonic()
        if remaining <= 0:
            raise GenerationTimeout(f"no reply from {self.base_url} before the deadline")
        timeout = httpx.Timeout(remaining, connect=min(self.connect_timeout_s, remaining))
        url = f"{self.base_url}/chat/completions"
        return remaining, client.build_request("POST", url, json=call.body, timeout=timeout)

    def _send_failed(self, exc: httpx.TransportError, deadline: float) -> Exception:
        """What a request that could not be sent ends in: a connect timeout, refused, reset
        or closed before answering is retried; a later timeout ends the call."""
        if isinstance(exc, httpx.ConnectTimeout) and time.monotonic() < deadline:
            return _Retry(f"connect timeout: {exc}")
        if isinstance(exc, httpx.TimeoutException):
            return GenerationTimeout(f"no reply from {self.base_url} before the deadline: {exc!r}")
        return _Retry(f"{type(exc).__name__}: {exc}")

    @property
    def _async_transport(self) -> httpx.AsyncBaseTransport | None:
        """The transport given to the engine, when it can also serve async requests
        (``httpx.MockTransport`` can); else httpx's default."""
        transport = getattr(self._client, "_transport", None)
        return transport if isinstance(transport, httpx.AsyncBaseTransport) else None

    def _raise_for_status(self, response: httpx.Response) -> None:
        status = response.status_code
        message = _error_message(response)
        if status in RETRY_STATUSES or (status >= 500 and status not in (501, 505)):
            raise _Retry(
                f"HTTP {status}: {message}",
                status=status,
                retry_after_s=parse_retry_after(response.headers.get("retry-after")),
            )
        if status == 400 and _is_context_error(message):
            raise BudgetError(
                f"the server says the prompt does not fit: {message} (raise margin_tokens, or pass the "
                "served model's tokenizer for exact counts)"
            )
        hint = {
            401: " (check the API key: --engine-api-key)",
            403: " (check the API key: --engine-api-key)",
            404: " (check base_url and the model name: --engine-url, --engine-model)",
        }.get(status, "")
        raise RemoteEngineError(f"{self.base_url} answered HTTP {status}: {message}{hint}", status=status)

    def _parse_plain(self, data: Any) -> _Result:
        if not isinstance(data, dict) or not data.get("choices"):
            raise RemoteEngineError(f"{self.base_url} answered without choices: {str(data)[:300]}")
        choice = data["choices"][0]
        message = choice.get("message") or {}
        text = message.get("content") or ""
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else None
        return _Result(str(text), choice.get("finish_reason"), usage, None, 0)

    # -- lifecycle ---------------------------------------------------------------------------------
    def release(self, cache_key: str) -> None:
        """No-op: the server owns its KV cache."""

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()

    def __enter__(self) -> OpenAIEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Watchdog:
    """Closes a streaming response when ``cancel`` is set or the deadline passes, so a
    blocked read ends instead of waiting for the next token."""

    def __init__(self, response: httpx.Response, deadline: float, cancel: threading.Event | None) -> None:
        self.response = response
        self.deadline = deadline
        self.cancel = cancel
        self.deadline_hit = False
        self.cancelled = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="convo-remote-watchdog", daemon=True)
        self._thread.start()

    @property
    def fired(self) -> bool:
        return self.deadline_hit or self.cancelled

    def _run(self) -> None:
        while not self._done.is_set():
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                self.deadline_hit = True
                break
            if self.cancel is not None and self.cancel.is_set():
                self.cancelled = True
                break
            self._done.wait(min(remaining, 0.05))
        if self.fired and not self._done.is_set():
            try:
                self.response.close()
            except Exception:  # the reader may be closing it too
                pass

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


class _SSEParser:
    """An OpenAI-style SSE stream (``data: {...}`` ... ``data: [DONE]``), a line at a time
    (shared by the sync and the async reader)."""

    def __init__(self) -> None:
        self._data: list[str] = []
        self.done = False

    def feed(self, line: str) -> dict[str, Any] | None:
        """The event this line completes, if any; ``done`` turns true at ``[DONE]``."""
        if line.startswith("data:"):
            self._data.append(line[5:].lstrip())
            return None
        if line.strip() or not self._data:
            return None  # comments, event: / id: fields, blank keep-alives
        payload, self._data = "\n".join(self._data), []
        if payload == "[DONE]":
            self.done = True
            return None
        return _json_event(payload)

    def flush(self) -> dict[str, Any] | None:
        """An event left unterminated when the stream ended."""
        payload, self._data = "\n".join(self._data), []
        return _json_event(payload) if payload and payload != "[DONE]" else None


def _sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """JSON objects of an OpenAI-style SSE stream (``data: {...}`` ... ``data: [DONE]``)."""
    parser = _SSEParser()
    for line in lines:
        event = parser.feed(line)
        if parser.done:
            return
        if event is not None:
            yield event
    last = parser.flush()
    if last is not None:
        yield last


class _StreamState:
    """What a streamed reply has said so far (shared by the sync and the async reader)."""

    def __init__(self, base_url: str, on_text: Callable[[str], None] | None) -> None:
        self.base_url = base_url
        self.on_text = on_text
        self.text: list[str] = []
        self.finish: str | None = None
        self.usage: Mapping[str, Any] | None = None
        self.first_at: float | None = None
        self.chunks = 0

    def feed(self, event: Mapping[str, Any]) -> None:
        if isinstance(event.get("error"), dict | str):
            err = event["error"]
            msg = str(err.get("message", err)) if isinstance(err, dict) else err
            raise RemoteEngineError(f"{self.base_url} stream error: {msg}")
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        for choice in event.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                if self.first_at is None:
                    self.first_at = time.monotonic()
                self.text.append(piece)
                self.chunks += 1
                if self.on_text is not None:
                    self.on_text(piece)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]

    def result(self) -> _Result:
        return _Result("".join(self.text), self.finish, self.usage, self.first_at, self.chunks)


def _json_event(payload: str) -> dict[str, Any]:
    try:
        event = json.loads(payload)
    except ValueError as exc:
        raise RemoteEngineError(f"bad event in the stream: {payload[:200]!r}") from exc
    if not isinstance(event, dict):
        raise RemoteEngineError(f"bad event in the stream: {payload[:200]!r}")
    return event


def _load_tokenizer(tokenizer: str | Path | Any) -> Any:
    if not isinstance(tokenizer, str | Path):
        return tokenizer
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise MissingDependency(
            "a tokenizer folder needs transformers; run: pip install 'convo[local]'"
        ) from None
    try:
        return AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    except Exception as exc:
        raise ConfigError(f"could not load the tokenizer from {tokenizer}: {exc}") from exc
