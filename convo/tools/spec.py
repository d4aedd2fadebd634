"""The tools a request offers the model, validated once at the edge.

An OpenAI Chat Completions request offers functions with three fields::

    "tools": [{"type": "function",
               "function": {"name": "get_weather",          # ^[a-zA-Z0-9_-]{1,64}$
                            "description": "Weather of a city",
                            "parameters": {"type": "object", "properties": {...}}}}],
    "tool_choice": "auto" | "none" | "required" | {"type": "function", "function": {"name": ...}},
    "parallel_tool_calls": true

:func:`parse_tool_request` turns them into a :class:`ToolRequest` (a tuple of
:class:`ToolSpec`, a :class:`ToolChoice`, the parallel flag) or raises
:class:`ToolSpecError` naming the offending field as OpenAI does in an error's ``param``
(``tools[1].function.name``). Defaults follow OpenAI: ``tool_choice`` is ``"none"`` when no
tool is offered and ``"auto"`` otherwise; ``parallel_tool_calls`` is true.

Limits (:class:`ToolLimits`) keep one request from filling the prompt with schemas: at most
``max_tools`` tools, each schema at most ``max_schema_bytes`` bytes as compact UTF-8 JSON.

What this module does not do: it does not enforce ``tool_choice`` on the model's output (a
local model can only be asked through its template; see :meth:`ToolRequest.check`), and it
does not validate the ``parameters`` schema beyond its top-level shape (JSON Schema
validation of arguments is the tool runner's job).
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from convo.errors import ConfigError, MessageError

__all__ = [
    "DEFAULT_TOOL_LIMITS",
    "MAX_SCHEMA_BYTES",
    "MAX_TOOLS_PER_REQUEST",
    "TOOL_NAME_PATTERN",
    "ToolChoice",
    "ToolChoiceMode",
    "ToolLimits",
    "ToolRequest",
    "ToolSpec",
    "ToolSpecError",
    "parse_tool_request",
]

#: OpenAI's rule for a function name: 1 to 64 letters, digits, underscores or dashes.
TOOL_NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")

#: Default for :attr:`ToolLimits.max_tools` (OpenAI's own limit is 128 tools).
MAX_TOOLS_PER_REQUEST = 128

#: Default for :attr:`ToolLimits.max_schema_bytes`: 32 KiB of compact JSON per tool,
#: several thousand tokens, already more than a small context should spend on one schema.
MAX_SCHEMA_BYTES = 32 * 1024


class ToolSpecError(MessageError):
    """A ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` field is malformed.

    A :class:`~convo.errors.MessageError` (so a ``ValueError``); the server answers 400.

    Attributes:
        field: the path of the field at fault, as OpenAI names it in an error's ``param``
            (``"tools[0].function.name"``, ``"tool_choice"``).
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


@dataclass(frozen=True, kw_only=True)
class ToolLimits:
    """How much a request may offer.

    Args:
        max_tools: the most tools one request may offer.
        max_schema_bytes: the most bytes one tool's ``function`` object (name, description
            and parameters) may take as compact UTF-8 JSON.

    Raises:
        ConfigError: a limit below 1.
    """

    max_tools: int = MAX_TOOLS_PER_REQUEST
    max_schema_bytes: int = MAX_SCHEMA_BYTES

    def __post_init__(self) -> None:
        for name in ("max_tools", "max_schema_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"ToolLimits.{name} must be an integer >= 1, got {value!r}")


DEFAULT_TOOL_LIMITS = ToolLimits()


@dataclass(frozen=True, kw_only=True)
class ToolSpec:
    """One function the model may call.

    Args:
        name: the function name (``TOOL_NAME_PATTERN``).
        description: what the function does, shown to the model; ``None`` when not given.
        parameters: the JSON Schema of the arguments, a ``"type": "object"`` schema.
            OpenAI reads an omitted ``parameters`` as a function without arguments; so
            does this class (an empty object schema).
        strict: OpenAI's ``strict`` flag, kept to be passed on (``None`` when not given).

    Example:
        >>> ToolSpec(name="now").to_openai()["function"]["parameters"]
        {'type': 'object', 'properties': {}}
    """

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None

    def to_openai(self) -> dict[str, Any]:
        """The tool as OpenAI sends it, which is also what Hugging Face chat templates read
        from ``apply_chat_template(tools=[...])``."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = _plain(self.parameters)
        if self.strict is not None:
            fn["strict"] = self.strict
        return {"type": "function", "function": fn}


class ToolChoiceMode(enum.StrEnum):
    """Whether and which tool the model is asked to call."""

    AUTO = "auto"  # the model decides
    NONE = "none"  # the model must answer in text
    REQUIRED = "required"  # the model must call at least one tool
    FUNCTION = "function"  # the model must call the named tool


@dataclass(frozen=True, kw_only=True)
class ToolChoice:
    """A parsed ``tool_choice``: a mode, plus the function name for ``FUNCTION``."""

    mode: ToolChoiceMode
    name: str | None = None

    def __post_init__(self) -> None:
        if (self.mode is ToolChoiceMode.FUNCTION) != (self.name is not None):
            raise ConfigError("ToolChoice.name is given exactly when mode is FUNCTION")

    def to_openai(self) -> str | dict[str, Any]:
        if self.mode is ToolChoiceMode.FUNCTION:
            return {"type": "function", "function": {"name": self.name}}
        return self.mode.value


@dataclass(frozen=True, kw_only=True)
class ToolRequest:
    """What a request offers: the tools, the choice, and whether several calls may come at once.

    Build it with :func:`parse_tool_request`.
    """

    tools: tuple[ToolSpec, ...] = ()
    choice: ToolChoice = ToolChoice(mode=ToolChoiceMode.NONE)
    parallel_tool_calls: bool = True

    @property
    def names(self) -> frozenset[str]:
        """The names of the offered functions."""
        return frozenset(t.name for t in self.tools)

    @property
    def calls_allowed(self) -> bool:
        """Whether the model may call a tool at all (tools offered, choice not ``none``).
        When false the engine renders no tools and parses no call out of the reply."""
        return bool(self.tools) and self.choice.mode is not ToolChoiceMode.NONE

    def to_template(self) -> list[dict[str, Any]] | None:
        """The ``tools`` argument for ``apply_chat_template``: ``None`` when no call is
        allowed (so the template renders exactly as without tools)."""
        return [t.to_openai() for t in self.tools] if self.calls_allowed else None

    def check(self, called: Sequence[str]) -> str | None:
        """Why the names the model called break this request, or ``None`` if they do not.

        Args:
            called: the function names of the reply's tool calls, in order.

        Returns:
            a sentence for the first broken rule: a call when calls are not allowed, an
            unknown name, several calls with ``parallel_tool_calls`` false, no call under
            ``required``, another function than the one named.
        """
        if called and not self.calls_allowed:
            return "the model called a tool but tool_choice is 'none' or no tool was offered"
        for name in called:
            if name not in self.names:
                return f"the model called {name!r}, which is not among the offered tools"
        if len(called) > 1 and not self.parallel_tool_calls:
            return f"the model made {len(called)} calls but parallel_tool_calls is false"
        if self.choice.mode is ToolChoiceMode.REQUIRED and not called:
            return "tool_choice is 'required' but the model called no tool"
        if self.choice.mode is ToolChoiceMode.FUNCTION and list(called) != [self.choice.name]:
            return f"tool_choice names {self.choice.name!r} but the model called {list(called)!r}"
        return None


def parse_tool_request(
    tools: Any = None,
    tool_choice: Any = None,
    parallel_tool_calls: Any = None,
    *,
    limits: ToolLimits = DEFAULT_TOOL_LIMITS,
) -> ToolRequest:
    """Validate the OpenAI ``tools``, ``tool_choice`` and ``parallel_tool_calls`` fields.

    Args:
        tools: the ``tools`` list, or ``None``.
        tool_choice: ``"auto"``, ``"none"``, ``"required"``,
            ``{"type": "function", "function": {"name": ...}}``, or ``None`` (OpenAI's
            default: ``"auto"`` with tools, ``"none"`` without).
        parallel_tool_calls: a bool, or ``None`` (true).
        limits: the request limits.

    Raises:
        ToolSpecError: the first malformed field, named in :attr:`ToolSpecError.field`.

    Example:
        >>> req = parse_tool_request([{"type": "function", "function": {"name": "now"}}])
        >>> req.choice.mode, req.names
        (<ToolChoiceMode.AUTO: 'auto'>, frozenset({'now'}))
    """
    specs = _parse_tools(tools, limits)
    choice = _parse_choice(tool_choice, {s.name for s in specs})
    if parallel_tool_calls is None:
        parallel = True
    elif isinstance(parallel_tool_calls, bool):
        parallel = parallel_tool_calls
    else:
        raise ToolSpecError("parallel_tool_calls", f"must be a boolean, got {_kind(parallel_tool_calls)}")
    return ToolRequest(tools=specs, choice=choice, parallel_tool_calls=parallel)


def _parse_tools(tools: Any, limits: ToolLimits) -> tuple[ToolSpec, ...]:
    if tools is None:
        return ()
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise ToolSpecError("tools", f"must be a list of tools, got {_kind(tools)}")
    if len(tools) > limits.max_tools:
        raise ToolSpecError("tools", f"offers {len(tools)} tools; at most {limits.max_tools} are allowed")
    specs: list[ToolSpec] = []
    seen: set[str] = set()
    for i, raw in enumerate(tools):
        spec = _parse_tool(raw, f"tools[{i}]", limits)
        if spec.name in seen:
            raise ToolSpecError(f"tools[{i}].function.name", f"{spec.name!r} is offered twice")
        seen.add(spec.name)
        specs.append(spec)
    return tuple(specs)


def _parse_tool(raw: Any, where: str, limits: ToolLimits) -> ToolSpec:
    if not isinstance(raw, Mapping):
        raise ToolSpecError(where, f"must be an object, got {_kind(raw)}")
    if raw.get("type") != "function":
        raise ToolSpecError(f"{where}.type", f"must be 'function', got {raw.get('type')!r}")
    fn = raw.get("function")
    if not isinstance(fn, Mapping):
        raise ToolSpecError(f"{where}.function", f"must be an object, got {_kind(fn)}")
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME_PATTERN.fullmatch(name):
        raise ToolSpecError(
            f"{where}.function.name",
            f"must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
        )
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolSpecError(f"{where}.function.description", f"must be a string, got {_kind(description)}")
    parameters = fn.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    elif not isinstance(parameters, Mapping):
        raise ToolSpecError(
            f"{where}.function.parameters", f"must be a JSON Schema object, got {_kind(parameters)}"
        )
    elif parameters.get("type", "object") != "object":
        raise ToolSpecError(
            f"{where}.function.parameters.type",
            f"must be 'object' (arguments are a JSON object), got {parameters.get('type')!r}",
        )
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolSpecError(f"{where}.function.strict", f"must be a boolean, got {_kind(strict)}")
    spec = ToolSpec(name=name, description=description, parameters=_plain(parameters), strict=strict)
    try:
        size = len(
            json.dumps(spec.to_openai()["function"], ensure_ascii=False, separators=(",", ":")).encode()
        )
    except (TypeError, ValueError) as exc:  # not JSON (a set, NaN...) when built in Python
        raise ToolSpecError(f"{where}.function.parameters", f"is not JSON: {exc}") from None
    except UnicodeEncodeError:
        raise ToolSpecError(f"{where}.function", "holds text that is not valid Unicode") from None
    if size > limits.max_schema_bytes:
        raise ToolSpecError(
            f"{where}.function",
            f"takes {size} bytes as JSON; at most {limits.max_schema_bytes} are allowed per tool",
        )
    return spec


def _parse_choice(choice: Any, names: set[str]) -> ToolChoice:
    if choice is None:
        return ToolChoice(mode=ToolChoiceMode.AUTO if names else ToolChoiceMode.NONE)
    if isinstance(choice, str):
        try:
            mode = ToolChoiceMode(choice)
        except ValueError:
            mode = ToolChoiceMode.FUNCTION  # not a string mode
        if mode is ToolChoiceMode.FUNCTION:
            raise ToolSpecError(
                "tool_choice", f"must be 'auto', 'none', 'required' or an object, got {choice!r}"
            )
        if mode is ToolChoiceMode.REQUIRED and not names:
            raise ToolSpecError("tool_choice", "is 'required' but no tools are offered")
        return ToolChoice(mode=mode)
    if not isinstance(choice, Mapping):
        raise ToolSpecError("tool_choice", f"must be a string or an object, got {_kind(choice)}")
    if choice.get("type") != "function":
        raise ToolSpecError("tool_choice.type", f"must be 'function', got {choice.get('type')!r}")
    fn = choice.get("function")
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ToolSpecError("tool_choice.function.name", "must be the name of an offered tool")
    name = fn["name"]
    if name not in names:
        raise ToolSpecError("tool_choice.function.name", f"{name!r} is not among the offered tools")
    return ToolChoice(mode=ToolChoiceMode.FUNCTION, name=name)


def _plain(value: Any) -> Any:
    """A deep copy as plain dicts and lists (what a template's ``tojson`` can render)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__
