"""Python conventions: typed package, logging under convo.*, quiet library loads, optional
frameworks imported only when asked for."""

from __future__ import annotations

import logging
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from convo import Budget, Session
from convo.errors import DeviceOutOfMemory, MissingDependency
from convo.integrations import require
from convo.tokens import CharCounter

ROOT = Path(__file__).resolve().parents[2]


def test_py_typed_ships() -> None:
    assert (ROOT / "convo" / "py.typed").is_file()
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["convo"]


def test_import_convo_loads_no_framework() -> None:
    heavy = "('langchain_core', 'llama_index', 'agents', 'prometheus_client', 'convo.integrations')"
    code = f"import sys, convo; print([m for m in {heavy} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_missing_extra_names_the_install() -> None:
    with pytest.raises(MissingDependency, match=r"pip install 'convo\[nothere\]'"):
        require("convo_no_such_module.sub", "nothere")


def test_window_moves_and_oom_recoveries_are_logged(
    caplog: pytest.LogCaptureFixture, fake_engine: Any
) -> None:
    session = Session(
        fake_engine,
        budget=Budget(window_turns=1, summarize_batch_turns=1, summary_tokens=0),
        counter=CharCounter(),
    )
    with caplog.at_level(logging.INFO, logger="convo"):
        session.send("one")
        fake_engine.fail_with, fake_engine.fail_times = DeviceOutOfMemory("injected"), 1
        session.send("two")
    records = {(r.name, r.levelno, r.getMessage().split(": ", 1)[1][:20]) for r in caplog.records}
    assert ("convo.session", logging.INFO, "turns 0-0 left the w") in records
    assert any(
        r.name == "convo.session" and r.levelno == logging.WARNING and "out of memory" in r.getMessage()
        for r in caplog.records
    )


def test_library_loads_keep_transformers_bars_off_and_restore_them() -> None:
    pytest.importorskip("transformers")
    from transformers.utils import logging as hf_logging

    from convo.engines.local.loading import progress_bars

    hf_logging.enable_progress_bar()
    with progress_bars(False):
        assert not hf_logging.is_progress_bar_enabled()
    assert hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    with progress_bars(True):  # the CLI passes a progress callback
        assert hf_logging.is_progress_bar_enabled()
    assert not hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()


def _function_level_convo_imports(path: Path) -> list[str]:
    """``from convo...`` / ``import convo...`` statements inside a function body of ``path``."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for inner in ast.walk(node):
            names = []
            if isinstance(inner, ast.ImportFrom) and inner.level == 0 and inner.module:
                names = [inner.module]
            elif isinstance(inner, ast.Import):
                names = [a.name for a in inner.names]
            if any(n == "convo" or n.startswith("convo.") for n in names):
                found.append(f"{path.relative_to(ROOT)}:{inner.lineno}")
    return found


#: Files under the rule "no import of the project inside a function" (issue 26 rule 2) that
#: this test checks. ``convo/cli/serve.py`` joins when its own change lands.
NO_FUNCTION_LEVEL_IMPORTS = [
    *(p for p in sorted((ROOT / "convo" / "cli").glob("*.py")) if p.name != "serve.py"),
    ROOT / "convo" / "integrations" / "llamaindex.py",
    ROOT / "convo" / "integrations" / "openai_agents.py",
    ROOT / "convo" / "integrations" / "__init__.py",
    ROOT / "convo" / "messages.py",
]


@pytest.mark.parametrize("path", NO_FUNCTION_LEVEL_IMPORTS, ids=lambda p: p.name)
def test_no_convo_import_inside_a_function(path: Path) -> None:
    assert _function_level_convo_imports(path) == []


def test_convo_help_and_version_load_no_subcommand() -> None:
    """``convo --help`` lists the sub-commands without importing them (nor torch, numpy,
    transformers, fastapi): each loads only when it runs."""
    code = (
        "import sys\nfrom convo.cli import main\n"
        "for argv in (['--help'], ['--version']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "heavy = ('torch', 'numpy', 'transformers', 'fastapi', 'convo.cli.chat', 'convo.cli.serve',"
        " 'convo.cli.plan', 'convo.retrieval', 'convo.planner.measure')\n"
        "print([m for m in heavy if m in sys.modules], file=sys.stderr)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert "chat" in out.stdout and "convo 0." in out.stdout
    assert out.stderr.strip() == "[]"


def test_adapter_extras_install_the_frameworks_openai_compatible_client() -> None:
    """``convo[langchain]`` brings ``ChatOpenAI``, what the README's examples use to talk to
    ``convo serve``. LlamaIndex's ``OpenAILike`` pins ``openai<3`` (it would move ``[dev]``'s
    openai and openai-agents back a major version), so the README names its own install."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def names(extra: str) -> set[str]:
        return {req.split(">")[0].split("=")[0].split("<")[0].strip() for req in extras[extra]}

    assert {"langchain-core", "langchain-openai"} <= names("langchain")
    assert {"llama-index-core"} <= names("llamaindex")
    assert "pip install llama-index-llms-openai-like" in (ROOT / "README.md").read_text(encoding="utf-8")


#: The editable install static type checkers can follow: a plain path in a ``.pth`` file
#: (setuptools' default editable install is an import hook that mypy and pyright cannot see).
EDITABLE_INSTALL_FOR_TYPE_CHECKERS = "pip install -e '.[dev]' --config-settings editable_mode=compat"


@pytest.mark.slow
def test_type_checkers_find_the_editable_install(tmp_path: Path) -> None:
    """mypy, run outside the checkout on a file that imports convo, finds the installed
    package (issue 27 #25); skipped unless convo is installed editable."""
    import importlib.metadata
    import json
    import os

    pytest.importorskip("mypy")
    installs = [d.read_text("direct_url.json") for d in importlib.metadata.distributions(name="convo")]
    if not any(url and json.loads(url).get("dir_info", {}).get("editable") for url in installs):
        pytest.skip("convo is not installed editable")  # (an egg-info in the checkout has no direct_url)
    (tmp_path / "uses_convo.py").write_text("import convo\n\nbudget: convo.Budget = convo.Budget()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}
    command = [sys.executable, "-m", "mypy", "--no-incremental", "--python-executable", sys.executable]
    out = subprocess.run(
        [*command, "uses_convo.py"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600
    )
    assert out.returncode == 0, (
        f"mypy cannot find the installed convo; install it with: {EDITABLE_INSTALL_FOR_TYPE_CHECKERS}\n"
        + out.stdout
    )
