"""Time-based behaviour in virtual time: trio's MockClock drives every wait."""

from __future__ import annotations

import trio
from standalone_support import consumer_and_producer

from pigeon.core.errors import Timeout


async def test_negative_ack_redelivers_after_the_delay(client, autojump_clock):
    producer = await client.create_producer("nack")
    await producer.send(b"one")
    consumer = await client.subscribe(
        "nack", "s", initial_position="earliest", negative_ack_redelivery_delay=30.0
    )
    msg = await consumer.receive(timeout=5)
    assert msg.redelivery_count == 0
    await consumer.negative_acknowledge(msg)
    start = trio.current_time()
    again = await consumer.receive(timeout=60)
    assert again.value == b"one"
    assert again.redelivery_count == 1
    assert 30.0 <= trio.current_time() - start < 31.0
    await consumer.close()
    await producer.close()


async def test_delayed_message_is_held_until_due(client, autojump_clock):
    consumer, producer = await consumer_and_producer(client, "later", subscription_type="shared")
    start = trio.current_time()
    await producer.send(b"in an hour", deliver_after=3600)
    await producer.send(b"now")
    first = await consumer.receive(timeout=10)
    assert first.value == b"now"
    try:
        await consumer.receive(timeout=3000)
        raise AssertionError("delayed message came early")
    except Timeout:
        pass
    late = await consumer.receive(timeout=1000)
    assert late.value == b"in an hour"
    # deliver_after is counted from the client's wall clock at send time
    assert trio.current_time() - start >= 3599
    await consumer.close()
    await producer.close()
