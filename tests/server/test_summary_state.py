"""The server reports where each session's summary stands (GET /v1/sessions/{id}:
``summary_state``, with its lag) and the summary backlog and lag on /metrics."""

from __future__ import annotations

import threading
from typing import Any

import httpx
from conftest import serve

from convo import Budget, InMemoryStore
from convo.models import Priority
from convo.server.app import create_app
from convo.summarize import SummaryWorker
from convo.testing import EchoEngine

BUDGET = Budget(
    context_tokens=4000, max_new_tokens=50, window_turns=1, summarize_batch_turns=1, summary_tokens=40
)


class GatedSummaries(EchoEngine):
    """An echo engine whose summary calls wait for ``gate``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.owners: list[Any] = []

    def generate(self, messages: Any, **kw: Any) -> Any:
        if kw.get("priority") == Priority.BACKGROUND:
            self.owners.append(kw.get("owner"))
            assert self.gate.wait(10)
        return super().generate(messages, **kw)


def test_session_state_and_metrics_report_the_summary_backlog_and_lag() -> None:
    engine, store = GatedSummaries(), InMemoryStore()
    worker = SummaryWorker(max_defer_s=0.0)
    app = create_app(engine, store=store, budget=BUDGET, model_name="echo", summaries=worker)
    try:
        with serve(app) as base:
            body = {"model": "echo", "messages": [{"role": "user", "content": "my boat is Nautilus"}]}
            r = httpx.post(f"{base}/v1/chat/completions", json=body, headers={"X-Session-Id": "s1"})
            assert r.status_code == 200, r.text
            pending = httpx.get(f"{base}/v1/sessions/s1").json()["summary_state"]
            assert pending["status"] in ("pending", "running") and pending["lag_s"] is None
            assert pending["backlog"] == 1
            assert "convo_summary_backlog 1.0" in httpx.get(f"{base}/metrics").text
            engine.gate.set()
            job = worker.job(store, "s1")
            assert job is not None and job.wait(10)
            done = httpx.get(f"{base}/v1/sessions/s1").json()["summary_state"]
            assert done["status"] == "done" and done["lag_s"] >= 0 and done["backlog"] == 0
            text = httpx.get(f"{base}/metrics").text
            assert "convo_summary_backlog 0.0" in text
            assert "convo_summary_lag_seconds_count 1.0" in text
            assert "convo_summary_written_total 1.0" in text
            assert engine.owners and set(engine.owners) == {"s1"}  # its own session's KV
    finally:
        engine.gate.set()
        worker.close(wait=False)
