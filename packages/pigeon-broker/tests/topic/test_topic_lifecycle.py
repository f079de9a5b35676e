"""``pigeon.broker._topic``: a topic loaded, used and unloaded on one broker (an in-process
standalone in virtual time).  Once unloaded, the old object refuses to attach anything
with a typed, retriable error (the caller looks the topic up again), refuses appends, and
the next lookup loads a new one that has kept the data."""

from __future__ import annotations

import pytest
from standalone_support import produce, read_all, values

from pigeon.broker._lifecycle import unload_topic
from pigeon.client.trio import Client
from pigeon.core import TopicName
from pigeon.core.errors import NotOwner, ProducerBusy, ServiceUnavailable


async def test_an_unloaded_topic_refuses_subscriptions_and_appends_with_typed_errors(
    pigeon_standalone, client, autojump_clock
):
    service = pigeon_standalone.service
    name = TopicName.parse("topic-unload")
    await produce(client, "topic-unload", [b"kept"])
    old = await service.get_topic(name)
    assert await unload_topic(service, name) == [name.full]
    assert old.unloaded and old.ledger.closed
    with pytest.raises(NotOwner) as refused:
        await old.subscription("s", "exclusive", "earliest", durable=True, start_offset=-1)
    assert refused.value.retriable
    answers: list = []
    with pytest.raises(ServiceUnavailable) as closed:
        old.append(b"late", 1, lambda result, error: answers.append((result, error)))
    assert closed.value.retriable and answers == []
    # the next lookup loads the topic again, with its data and room for more
    new = await service.get_topic(name)
    assert new is not old and not new.unloaded
    sub = await new.subscription("s", "exclusive", "earliest", durable=True, start_offset=-1)
    assert sub.backlog() == 1
    await produce(client, "topic-unload", [b"after"])
    assert values(await read_all(client, "topic-unload")) == [b"kept", b"after"]


async def test_stats_count_what_producers_and_subscriptions_did(
    pigeon_standalone, client, autojump_clock
):
    service = pigeon_standalone.service
    consumer = await client.subscribe("topic-stats", "s", initial_position="earliest")
    producer = await client.create_producer("topic-stats", batching_max_messages=1)
    for i in range(4):
        await producer.send(b"x" * 10 + bytes([i]))
    topic = await service.get_topic(TopicName.parse("topic-stats"))
    stats = topic.stats()
    assert (stats["msgs_in"], stats["next_offset"], stats["producers"]) == (4, 4, 1)
    assert stats["subscriptions"]["s"]["backlog"] == 4
    assert stats["subscriptions"]["s"]["consumers"] == 1
    await producer.close()
    await consumer.close()
    assert topic.stats()["producers"] == 0


async def test_a_producer_name_held_by_a_live_client_is_busy(
    pigeon_standalone, client, autojump_clock
):
    first = await client.create_producer("topic-busy", producer_name="ingest")
    async with Client(pigeon_standalone.url) as other:
        with pytest.raises(ProducerBusy):
            await other.create_producer("topic-busy", producer_name="ingest")
    await first.close()
    # once the holder is gone, the name is free again
    async with Client(pigeon_standalone.url) as other:
        again = await other.create_producer("topic-busy", producer_name="ingest")
        await again.send(b"x")
        await again.close()
