"""Chunking through the sync and asyncio faces (a standalone on a background thread, one
per module, with the default max_message_size of 5 MiB): a 50 MB message round-trips."""

from __future__ import annotations

import asyncio
import os

from pigeon.client import ChunkMessageId, Client
from pigeon.client import asyncio as aio

BIG = os.urandom(64 * 1024) * 3 + b"tail"  # four chunks of 64 KiB


def test_sync_face_round_trips_a_50_mb_message(admin_standalone):
    payload = os.urandom(1024 * 1024) * 50
    with (
        Client(admin_standalone.service_url) as client,
        client.subscribe("huge", "s", initial_position="earliest") as consumer,
        client.create_producer("huge", chunking_enabled=True, batching_enabled=False) as producer,
    ):
        sent = producer.send(payload, key="k")
        assert isinstance(sent, ChunkMessageId)
        msg = consumer.receive(timeout=30)
        assert len(msg.value) == len(payload) and msg.value == payload
        assert msg.key == "k" and msg.message_id == sent
        assert len(msg.message_id.chunk_ids) == 11  # 5 MiB entries, less their headers
        consumer.acknowledge(msg)


def test_sync_face_small_chunks_and_reader(admin_standalone):
    with Client(admin_standalone.service_url) as client:
        with client.create_producer(
            "sync-chunks",
            chunking_enabled=True,
            batching_enabled=False,
            chunk_max_message_size=64 * 1024 + 512,
        ) as producer:
            futures = [producer.send_async(v) for v in (b"a", BIG, b"b")]
            ids = [f.result(10) for f in futures]
        assert isinstance(ids[1], ChunkMessageId) and not isinstance(ids[0], ChunkMessageId)
        with client.create_reader("sync-chunks", "earliest") as reader:
            assert [reader.read_next(timeout=10).value for _ in range(3)] == [b"a", BIG, b"b"]
        with client.subscribe("sync-chunks", "s", initial_position="earliest") as consumer:
            msgs = [consumer.receive(timeout=10) for _ in range(3)]
            assert msgs[1].value == BIG and msgs[1].message_id == ids[1]


def test_asyncio_face_chunks_and_reassembles(admin_standalone):
    async def scenario() -> None:
        async with aio.Client(admin_standalone.service_url) as client:
            consumer = await client.subscribe("aio-chunks", "s", initial_position="earliest")
            producer = await client.create_producer(
                "aio-chunks",
                chunking_enabled=True,
                batching_enabled=False,
                chunk_max_message_size=64 * 1024 + 512,
            )
            sent = await producer.send(BIG, properties={"p": "1"})
            assert isinstance(sent, ChunkMessageId)
            msg = await consumer.receive(timeout=10)
            assert msg.value == BIG and msg.properties == {"p": "1"}
            assert msg.message_id == sent
            await consumer.acknowledge(msg)
            reader = await client.create_reader("aio-chunks", "earliest")
            assert (await reader.read_next(timeout=10)).value == BIG
            await reader.close()
            await consumer.close()
            await producer.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))
