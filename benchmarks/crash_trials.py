"""Crash trials: ``kill -9`` ``convo serve`` at random moments under concurrent turns.

Each trial starts ``convo serve`` (the echo test engine, ``CONVO_FAKE_ENGINE=1``, so a
trial takes about a second plus the server's start) on one store that lives across all
trials, runs ``--clients`` client threads that send turns (half streamed) to a few
sessions (two clients share one session, so the per-session lock is exercised), and
SIGKILLs the server after a random delay. After every kill it opens the store directly
and checks:

* SQLite: ``PRAGMA integrity_check`` is ``ok``;
* every acknowledged turn (a 200 whose body, or stream up to ``[DONE]``, arrived) is
  stored exactly once: its user message, immediately followed by the assistant reply
  the client received;
* each client's acknowledged turns are stored in the order it sent them;
* the turn number the server reported equals the user message's position in the stored
  history, and the session state's counters are consistent
  (``summarized_turns <= evicted_turns <= turns``).

Unacknowledged turns (in flight at the kill) may or may not be stored; they are not
counted. Prints one JSON object::

    {"trials", "acknowledged_turns", "lost", "duplicated", "integrity_failures",
     "order_errors", "turn_number_errors", "state_errors", "by_store", ...}

and writes it to ``--out`` when given. Redis trials run when a Redis answers at
``--redis-url`` (``--stores sqlite,redis``). Example (about 3 s a trial on 2 busy cores)::

    python benchmarks/crash_trials.py --trials 50 --out benchmarks/results/crash_trials.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from convo.testing import wait_until_serving


@dataclass
class Ack:
    """One acknowledged turn."""

    session: str
    client: int
    user: str
    reply: str
    turn: int | None  # None for a streamed turn (chunks carry no turn number)


@dataclass
class Tally:
    trials: int = 0
    acknowledged_turns: int = 0
    lost: int = 0
    duplicated: int = 0
    integrity_failures: int = 0
    order_errors: int = 0
    turn_number_errors: int = 0
    state_errors: int = 0
    unacknowledged_requests: int = 0
    problems: list[str] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(store_args: list[str], delay_s: float) -> tuple[subprocess.Popen[bytes], str]:

    port = free_port()
    cmd = [sys.executable, "-m", "convo.cli", "serve", "--port", str(port), *store_args]
    cmd += ["--budget", "600", "--max-new-tokens", "40"]  # small: windows move, summaries run
    env = {**os.environ, "CONVO_FAKE_ENGINE": "1", "CONVO_FAKE_DELAY_S": str(delay_s)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    if not wait_until_serving(f"{base}/health", proc, timeout_s=120):
        proc.kill()
        raise SystemExit(f"convo serve did not start: {' '.join(cmd)}")
    return proc, base


def one_turn(client: Any, base: str, sid: str, text: str, stream: bool) -> tuple[str, int | None]:
    """Send one turn; return (reply, turn) or raise on anything but a complete answer."""
    body = {"model": "echo", "messages": [{"role": "user", "content": text}], "stream": stream}
    headers = {"X-Session-Id": sid}
    if not stream:
        r = client.post(f"{base}/v1/chat/completions", json=body, headers=headers)
        if r.status_code != 200:
            raise RuntimeError(f"status {r.status_code}")
        data = r.json()
        return data["choices"][0]["message"]["content"], int(data["convo"]["turn"])
    parts, done, finished = [], False, False
    with client.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"status {r.status_code}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                done = True
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                raise RuntimeError(f"stream error {chunk['error']}")
            for choice in chunk["choices"]:
                parts.append(choice["delta"].get("content") or "")
                finished = finished or choice.get("finish_reason") is not None
    if not (done and finished):
        raise RuntimeError("stream cut")
    return "".join(parts), None


def run_clients(
    base: str,
    sessions: list[str],
    clients: int,
    counters: list[int],
    stop: threading.Event,
    acks: list[Ack],
    tally: Tally,
    rng_seed: int,
) -> list[threading.Thread]:
    import httpx

    lock = threading.Lock()

    def work(i: int) -> None:
        rng = random.Random(rng_seed * 1000 + i)
        sid = sessions[i % len(sessions)]
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                counters[i] += 1
                text = f"client {i} message {counters[i]}"
                try:
                    reply, turn = one_turn(client, base, sid, text, stream=rng.random() < 0.5)
                except Exception as exc:
                    if os.environ.get("CRASH_DEBUG"):
                        print("turn failed:", repr(exc)[:200], file=sys.stderr)
                    with lock:
                        tally.unacknowledged_requests += 1
                    if stop.is_set():
                        return
                    time.sleep(0.05)
                    continue
                with lock:
                    acks.append(Ack(session=sid, client=i, user=text, reply=reply, turn=turn))

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    return threads


def check(store: Any, sqlite_path: str | None, sessions: list[str], acks: list[Ack], tally: Tally) -> None:
    """Check every acknowledged turn so far against the store (see the module docstring)."""
    if sqlite_path is not None:
        with sqlite3.connect(sqlite_path) as db:
            result = db.execute("PRAGMA integrity_check").fetchall()
        if result != [("ok",)]:
            tally.integrity_failures += 1
            tally.problems.append(f"integrity_check: {result}")
    histories: dict[str, list[Any]] = {}
    for sid in sessions:
        if not store.exists(sid):
            histories[sid] = []
            continue
        state, messages = store.load(sid)
        histories[sid] = messages
        turns = sum(1 for m in messages if m.role.value == "user")
        if not state.summarized_turns <= state.evicted_turns <= turns:
            tally.state_errors += 1
            tally.problems.append(
                f"{sid}: summarized {state.summarized_turns} evicted {state.evicted_turns} turns {turns}"
            )
    last_pos: dict[int, int] = {}
    lost = duplicated = order = numbers = 0
    for ack in acks:
        messages = histories[ack.session]
        where = [i for i, m in enumerate(messages) if m.role.value == "user" and m.content == ack.user]
        if len(where) > 1:
            duplicated += 1
            tally.problems.append(f"duplicated: {ack.user!r}")
        if not where:
            lost += 1
            tally.problems.append(f"lost: {ack.user!r}")
            continue
        pos = where[0]
        after = messages[pos + 1] if pos + 1 < len(messages) else None
        if after is None or after.role.value != "assistant" or after.content != ack.reply:
            lost += 1
            tally.problems.append(f"reply lost or changed after {ack.user!r}")
        replies = [m for m in messages if m.role.value == "assistant" and m.content == ack.reply]
        if len(replies) > 1:  # a reply echoes its (unique) user text: two mean a duplicated turn
            duplicated += 1
            tally.problems.append(f"reply duplicated: {ack.reply!r}")
        if pos <= last_pos.get(ack.client, -1):
            order += 1
            tally.problems.append(f"out of order: {ack.user!r}")
        last_pos[ack.client] = pos
        if ack.turn is not None:
            number = sum(1 for m in messages[: pos + 1] if m.role.value == "user")
            if number != ack.turn:
                numbers += 1
                tally.problems.append(f"turn {ack.turn} reported, stored as turn {number}: {ack.user!r}")
    # the checks above re-scan every acknowledged turn after each trial: keep the worst count
    tally.lost = max(tally.lost, lost)
    tally.duplicated = max(tally.duplicated, duplicated)
    tally.order_errors = max(tally.order_errors, order)
    tally.turn_number_errors = max(tally.turn_number_errors, numbers)


def run_store(kind: str, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    from convo.stores import RedisStore, SQLiteStore, Store

    tmp = tempfile.mkdtemp(prefix="convo-crash-")
    run_id = uuid.uuid4().hex[:8]
    sessions = [f"crash-{run_id}-{k}" for k in range(max(1, args.clients - 1))]
    store: Store
    sqlite_path: str | None = None
    if kind == "sqlite":
        sqlite_path = f"{tmp}/sessions.db"
        store_args = ["--db", sqlite_path]
        store = SQLiteStore(sqlite_path)
    else:
        # A killed replica's turn leases expire after --lock-lease-s; 1 s keeps trials short.
        store_args = ["--redis", args.redis_url, "--lock-lease-s", "1"]
        store = RedisStore(args.redis_url)
    tally = Tally()
    acks: list[Ack] = []
    counters = [0] * args.clients
    kill_after: list[float] = []
    started = time.monotonic()
    try:
        for trial in range(args.trials):
            proc, base = start_server(store_args, args.delay_s)
            stop = threading.Event()
            threads = run_clients(base, sessions, args.clients, counters, stop, acks, tally, trial)
            delay = rng.uniform(args.min_kill_s, args.max_kill_s)
            kill_after.append(delay)
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            stop.set()
            for t in threads:
                t.join(timeout=35)
            tally.trials += 1
            if os.environ.get("CRASH_DEBUG"):
                print(f"trial {trial}: killed after {delay:.2f} s, {len(acks)} acks so far", file=sys.stderr)
            check(store, sqlite_path, sessions, acks, tally)
    finally:
        if kind == "redis":
            for sid in sessions:
                try:
                    store.delete(sid)
                except Exception:
                    pass
        store.close()
    tally.acknowledged_turns = len(acks)
    out = {k: v for k, v in tally.__dict__.items() if k != "problems"}
    out["problems"] = tally.problems[:20]
    out["sessions"] = len(sessions)
    out["kill_after_s"] = {"min": min(kill_after), "max": max(kill_after)} if kill_after else None
    out["seconds"] = round(time.monotonic() - started, 1)
    return out


def redis_up(url: str) -> bool:
    try:
        import redis

        return bool(redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1).ping())
    except Exception:
        return False


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0], "sqlite": sqlite3.sqlite_version}
    for name in ("convo", "httpx", "fastapi", "uvicorn", "redis"):
        try:
            out[name] = __import__(name).__version__
        except Exception:
            out[name] = "missing"
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=50, help="kills per store (50)")
    p.add_argument("--stores", default="sqlite,redis", help="sqlite,redis (redis if it answers)")
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--clients", type=int, default=4, help="client threads; two share a session (4)")
    p.add_argument("--delay-s", type=float, default=0.002, help="echo engine: seconds per word (0.002)")
    p.add_argument("--min-kill-s", type=float, default=0.5, help="earliest kill after the server is up")
    p.add_argument("--max-kill-s", type=float, default=3.0, help="latest kill after the server is up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="also write the JSON here")
    args = p.parse_args()
    if args.trials < 1 or args.clients < 1 or not 0 <= args.min_kill_s <= args.max_kill_s:
        p.error("--trials and --clients must be >= 1 and 0 <= --min-kill-s <= --max-kill-s")
    rng = random.Random(args.seed)
    kinds = [k.strip() for k in args.stores.split(",") if k.strip()]
    by_store: dict[str, Any] = {}
    for kind in kinds:
        if kind == "redis" and not redis_up(args.redis_url):
            by_store[kind] = {"skipped": f"no Redis at {args.redis_url}"}
            continue
        if kind not in ("sqlite", "redis"):
            p.error(f"unknown store {kind!r}")
        by_store[kind] = run_store(kind, args, rng)
    ran = [v for v in by_store.values() if "trials" in v]
    keys = (
        "trials",
        "acknowledged_turns",
        "lost",
        "duplicated",
        "integrity_failures",
        "order_errors",
        "turn_number_errors",
        "state_errors",
    )
    result: dict[str, Any] = {k: sum(v[k] for v in ran) for k in keys}
    result.update(
        {
            "by_store": by_store,
            "config": {k: v for k, v in vars(args).items() if k != "out"},
            "hardware": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
            "versions": versions(),
        }
    )
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    bad = result["lost"] + result["duplicated"] + result["integrity_failures"] + result["order_errors"]
    return 1 if bad or result["turn_number_errors"] or result["state_errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
