"""Edge cases of the client features of issue 17 found in review, through the sync and
asyncio faces (a standalone on a background thread, one per module)."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest
from standalone_support import CHUNK

from pigeon.client import Client, Message

BIG = bytes(range(256)) * (6 * CHUNK // 256)  # seven chunks


@pytest.fixture
def topic() -> str:
    return f"rv-{uuid.uuid4().hex[:10]}"


def test_sync_listener_gets_a_message_of_more_chunks_than_the_receiver_queue(
    admin_standalone: Any, topic: str
) -> None:
    got: list[bytes] = []
    done = threading.Event()

    def listener(consumer: Any, msg: Message) -> None:
        got.append(msg.value)
        consumer.acknowledge(msg)
        done.set()

    with Client(admin_standalone.service_url) as client:
        with client.create_producer(
            topic, chunking_enabled=True, batching_enabled=False, chunk_max_message_size=CHUNK
        ) as producer:
            producer.send(BIG)
        with client.subscribe(
            topic,
            "s",
            initial_position="earliest",
            receiver_queue_size=2,
            message_listener=listener,
        ):
            assert done.wait(10), "the chunked message never reached the listener"
    assert got == [BIG]
