"""Acknowledgement receipts (``ack_receipt_enabled``): an ack returns once the broker
stored it in the cursor, and raises AckNotPersisted when that cannot be said.

The broker here persists cursors only when asked (a persist interval of hours), so what
is in the metadata store after an ``acknowledge`` returned is what the receipt promised.
"""

from __future__ import annotations

import asyncio
import contextlib
import types
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
from standalone_support import PREFIX, produce, receive_n, subscribe_and_produce

from pigeon.broker._cursor import CursorState
from pigeon.broker._kafka_offsets import commit_offset
from pigeon.broker._lifecycle import unload_topic
from pigeon.client import Client as SyncClient
from pigeon.client import Message
from pigeon.client.asyncio import Client as AsyncioClient
from pigeon.client.trio import Client, Consumer
from pigeon.core import TopicName
from pigeon.core.errors import AckNotPersisted, MetadataError, NotSupported
from pigeon.core.paths import BROKER_SESSIONS_PATH, cursor_path
from pigeon.core.testing import InProcessStandalone, in_process_standalone

SENT = [f"m{i}".encode() for i in range(6)]
#: cursors are written only by receipts, closes and unloads
NEVER_MS = 3_600_000


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[InProcessStandalone]:
    async with in_process_standalone(
        tmp_path / "pigeon", cursor_persist_interval_ms=NEVER_MS
    ) as cluster:
        yield cluster


async def stored_cursor(cluster: InProcessStandalone, topic: str) -> CursorState | None:
    stat = await cluster.service.store.get(cursor_path(TopicName.parse(PREFIX + topic), "s"))
    return None if stat is None else CursorState.from_json(stat.value)


async def acked_offsets(cluster: InProcessStandalone, topic: str) -> list[int]:
    cursor = await stored_cursor(cluster, topic)
    return [] if cursor is None else [o for o in range(len(SENT)) if cursor.is_acked(o)]


@contextlib.asynccontextmanager
async def sent_and_received(
    cluster: InProcessStandalone, topic: str, *, ack_receipt_enabled: bool = True
) -> AsyncIterator[tuple[Consumer, list[Message]]]:
    """A trio consumer of ``topic`` and the SENT messages it received
    (:func:`subscribe_and_produce`); closed at the end."""
    async with Client(cluster.url) as client:
        consumer, got = await subscribe_and_produce(
            client, topic, SENT, ack_receipt_enabled=ack_receipt_enabled
        )
        yield consumer, got
        await consumer.close()


async def test_an_acknowledge_returns_once_the_cursor_is_stored(cluster, autojump_clock):
    async with sent_and_received(cluster, "rcpt") as (consumer, got):
        await consumer.acknowledge(got[1])
        assert await acked_offsets(cluster, "rcpt") == [1]
        await consumer.acknowledge_cumulative(got[3])
        assert await acked_offsets(cluster, "rcpt") == [0, 1, 2, 3]


async def test_without_receipts_an_ack_is_not_stored_yet(cluster, autojump_clock):
    """What the receipt buys: a plain ack returns before anything is stored."""
    async with sent_and_received(cluster, "plain", ack_receipt_enabled=False) as (consumer, got):
        # the broker's first cursor write comes at once; the next one an hour later
        await consumer.acknowledge(got[0])
        await trio.sleep(1)
        await consumer.acknowledge(got[1])
        await trio.sleep(1)  # the grouped ack went out (within 100 ms), unanswered
        assert 1 not in await acked_offsets(cluster, "plain")


async def test_concurrent_acks_share_one_request(cluster, autojump_clock):
    async with sent_and_received(cluster, "group") as (consumer, got):
        engine = consumer._handle.engines[0]
        requests = []
        real_ack = engine.ack

        async def counting_ack(positions: Any, cumulative: bool) -> None:
            requests.append(len(positions))
            await real_ack(positions, cumulative)

        engine.ack = counting_ack
        async with trio.open_nursery() as nursery:
            for m in got:
                nursery.start_soon(consumer.acknowledge, m)
        assert sum(requests) == len(SENT) and len(requests) <= 2, requests
        assert await acked_offsets(cluster, "group") == list(range(len(SENT)))


