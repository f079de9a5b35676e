"""The sync client's CPU time per message at 100 B, against a real ``pigeon standalone``:

    python -m bench.client_cpu                       # this tree only
    python -m bench.client_cpu --baseline main --rounds 4

Each measurement runs in a child process (``PYTHONPATH``: one tree's package sources),
so the figures are the client's alone: the standalone is another process, started once
(``fsync=never``: the server's disk does not pace the client) and shared by every run.
Per run and per message:

* ``send``: ``send_async`` of N messages then ``flush()`` (every one acknowledged);
  the caller thread's CPU (``time.thread_time``), the whole client process's CPU
  (``time.process_time``: the caller plus the client's engine thread), and msg/s.
* ``trio_send`` / ``asyncio_send``: the same through the trio face (``await
  send_async``) and the asyncio face (``send_async``, a future each); one thread there
  (trio) or the loop's and the engine's (asyncio): the process CPU alone.
* ``receive`` / ``batch_receive``: a consumer of a backlog of N messages, each message
  taken with ``receive()`` (or ``batch_receive(1000)``) and acknowledged cumulatively
  once per 1,000; the same CPU figures.

With ``--baseline REV`` the runs alternate between REV's packages (``git archive``) and
the working tree's, ABBA; it prints the medians per side and their ratio (working tree /
REV: below 1 is less CPU). Results are data, not tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any


def child(url: str, topic: str, n: int, size: int, parts: list[str]) -> dict[str, Any]:
    """Measure in this process (the client is whatever ``PYTHONPATH`` imports)."""
    from pigeon.client import Client

    out: dict[str, Any] = {}
    if "trio_send" in parts:
        out["trio_send"] = child_trio(url, f"{topic}-trio", n, size)
    if "asyncio_send" in parts:
        out["asyncio_send"] = child_asyncio(url, f"{topic}-asyncio", n, size)
    payload = os.urandom(size)
    with Client(url) as client:
        if "send" in parts:
            with client.create_producer(topic, **_PRODUCER) as p:
                for _ in range(2000):  # warm up (connection, first batches)
                    p.send_async(payload)
                p.flush()
                send = p.send_async
                w0, t0, c0 = time.perf_counter(), time.thread_time(), time.process_time()
                for _ in range(n // 100):
                    for _ in range(100):
                        send(payload)
                t1 = time.thread_time()
                p.flush()
                w1, c1 = time.perf_counter(), time.process_time()
            out["send"] = {
                "caller_us": (t1 - t0) / n * 1e6,
                "process_us": (c1 - c0) / n * 1e6,
                "msg_s": n / (w1 - w0),
            }
        for part in ("receive", "batch_receive"):
            if part not in parts:
                continue
            with client.subscribe(
                topic,
                f"cpu-{part}",
                initial_position="earliest",
                receiver_queue_size=20_000,
            ) as c:
                first = c.receive(timeout=30)  # the backlog is there, the link is up
                got = 1
                w0, t0, c0 = time.perf_counter(), time.thread_time(), time.process_time()
                last = first
                total = n + 2000
                if part == "receive":
                    receive = c.receive
                    while got < total:
                        for _ in range(min(1000, total - got)):
                            last = receive(timeout=30)
                        got += 1000 if total - got >= 1000 else total - got
                        c.acknowledge_cumulative(last)
                else:
                    while got < total:
                        msgs = c.batch_receive(1000, timeout=30)
                        if msgs:
                            got += len(msgs)
                            c.acknowledge_cumulative(msgs[-1])
                w1, t1, c1 = time.perf_counter(), time.thread_time(), time.process_time()
            m = total - 1
            out[part] = {
                "caller_us": (t1 - t0) / m * 1e6,
                "process_us": (c1 - c0) / m * 1e6,
                "msg_s": m / (w1 - w0),
            }
    return out


_PRODUCER = {
    "batching_max_messages": 1000,
    "batching_max_bytes": 1024 * 1024,
    "batching_max_delay_ms": 5,
    "max_pending_messages": 50_000,
}


def _figures(n: int, w: float, c: float) -> dict[str, Any]:
    """One face's figures: ``w`` wall seconds and ``c`` process CPU seconds for ``n``."""
    return {"caller_us": c / n * 1e6, "process_us": c / n * 1e6, "msg_s": n / w}


