"""Namespace policies: retention, message TTL, backlog quotas, de-duplication, size limit.

Virtual time throughout (``autojump_clock``); policies are set in-process through the
broker's PolicyStore.  Retention tests use their own in-process standalone with
two-entry segments, so trimming is visible in ``ledger.segments``.
"""

from __future__ import annotations

import pytest
import trio
from standalone_support import (
    NS,
    PREFIX,
    batch_of,
    drain,
    produce,
    raw_sends,
    read_all,
    real_time_limit,
    receive_n,
    set_backlog_quota,
)

from pigeon.client.trio import Client, Consumer, Producer
from pigeon.core.errors import MessageTooLarge, ProducerBlocked
from pigeon.core.testing import InProcessStandalone

# ----------------------------------------------------------------------------- helpers


def ledger(cluster: InProcessStandalone, topic: str):
    return cluster.service.topics[PREFIX + topic].ledger


async def consume_and_ack(client: Client, topic: str, n: int, sub: str = "s") -> None:
    consumer = await client.subscribe(topic, sub, initial_position="earliest")
    got = await receive_n(consumer, n)
    await consumer.acknowledge_cumulative(got[-1])
    await consumer.close()


VALUES = [f"value-{i:02d}".encode() for i in range(10)]


# ----------------------------------------------------------------------------- retention


async def test_consumed_segments_are_kept_for_the_retention_time(small_segments, autojump_clock):
    cluster = small_segments
    await cluster.service.policies.set(NS, {"retention_time_s": 30, "retention_size_mb": -1})
    async with Client(cluster.url) as client:
        await produce(client, "kept", VALUES)
        await consume_and_ack(client, "kept", 10)
        await trio.sleep(1)
        led = ledger(cluster, "kept")
        before = [s.id for s in led.segments]
        assert len([s for s in led.segments if s.state == "closed"]) >= 4
        await trio.sleep(20)  # twenty maintenance passes, all within retention
        assert [s.id for s in led.segments] == before
        assert [m.value for m in await read_all(client, "kept")] == VALUES
        await trio.sleep(15)  # past the retention time
        await cluster.service.maintain_once()
        assert not [s for s in led.segments if s.state == "closed"], "consumed segments kept"
        left = [m.value for m in await read_all(client, "kept")]
        assert len(left) <= 2 and left == VALUES[len(VALUES) - len(left) :], left


async def test_retention_size_keeps_the_newest_consumed_segments(small_segments, autojump_clock):
    cluster = small_segments
    await cluster.service.policies.set(NS, {"retention_time_s": -1, "retention_size_mb": -1})
    async with Client(cluster.url) as client:
        await produce(client, "sized", VALUES)
        await consume_and_ack(client, "sized", 10)
        await trio.sleep(5)
        led = ledger(cluster, "sized")
        closed = [s for s in led.segments if s.state == "closed"]
        assert len(closed) >= 4
        assert [m.value for m in await read_all(client, "sized")] == VALUES  # retention -1
        size = closed[0].size
        # keep two and a half segments' worth: all but the two newest consumed segments go
        await cluster.service.policies.set(NS, {"retention_size_mb": 2.5 * size / 2**20})
        await cluster.service.maintain_once()
        assert [s.id for s in led.segments if s.state == "closed"] == [s.id for s in closed[-2:]]
        left = [m.value for m in await read_all(client, "sized")]
        assert 4 <= len(left) < 10 and left == VALUES[10 - len(left) :], left


async def test_unconsumed_data_is_never_trimmed(small_segments, autojump_clock):
    cluster = small_segments  # default policies: consumed data goes at once
    async with Client(cluster.url) as client:
        slow = await client.subscribe("backlogged", "slow", initial_position="earliest")
        await produce(client, "backlogged", VALUES)
        led = ledger(cluster, "backlogged")
        await consume_and_ack(client, "backlogged", 10, sub="fast")
        await trio.sleep(5)
        await cluster.service.maintain_once()
        got = await drain(slow)
        assert [m.value for m in got] == VALUES, "data not yet consumed by 'slow' was trimmed"
        before = [s.id for s in led.segments]
        await slow.acknowledge_cumulative(got[3])
        await trio.sleep(5)
        await cluster.service.maintain_once()
        assert len(led.segments) < len(before), "consumed segments were not trimmed"
        left = [m.value for m in await read_all(client, "backlogged")]
        assert len(left) < 10 and left[-6:] == VALUES[4:], left
        await slow.close()


# ----------------------------------------------------------------------------- message TTL