async def test_a_cursor_that_cannot_be_stored_fails_the_ack(cluster, autojump_clock):
    async with sent_and_received(cluster, "fail") as (consumer, got):
        sub = cluster.service.topics[PREFIX + "fail"].subscriptions["s"]

        class FailingStore:
            def __getattr__(self, name: str) -> Any:
                return getattr(cluster.service.store, name)

            async def set(self, *args: Any, **kwargs: Any) -> int:
                raise MetadataError("metadata store unreachable")

            async def create(self, *args: Any, **kwargs: Any) -> str:
                raise MetadataError("metadata store unreachable")

        sub.store = FailingStore()
        with pytest.raises(AckNotPersisted, match="could not be stored"):
            await consumer.acknowledge(got[0])
        sub.store = cluster.service.store
        await consumer.acknowledge(got[1])  # the store is back: both are stored now
        assert await acked_offsets(cluster, "fail") == [0, 1]


async def test_a_disconnected_consumer_gets_no_receipt(cluster, autojump_clock):
    async with sent_and_received(cluster, "gone") as (consumer, got):
        engine = consumer._handle.engines[0]
        engine.conn.close()  # the network drops the connection
        with pytest.raises(AckNotPersisted):
            await consumer.acknowledge(got[0])
        again = await receive_n(consumer, len(SENT))  # re-attached: everything comes back
        assert [m.value for m in again] == SENT
        await consumer.acknowledge(again[0])
        assert await acked_offsets(cluster, "gone") == [0]


async def test_a_cursor_another_broker_took_over_fences_this_one(cluster, autojump_clock):
    """A broker that lost a topic without knowing it yet (paused past its metadata
    session while another broker loaded the topic) must not confirm an ack: the new
    owner serves the cursor it loaded, so the ack would be forgotten there."""
    store = cluster.service.store
    path = cursor_path(TopicName.parse(PREFIX + "moved"), "s")
    async with sent_and_received(cluster, "moved") as (consumer, got):
        stat = await store.get(path)
        assert stat is not None
        await store.set(path, stat.value)  # the new owner takes the cursor over
        with pytest.raises(AckNotPersisted):
            await consumer.acknowledge_cumulative(got[3])
        assert await acked_offsets(cluster, "moved") == [], "the new owner's cursor was overwritten"
        # the consumer was sent on (here: to the same broker, which loads the stored cursor)
        again = await receive_n(consumer, len(SENT))
        assert [m.value for m in again] == SENT
        await consumer.acknowledge_cumulative(again[3])
        assert await acked_offsets(cluster, "moved") == [0, 1, 2, 3]


async def test_a_kafka_commit_is_answered_only_once_stored(cluster, autojump_clock):
    """OffsetCommit goes through the same cursor: a commit on a cursor another broker
    took over fails (the client commits again), and the next one is stored."""
    store = cluster.service.store
    name = TopicName.parse(PREFIX + "kcommit")
    door = types.SimpleNamespace(core=cluster.service)  # what commit_offset uses of it
    async with sent_and_received(cluster, "kcommit") as (_consumer, _got):
        await commit_offset(door, name, "g", 2)
        path = cursor_path(name, "g")
        stat = await store.get(path)
        assert stat is not None and CursorState.from_json(stat.value).mark_delete == 2
        await store.set(path, stat.value)  # another broker took the cursor over
        with pytest.raises(AckNotPersisted):
            await commit_offset(door, name, "g", 4)
        await commit_offset(door, name, "g", 4)  # loaded again from the store: stored
        stat = await store.get(path)
        assert stat is not None and CursorState.from_json(stat.value).mark_delete == 4


