"""The ``convo`` command line.

::

    convo chat                               interactive chat on the embedded default model
    convo chat --script turns.txt --json     one user turn per line, one JSON object per turn
    convo plan --model M --context 1024,4096 --concurrency 1,4 --gpu-memory 24GiB
"""

from __future__ import annotations

import argparse
import sys

from convo.cli.chat import _chat
from convo.cli.common import (
    _missing,
    add_engine_arguments,
    add_local_engine_arguments,
    default_db_path,
    non_negative_int,
    positive_int,
    positive_seconds,
)
from convo.errors import ConvoError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="convo", description="LLM conversations inside a hard memory budget."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    chat = sub.add_parser(
        "chat",
        help="chat with a model (interactive, or --script FILE)",
        description="Chat inside a token budget. Interactive commands: /help, /history, /summary, "
        "/pin TEXT, /exit. Ctrl-C cancels the reply being written.",
        epilog="exit status: 0 ok; 2 bad flags or a convo error; 3 a scripted reply was cut by --timeout",
    )
    chat.add_argument(
        "--model", default=None, help="model folder, .gguf file or hub id (default: embedded SmolLM2-135M)"
    )
    chat.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    chat.add_argument(
        "--budget", type=positive_int, default=None, help="context_tokens of the session (default 2048)"
    )
    chat.add_argument("--max-new-tokens", type=positive_int, default=None, help="reply cap (default 256)")
    chat.add_argument(
        "--window", type=positive_int, default=None, help="recent turns kept verbatim (default 8)"
    )
    chat.add_argument(
        "--summary-tokens", type=non_negative_int, default=None, help="summary cap (default 256; 0 = off)"
    )
    chat.add_argument(
        "--memory",
        action="store_true",
        help="retrieve earlier turns that left the window into the prompt (MiniLM + FAISS + BM25, offline); "
        "turns are dated with the local clock, so 'yesterday' or 'last week' find theirs",
    )
    chat.add_argument("--system", default=None, help="system prompt of a new session")
    chat.add_argument("--session", default=None, help="resume (or create) the session with this id")
    chat.add_argument("--db", default=None, help=f"SQLite file (default {default_db_path()})")
    chat.add_argument(
        "--timeout", type=positive_seconds, default=None, help="wall-clock cap of one reply, seconds"
    )
    chat.add_argument("--script", default=None, help="file with one user turn per line")
    chat.add_argument("--json", action="store_true", help="print one JSON object per turn")
    add_local_engine_arguments(chat)
    add_engine_arguments(chat)
    chat.set_defaults(func=_chat)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server that keeps sessions in budget")
    serve.add_argument("--model", default=None, help="model folder, .gguf file or hub id (default: embedded)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=non_negative_int, default=8000, help="port (default 8000)")
    serve.add_argument("--api-key", default=None, help="bearer key clients must send (or $CONVO_API_KEY)")
    where = serve.add_mutually_exclusive_group()
    where.add_argument("--db", default=None, help=f"SQLite file for sessions (default {default_db_path()})")
    where.add_argument("--redis", default=None, help="Redis URL, for sessions shared by several replicas")
    serve.add_argument(
        "--budget", type=positive_int, default=None, help="context_tokens per session (default 2048)"
    )
    serve.add_argument("--max-new-tokens", type=positive_int, default=None, help="reply cap (default 256)")
    serve.add_argument(
        "--window-turns", type=positive_int, default=None, help="recent turns kept verbatim (default 8)"
    )
    serve.add_argument(
        "--summary-tokens", type=non_negative_int, default=None, help="summary cap (default 256; 0 = off)"
    )
    serve.add_argument(
        "--system-prompt", default=None, help="system prompt of a new session whose request sends none"
    )
    serve.add_argument(
        "--timeout", type=positive_seconds, default=None, help="wall-clock cap of one generation, seconds"
    )
    serve.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    serve.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="what the server logs to stderr (default info: one line per request)",
    )
    serve.add_argument(
        "--session-from-user",
        action="store_true",
        help="also read a request's 'user' field as its session id (OpenAI's 'user' names an end "
        "user, who may have many chats: use only when each user has one conversation)",
    )
    serve.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a browser origin allowed to call the server (repeatable; '*' for any); others get 403",
    )
    serve.add_argument(
        "--lock-lease-s",
        type=float,
        default=30.0,
        help="Redis: how long a dead replica's session lock lasts (default 30 s)",
    )
    add_local_engine_arguments(serve)
    add_engine_arguments(serve)
    serve.set_defaults(func=_serve)

    plan = sub.add_parser("plan", help="will this model fit context N with M sessions on this GPU?")
    try:
        from convo.cli.plan import add_plan_arguments, run_plan_cli
    except ImportError:
        plan.set_defaults(func=lambda a: _missing("convo plan"))
    else:
        add_plan_arguments(plan)
        plan.set_defaults(func=run_plan_cli)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from convo.cli.serve import run_server

    return run_server(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConvoError as exc:
        print(f"convo: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
