"""Partitioned topics and routing modes; non-persistent topics (in-process, virtual time)."""

from __future__ import annotations

import zlib
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from standalone_support import PREFIX, drain

from pigeon.client.trio import Client
from pigeon.core.errors import NotSupported

NP = "non-persistent://public/default/"


# ----------------------------------------------------------------------------- partitions


async def test_partitioned_topic_consumer_gets_every_partition(client, autojump_clock):
    await client.create_topic("sensor-data", partitions=4)
    topics = await client.list_topics("public/default")
    assert PREFIX + "sensor-data" in topics
    assert not any("-partition-" in t for t in topics), topics
    consumer = await client.subscribe("sensor-data", "s")
    producer = await client.create_producer("sensor-data", batching_max_messages=1)
    ids = [await producer.send(f"v{i}".encode()) for i in range(20)]
    assert {mid.partition for mid in ids} <= {0, 1, 2, 3}
    got = await drain(consumer)
    assert sorted(m.value for m in got) == sorted(f"v{i}".encode() for i in range(20))
    for m in got:
        assert 0 <= m.message_id.partition < 4
        assert m.topic == f"{PREFIX}sensor-data-partition-{m.message_id.partition}"
    by_value = {m.value: m.message_id for m in got}
    assert [by_value[f"v{i}".encode()] for i in range(20)] == ids
    await producer.close()
    await consumer.close()


async def test_round_robin_spreads_unkeyed_and_keeps_keys_sticky(client, autojump_clock):
    await client.create_topic("rr", partitions=4)
    producer = await client.create_producer("rr", batching_max_messages=1)
    unkeyed = Counter([(await producer.send(b"x")).partition for _ in range(40)])
    assert sorted(unkeyed) == [0, 1, 2, 3] and set(unkeyed.values()) == {10}, unkeyed
    per_key: dict[str, set[int]] = defaultdict(set)
    for i in range(60):
        key = f"user-{i % 12}"
        per_key[key].add((await producer.send(b"y", key=key)).partition)
    assert all(len(parts) == 1 for parts in per_key.values()), per_key
    assert len({p for parts in per_key.values() for p in parts}) > 1
    await producer.close()


async def test_round_robin_fills_one_batch_per_partition(client, autojump_clock):
    await client.create_topic("rr-batches", partitions=3)
    producer = await client.create_producer(
        "rr-batches", batching_max_messages=5, batching_max_delay_ms=10_000
    )
    results: list = []
    for _ in range(15):
        await producer.send_async(b"z", callback=lambda mid, err: results.append(mid))
    await producer.flush()
    parts = [mid.partition for mid in results]
    # batches of five, each to one partition, one partition after another
    assert Counter(parts) == {0: 5, 1: 5, 2: 5}
    assert all(
        len({mid.partition for mid in results if mid.segment_id == s}) == 1
        for s in {mid.segment_id for mid in results}
    )
    await producer.close()


async def test_single_partition_sends_every_unkeyed_message_to_one_partition(
    client, autojump_clock
):
    await client.create_topic("single", partitions=4)
    producer = await client.create_producer(
        "single", routing_mode="single_partition", batching_max_messages=1
    )
    parts = {(await producer.send(b"x")).partition for _ in range(20)}
    assert len(parts) == 1
    keyed = {(await producer.send(b"k", key=f"k{i}")).partition for i in range(20)}
    assert len(keyed) > 1, "keyed messages still go by key hash"
    await producer.close()


async def test_key_hash_routes_by_the_hash_of_the_key(client, autojump_clock):
    await client.create_topic("hashed", partitions=5)
    producer = await client.create_producer("hashed", routing_mode="key_hash")
    for i in range(25):
        key = f"device-{i}"
        mid = await producer.send(b"x", key=key)
        assert mid.partition == zlib.crc32(key.encode()) % 5, key
    await producer.close()


async def test_custom_message_router(client, autojump_clock):
    calls: list = []

    def router(key, n):
        calls.append((key, n))
        return int(key) % n

    await client.create_topic("routed", partitions=3)
    producer = await client.create_producer("routed", message_router=router)
    for i in range(9):
        assert (await producer.send(b"x", key=str(i))).partition == i % 3
    assert calls[0] == ("0", 3)
    await producer.close()
    consumer = await client.subscribe("routed", "s", initial_position="earliest")
    got = await drain(consumer)
    assert len(got) == 9
    assert all(m.message_id.partition == int(m.key) % 3 for m in got)
    await consumer.close()


