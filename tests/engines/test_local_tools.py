"""Tools in the local engine: the shared reply reader (convo.engines.local.toolreply), the
scripted tool engine that replays recorded replies through it, the model-free engines'
refusal of tools, the --tool-parser flag, and (slow) the real TransformersEngine with a
Hermes template on the embedded SmolLM2 tokenizer, with both KV backends."""

from __future__ import annotations

import argparse
import json
import random
from typing import Any

import pytest

from convo.engines.local.config import LoadConfig
from convo.engines.local.toolreply import ToolReply, call_prefill, resolve_parser, tool_request
from convo.errors import BudgetError, ConfigError, ToolsNotSupported
from convo.messages import Message, Role
from convo.models.generation import FinishReason, ToolCallDelta
from convo.testing import EchoEngine, ScriptedEngine, ScriptedToolEngine
from convo.tools import ToolSpecError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}

# Recorded replies, as each family writes them.
HERMES = (
    'I\'ll look it up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
MISTRAL = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
USER = [Message(role=Role.USER, content="Weather in Paris?")]


def _collect(engine: Any, **kwargs: Any) -> tuple[Any, list[str], list[ToolCallDelta]]:
    texts: list[str] = []
    deltas: list[ToolCallDelta] = []
    gen = engine.generate(
        USER, max_new_tokens=64, on_text=texts.append, on_tool_call_delta=deltas.append, **kwargs
    )
    return gen, texts, deltas


@pytest.mark.parametrize(
    ("family", "reply", "content"),
    [("hermes", HERMES, "I'll look it up."), ("llama3_json", LLAMA, ""), ("mistral", MISTRAL, "")],
)
def test_scripted_tool_engine_reads_each_family(family: str, reply: str, content: str) -> None:
    engine = ScriptedToolEngine([reply], parser=family, rng=random.Random(0))
    gen, texts, deltas = _collect(engine, tools=[WEATHER])
    assert gen.finish_reason is FinishReason.TOOL_CALLS
    assert gen.text == content and "".join(texts) == content
    (call,) = gen.tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    # OpenAI-style deltas: id and name first, then argument fragments that join to the arguments
    assert deltas[0].index == 0 and deltas[0].id == call.id and deltas[0].name == "get_weather"
    assert all(d.id is None and d.name is None for d in deltas[1:])
    assert "".join(d.arguments for d in deltas) == call.arguments
    assert engine.tools_seen == [[WEATHER]]


def test_invalid_arguments_come_back_as_text_with_stop() -> None:
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'
    gen, _texts, _ = _collect(ScriptedToolEngine([broken]), tools=[WEATHER])
    assert gen.finish_reason is FinishReason.STOP
    assert gen.tool_calls == ()
    assert gen.text == broken


def test_unknown_function_comes_back_as_text() -> None:
    other = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    gen, _, _ = _collect(ScriptedToolEngine([other]), tools=[WEATHER])
    assert (gen.finish_reason, gen.tool_calls, gen.text) == (FinishReason.STOP, (), other)


def test_parallel_false_refuses_two_calls() -> None:
    two = HERMES + '\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    gen, _, _ = _collect(ScriptedToolEngine([two]), tools=[WEATHER, NOW], parallel_tool_calls=False)
    assert gen.finish_reason is FinishReason.STOP and gen.tool_calls == ()
    ok, _, _ = _collect(ScriptedToolEngine([two]), tools=[WEATHER, NOW])
    assert [c.name for c in ok.tool_calls] == ["get_weather", "now"]


def test_tool_choice_none_renders_no_tools_and_parses_nothing() -> None:
    engine = ScriptedToolEngine([HERMES])
    gen, _texts, deltas = _collect(engine, tools=[WEATHER], tool_choice="none")
    assert engine.tools_seen == [None]
    assert gen.finish_reason is FinishReason.STOP and gen.text == HERMES and deltas == []


def test_named_choice_prefills_the_call_opening() -> None:
    parser = resolve_parser("hermes", None)
    assert parser is not None
    request = tool_request([WEATHER, NOW], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert request is not None
    prefill = call_prefill(parser, request)
    assert prefill == '<tool_call>\n{"name": "get_weather", "arguments": '
    # the model's continuation after the prefill
    engine = ScriptedToolEngine(['{"city": "Paris"}}\n</tool_call>'])
    gen, _, deltas = _collect(
        engine, tools=[WEATHER, NOW], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    assert gen.finish_reason is FinishReason.TOOL_CALLS
    assert [(c.name, c.arguments) for c in gen.tool_calls] == [("get_weather", '{"city":"Paris"}')]
    assert deltas[0].name == "get_weather"


@pytest.mark.parametrize(
    ("family", "opening"),
    [
        ("hermes", '<tool_call>\n{"name": "'),
        ("llama3_json", '{"name": "'),
        ("mistral", '[TOOL_CALLS] [{"name": "'),
    ],
)
def test_required_prefills_up_to_the_name(family: str, opening: str) -> None:
    parser = resolve_parser(family, None)
    request = tool_request([WEATHER], "required", None)
    assert parser is not None and request is not None
    assert call_prefill(parser, request) == opening


def test_required_with_no_call_is_text_and_stop() -> None:
    parser = resolve_parser("hermes", None)
    request = tool_request([WEATHER], "auto", None)
    assert parser is not None and request is not None
    required = tool_request([WEATHER], "required", None)
    assert required is not None
    reader = ToolReply(parser, required)
    reader.feed("just text")
    assert reader.finish(FinishReason.STOP) == ("just text", (), FinishReason.STOP)


def test_cut_reply_keeps_its_reason() -> None:
    parser = resolve_parser("hermes", None)
    request = tool_request([WEATHER], None, None)
    assert parser is not None and request is not None
    reader = ToolReply(parser, request)
    reader.feed('<tool_call>\n{"name": "get_weather", "argu')
    text, calls, reason = reader.finish(FinishReason.LENGTH)
    assert (calls, reason) == ((), FinishReason.LENGTH) and text.startswith("<tool_call>")


def test_scripted_tool_engine_budget_counts_the_schemas() -> None:
    engine = ScriptedToolEngine([HERMES])
    plain = engine.generate(USER, max_new_tokens=8).stats.prompt_tokens
    with_tools = engine.generate(USER, max_new_tokens=8, tools=[WEATHER]).stats.prompt_tokens
    assert with_tools > plain
    with pytest.raises(BudgetError):
        engine.generate(USER, max_new_tokens=8, tools=[WEATHER], max_prompt_tokens=with_tools - 1)
    assert len(engine.prompts) == 2  # the refused call never ran


def test_malformed_tools_name_the_field() -> None:
    with pytest.raises((ToolSpecError, ConfigError)):
        ScriptedToolEngine([HERMES]).generate(USER, max_new_tokens=8, tools=[{"type": "function"}])


@pytest.mark.parametrize("engine", [EchoEngine(), ScriptedEngine()], ids=["echo", "scripted"])
def test_model_free_engines_refuse_tools(engine: Any) -> None:
    assert engine.supports_tools is False
    with pytest.raises(ToolsNotSupported):
        engine.generate(USER, max_new_tokens=8, tools=[WEATHER])
    with pytest.raises(ToolsNotSupported):
        engine.generate(USER, max_new_tokens=8, tool_choice="required", tools=[WEATHER])
    assert engine.generate(USER, max_new_tokens=8, tool_choice="none").text  # no tools: fine


def test_tool_parser_setting_is_checked() -> None:
    assert LoadConfig().tool_parser == "auto"
    with pytest.raises(ConfigError, match="tool_parser"):
        LoadConfig(tool_parser="qwen")
    assert resolve_parser("none", "<tool_call>") is None
    parser = resolve_parser("auto", "{{ '<tool_call>' }}")
    assert parser is not None and parser.name == "hermes"


def test_cli_tool_parser_flag() -> None:
    from convo.cli.common import add_local_engine_arguments

    parser = argparse.ArgumentParser()
    add_local_engine_arguments(parser)
    assert parser.parse_args([]).tool_parser == "auto"
    assert parser.parse_args(["--tool-parser", "mistral"]).tool_parser == "mistral"
    with pytest.raises(SystemExit):
        parser.parse_args(["--tool-parser", "qwen"])


HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}"
    "{%- endfor %}\n</tools>\nReturn a call in <tool_call></tool_call> tags.<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@pytest.mark.slow
@pytest.mark.parametrize("kv_slots", [0, 2], ids=["DynamicKV", "SlotKV"])
def test_real_engine_renders_and_counts_tools(real_engine: Any, kv_slots: int) -> None:
    from transformers import AutoTokenizer

    from convo.engines.local.config import KVConfig
    from convo.engines.local.engine import TransformersEngine
    from convo.engines.local.loading import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_path()), local_files_only=True)
    tokenizer.chat_template = HERMES_TEMPLATE
    engine = TransformersEngine.from_model(
        real_engine.model,
        tokenizer,
        quant="fp32",
        device="cpu",
        kv=KVConfig(kv_slots=kv_slots, slot_tokens=1024),
    )
    assert engine.supports_tools and engine.tool_parser is not None and engine.tool_parser.name == "hermes"
    assert real_engine.supports_tools is False  # SmolLM2's ChatML template renders no tools
    prompt = engine.counter.render(USER, tools=[WEATHER])
    assert '"get_weather"' in prompt
    gen, texts, _ = _collect(engine, tools=[WEATHER])
    assert gen.stats.prompt_tokens == engine.counter.count_with_tools(USER, [WEATHER])
    assert gen.stats.prompt_tokens > engine.counter.count_prompt(USER)
    if not gen.tool_calls:
        assert "".join(texts) == gen.text
    forced = engine.generate(USER, max_new_tokens=24, tools=[WEATHER], tool_choice="required")
    assert forced.finish_reason in (FinishReason.TOOL_CALLS, FinishReason.STOP, FinishReason.LENGTH)
    with pytest.raises(BudgetError):
        engine.generate(
            USER, max_new_tokens=8, tools=[WEATHER], max_prompt_tokens=gen.stats.prompt_tokens - 1
        )
    with pytest.raises(ToolsNotSupported):
        real_engine.generate(USER, max_new_tokens=4, tools=[WEATHER])
    engine.close()
