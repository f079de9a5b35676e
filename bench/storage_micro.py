"""Micro-measure of the ledger storages: adds/s and add latency with fsync=always, N
segments written at once (one writer task per segment, like N producers on N topics),
``segment-files`` vs ``journal``, same machine, same run.

    python -m bench.storage_micro [--segments 16] [--seconds 5] [--size 1024]

``--rate R`` paces each writer at R adds/s (a latency measure, not a throughput one) and
``--busy F`` has another task of the event loop burn the fraction F of its time in slices
of 200 us (a broker's work beside its bookie in a standalone: what makes a thread hop wait
for the GIL).  ``--stores`` picks what is measured: ``segment-files``, ``journal``, and
``journal-thread`` (the journal with every round on its sync thread,
``journal_inline_sync_max_bytes = 0``), alternated over ``--repeat`` rounds.
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
    store: Any, segments: int, seconds: float, size: int, rate: float = 0.0, busy: float = 0.0
) -> tuple[float, float, float, Any]:
    latencies: list[float] = []
    payload = b"x" * size
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        stop = trio.current_time() + seconds
        if busy > 0:
            nursery.start_soon(_burn, busy)

        async def writer(seg: int) -> None:
            eid = 0
            start = trio.current_time()
            while trio.current_time() < stop:
                if rate:
                    await trio.sleep_until(start + eid / rate)
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


async def _burn(fraction: float, slice_s: float = 0.0002) -> None:
    """Keep the event loop busy ``fraction`` of the time, ``slice_s`` at a time."""
    while True:
        end = time.perf_counter() + slice_s
        while time.perf_counter() < end:
            pass
        await trio.sleep(slice_s * (1 - fraction) / fraction)


def _store(name: str, path: Path) -> Any:
    if name == "segment-files":
        return SegmentStore(path)
    if name == "journal-thread":
        return JournalStore(path / "j", path / "l", journal_inline_sync_max_bytes=0)
    return JournalStore(path / "j", path / "l")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--segments", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--dir", default=None, help="where the stores live (a temp dir)")
    parser.add_argument("--rate", type=float, default=0.0, help="adds/s per writer (0: max)")
    parser.add_argument("--busy", type=float, default=0.0, help="event-loop busy fraction")
    parser.add_argument("--stores", nargs="+", default=["segment-files", "journal"])
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    for _ in range(args.repeat):
        for name in args.stores:
            with tempfile.TemporaryDirectory(dir=args.dir) as d:
                store = _store(name, Path(d))
                rate, p50, p99, stats = trio.run(
                    measure, store, args.segments, args.seconds, args.size, args.rate, args.busy
                )
                print(
                    f"{name:14} segments={args.segments} adds/s={rate:8.0f}"
                    f" p50={p50 * 1e3:6.3f}ms p99={p99 * 1e3:6.2f}ms fsyncs={stats.fsyncs}"
                    f" rounds={stats.flush_rounds} inline={stats.inline_flush_rounds}"
                    f" ms/round={stats.flush_seconds / max(1, stats.flush_rounds) * 1e3:.3f}"
                )


if __name__ == "__main__":
    main()
