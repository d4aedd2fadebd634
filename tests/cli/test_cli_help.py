"""The commands' flags: every ``--help`` renders (argparse formats help strings with ``%``: a bare
``%`` in one, e.g. an f-string's ``5%``, crashed ``convo serve --help``), and the host KV each
command asks the engine for."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from convo.cli import build_parser


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: sub for action in subs for name, sub in action.choices.items()}


def test_the_cli_has_its_commands() -> None:
    assert {"chat", "serve", "plan"} <= set(_commands())


@pytest.mark.parametrize("command", sorted(_commands()))
def test_every_command_help_renders(command: str) -> None:
    text = _commands()[command].format_help()
    assert text.startswith("usage:") and "--help" in text


def test_serve_help_in_a_process_shows_the_memory_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "convo", "serve", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--gpu-memory" in out.stdout and "--kv-host-memory" in out.stdout and "5%," in out.stdout


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["chat", "--model", "default"], {"kv_host_memory": 0}),  # one conversation: no host KV
        (["serve", "--model", "default"], {}),  # the engine's default (a share of the RAM on CUDA)
        (["serve", "--model", "default", "--kv-host-memory", "2GiB"], {"kv_host_memory": 2 << 30}),
    ],
)
def test_host_kv_the_commands_ask_the_engine_for(
    argv: list[str], expected: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    from convo.cli import common

    seen: dict[str, object] = {}
    monkeypatch.setattr(common, "TransformersEngine", lambda *a, **kw: seen.update(kw))
    common.local_engine(build_parser().parse_args(argv), 2048, None)
    assert {k: v for k, v in seen.items() if k == "kv_host_memory"} == expected
