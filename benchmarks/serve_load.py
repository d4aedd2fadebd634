"""Load benchmark: flood ``convo serve`` on loopback beyond its capacity.

It starts its own server process (127.0.0.1 only) with small admission limits, then runs
``--sessions`` concurrent conversations of ``--turns`` turns each, with mixed message
lengths (short / medium / long) and a mix of streaming and plain requests, through
httpx's async client. It checks and reports:

* admitted requests complete (200), the rest are refused quickly (429 + Retry-After, or
  503 after the queue timeout) and nothing else happens;
* no session loses a message: ``GET /v1/sessions/{id}`` afterwards holds, in order, the
  user message and the reply of every turn that got a 200, and nothing of refused turns;
* the admission ledger (``/metrics``, sampled every 0.1 s) never exceeds its budget; the
  server process RSS (idle, peak) is sampled with psutil;
* requests/s, p50/p95 latency, time to first token (streaming), refusal latency.

Prints one JSON object (hardware, versions, config, results) and writes
``serve_load_<engine>.json`` and ``serve_load_<engine>.png`` (latency timeline and
histogram) under ``--out``.

GPU chat load (issue 11): ``--preset gpu-chat`` with ``--model``, ``--quant``, ``--kv-slots``
runs the local engine on CUDA: 16 sessions x 8 turns, ~300-token user turns, ``max_tokens``
32, budget 2,048, every turn streamed through the official ``openai`` client with
``X-Session-Id``. The JSON then adds ``reply_tokens_per_s``, ``ttft_p50_s`` / ``ttft_p95_s``,
``turn_latency_p50_s`` / ``turn_latency_p95_s``, the turn latency per turn index, the decode
step's 16-row tok/s measured in the server process before the load, ``engine`` (the
scheduler's steps and busy seconds by kind during the load, from ``convo_engine_*`` on
``/metrics``: a busy share near 1 means the device is the bottleneck), and
(``--baseline-kv-slots-0``) the same load with ``--kv-slots 0`` side by side under
``baseline_kv_slots_0``::

    python benchmarks/serve_load.py --preset gpu-chat --model random:llama-2-7b --quant int4 \
        --kv-slots 16 --baseline-kv-slots-0 --baseline-quant nf4 --out benchmarks/results

``--think-s S`` makes each session pause about ``S`` seconds between its turns (a person
reading and typing); the default 0 sends the next turn as soon as the reply ends.
``--think-min-s A --think-max-s B`` pauses uniformly between A and B seconds instead, and
``--start-spread-s T`` starts each session's first turn at a uniform moment in the first T
seconds. ``--waves N`` runs the load N times back to back on the same server, each time
with new sessions (is the next wave as fast as the first?).

KV reuse under a real chat load (issue 22): ``--preset chat-users`` is 64 users on 16 KV
slots, think time uniform 3-8 s, starts spread over 10 s, 6 turns of ~300 tokens,
``max_tokens`` 32, streamed through the official ``openai`` client with ``X-Session-Id``,
on a server of budget 2,048 and ``--max-new-tokens 64`` (``random:llama-2-7b`` int4 unless
``--model`` / ``--quant`` say otherwise); ``--preset think-16`` is 16 users on 16 slots,
12 turns, 2 s think. The JSON adds ``prefilled_prompt_tokens`` (the engine's
``convo_engine_prompt_tokens_total`` over the load), ``requested_prompt_tokens`` (the sum
of the requests' ``usage.prompt_tokens``) and their ratio ``reprefill`` (1.0: nothing was
reused), ``novel_prompt_tokens`` (``convo_engine_novel_prompt_tokens_total`` over the load:
what an unbounded exact KV cache would still prefill, the tokens past each prompt's common
prefix with what its session's KV last held, summaries' prompts included) and
``reprefill_floor`` (it over ``requested_prompt_tokens``; ``None`` for a server without the
counter; ``reprefill - reprefill_floor`` is what evictions cost), ``preemptions``,
``swaps_in`` / ``swaps_out`` and ``host_kv_bytes_peak`` (0 for an engine that does not
export them), ``summary_lag_p50_s`` / ``summary_lag_p95_s`` (from
``convo_summary_lag_seconds``), ``summary_backlog_peak`` and ``ttft_p50_s_by_turn``; with
``--waves`` also ``waves`` (each wave's figures, these included) and ``wave2_over_wave1``
(wall, TTFT p50)::

    python benchmarks/serve_load.py --preset chat-users --out benchmarks/results
    python benchmarks/serve_load.py --preset think-16 --out benchmarks/results
    python benchmarks/serve_load.py --preset gpu-chat --model random:llama-2-7b --quant int4 \
        --kv-slots 16 --waves 2 --out benchmarks/results

Fake engine (seconds):   python benchmarks/serve_load.py --fake --out /tmp/bench
    python benchmarks/serve_load.py --fake --preset chat-users --sessions 8 --turns 3 \
        --think-min-s 0.1 --think-max-s 0.3 --start-spread-s 0.5 --waves 2 --out /tmp/bench
Real default model, small (CPU, ~1-2 min):
    python benchmarks/serve_load.py --sessions 6 --turns 2 --max-new-tokens 16 \
        --budget 512 --max-concurrency 2 --max-queue 2 --out /tmp/bench
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from convo.cli.common import kv_host_memory_size
from convo.testing import wait_until_serving

WORDS = (
    "the tide came in slowly over the harbour while we argued about the budget for the "
    "new boat and whether the engine would survive another winter on the north coast"
).split()
LENGTHS = {"short": 6, "medium": 80, "long": 400}  # words per user message
#: Words of a ``--preset gpu-chat`` user turn (~300 tokens with the default tokenizer).
CHAT_WORDS = 270
#: The issue-11 GPU chat load.
PRESETS: dict[str, dict[str, Any]] = {
    "gpu-chat": {
        "sessions": 16,
        "turns": 8,
        "max_new_tokens": 32,
        "budget": 2048,
        "stream_fraction": 1.0,
        "client": "openai",
        "message_words": CHAT_WORDS,
        "max_concurrency": 16,
        "max_queue": 64,
        "admission_tokens": 65536,
        "queue_timeout_s": 120.0,
    },
    # Issue 22: more users than KV slots, people pausing between turns.
    "chat-users": {
        "sessions": 64,
        "turns": 6,
        "max_new_tokens": 64,
        "max_tokens": 32,
        "budget": 2048,
        "stream_fraction": 1.0,
        "client": "openai",
        "message_words": CHAT_WORDS,
        "think_min_s": 3.0,
        "think_max_s": 8.0,
        "start_spread_s": 10.0,
        "model": "random:llama-2-7b",
        "quant": "int4",
        "kv_slots": 16,
        "max_concurrency": 16,
        "max_queue": 64,
        "admission_tokens": 65536,
        "queue_timeout_s": 120.0,
    },
    # Issue 22: as many users as slots, a short pause: do summaries take thinking sessions' slots?
    "think-16": {
        "sessions": 16,
        "turns": 12,
        "max_new_tokens": 64,
        "max_tokens": 32,
        "budget": 2048,
        "stream_fraction": 1.0,
        "client": "openai",
        "message_words": CHAT_WORDS,
        "think_min_s": 2.0,
        "think_max_s": 2.0,
        "model": "random:llama-2-7b",
        "quant": "int4",
        "kv_slots": 16,
        "max_concurrency": 16,
        "max_queue": 64,
        "admission_tokens": 65536,
        "queue_timeout_s": 120.0,
    },
}


@dataclass
class Outcome:
    session: str
    turn: int
    kind: str  # short / medium / long
    stream: bool
    status: int  # HTTP status; 0 = transport error
    start_s: float  # since the run began
    latency_s: float
    ttft_s: float | None
    user: str
    reply: str
    error: str = ""
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    plan_s: float | None = None  # the server's ``convo.plan_s``: the turn before its prompt
    first_shown: int | None = None  # the server's ``convo.first_shown_turn``: the window's start
    cached_tokens: int | None = None  # ``usage.prompt_tokens_details.cached_tokens``: KV reused

    @property
    def uncached_tokens(self) -> int | None:
        """Prompt tokens the turn prefilled: its prompt less the cached ones (``None``: unknown)."""
        if self.prompt_tokens is None or self.cached_tokens is None:
            return None
        return self.prompt_tokens - self.cached_tokens


def usage_cached(usage: dict[str, Any] | None) -> int | None:
    """``prompt_tokens_details.cached_tokens`` of a response's ``usage`` (``None``: absent)."""
    details = (usage or {}).get("prompt_tokens_details") or {}
    return details.get("cached_tokens")


