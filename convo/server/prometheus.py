"""``GET /metrics`` through ``prometheus_client``: the serving metrics (admission, queue,
generation) and the process's own (CPU, memory, open files), in the exposition format
Prometheus negotiates.

The counts live in :class:`convo.metrics.ServingMetrics` (dependency-free, so the admission
controller works without the server extra); :class:`ServingCollector` reads them at scrape
time. Names say what they count: ``*_seconds``, ``*_tokens``, ``*_bytes``, ``*_total``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from convo.errors import MissingDependency
from convo.metrics import Counter, Gauge, Histogram, HistogramSnapshot, ServingMetrics

try:
    from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
    from prometheus_client.registry import Collector
except ImportError:  # pragma: no cover - the server extra installs it
    raise MissingDependency("the server needs prometheus_client; run: pip install 'convo[server]'") from None

#: What ``/metrics`` answers with (the classic text format, version 0.0.4).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServingCollector(Collector):
    """Reads a :class:`~convo.metrics.ServingMetrics` registry at scrape time."""

    def __init__(self, metrics: ServingMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        snapshot = self.metrics.registry.snapshot()
        for m in self.metrics.registry.metrics():
            value = snapshot[m.name]
            labelled: dict[tuple[tuple[str, str], ...], Any] = (
                value if m.labelnames else {(): value}  # type: ignore[assignment]
            )
            if isinstance(m, Counter):
                family: Any = CounterMetricFamily(m.name, m.help, labels=m.labelnames)
                for key, v in labelled.items():
                    family.add_metric([v_ for _, v_ in key], v)
            elif isinstance(m, Gauge):
                family = GaugeMetricFamily(m.name, m.help, labels=m.labelnames)
                for key, v in labelled.items():
                    family.add_metric([v_ for _, v_ in key], v)
            elif isinstance(m, Histogram):
                family = HistogramMetricFamily(m.name, m.help, labels=m.labelnames)
                for key, snap in labelled.items():
                    assert isinstance(snap, HistogramSnapshot)
                    buckets = [("+Inf" if math.isinf(b) else repr(b), float(c)) for b, c in snap.buckets]
                    family.add_metric([v_ for _, v_ in key], buckets, snap.sum)
            else:  # pragma: no cover
                continue
            yield family


class EngineCollector(Collector):
    """Reads the engine's scheduler counters at scrape time (``scheduler_stats``: a
    :class:`~convo.models.generation.SchedulerStats`, or ``None`` when it has no scheduler)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        if self.engine is None:
            return
        yield from self._memory()
        stats = self.engine.scheduler_stats
        if stats is None:
            return
        steps = CounterMetricFamily("convo_engine_steps", "scheduler steps run, by kind", labels=["kind"])
        busy = CounterMetricFamily(
            "convo_engine_busy_seconds",
            "seconds in scheduler steps, by kind, until their tokens were read back (device time included)",
            labels=["kind"],
        )
        for kind, n in stats.steps.items():
            steps.add_metric([kind], n)
            busy.add_metric([kind], stats.busy_s[kind])
        yield steps
        yield busy
        by_work = CounterMetricFamily(
            "convo_engine_work_prompt_tokens",
            "prompt tokens prefilled, by kind of work (reply, background: summaries, prefill ahead)",
            labels=["work"],
        )
        novel_by_work = CounterMetricFamily(
            "convo_engine_work_novel_prompt_tokens",
            "novel prompt tokens (as convo_engine_novel_prompt_tokens), by kind of work",
            labels=["work"],
        )
        for work, n in stats.prompt_tokens_by_work.items():
            by_work.add_metric([work], n)
            novel_by_work.add_metric([work], stats.novel_tokens_by_work.get(work, 0))
        yield by_work
        yield novel_by_work
        for name, text, value in (
            ("convo_engine_decode_rows", "tokens decoded by the scheduler", stats.decode_rows),
            ("convo_engine_prompt_tokens", "prompt tokens prefilled by the scheduler", stats.prompt_tokens),
            (
                "convo_engine_novel_prompt_tokens",
                "prompt tokens an unbounded exact KV cache would still prefill (past each prompt's "
                "common prefix with what its session's KV last held)",
                stats.novel_prompt_tokens,
            ),
            ("convo_engine_preemptions", "requests stopped to free a slot for a reply", stats.preemptions),
            ("convo_engine_preemptions_parked", "preempted work parked in host memory", stats.parked),
            (
                "convo_engine_recomputed_prompt_tokens",
                "prompt tokens preempted work prefilled again after its stop",
                stats.recomputed_tokens,
            ),
            ("convo_engine_kv_swaps_out", "sessions' KV copied from a slot to host memory", stats.swaps_out),
            ("convo_engine_kv_swaps_in", "sessions' KV copied from host memory into a slot", stats.swaps_in),
            ("convo_engine_kv_copied_bytes", "bytes of KV copied between slots and host", stats.swap_bytes),
            ("convo_engine_kv_host_dropped", "host KV entries dropped: host memory full", stats.host_dropped),
            (
                "convo_engine_kv_kept_for_background",
                "session prefixes kept in host memory for the session's queued summary "
                "(parked or handed over) before its turn overwrote them",
                stats.kept_for_background,
            ),
            (
                "convo_engine_kv_slot_copies",
                "session prefixes copied from a busy slot for other work of the session, not prefilled",
                stats.slot_copies,
            ),
            (
                "convo_engine_kv_slot_copied_tokens",
                "tokens of those session prefixes",
                stats.slot_copied_tokens,
            ),
            (
                "convo_engine_kv_shifts",
                "context shifts: cached turns moved where a slid window put them",
                stats.shifts,
            ),
            (
                "convo_engine_kv_shifted_tokens",
                "cached tokens moved by context shifts, not prefilled",
                stats.shifted_tokens,
            ),
        ):
            yield CounterMetricFamily(name, text, value=value)
        for name, text, value in (
            ("convo_engine_kv_host_bytes", "bytes of KV held in host memory", stats.host_bytes),
            (
                "convo_engine_kv_host_bytes_peak",
                "most bytes of KV held in host memory",
                stats.host_bytes_peak,
            ),
            (
                "convo_engine_kv_host_limit_bytes",
                "host memory bound for KV (0: none)",
                stats.host_limit_bytes,
            ),
            (
                "convo_engine_kv_host_reserved_bytes",
                "bytes of the host KV arena, taken once (in use or not)",
                stats.host_reserved_bytes,
            ),
        ):
            yield GaugeMetricFamily(name, text, value=value)

    def _memory(self) -> Iterator[Any]:
        """The device's memory (``convo_device_memory_*_bytes``, labelled ``kind``: ``cuda``
        for the caching allocator, ``rss`` for a CPU process) and, for an engine sized to a
        memory limit, the plan's peak (``convo_engine_planned_peak_reserved_bytes``)."""
        mem = self.engine.memory_report()
        if mem is None:
            return
        for key, text in (
            ("allocated_bytes", "device memory allocated now"),
            ("reserved_bytes", "device memory reserved now (allocated and cached)"),
            ("peak_allocated_bytes", "most device memory allocated since start"),
            ("peak_reserved_bytes", "most device memory reserved since start"),
        ):
            family = GaugeMetricFamily(f"convo_device_memory_{key}", text, labels=["kind"])
            family.add_metric([mem["memory_kind"]], mem[key])
            yield family
        planned = self.engine.planned_peak_reserved_bytes
        if planned is not None:
            yield GaugeMetricFamily(
                "convo_engine_planned_peak_reserved_bytes",
                "the plan's peak reserved for the slots picked (--gpu-memory)",
                value=planned,
            )


def metrics_registry(metrics: ServingMetrics, engine: Any = None) -> CollectorRegistry:
    """A registry of its own for one app: the serving metrics, the engine's scheduler
    counters (when it has a scheduler) and the process's."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServingCollector(metrics))
    registry.register(EngineCollector(engine))
    ProcessCollector(registry=registry)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The registry in the Prometheus text format."""
    return bytes(generate_latest(registry))
