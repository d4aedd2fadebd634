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

Tools (``supports_tools = True``): ``tools``, ``tool_choice`` and ``parallel_tool_calls``
are passed through to the server (vLLM, SGLang and llama.cpp render them with the served
model's template and parse its calls); the reply's calls come back in
:attr:`Generation.tool_calls <convo.models.generation.Generation.tool_calls>` with finish
reason ``tool_calls``. A stream hands content to ``on_text`` and the calls' pieces to
``on_tool_call_delta``. The prompt check counts the tool schemas too
(:meth:`~convo.tokens.TokenCounter.count_tools`: exact with the served model's template
when it renders tools, else an estimate inside the margin). Broken arguments from the
server are kept as sent (:mod:`.tool_calls` has the policy).

Errors: :class:`~convo.errors.RemoteEngineError` (refused, unreachable, bad answer; its
``status`` is the HTTP status or ``None``), :class:`~convo.errors.GenerationTimeout` (no
text before ``timeout_s``; a stream cut by the deadline returns its partial text with
finish reason ``timeout`` instead), :class:`~convo.errors.BudgetError` (the prompt does
not fit, locally or by the server's 400 "context length" answer).

Layout (httpx's pattern: one sans-I/O core, two transports):

* :mod:`.protocol` — request bodies, replies, SSE decoding and the error mapping (no I/O);
* :mod:`.retry` — :class:`RetryPolicy` and the retry decisions (pure);
* :mod:`.transports` — the sync and the async send loops over httpx;
* :mod:`.config` — :class:`Timeouts`, :class:`ConnectionLimits`;
* this module — :class:`OpenAIEngine`, which counts, plans and reports.

httpx is imported by this package only (``import convo`` does not load it). Credentials in
``base_url`` and the API key never appear in a message, a log line or a repr.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Unpack

from convo.budget import Budget
from convo.engines.base import Engine, GenerateOptions, GenerateRequest
from convo.engines.openai.config import ConnectionLimits, Timeouts, from_legacy
from convo.engines.openai.protocol import Call, Endpoint, Reply, chat_body, finish_reason, parse_models
from convo.engines.openai.retry import RetryPolicy
from convo.engines.openai.transports import AsyncTransport, SyncTransport
from convo.errors import ConfigError, MissingDependency
from convo.messages import Message
from convo.models import FinishReason, Generation, GenerationStats
from convo.tokens import HFTokenCounter, TiktokenCounter, TokenCounter

if TYPE_CHECKING:
    import httpx

#: Fraction of the prompt room held back when counting with tiktoken instead of the
#: served model's tokenizer (see the module docstring for the measured ratios).
DEFAULT_TIKTOKEN_MARGIN = 0.25
#: Tokens held back, on top of the fraction, for chat-template tokens the estimate misses.
TEMPLATE_MARGIN_TOKENS = 32


class OpenAIEngine(Engine):
    """An engine that generates on an OpenAI-compatible server.

    Args:
        base_url: the API root, e.g. ``"http://127.0.0.1:8000/v1"`` (a URL without a
            ``/v1`` suffix gets one). Credentials in it (``http://user:pw@host``) are sent
            as basic auth and masked wherever the URL is shown.
        model: the served model's name; ``None``: the first one ``/v1/models`` lists.
        api_key: sent as ``Authorization: Bearer``; ``None``: no header.
        counter: a token counter of your own (wins over ``tokenizer``).
        tokenizer: the served model's tokenizer: a local Hugging Face folder or a loaded
            tokenizer, for exact counts (:class:`~convo.tokens.HFTokenCounter`). Default:
            tiktoken ``cl100k_base`` with a margin (see the module docstring).
        context_window: the server's context length in tokens (prompt + reply);
            ``None``: read from ``/v1/models`` (vLLM's ``max_model_len``, llama.cpp's
            ``meta.n_ctx_train``), else :class:`~convo.errors.ConfigError`.
        margin_tokens: tokens held back for counting errors; ``None`` (default): 0 with an
            exact counter, else :meth:`recommended_margin_tokens` of the window.
        timeouts: :class:`Timeouts`: ``call_s`` caps one call, retries and waits included
            (default 60 s); ``connect_s`` caps opening a connection (default 10 s).
        limits: :class:`ConnectionLimits`: ``max_connections`` kept to the server (calls
            run in parallel threads; default 16).
        retry: :class:`RetryPolicy`: retries on 429, 408, 5xx and connection errors
            (default 3, from 0.5 s doubling, with jitter).
        extra_body: fields added to every request body, for server-specific options
            (e.g. ``{"cache_prompt": True}`` for llama.cpp).
        transport: an httpx transport (tests pass ``httpx.MockTransport``; one that is
            also async serves :meth:`agenerate` too).
        **legacy: the flat keywords of convo 0.1, deprecated (``timeout_s``,
            ``connect_timeout_s``, ``max_connections``, ``max_retries``, ``backoff_s``;
            see :func:`~convo.engines.openai.config.from_legacy`).

    Sampling: ``temperature``, ``top_p`` and ``seed`` are standard; ``top_k`` (when > 0),
    ``repetition_penalty`` (when != 1) and ``min_tokens`` (``min_new_tokens`` > 0) are sent
    only when set, as vLLM names them. ``cache_key`` is not sent: prefix caching is the
    server's business (vLLM's automatic prefix caching, llama.cpp's prompt cache).

    The engine holds one sync client and one async client per event loop; :meth:`close`
    (or ``with``) and :meth:`aclose` (or ``async with``) release them.

    Example:
        >>> engine = OpenAIEngine("http://127.0.0.1:8080/v1", "smollm2",
        ...                       timeouts=Timeouts(call_s=120))  # doctest: +SKIP
        >>> session = Session(engine, budget=engine.budget(max_new_tokens=128))  # doctest: +SKIP
    """

    #: Tools are passed through to the server (see the module docstring).
    supports_tools = True
    supports_async = True

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        api_key: str | None = None,
        counter: TokenCounter | None = None,
        tokenizer: str | Path | Any = None,
        context_window: int | None = None,
        margin_tokens: int | None = None,
        timeouts: Timeouts | None = None,
        limits: ConnectionLimits | None = None,
        retry: RetryPolicy | None = None,
        extra_body: Mapping[str, Any] | None = None,
        transport: httpx.BaseTransport | None = None,
        **legacy: Any,
    ) -> None:
        self.timeouts, self.limits, self.retry = from_legacy(
            legacy, timeouts=timeouts, limits=limits, retry=retry
        )
        self.endpoint = Endpoint.parse(base_url, api_key)
        if context_window is not None and context_window < 2:
            raise ConfigError("context_window must be >= 2")
        if margin_tokens is not None and margin_tokens < 0:
            raise ConfigError("margin_tokens must be >= 0")
        self._model = model
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
        self._sync = SyncTransport(
            self.endpoint, timeouts=self.timeouts, limits=self.limits, transport=transport
        )
        self._async = AsyncTransport(
            self.endpoint, timeouts=self.timeouts, limits=self.limits, transport=transport
        )
        #: Calls that run together (:func:`~convo.engines.base.concurrent_calls`): one per
        #: connection; the server decides how it runs them.
        self._lock = threading.Lock()
        #: The largest ``usage.prompt_tokens / local count`` seen so far (1.0 = exact).
        self.observed_token_ratio = 0.0
        #: Retries made so far, over all calls (for metrics and tests).
        self.retries = 0

    @property
    def base_url(self) -> str:
        """The API root as it may be shown (ends in ``/v1``; credentials masked)."""
        return self.endpoint.shown

    @property
    def timeout_s(self) -> float:
        """Default cap of one call, seconds (``timeouts.call_s``)."""
        return self.timeouts.call_s

    @property
    def connect_timeout_s(self) -> float:
        """Cap on opening a connection, seconds (``timeouts.connect_s``)."""
        return self.timeouts.connect_s

    def __repr__(self) -> str:
        return f"OpenAIEngine({self.endpoint.shown!r}, model={self._model!r})"

    # -- discovery -------------------------------------------------------------------------------
    def _discover(self) -> None:
        """Read ``/v1/models`` once for the model name and, where listed, its window."""
        status, body = self._sync.get("/models")
        served = parse_models(self.endpoint, status, body, self._model)
        if self._model is None:
            self._model = served.name
        if self._server_window is None:
            self._server_window = served.context_window

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
    def concurrent_calls(self) -> int:
        """Calls this engine runs together: its connections (``limits.max_connections``)."""
        return self.limits.max_connections

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
                refuses a prompt whose local count (tool schemas included) exceeds it;
                ``tools``, ``tool_choice`` and ``parallel_tool_calls`` are sent as they
                are, the calls come back in ``Generation.tool_calls``;
                ``on_tool_call_delta`` streams the reply and gets each tool-call piece.

        Raises:
            BudgetError: the prompt does not fit (local count, or the server said so).
            GenerationTimeout: no text came before the deadline.
            RemoteEngineError: refused after the retries, unreachable, or a bad answer.
        """
        call = self._prepare(messages, GenerateRequest(max_new_tokens=max_new_tokens, **options))
        try:
            reply = self._sync.send(call)
        finally:
            self.retries += call.retries
        return self._generation(call, reply)

    async def agenerate(
        self, messages: Sequence[Message], *, max_new_tokens: int, **options: Unpack[GenerateOptions]
    ) -> Generation:
        """:meth:`generate` on the event loop (``httpx.AsyncClient``): same arguments,
        checks, retries, deadline and errors; no thread. ``cancel`` is checked between
        streamed chunks and during retry waits."""
        call = self._prepare(messages, GenerateRequest(max_new_tokens=max_new_tokens, **options))
        try:
            reply = await self._async.send(call)
        finally:
            self.retries += call.retries
        return self._generation(call, reply)

    def _prepare(self, messages: Sequence[Message], request: GenerateRequest) -> Call:
        """Check the prompt against the budget and build the body: the call's state."""
        local = self._counter.count_with_tools(messages, request.tools)
        request.check_prompt(
            local,
            input_cap=self.context_window,
            cap_name=(
                f"this engine's context_window={self.context_window} (server window "
                f"{self.server_context_window} minus a {self.margin_tokens}-token counting margin)"
            ),
            supports_tools=self.supports_tools,
            engine=repr(self),
        )
        body = chat_body(
            model=self.model,
            messages=messages,
            max_new_tokens=request.max_new_tokens,
            sampling=request.sampling,
            stop=request.stop,
            stream=request.streams,
            extra_body=self.extra_body,
            tools=request.tools,
            tool_choice=request.tool_choice,
            parallel_tool_calls=request.parallel_tool_calls,
        )
        start = time.monotonic()
        deadline = start + (request.timeout_s or self.timeouts.call_s)
        return Call(request, local, body, self.retry, start, deadline)

    def _generation(self, call: Call, reply: Reply) -> Generation:
        """The call's :class:`Generation` from what the server answered."""
        local, max_new_tokens = call.prompt_tokens, call.request.max_new_tokens
        end = time.monotonic()
        reason = finish_reason(reply, cancel=call.request.cancel, deadline=call.deadline, now=end)
        usage = reply.usage or {}
        prompt = usage.get("prompt_tokens")
        prompt = int(prompt) if isinstance(prompt, int) else local
        if local > 0 and reply.usage:
            self.observed_token_ratio = max(self.observed_token_ratio, prompt / local)
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        cached = int(cached) if isinstance(cached, int) else 0
        new = usage.get("completion_tokens")
        if not isinstance(new, int):  # no usage: the stream's pieces, else a local count
            new = reply.chunks + reply.tool_chunks or self._counter.count_text(
                reply.text + "".join(c.name + c.arguments for c in reply.tool_calls)
            )
        new = min(int(new), max_new_tokens) if reason is not FinishReason.LENGTH else int(new)
        stats = GenerationStats.from_times(
            prompt_tokens=prompt,
            cached_tokens=cached,
            new_tokens=new,
            kv_tokens=prompt + new,  # what the request occupied on the server
            start=call.start,
            first_token_at=reply.first_text_at,
            end=end,
            memory_kind="remote",
            attention="remote",
        )
        return Generation(
            text=reply.text, finish_reason=reason, token_ids=(), stats=stats, tool_calls=reply.tool_calls
        )

    # -- lifecycle ---------------------------------------------------------------------------------
    def release(self, cache_key: str) -> None:
        """No-op: the server owns its KV cache."""

    def close(self) -> None:
        """Close the connection pools (the async clients close on their event loops)."""
        self._sync.close()
        self._async.close()

    async def aclose(self) -> None:
        """Close the connection pools, the running loop's async client first."""
        await self._async.aclose()
        self.close()

    def __enter__(self) -> OpenAIEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> OpenAIEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


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