async def test_message_ttl_skips_old_unconsumed_messages(pigeon_standalone, autojump_clock):
    cluster = pigeon_standalone
    await cluster.service.policies.set(NS, {"message_ttl_s": 10})
    async with Client(cluster.url) as client:
        await (await client.subscribe("ttl", "s")).close()
        await produce(client, "ttl", [b"old-1", b"old-2"])
        await trio.sleep(12)  # maintenance runs every second
        consumer = await client.subscribe("ttl", "s")
        assert await drain(consumer) == [], "expired messages were delivered"
        await produce(client, "ttl", [b"new"])
        assert [m.value for m in await drain(consumer)] == [b"new"]
        sub = cluster.service.topics[PREFIX + "ttl"].subscriptions["s"]
        await consumer.close()
        assert sub.cursor.mark_delete >= 2


async def test_message_ttl_keeps_messages_younger_than_the_ttl(pigeon_standalone, autojump_clock):
    cluster = pigeon_standalone
    await cluster.service.policies.set(NS, {"message_ttl_s": 10})
    async with Client(cluster.url) as client:
        await (await client.subscribe("ttl-young", "s")).close()
        await trio.sleep(30)  # the broker has been up a while
        await produce(client, "ttl-young", [b"young"])
        await trio.sleep(5)  # half the TTL
        consumer = await client.subscribe("ttl-young", "s")
        assert [m.value for m in await drain(consumer)] == [b"young"], "expired before its TTL"
        await consumer.close()


async def test_without_ttl_old_messages_stay(client, autojump_clock):
    await (await client.subscribe("no-ttl", "s")).close()
    await produce(client, "no-ttl", [b"old"])
    await trio.sleep(30)
    consumer = await client.subscribe("no-ttl", "s")
    assert [m.value for m in await drain(consumer)] == [b"old"]
    await consumer.close()


# ----------------------------------------------------------------------------- backlog quota


async def _quota_of_1000_bytes(
    cluster: InProcessStandalone, client: Client, topic: str, policy: str, send_timeout: float
) -> tuple[Consumer, Producer]:
    """A backlog quota of 1000 bytes with ``policy``; a consumer of ``topic`` from the
    earliest, and a producer (one message per entry) giving up after ``send_timeout``."""
    await set_backlog_quota(cluster, 1000, policy)
    consumer = await client.subscribe(topic, "s", initial_position="earliest")
    producer = await client.create_producer(
        topic, batching_max_messages=1, send_timeout=send_timeout
    )
    return consumer, producer


async def test_backlog_quota_producer_exception(pigeon_standalone, client, autojump_clock):
    consumer, producer = await _quota_of_1000_bytes(
        pigeon_standalone, client, "quota-ex", "producer_exception", send_timeout=20
    )
    with real_time_limit(5):
        stored = 0
        with pytest.raises(ProducerBlocked):
            for _ in range(10):
                await producer.send(b"x" * 300)
                stored += 1
        assert 2 <= stored <= 4, stored
        got = await drain(consumer)
        assert len(got) == stored, "the refused message was stored"
        await consumer.acknowledge_cumulative(got[-1])
        await trio.sleep(1)
        await producer.send(b"after the backlog drained")  # accepted again
        await producer.close()
        await consumer.close()


async def test_backlog_quota_producer_request_hold(pigeon_standalone, client, autojump_clock):
    consumer, producer = await _quota_of_1000_bytes(
        pigeon_standalone, client, "quota-hold", "producer_request_hold", send_timeout=60
    )
    with real_time_limit(30):

        async def send(value: bytes, done: trio.Event) -> None:
            await producer.send(value)
            done.set()

        async with trio.open_nursery() as nursery:
            accepted = 0
            for i in range(10):
                done = trio.Event()
                nursery.start_soon(send, f"{i}".encode() * 300, done)
                with trio.move_on_after(5):
                    await done.wait()
                if not done.is_set():
                    break  # held: the backlog is over the quota
                accepted += 1
            assert 2 <= accepted <= 4, accepted
            assert not done.is_set(), "no send was held although the backlog exceeds the quota"
            got = await drain(consumer, idle=1.0)
            assert len(got) == accepted, "the held message was stored before the backlog shrank"
            held_at = trio.current_time()
            await consumer.acknowledge_cumulative(got[-1])
            with trio.fail_after(10):
                await done.wait()
            assert trio.current_time() - held_at < 5
        assert [m.value for m in await drain(consumer)] == [f"{accepted}".encode() * 300]
        await producer.close()
        await consumer.close()


