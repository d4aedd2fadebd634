"""The README's "Agents with tools" snippets, each run as a user runs it (its own Python
process) against a live ``convo serve`` on loopback whose model is scripted in the Hermes
format (``ScriptedToolEngine``, the local engine's parser). The snippets are fenced
```` ```py ```` so that the README's generic block test (which has no server) leaves them to
this one. Each run checks what the snippet printed and what the model was shown."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import serve

from convo import Budget, InMemoryStore
from convo.messages import Role
from convo.server.app import create_app
from convo.testing import ScriptedToolEngine

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
SECTION = README.split("## Agents with tools", 1)[1].split("\n## ", 1)[0]
BLOCKS = re.findall(r"```py\n(.*?)```", SECTION, flags=re.S)
BUDGET = Budget(context_tokens=6000, max_new_tokens=200, window_turns=4, summary_tokens=0)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SUNNY = "It is sunny in Paris."

#: What each snippet's model says (in order), and what the snippet must print.
SCRIPTS = {
    "agents_default_model": ([CALL, SUNNY, "Yes, a light one."], [SUNNY, "Yes, a light one."]),
    "agents_chat_completions_model": ([CALL, SUNNY], [SUNNY]),
    "langchain_bind_tools": ([CALL, SUNNY], [SUNNY]),
    "openai_chat_completions": ([CALL, SUNNY], [SUNNY]),
    "openai_responses_streamed": ([CALL, SUNNY], [SUNNY]),
}


def test_the_section_has_one_snippet_per_client() -> None:
    assert len(BLOCKS) == len(SCRIPTS)
    assert "OpenAILike" in SECTION and "is_function_calling_model" in SECTION


@pytest.mark.parametrize(("block", "name"), list(zip(BLOCKS, SCRIPTS, strict=False)), ids=list(SCRIPTS))
def test_readme_agent_snippet_runs(block: str, name: str) -> None:
    replies, printed = SCRIPTS[name]
    engine, store = ScriptedToolEngine(replies), InMemoryStore()
    app = create_app(engine, store=store, budget=BUDGET, model_name="convo")
    with serve(app) as base:
        env = {**os.environ, "CONVO_URL": f"{base}/v1"}
        run = subprocess.run(
            [sys.executable, "-c", block], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
        )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split("\n")[: len(printed)] == printed
    # The model got the tool, then the call with its result, inside the budget.
    assert len(engine.prompts) == len(replies)
    assert all(seen and seen[0]["function"]["name"] == "get_weather" for seen in engine.tools_seen)
    answered = engine.prompts[1]
    assert [m.role for m in answered if m.role is not Role.SYSTEM][-2:] == [Role.ASSISTANT, Role.TOOL]
    assert answered[-1].content == "sunny in Paris"
    for prompt, tools in zip(engine.prompts, engine.tools_seen, strict=True):
        assert engine.counter.count_with_tools(prompt, tools) + BUDGET.max_new_tokens <= BUDGET.context_tokens
    if name == "agents_default_model":  # the second run sent only its question: the server kept the rest
        later = [m.role for m in engine.prompts[2] if m.role is not Role.SYSTEM]
        assert later == [Role.USER, Role.ASSISTANT, Role.TOOL, Role.ASSISTANT, Role.USER]
