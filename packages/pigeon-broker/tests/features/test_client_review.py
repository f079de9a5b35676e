"""Edge cases of the client features of issue 17 found in review (listeners, pause,
chunking, ack receipts, schemas), each against an in-process standalone."""

from __future__ import annotations

from typing import Any

from standalone_support import PREFIX

from pigeon.client.trio import Client
from pigeon.core.testing import InProcessStandalone

CHUNK = 4096
BIG = bytes(range(256)) * (3 * CHUNK // 256)


async def chunking_producer(client: Client, topic: str, **options: Any) -> Any:
    return await client.create_producer(
        topic,
        chunking_enabled=True,
        batching_enabled=False,
        chunk_max_message_size=CHUNK,
        **options,
    )


def backlog(cluster: InProcessStandalone, topic: str, sub: str) -> int:
    return int(cluster.service.topics[PREFIX + topic].subscriptions[sub].backlog())


async def test_an_ack_receipt_of_a_chunked_message_acks_every_chunk(
    client, pigeon_standalone, autojump_clock
):
    consumer = await client.subscribe(
        "rcpt-big", "s", initial_position="earliest", ack_receipt_enabled=True
    )
    producer = await chunking_producer(client, "rcpt-big")
    await producer.send(BIG)
    msg = await consumer.receive(timeout=10)
    assert msg.value == BIG and len(msg.message_id.chunk_ids) > 2
    await consumer.acknowledge(msg)
    assert backlog(pigeon_standalone, "rcpt-big", "s") == 0, "every chunk is acknowledged"
    await consumer.close()
    await producer.close()
