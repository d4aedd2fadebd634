"""``/metrics`` for the rolling summaries: the worker's backlog and each summary's lag.

Read at scrape time from the app's :class:`~convo.summarize.SummaryWorker`
(:meth:`~convo.summarize.SummaryWorker.stats`):

* ``convo_summary_backlog`` (gauge): summaries waiting, queued or running;
* ``convo_summary_lag_seconds`` (histogram): from a summary becoming due (its turns left
  the window) to its being written;
* ``convo_summary_written_total``, ``convo_summary_shed_total`` (a full backlog refused
  it; its turns stay owed), ``convo_summary_failed_total`` (counters).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from convo.summarize import SummaryWorker


class SummaryCollector(Collector):
    """Reads a summary worker's :class:`~convo.summarize.SummaryStats` at scrape time."""

    def __init__(self, worker: SummaryWorker) -> None:
        self.worker = worker

    def collect(self) -> Iterator[Any]:
        stats = self.worker.stats()
        yield GaugeMetricFamily(
            "convo_summary_backlog", "rolling summaries waiting (queued or running)", value=stats.backlog
        )
        lag = HistogramMetricFamily(
            "convo_summary_lag_seconds", "seconds from a summary becoming due to its being written"
        )
        buckets = [("+Inf" if math.isinf(b) else repr(b), float(c)) for b, c in stats.lag.buckets]
        lag.add_metric([], buckets, stats.lag.sum)
        yield lag
        for name, text, value in (
            ("convo_summary_written", "rolling summaries written", stats.written),
            ("convo_summary_shed", "summaries refused by a full backlog (their turns stay owed)", stats.shed),
            ("convo_summary_failed", "summary attempts that failed (retried on the next turn)", stats.failed),
        ):
            yield CounterMetricFamily(name, text, value=value)
