"""Engines and counters that need no model, for tests of code built on convo (and convo's own).

* :class:`EchoEngine` answers ``"heard N: <last user message>"``; it can stream slowly
  (``delay_s``) and honours ``cancel`` — what ``convo serve`` runs with
  ``CONVO_FAKE_ENGINE=1``.
* :class:`ScriptedEngine` answers ``reply {n}`` (or ``reply_fn(messages)``), records every
  prompt and can be told to fail, to test session logic around errors.
* :class:`ScriptedToolEngine` replays recorded replies of a model family (a Hermes
  ``<tool_call>``, a Llama JSON call, a Mistral ``[TOOL_CALLS]``) through the local
  engine's own tool-call parsing and streaming (:mod:`convo.engines.local.toolreply`).
* :class:`~convo.tokens.CharCounter` counts one token per character.
* :func:`wait_until_serving` waits for a ``convo serve`` started in a subprocess.

Example::

    import convo
    from convo.testing import EchoEngine

    session = convo.Session(EchoEngine(), budget=convo.Budget(context_tokens=512, max_new_tokens=32))
    assert session.send("hello").text.startswith("heard")
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from convo.engines.base import Engine, GenerateRequest
from convo.engines.local.toolreply import ToolReply, call_prefill, resolve_parser, tool_request
from convo.errors import BudgetError, ConfigError
from convo.messages import Message, Role, ToolCall
from convo.models import FinishReason, Generation, GenerationStats
from convo.tokens import CharCounter, TokenCounter

__all__ = [
    "SCRIPT_PIECE_CHARS",
    "CharCounter",
    "EchoEngine",
    "ScriptedEngine",
    "ScriptedToolEngine",
    "wait_until_serving",
]

#: Characters of each ``on_text`` piece :class:`ScriptedToolEngine` streams a reply in
#: (small, so that markers and JSON arrive split as a tokenizer splits them).
SCRIPT_PIECE_CHARS = 3

#: How often :func:`wait_until_serving` asks, in seconds.
SERVING_POLL_S = 0.1


def wait_until_serving(url: str, proc: subprocess.Popen[Any], timeout_s: float) -> bool:
    """Ask ``url`` (e.g. a server's ``/health``) until it answers 200: ``True``; or until
    ``proc``, the server's process, exits or ``timeout_s`` pass: ``False``. Needs httpx."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(SERVING_POLL_S)


class _ModelFree(Engine):
    """What both engines share: a counter, a context window and a record of prompts and
    released cache keys. Their capabilities are plain attributes a test may set (a batching
    engine: ``engine.concurrent_calls = 4``)."""

    context_window: int = 0
    concurrent_calls: int = 1

    #: Model-free engines get no tools (a call with ``tools=`` raises
    #: :class:`~convo.errors.ToolsNotSupported`), except :class:`ScriptedToolEngine`.
    supports_tools = False

    def __init__(self, counter: TokenCounter | None, context_window: int) -> None:
        self._counter = counter or CharCounter()
        self.context_window = context_window
        self.prompts: list[tuple[Message, ...]] = []
        self.released: list[str] = []

    @property
    def counter(self) -> TokenCounter:
        return self._counter

    def release(self, cache_key: str) -> None:
        self.released.append(cache_key)

    def _check_tools(self, options: dict[str, Any]) -> None:
        """Refuse tools this engine cannot use, rather than drop them silently."""
        tool_options = {k: options[k] for k in ("tools", "tool_choice") if k in options}
        GenerateRequest(max_new_tokens=1, **tool_options).check_tools(
            supports_tools=self.supports_tools, engine=type(self).__name__
        )


class EchoEngine(_ModelFree):
    """A tiny deterministic engine with no model (tests, demos, ``CONVO_FAKE_ENGINE=1``).

    It answers ``"heard N: <last user message>"`` (N = messages in its prompt) followed
    by ``pad_words`` words, one ``on_text`` chunk per word, sleeping ``delay_s`` between
    words and stopping when ``cancel`` is set; ``max_new_tokens`` caps the words. A
    ``stop`` string ends the reply where it first appears. ``calls`` counts generate calls.
    """

    def __init__(self, *, delay_s: float = 0.0, pad_words: int = 0, context_window: int = 100_000) -> None:
        super().__init__(None, context_window)
        self.delay_s = delay_s
        self.pad_words = pad_words
        self.calls = 0

    def generate(
        self,
        messages: Sequence[Message],
        *,
        max_new_tokens: int,
        on_text: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
        stop: Sequence[str] = (),
        **options: Any,
    ) -> Any:
        self._check_tools(options)
        self.calls += 1
        self.prompts.append(tuple(messages))
        last = next((m.content for m in reversed(messages) if m.role is Role.USER), "")
        words = [*f"heard {len(messages)}: {last}".split(" "), *(f"w{i}" for i in range(self.pad_words))]
        words = words[:max_new_tokens]
        out: list[str] = []
        reason = FinishReason.STOP
        for i, word in enumerate(words):
            if cancel is not None and cancel.is_set():
                reason = FinishReason.CANCELLED
                break
            piece = word if i == 0 else " " + word
            done = "".join(out)
            cut = min((j for j in ((done + piece).find(x) for x in stop) if j >= 0), default=-1)
            if cut >= 0:
                out = [(done + piece)[:cut]]
                piece = out[0][len(done) :]
            else:
                out.append(piece)
            if on_text is not None and piece:
                on_text(piece)
            if cut >= 0:
                break
            if self.delay_s:
                time.sleep(self.delay_s)
        text = "".join(out)
        prompt = self._counter.count_prompt(messages)
        stats = GenerationStats.untimed(prompt_tokens=prompt, new_tokens=len(out))
        return Generation(text=text, finish_reason=reason, token_ids=(), stats=stats)


class ScriptedEngine(_ModelFree):
    """A deterministic engine for unit tests of session logic (no model).

    It answers ``reply {n}`` (or what ``replies`` yields), records every prompt, and can be
    told to fail: ``fail_with`` is raised on the next ``fail_times`` calls.
    """

    def __init__(self, counter: TokenCounter | None = None, *, context_window: int = 100_000) -> None:
        super().__init__(counter, context_window)
        self.fail_with: BaseException | None = None
        self.fail_times = 0
        self.reply_fn: Callable[[Sequence[Message]], str] | None = None

    def generate(
        self,
        messages: Sequence[Message],
        *,
        max_new_tokens: int,
        on_text: Callable[[str], None] | None = None,
        max_prompt_tokens: int | None = None,
        **options: Any,
    ) -> Generation:
        self._check_tools(options)
        if max_prompt_tokens is not None and self._counter.count_prompt(messages) > max_prompt_tokens:
            raise BudgetError("rendered prompt over the budget")  # as the real engine does
        if self.fail_times > 0 and self.fail_with is not None:
            self.fail_times -= 1
            raise self.fail_with
        self.prompts.append(tuple(messages))
        text = self.reply_fn(messages) if self.reply_fn else f"reply {len(self.prompts)}"
        if on_text is not None:
            for word in text.split(" "):
                on_text(word + " ")
        prompt = self._counter.count_prompt(messages)
        return Generation(
            text=text,
            finish_reason=FinishReason.STOP,
            token_ids=(),
            stats=GenerationStats.untimed(prompt_tokens=prompt, new_tokens=self._counter.count_text(text)),
        )


class ScriptedToolEngine(_ModelFree):
    """Replays recorded model replies with tool calls, read exactly as the local engine
    reads a real model's (:class:`~convo.engines.local.toolreply.ToolReply`: the same
    parser, streaming deltas, invalid-call policy and ``tool_choice`` prefill).

    Args:
        replies: the reply texts, one per call, as the family writes them (special markers
            included: ``<|python_tag|>``, ``[TOOL_CALLS]``); the last one repeats.
        parser: the family (``"hermes"``, ``"llama3_json"``, ``"mistral"``).
        counter: the token counter (default :class:`CharCounter`); with an
            :class:`~convo.tokens.HFTokenCounter` the tools are counted through its template.
        rng: randomness of the call ids (seed it for stable ids).

    With ``tool_choice="required"`` or a named function the recorded reply is the model's
    continuation *after* the prefilled opening (:func:`~convo.engines.local.toolreply.call_prefill`),
    as the local engine's model would write it. ``prompts`` records each prompt and
    ``tools_seen`` the tool schemas each call rendered (``None``: none).

    Example:
        >>> engine = ScriptedToolEngine(['<tool_call>{"name": "now", "arguments": {}}</tool_call>'])
        >>> now = {"type": "function", "function": {"name": "now"}}
        >>> gen = engine.generate([], max_new_tokens=64, tools=[now])
        >>> gen.finish_reason.value, gen.tool_calls[0].name
        ('tool_calls', 'now')
    """

    supports_tools = True

    def __init__(
        self,
        replies: Sequence[str],
        *,
        parser: str = "hermes",
        counter: TokenCounter | None = None,
        context_window: int = 100_000,
        rng: Any = None,
    ) -> None:
        super().__init__(counter, context_window)
        if not replies:
            raise ConfigError("ScriptedToolEngine needs at least one reply")
        found = resolve_parser(parser, None)
        if found is None:
            raise ConfigError(f"ScriptedToolEngine needs a tool parser name, not {parser!r}")
        self.parser = found
        self.replies = list(replies)
        self.rng = rng
        self.tools_seen: list[list[dict[str, Any]] | None] = []

    def generate(self, messages: Sequence[Message], *, max_new_tokens: int, **options: Any) -> Generation:
        request = GenerateRequest(max_new_tokens=max_new_tokens, **options)
        tools = tool_request(request.tools, request.tool_choice, request.parallel_tool_calls)
        schemas = tools.to_template() if tools is not None else None
        prefill = call_prefill(self.parser, tools) if tools is not None else ""
        prompt = self._counter.count_with_tools(messages, schemas) + self._counter.count_text(prefill)
        request.check_prompt(
            prompt,
            input_cap=self.context_window,
            cap_name=f"the context window {self.context_window}",
            supports_tools=True,
            engine="ScriptedToolEngine",
        )
        self.prompts.append(tuple(messages))
        self.tools_seen.append(schemas)
        text = self.replies[min(len(self.prompts) - 1, len(self.replies) - 1)]
        pieces = [text[i : i + SCRIPT_PIECE_CHARS] for i in range(0, len(text), SCRIPT_PIECE_CHARS)]
        if tools is None:
            for piece in pieces:
                if request.on_text is not None:
                    request.on_text(piece)
            reply, reason = text, FinishReason.STOP
            calls: tuple[ToolCall, ...] = ()
        else:
            reader = ToolReply(
                self.parser,
                tools,
                on_text=request.on_text,
                on_tool_call_delta=request.on_tool_call_delta,
                prefill=prefill,
                rng=self.rng,
            )
            for piece in pieces:
                reader.feed(piece)
            reply, calls, reason = reader.finish(FinishReason.STOP)
        stats = GenerationStats.untimed(prompt_tokens=prompt, new_tokens=self._counter.count_text(text))
        return Generation(text=reply, finish_reason=reason, token_ids=(), stats=stats, tool_calls=calls)
