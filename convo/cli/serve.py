"""``convo serve``: build the engine, the store and the app, then run uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from typing import Any

from convo.budget import Budget
from convo.cli.common import (
    check_local_model,
    default_db_path,
    engine_from_args,
    local_engine,
    serve_memory_fit,
    spinner,
)
from convo.embeddings import Embedder, default_model_path
from convo.engines.local.loading import DEFAULT_MODEL_NAME, check_model
from convo.errors import ConfigError, MissingDependency, ModelLoadError
from convo.retrieval.hashing import FAKE_EMBEDDER_ENV, HashingEncoder
from convo.server.app import create_app
from convo.server.documents import DocumentLimits, Documents
from convo.server.limits import ServerLimits
from convo.server.memory import DEFAULT_EMBEDDING_DEVICE, DEFAULT_MEMORY_CACHE_BYTES, ServerMemory
from convo.stores import RedisStore, SQLiteStore, Store, redact_url
from convo.testing import EchoEngine

try:
    import uvicorn
except ImportError:  # the server extra installs it
    raise MissingDependency("the server needs uvicorn; run: pip install 'convo[server]'") from None

#: The only test hook: ``CONVO_FAKE_ENGINE=1`` makes :func:`run_server` serve a tiny
#: deterministic engine instead of loading a model (used by the multi-process tests).
FAKE_ENGINE_ENV = "CONVO_FAKE_ENGINE"


def _loopback(host: str) -> bool:
    return host in ("127.0.0.1", "::1", "localhost") or host.startswith("127.")


#: The format of the server's log lines on stderr.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    """Send the ``convo`` loggers (the request log included) to stderr at ``level``
    (``debug``, ``info``, ``warning``, ``error``), once."""
    log = logging.getLogger("convo")
    log.setLevel(level.upper())
    if not any(getattr(h, "convo_serve", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        handler.convo_serve = True  # type: ignore[attr-defined]
        log.addHandler(handler)


def run_server(args: argparse.Namespace) -> int:
    """``convo serve``: build the engine, the store and the app, then run uvicorn."""
    level = getattr(args, "log_level", "info")
    configure_logging(level)
    api_key = args.api_key or os.environ.get("CONVO_API_KEY") or None
    if not _loopback(args.host) and not api_key:
        raise ConfigError(
            f"refusing to serve on {args.host} without an API key: pass --api-key (or set CONVO_API_KEY), "
            "or bind 127.0.0.1"
        )
    given = {
        "context_tokens": args.budget,
        "max_new_tokens": args.max_new_tokens,
        "window_turns": getattr(args, "window_turns", None),
        "summary_tokens": getattr(args, "summary_tokens", None),
    }
    budget = Budget(**{k: v for k, v in given.items() if v is not None})  # Budget's own defaults
    _check_port_free(args.host, args.port)  # before minutes of loading, not after
    chosen = getattr(args, "embedding_model", None)
    if chosen is not None and not getattr(args, "no_memory", False) and not os.path.isdir(chosen):
        raise ConfigError(
            f"--embedding-model {chosen!r} is not a folder (a local sentence-transformers model)"
        )
    limits = ServerLimits(generation_timeout_s=getattr(args, "timeout", None))
    store: Store
    if args.redis:
        store = RedisStore(args.redis, lock_lease_s=getattr(args, "lock_lease_s", 30.0))
    else:
        store = SQLiteStore(args.db or default_db_path())
    engine: Any
    if getattr(args, "engine_url", None):  # a remote OpenAI-compatible engine
        engine = engine_from_args(args, default_context_tokens=budget.context_tokens)
        budget = engine.budget(
            context_tokens=budget.context_tokens,
            max_new_tokens=budget.max_new_tokens,
            **{k: v for k, v in given.items() if k in ("window_turns", "summary_tokens") and v is not None},
        )
        name = args.engine_model or engine.model
    elif os.environ.get(FAKE_ENGINE_ENV) == "1":  # test-only hook (see FAKE_ENGINE_ENV)
        engine, name = EchoEngine(delay_s=float(os.environ.get("CONVO_FAKE_DELAY_S", "0"))), "echo"
    else:
        check_model(args.model)
        # --budget and --max-new-tokens against the model's own context, before any weight loads
        check_local_model(
            args, {"--budget": budget.context_tokens, "--max-new-tokens": budget.max_new_tokens}
        )
        # --gpu-memory: the slots (and int4 layouts) that fit, or a refusal, before any weight loads
        fit = serve_memory_fit(args, budget.context_tokens)
        if fit is not None:
            print(f"[convo] --gpu-memory: {fit.describe()}", file=sys.stderr, flush=True)
        with spinner("loading model") as update:
            engine = local_engine(args, budget.context_tokens, update)
        name = os.path.basename(str(args.model).rstrip("/")) if args.model else DEFAULT_MODEL_NAME
    memory = server_memory(args, store)
    documents = server_documents(args, memory)
    app = create_app(
        engine,
        store=store,
        api_key=api_key,
        budget=budget,
        limits=limits,
        model_name=name,
        session_from_user=args.session_from_user,
        allowed_hosts=[args.host],
        allowed_origins=getattr(args, "allow_origin", []),
        system_prompt=getattr(args, "system_prompt", None),
        memory=memory,
        documents=documents,
    )
    where = f"redis {redact_url(args.redis)}" if args.redis else f"sqlite {args.db or default_db_path()}"

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:  # say where, once the socket is really bound
                for server in self.servers:
                    for sock in server.sockets:
                        host, port = sock.getsockname()[:2]
                        shown = f"[{host}]" if ":" in host else host
                        print(
                            f"[convo] listening on http://{shown}:{port}/v1 (model {name}, sessions in "
                            f"{where}, budget {budget.context_tokens} tokens); Ctrl-C to stop",
                            file=sys.stderr,
                            flush=True,
                        )

    try:
        # convo logs each request itself (convo.server.access): no uvicorn access log.
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=level, access_log=False)
        Server(config).run()
    finally:
        store.close()
        engine.close()  # join the engine's threads before the interpreter exits
    return 0


def _check_port_free(host: str, port: int) -> None:
    """Refuse a port another process listens on now, naming the flag (port 0: any).

    Raises:
        ConfigError: the address is in use or cannot be bound.
    """
    if not port:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigError(
                f"--port {port}: cannot listen on {host}:{port} ({exc.strerror}); pick another"
            ) from exc


def server_memory(args: argparse.Namespace, store: Store) -> ServerMemory | None:
    """The server's retrieval memory: off with ``--no-memory``, and (with a log line) where
    the default embedding model is not installed or cannot load; a :class:`HashingEncoder`
    with ``CONVO_FAKE_EMBEDDER=1`` or the fake engine (``CONVO_FAKE_ENGINE=1``, tests).

    Raises:
        ConfigError: ``--embedding-model`` names a model that cannot load (asked for by
            name, it is not turned off quietly)."""
    if getattr(args, "no_memory", False):
        return None
    mb = getattr(args, "memory_cache_mb", None)
    cache = DEFAULT_MEMORY_CACHE_BYTES if mb is None else mb << 20
    chosen = getattr(args, "embedding_model", None)
    embedder: Any
    if os.environ.get(FAKE_EMBEDDER_ENV) == "1" or os.environ.get(FAKE_ENGINE_ENV) == "1":
        embedder = HashingEncoder()  # test hooks: no model behind the fake engine either
    else:
        device = getattr(args, "embedding_device", None) or DEFAULT_EMBEDDING_DEVICE
        embedder = Embedder(chosen, device=device, process=getattr(args, "embedding_process", True))
        try:
            if chosen is None:
                default_model_path()
            # Loaded now, not inside the first turn that indexes (which holds its session's
            # lock); a model that cannot load turns memory off here, not every turn later.
            embedder.encode(["warm up"])
        except (MissingDependency, ModelLoadError) as exc:
            if chosen is not None:
                raise ConfigError(f"--embedding-model {chosen!r}: {exc}") from exc
            logging.getLogger("convo.serve").warning("retrieval memory is off: %s", exc)
            return None
    return ServerMemory(store, embedder, cache_bytes=cache)


def server_documents(args: argparse.Namespace, memory: ServerMemory | None) -> Documents | None:
    """Files and vector stores, with the memory's embedder (none without it), within the
    limits the flags give (:class:`DocumentLimits` for the rest)."""
    if memory is None:
        return None
    given = {
        "max_file_bytes": None if getattr(args, "max_file_mb", None) is None else args.max_file_mb << 20,
        "max_chunks_per_store": getattr(args, "max_chunks_per_store", None),
        "max_stores_per_key": getattr(args, "max_vector_stores", None),
    }
    limits = DocumentLimits(**{k: v for k, v in given.items() if v is not None})
    return Documents(memory.store, memory.embedder, limits=limits)
