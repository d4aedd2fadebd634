"""A tiny, dependency-free metrics registry: Counter, Gauge, Histogram.

Renders the Prometheus text exposition format (``render_prometheus()``) and reads back as
plain Python (``snapshot()``). Thread-safe; no global state: create a :class:`Registry`
and pass it where it is needed.

Example::

    reg = Registry()
    waits = reg.histogram("convo_queue_wait_seconds", "time spent queued")
    waits.observe(0.2)
    print(reg.render_prometheus())
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from convo.errors import ConfigError

LabelKey = tuple[tuple[str, str], ...]

DEFAULT_SECONDS_BUCKETS: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


def _check_name(name: str) -> None:
    import re

    if not re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", name):
        raise ConfigError(f"invalid metric name {name!r}")


def _key(labelnames: Sequence[str], labels: dict[str, str]) -> LabelKey:
    if set(labels) != set(labelnames):
        raise ConfigError(f"labels {sorted(labels)} do not match {sorted(labelnames)}")
    return tuple((n, str(labels[n])) for n in labelnames)


def _fmt_labels(key: LabelKey, extra: tuple[tuple[str, str], ...] = ()) -> str:
    items = key + extra
    if not items:
        return ""
    body = ",".join(
        f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(10), "").replace(chr(34), chr(92) + chr(34))}"'
        for k, v in items
    )
    return "{" + body + "}"


def _fmt_value(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if float(v).is_integer():
        return str(int(v))
    return repr(float(v))


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        _check_name(name)
        self.name = name
        self.help = help
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()


class Counter(_Metric):
    """A value that only goes up (requests, tokens)."""

    kind = "counter"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help, labelnames)
        self._values: dict[LabelKey, float] = {}
        if not self.labelnames:
            self._values[()] = 0.0

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        """Add ``amount`` (>= 0)."""
        if amount < 0:
            raise ConfigError("a counter cannot decrease")
        key = _key(self.labelnames, labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(_key(self.labelnames, labels), 0.0)

    def _samples(self) -> list[tuple[str, LabelKey, float]]:
        with self._lock:
            return [
                (self.name + "_total" if not self.name.endswith("_total") else self.name, k, v)
                for k, v in sorted(self._values.items())
            ]


class Gauge(_Metric):
    """A value that goes up and down (running requests, bytes in use)."""

    kind = "gauge"

    def __init__(self, name: str, help: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help, labelnames)
        self._values: dict[LabelKey, float] = {}
        if not self.labelnames:
            self._values[()] = 0.0

    def set(self, value: float, **labels: str) -> None:
        with self._lock:
            self._values[_key(self.labelnames, labels)] = float(value)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = _key(self.labelnames, labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def dec(self, amount: float = 1.0, **labels: str) -> None:
        self.inc(-amount, **labels)

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(_key(self.labelnames, labels), 0.0)

    def _samples(self) -> list[tuple[str, LabelKey, float]]:
        with self._lock:
            return [(self.name, k, v) for k, v in sorted(self._values.items())]


@dataclass(frozen=True, kw_only=True)
class HistogramSnapshot:
    """Readable state of a histogram: cumulative bucket counts, sum, count."""

    buckets: tuple[tuple[float, int], ...]
    sum: float
    count: int

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding quantile ``q`` (0..1); nan when empty."""
        if self.count == 0:
            return math.nan
        rank = q * self.count
        for upper, cum in self.buckets:
            if cum >= rank:
                return upper
        return math.inf


class Histogram(_Metric):
    """Observations counted in cumulative buckets (waits, latencies in seconds)."""

    kind = "histogram"

    def __init__(
        self,
        name: str,
        help: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = DEFAULT_SECONDS_BUCKETS,
    ) -> None:
        super().__init__(name, help, labelnames)
        bounds = sorted(float(b) for b in buckets)
        if not bounds or len(set(bounds)) != len(bounds):
            raise ConfigError("histogram buckets must be distinct and non-empty")
        if not math.isinf(bounds[-1]):
            bounds.append(math.inf)
        self.bounds = tuple(bounds)
        self._counts: dict[LabelKey, list[int]] = {}
        self._sums: dict[LabelKey, float] = {}

    def observe(self, value: float, **labels: str) -> None:
        key = _key(self.labelnames, labels)
        with self._lock:
            counts = self._counts.setdefault(key, [0] * len(self.bounds))
            for i, upper in enumerate(self.bounds):
                if value <= upper:
                    counts[i] += 1
                    break
            self._sums[key] = self._sums.get(key, 0.0) + value

    def snapshot_of(self, **labels: str) -> HistogramSnapshot:
        key = _key(self.labelnames, labels)
        with self._lock:
            counts = list(self._counts.get(key, [0] * len(self.bounds)))
            total = self._sums.get(key, 0.0)
        cum, acc = [], 0
        for upper, c in zip(self.bounds, counts, strict=True):
            acc += c
            cum.append((upper, acc))
        return HistogramSnapshot(buckets=tuple(cum), sum=total, count=acc)

    def _samples(self) -> list[tuple[str, LabelKey, float]]:
        with self._lock:
            keys = sorted(self._counts)
        out: list[tuple[str, LabelKey, float]] = []
        for key in keys:
            snap = self.snapshot_of(**dict(key))
            for upper, cum in snap.buckets:
                le = (("le", "+Inf" if math.isinf(upper) else _fmt_value(upper)),)
                out.append((self.name + "_bucket", key + le, float(cum)))
            out.append((self.name + "_sum", key, snap.sum))
            out.append((self.name + "_count", key, float(snap.count)))
        return out


