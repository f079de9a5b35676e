"""Subscribes that race each other or an unload (issue #12: consumers left detached).

Found by the nemesis: two consumers of one subscription re-attaching at the same moment
each opened the subscription (its cursor read from the metadata store in between), the
second replacing the first in the topic, so the first consumer was served by an orphan
dispatcher that the admin API and every unload no longer saw; and a subscribe that
waited while its topic was unloaded attached to the unloaded topic, where nothing would
ever be delivered, while the client believed it was attached.
"""

from __future__ import annotations

import trio

from pigeon.broker._admin_ops import unload_topic
from pigeon.client.trio import Client
from pigeon.core import TopicName

TOPIC = "persistent://public/default/subscribe-races"


def _slow_cursor_reads(service, delay: float) -> None:  # type: ignore[no-untyped-def]
    real_get = service.store.get

    async def slow_get(path: str, *args, **kw):  # type: ignore[no-untyped-def]
        if path.startswith("/pigeon/cursors/"):
            await trio.sleep(delay)
        return await real_get(path, *args, **kw)

    service.store.get = slow_get


async def test_consumers_subscribing_at_once_share_one_subscription(
    pigeon_standalone, client, autojump_clock
):
    service = pigeon_standalone.service
    producer = await client.create_producer(TOPIC, batching_max_messages=1)
    _slow_cursor_reads(service, 1.0)
    consumers = []

    async def subscribe(i: int) -> None:
        consumers.append(
            await client.subscribe(
                TOPIC,
                "s",
                subscription_type="shared",
                initial_position="earliest",
                consumer_name=f"c{i}",
            )
        )

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(subscribe, i)
    topic = service.topics[TopicName.parse(TOPIC).full]
    sub = topic.subscriptions["s"]
    assert sorted(c.name for c in sub.consumers) == ["c0", "c1", "c2"]
    for i in range(30):
        await producer.send(f"m{i}".encode())
    got: list[bytes] = []
    with trio.move_on_after(30):
        while len(got) < 30:
            for c in consumers:
                with trio.move_on_after(0.2):
                    for m in await c.batch_receive(30):
                        got.append(m.value)
                        await c.acknowledge(m)
    assert sorted(got) == sorted(f"m{i}".encode() for i in range(30))
    with trio.fail_after(10):  # every acknowledgement reaches the one subscription
        while sub.backlog():  # noqa: ASYNC110
            await trio.sleep(0.05)


async def test_a_subscribe_that_waited_through_an_unload_attaches_to_the_reloaded_topic(
    pigeon_standalone, client, autojump_clock
):
    service = pigeon_standalone.service
    name = TopicName.parse(TOPIC)
    producer = await client.create_producer(TOPIC, batching_max_messages=1)
    await producer.send(b"before")
    _slow_cursor_reads(service, 2.0)
    consumer = None

    async def subscribe() -> None:
        nonlocal consumer
        consumer = await client.subscribe(TOPIC, "s", initial_position="earliest")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(subscribe)
        await trio.sleep(0.5)  # the subscribe now waits for the cursor
        first = service.topics[name.full]
        assert await unload_topic(service, name) == [name.full]
    assert consumer is not None
    assert first.subscriptions.get("s") is None or not first.subscriptions["s"].consumers
    topic = service.topics[name.full]
    assert topic is not first
    assert [c.name for c in topic.subscriptions["s"].consumers]
    await producer.send(b"after")
    got: list[bytes] = []
    with trio.move_on_after(30):
        while len(got) < 2:
            got.extend(m.value for m in await consumer.batch_receive(2 - len(got)))
    assert got == [b"before", b"after"]


async def test_a_subscribe_the_client_gave_up_on_leaves_no_consumer_behind(
    pigeon_standalone, autojump_clock
):
    """A subscribe that outlives the client's operation timeout (a slow topic load) and
    then succeeds on the broker must not leave a consumer there: the client closed it
    when it gave up, before the broker had added it.  That ghost consumer held an
    exclusive subscription (the real one was refused as busy) and took a shared
    subscription's messages, which nobody would ever acknowledge (zlf 5004: a backlog
    that never drained)."""
    from pigeon.client import Timeout

    service = pigeon_standalone.service
    topic_name = TOPIC + "-abandoned"
    async with Client(pigeon_standalone.url, operation_timeout=2.0) as client:
        producer = await client.create_producer(topic_name, batching_max_messages=1)
        _slow_cursor_reads(service, 5.0)
        for sub_type in ("exclusive", "shared"):
            try:
                await client.subscribe(topic_name, sub_type, subscription_type=sub_type)
            except Timeout:
                pass
            else:
                raise AssertionError("the subscribe was expected to time out")
        await trio.sleep(10)  # the broker finishes both subscribes meanwhile
        topic = service.topics[TopicName.parse(topic_name).full]
        assert {n: s.consumers for n, s in topic.subscriptions.items()} == {
            "exclusive": [],
            "shared": [],
        }
        del service.store.get  # cursor reads are quick again
        consumers = [
            await client.subscribe(topic_name, t, subscription_type=t)
            for t in ("exclusive", "shared")
        ]
        await producer.send(b"m")
        for consumer in consumers:
            with trio.fail_after(10):
                assert (await consumer.receive()).value == b"m"