# -- the server (child process) ---------------------------------------------------------------


def child(args: argparse.Namespace) -> None:
    """Run ``convo serve``'s app with the benchmark's limits (in the child process)."""
    import uvicorn

    from convo.budget import Budget
    from convo.server.app import create_app
    from convo.server.limits import ServerLimits
    from convo.stores import SQLiteStore
    from convo.testing import EchoEngine

    engine: Any
    if args.fake:
        engine, name = EchoEngine(delay_s=args.delay_s), "echo"
        engine.concurrent_calls = args.fake_concurrent_calls
    elif args.model or args.quant or args.kv_slots is not None:
        from convo.engines.local.config import KVConfig, LoadConfig
        from convo.engines.local.engine import TransformersEngine

        engine = TransformersEngine(
            args.model,
            quant=args.quant or "auto",
            load=LoadConfig(int4_dense_copy_bytes=args.int4_dense_copy),
            kv=KVConfig(
                kv_slots=args.kv_slots,
                slot_tokens=args.budget,
                kv_host_memory=args.kv_host_memory,
                context_shift=args.context_shift,
            ),
        )
        name = args.model or "default"
    else:
        from convo.engines.local.engine import TransformersEngine

        engine, name = TransformersEngine(), "smollm2-135m-instruct"
    if args.step_file:
        Path(args.step_file).write_text(json.dumps(decode_step_rate(engine)))
    if args.preset:  # a chat server's own budget: summaries on, as `convo serve` runs
        budget = Budget(context_tokens=args.budget, max_new_tokens=args.max_new_tokens)
    else:
        budget = Budget(
            context_tokens=args.budget, max_new_tokens=args.max_new_tokens, window_turns=4, summary_tokens=0
        )
    limits = ServerLimits(
        max_concurrency=args.max_concurrency,
        max_queue=args.max_queue,
        queue_timeout_s=args.queue_timeout_s,
        admission_tokens=args.admission_tokens,
    )
    store = SQLiteStore(args.db)
    memory = None
    if args.memory:  # as `convo serve` builds it (its --embedding-model, its cache)
        from convo.cli.serve import server_memory

        given = argparse.Namespace(
            no_memory=False,
            memory_cache_mb=None,
            embedding_model=args.embedding_model,
            embedding_device=args.embedding_device,
            embedding_process=not args.embedding_in_process,
        )
        memory = server_memory(given, store)
        if memory is None:
            raise SystemExit("--memory: no embedding model could load (see the log line above)")
    app = create_app(engine, store=store, budget=budget, limits=limits, model_name=name, memory=memory)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


