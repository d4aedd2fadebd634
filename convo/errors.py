"""The exception tree of convo.

Every error convo raises on purpose derives from :class:`ConvoError`, so a caller can catch
one type. Subclasses also derive from the builtin that fits (``ValueError``,
``TimeoutError``...), so generic handlers keep working::

    ConvoError
    ├── ConfigError          (ValueError)    a limit or option makes no sense
    │   └── ToolsNotSupported                this engine cannot be given tools
    ├── MessageError         (ValueError)    a message has a bad role, content or shape
    ├── BudgetError          (ValueError)    something cannot fit the token budget
    ├── AdmissionError                       the engine will not run this request now
    │   ├── QueueFullError                   refused at once; ``retry_after_s`` says when to retry
    │   └── QueueTimeoutError (TimeoutError) waited in the queue past its deadline
    ├── GenerationTimeout    (TimeoutError)  generation ran past ``timeout_s`` (partial text kept)
    ├── RemoteEngineError                    a remote engine refused, failed or is unreachable (``status``)
    ├── DeviceOutOfMemory    (MemoryError)   the device ran out of memory (cache already freed)
    ├── StoreError                           the session store failed or the session is unknown
    │   ├── SessionBusy                      another turn holds the session's lock (HTTP 409)
    │   │   └── SessionLockLost              the turn's lock expired; its writes were refused
    │   └── SessionNotFound  (KeyError)
    ├── ModelLoadError                       a model or tokenizer could not be loaded
    └── MissingDependency    (ImportError)   an optional extra is not installed

Messages say what to do next.
"""

from __future__ import annotations


class ConvoError(Exception):
    """Base class of every error convo raises on purpose."""


class ConfigError(ConvoError, ValueError):
    """A configuration value is out of range or inconsistent."""


class ToolsNotSupported(ConfigError):
    """A call asked for tools (``tools=`` / ``tool_choice=``) on an engine that declares
    ``supports_tools = False``: it would ignore them, so it refuses the call instead."""


class MessageError(ConvoError, ValueError):
    """A message is malformed: unknown role, non-string content, orphan tool result..."""


class BudgetError(ConvoError, ValueError):
    """Content cannot be made to fit the token budget under the configured policy."""


class AdmissionError(ConvoError):
    """The engine did not admit a request."""


class QueueFullError(AdmissionError):
    """The wait queue is full; the request was refused without waiting.

    Attributes:
        retry_after_s: a hint, in seconds, for when a retry may be admitted.
    """

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QueueTimeoutError(AdmissionError, TimeoutError):
    """A queued request waited longer than its queue timeout."""


class GenerationTimeout(ConvoError, TimeoutError):
    """Generation exceeded its wall-clock limit. ``partial_text`` holds what was produced."""

    def __init__(self, message: str, *, partial_text: str = "") -> None:
        super().__init__(message)
        self.partial_text = partial_text


class RemoteEngineError(ConvoError):
    """A remote (OpenAI-compatible) engine refused the request, failed, or is unreachable.

    Raised after the retries are spent (429, 5xx, connection errors) or at once for an
    answer no retry can fix (401, 404, a malformed body).

    Attributes:
        status: the last HTTP status, or ``None`` when no answer came (connection error).
        retry_after_s: the server's last ``Retry-After``, in seconds, if it sent one.
    """

    def __init__(
        self, message: str, *, status: int | None = None, retry_after_s: float | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


class DeviceOutOfMemory(ConvoError, MemoryError):
    """The accelerator (or host) ran out of memory during a turn.

    The engine has already dropped the turn's KV cache and emptied the allocator's cache;
    the session retries once with a smaller plan before letting this through.
    """


class StoreError(ConvoError):
    """The session store failed."""


class SessionBusy(StoreError):
    """Another turn of the session held its lock longer than the wait allowed (HTTP 409)."""


class SessionLockLost(SessionBusy):
    """A turn's lock on its session expired while it ran (the store was unreachable for
    longer than the lease), and another holder may have taken it. The store refused the
    turn's writes, so nothing it meant to commit was stored; run the turn again."""


class SessionNotFound(StoreError, KeyError):
    """No session with this id exists in the store."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "session not found"


class ModelLoadError(ConvoError):
    """A model, tokenizer or embedding model could not be loaded."""


class MissingDependency(ConvoError, ImportError):
    """An optional dependency is missing; the message names the pip command to fix it."""


def require(module: str, extra: str) -> None:
    """Raise :class:`MissingDependency` unless ``module`` can be imported.

    Args:
        module: the import name, e.g. ``"torch"``.
        extra: the convo extra that installs it, e.g. ``"local"``.
    """
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise MissingDependency(f"{module!r} is not installed; run: pip install 'convo[{extra}]'")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a device (or host) out-of-memory error: ``torch.OutOfMemoryError``
    (CUDA, MPS, XPU...) or ``MemoryError``. The one place convo recognizes OOM; the engines
    map it to :class:`DeviceOutOfMemory` at their boundary. Needs no torch import."""
    if isinstance(exc, MemoryError):
        return True
    return any(
        cls.__name__ == "OutOfMemoryError" and cls.__module__.startswith("torch") for cls in type(exc).__mro__
    )
