"""``convo chat``: an interactive chat, or a scripted one (``--script FILE --json``)."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from convo.budget import Budget
from convo.cli.common import (
    add_engine_arguments,
    add_local_engine_arguments,
    check_local_model,
    default_db_path,
    engine_from_args,
    local_engine,
    non_negative_int,
    non_negative_seconds,
    open_sqlite_store,
    positive_int,
    positive_seconds,
    progress_bars_only_on_a_terminal,
    spinner,
)
from convo.engines.local.loading import DEFAULT_MODEL_NAME
from convo.errors import ConfigError, ConvoError, MissingDependency
from convo.messages import system
from convo.models import FinishReason
from convo.paths import cache_dir
from convo.session import DEFAULT_SUMMARY_WAIT_S, SUMMARY_WAIT_AUTO, Session
from convo.summarize import SummaryStatus
from convo.tokens import HFTokenCounter

try:  # --memory: numpy, FAISS and MiniLM (the retrieval extra); chat runs without them
    from convo.retrieval import RetrievalMemory
except ImportError:
    RetrievalMemory = None  # type: ignore[assignment,misc]


def add_chat_arguments(chat: argparse.ArgumentParser) -> None:
    """The flags of ``convo chat`` (its body is :func:`run_chat`)."""
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
    chat.add_argument(
        "--summary-wait",
        type=non_negative_seconds,
        default=None,
        metavar="SECONDS",
        help="how long a turn waits for the background summary when the turns it misses do not fit "
        f"(default: {DEFAULT_SUMMARY_WAIT_S:g} s on an engine that runs one call at a time, 0 on one "
        "that runs calls together); then the reply goes on without it",
    )
    chat.add_argument("--script", default=None, help="file with one user turn per line")
    chat.add_argument("--json", action="store_true", help="print one JSON object per turn")
    add_local_engine_arguments(chat)
    add_engine_arguments(chat)


def _turn_json(session: Any, reply: Any) -> dict[str, Any]:
    s, g = reply.stats, reply.stats.generation
    out: dict[str, Any] = {
        "turn": s.turn,
        "reply": reply.text,
        "prompt_tokens": s.prompt_tokens,
        "parts": dict(s.parts),
        "budget": s.context_tokens,
        "max_new_tokens": s.max_new_tokens,
        "summary_tokens": s.summary_tokens,  # tokens the summary takes in this prompt (kept: a contract)
        "summary_tokens_used": s.summary_tokens,
        "summary_tokens_cap": session.budget.summary_tokens,
        "evicted_turns": s.evicted_turns,
        "latency_s": round(s.latency_s, 4),
        "session_id": session.id,
        "finish_reason": reply.finish_reason.value,
        "summarized_turns": s.summarized_turns,
        "truncated_messages": s.truncated_messages,
        "passages_used": s.passages_used,
        "oom_retries": s.oom_retries,
        "summarize_s": round(s.summarize_s, 4),
        "hidden_turns": s.hidden_turns,
        "provisional_summary": s.provisional_summary,
        "summary": s.summary.to_dict() if s.summary is not None else None,
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


#: Exit status of ``convo chat --script`` when a reply was cut by ``--timeout``.
EXIT_TIMEOUT = 3

HELP = """commands:
  /help          this list
  /history       the stored conversation (what the model may still see is in /stats)
  /summary       the rolling summary of older turns
  /pin TEXT      pin TEXT to the prompt (never evicted)
  /stats         the last reply's token and memory figures
  /exit, /quit   leave (Ctrl-D too)
  //TEXT         send a message that starts with '/'
Ctrl-C cancels the reply being written."""


def _budget(args: argparse.Namespace, store: Any) -> Any:
    """The session's budget from the flags (unset flags: the stored session's, else
    :class:`Budget`'s own defaults), checked before any model loads."""
    given = {
        k: v
        for k, v in {
            "context_tokens": args.budget,
            "max_new_tokens": args.max_new_tokens,
            "window_turns": args.window,
            "summary_tokens": args.summary_tokens,
        }.items()
        if v is not None
    }
    if args.session and store.exists(args.session):
        if not given:
            return None  # the stored budget, as it is
        state, _ = store.load(args.session)
        return Budget.from_dict({**dict(state.settings.get("budget", {})), **given})
    return Budget(**given)


