"""Consumer catch-up on a backlog, per system (see :mod:`bench.peers` for the servers
and the other scenarios): :func:`catchup`."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

from bench.__main__ import client_options, fill_backlog
from bench.peers import (
    ADMIN_URLS,
    CATCHUP_LIMIT,
    FILL_LIMIT,
    KAFKA_PRODUCER,
    _nats_stream,
    kafka_topic,
)

# --------------------------------------------------------------------------- catch-up
# Fill a backlog of 1 KiB messages (same payload, as bench/__main__.py's fill_backlog does),
# with the subscription / consumer group / durable consumer made first where the system
# has one, then time one consumer reading it all (first message to last, as
# run_perf_consume does). The fill is preparation, done the fastest way each system offers,
# and is reported only as information. Fill and read are both cut at their limits; a
# cut run is marked (the rate is then over what was stored or read).


def _fill_pigeon(url: str, topic: str, n: int, deadline: float) -> int:
    messages: int = fill_backlog(url, topic, n, deadline=deadline)["messages"]
    return messages


def _read_pigeon(url: str, topic: str, n: int, deadline: float) -> dict:
    from pigeon.client._cli import run_perf_consume

    r = run_perf_consume(
        url,
        topic,
        duration=max(1.0, deadline - time.monotonic()),
        max_messages=n,
        idle_timeout=10.0,
        progress=False,
        client_options=client_options(url),
    )
    return {"messages": r["messages"], "seconds": r["seconds"]}


NATS_FILL_CHUNK = 10_000


async def _nats_fill(url: str, topic: str, n: int, deadline: float) -> int:
    import nats

    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await _nats_stream(js, topic, f"{topic}.0")
        payload = os.urandom(1024)
        subject = f"{topic}.0"
        pub = nc.publish
        sent = 0
        while sent < n and time.monotonic() < deadline:
            k = min(NATS_FILL_CHUNK, n - sent)
            for _ in range(k):
                await pub(subject, payload)
            sent += k
            await nc.flush(30)
        # core publishes are not acknowledged one by one: wait until the stream holds them
        stored = 0
        while time.monotonic() < deadline + 10:
            stored = (await js.stream_info(topic)).state.messages
            if stored >= sent:
                break
            await asyncio.sleep(0.05)
        return int(stored)
    finally:
        await nc.close()


async def _nats_read(url: str, topic: str, n: int, deadline: float) -> dict:
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    nc = await nats.connect(url)
    count = 0
    first = last = 0.0
    done = asyncio.Event()

    async def cb(msg: Any) -> None:
        nonlocal count, first, last
        if not count:
            first = time.perf_counter()
        count += 1
        if count % NATS_ACK_EVERY == 0 or count >= n:
            await msg.ack()  # AckAll: acknowledges everything up to here
        if count >= n:
            last = time.perf_counter()
            done.set()

    try:
        js = nc.jetstream()
        await js.subscribe(
            f"{topic}.0",
            durable="catchup",
            stream=topic,
            cb=cb,
            manual_ack=True,
            config=ConsumerConfig(
                ack_policy=AckPolicy.ALL,
                max_ack_pending=NATS_MAX_ACK_PENDING,
                deliver_policy=DeliverPolicy.ALL,
                flow_control=True,
                idle_heartbeat=5.0,
            ),
            pending_msgs_limit=200_000,
            pending_bytes_limit=512 * 1024 * 1024,
        )
        try:
            await asyncio.wait_for(done.wait(), max(1.0, deadline - time.monotonic()))
        except TimeoutError:
            last = time.perf_counter()
    finally:
        await nc.close()
    return {"messages": count, "seconds": round(max(last - first, 1e-9), 3)}


NATS_ACK_EVERY = 1000
NATS_MAX_ACK_PENDING = 20_000


def _fill_nats(url: str, topic: str, n: int, deadline: float) -> int:
    return asyncio.run(_nats_fill(url, topic, n, deadline))


def _read_nats(url: str, topic: str, n: int, deadline: float) -> dict:
    return asyncio.run(_nats_read(url, topic, n, deadline))


# XADD in a server-side loop: the fill is preparation, and redis-py's pipelines would
# spend half of the scenario's time limit on it
REDIS_FILL_LUA = (
    "for i = 1, tonumber(ARGV[2]) do redis.call('XADD', KEYS[1], '*', 'd', ARGV[1]) end return 1"
)
REDIS_READ_COUNT = 1000


def _fill_redis(url: str, topic: str, n: int, deadline: float) -> int:
    import redis

    r = redis.Redis.from_url(url)
    try:
        # the consumer group first, from the start of the stream
        r.xgroup_create(topic, "catchup", id="0", mkstream=True)
        fill = r.register_script(REDIS_FILL_LUA)
        payload = os.urandom(1024)
        sent = 0
        while sent < n and time.monotonic() < deadline:
            k = min(5000, n - sent)
            fill(keys=[topic], args=[payload, k])
            sent += k
        return int(r.xlen(topic))
    finally:
        r.close()


def _read_redis(url: str, topic: str, n: int, deadline: float) -> dict:
    import redis

    r = redis.Redis.from_url(url)
    count = 0
    first = last = 0.0
    ids: list[bytes] = []
    try:
        while count < n and time.monotonic() < deadline:
            # acknowledge the previous batch in the same round trip as the next read
            pipe = r.pipeline(transaction=False)
            if ids:
                pipe.xack(topic, "catchup", *ids)
            pipe.xreadgroup("catchup", "c1", {topic: ">"}, count=REDIS_READ_COUNT, block=1000)
            resp = pipe.execute()[-1]
            ids = []
            for _stream, entries in resp or []:
                if not count:
                    first = time.perf_counter()
                count += len(entries)
                ids = [e[0] for e in entries]
                last = time.perf_counter()
        if ids:
            r.xack(topic, "catchup", *ids)
    finally:
        r.close()
    return {"messages": count, "seconds": round(max(last - first, 1e-9), 3)}


def _fill_tansu(bootstrap: str, topic: str, n: int, deadline: float) -> int:
    from confluent_kafka import Producer

    kafka_topic(bootstrap, topic)
    p = Producer({"bootstrap.servers": bootstrap, **KAFKA_PRODUCER})
    payload = os.urandom(1024)
    produce = p.produce
    sent = 0
    while sent < n and time.monotonic() < deadline:
        k = min(1000, n - sent)
        i = 0
        while i < k:
            try:
                produce(topic, payload)
                i += 1
            except BufferError:
                p.poll(0.005)
        sent += k
        p.poll(0)
    left = p.flush(max(5.0, deadline + 10 - time.monotonic()))
    return sent - left


def _read_tansu(bootstrap: str, topic: str, n: int, deadline: float) -> dict:
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "catchup",
            "enable.auto.commit": True,  # librdkafka's default: commit every 5 s
            "auto.offset.reset": "earliest",
        }
    )
    c.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    count = 0
    first = last = 0.0
    idle_since = time.monotonic()
    try:
        while count < n and time.monotonic() < deadline:
            # a short timeout: consume() waits for all 10,000 or the timeout
            msgs = c.consume(10_000, 0.1)
            now = time.monotonic()
            k = sum(1 for m in msgs if m.error() is None)
            if not k:
                if now - idle_since > 10.0:
                    break
                continue
            idle_since = now
            if not count:
                first = time.perf_counter()
            count += k
            last = time.perf_counter()
        c.commit(asynchronous=False)
    finally:
        c.close()
    return {"messages": count, "seconds": round(max(last - first, 1e-9), 3)}


# --------------------------------------------------------------------------- offloaded backlog
# ``pigeon-offloaded``: between the fill and the read, the topic's closed segments are
# offloaded (``pigeon admin topics offload TOPIC``), and the harness waits until
# ``offload-status`` says SUCCESS and the bookie copies of every offloaded segment are gone
# (``bookies_deleted`` in ``internal-stats``; the namespace's ``offload_deletion_lag_s``
# is 0, set before the fill), so that the read is served by the offloader. The segment
# being written is never offloaded: its share is reported (``offloaded_fraction``).

OFFLOAD_LIMIT = 120.0  # seconds for the offload and the bookie deletions


def _admin(url: str) -> Any:
    from pigeon.client._admin_client import AdminClient

    return AdminClient(ADMIN_URLS[url])


def _before_offloaded(url: str, topic: str) -> None:
    from pigeon.client._admin_client import AdminError

    admin = _admin(url)
    deadline = time.monotonic() + 30
    while True:  # the admin API may come up a moment after the broker port
        try:
            admin.set_policies("public/default", {"offload_deletion_lag_s": 0})
            return
        except AdminError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _offload(url: str, topic: str) -> dict[str, Any]:
    admin = _admin(url)
    start = time.monotonic()
    deadline = start + OFFLOAD_LIMIT
    admin.offload(topic, size_threshold=0)
    while True:
        status = admin.offload_status(topic)
        segs = admin.internal_stats(topic)["segments"]
        offloaded = [s for s in segs if s.get("offload")]
        if status["status"] == "ERROR":
            raise RuntimeError(f"offload of {topic} failed: {status.get('last_error')}")
        if (
            status["status"] == "SUCCESS"
            and offloaded
            and all(s.get("bookies_deleted") for s in offloaded)
        ):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"offload of {topic} not done in {OFFLOAD_LIMIT:g} s: {status}")
        time.sleep(0.2)
    total = sum(int(s["size"]) for s in segs) or 1
    return {
        "offload_seconds": round(time.monotonic() - start, 2),
        "offloaded_segments": len(offloaded),
        "offloaded_fraction": round(sum(int(s["size"]) for s in offloaded) / total, 3),
    }


def _cache_stats(url: str, topic: str) -> dict[str, int] | None:
    if url not in ADMIN_URLS:
        return None
    cache = _admin(url).internal_stats(topic).get("cache")
    return dict(cache) if cache else None


#: per system: called before the fill (url, topic)
BEFORE: dict[str, Callable[[str, str], None]] = {"pigeon-offloaded": _before_offloaded}
#: per system: called between the fill and the read (url, topic) -> fields for the result
PREPARE: dict[str, Callable[[str, str], dict[str, Any]]] = {"pigeon-offloaded": _offload}


FILL: dict[str, Callable[[str, str, int, float], int]] = {
    "pigeon": _fill_pigeon,
    "pigeon-journal": _fill_pigeon,
    "pigeon-offloaded": _fill_pigeon,
    "pigeon-tls": _fill_pigeon,
    "pigeon-tls-auth": _fill_pigeon,
    "nats": _fill_nats,
    "redis": _fill_redis,
    "tansu": _fill_tansu,
    "pigeon-kafka": _fill_tansu,
}
READ: dict[str, Callable[[str, str, int, float], dict]] = {
    "pigeon": _read_pigeon,
    "pigeon-journal": _read_pigeon,
    "pigeon-offloaded": _read_pigeon,
    "pigeon-tls": _read_pigeon,
    "pigeon-tls-auth": _read_pigeon,
    "nats": _read_nats,
    "redis": _read_redis,
    "tansu": _read_tansu,
    "pigeon-kafka": _read_tansu,
}


def catchup(
    system: str,
    url: str,
    topic: str,
    backlog_mb: float,
    size: int = 1024,
    server_cpu: Callable[[], float | None] = lambda: None,
) -> dict:
    """Fill ``backlog_mb`` MiB of 1 KiB messages, then time one consumer reading them all.
    ``server_cpu()``: the server's CPU seconds so far, to report the read's share."""
    want = int(backlog_mb * 2**20) // size
    if system in BEFORE:
        BEFORE[system](url, topic)
    start = time.monotonic()
    filled = FILL[system](url, topic, want, start + FILL_LIMIT)
    fill_s = time.monotonic() - start
    prepared: dict[str, Any] = {}
    if system in PREPARE:  # not timed: the read's limit starts after it
        t = time.monotonic()
        prepared = PREPARE[system](url, topic)
        start += time.monotonic() - t
    cache = _cache_stats(url, topic)
    cpu = server_cpu()
    r = READ[system](url, topic, filled, start + CATCHUP_LIMIT)
    after = server_cpu()
    if cache is not None:
        now = _cache_stats(url, topic) or cache
        prepared["read_cache_hits"] = now["hits"] - cache["hits"]
        prepared["read_cache_misses"] = now["misses"] - cache["misses"]
    read_cpu = {}
    if cpu is not None and after is not None:
        read_cpu["read_server_cpu_seconds"] = round(after - cpu, 2)
        if r["messages"]:
            read_cpu["read_server_cpu_us_per_msg"] = round((after - cpu) / r["messages"] * 1e6, 3)
    n, secs = int(r["messages"]), float(r["seconds"])
    return {
        "scenario": "catchup",
        "system": system,
        "message_size": size,
        "backlog_mb_requested": backlog_mb,
        "backlog_messages": filled,
        "backlog_mb": round(filled * size / 2**20, 1),
        "fill_seconds": round(fill_s, 2),
        "fill_mb_per_s": round(filled * size / fill_s / 1e6, 1),
        "messages": n,
        "seconds": secs,
        "msg_per_s": round(n / secs, 1) if n else 0.0,
        "mb_per_s": round(n * size / secs / 1e6, 2) if n else 0.0,
        "complete": filled == want and n >= filled,
        "total_seconds": round(time.monotonic() - start, 2),
        **read_cpu,
        **prepared,
    }
