"""Unloading a bundle while its clients re-attach at once (issue #12: consumers left
detached).  A client told to re-attach looks the topic up while the bundle's node still
names this broker; before the fix the topic was opened here again and then the node was
deleted, leaving a topic served by a broker that no longer owns its bundle — its
consumers waited there forever while the producers moved to the new owner."""

from __future__ import annotations

import trio

from pigeon.broker._admin_ops import unload_bundle
from pigeon.core import TopicName

TOPIC = "persistent://public/default/unload-race"


async def test_no_topic_stays_loaded_without_its_bundle_after_an_unload(
    pigeon_standalone, client, autojump_clock
):
    service = pigeon_standalone.service
    name = TopicName.parse(TOPIC)
    consumer = await client.subscribe(TOPIC, "s", initial_position="earliest")
    producer = await client.create_producer(TOPIC, batching_max_messages=1)
    await producer.send(b"before")
    path = service.ownership.path_of(name)
    bundle = path.rsplit("/", 1)[1]
    seen: list[bool] = []
    done = trio.Event()
    real_delete = service.store.delete

    async def slow_delete(p: str, *args, **kw):  # type: ignore[no-untyped-def]
        if p == path:
            await trio.sleep(2.0)  # the clients re-attach meanwhile
        return await real_delete(p, *args, **kw)

    service.store.delete = slow_delete

    async def watch() -> None:
        # every time the topic is loaded during the unload, the bundle must be ours
        while not done.is_set():
            if name.full in service.topics:
                seen.append(service.ownership.owns(name))
            await trio.sleep(0.01)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        await unload_bundle(service, "public/default", bundle)
        await trio.sleep(1.0)
        done.set()
    assert all(seen), "a topic was served here while its bundle was not owned"
    if name.full in service.topics:
        assert service.ownership.owns(name)
        stat = await service.store.get(path)
        assert stat is not None, "topic served here, but its bundle's node is gone"
    await producer.send(b"after")
    got = []
    with trio.move_on_after(30):
        while len(got) < 2:
            got.extend(await consumer.batch_receive(2 - len(got)))
    assert [m.value for m in got] == [b"before", b"after"]
