"""Broker metrics: live rates, publish latency, and the Prometheus text served at ``/metrics``.

:class:`BrokerMonitor` belongs to the admin server of one broker.  Every ``interval`` it

* samples the broker's cumulative counters (messages and bytes in per topic, out per
  subscription) and turns the differences into rates, which the admin API and the
  dashboard show; the last ``history`` broker-wide samples are kept for the dashboard's
  throughput chart;
* keeps the broker-wide history of those rates.

Publish latency — from the moment the broker accepts a batch until the replication
policy acknowledges it — is measured by each managed ledger itself
(``ManagedLedger.publish_latency``), from its first append on, and exported here.

:meth:`BrokerMonitor.render` builds the exposition from the broker's live state at scrape
time (a custom collector on a private registry, so several brokers in one process never
share metrics).  Counters restart from zero when a topic is unloaded and loaded again;
Prometheus' ``rate()`` handles such resets.  Bookie-side metrics (disk, journal, reads)
belong to the bookie process and are not exported here; the broker only reports how many
bookies it sees writable or read-only.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.process_collector import ProcessCollector

from pigeon.broker._histogram import LatencyHistogram

if TYPE_CHECKING:
    from pigeon.broker._service import BrokerService

__all__ = ["CONTENT_TYPE", "BrokerMonitor", "LatencyHistogram", "Rates"]

log = logging.getLogger(__name__)

#: Content type of the text exposition format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Rates:
    """Per-second rates over the last sampling interval."""

    msg_rate_in: float = 0.0
    msg_throughput_in: float = 0.0  # bytes/s
    msg_rate_out: float = 0.0
    msg_throughput_out: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in asdict(self).items()}


ZERO = Rates()

#: The per-subscription metric families, in exposition order: (name, type, help).
_SUBSCRIPTION_FAMILIES: tuple[
    tuple[str, type[CounterMetricFamily] | type[GaugeMetricFamily], str], ...
] = (
    ("pigeon_subscription_messages_out", CounterMetricFamily, "Messages dispatched to consumers."),
    ("pigeon_subscription_bytes_out", CounterMetricFamily, "Bytes dispatched to consumers."),
    ("pigeon_subscription_msg_rate_out", GaugeMetricFamily, "Messages per second dispatched."),
    ("pigeon_subscription_msg_throughput_out", GaugeMetricFamily, "Bytes per second dispatched."),
    ("pigeon_subscription_backlog_messages", GaugeMetricFamily, "Unacknowledged messages."),
    (
        "pigeon_subscription_backlog_bytes",
        GaugeMetricFamily,
        "Stored bytes from the mark-delete position on.",
    ),
    ("pigeon_subscription_consumers", GaugeMetricFamily, "Connected consumers."),
    (
        "pigeon_subscription_delayed_messages",
        GaugeMetricFamily,
        "Entries held for delayed delivery.",
    ),
    (
        "pigeon_subscription_dropped_messages",
        CounterMetricFamily,
        "Non-persistent messages dropped (slow consumers).",
    ),
    (
        "pigeon_subscription_lost_messages",
        CounterMetricFamily,
        "Messages skipped because no replica holds their entry intact (policy skip).",
    ),
    (
        "pigeon_subscription_delivery_stopped",
        GaugeMetricFamily,
        "1 while delivery is stopped at a damaged entry (corrupt_entry_policy fail).",
    ),
)


def _topic_counters(topic: Any) -> tuple[int, int, int, int]:
    """(messages in, bytes in, messages out, bytes out) of a topic, cumulative."""
    subs = list(topic.subscriptions.values())
    return (
        topic.msgs_in,
        topic.bytes_in,
        sum(s.msgs_out for s in subs),
        sum(s.bytes_out for s in subs),
    )


def _rate(now: tuple[int, ...], before: tuple[int, ...], dt: float) -> Rates:
    # A counter that went down belongs to a topic that was unloaded and loaded again.
    d = [max(0, a - b) / dt for a, b in zip(now, before, strict=True)]
    return Rates(*d)


class BrokerMonitor:
    """Rates, latency histograms and the Prometheus exposition of one broker."""

    def __init__(
        self, service: BrokerService, *, interval: float = 1.0, history: int = 300
    ) -> None:
        self.service = service
        self.interval = interval
        self.topic_rates: dict[str, Rates] = {}
        self.subscription_rates: dict[tuple[str, str], Rates] = {}
        self.broker_rates = ZERO
        self.history: deque[dict[str, float]] = deque(maxlen=history)
        self._last: dict[Any, tuple[int, ...]] = {}
        self._last_at: float | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        ProcessCollector(namespace="pigeon_broker", registry=self.registry)

    # ------------------------------------------------------------------ sampling

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Sample every ``interval`` until cancelled."""
        self.sample()
        task_status.started()
        while True:
            await trio.sleep(self.interval)
            self.sample()

    def sample(self, now: float | None = None) -> None:
        """Take one sample of every counter and update the rates."""
        now = time.monotonic() if now is None else now
        dt = now - self._last_at if self._last_at is not None else 0.0
        current: dict[Any, tuple[int, ...]] = {}
        topic_rates: dict[str, Rates] = {}
        sub_rates: dict[tuple[str, str], Rates] = {}
        for name, topic in list(self.service.topics.items()):
            counters = _topic_counters(topic)
            current[name] = counters
            before = self._last.get(name)
            topic_rates[name] = _rate(counters, before, dt) if before and dt > 0 else ZERO
            for sub_name, sub in list(topic.subscriptions.items()):
                key = (name, sub_name)
                sc = (0, 0, sub.msgs_out, sub.bytes_out)
                current[key] = sc
                sb = self._last.get(key)
                sub_rates[key] = _rate(sc, sb, dt) if sb and dt > 0 else ZERO
        self._last = current
        self._last_at = now
        self.topic_rates = topic_rates
        self.subscription_rates = sub_rates
        self.broker_rates = Rates(
            sum(r.msg_rate_in for r in topic_rates.values()),
            sum(r.msg_throughput_in for r in topic_rates.values()),
            sum(r.msg_rate_out for r in topic_rates.values()),
            sum(r.msg_throughput_out for r in topic_rates.values()),
        )
        self.history.append({"time": round(time.time() * 1000), **self.broker_rates.to_dict()})

    def rates_of(self, topic: str) -> Rates:
        return self.topic_rates.get(topic, ZERO)

    def rates_of_subscription(self, topic: str, subscription: str) -> Rates:
        return self.subscription_rates.get((topic, subscription), ZERO)

    # ------------------------------------------------------------------ exposition

    def render(self) -> bytes:
        """The Prometheus text exposition of this broker, built from its state now."""
        text = generate_latest(self.registry)
        # Metrics of other nodes running in this process (the standalone's bookie).
        for extra in getattr(self.service, "extra_metrics", ()):
            text += extra().encode()
        return text


