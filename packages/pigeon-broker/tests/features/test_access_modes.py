"""Producer access modes (Pulsar's ProducerAccessMode) end to end: shared, exclusive,
wait_for_exclusive (first come first served) and exclusive_with_fencing, on the three
faces."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import uuid

import pytest
import trio
from standalone_support import PREFIX

from pigeon.broker._lifecycle import unload_topic
from pigeon.client import Client as SyncClient
from pigeon.client import asyncio as asyncio_face
from pigeon.client import trio as trio_face
from pigeon.client.asyncio import Client as AsyncioClient
from pigeon.core import TopicName
from pigeon.core.errors import InvalidArgument, ProducerBusy, ProducerFenced
from pigeon.core.paths import producer_epoch_path


def epoch_of(producer: trio_face.Producer) -> int:
    return int(producer._handle.engines[0].topic_epoch)


@pytest.mark.parametrize("face", [SyncClient, trio_face.Client, asyncio_face.Client])
def test_every_face_takes_the_new_options(face) -> None:
    producer = inspect.signature(face.create_producer).parameters["access_mode"]
    assert producer.default == "shared"
    consumer = inspect.signature(face.subscribe).parameters["ack_receipt_enabled"]
    assert consumer.default is False


async def test_a_bad_access_mode_is_refused_before_the_network(client) -> None:
    with pytest.raises(InvalidArgument, match="access_mode must be one of"):
        await client.create_producer("t", access_mode="exclusive-ish")


async def test_exclusive_keeps_every_other_producer_out(client, autojump_clock) -> None:
    shared = await client.create_producer("ex")
    with pytest.raises(ProducerBusy, match="has 1 connected producer"):
        await client.create_producer("ex", access_mode="exclusive")
    await shared.close()
    owner = await client.create_producer("ex", access_mode="exclusive")
    for mode in ("shared", "exclusive"):  # (wait_for_exclusive waits: below)
        with pytest.raises(ProducerBusy, match="already has an exclusive producer"):
            await client.create_producer("ex", access_mode=mode)
    await owner.send(b"only me")
    await owner.close()
    again = await client.create_producer("ex")  # free again
    await again.close()


async def test_wait_for_exclusive_waits_in_line(client, autojump_clock) -> None:
    owner = await client.create_producer("wait", access_mode="exclusive")
    order: list[str] = []
    producers: dict[str, trio_face.Producer] = {}

    async def wait(name: str) -> None:
        producers[name] = await client.create_producer("wait", access_mode="wait_for_exclusive")
        order.append(name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait, "first")
        await trio.sleep(1)
        nursery.start_soon(wait, "second")
        await trio.sleep(60)  # longer than any operation timeout: still waiting
        assert order == []
        await owner.close()
        await trio.sleep(1)
        assert order == ["first"]
        await producers["first"].send(b"from first")
        await producers["first"].close()
    assert order == ["first", "second"]
    assert epoch_of(producers["second"]) > epoch_of(producers["first"])
    await producers["second"].close()


async def test_fencing_removes_the_producers_and_they_stay_fenced(
    client, pigeon_standalone, autojump_clock
) -> None:
    old = await client.create_producer("fence", access_mode="exclusive")
    await old.send(b"before")
    fencer = await client.create_producer("fence", access_mode="exclusive_with_fencing")
    assert epoch_of(fencer) == epoch_of(old) + 1
    with pytest.raises(ProducerFenced):
        await old.send(b"after")
    with pytest.raises(ProducerFenced):
        await old.send(b"still")
    # the epoch is stored with the topic: after a move the fencer goes on, and a new
    # exclusive producer gets the next epoch
    name = TopicName.parse(PREFIX + "fence")
    stat = await pigeon_standalone.service.store.get(producer_epoch_path(name))
    assert json.loads(stat.value)["epoch"] == epoch_of(fencer)
    await unload_topic(pigeon_standalone.service, name)
    await fencer.send(b"after the move")
    assert epoch_of(fencer) == json.loads(stat.value)["epoch"]
    with pytest.raises(ProducerBusy):
        await client.create_producer("fence")
    await fencer.close()
    newer = await client.create_producer("fence", access_mode="exclusive")
    assert epoch_of(newer) == epoch_of(fencer) + 1
    await newer.close()
    with contextlib.suppress(ProducerFenced):
        await old.close()


# ------------------------------------------------------------------ sync and asyncio faces


def test_sync_exclusive_and_asyncio_fencing(admin_standalone) -> None:
    url = admin_standalone.service_url
    topic = f"faces-{uuid.uuid4().hex[:8]}"
    with contextlib.closing(SyncClient(url)) as client:
        owner = client.create_producer(topic, access_mode="exclusive")
        with pytest.raises(ProducerBusy, match="already has an exclusive producer"):
            client.create_producer(topic)
        owner.send(b"sync")

        async def scenario() -> None:
            async with AsyncioClient(url) as aclient:
                fencer = await aclient.create_producer(topic, access_mode="exclusive_with_fencing")
                await fencer.send(b"asyncio")
                await fencer.close()

        asyncio.run(asyncio.wait_for(scenario(), 30))
        with pytest.raises(ProducerFenced):
            owner.send(b"fenced")
        with contextlib.suppress(ProducerFenced):
            owner.close()