async def test_loading_a_subscription_takes_its_cursor_over(cluster, autojump_clock):
    """The broker that loads a stored cursor writes it at the version it read, so a
    broker that held it before can no longer store it."""
    store = cluster.service.store
    name = TopicName.parse(PREFIX + "reload")
    path = cursor_path(name, "s")
    async with sent_and_received(cluster, "reload") as (consumer, got):
        await consumer.acknowledge(got[0])
        before = await store.get(path)
        await consumer.close()
        assert await unload_topic(cluster.service, name) == [name.full]
        async with Client(cluster.url) as client:
            again = await client.subscribe("reload", "s", ack_receipt_enabled=True)
            after = await store.get(path)
            assert before is not None and after is not None
            assert after.version > before.version, "the cursor was loaded without a write"
            await again.close()


async def test_a_session_lost_and_regained_keeps_every_receipted_ack(cluster, autojump_clock):
    """The nemesis's sequence (embedded + quorum + journal, seed 777): the broker's
    metadata session expires, it registers again, takes its bundle back and reloads the
    topic.  Taking the cursor over writes it back unchanged (one version up), so nothing
    acknowledged with a receipt is stored as unacknowledged or delivered again."""
    store = cluster.service.store
    ownership = cluster.service.ownership
    path = cursor_path(TopicName.parse(PREFIX + "regained"), "s")
    async with sent_and_received(cluster, "regained") as (consumer, got):
        await consumer.acknowledge_cumulative(got[3])
        before = await store.get(path)
        assert before is not None and CursorState.from_json(before.value).mark_delete == 4
        old = ownership.token
        await store.expire_session()
        with trio.fail_after(30):  # no event for "registered again": polled, bounded
            while ownership.token == old or not await store.exists(  # noqa: ASYNC110
                f"{BROKER_SESSIONS_PATH}/{ownership.token}"
            ):
                await trio.sleep(0.1)
        again = await receive_n(consumer, 2)  # re-attached where the stored cursor is
        assert [m.value for m in again] == SENT[4:]
        after = await store.get(path)
        assert after is not None and after.version > before.version
        assert CursorState.from_json(after.value).mark_delete == 4


async def test_cumulative_receipts_keep_the_subscription_type_rule(cluster, autojump_clock):
    async with Client(cluster.url) as client:
        consumer = await client.subscribe(
            "shared", "s", subscription_type="shared", ack_receipt_enabled=True
        )
        await produce(client, "shared", SENT[:1])
        (m,) = await receive_n(consumer, 1)
        with pytest.raises(NotSupported):
            await consumer.acknowledge_cumulative(m)
        await consumer.close()


# ------------------------------------------------------------------ sync and asyncio faces


def test_sync_and_asyncio_faces_wait_for_the_receipt(admin_standalone):
    url = admin_standalone.service_url
    store = admin_standalone.service.store

    def stored(topic: str) -> list[int]:
        path = cursor_path(TopicName.parse(PREFIX + topic), "s")
        stat = admin_standalone.call(store.get, path)
        cursor = CursorState.from_json(stat.value)
        return [o for o in range(len(SENT)) if cursor.is_acked(o)]

    sync_topic = f"sync-{uuid.uuid4().hex[:8]}"
    with contextlib.closing(SyncClient(url)) as client:
        consumer = client.subscribe(
            sync_topic, "s", initial_position="earliest", ack_receipt_enabled=True
        )
        producer = client.create_producer(sync_topic, batching_max_messages=1)
        for v in SENT[:3]:
            producer.send(v)
        got = [consumer.receive(timeout=10) for _ in range(3)]
        consumer.acknowledge(got[0])
        consumer.acknowledge_cumulative(got[2])
        assert stored(sync_topic) == [0, 1, 2]
        producer.close()
        consumer.close()

    asyncio_topic = f"asyncio-{uuid.uuid4().hex[:8]}"

    async def scenario() -> None:
        async with AsyncioClient(url) as client:
            consumer = await client.subscribe(
                asyncio_topic, "s", initial_position="earliest", ack_receipt_enabled=True
            )
            producer = await client.create_producer(asyncio_topic, batching_max_messages=1)
            for v in SENT[:3]:
                await producer.send(v)
            got = [await consumer.receive(timeout=10) for _ in range(3)]
            await consumer.acknowledge(got[1])
            assert await asyncio.to_thread(stored, asyncio_topic) == [1]
            await producer.close()
            await consumer.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))
