"""BrokerMonitor and LatencyHistogram without a broker: rates from counter samples."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from pigeon.broker._histogram import LATENCY_BUCKETS, LatencyHistogram
from pigeon.broker._metrics import BrokerMonitor
from pigeon.core import TopicName


def test_histogram_buckets_are_cumulative() -> None:
    h = LatencyHistogram()
    for seconds in (0.0001, 0.002, 0.002, 0.3, 100.0):
        h.observe(seconds)
    buckets = dict(h.buckets())
    assert buckets["0.0005"] == 1
    assert buckets["0.0025"] == 3
    assert buckets["0.5"] == 4
    assert buckets[repr(LATENCY_BUCKETS[-1])] == 4
    assert buckets["+Inf"] == 5 == h.count
    assert h.sum == pytest.approx(100.3041)
    assert h.quantile(0.5) == 0.0025
    assert h.quantile(1.0) == float("inf")
    assert LatencyHistogram().quantile(0.5) is None


def _sub(msgs_out: int, bytes_out: int) -> Any:
    return SimpleNamespace(msgs_out=msgs_out, bytes_out=bytes_out, consumers=[])


class FakeLedger:  # a weak-referenceable stand-in for ManagedLedger
    def __init__(self, msgs_in: int, bytes_in: int) -> None:
        self.msgs_in = msgs_in
        self.bytes_in = bytes_in

    def append_nowait(self, *args: Any, **kwargs: Any) -> None:
        return None


class FakeTopic(SimpleNamespace):  # its counters are its ledger's, as a Topic's are
    msgs_in = property(lambda self: self.ledger.msgs_in)
    bytes_in = property(lambda self: self.ledger.bytes_in)


def _topic(name: str, msgs_in: int, bytes_in: int, subs: dict[str, Any]) -> Any:
    ledger = FakeLedger(msgs_in, bytes_in)
    return FakeTopic(
        name=TopicName.parse(name), persistent=True, ledger=ledger, subscriptions=subs, producers={}
    )


def test_rates_come_from_counter_differences() -> None:
    t = _topic("a", 100, 10_000, {"s": _sub(40, 4000)})
    service = SimpleNamespace(
        topics={"persistent://public/default/a": t}, bookies=None, connections=0
    )
    monitor = BrokerMonitor(service)  # type: ignore[arg-type]
    monitor.sample(now=10.0)
    assert monitor.rates_of("persistent://public/default/a").msg_rate_in == 0.0
    t.ledger.msgs_in, t.ledger.bytes_in = 300, 30_000
    t.subscriptions["s"].msgs_out = 140
    monitor.sample(now=12.0)
    r = monitor.rates_of("persistent://public/default/a")
    assert (r.msg_rate_in, r.msg_throughput_in, r.msg_rate_out) == (100.0, 10_000.0, 50.0)
    assert monitor.rates_of_subscription("persistent://public/default/a", "s").msg_rate_out == 50.0
    assert monitor.broker_rates.msg_rate_in == 100.0
    assert monitor.history[-1]["msg_rate_in"] == 100.0
    # an unloaded-and-reloaded topic restarts its counters: no negative rate
    t.ledger.msgs_in = 5
    monitor.sample(now=13.0)
    assert monitor.rates_of("persistent://public/default/a").msg_rate_in == 0.0
