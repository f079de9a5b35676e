"""End-to-end latency at a fixed rate, per system (see :mod:`bench.peers` for the
servers and the other scenarios): :func:`latency`."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

from bench.__main__ import client_options
from bench.peers import (
    KAFKA_PRODUCER,
    KAFKA_SYSTEMS,
    NATIVE,
    STAMP,
    SUSTAINED,
    TAIL_LIMIT,
    _nats_stream,
    kafka_topic,
    pct,
)

# --------------------------------------------------------------------------- end-to-end latency
# The producer (this process) stamps time.time_ns() in the first 8 bytes; a consumer in a
# separate process records receive time - stamp. The first second is warm-up, not recorded.


def _consume(system: str, addr: str, topic: str, ready: Any, stop: Any, out: Any, got: Any) -> None:
    """The latency consumer (own process). ``got`` counts every message received, warm-up
    included, so the producer side can wait for the tail instead of guessing."""
    lat: list[float] = []
    warm_ns = [0]

    def record(data: bytes, now_ns: int) -> None:
        (ts,) = STAMP.unpack_from(data)
        if ts >= warm_ns[0]:
            lat.append((now_ns - ts) / 1e9)

    try:
        if system in NATIVE:
            from pigeon.client import Client, Timeout

            with Client(addr, **client_options(addr)) as client:
                c = client.subscribe(topic, "lat", initial_position="latest")
                ready.put("ready")
                warm_ns[0] = out_start(ready)
                while not stop.is_set():
                    try:
                        msgs = c.batch_receive(1000, timeout=0.2)
                    except Timeout:
                        continue
                    now = time.time_ns()
                    for m in msgs:
                        record(m.value, now)
                    got.value += len(msgs)
                    c.acknowledge_cumulative(msgs[-1])
                c.close()
        elif system == "nats":

            async def run() -> None:
                import nats
                from nats.js.api import DeliverPolicy

                nc = await nats.connect(addr)
                js = nc.jetstream()

                async def cb(msg: Any) -> None:
                    record(msg.data, time.time_ns())
                    got.value += 1

                await js.subscribe(
                    f"{topic}.0", cb=cb, ordered_consumer=True, deliver_policy=DeliverPolicy.NEW
                )
                await nc.flush()
                ready.put("ready")
                warm_ns[0] = await asyncio.to_thread(out_start, ready)
                while not stop.is_set():  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
                await nc.close()

            asyncio.run(run())
        elif system == "redis":
            import redis

            r = redis.Redis.from_url(addr)
            # resolve "$" now: XREAD from "$" after the producer started would miss messages
            tip = r.xrevrange(topic, count=1)
            last = tip[0][0] if tip else "0-0"
            ready.put("ready")
            warm_ns[0] = out_start(ready)
            while not stop.is_set():
                resp = r.xread({topic: last}, count=1000, block=200)
                now = time.time_ns()
                for _stream, entries in resp or []:
                    for _eid, fields in entries:
                        record(fields[b"d"], now)
                    got.value += len(entries)
                    last = entries[-1][0]
            r.close()
        elif system in KAFKA_SYSTEMS:
            from confluent_kafka import OFFSET_END, Consumer, TopicPartition

            c = Consumer(
                {
                    "bootstrap.servers": addr,
                    "group.id": "lat",
                    "enable.auto.commit": False,
                    "fetch.wait.max.ms": 5,
                    "fetch.queue.backoff.ms": 0,
                    "fetch.min.bytes": 1,
                }
            )
            c.assign([TopicPartition(topic, 0, OFFSET_END)])
            # the first poll resolves OFFSET_END; give it time before the producer starts
            t_end = time.monotonic() + 3
            while time.monotonic() < t_end:
                c.poll(0.1)
            ready.put("ready")
            warm_ns[0] = out_start(ready)
            while not stop.is_set():
                msgs = c.consume(1000, 0.2)
                now = time.time_ns()
                k = 0
                for m in msgs:
                    if m.error() is None:
                        record(m.value(), now)
                        k += 1
                got.value += k
            c.close()
        out.put(("ok", lat))
    except BaseException as exc:
        out.put(("error", repr(exc)))


def out_start(q: Any) -> int:
    """Wait for the producer's start stamp (sent back on the ready queue)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            v = q.get(timeout=0.5)
        except Exception:
            continue
        if isinstance(v, int):
            return v
        q.put(v)
        time.sleep(0.05)
    return 0


def _paced(send: Callable[[list[bytes]], None], rate: float, size: int, duration: float,
           idle: Callable[[], None] | None = None) -> int:  # fmt: skip
    pad = os.urandom(size - 8)
    perf = time.perf_counter
    t0 = perf()
    end = t0 + duration
    n = 0
    while True:
        now = perf()
        if now >= end:
            break
        due = int((now - t0) * rate) + 1
        if due <= n:
            if idle is not None:
                idle()
            time.sleep(max(0.0, min((n / rate) - (now - t0), 0.001)))
            continue
        k = min(due - n, 1000)
        stamp = STAMP.pack(time.time_ns())
        send([stamp + pad] * k)
        n += k
    return n


