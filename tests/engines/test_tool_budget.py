"""What tool schemas cost in the budget (convo.tokens: TokenCounter.count_tools,
count_with_tools, estimate_tools_tokens, check_tools_fit).

The schemas go with every call, so they are a pinned cost. Counted exactly through a
Hugging Face template that renders them (the prompt with ``tools=`` minus the prompt
without), estimated elsewhere (their JSON plus a fixed per-tool overhead)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest

from convo.budget import Budget
from convo.errors import BudgetError
from convo.messages import Message, Role, ToolCall
from convo.tokens import (
    TOOL_OVERHEAD_TOKENS,
    TOOLS_OVERHEAD_TOKENS,
    CharCounter,
    HFTokenCounter,
    TiktokenCounter,
    TokenCounter,
    check_tools_fit,
    estimate_tools_tokens,
)


def function(name: str, description: str = "Does a thing.", **params: str) -> dict[str, Any]:
    props = {k: {"type": "string", "description": v} for k, v in params.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": props, "required": list(props)},
        },
    }


WEATHER = function("get_weather", "The current weather in a city.", city="City name, e.g. Paris")
TIME = function("get_time", "The local time in a time zone.", tz="An IANA zone such as Europe/Oslo")
TOOLS = [WEATHER, TIME]
CHAT = [
    Message(role=Role.SYSTEM, content="You are terse."),
    Message(role=Role.USER, content="Weather in Oslo, and the time there?"),
]


# -- estimates (counters without the served template) --------------------------------------------


@pytest.mark.parametrize("counter", [CharCounter(), TiktokenCounter()], ids=["chars", "tiktoken"])
def test_the_estimate_is_the_schemas_json_plus_a_fixed_overhead(counter: TokenCounter) -> None:
    expected = sum(counter.count_text(json.dumps(t)) for t in TOOLS)
    expected += TOOL_OVERHEAD_TOKENS * len(TOOLS) + TOOLS_OVERHEAD_TOKENS
    assert counter.count_tools(TOOLS) == estimate_tools_tokens(counter, TOOLS) == expected
    assert counter.count_tools([]) == counter.count_tools(None) == 0
    assert counter.count_with_tools(CHAT, TOOLS) == counter.count_prompt(CHAT) + expected
    assert counter.count_with_tools(CHAT, None) == counter.count_prompt(CHAT)
    # More or longer schemas cost more.
    longer = function("get_weather", "The current weather in a city. " * 20, city="City")
    assert counter.count_tools([longer]) > counter.count_tools([WEATHER])
    assert counter.count_tools(TOOLS) > counter.count_tools([WEATHER])


def test_a_counter_written_before_tools_gets_the_default() -> None:
    class Old(TokenCounter):  # implements only what TokenCounter asked for before tools
        def encode(self, text: str) -> list[int]:
            return list(range(len(text.split())))

        def decode(self, ids: Sequence[int]) -> str:
            return "w " * len(ids)

        def _message_cost(self, message: Message) -> int:
            return 2 + self.count_text(message.content)

        def count_prompt(self, messages: Sequence[Message]) -> int:
            return 1 + sum(self._message_cost(m) for m in messages)

        def _overhead_cost(self, starts_with_system: bool) -> int:
            return 1

    old = Old()
    assert old.count_tools(TOOLS) == estimate_tools_tokens(old, TOOLS) > 0
    assert old.count_with_tools(CHAT, TOOLS) == old.count_prompt(CHAT) + old.count_tools(TOOLS)


def test_schemas_too_big_for_the_budget_are_a_clear_budget_error() -> None:
    counter = CharCounter()
    cost = counter.count_tools(TOOLS)
    assert check_tools_fit(counter, TOOLS, cost) == cost  # exactly fits
    huge = function("search_everything", "Searches. " * 400, query="What to look for")
    with pytest.raises(BudgetError, match=r"take \d+ tokens, over the 200-token budget") as info:
        check_tools_fit(counter, [WEATHER, huge], 200)
    assert "'search_everything'" in str(info.value)  # names the largest tool
    budget = Budget(context_tokens=1024, max_new_tokens=128)  # pinned cap: 224
    assert check_tools_fit(counter, TOOLS, budget) == cost <= budget.pinned_cap
    with pytest.raises(BudgetError, match="pinned cap") as info:
        check_tools_fit(counter, [huge], budget)
    assert "Budget.pinned_tokens" in str(info.value)
    roomy = Budget(context_tokens=8192, max_new_tokens=128, pinned_tokens=4000)
    assert check_tools_fit(counter, [huge], roomy) == counter.count_tools([huge])


# -- exact counts through the model's template (the real SmolLM2 tokenizer) ----------------------

# A shortened copy of Qwen2.5's published template (ChatML, the tool schemas as JSON lines in
# the system message), run on SmolLM2's tokenizer, which has the same ChatML special tokens.
QWEN_TOOLS = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags.<|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' + tool_call.arguments'
    " + '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CALL = ToolCall(id="c1", name="get_weather", arguments='{"city": "Oslo"}')
CONVERSATIONS = {
    "system first": CHAT,
    "no system": CHAT[1:],
    "after a call": [
        *CHAT,
        Message(role=Role.ASSISTANT, content="", tool_calls=(CALL,)),
        Message(role=Role.TOOL, content='{"temp_c": -3}', tool_call_id="c1", name="get_weather"),
    ],
}


def template_len(tokenizer: Any, messages: Sequence[Message], tools: Any, template: str | None) -> int:
    ids = tokenizer.apply_chat_template(
        [m.to_dict() for m in messages],
        tools=tools,
        chat_template=template,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    return len(ids)


@pytest.mark.slow
@pytest.mark.parametrize("shape", list(CONVERSATIONS))
def test_tools_cost_exactly_what_the_template_adds(smol_counter: Any, shape: str) -> None:
    tokenizer = smol_counter.tokenizer
    counter = HFTokenCounter(tokenizer, chat_template=QWEN_TOOLS)
    assert counter.renders_tools and counter.fold == "as-is"
    messages = CONVERSATIONS[shape]
    for tools in ([WEATHER], TOOLS):
        with_tools = template_len(tokenizer, messages, tools, QWEN_TOOLS)
        without = template_len(tokenizer, messages, None, QWEN_TOOLS)
        assert counter.count_tools(tools, messages) == with_tools - without > 0
        assert counter.count_with_tools(messages, tools) == with_tools
        assert counter.count_prompt(messages) == without
    # Without messages: a prompt that starts with a system message (cached per schema list).
    probe = CONVERSATIONS["system first"]
    expected = template_len(tokenizer, probe, TOOLS, QWEN_TOOLS) - template_len(
        tokenizer, probe, None, QWEN_TOOLS
    )
    assert counter.count_tools(TOOLS) == counter.count_tools(TOOLS) == expected
    # The exact count differs from the estimate: the template is not the estimate's framing.
    assert counter.count_tools(TOOLS) != estimate_tools_tokens(counter, TOOLS)


@pytest.mark.slow
def test_a_template_that_ignores_tools_falls_back_to_the_estimate(smol_counter: Any) -> None:
    """SmolLM2's own template renders no tools (with tools= the prompt is the same), so the
    exact difference is 0; the counter says so and counts the estimate instead: a server
    that serves this model with tools renders them its own way (llama.cpp's
    chatml-function-calling), and over-counting keeps the budget safe."""
    tokenizer = smol_counter.tokenizer
    assert template_len(tokenizer, CHAT, TOOLS, None) == template_len(tokenizer, CHAT, None, None)
    assert not smol_counter.renders_tools
    assert smol_counter.count_tools(TOOLS, CHAT) == estimate_tools_tokens(smol_counter, TOOLS) > 0
    assert smol_counter.render(CHAT, tools=TOOLS) == smol_counter.render(CHAT)


@pytest.mark.slow
def test_real_schemas_over_a_small_budget_are_refused(smol_counter: Any) -> None:
    counter = HFTokenCounter(smol_counter.tokenizer, chat_template=QWEN_TOOLS)
    many = [
        function(f"tool_{i}", "A tool with a long description. " * 10, arg="An argument") for i in range(12)
    ]
    budget = Budget(context_tokens=2048, max_new_tokens=256)  # pinned cap 448
    cost = counter.count_tools(many)
    assert cost > budget.pinned_cap
    with pytest.raises(
        BudgetError, match=f"take {cost} tokens, over the {budget.pinned_cap}-token pinned cap"
    ):
        check_tools_fit(counter, many, budget)
    assert check_tools_fit(counter, many[:2], budget) == counter.count_tools(many[:2])
