"""Micro-measure of the ledger storages: adds/s and add latency with fsync=always, N
segments written at once (one writer task per segment, like N producers on N topics),
``segment-files`` vs ``journal``, same machine, same run.

    python -m bench.storage_micro [--segments 16] [--seconds 5] [--size 1024]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from pigeon.bookie._journal import JournalStore
from pigeon.bookie._storage import SegmentStore


async def measure(
    store: Any, segments: int, seconds: float, size: int
) -> tuple[float, float, float, Any]:
    latencies: list[float] = []
    payload = b"x" * size
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        stop = trio.current_time() + seconds

        async def writer(seg: int) -> None:
            eid = 0
            while trio.current_time() < stop:
                t0 = time.perf_counter()
                await store.add_entry(seg, eid, payload, lac=eid - 1)
                latencies.append(time.perf_counter() - t0)
                eid += 1

        started = time.perf_counter()
        async with trio.open_nursery() as writers:
            for seg in range(segments):
                writers.start_soon(writer, seg)
        elapsed = time.perf_counter() - started
        stats = store.statistics()
        nursery.cancel_scope.cancel()
    latencies.sort()
    p99 = latencies[int(len(latencies) * 0.99)]
    return len(latencies) / elapsed, statistics.median(latencies), p99, stats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--segments", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--dir", default=None, help="where the stores live (a temp dir)")
    args = parser.parse_args()
    for name in ("segment-files", "journal", "segment-files", "journal"):
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            path = Path(d)
            store: Any = (
                SegmentStore(path)
                if name == "segment-files"
                else JournalStore(path / "j", path / "l")
            )
            rate, p50, p99, stats = trio.run(measure, store, args.segments, args.seconds, args.size)
            print(
                f"{name:14} segments={args.segments} adds/s={rate:8.0f} p50={p50 * 1e3:6.2f}ms"
                f" p99={p99 * 1e3:6.2f}ms fsyncs={stats.fsyncs} rounds={stats.flush_rounds}"
                f" fsync_ms/round={stats.flush_seconds / max(1, stats.flush_rounds) * 1e3:.2f}"
            )


if __name__ == "__main__":
    main()
