"""What every engine is: the :class:`Engine` protocol a :class:`~convo.session.Session`
drives, the options of a call, and how text streams out of it.

* :class:`GenerateOptions` / :class:`GenerateRequest` — the keyword options of
  :meth:`Engine.generate` and their defaults;
* :class:`KVCall` / :class:`KVRun` / :class:`KVBackend` — how a local engine hands a call
  to the place its KV cache lives;
* :class:`TextStream` / :class:`AsyncTextStream` — text chunks of a running call.

The values a call returns (:class:`~convo.models.generation.Sampling`,
:class:`~convo.models.generation.Generation`, :class:`~convo.models.generation.GenerationStats`,
:class:`~convo.models.generation.FinishReason`, :class:`~convo.models.generation.Priority`)
and :class:`~convo.models.quant.Quant` live in :mod:`convo.models`; their old names here
still work for one release (with a ``DeprecationWarning``).

Engines: :class:`~convo.engines.local.engine.TransformersEngine` (local, Hugging Face
transformers, optional static KV slots from :mod:`convo.fast`) and
:class:`~convo.engines.openai.OpenAIEngine` (any OpenAI-compatible server). A test engine
that needs no model is :class:`convo.testing.EchoEngine`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypedDict, TypeVar, Unpack

from convo.errors import BudgetError, ConfigError, ToolsNotSupported
from convo.messages import Message
from convo.models import generation as _generation
from convo.models.legacy import warn_moved
from convo.tokens import TokenCounter

if TYPE_CHECKING:
    from convo.models.generation import Generation, Priority, Sampling, SchedulerStats, ToolCallDelta

#: Names that moved to :mod:`convo.models`: served from their old home here for one
#: release, with a ``DeprecationWarning`` (not to convo's own modules that still import
#: them: see :func:`~convo.models.legacy.warn_moved`).
_MOVED = {
    **dict.fromkeys(
        ["FinishReason", "Sampling", "GREEDY", "GenerationStats", "Generation", "Priority"],
        "convo.models.generation",
    ),
    **dict.fromkeys(["Quant", "INT4_GROUP_SIZE", "INT4_KERNELS", "INT4_GROUP_SIZES"], "convo.models.quant"),
    "empty_device_cache": "convo.models.device",
}


def __getattr__(name: str) -> Any:
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warn_moved(f"convo.engines.base.{name}", f"{module}.{name} (or convo.models)")
    return getattr(importlib.import_module(module), name)


class GenerateOptions(TypedDict, total=False):
    """The optional keyword arguments of :meth:`Engine.generate` (and ``agenerate``), the
    same for every engine; :class:`GenerateRequest` gives each its default.

    * ``timeout_s``: wall-clock cap of the call (default: the engine's ``timeout_s``);
    * ``sampling``: decoding settings (default greedy);
    * ``stop``: strings that end the reply where they first appear (not part of it);
    * ``cache_key``: keep and reuse the KV cache under this key (a session id);
    * ``on_text``: called with each new piece of text;
    * ``cancel``: set it to stop early (finish reason ``cancelled``);
    * ``max_prompt_tokens``: refuse a prompt longer than this (the session's budget,
      checked before the model runs);
    * ``priority``: a :class:`~convo.models.generation.Priority`: how urgent the call is
      to an engine that batches calls (its scheduler serves ``REPLY`` before
      ``BACKGROUND``, the rolling summaries' priority); other engines ignore it. Default:
      a reply's;
    * ``tools``: OpenAI function tools the model may call (``[{"type": "function",
      "function": {"name", "description", "parameters"}}]``); the reply's calls come back
      in :attr:`Generation.tool_calls <convo.models.generation.Generation.tool_calls>`.
      An engine whose ``supports_tools`` is false refuses a call with tools
      (:class:`~convo.errors.ToolsNotSupported`);
    * ``tool_choice``: ``"auto"``, ``"none"``, ``"required"`` or
      ``{"type": "function", "function": {"name": ...}}`` (OpenAI's), default the server's;
    * ``parallel_tool_calls``: whether the model may ask for several calls at once
      (``None``: the server's default);
    * ``owner``: the ``cache_key`` of the session this call works for without being its
      turn (a rolling summary, a background prefill): a KV-caching engine serves it from
      that session's own cached prefix or slot and never evicts another session for it;
      the call's KV is not kept under ``cache_key``. Other engines ignore it;
    * ``on_tool_call_delta``: called with each :class:`~convo.models.generation.ToolCallDelta`
      while a reply streams (``on_text`` keeps getting only content text); giving it
      streams the reply. A server relaying tool calls to its own streaming client uses it.
    """

    timeout_s: float | None
    sampling: Sampling
    stop: Sequence[str]
    cache_key: str | None
    on_text: Callable[[str], None] | None
    cancel: threading.Event | None
    max_prompt_tokens: int | None
    priority: Priority | None
    tools: Sequence[Mapping[str, Any]] | None
    tool_choice: str | Mapping[str, Any] | None
    parallel_tool_calls: bool | None
    owner: str | None
    on_tool_call_delta: Callable[[ToolCallDelta], None] | None


#: The string values of ``tool_choice`` (OpenAI's).
TOOL_CHOICES = ("auto", "none", "required")


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """The arguments of one :meth:`Engine.generate` call, defaults filled in
    (:class:`GenerateOptions` says what each is). ``GenerateRequest(max_new_tokens=n,
    **options)`` refuses an unknown keyword with ``TypeError``, as a signature would.

    ``tools`` is kept as a tuple of the given mappings (an empty list is no tools); each
    must be an OpenAI function tool with a function ``name``. ``tool_choice`` other than
    ``"none"`` needs tools, and a named choice must name one of them.

    Raises:
        ConfigError: ``max_new_tokens`` < 1, a malformed tool or ``tool_choice``.
    """

    max_new_tokens: int
    timeout_s: float | None = None
    sampling: Sampling = _generation.GREEDY
    stop: Sequence[str] = ()
    cache_key: str | None = None
    on_text: Callable[[str], None] | None = None
    cancel: threading.Event | None = None
    max_prompt_tokens: int | None = None
    #: ``None``: a reply's (:attr:`Priority.REPLY <convo.models.generation.Priority.REPLY>`).
    priority: Priority | None = None
    #: ``None`` (or an empty list): no tools.
    tools: Sequence[Mapping[str, Any]] | None = None
    tool_choice: str | Mapping[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    #: ``None``: the call is its own (a turn of ``cache_key``, or a one-off).
    owner: str | None = None
    on_tool_call_delta: Callable[[ToolCallDelta], None] | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError("max_new_tokens must be >= 1")
        tools = tuple(self.tools or ())
        names = [tool_name(t) for t in tools]
        object.__setattr__(self, "tools", tools or None)
        choice = self.tool_choice
        if choice is None:
            return
        if isinstance(choice, str):
            if choice not in TOOL_CHOICES:
                raise ConfigError(
                    f"tool_choice must be one of {TOOL_CHOICES} or a named function, got {choice!r}"
                )
            wanted = None
        elif isinstance(choice, Mapping) and isinstance(choice.get("function"), Mapping):
            wanted = choice["function"].get("name")
            if not isinstance(wanted, str) or not wanted:
                raise ConfigError("a named tool_choice needs {'function': {'name': ...}}")
        else:
            raise ConfigError(
                "tool_choice must be 'auto', 'none', 'required' or "
                f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}"
            )
        if choice != "none" and not tools:
            raise ConfigError(f"tool_choice={choice!r} needs tools")
        if wanted is not None and wanted not in names:
            raise ConfigError(f"tool_choice names {wanted!r}, which is not among the tools {names}")

    @property
    def streams(self) -> bool:
        """The caller wants text (or tool-call pieces) as they come, or may cancel the call."""
        return self.on_text is not None or self.cancel is not None or self.on_tool_call_delta is not None

    @property
    def wants_tools(self) -> bool:
        """The call gives the model tools (or a ``tool_choice`` other than ``"none"``)."""
        return bool(self.tools) or (self.tool_choice is not None and self.tool_choice != "none")

    def check_tools(self, *, supports_tools: bool, engine: str) -> None:
        """Refuse tools on an engine that cannot use them (``supports_tools`` false).

        Raises:
            ToolsNotSupported: the call has tools and the engine does not support them.
        """
        if self.wants_tools and not supports_tools:
            raise ToolsNotSupported(
                f"{engine} does not support tools yet; drop tools= / tool_choice=, or use an "
                "engine that declares supports_tools (OpenAIEngine, --engine-url)"
            )

    def check_prompt(
        self,
        prompt_tokens: int,
        *,
        input_cap: int,
        cap_name: str,
        supports_tools: bool = False,
        engine: str = "this engine",
    ) -> None:
        """Refuse a prompt over ``max_prompt_tokens``, or one that leaves no room for
        ``max_new_tokens`` under the engine's ``input_cap`` (``cap_name`` says which cap),
        and tools on an engine without ``supports_tools`` (:meth:`check_tools`; the default
        ``False`` makes an engine that predates tools refuse them rather than drop them;
        ``engine`` names it in the message).

        Raises:
            BudgetError: the prompt does not fit.
            ToolsNotSupported: tools on an engine that cannot use them.
        """
        self.check_tools(supports_tools=supports_tools, engine=engine)
        cap = self.max_prompt_tokens
        if cap is not None and prompt_tokens > cap:
            raise BudgetError(f"prompt of {prompt_tokens} tokens is over the budget's {cap}")
        if prompt_tokens + self.max_new_tokens > input_cap:
            raise BudgetError(
                f"prompt of {prompt_tokens} tokens + max_new_tokens={self.max_new_tokens} exceeds {cap_name}"
            )


def tool_name(tool: Any) -> str:
    """The function name of an OpenAI function tool (``{"type": "function", "function":
    {"name": ...}}``).

    Raises:
        ConfigError: not a function tool with a non-empty name.
    """
    fn = tool.get("function") if isinstance(tool, Mapping) else None
    if (
        not isinstance(tool, Mapping)
        or tool.get("type", "function") != "function"
        or not isinstance(fn, Mapping)
    ):
        raise ConfigError(f"a tool must be {{'type': 'function', 'function': {{'name': ...}}}}, got {tool!r}")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a function tool needs a non-empty 'name', got {fn!r}")
    return name


class Engine(Protocol):
    """What a :class:`~convo.session.Session` needs from an engine, capabilities included.

    Capabilities are declared, never probed: callers read these attributes and do not
    ``getattr`` or ``inspect``. Subclass ``Engine`` to inherit the defaults below (as the
    engines of convo and :mod:`convo.testing` do), or declare each attribute yourself.

    ==========================  =========  ===================================================
    capability                  default    meaning
    ==========================  =========  ===================================================
    ``concurrent_calls``        1          calls run together rather than one after another
                                           (a batching local engine: its KV slots; a client
                                           of a server: its connections)
    ``margin_tokens``           0          tokens a budget over this engine holds back for
                                           counting errors (a counter of another tokenizer)
    ``supports_async``          False      :meth:`agenerate` runs on the event loop (else the
                                           session runs :meth:`generate` in a worker thread)
    ``supports_tools``          False      the ``tools`` options are honoured (else they are
                                           refused with :class:`~convo.errors.ToolsNotSupported`)
    ``scheduler_stats``         None       counters of the engine's decode scheduler
                                           (:class:`~convo.models.generation.SchedulerStats`)
    ``supports_prefill``        False      :meth:`prefill` computes a prompt's KV ahead of
                                           the turn (else it does nothing)
    ``memory_report()``         None       the device's memory now (``memory_kind``,
                                           ``allocated_bytes``, ``reserved_bytes`` and peaks)
    ``planned_peak_reserved_``  None       an engine sized to a memory limit: the plan's
    ``bytes``                              peak reserved for what it picked
    ==========================  =========  ===================================================
    """

    @property
    def concurrent_calls(self) -> int:
        return 1

    @property
    def margin_tokens(self) -> int:
        return 0

    @property
    def supports_async(self) -> bool:
        return False

    @property
    def supports_tools(self) -> bool:
        return False

    @property
    def scheduler_stats(self) -> SchedulerStats | None:
        return None

    @property
    def supports_prefill(self) -> bool:
        return False

    def memory_report(self) -> dict[str, Any] | None:
        return None

    @property
    def planned_peak_reserved_bytes(self) -> int | None:
        return None

    @property
    def counter(self) -> TokenCounter: ...

    @property
    def context_window(self) -> int: ...

    def generate(
        self, messages: Sequence[Message], *, max_new_tokens: int, **options: Unpack[GenerateOptions]
    ) -> Generation: ...

    async def agenerate(
        self, messages: Sequence[Message], *, max_new_tokens: int, **options: Unpack[GenerateOptions]
    ) -> Generation:
        """The async twin of :meth:`generate`, for engines that declare ``supports_async``."""
        raise NotImplementedError(f"{type(self).__name__} declares no async generate")

    def release(self, cache_key: str) -> None: ...

    def prefill(self, messages: Sequence[Message], *, cache_key: str) -> None:
        """Compute the KV of ``messages`` (the prefix of a session's next prompt: system,
        summary, kept window) under ``cache_key`` in the background, at background priority,
        so that the session's next turn prefills only its new message. Returns at once;
        engines that do not declare ``supports_prefill`` do nothing."""
        return None

    def close(self) -> None:
        """Stop the engine's threads and close its clients. Idempotent."""


def concurrent_calls(engine: Engine) -> int:
    """Calls ``engine`` runs together rather than one after another (its declared
    ``concurrent_calls``, at least 1)."""
    return max(int(engine.concurrent_calls), 1)


# -- the KV cache of a local engine ------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class KVCall:
    """One call to a :class:`KVBackend`: a checked prompt and how to decode its reply (the
    arguments of :meth:`Engine.generate`, after the engine rendered and capped the prompt)."""

    #: The rendered prompt's token ids (tokenizer vocabulary).
    ids: list[int]
    max_new_tokens: int
    #: Wall-clock cap, prefill (and, with slots, the wait for one) included.
    timeout_s: float
    sampling: Sampling = _generation.GREEDY
    stop: Sequence[str] = ()
    cache_key: str | None = None
    on_text: Callable[[str], None] | None = None
    cancel: threading.Event | None = None
    #: How urgent the call is to a batching backend (``None``: a reply's).
    priority: Priority | None = None
    #: The session the call works for without being its turn (``GenerateOptions.owner``).
    owner: str | None = None
    #: Decode the reply's text with special tokens kept (less ``eos``), for tool-call
    #: markers that are special tokens (Llama's ``<|python_tag|>``, Mistral's ``[TOOL_CALLS]``).
    keep_special_tokens: bool = False


@dataclass(frozen=True, kw_only=True)
class KVRun:
    """What a :class:`KVBackend` reports about one call: the reply's token ids and what the
    KV cache held. The engine turns it into a :class:`Generation` (text, finish reason,
    :class:`GenerationStats`)."""

    #: Token ids of the reply (model vocabulary).
    new_ids: list[int]
    #: Prompt tokens whose KV was reused from the session's previous turn.
    cached_tokens: int
    #: Tokens whose K/V the cache held at the end of the call.
    kv_tokens: int
    #: Bytes of those K/V tensors.
    kv_bytes: int
    #: Bytes of one preallocated slot (0 for a growing cache).
    kv_slot_bytes: int = 0
    #: ``time.monotonic()`` when the call started (its deadline counts from here), when
    #: the first reply token came (``None``: none came) and when it ended.
    start: float
    first_token_at: float | None
    end: float
    cancelled: bool
    timed_out: bool
    #: The ``torch.device`` the cache lives on (for the memory report).
    device: Any


class KVBackend(Protocol):
    """Where a local engine keeps the KV cache of its sessions, and how it decodes on it.

    Two backends implement it (:mod:`convo.engines.local.kv`): ``DynamicKV``, a growing
    transformers cache per session run through ``model.generate`` one call at a time, and
    ``SlotKV``, the static slots of :mod:`convo.fast` decoded together by a scheduler. The
    engine picks one at load; validation, text and statistics stay in the engine.
    """

    def generate(self, call: KVCall) -> KVRun:
        """Prefill ``call.ids`` (reusing the session's kept prefix) and decode the reply.

        Raises:
            DeviceOutOfMemory: the device ran out of memory (the session's cache is freed).
        """
        ...

    @property
    def cached_sessions(self) -> list[str]:
        """Keys of the sessions whose KV cache is kept."""
        ...

    def release(self, cache_key: str) -> None:
        """Drop the KV cache kept for ``cache_key`` (no-op if none)."""
        ...

    def release_all(self) -> None:
        """Drop every kept KV cache and return cached blocks to the device."""
        ...

    #: Whether :meth:`prefill` computes a prompt's KV ahead of its turn.
    supports_prefill: bool

    def prefill(self, ids: Sequence[int], *, cache_key: str, timeout_s: float) -> Any:
        """Compute the KV of ``ids`` (a session's next prompt prefix) for ``cache_key`` in the
        background, after the calls waiting; returns at once (a handle of the work)."""
        ...

    def close(self) -> None:
        """Stop and join the backend's threads and drop its caches. Idempotent."""
        ...


_END = object()
T = TypeVar("T")


class TextStream(Generic[T]):
    """Text chunks of a call running in a worker thread.

    ``call(on_text=..., cancel=..., **kwargs)`` runs in the worker; iterate the stream
    (sync) or ``async for`` over :meth:`aiter`. ``result`` holds the call's return value
    after the last chunk; an error in the call is raised to the consumer. ``close()``
    cancels the call and waits for it.
    """

    def __init__(self, call: Callable[..., T], kwargs: dict[str, Any]) -> None:
        self._queue: queue.Queue[Any] = queue.Queue()
        self._cancel = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None
        # An async consumer's loop and wake-up event (set from the worker thread).
        self._waker: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        kwargs = dict(kwargs, on_text=self._put, cancel=self._cancel)

        def work() -> None:
            try:
                self.result = call(**kwargs)
            except BaseException as exc:  # delivered to the consumer
                self.error = exc
            finally:
                self._put(_END)

        self._thread = threading.Thread(target=work, name="convo-generate", daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[str]:
        with self._draining():
            while (item := self._queue.get()) is not _END:
                yield item

    async def aiter(self) -> AsyncIterator[str]:
        """Async iteration without blocking the event loop: the worker wakes the loop
        (no thread hop per chunk), and every chunk that came meanwhile is taken at once."""
        ready = asyncio.Event()
        self._waker = (asyncio.get_running_loop(), ready)
        with self._draining():
            while True:
                ready.clear()
                items = []
                with contextlib.suppress(queue.Empty):
                    while True:
                        items.append(self._queue.get_nowait())
                for item in items:
                    if item is _END:
                        return
                    yield item
                if not items:
                    await ready.wait()

    def _put(self, item: Any) -> None:
        self._queue.put(item)
        waker = self._waker
        if waker is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                waker[0].call_soon_threadsafe(waker[1].set)

    @contextlib.contextmanager
    def _draining(self) -> Iterator[None]:
        """Around the iteration: the call is closed however it ends (a consumer that
        stops early cancels it); once every chunk came, the call's error is raised."""
        try:
            yield
        finally:
            self.close()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Cancel the call (if still running) and wait for the worker to finish."""
        if self._thread.is_alive():
            self._cancel.set()
        self._thread.join()


class AsyncTextStream(Generic[T]):
    """Text chunks of a coroutine, on the event loop.

    ``call(on_text=..., cancel=..., **kwargs)`` is awaited in a task from the first
    ``__anext__``; each ``on_text`` piece is yielded (``on_text`` may be called from the
    loop or from a worker thread). ``result`` holds the call's return value after the last
    chunk; an error in the call is raised to the consumer. Use it as a context manager so
    that leaving early cancels the call and waits for it (``async for`` alone cannot tell
    an early ``break`` in time)::

        async with session.astream("hi") as stream:
            async for piece in stream:
                ...
    """

    def __init__(self, call: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        self._call = call
        self._kwargs = kwargs
        self._task: asyncio.Future[Any] | None = None
        self._pieces: asyncio.Queue[Any] | None = None
        self._cancel = threading.Event()
        self.result: T | None = None

    def _start(self) -> asyncio.Queue[Any]:
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[Any] = asyncio.Queue()

        def on_text(piece: str) -> None:
            loop.call_soon_threadsafe(pieces.put_nowait, piece)

        self._task = asyncio.ensure_future(self._call(on_text=on_text, cancel=self._cancel, **self._kwargs))
        self._task.add_done_callback(lambda _: loop.call_soon_threadsafe(pieces.put_nowait, _END))
        self._pieces = pieces
        return pieces

    def __aiter__(self) -> AsyncTextStream[T]:
        return self

    async def __anext__(self) -> str:
        pieces = self._pieces or self._start()
        item = await pieces.get()
        if item is _END:
            assert self._task is not None
            pieces.put_nowait(_END)  # stay exhausted
            self.result = self._task.result()  # raises the call's error
            raise StopAsyncIteration
        return str(item)

    async def aclose(self) -> None:
        """Cancel the call (if still running) and wait for it to finish."""
        if self._task is not None and not self._task.done():
            self._cancel.set()
            await asyncio.gather(self._task, return_exceptions=True)

    async def __aenter__(self) -> AsyncTextStream[T]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
