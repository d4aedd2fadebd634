"""The dependency-free metrics registry."""

from __future__ import annotations

import math
import threading

import pytest

from convo.errors import ConfigError
from convo.metrics import Registry, ServingMetrics


def test_counter_gauge_histogram_render() -> None:
    reg = Registry()
    c = reg.counter("convo_requests_refused_total", "refused", ("reason",))
    g = reg.gauge("convo_requests_running", "running")
    h = reg.histogram("convo_queue_wait_seconds", "wait", buckets=(0.1, 1.0))
    c.inc(reason="queue_full")
    c.inc(2, reason="queue_full")
    c.inc(reason="queue_timeout")
    g.set(3)
    g.dec()
    for v in (0.05, 0.5, 5.0):
        h.observe(v)
    text = reg.render_prometheus()
    assert "# TYPE convo_requests_refused_total counter" in text
    assert 'convo_requests_refused_total{reason="queue_full"} 3' in text
    assert 'convo_requests_refused_total{reason="queue_timeout"} 1' in text
    assert "convo_requests_running 2" in text
    assert 'convo_queue_wait_seconds_bucket{le="0.1"} 1' in text
    assert 'convo_queue_wait_seconds_bucket{le="1"} 2' in text
    assert 'convo_queue_wait_seconds_bucket{le="+Inf"} 3' in text
    assert "convo_queue_wait_seconds_count 3" in text
    assert "convo_queue_wait_seconds_sum 5.55" in text
    assert text.endswith("\n")
    snap = reg.snapshot()
    assert snap["convo_requests_running"] == 2
    assert snap["convo_requests_refused_total"] == {
        (("reason", "queue_full"),): 3.0,
        (("reason", "queue_timeout"),): 1.0,
    }
    hs = snap["convo_queue_wait_seconds"]
    assert hs.count == 3 and hs.quantile(0.5) == 1.0 and math.isinf(hs.quantile(1.0))


def test_counter_rejects_negative_and_bad_names() -> None:
    reg = Registry()
    c = reg.counter("x_total", "x")
    with pytest.raises(ConfigError):
        c.inc(-1)
    with pytest.raises(ConfigError):
        reg.gauge("bad name", "x")
    with pytest.raises(ConfigError):
        reg.counter("x_total", "again")
    with pytest.raises(ConfigError):
        c.inc(reason="no labels declared")


def test_counter_is_thread_safe() -> None:
    reg = Registry()
    c = reg.counter("hits_total", "hits")

    def work() -> None:
        for _ in range(10_000):
            c.inc()

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.value() == 80_000


def test_label_values_are_escaped() -> None:
    reg = Registry()
    g = reg.gauge("g", "g", ("path",))
    g.set(1, path='a"b\\c')
    assert 'g{path="a\\"b\\\\c"} 1' in reg.render_prometheus()


def test_serving_metrics_tokens_per_second() -> None:
    m = ServingMetrics()
    m.add_tokens(100)
    snap = m.snapshot()
    assert snap["convo_generated_tokens_total"] == 100
    assert snap["convo_tokens_per_second"] > 0
    assert "convo_time_to_first_token_seconds" in m.render_prometheus()
