"""CPU time of the client's Arrow work, for A/B runs of two trees (issue 18).

    python -m bench.arrow_cpu              # record batches from entries, and the sink
    PYTHONPATH=<other tree's packages/*/src>:. python -m bench.arrow_cpu

Two figures, in CPU time (``time.process_time`` of this process: the caller's thread and
the client's engine thread), so that a machine shared with other jobs disturbs them less
than wall-clock rates:

* rows/s of building record batches from stored 100-byte entries (no I/O): what
  ``receive_arrow`` does per entry (``entry_rows``) and what the Spark source does per
  group of entries (``record_batches``), entries of 20,000 and of 1,000 rows;
* µs of client CPU per row of the Spark sink's task write (``_Task.write``, no Spark):
  200,000 keyed 100-byte rows to a one-partition topic (batch sink) and to a
  two-partition topic (the exactly-once streaming sink), against a ``fsync=never``
  standalone.

Run it on each tree in turn (base, new, new, base) and compare within a row.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROWS = 100_000
SINK_ROWS = 200_000


def build_rates(entry_rows: int) -> dict[str, float]:
    import pyarrow as pa

    from pigeon.client import _arrow
    from pigeon.client._handles import codecs_of
    from pigeon.core import PluginManager
    from pigeon.core.batch import pack_entry_header

    codecs = codecs_of(PluginManager())
    values = pa.array([i.to_bytes(4, "little") * 25 for i in range(ROWS)])
    rows = _arrow.plan_rows(
        pa.record_batch({"value": values}),
        value="value",
        key=None,
        properties=None,
        event_time=None,
    )
    spans = _arrow.split_points(rows, max_messages=entry_rows, max_bytes=4 << 20, max_entry=5 << 20)
    stored = [
        SimpleNamespace(
            segment_id=7,
            entry_id=i,
            data=pack_entry_header(e - s, 1_000_000 + s, 1)
            + _arrow.encode_entry(
                rows, s, e, producer_name="p", sequence_id=s, codec=codecs.by_name("none")
            ),
        )
        for i, (s, e) in enumerate(spans)
    ]

    def rate(work: Any) -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.process_time()
            for _ in range(10):
                work()
            best = min(best, (time.process_time() - t0) / 10)
        return ROWS / best

    return {
        "entry_rows rows/s": rate(
            lambda: [_arrow.entry_rows(e, topic="t", partition=-1, codecs=codecs) for e in stored]
        ),
        "record_batches rows/s": rate(
            lambda: list(
                _arrow.record_batches(
                    stored,
                    topic="t",
                    partition=-1,
                    start=0,
                    end=1 << 60,
                    codecs=codecs,
                    include_properties=False,
                )
            )
        ),
    }


def sink_cpu() -> dict[str, float]:
    import pyarrow as pa

    from bench.__main__ import Standalone
    from pigeon.client import Client
    from pigeon.spark import _sink
    from pigeon.spark._options import SinkOptions

    rb = pa.record_batch(
        {
            "key": pa.array([b"k%d" % (i % 1000) for i in range(10_000)]),
            "value": pa.array([b"v" * 100] * 10_000),
        }
    )
    out: dict[str, float] = {}
    with (
        tempfile.TemporaryDirectory(prefix="pigeon-bench-") as tmp,
        Standalone(Path(tmp) / "data", fsync="never") as sa,
    ):
        with Client(sa.url) as client:
            client.create_topic("out-eo", 2)
        for label, topic, exactly_once in (
            ("batch", "out-b", False),
            ("exactly-once", "out-eo", True),
        ):
            best = float("inf")
            for rep in range(2):
                task = _sink._Task(
                    SinkOptions(sa.url, topic=topic), ("q", rep, 1) if exactly_once else None
                )
                t0 = time.process_time()
                task.write(iter([rb] * (SINK_ROWS // rb.num_rows)))
                best = min(best, time.process_time() - t0)
            out[f"sink {label} us CPU/row"] = 1e6 * best / SINK_ROWS
    return out


def main() -> None:
    for n in (20_000, 1_000):
        for name, value in build_rates(n).items():
            print(f"entries of {n:>6} rows  {name:<24} {value:>14,.0f}")
    for name, value in sink_cpu().items():
        print(f"{name:<40} {value:>8.2f}")


if __name__ == "__main__":
    main()
