"""The OpenAI chat protocol without I/O: what to send, how to read what came back, and
what every failure means in convo's error types.

The sync and the async transport (:mod:`convo.engines.openai.transports`) only move
bytes; everything they learn goes through one :class:`Attempt`::

    Call (one generate call: body, deadline, retries so far)
      └─ Attempt (one HTTP exchange)
           with attempt.errors():            <- the ONE place an httpx exception or an
               send request                     HTTP status becomes a convo error
               attempt.responded(status)
               attempt.refused(status, ...)  (non-200: raises)
               attempt.read_plain(body)      (JSON reply)
               attempt.feed(chunk) ...       (SSE bytes, split anywhere)
           attempt.reply()  -> Reply

Failure outcomes (the same for both transports):

============================================  ==========================================
what happened                                 outcome
============================================  ==========================================
refused / reset / connect timeout, no answer  :class:`~.retry.Retryable` (retry)
429, 408, most 5xx                            :class:`~.retry.Retryable` with Retry-After
400 "context length ..."                      :class:`~convo.errors.BudgetError`
other 4xx, 501, 505                           :class:`~convo.errors.RemoteEngineError`
any other timeout, no text yet                :class:`~convo.errors.GenerationTimeout`
deadline or cancel after some text            the partial reply (finish ``timeout`` /
                                              ``cancelled``)
stream broke before any text                  :class:`~.retry.Retryable`
stream broke mid-reply                        :class:`~convo.errors.RemoteEngineError`
a body that is not JSON, an error event       :class:`~convo.errors.RemoteEngineError`
a malformed tool call                         :class:`~convo.errors.RemoteEngineError`
============================================  ==========================================

("Text" above means any output: content pieces or tool-call pieces.)

Tools. :func:`chat_body` sends ``tools``, ``tool_choice`` and ``parallel_tool_calls`` when
the call sets them, and the prompt's messages in OpenAI's shape (:meth:`Message.to_dict
<convo.messages.Message.to_dict>`): an assistant message's ``tool_calls`` as
``[{id, type: "function", function: {name, arguments}}]`` (its ``content`` ``""`` when it
only calls tools: every server's template takes a string, not all take ``null``), a tool
result as ``{"role": "tool", "content", "tool_call_id"}`` (plus ``name`` when set). The
reply's calls are read by :mod:`.tool_calls` (its docstring has the policy for broken
arguments) into :attr:`Reply.tool_calls`; :func:`finish_reason` says ``tool_calls``
whenever the reply carries calls and the server stopped normally.

No message built here carries the credentials of the base URL or the API key
(:class:`Endpoint` keeps them apart from the URL that is shown).
"""

from __future__ import annotations

import base64
import codecs
import json
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import httpx

from convo.engines.base import GenerateRequest
from convo.engines.openai.retry import Retryable, RetryPolicy, is_retryable_status, parse_retry_after
from convo.engines.openai.tool_calls import ToolCallStream, message_tool_calls
from convo.errors import BudgetError, ConfigError, ConvoError, GenerationTimeout, RemoteEngineError
from convo.messages import Message, ToolCall
from convo.models import FinishReason, Sampling
from convo.models.generation import ToolCallDelta
from convo.stores import redact_url

#: The server's ``finish_reason`` values and convo's.
FINISH_REASONS: Mapping[str, FinishReason] = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "eos": FinishReason.STOP,
    "tool_calls": FinishReason.TOOL_CALLS,
    "function_call": FinishReason.TOOL_CALLS,
    "content_filter": FinishReason.STOP,
}
#: Characters of a server's error text kept in an exception message.
MAX_ERROR_CHARS = 500
_MASK = "***"


# -- where the server is, and what must never be shown ---------------------------------------


