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

ROOT = Path(__file__).resolve().parents[1]


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

    from convo.engines.models import progress_bars

    hf_logging.enable_progress_bar()
    with progress_bars(False):
        assert not hf_logging.is_progress_bar_enabled()
    assert hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    with progress_bars(True):  # the CLI passes a progress callback
        assert hf_logging.is_progress_bar_enabled()
    assert not hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