def latency(
    system: str,
    addr: str,
    topic: str,
    mb_per_s: float,
    duration: float,
    size: int = 1024,
    linger_ms: float = 1.0,
) -> dict:
    """End-to-end latency at ``mb_per_s``: a paced producer (batching delay
    ``linger_ms``: PigeonMQ's ``batching_max_delay_ms``, Kafka's ``linger.ms``; 0 sends a
    batch as soon as the client can, with whatever came meanwhile) and a consumer in
    another process."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    ready, out, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    got = ctx.Value("q", 0, lock=False)  # one writer: the consumer process
    rate = mb_per_s * 1e6 / size
    # topic/stream must exist before the consumer attaches
    if system == "nats":

        async def mk() -> None:
            import nats

            nc = await nats.connect(addr)
            await _nats_stream(nc.jetstream(), f"{topic}-0", f"{topic}.0")
            await nc.close()

        asyncio.run(mk())
    elif system in KAFKA_SYSTEMS:
        kafka_topic(addr, topic)
    proc = ctx.Process(
        target=_consume, args=(system, addr, topic, ready, stop, out, got), daemon=True
    )
    proc.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if ready.get(timeout=0.5) == "ready":
                    break
            except Exception:
                pass
            if not proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{system} consumer did not become ready")
        t_send = time.monotonic()
        n, warm = _produce_paced(system, addr, topic, rate, size, duration, ready, linger_ms)
        sent_s = time.monotonic() - t_send  # includes the final flush: every message sent
        # let the tail arrive: until every message is in, or nothing came for 2 s, or the
        # consumer is TAIL_LIMIT behind (then the run is marked, not waited for)
        t_tail = time.monotonic()
        seen, seen_at = got.value, t_tail
        while got.value < n:
            now = time.monotonic()
            if got.value != seen:
                seen, seen_at = got.value, now
            if now - seen_at > 2.0 or now - t_tail > TAIL_LIMIT:
                break
            time.sleep(0.05)
        tail_s = time.monotonic() - t_tail
        time.sleep(0.2)
        stop.set()
        status, lat = out.get(timeout=30)
        if status != "ok":
            raise RuntimeError(f"{system} consumer failed: {lat}")
    finally:
        stop.set()
        proc.join(20)
        if proc.is_alive():
            proc.kill()
            proc.join()
    lat.sort()
    expected = int(rate * (duration - warm))
    achieved = n * size / duration / 1e6
    received = int(got.value)
    sustained = n >= SUSTAINED * rate * duration and received >= SUSTAINED * n
    return {
        "scenario": "e2e_latency",
        "system": system,
        "target_mb_per_s": mb_per_s,
        "achieved_mb_per_s": round(achieved, 2),
        "sustained": sustained,
        "message_size": size,
        "linger_ms": linger_ms,
        "sent": n,
        "send_seconds": round(sent_s, 3),
        "received": received,
        "tail_seconds": round(tail_s, 3),
        "received_after_warmup": len(lat),
        "expected_after_warmup": expected,
        "latency_ms_p50": round(pct(lat, 0.50) * 1000, 3),
        "latency_ms_p99": round(pct(lat, 0.99) * 1000, 3),
        "latency_ms_p999": round(pct(lat, 0.999) * 1000, 3),
        "latency_ms_max": round(lat[-1] * 1000, 3) if lat else None,
        "cdf_ms": [round(pct(lat, q / 100) * 1000, 3) for q in range(0, 101)],
    }


def _produce_paced(
    system: str,
    addr: str,
    topic: str,
    rate: float,
    size: int,
    duration: float,
    ready: Any,
    linger_ms: float = 1.0,
) -> tuple[int, float]:
    warm = 1.0

    def announce() -> None:
        ready.put(time.time_ns() + int(warm * 1e9))

    if system in NATIVE:
        from pigeon.client import Client

        with Client(addr, **client_options(addr)) as client:
            p = client.create_producer(topic, batching_max_delay_ms=linger_ms)
            announce()

            def send(batch: list[bytes]) -> None:
                for m in batch:
                    p.send_async(m)

            n = _paced(send, rate, size, duration)
            p.flush()
            p.close()
        return n, warm
    if system == "redis":
        import redis

        r = redis.Redis.from_url(addr)
        announce()

        def send(batch: list[bytes]) -> None:
            pipe = r.pipeline(transaction=False)
            for m in batch:
                pipe.xadd(topic, {b"d": m}, maxlen=1_000_000, approximate=True)
            pipe.execute()

        n = _paced(send, rate, size, duration)
        r.close()
        return n, warm
    if system in KAFKA_SYSTEMS:
        from confluent_kafka import Producer

        p = Producer({"bootstrap.servers": addr, **KAFKA_PRODUCER, "linger.ms": linger_ms})
        announce()

        def send(batch: list[bytes]) -> None:
            for m in batch:
                while True:
                    try:
                        p.produce(topic, m)
                        break
                    except BufferError:
                        p.poll(0.001)
            p.poll(0)

        n = _paced(send, rate, size, duration, idle=lambda: p.poll(0))
        p.flush(30)
        return n, warm
    if system == "nats":
        return asyncio.run(_nats_paced(addr, topic, rate, size, duration, announce)), warm
    raise ValueError(system)


async def _nats_paced(
    addr: str, topic: str, rate: float, size: int, duration: float, announce: Callable[[], None]
) -> int:
    import nats

    nc = await nats.connect(addr)
    js = nc.jetstream(publish_async_max_pending=4000)
    subject = f"{topic}.0"
    pad = os.urandom(size - 8)
    announce()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    end = t0 + duration
    n = 0
    while True:
        now = loop.time()
        if now >= end:
            break
        due = int((now - t0) * rate) + 1
        if due <= n:
            await asyncio.sleep(max(0.0, min((n / rate) - (now - t0), 0.001)))
            continue
        k = min(due - n, 1000)
        stamp = STAMP.pack(time.time_ns())
        for _ in range(k):
            await js.publish_async(subject, stamp + pad)
        n += k
    await asyncio.wait_for(js.publish_async_completed(), 30)
    await nc.close()
    return n
