"""Acknowledgements, redelivery, ack timeouts, dead letters and retries, in virtual time."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from standalone_support import PREFIX, drain, produce, receive_n, subscribe_and_produce, values

from pigeon.client import DeadLetterPolicy
from pigeon.client.trio import Client, Consumer
from pigeon.core.errors import Timeout

#: delays are whole milliseconds of wall time; allow for rounding and float noise
EPS = 0.01

SENT = [f"m{i}".encode() for i in range(10)]


# ----------------------------------------------------------------------------- acks


async def test_individual_acks_survive_a_resubscribe(client, autojump_clock):
    consumer, got = await subscribe_and_produce(client, "ind", SENT)
    for m in got[::2]:
        await consumer.acknowledge(m)
    await consumer.close()
    consumer = await client.subscribe("ind", "s")
    again = await drain(consumer)
    assert values(again) == SENT[1::2], "only the unacknowledged messages come back"
    await consumer.close()


async def test_cumulative_ack_covers_everything_before(client, autojump_clock):
    consumer, got = await subscribe_and_produce(client, "cum", SENT)
    await consumer.acknowledge(got[8])
    await consumer.acknowledge_cumulative(got[3])
    await consumer.close()
    consumer = await client.subscribe("cum", "s")
    again = await drain(consumer)
    assert values(again) == [SENT[i] for i in (4, 5, 6, 7, 9)]
    await consumer.close()


async def test_after_a_dropped_connection_only_unacked_messages_come_back(client, autojump_clock):
    consumer, got = await subscribe_and_produce(client, "drop", SENT)
    for m in got[:6]:
        await consumer.acknowledge(m)
    await trio.sleep(1)  # grouped acks go out within 100 ms
    consumer._handle.engines[0].conn.close()  # the network drops the connection
    again = await receive_n(consumer, 4)
    assert values(again) == SENT[6:]
    assert all(m.redelivery_count == 1 for m in again)
    assert await drain(consumer) == []
    await consumer.close()


# ----------------------------------------------------------------------------- nack


async def test_negative_ack_redelivers_only_that_message_after_its_delay(client, autojump_clock):
    consumer, (a, b, c) = await subscribe_and_produce(
        client, "nack-one", SENT[:3], subscription_type="shared", negative_ack_redelivery_delay=20.0
    )
    await consumer.acknowledge(a)
    await consumer.negative_acknowledge(b)
    await consumer.acknowledge(c)
    start = trio.current_time()
    with pytest.raises(Timeout):
        await consumer.receive(timeout=19.0)
    again = await consumer.receive(timeout=5.0)
    assert again.value == b.value and again.redelivery_count == 1
    assert 20.0 - EPS <= trio.current_time() - start < 21.0
    await consumer.acknowledge(again)
    assert await drain(consumer, idle=30) == []
    await consumer.close()


async def test_negative_ack_on_key_shared_redelivers_the_message(client, autojump_clock):
    consumer = await client.subscribe(
        "nack-ks",
        "s",
        subscription_type="key_shared",
        initial_position="earliest",
        negative_ack_redelivery_delay=1.0,
    )
    producer = await client.create_producer("nack-ks", batching_max_messages=1)
    for key in ("a", "b"):
        await producer.send(key.encode(), key=key)
    first, second = await receive_n(consumer, 2)
    await consumer.acknowledge(first)
    await consumer.negative_acknowledge(second)
    again = await consumer.receive(timeout=10.0)
    assert again.value == second.value and again.redelivery_count == 1
    await consumer.acknowledge(again)
    assert await drain(consumer) == []
    await consumer.close()
    await producer.close()


# ----------------------------------------------------------------------------- ack timeout


async def test_ack_timeout_redelivers_unacked_messages(client, autojump_clock):
    consumer, got = await subscribe_and_produce(
        client, "ack-timeout", SENT[:3], subscription_type="shared", ack_timeout=10.0
    )
    start = trio.current_time()
    await consumer.acknowledge(got[1])
    with pytest.raises(Timeout):
        await consumer.receive(timeout=9.5)
    again = await receive_n(consumer, 2, within=3)
    assert 10.0 - EPS <= trio.current_time() - start < 11.0
    assert sorted(values(again)) == [SENT[0], SENT[2]]
    assert all(m.redelivery_count == 1 for m in again)
    for m in again:
        await consumer.acknowledge(m)
    assert await drain(consumer, idle=25) == [], "acknowledged messages came back"
    await consumer.close()


async def test_without_ack_timeout_unacked_messages_are_not_redelivered(client, autojump_clock):
    consumer = await client.subscribe("no-ack-timeout", "s", subscription_type="shared")
    await produce(client, "no-ack-timeout", SENT[:2])
    await receive_n(consumer, 2)
    assert await drain(consumer, idle=60) == []
    await consumer.close()


# ----------------------------------------------------------------------------- dead letters


async def _shared_with_dead_letters(
    client: Client, topic: str, sub: str, policy: DeadLetterPolicy, **options: Any
) -> Consumer:
    """A consumer of the shared subscription ``sub`` with the dead letter ``policy``."""
    return await client.subscribe(
        topic, sub, subscription_type="shared", dead_letter_policy=policy, **options
    )


async def test_dead_letter_after_max_redeliveries(pigeon_standalone, client, autojump_clock):
    dlq = await client.subscribe("jobs-w-DLQ", "audit", initial_position="earliest")
    consumer = await _shared_with_dead_letters(
        client,
        "jobs",
        "w",
        DeadLetterPolicy(max_redeliver_count=2),
        negative_ack_redelivery_delay=1.0,
    )
    producer = await client.create_producer("jobs", batching_max_messages=1)
    poison_id = await producer.send(b"poison", key="p", properties={"a": "1"})
    await producer.send(b"fine")
    counts = []
    for _ in range(10):
        try:
            m = await consumer.receive(timeout=10)
        except Timeout:
            break
        if m.value == b"poison":
            counts.append(m.redelivery_count)
            assert m.message_id == poison_id
            await consumer.negative_acknowledge(m)
        else:
            await consumer.acknowledge(m)
    assert counts == [0, 1, 2], "delivered once plus max_redeliver_count redeliveries"
    dead = await dlq.receive(timeout=10)
    assert dead.value == b"poison" and dead.key == "p"
    assert dead.properties["ORIGIN_MESSAGE_ID"] == str(poison_id)
    assert dead.properties["REAL_TOPIC"] == PREFIX + "jobs"
    assert dead.properties["a"] == "1"
    assert dead.topic == PREFIX + "jobs-w-DLQ"
    assert await drain(consumer, idle=20) == [], "a dead-lettered message came back"
    sub = pigeon_standalone.service.topics[PREFIX + "jobs"].subscriptions["w"]
    assert sub.backlog() == 0, "the dead-lettered message is acknowledged on the original"
    await dlq.close()
    await consumer.close()
    await producer.close()


async def test_dead_letter_topic_can_be_named(client, autojump_clock):
    dlq = await client.subscribe("graveyard", "audit", initial_position="earliest")
    consumer = await _shared_with_dead_letters(
        client,
        "named-dlq",
        "w",
        DeadLetterPolicy(max_redeliver_count=1, dead_letter_topic="graveyard"),
        negative_ack_redelivery_delay=1.0,
    )
    await produce(client, "named-dlq", [b"bad"])
    for _ in range(2):
        await consumer.negative_acknowledge(await consumer.receive(timeout=10))
    # the next redelivery (count 2 > 1) is dead-lettered on the receive path
    with pytest.raises(Timeout):
        await consumer.receive(timeout=10)
    dead = await dlq.receive(timeout=10)
    assert dead.value == b"bad"
    assert dead.properties["REAL_TOPIC"] == PREFIX + "named-dlq"
    await dlq.close()
    await consumer.close()


async def test_reconsume_later_delivers_through_the_retry_topic_after_the_delay(
    client, autojump_clock
):
    consumer = await _shared_with_dead_letters(
        client, "later", "r", DeadLetterPolicy(max_redeliver_count=2, enable_retry=True)
    )
    first_id = (await produce(client, "later", [b"again"]))[0]
    m = await consumer.receive(timeout=10)
    start = trio.current_time()
    await consumer.reconsume_later(m, 10.0)
    with pytest.raises(Timeout):
        await consumer.receive(timeout=9.5)
    m = await consumer.receive(timeout=5)
    assert trio.current_time() - start >= 10.0 - EPS
    assert m.value == b"again"
    assert m.topic == PREFIX + "later-r-RETRY"
    assert m.properties["RECONSUMETIMES"] == "1"
    assert m.properties["REAL_TOPIC"] == PREFIX + "later"
    assert m.properties["ORIGIN_MESSAGE_ID"] == str(first_id)
    await consumer.acknowledge(m)
    assert await drain(consumer, idle=20) == [], "the original came back after reconsume_later"
    await consumer.close()


async def test_reconsume_later_past_max_count_goes_to_dlq(client, autojump_clock):
    dlq = await client.subscribe("orders-r-DLQ", "audit", initial_position="earliest")
    consumer = await _shared_with_dead_letters(
        client, "orders", "r", DeadLetterPolicy(max_redeliver_count=2, enable_retry=True)
    )
    first_id = (await produce(client, "orders", [b"again"]))[0]
    m = await consumer.receive(timeout=10)
    for attempt in (1, 2):
        await consumer.reconsume_later(m, 1.0)
        m = await consumer.receive(timeout=30)
        assert m.properties["RECONSUMETIMES"] == str(attempt)
    await consumer.reconsume_later(m, 1.0)  # third time: over max_redeliver_count
    dead = await dlq.receive(timeout=10)
    assert dead.value == b"again"
    assert dead.properties["REAL_TOPIC"] == PREFIX + "orders"
    assert dead.properties["ORIGIN_MESSAGE_ID"] == str(first_id)
    assert await drain(consumer, idle=20) == []
    await dlq.close()
    await consumer.close()


async def test_reconsume_later_delay_holds_after_virtual_time_has_passed(client, autojump_clock):
    """The same delay, asked for a minute (virtual) into the run, must still hold."""
    consumer = await _shared_with_dead_letters(
        client, "later2", "r", DeadLetterPolicy(max_redeliver_count=5, enable_retry=True)
    )
    await produce(client, "later2", [b"again"])
    m = await consumer.receive(timeout=10)
    await trio.sleep(60)
    start = trio.current_time()
    await consumer.reconsume_later(m, 10.0)
    m = await consumer.receive(timeout=30)
    assert trio.current_time() - start >= 10.0 - EPS, (
        f"retry delivered after {trio.current_time() - start:.2f}s instead of 10s"
    )
    await consumer.close()