def decode_step_rate(engine: Any, rows: int = 16, prompt: int = 300, new: int = 64) -> dict[str, Any]:
    """The decode step's tok/s at ``rows`` rows, through the engine's own scheduler (in the
    server process, before the load); ``{}`` without static decode."""
    decoder = getattr(engine, "decoder", None)
    sched = getattr(getattr(engine, "kv_backend", None), "scheduler", None)  # SlotKV's
    if decoder is None or sched is None:
        return {}
    import torch
    from _common import decode_round  # benchmarks/

    from convo.fast import DecodeRequest
    from convo.models import GREEDY

    rows = min(rows, decoder.pool.slots)
    vocab = decoder.vocab_size

    def round_(n: int, seed: int) -> tuple[float, int]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(100, vocab - 1, (rows, prompt), generator=g).tolist()
        reqs = [
            DecodeRequest(ids=i, max_new_tokens=n, deadline=time.monotonic() + 300, sampling=GREEDY)
            for i in ids
        ]
        return decode_round(sched, reqs)

    round_(8, 1)
    elapsed, tokens = sorted(round_(new, 2 + i) for i in range(3))[1]
    for key in list(decoder.pool.owners()):
        decoder.pool.forget(key)
    return {"rows": rows, "prompt_tokens": prompt, "new_tokens": new, "tok_s": round(tokens / elapsed, 1)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the client -------------------------------------------------------------------------------


def message(rng: random.Random, kind: str, tag: str) -> str:
    n = LENGTHS[kind]
    return f"[{tag}] " + " ".join(rng.choice(WORDS) for _ in range(n))


async def one_turn(
    client: Any, base: str, sid: str, turn: int, kind: str, stream: bool, text: str, t0: float
) -> Outcome:
    body: dict[str, Any] = {
        "model": "any",
        "messages": [{"role": "user", "content": text}],
        "metadata": {"session_id": sid},
    }
    start = time.monotonic()
    out = Outcome(sid, turn, kind, stream, 0, start - t0, 0.0, None, text, "")
    try:
        if not stream:
            r = await client.post(f"{base}/v1/chat/completions", json=body)
            out.status = r.status_code
            if r.status_code == 200:
                data = r.json()
                out.reply = data["choices"][0]["message"]["content"]
                out.completion_tokens = (data.get("usage") or {}).get("completion_tokens")
                out.prompt_tokens = (data.get("usage") or {}).get("prompt_tokens")
                out.cached_tokens = usage_cached(data.get("usage"))
                out.plan_s = (data.get("convo") or {}).get("plan_s")
                out.first_shown = (data.get("convo") or {}).get("first_shown_turn")
            else:
                out.error = r.text[:200]
        else:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
            async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
                out.status = r.status_code
                if r.status_code != 200:
                    out.error = (await r.aread()).decode()[:200]
                else:
                    parts = []
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            out.error = str(event["error"])[:200]
                        if event.get("usage"):
                            out.completion_tokens = event["usage"].get("completion_tokens")
                            out.prompt_tokens = event["usage"].get("prompt_tokens")
                            out.cached_tokens = usage_cached(event["usage"])
                        if event.get("convo"):
                            out.plan_s = event["convo"].get("plan_s")
                            out.first_shown = event["convo"].get("first_shown_turn")
                        for ch in event.get("choices") or []:
                            piece = (ch.get("delta") or {}).get("content")
                            if piece:
                                if out.ttft_s is None:
                                    out.ttft_s = time.monotonic() - start
                                parts.append(piece)
                    out.reply = "".join(parts)
    except Exception as exc:  # a transport failure is a result too
        out.error = f"{type(exc).__name__}: {exc}"
    out.latency_s = time.monotonic() - start
    return out


async def openai_turn(client: Any, sid: str, turn: int, text: str, t0: float, max_tokens: int) -> Outcome:
    """One streamed turn through the official ``openai`` client, session in ``X-Session-Id``."""
    import openai

    start = time.monotonic()
    out = Outcome(sid, turn, "chat", True, 0, start - t0, 0.0, None, text, "")
    try:
        stream = await client.chat.completions.create(
            model="any",
            messages=[{"role": "user", "content": text}],
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={"X-Session-Id": sid},
        )
        out.status = 200
        parts = []
        async for chunk in stream:
            for ch in chunk.choices or []:
                piece = ch.delta.content if ch.delta else None
                if piece:
                    if out.ttft_s is None:
                        out.ttft_s = time.monotonic() - start
                    parts.append(piece)
            if chunk.usage is not None:
                out.completion_tokens = chunk.usage.completion_tokens
                out.prompt_tokens = chunk.usage.prompt_tokens
                details = chunk.usage.prompt_tokens_details
                out.cached_tokens = details.cached_tokens if details is not None else None
            block = (chunk.model_extra or {}).get("convo")
            if block:
                out.plan_s = block.get("plan_s")
                out.first_shown = block.get("first_shown_turn")
        out.reply = "".join(parts)
    except openai.APIStatusError as exc:
        out.status, out.error = exc.status_code, str(exc)[:200]
    except Exception as exc:  # a transport failure is a result too
        out.error = f"{type(exc).__name__}: {exc}"
    out.latency_s = time.monotonic() - start
    return out


async def conversation(
    client: Any, base: str, sid: str, args: argparse.Namespace, rng: random.Random, t0: float, end: float
) -> list[Outcome]:
    outcomes = []
    if args.start_spread_s > 0:  # users do not all arrive at once
        await asyncio.sleep(rng.uniform(0.0, args.start_spread_s))
    for turn in range(args.turns):
        if turn and args.think_max_s > 0:  # reading and typing: uniform in [min, max]
            await asyncio.sleep(rng.uniform(args.think_min_s, args.think_max_s))
        elif turn and args.think_s > 0:  # the person reads the reply and types the next message
            await asyncio.sleep(args.think_s * rng.uniform(0.5, 1.5))
        if time.monotonic() > end:
            break
        if args.client == "openai":
            words = " ".join(rng.choice(WORDS) for _ in range(args.message_words))
            text = f"[{sid} t{turn}] {words}"
            max_tokens = args.max_tokens or args.max_new_tokens
            outcomes.append(await openai_turn(client, sid, turn, text, t0, max_tokens))
            continue
        kind = rng.choices(list(LENGTHS), weights=(5, 3, 2))[0]
        stream = rng.random() < args.stream_fraction
        text = message(rng, kind, f"{sid} t{turn}")
        outcomes.append(await one_turn(client, base, sid, turn, kind, stream, text, t0))
    return outcomes


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


async def sampler(base: str, pid: int, stop: asyncio.Event, samples: dict[str, Any]) -> None:
    import httpx
    import psutil

    proc = psutil.Process(pid)
    async with httpx.AsyncClient(timeout=5) as c:
        while not stop.is_set():
            try:
                m = parse_metrics((await c.get(f"{base}/metrics")).text)
                # (the server's ledger counts tokens: prompt + reply cap)
                samples["ledger_peak"] = max(samples["ledger_peak"], m.get("convo_kv_tokens_in_use", 0))
                samples["ledger_budget"] = m.get("convo_kv_budget_tokens", 0)
                samples["running_peak"] = max(samples["running_peak"], m.get("convo_requests_running", 0))
                samples["waiting_peak"] = max(samples["waiting_peak"], m.get("convo_requests_waiting", 0))
                # (reset by each wave: the peaks of the wave in progress)
                host = m.get("convo_engine_kv_host_bytes", 0)
                samples["wave_host_peak"] = max(samples["wave_host_peak"], host)
                backlog = m.get("convo_summary_backlog", 0)
                samples["wave_backlog_peak"] = max(samples["wave_backlog_peak"], backlog)
            except Exception:
                pass
            samples["rss_peak"] = max(samples["rss_peak"], proc.memory_info().rss)
            try:
                await asyncio.wait_for(stop.wait(), 0.1)
            except TimeoutError:
                pass


async def run(args: argparse.Namespace, base: str, pid: int) -> dict[str, Any]:
    import httpx
    import psutil

    samples: dict[str, Any] = {
        "ledger_peak": 0.0,
        "ledger_budget": 0.0,
        "running_peak": 0.0,
        "waiting_peak": 0.0,
        "rss_peak": 0,
        "wave_host_peak": 0.0,
        "wave_backlog_peak": 0.0,
    }
    rss_idle = psutil.Process(pid).memory_info().rss
    async with httpx.AsyncClient() as c:
        engine_before = parse_metrics((await c.get(f"{base}/metrics")).text)
    stop = asyncio.Event()
    sample_task = asyncio.create_task(sampler(base, pid, stop, samples))
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.sessions + 8, max_keepalive_connections=args.sessions + 8)
    async with httpx.AsyncClient(timeout=args.request_timeout_s, limits=limits) as client:
        talker: Any = client
        if args.client == "openai":
            import openai

            talker = openai.AsyncOpenAI(
                base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=args.request_timeout_s,
                http_client=httpx.AsyncClient(timeout=args.request_timeout_s, limits=limits),
            )  # fmt: skip
        # The load starts now: importing and building the client (about 1.5 s for ``openai``
        # on the H200 host) was inside ``wall_s`` until 2026-12-01.
        t0 = time.monotonic()
        waves: list[dict[str, Any]] = []
        sids: list[str] = []
        results: list[list[Outcome]] = []
        for w in range(args.waves):  # back to back, each with new sessions
            tag = "load" if w == 0 else f"load-w{w}"
            wave_sids = [f"{tag}-{i:03d}-{rng.randrange(1 << 30):x}" for i in range(args.sessions)]
            rngs = [random.Random(rng.random()) for _ in wave_sids]
            before = engine_before if w == 0 else parse_metrics((await client.get(f"{base}/metrics")).text)
            samples["wave_host_peak"] = samples["wave_backlog_peak"] = 0.0
            t_wave = time.monotonic()
            end = t_wave + args.duration_s
            wave_results = await asyncio.gather(
                *(
                    conversation(talker, base, s, args, r, t0, end)
                    for s, r in zip(wave_sids, rngs, strict=True)
                )
            )
            wave_wall = time.monotonic() - t_wave
            after = parse_metrics((await client.get(f"{base}/metrics")).text)
            waves.append(
                {
                    "outcomes": [o for outs in wave_results for o in outs],
                    "wall_s": wave_wall,
                    "before": before,
                    "after": after,
                    "host_peak": samples["wave_host_peak"],
                    "backlog_peak": samples["wave_backlog_peak"],
                }
            )
            sids += wave_sids
            results += wave_results
        wall = time.monotonic() - t0
        engine_after = waves[-1]["after"]
        stop.set()
        await sample_task
        # Nothing lost: every 200 turn's message and reply are stored, in order; refused ones not.
        lost, extra = 0, 0
        for sid, outs in zip(sids, results, strict=True):
            expected = []
            for o in outs:
                if o.status == 200 and not o.error:
                    expected += [o.user, o.reply]
            r = await client.get(f"{base}/v1/sessions/{sid}")
            stored = [m["content"] for m in r.json()["messages"]] if r.status_code == 200 else []
            lost += sum(1 for m in expected if m not in stored)
            extra += max(len(stored) - len(expected), 0)
            if stored != expected:
                print(
                    f"[serve_load] session {sid}: stored {len(stored)} != expected {len(expected)}",
                    file=sys.stderr,
                )
        metrics = parse_metrics((await client.get(f"{base}/metrics")).text)
    outcomes = [o for outs in results for o in outs]
    return {
        "outcomes": outcomes,
        "wall_s": wall,
        "lost_messages": lost,
        "unexpected_stored_messages": extra,
        "samples": samples,
        "rss_idle_bytes": rss_idle,
        "metrics": metrics,
        "engine": engine_during(engine_before, engine_after, wall),
        "waves": waves,
    }