async def test_backlog_quota_consumer_eviction_advances_the_slow_cursor(
    small_segments, autojump_clock
):
    cluster = small_segments
    async with Client(cluster.url) as client:
        slow = await client.subscribe(
            "evict", "slow", initial_position="earliest", receiver_queue_size=1
        )
        await produce(client, "evict", VALUES)
        led = ledger(cluster, "evict")
        size = next(s.size for s in led.segments if s.state == "closed")
        quota = int(2.5 * size)
        await set_backlog_quota(cluster, quota, "consumer_backlog_eviction")
        await trio.sleep(3)  # maintenance
        topic = cluster.service.topics[PREFIX + "evict"]
        sub = topic.subscriptions["slow"]
        assert sub.cursor.mark_delete > 0, "the slow subscription was not advanced"
        assert topic.backlog_bytes() <= quota
        await slow.close()
        slow = await client.subscribe("evict", "slow")
        got = [m.value for m in await drain(slow)]
        assert got and got == VALUES[-len(got) :], "the newest messages stay"
        assert len(got) < 10
        await slow.close()


async def test_backlog_eviction_drops_only_what_is_over_the_quota(
    pigeon_standalone, autojump_clock
):
    """Ten 300-byte messages against a 2000-byte quota: the newest messages that fit stay."""
    cluster = pigeon_standalone
    await set_backlog_quota(cluster, 2000, "consumer_backlog_eviction")
    async with Client(cluster.url) as client:
        await (await client.subscribe("evict-one-seg", "slow")).close()
        await produce(client, "evict-one-seg", [f"{i}".encode() * 300 for i in range(10)])
        await trio.sleep(3)
        slow = await client.subscribe("evict-one-seg", "slow")
        got = await drain(slow)
        assert got, "eviction dropped the whole backlog although the newest messages fit the quota"
        assert got[-1].value == b"9" * 300
        await slow.close()


# ----------------------------------------------------------------------------- dedup


async def _raw_sends(
    cluster: InProcessStandalone, topic: str, sends: list[tuple[int, bytes]]
) -> list[dict]:
    """Send (sequence id, value) batches over a raw protocol connection; the receipts."""
    batches = [(seq, 1, batch_of([value], "raw-producer", seq)) for seq, value in sends]
    return await raw_sends(cluster.url, topic, "raw-producer", batches)


async def test_deduplication_stores_a_resent_sequence_once(
    pigeon_standalone, client, autojump_clock
):
    receipts = await _raw_sends(
        pigeon_standalone, "dedup-on", [(0, b"a"), (1, b"b"), (0, b"a"), (1, b"b")]
    )
    assert [bool(r.get("duplicate")) for r in receipts] == [False, False, True, True]
    assert [m.value for m in await read_all(client, "dedup-on")] == [b"a", b"b"]


async def test_without_deduplication_a_resent_sequence_is_stored_again(
    pigeon_standalone, client, autojump_clock
):
    await pigeon_standalone.service.policies.set(NS, {"deduplication": False})
    receipts = await _raw_sends(pigeon_standalone, "dedup-off", [(0, b"a"), (1, b"b"), (0, b"a")])
    assert not any(r.get("duplicate") for r in receipts)
    assert [m.value for m in await read_all(client, "dedup-off")] == [b"a", b"b", b"a"]


async def test_named_producer_resumes_after_its_last_stored_sequence(client, autojump_clock):
    p = await client.create_producer("named", producer_name="ingest-1", batching_max_messages=1)
    for v in VALUES[:3]:
        await p.send(v)
    await p.close()
    p = await client.create_producer("named", producer_name="ingest-1", batching_max_messages=1)
    assert p._handle.engines[0].last_sequence_id == 2
    await p.send(VALUES[3])
    await p.close()
    assert [m.value for m in await read_all(client, "named")] == VALUES[:4]


# ----------------------------------------------------------------------------- size limit


async def test_max_message_size_policy(pigeon_standalone, client, autojump_clock):
    await pigeon_standalone.service.policies.set(NS, {"max_message_size": 1000})
    producer = await client.create_producer("sized-msgs", batching_max_messages=1)
    with pytest.raises(MessageTooLarge):
        await producer.send(b"x" * 2000)
    await producer.send(b"y" * 500)
    await producer.close()
    assert [m.value for m in await read_all(client, "sized-msgs")] == [b"y" * 500]


async def test_messages_under_the_policy_limit_are_not_refused_because_of_batching(
    pigeon_standalone, client, autojump_clock
):
    await pigeon_standalone.service.policies.set(NS, {"max_message_size": 1000})
    producer = await client.create_producer("batched-msgs", batching_max_delay_ms=100)
    errors: list = []
    for i in range(3):
        await producer.send_async(
            f"{i}".encode() * 400, callback=lambda mid, err: errors.append(err)
        )
    await producer.flush()
    await producer.close()
    assert errors == [None, None, None]
    assert len(await read_all(client, "batched-msgs")) == 3
