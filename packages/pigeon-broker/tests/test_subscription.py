"""``pigeon.broker._subscription``: what a subscription keeps for its consumers, through the
real client and an in-process standalone in virtual time: unacknowledged messages stay in
its backlog and come back, its cursor is persisted and survives the topic being reloaded,
and expiring moves it on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio
from standalone_support import PREFIX, drain, produce, subscribe_and_produce, values

from pigeon.broker._cursor import CursorState
from pigeon.broker._kafka_offsets import commit_offset, committed_offset, subscription_of
from pigeon.broker._lifecycle import unload_topic
from pigeon.core import TopicName, check_subscription_name
from pigeon.core.errors import InvalidSubscriptionName, Timeout
from pigeon.core.paths import cursor_path

SENT = [f"m{i}".encode() for i in range(10)]


async def test_a_nacked_message_stays_in_the_backlog_and_is_redelivered_after_the_delay(
    pigeon_standalone, client, autojump_clock
):
    consumer, (a, b, c) = await subscribe_and_produce(
        client, "sub-nack", SENT[:3], subscription_type="shared", negative_ack_redelivery_delay=5.0
    )
    sub = pigeon_standalone.service.topics[PREFIX + "sub-nack"].subscriptions["s"]
    await consumer.acknowledge(a)
    await consumer.acknowledge(c)
    await consumer.negative_acknowledge(b)
    await trio.sleep(1)  # the acks reach the broker
    assert sub.backlog() == 1, "only the nacked message is left to deliver"
    with pytest.raises(Timeout):
        await consumer.receive(timeout=3.5)
    again = await consumer.receive(timeout=5)
    assert (again.value, again.redelivery_count) == (b.value, 1)
    await consumer.acknowledge(again)
    await trio.sleep(1)
    assert sub.backlog() == 0
    assert await drain(consumer) == [], "an acknowledged message came back"
    await consumer.close()


async def test_the_cursor_is_persisted_and_a_reloaded_topic_resumes_from_it(
    pigeon_standalone, client, autojump_clock
):
    service = pigeon_standalone.service
    name = TopicName.parse("sub-persist")
    consumer, got = await subscribe_and_produce(client, "sub-persist", SENT)
    await consumer.acknowledge_cumulative(got[4])
    await trio.sleep(1)  # past the persist interval (50 ms in the fixture)
    stat = await service.store.get(cursor_path(name, "s"))
    assert stat is not None, "the cursor was never written to the metadata store"
    assert CursorState.from_json(stat.value).mark_delete == 5
    await consumer.close()
    assert await unload_topic(service, name) == [name.full]
    assert name.full not in service.topics
    consumer = await client.subscribe("sub-persist", "s", initial_position="earliest")
    assert values(await drain(consumer)) == SENT[5:], "the reloaded topic lost the cursor"
    await consumer.close()


async def test_a_subscription_without_consumers_keeps_its_type_across_a_reload(
    pigeon_standalone, client, autojump_clock
):
    service = pigeon_standalone.service
    name = TopicName.parse("sub-type")
    consumer, _ = await subscribe_and_produce(
        client, "sub-type", SENT[:1], subscription_type="shared"
    )
    await consumer.close()
    await trio.sleep(1)  # past the persist interval
    stat = await service.store.get(cursor_path(name, "s"))
    assert stat is not None and CursorState.from_json(stat.value).sub_type == "shared"
    assert await unload_topic(service, name) == [name.full]
    topic = await service.get_topic(name)
    sub = await topic.find_subscription("s")  # loaded from the store, as the admin API does
    assert (sub.type, sub.consumers) == ("shared", [])
    # a consumer asking for another type of the empty subscription changes (and stores) it
    consumer = await client.subscribe("sub-type", "s", subscription_type="failover")
    await trio.sleep(1)
    stat = await service.store.get(cursor_path(name, "s"))
    assert stat is not None and CursorState.from_json(stat.value).sub_type == "failover"
    await consumer.close()


async def test_expiring_acknowledges_the_older_messages_for_every_consumer(
    pigeon_standalone, client, autojump_clock
):
    await (await client.subscribe("sub-expire", "s")).close()
    await produce(client, "sub-expire", SENT)
    sub = pigeon_standalone.service.topics[PREFIX + "sub-expire"].subscriptions["s"]
    assert sub.backlog() == 10
    sub.expire_before(7)
    assert sub.backlog() == 3
    consumer = await client.subscribe("sub-expire", "s")
    assert values(await drain(consumer)) == SENT[7:]
    await consumer.close()


async def test_a_subscription_name_outside_the_rule_is_refused(
    pigeon_standalone, client, autojump_clock
):
    with pytest.raises(InvalidSubscriptionName, match="may only hold ASCII letters, digits"):
        await client.subscribe("sub-names", "my sub")
    with pytest.raises(InvalidSubscriptionName, match="300 characters long, at most 255"):
        await client.subscribe("sub-names", "s" * 300)


@pytest.mark.parametrize(
    ("group", "subscription"),
    [
        ("app", "app"),
        ("my group", "my%20group"),
        ("a/b%c", "a%2Fb%25c"),
        ("gruppé", "grupp%C3%A9"),
        ("..", "%2E%2E"),
    ],
)
def test_a_kafka_group_id_maps_to_a_valid_subscription_name(group, subscription):
    assert subscription_of(group) == subscription
    assert check_subscription_name(subscription) == subscription


async def test_a_group_committed_under_its_former_name_resumes_from_there(pigeon_standalone):
    """A group whose id holds a space committed as ``my group`` before such characters
    were encoded: its offset is still found (and the next commit goes to ``my%20group``)."""
    service = pigeon_standalone.service
    name = TopicName.parse("kafka-former-partition-0")
    door = SimpleNamespace(core=service)  # what committed_offset reads of the front door
    assert await committed_offset(door, name, "my group") == -1
    await service.store.create(cursor_path(name, "my group"), CursorState(42).to_json())
    assert await committed_offset(door, name, "my group") == 42
    # the first commit stores the new name and drops the former one (retention)
    await commit_offset(door, name, "my group", 0)
    assert await committed_offset(door, name, "my group") == 0
    assert not await service.store.exists(cursor_path(name, "my group"))
    assert await service.store.exists(cursor_path(name, "my%20group"))


class _BrokerTasks(trio.abc.Instrument):
    """The tasks of the subscription's code spawned while it is installed."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        if task.name.startswith("pigeon.broker._subscription."):
            self.names.append(task.name)