def child_trio(url: str, topic: str, n: int, size: int) -> dict[str, Any]:
    """``await producer.send_async(value)`` N times, then ``flush()``: the trio face runs
    the engine in the caller's own thread, so caller and process CPU are the same."""
    import trio

    from pigeon.client.trio import Client

    payload = os.urandom(size)

    async def main() -> dict[str, Any]:
        async with Client(url) as client, await client.create_producer(topic, **_PRODUCER) as p:
            for _ in range(2000):
                await p.send_async(payload)
            await p.flush()
            send = p.send_async
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(n):
                await send(payload)
            await p.flush()
            return _figures(n, time.perf_counter() - w0, time.process_time() - c0)

    return trio.run(main)


def child_asyncio(url: str, topic: str, n: int, size: int) -> dict[str, Any]:
    """``producer.send_async(value)`` N times (a future each), then ``flush()``."""
    import asyncio

    from pigeon.client.asyncio import Client

    payload = os.urandom(size)

    async def main() -> dict[str, Any]:
        async with Client(url) as client, await client.create_producer(topic, **_PRODUCER) as p:
            send = p.send_async
            for _ in range(2000):
                send(payload)
            await p.flush()
            w0, c0 = time.perf_counter(), time.process_time()
            for i in range(n):
                send(payload)
                if i % 20_000 == 19_999:
                    await p.flush()  # max_pending_messages: send_async never waits
            await p.flush()
            return _figures(n, time.perf_counter() - w0, time.process_time() - c0)

    return asyncio.run(main())


