"""``convo chat``: an interactive chat, or a scripted one (``--script FILE --json``)."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

from convo.cli.common import default_db_path, engine_from_args, local_engine, spinner
from convo.errors import ConfigError, ConvoError


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
    from convo.budget import Budget

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


def _check_system_prompt(args: argparse.Namespace, budget: Any, counter: Any) -> None:
    """A ``--system`` prompt over the pinned cap is a flag error, named as such."""
    if not args.system or budget is None or counter is None:
        return
    from convo.messages import system

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
    from convo.engines.models import DEFAULT_MODEL_NAME
    from convo.paths import cache_dir

    if model is None or model == "default" or str(model).startswith("random:"):
        folder = cache_dir() / "models" / DEFAULT_MODEL_NAME
    else:
        folder = Path(model).expanduser()
    if not (folder / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    from convo.tokens import HFTokenCounter

    return HFTokenCounter(AutoTokenizer.from_pretrained(str(folder), local_files_only=True))


def _build_session(args: argparse.Namespace) -> Any:
    from convo.engines.models import check_model
    from convo.session import Session
    from convo.store import SQLiteStore

    store = SQLiteStore(args.db or default_db_path())
    budget = _budget(args, store)  # bad flags fail here, in a second, before the model loads
    engine: Any
    if args.engine_url:  # a remote OpenAI-compatible server generates and summarizes
        from convo.budget import Budget

        engine = engine_from_args(args, default_context_tokens=(budget or Budget()).context_tokens)
        if budget is not None and budget.margin_tokens == 0:  # the engine adds its counting margin
            budget = engine.budget(**{k: v for k, v in budget.to_dict().items() if k != "margin_tokens"})
        _check_system_prompt(args, budget, engine.counter)
    else:
        check_model(args.model)
        if args.system and budget is not None:
            _check_system_prompt(args, budget, _local_counter(args.model))
        from convo.budget import Budget

        with spinner("loading model") as update:
            engine = local_engine(args, (budget or Budget()).context_tokens, update)
        _check_system_prompt(args, budget, engine.counter)
    retriever = None
    if args.memory:  # a resumed session's stored turns are indexed at its first turn
        from convo.retrieval import RetrievalMemory

        retriever = RetrievalMemory()
    return Session(
        engine,
        budget=budget,
        store=store,
        session_id=args.session,
        system_prompt=args.system,
        timeout_s=args.timeout,
        retriever=retriever,
        clock=datetime.now if args.memory else None,  # "what did I say yesterday?"
    )


def _notes(reply: Any, args: argparse.Namespace) -> list[str]:
    """What a person should know about a reply beyond its text."""
    from convo.engines.base import FinishReason

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


def _chat(args: argparse.Namespace) -> int:
    if args.script and not Path(args.script).is_file():
        raise ConfigError(f"--script {args.script}: no such file")
    session = _build_session(args)
    try:
        return _script(session, args) if args.script else _interactive(session, args)
    finally:
        session.close()
        close = getattr(session.engine, "close", None)
        if close is not None:  # join the engine's threads before the interpreter exits
            close()


def _script(session: Any, args: argparse.Namespace) -> int:
    from convo.engines.base import FinishReason

    out, status = sys.stdout, 0
    for line in Path(args.script).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
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
    stream = session.stream(line)
    try:
        for chunk in stream:
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