async def test_a_caught_up_subscription_pushes_a_new_message_without_starting_a_task(
    pigeon_standalone, client, autojump_clock
):
    # the dispatch loop of a subscription waiting for new entries wakes on one event the
    # ledger sets: no task per wait (each took scheduler passes between store and push)
    consumer = await client.subscribe("sub-wake", "s")
    producer = await client.create_producer("sub-wake", batching_enabled=False)
    await producer.send(b"warm-up")
    assert (await consumer.receive(timeout=5)).value == b"warm-up"
    spawned = _BrokerTasks()
    trio.lowlevel.add_instrument(spawned)
    try:
        for i in range(5):
            await producer.send(b"m%d" % i)
            msg = await consumer.receive(timeout=5)
            assert msg.value == b"m%d" % i
            await consumer.acknowledge(msg)
            await trio.sleep(0.5)  # caught up: the loop waits again
    finally:
        trio.lowlevel.remove_instrument(spawned)
    assert spawned.names == [], "the subscription started tasks to deliver caught-up messages"
    await producer.close()
    await consumer.close()


class _HeldWrites:
    """A metadata store whose cursor writes wait until ``release`` is set."""

    def __init__(self, store: object) -> None:
        self._store = store
        self.started = trio.Event()
        self.release = trio.Event()

    async def set(self, *args: object, **kwargs: object) -> object:
        self.started.set()
        await self.release.wait()
        return await self._store.set(*args, **kwargs)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)


async def test_a_message_is_delivered_while_the_cursor_is_being_written(
    pigeon_standalone, client, autojump_clock
):
    # the cursor is written beside the dispatch loop: a push never waits for a
    # metadata-store write (1-8 ms on the embedded store, at most every 100 ms)
    consumer = await client.subscribe("sub-slow-cursor", "s")
    producer = await client.create_producer("sub-slow-cursor", batching_enabled=False)
    sub = pigeon_standalone.service.topics[PREFIX + "sub-slow-cursor"].subscriptions["s"]
    held = _HeldWrites(sub.store)
    sub.store = held
    await producer.send(b"first")
    first = await consumer.receive(timeout=5)
    await consumer.acknowledge(first)
    with trio.fail_after(5):
        await held.started.wait()  # the ack's cursor write is under way, and held
    await producer.send(b"second")
    second = await consumer.receive(timeout=5)
    assert second.value == b"second"
    held.release.set()
    await consumer.acknowledge(second)
    await trio.sleep(1)
    stat = await pigeon_standalone.service.store.get(cursor_path(sub.ledger.topic, "s"))
    assert CursorState.from_json(stat.value).mark_delete == 2, "the acks were not stored"
    await producer.close()
    await consumer.close()
