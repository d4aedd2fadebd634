"""What one generation is: its settings, its result and how urgent it is.

* :class:`Sampling` — decoding settings (greedy by default, :data:`GREEDY`);
* :class:`Generation` — the reply text, the tool calls it asks for
  (:class:`~convo.messages.ToolCall`), its :class:`FinishReason` and its
  :class:`GenerationStats` (tokens, KV bytes, device memory, timings);
* :class:`ToolCallDelta` — one piece of a tool call as a streaming engine sees it form;
* :class:`Priority` — the order in which a batching engine serves waiting work (replies
  before background work such as summaries).

Every engine returns these values and the fast path's scheduler reads them; this module
imports nothing of convo but :mod:`convo.errors` (and, for type checking only,
:class:`~convo.messages.ToolCall`, whose module imports only errors too).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from convo.errors import ConfigError

if TYPE_CHECKING:  # a type only: at run time this leaf imports nothing of convo but errors
    from convo.messages import ToolCall


class FinishReason(enum.StrEnum):
    """Why generation stopped."""

    STOP = "stop"  # end-of-turn token or a stop string
    LENGTH = "length"  # max_new_tokens reached
    TIMEOUT = "timeout"  # the wall-clock limit
    CANCELLED = "cancelled"  # the consumer stopped reading a stream
    TOOL_CALLS = "tool_calls"  # the reply asks for tool calls (Generation.tool_calls)


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
class ToolCallDelta:
    """One piece of a tool call while a reply streams (OpenAI's ``delta.tool_calls[i]``).

    A call is identified by its ``index`` in the reply; its first piece usually carries the
    ``id`` and the function ``name``, the following ones fragments of the ``arguments``
    JSON text. Joining every piece of one index, in order, gives the finished call that
    :attr:`Generation.tool_calls` holds at the end.

    Args:
        index: position of the call in the reply (0, 1, ... for parallel calls).
        id: the call id, on the piece that first carries it (else ``None``).
        name: a fragment of the function name (usually all of it, on the first piece).
        arguments: a fragment of the arguments' JSON text (may be empty).
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True, kw_only=True)
class Generation:
    """A reply from the engine.

    ``tool_calls`` holds the function calls the reply asks for (then ``finish_reason`` is
    usually :attr:`FinishReason.TOOL_CALLS`); their ``arguments`` are the JSON text the
    model produced, kept as it came (check :attr:`~convo.messages.ToolCall.parsed_arguments`).
    ``text`` is the content beside them (often empty).
    """

    text: str
    finish_reason: FinishReason
    token_ids: tuple[int, ...]
    stats: GenerationStats
    tool_calls: tuple[ToolCall, ...] = ()

    @property
    def timed_out(self) -> bool:
        return self.finish_reason is FinishReason.TIMEOUT


class Priority(enum.IntEnum):
    """Order in which waiting work gets KV slots and prefill budget (lower first). Pass it
    as the ``priority`` option of :meth:`~convo.engines.base.Engine.generate`; the rolling
    summaries (:mod:`convo.summarize`) ask for ``BACKGROUND``."""

    REPLY = 0  # a turn a user waits for
    BACKGROUND = 1  # work nobody waits on token by token: summaries


@dataclass(frozen=True, kw_only=True)
class SchedulerStats:
    """What a :class:`~convo.fast.scheduler.DecodeScheduler` has run since it started
    (``convo serve`` exports it on ``/metrics`` as ``convo_engine_*``).

    Attributes:
        steps: steps run, by kind (:data:`~convo.fast.scheduler.STEP_KINDS`).
        busy_s: seconds spent in steps, by kind, from launch until the step's tokens were
            read back (so device time is included).
        decode_rows: tokens decoded (the rows of decode and mixed steps).
        prompt_tokens: prompt tokens prefilled.
        preemptions: requests stopped to free a slot for a reply (they went on later).
        swaps_out: sessions' KV copied from a slot to host memory (their slot was given away).
        swaps_in: sessions' KV copied from host memory back into a slot.
        swap_bytes: bytes those copies moved, both directions.
        host_bytes: bytes of KV held in host memory now.
        host_bytes_peak: most bytes of KV held in host memory at once.
        host_dropped: host entries dropped (or never kept) because host memory was full.
        host_limit_bytes: the host memory bound (0: evicted KV is dropped).
        host_reserved_bytes: bytes of the host KV arena, taken once (the whole blocks
            within the bound): what the process holds for host KV, in use or not.
        parked: of the preemptions, those whose KV was parked in host memory (the work
            resumed by a copy, not a recompute).
        prefills: background prefill requests run (a prompt's KV computed ahead of its turn).
        novel_prompt_tokens: prompt tokens an unbounded exact cache would still prefill:
            the tokens past each request's common prefix with what its session's KV last
            held (at least its last one for a request that samples; all of a request
            without a session). ``prompt_tokens - novel_prompt_tokens`` is what evictions
            cost (KV dropped and recomputed, preempted work recomputed).
        shifts: context shifts run (cached tokens moved to the positions a slid window
            gave them, :mod:`convo.fast.kv_shift`).
        shifted_tokens: the cached tokens those shifts moved instead of prefilling them.
        prompt_tokens_by_work: ``prompt_tokens`` by kind of work
            (:data:`~convo.fast.scheduler.WORK_KINDS`: ``reply``, ``background``, ``prefill``).
        novel_tokens_by_work: ``novel_prompt_tokens`` by the same kinds. A kind's prefilled
            less novel tokens is what evictions cost that kind, less what shifts saved it.
        recomputed_tokens: of ``prompt_tokens``, those preempted work prefilled again
            after it was stopped (parked work that came back by a copy prefills none).
        kept_for_background: session prefixes kept in host memory for the session's
            queued background work (its summary) before the session's turn overwrote them
            (a slid window): parked from the slot, or host memory's copy handed over; that
            work resumes from them by a copy.
        slot_copies: session prefixes copied from the slot where the session's turn runs
            into another slot, for other work of that session (its summary), instead of
            prefilled again; ``slot_copied_tokens``: the tokens they held.
    """

    steps: dict[str, int]
    busy_s: dict[str, float]
    decode_rows: int
    prompt_tokens: int
    preemptions: int
    swaps_out: int = 0
    swaps_in: int = 0
    swap_bytes: int = 0
    host_bytes: int = 0
    host_bytes_peak: int = 0
    host_dropped: int = 0
    host_limit_bytes: int = 0
    prefills: int = 0
    host_reserved_bytes: int = 0
    parked: int = 0
    novel_prompt_tokens: int = 0
    shifts: int = 0
    shifted_tokens: int = 0
    prompt_tokens_by_work: dict[str, int] = field(default_factory=dict)
    novel_tokens_by_work: dict[str, int] = field(default_factory=dict)
    recomputed_tokens: int = 0
    kept_for_background: int = 0
    slot_copies: int = 0
    slot_copied_tokens: int = 0