@dataclass(frozen=True)
class Endpoint:
    """The server's API root, split into what is sent and what may be shown.

    Credentials in the URL (``http://user:pw@host``) are taken out of it and sent as HTTP
    basic auth (as httpx would), so no request URL, log line or message carries them;
    ``shown`` masks them, and :meth:`scrub` removes them (and the API key) from any text.

    Example:
        >>> e = Endpoint.parse("http://ada:s3cret@127.0.0.1:8080")
        >>> e.url, e.shown, e.auth
        ('http://127.0.0.1:8080/v1', 'http://ada:***@127.0.0.1:8080/v1', ('ada', 's3cret'))
    """

    #: The API root to send to, without credentials, ending in ``/v1``.
    url: str
    #: The API root fit to print or log: a password (or a lone user name) masked.
    shown: str
    #: ``(user, password)`` for basic auth, from the URL; ``None`` when it has none.
    auth: tuple[str, str] | None = field(default=None, repr=False)
    api_key: str | None = field(default=None, repr=False)
    #: The strings that must never appear in a message (longest first): the API key, the
    #: password (as written in the URL and decoded), a lone user name, the basic-auth token.
    secrets: tuple[str, ...] = field(default=(), repr=False)

    @classmethod
    def parse(cls, base_url: str, api_key: str | None = None) -> Endpoint:
        """The endpoint of ``base_url`` (a URL without a ``/v1`` suffix gets one).

        Raises:
            ConfigError: not an http(s) URL (the message does not repeat credentials).
        """
        try:
            parts = urlsplit(base_url.strip())
            parts.port  # noqa: B018 - raises ValueError for a bad port
        except ValueError:
            parts = None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            shown = base_url if "@" not in base_url else "<a URL with credentials>"
            raise ConfigError(
                f"base_url must be an http(s) URL such as http://127.0.0.1:8000/v1, got {shown!r}"
            )
        path = parts.path.rstrip("/")
        path = path if path.endswith("/v1") else path + "/v1"
        host = parts.netloc.rpartition("@")[2]
        url = urlunsplit((parts.scheme, host, path, parts.query, ""))
        auth = None
        shown = url
        found = {api_key} if api_key else set()
        if parts.username is not None or parts.password is not None:
            auth = (unquote(parts.username or ""), unquote(parts.password or ""))
            # (and the basic-auth token, should a server echo the header back)
            found.add(base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
            if parts.password:
                found.update((parts.password, auth[1]))
            elif parts.username:
                found.update((parts.username, auth[0]))
            with_user = urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))
            shown = redact_url(with_user)  # the store's rule: the password masked
            if parts.password is None:  # a lone user name is often a token: mask it too
                shown = urlunsplit((parts.scheme, f"{_MASK}@{host}", path, parts.query, ""))
        secrets = tuple(sorted((s for s in found if s), key=len, reverse=True))
        return cls(url=url, shown=shown, auth=auth, api_key=api_key or None, secrets=secrets)

    @property
    def headers(self) -> dict[str, str]:
        """Headers every request carries (the API key as a bearer token)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def scrub(self, text: str) -> str:
        """``text`` with every credential of this endpoint replaced by ``***``."""
        for secret in self.secrets:
            text = text.replace(secret, _MASK)
        return text

    def __str__(self) -> str:
        return self.shown


# -- requests ----------------------------------------------------------------------------------


def chat_body(
    *,
    model: str,
    messages: Sequence[Message],
    max_new_tokens: int,
    sampling: Sampling,
    stop: Sequence[str],
    stream: bool,
    extra_body: Mapping[str, Any],
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
) -> dict[str, Any]:
    """The JSON body of ``POST /v1/chat/completions``.

    ``top_k`` (when > 0), ``repetition_penalty`` (when != 1) and ``min_tokens``
    (``min_new_tokens`` > 0) are sent only when set, as vLLM names them; so are ``tools``
    (non-empty), ``tool_choice`` and ``parallel_tool_calls`` (not ``None``), as OpenAI
    names them; a stream asks for usage in its last event; ``extra_body`` is merged last
    (server-specific options).
    """
    body: dict[str, Any] = {
        "model": model,
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
    if tools:
        body["tools"] = [dict(t) for t in tools]
    if tool_choice is not None:
        body["tool_choice"] = tool_choice if isinstance(tool_choice, str) else dict(tool_choice)
    if parallel_tool_calls is not None:
        body["parallel_tool_calls"] = parallel_tool_calls
    body.update(extra_body)
    return body


@dataclass
class Call:
    """One ``generate`` call across its attempts: the checked request, the prompt's local
    count (tokens), the body, the retry policy, when it started and its deadline
    (``time.monotonic()`` seconds), and the retries made so far."""

    request: GenerateRequest
    prompt_tokens: int
    body: dict[str, Any]
    policy: RetryPolicy
    start: float
    deadline: float
    retries: int = 0


# -- what came back ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """What the server answered in one attempt: the text, its ``finish_reason`` (``None``
    when the stream was cut), the ``usage`` object, when the first output came
    (``time.monotonic()``: text or a tool-call piece), the streamed text pieces, whether
    the call was cancelled before any attempt answered, the tool calls and the streamed
    tool-call pieces."""

    text: str = ""
    finish: str | None = None
    usage: Mapping[str, Any] | None = None
    first_text_at: float | None = None
    chunks: int = 0
    cancelled: bool = False
    tool_calls: tuple[ToolCall, ...] = ()
    tool_chunks: int = 0


#: What a call cancelled during a retry wait got from the server: nothing.
CANCELLED = Reply(cancelled=True)


def finish_reason(
    reply: Reply, *, cancel: threading.Event | None, deadline: float, now: float
) -> FinishReason:
    """convo's finish reason for ``reply``: cancelled or timed out when the server did not
    say (a cut stream), else the server's, where a reply that carries tool calls and
    stopped normally says ``tool_calls`` (some servers say ``stop``) and one that says
    ``tool_calls`` without any says ``stop``."""
    if reply.cancelled:
        return FinishReason.CANCELLED
    if cancel is not None and cancel.is_set() and reply.finish is None:
        return FinishReason.CANCELLED
    if reply.finish is None and now >= deadline:
        return FinishReason.TIMEOUT
    reason = FINISH_REASONS.get(reply.finish or "stop", FinishReason.STOP)
    if reason in (FinishReason.STOP, FinishReason.TOOL_CALLS):
        return FinishReason.TOOL_CALLS if reply.tool_calls else FinishReason.STOP
    return reason


def error_message(body: bytes) -> str:
    """The server's explanation in an error body (OpenAI's ``{"error": {"message"}}``,
    FastAPI's ``{"detail"}``, or the text), cut to ``MAX_ERROR_CHARS``."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")[:MAX_ERROR_CHARS]
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)[:MAX_ERROR_CHARS]
        return str(err)[:MAX_ERROR_CHARS]
    return str(data)[:MAX_ERROR_CHARS]


