"""Hostile review of compaction (issue 17): redelivery of compacted messages whose log
entries are trimmed, ownership moving mid-compaction, deletion racing a compaction."""

from __future__ import annotations

from standalone_support import PREFIX, drain
from test_compaction import AFTER_E, HISTORY, compact, compacted_then_trimmed, kv, send_kv

from pigeon.core import TopicName


async def test_compacted_messages_redelivered_after_the_log_was_trimmed(
    small_segments, small_segments_client, autojump_clock
):
    client = small_segments_client
    t = await compacted_then_trimmed(small_segments, client, "cattack-redeliver")
    assert t.ledger.first_offset >= len(HISTORY)
    consumer = await client.subscribe(
        "cattack-redeliver", "s", initial_position="earliest", read_compacted=True
    )
    first = await drain(consumer)
    assert kv(first) == AFTER_E
    await consumer.close()  # nothing acknowledged: all of it comes again
    again = await client.subscribe("cattack-redeliver", "s", read_compacted=True)
    assert kv(await drain(again)) == kv(first)
    await again.close()


async def test_a_redelivered_compacted_message_superseded_since_is_dropped(
    small_segments, small_segments_client, autojump_clock
):
    client = small_segments_client
    await compacted_then_trimmed(small_segments, client, "cattack-superseded")
    consumer = await client.subscribe(
        "cattack-superseded", "s", initial_position="earliest", read_compacted=True
    )
    assert kv(await drain(consumer)) == AFTER_E
    await consumer.close()
    await send_kv(client, "cattack-superseded", [("c", b"c2")])
    await compact(small_segments, "cattack-superseded")
    again = await client.subscribe("cattack-superseded", "s", read_compacted=True)
    got = kv(await drain(again))
    assert sorted(got) == [("a", b"a3"), ("c", b"c2"), ("d", b"d1"), ("e", b"e1")]
    await again.close()


async def test_ownership_moving_mid_compaction_keeps_the_new_owners_compacted_ledger(
    pigeon_standalone, client, autojump_clock
):
    import trio

    from pigeon.broker._ledger import LedgerConfig, ManagedLedger
    from pigeon.broker._lifecycle import unload_topic
    from pigeon.core.paths import segment_path

    # the new owner's recovery waits for the bookie's fence, which a worker thread
    # completes: the virtual clock must not jump (and time the recovery out) meanwhile
    autojump_clock.autojump_threshold = 0.2
    service = pigeon_standalone.service
    name = TopicName.parse(PREFIX + "cattack-move")
    await send_kv(client, "cattack-move", HISTORY)
    previous = (await compact(pigeon_standalone, "cattack-move")).ledger.compacted
    await send_kv(client, "cattack-move", [("e", b"e1")])
    # loaded again (its segments closed, nothing written since): an idle topic
    await unload_topic(service, name)
    t = await service.get_topic(name)
    reached, go = trio.Event(), trio.Event()
    write = t.ledger._write_compacted

    async def paused(*args):
        compacted = await write(*args)
        reached.set()
        await go.wait()
        return compacted

    t.ledger._write_compacted = paused
    async with trio.open_nursery() as nursery:
        nursery.start_soon(t.compact)
        await reached.wait()
        # the topic moves: the new owner opens the ledger and drops the pending run
        other = ManagedLedger(
            name,
            store=service.store,
            policy=service.policy,
            bookies=service.bookies,
            nursery=nursery,
            config=LedgerConfig(),
        )
        await other.open()
        await other.drop_pending_compaction()
        go.set()
    # the old owner must not record its run, nor delete the new owner's compacted ledger
    assert t.ledger.compaction_status["status"] == "ERROR", t.ledger.compaction_status
    assert await service.store.get(segment_path(previous.id)) is not None
    assert other.compacted.id == previous.id
    await other.close()


async def segments_of(store, topic):
    """Ids of the segment nodes (log and compacted) naming ``topic``."""
    import json

    out = []
    for child in await store.children("/pigeon/segments"):
        stat = await store.get(f"/pigeon/segments/{child}")
        if stat is not None and json.loads(stat.value).get("topic") == topic:
            out.append(child)
    return out


async def test_deleting_a_topic_mid_compaction_leaves_no_compacted_ledger(
    pigeon_standalone, client, autojump_clock
):
    from functools import partial

    import trio

    from pigeon.broker._lifecycle import delete_topic
    from pigeon.core.paths import cursors_path

    service = pigeon_standalone.service
    store = service.store
    name = TopicName.parse(PREFIX + "cattack-delete")
    await send_kv(client, "cattack-delete", HISTORY)
    t = await compact(pigeon_standalone, "cattack-delete")
    await send_kv(client, "cattack-delete", [("e", b"e1")])
    compaction_reached, compaction_go = trio.Event(), trio.Event()
    delete_reached, delete_go = trio.Event(), trio.Event()
    write = t.ledger._write_compacted

    async def paused_write(*args):
        compaction_reached.set()
        await compaction_go.wait()
        return await write(*args)

    t.ledger._write_compacted = paused_write
    delete = store.delete

    async def paused_delete(path, **kw):
        if path == cursors_path(name):  # the deletion read the ledger's metadata
            delete_reached.set()
            await delete_go.wait()
        return await delete(path, **kw)

    store.delete = paused_delete
    compaction_done = trio.Event()

    async def compaction():
        await t.compact()
        compaction_done.set()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(compaction)
            await compaction_reached.wait()
            nursery.start_soon(partial(delete_topic, service, name, force=True))
            await delete_reached.wait()
            compaction_go.set()
            await compaction_done.wait()
            delete_go.set()
    finally:
        store.delete = delete
    assert await segments_of(store, name.full) == []


async def test_seek_on_a_read_compacted_subscription_after_the_log_was_trimmed(
    small_segments, small_segments_client, autojump_clock
):
    client = small_segments_client
    await compacted_then_trimmed(small_segments, client, "cattack-seek")
    consumer = await client.subscribe(
        "cattack-seek", "s", initial_position="earliest", read_compacted=True
    )
    first = await drain(consumer)
    assert kv(first) == AFTER_E
    await consumer.seek(first[1].message_id)  # a compacted message below the log start
    assert kv(await drain(consumer)) == kv(first[1:])
    await consumer.seek(offset=0)
    assert kv(await drain(consumer)) == kv(first)
    await consumer.close()