class _Collector:
    """Reads the broker's state at scrape time (prometheus_client custom collector)."""

    def __init__(self, monitor: BrokerMonitor) -> None:
        self.monitor = monitor

    def collect(self) -> Iterator[Metric]:
        service = self.monitor.service
        monitor = self.monitor
        # storage metrics read a persistent topic's ledger
        topics: list[tuple[str, Any]] = list(service.topics.items())

        def gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=labels)

        def counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=labels)

        yield GaugeMetricFamily(
            "pigeon_broker_connections", "Open client connections.", value=service.connections
        )
        yield GaugeMetricFamily(
            "pigeon_broker_topics", "Topics loaded on this broker.", value=len(topics)
        )
        bookies = getattr(service.bookies, "_bookies", {})
        bk = gauge("pigeon_broker_bookies", "Bookies this broker sees, by state.", ["state"])
        ro = sum(1 for info in bookies.values() if info.get("read_only"))
        bk.add_metric(["writable"], len(bookies) - ro)
        bk.add_metric(["read_only"], ro)
        yield bk
        sweeper = getattr(service, "offload_sweeper", None)
        if sweeper is not None:  # counts on the broker elected to sweep (0 elsewhere)
            swept = sweeper.statistics()
            yield CounterMetricFamily(
                "pigeon_broker_offload_orphans_deleted",
                "Offloaded objects no ledger referred to, deleted by the sweeper.",
                value=swept.orphans_deleted,
            )
            yield CounterMetricFamily(
                "pigeon_broker_offload_sweep_delete_failures",
                "Sweeper deletes of orphaned offloaded objects that failed (retried).",
                value=swept.delete_failures,
            )
        rates = monitor.broker_rates
        for field, doc in (
            ("msg_rate_in", "Messages per second received (last sampling interval)."),
            ("msg_throughput_in", "Bytes per second received (last sampling interval)."),
            ("msg_rate_out", "Messages per second dispatched (last sampling interval)."),
            ("msg_throughput_out", "Bytes per second dispatched (last sampling interval)."),
        ):
            yield GaugeMetricFamily(f"pigeon_broker_{field}", doc, value=getattr(rates, field))

        t = ["topic"]
        msgs_in = counter("pigeon_topic_messages_in", "Messages received by a topic.", t)
        bytes_in = counter("pigeon_topic_bytes_in", "Bytes received (stored entry size).", t)
        msgs_out = counter("pigeon_topic_messages_out", "Messages dispatched from a topic.", t)
        bytes_out = counter("pigeon_topic_bytes_out", "Bytes dispatched from a topic.", t)
        rate_in = gauge("pigeon_topic_msg_rate_in", "Messages per second received.", t)
        rate_out = gauge("pigeon_topic_msg_rate_out", "Messages per second dispatched.", t)
        thr_in = gauge("pigeon_topic_msg_throughput_in", "Bytes per second received.", t)
        thr_out = gauge("pigeon_topic_msg_throughput_out", "Bytes per second dispatched.", t)
        producers = gauge("pigeon_topic_producers", "Connected producers.", t)
        subscriptions = gauge("pigeon_topic_subscriptions", "Subscriptions of a topic.", t)
        storage = gauge(
            "pigeon_topic_storage_size_bytes", "Bytes stored in the topic's segments.", t
        )
        segments = gauge("pigeon_topic_segments", "Segments of the topic's managed ledger.", t)
        backlog_bytes = gauge(
            "pigeon_topic_backlog_bytes", "Unacknowledged bytes of the slowest subscription.", t
        )
        hits = counter("pigeon_topic_cache_hits", "Reads served by the tail-entry cache.", t)
        misses = counter("pigeon_topic_cache_misses", "Reads that missed the tail-entry cache.", t)
        cache_bytes = gauge(
            "pigeon_topic_cache_size_bytes", "Bytes held in the tail-entry cache.", t
        )
        corrupt = counter(
            "pigeon_corrupt_entries",
            "Entries found on no replica intact (damaged or lost) since the topic loaded.",
            t,
        )
        latency = HistogramMetricFamily(
            "pigeon_publish_latency_seconds",
            "Time from accepting a batch to its acknowledgement by the bookies.",
            labels=t,
        )
        (
            s_msgs,
            s_bytes,
            s_rate,
            s_thr,
            s_backlog,
            s_backlog_b,
            s_consumers,
            s_delayed,
            s_dropped,
            s_lost,
            s_stopped,
        ) = sub_families = [
            kind(name, doc, labels=["topic", "subscription"])
            for name, kind, doc in _SUBSCRIPTION_FAMILIES
        ]
        for name, topic in topics:
            lbl = [name]
            m_in, b_in, m_out, b_out = _topic_counters(topic)
            msgs_in.add_metric(lbl, m_in)
            bytes_in.add_metric(lbl, b_in)
            msgs_out.add_metric(lbl, m_out)
            bytes_out.add_metric(lbl, b_out)
            r = monitor.rates_of(name)
            rate_in.add_metric(lbl, r.msg_rate_in)
            rate_out.add_metric(lbl, r.msg_rate_out)
            thr_in.add_metric(lbl, r.msg_throughput_in)
            thr_out.add_metric(lbl, r.msg_throughput_out)
            producers.add_metric(lbl, len(topic.producers))
            subscriptions.add_metric(lbl, len(topic.subscriptions))
            if topic.persistent:
                ledger = topic.ledger
                storage.add_metric(lbl, sum(s.size for s in ledger.segments))
                segments.add_metric(lbl, len(ledger.segments))
                backlog_bytes.add_metric(lbl, topic.backlog_bytes())
                hits.add_metric(lbl, ledger.cache.hits)
                misses.add_metric(lbl, ledger.cache.misses)
                cache_bytes.add_metric(lbl, ledger.cache.bytes)
                corrupt.add_metric(lbl, ledger.corrupt_entries)
                hist = ledger.publish_latency
                latency.add_metric(lbl, hist.buckets(), hist.sum)
            for sub_name, sub in list(topic.subscriptions.items()):
                sl = [name, sub_name]
                s_msgs.add_metric(sl, sub.msgs_out)
                s_bytes.add_metric(sl, sub.bytes_out)
                sr = monitor.rates_of_subscription(name, sub_name)
                s_rate.add_metric(sl, sr.msg_rate_out)
                s_thr.add_metric(sl, sr.msg_throughput_out)
                s_backlog.add_metric(sl, sub.backlog())
                s_consumers.add_metric(sl, len(sub.consumers))
                if topic.persistent:
                    s_backlog_b.add_metric(sl, topic.ledger.bytes_after(sub.cursor.mark_delete))
                    s_delayed.add_metric(sl, sub.delayed_count)
                    s_lost.add_metric(sl, sub.lost_messages)
                    s_stopped.add_metric(sl, int(sub.read_error is not None))
                else:
                    s_dropped.add_metric(sl, getattr(sub, "dropped", 0))
        yield from (
            msgs_in,
            bytes_in,
            msgs_out,
            bytes_out,
            rate_in,
            rate_out,
            thr_in,
            thr_out,
            producers,
            subscriptions,
            storage,
            segments,
            backlog_bytes,
            hits,
            misses,
            cache_bytes,
            corrupt,
            latency,
            *sub_families,
        )
