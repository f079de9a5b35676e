"""Hostile review of producer access modes (issue 17): the epoch store failing, waiters
going away, the exclusive producer's connection dropping."""

from __future__ import annotations

import pytest
import trio
from standalone_support import PREFIX

from pigeon.client.trio import Client
from pigeon.core import TopicName
from pigeon.core.errors import MetadataError, PigeonError, ProducerBusy
from pigeon.core.paths import producer_epoch_path


async def test_a_fencing_producer_refused_for_want_of_the_epoch_store_changes_nothing(
    client, pigeon_standalone, autojump_clock
) -> None:
    store = pigeon_standalone.service.store
    path = producer_epoch_path(TopicName.parse(PREFIX + "afence-down"))
    owner = await client.create_producer("afence-down", access_mode="exclusive")
    create, set_ = store.create, store.set

    async def down_create(p, *args, **kw):
        if p == path:
            raise MetadataError("metadata store unreachable")
        return await create(p, *args, **kw)

    async def down_set(p, *args, **kw):
        if p == path:
            raise MetadataError("metadata store unreachable")
        return await set_(p, *args, **kw)

    store.create, store.set = down_create, down_set
    try:
        with pytest.raises(PigeonError):
            with trio.fail_after(120):
                await client.create_producer("afence-down", access_mode="exclusive_with_fencing")
    finally:
        store.create, store.set = create, set_
    # the fencing never happened: the owner still holds the topic, alone
    await owner.send(b"still mine")
    with pytest.raises(ProducerBusy):
        await client.create_producer("afence-down")
    await owner.close()


async def test_a_waiter_whose_client_went_away_leaves_the_line(
    client, pigeon_standalone, autojump_clock
) -> None:
    owner = await client.create_producer("await-gone", access_mode="exclusive")
    async with Client(pigeon_standalone.url) as other:
        with trio.move_on_after(5):
            await other.create_producer("await-gone", access_mode="wait_for_exclusive")
    await trio.sleep(5)
    await owner.close()
    # nobody waits any more: a shared producer may attach
    shared = await client.create_producer("await-gone")
    await shared.send(b"shared again")
    await shared.close()
