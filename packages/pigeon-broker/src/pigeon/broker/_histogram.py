"""The publish latency histogram: counts per bucket, kept by each managed ledger and
exported by the metrics endpoint (no I/O)."""

from __future__ import annotations

import bisect

__all__ = ["LATENCY_BUCKETS", "LatencyHistogram"]

#: Upper bounds (seconds) of the publish latency buckets.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.0025,
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
)


class LatencyHistogram:
    """Counts of observations per bucket (not cumulative), their number and their sum."""

    __slots__ = ("count", "counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last one is +Inf
        self.count = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.count += 1
        self.sum += seconds

    def buckets(self) -> list[tuple[str, int]]:
        """Cumulative ``(le, count)`` pairs as Prometheus wants them, ending with +Inf."""
        out: list[tuple[str, int]] = []
        total = 0
        for bound, n in zip(LATENCY_BUCKETS, self.counts, strict=False):
            total += n
            out.append((repr(bound), total))
        out.append(("+Inf", self.count))
        return out

    def quantile(self, q: float) -> float | None:
        """Upper bound of the bucket holding quantile ``q`` (None without observations)."""
        if not self.count:
            return None
        rank = q * self.count
        total = 0
        for bound, n in zip(LATENCY_BUCKETS, self.counts, strict=False):
            total += n
            if total >= rank:
                return bound
        return float("inf")
