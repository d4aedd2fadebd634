"""The ``convo`` command line.

::

    convo chat                               interactive chat on the embedded default model
    convo chat --script turns.txt --json     one user turn per line, one JSON object per turn
    convo plan --model M --context 1024,4096 --concurrency 1,4 --gpu-memory 24GiB
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from convo.errors import ConfigError, ConvoError


def default_db_path() -> Path:
    """Where ``convo chat`` keeps sessions: ``$CONVO_HOME/sessions.db``, else
    ``$XDG_DATA_HOME/convo/sessions.db``, else ``~/.local/share/convo/sessions.db``."""
    home = os.environ.get("CONVO_HOME")
    if home:
        return Path(home) / "sessions.db"
    data = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(data) / "convo" / "sessions.db"


@contextmanager
def spinner(message: str, stream: TextIO = sys.stderr) -> Iterator[Any]:
    """Show ``message`` with a spinner (or plain progress lines off a terminal)."""
    done = threading.Event()
    state = {"text": message}
    tty = stream.isatty()

    def update(text: str) -> None:
        state["text"] = text
        if not tty:
            print(f"[convo] {text}", file=stream, flush=True)

    def spin() -> None:
        for ch in itertools.cycle("|/-\\"):
            if done.wait(0.1):
                break
            stream.write(f"\r{ch} {state['text']}"[:120].ljust(80))
            stream.flush()

    started = time.monotonic()
    if tty:
        thread = threading.Thread(target=spin, daemon=True)
        thread.start()
    else:
        print(f"[convo] {message}", file=stream, flush=True)
    try:
        yield update
    finally:
        done.set()
        elapsed = time.monotonic() - started
        if tty:
            thread.join()
            stream.write("\r" + " " * 80 + "\r")
        print(f"[convo] ready in {elapsed:.1f} s", file=stream, flush=True)


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
        from convo.remote import engine_from_args

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="convo", description="LLM conversations inside a hard memory budget."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    chat = sub.add_parser("chat", help="chat with a model (interactive, or --script FILE)")
    chat.add_argument(
        "--model", default=None, help="model folder, .gguf file or hub id (default: embedded SmolLM2-135M)"
    )
    chat.add_argument(
        "--quant", default="auto", choices=["auto", "nf4", "int4", "int8", "bf16", "fp16", "fp32"]
    )
    chat.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    chat.add_argument("--budget", type=int, default=None, help="context_tokens of the session (default 2048)")
    chat.add_argument("--max-new-tokens", type=int, default=None, help="reply cap (default 256)")
    chat.add_argument("--window", type=int, default=None, help="recent turns kept verbatim (default 8)")
    chat.add_argument("--summary-tokens", type=int, default=None, help="summary cap (default 256; 0 = off)")
    chat.add_argument("--system", default=None, help="system prompt of a new session")
    chat.add_argument("--session", default=None, help="resume (or create) the session with this id")
    chat.add_argument("--db", default=None, help=f"SQLite file (default {default_db_path()})")
    chat.add_argument("--timeout", type=float, default=None, help="wall-clock cap of one reply, seconds")
    chat.add_argument("--script", default=None, help="file with one user turn per line")
    chat.add_argument("--json", action="store_true", help="print one JSON object per turn")
    add_local_engine_arguments(chat)
    add_engine_arguments(chat)
    chat.set_defaults(func=_chat)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server that keeps sessions in budget")
    serve.add_argument("--model", default=None, help="model folder, .gguf file or hub id (default: embedded)")
    serve.add_argument(
        "--quant", default="auto", choices=["auto", "nf4", "int4", "int8", "bf16", "fp16", "fp32"]
    )
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--api-key", default=None, help="bearer key clients must send (or $CONVO_API_KEY)")
    where = serve.add_mutually_exclusive_group()
    where.add_argument("--db", default=None, help=f"SQLite file for sessions (default {default_db_path()})")
    where.add_argument("--redis", default=None, help="Redis URL, for sessions shared by several replicas")
    serve.add_argument("--budget", type=int, default=None, help="context_tokens per session (default 2048)")
    serve.add_argument("--max-new-tokens", type=int, default=None, help="reply cap (default 256)")
    add_local_engine_arguments(serve)
    add_engine_arguments(serve)
    serve.set_defaults(func=_serve)

    plan = sub.add_parser("plan", help="will this model fit context N with M sessions on this GPU?")
    try:
        from convo.memory import add_plan_arguments, run_plan_cli
    except ImportError:
        plan.set_defaults(func=lambda a: _missing("convo.memory"))
    else:
        add_plan_arguments(plan)
        plan.set_defaults(func=run_plan_cli)
    return parser


def add_local_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """``--kv-slots``: the local engine's static KV slots (sized to the session budget)."""
    parser.add_argument(
        "--kv-slots",
        type=int,
        default=None,
        help="static KV slots of --budget tokens, taken at load (default: 8 on CUDA, 0 on CPU; 0 = off)",
    )


def local_engine(args: argparse.Namespace, context_tokens: int, progress: Any) -> Any:
    """The local :class:`TransformersEngine` the flags ask for; a KV slot holds one session's
    whole budget (``context_tokens``)."""
    from convo.engine import TransformersEngine

    return TransformersEngine(
        args.model,
        quant=args.quant,
        device=getattr(args, "device", None),
        kv_slots=getattr(args, "kv_slots", None),
        slot_tokens=context_tokens,
        progress=progress,
    )


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """``--engine-*``: generate (and summarize) on a remote OpenAI-compatible server."""
    group = parser.add_argument_group("remote engine (vLLM, SGLang, llama.cpp server, convo serve)")
    group.add_argument(
        "--engine-url", default=None, help="OpenAI-compatible API root, e.g. http://host:8080/v1"
    )
    group.add_argument(
        "--engine-model", default=None, help="served model name (default: first in /v1/models)"
    )
    group.add_argument(
        "--engine-api-key", default=None, help="bearer key for the engine (or $CONVO_ENGINE_API_KEY)"
    )
    group.add_argument(
        "--engine-tokenizer",
        default=None,
        help="local Hugging Face folder of the served model's tokenizer, for exact counts "
        "(default: tiktoken cl100k with a safety margin)",
    )
    group.add_argument(
        "--engine-context",
        type=int,
        default=None,
        help="the engine's context length in tokens (default: from /v1/models, else --budget)",
    )


def _serve(args: argparse.Namespace) -> int:
    from convo.server import run_server

    return run_server(args)


def _missing(what: str) -> int:
    print(f"convo: {what} is not available in this installation", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConvoError as exc:
        print(f"convo: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