def engine_during(before: dict[str, float], after: dict[str, float], wall: float) -> dict[str, Any] | None:
    """The engine scheduler's counters (``convo_engine_*`` on /metrics) over the load: steps
    and busy seconds by kind, tokens, preemptions, and the busy share of the wall time
    (near 1: the device is the bottleneck). ``None`` for an engine without a scheduler."""
    names = [k for k in after if k.startswith("convo_engine_")]
    if not names:
        return None

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    kinds = ("decode", "mixed", "prefill")
    busy = {k: round(delta(f'convo_engine_busy_seconds_total{{kind="{k}"}}'), 3) for k in kinds}
    return {
        "steps": {k: int(delta(f'convo_engine_steps_total{{kind="{k}"}}')) for k in kinds},
        "busy_s": busy,
        "busy_share_of_wall": round(sum(busy.values()) / wall, 3) if wall > 0 else None,
        "prompt_tokens": int(delta("convo_engine_prompt_tokens_total")),
        "decode_rows": int(delta("convo_engine_decode_rows_total")),
        "preemptions": int(delta("convo_engine_preemptions_total")),
    }


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))], 4)


def histogram_quantile(
    before: dict[str, float], after: dict[str, float], name: str, q: float
) -> float | None:
    """Quantile ``q`` of the observations a Prometheus histogram ``name`` got between two
    scrapes (linear within its bucket, as Prometheus' ``histogram_quantile``); ``None``
    when it got none."""
    prefix = name + '_bucket{le="'
    bounds = sorted(
        (float("inf") if k[len(prefix) : -2] == "+Inf" else float(k[len(prefix) : -2]), k)
        for k in after
        if k.startswith(prefix)
    )
    cum = [(b, after[k] - before.get(k, 0.0)) for b, k in bounds]
    if not cum or cum[-1][1] <= 0:
        return None
    rank = q * cum[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in cum:
        if count >= rank:
            if upper == float("inf"):
                return round(lower, 4)
            share = (rank - below) / (count - below) if count > below else 1.0
            return round(lower + (upper - lower) * share, 4)
        lower, below = upper, count
    return None


def background_figures(
    outs: list[Outcome],
    before: dict[str, float],
    after: dict[str, float],
    *,
    host_peak: float,
    backlog_peak: float,
) -> dict[str, Any]:
    """KV reuse and background work over one load (issue 22): what the engine prefilled
    against what the requests asked (``reprefill``), preemptions, host swaps and bytes,
    the summaries' lag and backlog, TTFT p50 by turn index. 0 for what /metrics lacks."""
    ok = [o for o in outs if o.status == 200 and not o.error]

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    prefilled = int(delta("convo_engine_prompt_tokens_total"))
    novel = int(delta("convo_engine_novel_prompt_tokens_total"))
    requested = sum(o.prompt_tokens or 0 for o in ok)
    host_peak = max(host_peak, after.get("convo_engine_kv_host_bytes_peak", 0.0))
    lag = "convo_summary_lag_seconds"
    return {
        "prefilled_prompt_tokens": prefilled,
        "requested_prompt_tokens": requested,
        # (None: no request reported its prompt, or the engine exports no prompt counter)
        "reprefill": round(prefilled / requested, 3)
        if requested and "convo_engine_prompt_tokens_total" in after
        else None,
        # What an unbounded exact cache would still prefill (None: an older server's /metrics)
        "novel_prompt_tokens": novel,
        "reprefill_floor": round(novel / requested, 3)
        if requested and "convo_engine_novel_prompt_tokens_total" in after
        else None,
        # Prefilled and novel prompt tokens by kind of work (reply, background, prefill ahead),
        # and what preempted work prefilled again ({} and 0: an older server's /metrics)
        "prefilled_prompt_tokens_by_work": {
            w: int(delta(f'convo_engine_work_prompt_tokens_total{{work="{w}"}}')) for w in WORKS
        },
        "novel_prompt_tokens_by_work": {
            w: int(delta(f'convo_engine_work_novel_prompt_tokens_total{{work="{w}"}}')) for w in WORKS
        },
        "recomputed_prompt_tokens": int(delta("convo_engine_recomputed_prompt_tokens_total")),
        # Session prefixes copied slot to slot for other work of the session (its summary)
        "slot_copied_tokens": int(delta("convo_engine_kv_slot_copied_tokens_total")),
        # ... and prefixes parked in host memory for it before the session's turn overwrote them
        "kept_for_background": int(delta("convo_engine_kv_kept_for_background_total")),
        "preemptions": int(delta("convo_engine_preemptions_total")),
        # Cached tokens a context shift moved instead of prefilling (0: off, or none slid)
        "shifted_tokens": int(delta("convo_engine_kv_shifted_tokens_total")),
        "swaps_in": int(delta("convo_engine_kv_swaps_in_total")),
        "swaps_out": int(delta("convo_engine_kv_swaps_out_total")),
        "host_kv_bytes_peak": int(host_peak),
        "summaries_written": int(delta("convo_summary_written_total")),
        "summary_lag_p50_s": histogram_quantile(before, after, lag, 0.5),
        "summary_lag_p95_s": histogram_quantile(before, after, lag, 0.95),
        "summary_backlog_peak": int(backlog_peak),
        "summary_backlog_end": int(after.get("convo_summary_backlog", 0.0)),
        "ttft_p50_s_by_turn": p50_by_turn(ok, "ttft_s"),
        # Prompt tokens each turn prefilled (its prompt less what the server reports cached)
        "prefilled_p50_by_turn": p50_by_turn(ok, "uncached_tokens"),
        # The server's part of it: the turn's seconds before its prompt went to the engine
        # (indexing, retrieval, planning; ``convo.plan_s``).
        "plan_s_p50_by_turn": p50_by_turn(ok, "plan_s"),
    }


def p50_by_turn(outcomes: Sequence[Outcome], field: str) -> dict[str, float | None]:
    """The median of ``field`` of ``outcomes`` for each turn index (those without it left out)."""
    values: dict[int, list[float]] = {}
    for o in outcomes:
        values.setdefault(o.turn, [])
        if (v := getattr(o, field)) is not None:
            values[o.turn].append(v)
    return {str(t): pct(values[t], 0.5) for t in sorted(values)}


#: The kinds of work the engine counts prompt tokens for (``convo.fast.scheduler.WORK_KINDS``).
WORKS = ("reply", "background", "prefill")

#: The figures of each wave under ``waves`` (with :func:`background_figures`).
WAVE_KEYS = (
    "wall_s",
    "completed_200",
    "ttft_p50_s",
    "ttft_p95_s",
    "turn_latency_p50_s",
    "turn_latency_p95_s",
    "window_slide_vs_ordinary",
)


def wave_figures(args: argparse.Namespace, waves: list[dict[str, Any]]) -> dict[str, Any]:
    """``waves`` (each wave's figures) and ``wave2_over_wave1`` (wall and TTFT p50 of the
    second wave over the first's; the issue asks <= 1.15)."""
    figures = []
    for i, w in enumerate(waves):
        part = {
            "outcomes": w["outcomes"], "wall_s": w["wall_s"], "metrics": w["after"],
            "samples": {"ledger_peak": 0.0, "ledger_budget": 0.0, "running_peak": 0.0, "waiting_peak": 0.0,
                        "rss_peak": 0},
            "rss_idle_bytes": 0, "lost_messages": 0, "unexpected_stored_messages": 0,
        }  # fmt: skip
        full = summarize_load(part)
        one = {"wave": i + 1, **{k: full[k] for k in WAVE_KEYS}}
        one.update(background_figures(w["outcomes"], w["before"], w["after"],
                                      host_peak=w["host_peak"], backlog_peak=w["backlog_peak"]))  # fmt: skip
        figures.append(one)
    out: dict[str, Any] = {"waves": figures}
    if len(figures) >= 2:
        first, second = figures[0], figures[1]

        def ratio(key: str) -> float | None:
            a, b = first.get(key), second.get(key)
            return round(b / a, 3) if a and b is not None else None

        out["wave2_over_wave1"] = {"wall_s": ratio("wall_s"), "ttft_p50_s": ratio("ttft_p50_s")}
    return out


def summarize(args: argparse.Namespace, res: dict[str, Any]) -> dict[str, Any]:
    """The load's figures (see the module docstring)."""
    out = summarize_load(res)
    waves = res.get("waves") or []
    if waves:
        host_peak = max(w["host_peak"] for w in waves)
        backlog_peak = max(w["backlog_peak"] for w in waves)
        out.update(background_figures(res["outcomes"], waves[0]["before"], waves[-1]["after"],
                                      host_peak=host_peak, backlog_peak=backlog_peak))  # fmt: skip
        if args.waves > 1:
            out.update(wave_figures(args, waves))
    return out


def summarize_load(res: dict[str, Any]) -> dict[str, Any]:
    outs: list[Outcome] = res["outcomes"]
    ok = [o for o in outs if o.status == 200 and not o.error]
    refused = [o for o in outs if o.status == 429]
    timed_out = [o for o in outs if o.status == 503]
    other = [o for o in outs if o not in ok and o not in refused and o not in timed_out]
    ttft = [o.ttft_s for o in ok if o.stream and o.ttft_s is not None]
    m = res["metrics"]
    s = res["samples"]
    reply_tokens = sum(o.completion_tokens or 0 for o in ok)
    by_turn = {
        str(t): pct([o.latency_s for o in ok if o.turn == t], 0.5) for t in sorted({o.turn for o in ok})
    }
    # A turn on which the window slid: its prompt starts at a later turn than the session's
    # previous one (``convo.first_shown_turn``); from a server that does not say, its prompt
    # is no longer than the previous one (older turns left the window; the summary took
    # their place). With memory on the prompts stay full (passages take the room), so only
    # the first rule tells.
    slides, ordinary = [], []
    for sid in {o.session for o in ok}:
        turns = sorted((o for o in ok if o.session == sid and o.prompt_tokens), key=lambda o: o.turn)
        for prev, cur in itertools.pairwise(turns):
            if cur.first_shown is not None and prev.first_shown is not None:
                slid = cur.first_shown > prev.first_shown
            else:
                slid = (cur.prompt_tokens or 0) <= (prev.prompt_tokens or 0)
            (slides if slid else ordinary).append(cur.latency_s)
    slide_p50, ordinary_p50 = pct(slides, 0.5), pct(ordinary, 0.5)
    chat = {
        "reply_tokens": reply_tokens,
        "reply_tokens_per_s": round(reply_tokens / res["wall_s"], 1),
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p95_s": pct(ttft, 0.95),
        "turn_latency_p50_s": pct([o.latency_s for o in ok], 0.5),
        "turn_latency_p95_s": pct([o.latency_s for o in ok], 0.95),
        "turn_latency_p50_s_by_turn": by_turn,
        "prompt_tokens_p50": pct([float(o.prompt_tokens) for o in ok if o.prompt_tokens is not None], 0.5),
        "window_slide_turns": len(slides),
        "window_slide_turn_latency_p50_s": slide_p50,
        "ordinary_turn_latency_p50_s": ordinary_p50,
        "window_slide_vs_ordinary": round(slide_p50 / ordinary_p50, 2) if slides and ordinary_p50 else None,
    }
    refused_by = {k.split('"')[1]: v for k, v in m.items() if k.startswith("convo_requests_refused_total{")}
    return {
        "requests": len(outs),
        "completed_200": len(ok),
        "refused_429": len(refused),
        "queue_timeout_503": len(timed_out),
        "other_errors": len(other),
        "other_error_samples": [f"{o.status} {o.error}" for o in other[:3]],
        "wall_s": round(res["wall_s"], 3),
        "completed_per_s": round(len(ok) / res["wall_s"], 3),
        "requests_per_s": round(len(outs) / res["wall_s"], 3),
        "latency_s": {
            "p50": pct([o.latency_s for o in ok], 0.5),
            "p95": pct([o.latency_s for o in ok], 0.95),
        },
        "latency_by_length_p50_s": {k: pct([o.latency_s for o in ok if o.kind == k], 0.5) for k in LENGTHS},
        "ttft_stream_s": {"p50": pct(ttft, 0.5), "p95": pct(ttft, 0.95), "n": len(ttft)},
        "refusal_latency_s": {
            "p50": pct([o.latency_s for o in refused], 0.5),
            "p95": pct([o.latency_s for o in refused], 0.95),
            "max": round(max((o.latency_s for o in refused), default=0.0), 4),
        },
        "lost_messages": res["lost_messages"],
        "unexpected_stored_messages": res["unexpected_stored_messages"],
        "admission_ledger": {
            "unit": "tokens (prompt bound + reply cap per admitted request)",
            "budget": s["ledger_budget"],
            "peak_in_use": s["ledger_peak"],
            "within_budget": s["ledger_peak"] <= s["ledger_budget"],
            "running_peak": s["running_peak"],
            "waiting_peak": s["waiting_peak"],
            "admitted_total": m.get("convo_requests_admitted_total"),
            "refused_total_by_reason": refused_by,
        },
        "server_rss_bytes": {
            "idle": res["rss_idle_bytes"],
            "peak": s["rss_peak"],
            "growth": s["rss_peak"] - res["rss_idle_bytes"],
        },
        **chat,
        "engine": res.get("engine"),
    }


def hardware() -> dict[str, Any]:
    import psutil

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
    }


