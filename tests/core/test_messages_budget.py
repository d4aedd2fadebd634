from __future__ import annotations

import pytest

from convo import Budget, Message, OversizePolicy, Role, ToolCall
from convo.errors import ConfigError, MessageError
from convo.messages import assistant, group_blocks, tool, user


def test_roles_become_enums_and_system_is_pinned() -> None:
    m = Message(role="system", content="be brief")
    assert m.role is Role.SYSTEM and m.pinned


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"role": "wizard", "content": "x"}, "invalid role"),
        ({"role": "user", "content": 42}, "must be a string"),
        ({"role": "user", "content": None}, "must be a string"),
        ({"role": "tool", "content": "x"}, "tool_call_id"),
        ({"role": "user", "content": "x", "tool_call_id": "a"}, "only valid on tool"),
        ({"role": "user", "content": "x", "tool_calls": (ToolCall(id="a", name="f"),)}, "only assistant"),
    ],
)
def test_bad_messages_raise_typed_errors(kwargs: dict, fragment: str) -> None:
    with pytest.raises(MessageError, match=fragment):
        Message(**kwargs)


def test_record_round_trip_keeps_tool_calls() -> None:
    m = assistant("", tool_calls=[ToolCall(id="c1", name="get", arguments='{"q": 1}')])
    back = Message.from_record(m.to_record())
    assert back == m
    assert m.to_dict()["tool_calls"][0]["function"]["name"] == "get"


def test_blocks_keep_tool_call_with_its_results() -> None:
    call = assistant("", tool_calls=[ToolCall(id="a", name="f"), ToolCall(id="b", name="g")])
    msgs = [user("hi"), call, tool("1", tool_call_id="a"), tool("2", tool_call_id="b"), assistant("done")]
    assert group_blocks(msgs) == [(0, 1), (1, 4), (4, 5)]
    with pytest.raises(MessageError):
        group_blocks([user("x"), tool("1", tool_call_id="a")])


def test_budget_defaults_and_shares() -> None:
    b = Budget(context_tokens=2048, max_new_tokens=256)
    assert b.available_prompt_tokens == 1792
    assert b.pinned_cap == 1792 // 4
    assert b.recent_min == (1792 - 448) // 2
    assert b.oversize is OversizePolicy.TRUNCATE
    assert Budget.from_dict(b.to_dict()) == b


@pytest.mark.parametrize(
    "kwargs",
    [
        {"context_tokens": 0},
        {"context_tokens": 100, "max_new_tokens": 100},
        {"context_tokens": 100, "max_new_tokens": 150},
        {"max_new_tokens": 0},
        {"window_turns": 0},
        {"summary_tokens": -1},
        {"context_tokens": 100, "max_new_tokens": 10, "pinned_tokens": 91},
        {"context_tokens": 100, "max_new_tokens": 10, "pinned_tokens": 50, "recent_min_tokens": 41},
        {"context_tokens": 1.5},
        {"oversize": "explode"},
    ],
)
def test_nonsense_budgets_raise_config_error(kwargs: dict) -> None:
    with pytest.raises((ConfigError, ValueError)):
        Budget(**kwargs)


def test_replace_rederives_the_caps_that_were_left_to_the_budget() -> None:
    import dataclasses

    b = Budget(context_tokens=1000, max_new_tokens=100)
    assert (b.pinned_cap, b.recent_min) == (225, 337)
    smaller = dataclasses.replace(b, max_new_tokens=500)  # a per-request reply cap
    assert (smaller.pinned_cap, smaller.recent_min) == (125, 187)
    assert smaller.to_dict()["pinned_tokens"] is None  # persisted as "derived", not a stale int
    fixed = Budget(context_tokens=1000, max_new_tokens=100, pinned_tokens=50)
    assert dataclasses.replace(fixed, max_new_tokens=500).pinned_cap == 50


def test_out_of_memory_is_recognized_in_one_place() -> None:
    import torch

    from convo.errors import is_out_of_memory

    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("CUDA error: an illegal memory access"))

    class OutOfMemoryError(Exception):  # same name, not torch's
        pass

    assert not is_out_of_memory(OutOfMemoryError())


def test_common_prefix_length() -> None:
    from convo.tokens import common_prefix_length

    assert common_prefix_length([1, 2, 3, 4], [1, 2, 9]) == 2
    assert common_prefix_length([1, 2, 3], [1, 2, 3], limit=2) == 2
    assert common_prefix_length([], [1]) == 0