class Registry:
    """Holds metrics by name; renders them all."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}
        self._lock = threading.Lock()

    def _add(self, metric: _Metric) -> _Metric:
        with self._lock:
            if metric.name in self._metrics:
                raise ConfigError(f"metric {metric.name!r} is already registered")
            self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Counter:
        m = Counter(name, help, labelnames)
        self._add(m)
        return m

    def gauge(self, name: str, help: str, labelnames: Sequence[str] = ()) -> Gauge:
        m = Gauge(name, help, labelnames)
        self._add(m)
        return m

    def histogram(
        self,
        name: str,
        help: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = DEFAULT_SECONDS_BUCKETS,
    ) -> Histogram:
        m = Histogram(name, help, labelnames, buckets)
        self._add(m)
        return m

    def metrics(self) -> list[Counter | Gauge | Histogram]:
        """Every registered metric, in registration order (exporters read them)."""
        with self._lock:
            return [m for m in self._metrics.values() if isinstance(m, (Counter, Gauge, Histogram))]

    def render_prometheus(self) -> str:
        """All metrics in the Prometheus text exposition format (version 0.0.4)."""
        lines: list[str] = []
        with self._lock:
            metrics = list(self._metrics.values())
        for m in metrics:
            lines.append(f"# HELP {m.name} {m.help.replace(chr(10), ' ')}")
            lines.append(f"# TYPE {m.name} {m.kind}")
            for name, key, value in m._samples():  # type: ignore[attr-defined]
                lines.append(f"{name}{_fmt_labels(key)} {_fmt_value(value)}")
        return "\n".join(lines) + "\n"

    def snapshot(self) -> dict[str, object]:
        """``{name: value}`` for unlabelled counters/gauges, ``{name: {labels: value}}``
        for labelled ones, and a :class:`HistogramSnapshot` (or a dict of them) for
        histograms."""
        out: dict[str, object] = {}
        with self._lock:
            metrics = list(self._metrics.values())
        for m in metrics:
            if isinstance(m, Histogram):
                with m._lock:
                    keys = sorted(m._counts)
                if not m.labelnames:
                    out[m.name] = m.snapshot_of()
                else:
                    out[m.name] = {k: m.snapshot_of(**dict(k)) for k in keys}
            elif isinstance(m, (Counter, Gauge)):
                with m._lock:
                    values = dict(m._values)
                out[m.name] = values.get((), 0.0) if not m.labelnames else values
        return out


#: What the admission ledger counts, as metric names spell it.
LEDGER_UNITS = ("bytes", "tokens")


class ServingMetrics:
    """The metrics of a serving process (admission, queue, generation).

    Args:
        registry: where to register them; a new one by default.
        prefix: metric name prefix. Default ``"convo"``.
        ledger_unit: what the admission ledger charges: ``"bytes"`` (a KV memory model;
            ``convo_kv_budget_bytes``, ``convo_kv_bytes_in_use``) or ``"tokens"`` (the
            server's token ledger; ``convo_kv_budget_tokens``, ``convo_kv_tokens_in_use``).
            Default ``"bytes"``.

    Raises:
        ConfigError: an unknown ``ledger_unit``.
    """

    def __init__(
        self, registry: Registry | None = None, *, prefix: str = "convo", ledger_unit: str = "bytes"
    ) -> None:
        if ledger_unit not in LEDGER_UNITS:
            raise ConfigError(f"ledger_unit must be one of {LEDGER_UNITS}, got {ledger_unit!r}")
        self.ledger_unit = ledger_unit
        self.registry = registry or Registry()
        r, p, unit = self.registry, prefix, ledger_unit
        self.running = r.gauge(f"{p}_requests_running", "requests admitted and not yet released")
        self.waiting = r.gauge(f"{p}_requests_waiting", "requests in the admission queues")
        self.admitted = r.counter(f"{p}_requests_admitted_total", "requests admitted")
        self.completed = r.counter(f"{p}_requests_completed_total", "requests released")
        self.refused = r.counter(f"{p}_requests_refused_total", "requests refused, by reason", ("reason",))
        self.kv_in_use = r.gauge(f"{p}_kv_{unit}_in_use", f"{unit} charged to admitted requests")
        self.kv_budget = r.gauge(f"{p}_kv_budget_{unit}", f"the admission budget in {unit}")
        self.queue_wait = r.histogram(f"{p}_queue_wait_seconds", "time from submit to admission")
        self.ttft = r.histogram(
            f"{p}_time_to_first_token_seconds", "time from submit to the first generated token"
        )
        self.tokens = r.counter(f"{p}_generated_tokens_total", "tokens generated")
        self.tokens_per_s = r.gauge(
            f"{p}_tokens_per_second", "generated tokens per second since the metrics started"
        )
        self._t0 = time.monotonic()

    def add_tokens(self, n: int) -> None:
        """Count ``n`` generated tokens and update the tokens/s gauge."""
        self.tokens.inc(n)
        elapsed = max(time.monotonic() - self._t0, 1e-9)
        self.tokens_per_s.set(self.tokens.value() / elapsed)

    def render_prometheus(self) -> str:
        return self.registry.render_prometheus()

    def snapshot(self) -> dict[str, object]:
        return self.registry.snapshot()