def is_context_error(message: str) -> bool:
    """Whether a 400's message says the prompt is over the model's context length."""
    text = message.lower()
    return "context" in text and any(w in text for w in ("length", "window", "exceed", "maximum"))


_HINTS = {
    401: " (check the API key: --engine-api-key)",
    403: " (check the API key: --engine-api-key)",
    404: " (check base_url and the model name: --engine-url, --engine-model)",
}


def status_error(endpoint: Endpoint, status: int, body: bytes, retry_after: str | None) -> Exception:
    """The error a non-200 answer ends its attempt with: :class:`Retryable` (429, 408,
    most 5xx, with the ``Retry-After`` header's seconds), :class:`BudgetError` (a 400
    about the context length) or :class:`RemoteEngineError` (with ``status``)."""
    message = endpoint.scrub(error_message(body))
    if is_retryable_status(status):
        return Retryable(
            f"HTTP {status}: {message}", status=status, retry_after_s=parse_retry_after(retry_after)
        )
    if status == 400 and is_context_error(message):
        return BudgetError(
            f"the server says the prompt does not fit: {message} (raise margin_tokens, or pass the "
            "served model's tokenizer for exact counts)"
        )
    return RemoteEngineError(
        f"{endpoint} answered HTTP {status}: {message}{_HINTS.get(status, '')}", status=status
    )


