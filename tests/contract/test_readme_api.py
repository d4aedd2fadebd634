"""The README's promises: two set-up commands, runnable examples, a small public API."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import convo

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_first_bash_block_has_exactly_two_commands_and_ci_runs_the_second() -> None:
    block = re.search(r"```bash\n(.*?)```", README, flags=re.S)
    assert block is not None
    lines = [line for line in block.group(1).splitlines() if line.strip()]
    assert len(lines) == 2
    assert "convo chat --script" in lines[0]
    assert "pytest" in lines[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "sed -n 2p" in ci  # CI executes the README's second line verbatim


@pytest.mark.parametrize(
    "code",
    [
        pytest.param(
            code, marks=[pytest.mark.slow] if ("Engine(" in code or "Memory(" in code) else [], id=f"block{i}"
        )
        for i, code in enumerate(python_blocks())
    ],
)
def test_readme_python_examples_run(code: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_public_api_is_sorted_and_complete() -> None:
    assert convo.__all__ == sorted(convo.__all__)
    for name in convo.__all__:
        assert getattr(convo, name) is not None


def test_import_is_light() -> None:
    heavy = "('torch', 'transformers', 'faiss', 'sentence_transformers')"
    code = f"import sys, convo; print(any(m in sys.modules for m in {heavy}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_public_api_is_small() -> None:
    assert len(convo.__all__) <= 30, len(convo.__all__)


def test_no_library_module_imports_the_cli() -> None:
    """The CLI is a client of the library, never the reverse (all argparse lives in convo.cli)."""
    import ast

    offenders = []
    for path in (ROOT / "convo").rglob("*.py"):
        rel = path.relative_to(ROOT / "convo")
        if rel.parts[0] == "cli" or rel.name == "__main__.py":  # the CLI and `python -m convo`
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any(n == "convo.cli" or n.startswith("convo.cli.") for n in names):
                offenders.append(str(rel))
            if isinstance(node, ast.Import | ast.ImportFrom) and any(
                (a.name == "argparse") for a in node.names
            ):
                offenders.append(f"{rel} (argparse)")
    assert not offenders, offenders


@pytest.mark.parametrize(
    ("old", "new"),
    [("Memory", "RetrievalMemory"), ("ConfigError", "ConfigError"), ("Turn", "Turn")],
)
def test_old_top_level_names_still_work_with_a_warning(old: str, new: str) -> None:
    with pytest.warns(DeprecationWarning, match=old):
        value = getattr(convo, old)
    assert value.__name__ == new


def test_old_planner_module_warns() -> None:
    code = (
        "import warnings; warnings.simplefilter('error');\n"
        "try:\n import convo.memory\nexcept DeprecationWarning as e:\n print('warned', e)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.startswith("warned") and "convo.planner" in out.stdout
