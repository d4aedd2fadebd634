"""The decode loop: every generating session decoded together, one row per slot."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from convo.errors import ConfigError, DeviceOutOfMemory
from convo.fast.decoder import StaticDecoder, _empty_cuda_cache


@dataclass(eq=False, kw_only=True)
class DecodeRequest:
    """One generation handed to :class:`DecodeScheduler` (model token ids in and out).

    Args:
        ids: the prompt, as model token ids.
        max_new_tokens: cap on the reply.
        deadline: ``time.monotonic()`` value at which generation stops (finish ``timeout``).
        sampling: an object with ``temperature``, ``top_p``, ``top_k``,
            ``repetition_penalty``, ``seed`` and ``min_new_tokens`` (:class:`~convo.engine.Sampling`).
        eos: token ids that end the reply (finish ``stop``).
        cache_key: the session whose slot (and cached tokens) to use.
        on_token: called with each new token id; returning True stops (a stop string).
        cancel: set to stop early (finish ``cancelled``).
    """

    ids: list[int]
    max_new_tokens: int
    deadline: float
    sampling: Any
    eos: frozenset[int] = frozenset()
    cache_key: str | None = None
    on_token: Callable[[int], bool] | None = None
    cancel: threading.Event | None = None
    # Filled in by the scheduler.
    new_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    kv_tokens: int = 0
    slot: int = -1
    started_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished_at: float | None = None
    finish: str | None = None  # "stop", "length", "timeout", "cancelled"
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    _generator: Any = None

    @property
    def position(self) -> int:
        """Where the last sampled token goes in the slot."""
        return len(self.ids) + len(self.new_ids) - 1


class DecodeScheduler:
    """Decodes every generating session together, one row per slot.

    A background thread admits waiting requests in arrival order as slots free up (a
    request whose deadline passes while it waits finishes with ``timeout``), prefills
    each newcomer into its slot, then runs one batched step for all rows at a time,
    sampling per row and finishing rows as they stop.

    Args:
        decoder: the :class:`StaticDecoder` (warmed up).
    """

    def __init__(self, decoder: StaticDecoder) -> None:
        self.decoder = decoder
        self._pending: list[DecodeRequest] = []
        self._active: list[DecodeRequest] = []
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        #: Steps run, and rows decoded in them (rows / steps = mean batch).
        self.steps = 0
        self.rows = 0

    def submit(self, request: DecodeRequest) -> DecodeRequest:
        """Queue ``request``; wait on ``request.done``."""
        with self._cv:
            if self._closed:
                raise ConfigError("the decode scheduler is closed")
            self._pending.append(request)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="convo-decode", daemon=True)
                self._thread.start()
            self._cv.notify()
        return request

    def run(self, request: DecodeRequest) -> DecodeRequest:
        """Submit and wait until done; re-raises the scheduler's error for this request."""
        self.submit(request).done.wait()
        if request.error is not None:
            raise request.error
        return request

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()

    # -- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._active and not self._closed:
                    self._cv.wait()
                if self._closed and not self._pending and not self._active:
                    self._thread = None
                    return
            try:
                self._admit()
                if self._active:
                    self._step()
            except BaseException as exc:  # a device error ends every row in flight
                self._fail_active(exc)

    def _finish(self, req: DecodeRequest, reason: str | None, error: BaseException | None = None) -> None:
        req.finish, req.error = reason, error
        req.finished_at = time.monotonic()
        if req.slot >= 0:
            kept = (req.ids + req.new_ids)[: req.kv_tokens] if error is None else []
            self.decoder.pool.release(req.slot, kept)
        req.done.set()

    def _fail_active(self, exc: BaseException) -> None:
        error = _device_error(exc)
        for req in self._active:
            req.kv_tokens = 0
            self._finish(req, None, error)
        self._active = []
        _empty_cuda_cache()

    def _admit(self) -> None:
        while True:
            with self._cv:
                if not self._pending:
                    return
                req = self._pending[0]
                now = time.monotonic()
                stop = "cancelled" if req.cancel is not None and req.cancel.is_set() else None
                stop = stop or ("timeout" if now >= req.deadline else None)
                got = None
                if stop is None:
                    got = self.decoder.pool.acquire(req.cache_key)
                    if got is None:
                        return  # every slot is generating: wait for a row to finish
                self._pending.pop(0)
            if stop is not None or got is None:
                self._finish(req, stop)
                continue
            req.slot, kept = got
            try:
                self._prefill(req, kept)
            except BaseException as exc:
                req.kv_tokens = 0
                self._finish(req, None, _device_error(exc))
                _empty_cuda_cache()

    def _prefill(self, req: DecodeRequest, kept: list[int]) -> None:
        limit = min(len(kept), len(req.ids) - 1)
        common = 0
        while common < limit and kept[common] == req.ids[common]:
            common += 1
        req.cached_tokens = common
        logits, done = self.decoder.prefill(
            req.slot, req.ids, common, deadline=req.deadline, cancel=req.cancel
        )
        req.kv_tokens = done
        if logits is None:
            self._finish(req, "cancelled" if req.cancel is not None and req.cancel.is_set() else "timeout")
            return
        if req.sampling.seed is not None:
            import torch

            req._generator = torch.Generator(device=logits.device).manual_seed(req.sampling.seed)
        token = _sample(logits[None], [req])[0]
        req.first_token_at = time.monotonic()
        if not self._accept(req, token):
            self._active.append(req)

    def _accept(self, req: DecodeRequest, token: int) -> bool:
        """Record ``token`` for ``req``; True when the request finished."""
        req.new_ids.append(token)
        stop_string = req.on_token(token) if req.on_token is not None else False
        if token in req.eos or stop_string:
            reason: str | None = "stop"
        elif len(req.new_ids) >= req.max_new_tokens:
            reason = "length"
        elif req.cancel is not None and req.cancel.is_set():
            reason = "cancelled"
        elif time.monotonic() >= req.deadline:
            reason = "timeout"
        else:
            return False
        self._finish(req, reason)
        return True

    def _step(self) -> None:
        rows = self._active
        logits = self.decoder.step(
            [r.new_ids[-1] for r in rows], [r.slot for r in rows], [r.position for r in rows]
        )
        for r in rows:
            r.kv_tokens = r.position + 1
        tokens = _sample(logits, rows)
        self.steps += 1
        self.rows += len(rows)
        self._active = [r for r, t in zip(rows, tokens, strict=True) if not self._accept(r, t)]