def parse_plain(endpoint: Endpoint, body: bytes) -> Reply:
    """The :class:`Reply` of a non-streamed answer (``choices[0].message``)."""
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise RemoteEngineError(f"{endpoint} answered something that is not JSON: {exc}") from exc
    if not isinstance(data, dict) or not data.get("choices"):
        raise RemoteEngineError(f"{endpoint} answered without choices: {endpoint.scrub(str(data)[:300])}")
    choice = data["choices"][0]
    message = choice.get("message") or {}
    text = message.get("content") or ""
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else None
    calls = message_tool_calls(message, where=endpoint.shown) if isinstance(message, dict) else ()
    return Reply(str(text), choice.get("finish_reason"), usage, tool_calls=calls)


@dataclass(frozen=True)
class ServedModel:
    """What ``/v1/models`` says about the served model: its name and, where listed, its
    context length in tokens (vLLM's ``max_model_len``, llama.cpp's ``meta.n_ctx_train``)."""

    name: str
    context_window: int | None


def parse_models(endpoint: Endpoint, status: int, body: bytes, wanted: str | None) -> ServedModel:
    """The entry of ``wanted`` (else the first) in a ``/v1/models`` answer.

    Raises:
        RemoteEngineError: not a 200, not JSON, or no model listed.
    """
    where = f"{endpoint}/models"
    if status != 200:
        raise RemoteEngineError(
            f"{where} answered {status}: {endpoint.scrub(error_message(body))}", status=status
        )
    try:
        listing = json.loads(body)
    except ValueError as exc:
        raise RemoteEngineError(f"{where} answered something that is not JSON: {exc}") from exc
    raw = listing.get("data") if isinstance(listing, dict) else None
    data = [m for m in (raw or []) if isinstance(m, dict) and "id" in m]
    if not data:
        raise RemoteEngineError(f"{where} lists no model")
    entry = next((m for m in data if m.get("id") == wanted), data[0])
    meta: dict[str, Any] = entry["meta"] if isinstance(entry.get("meta"), dict) else {}
    window = None
    for value in (entry.get("max_model_len"), entry.get("context_length"), meta.get("n_ctx_train")):
        if isinstance(value, int) and value > 1:
            window = value
            break
    return ServedModel(name=str(entry["id"]), context_window=window)


def unreachable(endpoint: Endpoint, path: str, exc: httpx.HTTPError) -> RemoteEngineError:
    """The error of a request (``/v1/models``) that got no answer."""
    return RemoteEngineError(f"cannot reach {endpoint}{path}: {endpoint.scrub(describe(exc))}")


