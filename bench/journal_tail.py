"""The journal's latency tail behind a checkpoint, with and without the entry-log
write-behind (``flush_entrylog_bytes``), alternating in one run.

Each run: a ``journal`` store with ``fsync = always``, no checkpoint but one.  A
background writer adds 256 KiB entries at ``--mb-s`` (a steady stream the disk keeps up
with), and a paced writer one 1 KiB add every millisecond, each awaited (a paced
producer's publish->ack).  After ``--seconds`` the checkpoint runs (what
``flush_interval_ms`` does every 10 s); both writers go on for ``--after`` seconds.
Without the write-behind, every byte of the interval is still dirty in the page cache
when the checkpoint's fdatasync comes; with it, at most ``flush_entrylog_bytes``.
Reports per side: the checkpoint's duration, the part of it spent in the entry logs'
fdatasync (timed around ``EntryLogs.sync``), and the paced adds' latency percentiles
over the ``--after`` window (the checkpoint's) and over the whole run.

    python -m bench.journal_tail [--rounds 3] [--mb-s 50] [--seconds 6] [--after 2]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from pigeon.bookie._journal import JournalStore
from pigeon.bookie._journal_logs import EntryLogs

BIG = 256 * 1024
#: durations (s) of the entry logs' fdatasyncs of the checkpoints, newest last
_syncs: list[float] = []
_sync = EntryLogs.sync


def _timed_sync(self: EntryLogs, logs: list[Any], dirs: list[int]) -> int:
    t0 = time.perf_counter()
    try:
        return _sync(self, logs, dirs)
    finally:
        _syncs.append(time.perf_counter() - t0)


EntryLogs.sync = _timed_sync  # type: ignore[method-assign]


def percentiles(latencies: list[float]) -> tuple[float, float, float, float]:
    """(p50, p99, p99.9, max) in ms."""
    lat = sorted(latencies)
    n = len(lat)
    return lat[n // 2] * 1e3, lat[int(n * 0.99)] * 1e3, lat[int(n * 0.999)] * 1e3, lat[-1] * 1e3


async def one_run(
    data_dir: Path, *, write_behind: int, mb_s: float, seconds: float, after: float
) -> dict[str, float]:
    store = JournalStore(
        data_dir / "journal",
        data_dir / "ledgers",
        fsync="always",
        flush_interval_ms=1e9,
        flush_entrylog_bytes=write_behind,
    )
    big, small = b"b" * BIG, b"s" * 1024
    before: list[float] = []
    during: list[float] = []
    checkpoint_s = log_sync_s = 0.0
    checkpointed = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        start = trio.current_time()
        at = start + seconds
        end = at + after

        async def background() -> None:
            per_s = mb_s * 1e6 / BIG
            eid = 0
            while (now := trio.current_time()) < end:
                due = start + eid / per_s
                if due > now:
                    await trio.sleep(due - now)
                await store.add_entry(1, eid, big)
                eid += 1

        async def checkpoint() -> None:
            nonlocal checkpoint_s, log_sync_s
            await trio.sleep_until(at)
            t0 = time.perf_counter()
            await store.checkpoint()
            checkpoint_s = time.perf_counter() - t0
            log_sync_s = _syncs[-1]
            checkpointed.set()

        nursery.start_soon(background)
        nursery.start_soon(checkpoint)
        eid = 0
        while (now := trio.current_time()) < end:
            due = start + eid / 1000
            if due > now:
                await trio.sleep(due - now)
            t0 = time.perf_counter()
            await store.add_entry(9, eid, small)
            (during if trio.current_time() >= at else before).append(time.perf_counter() - t0)
            eid += 1
        await checkpointed.wait()  # it may outlast the writers
        nursery.cancel_scope.cancel()
    p50, p99, p999, top = percentiles(during)
    _, all99, all999, _ = percentiles(before + during)
    return {
        "checkpoint_ms": checkpoint_s * 1e3,
        "log_fsync_ms": log_sync_s * 1e3,
        "p50": p50,
        "p99": p99,
        "p999": p999,
        "max": top,
        "all_p99": all99,
        "all_p999": all999,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mb-s", type=float, default=50.0)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--after", type=float, default=2.0)
    parser.add_argument("--write-behind", type=int, default=8 << 20)
    args = parser.parse_args()
    sides = {"off (0)": 0, f"on ({args.write_behind >> 20} MiB)": args.write_behind}
    results: dict[str, list[dict[str, float]]] = {k: [] for k in sides}
    for i in range(args.rounds):
        order = list(sides) if i % 2 == 0 else list(reversed(sides))
        for side in order:
            tmp = Path(tempfile.mkdtemp(prefix="journal-tail-"))
            try:
                results[side].append(
                    trio.run(
                        lambda t=tmp, wb=sides[side]: one_run(  # type: ignore[misc]
                            t,
                            write_behind=wb,
                            mb_s=args.mb_s,
                            seconds=args.seconds,
                            after=args.after,
                        )
                    )
                )
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            print(side, {k: round(v, 2) for k, v in results[side][-1].items()}, flush=True)
    keys = ("checkpoint_ms", "log_fsync_ms", "p50", "p99", "p999", "max", "all_p99", "all_p999")
    print(
        "| write-behind | checkpoint ms | of which entry-log fdatasync ms | p50 ms | p99 ms"
        " | p99.9 ms | max ms | whole run p99 ms | whole run p99.9 ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for side, rows in results.items():
        cells = [
            " / ".join(f"{r[k]:.{0 if k.endswith('_ms') else 2}f}" for r in rows) for k in keys
        ]
        print(f"| {side} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
