"""Micro-measure of the broker's link to a bookie of the same process (``pigeon
standalone``): loopback TCP against the in-process link, alternating in one run.

One BookieServer and one BookieClient in this trio run; one add in flight at a time (the
publish->ack path of a paced producer), ``fsync = never`` so the link is all there is to
measure.  Reports, per side, the wall round trip (median, p99) and the CPU time of this
process per add (both ends of the link run here, as in a standalone).  CPU time is the
figure to trust on a loaded machine; the wall round trip suffers every other process.

    python -m bench.link_micro [--adds 3000] [--rounds 4] [--size 1024]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import trio

from pigeon.bookie import BookieConfig, BookieServer
from pigeon.core.replication import BookieClient


async def one_side(
    data_dir: Path, *, local: bool, adds: int, size: int
) -> tuple[float, float, float]:
    """(wall median µs, wall p99 µs, CPU µs per add) of ``adds`` sequential adds."""
    config = BookieConfig(data_dir=str(data_dir), port=0, fsync="never")
    server = BookieServer(config)
    client = BookieClient(name="bench")
    payload = b"x" * size
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        await nursery.start(client.run)
        addr = server.advertised
        if local:
            client.add_local(addr, server.open_local_link)
        for eid in range(50):  # warm up: connect, first segment
            await client.add_entry(addr, 1, eid, eid - 1, payload)
        walls: list[float] = []
        cpu0 = time.process_time()
        for eid in range(50, 50 + adds):
            t0 = time.perf_counter()
            await client.add_entry(addr, 1, eid, eid - 1, payload)
            walls.append(time.perf_counter() - t0)
        cpu = time.process_time() - cpu0
        client.close()
        nursery.cancel_scope.cancel()
    walls.sort()
    return (
        statistics.median(walls) * 1e6,
        walls[int(len(walls) * 0.99)] * 1e6,
        cpu / adds * 1e6,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adds", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--size", type=int, default=1024)
    args = parser.parse_args()
    results: dict[str, list[tuple[float, float, float]]] = {"tcp": [], "in-process": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            order = ["tcp", "in-process"] if i % 2 == 0 else ["in-process", "tcp"]
            for side in order:
                data_dir = Path(tmp) / f"{side}-{i}"
                results[side].append(
                    trio.run(
                        lambda d=data_dir, s=side: one_side(  # type: ignore[misc]
                            d, local=s == "in-process", adds=args.adds, size=args.size
                        )
                    )
                )
    print(
        f"{args.adds} sequential adds of {args.size} B per run, {args.rounds} runs per side, ABAB"
    )
    print("| link | wall p50 µs | wall p99 µs | CPU µs / add |")
    print("|---|---|---|---|")
    for side, rows in results.items():
        p50 = " / ".join(f"{r[0]:.0f}" for r in rows)
        p99 = " / ".join(f"{r[1]:.0f}" for r in rows)
        cpu = " / ".join(f"{r[2]:.0f}" for r in rows)
        print(f"| {side} | {p50} | {p99} | {cpu} |")


if __name__ == "__main__":
    main()