def describe(exc: BaseException) -> str:
    """An exception as a message part: its type, and its text when it has one."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# -- server-sent events ------------------------------------------------------------------------

_EOL = re.compile(r"\r\n|\r|\n")


class SSEDecoder:
    """An OpenAI-style event stream (``data: {...}`` ... ``data: [DONE]``), fed the bytes
    as they arrive: a line, a UTF-8 character or a ``\\r\\n`` may be split across chunks.

    Lines end with ``\\n``, ``\\r\\n`` or ``\\r``; ``data:`` lines accumulate until a blank
    line ends the event; comments (``: keep-alive``) and other fields are skipped. After
    ``[DONE]``, :attr:`done` is true and the rest is ignored.

    Example:
        >>> d = SSEDecoder()
        >>> d.feed(b'data: {"a"'), d.feed(b': 1}\\n\\ndata: [DONE]\\n\\n'), d.done
        ([], [{'a': 1}], True)
    """

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._line = ""  # an unterminated line
        self._after_cr = False  # the last chunk ended in \r: a leading \n belongs to it
        self._data: list[str] = []
        self.done = False

    def feed(self, chunk: bytes) -> list[dict[str, Any]]:
        """The events ``chunk`` completes, in order."""
        if self.done:
            return []
        text = self._utf8.decode(chunk)
        if self._after_cr and text.startswith("\n"):
            text = text[1:]
        if text:
            self._after_cr = text.endswith("\r")
        *lines, self._line = _EOL.split(self._line + text)
        return self._events(lines)

    def flush(self) -> list[dict[str, Any]]:
        """Events left when the stream ended without a final blank line."""
        if self.done:
            return []
        tail = self._line + self._utf8.decode(b"", final=True)
        self._line = ""
        events = self._events([*(_EOL.split(tail) if tail else []), ""])
        return events

    def _events(self, lines: list[str]) -> list[dict[str, Any]]:
        events = []
        for line in lines:
            if line.startswith("data:") or line == "data":
                value = line[5:]
                self._data.append(value[1:] if value.startswith(" ") else value)
                continue
            if line.strip() or not self._data:
                continue  # comments, event: / id: fields, blank keep-alives
            payload, self._data = "\n".join(self._data), []
            if payload.strip() == "[DONE]":
                self.done = True
                break
            events.append(_json_event(payload))
        return events


def _json_event(payload: str) -> dict[str, Any]:
    try:
        event = json.loads(payload)
    except ValueError as exc:
        raise RemoteEngineError(f"bad event in the stream: {payload[:200]!r}") from exc
    if not isinstance(event, dict):
        raise RemoteEngineError(f"bad event in the stream: {payload[:200]!r}")
    return event


class StreamState:
    """What a streamed reply has said so far: the text pieces (each passed to
    ``on_text``), the tool-call pieces (each passed to ``on_tool_call_delta``, joined by
    :class:`~.tool_calls.ToolCallStream`), the finish reason, the usage of the last event."""

    def __init__(
        self,
        endpoint: Endpoint,
        on_text: Callable[[str], None] | None,
        on_tool_call_delta: Callable[[ToolCallDelta], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.on_text = on_text
        self.text: list[str] = []
        self.tools = ToolCallStream(endpoint.shown, on_tool_call_delta)
        self.finish: str | None = None
        self.usage: Mapping[str, Any] | None = None
        self.first_at: float | None = None
        self.chunks = 0

    @property
    def emitted(self) -> bool:
        """Some output (text or a tool-call piece) came, and was passed on: the call
        cannot be retried from scratch any more."""
        return self.chunks > 0 or self.tools.pieces > 0

    def feed(self, event: Mapping[str, Any]) -> None:
        """Take one event.

        Raises:
            RemoteEngineError: the event is the server's error report.
        """
        if isinstance(event.get("error"), dict | str):
            err = event["error"]
            msg = str(err.get("message", err)) if isinstance(err, dict) else err
            raise RemoteEngineError(f"{self.endpoint} stream error: {self.endpoint.scrub(msg)}")
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("tool_calls"):
                if self.first_at is None:
                    self.first_at = time.monotonic()
                self.tools.feed(delta["tool_calls"])
            piece = delta.get("content")
            if piece:
                if self.first_at is None:
                    self.first_at = time.monotonic()
                self.text.append(piece)
                self.chunks += 1
                if self.on_text is not None:
                    self.on_text(piece)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]

    def reply(self) -> Reply:
        calls = self.tools.calls(cut=self.finish is None)
        return Reply(
            "".join(self.text),
            self.finish,
            self.usage,
            self.first_at,
            self.chunks,
            tool_calls=calls,
            tool_chunks=self.tools.pieces,
        )


# -- one attempt -------------------------------------------------------------------------------


class Attempt:
    """One HTTP exchange of a :class:`Call`, fed by a transport.

    The transport sets :attr:`deadline_hit` / :attr:`cancelled` when it cut the exchange
    itself (the sync watchdog closes the response; the async deadline raises
    ``TimeoutError``), and runs its I/O inside :meth:`errors`.

    Raises (on creation):
        GenerationTimeout: no time is left before the call's deadline.
    """

    def __init__(self, endpoint: Endpoint, call: Call, *, connect_s: float) -> None:
        self.endpoint = endpoint
        self.call = call
        #: Seconds left before the call's deadline when the attempt began.
        self.remaining_s = call.deadline - time.monotonic()
        if self.remaining_s <= 0:
            raise GenerationTimeout(f"no reply from {endpoint} before the deadline")
        #: httpx timeouts of this attempt: the time left, connecting at most ``connect_s``.
        self.timeout = httpx.Timeout(self.remaining_s, connect=min(connect_s, self.remaining_s))
        self.answered = False
        self.deadline_hit = False
        self.cancelled = False
        self._stream = StreamState(endpoint, call.request.on_text, call.request.on_tool_call_delta)
        self._sse = SSEDecoder()
        self._plain: Reply | None = None

    @property
    def url(self) -> str:
        return f"{self.endpoint.url}/chat/completions"

    @property
    def stopped(self) -> bool:
        """The deadline passed or the caller cancelled: stop reading."""
        cancel = self.call.request.cancel
        if cancel is not None and cancel.is_set():
            self.cancelled = True
        return self.deadline_hit or self.cancelled

    def responded(self) -> None:
        """The response's status line arrived (failures from now on are read failures)."""
        self.answered = True

    def refused(self, status: int, body: bytes, retry_after: str | None) -> None:
        """A non-200 answer: raise what it means (see :func:`status_error`)."""
        raise status_error(self.endpoint, status, body, retry_after)

    def read_plain(self, body: bytes) -> None:
        """A non-streamed answer's whole body."""
        self._plain = parse_plain(self.endpoint, body)

    def feed(self, chunk: bytes) -> bool:
        """Bytes of the event stream; whether to stop reading (``[DONE]``, deadline, cancel)."""
        for event in self._sse.feed(chunk):
            self._stream.feed(event)
        return self._sse.done or self.stopped

    def end_of_stream(self) -> None:
        """The stream ended (the server closed it)."""
        for event in self._sse.flush():
            self._stream.feed(event)

    def reply(self) -> Reply:
        """What the attempt got.

        Raises:
            GenerationTimeout: the deadline cut a stream before any text.
        """
        if self._plain is not None:
            return self._plain
        if self.deadline_hit and not self._stream.emitted:
            raise GenerationTimeout(f"no text from {self.endpoint} before the deadline")
        return self._stream.reply()

    @contextmanager
    def errors(self) -> Iterator[None]:
        """Run the attempt's I/O; turn what it raises into convo's outcome (module table).

        convo's own errors and :class:`Retryable` pass through; an httpx error or the
        async deadline's ``TimeoutError`` becomes :class:`Retryable`,
        :class:`GenerationTimeout` or :class:`RemoteEngineError`, or is swallowed when
        the partial reply stands (then :meth:`reply` says what it is).
        """
        try:
            yield
        except (ConvoError, Retryable):
            raise
        except TimeoutError as exc:  # the async deadline (asyncio.timeout)
            self.deadline_hit = True
            if not self._stream.emitted:
                raise GenerationTimeout(f"no text from {self.endpoint} before the deadline") from exc
        except (httpx.HTTPError, httpx.StreamError) as exc:  # (StreamError is no HTTPError)
            error = self._outcome(exc)
            if error is not None:
                raise error from exc

    def _outcome(self, exc: httpx.HTTPError | httpx.StreamError) -> Exception | None:
        """What an httpx error means at this point of the attempt (``None``: keep the
        partial reply)."""
        where, what = self.endpoint, self.endpoint.scrub(describe(exc))
        if isinstance(exc, httpx.DecodingError):
            return RemoteEngineError(f"{where} sent a body that cannot be decoded: {what}")
        if not self.answered:  # connecting or sending: nothing came back
            if isinstance(exc, httpx.ConnectTimeout) and time.monotonic() < self.call.deadline:
                return Retryable(f"connect timeout: {what}")
            if isinstance(exc, httpx.TimeoutException):
                return GenerationTimeout(f"no reply from {where} before the deadline: {what}")
            return Retryable(what)
        emitted = self._stream.emitted
        if self.deadline_hit:  # we closed it at the deadline
            return None if emitted else GenerationTimeout(f"no reply from {where} before the deadline")
        if self.stopped:  # we closed it on cancel
            return None
        if isinstance(exc, httpx.TimeoutException):
            return None if emitted else GenerationTimeout(f"no text from {where} before the deadline")
        if emitted:
            return RemoteEngineError(f"{where} stream broke mid-reply: {what}")
        return Retryable(f"stream broke before any text: {what}")
