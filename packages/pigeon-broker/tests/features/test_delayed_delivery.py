"""Delayed delivery (deliver_at / deliver_after), in virtual time.

Shared and key_shared subscriptions hold a delayed message back until its time;
exclusive and failover subscriptions deliver it at once (Pulsar's semantics, which
``_subscription.py`` follows: only shared and key_shared dispatch looks at deliver_at).
"""

from __future__ import annotations

import time

import pytest
import trio
from standalone_support import consumer_and_producer

from pigeon.core.errors import InvalidArgument, Timeout

#: delays are whole milliseconds of wall time; allow for rounding and float noise
EPS = 0.01


@pytest.mark.parametrize("sub_type", ["shared", "key_shared"])
async def test_deliver_after_holds_the_message_on_shared_subscriptions(
    client, autojump_clock, sub_type
):
    consumer, producer = await consumer_and_producer(client, "later", subscription_type=sub_type)
    start = trio.current_time()
    await producer.send(b"in 30s", key="k", deliver_after=30)
    await producer.send(b"in 10s", key="k", deliver_after=10)
    await producer.send(b"now", key="k")
    first = await consumer.receive(timeout=5)
    assert first.value == b"now"
    with pytest.raises(Timeout):
        await consumer.receive(timeout=9)
    second = await consumer.receive(timeout=5)
    assert second.value == b"in 10s"
    assert 10 - EPS <= trio.current_time() - start < 11
    with pytest.raises(Timeout):
        await consumer.receive(timeout=18)
    third = await consumer.receive(timeout=5)
    assert third.value == b"in 30s"
    assert 30 - EPS <= trio.current_time() - start < 31
    await consumer.close()
    await producer.close()


async def test_deliver_at_an_absolute_time(client, autojump_clock):
    consumer, producer = await consumer_and_producer(client, "at", subscription_type="shared")
    start = trio.current_time()
    due = int(time.time() * 1000) + 20_000
    await producer.send(b"at due", deliver_at=due)
    with pytest.raises(Timeout):
        await consumer.receive(timeout=19)
    msg = await consumer.receive(timeout=5)
    assert msg.value == b"at due"
    assert trio.current_time() - start >= 20 - EPS
    await consumer.close()
    await producer.close()


async def test_deliver_at_in_the_past_is_delivered_at_once(client, autojump_clock):
    consumer, producer = await consumer_and_producer(client, "past", subscription_type="shared")
    start = trio.current_time()
    await producer.send(b"late", deliver_at=int(time.time() * 1000) - 60_000)
    assert (await consumer.receive(timeout=5)).value == b"late"
    assert trio.current_time() - start < 1
    await consumer.close()
    await producer.close()


@pytest.mark.parametrize("sub_type", ["exclusive", "failover"])
async def test_exclusive_and_failover_ignore_the_delay(client, autojump_clock, sub_type):
    consumer, producer = await consumer_and_producer(client, "ignored", subscription_type=sub_type)
    start = trio.current_time()
    await producer.send(b"delayed", deliver_after=3600)
    assert (await consumer.receive(timeout=5)).value == b"delayed"
    assert trio.current_time() - start < 1
    await consumer.close()
    await producer.close()


async def test_a_delayed_message_redelivered_after_a_consumer_leaves_keeps_its_delay(
    client, autojump_clock
):
    a, producer = await consumer_and_producer(client, "delay-handover", subscription_type="shared")
    start = trio.current_time()
    await producer.send(b"later", deliver_after=20)
    await a.close()  # nothing was delivered yet; the delay is the broker's business
    b = await client.subscribe("delay-handover", "s", subscription_type="shared")
    with pytest.raises(Timeout):
        await b.receive(timeout=15)
    assert (await b.receive(timeout=10)).value == b"later"
    assert trio.current_time() - start >= 20 - EPS
    await b.close()
    await producer.close()


async def test_deliver_at_and_deliver_after_together_are_refused(client, autojump_clock):
    producer = await client.create_producer("both")
    with pytest.raises(InvalidArgument):
        await producer.send(b"x", deliver_at=1, deliver_after=1.0)
    await producer.close()


async def test_deliver_after_counts_from_the_send_later_in_the_run(client, autojump_clock):
    """deliver_after sent a minute (virtual) into the run must still wait its delay."""
    consumer, producer = await consumer_and_producer(
        client, "later-in-run", subscription_type="shared"
    )
    await trio.sleep(60)
    start = trio.current_time()
    await producer.send(b"in 10s", deliver_after=10)
    msg = await consumer.receive(timeout=30)
    assert msg.value == b"in 10s"
    assert trio.current_time() - start >= 10 - EPS, (
        f"delivered after {trio.current_time() - start:.2f}s instead of 10s"
    )
    await consumer.close()
    await producer.close()