def _context_flags(args: argparse.Namespace, store: Any, budget: Any) -> dict[str, int | None]:
    """The token counts the flags set (or left at their defaults), named as a person would
    fix them, for :func:`~convo.cli.common.check_context_flags`."""
    if budget is None and args.session and store.exists(args.session):
        state, _ = store.load(args.session)
        stored = Budget.from_dict(dict(state.settings.get("budget", {})))
        return {f"--budget (session {args.session}'s stored budget)": stored.context_tokens}
    effective = budget or Budget()
    label = "--budget" if args.budget is not None else "--budget (default)"
    return {label: effective.context_tokens, "--max-new-tokens": args.max_new_tokens}


def _check_system_prompt(args: argparse.Namespace, budget: Any, counter: Any) -> None:
    """A ``--system`` prompt over the pinned cap is a flag error, named as such."""
    if not args.system or budget is None or counter is None:
        return

    cost = counter.message_tokens(system(args.system))
    if cost > budget.pinned_cap:
        raise ConfigError(
            f"--system is {cost} tokens, over the {budget.pinned_cap} the pinned part may take "
            f"(a quarter of the prompt room of --budget {budget.context_tokens}); shorten it or "
            "raise --budget"
        )


def _local_counter(model: str | None) -> Any:
    """The local model's token counter from its tokenizer alone (no weights), or ``None``
    when that cannot be had cheaply (a hub id, a GGUF not converted yet)."""
    if model is None or model == "default" or str(model).startswith("random:"):
        folder = cache_dir() / "models" / DEFAULT_MODEL_NAME
    else:
        folder = Path(model).expanduser()
    if not (folder / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return HFTokenCounter(AutoTokenizer.from_pretrained(str(folder), local_files_only=True))


def _build_session(args: argparse.Namespace) -> Any:
    store = open_sqlite_store(args.db or default_db_path())
    budget = _budget(args, store)  # bad flags fail here, in a second, before the model loads
    engine: Any
    if args.engine_url:  # a remote OpenAI-compatible server generates and summarizes
        engine = engine_from_args(args, default_context_tokens=(budget or Budget()).context_tokens)
        if budget is not None and budget.margin_tokens == 0:  # the engine adds its counting margin
            budget = engine.budget(**{k: v for k, v in budget.to_dict().items() if k != "margin_tokens"})
        _check_system_prompt(args, budget, engine.counter)
    else:
        check_local_model(args, _context_flags(args, store, budget))
        if args.system and budget is not None:
            _check_system_prompt(args, budget, _local_counter(args.model))

        with spinner("loading model") as update:
            engine = local_engine(args, (budget or Budget()).context_tokens, update)
        _check_system_prompt(args, budget, engine.counter)
    retriever = None
    if args.memory:  # a resumed session's stored turns are indexed at its first turn
        if RetrievalMemory is None:
            raise MissingDependency("--memory needs the retrieval extra; run: pip install 'convo[retrieval]'")
        with spinner("loading the embedder for --memory"):
            retriever = RetrievalMemory()
            _ = retriever.embedder.dim  # loads it now, not silently at the first turn
    return Session(
        engine,
        budget=budget,
        store=store,
        session_id=args.session,
        system_prompt=args.system,
        timeout_s=args.timeout,
        summary_wait_s=SUMMARY_WAIT_AUTO if args.summary_wait is None else args.summary_wait,
        retriever=retriever,
        clock=datetime.now if args.memory else None,  # "what did I say yesterday?"
    )


#: Seconds a reply may take to start before ``convo chat`` says on stderr that it waits
#: for the background summary (when one is being written), and between its later lines.
WAIT_NOTICE_AFTER_S = 3.0
WAIT_NOTICE_EVERY_S = 15.0


@contextmanager
def waiting_notice(session: Any, stream: Any = None) -> Iterator[Callable[[], None]]:
    """Say on ``stream`` (stderr) that a reply waits for the summary, while it does.

    When a summary is being written as the turn starts, and the reply has not begun after
    :data:`WAIT_NOTICE_AFTER_S`, a line says so and how long the turn waits at most
    (``Session.summary_wait_limit``); another follows every :data:`WAIT_NOTICE_EVERY_S`.
    Call the yielded function when the reply begins (leaving the block does too).
    """
    out = stream if stream is not None else sys.stderr
    state = session.summary_state
    started = threading.Event()
    if state.status not in (SummaryStatus.RUNNING, SummaryStatus.PENDING) or not state.pending_turns:
        yield started.set
        return
    limit = session.summary_wait_limit
    turns = f"turns {state.job_turns[0] + 1}-{state.job_turns[1]}" if state.job_turns else "older turns"
    bound = "no time limit" if limit is None else f"at most {limit:g} s, then the reply goes on without it"
    t0 = time.monotonic()

    def tell() -> None:
        if started.wait(WAIT_NOTICE_AFTER_S):
            return
        print(f"[convo] waiting for the summary of {turns} ({bound})", file=out, flush=True)
        while not started.wait(WAIT_NOTICE_EVERY_S):
            print(f"[convo] still waiting ({time.monotonic() - t0:.0f} s)", file=out, flush=True)

    teller = threading.Thread(target=tell, name="convo-wait-notice", daemon=True)
    teller.start()
    try:
        yield started.set
    finally:
        started.set()
        teller.join()


def _notes(reply: Any, args: argparse.Namespace) -> list[str]:
    """What a person should know about a reply beyond its text."""
    notes = []
    if reply.finish_reason is FinishReason.TIMEOUT:
        limit = f"the --timeout of {args.timeout:g} s" if args.timeout else "the engine's time limit"
        notes.append(f"reply cut: it hit {limit}")
    elif reply.finish_reason is FinishReason.LENGTH:
        notes.append(f"reply cut: it hit --max-new-tokens ({reply.stats.max_new_tokens})")
    elif reply.finish_reason is FinishReason.CANCELLED:
        notes.append("reply cancelled")
    if reply.stats.truncated_messages:
        notes.append(
            f"{reply.stats.truncated_messages} message(s) shortened in the middle to fit the "
            f"--budget of {reply.stats.context_tokens} tokens (stored whole)"
        )
    return notes


def _history(session: Any) -> str:
    lines = [f"{m.role.value}: {m.content}" for m in session.messages]
    return "\n".join(lines) or "(nothing stored yet)"


def _stats(reply: Any) -> str:
    """``/stats``: the last reply's token figures and, when the engine measures them, its
    memory (KV cache bytes, peak device or process memory)."""
    s = reply.stats
    parts = ", ".join(f"{k} {v}" for k, v in s.parts.items())
    text = (
        f"turn {s.turn}: prompt {s.prompt_tokens} of {s.context_tokens} tokens ({parts}); {s.latency_s:.2f} s"
    )
    g = s.generation
    if g is None or g.memory_kind in ("none", "remote") or not (g.kv_bytes or g.peak_allocated_bytes):
        return text + "\nmemory: not measured by this engine"
    mib = 1 << 20
    return (
        f"{text}\nmemory: KV cache {g.kv_bytes / mib:.1f} MiB for {g.kv_tokens} tokens; "
        f"peak {g.memory_kind} allocated {g.peak_allocated_bytes / mib:.1f} MiB, "
        f"reserved {g.peak_reserved_bytes / mib:.1f} MiB"
    )


def run_chat(args: argparse.Namespace) -> int:
    """``convo chat``: a scripted chat (``--script``) or an interactive one; the exit status."""
    if args.script:
        read_script(args.script)  # a missing or unreadable file fails before the model loads
    progress_bars_only_on_a_terminal(sys.stderr)
    session = _build_session(args)
    if args.memory and session.turn_count:
        print(
            f"[convo] --memory: the {session.turn_count} stored turns are indexed at the first turn",
            file=sys.stderr,
            flush=True,
        )
    try:
        return _script(session, args) if args.script else _interactive(session, args)
    finally:
        session.close()
        session.engine.close()  # join the engine's threads before the interpreter exits


def read_script(path: str) -> list[str]:
    """The user turns of ``--script``: its non-blank lines, decoded as UTF-8.

    Raises:
        ConfigError: no such file, a folder, not UTF-8 text, or unreadable; the message
            names ``--script``.
    """
    where = Path(path)
    if not where.exists():
        raise ConfigError(f"--script {path}: no such file")
    if where.is_dir():
        raise ConfigError(f"--script {path}: a folder, not a file of turns")
    try:
        text = where.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"--script {path}: not UTF-8 text (byte {exc.start}: {exc.reason}); save it as UTF-8"
        ) from None
    except OSError as exc:
        raise ConfigError(f"--script {path}: cannot read it ({exc.strerror or exc})") from None
    return [line for line in text.splitlines() if line.strip()]


