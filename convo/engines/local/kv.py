"""The two KV-cache backends of :class:`~convo.engines.local.engine.TransformersEngine`.

Both implement :class:`~convo.engines.base.KVBackend`; the engine picks one at load:

* :class:`DynamicKV` — a transformers ``DynamicCache`` per session, grown as needed and run
  through ``model.generate`` one call at a time. Between turns the cache is kept (LRU, up
  to ``max_cached_sessions``), the next turn reuses its longest common token prefix
  (:func:`convo.tokens.common_prefix_length`) and the cache is cropped where the prompt
  diverged; a background sweeper drops caches idle longer than ``cache_idle_s``.
* :class:`SlotKV` — the static KV slots of :mod:`convo.fast`: memory taken once at load,
  sessions decoded together by the continuous-batching
  :class:`~convo.fast.scheduler.DecodeScheduler`; the slots keep the sessions' tokens, and
  a session whose slot is given away keeps its KV in host memory (``host_memory``). A call
  with ``owner`` (a summary) runs from its session's own slot; :meth:`SlotKV.prefill`
  computes a session's next prompt prefix in the background.

``DynamicKV`` runs a call with ``owner`` as a one-off that keeps nothing: it never evicts
another session's cache for it (calls run one at a time there), from a copy of its session's
cached prefix. Its :meth:`DynamicKV.prefill` computes a session's next prompt prefix in a
background thread, a chunk at a time between calls (a call waiting for the model goes
first).

Nothing here imports torch at import time.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import inspect
import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from convo.engines.base import KVCall, KVRun
from convo.engines.local.replytext import IncrementalDecoder, StopMatcher
from convo.errors import DeviceOutOfMemory, is_out_of_memory
from convo.fast.scheduler import DecodeRequest, DecodeScheduler
from convo.models.device import empty_device_cache
from convo.models.generation import GREEDY, FinishReason, Priority
from convo.tokens import common_prefix_length

logger = logging.getLogger(__name__)

#: Seconds a background prefill (:meth:`DynamicKV.prefill`) sleeps while a call waits for
#: the model, before it looks again.
PREFILL_YIELD_S = 0.005
#: Seconds :meth:`DynamicKV.close` (and the process's exit) waits for a background prefill
#: to finish its current chunk.
PREFILL_EXIT_WAIT_S = 10.0


def _join_at_exit(backend: weakref.ref[DynamicKV]) -> None:
    alive = backend()
    if alive is not None:
        alive._join_prefills()


#: Ids of the model's vocabulary for ids of the tokenizer (identity but for random models).
ModelIds = Callable[[Sequence[int]], list[int]]


class _Streamer:
    """Receives a reply's tokens (from ``generate`` or the scheduler), decodes them
    incrementally when someone needs the text, watches for stop strings and notes the
    first token.

    ``on_text`` gets the text piece by piece, never past a stop string: with stop strings,
    the last ``longest stop - 1`` characters are held back until they cannot start one.
    Everything costs O(reply), whatever the stop strings (:mod:`.replytext`).
    """

    def __init__(
        self,
        tokenizer: Any,
        on_text: Callable[[str], None] | None,
        *,
        stops: Sequence[str] = (),
        keep_special: Sequence[int] | None = None,
    ) -> None:
        self.on_text = on_text
        self.ids: list[int] = []
        self.first_token_at: float | None = None
        self._decoder = (
            IncrementalDecoder(tokenizer, keep_special=keep_special) if on_text is not None or stops else None
        )
        self._stops = StopMatcher(stops)
        self._hold = max((len(s) for s in self._stops.stops), default=1) - 1
        self._prompt_seen = False
        self._pending = ""  # decoded, not passed to on_text yet
        self._sent = 0  # characters passed to on_text

    @property
    def stopped(self) -> bool:
        """A stop string has appeared in the reply."""
        return self._stops.found is not None

    def put(self, value: Any) -> None:
        if not self._prompt_seen:  # generate pushes the prompt first
            self._prompt_seen = True
            return
        self.add(int(t) for t in value.reshape(-1).tolist())

    def add(self, ids: Iterable[int]) -> None:
        """New token ids of the reply."""
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        new = list(ids)
        self.ids.extend(new)
        if self._decoder is not None and not self.stopped:
            self._text(self._decoder.add(new), final=False)

    def _text(self, piece: str, *, final: bool) -> None:
        if piece:
            self._stops.feed(piece)
            self._pending += piece
        if self.on_text is None:
            self._pending = ""
            return
        found = self._stops.found
        if found is not None:
            ready = max(found - self._sent, 0)
        else:
            ready = len(self._pending) if final else len(self._pending) - self._hold
        if ready > 0:
            self.on_text(self._pending[:ready])
            self._sent += ready
            self._pending = self._pending[ready:]
        if found is not None:
            self._pending = ""

    def end(self) -> None:
        if self._decoder is not None and not self.stopped:
            self._text(self._decoder.flush(), final=True)


class _StopSeen:
    """A stopping criterion for ``generate``: the reply holds a stop string (watched by the
    :class:`_Streamer`, so transformers' own ``stop_strings``, whose tables grow with the
    strings' length times the vocabulary, are never built)."""

    def __init__(self, streamer: _Streamer) -> None:
        self.streamer = streamer

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        stopped = self.streamer.stopped
        return torch.full((input_ids.shape[0],), stopped, dtype=torch.bool, device=input_ids.device)


# -- a growing cache per session ---------------------------------------------------------------------


@dataclass
class _CacheEntry:
    token_ids: list[int]
    cache: Any
    last_used: float = field(default_factory=time.monotonic)


class _Deadline:
    """A stopping criterion that ends generation at a wall-clock deadline or on cancel."""

    def __init__(self, deadline: float, cancel: threading.Event | None) -> None:
        self.deadline = deadline
        self.cancel = cancel
        self.hit = False
        self.cancelled = False

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        if self.cancel is not None and self.cancel.is_set():
            self.cancelled = True
        elif time.monotonic() >= self.deadline:
            self.hit = True
        done = self.hit or self.cancelled
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


def _crop_cache(cache: Any, keep: int) -> None:
    remove = cache.get_seq_length() - keep
    if remove > 0:
        cache.crop(-remove)  # a negative count removes tokens in every transformers 4.4x/5.x


def _cache_nbytes(cache: Any) -> int:
    total = 0
    for layer in getattr(cache, "layers", ()):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None and hasattr(t, "numel"):
                total += t.numel() * t.element_size()
    return total


class DynamicKV:
    """A transformers ``DynamicCache`` per session, run through ``model.generate``.

    One call at a time (a lock). The prompt is prefilled in chunks of
    ``prefill_chunk_tokens`` with the clock checked between chunks; only the tokens after
    the longest common prefix with the session's kept cache are prefilled.

    Args:
        model, tokenizer: the loaded model and its tokenizer.
        model_ids: maps tokenizer ids to model ids.
        eos: end-of-turn token ids.
        prefill_chunk_tokens: tokens per prefill chunk.
        max_cached_sessions: caches kept between turns (LRU); 0 keeps none.
        cache_idle_s: a kept cache is dropped after this long unused.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_ids: ModelIds,
        eos: Sequence[int],
        prefill_chunk_tokens: int,
        max_cached_sessions: int,
        cache_idle_s: float,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        # transformers renamed ``past_key_values`` to ``cache`` (5.2x); speak whichever it knows.
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.model_ids = model_ids
        self.eos = list(eos)
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.max_cached_sessions = max_cached_sessions
        self.cache_idle_s = cache_idle_s
        self._lock = threading.RLock()
        self._caches: OrderedDict[str, _CacheEntry] = OrderedDict()
        self._sweeper: threading.Thread | None = None
        self._closing = threading.Event()
        #: Calls waiting for the model (a background prefill lets them go first).
        self._calls_waiting = 0
        self._waiting_lock = threading.Lock()
        self._prefill_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
        self._exit_hook = False  # (registered once, with the first prefill)
        #: Background prefills run to their end, and the prompt tokens they computed.
        self.prefills = 0
        self.prefilled_tokens = 0

    #: :meth:`prefill` computes a session's next prompt prefix in a background thread.
    supports_prefill = True

    def prefill(self, ids: Sequence[int], *, cache_key: str, timeout_s: float) -> threading.Thread | None:
        """Compute the KV of ``ids`` (tokenizer ids: a session's next prompt prefix) into
        ``cache_key``'s kept cache in a background thread, ``prefill_chunk_tokens`` at a
        time, each chunk under the model's lock: a call waiting for the model goes before
        the next chunk, and once another call changed the session's cache (its turn came)
        the prefill stops, that call having taken what was computed. Returns the thread
        (``None``: nothing to do, caches are off or the backend is closing)."""
        if self.max_cached_sessions <= 0 or self._closing.is_set() or not ids:
            return None
        # What the session's cache holds now (read without waiting for the model: entries
        # are replaced whole): a call that changes it before the prefill ends it.
        entry = self._caches.get(cache_key)
        held = list(entry.token_ids) if entry is not None else None
        thread = threading.Thread(
            target=self._prefill_logged,
            args=(list(ids), cache_key, held, time.monotonic() + timeout_s),
            name="convo-kv-prefill",
            daemon=True,
        )
        if not self._exit_hook:  # (the first: at exit, stop them before Python finalizes)
            self._exit_hook = True
            atexit.register(_join_at_exit, weakref.ref(self))
        self._prefill_threads.add(thread)
        thread.start()
        return thread

    def _prefill_logged(self, ids: list[int], key: str, held: list[int] | None, deadline: float) -> None:
        try:
            self._prefill(ids, key, held, deadline)
        except Exception:  # (a failed prefill only costs the next turn its reuse)
            logger.exception("prefilling the next prompt of session %r failed", key)

    def _prefill(self, ids: list[int], key: str, expected: list[int] | None, deadline: float) -> None:
        import torch
        from transformers import DynamicCache

        while time.monotonic() < deadline and not self._closing.is_set():
            if self._calls_waiting:  # calls first: a chunk waits for the model to be free
                time.sleep(PREFILL_YIELD_S)
                continue
            with self._lock:
                entry = self._caches.get(key)
                if (list(entry.token_ids) if entry is not None else None) != expected:
                    return  # a call of the session changed its cache: it has what it needs
                if entry is None:
                    entry = _CacheEntry(token_ids=[], cache=DynamicCache(config=self.model.config))
                pos = common_prefix_length(entry.token_ids, ids, min(len(ids), entry.cache.get_seq_length()))
                if pos >= len(ids):
                    return
                _crop_cache(entry.cache, pos)
                end = min(pos + self.prefill_chunk_tokens, len(ids))
                device = self.model.device
                with torch.inference_mode():
                    self.model(
                        input_ids=torch.tensor([self.model_ids(ids[pos:end])], device=device),
                        **{self.cache_kw: entry.cache},
                        use_cache=True,
                        cache_position=torch.arange(pos, end, device=device),
                        logits_to_keep=1,
                    )
                expected = ids[:end]
                self._caches[key] = _CacheEntry(token_ids=list(expected), cache=entry.cache)
                self._caches.move_to_end(key)
                self.prefilled_tokens += end - pos
                if end == len(ids):
                    self.prefills += 1
                    self._expire()
                    return

    @property
    def cached_sessions(self) -> list[str]:
        with self._lock:
            return list(self._caches)

    def release(self, cache_key: str) -> None:
        with self._lock:
            self._caches.pop(cache_key, None)

    def release_all(self) -> None:
        with self._lock:
            self._caches.clear()
            empty_device_cache()

    def close(self) -> None:
        self._closing.set()
        sweeper = self._sweeper
        if sweeper is not None and sweeper is not threading.current_thread():
            sweeper.join()
        self._join_prefills()
        with self._lock:
            self._caches.clear()

    def _join_prefills(self, timeout_s: float = PREFILL_EXIT_WAIT_S) -> None:
        """Stop the background prefills after their current chunk and wait for them (a
        thread still in the model's native code when Python finalizes aborts it)."""
        self._closing.set()
        deadline = time.monotonic() + timeout_s
        for thread in list(self._prefill_threads):
            if thread is not threading.current_thread():
                thread.join(max(deadline - time.monotonic(), 0.0))

    def _sweep(self) -> None:
        """Background sweeper: drop KV caches idle longer than ``cache_idle_s``."""
        while True:
            if self._closing.wait(min(self.cache_idle_s, 60.0)):
                with self._lock:
                    self._sweeper = None
                return
            with self._lock:
                self._expire()
                if not self._caches:
                    self._sweeper = None
                    return

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, e in self._caches.items() if now - e.last_used > self.cache_idle_s]:
            del self._caches[key]
            logger.info("evicted the KV cache of session %r (idle over %.0f s)", key, self.cache_idle_s)
        while len(self._caches) > self.max_cached_sessions:
            key, _ = self._caches.popitem(last=False)
            logger.info("evicted the KV cache of session %r (over %d cached)", key, self.max_cached_sessions)

    @contextlib.contextmanager
    def _call(self) -> Iterator[None]:
        """Hold the model for a call; while the call waits for it, a background prefill
        runs no further chunk."""
        with self._waiting_lock:
            self._calls_waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._waiting_lock:
                self._calls_waiting -= 1
        try:
            yield
        finally:
            self._lock.release()

    def generate(self, call: KVCall) -> KVRun:
        with self._call():
            try:
                return self._generate(call)
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                message = f"out of memory during generate ({len(call.ids)} prompt tokens): {exc}"
            # Outside the except block the traceback, whose frames still hold the partly
            # filled KV cache, is gone: now the memory can really be given back.
            if call.cache_key is not None:
                self._caches.pop(call.cache_key, None)
            gc.collect()
            empty_device_cache()
        logger.warning("%s; freed the session's KV cache and the allocator's cached blocks", message)
        raise DeviceOutOfMemory(message)

    def _owner_copy(self, owner: str, ids: Sequence[int]) -> _CacheEntry | None:
        """A copy of ``owner``'s kept cache, cropped to what it shares with ``ids`` (``None``:
        nothing kept, or nothing shared)."""
        import copy

        kept = self._caches.get(owner)
        if kept is None:
            return None
        shared = common_prefix_length(kept.token_ids, ids, min(len(ids) - 1, kept.cache.get_seq_length()))
        if shared == 0:
            return None
        cache = copy.deepcopy(kept.cache)
        _crop_cache(cache, shared)
        return _CacheEntry(token_ids=list(kept.token_ids[:shared]), cache=cache)

    def _generate(self, call: KVCall) -> KVRun:
        import torch
        from transformers import DynamicCache, StoppingCriteriaList

        ids, cache_key, cancel = list(call.ids), call.cache_key, call.cancel
        start = time.monotonic()
        deadline = start + call.timeout_s
        device = self.model.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self._expire()

        # Reuse the longest common token prefix of the session's previous turn. A call done
        # for another session (``owner``: its summary) starts from a copy of that session's
        # cache, which stays as it was, and keeps nothing.
        if call.owner is not None:
            cache_key = None
            entry = self._owner_copy(call.owner, ids)
        else:
            entry = self._caches.pop(cache_key, None) if cache_key is not None else None
        cached = 0
        if entry is not None:
            cached = common_prefix_length(
                entry.token_ids, ids, min(len(ids) - 1, entry.cache.get_seq_length())
            )
            if cached == 0:
                entry = None
            else:
                _crop_cache(entry.cache, cached)
        cache = entry.cache if entry is not None else DynamicCache(config=self.model.config)

        # Chunked prefill of all but the last prompt token, checking the clock in between.
        timed_out = False
        pos = cached
        with torch.inference_mode():
            while pos < len(ids) - 1:
                end = min(pos + self.prefill_chunk_tokens, len(ids) - 1)
                chunk = torch.tensor([self.model_ids(ids[pos:end])], device=device)
                self.model(
                    input_ids=chunk,
                    **{self.cache_kw: cache},
                    use_cache=True,
                    cache_position=torch.arange(pos, end, device=device),
                    logits_to_keep=1,
                )
                pos = end
                if time.monotonic() >= deadline or (cancel is not None and cancel.is_set()):
                    timed_out = time.monotonic() >= deadline
                    break

            streamer = _Streamer(
                self.tokenizer,
                call.on_text,
                stops=call.stop,
                keep_special=self.eos if call.keep_special_tokens else None,
            )
            criterion = _Deadline(deadline, cancel)
            new_ids: list[int] = []
            if pos >= len(ids) - 1 and not timed_out and not (cancel is not None and cancel.is_set()):
                # A seed is this request's own: the global generator is put back afterwards,
                # so one client's seed never changes another's samples (calls hold _lock).
                seeded = call.sampling.seed is not None and call.sampling.temperature > 0
                cuda = [device] if device.type == "cuda" else []
                with torch.random.fork_rng(devices=cuda, enabled=seeded):
                    if seeded:
                        torch.manual_seed(call.sampling.seed)
                    input_ids = torch.tensor([self.model_ids(ids)], device=device)
                    out = self.model.generate(
                        input_ids=input_ids,
                        attention_mask=torch.ones_like(input_ids),
                        **{self.cache_kw: cache},
                        max_new_tokens=call.max_new_tokens,
                        max_time=max(deadline - time.monotonic(), 0.001),
                        stopping_criteria=StoppingCriteriaList([criterion, _StopSeen(streamer)]),
                        eos_token_id=self.eos,
                        pad_token_id=self.tokenizer.pad_token_id or self.eos[0],
                        streamer=streamer,
                        **call.sampling.generate_kwargs(),
                    )
                new_ids = out[0, len(ids) :].tolist()
            timed_out = timed_out or criterion.hit or time.monotonic() >= deadline
        end_time = time.monotonic()
        cancelled = criterion.cancelled or (cancel is not None and cancel.is_set() and not timed_out)

        # Keep the cache for the next turn: it holds the prompt and all but the last token.
        kv_tokens = cache.get_seq_length()
        kv_bytes = _cache_nbytes(cache)
        if cache_key is not None and self.max_cached_sessions > 0 and kv_tokens > 0:
            self._caches[cache_key] = _CacheEntry(token_ids=(ids + new_ids)[:kv_tokens], cache=cache)
            self._expire()
            if self._sweeper is None and not self._closing.is_set():  # idle caches go even if no call comes
                self._sweeper = threading.Thread(target=self._sweep, name="convo-kv-sweeper", daemon=True)
                self._sweeper.start()
        return KVRun(
            new_ids=new_ids,
            cached_tokens=cached,
            kv_tokens=kv_tokens,
            kv_bytes=kv_bytes,
            start=start,
            first_token_at=streamer.first_token_at,
            end=end_time,
            cancelled=cancelled,
            timed_out=timed_out,
            device=device,
        )


# -- static slots -----------------------------------------------------------------------------------


class SlotKV:
    """The static KV slots of :mod:`convo.fast`: a call is queued for a slot and decoded in
    batch with the other generating sessions by a
    :class:`~convo.fast.scheduler.DecodeScheduler`.

    Args:
        decoder: the :class:`~convo.fast.decoder.StaticDecoder` (its pool holds the slots),
            warmed up.
        tokenizer: decodes the reply as it comes (streaming, stop strings).
        model_ids: maps tokenizer ids to model ids.
        eos: end-of-turn token ids.
        step_tokens: the token budget of one scheduler step.
        interleave_tokens: the prefill chunk of a step while replies stream.
        host_memory: bytes of host memory for the KV of sessions that lost their slot
            (:meth:`~convo.fast.kv_pool.KVSlotPool.set_host_memory`); 0: it is dropped.
        context_shift: move a session's kept turns after a slide instead of prefilling them
            (:mod:`convo.fast.kv_shift`; not exact). Default False.
    """

    #: :meth:`prefill` computes a session's next prompt prefix in the background.
    supports_prefill = True

    def __init__(
        self,
        decoder: Any,
        tokenizer: Any,
        *,
        model_ids: ModelIds,
        eos: Sequence[int],
        step_tokens: int,
        interleave_tokens: int,
        host_memory: int = 0,
        context_shift: bool = False,
    ) -> None:
        self.decoder = decoder
        decoder.pool.set_host_memory(host_memory)
        self.tokenizer = tokenizer
        self.model_ids = model_ids
        self.eos = frozenset(eos)
        self.scheduler = DecodeScheduler(
            decoder, step_tokens=step_tokens, interleave_tokens=interleave_tokens, context_shift=context_shift
        )

    @property
    def cached_sessions(self) -> list[str]:
        return list(self.decoder.pool.owners())

    def release(self, cache_key: str) -> None:
        self.scheduler.forget(cache_key)

    def release_all(self) -> None:
        """Forget every slot's tokens (the slots stay allocated: they are taken once, at load)."""
        for key in self.decoder.pool.owners():
            self.decoder.pool.forget(key)
        empty_device_cache()

    def close(self) -> None:
        self.scheduler.close()

    def prefill(self, ids: Sequence[int], *, cache_key: str, timeout_s: float) -> DecodeRequest:
        """Queue the computation of ``ids``' KV (tokenizer ids: a session's next prompt
        prefix) for ``cache_key`` at background priority, in the session's own or an empty
        slot; returns the queued request at once (its ``done`` is set when it is over)."""
        request = DecodeRequest(
            ids=self.model_ids(ids),
            max_new_tokens=1,
            deadline=time.monotonic() + timeout_s,
            sampling=GREEDY,
            cache_key=cache_key,
            priority=Priority.BACKGROUND,
            prefill_only=True,
        )
        return self.scheduler.submit(request)

    def generate(self, call: KVCall) -> KVRun:
        start = time.monotonic()
        streamer = _Streamer(
            self.tokenizer,
            call.on_text,
            stops=call.stop,
            keep_special=self.eos if call.keep_special_tokens else None,
        )

        def on_token(token: int) -> bool:  # True: a stop string appeared
            streamer.add([token])
            return streamer.stopped

        request = DecodeRequest(
            ids=self.model_ids(call.ids),
            max_new_tokens=call.max_new_tokens,
            deadline=start + call.timeout_s,
            sampling=call.sampling,
            eos=self.eos,
            cache_key=call.cache_key,
            on_token=on_token,
            cancel=call.cancel,
            owner=call.owner,
        )
        if call.priority is not None:  # else the request's default: a reply's
            request.priority = call.priority
        self.scheduler.run(request)  # DeviceOutOfMemory propagates
        streamer.end()
        pool = self.decoder.pool
        per_token = pool.slot_nbytes // pool.slot_tokens
        return KVRun(
            new_ids=request.new_ids,
            cached_tokens=request.cached_tokens,
            kv_tokens=request.kv_tokens,
            kv_bytes=request.kv_tokens * per_token,
            kv_slot_bytes=pool.slot_nbytes,
            start=start,
            first_token_at=request.first_token_at,
            end=request.finished_at or time.monotonic(),
            cancelled=request.finish is FinishReason.CANCELLED,
            timed_out=request.finish is FinishReason.TIMEOUT,
            device=self.decoder.device,
        )
