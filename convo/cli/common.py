"""What the subcommands share: the session database's place, a progress spinner, and the
engine flags (local ``--quant``/``--kv-slots``, remote ``--engine-*``)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sqlite3
import struct
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlparse

from convo.engines.local.config import TOOL_PARSER_CHOICES
from convo.engines.local.engine import TransformersEngine
from convo.engines.local.loading import DEFAULT_MODEL_NAME, check_model, default_gguf_path, looks_like_path
from convo.engines.openai import OpenAIEngine
from convo.errors import ConfigError, ConvoError
from convo.models import BUILTIN_CONFIGS, INT4_KERNELS, Quant, format_size, load_config
from convo.models.defaults import KV_DTYPE_CHOICES
from convo.models.spec import random_config_path
from convo.models.units import parse_size
from convo.paths import cache_dir
from convo.planner.fit import (
    FIT_HEADROOM_FRACTION,
    FIT_MIN_HEADROOM_BYTES,
    ServeFit,
    fit_serve,
    memory_limit_bytes,
)
from convo.stores import SQLiteStore

#: ``--quant`` of ``convo chat``/``serve``: every :class:`Quant` the local engine loads
#: (``fp4`` is priced by ``convo plan`` only; ``none``, the checkpoint's own dtype, is the
#: planner's spelling).
ENGINE_QUANTS = tuple(q.value for q in Quant if q not in (Quant.FP4, Quant.NONE))

#: Exit status of a bad flag or a :class:`~convo.errors.ConvoError` (argparse's own, too).
EXIT_ERROR = 2
#: Exit status when Ctrl-C ends ``convo`` (128 + SIGINT, as shells report it).
EXIT_INTERRUPTED = 130


def default_db_path() -> Path:
    """Where ``convo chat`` keeps sessions: ``$CONVO_HOME/sessions.db``, else
    ``$XDG_DATA_HOME/convo/sessions.db``, else ``~/.local/share/convo/sessions.db``."""
    home = os.environ.get("CONVO_HOME")
    if home:
        return Path(home) / "sessions.db"
    data = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(data) / "convo" / "sessions.db"


def open_sqlite_store(path: str | os.PathLike[str], flag: str = "--db") -> SQLiteStore:
    """The :class:`SQLiteStore` at ``path``, the value of ``flag``.

    Raises:
        ConfigError: ``path`` is a folder, a file that is not a SQLite database, or cannot
            be opened or created; the message names ``flag``.
    """
    where = Path(path)
    if where.is_dir():
        raise ConfigError(f"{flag} {path}: a folder; give a file, e.g. {where / 'sessions.db'}")
    try:
        return SQLiteStore(where)
    except sqlite3.DatabaseError as exc:  # "file is not a database", "unable to open database file"
        raise ConfigError(f"{flag} {path}: not a usable SQLite session database ({exc})") from None
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot create it ({exc.strerror or exc})") from None


@contextmanager
def spinner(message: str, stream: TextIO = sys.stderr) -> Iterator[Callable[[str], None]]:
    """Report a slow step as plain lines on ``stream``: ``message``, each progress text passed
    to the yielded ``update``, then ``ready in N s`` on success or ``failed after N s`` when
    the step raised. Plain lines (no carriage-return animation) never fight with other
    progress output (transformers' bars) for the same terminal line."""
    started = time.monotonic()
    print(f"[convo] {message}", file=stream, flush=True)

    def update(text: str) -> None:
        print(f"[convo] {text}", file=stream, flush=True)

    try:
        yield update
    except BaseException:
        print(f"[convo] failed after {time.monotonic() - started:.1f} s", file=stream, flush=True)
        raise
    print(f"[convo] ready in {time.monotonic() - started:.1f} s", file=stream, flush=True)


def _whole_number(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {minimum}, got {value}")
        return value

    return parse


#: argparse type: an int >= 1 (one message for 0 and for negatives).
positive_int = _whole_number(1)
#: argparse type: an int >= 0.
non_negative_int = _whole_number(0)


def positive_seconds(text: str) -> float:
    """argparse type: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be seconds > 0, got {text}")
    return value


def non_negative_seconds(text: str) -> float:
    """argparse type: a number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be seconds >= 0, got {text}")
    return value


def add_local_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The local engine's ``--quant`` and ``--kv-slots`` (static KV slots sized to the
    session budget)."""
    parser.add_argument(
        "--quant",
        default=Quant.AUTO.value,
        choices=ENGINE_QUANTS,
        help="weight format (default auto: nf4 on CUDA, fp32 on CPU; int4: the fast static decoder)",
    )
    parser.add_argument(
        "--kv-slots",
        type=non_negative_int,
        default=None,
        help=(
            "static KV slots of --budget tokens, taken at load (default: 8 on CUDA, fewer if memory is"
            " short; on CPU 0, plain generate, or 2 with --quant int4; 0 = off)"
        ),
    )
    parser.add_argument(
        "--kv-dtype",
        default="auto",
        choices=KV_DTYPE_CHOICES,
        help="how the KV slots store K/V: auto (the model's dtype) or fp8 (e4m3 with a scale per "
        "token and head: about half the bytes of bf16, twice the slots; needs slots, so on CPU it "
        "takes 2 by default)",
    )
    add_int4_kernel_argument(parser)
    add_int4_dense_copy_argument(parser)
    parser.add_argument(
        "--tool-parser",
        default="auto",
        choices=TOOL_PARSER_CHOICES,
        help="how tool calls are read out of the model's replies (default auto: from the chat "
        "template; none: the model gets no tools)",
    )


def kv_host_memory_size(text: str) -> int:
    """A size flag (``--kv-host-memory``, ``--int4-dense-copy``): ``16GiB``, ``512MB``,
    bytes, or ``0`` (off)."""
    if text.strip() == "0":
        return 0
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_kv_host_memory_argument(parser: argparse.ArgumentParser) -> None:
    """``--kv-host-memory``: host memory for the KV of sessions evicted from their slots."""
    parser.add_argument(
        "--kv-host-memory",
        type=kv_host_memory_size,
        default=None,
        help="with KV slots: host memory for the KV of sessions whose slot was given to another "
        "(their next turn copies it back instead of recomputing it), e.g. 32GiB; 0 = off "
        "(default: half the RAM, at most half of what is free and 8 KV pools on CUDA, 2 on CPU)",
    )


def add_context_shift_argument(parser: argparse.ArgumentParser) -> None:
    """``--context-shift``: reuse a session's kept turns after a slide (not exact)."""
    parser.add_argument(
        "--context-shift",
        action="store_true",
        help="with KV slots: when a session's window slides, move the turns it kept to their new "
        "positions instead of prefilling them again (llama.cpp's context shift; faster, not exact: "
        "a reply can differ from one on a recomputed prompt)",
    )


def add_int4_kernel_argument(parser: argparse.ArgumentParser) -> None:
    """``--int4-kernel``: which int4 weight layouts ``--quant int4`` keeps."""
    parser.add_argument(
        "--int4-kernel",
        default="auto",
        choices=INT4_KERNELS,
        help="with --quant int4: auto keeps tinygemm's and the Triton kernel's layouts on CUDA "
        "(fastest at every batch size, twice the int4 weight bytes); triton or tinygemm keep one",
    )


def add_int4_dense_copy_argument(parser: argparse.ArgumentParser) -> None:
    """``--int4-dense-copy``: dense copies of the int4 weights for prefill speed."""
    parser.add_argument(
        "--int4-dense-copy",
        type=kv_host_memory_size,
        default=0,
        metavar="SIZE",
        help="with --quant int4 on KV slots: keep dense copies of the int4 weights, whole layers up "
        "to SIZE (e.g. 13GiB; Llama-2-7B takes 12.1 GiB for all): mixed steps and prefill chunks "
        "multiply them instead of dequantizing each forward (default 0: none)",
    )


def local_engine(args: argparse.Namespace, context_tokens: int, progress: Any) -> Any:
    """The local :class:`TransformersEngine` the flags ask for; a KV slot holds one session's
    whole budget (``context_tokens``); ``--gpu-memory`` / ``--gpu-memory-utilization`` size it."""
    return TransformersEngine(
        args.model,
        quant=args.quant,
        device=getattr(args, "device", None),
        kv_slots=getattr(args, "kv_slots", None),
        kv_dtype=getattr(args, "kv_dtype", "auto"),
        slot_tokens=context_tokens,
        int4_kernel=getattr(args, "int4_kernel", "auto"),
        int4_dense_copy_bytes=getattr(args, "int4_dense_copy", 0),
        tool_parser=getattr(args, "tool_parser", "auto"),
        progress=progress,
        **_kv_host_memory(args),
        **_context_shift(args),
        **memory_kwargs(args),
    )


def _context_shift(args: argparse.Namespace) -> dict[str, Any]:
    """``--context-shift`` when given (commands without the flag keep the engine's default)."""
    return {"context_shift": True} if getattr(args, "context_shift", False) else {}


def _kv_host_memory(args: argparse.Namespace) -> dict[str, Any]:
    """``--kv-host-memory`` as given, else the engine's default; commands without the flag
    (``convo chat``: one conversation, never evicted from its slot) take none, rather than
    page-locking a share of the RAM at start for nothing."""
    if not hasattr(args, "kv_host_memory"):
        return {"kv_host_memory": 0}
    value = args.kv_host_memory
    return {} if value is None else {"kv_host_memory": value}


def memory_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's ``gpu_memory`` / ``gpu_memory_utilization`` from the flags (absent when unset)."""
    out: dict[str, Any] = {}
    if getattr(args, "gpu_memory", None) is not None:
        out["gpu_memory"] = args.gpu_memory
    if getattr(args, "gpu_memory_utilization", None) is not None:
        out["gpu_memory_utilization"] = args.gpu_memory_utilization
    return out


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    """``--gpu-memory`` and ``--gpu-memory-utilization``: a server that sizes itself."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--gpu-memory",
        default=None,
        help="size the server to this much GPU memory, with a unit (24GiB, 16GB): the planner picks "
        "the KV slots of --budget tokens, and with --quant int4 one weight layout or both, to fit "
        f"with a headroom ({FIT_HEADROOM_FRACTION:.0%}%, at least {format_size(FIT_MIN_HEADROOM_BYTES)}); "
        "a setting that cannot fit is refused before loading, naming the largest that does; "
        "--kv-slots and --int4-kernel, when given, win and are checked",
    )
    group.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="the same as a share of the GPU's total memory, as vLLM spells it (e.g. 0.9)",
    )


def serve_memory_fit(args: argparse.Namespace, context_tokens: int) -> ServeFit | None:
    """What ``--gpu-memory`` (or ``--gpu-memory-utilization``) makes the server take, priced
    before anything loads: ``None`` without either flag (or when the model's config cannot be
    read without loading it: the engine sizes itself once it has loaded).

    Raises:
        ConfigError: it cannot fit, naming the largest safe setting; or the server is not
            on CUDA.
    """
    gpu_memory = getattr(args, "gpu_memory", None)
    utilization = getattr(args, "gpu_memory_utilization", None)
    if gpu_memory is None and utilization is None:
        return None
    total = _cuda_total_bytes()
    limit = memory_limit_bytes(gpu_memory, utilization, total)
    config = model_config(args.model)
    fit = None
    if config is not None:
        kv_slots = getattr(args, "kv_slots", None)
        if kv_slots == 0:
            raise ConfigError("--gpu-memory sizes the KV slots: not with --kv-slots 0")
        fit = fit_serve(
            config,
            memory_bytes=int(limit or 0),
            slot_tokens=context_tokens,
            quant=args.quant,
            kv_dtype=getattr(args, "kv_dtype", None),
            kv_slots=kv_slots,
            int4_kernel=getattr(args, "int4_kernel", "auto"),
        )
    device = getattr(args, "device", None)
    if (device and not str(device).startswith("cuda")) or total is None:
        raise ConfigError("--gpu-memory sizes a CUDA server; no CUDA device here (pass --kv-slots on CPU)")
    return fit


def _cuda_total_bytes() -> int | None:
    try:
        import torch
    except ImportError:
        return None
    return int(torch.cuda.mem_get_info(0)[1]) if torch.cuda.is_available() else None


def model_config(model: str | os.PathLike[str] | None) -> Mapping[str, Any] | None:
    """``model``'s config without loading it: a built-in or ``random:`` name, a folder or
    ``config.json`` (:func:`~convo.models.load_config`), a hub id's cached ``config.json``;
    ``None`` when it cannot be read that cheaply."""
    name = "default" if model is None else os.fspath(model)
    try:
        return load_config(name)
    except ConfigError:
        pass
    if looks_like_path(name):
        return None
    cached = _hub_config(name)
    return _read_config(cached) if cached is not None else None


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
        type=positive_int,
        default=None,
        help="the engine's context length in tokens (default: from /v1/models, else --budget)",
    )


def engine_from_args(args: Any, *, default_context_tokens: int) -> OpenAIEngine:
    """The engine ``convo chat`` / ``convo serve`` build from ``--engine-*`` flags.

    ``--engine-context`` wins; else the window ``/v1/models`` lists; else (llama.cpp's
    Python server and others do not list it) ``default_context_tokens``, the session
    budget's, with a note on stderr. The API key may also come from
    ``$CONVO_ENGINE_API_KEY``.
    """
    engine = OpenAIEngine(
        args.engine_url,
        args.engine_model,
        api_key=args.engine_api_key or os.environ.get("CONVO_ENGINE_API_KEY") or None,
        tokenizer=args.engine_tokenizer,
        context_window=args.engine_context,
        timeout_s=getattr(args, "timeout", None) or 60.0,
    )
    if args.engine_context is None:
        try:
            _ = engine.server_context_window
        except ConfigError:
            print(
                f"[convo] {engine.base_url} does not list its context length; assuming "
                f"{default_context_tokens} (pass --engine-context N)",
                file=sys.stderr,
            )
            engine.assume_context_window(default_context_tokens)
    return engine


# -- flags checked against the model's context, before any weight loads -------------------

#: Config keys that state a model's context length, read in this order (transformers'
#: ``max_position_embeddings`` first; GPT-2 style ``n_positions``; others').
CONTEXT_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")

#: How many metadata entries of a GGUF header :func:`model_context_tokens` reads looking for
#: ``<arch>.context_length`` (it comes in the first few; the tokenizer's arrays come later).
GGUF_MAX_HEADER_ENTRIES = 64

_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_context_length(path: Path) -> int | None:
    """``<general.architecture>.context_length`` from a GGUF file's header, or ``None``."""

    def read(fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        data = f.read(size)
        if len(data) != size:
            raise ValueError("truncated GGUF header")
        return struct.unpack("<" + fmt, data)[0]

    def string() -> str:
        return f.read(read("Q")).decode("utf-8", "replace")

    def value(kind: int) -> Any:
        if kind == _GGUF_STRING:
            return string()
        if kind == _GGUF_ARRAY:
            inner, n = read("I"), read("Q")
            for _ in range(n):
                value(inner)
            return None
        return read(_GGUF_SCALARS[kind])

    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return None
            read("I")  # version
            read("Q")  # tensor count
            entries = read("Q")
            arch = None
            for _ in range(min(entries, GGUF_MAX_HEADER_ENTRIES)):
                key, kind = string(), read("I")
                got = value(kind)
                if key == "general.architecture":
                    arch = got
                elif arch is not None and key == f"{arch}.context_length":
                    return int(got)
    except (OSError, ValueError, KeyError, struct.error):
        return None
    return None


def _config_context_length(config: Mapping[str, Any]) -> int | None:
    for cfg in (config, config.get("text_config") or {}):
        for key in CONTEXT_LENGTH_KEYS:
            value = cfg.get(key) if isinstance(cfg, Mapping) else None
            if isinstance(value, int) and value > 0:
                return value
    return None


def _read_config(path: Path) -> Mapping[str, Any] | None:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, Mapping) else None


def _hub_config(model: str) -> Path | None:
    """The cached ``config.json`` of hub id ``model``, or ``None`` (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(model, "config.json")
    except Exception:  # an id the hub library refuses (not a repo id): not cached
        return None
    return Path(found) if isinstance(found, str) else None


def model_context_tokens(model: str | os.PathLike[str] | None) -> int | None:
    """The context length ``model`` declares, from its config alone: no weights, no network.

    ``None`` or ``"default"``: the embedded model (its converted folder, else its GGUF);
    ``random:NAME``: :data:`~convo.models.BUILTIN_CONFIGS`; ``random:<folder or
    config.json>``: that config; a folder: its
    ``config.json`` (:data:`CONTEXT_LENGTH_KEYS`, also under ``text_config``); a ``.gguf``
    file: ``<arch>.context_length`` in its header; a hub id: its cached ``config.json``.
    ``None`` when it cannot be known that cheaply (a hub id not downloaded yet).
    """
    name = "default" if model is None else os.fspath(model)
    if name == "default":
        folder = cache_dir() / "models" / DEFAULT_MODEL_NAME
        if (folder / "config.json").is_file():
            return model_context_tokens(folder)
        try:
            return _gguf_context_length(default_gguf_path())
        except ConvoError:  # not installed: the load says so
            return None
    if name in BUILTIN_CONFIGS:
        return _config_context_length(BUILTIN_CONFIGS[name])
    random_config = random_config_path(name)
    if random_config is not None:
        config = _read_config(random_config)
        return _config_context_length(config) if config is not None else None
    path = Path(name).expanduser()
    if path.is_dir():
        config = _read_config(path / "config.json")
        return _config_context_length(config) if config is not None else None
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_context_length(path)
    if looks_like_path(name):
        return None
    cached = _hub_config(name)
    config = _read_config(cached) if cached is not None else None
    return _config_context_length(config) if config is not None else None


def check_context_flags(model: str | os.PathLike[str] | None, flags: Mapping[str, int | None]) -> int | None:
    """Check token-count flags against the context length ``model`` declares, before any
    weight loads (:func:`model_context_tokens`: config.json or GGUF metadata).

    Args:
        model: the ``--model`` value (``None``: the embedded default).
        flags: each flag as the user would read it (``"--budget"``, or ``"--budget (default)"``
            for a value the flag left at its default) and its value; ``None`` values are
            skipped.

    Returns:
        The model's context length, or ``None`` when it is not known without loading (the
        engine then checks at load).

    Raises:
        ConfigError: a value over the model's context, naming the flag and the limit.
    """
    limit = model_context_tokens(model)
    if limit is None:
        return None
    shown = "the embedded default model" if model in (None, "default") else os.fspath(model)
    for flag, value in flags.items():
        if value is not None and value > limit:
            bare = flag.split(" ")[0]
            raise ConfigError(
                f"{flag} {value} is over the {limit}-token context of {shown} (its "
                f"max_position_embeddings); pass {bare} {limit} or less"
            )
    return limit


# -- a model argument checked before anything loads ------------------------------------------

#: Files that hold a checkpoint's weights; a model folder needs one of them.
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json", "*.pt", "*.pth")
#: Files that hold a tokenizer; a model folder needs one of them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
#: Seconds ``convo`` waits to reach the Hugging Face hub before it says a model that is not
#: cached cannot be downloaded (instead of transformers' retries, ~47 s).
HUB_PROBE_TIMEOUT_S = 3.0
#: Environment variables that say "no network" to the Hugging Face libraries.
OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def _is_set(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def check_model_folder(model: str | os.PathLike[str] | None, flag: str = "--model") -> None:
    """A model folder must hold a config, weights and a tokenizer: say which is missing
    (transformers would blame an unrelated package, such as sentencepiece).

    Raises:
        ConfigError: ``model`` is a folder without ``config.json``, any of
            :data:`WEIGHT_FILES` or any of :data:`TOKENIZER_FILES`.
    """
    if model is None:
        return
    folder = Path(os.fspath(model)).expanduser()
    if not folder.is_dir():
        return
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if not any(next(folder.glob(pattern), None) for pattern in WEIGHT_FILES):
        missing.append("weights (*.safetensors or pytorch_model*.bin)")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        missing.append("tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    if missing:
        raise ConfigError(
            f"{flag} {os.fspath(model)}: the folder has no {' and no '.join(missing)}; give a "
            "complete model folder (as save_pretrained writes it), a .gguf file, or a hub id"
        )


def _hub_reachable(timeout_s: float) -> bool:
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    url = urlparse(endpoint)
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        with socket.create_connection((url.hostname or "huggingface.co", port), timeout=timeout_s):
            return True
    except OSError:
        return False


def check_hub_model(model: str | os.PathLike[str] | None, flag: str = "--model") -> None:
    """A hub id that is not in the local cache fails at once when it cannot be downloaded:
    with ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) set, or when the hub does not
    answer within :data:`HUB_PROBE_TIMEOUT_S`.

    Raises:
        ConfigError: the model cannot be had, naming the flag and what to do.
    """
    if model is None:
        return
    name = os.fspath(model)
    if name == "default" or name.startswith("random:") or looks_like_path(name) or _hub_config(name):
        return
    offline = [v for v in OFFLINE_ENV if _is_set(v)]
    if offline:
        reason = f"{offline[0]} is set"
    elif not _hub_reachable(HUB_PROBE_TIMEOUT_S):
        reason = f"the Hugging Face hub did not answer within {HUB_PROBE_TIMEOUT_S:g} s"
    else:
        return
    raise ConfigError(
        f"{flag} {name}: not in the local Hugging Face cache, and {reason}; download it where "
        "there is network (huggingface-cli download NAME), or give a local folder or .gguf file"
    )


def check_device(device: str | None, flag: str = "--device") -> None:
    """``--device cuda`` needs a torch that sees a CUDA GPU: say so before anything loads
    (the load would print bitsandbytes' and torch's warnings first).

    Raises:
        ConfigError: a ``cuda`` device and no GPU visible to torch.
    """
    if not device or not str(device).startswith("cuda"):
        return
    try:
        import torch
    except ImportError:
        return  # the engine names the missing extra
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ConfigError(
            f"{flag} {device}: torch {torch.__version__} ({build}) sees no CUDA GPU; leave {flag} out "
            f"or pass {flag} cpu"
        )


def check_local_model(args: argparse.Namespace, flags: Mapping[str, int | None]) -> None:
    """Every check of a local model's flags that needs no weights, in the order a person
    would fix them: the path exists, the folder is complete, a hub id can be had, the
    device exists, the token counts fit the model's context (:func:`check_context_flags`).
    ``convo chat`` and ``convo serve`` run it before loading.

    Raises:
        ConvoError: the first problem found, naming its flag.
    """
    check_model(args.model)
    check_model_folder(args.model)
    check_hub_model(args.model)
    check_device(getattr(args, "device", None))
    check_context_flags(args.model, flags)


#: Environment variables that turn tqdm's (and so transformers' and the hub's) progress bars
#: off when stderr is not a terminal.
PROGRESS_BAR_ENV = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def progress_bars_only_on_a_terminal(stream: TextIO = sys.stderr) -> bool:
    """Turn third-party progress bars off unless ``stream`` is a terminal (a log file gets
    the ``[convo]`` lines, not thousands of bar redraws). Leaves a variable the user set as
    it is. Returns whether bars stay on."""
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return True
    for name, value in PROGRESS_BAR_ENV.items():
        os.environ.setdefault(name, value)
    return False