def _sample(logits: Any, rows: Sequence[DecodeRequest]) -> list[int]:
    """Next token per row: greedy rows by one argmax, the others with their own settings."""
    import torch

    out = logits.argmax(dim=-1)
    special = [
        i
        for i, r in enumerate(rows)
        if r.sampling.temperature > 0
        or r.sampling.repetition_penalty != 1.0
        or len(r.new_ids) < r.sampling.min_new_tokens
    ]
    if not special:
        return [int(t) for t in out.tolist()]
    result = out.tolist()
    for i in special:
        r, s = rows[i], rows[i].sampling
        row = logits[i].clone()
        if s.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.ids) | set(r.new_ids)), device=row.device)
            seen = seen[seen < row.shape[0]]
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / s.repetition_penalty, vals * s.repetition_penalty)
        if len(r.new_ids) < s.min_new_tokens and r.eos:
            eos = torch.tensor(sorted(r.eos), device=row.device)
            row[eos[eos < row.shape[0]]] = float("-inf")
        if s.temperature == 0:
            result[i] = int(row.argmax())
            continue
        row = row / s.temperature
        if s.top_k:
            kth = torch.topk(row, min(s.top_k, row.shape[0])).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if s.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
            drop = cum - torch.softmax(sorted_logits, dim=-1) > s.top_p
            row[order[drop]] = float("-inf")
        probs = torch.softmax(row, dim=-1)
        result[i] = int(torch.multinomial(probs, 1, generator=r._generator))
    return [int(t) for t in result]


def _device_error(exc: BaseException) -> BaseException:
    if type(exc).__name__ == "OutOfMemoryError" or isinstance(exc, MemoryError):
        return DeviceOutOfMemory(f"out of memory in the decode loop: {exc}")
    return exc
