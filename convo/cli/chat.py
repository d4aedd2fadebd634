"""``convo chat``: an interactive chat, or a scripted one (``--script FILE --json``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from convo.cli.common import default_db_path, engine_from_args, local_engine, spinner
from convo.errors import ConfigError


def _turn_json(session: Any, reply: Any) -> dict[str, Any]:
    s, g = reply.stats, reply.stats.generation
    out: dict[str, Any] = {
        "turn": s.turn,
        "reply": reply.text,
        "prompt_tokens": s.prompt_tokens,
        "parts": dict(s.parts),
        "budget": s.context_tokens,
        "max_new_tokens": s.max_new_tokens,
        "summary_tokens": s.summary_tokens,
        "evicted_turns": s.evicted_turns,
        "latency_s": round(s.latency_s, 4),
        "session_id": session.id,
        "finish_reason": reply.finish_reason.value,
        "summarized_turns": s.summarized_turns,
        "truncated_messages": s.truncated_messages,
        "passages_used": s.passages_used,
        "oom_retries": s.oom_retries,
        "summarize_s": round(s.summarize_s, 4),
    }
    if g is not None:
        out.update(
            completion_tokens=g.new_tokens,
            cached_tokens=g.cached_tokens,
            ttft_s=round(g.ttft_s, 4),
            tokens_per_s=round(g.tokens_per_s, 2),
            kv_bytes=g.kv_bytes,
            memory_kind=g.memory_kind,
            peak_allocated_bytes=g.peak_allocated_bytes,
            peak_reserved_bytes=g.peak_reserved_bytes,
        )
    return out


def _build_session(args: argparse.Namespace) -> Any:
    from convo.budget import Budget
    from convo.session import Session
    from convo.store import SQLiteStore

    store = SQLiteStore(args.db or default_db_path())
    budget = None
    explicit = {
        "context_tokens": args.budget,
        "max_new_tokens": args.max_new_tokens,
        "window_turns": args.window,
        "summary_tokens": args.summary_tokens,
    }
    given = {k: v for k, v in explicit.items() if v is not None}
    if args.session and store.exists(args.session):
        if given:
            state, _ = store.load(args.session)
            stored = dict(state.settings.get("budget", {}))
            stored.update(given)
            budget = Budget.from_dict(stored)
    else:
        defaults: dict[str, Any] = {
            "context_tokens": 2048,
            "max_new_tokens": 256,
            "window_turns": 8,
            "summary_tokens": 256,
        }
        defaults.update(given)
        budget = Budget(**defaults)
    # The budget is checked above, before the model loads: bad flags fail in a second.
    engine: Any
    if args.engine_url:  # a remote OpenAI-compatible server generates and summarizes
        engine = engine_from_args(args, default_context_tokens=(budget or Budget()).context_tokens)
        if budget is not None and "margin_tokens" not in given:
            derived = ("margin_tokens", "pinned_tokens", "recent_min_tokens")  # re-derived with the margin
            budget = engine.budget(**{k: v for k, v in budget.to_dict().items() if k not in derived})
    else:
        with spinner("loading model") as update:
            engine = local_engine(args, (budget or Budget()).context_tokens, update)
    return Session(
        engine,
        budget=budget,
        store=store,
        session_id=args.session,
        system_prompt=args.system,
        timeout_s=args.timeout,
    )


def _chat(args: argparse.Namespace) -> int:
    if args.script and not Path(args.script).is_file():
        raise ConfigError(f"--script {args.script}: no such file")
    session = _build_session(args)
    out = sys.stdout
    if args.script:
        lines = Path(args.script).read_text(encoding="utf-8").splitlines()
        for line in lines:
            if not line.strip():
                continue
            reply = session.send(line)
            if args.json:
                out.write(json.dumps(_turn_json(session, reply), ensure_ascii=False) + "\n")
            else:
                out.write(f"you> {line}\nbot> {reply.text}\n")
            out.flush()
        session.close()
        return 0
    print(
        f"[convo] session {session.id} (resume with --session {session.id}); /exit to quit", file=sys.stderr
    )
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        if line.strip() in ("/exit", "/quit"):
            break
        if line.startswith("/summary"):
            print(session.summary or "(no summary yet)")
            continue
        if line.startswith("/pin "):
            session.pin(line[5:])
            continue
        if not line.strip():
            continue
        out.write("bot> ")
        stream = session.stream(line)
        for chunk in stream:
            out.write(chunk)
            out.flush()
        out.write("\n")
        if args.json and stream.result is not None:
            print(json.dumps(_turn_json(session, stream.result)), file=sys.stderr)
    session.close()
    return 0

