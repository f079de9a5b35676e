"""``pigeon.broker._service``: the broker's registry of topics (an in-process standalone
in virtual time).  A topic is loaded once however many look it up at the same time; a
lookup that must not create refuses an unknown topic; creating a topic checks what
exists."""

from __future__ import annotations

import pytest
import trio
from standalone_support import PREFIX

from pigeon.broker._ledger import ManagedLedger
from pigeon.core import TopicName
from pigeon.core.errors import InvalidArgument, TopicExists, TopicNotFound


async def test_concurrent_lookups_load_a_topic_once(pigeon_standalone, autojump_clock, monkeypatch):
    service = pigeon_standalone.service
    name = TopicName.parse("svc-once")
    opened: list[ManagedLedger] = []
    real_open = ManagedLedger.open

    async def slow_open(self: ManagedLedger) -> None:
        opened.append(self)
        await trio.sleep(1)  # every other lookup arrives while this one loads
        await real_open(self)

    monkeypatch.setattr(ManagedLedger, "open", slow_open)
    found: list = []

    async def lookup() -> None:
        found.append(await service.get_topic(name))

    async with trio.open_nursery() as nursery:
        for _ in range(10):
            nursery.start_soon(lookup)
    assert len(opened) == 1, f"the topic's ledger was opened {len(opened)} times"
    assert len(found) == 10 and all(t is found[0] for t in found)
    assert service.topics[name.full] is found[0]


async def test_a_lookup_that_must_not_create_refuses_an_unknown_topic(
    pigeon_standalone, autojump_clock
):
    service = pigeon_standalone.service
    with pytest.raises(TopicNotFound):
        await service.get_topic(TopicName.parse("svc-unknown"), create=False)
    with pytest.raises(TopicNotFound):
        await service.get_topic(TopicName.parse("persistent://nobody/nowhere/t"))
    assert PREFIX + "svc-unknown" not in service.topics
    await service.create_topic(TopicName.parse("svc-unknown"), 0)
    topic = await service.get_topic(TopicName.parse("svc-unknown"), create=False)
    assert topic.name.full == PREFIX + "svc-unknown"


async def test_create_topic_checks_what_exists(pigeon_standalone, autojump_clock):
    service = pigeon_standalone.service
    await service.create_topic(TopicName.parse("svc-plain"), 0)
    with pytest.raises(TopicExists):
        await service.create_topic(TopicName.parse("svc-plain"), 0)
    await service.create_topic(TopicName.parse("svc-parts"), 3)
    assert await service.partitions_of(TopicName.parse("svc-parts")) == 3
    with pytest.raises(TopicExists):
        await service.create_topic(TopicName.parse("svc-parts"), 2)
    with pytest.raises(InvalidArgument):
        await service.create_topic(TopicName.parse("svc-parts-partition-1"), 2)
    with pytest.raises(InvalidArgument):  # a partitioned topic is used through its partitions
        await service.get_topic(TopicName.parse("svc-parts"))
    listed = await service.list_topics("public/default")
    assert {
        "persistent://public/default/svc-plain",
        "persistent://public/default/svc-parts",
    } <= set(listed)
    assert not any("-partition-" in t for t in listed)