def versions(fake: bool) -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    names = ["convo", "httpx", "fastapi", "uvicorn"] + ([] if fake else ["torch", "transformers"])
    for name in names:
        try:
            out[name] = __import__(name).__version__
        except Exception:
            out[name] = "missing"
    return out


def plot(outs: list[Outcome], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    groups = {
        "200": ([o for o in outs if o.status == 200 and not o.error], "tab:green"),
        "429": ([o for o in outs if o.status == 429], "tab:red"),
        "503": ([o for o in outs if o.status == 503], "tab:orange"),
        "other": ([o for o in outs if o.status not in (200, 429, 503) or (o.status == 200 and o.error)], "k"),
    }
    for label, (group, color) in groups.items():
        if group:
            a.scatter([o.start_s for o in group], [o.latency_s for o in group], s=12, c=color, label=label)
    a.set_xlabel("request start (s since run began)")
    a.set_ylabel("latency (s)")
    a.set_title("timeline")
    a.legend()
    ok = groups["200"][0]
    if ok:
        b.hist([o.latency_s for o in ok], bins=30, color="tab:green", alpha=0.7, label="200 latency")
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    if ttft:
        b.hist(ttft, bins=30, color="tab:blue", alpha=0.6, label="TTFT (stream)")
    if groups["429"][0]:
        b.hist([o.latency_s for o in groups["429"][0]], bins=30, color="tab:red", alpha=0.6, label="429")
    b.set_xlabel("seconds")
    b.set_title("latency histogram")
    b.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fake", action="store_true", help="the test engine (no model), with --delay-s per word")
    p.add_argument("--delay-s", type=float, default=0.02, help="fake engine: seconds per word (0.02)")
    p.add_argument(
        "--fake-concurrent-calls",
        type=int,
        default=1,
        help="fake engine: the calls it declares it runs together (1); above 1 a turn never "
        "waits for a late summary, as on a batching GPU engine",
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="a named load (gpu-chat: issue 11; chat-users, think-16: issue 22)",
    )
    p.add_argument(
        "--model", default=None, help="local engine model (e.g. random:llama-2-7b); default: default"
    )
    p.add_argument("--quant", default=None, help="local engine quantization (int4, nf4, bf16, ...)")
    p.add_argument("--kv-slots", type=int, default=None, help="local engine static KV slots (0 = off)")
    p.add_argument("--client", choices=("httpx", "openai"), default="httpx", help="client library (httpx)")
    p.add_argument("--message-words", type=int, default=CHAT_WORDS, help="openai client: words per turn")
    p.add_argument("--baseline-kv-slots-0", action="store_true", help="also run the load with --kv-slots 0")
    p.add_argument("--baseline-quant", default=None, help="quant of the --kv-slots 0 run (default: --quant)")
    p.add_argument("--baseline-duration-s", type=float, default=None, help="--duration-s of the baseline run")
    p.add_argument("--sessions", type=int, default=48, help="concurrent conversations (48)")
    p.add_argument("--turns", type=int, default=3, help="turns per conversation (3)")
    p.add_argument("--stream-fraction", type=float, default=0.5, help="share of streaming requests (0.5)")
    p.add_argument("--budget", type=int, default=2048, help="context_tokens per session (2048)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="reply cap (64)")
    p.add_argument("--max-concurrency", type=int, default=4, help="server: requests generating at once (4)")
    p.add_argument("--max-queue", type=int, default=8, help="server: requests waiting, more get 429 (8)")
    p.add_argument("--queue-timeout-s", type=float, default=30.0, help="server: queue wait before 503 (30)")
    p.add_argument("--admission-tokens", type=int, default=16384, help="server: token ledger budget (16384)")
    p.add_argument("--duration-s", type=float, default=120.0, help="stop starting turns after this (120)")
    p.add_argument("--request-timeout-s", type=float, default=300.0, help="client timeout per request (300)")
    p.add_argument(
        "--think-s",
        type=float,
        default=0.0,
        help="mean pause of a session between its turns, seconds, uniform in 0.5-1.5x (default 0: none)",
    )
    p.add_argument(
        "--think-min-s", type=float, default=0.0, help="think time uniform from (with --think-max-s)"
    )
    p.add_argument(
        "--think-max-s", type=float, default=0.0, help="think time uniform to; > 0 wins over --think-s"
    )
    p.add_argument(
        "--start-spread-s",
        type=float,
        default=0.0,
        help="first turns start uniformly over this many seconds (0)",
    )
    p.add_argument("--waves", type=int, default=1, help="loads back to back, each with new sessions (1)")
    p.add_argument(
        "--kv-host-memory",
        type=kv_host_memory_size,
        default=None,
        help="local engine: host memory for evicted KV (16GiB; 0 = off; default: the engine's)",
    )
    p.add_argument(
        "--int4-dense-copy",
        type=kv_host_memory_size,
        default=0,
        help="local engine, --quant int4: dense copies of the int4 weights up to this size (13GiB; "
        "convo serve's --int4-dense-copy; default 0: none)",
    )
    p.add_argument(
        "--context-shift",
        action="store_true",
        help="local engine: move a session's kept turns after a slide instead of prefilling them",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="openai client: the requests' max_tokens (--max-new-tokens)",
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="the server's retrieval memory on, as `convo serve` runs where the embedder is installed "
        "(off by default, so that earlier figures stay comparable)",
    )
    p.add_argument(
        "--embedding-model",
        default=None,
        metavar="PATH",
        help="with --memory: a local sentence-transformers folder (convo serve's --embedding-model)",
    )
    p.add_argument(
        "--embedding-device",
        default=None,
        metavar="DEVICE",
        help="with --memory: where the embedding model runs (convo serve's --embedding-device)",
    )
    p.add_argument(
        "--embedding-in-process",
        action="store_true",
        help="with --memory: the embedding model in the server's own process (convo serve's "
        "--no-embedding-process; before issue 24's child process)",
    )
    p.add_argument(
        "--compare-memory",
        action="store_true",
        help="run the load without memory, then with it (new server each), and report side_by_side",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results", help="folder for the JSON and PNG")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--db", default="", help=argparse.SUPPRESS)
    p.add_argument("--step-file", default="", help=argparse.SUPPRESS)
    first, _ = p.parse_known_args()
    if first.preset:  # the preset's values, unless a flag says otherwise
        p.set_defaults(**PRESETS[first.preset])
    args = p.parse_args()
    if args.child:
        child(args)
        return 0
    if args.sessions < 1 or args.turns < 1 or args.sessions * args.turns * args.waves > 5000:
        p.error("--sessions, --turns and --waves must be >= 1, at most 5000 requests in all")
    if args.waves < 1 or not 0 <= args.think_min_s <= max(args.think_max_s, args.think_min_s):
        p.error("--waves must be >= 1 and --think-min-s within [0, --think-max-s]")
    if args.think_max_s > 0 and args.think_min_s > args.think_max_s:
        p.error("--think-min-s must be <= --think-max-s")

    if args.compare_memory and args.baseline_kv_slots_0:
        p.error("--compare-memory and --baseline-kv-slots-0 are separate runs")
    if args.compare_memory:
        off_args = argparse.Namespace(**vars(args))
        off_args.memory = False
        off_results, _, off_startup = serve_and_load(off_args, step=False)
        off_results["memory"] = False
        args.memory = True
    results, res, _ = serve_and_load(args, step=not args.fake)
    results["memory"] = bool(args.memory)
    if args.memory:  # (evidence that it ran: the indexes the load built)
        m = res["metrics"]
        results["memory_indexes_cached"] = int(m.get("convo_memory_cache_entries", 0))
        results["memory_cache_bytes"] = int(m.get("convo_memory_cache_bytes", 0))
        # Embedding done after replies for the next turn's indexing (issue 24), and left waiting
        results["embedded_ahead_texts"] = int(m.get("convo_memory_embedded_ahead_texts_total", 0))
        results["embed_ahead_jobs"] = int(m.get("convo_memory_embed_ahead_jobs_total", 0))
        results["embed_ahead_backlog_end"] = int(m.get("convo_memory_embed_ahead_backlog", 0))
    local = bool(args.model or args.quant or args.kv_slots is not None)
    engine = "fake" if args.fake else (_engine_label(args) if local else "smollm2")
    # (the files of one run do not overwrite another load's: gpu-chat keeps its old names)
    suffix = f"_{args.preset}" if args.preset not in (None, "gpu-chat") else ""
    stem = engine + suffix + (f"_waves{args.waves}" if args.waves > 1 else "")
    stem += "_memory" if args.compare_memory else ("_memory_on" if args.memory else "")
    stem += "_shift" if args.context_shift else ""
    config = {k: v for k, v in vars(args).items() if k not in ("child", "port", "db", "step_file")}
    report: dict[str, Any] = {
        "benchmark": "serve_load",
        "engine": engine,
        "hardware": hardware(),
        "versions": versions(args.fake),
        "config": config,
        "results": results,
    }
    if args.baseline_kv_slots_0:
        base_args = argparse.Namespace(**vars(args))
        base_args.kv_slots = 0
        base_args.quant = args.baseline_quant or args.quant
        if args.baseline_duration_s is not None:
            base_args.duration_s = args.baseline_duration_s
        base_results, _, base_startup = serve_and_load(base_args, step=False)
        report["baseline_kv_slots_0"] = {
            "quant": base_args.quant,
            "duration_s": base_args.duration_s,
            "server_startup_s": base_startup,
            "results": base_results,
        }
        keys = ("wall_s", "completed_200", "reply_tokens_per_s", "ttft_p50_s", "ttft_p95_s",
                "turn_latency_p50_s", "turn_latency_p95_s")  # fmt: skip
        report["side_by_side"] = {
            k: {f"kv_slots_{args.kv_slots}": results.get(k), "kv_slots_0": base_results.get(k)} for k in keys
        }
    if args.compare_memory:
        keys = ("wall_s", "ttft_p50_s", "ttft_p95_s", "turn_latency_p50_s", "turn_latency_p95_s")
        report["memory_off"] = {"server_startup_s": off_startup, "results": off_results}
        report["side_by_side"] = {
            k: {
                "memory_on": results.get(k),
                "memory_off": off_results.get(k),
                "on_over_off": round(results[k] / off_results[k], 3)
                if results.get(k) and off_results.get(k)
                else None,
            }
            for k in keys
        }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"serve_load_{stem}.json").write_text(json.dumps(report, indent=2))
    (out / f"serve_load_{stem}_requests.json").write_text(
        json.dumps(
            [{k: v for k, v in asdict(o).items() if k not in ("user", "reply")} for o in res["outcomes"]]
        )
    )
    plot(res["outcomes"], out / f"serve_load_{stem}.png", f"convo serve under load ({engine})")
    print(json.dumps(report, indent=2))
    ok = results["lost_messages"] == 0 and results["admission_ledger"]["within_budget"]
    return 0 if ok and results["other_errors"] == 0 else 1


def _engine_label(args: argparse.Namespace) -> str:
    model = (args.model or "default").replace("random:", "").replace("/", "_")
    return f"{model}_{args.quant or 'auto'}_slots{args.kv_slots if args.kv_slots is not None else 'auto'}"


def serve_and_load(args: argparse.Namespace, *, step: bool) -> tuple[dict[str, Any], dict[str, Any], float]:
    """Start the server process with ``args``, run the load, stop it: (summary, raw, startup s)."""

    port = free_port()
    tmp = tempfile.mkdtemp(prefix="convo-load-")
    step_file = f"{tmp}/step.json" if step else ""
    cmd = [sys.executable, __file__, "--child", "--port", str(port), "--db", f"{tmp}/s.db"]
    for name in (
        "delay_s",
        "budget",
        "max_new_tokens",
        "max_concurrency",
        "max_queue",
        "queue_timeout_s",
        "admission_tokens",
    ):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    passed = ("model", "quant", "kv_slots", "preset", "kv_host_memory", "embedding_model", "embedding_device")
    passed += ("int4_dense_copy",) * bool(args.int4_dense_copy)
    for name in passed:
        if getattr(args, name) is not None:
            cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.memory:
        cmd.append("--memory")
    if args.context_shift:
        cmd.append("--context-shift")
    if args.embedding_in_process:
        cmd.append("--embedding-in-process")
    if step_file:
        cmd += ["--step-file", step_file]
    if args.fake:
        cmd += ["--fake", "--fake-concurrent-calls", str(args.fake_concurrent_calls)]
    base = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    try:
        if not wait_until_serving(f"{base}/health", proc, timeout_s=600):
            raise SystemExit("the server did not start")
        startup_s = time.monotonic() - started
        res = asyncio.run(run(args, base, proc.pid))
    finally:
        proc.terminate()
        proc.wait(30)
    results = summarize(args, res)
    results["server_startup_s"] = round(startup_s, 2)
    if step_file and Path(step_file).is_file():
        results["decode_step"] = json.loads(Path(step_file).read_text())
        results["decode_step_16_rows_tok_s"] = results["decode_step"].get("tok_s")
    return results, res, startup_s


if __name__ == "__main__":
    sys.exit(main())
