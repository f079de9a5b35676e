"""The asyncio face's batching timer: how late it seals a batch, and publish → ack.

    python -m bench.asyncio_timer                          # this tree only
    python -m bench.asyncio_timer --baseline 2e8738a --rounds 3

An asyncio producer sends 1 KiB messages at a fixed rate (default 1,000 msg/s, each
``send_async`` on its own schedule) with ``batching_max_delay_ms=1`` to a ``pigeon
standalone --storage journal --fsync never`` started here on free ports. Per run, over
the messages after a one-second warm-up:

* ``late_us``: how late the batching timer ran, ``time.monotonic()`` on entering
  ``Producer._timer_fired`` minus the batch's due time (timers of batches already sealed
  left out): the producer's own timer, which is what changed.
* ``ack_us``: publish → ack, from ``send_async`` to the future's done callback (on the
  loop; the same callback hop on both sides).
* ``timer seals``: how many batches the timer sealed (the rest of the messages joined a
  batch already open).
* ``cpu_us``: the client process's CPU (``time.process_time``: the loop's thread and the
  engine's) per message.

Each run is a child process (``PYTHONPATH``: one tree's package sources) so the client is
that tree's; with ``--baseline REV`` the runs alternate between REV's packages (``git
archive``) and the working tree's, ABBA, and it prints the medians of the runs' p50 and
p90 per side. Results are data, not tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

WARMUP = 1.0


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {"p50": float("nan"), "p90": float("nan"), "n": 0}
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": pick(0.5) * 1e6, "p90": pick(0.9) * 1e6, "n": len(ordered)}


def child(url: str, topic: str, rate: float, size: int, duration: float) -> dict[str, Any]:
    """Measure in this process (the client is whatever ``PYTHONPATH`` imports)."""
    import asyncio

    from pigeon.client.asyncio import Client, Producer

    late: list[float] = []
    fired = Producer._timer_fired

    def timer_fired(self: Any, index: int, generation: int) -> None:
        core = self._handle.logic.cores[index]
        if core.generation == generation and not self._handle.logic.linger:
            late.append(time.monotonic() - core.due)
        fired(self, index, generation)

    # on the class, before the producer exists: its timers hold the bound method
    Producer._timer_fired = timer_fired  # type: ignore[method-assign]
    payload = os.urandom(size)

    async def main() -> dict[str, Any]:
        acks: list[float] = []
        async with Client(url) as client:
            producer = await client.create_producer(topic, batching_max_delay_ms=1)
            mechanism = "timerfd" if getattr(producer, "_timers", None) else "call_at"
            await producer.send(payload)
            start = time.perf_counter()
            n = int(rate * duration)
            counting_from = int(rate * WARMUP)
            futures = []
            c0 = 0.0
            for i in range(n):
                if i == counting_from:
                    late.clear()
                    c0 = time.process_time()
                wait = start + i / rate - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                sent = time.perf_counter()
                fut = producer.send_async(payload)
                if i >= counting_from:
                    fut.add_done_callback(lambda _f, t=sent: acks.append(time.perf_counter() - t))
                futures.append(fut)
            await asyncio.gather(*futures)
            cpu = time.process_time() - c0
            await producer.close()
        counted = n - counting_from
        return {
            "mechanism": mechanism,
            "late_us": _quantiles(late),
            "ack_us": _quantiles(acks),
            "cpu_us": cpu / counted * 1e6,
            "msg_s": counted / (time.perf_counter() - start - WARMUP),
        }

    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=1000.0, help="msg/s (default 1,000)")
    ap.add_argument("--size", type=int, default=1024, help="message bytes (default 1,024)")
    ap.add_argument("--duration", type=float, default=6.0, help="seconds per run (default 6)")
    ap.add_argument("--rounds", type=int, default=3, help="runs per side (default 3)")
    ap.add_argument("--baseline", help="a git revision to compare with (same session)")
    ap.add_argument("--child", nargs=2, metavar=("URL", "TOPIC"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        got = child(args.child[0], args.child[1], args.rate, args.size, args.duration)
        print(json.dumps(got))
        return

    from bench.baseline import alternate_children

    extra = ["--rate", str(args.rate), "--size", str(args.size), "--duration", str(args.duration)]
    runs = alternate_children(
        "bench.asyncio_timer",
        args.baseline,
        args.rounds,
        extra,
        topic="timer",
        fsync="never",
        storage="journal",
    )
    names = list(runs)
    print(
        f"asyncio producer, {args.size} B at {args.rate:g} msg/s, batching_max_delay_ms=1,"
        f" {args.rounds} runs per side of {args.duration:g} s, medians of the runs' figures:"
    )
    print("| figure | " + " | ".join(f"{n} ({runs[n][0]['mechanism']})" for n in names) + " |")
    print("|---|" + "---:|" * len(names))
    for fig, q in (
        ("late_us", "p50"),
        ("late_us", "p90"),
        ("ack_us", "p50"),
        ("ack_us", "p90"),
        ("late_us", "n"),
        ("cpu_us", None),
    ):
        med = [statistics.median(r[fig][q] if q else r[fig] for r in runs[side]) for side in names]
        label = "timer seals" if q == "n" else f"{fig} {q}" if q else fig
        print(f"| {label} | " + " | ".join(f"{m:,.0f}" for m in med) + " |")


if __name__ == "__main__":
    main()