async def test_a_partition_can_be_used_as_a_topic(client, autojump_clock):
    await client.create_topic("parts", partitions=2)
    consumer = await client.subscribe("parts-partition-1", "s")
    producer = await client.create_producer("parts", message_router=lambda key, n: 1)
    await producer.send(b"to one", key="k")
    msg = await consumer.receive(timeout=10)
    assert msg.value == b"to one" and msg.message_id.partition == 1
    await producer.close()
    await consumer.close()


# ----------------------------------------------------------------------------- non-persistent


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


async def test_non_persistent_fans_out_and_never_touches_disk(pigeon_standalone, autojump_clock):
    cluster = pigeon_standalone
    bookie_dir = cluster.data_dir / "bookie"
    async with Client(cluster.url) as client:
        a = await client.subscribe(NP + "prices", "ui")
        b = await client.subscribe(NP + "prices", "audit")
        before = _files(bookie_dir)
        producer = await client.create_producer(NP + "prices", batching_max_messages=1)
        for i in range(20):
            await producer.send(f"p{i}".encode() * 100)
        got_a, got_b = await drain(a), await drain(b)
        assert [m.value for m in got_a] == [f"p{i}".encode() * 100 for i in range(20)]
        assert [m.value for m in got_b] == [m.value for m in got_a]
        assert _files(bookie_dir) == before, "a non-persistent topic wrote to the bookie"
        assert (
            await cluster.service.store.get("/pigeon/ledgers/non-persistent/public/default/prices")
            is None
        )
        # nothing stored: a later subscription sees nothing of it
        late = await client.subscribe(NP + "prices", "late", initial_position="earliest")
        assert await drain(late) == []
        for c in (a, b, late):
            await c.close()
        await producer.close()


async def test_non_persistent_slow_consumer_loses_messages(pigeon_standalone, autojump_clock):
    cluster = pigeon_standalone
    async with Client(cluster.url) as client:
        slow = await client.subscribe(NP + "ticks", "slow", receiver_queue_size=5)
        fast = await client.subscribe(NP + "ticks", "fast")
        producer = await client.create_producer(NP + "ticks", batching_max_messages=1)
        for i in range(50):
            await producer.send(f"t{i}".encode())
        got_fast = await drain(fast)
        assert len(got_fast) == 50, "a consumer with room loses nothing"
        got_slow = await drain(slow)
        assert 0 < len(got_slow) < 50
        stats = cluster.service.topics[NP + "ticks"].stats()["subscriptions"]
        assert stats["slow"]["dropped"] == 50 - len(got_slow)
        assert stats["fast"]["dropped"] == 0
        # once it has room again it gets new messages; offsets show the gap
        await producer.send(b"after")
        after = await drain(slow)
        assert [m.value for m in after] == [b"after"]
        assert after[0].offset == 50
        await producer.close()
        await slow.close()
        await fast.close()


@pytest.mark.parametrize("sub_type", ["shared", "exclusive"])
async def test_non_persistent_subscription_types(client, autojump_clock, sub_type):
    consumers = [await client.subscribe(NP + f"np-{sub_type}", "s", subscription_type=sub_type)]
    if sub_type == "shared":
        consumers.append(await client.subscribe(NP + "np-shared", "s", subscription_type="shared"))
    producer = await client.create_producer(NP + f"np-{sub_type}", batching_max_messages=1)
    for i in range(10):
        await producer.send(f"{i}".encode())
    got = [await drain(c) for c in consumers]
    assert sorted(m.value for g in got for m in g) == sorted(f"{i}".encode() for i in range(10))
    assert all(got)
    await producer.close()
    for c in consumers:
        await c.close()


async def test_non_persistent_messages_are_not_redelivered(client, autojump_clock):
    a = await client.subscribe(NP + "np-noredeliver", "s", subscription_type="shared")
    producer = await client.create_producer(NP + "np-noredeliver")
    await producer.send(b"once")
    assert (await a.receive(timeout=5)).value == b"once"
    b = await client.subscribe(NP + "np-noredeliver", "s", subscription_type="shared")
    await a.close()  # unacknowledged, but nothing is kept to redeliver
    assert await drain(b) == []
    await producer.close()
    await b.close()


async def test_non_persistent_refuses_key_shared(client, autojump_clock):
    with pytest.raises(NotSupported):
        await client.subscribe(NP + "np-ks", "s", subscription_type="key_shared")