def breakdown(n: int = 500_000) -> dict[str, float]:
    """Nanoseconds per message of the pieces of the sync face's hot paths, in this
    process without an engine or a server (each the best of 3 runs of ``n``): what
    ``send_async`` and ``receive`` cost beside the work they stand for."""
    import threading

    from pigeon.client._core import BatchCompletion, ProducerCore, Router
    from pigeon.client._engine import ReceivedEntry
    from pigeon.client._future import BatchState, MessageFuture
    from pigeon.client._handles import codecs_of
    from pigeon.client._logic import ProducerLogic
    from pigeon.client._message import Message, split_entry
    from pigeon.core import PluginManager
    from pigeon.core.batch import BatchBuilder, pack_entry_header

    codecs = codecs_of(PluginManager())
    codec = codecs.by_name("none")
    v = b"x" * 100
    clock = time.process_time

    def logic() -> Any:
        core = ProducerCore(
            producer_name="p",
            codec=codec,
            partition=-1,
            max_messages=1000,
            max_bytes=1 << 20,
            max_message_size=5 * 1024 * 1024,
            first_sequence_id=0,
        )
        out = ProducerLogic(
            ["engine"],
            [core],
            Router("round_robin", 1),
            max_delay=0.005,
            submit=lambda engine, batch: None,
            start_timer=lambda index, generation: None,
            clock=time.perf_counter,
        )
        out.callback_for = lambda c, s, p: BatchCompletion(c, s, p, lambda count: None)
        return out

    def loop() -> float:
        def f(value: bytes) -> None:
            return None

        t = clock()
        for _ in range(n):
            f(v)
        return clock() - t

    def lock() -> float:
        lk = threading.Lock()
        t = clock()
        for _ in range(n):
            with lk:
                pass
        return clock() - t

    def clock_read() -> float:
        c = time.perf_counter
        t = clock()
        for _ in range(n):
            c()
        return clock() - t

    def future() -> float:
        state = BatchState(-1)
        t = clock()
        for i in range(n):
            MessageFuture(state, i)
        return clock() - t

    def builder() -> float:
        b = BatchBuilder(producer_name="p", codec=codec, max_messages=1 << 30, max_bytes=1 << 30)
        add = b.add_value
        t = clock()
        for _ in range(n):
            add(v)
        return clock() - t

    def add_plain() -> float:
        add = logic().add_plain
        t = clock()
        for _ in range(n):
            add(v, None, None, 0)
        return clock() - t

    def add_plain_locked() -> float:
        add = logic().add_plain
        lk = threading.Lock()
        t = clock()
        for _ in range(n):
            with lk:
                add(v, None, None, 0)
        return clock() - t

    b = BatchBuilder(producer_name="p", codec=codec)
    for _ in range(1000):
        b.add(v)
    data = pack_entry_header(1000, 0, 1) + b.build(sequence_id=0, publish_time=1)

    class Source:
        partition, topic = -1, "t"

    def split() -> float:
        t = clock()
        for _ in range(n // 1000):
            entry = ReceivedEntry(1, 2, memoryview(data), 0, [], 0, Source())
            split_entry(entry, -1, "t", codecs)
        return clock() - t

    def message() -> float:
        e: dict[str, str] = {}
        t = clock()
        for i in range(n):
            Message(v, None, e, 0, 1, 2, 3, i, -1, i, 0, "t", v)
        return clock() - t

    pieces = {
        "the caller's loop and a call": loop,
        "the producer's lock": lock,
        "a clock read": clock_read,
        "a MessageFuture": future,
        "BatchBuilder.add_value": builder,
        "ProducerLogic.add_plain (all of it, seals included)": add_plain,
        "the lock and add_plain": add_plain_locked,
        "split_entry, per message": split,
        "a Message alone": message,
    }
    return {name: min(f() for _ in range(3)) / n * 1e9 for name, f in pieces.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=200_000, help="per run (default 200,000)")
    ap.add_argument("--size", type=int, default=100, help="message bytes (default 100)")
    ap.add_argument("--rounds", type=int, default=3, help="runs per side (default 3)")
    ap.add_argument("--baseline", help="a git revision to compare with (same session)")
    ap.add_argument(
        "--parts",
        nargs="+",
        default=["send", "receive", "batch_receive"],
        choices=["send", "receive", "batch_receive", "trio_send", "asyncio_send"],
        help="receive and batch_receive read what send wrote (default: the sync face's three)",
    )
    ap.add_argument("--child", nargs=2, metavar=("URL", "TOPIC"), help=argparse.SUPPRESS)
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="ns per message of the hot paths' pieces, in this process (no server)",
    )
    args = ap.parse_args()
    if args.breakdown:
        for name, ns in breakdown().items():
            print(f"| {name} | {ns:,.0f} |")
        return
    if args.child:
        result = child(args.child[0], args.child[1], args.messages, args.size, args.parts)
        print(json.dumps(result))
        return

    from bench.baseline import alternate_children

    extra = ["--messages", str(args.messages), "--size", str(args.size), "--parts", *args.parts]
    runs = alternate_children(
        "bench.client_cpu", args.baseline, args.rounds, extra, topic="cpu", fsync="never"
    )
    print(f"client CPU per message, {args.size} B, {args.messages:,} messages, medians:")
    names = list(runs)
    print("| figure | " + " | ".join(names) + (" | ratio |" if len(names) == 2 else " |"))
    for part in args.parts:
        for fig in ("caller_us", "process_us", "msg_s"):
            med = [statistics.median(r[part][fig] for r in runs[s]) for s in names]
            row = f"| {part} {fig} | " + " | ".join(f"{m:,.2f}" for m in med)
            if len(med) == 2:
                row += f" | {med[1] / med[0]:.2f} |"
            else:
                row += " |"
            print(row)


if __name__ == "__main__":
    main()
