"""What every engine is: the :class:`Engine` protocol a :class:`~convo.session.Session`
drives, and the typed values it returns.

* :class:`Sampling` — decoding settings (greedy by default);
* :class:`Generation` — the reply text, its :class:`FinishReason` and its
  :class:`GenerationStats` (tokens, KV bytes, device memory, timings);
* :class:`TextStream` — text chunks of a call running in a worker thread.

Engines: :class:`~convo.engines.transformers.TransformersEngine` (local, Hugging Face
transformers, optional static KV slots from :mod:`convo.fast`) and
:class:`~convo.engines.openai.OpenAIEngine` (any OpenAI-compatible server). A test engine
that needs no model is :class:`convo.testing.EchoEngine`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypedDict, TypeVar, Unpack

from convo.errors import BudgetError, ConfigError
from convo.messages import Message
from convo.tokens import TokenCounter


class Quant(enum.StrEnum):
    """Weight format, one enum for the engines and the memory planner.

    ``AUTO`` (the engine's default) is ``NF4`` on CUDA, where weights compete with the KV
    cache for memory, and ``FP32`` on CPU, where host memory is rarely the limit and both
    bitsandbytes' 4-bit kernels and bf16 matrix products run several times slower than
    fp32 on CPUs without bf16 matrix units (measured on the CI machine: SmolLM2-135M
    prefill of 1,000 tokens 11.5 s fp32 vs 31.7 s bf16; a decode step 0.27 s vs 1.9 s).
    Ask for ``NF4`` to get 4-bit on CPU. ``NF4`` is bitsandbytes NormalFloat-4 with double
    quantization and bf16 compute on CUDA (fp16 where bf16 is unsupported; fp32 on CPU).
    ``FP4`` is bitsandbytes' other 4-bit type (the planner prices it; the engine loads nf4).

    ``INT4`` is the fast 4-bit path: group-wise int4 (group :data:`INT4_GROUP_SIZE`) held by
    :class:`convo.fast.int4.Int4Linear` (PyTorch's tinygemm layout and a plain one for
    convo's Triton kernel, see :data:`INT4_KERNELS`), run by the static decoder
    (:mod:`convo.fast`), whose compiled, graph-captured step these kernels fit into. The
    model is loaded dense (bf16 on CUDA, fp32 on CPU) and quantized at load; it needs
    ``kv_slots`` > 0 (the default for it). On CPU its kernel runs float32 activations in
    bfloat16 (PyTorch's vectorized form; SmolLM2-135M on 2 cores: 26.9 tok/s against
    fp32's 18.6).

    ``NONE`` is no quantization: dense weights in the checkpoint's own dtype on the planner
    (the ``convo plan`` default), bf16 on CUDA and fp32 on CPU in the engine. ``BF16``,
    ``FP16`` and ``FP32`` are dense in that dtype.

    :meth:`parse` also takes ``None``, any case and torch spellings (``"bfloat16"``).
    """

    AUTO = "auto"
    NF4 = "nf4"
    INT8 = "int8"
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    INT4 = "int4"
    NONE = "none"
    FP4 = "fp4"

    @classmethod
    def parse(cls, value: str | Quant | None) -> Quant:
        """``None``/``""`` -> ``NONE``; ``"NF4"``, ``"bfloat16"``, ``"float32"``... accepted.

        Raises:
            ConfigError: unknown format.
        """
        if isinstance(value, Quant):
            return value
        key = "" if value is None else str(value).strip().lower().removeprefix("torch.")
        key = _QUANT_ALIASES.get(key, key)
        try:
            return cls(key)
        except ValueError:
            raise ConfigError(
                f"unknown weight format {value!r}; use one of {[q.value for q in cls]}"
            ) from None

    def resolved(self, *, cuda: bool) -> Quant:
        """``AUTO`` made concrete for the device (``NF4`` on CUDA, ``FP32`` elsewhere);
        any other format as it is."""
        if self is Quant.AUTO:
            return Quant.NF4 if cuda else Quant.FP32
        return self

    @property
    def is_dense(self) -> bool:
        """No quantization: ``NONE``, ``BF16``, ``FP16``, ``FP32``."""
        return self in (Quant.NONE, Quant.BF16, Quant.FP16, Quant.FP32)

    @property
    def is_bitsandbytes(self) -> bool:
        """Quantized by bitsandbytes at load (``NF4``, ``FP4``, ``INT8``): the engine runs
        these through transformers' ``generate`` or calls the modules as loaded."""
        return self in (Quant.NF4, Quant.FP4, Quant.INT8)

    @property
    def dense_dtype(self) -> str | None:
        """``"bf16"``/``"fp16"``/``"fp32"`` for those dense formats, else ``None``."""
        return self.value if self in (Quant.BF16, Quant.FP16, Quant.FP32) else None

    @property
    def bits_per_weight(self) -> int | None:
        """Nominal storage bits of a quantized ``nn.Linear`` weight, before per-block
        scales (4 or 8; 16/32 for dense dtypes), or ``None`` (``AUTO``, ``NONE``: it
        depends). The exact bytes come from :func:`convo.planner.model.weight_bytes`."""
        return _QUANT_BITS.get(self)


_QUANT_ALIASES = {
    "": "none",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
}
_QUANT_BITS = {
    Quant.NF4: 4,
    Quant.FP4: 4,
    Quant.INT4: 4,
    Quant.INT8: 8,
    Quant.BF16: 16,
    Quant.FP16: 16,
    Quant.FP32: 32,
}

#: Input features per int4 scale/zero pair that :class:`~convo.engines.transformers.TransformersEngine`
#: (and so ``convo serve --quant int4``) uses by default; ``convo plan --quant int4`` prices it.
INT4_GROUP_SIZE = 32
#: The int4 kernel choices (``TransformersEngine(int4_kernel=)``, ``--int4-kernel``): which
#: weight layouts are kept. ``auto``: both on CUDA with Triton (tinygemm for a few rows,
#: Triton above; twice the weight bytes), else tinygemm's; ``triton``: the plain layout
#: alone; ``tinygemm``: PyTorch's alone.
INT4_KERNELS = ("auto", "triton", "tinygemm")


class FinishReason(enum.StrEnum):
    """Why generation stopped."""

    STOP = "stop"  # end-of-turn token or a stop string
    LENGTH = "length"  # max_new_tokens reached
    TIMEOUT = "timeout"  # the wall-clock limit
    CANCELLED = "cancelled"  # the consumer stopped reading a stream


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """Decoding settings. The default is greedy (``temperature=0``).

    Args:
        temperature: 0 for greedy, else the sampling temperature.
        top_p: nucleus sampling mass (1.0 = off).
        top_k: keep the k most likely tokens (0 = off).
        repetition_penalty: 1.0 = off.
        seed: seeds torch before sampling, for reproducible samples.
        min_new_tokens: suppress end-of-turn before this many tokens (benchmarks use it
            to fix reply lengths). Default 0.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    min_new_tokens: int = 0

    def __post_init__(self) -> None:
        if self.min_new_tokens < 0:
            raise ConfigError("min_new_tokens must be >= 0")
        if self.temperature < 0:
            raise ConfigError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ConfigError("top_k must be >= 0")
        if self.repetition_penalty <= 0:
            raise ConfigError("repetition_penalty must be > 0")

    def generate_kwargs(self) -> dict[str, Any]:
        extra = {"min_new_tokens": self.min_new_tokens} if self.min_new_tokens else {}
        if self.temperature == 0:
            return {"do_sample": False, "repetition_penalty": self.repetition_penalty, **extra}
        return {
            **extra,
            "do_sample": True,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k or None,
            "repetition_penalty": self.repetition_penalty,
        }


GREEDY = Sampling()


@dataclass(frozen=True, kw_only=True)
class GenerationStats:
    """What one generate call cost. Bytes are bytes, times are seconds.

    On CUDA ``allocated_bytes`` / ``reserved_bytes`` are read after the call and the
    ``peak_*`` values are the peaks during it. On CPU ``memory_kind`` is ``"rss"``: the
    allocated / reserved fields hold the process RSS after the call and ``peak_*`` the
    process's peak RSS so far (the OS keeps no per-call peak). An engine that cannot see
    the memory (a remote server, a test engine) leaves the byte fields at 0.
    """

    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the previous turn
    prefill_tokens: int  # prompt tokens actually run through the model
    new_tokens: int
    kv_tokens: int  # tokens in the KV cache after the call
    kv_bytes: int = 0  # measured from the cache tensors
    kv_bytes_expected: int = 0  # 2 * layers * kv_heads * head_dim * kv_tokens * dtype bytes
    prefill_s: float
    decode_s: float
    ttft_s: float
    total_s: float
    tokens_per_s: float
    memory_kind: str  # "cuda", "rss", "remote" (a server's) or "none" (a test engine)
    allocated_bytes: int = 0
    reserved_bytes: int = 0
    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    attention: str
    kv_slot_bytes: int = 0  # the static KV slot the call ran in (0 without static decode)

    @classmethod
    def from_times(
        cls,
        *,
        prompt_tokens: int,
        cached_tokens: int,
        new_tokens: int,
        kv_tokens: int,
        start: float,
        first_token_at: float | None,
        end: float,
        memory_kind: str,
        attention: str,
        **extra: Any,
    ) -> GenerationStats:
        """Stats of a call timed by ``time.perf_counter()`` stamps: its start, its first
        token (``None``: no token, the whole call counts as prefill) and its end."""
        ttft_at = first_token_at or end
        decode_s = max(end - ttft_at, 0.0)
        return cls(
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            prefill_tokens=prompt_tokens - cached_tokens,
            new_tokens=new_tokens,
            kv_tokens=kv_tokens,
            prefill_s=ttft_at - start,
            decode_s=decode_s,
            ttft_s=ttft_at - start,
            total_s=end - start,
            tokens_per_s=(new_tokens - 1) / decode_s if new_tokens > 1 and decode_s > 0 else 0.0,
            memory_kind=memory_kind,
            attention=attention,
            **extra,
        )

    @classmethod
    def untimed(cls, *, prompt_tokens: int, new_tokens: int) -> GenerationStats:
        """Stats of an engine that neither times nor sees memory (test engines)."""
        return cls.from_times(
            prompt_tokens=prompt_tokens,
            cached_tokens=0,
            new_tokens=new_tokens,
            kv_tokens=prompt_tokens + new_tokens,
            start=0.0,
            first_token_at=None,
            end=0.0,
            memory_kind="none",
            attention="none",
        )


@dataclass(frozen=True, kw_only=True)
class Generation:
    """A reply from the engine."""

    text: str
    finish_reason: FinishReason
    token_ids: tuple[int, ...]
    stats: GenerationStats

    @property
    def timed_out(self) -> bool:
        return self.finish_reason is FinishReason.TIMEOUT


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
      checked before the model runs).
    """

    timeout_s: float | None
    sampling: Sampling
    stop: Sequence[str]
    cache_key: str | None
    on_text: Callable[[str], None] | None
    cancel: threading.Event | None
    max_prompt_tokens: int | None


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """The arguments of one :meth:`Engine.generate` call, defaults filled in
    (:class:`GenerateOptions` says what each is). ``GenerateRequest(max_new_tokens=n,
    **options)`` refuses an unknown keyword with ``TypeError``, as a signature would.

    Raises:
        ConfigError: ``max_new_tokens`` < 1.
    """

    max_new_tokens: int
    timeout_s: float | None = None
    sampling: Sampling = GREEDY
    stop: Sequence[str] = ()
    cache_key: str | None = None
    on_text: Callable[[str], None] | None = None
    cancel: threading.Event | None = None
    max_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError("max_new_tokens must be >= 1")

    @property
    def streams(self) -> bool:
        """The caller wants text piece by piece, or may cancel the call."""
        return self.on_text is not None or self.cancel is not None

    def check_prompt(self, prompt_tokens: int, *, input_cap: int, cap_name: str) -> None:
        """Refuse a prompt over ``max_prompt_tokens``, or one that leaves no room for
        ``max_new_tokens`` under the engine's ``input_cap`` (``cap_name`` says which cap).

        Raises:
            BudgetError: either.
        """
        cap = self.max_prompt_tokens
        if cap is not None and prompt_tokens > cap:
            raise BudgetError(f"prompt of {prompt_tokens} tokens is over the budget's {cap}")
        if prompt_tokens + self.max_new_tokens > input_cap:
            raise BudgetError(
                f"prompt of {prompt_tokens} tokens + max_new_tokens={self.max_new_tokens} exceeds {cap_name}"
            )


class Engine(Protocol):
    """What a :class:`~convo.session.Session` needs from an engine."""

    @property
    def counter(self) -> TokenCounter: ...

    @property
    def context_window(self) -> int: ...

    def generate(
        self, messages: Sequence[Message], *, max_new_tokens: int, **options: Unpack[GenerateOptions]
    ) -> Generation: ...

    def release(self, cache_key: str) -> None: ...


def concurrent_calls(engine: object) -> int:
    """Calls ``engine`` runs together rather than one after another: its
    ``concurrent_calls`` attribute (a batching local engine: its KV slots; a client of a
    server: its connections), 1 for an engine without one."""
    return max(int(getattr(engine, "concurrent_calls", 1) or 1), 1)


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
    sampling: Sampling = GREEDY
    stop: Sequence[str] = ()
    cache_key: str | None = None
    on_text: Callable[[str], None] | None = None
    cancel: threading.Event | None = None


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

    Two backends implement it (:mod:`convo.engines.kv`): ``DynamicKV``, a growing
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

    def close(self) -> None:
        """Stop and join the backend's threads and drop its caches. Idempotent."""
        ...


def empty_device_cache() -> None:
    """Return the CUDA allocator's cached, unused blocks to the device (no-op without CUDA
    or torch). The one place convo empties the cache: after an OOM and on release."""
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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
