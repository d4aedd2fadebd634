"""``/metrics`` reports the device's memory (``convo_device_memory_*``) and, for a server
sized to a memory limit, the plan's peak: what an operator compares against the card."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("fastapi")


def _scrape(engine: Any, tmp_path: Path) -> dict[str, Any]:
    from fastapi.testclient import TestClient
    from prometheus_client.parser import text_string_to_metric_families

    from convo.server import create_app
    from convo.stores import SQLiteStore

    store = SQLiteStore(tmp_path / f"m{len(list(tmp_path.iterdir()))}.db")
    with TestClient(create_app(engine, store=store), base_url="http://127.0.0.1") as c:
        text = c.get("/metrics").text
    return {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}


def test_a_real_engine_reports_its_memory_on_metrics(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from convo.engines.local.engine import TransformersEngine
    from convo.messages import user

    engine = TransformersEngine("random:tiny-llama", device="cpu")
    engine.generate([user("hello")], max_new_tokens=2)
    got = _scrape(engine, tmp_path)
    rss = got["convo_device_memory_reserved_bytes"]
    assert rss.labels == {"kind": "rss"} and rss.value > 1 << 20
    assert got["convo_device_memory_peak_reserved_bytes"].value >= rss.value
    assert "convo_engine_planned_peak_reserved_bytes" not in got  # not sized to a limit


def test_a_sized_engine_also_reports_the_planned_peak(tmp_path: Path) -> None:
    from convo.testing import EchoEngine

    class Sized(EchoEngine):
        planned_peak_reserved_bytes = 15 << 30

        def memory_report(self) -> dict[str, Any]:
            return {"memory_kind": "cuda", "allocated_bytes": 10 << 30, "reserved_bytes": 11 << 30,
                    "peak_allocated_bytes": 12 << 30, "peak_reserved_bytes": 14 << 30}  # fmt: skip

    got = _scrape(Sized(), tmp_path)
    assert got["convo_device_memory_peak_reserved_bytes"].value == 14 << 30
    assert got["convo_device_memory_allocated_bytes"].labels == {"kind": "cuda"}
    assert got["convo_engine_planned_peak_reserved_bytes"].value == 15 << 30
    assert "convo_device_memory_reserved_bytes" not in _scrape(EchoEngine(), tmp_path)  # no device: none