def _script(session: Any, args: argparse.Namespace) -> int:

    out, status = sys.stdout, 0
    for line in read_script(args.script):
        with waiting_notice(session):
            reply = session.send(line)
        if args.json:
            out.write(json.dumps(_turn_json(session, reply), ensure_ascii=False) + "\n")
        else:
            out.write(f"you> {line}\nbot> {reply.text}\n")
        out.flush()
        for note in _notes(reply, args):
            print(f"[convo] turn {reply.stats.turn}: {note}", file=sys.stderr)
        if reply.finish_reason is FinishReason.TIMEOUT:
            status = EXIT_TIMEOUT
    return status


def _interactive(session: Any, args: argparse.Namespace) -> int:
    print(
        f"[convo] session {session.id} (resume with --session {session.id}); /help for commands, "
        "/exit to quit",
        file=sys.stderr,
    )
    last = None
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        except KeyboardInterrupt:
            print("\n(/exit or Ctrl-D to quit)", file=sys.stderr)
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        try:
            last = _handle(session, line, text, args, last)
        except ConvoError as exc:  # one bad message or command does not end the chat
            print(f"convo: error: {exc}", file=sys.stderr)
    return 0


def _handle(session: Any, line: str, text: str, args: argparse.Namespace, last: Any) -> Any:
    """Run one interactive line: a /command, or a message to the model. Returns the last reply."""
    out = sys.stdout
    if text.startswith("/") and not text.startswith("//"):
        command, _, rest = text.partition(" ")
        if command == "/help":
            print(HELP)
        elif command == "/history":
            print(_history(session))
        elif command == "/summary":
            print(session.summary or "(no summary yet)")
        elif command == "/pin" and rest.strip():
            session.pin(rest.strip())
            print(f"pinned ({sum(m.pinned for m in session.messages)} pinned message(s))")
        elif command == "/stats":
            print(_stats(last) if last is not None else "(no reply yet)")
        else:
            print(f"unknown command {command!r}; /help lists them", file=sys.stderr)
        return last
    if text.startswith("//"):
        line = line.lstrip()[1:]
    out.write("bot> ")
    out.flush()
    with waiting_notice(session) as begun:
        stream = session.stream(line)
        try:
            for chunk in stream:
                begun()
                out.write(chunk)
                out.flush()
        except KeyboardInterrupt:
            stream.close()  # cancels the reply; the session stays usable
    out.write("\n")
    reply = stream.result
    if reply is None:
        return last
    for note in _notes(reply, args):
        print(f"[{note}]", file=sys.stderr)
    if args.json:
        print(json.dumps(_turn_json(session, reply)), file=sys.stderr)
    return reply
